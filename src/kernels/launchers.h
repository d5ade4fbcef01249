// Host-callable launchers of the device kernels (compiled by nvcc, called from the plain C++
// host runtime). Pointers are device memory; nothing here synchronizes.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/expert_gemm_params.h"
#include "mok/dtype.h"
#include "mok/schedule.h"

namespace mok::kernels {

// Expert grouped GEMM (expert_gemm.cu): the tensor maps each form reads are listed at the top
// of expert_gemm.cu; unused maps may be any valid map.
// The persistent forward GEMM kernel (forward_gemms.cu): every gate/up and down tile of the
// forward in one launch of num_ctas CTAs; `epoch` = params.epoch must be advanced after it.
struct ForwardSetMaps {
  CUtensorMap x_rows;      // A of gate/up: the gathered x rows [rows, H], [128 x 64] boxes
  CUtensorMap w_gate;      // [E_loc, I, H], [128 x 64] boxes
  CUtensorMap w_up;        // likewise
  CUtensorMap hidden_in;   // A of down: h [rows, I], [128 x 64] boxes
  CUtensorMap w_down;      // [E_loc, H, I], [256 x 64] boxes
  CUtensorMap hidden_out;  // stores, [1, rows, N] maps with [128 rows x 64] boxes: h,
  CUtensorMap gate_out;    // bf16(g), bf16(u) (the forward context),
  CUtensorMap up_out;
  CUtensorMap y_out;  // and the expert output rows [rows, H]
};
// The routed experts' maps, and the shared expert's (x itself as its rows, one expert, Is; used
// when params.shared_m_tiles > 0).
struct ForwardGemmsMaps {
  ForwardSetMaps routed;
  ForwardSetMaps shared;
};
cudaError_t launch_forward_gemms(const ForwardGemmsMaps& maps, const ForwardGemmsParams& params,
                                 int num_ctas, cudaStream_t stream);

// The persistent backward kernel (backward_gemms.cu): every recompute, down dgrad, SwiGLU,
// gate/up dgrad and weight-gradient task of the routed experts' backward (and of the shared
// expert's, params.num_sets = 2) in one launch of num_ctas CTAs (one macrobatch; the rows
// gathered before it or by its spare warps, the d_x combine after it); params.epoch must be
// advanced after it. Maps of one expert set, as the standalone forms read and store them.
struct BackwardSetMaps {
  CUtensorMap x_rows;        // recompute A: x rows [rows, H], K-major [128 x 64] boxes
  CUtensorMap w_gate, w_up;  // recompute B: [E_loc, I, H], K-major [128 x 64] boxes
  CUtensorMap gate_out;      // stores: bf16(g) and bf16(u) [rows, I]
  CUtensorMap up_out;
  CUtensorMap d_out_rows;    // down dgrad A: d_out rows [rows, H], K-major
  CUtensorMap w_down_mn;     // down dgrad B: [E_loc, H, I] read MN-major
  CUtensorMap dh_out;        // store: dh_raw [rows, I] (the SwiGLU task turns it into h_w)
  CUtensorMap d_gate, d_up;  // gate/up dgrad A: [rows, I], K-major
  CUtensorMap w_gate_mn;     // gate/up dgrad B: [E_loc, I, H] read MN-major
  CUtensorMap w_up_mn;
  CUtensorMap dx_out;     // store: the dx rows [rows, H]
  CUtensorMap d_gate_mn;  // weight-gradient A operands [rows, M], MN-major
  CUtensorMap d_up_mn;
  CUtensorMap d_out_mn;
  CUtensorMap x_mn;  // weight-gradient B operands [rows, N], MN-major
  CUtensorMap h_w_mn;
  CUtensorMap d_w_gate;  // stores [E_loc, M, N]
  CUtensorMap d_w_up;
  CUtensorMap d_w_down;
  // The SwiGLU task's loads (swiglu_backward_task.cuh): g, u, dh_raw [rows, I] in [32 x 64]
  // boxes.
  CUtensorMap swiglu_gate, swiglu_up, swiglu_dh;
};
struct BackwardGemmsMaps {
  BackwardSetMaps sets[2];  // the routed experts', the shared expert's
};
cudaError_t launch_backward_gemms(const BackwardGemmsMaps& maps, const BackwardGemmsParams& params,
                                  int num_ctas, cudaStream_t stream);

struct ExpertGemmMaps {
  CUtensorMap a0, a1, b0, b1;
  // Outputs of the form (expert_gemm_params.h), 3-D maps with boxes of [128 rows x 64 columns]:
  // [1, rows, N] for the row forms, [E_loc, M, N] for kWeightGrad. out2/out3 only where the
  // form has them.
  CUtensorMap out, out2, out3;
};
cudaError_t launch_expert_gemm(ExpertGemmForm form, const ExpertGemmMaps& maps,
                               const ExpertGemmParams& params, int num_ctas, cudaStream_t stream);

// Local dispatch (dispatch_local.cu): schedule rows [row_begin, row_begin + max_rows), clipped to
// header.total_rows, get x[token of row_pair[row]] (padding rows get zeros), stored at row -
// row_begin of `rows` [max_rows, hidden] (a macrobatch's ring buffer; row_begin 0 and max_rows
// the schedule's max_rows: the whole schedule). `top_k` decodes the pair index.
cudaError_t launch_gather_rows(const ScheduleHeader* header, const int32_t* row_pair, const void* x,
                               int64_t hidden, int32_t top_k, void* rows, int64_t max_rows,
                               cudaStream_t stream, int64_t row_begin = 0);

// Advances an epoch word by one (the fused local dispatch's after each gate/up GEMM that used
// it, the persistent forward's after each launch): one thread, stream-ordered, CUDA-graph
// capturable.
cudaError_t launch_advance_epoch(unsigned long long* epoch, cudaStream_t stream);

// Combine (combine.cu): out[t] = bf16(shared[t] + sum_k fmaf(w[t,k], row(p))) with p = t*K + k,
// in k order, where row(p) is row index[p] of `expert_rows` for index[p] >= 0, row
// -index[p] - 2 of `local_rows` for index[p] <= -2 (the expert-parallel combine reads the pairs
// of this rank's own experts where the expert GEMM left them: launch_slot_index), and nothing
// for -1. `expert_rows` [rows, H] holds the expert outputs (schedule order, or the slots);
// `shared` may be null; `router_weights` null means weight 1 (the d_x sum: fmaf(1, y, acc) ==
// acc + y exactly).
cudaError_t launch_combine(const void* expert_rows, const int32_t* index, const void* shared,
                           const float* router_weights, int64_t num_tokens, int64_t hidden,
                           int32_t top_k, void* out, cudaStream_t stream,
                           const void* local_rows = nullptr);

// The routing all-gather (routing_exchange.cu): this rank's top_experts into block `rank` of
// every rank's routing_all [R, T, K], then one signal per peer pair. Advance `epoch` after it.
struct RoutingExchangeArgs {
  const void* top_experts;     // this rank's [T, K] (int32 or int64); null with 0 bytes: a barrier
  int64_t bytes_per_rank;      // T * K * element size (a multiple of 4)
  void* const* routing_peers;  // [R] device array: each rank's routing_all, as this GPU sees it
  const float* weights = nullptr;       // optional second payload: router weights [T, K]
  int64_t weight_bytes_per_rank = 0;    // T * K * 4
  void* const* weight_peers = nullptr;  // [R] each rank's weights_all [R, T, K]
  uint64_t* const* flag_peers;          // [R] device array: each rank's flags [R] (symmetric)
  int32_t rank, num_ranks;
  const unsigned long long* epoch;  // this exchange's epoch - 1, in this rank's device memory
  WaitContext wait;
};
cudaError_t launch_routing_exchange(const RoutingExchangeArgs& args, cudaStream_t stream);

// Pull dispatch (dispatch_ep.cu): received[e] = row recv_tokens[e] of source rank s's buffer for
// every receive entry e of another rank (entries of rank s: [recv_offsets[s],
// recv_offsets[s + 1])). This rank's own entries are not copied: launch_expand_received reads
// them from its own source.
struct PullRowsArgs {
  const ScheduleHeader* header;  // total_recv
  const int32_t* recv_offsets;   // [R + 1]
  const int32_t* recv_tokens;    // [R*T]
  void* const* source_peers;     // [R] device array: each rank's symmetric [T, H] source
  int64_t vectors_per_row;       // H / 8
  int32_t rank, num_ranks;
  void* received;  // [R*T, H] local
};
// The pull of a rank's schedule (its receive list) from `source_peers` into `received`.
inline PullRowsArgs pull_rows_args(const ScheduleView& view, void* const* source_peers,
                                   int64_t hidden, int32_t rank, int32_t num_ranks,
                                   void* received) {
  return {view.header, view.recv_offsets, view.recv_tokens, source_peers, hidden / 8,
          rank,        num_ranks,         received};
}
// The receive side's expansion (dispatch_ep.cu): schedule row r of [row_begin, row_begin +
// row_count) gets the row of receive entry e = row_recv[r], stored at r - row_begin of `rows`
// (zeros for e < 0, a padding row): from `received` for another rank's entry, from this rank's
// own `local_source` [T, H] (token recv_tokens[e]) for one of its own entries, which no
// dispatch copies (at R = 2 they are half of them).
struct ExpandReceivedArgs {
  const ScheduleHeader* header;  // total_rows
  const int32_t* row_recv;
  const int32_t* recv_offsets;  // [R + 1]
  const int32_t* recv_tokens;   // [R*T]
  const void* received;         // [R*T, H]: rows of the other ranks' entries
  const void* local_source;     // [T, H]: this rank's x or d_out
  int64_t vectors_per_row;      // H / 8
  int32_t rank;
  void* rows;
  int64_t row_begin, row_count;
};
inline ExpandReceivedArgs expand_received_args(const ScheduleView& view, const void* received,
                                               const void* local_source, int64_t hidden,
                                               int32_t rank, void* rows, int64_t row_begin,
                                               int64_t row_count) {
  return {view.header, view.row_recv, view.recv_offsets, view.recv_tokens,
          received,    local_source,  hidden / 8,        rank,
          rows,        row_begin,     row_count};
}
cudaError_t launch_expand_received(const ExpandReceivedArgs& args, cudaStream_t stream);
// How the communication kernels move rows: warp copies (16-byte loads and stores, 16 in flight
// per lane) or the bulk-copy engine (one thread per CTA, a 4-row shared-memory ring;
// bulk_rows.cuh). Same bytes land either way; `wait` times the bulk loads.
enum class RowCopy : int32_t { kWarp = 0, kBulk = 1 };
// Threads per CTA of the warp-copy kernels that cross NVLink. A row copy is bound by the bytes
// in flight (the link's latency is ~1-2 us), and the target caps the SMs, not the threads: 512
// threads of ~110 registers fit one SM and keep twice the loads of 256 in flight.
// `threads_per_cta` below: a multiple of 32 in [32, kMaxNvlinkCopyThreads] (unused by bulk copies).
constexpr int kNvlinkCopyThreads = 512;
constexpr int kMaxNvlinkCopyThreads = 512;
inline bool valid_copy_threads(int threads_per_cta) {
  return threads_per_cta >= 32 && threads_per_cta <= kMaxNvlinkCopyThreads &&
         threads_per_cta % 32 == 0;
}
cudaError_t launch_pull_rows(const PullRowsArgs& args, RowCopy copy, int num_ctas,
                             const WaitContext& wait, cudaStream_t stream,
                             int threads_per_cta = kNvlinkCopyThreads);
// Push dispatch (dispatch_ep.cu), the alternative to the pull that `mok comm-bench` measures
// beside it: the source rank writes each routed row into every other destination's receive
// buffer, at the entry the destination's receive list gives it, so the destination finds the
// same rows at the same entries as after a pull (its own entries: launch_expand_received).
// launch_send_entries computes those entries on the GPU (build_send_entries_host's contract) from
// the gathered routing; launch_push_dispatch writes the rows, then its last CTA signals every rank;
// the destination runs launch_wait_for_peers on the dispatch flags before it reads, and advances
// `epoch` after.
cudaError_t launch_send_entries(const ScheduleParams& params, const void* top_experts_all,
                                DType expert_dtype, int32_t* send_entry, cudaStream_t stream);
struct PushDispatchArgs {
  const int32_t* send_entry;    // [R*T] this rank's send entries
  const void* source;           // this rank's [T, H] rows (x or d_out), local
  void* const* received_peers;  // [R] device array: each rank's symmetric [R*T, H] receive buffer
  int64_t vectors_per_row;      // H / 8
  int32_t num_tokens;           // T
  int32_t rank, num_ranks;
  uint64_t* const* flag_peers;      // [R] device array: each rank's dispatch flags
  unsigned long long* done;         // local counter, zeroed once (epochs)
  const unsigned long long* epoch;  // this call's epoch - 1
};
cudaError_t launch_push_dispatch(const PushDispatchArgs& args, int num_ctas, cudaStream_t stream,
                                 int threads_per_cta = kNvlinkCopyThreads);
// A contiguous copy of `bytes` (a multiple of 16) with num_ctas CTAs: the ceiling the pull is
// measured against (source may be a peer pointer).
cudaError_t launch_copy_contiguous(const void* source, void* destination, int64_t bytes,
                                   int num_ctas, cudaStream_t stream,
                                   int threads_per_cta = kNvlinkCopyThreads);

// Push combine (combine_ep.cu): row r of `rows` (schedule order) goes to slot pair % (T*K) of
// rank pair / (T*K)'s symmetric slot buffer, pair = row_pair[r], for every pair of another rank
// (this rank's own pairs stay in `rows`, where its combine reads them); then the launch's last
// CTA signals every rank. Advance `epoch` after the matching launch_wait_for_peers.
struct PushRowsArgs {
  const ScheduleHeader* header;  // total_rows
  const int32_t* row_pair;
  const void* rows;  // [rows, H] local
  int64_t vectors_per_row;
  int32_t pairs_per_rank;       // T * K (0 with no tokens: the launch only signals)
  void* const* slot_peers;      // [R] device array: each rank's symmetric [T*K, H] slots
  uint64_t* const* flag_peers;  // [R] device array: each rank's flags of this barrier
  int32_t rank, num_ranks;
  unsigned long long* done;         // local counter, zeroed once (epochs)
  const unsigned long long* epoch;  // this call's epoch - 1
};
// The push of a rank's `rows` (schedule order) into the slots of their source ranks; the
// barrier's counters are this rank's [0] epoch and [1] done count.
inline PushRowsArgs push_rows_args(const ScheduleView& view, const void* rows, int64_t hidden,
                                   int32_t pairs_per_rank, void* const* slot_peers,
                                   uint64_t* const* flag_peers, int32_t rank, int32_t num_ranks,
                                   unsigned long long* counters) {
  return {view.header, view.row_pair, rows,      hidden / 8,   pairs_per_rank, slot_peers,
          flag_peers,  rank,          num_ranks, counters + 1, counters};
}
cudaError_t launch_push_rows(const PushRowsArgs& args, RowCopy copy, int num_ctas,
                             const WaitContext& wait, cudaStream_t stream,
                             int threads_per_cta = kNvlinkCopyThreads);
// Waits until every rank signaled this rank's flags with this call's epoch (then the slots
// pushed to this rank are complete).
cudaError_t launch_wait_for_peers(const uint64_t* own_flags, int32_t num_ranks,
                                  const unsigned long long* epoch, const WaitContext& wait,
                                  cudaStream_t stream);
// The expert-parallel combine's index (launch_combine over the slot buffer [T*K, H], with this
// rank's expert rows as `local_rows`): slot_index[i] = -(own_pair_row[i] + 2) for a pair routed
// to one of this rank's experts (own_pair_row = the schedule's pair_row of this rank's pairs:
// the row the push left in place), i (its slot) for one routed to another rank, -1 for one
// routed nowhere (top_experts[i] outside [0, num_experts)).
cudaError_t launch_slot_index(const void* top_experts, DType expert_dtype, int64_t count,
                              int64_t num_experts, const int32_t* own_pair_row, int32_t* slot_index,
                              cudaStream_t stream);

// The expert-parallel baseline's kernels (ep_baseline.cu). Bucketing of (token, k) pairs by
// destination rank (expert / experts_per_rank; ids outside [0, E) go nowhere): with perm null it
// writes counts[r]; with perm set (and counts from the first call) it writes perm (pairs in
// bucket order, stable) and pos[pair] = its place (pos must be -1-filled before).
cudaError_t launch_bucket_pairs(const void* top_experts, DType expert_dtype, int32_t pairs,
                                int32_t experts_per_rank, int32_t num_ranks, int32_t* counts,
                                int32_t* perm, int32_t* pos, cudaStream_t stream);
// destination[j] = source row perm[j] / divisor, for j < count.
cudaError_t launch_gather_pair_rows(const int32_t* perm, int32_t count, int32_t divisor,
                                    const void* source, int64_t hidden, void* destination,
                                    cudaStream_t stream);
// local_expert[j] = top_experts[perm[j]] % experts_per_rank, weight[j] = weights[perm[j]].
cudaError_t launch_gather_pair_meta(const int32_t* perm, int32_t count, const void* top_experts,
                                    DType expert_dtype, const float* weights,
                                    int32_t experts_per_rank, int32_t* local_expert, float* weight,
                                    cudaStream_t stream);
// inner_top[j] = received_expert[j] below `received`, else -1, for j < capacity.
cudaError_t launch_inner_routing(const int32_t* received_expert, int32_t received, int32_t capacity,
                                 int32_t* inner_top, cudaStream_t stream);
// out[p] = values[pos[p]] where pos[p] >= 0, else 0.
cudaError_t launch_scatter_by_pair(const int32_t* pos, int32_t pairs, const float* values,
                                   float* out, cudaStream_t stream);

// Unfused baseline (baseline.cu): SwiGLU over rows [0, num_rows) of [rows, I] buffers. (Its
// unpermute is launch_combine over its own permutation's pair_row.)
cudaError_t launch_baseline_swiglu(int64_t num_rows, const void* gate, const void* up,
                                   int64_t intermediate, float limit, void* hidden,
                                   cudaStream_t stream);

// SwiGLU backward (swiglu_backward.cu), one warp per row, over rows [0, header->total_rows) (or
// [0, num_rows) when header is null): from bf16 g, u and dh_raw rows, d_g, d_up and
// h_w = bf16(w h) rows (weighted_hidden may alias dh_raw: each element is read, then written, by
// one thread), and d_router_weights[row_pair[row]] = <dh_raw, h> of the row (lanes in fixed
// order, then a fixed xor tree). Row r's pair is row_pair[r] (identity when null; -1 = padding,
// weight 0, nothing written to d_router_weights); router_weights null = weight 1;
// d_router_weights may be null (the shared expert). Expert parallel: with
// d_router_weights_peers set, pair p's gradient goes to d_router_weights_peers[p / pairs_per_rank]
// [p % pairs_per_rank] (its source rank's buffer) instead.
// Macrobatch: only rows [row_begin, row_begin + row_count) run, and the row buffers (gate, up,
// dh_raw, d_gate, d_up, weighted_hidden) hold them at row - row_begin (row_pair stays indexed by
// the schedule row).
cudaError_t launch_swiglu_backward(const ScheduleHeader* header, int64_t num_rows, const void* gate,
                                   const void* up, const void* dh_raw, const int32_t* row_pair,
                                   const float* router_weights, int64_t intermediate, float limit,
                                   void* d_gate, void* d_up, void* weighted_hidden,
                                   float* d_router_weights, float* const* d_router_weights_peers,
                                   int32_t pairs_per_rank, cudaStream_t stream,
                                   int64_t row_begin = 0, int64_t row_count = INT64_MAX);

}  // namespace mok::kernels
