// Row moves with the bulk-copy engine (cp.async.bulk, the TMA without tensor maps), the Hopper
// way to move whole rows between GPUs (DESIGN.md §2.2): one thread per CTA streams rows through
// a ring of kBulkSlots shared-memory slots — bulk load of row j into slot j % kBulkSlots
// (completing on that slot's mbarrier), then bulk store from the slot to the row's destination —
// keeping kBulkSlots - 1 loads in flight while earlier rows are stored. A slot is reloaded only
// after the store that read it has finished reading (bulk wait_group.read). The rows of a CTA are
// given by `row_at(i)` for i = 0, 1, ... (false ends the walk).
#pragma once

#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"

namespace mok::kernels {

constexpr int kBulkSlots = 4;

// Dynamic shared memory of a bulk-row CTA: kBulkSlots rows, then kBulkSlots mbarriers.
__host__ __device__ constexpr size_t bulk_rows_smem_bytes(int64_t row_bytes) {
  return static_cast<size_t>(row_bytes) * kBulkSlots + 8 * kBulkSlots;
}

// Waits until at most `pending` (0 .. kBulkSlots - 1) of this thread's bulk groups still read
// their shared-memory source.
__device__ __forceinline__ void wait_bulk_reads_at_most(int pending) {
  static_assert(kBulkSlots == 4, "one case per allowed count");
  switch (pending) {
    case 0:
      ptx::bulk_wait_group_read<0>();
      break;
    case 1:
      ptx::bulk_wait_group_read<1>();
      break;
    case 2:
      ptx::bulk_wait_group_read<2>();
      break;
    default:
      ptx::bulk_wait_group_read<3>();
      break;
  }
}

// `next(i, &source, &destination)` names the i-th row of this CTA; returns false past the last.
// Run by one thread; `smem` holds bulk_rows_smem_bytes(row_bytes), 16-byte aligned.
template <typename Next>
__device__ __forceinline__ void move_rows_bulk(const WaitContext& wait, char* smem,
                                               uint32_t row_bytes, Next next) {
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(row_bytes) * kBulkSlots);
  for (int s = 0; s < kBulkSlots; ++s) ptx::mbarrier_init(&full[s], 1);
  ptx::fence_barrier_init();
  void* destinations[kBulkSlots];
  int64_t loaded = 0, stored = 0;
  bool more = true;
  for (;;) {
    // Keep up to kBulkSlots loads ahead of the stores.
    while (more && loaded - stored < kBulkSlots) {
      const void* source = nullptr;
      void* destination = nullptr;
      if (!next(loaded, &source, &destination)) {
        more = false;
        break;
      }
      const int slot = static_cast<int>(loaded % kBulkSlots);
      // The slot's previous row (loaded - kBulkSlots) was stored by an earlier group; the groups
      // committed after it may stay in flight, it must have finished reading the slot.
      if (loaded >= kBulkSlots)
        wait_bulk_reads_at_most(static_cast<int>(stored - (loaded - kBulkSlots) - 1));
      destinations[slot] = destination;
      ptx::mbarrier_arrive_expect_tx(&full[slot], row_bytes);
      ptx::bulk_load_1d(smem + static_cast<size_t>(slot) * row_bytes, source, row_bytes,
                        &full[slot]);
      ++loaded;
    }
    if (stored == loaded) break;
    const int slot = static_cast<int>(stored % kBulkSlots);
    mbarrier_wait(wait, WaitSite::kBulkRow, &full[slot],
                  static_cast<uint32_t>((stored / kBulkSlots) & 1));
    ptx::bulk_store_1d(destinations[slot], smem + static_cast<size_t>(slot) * row_bytes, row_bytes);
    ptx::bulk_commit_group();
    ++stored;
  }
  ptx::bulk_wait_group<0>();  // every store complete (written, not only read)
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Launches a bulk-row kernel `kernel(args, wait)`: one 32-thread CTA each (its first thread
// works), with the slot ring as dynamic shared memory.
template <typename Args>
inline cudaError_t launch_bulk_rows(void (*kernel)(Args, WaitContext), const Args& args,
                                    const WaitContext& wait, int64_t row_bytes, int num_ctas,
                                    cudaStream_t stream) {
  const size_t smem_bytes = bulk_rows_smem_bytes(row_bytes);
  const cudaError_t status = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  kernel<<<num_ctas, 32, smem_bytes, stream>>>(args, wait);
  return cudaGetLastError();
}

}  // namespace mok::kernels
