// The L2 partition probe's kernel (layer/l2_partitions.h clusters what it measures).
//
// Kernel map: one CTA per SM (its dynamic shared memory is sized so no second CTA fits), one
// thread. It records its SM id, then for each of kL2ProbeLines lines, starting at its block's
// own line so the SMs spread over them, times a chain of kChaseOps dependent atomic adds of 0
// to the line: each line holds 0, and each operation's address adds the previous one's result,
// so they cannot overlap. Atomics, not loads: an L2 partition keeps copies of the far lines its
// SMs read (the H100 whitepaper's "localizes and caches"), so after the first load every line
// would look near; an atomic is performed at the line's home slice every time.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/stages/launch.h"

namespace mok::kernels {

namespace {

constexpr int32_t kChaseOps = 16;
constexpr int32_t kOneCtaPerSmBytes = 200 * 1024;

// An atomic add of 0 at the line's home L2 slice; returns the line's value (0).
__device__ __forceinline__ uint32_t add_zero_at_home(uint32_t* address) {
  uint32_t value;
  asm volatile("atom.global.relaxed.gpu.add.u32 %0, [%1], 0;"
               : "=r"(value)
               : "l"(address)
               : "memory");
  return value;
}

__global__ void __launch_bounds__(32, 1)
    probe_l2_latency_kernel(uint32_t* lines, uint32_t* latency, int32_t* sm_of_block) {
  if (threadIdx.x != 0) return;
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  sm_of_block[blockIdx.x] = static_cast<int32_t>(sm);
  for (int32_t i = 0; i < kL2ProbeLines; ++i) {
    const int32_t line = (i + static_cast<int32_t>(blockIdx.x)) % kL2ProbeLines;
    uint32_t* address = lines + static_cast<int64_t>(line) * kL2ProbeLineStrideWords;
    uint32_t offset = add_zero_at_home(address);  // the line into L2
    const long long start = clock64();
    for (int32_t r = 0; r < kChaseOps; ++r) offset = add_zero_at_home(address + offset);
    const long long stop = clock64();
    latency[blockIdx.x * kL2ProbeLines + line] =
        static_cast<uint32_t>((stop - start) / kChaseOps) + offset;  // offset is 0
  }
}

}  // namespace

cudaError_t launch_l2_probe(uint32_t* lines, uint32_t* latency, int32_t* sm_of_block,
                            int32_t num_ctas, cudaStream_t stream) {
  const cudaError_t status = cudaFuncSetAttribute(
      probe_l2_latency_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kOneCtaPerSmBytes);
  if (status != cudaSuccess) return status;
  probe_l2_latency_kernel<<<num_ctas, 32, kOneCtaPerSmBytes, stream>>>(lines, latency, sm_of_block);
  return cudaGetLastError();
}

}  // namespace mok::kernels
