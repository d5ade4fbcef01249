// Parameters of the expert grouped GEMMs, shared by the host launcher and the kernels (plain
// data: included by host C++ too). Outputs ("out", "out2", "out3" below) are TMA tensor maps
// (ExpertGemmMaps in gemm/launch.h), written through the staging-tile epilogue (epilogue.cuh).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/common/wait_types.h"
#include "kernels/gemm/gemm_ablation.h"
#include "kernels/gemm/l2_placement.h"
#include "kernels/gemm/lockstep.h"
#include "kernels/gemm/tile_tickets.h"
#include "mok/schedule.h"
#include "mok/task_trace.h"

namespace mok::kernels {

// Which GEMM of the layer: its operand loads, its tiles and its epilogue.
// "rows" are the expert-grouped rows of the schedule (128-row tiles, one expert each).
enum class ExpertGemmForm : int32_t {
  // Forward gate/up: A = rows [rows, H]; B = gate and up weights [E_loc, I, H]; a tile is 128
  // rows x (128 gate + 128 up) columns; out = h = swiglu(g, u) [rows, I]; it also keeps bf16(g)
  // in out2 and bf16(u) in out3 (the forward context of the backward).
  kGateUpSwiGLU = 0,
  // Forward down: A = h [rows, I]; B = Wd [E_loc, H, I]; y = bf16 rows in schedule order to
  // out [rows, H]; the combine reads each pair's row through the schedule's pair_row.
  kDownStore = 1,
  // Backward recompute of gate/up: like kGateUpSwiGLU but stores bf16(g) to out and bf16(u) to
  // out2 (both [rows, I], before the clamp).
  kGateUpStore = 2,
  // Backward dgrad of down: dh_raw = bf16(d_out rows Wd) [rows, I] to out. A = d_out rows
  // [rows, H] (K = H); B = Wd [E_loc, H, I] read MN-major (K = H rows, N = I contiguous). The
  // SwiGLU backward runs after it as its own memory-bound kernel (swiglu_backward.cu), or in
  // the GEMM's epilogue (kDownGradSwiGLU).
  kDownGrad = 3,
  // Backward dgrad of gate/up: A = [d_g | d_u] (two maps, K = 2I); B = [Wg ; Wu] read MN-major
  // (K = I rows of each, N = H contiguous); dx rows stored in schedule order like kDownStore.
  kGateUpGradStore = 4,
  // Weight gradient of one expert per tile: out[e] [M, N] = A^T B over the expert's rows
  // (K = rows in schedule order, one CTA per output tile, fixed order): A = [rows, M] and
  // B = [rows, N], both MN-major. dWg = d_g^T x, dWu = d_u^T x, dWd = d_out^T h_w.
  kWeightGrad = 5,
  // Backward dgrad of down with the SwiGLU backward in its epilogue (dgated_epilogue.cuh;
  // MoeConfig::swiglu_backward_in_dgrad): kDownGrad's mainloop (a0, b0); the epilogue reads g
  // (a1) and u (b1) [rows, I] by TMA in [128 x 32] subtiles and writes d_g (out), d_u (out2) and
  // h_w (out3) [rows, I], and each row's router-weight gradient over the tile's 256 columns
  // into params.dgated.router_grad_partials (summed by launch_router_weight_grad_sum). dh_raw is
  // never written.
  kDownGradSwiGLU = 6,
};

// kDownGradSwiGLU's epilogue: the rows' router weights, and where each row's share of
// d_router_weights over a column tile goes: partials[n_tile * partial_rows + row - out_row_base]
// (routed rows only; the sum over column tiles, in column order, is
// launch_router_weight_grad_sum's).
struct DgatedArgs {
  const float* router_weights = nullptr;  // per pair; null = weight 1 (the shared expert)
  float* router_grad_partials = nullptr;  // [ceil(I / 256)][partial_rows]; null = not wanted
  int64_t partial_rows = 0;
};

// The local dispatch fused into the forward gate/up GEMM (dispatch_local.cuh): the producer
// warpgroup's spare warps copy routed x rows into the row buffer the GEMM reads, claiming rows
// with a ticket, and count each 128-row tile's rows; the TMA thread waits for a tile's count.
// Counters carry the launch's epoch (no reset pass): ticket = epoch << 32 | next row,
// tile count = epoch * kTileCountStride + rows gathered.
struct FusedGather {
  const __nv_bfloat16* x;              // [T, H]; null = no fused gather
  __nv_bfloat16* rows;                 // the A operand of the GEMM: row r at r - row_begin
  int32_t hidden;                      // H
  int32_t top_k;                       // K: pair index / K = token
  unsigned long long* ticket;          // one word
  unsigned long long* tile_rows_done;  // [max_tiles]
  unsigned long long* epoch;           // this launch's epoch - 1 (advanced after each launch)
  int64_t row_begin, row_end;          // the schedule rows to gather (a macrobatch's window)
  // Expert parallel, the dispatch inside the GEMM (MoeConfig::ep_dispatch_in_gemm): each row is
  // read from its source rank's published x through `peer_x` (one pointer per rank), found
  // through this rank's schedule: row_recv[row] = receive entry e, e in [recv_offsets[s],
  // recv_offsets[s + 1]) comes from rank s, token recv_tokens[e]. Null: x is local, row_pair.
  const __nv_bfloat16* const* peer_x;
  const int32_t* row_recv;
  const int32_t* recv_offsets;  // [num_ranks + 1]
  const int32_t* recv_tokens;
  int32_t num_ranks;
};

// Expert parallel, the push combine inside the GEMM that makes the rows (MoeConfig::
// ep_dispatch_in_gemm; the forward's down GEMM, the backward's gate/up dgrad): the epilogue
// also writes each output row of another rank's pair
// (row_pair[row] = source * pairs_per_rank + slot) from the staging tile into slot `slot` of
// that rank's symmetric [T*K, H] slot buffer. This rank's own pairs stay where the TMA store
// puts them (its combine reads them in place). slot_peers null: no push.
struct RowPush {
  void* const* slot_peers;  // [R] device array
  const int32_t* row_pair;
  int32_t pairs_per_rank;  // T * K
  int32_t rank;
};

// A macrobatch of a launch (kernels/macrobatch.h). Row-tile forms run the schedule's tiles
// [tile_begin, min(tile_end, num_tiles)); their A rows live in a ring buffer at row -
// ring_row_base, and so does the output unless it is a full-size one (out_row_base 0: the
// expert output or dx rows). kWeightGrad reduces each expert's rows of macrobatch `index`
// (weight_grad_slice) from ring rows, continuing from and leaving fp32 accumulators in the
// partial slots. The defaults are one macrobatch over everything.
struct MacrobatchParams {
  int32_t tile_begin = 0;
  int32_t tile_end = 0x7fffffff;
  int32_t ring_row_base = 0;
  int32_t out_row_base = 0;
  int32_t index = 0;
  int64_t rows = 0;                        // M; 0 = one pass (no slicing, no partials)
  float* partial[2] = {nullptr, nullptr};  // kWeightGrad: [n_tiles of M x N][256 threads][128]
};

struct ExpertGemmParams {
  const ScheduleHeader* header;   // num_tiles: the 128-row tiles the schedule filled
  const int32_t* tile_expert;     // local expert of each 128-row tile
  const int32_t* row_pair;        // pair index of each row, -1 = padding
  const int32_t* expert_offsets;  // segment starts (kWeightGrad)
  const int32_t* expert_counts;   // routed rows of each segment (kWeightGrad with skip_padding)
  int32_t num_experts;            // E_loc (kWeightGrad)
  // MoeConfig::skip_padding_rows, for the standalone expert GEMM kernel (expert_gemm.cu): a
  // weight gradient's K stops at its expert's routed rows rounded up to BLOCK_K (skip_padding),
  // and, where the experts average few rows (half_row_tiles), the forward GEMMs run an expert's
  // last row tile at 64 rows when it holds at most 64 routed rows. The persistent kernels run
  // every tile whole. Same bits either way.
  int32_t skip_padding;
  int32_t half_row_tiles;
  // MoeConfig::gemm_dgrad_half_row_tiles: the same 64-row tiles in the dgrads (B MN-major),
  // where half_row_tiles holds.
  int32_t dgrad_half_row_tiles;
  // MoeConfig::gemm_tile_group: the row-tile forms walk their tiles (or pairs, or 256-row units)
  // this many row tiles at a time, swept n-major (tile_walk.h, wide_tile_gemm.cu). Same bits for
  // any group.
  int32_t tile_group;
  // MoeConfig::gemm_expert_aligned_groups: those groups start where an expert does, within
  // kGroupAlignReach row tiles of their place (tile_walk.h; the row-tile forms without pairs).
  int32_t expert_aligned_groups;
  // MoeConfig::gemm_l2_placement (l2_placement.h): each L2 partition's SMs on their share of the
  // row tiles (the row-tile forms without CTA pairs); slot_of_sm null: the block-index walk.
  L2Placement l2;
  // MoeConfig::weight_grad_pingpong: kWeightGrad in weight_grad_pingpong.cu (one macrobatch, no
  // CTA pairs; expert_gemm.cu's form otherwise).
  int32_t weight_grad_pingpong;
  // MoeConfig::gemm_four_stages: the row-tile forms on a ring of four stages (a staging tile of
  // 128 columns, stored in two rounds), without CTA pairs or the push (the launcher's choice;
  // expert_gemm.cu). Same bits either way.
  int32_t four_stages;
  // MoeConfig::gemm_lockstep_k_blocks: the row-tile forms' CTAs kept in step (lockstep.h);
  // ticks null: off.
  GemmLockstep lockstep;
  // MoeConfig::gemm_tiles_by_ticket: the row-tile forms' units by ticket (tile_tickets.h; not
  // in CTA pairs or under the L2 placement); counter null: the static walk.
  GemmTickets tickets;
  // kGateUpSwiGLU: 1 = g and u are not stored, h alone (ForwardArgs::keep_context off: no
  // backward reads them).
  int32_t skip_context_stores;
  int32_t m_extent;    // output rows M (kWeightGrad)
  int32_t n_extent;    // output columns N
  int32_t k_extent;    // reduction length (row-tile forms; kGateUpGradStore: I of one half)
  float swiglu_limit;  // infinity = no clamp
  FusedGather gather;  // kGateUpSwiGLU only: the fused local dispatch (gather.x null = off)
  RowPush push;       // kDownStore / kGateUpGradStore of the routed experts (slot_peers null = off)
  DgatedArgs dgated;  // kDownGradSwiGLU only
  WaitContext wait;
  MacrobatchParams macrobatch;
  GemmAblation ablation;  // kNone but in a measurement (gemm_ablation.h)
};

// Where a persistent kernel records its task trace (task_trace.cuh; MoeConfig::trace_tasks).
struct TaskTraceArgs {
  TaskTraceEvent* events = nullptr;  // [capacity], by ticket; null = not tracing
  int64_t capacity = 0;
};

// The persistent forward GEMM kernel (forward_gemms.cu): both GEMMs' parameters and the state
// of its task order (task_order.h, GEMM tiles only). Counters carry the launch's epoch, like
// the fused dispatch's: ticket = epoch << 32 | next ticket, gate_up_done[m] = epoch *
// kGateUpDoneStride + gate/up tiles of row tile m finished (TMA stores complete).
struct ForwardGemmsParams {
  ExpertGemmParams gate_up;  // form kGateUpSwiGLU (its gather: the fused local dispatch)
  ExpertGemmParams down;     // form kDownStore
  int32_t minibatch_tiles;   // MoeConfig::minibatch_size / 128
  unsigned long long* ticket;
  unsigned long long* epoch;         // this launch's epoch - 1 (advanced after each launch)
  unsigned long long* gate_up_done;  // [max_tiles]
  TaskTraceArgs trace;
  // The shared expert's tiles in the same ticket stream (task_order.h), on its own fixed
  // schedule (every token, one expert): shared_m_tiles = 0 when there is none in this launch.
  int32_t shared_m_tiles;
  ExpertGemmParams shared_gate_up;
  ExpertGemmParams shared_down;
  unsigned long long* shared_gate_up_done;  // [shared_m_tiles]
};
constexpr unsigned long long kGateUpDoneStride = 1ull << 20;  // > gate/up tiles per row tile

// The SwiGLU backward of a row (swiglu_backward.cuh): the standalone pass and the persistent
// backward's SwiGLU task read and write through the same arguments.
struct SwigluBackwardArgs {
  const uint4* gate;                     // bf16 g rows (the forward context or the recompute)
  const uint4* up;                       // bf16 u rows
  const uint4* dh_raw;                   // bf16 rows of d_out Wd
  const int32_t* row_pair;               // pair of each schedule row (-1 padding); null = identity
  const float* router_weights;           // per pair; null = weight 1
  int64_t vectors_per_row;               // I / 8
  float limit;                           // the SwiGLU clamp (infinity = none)
  uint4* d_gate;                         // bf16 rows out
  uint4* d_up;                           // bf16 rows out
  uint4* weighted_hidden;                // bf16 h_w rows out (may alias dh_raw: read first)
  float* d_router_weights;               // per pair, or null (the shared expert)
  float* const* d_router_weights_peers;  // expert parallel: each source rank's buffer, or null
  int32_t pairs_per_rank;
  int64_t row_begin;  // the row buffers hold schedule row r at r - row_begin (a macrobatch)
};

// The arguments of one SwiGLU backward over rows of `intermediate` columns (the standalone pass,
// and the FP8 pass that quantizes its outputs, whose bf16 outputs are then null).
inline SwigluBackwardArgs make_swiglu_backward_args(
    const void* gate, const void* up, const void* dh_raw, const int32_t* row_pair,
    const float* router_weights, int64_t intermediate, float limit, void* d_gate, void* d_up,
    void* weighted_hidden, float* d_router_weights, float* const* d_router_weights_peers,
    int32_t pairs_per_rank, int64_t row_begin) {
  SwigluBackwardArgs args;
  args.gate = static_cast<const uint4*>(gate);
  args.up = static_cast<const uint4*>(up);
  args.dh_raw = static_cast<const uint4*>(dh_raw);
  args.row_pair = row_pair;
  args.router_weights = router_weights;
  args.vectors_per_row = intermediate / 8;
  args.limit = limit;
  args.d_gate = static_cast<uint4*>(d_gate);
  args.d_up = static_cast<uint4*>(d_up);
  args.weighted_hidden = static_cast<uint4*>(weighted_hidden);
  args.d_router_weights = d_router_weights;
  args.d_router_weights_peers = d_router_weights_peers;
  args.pairs_per_rank = pairs_per_rank;
  args.row_begin = row_begin;
  return args;
}

// The persistent backward kernel (backward_gemms.cu), per expert set (the routed experts, the
// shared expert): the parameters of each GEMM form it runs, the SwiGLU task's arguments and the
// set's dependency counters (backward_task_order.h). Counters carry the launch's epoch like the
// forward's: value = epoch * kGateUpDoneStride + tasks done.
struct BackwardSetParams {
  ExpertGemmParams recompute;      // kGateUpStore: g and u again (without the forward context)
  ExpertGemmParams down_dgrad;     // kDownGrad: dh_raw
  ExpertGemmParams gate_up_dgrad;  // kGateUpGradStore: the dx rows
  ExpertGemmParams wgrad_gate_up;  // kWeightGrad of gate and up: M = I, N = H
  ExpertGemmParams wgrad_down;     // kWeightGrad of down: M = H, N = I
  SwigluBackwardArgs swiglu;
  // The rows(m) tasks as the forward's fused local dispatch (dispatch_local.cuh): the spare
  // producer warps gather the d_out rows (and the x rows when recomputing) while the GEMM tiles
  // run, and a tile's loads wait for its rows; `x` null = gathered before the launch (or, for
  // the shared expert, nothing to gather: its rows are the tokens).
  FusedGather d_out_gather;
  FusedGather x_gather;
  int32_t recompute_rows;              // 1: no forward context, the recompute tasks run
  int32_t minibatch_tiles;             // MoeConfig::minibatch_size / 128 (shared: all its tiles)
  unsigned long long* row_gemms_done;  // [row tiles]: recompute + down dgrad tiles finished
  unsigned long long* swiglu_done;     // [row tiles]: the row tile's SwiGLU task finished
  unsigned long long* expert_ready;    // [experts]: SwiGLU tasks of the expert's row tiles
};
struct BackwardGemmsParams {
  BackwardSetParams sets[2];  // the routed experts', the shared expert's
  int32_t num_sets;           // 1, or 2 with the shared expert
  unsigned long long* ticket;
  unsigned long long* epoch;  // this launch's epoch - 1 (advanced after each launch)
  TaskTraceArgs trace;
};

constexpr int tile_n_columns(ExpertGemmForm form) {  // kDownGradSwiGLU: 256, as kDownGrad
  return form == ExpertGemmForm::kGateUpSwiGLU || form == ExpertGemmForm::kGateUpStore ? 128 : 256;
}

}  // namespace mok::kernels
