// Helpers of the `mok` CLI shared by its CPU and GPU paths (tools/cli.h).
#include <cstdio>

#include "cli.h"

namespace mok::cli {

void print_comparisons(const std::vector<Comparison>& comparisons, int name_width) {
  for (const Comparison& error : comparisons)
    std::printf("    %-*s max |err| %.3e  rel err %.3e%s\n", name_width, error.name.c_str(),
                error.max_abs, error.rel, error.finite ? "" : "  NOT FINITE");
}

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string cuda_device_name() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return "";
  }
  cudaDeviceProp props{};
  if (cudaGetDeviceProperties(&props, 0) != cudaSuccess) return "";
  return props.name;
}

}  // namespace mok::cli
