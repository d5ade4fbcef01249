// The hand-written PTX layer of mok: every inline-asm wrapper the kernels use lives here, so
// the rest of the device code reads as C++. Hopper (sm_90a) only: mbarriers, bulk tensor
// copies (TMA), wgmma, register reallocation, proxy fences.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace mok::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// The dynamic shared memory rounded up to 1024 bytes (TMA's 128-byte swizzle needs it), as an
// offset added to the pointer itself: rounding through an integer loses the address space, and
// the kernels' staging stores then compile as generic stores (ST.E) with 64-bit addresses.
template <typename T>
__device__ __forceinline__ T& align_shared_1024(unsigned char* dynamic_smem) {
  const uint32_t padding = (1024u - (smem_addr(dynamic_smem) & 1023u)) & 1023u;
  return *reinterpret_cast<T*>(dynamic_smem + padding);
}

// ---- mbarrier ------------------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(barrier)),
               "r"(arrive_count));
}

// Makes mbarrier inits visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(barrier)) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(barrier)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* barrier, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(barrier)), "r"(phase)
      : "memory");
  return done != 0;
}

// Whether the phase has completed, without suspending the thread (mbarrier.test_wait).
__device__ __forceinline__ bool mbarrier_test_wait(uint64_t* barrier, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(barrier)), "r"(phase)
      : "memory");
  return done != 0;
}

// A load that later loads of this thread cannot pass (pairs with red.release / st.release at
// gpu scope: the dependency counters).
__device__ __forceinline__ unsigned long long acquire_load_u64(const unsigned long long* address) {
  unsigned long long value;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

// ---- clusters ---------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Arrives on the mbarrier at `barrier`'s offset in the shared memory of cluster CTA `cta`, with
// the default .release.cta semantics: a consumer's release of a stage orders only its completed
// wgmma reads (a .release.cluster arrive ran the paired GEMMs 1.9x slower).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* barrier, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_addr(barrier)), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// Every thread of every CTA of the cluster (divergent callers allowed: not .aligned).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// ---- TMA (bulk tensor copies) --------------------------------------------------------------

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Asks the bulk-copy engine to bring `bytes` (a multiple of 16, 16-byte aligned) of global
// memory into L2, asynchronously: many rows in flight for the cost of one instruction each and
// no registers (a hint: nothing waits for it, and it changes no value).
__device__ __forceinline__ void bulk_prefetch_l2(const void* address, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address), "r"(bytes) : "memory");
}

// The same for one box of a tensor map: brought into L2, nothing written to shared memory.
__device__ __forceinline__ void tma_prefetch_l2_3d(const CUtensorMap* map, int32_t coord_inner,
                                                   int32_t coord_middle, int32_t coord_outer) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(coord_inner), "r"(coord_middle), "r"(coord_outer)
               : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map,
                                            uint64_t* barrier, int32_t coord_inner,
                                            int32_t coord_outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(barrier)), "r"(coord_inner),
      "r"(coord_outer)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map,
                                            uint64_t* barrier, int32_t coord_inner,
                                            int32_t coord_middle, int32_t coord_outer) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(barrier)), "r"(coord_inner),
      "r"(coord_middle), "r"(coord_outer)
      : "memory");
}

// The same loads multicast: the box lands at `smem_dst`'s offset in every cluster CTA of
// `cta_mask` and completes on the mbarrier at `barrier`'s offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* map,
                                                      uint64_t* barrier, int32_t coord_inner,
                                                      int32_t coord_outer, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(barrier)), "r"(coord_inner),
      "r"(coord_outer), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d_multicast(void* smem_dst, const CUtensorMap* map,
                                                      uint64_t* barrier, int32_t coord_inner,
                                                      int32_t coord_middle, int32_t coord_outer,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(barrier)), "r"(coord_inner),
      "r"(coord_middle), "r"(coord_outer), "h"(cta_mask)
      : "memory");
}

