// What the tensor pipe gives the FP8 GEMMs' consumer loops with no loads at all: two consumer
// (or three) warpgroups per SM, their operands fixed in shared memory, running the K-block loop of
// fp8_gemm.cu's consumers (four m64nNk32 e4m3 wgmma per 128-long K-block) in these forms:
//   accumulate N   one accumulator, as a bf16 GEMM's loop (no promotion): the pipe's ceiling for
//                  m64nNk32 at N = 128 and 256;
//   2 in flight    fp8_gemm.cu's loop: K-block k + 1 issued while K-block k is promoted into the
//                  fp32 sum, one factor per row (the row tiles) or per element (the weight
//                  gradients: FMUL + FFMA, the column scales read from shared memory per
//                  K-block). Three more forms take the element form apart: its column scales held
//                  in registers (no shared-memory reads), and row factors with two FFMA per
//                  element (its FP32 instruction count, no FMUL feeding an FFMA), and the
//                  column scales stored in the fragment's order (half the shared-memory reads);
//   1 in flight N  each K-block waited for, then promoted (DeepGEMM's loop), at N = 128 and 192,
//                  and with element factors at N = 128 (their column scales read from shared
//                  memory in the promotion, or into registers while the K-block's wgmma run);
//                  192 columns fit the registers only with one block in flight. And with three
//                  consumer warpgroups (a 192 x 128 tile: one in flight is what fits 384
//                  consumer threads' registers), the row tiles' loop for fewer operand bytes
//                  per FLOP than 128 x 128, and the weight gradients' (element factors, their
//                  scales also in fragment order): can three warpgroups cover each other's
//                  promotion where two could not?
// Each prints TFLOP/s per call and its share of the FP8 peak at the SM clock the launches ran at
// (8,192 FLOP per cycle per SM; the clock from mok::SmClockWindow's probes). The row-tile GEMMs
// reach 60-63% of the pipe in the layer and the weight gradients ~47%: these forms say how much
// of that the loop's shape sets (session 47: the row tiles' loop ~99%, the weight gradients'
// 55-63%; docs/design.md, "What binds the FP8 GEMMs"). No bits are checked (the operands are
// fixed codes); the bounds catch a miscounted FLOP or a broken clock.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "device_memory.h"
#include "kernels/common/ptx.cuh"
#include "mok/sm_clock.h"

namespace mok {
namespace {

constexpr int kMaxThreads = 384;   // up to three consumer warpgroups
constexpr int kBlockKBytes = 128;  // one K-block: 128 e4m3 values, one swizzled row
constexpr int kKBlocks = 4096;     // per CTA and launch (even: the 2-in-flight loop's pairs)
constexpr double kFlopPerCyclePerSm = 8192;  // FP8 dense wgmma, H100 / H200

enum class Loop { kAccumulate, kTwoInFlight, kOneInFlight };

// How a K-block's products are added into the sum.
enum class Promotion {
  kRow,                   // sum += block * row factor (the row tiles)
  kElement,               // sum += block * (row factor * column scale), scales read per K-block
  kElementHeldColumns,    // the same, the column scales read once into registers
  kRowTwice,              // sum += block * f0; sum += block * f1: kElement's FP32 count, no FMUL
  kElementReadAtIssue,    // kElement with the K-block's column scales read into registers while
                          // its wgmma run (one in flight: the registers of a second block free)
  kElementFragmentOrder,  // kElement with each 16 columns' scales stored in the fragment's
                          // order: a thread's four of them one 16-byte read (8 LDS.128 per
                          // K-block where kElement has 16 LDS.64), the four lanes' reads of one
                          // instruction 64 consecutive bytes (no bank conflict)
};

template <int N>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                           bool accumulate) {
  if constexpr (N == 128)
    ptx::wgmma_m64n128k32_e4m3(d, desc_a, desc_b, accumulate);
  else if constexpr (N == 192)
    ptx::wgmma_m64n192k32_e4m3(d, desc_a, desc_b, accumulate);
  else
    ptx::wgmma_m64n256k32_e4m3(d, desc_a, desc_b, accumulate);
}

template <int N>
__device__ __forceinline__ void issue(float (&block)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                      bool accumulate) {
  ptx::fence_registers(block);
  ptx::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kBlockKBytes / 32; ++k)  // 32 bytes = 2 descriptor units per step
    wgmma_e4m3<N>(block, desc_a + 2 * k, desc_b + 2 * k, accumulate || k > 0);
  ptx::wgmma_commit();
}

