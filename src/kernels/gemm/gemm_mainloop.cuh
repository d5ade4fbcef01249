// The grouped-GEMM mainloop on Hopper: TMA producer and wgmma consumers over a ring of
// shared-memory stages.
//
// Warp roles of a 384-thread CTA (three warpgroups):
//   warpgroup 0  producer: one thread issues the TMA loads of A and B tiles into stage s and
//                arms full[s] with the expected bytes; it waits on empty[s] before reusing s.
//                It gives registers away (setmaxnreg.dec to 56; its spare warps 1-3 run the
//                fused local dispatch in the forward gate/up GEMM, dispatch_local.cuh).
//   warpgroups 1, 2  consumers: each owns 64 rows of the 128-row tile and a 64 x 256 fp32
//                accumulator (128 registers per thread, setmaxnreg.inc to 224). For each
//                K-block: wait full[s], issue 4 wgmma m64n256k16 (K = 64), keep one wgmma
//                group in flight, release the previous stage to the producer through empty[s].
// Pipeline: kNumStages stages of (A 128x64, B 256x64) bf16, 128-byte swizzled as TMA writes them
// and wgmma reads them; the ring runs on across tiles, so the producer prefetches the next
// tile while the consumers run the epilogue of the current one.
// Operands may be K-major (rows contiguous along K: x * W^T, h * Wd^T) or MN-major (contiguous
// along M or N: the dgrad forms' weights, and both operands of the weight gradients, whose K is
// the token rows); wgmma reads either from the swizzled tiles through its transpose bits.
// CTA pairs (kPaired; expert_gemm.cu): each consumer warp releases a stage on its own CTA's
// empty barrier and on its peer's, since the peer's producer multicasts into this CTA's stage
// too; the barriers then count both CTAs' consumer warps. A phantom tile (pass_stages)
// waits for and releases its stages without reading them.
#pragma once

#include <cuda_bf16.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"

namespace mok::kernels {

constexpr int BLOCK_M = 128;
constexpr int BLOCK_N = 256;
constexpr int BLOCK_K = 64;
constexpr int kNumStages = 3;  // the staging tile of the epilogue takes a fourth stage's memory
constexpr int kNumThreads = 384;
constexpr int kConsumerThreads = 256;
constexpr int kProducerRegisters = 56;
constexpr int kConsumerRegisters = 224;
// The registers a 384-thread CTA holds at launch: 168 per thread (65,536 / 384, rounded down to
// the allocation unit of 8). setmaxnreg moves registers between warpgroups inside that pool; a
// split asking for more blocks setmaxnreg.inc forever.
constexpr int kLaunchRegisters = 168;
constexpr bool register_split_fits(int producer_registers, int consumer_registers,
                                   int consumer_warpgroups) {
  return 128 * (producer_registers + consumer_warpgroups * consumer_registers) <=
         kNumThreads * kLaunchRegisters;
}
static_assert(register_split_fits(kProducerRegisters, kConsumerRegisters, 2),
              "the expert GEMM's register split fits the launch's pool");
constexpr int kTileABytes = BLOCK_M * BLOCK_K * 2;
constexpr int kTileBBytes = BLOCK_N * BLOCK_K * 2;

constexpr int kStorageTailBytes = 256;  // GemmSharedStorage::tail_bytes
// Shared memory of one CTA: the stage ring of (A kTileM x 64, B kTileN x 64) and the
// epilogue's staging tile of kStagingRows x kStagingCols bf16 (128B-swizzled chunks of 64
// columns, epilogue.cuh). The expert GEMM's: 128 x 256 tiles, all 128 rows and 256 columns
// staged at once; with four stages, 128 columns at a time.
template <int kStages, int kTileM = BLOCK_M, int kTileN = BLOCK_N, int kStagingRows = BLOCK_M,
          int kStagingCols = kTileN>
struct alignas(1024) GemmSharedStorage {
  static constexpr int kNumStagesHere = kStages;
  static constexpr int kStagingChunks = kStagingCols / 64;
  __nv_bfloat16 a[kStages][kTileM * BLOCK_K];
  __nv_bfloat16 b[kStages][kTileN * BLOCK_K];
  __nv_bfloat16 store_tile[kStagingRows * kStagingCols];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  // Room for a small hand-off between warps (the expert GEMM's queue of units by ticket) in
  // the tail padding that alignas(1024) adds anyway: sizeof stays what it was. Four stages
  // fill the 227 KB to the byte, so nothing may go after the struct.
  alignas(16) unsigned char tail_bytes[kStorageTailBytes];
};
// The tail bytes take no room: they end inside the 1024-byte block the barriers began.
template <typename Storage>
constexpr bool kTailInPadding = offsetof(Storage, tail_bytes) / 1024 ==
                                    (offsetof(Storage, tail_bytes) + kStorageTailBytes - 1) /
                                        1024 &&
                                offsetof(Storage, full) / 1024 ==
                                    offsetof(Storage, tail_bytes) / 1024;
static_assert(kTailInPadding<GemmSharedStorage<kNumStages>>, "the tail bytes cost no room");
static_assert(sizeof(__nv_bfloat16) * BLOCK_M * BLOCK_K % 1024 == 0, "stages stay 1024-aligned");
static_assert(sizeof(GemmSharedStorage<kNumStages>) + 1024 <= 227 * 1024,
              "fits the SM's shared memory");

// Position in the stage ring; the phase bit flips each time the ring wraps.
template <int kStages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// A stage is free again once every consumer warp that reads it has arrived: this CTA's, and
// with kPaired its cluster peer's too (a CTA pair multicasts B into both CTAs' stages, so each
// producer waits for both CTAs' consumers; expert_gemm.cu).
template <bool kPaired>
constexpr uint32_t kEmptyArrivals = (kPaired ? 2 : 1) * kConsumerThreads / 32;

template <bool kPaired = false, typename Storage>
__device__ __forceinline__ void init_pipeline(Storage& smem) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < Storage::kNumStagesHere; ++s) {
      ptx::mbarrier_init(&smem.full[s], 1);
      ptx::mbarrier_init(&smem.empty[s], kEmptyArrivals<kPaired>);
    }
    ptx::fence_barrier_init();
  }
  if constexpr (kPaired)
    ptx::cluster_sync();  // the peer's barriers exist before anything arrives on them
  else
    __syncthreads();
}

