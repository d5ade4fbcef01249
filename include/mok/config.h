// Tuning knobs of the fused layer. None of them changes the result: outputs are bitwise
// identical for every valid config (DESIGN.md section 7).
#pragma once

#include <cstdint>
#include <string>

#include "mok/error.h"
#include "mok/shape.h"

namespace mok {

enum class Precision : int32_t {
  kBF16 = 0,  // bf16 operands, fp32 accumulation
  // e4m3 operands with power-of-two fp32 block scales (1 x 128 activation groups, 128 x 128
  // weight blocks; mok/fp8.h), on the GPU layer (one GPU, one macrobatch, the kernel sequences;
  // can_implement names what it refuses) and the CPU reference (reference::Options::precision).
  // H, I and Is must be multiples of 128. Weights may be given pre-quantized
  // (ForwardArgs::w_*_fp8).
  kFP8Block = 1,
};

const char* precision_name(Precision precision);
// The precision named `name` (bf16, fp8_block); throws mok::Error naming the valid names.
Precision precision_from_name(const std::string& name);

// The forward's local dispatch (the routed x rows in expert-grouped order, the gate/up GEMM's
// A operand).
enum class LocalDispatch : int32_t {
  // A memory-bound kernel copies the rows into a row buffer before the gate/up GEMM.
  kGatherKernel = 0,
  // The gate/up GEMM's producer warpgroup copies them (spare warps, generic loads/stores)
  // while its TMA thread waits per tile: the copy overlaps the GEMM.
  kProducerWarps = 1,
};

const char* local_dispatch_name(LocalDispatch dispatch);
// The mode named `name` (as local_dispatch_name spells it); throws mok::Error naming the valid
// names otherwise.
LocalDispatch local_dispatch_from_name(const std::string& name);

// Where the FP8 forward (precision fp8_block) computes SwiGLU and h's quantization for the down
// GEMM. Same bits in every place.
enum class Fp8SwigluPlace : int32_t {
  // A pass of its own after the gate/up GEMM, reading the g and u it wrote.
  kPass = 0,
  // The gate/up GEMM's epilogue (src/kernels/gemm/fp8_swiglu_epilogue.cuh) in a forward that
  // keeps no context (ForwardArgs::keep_context false: inference, evaluation, a no_grad forward),
  // which then writes neither g nor u; the pass in a forward that keeps one. Measured on an H100
  // (docs/perf.md, session 61): without a context the epilogue was level at dsv3_local and 4-6.5%
  // faster at qwen3; with one (g and u stored as well) the training step ran up to 2% slower at
  // dsv3_local.
  kGateUpWithoutContext = 1,
  // The gate/up GEMM's epilogue in every forward (g and u stored there for a context).
  kGateUp = 2,
};

const char* fp8_swiglu_place_name(Fp8SwigluPlace place);
// The place named `name` (as fp8_swiglu_place_name spells it); throws mok::Error naming the
// valid names otherwise.
Fp8SwigluPlace fp8_swiglu_place_from_name(const std::string& name);

struct MoeConfig {
  int32_t fwd_num_comm_sms = 24;  // SMs that run dispatch/combine in the forward kernel
  int32_t bwd_num_comm_sms = 24;  // likewise in the backward kernel
  // Rows of the expert-grouped buffer per overlap step of the persistent kernels (the forward's
  // gate/up tiles of minibatch b + 1 run between the gate/up and the down tiles of b; the
  // backward's likewise). Same bits for any size. kAutoMinibatch (the default): chosen from the
  // shape and the GPU (minibatch_rows: at least two full SM waves of tiles per expert-grouped
  // GEMM of a minibatch, MoK's rule).
  int64_t minibatch_size = 0;
  // Rows of the ring buffers that hold the routed intermediates (x rows, g, u, h, d_out rows,
  // d_g, d_u) of one macrobatch at a time. The layer walks the schedule's worst case (max_rows)
  // in macrobatches of this many rows; the backward recomputes all but the first. Same bits for
  // any size; memory of those buffers scales with min(macrobatch_size, max_rows).
  // kAutoMacrobatch (the default): one macrobatch while its ring fits kAutoMacrobatchRingBytes,
  // else the largest multiple of minibatch_size that does (macrobatch_ring_rows).
  int64_t macrobatch_size = 0;
  Precision precision = Precision::kBF16;
  double wait_timeout_s = 100.0;  // device spin-waits abort with a diagnosis after this long
  // How the forward gathers the routed x rows for the gate/up GEMM. Same bits either way; the
  // producer warps measured ~2.5% faster at dsv3_local and qwen3 once every epilogue stored
  // through TMA (docs/perf.md v8; v6 measured a third way, one-row TMA loads, 3x slower).
  LocalDispatch local_dispatch = LocalDispatch::kProducerWarps;
  // Run the forward's gate/up and down GEMMs, the routed experts' and the shared expert's, as
  // one persistent kernel (a task queue over every tile, the minibatch pipeline of
  // task_order.h, dependency counters with epochs) instead of two kernels per expert set. Same
  // bits either way.
  bool persistent_forward = false;
  // Run the experts' backward (recompute, down dgrad, SwiGLU backward, gate/up dgrad, weight
  // gradients; the routed experts' and the shared expert's) as one persistent kernel: a task
  // queue in the order of backward_task_order.h with dependency counters instead of kernel
  // boundaries. Same bits either way. With several macrobatches the backward runs its kernel
  // sequence.
  bool persistent_backward = false;
  // The expert GEMM kernels (not the persistent ones) in clusters of two CTAs that take two row
  // tiles of one expert (or of one expert's weight gradient) together and multicast the weight
  // tile they share: a third less L2 traffic per FLOP. Same bits either way. bf16 only: the FP8
  // GEMMs in pairs measured level (docs/perf.md, session 33) and run as single CTAs.
  bool gemm_cta_pairs = false;
  // The forward's two GEMMs and the backward's two dgrads (the kernel sequences) in 256 x 192
  // tiles instead of 128 x 256 (src/kernels/gemm/wide_tile_gemm.cu; gate/up as 96 gate + 96 up
  // columns): 22% fewer operand bytes per FLOP per CTA, but measured slower on H200 (forward
  // 1.18x the time at dsv3_e128, 1.31x at qwen3, 0.98x at dsv3; docs/perf.md, session 18),
  // because it moves more sectors through the L2's partition fabric. Each expert's 128-row tiles
  // go in pairs (an odd last one alone); the padding rows are computed.
  // Same bits either way. bf16, without CTA pairs, the persistent kernels or the in-GEMM
  // expert-parallel push; at most kMaxWideTileExperts local experts. Off.
  bool gemm_wide_tiles = false;
  // The expert GEMM kernels (not the persistent ones) skip the padding rows they can: the
  // weight gradients reduce each expert's routed rows rounded up to 64 instead of its 128-row
  // segment, and where the experts average at most kHalfRowTilesMaxRowsPerExpert routed rows,
  // the forward's GEMMs (not in CTA pairs) run an expert's last row tile at 64 rows when it
  // holds at most 64 routed rows (half its tensor-core work). Same bits either way
  // (docs/design.md).
  bool skip_padding_rows = true;
  // The same 64-row last tiles in the backward's two dgrads (the kernel sequence's row-tile
  // GEMMs, bf16 128 x 256 tiles, not CTA pairs), where skip_padding_rows runs them in the forward.
  // Free-running they lost (session 13: the 64-row tile ends its K loop early and its partner
  // reads the shared weight tile from HBM again); with gemm_lockstep_k_blocks the partners stay
  // in step. Same bits. Off until measured faster (written in session 23, not yet run).
  bool gemm_dgrad_half_row_tiles = false;
  // The row tiles (or CTA pairs, or 256-row units) the expert GEMM kernels' walk takes together,
  // sweeping their column tiles before the next group's (tile_walk.h): CTAs running together
  // then share the group's activation rows and its experts' weight tiles through L2. 1..1024;
  // kTileGroupM (8) by default. Same bits for any group. The persistent kernels keep
  // kTileGroupM. A knob to measure the L2 partition fabric's traffic by (docs/perf.md, session
  // 18: `mok walk-bench` replays the walks).
  int32_t gemm_tile_group = 8;
  // The standalone expert GEMMs' row-tile forms (not CTA pairs, the 256 x 192 tiles, FP8 or the
  // persistent kernels) start each group of gemm_tile_group row tiles where an expert starts,
  // if one does within 4 row tiles of the group's place (src/kernels/gemm/tile_walk.h). With
  // fixed groups an expert whose row tiles straddle two groups has its weight tiles read about
  // a sweep apart, from HBM twice: at `dsv3` (about a third of the experts' two-tile pairs)
  // the walk model counts 6.6% more weight reads than the weights (1.0 GB of the gate/up's
  // 17.8). Same bits. Off until measured faster (written in session 23, not yet run).
  bool gemm_expert_aligned_groups = false;
  // The FP8 row-tile GEMMs (precision fp8_block) walk each expert's row tiles as groups of their
  // own, at most this many a group, an expert of more split into groups that differ by one tile
  // at most (src/kernels/gemm/tile_walk.h, expert_grouped_tile_in), in a kernel of its own; 0:
  // groups of 8 (the FP8 GEMMs do not take gemm_tile_group). Where experts hold a few more row
  // tiles than a fixed group (`dsv3_local`: ~9 against 8), nearly every expert straddles two
  // groups, whose CTAs read its weight tiles a sweep apart, from HBM twice (docs/design.md, "Groups
  // of one expert"). 0 to 1024. Same bits. Off until measured faster (session 35; docs/perf.md).
  int32_t gemm_expert_groups = 0;
  // The FP8 row-tile GEMMs' tile height (precision fp8_block): 128, or 192 (three consumer
  // warpgroups over one expert's rows, src/kernels/gemm/fp8_gemm_192_rows.cu): B, the weights,
  // read once per 192 rows instead of once per 128, a sixth fewer operand bytes per FLOP. Same
  // bits. Not with gemm_expert_groups, and the GEMM lockstep does not apply to these tiles.
  // kAutoFp8RowTileRows (0, the default): chosen from the shape (fp8_row_tile_rows_for, below).
  int32_t fp8_row_tile_rows = 0;
  // The FP8 weight gradients' staging tiles (precision fp8_block): 1, or 2 (their epilogue
  // alternates two, the second in a pipeline stage's memory: src/kernels/gemm/fp8_gemm.cu), so
  // that a tile's staging waits for the store of the tile two back, not one. For the shapes
  // whose weight-gradient tiles have few K-blocks (`dsv3_e128`: two), where the bf16 stores
  // pace them. Same bits. 1: in the layer it measured level (docs/perf.md, session 61).
  int32_t fp8_weight_grad_staging_tiles = 1;
  // Where FP8's SwiGLU and h's quantization run (precision fp8_block; Fp8SwigluPlace above). In
  // the gate/up GEMM's epilogue a CTA takes a column tile of g with the one of u of the same
  // columns, keeps g's tile staged, and quantizes h from u's accumulators; the pass's read of g
  // and u is gone. With gemm_expert_groups' walk (128-row tiles) always the pass.
  Fp8SwigluPlace fp8_swiglu = Fp8SwigluPlace::kGateUpWithoutContext;
  // FP8's x rows in a forward that keeps no context, on one GPU (the local exchange): gathered
  // from x and quantized into their row groups by the gate/up GEMM's spare producer warps while
  // its TMA thread waits for each 64-row chunk (src/kernels/gemm/fp8_row_gather.cuh), instead of
  // a pass of their own before it (a forward with a context keeps the pass, which also writes the
  // column groups the backward reads). Same bits. Off: measured 0.5 ms slower at dsv3_local and
  // qwen3 (H100; the GEMM waits on its gatherers' rate: docs/perf.md, session 62).
  bool fp8_gather_in_gate_up = false;
  // The standalone expert GEMM kernels' row-tile forms (not the persistent kernels) with each of
  // the L2's two partitions on its own share of the row tiles (src/kernels/gemm/l2_placement.h):
  // the layer probes which SMs share a partition when it is built (atomic latencies,
  // src/layer/l2_partitions.h), and a CTA takes its slot from its SM. Where the probe finds no
  // clear partitions the walk stays as it is (GpuLayer::l2_placement_report says which). Same
  // bits either way. bf16, without CTA pairs or the 256 x 192 tiles. Off until measured faster
  // (written in session 18, not yet run).
  bool gemm_l2_placement = false;
  // The row-tile GEMMs of the kernel sequences (the forward's gate/up + SwiGLU and down, the
  // backward's recompute and both dgrads; not the weight gradients, the persistent kernels, CTA
  // pairs or the expert-parallel push) on a ring of four stages instead of three: their staging
  // tile holds 128 columns instead of 256 and each tile's outputs leave in two rounds, so two
  // stages load while the consumers hold two (one today). Same bits either way. Alone it loses
  // (1.37x the forward's time at dsv3_e128, its gate/up reading twice the DRAM bytes: the CTAs
  // that share a weight tile drift apart, docs/perf.md, session 22); with
  // gemm_lockstep_k_blocks it wins at dsv3, where gemm_auto_lockstep sets both.
  bool gemm_four_stages = false;
  // The kernel sequences' row-tile GEMMs (bf16 in 128 x 256 or 256 x 192 tiles, and FP8; not
  // the weight gradients, CTA pairs or the persistent kernels) keep their CTAs in step: no CTA's
  // producer runs more than about this many K-blocks ahead of the slowest CTA of its launch
  // (src/kernels/gemm/lockstep.h). CTAs that share a weight tile or activation rows then read
  // them from L2 close together instead of drifting apart and reading them from HBM again, which
  // the four-stage ring does (docs/perf.md, session 22). Timing only: the same bits for every
  // value. 0 (off) or 2..kMaxLockstepKBlocks; off, except where gemm_auto_lockstep sets it.
  int32_t gemm_lockstep_k_blocks = 0;
  // The automatic choice of the two knobs above: at shapes whose weights stream from HBM
  // (auto_lockstep_engages: the experts average under kAutoLockstepMaxRowsPerExpert routed rows
  // and their weights exceed kAutoLockstepMinWeightBytes, as at `dsv3`), the layer runs with
  // gemm_four_stages and a lead of kAutoLockstepKBlocks, unless either is set here or a knob
  // that excludes them is. At `dsv3` the forward took 0.87x its time and the step 0.95x, the
  // gate/up reading 17.8 GB of HBM instead of 23.9; at 256 and more rows per expert it lost
  // 1-6% (docs/perf.md, session 23). Same bits either way. GpuLayer::config() says what ran.
  bool gemm_auto_lockstep = true;
  // The standalone expert GEMM's row-tile forms (bf16 128 x 256 tiles, three or four stages)
  // take their tiles from a launch-wide ticket counter instead of the static walk
  // (src/kernels/gemm/tile_tickets.h): the tiles in flight stay a window of consecutive tickets
  // however the CTAs' speeds differ, so no drift accumulates, and no CTA waits on another. Same
  // bits. Not with CTA pairs, the L2 placement, gemm_lockstep_k_blocks, the 256 x 192 tiles or
  // FP8. Off until measured faster (written in session 22).
  bool gemm_tiles_by_ticket = false;
  // The backward's down dgrad runs the SwiGLU backward in its epilogue (g and u by TMA in
  // 128 x 32 subtiles, d_g, d_u and h_w stored from shared memory; dh_raw never written; the
  // router weights' gradient per 256-column tile, summed after), replacing the standalone
  // SwiGLU backward pass. The stage path only (not persistent_backward), bf16. Same bits either
  // way. The down dgrad then runs without CTA pairs, four stages, 64-row tiles or tiles by
  // ticket (its epilogue's shared memory takes their room).
  bool swiglu_backward_in_dgrad = false;
  // The weight gradients with the two consumer warpgroups of a CTA on different 128 x 128 tiles,
  // one's epilogue under the other's mainloop, instead of both on one 128 x 256 tile
  // (src/kernels/gemm/weight_grad_pingpong.cu): with one macrobatch and without CTA pairs. Same
  // bits either way. Off until it is measured faster (written in session 13, not yet run).
  bool weight_grad_pingpong = false;
  // The single-GPU layer's kernels (the expert GEMMs, the gathers, the SwiGLU backward, the
  // combines, the epoch advances, FP8's quantizations and GEMMs, and the schedule's last three,
  // which always are) launch with
  // programmatic dependent launch: a kernel's CTAs are scheduled while the previous kernel
  // finishes, and wait for its completion before they touch memory. The same results as plain
  // stream order, with the launch latency between kernels taken under the previous kernel's
  // tail. Off until it is measured faster (written in session 43).
  bool overlap_kernel_launches = false;
  // The persistent kernels record when each task was taken, queued, started and finished
  // (mok/task_trace.h; GpuLayer::task_traces). A profiling aid: a few stores per task, a buffer
  // of 64 bytes per task; the kernel sequences have nothing to trace.
  bool trace_tasks = false;
  // Expert parallel: move dispatch / combine rows with the bulk-copy engine (cp.async.bulk, one
  // thread per communication CTA) instead of warp copies. Same bits either way.
  bool ep_bulk_copies = false;
  // Expert parallel: dispatch by push (every rank writes its routed rows into the receivers'
  // symmetric buffers at their receive-list entries) instead of pull (the receivers read them
  // from the senders' published inputs). Same bits either way; NVLink writes measured faster
  // than reads on 2 x H200 (docs/perf.md), the push is measured beside the pull before it
  // becomes the default.
  bool ep_push_dispatch = false;
  // Expert parallel: the communication inside the GEMMs. The forward's gate/up GEMM's producer
  // warps, which gather the rows of the expert-grouped buffer (local_dispatch =
  // producer-warps), read each routed row straight from its source rank's published x through
  // the peer pointers, while the tensor cores run the tiles whose rows have landed (no dispatch
  // kernel, no received-rows buffer). The forward's down GEMM and the backward's gate/up dgrad
  // write each output row of another rank's pair into that rank's slot as the tile is stored
  // (no push kernel: only its signal follows). Same bits. The pull only (not with
  // ep_push_dispatch), bf16 only (FP8 quantizes the rows as it gathers them). Off until it is
  // measured faster on 2+ GPUs.
  bool ep_dispatch_in_gemm = false;
  // Scan each call's inputs for NaN and infinities and report the first one at synchronize()
  // (kDeviceFault, naming the tensor, the element's coordinates and the value), the way bad
  // expert ids are reported. The forward scans x, the routed slots' router weights and every
  // weight; the backward d_out, and the forward's inputs too when it recomputes (without a
  // context). "First" is in that tensor order, then by element, over the calls since the last
  // synchronize. A debugging aid: one memory-bound pass over the inputs per call (the weights
  // dominate: ~0.7 ms per forward at dsv3_local). The layer's outputs do not depend on it: they
  // carry NaN and infinities exactly where the reference's IEEE math puts them either way
  // (docs/design.md).
  bool check_finite = false;
};

inline constexpr int32_t kMaxCommSms = 128;
// MoeConfig::gemm_wide_tiles: the most local experts (its kernels keep a per-expert table in
// shared memory).
inline constexpr int64_t kMaxWideTileExperts = 1024;
// MoeConfig::gemm_tile_group: the largest group.
inline constexpr int32_t kMaxTileGroup = 1024;
// MoeConfig::gemm_lockstep_k_blocks: the largest lead.
inline constexpr int32_t kMaxLockstepKBlocks = 4096;

// MoeConfig::gemm_auto_lockstep: where it engages, and with what lead. Its weights are the
// local experts' three matrices in bf16; 1 GiB is twenty times any Hopper L2, so the CTAs that
// share a weight tile find it in L2 only if they read it close together.
inline constexpr int64_t kAutoLockstepMaxRowsPerExpert = 192;
inline constexpr int64_t kAutoLockstepMinWeightBytes = int64_t{1} << 30;
inline constexpr int32_t kAutoLockstepKBlocks = 16;

// MoeConfig::skip_padding_rows: 64-row last tiles only where the experts average this many
// routed rows or fewer, where the padding is 20-31% of the row tiles' work. A 64-row tile saves
// half its work but finishes its K loop before its expert's 128-row tiles on the same weight
// columns, which then read them from HBM again instead of L2: the forwards at 128 and 256 rows
// per expert (`dsv3`, `dsv3_e128`) ran 0-6% faster, at 512 (`qwen3`, 10% padding) no faster
// (docs/perf.md, session 13).
inline constexpr int32_t kHalfRowTilesMaxRowsPerExpert = 256;

// MoeConfig::macrobatch_size = kAutoMacrobatch sizes the ring from the shape: one macrobatch
// (no recompute in the backward) while the ring's buffers take at most kAutoMacrobatchRingBytes.
// A recomputed row costs a third of its forward FLOPs again (the gate/up GEMM); 8 GiB holds one
// macrobatch at every named shape (sonic_e128's 278528 worst-case rows: 7.4 GB).
inline constexpr int64_t kAutoMacrobatch = 0;
inline constexpr int64_t kAutoMacrobatchRingBytes = int64_t{8} << 30;

// MoeConfig::minibatch_size = kAutoMinibatch sizes the minibatch from the shape and the GPU:
// the fewest 128-row tiles that give each expert-grouped GEMM of a minibatch (the forward's
// gate/up and down, the backward's two dgrads) at least kMinibatchSmWaves full waves of tiles
// on `num_sms` SMs. Under an explicit macrobatch_size, the smallest such multiple of 128 that
// divides it (the macrobatch itself if none does).
inline constexpr int64_t kAutoMinibatch = 0;
inline constexpr int32_t kMinibatchSmWaves = 2;

// MoeConfig::gemm_auto_lockstep: true where it sets the two knobs for `shape`: bf16, neither
// gemm_four_stages nor gemm_lockstep_k_blocks set, none of CTA pairs, the 256 x 192 tiles, the
// L2 placement, the tiles by ticket or the communication inside the GEMMs, and the rule above
// (routed rows per expert: T * K * R / E).
bool auto_lockstep_engages(const MoeConfig& config, const MoeShape& shape);

// MoeConfig::fp8_row_tile_rows = kAutoFp8RowTileRows: 192-row tiles where the experts average at
// least kFp8Rows192MinRowsPerExpert routed rows (an expert's last, part-filled tile a small share
// of its rows) and the intermediate size, the down GEMM's K, is at least
// kFp8Rows192MinIntermediate (K loops long enough for the 192-row kernel's one K-block in
// flight and four stages); 128 elsewhere. Measured on H100 (docs/perf.md, sessions 48-49), the
// 192-row tiles' share of the 128-row tiles' time, forward / forward+backward: `dsv3_local` (1024
// rows per expert, I = 2048) 0.92x / 0.96x; `qwen3` (512, 768) 1.04x / 1.03x; `sonic_e128`
// (2048, 1024) 1.04x / 1.01x; `dsv3_e128` (256, 2048) 1.01x / 0.99-1.01x (1.29x / 1.14x before
// the walk split an expert's last 3 + 1 chunks as 2 + 2).
inline constexpr int32_t kAutoFp8RowTileRows = 0;
inline constexpr int64_t kFp8Rows192MinRowsPerExpert = 768;
inline constexpr int64_t kFp8Rows192MinIntermediate = 2048;

// The FP8 row tiles' height a layer of `shape` runs with: config.fp8_row_tile_rows, or with
// kAutoFp8RowTileRows the rule above (128 under bf16 or gemm_expert_groups, which walk 128-row
// tiles only).
int32_t fp8_row_tile_rows_for(const MoeConfig& config, const MoeShape& shape);

// `config` with its automatic choices made for `shape`: gemm_auto_lockstep's knobs (unchanged
// where it does not engage) and fp8_row_tile_rows.
MoeConfig with_auto_choices(const MoeConfig& config, const MoeShape& shape);

// The minibatch rows a layer runs with: config.minibatch_size, or with kAutoMinibatch the rule
// above. `num_sms`: the GPU's SM count (positive).
int64_t minibatch_rows(const MoeConfig& config, const MoeShape& shape, int32_t num_sms);

// Bytes of the macrobatch ring per row: the x and d_out rows (H each) and the routed
// intermediates h, g, u, d_g, d_u (I each), all bf16.
int64_t macrobatch_ring_bytes_per_row(const MoeShape& shape);
// Rows of the ring for a schedule of `max_rows` worst-case rows: min(macrobatch_size, max_rows),
// or with kAutoMacrobatch the rule above (whole minibatches of minibatch_rows on `num_sms`
// SMs, never fewer than one).
int64_t macrobatch_ring_rows(const MoeConfig& config, const MoeShape& shape, int64_t max_rows,
                             int32_t num_sms);

// Checks the config against the shape it will run; the message names the knob and its value.
Status can_implement(const MoeConfig& config, const MoeShape& shape);
// The part of those checks that needs no sizes but the group's rank count: each knob's range and
// the knobs that exclude each other. The CPU reference runs with any knobs; callers that build
// no GPU layer (the Python package's CPU path) check them here, so that a config accepted on
// the CPU is one the GPU accepts too.
Status can_implement_knobs(const MoeConfig& config, int32_t num_ranks);

}  // namespace mok
