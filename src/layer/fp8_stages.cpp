// The FP8 stages of one expert set (MoeConfig::precision = kFP8Block, one macrobatch, the
// kernel sequence; gpu_layer_state.h): the bf16 path's stages with every GEMM on e4m3 operands
// with block scales (kernels/gemm/fp8_gemm.h), quantized where the CPU reference quantizes
// them (src/reference/fp8_emulation.h), so the layer matches that reference at the bf16
// tolerance. Buffers and layouts: layer/fp8_buffers.h.
//
//   forward   weights -> blocks (unless given pre-quantized); x rows -> row groups (the local
//             exchange's rows: gathered from x and quantized in one pass, into row groups and
//             the column groups the backward's context keeps); gate/up GEMM (B
//   = Wg | Wu, out g | u: the
//             forward context, bf16 as in bf16); SwiGLU fused with h's quantization; down GEMM
//             -> the expert output rows
//   backward  (recompute: x rows and the gate/up GEMM again); weights -> blocks transposed
//             (pre-quantized ones: their codes and scales transposed, the same bits); d_out rows
//             (and x rows when recomputing) gathered and quantized both ways in one pass, or
//             quantized from the exchange's rows;
//             d_out rows -> row groups; down dgrad -> dh_raw; the bf16 path's SwiGLU backward
//             (d_g, d_u, h_w, d_router_weights) with d_g, d_u quantized both ways and h_w in
//             column groups in the same pass (swiglu_backward_quantize.h); gate/up dgrad (K split
//             d_g | d_u against Wg^T | Wu^T) -> dx rows; x, d_out -> column groups transposed
//             (unless gathered so); the three weight-gradient GEMMs
#include <cuda.h>

#include <cstdint>
#include <string>

#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/fp8_rows192_walk.h"
#include "kernels/stages/fp8_quantize.h"
#include "kernels/stages/launch.h"
#include "kernels/stages/swiglu_backward_quantize.h"
#include "kernels/stages/swiglu_quantize.h"
#include "layer/fp8_buffers.h"
#include "layer/gemm_ablation.h"
#include "layer/gpu_layer_state.h"
#include "layer/tma.h"

