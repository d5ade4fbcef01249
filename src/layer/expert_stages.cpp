// The GEMM stages of one expert set (the routed experts or the shared expert): tensor maps and
// launches of the expert GEMM forms, forward and backward. See gpu_layer_state.h.
#include <cuda.h>

#include <cstdint>
#include <string>

#include "kernels/gemm/launch.h"
#include "kernels/persistent/launch.h"
#include "kernels/stages/launch.h"
#include "layer/gemm_ablation.h"
#include "layer/gpu_layer_state.h"
#include "layer/tma.h"

namespace mok {

namespace {

// Tensor maps: K-major operands are read in [128 rows x 64] boxes (A, and B: a 256-row B tile in
// two, so that a CTA pair can multicast one each); MN-major ones in [64 K-rows x 64] boxes.
CUtensorMap k_major_rows(const void* base, int64_t width, int64_t rows, const char* what) {
  return make_tensor_map_2d(base, width, rows, 64, 128, what);
}
CUtensorMap mn_major_rows(const void* base, int64_t width, int64_t rows, const char* what) {
  return make_tensor_map_2d(base, width, rows, 64, 64, what);
}
// Weights [experts, n, k], each expert's matrix `expert_stride` elements after the previous one
// (0: dense).
CUtensorMap k_major_weights(const void* base, int64_t k, int64_t n, int64_t experts, int32_t box_n,
                            const char* what, int64_t expert_stride) {
  return make_tensor_map_3d(base, k, n, experts, 64, box_n, what, expert_stride);
}
// The staging-tile epilogue's store map of [rows, width] outputs: [128 rows x 64] boxes (3-D
// with one batch, like the weight gradients' maps).
CUtensorMap output_rows(void* base, int64_t width, int64_t rows, const char* what) {
  return make_tensor_map_3d(base, width, rows, 1, 64, 128, what);
}
CUtensorMap mn_major_weights(const void* base, int64_t n, int64_t k, int64_t experts,
                             const char* what, int64_t expert_stride) {
  return make_tensor_map_3d(base, n, k, experts, 64, 64, what, expert_stride);
}

kernels::ExpertGemmParams base_params(const GpuLayer::State& s, const ExpertSet& set) {
  kernels::ExpertGemmParams params{};
  const ScheduleView view = set.view();
  params.header = view.header;
  params.tile_expert = view.tile_expert;
  params.row_pair = view.row_pair;
  params.expert_offsets = view.expert_offsets;
  params.expert_counts = view.expert_counts;
  params.num_experts = static_cast<int32_t>(set.num_experts);
  params.skip_padding = s.config.skip_padding_rows ? 1 : 0;
  // 64-row last tiles where the padding is a large part of the row tiles' work: experts of at
  // most kHalfRowTilesMaxRowsPerExpert routed rows on average (the routed set: R*T*K / E; the
  // shared expert: T).
  const ScheduleParams& schedule = set.layout.params;
  const bool few_rows =
      schedule.num_pairs() <= int64_t{kHalfRowTilesMaxRowsPerExpert} * schedule.num_experts;
  params.half_row_tiles = s.config.skip_padding_rows && few_rows ? 1 : 0;
  params.dgrad_half_row_tiles = params.half_row_tiles && s.config.gemm_dgrad_half_row_tiles ? 1 : 0;
  params.weight_grad_pingpong = s.config.weight_grad_pingpong ? 1 : 0;
  params.four_stages = s.config.gemm_four_stages ? 1 : 0;
  params.tile_group = s.config.gemm_tile_group;
  params.expert_aligned_groups = s.config.gemm_expert_aligned_groups ? 1 : 0;
  params.l2 = s.l2_placement;
  params.lockstep = s.lockstep;
  params.tickets = s.tickets;
  params.swiglu_limit = s.shape.swiglu_limit;
  params.wait = s.wait_context();
  params.ablation = gemm_ablation_from_env();
  return params;
}

// The task-trace arguments of a persistent launch (MoeConfig::trace_tasks), the buffer emptied
// first; none when not tracing.
kernels::TaskTraceArgs task_trace(const DeviceBuffer& buffer, int64_t capacity,
                                  cudaStream_t stream) {
  kernels::TaskTraceArgs trace;
  if (capacity == 0) return trace;
  cuda_check(cudaMemsetAsync(buffer.pointer, 0xff, buffer.bytes, stream), "empty a task trace");
  trace.events = buffer.as<TaskTraceEvent>();
  trace.capacity = capacity;
  return trace;
}

// The maps of one expert set's forward in the persistent kernel: as forward_experts builds them.
kernels::ForwardSetMaps forward_set_maps(const GpuLayer::State& s, const ExpertSetForward& f) {
  const ExpertSet& set = *f.set;
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts;
  const int64_t R = set.capacity_rows;
  kernels::ForwardSetMaps maps{};
  maps.x_rows = k_major_rows(f.rows, H, f.rows_in_map, "expert rows");
  maps.w_gate = k_major_weights(f.weights.gate, H, I, E, 128, "w_gate", f.weights.gate_stride);
  maps.w_up = k_major_weights(f.weights.up, H, I, E, 128, "w_up", f.weights.up_stride);
  maps.hidden_in = k_major_rows(set.hidden.pointer, I, R, "hidden");
  maps.w_down = k_major_weights(f.weights.down, I, H, E, 128, "w_down", f.weights.down_stride);
  maps.hidden_out = output_rows(set.hidden.pointer, I, R, "hidden");
  maps.gate_out = output_rows(set.gate.pointer, I, R, "gate (forward context)");
  maps.up_out = output_rows(set.up.pointer, I, R, "up (forward context)");
  maps.y_out = output_rows(f.out, H, f.out_rows, "expert output rows");
  return maps;
}

// The persistent kernel's gate/up and down parameters of one expert set.
void forward_set_params(const GpuLayer::State& s, const ExpertSet& set,
                        kernels::ExpertGemmParams& gate_up, kernels::ExpertGemmParams& down) {
  gate_up = base_params(s, set);
  gate_up.n_extent = static_cast<int32_t>(set.intermediate);
  gate_up.k_extent = static_cast<int32_t>(s.shape.hidden);
  down = base_params(s, set);
  down.n_extent = static_cast<int32_t>(s.shape.hidden);
  down.k_extent = static_cast<int32_t>(set.intermediate);
}

// The persistent backward's maps and parameters of one expert set (backward_experts' forms),
// its counters and pipeline left to the caller. router_weights null = weight 1 (the shared
// expert).
kernels::BackwardSetMaps backward_set(const GpuLayer::State& s, const ExpertSetBackward& b,
                                      kernels::BackwardSetParams& params) {
  const ExpertSet& set = *b.set;
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts,
                R = set.capacity_rows;
  const void *rows = b.rows, *d_out_rows = b.d_out_rows;
  const void *w_gate = b.weights.gate, *w_up = b.weights.up, *w_down = b.weights.down;
  const int64_t rows_in_map = b.rows_in_map;
  const WeightGrads& grads = b.grads;
  kernels::BackwardSetMaps maps{};
  maps.x_rows = k_major_rows(rows, H, rows_in_map, "expert rows");
  maps.w_gate = k_major_weights(w_gate, H, I, E, 128, "w_gate", b.weights.gate_stride);
  maps.w_up = k_major_weights(w_up, H, I, E, 128, "w_up", b.weights.up_stride);
  maps.gate_out = output_rows(set.gate.pointer, I, R, "gate (recomputed)");
  maps.up_out = output_rows(set.up.pointer, I, R, "up (recomputed)");
  maps.d_out_rows = k_major_rows(d_out_rows, H, rows_in_map, "d_out rows");
  maps.w_down_mn = mn_major_weights(w_down, I, H, E, "w_down (MN-major)", b.weights.down_stride);
  maps.dh_out = output_rows(set.hidden.pointer, I, R, "dh_raw");
  maps.d_gate = k_major_rows(set.d_gate.pointer, I, R, "d_gate");
  maps.d_up = k_major_rows(set.d_up.pointer, I, R, "d_up");
  maps.w_gate_mn = mn_major_weights(w_gate, H, I, E, "w_gate (MN-major)", b.weights.gate_stride);
  maps.w_up_mn = mn_major_weights(w_up, H, I, E, "w_up (MN-major)", b.weights.up_stride);
  maps.dx_out = output_rows(b.dx_out, H, b.dx_rows, "dx rows");
  maps.d_gate_mn = mn_major_rows(set.d_gate.pointer, I, R, "d_gate (MN-major)");
  maps.d_up_mn = mn_major_rows(set.d_up.pointer, I, R, "d_up (MN-major)");
  maps.d_out_mn = mn_major_rows(d_out_rows, H, rows_in_map, "d_out rows (MN-major)");
  maps.x_mn = mn_major_rows(rows, H, rows_in_map, "expert rows (MN-major)");
  maps.h_w_mn = mn_major_rows(set.hidden.pointer, I, R, "h_w (MN-major)");
  maps.d_w_gate = make_tensor_map_3d(grads.d_w_gate, H, I, E, 64, 128, "weight gradient of gate",
                                     grads.d_w_gate_stride);
  maps.d_w_up = make_tensor_map_3d(grads.d_w_up, H, I, E, 64, 128, "weight gradient of up",
                                   grads.d_w_up_stride);
  maps.d_w_down = make_tensor_map_3d(grads.d_w_down, I, H, E, 64, 128, "weight gradient of down",
                                     grads.d_w_down_stride);
  maps.swiglu_gate = make_tensor_map_2d(set.gate.pointer, I, R, 64, 32, "gate (SwiGLU task)");
  maps.swiglu_up = make_tensor_map_2d(set.up.pointer, I, R, 64, 32, "up (SwiGLU task)");
  maps.swiglu_dh = make_tensor_map_2d(set.hidden.pointer, I, R, 64, 32, "dh_raw (SwiGLU task)");

  auto form = [&](int64_t m, int64_t n, int64_t k) {
    kernels::ExpertGemmParams p = base_params(s, set);
    p.m_extent = static_cast<int32_t>(m);
    p.n_extent = static_cast<int32_t>(n);
    p.k_extent = static_cast<int32_t>(k);
    return p;
  };
  params.recompute = form(0, I, H);
  params.down_dgrad = form(0, I, H);
  params.gate_up_dgrad = form(0, H, I);
  params.gate_up_dgrad.push = b.push;
  params.wgrad_gate_up = form(I, H, 0);
  params.wgrad_down = form(H, I, 0);
  const ScheduleView view = set.view();
  params.swiglu = kernels::make_swiglu_backward_args(
      set.gate.pointer, set.up.pointer, set.hidden.pointer, view.row_pair, b.router.weights, I,
      s.shape.swiglu_limit, set.d_gate.pointer, set.d_up.pointer, set.hidden.pointer,
      b.router.grads, b.router.grad_peers, b.router.pairs_per_rank, 0);
  return maps;
}

// MoeConfig::gemm_lockstep_k_blocks and gemm_tiles_by_ticket: their counters name a row-tile
// launch by its epoch, so the next launch gets a new one.
void advance_epochs(const kernels::ExpertGemmParams& params, kernels::ExpertGemmForm form,
                    kernels::KernelStream on) {
  if (params.lockstep.ticks != nullptr && form != kernels::ExpertGemmForm::kWeightGrad)
    cuda_check(kernels::launch_advance_epoch(params.lockstep.epoch, on),
               "advance the GEMM lockstep's epoch");
  if (params.tickets.counter != nullptr && form != kernels::ExpertGemmForm::kWeightGrad)
    cuda_check(kernels::launch_advance_epoch(params.tickets.epoch, on),
               "advance the GEMM tickets' epoch");
}

void launch(const GpuLayer::State& s, kernels::ExpertGemmForm form,
            const kernels::ExpertGemmMaps& maps, const kernels::ExpertGemmParams& params,
            cudaStream_t stream, const char* what) {
  cuda_check(kernels::launch_expert_gemm(form, maps, params, s.sm_count, s.config.gemm_cta_pairs,
                                         s.on(stream)),
             what);
  // The L2 placement's claims name the launch by the epoch: the next launch gets a new one.
  if (params.l2.slot_of_sm != nullptr && form != kernels::ExpertGemmForm::kWeightGrad)
    cuda_check(kernels::launch_advance_epoch(s.l2_claims.as<unsigned long long>() + s.sm_count,
                                             s.on(stream)),
               "advance the L2 placement's epoch");
  advance_epochs(params, form, s.on(stream));
}

// The 256 x 192 tiles' maps where they read and write what the 128 x 256 tiles' do (the dgrads).
kernels::WideGemmMaps wide_maps(const kernels::ExpertGemmMaps& maps) {
  kernels::WideGemmMaps wide{};
  wide.a0 = maps.a0;
  wide.a1 = maps.a1;
  wide.b0 = maps.b0;
  wide.b1 = maps.b1;
  wide.out = maps.out;
  return wide;
}

// The 256 x 192 tiles of MoeConfig::gemm_wide_tiles (wide_tile_gemm.cu).
void launch_wide(const GpuLayer::State& s, kernels::ExpertGemmForm form,
                 const kernels::WideGemmMaps& maps, const kernels::ExpertGemmParams& params,
                 cudaStream_t stream, const char* what) {
  cuda_check(kernels::launch_wide_tile_gemm(form, maps, params, s.sm_count, stream),
             std::string(what) + " (256 x 192 tiles)");
  advance_epochs(params, form, stream);
}

}  // namespace

namespace stages {

// Forward of one expert set (gpu_layer_state.h).
void forward_experts(const GpuLayer::State& s, const ExpertSetForward& f,
                     const kernels::FusedGather& gather, cudaStream_t stream,
                     const StageMarker& mark, const kernels::MacrobatchParams& macrobatch) {
  const ExpertSet& set = *f.set;
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts;
  const int64_t R = set.capacity_rows;
  kernels::ExpertGemmMaps maps{};
  maps.a0 = maps.a1 = k_major_rows(f.rows, H, f.rows_in_map, "expert rows");
  maps.b0 = k_major_weights(f.weights.gate, H, I, E, 128, "w_gate", f.weights.gate_stride);
  maps.b1 = k_major_weights(f.weights.up, H, I, E, 128, "w_up", f.weights.up_stride);
  maps.out = output_rows(set.hidden.pointer, I, R, "hidden");
  maps.out2 = output_rows(set.gate.pointer, I, R, "gate (forward context)");
  maps.out3 = output_rows(set.up.pointer, I, R, "up (forward context)");
  kernels::ExpertGemmParams params = base_params(s, set);
  params.n_extent = static_cast<int32_t>(I);
  params.k_extent = static_cast<int32_t>(H);
  params.gather = gather;
  params.macrobatch = macrobatch;
  params.skip_context_stores = f.keep_context ? 0 : 1;
  if (s.config.gemm_wide_tiles) {
    // 256 x (96 gate + 96 up) tiles; h, g and u written with plain stores.
    kernels::WideGemmMaps wide{};
    wide.a0 = wide.a1 = maps.a0;
    wide.b0 = k_major_weights(f.weights.gate, H, I, E, 96, "w_gate (96-row boxes)",
                              f.weights.gate_stride);
    wide.b1 =
        k_major_weights(f.weights.up, H, I, E, 96, "w_up (96-row boxes)", f.weights.up_stride);
    wide.out = maps.out;
    wide.swiglu = {set.hidden.as<__nv_bfloat16>(), set.gate.as<__nv_bfloat16>(),
                   set.up.as<__nv_bfloat16>()};
    launch_wide(s, kernels::ExpertGemmForm::kGateUpSwiGLU, wide, params, stream, "gate/up GEMM");
  } else {
    launch(s, kernels::ExpertGemmForm::kGateUpSwiGLU, maps, params, stream, "gate/up GEMM");
  }
  if (gather.x != nullptr) {
    cuda_check(kernels::launch_advance_epoch(gather.epoch, s.on(stream)),
               "advance the gather epoch");
    mark("gather + gate/up GEMM + SwiGLU");
  } else {
    mark("gate/up GEMM + SwiGLU");
  }

  params.n_extent = static_cast<int32_t>(H);
  params.k_extent = static_cast<int32_t>(I);
  params.gather = kernels::FusedGather{};
  params.push = f.push;
  params.macrobatch.out_row_base = 0;  // y is full size, in schedule rows
  if (s.config.gemm_wide_tiles) {
    // 256 x 192 tiles (can_implement refused the push they do not make).
    kernels::WideGemmMaps wide{};
    wide.a0 = wide.a1 = k_major_rows(set.hidden.pointer, I, R, "hidden");
    wide.b0 = wide.b1 = k_major_weights(f.weights.down, I, H, E, 192, "w_down (192-row boxes)",
                                        f.weights.down_stride);
    wide.out = output_rows(f.out, H, f.out_rows, "expert output rows");
    launch_wide(s, kernels::ExpertGemmForm::kDownStore, wide, params, stream, "down GEMM");
  } else {
    maps.a0 = maps.a1 = k_major_rows(set.hidden.pointer, I, R, "hidden");
    maps.b0 = maps.b1 =
        k_major_weights(f.weights.down, I, H, E, 128, "w_down", f.weights.down_stride);
    maps.out = output_rows(f.out, H, f.out_rows, "expert output rows");
    launch(s, kernels::ExpertGemmForm::kDownStore, maps, params, stream, "down GEMM");
  }
  mark("down GEMM");
}

// The routed experts' forward as one persistent kernel (forward_gemms.cu): the same GEMMs and
// epilogues as forward_experts, with the fused local dispatch when `gather.x` is set, and the
// shared expert's tiles (the same as forward_experts on s.shared) when `shared` is set.
void forward_experts_persistent(const GpuLayer::State& s, const ExpertSetForward& routed,
                                const ExpertSetForward* shared, const kernels::FusedGather& gather,
                                const kernels::MacrobatchParams& macrobatch, cudaStream_t stream,
                                const StageMarker& mark) {
  kernels::ForwardGemmsMaps maps{};
  maps.routed = forward_set_maps(s, routed);
  kernels::ForwardGemmsParams params{};
  forward_set_params(s, *routed.set, params.gate_up, params.down);
  params.gate_up.gather = gather;
  params.gate_up.macrobatch = macrobatch;
  params.gate_up.skip_context_stores = routed.keep_context ? 0 : 1;
  params.down.macrobatch = macrobatch;
  params.down.macrobatch.out_row_base = 0;  // y is full size, in schedule rows
  params.down.push = routed.push;
  params.minibatch_tiles = static_cast<int32_t>(s.config.minibatch_size / kDefaultRowAlign);
  const kernels::ForwardCounterLayout& counters = s.forward_counters;
  params.ticket = s.counter(s.persistent_state, counters.ticket());
  params.epoch = s.counter(s.persistent_state, counters.epoch());
  params.gate_up_done = s.counter(s.persistent_state, counters.gate_up_done());
  if (shared != nullptr) {
    maps.shared = forward_set_maps(s, *shared);
    forward_set_params(s, *shared->set, params.shared_gate_up, params.shared_down);
    params.shared_gate_up.skip_context_stores = shared->keep_context ? 0 : 1;
    params.shared_m_tiles = static_cast<int32_t>(counters.shared_tiles);
    params.shared_gate_up_done = s.counter(s.persistent_state, counters.shared_gate_up_done());
  }
  params.trace = task_trace(s.forward_trace, s.forward_trace_capacity, stream);
  cuda_check(kernels::launch_forward_gemms(maps, params, s.sm_count, stream),
             "persistent forward GEMM kernel");
  cuda_check(kernels::launch_advance_epoch(params.epoch, stream),
             "advance the persistent forward's epoch");
  if (gather.x != nullptr)
    cuda_check(kernels::launch_advance_epoch(gather.epoch, stream), "advance the gather epoch");
  mark(params.shared_m_tiles > 0
           ? (gather.x != nullptr ? "gather + gate/up + down + shared expert (persistent)"
                                  : "gate/up + down + shared expert (persistent)")
           : (gather.x != nullptr ? "gather + gate/up + down (persistent)"
                                  : "gate/up + down (persistent)"));
}

// Backward of one expert set (gpu_layer_state.h).
void backward_experts(const GpuLayer::State& s, const ExpertSetBackward& b, bool recompute,
                      cudaStream_t stream, const StageMarker& mark, int32_t macrobatch_index,
                      const kernels::FusedGather& d_out_gather) {
  const ExpertSet& set = *b.set;
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts,
                R = set.capacity_rows;
  const void *rows = b.rows, *d_out_rows = b.d_out_rows;
  const void *w_gate = b.weights.gate, *w_up = b.weights.up, *w_down = b.weights.down;
  const int64_t rows_in_map = b.rows_in_map;
  const WeightGrads& grads = b.grads;
  auto macrobatch = [&](int matrix) {
    return macrobatch_index < 0 ? kernels::MacrobatchParams{}
                                : s.macrobatch(macrobatch_index, matrix);
  };
  kernels::ExpertGemmParams params = base_params(s, set);
  params.macrobatch = macrobatch(0);

  kernels::ExpertGemmMaps maps{};
  maps.a0 = maps.a1 = k_major_rows(rows, H, rows_in_map, "expert rows");
  maps.b0 = k_major_weights(w_gate, H, I, E, 128, "w_gate", b.weights.gate_stride);
  maps.b1 = k_major_weights(w_up, H, I, E, 128, "w_up", b.weights.up_stride);
  maps.out = output_rows(set.gate.pointer, I, R, "gate (recomputed)");
  maps.out2 = output_rows(set.up.pointer, I, R, "up (recomputed)");
  params.n_extent = static_cast<int32_t>(I);
  params.k_extent = static_cast<int32_t>(H);
  if (recompute) {
    launch(s, kernels::ExpertGemmForm::kGateUpStore, maps, params, stream,
           "gate/up recompute GEMM");
    mark("gate/up recompute");
  }

  // dh_raw = bf16(d_out Wd) into `hidden`; the SwiGLU backward then turns it into h_w in place.
  maps.a0 = maps.a1 = k_major_rows(d_out_rows, H, rows_in_map, "d_out rows");
  maps.b0 = maps.b1 = mn_major_weights(w_down, I, H, E, "w_down (MN-major)", b.weights.down_stride);
  maps.out = output_rows(set.hidden.pointer, I, R, "dh_raw");
  const ScheduleView view = set.view();
  const int64_t window_begin = params.macrobatch.ring_row_base;
  const int64_t window_rows = params.macrobatch.rows > 0 ? params.macrobatch.rows : INT64_MAX;
  if (s.config.swiglu_backward_in_dgrad) {
    // The SwiGLU backward in the down dgrad's epilogue: h_w, d_g and d_u come out of the GEMM,
    // dh_raw is never written, and each row's router-weight gradient leaves as one partial per
    // 256-column tile, summed after in column order (the standalone pass's order: same bits).
    if (d_out_gather.x != nullptr)
      throw Error(ErrorCode::kInternal,
                  "backward_experts: swiglu_backward_in_dgrad with the d_out pull inside the down "
                  "dgrad (ep_dispatch_in_gemm); can_implement refuses the two together");
    kernels::ExpertGemmMaps dgated = maps;
    // [128 rows x 32 columns] boxes (64-byte swizzle): the epilogue's subtiles.
    auto subtiles = [&](void* base, const char* what) {
      return make_tensor_map_3d(base, I, R, 1, 32, 128, what);
    };
    dgated.a1 = subtiles(set.gate.pointer, "gate (dgated epilogue)");
    dgated.b1 = subtiles(set.up.pointer, "up (dgated epilogue)");
    dgated.out = subtiles(set.d_gate.pointer, "d_gate (dgated epilogue)");
    dgated.out2 = subtiles(set.d_up.pointer, "d_up (dgated epilogue)");
    dgated.out3 = subtiles(set.hidden.pointer, "h_w (dgated epilogue)");
    kernels::ExpertGemmParams dgated_params = params;
    dgated_params.dgated.router_weights = b.router.weights;
    const bool router_grads = b.router.grads != nullptr || b.router.grad_peers != nullptr;
    if (router_grads && set.router_grad_partials.pointer == nullptr)
      throw Error(ErrorCode::kInternal,
                  "backward_experts: swiglu_backward_in_dgrad with router weight gradients wanted "
                  "for an expert set without router-gradient partials (only the routed set has "
                  "them)");
    float* partials = router_grads ? set.router_grad_partials.as<float>() : nullptr;
    dgated_params.dgated.router_grad_partials = partials;
    dgated_params.dgated.partial_rows = set.capacity_rows;
    launch(s, kernels::ExpertGemmForm::kDownGradSwiGLU, dgated, dgated_params, stream,
           "down dgrad + SwiGLU backward GEMM");
    if (partials != nullptr)
      cuda_check(kernels::launch_router_weight_grad_sum(
                     view.header, partials, set.capacity_rows, view.row_pair, I, b.router.grads,
                     b.router.grad_peers, b.router.pairs_per_rank, s.on(stream), window_begin,
                     window_rows),
                 "router weight gradient sum launch");
    mark("down dgrad + SwiGLU backward + router weight gradient");
  } else {
    if (s.config.gemm_wide_tiles) {  // (can_implement refused the pull they do not make)
      launch_wide(s, kernels::ExpertGemmForm::kDownGrad, wide_maps(maps), params, stream,
                  "down dgrad GEMM");
    } else {
      params.gather = d_out_gather;
      launch(s, kernels::ExpertGemmForm::kDownGrad, maps, params, stream, "down dgrad GEMM");
      params.gather = kernels::FusedGather{};
    }
    if (d_out_gather.x != nullptr) {
      cuda_check(kernels::launch_advance_epoch(d_out_gather.epoch, s.on(stream)),
                 "advance the gather epoch");
      mark("pull d_out + down dgrad");
    } else {
      mark("down dgrad");
    }
    cuda_check(kernels::launch_swiglu_backward(
                   view.header, 0, set.gate.pointer, set.up.pointer, set.hidden.pointer,
                   view.row_pair, b.router.weights, I, s.shape.swiglu_limit, set.d_gate.pointer,
                   set.d_up.pointer, set.hidden.pointer, b.router.grads, b.router.grad_peers,
                   b.router.pairs_per_rank, s.on(stream), window_begin, window_rows),
               "SwiGLU backward launch");
    mark("SwiGLU backward + router weight gradient");
  }

  maps.a0 = k_major_rows(set.d_gate.pointer, I, R, "d_gate");
  maps.a1 = k_major_rows(set.d_up.pointer, I, R, "d_up");
  maps.b0 = mn_major_weights(w_gate, H, I, E, "w_gate (MN-major)", b.weights.gate_stride);
  maps.b1 = mn_major_weights(w_up, H, I, E, "w_up (MN-major)", b.weights.up_stride);
  params.n_extent = static_cast<int32_t>(H);
  params.k_extent = static_cast<int32_t>(I);
  maps.out = output_rows(b.dx_out, H, b.dx_rows, "dx rows");
  kernels::ExpertGemmParams dx_params = params;
  dx_params.macrobatch.out_row_base = 0;  // dx rows are full size, in schedule rows
  dx_params.push = b.push;
  if (s.config.gemm_wide_tiles)  // (can_implement refused the push they do not make)
    launch_wide(s, kernels::ExpertGemmForm::kGateUpGradStore, wide_maps(maps), dx_params, stream,
                "gate/up dgrad GEMM");
  else
    launch(s, kernels::ExpertGemmForm::kGateUpGradStore, maps, dx_params, stream,
           "gate/up dgrad GEMM");
  mark("gate/up dgrad");

  // Weight gradients: K = the expert's rows (zero on padding rows), both operands MN-major.
  const CUtensorMap x_rows = mn_major_rows(rows, H, rows_in_map, "expert rows (MN-major)");
  // `a_rows`: rows the A operand's memory holds (d_out of the shared expert has only T rows;
  // TMA fills the rest of the last tile with zeros).
  auto weight_grad = [&](int matrix, const void* a, int64_t a_rows, int64_t m, const CUtensorMap& b,
                         int64_t n, void* out, int64_t out_stride, const char* what) {
    kernels::ExpertGemmMaps wgrad_maps{};
    wgrad_maps.a0 = wgrad_maps.a1 = mn_major_rows(a, m, a_rows, what);
    wgrad_maps.b0 = wgrad_maps.b1 = b;
    wgrad_maps.out = make_tensor_map_3d(out, n, m, E, 64, 128, what, out_stride);
    kernels::ExpertGemmParams wgrad = base_params(s, set);
    wgrad.m_extent = static_cast<int32_t>(m);
    wgrad.n_extent = static_cast<int32_t>(n);
    wgrad.macrobatch = macrobatch(matrix);
    launch(s, kernels::ExpertGemmForm::kWeightGrad, wgrad_maps, wgrad, stream, what);
  };
  if (grads.d_w_gate == nullptr) return;  // frozen weights (BackwardArgs): none asked for
  weight_grad(0, set.d_gate.pointer, R, I, x_rows, H, grads.d_w_gate, grads.d_w_gate_stride,
              "weight gradient of gate");
  weight_grad(1, set.d_up.pointer, R, I, x_rows, H, grads.d_w_up, grads.d_w_up_stride,
              "weight gradient of up");
  weight_grad(2, d_out_rows, rows_in_map, H,
              mn_major_rows(set.hidden.pointer, I, R, "h_w (MN-major)"), I, grads.d_w_down,
              grads.d_w_down_stride, "weight gradient of down");
  mark("weight gradients");
}

// The routed experts' backward as one persistent kernel (backward_gemms.cu): the same GEMM
// forms, epilogues and SwiGLU backward as backward_experts, one macrobatch; with `shared`, the
// shared expert's backward (backward_experts on s.shared) in the same launch.
void backward_experts_persistent(const GpuLayer::State& s, const ExpertSetBackward& routed,
                                 const ExpertSetBackward* shared, bool recompute,
                                 const kernels::FusedGather& d_out_gather,
                                 const kernels::FusedGather& x_gather, cudaStream_t stream,
                                 const StageMarker& mark) {
  const kernels::BackwardCounterLayout& counters = s.backward_counters;
  auto counter = [&](int64_t offset) { return s.counter(s.persistent_backward_state, offset); };
  kernels::BackwardGemmsMaps maps{};
  kernels::BackwardGemmsParams params{};
  params.num_sets = 1;
  params.ticket = counter(counters.ticket());
  params.epoch = counter(counters.epoch());
  kernels::BackwardSetParams& routed_set = params.sets[0];
  maps.sets[0] = backward_set(s, routed, routed_set);
  routed_set.minibatch_tiles = static_cast<int32_t>(s.config.minibatch_size / kDefaultRowAlign);
  routed_set.recompute_rows = recompute ? 1 : 0;
  routed_set.d_out_gather = d_out_gather;
  routed_set.x_gather = x_gather;
  routed_set.row_gemms_done = counter(counters.row_gemms_done());
  routed_set.swiglu_done = counter(counters.swiglu_done());
  routed_set.expert_ready = counter(counters.expert_ready());
  if (shared != nullptr) {
    // The shared expert: every token is a row (its own fixed schedule), one expert, one
    // minibatch.
    kernels::BackwardSetParams& shared_set = params.sets[1];
    maps.sets[1] = backward_set(s, *shared, shared_set);
    shared_set.minibatch_tiles = static_cast<int32_t>(counters.shared_tiles);
    shared_set.recompute_rows = recompute ? 1 : 0;
    shared_set.row_gemms_done = counter(counters.shared_row_gemms_done());
    shared_set.swiglu_done = counter(counters.shared_swiglu_done());
    shared_set.expert_ready = counter(counters.shared_expert_ready());
    params.num_sets = 2;
  }
  params.trace = task_trace(s.backward_trace, s.backward_trace_capacity, stream);
  cuda_check(kernels::launch_backward_gemms(maps, params, s.sm_count, stream),
             "persistent backward kernel");
  cuda_check(kernels::launch_advance_epoch(params.epoch, stream),
             "advance the persistent backward's epoch");
  for (const kernels::FusedGather* gather : {&d_out_gather, &x_gather})
    if (gather->x != nullptr)
      cuda_check(kernels::launch_advance_epoch(gather->epoch, stream), "advance a gather's epoch");
  const char* what =
      params.num_sets == 2
          ? (recompute ? "recompute + dgrads + SwiGLU + weight gradients + shared "
                         "expert (persistent)"
                       : "dgrads + SwiGLU + weight gradients + shared expert "
                         "(persistent)")
          : (recompute ? "recompute + dgrads + SwiGLU + weight gradients (persistent)"
                       : "dgrads + SwiGLU + weight gradients (persistent)");
  mark(what);
}

}  // namespace stages
}  // namespace mok
