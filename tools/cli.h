// Shared pieces of the `mok` command-line tool: the options of `mok run`, error measures, and
// the two paths of `mok run` (tools/run_cpu.cpp, tools/run_gpu.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mok/config.h"
#include "mok/dtype.h"
#include "mok/error.h"
#include "mok/gpu_layer.h"
#include "mok/shape.h"
#include "mok/testing/host_problem.h"

namespace mok::cli {

struct RunOptions {
  std::string shape_name;  // empty: dsv3_local on a GPU, tiny on the CPU
  int64_t tokens = -1, experts = -1, shared_intermediate = 0;
  int32_t ranks = 1, top_k = -1, threads = 0;
  int64_t check_tokens = -1;
  float clamp = 0;
  std::string routing = "uniform";
  std::string local_dispatch;      // empty: MoeConfig's default
  std::string precision = "bf16";  // bf16, fp8_block
  uint64_t seed = 1;
  std::string json_path;
  std::string trace_path;  // GPU: trace the persistent kernels' tasks into this Chrome trace
  bool cpu_only = false;
  bool persistent_forward = false;   // GPU: MoeConfig::persistent_forward
  bool persistent_backward = false;  // GPU: MoeConfig::persistent_backward
  bool cta_pairs = false;            // GPU: MoeConfig::gemm_cta_pairs
  bool wide_tiles = false;           // GPU: MoeConfig::gemm_wide_tiles
  bool l2_placement = false;         // GPU: MoeConfig::gemm_l2_placement
  bool four_stages = false;          // GPU: MoeConfig::gemm_four_stages
  bool tiles_by_ticket = false;      // GPU: MoeConfig::gemm_tiles_by_ticket
  bool no_auto_lockstep = false;     // GPU: MoeConfig::gemm_auto_lockstep off
  bool aligned_groups = false;       // GPU: MoeConfig::gemm_expert_aligned_groups
  bool dgrad_half_tiles = false;     // GPU: MoeConfig::gemm_dgrad_half_row_tiles
  bool swiglu_in_dgrad = false;      // GPU: MoeConfig::swiglu_backward_in_dgrad
  bool overlap_launches = false;     // GPU: MoeConfig::overlap_kernel_launches
  bool padding_rows = false;         // GPU: MoeConfig::skip_padding_rows off
  bool quick = false;                // GPU, one GPU: the layer against the baseline only
  std::vector<std::string> compare;  // --quick: knobs flipped and timed beside the layer
  int32_t gpus = 0;                  // > 0: the expert-parallel layer on this many GPUs
  int64_t minibatch_size = -1;       // -1: MoeConfig's default
  int64_t macrobatch_size = -1;      // -1: MoeConfig's default
  int32_t tile_group = -1;           // -1: MoeConfig::gemm_tile_group's default
  int32_t expert_groups = -1;        // -1: MoeConfig::gemm_expert_groups's default (off)
  int32_t fp8_rows = -1;             // -1: MoeConfig::fp8_row_tile_rows's default (by shape)
  int32_t lockstep = -1;             // -1: MoeConfig::gemm_lockstep_k_blocks's default (off)
  bool push_dispatch = false;        // --gpus: MoeConfig::ep_push_dispatch
  bool dispatch_in_gemm = false;     // --gpus: MoeConfig::ep_dispatch_in_gemm
  bool bulk_copies = false;          // --gpus: MoeConfig::ep_bulk_copies
  bool once = false;                 // walk-bench: one run of each walk (for ncu)
  bool pace_sweep = false;           // walk-bench: the GEMM's walk at a range of paces
  bool fabric_probe = false;         // walk-bench: the L2 fabric probe instead of the walks
};

// The layer's config from the options (MoeConfig's defaults where unset); throws mok::Error if
// can_implement(config, shape) fails, so a bad value is reported on every path, the CPU one too.
mok::MoeConfig config_from_options(const RunOptions& options, const mok::MoeShape& shape);

// `options` in bf16 without the FP8 GPU layer's knobs (--expert-groups, --fp8-rows): the bf16
// layer an FP8 run times beside it, and the CPU reference's check of an FP8 run.
RunOptions bf16_options_of(const RunOptions& options);

// The knobs `mok run --quick --compare` flips (kCompareKnobs, null-terminated), and `config` with
// knob `name` flipped; knobs that exclude the flipped one on are turned off. Throws mok::Error
// naming the knob and the valid names if `name` is none of them.
extern const char* const kCompareKnobs[];
mok::MoeConfig flip_knob(const mok::MoeConfig& config, const std::string& name);

// Runs `set_up` (a compared knob's layer made and its first step run); an out-of-memory error
// there is rethrown saying that each compared knob holds a layer of its own, so fewer knobs a
// run fit (e.g. `dsv3_e128` in FP8 fits one beside the layer and bf16's on 80 GB).
void set_up_compared_knob(const std::string& knob, size_t knobs,
                          const std::function<void()>& set_up);

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

inline double value_of(const mok::bf16& value) { return mok::bf16_to_float(value); }
inline double value_of(float value) { return value; }

// Relative error of a whole output (two GPU runs, or a GPU run against another precision).
template <typename T>
Comparison compare_all(const std::string& name, const std::vector<T>& got,
                       const std::vector<T>& want) {
  ErrorAccumulator acc;
  for (size_t i = 0; i < got.size(); ++i) acc.add(value_of(got[i]), value_of(want[i]));
  return acc.result(name);
}

// The CPU reference (at `precision`) on `check_tokens` evenly spaced tokens of a problem (-1:
// 128): each token's out, d_x and d_router_weights depend on that token only, so a whole-shape
// GPU result is checked on them without the reference's cost for every token.
class TokenSliceReference {
 public:
  TokenSliceReference(const mok::HostProblem& problem, int64_t check_tokens, int threads,
                      mok::Precision precision);
  int64_t count() const { return static_cast<int64_t>(tokens_.size()); }
  // out, d_x and d_router_w of `got` on the slice's tokens, each name prefixed.
  std::vector<Comparison> compare(const mok::HostRank& got, const std::string& prefix) const;