namespace mok {

namespace {

using kernels::Fp8QuantizeForm;

// `rows` rows of `width` bf16 at `in` quantized as `form` into `out`.
void quantize(const void* in, int64_t rows, int64_t width, Fp8QuantizeForm form,
              const Fp8Operand& out, kernels::KernelStream on, const char* what) {
  cuda_check(
      kernels::launch_quantize_fp8(in, rows, width, form, out.codes.pointer, out.scale_data(), on),
      std::string("FP8 quantization of ") + what);
}

// Weights [E, n, k] (experts `stride` elements apart, 0 = dense) in 128 x 128 blocks, into `out`
// [E, n, k] (the forward's), `out_t` [E, k, n] (the dgrads'), or both in one pass (the bf16
// read once); a null one is skipped.
void quantize_weights(const void* weights, int64_t experts, int64_t n, int64_t k, int64_t stride,
                      const Fp8Operand* out, const Fp8Operand* out_t, kernels::KernelStream on,
                      const char* what) {
  kernels::Fp8QuantizeBatch batch;
  batch.count = experts;
  batch.in_stride = stride;
  cuda_check(
      kernels::launch_quantize_fp8_blocks_both(
          weights, n, k, out ? out->codes.pointer : nullptr, out ? out->scale_data() : nullptr,
          out_t ? out_t->codes.pointer : nullptr, out_t ? out_t->scale_data() : nullptr, on, batch),
      std::string("FP8 quantization of ") + what);
}

// A matrix's identity in the keys: its bf16 pointer, or its pre-quantized codes'.
const void* identity(const void* values, const Fp8View& given) {
  return given.present() ? given.codes : values;
}
Fp8WeightKey key_of(const ExpertWeights& weights) {
  return {identity(weights.gate, weights.gate_fp8), identity(weights.up, weights.up_fp8),
          identity(weights.down, weights.down_fp8), weights.version};
}
// True when `key` says the buffers already hold these weights' quantization (a nonzero version
// and the same pointers). The caller sets the key once it has quantized them.
bool holds_weights(const Fp8WeightKey& key, const ExpertWeights& weights) {
  return weights.version != 0 && key == key_of(weights);
}

// The forward's weights in blocks: each given pre-quantized, or quantized into the buffers
// unless they hold it already.
struct ForwardWeights {
  Fp8View gate, up, down;
};
// `with_transposed` (a backward follows: a training forward, or the backward's recompute): where
// every matrix comes as bf16 and is quantized here, the dgrads' transposed blocks are written in
// the same pass (the bf16 read once, not twice: ~1 ms less per training step at dsv3_local when
// the weights change every step), and transposed_weights finds them.
ForwardWeights forward_weights(const ExpertWeights& weights, int64_t experts, int64_t hidden,
                               int64_t inter, const Fp8SetBuffers& fp8, kernels::KernelStream on,
                               bool with_transposed) {
  const bool held = holds_weights(fp8.weights_key, weights);
  const bool all_bf16 =
      !weights.gate_fp8.present() && !weights.up_fp8.present() && !weights.down_fp8.present();
  const bool both = !held && with_transposed && all_bf16;
  auto block = [&](const void* values, const Fp8View& given, int64_t n, int64_t k, int64_t stride,
                   const Fp8Operand& buffer, const Fp8Operand& transposed, const char* what) {
    if (given.present()) return given;
    if (!held)
      quantize_weights(values, experts, n, k, stride, &buffer, both ? &transposed : nullptr, on,
                       what);
    return buffer.view();
  };
  const ForwardWeights out{block(weights.gate, weights.gate_fp8, inter, hidden, weights.gate_stride,
                                 fp8.w_gate, fp8.w_gate_t, "w_gate"),
                           block(weights.up, weights.up_fp8, inter, hidden, weights.up_stride,
                                 fp8.w_up, fp8.w_up_t, "w_up"),
                           block(weights.down, weights.down_fp8, hidden, inter, weights.down_stride,
                                 fp8.w_down, fp8.w_down_t, "w_down")};
  if (both) {
    fp8.transposed_key = key_of(weights);
    fp8.transposed_by_forward = true;
  } else if (!held) {
    fp8.transposed_by_forward = false;  // these weights' transposed blocks are not written yet
  }
  fp8.weights_key = key_of(weights);
  return out;
}

// The backward's weights as the dgrads' K-major operands, [E, k, n] from [E, n, k]: a bf16
// weight quantized transposed, a pre-quantized one transposed code by code (the same bits).
void transposed_weights(const ExpertWeights& weights, int64_t experts, int64_t hidden,
                        int64_t inter, const Fp8SetBuffers& fp8, kernels::KernelStream on) {
  // Held across calls (a nonzero weights_version), or written by the forward's pass this
  // backward follows (any version: a forward and its backward see the same weights).
  const bool from_forward = fp8.transposed_by_forward && fp8.transposed_key == key_of(weights);
  fp8.transposed_by_forward = false;
  if (from_forward || holds_weights(fp8.transposed_key, weights)) return;
  auto transpose = [&](const void* values, const Fp8View& given, int64_t n, int64_t k,
                       int64_t stride, const Fp8Operand& out, const char* what) {
    if (!given.present()) {
      quantize_weights(values, experts, n, k, stride, nullptr, &out, on, what);
      return;
    }
    kernels::Fp8QuantizeBatch batch;
    batch.count = experts;
    batch.in_stride = given.codes_stride;  // 0: dense
    cuda_check(kernels::launch_transpose_fp8_blocks(given.codes, given.scales, n, k,
                                                    out.codes.pointer, out.scale_data(), on, batch),
               std::string("FP8 transposition of ") + what);
  };
  transpose(weights.down, weights.down_fp8, hidden, inter, weights.down_stride, fp8.w_down_t,
            "w_down (transposed)");
  transpose(weights.gate, weights.gate_fp8, inter, hidden, weights.gate_stride, fp8.w_gate_t,
            "w_gate (transposed)");
  transpose(weights.up, weights.up_fp8, inter, hidden, weights.up_stride, fp8.w_up_t,
            "w_up (transposed)");
  fp8.transposed_key = key_of(weights);
}

// e4m3 [rows, width], [box_rows x 128] boxes (chunk_box_rows for a row-tile GEMM's A).
CUtensorMap codes_2d(const Fp8View& op, int64_t rows, int64_t width, const char* what,
                     int32_t box_rows = 128) {
  const int64_t dims[2] = {width, rows}, strides[1] = {width};
  const int32_t box[2] = {128, box_rows};
  return make_tensor_map(op.codes, TmaElement::kE4M3, 2, dims, strides, box, true, what);
}
// e4m3 [E, n, k] (experts op.codes_stride apart, or dense), [1, 128 x 128] boxes.
CUtensorMap codes_3d(const Fp8View& op, int64_t experts, int64_t n, int64_t k, const char* what) {
  const int64_t expert_stride = op.codes_stride != 0 ? op.codes_stride : n * k;
  const int64_t dims[3] = {k, n, experts}, strides[2] = {k, expert_stride};
  const int32_t box[3] = {128, 128, 1};
  return make_tensor_map(op.codes, TmaElement::kE4M3, 3, dims, strides, box, true, what);
}
// fp32 group-major scales [groups, lines], [1 x box_lines] boxes.
CUtensorMap scales_2d(const Fp8View& op, int64_t lines, int64_t groups, const char* what,
                      int32_t box_lines = 128) {
  const int64_t dims[2] = {lines, groups}, strides[1] = {lines * 4};
  const int32_t box[2] = {box_lines, 1};
  return make_tensor_map(op.scales, TmaElement::kF32, 2, dims, strides, box, false, what);
}
// The staging-tile epilogue's bf16 output [rows, width] (one batch entry), in [box_rows x 64]
// boxes (the 192-row tiles store 64-row chunks).
CUtensorMap output_map(void* base, int64_t width, int64_t rows, const char* what,
                       int32_t box_rows = 128) {
  return make_tensor_map_3d(base, width, rows, 1, 64, box_rows, what);
}
// A row-tile GEMM's boxes for MoeConfig::fp8_row_tile_rows: A's codes and the outputs move in
// 64-row chunks with the 192-row tiles (a part-filled tile loads and stores only its chunks),
// whole tiles of 128 otherwise; A's line scales in the tile's rows.
int32_t chunk_box_rows(const GpuLayer::State& s) {
  return s.config.fp8_row_tile_rows == 192 ? kernels::kRows192Chunk : 128;
}
int32_t a_scales_box_rows(const GpuLayer::State& s) { return s.config.fp8_row_tile_rows; }

kernels::Fp8GemmParams row_tile_params(const GpuLayer::State& s, const ExpertSet& set) {
  kernels::Fp8GemmParams params;
  const ScheduleView view = set.view();
  params.form = kernels::Fp8GemmForm::kRowTiles;
  params.header = view.header;
  params.tile_expert = view.tile_expert;
  params.expert_offsets = view.expert_offsets;
  params.expert_groups = s.config.gemm_expert_groups;
  params.wait = s.wait_context();
  params.ablation = gemm_ablation_from_env();
  params.tile_rows = s.config.fp8_row_tile_rows;
  if (params.tile_rows == 192) {
    params.num_experts = static_cast<int32_t>(set.num_experts);  // the 192-row tiles' numbering
    // A 64-row chunk of padding alone is skipped; no stage reads a padding row of the row-tile
    // GEMMs' outputs (the SwiGLU backward and the combines read routed rows only, the down
    // GEMM and the dgrads the chunks the same walk covers).
    params.expert_counts = view.expert_counts;
    params.tile_tickets = s.fp8_tile_tickets;
  } else {
    params.lockstep = s.lockstep;  // the lockstep counts 128-row tiles
  }
  return params;
}

// The rows of `gather` (the local exchange's) gathered from its tokens (schedule row r is token
// row_pair[r] / top_k) and quantized into both group forms in one pass: row groups (a row-tile
// GEMM's A) and column groups (a weight gradient's operand; skipped when `column_groups` holds
// none).
void gather_quantize(const ExpertSet& set, const kernels::FusedGather& gather,
                     const Fp8Operand& row_groups, const Fp8Operand& column_groups,
                     kernels::KernelStream on, const char* what) {
  const ScheduleView view = set.view();
  kernels::Fp8GatherQuantize params;
  params.header = view.header;
  params.row_pair = view.row_pair;
  params.top_k = gather.top_k;
  params.tokens = gather.x;
  params.cols = gather.hidden;
  params.capacity_rows = set.capacity_rows;
  params.row_codes = row_groups.codes.pointer;
  params.row_scales = row_groups.scale_data();
  params.column_codes = column_groups.codes.pointer;
  params.column_scales = column_groups.scale_data();
  cuda_check(kernels::launch_gather_quantize_fp8(params, on),
             std::string("FP8 quantization of ") + what);
}

// A gather over `count` rows: the set's whole capacity (one macrobatch, as FP8 runs).
void check_gather_rows(const ExpertSet& set, int64_t count) {
  if (count != set.capacity_rows)
    throw Error(ErrorCode::kInternal, "FP8: a gather over " + std::to_string(count) + " rows, " +
                                          std::to_string(set.capacity_rows) + " in the buffers");
}

// x's rows for the gate/up GEMM: gathered here both ways (`gather` from the local exchange; the
// column groups are the backward's, skipped without `column_groups`), or the exchange's `rows`
// [count, H] in row groups.
void quantize_x_rows(const ExpertSet& set, const kernels::FusedGather& gather, const void* rows,
                     int64_t count, int64_t hidden, const Fp8SetBuffers& fp8,
                     kernels::KernelStream on, bool column_groups = true) {
  if (gather.x == nullptr) {
    quantize(rows, count, hidden, Fp8QuantizeForm::kRowGroups, fp8.x_rows, on, "x rows");
    return;
  }
  check_gather_rows(set, count);
  const Fp8Operand none;  // no column groups: the kernel writes row groups alone
  gather_quantize(set, gather, fp8.x_rows, column_groups ? fp8.x_t : none, on, "x rows");
}

// Whether the gate/up GEMM's kernel takes the fusions below: the row-tile GEMMs but the expert
// groups' walk (a kernel of its own).
bool gate_up_takes_fusions(const MoeConfig& config) {
  return config.fp8_row_tile_rows == 192 || config.gemm_expert_groups == 0;
}

// MoeConfig::fp8_swiglu: the gate/up GEMM's epilogue for a forward that keeps a context or not.
bool swiglu_in_gate_up(const MoeConfig& config, bool keep_context) {
  const bool wanted = config.fp8_swiglu == Fp8SwigluPlace::kGateUp ||
                      (config.fp8_swiglu == Fp8SwigluPlace::kGateUpWithoutContext && !keep_context);
  return wanted && gate_up_takes_fusions(config);
}

// MoeConfig::fp8_gather_in_gate_up where it applies: a forward without a context whose rows the
// local exchange gathers (not an expert-parallel rank's received rows), with its counters.
bool gather_in_gate_up(const MoeConfig& config, const kernels::FusedGather& gather,
                       bool keep_context) {
  return config.fp8_gather_in_gate_up && !keep_context && gather.x != nullptr &&
         gather.peer_x == nullptr && gather.ticket != nullptr && gate_up_takes_fusions(config);
}

void launch(const GpuLayer::State& s, const kernels::Fp8GemmMaps& maps,
            const kernels::Fp8GemmParams& params, kernels::KernelStream on, const char* what) {
  cuda_check(kernels::launch_fp8_grouped_gemm(maps, params, s.sm_count, on), what);
  // The fused gather's ticket and counts name a launch by its epoch too.
  if (params.row_gather.tokens != nullptr)
    cuda_check(kernels::launch_advance_epoch(params.row_gather.epoch, on),
               "advance the FP8 gather's epoch");
  // The lockstep's counters and the tiles' tickets name a row-tile launch by its epoch: the
  // next one gets a new one.
  if (params.form != kernels::Fp8GemmForm::kRowTiles) return;
  if (params.lockstep.ticks != nullptr)
    cuda_check(kernels::launch_advance_epoch(params.lockstep.epoch, on),
               "advance the GEMM lockstep's epoch");
  if (params.tile_rows == 192 && params.tile_tickets.counter != nullptr)
    cuda_check(kernels::launch_advance_epoch(params.tile_tickets.epoch, on),
               "advance the FP8 tiles' ticket epoch");
}

// out [out_rows, n] = a [rows, k] times each row tile's expert's b [n, k]^T (one part each).
void row_tile_gemm(const GpuLayer::State& s, const ExpertSet& set, const Fp8View& a, int64_t rows,
                   int64_t k, const Fp8View& b, int64_t n, void* out, int64_t out_rows,
                   kernels::KernelStream on, const char* what) {
  kernels::Fp8GemmMaps maps{};
  maps.a = codes_2d(a, rows, k, what, chunk_box_rows(s));
  maps.a_scales = scales_2d(a, rows, k / 128, what, a_scales_box_rows(s));
  maps.b = codes_3d(b, set.num_experts, n, k, what);
  maps.out = maps.out2 = output_map(out, n, out_rows, what, chunk_box_rows(s));
  kernels::Fp8GemmParams params = row_tile_params(s, set);
  params.b_scales = b.scales;
  params.n_extent = static_cast<int32_t>(n);
  params.k_extent = static_cast<int32_t>(k);
  launch(s, maps, params, on, what);
}

// g | u = rows (Wg | Wu)^T into the set's gate and up buffers (from `fp8.x_rows`, quantized
// before, or with `gather` (gather_in_gate_up) gathered and quantized there by the GEMM itself).
// With `swiglu` (swiglu_in_gate_up), the epilogue also quantizes h = SwiGLU(g, u) into `fp8.h`,
// and writes g and u only if `keep_gate_up`.
void gate_up_gemm(const GpuLayer::State& s, const ExpertSet& set, const Fp8SetBuffers& fp8,
                  const ForwardWeights& weights, int64_t rows, kernels::KernelStream on,
                  bool swiglu = false, bool keep_gate_up = true,
                  const kernels::FusedGather* gather = nullptr) {
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts;
  const int64_t R = set.capacity_rows;
  kernels::Fp8GemmMaps maps{};
  maps.a = codes_2d(fp8.x_rows.view(), rows, H, "x rows (FP8)", chunk_box_rows(s));
  maps.a_scales =
      scales_2d(fp8.x_rows.view(), rows, H / 128, "x rows' scales", a_scales_box_rows(s));
  maps.b = codes_3d(weights.gate, E, I, H, "w_gate (FP8)");
  maps.b2 = codes_3d(weights.up, E, I, H, "w_up (FP8)");
  maps.out = output_map(set.gate.pointer, I, R, "gate", chunk_box_rows(s));
  maps.out2 = output_map(set.up.pointer, I, R, "up", chunk_box_rows(s));
  kernels::Fp8GemmParams params = row_tile_params(s, set);
  params.b_scales = weights.gate.scales;
  params.b2_scales = weights.up.scales;
  params.n_extent = static_cast<int32_t>(2 * I);
  params.n_split = static_cast<int32_t>(I);
  params.k_extent = static_cast<int32_t>(H);
  if (swiglu) {
    params.swiglu_h_codes = fp8.h.codes.pointer;
    params.swiglu_h_scales = fp8.h.scale_data();
    params.swiglu_h_rows = R;
    params.swiglu_limit = s.shape.swiglu_limit;
    params.swiglu_stores_gate_up = keep_gate_up ? 1 : 0;
  }
  if (gather != nullptr) {
    if (R % kernels::kFp8GatherChunkRows != 0 ||
        R / kernels::kFp8GatherChunkRows > s.gather_counters.max_tiles)
      throw Error(ErrorCode::kInternal,
                  "FP8 gather in the gate/up GEMM: " + std::to_string(R) + " rows, counters for " +
                      std::to_string(s.gather_counters.max_tiles) + " chunks of 64");
    kernels::Fp8RowGather& row_gather = params.row_gather;
    row_gather.tokens = gather->x;
    row_gather.row_pair = set.view().row_pair;
    row_gather.top_k = gather->top_k;
    row_gather.codes = static_cast<uint8_t*>(fp8.x_rows.codes.pointer);
    row_gather.scales = fp8.x_rows.scale_data();
    row_gather.capacity_rows = R;
    row_gather.ticket = gather->ticket;
    row_gather.chunk_rows_done = gather->tile_rows_done;
    row_gather.epoch = gather->epoch;
  }
  launch(s, maps, params, on, swiglu ? "FP8 gate/up GEMM + SwiGLU" : "FP8 gate/up GEMM");
}

// Pre-quantized matrices are dense (check_forward_args); their bf16 strides are 0.
void check_dense(const ExpertWeights& weights, int64_t matrix_elements, int64_t down_elements) {
  for (const int64_t stride : {weights.gate_stride, weights.up_stride})
    if (stride != 0 && stride != matrix_elements)
      throw Error(ErrorCode::kUnsupported,
                  "precision fp8_block: expert-strided gate/up weights (expert stride " +
                      std::to_string(stride) + " elements) are not supported yet; pass dense " +
                      "[E, I, H] tensors");
  if (weights.down_stride != 0 && weights.down_stride != down_elements)
    throw Error(ErrorCode::kUnsupported,
                "precision fp8_block: an expert-strided w_down is not supported yet");
}

}  // namespace

namespace stages {

void forward_experts_fp8(const GpuLayer::State& s, const ExpertSetForward& f,
                         const kernels::FusedGather& x_gather, const Fp8SetBuffers& fp8,
                         cudaStream_t stream, const StageMarker& mark) {
  const kernels::KernelStream on = s.on(stream);
  const ExpertSet& set = *f.set;
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts;
  const int64_t R = set.capacity_rows, rows = f.rows_in_map;
  check_dense(f.weights, I * H, H * I);
  const ForwardWeights weights = forward_weights(f.weights, E, H, I, fp8, on, f.keep_context);
  // MoeConfig::fp8_gather_in_gate_up: x's rows gathered and quantized by the gate/up GEMM.
  const bool gather = gather_in_gate_up(s.config, x_gather, f.keep_context);
  if (gather)
    check_gather_rows(set, rows);
  else
    quantize_x_rows(set, x_gather, f.rows, rows, H, fp8, on, f.keep_context);
  mark("FP8 quantization of the weights and x rows");
  // MoeConfig::fp8_swiglu: h quantized in the gate/up GEMM's epilogue (the pass's bits), g and u
  // written only for a context (the SwiGLU backward reads them).
  const kernels::FusedGather* fused = gather ? &x_gather : nullptr;
  if (swiglu_in_gate_up(s.config, f.keep_context)) {
    gate_up_gemm(s, set, fp8, weights, rows, on, true, f.keep_context, fused);
  } else {
    gate_up_gemm(s, set, fp8, weights, rows, on, false, true, fused);
    cuda_check(kernels::launch_swiglu_quantize_fp8(set.gate.pointer, set.up.pointer, R, I,
                                                   s.shape.swiglu_limit, fp8.h.codes.pointer,
                                                   fp8.h.scale_data(), on),
               "FP8 SwiGLU + quantization of h");
  }
  mark("FP8 gate/up GEMM + SwiGLU");

  row_tile_gemm(s, set, fp8.h.view(), R, I, weights.down, H, f.out, f.out_rows, on,
                "FP8 down GEMM");
  mark("FP8 down GEMM");
}

void backward_experts_fp8(const GpuLayer::State& s, const ExpertSetBackward& b, bool recompute,
                          const kernels::FusedGather& d_out_gather,
                          const kernels::FusedGather& x_gather, const Fp8SetBuffers& fp8,
                          cudaStream_t stream, const StageMarker& mark) {
  const kernels::KernelStream on = s.on(stream);
  const ExpertSet& set = *b.set;
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts;
  const int64_t R = set.capacity_rows, rows = b.rows_in_map;
  check_dense(b.weights, I * H, H * I);
  if (R != rows)  // can_implement: the shared expert's T is a multiple of 128 in FP8
    throw Error(ErrorCode::kInternal, "FP8 backward: " + std::to_string(rows) +
                                          " rows in the maps, " + std::to_string(R) +
                                          " in the set's buffers");
  // Gathered here (the local exchange): x's column groups come from this pass when recomputing,
  // else from the forward's (its context); d_out's both ways. Else from the exchange's rows.
  const bool gathered = d_out_gather.x != nullptr;
  if (recompute) {
    const ForwardWeights weights = forward_weights(b.weights, E, H, I, fp8, on, true);
    quantize_x_rows(set, x_gather, b.rows, rows, H, fp8, on);
    gate_up_gemm(s, set, fp8, weights, rows, on);
    mark("FP8 gate/up recompute");
  }
  transposed_weights(b.weights, E, H, I, fp8, on);
  if (gathered)
    gather_quantize(set, d_out_gather, fp8.d_out_rows, fp8.d_out_t, on, "d_out rows");
  else
    quantize(b.d_out_rows, rows, H, Fp8QuantizeForm::kRowGroups, fp8.d_out_rows, on, "d_out rows");
  mark("FP8 quantization of the weights and d_out rows");

  // dh_raw = bf16(d_out Wd) into `hidden`, which the SwiGLU backward reads.
  row_tile_gemm(s, set, fp8.d_out_rows.view(), rows, H, fp8.w_down_t.view(), I, set.hidden.pointer,
                R, on, "FP8 down dgrad GEMM");
  mark("FP8 down dgrad");
  // The SwiGLU backward (the bf16 path's math and d_router_weights) with d_g and d_u quantized
  // both ways (row groups for this dgrad, column groups for the weight gradients) and h_w in
  // column groups, in one pass: no bf16 d_g, d_u or h_w is written.
  const ScheduleView view = set.view();
  const bool weight_grads = b.grads.d_w_gate != nullptr;
  kernels::Fp8SwigluBackward swiglu;
  swiglu.swiglu = kernels::make_swiglu_backward_args(
      set.gate.pointer, set.up.pointer, set.hidden.pointer, view.row_pair, b.router.weights, I,
      s.shape.swiglu_limit, nullptr, nullptr, nullptr, b.router.grads, b.router.grad_peers,
      b.router.pairs_per_rank, 0);
  swiglu.header = view.header;
  swiglu.capacity_rows = R;
  swiglu.router_grad_partials = set.router_grad_partials.as<float>();  // lets I split over CTAs
  swiglu.d_gate_rows = fp8.d_gate.codes.pointer;
  swiglu.d_gate_row_scales = fp8.d_gate.scale_data();
  swiglu.d_up_rows = fp8.d_up.codes.pointer;
  swiglu.d_up_row_scales = fp8.d_up.scale_data();
  if (weight_grads) {
    swiglu.d_gate_columns = fp8.d_gate_t.codes.pointer;
    swiglu.d_gate_column_scales = fp8.d_gate_t.scale_data();
    swiglu.d_up_columns = fp8.d_up_t.codes.pointer;
    swiglu.d_up_column_scales = fp8.d_up_t.scale_data();
    swiglu.h_w_columns = fp8.h_w_t.codes.pointer;
    swiglu.h_w_column_scales = fp8.h_w_t.scale_data();
  }
  cuda_check(kernels::launch_swiglu_backward_quantize_fp8(swiglu, on),
             "FP8 SwiGLU backward and quantization of d_g, d_u, h_w");
  mark("SwiGLU backward + router weight gradient + d_g, d_u, h_w quantized");

  // dx rows = [d_g | d_u] [Wg; Wu]: K split at I.
  kernels::Fp8GemmMaps maps{};
  maps.a = codes_2d(fp8.d_gate.view(), R, I, "d_gate (FP8)", chunk_box_rows(s));
  maps.a2 = codes_2d(fp8.d_up.view(), R, I, "d_up (FP8)", chunk_box_rows(s));
  maps.a_scales = scales_2d(fp8.d_gate.view(), R, I / 128, "d_gate's scales", a_scales_box_rows(s));
  maps.a2_scales = scales_2d(fp8.d_up.view(), R, I / 128, "d_up's scales", a_scales_box_rows(s));
  maps.b = codes_3d(fp8.w_gate_t.view(), E, H, I, "w_gate transposed (FP8)");
  maps.b2 = codes_3d(fp8.w_up_t.view(), E, H, I, "w_up transposed (FP8)");
  maps.out = maps.out2 = output_map(b.dx_out, H, b.dx_rows, "dx rows", chunk_box_rows(s));
  kernels::Fp8GemmParams params = row_tile_params(s, set);
  params.b_scales = fp8.w_gate_t.scale_data();
  params.b2_scales = fp8.w_up_t.scale_data();
  params.n_extent = static_cast<int32_t>(H);
  params.k_extent = static_cast<int32_t>(2 * I);
  params.k_split = static_cast<int32_t>(I);
  launch(s, maps, params, on, "FP8 gate/up dgrad GEMM");
  mark("FP8 gate/up dgrad");

  // Weight gradients: K = the expert's rows (zero on padding rows), both operands transposed in
  // groups of 128 rows. None with frozen weights (BackwardArgs), nor their operands.
  if (!weight_grads) return;
  if (!gathered) {
    quantize(b.rows, rows, H, Fp8QuantizeForm::kColumnGroups, fp8.x_t, on, "x rows (transposed)");
    quantize(b.d_out_rows, rows, H, Fp8QuantizeForm::kColumnGroups, fp8.d_out_t, on,
             "d_out rows (transposed)");
  }
  // out: bf16 or fp32 [E, m, n] (expert stride out_stride elements; 0: dense), written or, with
  // BackwardArgs::accumulate_weight_grads, added to (Fp8WeightGradOut).
  auto weight_grad = [&](const Fp8Operand& a, int64_t m, const Fp8Operand& b_op, int64_t n,
                         void* out, int64_t out_stride, bool out_f32, const char* what) {
    using kernels::Fp8WeightGradOut;
    kernels::Fp8GemmMaps wgrad_maps{};
    wgrad_maps.a = codes_2d(a.view(), m, rows, what);
    wgrad_maps.b = codes_2d(b_op.view(), n, rows, what);
    wgrad_maps.a_scales = scales_2d(a.view(), m, rows / 128, what);
    wgrad_maps.b_scales = scales_2d(b_op.view(), n, rows / 128, what);
    if (out_f32) {  // boxes of [128 rows x 32] fp32: 128-byte rows, as the bf16 boxes' 64
      const int64_t dims[3] = {n, m, E};
      const int64_t strides[2] = {n * 4, (out_stride > 0 ? out_stride : m * n) * 4};
      const int32_t box[3] = {32, 128, 1};
      wgrad_maps.out = make_tensor_map(out, TmaElement::kF32, 3, dims, strides, box, true, what);
    } else {
      wgrad_maps.out = make_tensor_map_3d(out, n, m, E, 64, 128, what, out_stride);
    }
    kernels::Fp8GemmParams wgrad;
    wgrad.form = kernels::Fp8GemmForm::kWeightGrad;
    wgrad.expert_offsets = view.expert_offsets;
    wgrad.num_experts = static_cast<int32_t>(E);
    wgrad.m_extent = static_cast<int32_t>(m);
    wgrad.n_extent = static_cast<int32_t>(n);
    wgrad.weight_grad_out =
        out_f32
            ? (b.grads.accumulate ? Fp8WeightGradOut::kF32Accumulate : Fp8WeightGradOut::kF32)
            : (b.grads.accumulate ? Fp8WeightGradOut::kBF16Accumulate : Fp8WeightGradOut::kBF16);
    // The second staging tile serves the plain bf16 form only (fp8_gemm.h).
    wgrad.weight_grad_staging_tiles = wgrad.weight_grad_out == Fp8WeightGradOut::kBF16
                                          ? s.config.fp8_weight_grad_staging_tiles
                                          : 1;
    wgrad.wait = s.wait_context();
    wgrad.ablation = gemm_ablation_from_env();
    launch(s, wgrad_maps, wgrad, on, what);
  };
  weight_grad(fp8.d_gate_t, I, fp8.x_t, H, b.grads.d_w_gate, b.grads.d_w_gate_stride,
              b.grads.d_w_gate_f32, "FP8 weight gradient of gate");
  weight_grad(fp8.d_up_t, I, fp8.x_t, H, b.grads.d_w_up, b.grads.d_w_up_stride, b.grads.d_w_up_f32,
              "FP8 weight gradient of up");
  weight_grad(fp8.d_out_t, H, fp8.h_w_t, I, b.grads.d_w_down, b.grads.d_w_down_stride,
              b.grads.d_w_down_f32, "FP8 weight gradient of down");
  mark("FP8 weight gradients");
}

}  // namespace stages
}  // namespace mok
