// The grouped-GEMM mainloop on Hopper: TMA producer and wgmma consumers over a ring of
// shared-memory stages.
//
// Warp roles of a 384-thread CTA (three warpgroups):
//   warpgroup 0  producer: one thread issues the TMA loads of A and B tiles into stage s and
//                arms full[s] with the expected bytes; it waits on empty[s] before reusing s.
//                It gives its registers away (setmaxnreg.dec to 40).
//   warpgroups 1, 2  consumers: each owns 64 rows of the 128-row tile and a 64 x 256 fp32
//                accumulator (128 registers per thread, setmaxnreg.inc to 232). For each
//                K-block: wait full[s], issue 4 wgmma m64n256k16 (K = 64), keep one wgmma
//                group in flight, release the previous stage to the producer through empty[s].
// Pipeline: kNumStages stages of (A 128x64, B 256x64) bf16, 128-byte swizzled as TMA writes them
// and wgmma reads them; the ring runs on across tiles, so the producer prefetches the next
// tile while the consumers run the epilogue of the current one.
// Operands are K-major (both A rows and B rows contiguous along K): x * W^T and h * Wd^T.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/ptx.cuh"
#include "kernels/wait.cuh"

namespace mok::kernels {

constexpr int BLOCK_M = 128;
constexpr int BLOCK_N = 256;
constexpr int BLOCK_K = 64;
constexpr int kNumStages = 4;
constexpr int kNumThreads = 384;
constexpr int kConsumerThreads = 256;
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
constexpr int kTileABytes = BLOCK_M * BLOCK_K * 2;
constexpr int kTileBBytes = BLOCK_N * BLOCK_K * 2;

struct alignas(1024) GemmSharedStorage {
  __nv_bfloat16 a[kNumStages][BLOCK_M * BLOCK_K];
  __nv_bfloat16 b[kNumStages][BLOCK_N * BLOCK_K];
  uint64_t full[kNumStages];
  uint64_t empty[kNumStages];
};
static_assert(sizeof(__nv_bfloat16) * BLOCK_M * BLOCK_K % 1024 == 0, "stages stay 1024-aligned");

// Position in the stage ring; the phase bit flips each time the ring wraps.
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kNumStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

__device__ __forceinline__ void init_pipeline(GemmSharedStorage& smem) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbarrier_init(&smem.full[s], 1);
      ptx::mbarrier_init(&smem.empty[s], kConsumerThreads / 32);  // one arrive per consumer warp
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
}

// Producer side of one K-block: waits for the stage to be free, arms it, and calls
// `issue_loads(a_dst, b_dst, full_barrier)` which must issue TMA loads of exactly
// `bytes` bytes completing on the barrier.
template <typename IssueLoads>
__device__ __forceinline__ void produce_stage(const WaitContext& wait, GemmSharedStorage& smem,
                                              PipelineState& state, uint32_t bytes,
                                              IssueLoads issue_loads) {
  mbarrier_wait(wait, WaitSite::kGemmFreeStage, &smem.empty[state.stage], state.phase ^ 1);
  ptx::mbarrier_arrive_expect_tx(&smem.full[state.stage], bytes);
  issue_loads(smem.a[state.stage], smem.b[state.stage], &smem.full[state.stage]);
  state.advance();
}

// Consumer side of one tile: accumulates A[rows of this warpgroup] * B^T over `num_k_blocks`
// K-blocks into `acc`, releasing each stage once the wgmma that read it has completed.
__device__ __forceinline__ void consume_tile(const WaitContext& wait, GemmSharedStorage& smem,
                                             PipelineState& state, int num_k_blocks,
                                             int consumer_idx, float (&acc)[128]) {
  const bool releases = (threadIdx.x % 32) == 0;
  int previous_stage = -1;
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    mbarrier_wait(wait, WaitSite::kGemmLoadedStage, &smem.full[state.stage], state.phase);
    const __nv_bfloat16* a_tile = smem.a[state.stage] + consumer_idx * 64 * BLOCK_K;
    const uint64_t desc_a = ptx::smem_desc_k_major_sw128(a_tile);
    const uint64_t desc_b = ptx::smem_desc_k_major_sw128(smem.b[state.stage]);
    ptx::fence_registers(acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < BLOCK_K / 16; ++k)  // 16 bf16 = 32 bytes = 2 descriptor units
      ptx::wgmma_m64n256k16_bf16(acc, desc_a + 2 * k, desc_b + 2 * k, k_block > 0 || k > 0);
    ptx::wgmma_commit();
    ptx::fence_registers(acc);
    ptx::wgmma_wait<1>();
    if (previous_stage >= 0 && releases) ptx::mbarrier_arrive(&smem.empty[previous_stage]);
    previous_stage = state.stage;
    state.advance();
  }
  ptx::wgmma_wait<0>();
  ptx::fence_registers(acc);
  if (previous_stage >= 0 && releases) ptx::mbarrier_arrive(&smem.empty[previous_stage]);
}

// Accumulator fragment coordinates of wgmma m64nN (fp32): register j*4 + i*2 + c holds
// row (warp%4)*16 + lane/4 + 8*i and column 8*j + 2*(lane%4) + c of the 64-row slice.
__device__ __forceinline__ int fragment_row(int i) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  return warp * 16 + lane / 4 + 8 * i;
}
__device__ __forceinline__ int fragment_col(int j) { return 8 * j + 2 * (threadIdx.x % 4); }

}  // namespace mok::kernels
