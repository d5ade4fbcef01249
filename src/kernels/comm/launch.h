// Host-callable launchers of the expert-parallel data movement: the routing all-gather, pull and
// push dispatch, the push combine, the peer barrier and the combine's slot index
// (routing_exchange.cu, dispatch_ep.cu, combine_ep.cu). Pointers are device memory (peer
// pointers where named so); nothing here synchronizes.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/wait_types.h"
#include "mok/dtype.h"
#include "mok/schedule.h"

namespace mok::kernels {

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
  // 1: copy nothing, only count and signal (the rows were pushed by the down GEMM's epilogue,
  // RowPush, in launches before this one on the stream).
  int32_t signal_only = 0;
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

}  // namespace mok::kernels