// Store of a shared-memory tile to global memory through a tensor map (async proxy). The
// writing threads must have made their smem writes visible to the async proxy first
// (fence_proxy_async_shared), and the tile must stay untouched until bulk_wait_group_read.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* smem_src,
                                             int32_t coord_inner, int32_t coord_middle,
                                             int32_t coord_outer) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(smem_src)), "r"(coord_inner), "r"(coord_middle), "r"(coord_outer)
      : "memory");
}

// 1-D bulk copies (no tensor map): global (local or a peer's, 16-byte aligned) -> shared,
// completing on an mbarrier; shared -> global in the thread's bulk group. Sizes: multiples of 16.
__device__ __forceinline__ void bulk_load_1d(void* smem_dst, const void* global_src, uint32_t bytes,
                                             uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(global_src)), "r"(bytes), "r"(smem_addr(barrier))
      : "memory");
}

__device__ __forceinline__ void bulk_store_1d(void* global_dst, const void* smem_src,
                                              uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                   reinterpret_cast<uint64_t>(global_dst)),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most kPending bulk groups still read their shared-memory source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Waits until at most kPending bulk groups are still in flight (writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- wgmma ---------------------------------------------------------------------------------

// Shared-memory matrix descriptor for a K-major operand tile stored with the 128-byte swizzle
// that TMA writes (rows of 64 bf16 = 128 bytes; 8-row groups 1024 bytes apart).
__device__ __forceinline__ uint64_t smem_desc_k_major_sw128(const void* tile) {
  const uint64_t address = smem_addr(tile);
  uint64_t desc = 0;
  desc |= (address & 0x3FFFF) >> 4;   // start address, 16-byte units
  desc |= uint64_t{1} << 16;          // leading byte offset (unused for swizzled K-major)
  desc |= uint64_t{1024 >> 4} << 32;  // stride byte offset: 8 rows * 128 bytes
  desc |= uint64_t{1} << 62;          // swizzle mode: 128 bytes
  return desc;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across wgmma issue points.
template <int kCount>
__device__ __forceinline__ void fence_registers(float (&acc)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Shared-memory matrix descriptor for an MN-major operand tile (contiguous along M or N) as
// TMA writes it with the 128-byte swizzle from boxes of [64 K-rows x 64 MN-elements]: a K-row is
// 128 bytes, 8 K-rows form a 1024-byte group (stride byte offset), and successive 64-element
// MN chunks are `chunk_bytes` apart (leading byte offset).
__device__ __forceinline__ uint64_t smem_desc_mn_major_sw128(const void* tile,
                                                             uint32_t chunk_bytes) {
  const uint64_t address = smem_addr(tile);
  uint64_t desc = 0;
  desc |= (address & 0x3FFFF) >> 4;
  desc |= uint64_t{(chunk_bytes >> 4) & 0x3FFF} << 16;  // leading byte offset: next MN chunk
  desc |= uint64_t{1024 >> 4} << 32;                    // stride byte offset: next 8 K-rows
  desc |= uint64_t{1} << 62;
  return desc;
}

// The fp32 accumulator registers of a wgmma with N = 128, 192 or 256 (FP32 out: N / 2 per
// thread): the asm template's operand lists and the matching "+f" constraints of d[0..N/2-1].
#define MOK_WGMMA_REGS_0_63                                                               \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, " \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MOK_WGMMA_REGS_64_95                                                              \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, " \
  "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define MOK_WGMMA_REGS_96_127                                                            \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "     \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
  "%124, %125, %126, %127"
#define MOK_WGMMA_64_ACCUMULATORS "{" MOK_WGMMA_REGS_0_63 "}, "
#define MOK_WGMMA_96_ACCUMULATORS "{" MOK_WGMMA_REGS_0_63 ", " MOK_WGMMA_REGS_64_95 "}, "
#define MOK_WGMMA_128_ACCUMULATORS \
  "{" MOK_WGMMA_REGS_0_63 ", " MOK_WGMMA_REGS_64_95 ", " MOK_WGMMA_REGS_96_127 "}, "
#define MOK_WGMMA_8_OPERANDS(d, b)                                                          \
  "+f"(d[(b) + 0]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]), \
      "+f"(d[(b) + 5]), "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define MOK_WGMMA_32_OPERANDS(d, b)                                                                \
  MOK_WGMMA_8_OPERANDS(d, b), MOK_WGMMA_8_OPERANDS(d, (b) + 8), MOK_WGMMA_8_OPERANDS(d, (b) + 16), \
      MOK_WGMMA_8_OPERANDS(d, (b) + 24)
#define MOK_WGMMA_64_ACCUMULATOR_OPERANDS(d) \
  MOK_WGMMA_32_OPERANDS(d, 0), MOK_WGMMA_32_OPERANDS(d, 32)
#define MOK_WGMMA_96_ACCUMULATOR_OPERANDS(d) \
  MOK_WGMMA_64_ACCUMULATOR_OPERANDS(d), MOK_WGMMA_32_OPERANDS(d, 64)
#define MOK_WGMMA_128_ACCUMULATOR_OPERANDS(d) \
  MOK_WGMMA_96_ACCUMULATOR_OPERANDS(d), MOK_WGMMA_32_OPERANDS(d, 96)

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256]^T, bf16 in, fp32 accumulate. kTransA / kTransB = 1
// when that operand is MN-major in shared memory (0: K-major).
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a,
                                                      uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " MOK_WGMMA_128_ACCUMULATORS
      "%128, %129, p, 1, 1, %131, %132;\n}\n"
      : MOK_WGMMA_128_ACCUMULATOR_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int32_t>(accumulate)), "n"(kTransA),
        "n"(kTransB));
}

