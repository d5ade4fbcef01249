// The `mok` command-line tool: `mok run` is the project's main job (DESIGN.md section 3).
//
// Today `mok run` runs the CPU reference of the whole layer (forward and backward, with R-rank
// expert-parallel emulation), checks it against the independent fp64 oracle, and prints the
// time, the errors and a determinism hash. Where a CUDA GPU is present it also builds the
// routing schedule of every rank on the GPU and checks it bit for bit against the host's. The
// fused GPU layer joins here when it exists.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "mok/baseline_layer.h"
#include "mok/device_problem.h"
#include "mok/gpu_layer.h"
#include "mok/host_problem.h"
#include "mok/reference.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "mok/shape.h"

namespace {

using mok::Error;
using mok::ErrorCode;

constexpr double kOracleRelTolerance = 5e-3;  // reference vs the bf16-rounding fp64 oracle
constexpr double kCheckFlopBudget = 1e10;     // fp64 oracle work the check may spend

const char* kUsage = R"(mok: deterministic MoE training layer for Hopper GPUs

usage:
  mok run [options]     run the layer on a shape and check it (the main job)
  mok shapes            list the named shapes
  mok --help | --version

mok run options:
  --shape NAME                 tiny, qwen3, dsv3, dsv3_local, kimi_slice (default: dsv3_local
                               on a GPU, the single-GPU target; tiny on the CPU)
  --tokens N                   tokens per rank (default: the shape's)
  --experts E                  routed experts in the whole group (default: the shape's)
  --ranks R                    expert-parallel ranks, emulated in one process (default 1)
  --top-k K                    routing slots per token (default: the shape's)
  --shared-intermediate IS     add a shared expert of intermediate size IS (default none)
  --clamp L                    SwiGLU clamp limit (default none)
  --routing KIND               uniform (default), holes, skewed, one_expert, one_rank,
                               empty_rank, no_routes
  --seed S                     random seed of inputs and routing (default 1)
  --threads N                  CPU threads of the reference (default: all)
  --check-tokens N             tokens the fp64 oracle checks (default: all that fit a budget)
  --json FILE                  also write the results as JSON
  --cpu                        run the CPU reference even where a GPU is present

On a GPU (one rank), `mok run` runs mok's forward and the unfused cuBLAS baseline in the same
run, checks both against the CPU reference on a slice of tokens, and prints times and TFLOP/s.
Without a GPU (or with --cpu, or --ranks > 1 for now), it runs the CPU reference forward and
backward, checks it against an independent fp64 implementation, and, where a GPU is present,
checks the GPU schedule builder against the host's.
)";

struct RunOptions {
  std::string shape_name;  // empty: dsv3_local on a GPU, tiny on the CPU
  int64_t tokens = -1, experts = -1, shared_intermediate = 0;
  int32_t ranks = 1, top_k = -1, threads = 0;
  int64_t check_tokens = -1;
  float clamp = 0;
  std::string routing = "uniform";
  uint64_t seed = 1;
  std::string json_path;
  bool cpu_only = false;
};

int64_t parse_int(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    long long value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw Error(ErrorCode::kInvalidArgument, flag + " expects an integer; got '" + text + "'");
}

RunOptions parse_run_options(const std::vector<std::string>& args) {
  RunOptions options;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (flag == "--cpu") {
      options.cpu_only = true;
      continue;
    }
    if (i + 1 >= args.size())
      throw Error(ErrorCode::kInvalidArgument, "option " + flag + " needs a value (see mok --help)");
    const std::string& value = args[++i];
    if (flag == "--shape") options.shape_name = value;
    else if (flag == "--tokens") options.tokens = parse_int(flag, value);
    else if (flag == "--experts") options.experts = parse_int(flag, value);
    else if (flag == "--ranks") options.ranks = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--top-k") options.top_k = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--shared-intermediate") options.shared_intermediate = parse_int(flag, value);
    else if (flag == "--clamp") options.clamp = std::stof(value);
    else if (flag == "--routing") options.routing = value;
    else if (flag == "--seed") options.seed = static_cast<uint64_t>(parse_int(flag, value));
    else if (flag == "--threads") options.threads = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--check-tokens") options.check_tokens = parse_int(flag, value);
    else if (flag == "--json") options.json_path = value;
    else throw Error(ErrorCode::kInvalidArgument, "unknown option '" + flag + "' (see mok --help)");
  }
  return options;
}

mok::MoeShape shape_from_options(const RunOptions& options) {
  if (options.ranks < 1)
    throw Error(ErrorCode::kInvalidArgument,
                "--ranks = " + std::to_string(options.ranks) + "; valid: 1.." + std::to_string(mok::kMaxRanks));
  mok::MoeShape shape = mok::named_shape(options.shape_name, options.ranks);
  if (options.tokens >= 0) shape.num_tokens = options.tokens;
  if (options.experts >= 0) shape.num_experts = options.experts;
  if (options.top_k >= 0) shape.top_k = options.top_k;
  shape.shared_intermediate = options.shared_intermediate;
  if (options.clamp != 0) shape.swiglu_limit = options.clamp;
  mok::can_implement(shape).throw_if_error();
  return shape;
}

int64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return int64_t{16} << 30;
}

