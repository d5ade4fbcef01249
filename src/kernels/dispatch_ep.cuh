// Pull dispatch as device functions (DESIGN.md §2.2): the standalone kernels of dispatch_ep.cu
// call them with the whole grid; a persistent kernel calls them from its communication warps or
// CTAs with its own indices. Every call moves a disjoint share of the schedule's receive list:
// entry e (source rank s, token t) lands at row e of `received`, read from s's symmetric buffer.
//
//   pull_rows_warp      one warp per entry, warp `warp` of `num_warps` takes entries
//                       warp, warp + num_warps, ...; 16-byte loads, kNvlinkLoadsInFlight per lane
//   pull_rows_bulk_cta  one thread of a CTA streams entries cta, cta + num_ctas, ... through a
//                       shared-memory ring with the bulk-copy engine (bulk_rows.cuh)
//
//   push_dispatch_warp  the push alternative, on the source rank: item i = (destination
//                       (rank + 1 + i / T) % R, token i % T), one warp per item with a send
//                       entry; the row lands at that entry of the destination's receive buffer
//                       (same place as a pull). Destination-major from the next rank on: the
//                       warps start on rows that cross NVLink and copy their own rank's last
//                       (token-major with R = 2 gave every other warp only local rows).
//
// The entries of source rank s are [recv_offsets[s], recv_offsets[s + 1]); a caller finds s by a
// walk over the R + 1 offsets (entries only grow within one call).
#pragma once

#include <stdint.h>

#include "kernels/bulk_rows.cuh"
#include "kernels/launchers.h"
#include "kernels/row_copy.cuh"

namespace mok::kernels {

__device__ __forceinline__ void pull_rows_warp(const PullRowsArgs& args, int64_t warp,
                                               int64_t num_warps) {
  const int32_t total = args.header->total_recv;
  int32_t source_rank = 0;
  for (int64_t entry = warp; entry < total; entry += num_warps) {
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
  const int32_t total = args.header->total_recv;
  const uint32_t row_bytes = static_cast<uint32_t>(args.vectors_per_row * 16);
  int32_t source_rank = 0;
  move_rows_bulk(wait, smem, row_bytes, [&](int64_t i, const void** source, void** destination) {
    const int64_t entry = cta + i * num_ctas;
    if (entry >= total) return false;
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
  const int64_t items = static_cast<int64_t>(args.num_tokens) * args.num_ranks;
  for (int64_t item = warp; item < items; item += num_warps) {
    const int32_t token = static_cast<int32_t>(item % args.num_tokens);
    const int32_t destination =
        static_cast<int32_t>((args.rank + 1 + item / args.num_tokens) % args.num_ranks);
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