// D[64 x 192] (+)= A[64 x 16] * B[16 x 192]^T, bf16 in, fp32 accumulate (96 registers per
// thread, the m64nN fragment layout of gemm_mainloop.cuh): the 256 x 192 tiles of
// wide_tile_gemm.cu. Per output element the same products and order as m64n256k16.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n192k16_bf16(float (&d)[96], uint64_t desc_a,
                                                      uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 " MOK_WGMMA_96_ACCUMULATORS
      "%96, %97, p, 1, 1, %99, %100;\n}\n"
      : MOK_WGMMA_96_ACCUMULATOR_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int32_t>(accumulate)), "n"(kTransA),
        "n"(kTransB));
}

// D[64 x 128] (+)= A[64 x 16] * B[16 x 128]^T into the first 64 registers of `d`: a 64-register
// accumulator (weight_grad_pingpong.cu's halves of a 128 x 128 tile), or a m64n256
// accumulator's columns 0-127 in the same fragment layout (expert_gemm.cu's 64-row tiles). Per
// output element the same products and order as m64n256k16, so the same bits.
template <int kTransA, int kTransB, int kRegisters>
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[kRegisters], uint64_t desc_a,
                                                      uint64_t desc_b, bool accumulate) {
  static_assert(kRegisters >= 64, "m64n128 fp32 accumulates into 64 registers per thread");
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MOK_WGMMA_64_ACCUMULATORS
      "%64, %65, p, 1, 1, %67, %68;\n}\n"
      : MOK_WGMMA_64_ACCUMULATOR_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int32_t>(accumulate)), "n"(kTransA),
        "n"(kTransB));
}

// D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T, e4m3 in (both K-major: wgmma's FP8 form has no
// transpose), fp32 accumulate. `accumulate` false starts from zero (the FP8 GEMM's fresh
// per-K-block tile, fp8_gemm.cu).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MOK_WGMMA_64_ACCUMULATORS
      "%64, %65, p, 1, 1;\n}\n"
      : MOK_WGMMA_64_ACCUMULATOR_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int32_t>(accumulate)));
}