double gib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

std::string format_gb(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f GB", static_cast<double>(bytes) / 1e9);
  return text;
}

// Host memory of the whole run: the problem, the reference's working set (fp32 copies of one
// expert's weights, transposes, the routed rows), and the oracle's fp64 copy of the weights.
int64_t run_memory_bytes(const mok::MoeShape& shape) {
  const int64_t H = shape.hidden, I = shape.intermediate;
  const int64_t rows = shape.num_ranks * shape.num_tokens * shape.top_k;
  const int64_t reference = 4 * (6 * I * H + rows * (2 * H + 6 * I));
  const int64_t oracle = 8 * 2 * (3 * shape.num_experts * I * H + 3 * shape.shared_intermediate * H);
  return mok::HostProblem::bytes_needed(shape) + reference + oracle;
}

// Refuses a shape that would not fit, naming the sizes and a --experts that would.
void check_fits_in_memory(const mok::MoeShape& shape, const std::string& shape_name) {
  const int64_t needed = run_memory_bytes(shape);
  const int64_t available = available_memory_bytes();
  if (needed <= available * 85 / 100) return;
  mok::MoeShape smaller = shape;
  while (smaller.num_experts > smaller.num_ranks && run_memory_bytes(smaller) > available * 85 / 100)
    smaller.num_experts = std::max<int64_t>(smaller.num_ranks, smaller.num_experts / 2 / smaller.num_ranks * smaller.num_ranks);
  std::ostringstream message;
  message << "shape " << shape_name << " (" << shape.to_string() << ") has "
          << format_gb(mok::weight_bytes_per_rank(shape) * shape.num_ranks)
          << " of bf16 expert weights and needs about " << format_gb(needed)
          << " of host memory for the CPU reference and its check, but this machine has "
          << format_gb(available) << " available. Run fewer experts, e.g. --experts "
          << smaller.num_experts << " (about " << format_gb(run_memory_bytes(smaller)) << ")";
  throw Error(ErrorCode::kOutOfMemory, message.str());
}

uint64_t fnv1a(uint64_t hash, const void* data, size_t bytes) {
  const auto* byte = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ byte[i]) * 0x100000001b3ull;
  return hash;
}

template <typename T>
uint64_t hash_vector(uint64_t hash, const std::vector<T>& values) {
  return fnv1a(hash, values.data(), values.size() * sizeof(T));
}

// Hash of every output of every rank, in a fixed order.
uint64_t outputs_hash(const mok::HostProblem& problem) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const mok::HostRank& rank : problem.ranks) {
    hash = hash_vector(hash, rank.out);
    hash = hash_vector(hash, rank.d_x);
    hash = hash_vector(hash, rank.d_router_weights);
    for (const auto* grad : {&rank.d_w_gate, &rank.d_w_up, &rank.d_w_down, &rank.d_w_shared_gate,
                             &rank.d_w_shared_up, &rank.d_w_shared_down})
      hash = hash_vector(hash, *grad);
  }
  return hash;
}

struct Comparison {
  std::string name;
  double max_abs = 0, rel = 0;
  bool finite = true;
};

// ||got - want|| / ||want|| and the largest absolute difference, over matching elements.
struct ErrorAccumulator {
  double diff_sq = 0, ref_sq = 0, max_abs = 0;
  bool finite = true;
  void add(double got, double want) {
    if (!std::isfinite(got)) finite = false;
    diff_sq += (got - want) * (got - want);
    ref_sq += want * want;
    max_abs = std::max(max_abs, std::fabs(got - want));
  }
  Comparison result(const std::string& name) const {
    return {name, max_abs, ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq), finite};
  }
};

double value_of(const mok::bf16& value) { return mok::bf16_to_float(value); }
double value_of(float value) { return value; }