 private:
  std::vector<int64_t> tokens_;
  mok::HostProblem slice_;
};

// Throws mok::Error naming the failed CUDA call.
#define CLI_CUDA_CHECK(call)                                                          \
  do {                                                                                \
    cudaError_t cli_error_ = (call);                                                  \
    if (cli_error_ != cudaSuccess)                                                    \
      throw ::mok::Error(::mok::ErrorCode::kCudaError,                                \
                         std::string(#call) + ": " + cudaGetErrorString(cli_error_)); \
  } while (0)

std::string json_escape(const std::string& text);
// Median milliseconds of `iterations` calls of `body` timed with events on `stream` after
// `warmup` calls; `settle` (optional) runs before each timed call (e.g. waits for other GPUs).
double median_ms(const std::function<void()>& body, cudaStream_t stream, int warmup, int iterations,
                 const std::function<void()>& settle = {});
// The layer's useful FLOPs over the whole group: 6 H I per routed (token, slot) pair and 6 H Is
// per token (gate, up, down); a backward is twice the forward.
struct FlopCount {
  int64_t routed_pairs = 0;
  double forward = 0;
};
FlopCount count_flop(const mok::HostProblem& problem);

// Median milliseconds of each body, in `rounds` rounds that visit every body, in a new order each
// round (a fixed-seed shuffle after the first): one warm-up, then `per_round` timed calls each.
// On a power-capped card a body's time depends on what ran just before it. With the rounds only
// rotated, each body always followed the same one, and in session 13 a forward that followed a
// training step timed ~3% slower than the same kernels after another forward (docs/perf.md).
std::vector<double> interleaved_median_ms(const std::vector<std::function<void()>>& bodies,
                                          cudaStream_t stream, int rounds, int per_round,
                                          const std::function<void()>& settle = {});
// One line per comparison: name (padded to name_width), max |err|, rel err, NOT FINITE.
void print_comparisons(const std::vector<Comparison>& comparisons, int name_width);
// One line per profiled stage: name (padded to name_width), ms, and its SM clock in GHz ("?" when
// the clock probes paired no SM).
void print_stages(const std::vector<mok::StageTime>& stages, int name_width);
// The name of CUDA device 0, or "" when there is no usable GPU.
std::string cuda_device_name();

// `mok run` on the CPU: the reference (R-rank emulation), checked against the fp64 oracle; where
// a GPU is present, also the GPU schedule builder against the host's.
int run_cpu(const RunOptions& options, const mok::MoeShape& shape);
// `mok run` on one GPU: mok's layer against the unfused baseline, checked against the reference.
int run_gpu(const RunOptions& options, const mok::MoeShape& shape, const std::string& device_name);
// The same with MoeConfig::precision = kFP8Block (run_gpu_fp8.cpp): FP8 against the CPU
// reference's FP8 and timed beside the bf16 layer.
int run_gpu_fp8(const RunOptions& options, const mok::MoeShape& shape,
                const std::string& device_name);
// `mok run --gpus N`: the expert-parallel layer on N GPUs, one process (tools/run_ep.cpp).
int run_ep(const RunOptions& options, const mok::MoeShape& shape);

}  // namespace mok::cli
