// The probe half of mok/testing/l2_partitions.h.
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

#include "layer/cuda_buffer.h"
#include "mok/testing/l2_partitions.h"
#include "testing/bench_device.h"

namespace mok {

namespace {

constexpr int32_t kChaseOps = 16;
// Words between probed lines: 36,992 bytes, an odd multiple of 128-byte lines, so the lines
// fall on many L2 slices of both partitions.
constexpr int32_t kLineStrideWords = 9248;
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
    uint32_t* address = lines + static_cast<int64_t>(line) * kLineStrideWords;
    uint32_t offset = add_zero_at_home(address);  // the line into L2
    const long long start = clock64();
    for (int32_t r = 0; r < kChaseOps; ++r) offset = add_zero_at_home(address + offset);
    const long long stop = clock64();
    latency[blockIdx.x * kL2ProbeLines + line] =
        static_cast<uint32_t>((stop - start) / kChaseOps) + offset;  // offset is 0
  }
}

}  // namespace

L2PartitionMap probe_l2_partitions() {
  const int sms = current_sm_count();
  cuda_check(cudaFuncSetAttribute(probe_l2_latency_kernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, kOneCtaPerSmBytes),
             "cudaFuncSetAttribute(probe_l2_latency_kernel)");
  DeviceBuffer lines(int64_t{kL2ProbeLines} * kLineStrideWords * 4, "L2 probe lines");
  DeviceBuffer latency(int64_t{sms} * kL2ProbeLines * 4, "L2 probe latencies");
  DeviceBuffer ids(int64_t{sms} * 4, "L2 probe SM ids");
  cuda_check(cudaMemset(lines.pointer, 0, static_cast<size_t>(lines.bytes)), "cudaMemset");
  probe_l2_latency_kernel<<<sms, 32, kOneCtaPerSmBytes>>>(
      lines.as<uint32_t>(), latency.as<uint32_t>(), ids.as<int32_t>());
  cuda_check(cudaGetLastError(), "probe_l2_latency_kernel launch");
  std::vector<uint32_t> host_latency(static_cast<size_t>(sms) * kL2ProbeLines);
  std::vector<int32_t> host_ids(sms);
  cuda_check(cudaMemcpy(host_latency.data(), latency.pointer, host_latency.size() * 4,
                        cudaMemcpyDeviceToHost),
             "L2 probe latencies");
  cuda_check(cudaMemcpy(host_ids.data(), ids.pointer, host_ids.size() * 4, cudaMemcpyDeviceToHost),
             "L2 probe SM ids");
  return cluster_l2_partitions(host_ids, host_latency);
}

}  // namespace mok
