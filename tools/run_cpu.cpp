// `mok run` on the CPU: the reference of the whole layer, forward and backward, with R-rank
// expert-parallel emulation, checked against the independent fp64 oracle (on a slice of tokens
// when the full check would be too slow), with time, errors and a determinism hash of every
// output. Where a GPU is present (and the run is multi-rank or --cpu), it also builds every
// rank's schedule on the GPU and checks it bit for bit against the host builder.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "mok/reference.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "mok/testing/host_problem.h"

namespace mok::cli {

namespace {

constexpr double kOracleRelTolerance = 5e-3;  // reference vs the bf16-rounding fp64 oracle
constexpr double kCheckFlopBudget = 1e10;     // fp64 oracle work the check may spend

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
  // fp32 copies of one expert's weights and transposes, the routed rows' fp32 activations, the
  // bf16 combine / dx slots of every pair, and the pulled x and d_out rows.
  const int64_t reference = 4 * (6 * I * H + rows * (2 * H + 6 * I)) + 2 * rows * H * 2 +
                            2 * shape.num_ranks * shape.num_tokens * H * 2;
  const int64_t oracle =
      8 * 2 * (3 * shape.num_experts * I * H + 3 * shape.shared_intermediate * H);
  return mok::HostProblem::bytes_needed(shape) + reference + oracle;
}

// Refuses a shape that would not fit, naming the sizes and a --experts that would.
void check_fits_in_memory(const mok::MoeShape& shape, const std::string& shape_name) {
  const int64_t needed = run_memory_bytes(shape);
  const int64_t available = available_memory_bytes();
  if (needed <= available * 85 / 100) return;
  mok::MoeShape smaller = shape;
  while (smaller.num_experts > smaller.num_ranks &&
         run_memory_bytes(smaller) > available * 85 / 100)
    smaller.num_experts = std::max<int64_t>(
        smaller.num_ranks, smaller.num_experts / 2 / smaller.num_ranks * smaller.num_ranks);
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
  for (const mok::HostRank& rank : problem.ranks)
    mok::for_each_output_field(
        [&](const char*, auto member) { hash = hash_vector(hash, rank.*member); });
  return hash;
}

// Checks the reference's outputs (of the R = 1 equivalent `single`) against the fp64 oracle on
// `tokens`; weight gradients only when every token is checked.
std::vector<Comparison> check_against_oracle(const mok::HostProblem& single,
                                             const std::vector<int64_t>& tokens) {
  const mok::MoeShape& shape = single.shape;
  const int64_t H = shape.hidden, K = shape.top_k;
  const bool all_tokens = static_cast<int64_t>(tokens.size()) == shape.num_tokens;
  const mok::HostProblem slice = all_tokens ? mok::HostProblem{} : single.token_slice(tokens);
  const mok::HostProblem& checked = all_tokens ? single : slice;
  const mok::oracle::Outputs want =
      mok::oracle::run(checked.shape, checked.to_oracle_inputs(), /*round_like_kernel=*/true);
  const mok::HostRank& got = single.ranks[0];

  std::vector<Comparison> results;
  auto per_token = [&](const std::string& name, const auto& values,
                       const std::vector<double>& expected, int64_t width) {
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
    auto whole = [&](const std::string& name, const std::vector<mok::bf16>& values,
                     const std::vector<double>& expected) {
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

// The FP8 run against the bf16 reference on the same problem: every output's relative error
// and cosine similarity (the bounds of docs/design.md, "FP8").
constexpr double kFp8RelBound = 8e-2, kFp8CosineBound = 0.996;

struct Fp8Comparison {
  std::string name;
  double rel = 0, cosine = 1;
  bool finite = true;
};

std::vector<Fp8Comparison> compare_with_bf16(const mok::HostProblem& fp8,
                                             const mok::HostProblem& bf16) {
  std::vector<Fp8Comparison> results;
  mok::for_each_output_field([&](const char* name, auto member) {
    double diff = 0, norm = 0, got_norm = 0, dot = 0;
    bool finite = true, any = false;
    for (size_t r = 0; r < fp8.ranks.size(); ++r) {
      const auto& got = fp8.ranks[r].*member;
      const auto& want = bf16.ranks[r].*member;
      for (size_t i = 0; i < want.size(); ++i) {
        const double a = value_of(got[i]), b = value_of(want[i]);
        finite &= std::isfinite(a);
        diff += (a - b) * (a - b);
        norm += b * b;
        got_norm += a * a;
        dot += a * b;
        any = true;
      }
    }
    if (any)
      results.push_back({name, std::sqrt(diff / norm), dot / std::sqrt(norm * got_norm), finite});
  });
  return results;
}

struct GpuScheduleCheck {
  bool ran = false;
  std::string device;
  std::string note;  // why it did not run, or the first difference
  bool identical = false;
  double microseconds_per_build = 0;  // median over launches, all ranks' schedules
};

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
  CLI_CUDA_CHECK(
      cudaMemcpy(routing_device, routing.data(), routing.size() * 4, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CLI_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CLI_CUDA_CHECK(cudaEventCreate(&start));
  CLI_CUDA_CHECK(cudaEventCreate(&stop));

  check.identical = true;
  std::vector<double> times_us;
  for (int32_t rank = 0; rank < shape.num_ranks && check.identical; ++rank) {
    const mok::ScheduleParams params = mok::schedule_params(shape, rank);
    const mok::ScheduleLayout layout = mok::ScheduleLayout::make(params);
    std::vector<char> host(layout.output_bytes), from_device(layout.output_bytes);
    mok::build_schedule_host(layout, routing.data(), mok::DType::kInt32, host.data());
    void* buffer = nullptr;
    CLI_CUDA_CHECK(cudaMalloc(&buffer, layout.total_bytes));
    CLI_CUDA_CHECK(
        cudaMemset(buffer, 0xAB, layout.total_bytes));  // poison: every output must be written
    for (int launch = 0; launch < 21; ++launch) {
      CLI_CUDA_CHECK(cudaEventRecord(start, stream));
      mok::launch_build_schedule(layout, routing_device, mok::DType::kInt32, buffer, stream)
          .throw_if_error();
      CLI_CUDA_CHECK(cudaEventRecord(stop, stream));
      CLI_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CLI_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (launch > 0) times_us.push_back(ms * 1e3);
    }
    CLI_CUDA_CHECK(
        cudaMemcpy(from_device.data(), buffer, layout.output_bytes, cudaMemcpyDeviceToHost));
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

}  // namespace

// `mok run --precision fp8_block` on the CPU: the FP8 reference against the bf16 reference of
// the same problem (the fp64 oracle computes the bf16 layer, so it checks the bf16 run only).
int report_fp8_run(const RunOptions& options, const mok::MoeShape& shape, mok::RoutingKind routing,
                   const mok::HostProblem& fp8_problem, uint64_t hash, double forward_s,
                   double backward_s) {
  mok::HostProblem bf16_problem = mok::HostProblem::make(shape, routing, options.seed);
  mok::reference::Options bf16_options;
  bf16_options.num_threads = options.threads;
  mok::reference::forward_ep(shape, bf16_problem.all_forward_args(), bf16_options);
  mok::reference::backward_ep(shape, bf16_problem.all_backward_args(), bf16_options);
  const std::vector<Fp8Comparison> results = compare_with_bf16(fp8_problem, bf16_problem);
  bool passed = true;
  std::printf(
      "mok run: CPU reference of the MoE layer in FP8 (e4m3, 1x128 / 128x128 block "
      "scales)\n");
  std::printf("  shape     %s (%s), routing %s, seed %llu\n", options.shape_name.c_str(),
              shape.to_string().c_str(), options.routing.c_str(),
              static_cast<unsigned long long>(options.seed));
  std::printf("  forward %.3f s, backward %.3f s\n", forward_s, backward_s);
  std::printf("  against the bf16 reference (bounds: rel err %.0e, cosine %.3f):\n", kFp8RelBound,
              kFp8CosineBound);
  std::printf("  %-18s %12s %12s\n", "output", "rel err", "cosine");
  for (const Fp8Comparison& c : results) {
    const bool ok = c.finite && c.rel <= kFp8RelBound && c.cosine >= kFp8CosineBound;
    passed &= ok;
    std::printf("  %-18s %12.3e %12.6f%s\n", c.name.c_str(), c.rel, c.cosine,
                ok ? "" : "  OUT OF BOUNDS");
  }
  std::printf("  determinism hash of all outputs: %016llx\n",
              static_cast<unsigned long long>(hash));
  std::printf("%s\n", passed ? "PASS" : "FAIL");
  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    if (!json)
      throw Error(ErrorCode::kInvalidArgument,
                  "--json " + options.json_path + ": cannot open the file for writing");
    json << "{\"precision\": \"fp8_block\", \"shape\": \"" << shape.to_string()
         << "\", \"passed\": " << (passed ? "true" : "false") << ", \"hash\": \"" << std::hex
         << hash << std::dec << "\", \"against_bf16\": {";
    for (size_t i = 0; i < results.size(); ++i)
      json << (i ? ", " : "") << "\"" << results[i].name << "\": {\"rel\": " << results[i].rel
           << ", \"cosine\": " << results[i].cosine << "}";
    json << "}}\n";
  }
  return passed ? 0 : 1;
}

int run_cpu(const RunOptions& options, const mok::MoeShape& shape) {
  const mok::RoutingKind routing = mok::routing_kind_from_name(options.routing);
  check_fits_in_memory(shape, options.shape_name);
  mok::reference::Options reference_options;
  reference_options.num_threads = options.threads;
  reference_options.precision = mok::precision_from_name(options.precision);
  const bool fp8 = reference_options.precision == mok::Precision::kFP8Block;

  const int64_t pairs_per_group = shape.num_ranks * shape.num_tokens * shape.top_k;
  mok::HostProblem problem = mok::HostProblem::make(shape, routing, options.seed);
  const FlopCount flop = count_flop(problem);
  const int64_t routed_pairs = flop.routed_pairs;
  const double forward_flop = flop.forward;

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
  if (fp8) return report_fp8_run(options, shape, routing, problem, hash, forward_s, backward_s);

  // The oracle checks the R = 1 equivalent; the reference's R-rank outputs equal it bitwise
  // (tests/cpu/test_ep_emulation.cpp), so check the single-rank run's outputs after running it.
  mok::HostProblem single =
      shape.num_ranks == 1 ? std::move(problem) : problem.single_rank_equivalent();
  if (shape.num_ranks > 1) {
    single.poison_outputs();
    mok::reference::forward(single.shape, single.forward_args(0), reference_options);
    mok::reference::backward(single.shape, single.backward_args(0), reference_options);
  }
  const int64_t total_tokens = single.shape.num_tokens;
  const double oracle_flop_per_token = 18.0 * shape.top_k * shape.hidden * shape.intermediate +
                                       18.0 * shape.hidden * shape.shared_intermediate + 1;
  int64_t check_count =
      options.check_tokens >= 0
          ? std::min(options.check_tokens, total_tokens)
          : std::min<int64_t>(total_tokens,
                              std::max<int64_t>(1, kCheckFlopBudget / oracle_flop_per_token));
  std::vector<int64_t> check_tokens;
  for (int64_t i = 0; i < check_count; ++i) check_tokens.push_back(i * total_tokens / check_count);
  const std::vector<Comparison> errors =
      check_tokens.empty() ? std::vector<Comparison>{} : check_against_oracle(single, check_tokens);
  bool passed = true;
  for (const Comparison& error : errors) passed &= error.finite && error.rel <= kOracleRelTolerance;

  const GpuScheduleCheck gpu = check_gpu_schedule(shape.num_ranks == 1 ? single : problem);
  if (gpu.ran) passed &= gpu.identical;

  std::printf("mok run: CPU reference of the MoE layer%s\n",
              gpu.ran ? (" (GPU " + gpu.device +
                         " found, but the multi-GPU layer is not built yet or --cpu "
                         "was given: the group is emulated on the CPU; the GPU builds the "
                         "schedule)")
                            .c_str()
                      : (", on the CPU: " + gpu.note).c_str());
  std::printf("  shape     %s (%s), routing %s, seed %llu\n", options.shape_name.c_str(),
              shape.to_string().c_str(), options.routing.c_str(),
              static_cast<unsigned long long>(options.seed));
  std::printf("  work      %lld of %lld slots routed, %.2f GFLOP forward, %.2f GFLOP backward\n",
              static_cast<long long>(routed_pairs), static_cast<long long>(pairs_per_group),
              forward_flop / 1e9, 2 * forward_flop / 1e9);
  std::printf("  %-10s %10s %10s\n", "step", "time (s)", "GFLOP/s");
  std::printf("  %-10s %10.3f %10.1f\n", "forward", forward_s, forward_flop / forward_s / 1e9);
  std::printf("  %-10s %10.3f %10.1f\n", "backward", backward_s,
              2 * forward_flop / backward_s / 1e9);
  std::printf("  check against the fp64 oracle on %lld of %lld tokens%s (tolerance %.0e):\n",
              static_cast<long long>(check_count), static_cast<long long>(total_tokens),
              check_count == total_tokens ? "" : ", weight gradients need all tokens: not compared",
              kOracleRelTolerance);
  std::printf("  %-18s %12s %12s\n", "output", "max |err|", "rel err");
  for (const Comparison& error : errors)
    std::printf("  %-18s %12.3e %12.3e%s\n", error.name.c_str(), error.max_abs, error.rel,
                !error.finite                     ? "  NOT FINITE"
                : error.rel > kOracleRelTolerance ? "  TOO LARGE"
                                                  : "");
  if (gpu.ran)
    std::printf("  GPU schedule (%s): %s, %.1f us per build (median)\n", gpu.device.c_str(),
                gpu.identical ? "bit-identical to the host's for every rank"
                              : ("DIFFERS: " + gpu.note).c_str(),
                gpu.microseconds_per_build);
  std::printf("  determinism hash of all outputs: %016llx\n",
              static_cast<unsigned long long>(hash));
  std::printf("%s\n", passed ? "PASS" : "FAIL");

  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    if (!json)
      throw Error(ErrorCode::kInvalidArgument,
                  "--json " + options.json_path + ": cannot open for writing");
    json << "{\n  \"device\": \"cpu\",\n  \"gpu\": \""
         << json_escape(gpu.ran ? gpu.device : gpu.note) << "\",\n"
         << "  \"shape_name\": \"" << options.shape_name << "\",\n"
         << "  \"shape\": {\"tokens\": " << shape.num_tokens << ", \"hidden\": " << shape.hidden
         << ", \"intermediate\": " << shape.intermediate << ", \"experts\": " << shape.num_experts
         << ", \"top_k\": " << shape.top_k << ", \"ranks\": " << shape.num_ranks
         << ", \"shared_intermediate\": " << shape.shared_intermediate << "},\n"
         << "  \"routing\": \"" << options.routing << "\", \"seed\": " << options.seed << ",\n"
         << "  \"routed_pairs\": " << routed_pairs << ", \"forward_gflop\": " << forward_flop / 1e9
         << ",\n"
         << "  \"forward_s\": " << forward_s << ", \"backward_s\": " << backward_s << ",\n"
         << "  \"checked_tokens\": " << check_count << ",\n  \"errors\": {";
    for (size_t i = 0; i < errors.size(); ++i)
      json << (i ? ", " : "") << "\"" << errors[i].name << "\": {\"max_abs\": " << errors[i].max_abs
           << ", \"rel\": " << errors[i].rel
           << ", \"finite\": " << (errors[i].finite ? "true" : "false") << "}";
    json << "},\n";
    if (gpu.ran)
      json << "  \"gpu_schedule\": {\"identical\": " << (gpu.identical ? "true" : "false")
           << ", \"us_per_build\": " << gpu.microseconds_per_build << "},\n";
    char hash_text[17];
    std::snprintf(hash_text, sizeof(hash_text), "%016llx", static_cast<unsigned long long>(hash));
    json << "  \"hash\": \"" << hash_text << "\",\n  \"passed\": " << (passed ? "true" : "false")
         << "\n}\n";
  }
  return passed ? 0 : 1;
}

}  // namespace mok::cli