// Promotes one K-block (Promotion above). `scales`: four stages of N row factors and N column
// scales in shared memory; `held`: this thread's column scales when kElementHeldColumns.
template <int N, Promotion kPromotion>
__device__ __forceinline__ void promote(float (&block)[N / 2], float (&sum)[N / 2],
                                        const float* scales, const float2 (&held)[N / 8],
                                        int k_block) {
  ptx::fence_registers(block);
  const float* stage = scales + (k_block % 4) * 2 * N;
  const float factor0 = stage[threadIdx.x % 64], factor1 = stage[threadIdx.x % 64 + 64];
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    float2 column = make_float2(1.0f, 1.0f);
    if constexpr (kPromotion == Promotion::kElementFragmentOrder) {
      // Columns 16 g + 2 q + c (j = 2 g) and 16 g + 8 + 2 q + c (j = 2 g + 1) at 16 g + 4 q + c
      // and 16 g + 4 q + 2 + c: ptxas keeps one LDS.128 per pair of j.
      const float4 four =
          *reinterpret_cast<const float4*>(&stage[N + 16 * (j / 2) + 4 * (threadIdx.x % 4)]);
      column = j % 2 == 0 ? make_float2(four.x, four.y) : make_float2(four.z, four.w);
    }
    if constexpr (kPromotion == Promotion::kElement)
      column = *reinterpret_cast<const float2*>(&stage[N + 8 * j + 2 * (threadIdx.x % 4)]);
    if constexpr (kPromotion == Promotion::kElementHeldColumns ||
                  kPromotion == Promotion::kElementReadAtIssue)
      column = held[j];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float row = i < 2 ? factor0 : factor1;
      const int r = j * 4 + i;
      if constexpr (kPromotion == Promotion::kRowTwice) {
        sum[r] = fmaf(block[r], row, sum[r]);
        sum[r] = fmaf(block[r], factor0 + factor1, sum[r]);
      } else if constexpr (kPromotion == Promotion::kRow) {
        sum[r] = fmaf(block[r], row, sum[r]);
      } else {
        sum[r] = fmaf(block[r], row * (i % 2 ? column.y : column.x), sum[r]);
      }
    }
  }
}

// Every value of the sum, so that none of its promotions is dead code.
template <int kCount>
__device__ __forceinline__ float total(const float (&values)[kCount]) {
  float result = 0.0f;
#pragma unroll
  for (int i = 0; i < kCount; ++i) result += values[i];
  return result;
}

