#include "kernels/common/kernel_preload.h"

#include <mutex>
#include <utility>
#include <vector>

namespace mok::kernels {

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::pair<const char*, const void*>> kernels;
};

// A function-local static: the lists of other files register during static initialization, in
// an order C++ leaves open.
Registry& registry() {
  static Registry instance;
  return instance;
}

}  // namespace

KernelPreloadList::KernelPreloadList(const char* file, std::initializer_list<const void*> kernels) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const void* kernel : kernels) r.kernels.emplace_back(file, kernel);
}

cudaError_t preload_kernels(const char** failed_file) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [file, kernel] : r.kernels) {
    cudaFuncAttributes attributes{};
    const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
    if (status != cudaSuccess) {
      if (failed_file != nullptr) *failed_file = file;
      return status;
    }
  }
  return cudaSuccess;
}

int registered_kernel_count() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<int>(r.kernels.size());
}

}  // namespace mok::kernels