// D[64 x N] (+)= A[64 x 32] * B[N x 32]^T for N = 192 and 256, e4m3 in (K-major), fp32
// accumulate: the wider FP8 tiles' wgmma (tests/gpu/test_fp8_wgmma_ceiling_gpu.cu times them
// against N = 128).
__device__ __forceinline__ void wgmma_m64n192k32_e4m3(float (&d)[96], uint64_t desc_a,
                                                      uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 " MOK_WGMMA_96_ACCUMULATORS
      "%96, %97, p, 1, 1;\n}\n"
      : MOK_WGMMA_96_ACCUMULATOR_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int32_t>(accumulate)));
}
__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float (&d)[128], uint64_t desc_a,
                                                      uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 " MOK_WGMMA_128_ACCUMULATORS
      "%128, %129, p, 1, 1;\n}\n"
      : MOK_WGMMA_128_ACCUMULATOR_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int32_t>(accumulate)));
}

// ---- register reallocation and fences ------------------------------------------------------

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// Named barrier among `thread_count` threads (a multiple of 32), id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int thread_count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(thread_count) : "memory");
}
// Arrives on the named barrier without waiting: a signal to the threads that bar.sync on it
// (arrivals and syncs together make thread_count).
__device__ __forceinline__ void named_barrier_arrive(int id, int thread_count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(thread_count) : "memory");
}

// 16 bytes from shared memory (`address` in the shared window), as an ordered (volatile) access.
__device__ __forceinline__ uint4 ld_shared_v4(const void* address) {
  uint4 value;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
               : "r"(smem_addr(address)));
  return value;
}

// ---- programmatic dependent launch (PDL) --------------------------------------------------
// A kernel launched with the programmatic-serialization attribute (kernels/common/
// overlapped_launch.h) may be resident before the previous kernel on its stream has finished;
// it must call wait_for_previous_kernel before its first access to global memory. Without the
// attribute both are no-ops, so a kernel that waits may be launched either way.

// The previous kernel has completed and its writes are visible after this.
__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The next kernel may be scheduled once every CTA of this one has called this (or exited); it
// still waits for this kernel's completion before touching memory.
__device__ __forceinline__ void let_next_kernel_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Both, as the layer's kernels begin. The next kernel is let go first, so that in a chain
// A -> B -> C the launch of C overlaps A's tail too, not only B (B may be a one-thread epoch
// advance); it cannot take an SM from A or B: it is scheduled only once every CTA of B is
// resident, and B only once every CTA of A was. Then nothing of this kernel touches memory
// before the previous one is done.
__device__ __forceinline__ void begin_after_previous_kernel() {
  let_next_kernel_launch();
  wait_for_previous_kernel();
}

// ---- fp32 arithmetic -------------------------------------------------------------------------

// min / max that return NaN when either operand is NaN (fminf / fmaxf return the other operand:
// a clamp through them turns a NaN into the limit). One FMNMX.NAN each, as fminf is one FMNMX.
__device__ __forceinline__ float min_nan(float a, float b) {
  float result;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
  return result;
}
__device__ __forceinline__ float max_nan(float a, float b) {
  float result;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
  return result;
}

// Two bf16 pairs' larger magnitude, half by half, in one HMNMX2: each half of the result is
// max(|a|, |b|) with the XOR of the inputs' signs as its sign (ignore it: take the magnitude),
// or NaN if either input is. An amax over bf16 values two at a time, with no conversion.
__device__ __forceinline__ uint32_t max_abs_bf16x2_nan(uint32_t a, uint32_t b) {
  uint32_t result;
  asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(result) : "r"(a), "r"(b));
  return result;
}

// 1 / b to about 1 ulp (MUFU.RCP), subnormals flushed: swiglu.cuh's sigmoid.
__device__ __forceinline__ float reciprocal_approx_ftz(float b) {
  float result;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(b));
  return result;
}

// 2^x, MUFU.EX2 (relative error ~2^-22; inputs and results below 2^-126 flushed to zero).
__device__ __forceinline__ float exp2_approx_ftz(float x) {
  float result;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(x));
  return result;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t time;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(time));
  return time;
}

}  // namespace mok::ptx