template <int N, Loop kLoop, Promotion kPromotion, int kWarpgroups>
__global__ void __launch_bounds__(kWarpgroups * 128, 1)
    wgmma_ceiling_kernel(int k_blocks, float* sink) {
  constexpr int kThreads = kWarpgroups * 128;
  extern __shared__ __align__(1024) unsigned char shared_raw[];
  // Rounded up as an offset (ptx::align_shared_1024), so that the scales' reads stay LDS.
  uint8_t* shared = &ptx::align_shared_1024<uint8_t>(shared_raw);
  uint8_t* a = shared;                                             // each warpgroup's 64 rows
  uint8_t* b = a + 64 * kWarpgroups * kBlockKBytes;                // N rows
  float* scales = reinterpret_cast<float*>(b + N * kBlockKBytes);  // 4 stages of 2N factors
  // Fixed codes with their exponents spread (no NaN: bit patterns 0x7F and 0xFF never occur).
  uint32_t* codes = reinterpret_cast<uint32_t*>(shared);
  for (int i = threadIdx.x; i < (64 * kWarpgroups + N) * kBlockKBytes / 4; i += kThreads)
    codes[i] = (i * 0x9E3779B1u) & 0x3E3E3E3Eu;
  for (int i = threadIdx.x; i < 4 * 2 * N; i += kThreads)
    scales[i] = 1.0f / static_cast<float>(1 << (i % 5));
  ptx::fence_proxy_async_shared();  // the codes, written by threads, read by wgmma
  __syncthreads();
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const uint64_t desc_a = ptx::smem_desc_k_major_sw128(a + warpgroup * 64 * kBlockKBytes);
  const uint64_t desc_b = ptx::smem_desc_k_major_sw128(b);
  float2 held[N / 8];
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
    held[j] = kPromotion == Promotion::kElementHeldColumns
                  ? *reinterpret_cast<const float2*>(&scales[N + 8 * j + 2 * (threadIdx.x % 4)])
                  : make_float2(1.0f, 1.0f);
  float result = 0.0f;
  if constexpr (kLoop == Loop::kAccumulate) {
    float acc[N / 2];
#pragma unroll
    for (int r = 0; r < N / 2; ++r) acc[r] = 0.0f;
    for (int k_block = 0; k_block < k_blocks; ++k_block) {
      issue<N>(acc, desc_a, desc_b, k_block > 0);
      ptx::wgmma_wait<1>();
    }
    ptx::wgmma_wait<0>();
    ptx::fence_registers(acc);
    result = total(acc);
  } else if constexpr (kLoop == Loop::kOneInFlight) {
    float block[N / 2], sum[N / 2];
#pragma unroll
    for (int r = 0; r < N / 2; ++r) sum[r] = -0.0f;
    for (int k_block = 0; k_block < k_blocks; ++k_block) {
      issue<N>(block, desc_a, desc_b, false);
      if constexpr (kPromotion == Promotion::kElementReadAtIssue) {
        const float* stage = scales + (k_block % 4) * 2 * N;
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
          held[j] = *reinterpret_cast<const float2*>(&stage[N + 8 * j + 2 * (threadIdx.x % 4)]);
      }
      ptx::wgmma_wait<0>();
      promote<N, kPromotion>(block, sum, scales, held, k_block);
    }
    result = total(sum);
  } else {
    float block0[N / 2], block1[N / 2], sum[N / 2];
#pragma unroll
    for (int r = 0; r < N / 2; ++r) sum[r] = -0.0f;
    // At the loop's head K-block k is in flight in block0, and every exit waits for all: one
    // state on every path, so that ptxas keeps the wgmma asynchronous (fp8_gemm.cu's loop).
    issue<N>(block0, desc_a, desc_b, false);
    for (int k_block = 0;; k_block += 2) {
      if (k_block + 1 == k_blocks) {
        ptx::wgmma_wait<0>();
        promote<N, kPromotion>(block0, sum, scales, held, k_block);
        break;
      }
      issue<N>(block1, desc_a, desc_b, false);
      ptx::wgmma_wait<1>();
      promote<N, kPromotion>(block0, sum, scales, held, k_block);
      if (k_block + 2 == k_blocks) {
        ptx::wgmma_wait<0>();
        promote<N, kPromotion>(block1, sum, scales, held, k_block + 1);
        break;
      }
      issue<N>(block0, desc_a, desc_b, false);
      ptx::wgmma_wait<1>();
      promote<N, kPromotion>(block1, sum, scales, held, k_block + 1);
    }
    result = total(sum);
  }
  sink[blockIdx.x * kThreads + threadIdx.x] = result;
}

struct Measured {
  double ms = 0, tflops = 0, clock_ghz = 0, peak_share = 0;
};

template <int N, Loop kLoop, Promotion kPromotion = Promotion::kRow, int kWarpgroups = 2>
Measured time_form(int sm_count, float* sink, SmClockWindow& window) {
  constexpr int kThreads = kWarpgroups * 128;
  const int shared_bytes = 1024 + (64 * kWarpgroups + N) * kBlockKBytes + 4 * 2 * N * 4;
  auto kernel = wgmma_ceiling_kernel<N, kLoop, kPromotion, kWarpgroups>;
  EXPECT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes),
            cudaSuccess);
  for (int warm = 0; warm < 2; ++warm) kernel<<<sm_count, kThreads, shared_bytes>>>(kKBlocks, sink);
  constexpr int kLaunches = 10;
  const test::TimingEvents events;
  window.open(nullptr);
  cudaEventRecord(events.start);
  for (int launch = 0; launch < kLaunches; ++launch)
    kernel<<<sm_count, kThreads, shared_bytes>>>(kKBlocks, sink);
  cudaEventRecord(events.stop);
  window.close(nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  float ms = 0;
  cudaEventElapsedTime(&ms, events.start, events.stop);
  Measured m;
  m.ms = ms / kLaunches;
  const double flop = 2.0 * 64 * kWarpgroups * N * kBlockKBytes * kKBlocks * sm_count;
  m.tflops = flop / (m.ms * 1e-3) / 1e12;
  m.clock_ghz = window.ghz();
  if (m.clock_ghz > 0)
    m.peak_share = m.tflops * 1e12 / (kFlopPerCyclePerSm * sm_count * m.clock_ghz * 1e9);
  return m;
}