// One consumer warp's release of a stage (called by one lane).
template <bool kPaired>
__device__ __forceinline__ void release_stage(uint64_t* empty) {
  ptx::mbarrier_arrive(empty);
  if constexpr (kPaired) ptx::mbarrier_arrive_cluster(empty, ptx::cluster_cta_rank() ^ 1);
}

// Producer side of one K-block: waits for the stage to be free, arms it, and calls
// `issue_loads(a_dst, b_dst, full_barrier)` which must issue TMA loads of exactly
// `bytes` bytes completing on the barrier.
template <typename Storage, typename State, typename IssueLoads>
__device__ __forceinline__ void produce_stage(const WaitContext& wait, Storage& smem, State& state,
                                              uint32_t bytes, IssueLoads issue_loads) {
  mbarrier_wait(wait, WaitSite::kGemmFreeStage, &smem.empty[state.stage], state.phase ^ 1);
  ptx::mbarrier_arrive_expect_tx(&smem.full[state.stage], bytes);
  issue_loads(smem.a[state.stage], smem.b[state.stage], &smem.full[state.stage]);
  state.advance();
}

// Operand tiles in a stage: A is 128 (M) x 64 (K), B is 256 (N) x 64 (K), each either
// K-major (TMA box [rows x 64 K-elements]) or MN-major (boxes of [64 K-rows x 64 MN-elements],
// 64-element MN chunks 8 KB apart). Consumer c uses M rows [64c, 64c + 64).
constexpr uint32_t kMnChunkBytes = BLOCK_K * 64 * 2;  // one [64 K-rows x 64 MN] box

template <bool kMnMajor>
__device__ __forceinline__ uint64_t operand_desc(const __nv_bfloat16* tile) {
  if constexpr (kMnMajor)
    return ptx::smem_desc_mn_major_sw128(tile, kMnChunkBytes);
  else
    return ptx::smem_desc_k_major_sw128(tile);
}

// Descriptor advance for the next 16 elements of K, in 16-byte units: K-major moves 32 bytes
// along the swizzled row; MN-major moves 16 K-rows of 128 bytes.
template <bool kMnMajor>
constexpr uint64_t k16_step() {
  return kMnMajor ? (16 * 128) >> 4 : (16 * 2) >> 4;
}

