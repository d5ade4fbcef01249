// Pull dispatch as device functions (DESIGN.md §2.2): the standalone kernels of dispatch_ep.cu
// call them with the whole grid; a persistent kernel calls them from its communication warps or
// CTAs with its own indices. Every call moves a disjoint share of the schedule's receive list:
// entry e (source rank s, token t) lands at row e of `received`, read from s's symmetric buffer.
//
//   pull_rows_warp      one warp per entry of another rank, warp `warp` of `num_warps` takes
//                       the warp-th, (warp + num_warps)-th, ... of them; 16-byte loads,
//                       kNvlinkLoadsInFlight per lane
//   pull_rows_bulk_cta  one thread of a CTA streams the cta-th, (cta + num_ctas)-th, ... through
//                       a shared-memory ring with the bulk-copy engine (bulk_rows.cuh)
//
//   push_dispatch_warp  the push alternative, on the source rank: item i = (token i / (R - 1),
//                       destination (rank + 1 + i % (R - 1)) % R), one warp per item with a
//                       send entry; the row lands at that entry of the destination's receive
//                       buffer (same place as a pull). Token-major over the other ranks.
//
// The entries of source rank s are [recv_offsets[s], recv_offsets[s + 1]); a caller finds s by a
// walk over the R + 1 offsets (entries only grow within one call). No copy moves this rank's
// own rows: the pulls walk the other ranks' entries only (index j past this rank's entries is
// shifted over them), the push skips its own destination, and launch_expand_received reads
// those rows from the local source.
#pragma once

#include <stdint.h>

#include "kernels/comm/bulk_rows.cuh"
#include "kernels/comm/launch.h"
#include "kernels/comm/row_copy.cuh"

namespace mok::kernels {

// Entries of the other ranks: [0, total - own_count), the j-th at entry j, or j + own_count from
// this rank's first own entry on.
struct RemoteEntries {
  int32_t count, own_begin, own_count;
  __device__ __forceinline__ int64_t entry(int64_t j) const {
    return j < own_begin ? j : j + own_count;
  }
};
__device__ __forceinline__ RemoteEntries remote_entries(const PullRowsArgs& args) {
  const int32_t own_begin = args.recv_offsets[args.rank];
  const int32_t own_count = args.recv_offsets[args.rank + 1] - own_begin;
  return {args.header->total_recv - own_count, own_begin, own_count};
}

__device__ __forceinline__ void pull_rows_warp(const PullRowsArgs& args, int64_t warp,
                                               int64_t num_warps) {
  const RemoteEntries remote = remote_entries(args);
  int32_t source_rank = 0;
  for (int64_t j = warp; j < remote.count; j += num_warps) {
    const int64_t entry = remote.entry(j);
    while (source_rank + 1 < args.num_ranks && entry >= args.recv_offsets[source_rank + 1])
      ++source_rank;
    const int32_t token = args.recv_tokens[entry];
    const uint4* src = static_cast<const uint4*>(args.source_peers[source_rank]) +
                       static_cast<int64_t>(token) * args.vectors_per_row;
    copy_row_warp<kNvlinkLoadsInFlight>(
        static_cast<uint4*>(args.received) + entry * args.vectors_per_row, src,
        args.vectors_per_row);
  }
}

// Run by one thread; `smem` holds bulk_rows_smem_bytes(row bytes), 16-byte aligned.
__device__ __forceinline__ void pull_rows_bulk_cta(const PullRowsArgs& args,
                                                   const WaitContext& wait, char* smem, int64_t cta,
                                                   int64_t num_ctas) {
  const RemoteEntries remote = remote_entries(args);
  const uint32_t row_bytes = static_cast<uint32_t>(args.vectors_per_row * 16);
  int32_t source_rank = 0;
  move_rows_bulk(wait, smem, row_bytes, [&](int64_t i, const void** source, void** destination) {
    const int64_t j = cta + i * num_ctas;
    if (j >= remote.count) return false;
    const int64_t entry = remote.entry(j);
    while (source_rank + 1 < args.num_ranks && entry >= args.recv_offsets[source_rank + 1])
      ++source_rank;
    *source = static_cast<const char*>(args.source_peers[source_rank]) +
              static_cast<int64_t>(args.recv_tokens[entry]) * row_bytes;
    *destination = static_cast<char*>(args.received) + entry * row_bytes;
    return true;
  });
}

__device__ __forceinline__ void push_dispatch_warp(const PushDispatchArgs& args, int64_t warp,
                                                   int64_t num_warps) {
  const int32_t others = args.num_ranks - 1;
  const int64_t items = static_cast<int64_t>(args.num_tokens) * others;
  for (int64_t item = warp; item < items; item += num_warps) {
    const int32_t token = static_cast<int32_t>(item / others);
    const int32_t destination =
        (args.rank + 1 + static_cast<int32_t>(item % others)) % args.num_ranks;
    const int32_t entry =
        args.send_entry[static_cast<int64_t>(destination) * args.num_tokens + token];
    if (entry < 0) continue;
    copy_row_warp<kNvlinkLoadsInFlight>(
        static_cast<uint4*>(args.received_peers[destination]) + entry * args.vectors_per_row,
        static_cast<const uint4*>(args.source) + token * args.vectors_per_row,
        args.vectors_per_row);
  }
}

}  // namespace mok::kernels
