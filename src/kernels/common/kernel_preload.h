// Every mok kernel, loaded on a device before anything that waits for a peer GPU is launched.
//
// CUDA loads a kernel lazily, at its first launch on a device (CUDA_MODULE_LOADING=LAZY is the
// default, and PyTorch sets it), and that load may wait until the device is idle. In a process
// that drives several GPUs this deadlocks the expert-parallel layer: rank 0's kernel spins until
// rank 1's kernel signals, while the host thread, about to launch rank 1's kernel, first launches
// a not-yet-loaded kernel on rank 0 and waits for rank 0 to go idle. The spin ends in its
// timeout and the context is lost. Loading every kernel up front (cudaFuncGetAttributes loads
// one) removes the hidden wait; CUDA's programming guide names this remedy for lazy loading.
//
// Each kernel file lists its kernels (every template instantiation it launches) in one
// KernelPreloadList object; expert-parallel communicators call preload_kernels() on their device.
#pragma once

#include <cuda_runtime_api.h>

#include <initializer_list>

namespace mok::kernels {

// Registers the kernels of one file at static initialization.
class KernelPreloadList {
 public:
  KernelPreloadList(const char* file, std::initializer_list<const void*> kernels);
};

template <typename Kernel>
const void* kernel_symbol(Kernel* kernel) {
  return reinterpret_cast<const void*>(kernel);
}

// Loads every registered kernel on the current device; on failure returns the error and writes
// the file of the kernel that failed to *failed_file (if given).
cudaError_t preload_kernels(const char** failed_file = nullptr);

// How many kernels are registered (a test checks the lists are linked in).
int registered_kernel_count();

}  // namespace mok::kernels
