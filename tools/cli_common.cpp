// Helpers of the `mok` CLI shared by its CPU and GPU paths (tools/cli.h).
#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "cli.h"
#include "mok/reference.h"

namespace mok::cli {

mok::MoeConfig config_from_options(const RunOptions& options, const mok::MoeShape& shape) {
  mok::MoeConfig config;
  if (!options.local_dispatch.empty())
    config.local_dispatch = mok::local_dispatch_from_name(options.local_dispatch);
  config.precision = mok::precision_from_name(options.precision);
  config.persistent_forward = options.persistent_forward;
  config.persistent_backward = options.persistent_backward;
  config.gemm_cta_pairs = options.cta_pairs;
  config.gemm_wide_tiles = options.wide_tiles;
  config.gemm_l2_placement = options.l2_placement;
  config.gemm_four_stages = options.four_stages;
  config.gemm_tiles_by_ticket = options.tiles_by_ticket;
  config.gemm_auto_lockstep = !options.no_auto_lockstep;
  config.gemm_expert_aligned_groups = options.aligned_groups;
  config.gemm_dgrad_half_row_tiles = options.dgrad_half_tiles;
  config.swiglu_backward_in_dgrad = options.swiglu_in_dgrad;
  config.overlap_kernel_launches = options.overlap_launches;
  if (options.padding_rows) config.skip_padding_rows = false;
  if (options.minibatch_size >= 0) config.minibatch_size = options.minibatch_size;
  if (options.tile_group >= 0) config.gemm_tile_group = options.tile_group;
  if (options.expert_groups >= 0) config.gemm_expert_groups = options.expert_groups;
  if (options.fp8_rows >= 0) config.fp8_row_tile_rows = options.fp8_rows;
  if (options.lockstep >= 0) config.gemm_lockstep_k_blocks = options.lockstep;
  if (options.macrobatch_size >= 0) config.macrobatch_size = options.macrobatch_size;
  config.ep_push_dispatch = options.push_dispatch;
  config.ep_dispatch_in_gemm = options.dispatch_in_gemm;
  config.ep_bulk_copies = options.bulk_copies;
  // The FP8 row tiles' height made explicit, so that --compare fp8-rows-192 flips what runs.
  config.fp8_row_tile_rows = mok::fp8_row_tile_rows_for(config, shape);
  mok::can_implement(config, shape).throw_if_error();
  return config;
}

RunOptions bf16_options_of(const RunOptions& options) {
  RunOptions bf16 = options;
  bf16.precision = "bf16";
  bf16.expert_groups = -1;
  bf16.fp8_rows = -1;
  return bf16;
}

const char* const kCompareKnobs[] = {"cta-pairs",
                                     "persistent-forward",
                                     "persistent-backward",
                                     "weight-grad-pingpong",
                                     "skip-padding-rows",
                                     "local-dispatch",
                                     "wide-tiles",
                                     "tile-group-N",
                                     "l2-placement",
                                     "four-stages",
                                     "lockstep-N",
                                     "tiles-by-ticket",
                                     "auto-lockstep",
                                     "aligned-groups",
                                     "dgrad-half-tiles",
                                     "expert-groups-N",
                                     "swiglu-in-dgrad",
                                     "overlap-launches",
                                     "fp8-rows-192",
                                     "fp8-wgrad-staging-2",
                                     "fp8-swiglu-in-gate-up",
                                     "fp8-swiglu-pass",
                                     "fp8-gather-in-gate-up",
                                     nullptr};

namespace {

// N of a knob named `prefix` + N (at most 4 digits), or -1 if `name` is not one.
int numbered_knob(const std::string& name, std::string_view prefix) {
  if (name.rfind(prefix, 0) != 0 || name.size() <= prefix.size() ||
      name.size() > prefix.size() + 4 ||
      name.find_first_not_of("0123456789", prefix.size()) != std::string::npos)
    return -1;
  return std::stoi(name.substr(prefix.size()));
}

}  // namespace

void set_up_compared_knob(const std::string& knob, size_t knobs,
                          const std::function<void()>& set_up) {
  try {
    set_up();
  } catch (const mok::Error& error) {
    if (error.code() != mok::ErrorCode::kOutOfMemory) throw;
    throw mok::Error(mok::ErrorCode::kOutOfMemory,
                     std::string(error.what()) + " (--compare " + knob + ": each of the " +
                         std::to_string(knobs) +
                         " compared knobs holds a layer of its own beside the layer and its "
                         "baseline; compare fewer knobs a run)");
  }
}

mok::MoeConfig flip_knob(const mok::MoeConfig& config, const std::string& name) {
  // "K1+K2+...": the knobs flipped in turn, each on the previous one's config.
  if (const size_t plus = name.find('+'); plus != std::string::npos)
    return flip_knob(flip_knob(config, name.substr(0, plus)), name.substr(plus + 1));
  mok::MoeConfig flipped = config;
  // A variant of the 128 x 256 row-tile GEMMs: flipped; turned on, it leaves out the CTA pairs
  // and the 256 x 192 tiles, which exclude it.
  auto flip_row_tile_variant = [&](bool mok::MoeConfig::*knob) {
    flipped.*knob = !(config.*knob);
    if (flipped.*knob) {
      flipped.gemm_cta_pairs = false;
      flipped.gemm_wide_tiles = false;
    }
  };
  if (name == "cta-pairs") {
    flipped.gemm_cta_pairs = !config.gemm_cta_pairs;
    if (flipped.gemm_cta_pairs) {  // they exclude each other
      flipped.gemm_wide_tiles = false;
      flipped.gemm_tiles_by_ticket = false;
      flipped.gemm_lockstep_k_blocks = 0;
      flipped.gemm_l2_placement = false;
      flipped.gemm_four_stages = false;
    }
  } else if (name == "persistent-forward") {
    flipped.persistent_forward = !config.persistent_forward;
    if (flipped.persistent_forward) flipped.gemm_wide_tiles = false;
  } else if (name == "wide-tiles") {
    flipped.gemm_wide_tiles = !config.gemm_wide_tiles;
    if (flipped.gemm_wide_tiles) {
      flipped.gemm_cta_pairs = false;
      flipped.gemm_tiles_by_ticket = false;
      flipped.persistent_forward = false;
      flipped.persistent_backward = false;
      flipped.gemm_l2_placement = false;
      flipped.gemm_four_stages = false;
      flipped.swiglu_backward_in_dgrad = false;
    }
  } else if (name == "l2-placement") {
    flipped.gemm_l2_placement = !config.gemm_l2_placement;
    if (flipped.gemm_l2_placement) {
      flipped.gemm_cta_pairs = false;
      flipped.gemm_tiles_by_ticket = false;
      flipped.gemm_wide_tiles = false;
    }
  } else if (name == "four-stages") {
    flip_row_tile_variant(&mok::MoeConfig::gemm_four_stages);
  } else if (name == "tiles-by-ticket") {
    flipped.gemm_tiles_by_ticket = !config.gemm_tiles_by_ticket;
    if (flipped.gemm_tiles_by_ticket) {  // what it excludes
      flipped.gemm_cta_pairs = false;
      flipped.gemm_l2_placement = false;
      flipped.gemm_lockstep_k_blocks = 0;
      flipped.gemm_wide_tiles = false;
    }
  } else if (name == "aligned-groups") {
    flip_row_tile_variant(&mok::MoeConfig::gemm_expert_aligned_groups);
  } else if (name == "dgrad-half-tiles") {
    flip_row_tile_variant(&mok::MoeConfig::gemm_dgrad_half_row_tiles);
  } else if (name == "swiglu-in-dgrad") {
    flipped.swiglu_backward_in_dgrad = !config.swiglu_backward_in_dgrad;
    if (flipped.swiglu_backward_in_dgrad) {  // what has no such epilogue
      flipped.persistent_backward = false;
      flipped.gemm_wide_tiles = false;
      flipped.ep_dispatch_in_gemm = false;
    }
  } else if (name == "auto-lockstep") {
    // Where it engages (dsv3) the layer runs three stages free instead; elsewhere nothing changes.
    flipped.gemm_auto_lockstep = !config.gemm_auto_lockstep;
  } else if (name == "persistent-backward") {
    flipped.persistent_backward = !config.persistent_backward;
    if (flipped.persistent_backward) {
      flipped.gemm_wide_tiles = false;
      flipped.swiglu_backward_in_dgrad = false;
    }
  } else if (name == "overlap-launches") {
    flipped.overlap_kernel_launches = !config.overlap_kernel_launches;
  } else if (name == "weight-grad-pingpong") {
    flipped.weight_grad_pingpong = !config.weight_grad_pingpong;
  } else if (name == "skip-padding-rows") {
    flipped.skip_padding_rows = !config.skip_padding_rows;
  } else if (const int group = numbered_knob(name, "tile-group-"); group >= 0) {
    // "tile-group-N" (can_implement checks its range): the expert GEMMs' walk in groups of N
    // row tiles.
    flipped.gemm_tile_group = group;
  } else if (const int most = numbered_knob(name, "expert-groups-"); most >= 0) {
    // "expert-groups-N" (FP8; 0 = off; can_implement checks the range): each expert's row
    // tiles walked in groups of their own, at most N a group.
    flipped.gemm_expert_groups = most;
  } else if (const int lead = numbered_knob(name, "lockstep-"); lead >= 0) {
    // "lockstep-N" (0 = off; can_implement checks its range): the row-tile GEMMs' CTAs kept
    // within about N K-blocks of the slowest.
    flipped.gemm_lockstep_k_blocks = lead;
    if (flipped.gemm_lockstep_k_blocks > 0) {
      flipped.gemm_cta_pairs = false;
      flipped.gemm_tiles_by_ticket = false;
    }
  } else if (name == "fp8-rows-192") {
    // FP8: the row-tile GEMMs in 192-row tiles (128 when they already are).
    flipped.fp8_row_tile_rows = config.fp8_row_tile_rows == 192 ? 128 : 192;
    if (flipped.fp8_row_tile_rows == 192) flipped.gemm_expert_groups = 0;
  } else if (name == "fp8-wgrad-staging-2") {
    // FP8: the weight gradients with two staging tiles (one when they already have two).
    flipped.fp8_weight_grad_staging_tiles = config.fp8_weight_grad_staging_tiles == 2 ? 1 : 2;
  } else if (name == "fp8-swiglu-in-gate-up") {
    // FP8: SwiGLU in the gate/up GEMM's epilogue in every forward (the pass when it already is).
    flipped.fp8_swiglu = config.fp8_swiglu == mok::Fp8SwigluPlace::kGateUp
                             ? mok::Fp8SwigluPlace::kPass
                             : mok::Fp8SwigluPlace::kGateUp;
  } else if (name == "fp8-swiglu-pass") {
    // FP8: SwiGLU as a pass of its own in every forward (the default place when it already is).
    flipped.fp8_swiglu = config.fp8_swiglu == mok::Fp8SwigluPlace::kPass
                             ? mok::Fp8SwigluPlace::kGateUpWithoutContext
                             : mok::Fp8SwigluPlace::kPass;
  } else if (name == "fp8-gather-in-gate-up") {
    // FP8: x's rows gathered and quantized by the gate/up GEMM in a forward without a context.
    flipped.fp8_gather_in_gate_up = !config.fp8_gather_in_gate_up;
  } else if (name == "local-dispatch") {
    flipped.local_dispatch = config.local_dispatch == mok::LocalDispatch::kGatherKernel
                                 ? mok::LocalDispatch::kProducerWarps
                                 : mok::LocalDispatch::kGatherKernel;
  } else {
    std::string valid;
    for (const char* const* knob = kCompareKnobs; *knob != nullptr; ++knob)
      valid += (valid.empty() ? "" : ", ") + std::string(*knob);
    throw Error(ErrorCode::kInvalidArgument,
                "--compare knob '" + name + "' is unknown; valid: " + valid);
  }
  return flipped;
}

void print_comparisons(const std::vector<Comparison>& comparisons, int name_width) {
  for (const Comparison& error : comparisons)
    std::printf("    %-*s max |err| %.3e  rel err %.3e%s\n", name_width, error.name.c_str(),
                error.max_abs, error.rel, error.finite ? "" : "  NOT FINITE");
}

void print_stages(const std::vector<mok::StageTime>& stages, int name_width) {
  for (const mok::StageTime& stage : stages) {
    if (stage.sm_clock_ghz > 0)
      std::printf("    %-*s %9.3f ms %6.2f GHz\n", name_width, stage.name.c_str(), stage.ms,
                  stage.sm_clock_ghz);
    else
      std::printf("    %-*s %9.3f ms %6s GHz\n", name_width, stage.name.c_str(), stage.ms, "?");
  }
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
FlopCount count_flop(const mok::HostProblem& problem) {
  const mok::MoeShape& shape = problem.shape;
  FlopCount count;
  for (const mok::HostRank& rank : problem.ranks)
    for (int32_t expert : rank.top_experts) count.routed_pairs += expert >= 0;
  count.forward =
      6.0 * count.routed_pairs * shape.hidden * shape.intermediate +
      6.0 * shape.num_ranks * shape.num_tokens * shape.hidden * shape.shared_intermediate;
  return count;
}

std::vector<double> interleaved_median_ms(const std::vector<std::function<void()>>& bodies,
                                          cudaStream_t stream, int rounds, int per_round,
                                          const std::function<void()>& settle) {
  std::vector<std::vector<double>> samples(bodies.size());
  std::vector<size_t> order(bodies.size());
  for (size_t body = 0; body < order.size(); ++body) order[body] = body;
  std::mt19937 shuffler(0x6d6f6b);  // fixed: every run visits the bodies in the same orders
  for (int round = 0; round < rounds; ++round) {
    if (round > 0) std::shuffle(order.begin(), order.end(), shuffler);
    for (const size_t body : order)
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

TokenSliceReference::TokenSliceReference(const mok::HostProblem& problem, int64_t check_tokens,
                                         int threads, mok::Precision precision) {
  const int64_t total = problem.shape.num_tokens;
  const int64_t count = std::min<int64_t>(total, check_tokens >= 0 ? check_tokens : 128);
  for (int64_t i = 0; i < count; ++i) tokens_.push_back(i * total / count);
  if (count == 0) return;  // no check: no copy of the weights either
  slice_ = problem.token_slice(tokens_);
  mok::reference::Options options;
  options.num_threads = threads;
  options.precision = precision;
  if (count > 0) {
    mok::reference::forward(slice_.shape, slice_.forward_args(0), options);
    mok::reference::backward(slice_.shape, slice_.backward_args(0), options);
  }
}

std::vector<Comparison> TokenSliceReference::compare(const mok::HostRank& got,
                                                     const std::string& prefix) const {
  if (tokens_.empty()) return {};
  const mok::HostRank& want = slice_.ranks[0];
  auto on_slice = [&](const std::string& name, const auto& values, const auto& expected,
                      int64_t width) {
    ErrorAccumulator acc;
    for (size_t slot = 0; slot < tokens_.size(); ++slot)
      for (int64_t col = 0; col < width; ++col)
        acc.add(value_of(values[tokens_[slot] * width + col]),
                value_of(expected[slot * width + col]));
    return acc.result(prefix + name);
  };
  const int64_t hidden = slice_.shape.hidden;
  return {on_slice("out", got.out, want.out, hidden), on_slice("d_x", got.d_x, want.d_x, hidden),
          on_slice("d_router_w", got.d_router_weights, want.d_router_weights, slice_.shape.top_k)};
}

}  // namespace mok::cli