// Checks the reference's outputs (of the R = 1 equivalent `single`) against the fp64 oracle on
// `tokens`; weight gradients only when every token is checked.
std::vector<Comparison> check_against_oracle(const mok::HostProblem& single,
                                             const std::vector<int64_t>& tokens) {
  const mok::MoeShape& shape = single.shape;
  const int64_t H = shape.hidden, K = shape.top_k;
  mok::oracle::Inputs inputs = single.to_oracle_inputs();
  mok::MoeShape slice_shape = shape;
  slice_shape.num_tokens = static_cast<int64_t>(tokens.size());
  const bool all_tokens = slice_shape.num_tokens == shape.num_tokens;
  if (!all_tokens) {
    mok::oracle::Inputs sliced = inputs;
    sliced.x.clear();
    sliced.d_out.clear();
    sliced.top_experts.clear();
    sliced.router_weights.clear();
    for (int64_t token : tokens) {
      sliced.x.insert(sliced.x.end(), inputs.x.begin() + token * H, inputs.x.begin() + (token + 1) * H);
      sliced.d_out.insert(sliced.d_out.end(), inputs.d_out.begin() + token * H, inputs.d_out.begin() + (token + 1) * H);
      sliced.top_experts.insert(sliced.top_experts.end(), inputs.top_experts.begin() + token * K,
                                inputs.top_experts.begin() + (token + 1) * K);
      sliced.router_weights.insert(sliced.router_weights.end(), inputs.router_weights.begin() + token * K,
                                   inputs.router_weights.begin() + (token + 1) * K);
    }
    inputs = std::move(sliced);
  }
  const mok::oracle::Outputs want = mok::oracle::run(slice_shape, inputs, /*round_like_kernel=*/true);
  const mok::HostRank& got = single.ranks[0];

  std::vector<Comparison> results;
  auto per_token = [&](const std::string& name, const auto& values, const std::vector<double>& expected, int64_t width) {
    ErrorAccumulator acc;
    for (size_t slot = 0; slot < tokens.size(); ++slot)
      for (int64_t col = 0; col < width; ++col)
        acc.add(value_of(values[tokens[slot] * width + col]), expected[slot * width + col]);
    results.push_back(acc.result(name));
  };
  per_token("out", got.out, want.out, H);
  per_token("d_x", got.d_x, want.d_x, H);
  per_token("d_router_weights", got.d_router_weights, want.d_router_weights, K);
  if (all_tokens) {
    auto whole = [&](const std::string& name, const std::vector<mok::bf16>& values, const std::vector<double>& expected) {
      if (values.empty()) return;
      ErrorAccumulator acc;
      for (size_t i = 0; i < values.size(); ++i) acc.add(value_of(values[i]), expected[i]);
      results.push_back(acc.result(name));
    };
    whole("d_w_gate", got.d_w_gate, want.d_w_gate);
    whole("d_w_up", got.d_w_up, want.d_w_up);
    whole("d_w_down", got.d_w_down, want.d_w_down);
    whole("d_w_shared_gate", got.d_w_shared_gate, want.d_w_shared_gate);
    whole("d_w_shared_up", got.d_w_shared_up, want.d_w_shared_up);
    whole("d_w_shared_down", got.d_w_shared_down, want.d_w_shared_down);
  }
  return results;
}

struct GpuScheduleCheck {
  bool ran = false;
  std::string device;
  std::string note;  // why it did not run, or the first difference
  bool identical = false;
  double microseconds_per_build = 0;  // median over launches, all ranks' schedules
};

