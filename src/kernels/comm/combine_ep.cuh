// Push combine as device functions (DESIGN.md §2.4): the standalone kernels of combine_ep.cu
// call them with the whole grid; a persistent kernel calls them from its communication warps or
// CTAs with its own indices and counts.
//
//   push_epoch           this call's epoch (the counter's value + 1; the caller advances it after)
//   push_rows_warp       one warp per expert row: warp `warp` of `num_warps` takes rows warp,
//                        warp + num_warps, ...; row r with pair p = source * T*K + slot goes to
//                        slot `slot` of rank `source` (one writer per slot); rows of this
//                        rank's own pairs stay (the combine reads them in place)
//   push_rows_bulk_cta   one thread of a CTA streams rows cta, cta + num_ctas, ... with the
//                        bulk-copy engine (bulk_rows.cuh)
//   count_push_done      one thread per pushing CTA, after all of its CTA's stores: the last of
//                        `num_ctas` to count itself signals every rank (peer_barrier.cuh)
//   wait_for_all_pushes  the source side: waits for every rank's signal before reading its slots
//
// The done counter holds epoch * kDoneStride + CTAs done (peer_barrier.cuh).
#pragma once

#include <stdint.h>

#include "kernels/comm/bulk_rows.cuh"
#include "kernels/comm/launch.h"
#include "kernels/comm/peer_barrier.cuh"
#include "kernels/comm/row_copy.cuh"

namespace mok::kernels {

__device__ __forceinline__ uint64_t push_epoch(const unsigned long long* epoch_word) {
  return *reinterpret_cast<const volatile unsigned long long*>(epoch_word) + 1;
}

__device__ __forceinline__ void push_rows_warp(const PushRowsArgs& args, int64_t warp,
                                               int64_t num_warps) {
  const int32_t total_rows = args.header->total_rows;
  for (int64_t row = warp; row < total_rows; row += num_warps) {
    const int32_t pair = args.row_pair[row];
    if (pair < 0) continue;
    const int32_t source_rank = pair / args.pairs_per_rank, slot = pair % args.pairs_per_rank;
    if (source_rank == args.rank) continue;
    uint4* dst = static_cast<uint4*>(args.slot_peers[source_rank]) +
                 static_cast<int64_t>(slot) * args.vectors_per_row;
    copy_row_warp<kNvlinkLoadsInFlight>(
        dst, static_cast<const uint4*>(args.rows) + row * args.vectors_per_row,
        args.vectors_per_row);
  }
}

// Run by one thread; `smem` holds bulk_rows_smem_bytes(row bytes), 16-byte aligned.
__device__ __forceinline__ void push_rows_bulk_cta(const PushRowsArgs& args,
                                                   const WaitContext& wait, char* smem, int64_t cta,
                                                   int64_t num_ctas) {
  const int32_t total_rows = args.header->total_rows;
  const uint32_t row_bytes = static_cast<uint32_t>(args.vectors_per_row * 16);
  int64_t row = cta;  // the next candidate row of this CTA
  move_rows_bulk(wait, smem, row_bytes, [&](int64_t, const void** source, void** destination) {
    for (; row < total_rows; row += num_ctas) {
      const int32_t pair = args.row_pair[row];
      if (pair < 0) continue;
      const int32_t source_rank = pair / args.pairs_per_rank, slot = pair % args.pairs_per_rank;
      if (source_rank == args.rank) continue;
      *source = static_cast<const char*>(args.rows) + row * row_bytes;
      *destination =
          static_cast<char*>(args.slot_peers[source_rank]) + static_cast<int64_t>(slot) * row_bytes;
      row += num_ctas;
      return true;
    }
    return false;
  });
}

__device__ __forceinline__ void count_push_done(const PushRowsArgs& args, uint64_t epoch,
                                                int64_t num_ctas) {
  count_done_and_signal(args.done, args.flag_peers, args.rank, args.num_ranks, epoch, num_ctas);
}

// Thread `peer` (< num_ranks) of the calling group waits for rank `peer`'s signal.
__device__ __forceinline__ void wait_for_all_pushes(const WaitContext& wait,
                                                    const uint64_t* own_flags, int32_t num_ranks,
                                                    int32_t peer, uint64_t epoch) {
  if (peer < num_ranks) wait_for_peer(wait, own_flags, peer, epoch);
}

}  // namespace mok::kernels