TEST(Fp8WgmmaCeilingGpu, TensorPipeByTileWidthAndPromotion) {
  int device = 0, sm_count = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  test::DeviceAllocations memory;
  float* sink = memory.allocate<float>(sm_count * kMaxThreads * sizeof(float));
  SmClockWindow window;
  const std::vector<std::pair<std::string, Measured>> forms = {
      {"accumulate, N = 128", time_form<128, Loop::kAccumulate>(sm_count, sink, window)},
      {"accumulate, N = 256", time_form<256, Loop::kAccumulate>(sm_count, sink, window)},
      {"2 in flight, row factors, N = 128 (row tiles)",
       time_form<128, Loop::kTwoInFlight>(sm_count, sink, window)},
      {"2 in flight, element factors, N = 128 (wgrad)",
       time_form<128, Loop::kTwoInFlight, Promotion::kElement>(sm_count, sink, window)},
      {"2 in flight, element factors, column scales held",
       time_form<128, Loop::kTwoInFlight, Promotion::kElementHeldColumns>(sm_count, sink, window)},
      {"2 in flight, element factors, scales in fragment order",
       time_form<128, Loop::kTwoInFlight, Promotion::kElementFragmentOrder>(sm_count, sink,
                                                                            window)},
      {"2 in flight, row factors, two FFMA per element",
       time_form<128, Loop::kTwoInFlight, Promotion::kRowTwice>(sm_count, sink, window)},
      {"1 in flight, row factors, N = 128",
       time_form<128, Loop::kOneInFlight>(sm_count, sink, window)},
      {"1 in flight, element factors, N = 128",
       time_form<128, Loop::kOneInFlight, Promotion::kElement>(sm_count, sink, window)},
      {"1 in flight, element factors, column scales read at issue",
       time_form<128, Loop::kOneInFlight, Promotion::kElementReadAtIssue>(sm_count, sink, window)},
      {"1 in flight, row factors, three warpgroups (192 x 128)",
       time_form<128, Loop::kOneInFlight, Promotion::kRow, 3>(sm_count, sink, window)},
      {"1 in flight, element factors, three warpgroups",
       time_form<128, Loop::kOneInFlight, Promotion::kElement, 3>(sm_count, sink, window)},
      {"1 in flight, element factors in fragment order, three warpgroups",
       time_form<128, Loop::kOneInFlight, Promotion::kElementFragmentOrder, 3>(sm_count, sink,
                                                                               window)},
      {"1 in flight, element factors read at issue, three warpgroups",
       time_form<128, Loop::kOneInFlight, Promotion::kElementReadAtIssue, 3>(sm_count, sink,
                                                                             window)},
      {"1 in flight, row factors, N = 192",
       time_form<192, Loop::kOneInFlight>(sm_count, sink, window)},
  };
  for (const auto& [name, m] : forms) {
    std::printf("  fp8 wgmma loop, %-48s %8.3f ms %7.0f TFLOP/s  %.2f GHz  %5.1f%% of peak\n",
                name.c_str(), m.ms, m.tflops, m.clock_ghz, 100 * m.peak_share);
    EXPECT_GT(m.tflops, 50.0) << name;
    EXPECT_GT(m.clock_ghz, 0.3) << name;
    EXPECT_LT(m.peak_share, 1.05) << name << ": more than the tensor pipe can do (a miscount)";
  }
}

}  // namespace
}  // namespace mok