#define CLI_CUDA_CHECK(call)                                                                      \
  do {                                                                                            \
    cudaError_t cli_error_ = (call);                                                              \
    if (cli_error_ != cudaSuccess)                                                                \
      throw Error(ErrorCode::kCudaError, std::string(#call) + ": " + cudaGetErrorString(cli_error_)); \
  } while (0)

// Builds every rank's schedule on the GPU from the gathered routing and compares it with the
// host builder's, bit for bit; times the builds.
GpuScheduleCheck check_gpu_schedule(const mok::HostProblem& problem) {
  GpuScheduleCheck check;
  int device_count = 0;
  cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count == 0) {
    check.note = std::string("no CUDA GPU (") +
                 (status != cudaSuccess ? cudaGetErrorString(status) : "0 devices") + ")";
    cudaGetLastError();
    return check;
  }
  cudaDeviceProp props{};
  CLI_CUDA_CHECK(cudaGetDeviceProperties(&props, 0));
  check.ran = true;
  check.device = props.name;

  const mok::MoeShape& shape = problem.shape;
  std::vector<int32_t> routing;
  for (const mok::HostRank& rank : problem.ranks)
    routing.insert(routing.end(), rank.top_experts.begin(), rank.top_experts.end());
  void* routing_device = nullptr;
  CLI_CUDA_CHECK(cudaMalloc(&routing_device, std::max<size_t>(4, routing.size() * 4)));
  CLI_CUDA_CHECK(cudaMemcpy(routing_device, routing.data(), routing.size() * 4, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CLI_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CLI_CUDA_CHECK(cudaEventCreate(&start));
  CLI_CUDA_CHECK(cudaEventCreate(&stop));

  check.identical = true;
  std::vector<double> times_us;
  for (int32_t rank = 0; rank < shape.num_ranks && check.identical; ++rank) {
    mok::ScheduleParams params;
    params.num_ranks = shape.num_ranks;
    params.tokens_per_rank = static_cast<int32_t>(shape.num_tokens);
    params.top_k = shape.top_k;
    params.num_experts = static_cast<int32_t>(shape.num_experts);
    params.local_rank = rank;
    const mok::ScheduleLayout layout = mok::ScheduleLayout::make(params);
    std::vector<char> host(layout.output_bytes), from_device(layout.output_bytes);
    mok::build_schedule_host(layout, routing.data(), mok::DType::kInt32, host.data());
    void* buffer = nullptr;
    CLI_CUDA_CHECK(cudaMalloc(&buffer, layout.total_bytes));
    CLI_CUDA_CHECK(cudaMemset(buffer, 0xAB, layout.total_bytes));  // poison: every output must be written
    for (int launch = 0; launch < 21; ++launch) {
      CLI_CUDA_CHECK(cudaEventRecord(start, stream));
      mok::launch_build_schedule(layout, routing_device, mok::DType::kInt32, buffer, stream).throw_if_error();
      CLI_CUDA_CHECK(cudaEventRecord(stop, stream));
      CLI_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CLI_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (launch > 0) times_us.push_back(ms * 1e3);
    }
    CLI_CUDA_CHECK(cudaMemcpy(from_device.data(), buffer, layout.output_bytes, cudaMemcpyDeviceToHost));
    CLI_CUDA_CHECK(cudaFree(buffer));
    mok::Status same = mok::compare_schedules(layout, host.data(), from_device.data());
    if (!same.ok()) {
      check.identical = false;
      check.note = "rank " + std::to_string(rank) + ": " + same.message;
    }
  }
  std::sort(times_us.begin(), times_us.end());
  if (!times_us.empty()) check.microseconds_per_build = times_us[times_us.size() / 2];
  CLI_CUDA_CHECK(cudaEventDestroy(start));
  CLI_CUDA_CHECK(cudaEventDestroy(stop));
  CLI_CUDA_CHECK(cudaStreamDestroy(stream));
  CLI_CUDA_CHECK(cudaFree(routing_device));
  return check;
}

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') { out += "\\n"; continue; }
    out += c;
  }
  return out;
}

// A copy of rank 0 of an R = 1 problem holding only `tokens` (weights shared by value).
mok::HostProblem token_slice(const mok::HostProblem& problem, const std::vector<int64_t>& tokens) {
  mok::HostProblem slice;
  slice.shape = problem.shape;
  slice.shape.num_tokens = static_cast<int64_t>(tokens.size());
  const mok::HostRank& full = problem.ranks[0];
  mok::HostRank rank;
  const int64_t H = problem.shape.hidden, K = problem.shape.top_k;
  for (int64_t token : tokens) {
    rank.x.insert(rank.x.end(), full.x.begin() + token * H, full.x.begin() + (token + 1) * H);
    rank.d_out.insert(rank.d_out.end(), full.d_out.begin() + token * H, full.d_out.begin() + (token + 1) * H);
    rank.top_experts.insert(rank.top_experts.end(), full.top_experts.begin() + token * K,
                            full.top_experts.begin() + (token + 1) * K);
    rank.router_weights.insert(rank.router_weights.end(), full.router_weights.begin() + token * K,
                               full.router_weights.begin() + (token + 1) * K);
  }
  rank.w_gate = full.w_gate;
  rank.w_up = full.w_up;
  rank.w_down = full.w_down;
  rank.w_shared_gate = full.w_shared_gate;
  rank.w_shared_up = full.w_shared_up;
  rank.w_shared_down = full.w_shared_down;
  rank.out.resize(tokens.size() * H);
  rank.d_x.resize(tokens.size() * H);
  rank.d_router_weights.resize(tokens.size() * K);
  rank.d_w_gate.resize(full.d_w_gate.size());
  rank.d_w_up.resize(full.d_w_up.size());
  rank.d_w_down.resize(full.d_w_down.size());
  rank.d_w_shared_gate.resize(full.d_w_shared_gate.size());
  rank.d_w_shared_up.resize(full.d_w_shared_up.size());
  rank.d_w_shared_down.resize(full.d_w_shared_down.size());
  slice.ranks.push_back(std::move(rank));
  return slice;
}

double median_ms(const std::function<void()>& body, cudaStream_t stream, int warmup, int iterations) {
  cudaEvent_t start, stop;
  CLI_CUDA_CHECK(cudaEventCreate(&start));
  CLI_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) body();
  std::vector<float> times;
  for (int i = 0; i < iterations; ++i) {
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

// Relative error of a whole output (for gradients compared between two GPU runs).
template <typename T>
Comparison compare_all(const std::string& name, const std::vector<T>& got, const std::vector<T>& want) {
  ErrorAccumulator acc;
  for (size_t i = 0; i < got.size(); ++i) acc.add(value_of(got[i]), value_of(want[i]));
  return acc.result(name);
}

// The GPU path of `mok run` (one GPU): mok's forward and backward against the unfused cuBLAS
// baseline in the same run; outputs checked against the CPU reference on a slice of tokens
// (out, d_x, d_router_weights: each token's depend on that token only), weight gradients
// against the baseline's on the whole shape, mok bitwise against itself across runs.
int run_gpu_command(const RunOptions& options, const mok::MoeShape& shape, const std::string& device_name) {
  constexpr double kGpuTolerance = 1e-2;
  const mok::RoutingKind routing = mok::routing_kind_from_name(options.routing);
  mok::HostProblem problem = mok::HostProblem::make(shape, routing, options.seed);
  int64_t routed_pairs = 0;
  for (int32_t expert : problem.ranks[0].top_experts) routed_pairs += expert >= 0;
  const double forward_flop = 6.0 * routed_pairs * shape.hidden * shape.intermediate +
                              6.0 * shape.num_tokens * shape.hidden * shape.shared_intermediate;
  const double backward_flop = 2 * forward_flop;

  mok::DeviceProblem device(problem, 0);
  mok::GpuLayer layer(shape, mok::MoeConfig{});
  mok::BaselineLayer baseline(shape);
  cudaStream_t stream;
  CLI_CUDA_CHECK(cudaStreamCreate(&stream));
  const mok::ForwardArgs args = device.forward_args();
  const mok::BackwardArgs backward_args = device.backward_args();

  // Correctness first, outputs poisoned before each run: mok with the forward context, mok
  // recomputing the forward in the backward (must give the same bits), the baseline.
  std::vector<mok::HostRank> results(3, problem.ranks[0]);
  for (int run = 0; run < 3; ++run) {
    device.poison_outputs();
    if (run < 2) {
      const mok::ForwardContext context = layer.forward(args, stream);
      layer.backward(backward_args, stream, run == 0 ? &context : nullptr);
      layer.synchronize(stream).throw_if_error();
    } else {
      baseline.forward(args, stream);
      baseline.backward(backward_args, stream, /*saved_activations=*/true);
      CLI_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    device.download_outputs(results[run]);
  }
  const mok::HostRank& first = results[0];
  const mok::HostRank& second = results[1];
  auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  const bool deterministic = same(first.out, second.out) && same(first.d_x, second.d_x) &&
                             same(first.d_router_weights, second.d_router_weights) &&
                             same(first.d_w_gate, second.d_w_gate) && same(first.d_w_up, second.d_w_up) &&
                             same(first.d_w_down, second.d_w_down) && same(first.d_w_shared_gate, second.d_w_shared_gate) &&
                             same(first.d_w_shared_up, second.d_w_shared_up) &&
                             same(first.d_w_shared_down, second.d_w_shared_down);

  const int64_t total_tokens = shape.num_tokens;
  const int64_t check_count = std::min<int64_t>(total_tokens, options.check_tokens >= 0 ? options.check_tokens : 128);
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < check_count; ++i) tokens.push_back(i * total_tokens / check_count);
  mok::HostProblem slice = token_slice(problem, tokens);
  mok::reference::Options reference_options;
  reference_options.num_threads = options.threads;
  if (check_count > 0) {
    mok::reference::forward(slice.shape, slice.forward_args(0), reference_options);
    mok::reference::backward(slice.shape, slice.backward_args(0), reference_options);
  }
  const mok::HostRank& want = slice.ranks[0];
  auto compare_slice = [&](const std::string& name, const auto& got, const auto& expected, int64_t width) {
    ErrorAccumulator acc;
    for (size_t slot = 0; slot < tokens.size(); ++slot)
      for (int64_t col = 0; col < width; ++col)
        acc.add(value_of(got[tokens[slot] * width + col]), value_of(expected[slot * width + col]));
    return acc.result(name);
  };
  std::vector<Comparison> errors;
  for (int run : {0, 2}) {
    const std::string who = run == 0 ? "mok " : "baseline ";
    errors.push_back(compare_slice(who + "out", results[run].out, want.out, shape.hidden));
    errors.push_back(compare_slice(who + "d_x", results[run].d_x, want.d_x, shape.hidden));
    errors.push_back(compare_slice(who + "d_router_w", results[run].d_router_weights, want.d_router_weights, shape.top_k));
  }
  std::vector<Comparison> grad_errors = {compare_all("d_w_gate", first.d_w_gate, results[2].d_w_gate),
                                         compare_all("d_w_up", first.d_w_up, results[2].d_w_up),
                                         compare_all("d_w_down", first.d_w_down, results[2].d_w_down)};
  if (shape.has_shared_expert()) {
    grad_errors.push_back(compare_all("d_w_shared_gate", first.d_w_shared_gate, results[2].d_w_shared_gate));
    grad_errors.push_back(compare_all("d_w_shared_up", first.d_w_shared_up, results[2].d_w_shared_up));
    grad_errors.push_back(compare_all("d_w_shared_down", first.d_w_shared_down, results[2].d_w_shared_down));
  }

  // Training step timing: forward, then the backward from the forward's saved activations
  // (mok's context; the baseline keeps its permuted x and gate/up outputs as autograd would).
  const auto forward_stages = layer.profile_forward(args, stream, 10);
  const mok::ForwardContext context = layer.forward(args, stream);
  const auto backward_stages = layer.profile_backward(backward_args, stream, 10, &context);
  const double mok_forward_ms = median_ms([&] { layer.forward(args, stream); }, stream, 3, 20);
  const double mok_step_ms = median_ms(
      [&] {
        const mok::ForwardContext step = layer.forward(args, stream);
        layer.backward(backward_args, stream, &step);
      },
      stream, 3, 20);
  const double mok_recompute_ms = median_ms([&] { layer.backward(backward_args, stream); }, stream, 3, 20);
  const double base_forward_ms = median_ms([&] { baseline.forward(args, stream); }, stream, 3, 20);
  const double base_step_ms = median_ms(
      [&] {
        baseline.forward(args, stream);
        baseline.backward(backward_args, stream, true);
      },
      stream, 3, 20);
  const double mok_backward_ms = mok_step_ms - mok_forward_ms;
  const double base_backward_ms = base_step_ms - base_forward_ms;
  CLI_CUDA_CHECK(cudaStreamDestroy(stream));

  bool passed = deterministic;
  for (const Comparison& error : errors) passed &= error.finite && error.rel <= kGpuTolerance;
  for (const Comparison& error : grad_errors) passed &= error.finite && error.rel <= kGpuTolerance;
  std::printf("mok run: forward and backward on %s (EP = 1)\n", device_name.c_str());
  std::printf("  shape     %s (%s), routing %s, seed %llu\n", options.shape_name.c_str(), shape.to_string().c_str(),
              options.routing.c_str(), static_cast<unsigned long long>(options.seed));
  std::printf("  work      %lld routed pairs, %.1f GFLOP forward, %.1f GFLOP backward\n",
              static_cast<long long>(routed_pairs), forward_flop / 1e9, backward_flop / 1e9);
  std::printf("  %-22s %10s %10s %10s %10s %9s\n", "", "mok ms", "TFLOP/s", "base ms", "TFLOP/s", "speedup");
  auto row = [&](const char* name, double flop, double mok_ms, double base_ms) {
    std::printf("  %-22s %10.3f %10.1f %10.3f %10.1f %8.2fx\n", name, mok_ms, flop / mok_ms / 1e9, base_ms,
                flop / base_ms / 1e9, base_ms / mok_ms);
  };
  row("forward", forward_flop, mok_forward_ms, base_forward_ms);
  row("backward", backward_flop, mok_backward_ms, base_backward_ms);
  row("forward+backward", forward_flop + backward_flop, mok_step_ms, base_step_ms);
  std::printf("  (backward = forward+backward minus forward, both from saved activations; mok's backward\n"
              "   recomputing the forward instead: %.3f ms, %.1f TFLOP/s)\n",
              mok_recompute_ms, backward_flop / mok_recompute_ms / 1e9);
  for (const auto* stages : {&forward_stages, &backward_stages}) {
    std::printf("  mok %s stages (median of 10, events between stages):\n", stages == &forward_stages ? "forward" : "backward");
    for (const auto& [name, ms] : *stages) std::printf("    %-30s %9.3f ms\n", name.c_str(), ms);
  }
  std::printf("  against the CPU reference on %lld of %lld tokens (tolerance %.0e):\n",
              static_cast<long long>(check_count), static_cast<long long>(total_tokens), kGpuTolerance);
  for (const Comparison& error : errors)
    std::printf("    %-22s max |err| %.3e  rel err %.3e%s\n", error.name.c_str(), error.max_abs, error.rel,
                error.finite ? "" : "  NOT FINITE");
  std::printf("  mok weight gradients against the baseline's, whole shape:\n");
  for (const Comparison& error : grad_errors)
    std::printf("    %-22s max |err| %.3e  rel err %.3e%s\n", error.name.c_str(), error.max_abs, error.rel,
                error.finite ? "" : "  NOT FINITE");
  std::printf("  mok bitwise identical across runs, with and without the forward context: %s\n",
              deterministic ? "yes" : "NO");
  std::printf("%s\n", passed ? "PASS" : "FAIL");

  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    json << "{\n  \"device\": \"" << json_escape(device_name) << "\", \"shape_name\": \"" << options.shape_name
         << "\", \"shape\": \"" << shape.to_string() << "\", \"routing\": \"" << options.routing << "\",\n"
         << "  \"forward_gflop\": " << forward_flop / 1e9 << ",\n"
         << "  \"mok_ms\": {\"forward\": " << mok_forward_ms << ", \"backward\": " << mok_backward_ms
         << ", \"forward_backward\": " << mok_step_ms << ", \"backward_recompute\": " << mok_recompute_ms << "},\n"
         << "  \"baseline_ms\": {\"forward\": " << base_forward_ms << ", \"backward\": " << base_backward_ms
         << ", \"forward_backward\": " << base_step_ms << "},\n"
         << "  \"mok_tflops\": {\"forward\": " << forward_flop / mok_forward_ms / 1e9 << ", \"forward_backward\": "
         << 3 * forward_flop / mok_step_ms / 1e9 << "},\n  \"speedup\": {\"forward\": " << base_forward_ms / mok_forward_ms
         << ", \"forward_backward\": " << base_step_ms / mok_step_ms << "},\n  \"stages_ms\": {";
    bool first_stage = true;
    for (const auto* stages : {&forward_stages, &backward_stages})
      for (const auto& [name, ms] : *stages) {
        json << (first_stage ? "" : ", ") << "\"" << (stages == &forward_stages ? "fwd " : "bwd ") << name
             << "\": " << ms;
        first_stage = false;
      }
    json << "},\n  \"errors\": {";
    bool first_error = true;
    for (const auto* list : {&errors, &grad_errors})
      for (const Comparison& error : *list) {
        json << (first_error ? "" : ", ") << "\"" << error.name << "\": " << error.rel;
        first_error = false;
      }
    json << "},\n  \"deterministic\": " << (deterministic ? "true" : "false") << ", \"passed\": "
         << (passed ? "true" : "false") << "\n}\n";
  }
  return passed ? 0 : 1;
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

int run_command(RunOptions options) {
  const std::string device_name = options.cpu_only ? "" : cuda_device_name();
  if (options.shape_name.empty()) options.shape_name = device_name.empty() || options.ranks > 1 ? "tiny" : "dsv3_local";
  const mok::MoeShape shape = shape_from_options(options);
  if (!device_name.empty() && shape.num_ranks == 1) return run_gpu_command(options, shape, device_name);
  const mok::RoutingKind routing = mok::routing_kind_from_name(options.routing);
  check_fits_in_memory(shape, options.shape_name);
  mok::reference::Options reference_options;
  reference_options.num_threads = options.threads;

  const int64_t pairs_per_group = shape.num_ranks * shape.num_tokens * shape.top_k;
  mok::HostProblem problem = mok::HostProblem::make(shape, routing, options.seed);
  int64_t routed_pairs = 0;
  for (const mok::HostRank& rank : problem.ranks)
    for (int32_t expert : rank.top_experts) routed_pairs += expert >= 0;
  const double forward_flop = 6.0 * routed_pairs * shape.hidden * shape.intermediate +
                              6.0 * shape.num_ranks * shape.num_tokens * shape.hidden * shape.shared_intermediate;

  problem.poison_outputs();
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  mok::reference::forward_ep(shape, problem.all_forward_args(), reference_options);
  auto t1 = Clock::now();
  mok::reference::backward_ep(shape, problem.all_backward_args(), reference_options);
  auto t2 = Clock::now();
  const double forward_s = std::chrono::duration<double>(t1 - t0).count();
  const double backward_s = std::chrono::duration<double>(t2 - t1).count();
  const uint64_t hash = outputs_hash(problem);

  // The oracle checks the R = 1 equivalent; the reference's R-rank outputs equal it bitwise
  // (tests/cpu/test_ep_emulation.cpp), so check the single-rank run's outputs after running it.
  mok::HostProblem single = shape.num_ranks == 1 ? std::move(problem) : problem.single_rank_equivalent();
  if (shape.num_ranks > 1) {
    single.poison_outputs();
    mok::reference::forward(single.shape, single.forward_args(0), reference_options);
    mok::reference::backward(single.shape, single.backward_args(0), reference_options);
  }
  const int64_t total_tokens = single.shape.num_tokens;
  const double oracle_flop_per_token = 18.0 * shape.top_k * shape.hidden * shape.intermediate +
                                       18.0 * shape.hidden * shape.shared_intermediate + 1;
  int64_t check_count = options.check_tokens >= 0
                            ? std::min(options.check_tokens, total_tokens)
                            : std::min<int64_t>(total_tokens, std::max<int64_t>(1, kCheckFlopBudget / oracle_flop_per_token));
  std::vector<int64_t> check_tokens;
  for (int64_t i = 0; i < check_count; ++i) check_tokens.push_back(i * total_tokens / check_count);
  const std::vector<Comparison> errors = check_tokens.empty() ? std::vector<Comparison>{}
                                                              : check_against_oracle(single, check_tokens);
  bool passed = true;
  for (const Comparison& error : errors) passed &= error.finite && error.rel <= kOracleRelTolerance;

  const GpuScheduleCheck gpu = check_gpu_schedule(shape.num_ranks == 1 ? single : problem);
  if (gpu.ran) passed &= gpu.identical;

  std::printf("mok run: CPU reference of the MoE layer%s\n",
              gpu.ran ? (" (GPU " + gpu.device + " found, but the multi-GPU layer is not built yet or --cpu "
                                                 "was given: the group is emulated on the CPU; the GPU builds the "
                                                 "schedule)").c_str()
                      : (", on the CPU: " + gpu.note).c_str());
  std::printf("  shape     %s (%s), routing %s, seed %llu\n", options.shape_name.c_str(),
              shape.to_string().c_str(), options.routing.c_str(), static_cast<unsigned long long>(options.seed));
  std::printf("  work      %lld of %lld slots routed, %.2f GFLOP forward, %.2f GFLOP backward\n",
              static_cast<long long>(routed_pairs), static_cast<long long>(pairs_per_group),
              forward_flop / 1e9, 2 * forward_flop / 1e9);
  std::printf("  %-10s %10s %10s\n", "step", "time (s)", "GFLOP/s");
  std::printf("  %-10s %10.3f %10.1f\n", "forward", forward_s, forward_flop / forward_s / 1e9);
  std::printf("  %-10s %10.3f %10.1f\n", "backward", backward_s, 2 * forward_flop / backward_s / 1e9);
  std::printf("  check against the fp64 oracle on %lld of %lld tokens%s (tolerance %.0e):\n",
              static_cast<long long>(check_count), static_cast<long long>(total_tokens),
              check_count == total_tokens ? "" : ", weight gradients need all tokens: not compared",
              kOracleRelTolerance);
  std::printf("  %-18s %12s %12s\n", "output", "max |err|", "rel err");
  for (const Comparison& error : errors)
    std::printf("  %-18s %12.3e %12.3e%s\n", error.name.c_str(), error.max_abs, error.rel,
                !error.finite ? "  NOT FINITE" : error.rel > kOracleRelTolerance ? "  TOO LARGE" : "");
  if (gpu.ran)
    std::printf("  GPU schedule (%s): %s, %.1f us per build (median)\n", gpu.device.c_str(),
                gpu.identical ? "bit-identical to the host's for every rank" : ("DIFFERS: " + gpu.note).c_str(),
                gpu.microseconds_per_build);
  std::printf("  determinism hash of all outputs: %016llx\n", static_cast<unsigned long long>(hash));
  std::printf("%s\n", passed ? "PASS" : "FAIL");

  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    if (!json) throw Error(ErrorCode::kInvalidArgument, "--json " + options.json_path + ": cannot open for writing");
    json << "{\n  \"device\": \"cpu\",\n  \"gpu\": \"" << json_escape(gpu.ran ? gpu.device : gpu.note) << "\",\n"
         << "  \"shape_name\": \"" << options.shape_name << "\",\n"
         << "  \"shape\": {\"tokens\": " << shape.num_tokens << ", \"hidden\": " << shape.hidden
         << ", \"intermediate\": " << shape.intermediate << ", \"experts\": " << shape.num_experts
         << ", \"top_k\": " << shape.top_k << ", \"ranks\": " << shape.num_ranks
         << ", \"shared_intermediate\": " << shape.shared_intermediate << "},\n"
         << "  \"routing\": \"" << options.routing << "\", \"seed\": " << options.seed << ",\n"
         << "  \"routed_pairs\": " << routed_pairs << ", \"forward_gflop\": " << forward_flop / 1e9 << ",\n"
         << "  \"forward_s\": " << forward_s << ", \"backward_s\": " << backward_s << ",\n"
         << "  \"checked_tokens\": " << check_count << ",\n  \"errors\": {";
    for (size_t i = 0; i < errors.size(); ++i)
      json << (i ? ", " : "") << "\"" << errors[i].name << "\": {\"max_abs\": " << errors[i].max_abs
           << ", \"rel\": " << errors[i].rel << ", \"finite\": " << (errors[i].finite ? "true" : "false") << "}";
    json << "},\n";
    if (gpu.ran)
      json << "  \"gpu_schedule\": {\"identical\": " << (gpu.identical ? "true" : "false")
           << ", \"us_per_build\": " << gpu.microseconds_per_build << "},\n";
    char hash_text[17];
    std::snprintf(hash_text, sizeof(hash_text), "%016llx", static_cast<unsigned long long>(hash));
    json << "  \"hash\": \"" << hash_text << "\",\n  \"passed\": " << (passed ? "true" : "false") << "\n}\n";
  }
  return passed ? 0 : 1;
}

void list_shapes() {
  std::printf("%-12s %6s %6s %5s %3s %8s\n", "name", "H", "I", "E", "K", "tokens");
  for (const std::string& name : mok::named_shape_names()) {
    mok::MoeShape shape = mok::named_shape(name, 1);
    std::printf("%-12s %6lld %6lld %5lld %3d %8lld%s\n", name.c_str(), static_cast<long long>(shape.hidden),
                static_cast<long long>(shape.intermediate), static_cast<long long>(shape.num_experts), shape.top_k,
                static_cast<long long>(shape.num_tokens), name == "kimi_slice" ? "  (E = 8 per rank)" : "");
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      std::cout << kUsage;
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "--version") {
      std::printf("mok 0.1.0\n");
      return 0;
    }
    if (args[0] == "shapes") {
      list_shapes();
      return 0;
    }
    if (args[0] == "run") return run_command(parse_run_options({args.begin() + 1, args.end()}));
    throw Error(ErrorCode::kInvalidArgument, "unknown command '" + args[0] + "'; valid: run, shapes (see mok --help)");
  } catch (const Error& error) {
    std::fprintf(stderr, "mok: error (%s): %s\n", mok::error_code_name(error.code()), error.what());
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "mok: error: %s\n", error.what());
    return 2;
  }
}
