// Programmatic dependent launch (PDL), host side: a launch that lets the kernel's CTAs become
// resident and run their prologue while the previous kernel on the stream finishes, instead of
// after it. The kernel must call ptx::wait_for_previous_kernel (ptx.cuh) before its first access
// to global memory; then its results are those of plain stream order, with less of the launch's
// latency between the two kernels. Kernels that wait may also be launched plainly (`overlap`
// false): the wait is then a no-op. Compiled by nvcc (a template over the kernel's parameters).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/common/kernel_stream.h"

namespace mok::kernels {

// `kernel`<<<grid, block, shared_bytes, on.stream>>>(args...), overlapped with the previous
// kernel when on.overlap is set; `cluster_x` > 1 launches clusters of that many CTAs along x.
template <typename... Params, typename... Args>
cudaError_t launch_maybe_overlapped(void (*kernel)(Params...), dim3 grid, dim3 block,
                                    size_t shared_bytes, KernelStream on, unsigned cluster_x,
                                    Args... args) {
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (on.overlap) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster_x > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = cluster_x;
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = on.stream;
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace mok::kernels
