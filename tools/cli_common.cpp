// Helpers of the `mok` CLI shared by its CPU and GPU paths (tools/cli.h).
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "cli.h"

namespace mok::cli {

mok::MoeConfig config_from_options(const RunOptions& options, const mok::MoeShape& shape) {
  mok::MoeConfig config;
  if (!options.local_dispatch.empty())
    config.local_dispatch = mok::local_dispatch_from_name(options.local_dispatch);
  config.precision = mok::precision_from_name(options.precision);
  config.persistent_forward = options.persistent_forward;
  config.persistent_backward = options.persistent_backward;
  config.gemm_cta_pairs = options.cta_pairs;
  if (options.minibatch_size >= 0) config.minibatch_size = options.minibatch_size;
  if (options.macrobatch_size >= 0) config.macrobatch_size = options.macrobatch_size;
  config.ep_push_dispatch = options.push_dispatch;
  config.ep_bulk_copies = options.bulk_copies;
  mok::can_implement(config, shape).throw_if_error();
  return config;
}

void print_comparisons(const std::vector<Comparison>& comparisons, int name_width) {
  for (const Comparison& error : comparisons)
    std::printf("    %-*s max |err| %.3e  rel err %.3e%s\n", name_width, error.name.c_str(),
                error.max_abs, error.rel, error.finite ? "" : "  NOT FINITE");
}

double median_ms(const std::function<void()>& body, cudaStream_t stream, int warmup, int iterations,
                 const std::function<void()>& settle) {
  cudaEvent_t start, stop;
  CLI_CUDA_CHECK(cudaEventCreate(&start));
  CLI_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) body();
  std::vector<float> times;
  for (int i = 0; i < iterations; ++i) {
    if (settle) settle();
    CLI_CUDA_CHECK(cudaEventRecord(start, stream));
    body();
    CLI_CUDA_CHECK(cudaEventRecord(stop, stream));
    CLI_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CLI_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Median milliseconds of each body, timed in `rounds` rounds that visit every body in turn
// (one warm-up call, then `per_round` timed calls, each synchronized). Round r starts at body
// r: a body's place in the round changes its time by ~2% (the card's power state), so every
// body takes every place once when rounds = bodies.size().
std::vector<double> interleaved_median_ms(const std::vector<std::function<void()>>& bodies,
                                          cudaStream_t stream, int rounds, int per_round,
                                          const std::function<void()>& settle) {
  std::vector<std::vector<double>> samples(bodies.size());
  for (int round = 0; round < rounds; ++round)
    for (size_t place = 0; place < bodies.size(); ++place) {
      const size_t body = (place + round) % bodies.size();
      for (int call = 0; call < per_round; ++call)
        samples[body].push_back(median_ms(bodies[body], stream, call == 0 ? 1 : 0, 1, settle));
    }
  std::vector<double> medians;
  for (std::vector<double>& values : samples) {
    std::sort(values.begin(), values.end());
    medians.push_back(values[values.size() / 2]);
  }
  return medians;
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