// Consumer side of one tile: accumulates A[rows of this warpgroup] * B^T over `num_k_blocks`
// K-blocks into `acc`, releasing each stage once the wgmma that read it has completed. With no
// K-blocks (an expert without rows) it returns at once; zeroing 128 registers here would make
// ptxas spill, so the epilogue handles that case.
// With `accumulate`, acc already holds a partial sum (a weight gradient resumed across a
// macrobatch boundary) and the first wgmma adds to it instead of overwriting it.
// kHalf: a 64-row tile (K-major A): both consumers read A rows 0-63 and consumer c the B columns
// [128c, 128c + 128), into acc's first 64 registers (m64n128k16: half the tensor-core work).
template <bool kAMnMajor, bool kBMnMajor, bool kPaired = false, bool kHalf = false,
          typename Storage, typename State>
__device__ __forceinline__ void consume_tile(const WaitContext& wait, Storage& smem, State& state,
                                             int num_k_blocks, int consumer_idx, float (&acc)[128],
                                             bool accumulate = false) {
  static_assert(!kHalf || !kAMnMajor, "64-row tiles are row tiles: A is K-major");
  const bool releases = (threadIdx.x % 32) == 0;
  if (num_k_blocks == 0) return;  // acc is left undefined: the epilogue writes zeros instead
  int previous_stage = -1;
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    mbarrier_wait(wait, WaitSite::kGemmLoadedStage, &smem.full[state.stage], state.phase);
    // Consumer c's 64 M rows: 64 K-major rows of 128 bytes, or MN chunk c; both 8 KB in. A
    // 64-row tile's B columns of consumer c: 128 K-major rows or two MN chunks, 16 KB in.
    const uint64_t desc_a =
        operand_desc<kAMnMajor>(smem.a[state.stage] + (kHalf ? 0 : consumer_idx * 64 * BLOCK_K));
    const uint64_t desc_b =
        operand_desc<kBMnMajor>(smem.b[state.stage] + (kHalf ? consumer_idx * 128 * BLOCK_K : 0));
    ptx::fence_registers(acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < BLOCK_K / 16; ++k) {
      const bool scale_d = k_block > 0 || k > 0 || accumulate;
      if constexpr (kHalf)
        ptx::wgmma_m64n128k16_bf16<kAMnMajor, kBMnMajor>(
            acc, desc_a + k * k16_step<kAMnMajor>(), desc_b + k * k16_step<kBMnMajor>(), scale_d);
      else
        ptx::wgmma_m64n256k16_bf16<kAMnMajor, kBMnMajor>(
            acc, desc_a + k * k16_step<kAMnMajor>(), desc_b + k * k16_step<kBMnMajor>(), scale_d);
    }
    ptx::wgmma_commit();
    ptx::fence_registers(acc);
    ptx::wgmma_wait<1>();
    if (previous_stage >= 0 && releases) release_stage<kPaired>(&smem.empty[previous_stage]);
    previous_stage = state.stage;
    state.advance();
  }
  ptx::wgmma_wait<0>();
  ptx::fence_registers(acc);
  if (releases) release_stage<kPaired>(&smem.empty[previous_stage]);
}

// Waits for and releases a tile's stages without reading them: a CTA pair's phantom tile (its
// partner's row tile has no counterpart here, kPaired), so both CTAs walk the same stage
// sequence; and GemmAblation::kNoMath.
template <bool kPaired, typename Storage, typename State>
__device__ __forceinline__ void pass_stages(const WaitContext& wait, Storage& smem, State& state,
                                            int num_k_blocks) {
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    mbarrier_wait(wait, WaitSite::kGemmLoadedStage, &smem.full[state.stage], state.phase);
    if (threadIdx.x % 32 == 0) release_stage<kPaired>(&smem.empty[state.stage]);
    state.advance();
  }
}

// Accumulator fragment coordinates of wgmma m64nN (fp32): register j*4 + i*2 + c holds
// row (warp%4)*16 + lane/4 + 8*i and column 8*j + 2*(lane%4) + c of the 64-row slice.
__device__ __forceinline__ int fragment_row(int i) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  return warp * 16 + lane / 4 + 8 * i;
}
__device__ __forceinline__ int fragment_col(int j) { return 8 * j + 2 * (threadIdx.x % 4); }

}  // namespace mok::kernels
