// `mok run --gpus N`: the expert-parallel layer on N GPUs of this machine, one process driving
// them (Communicator::create_all). Checks every rank's token-local outputs (out, d_x,
// d_router_weights) against the CPU reference on a slice of tokens, checks that a step is
// bitwise identical with and without the forward context, and times forward and forward +
// backward steps of the whole group beside the NCCL all-to-all baseline (bf16; none with a
// shared expert). With --precision fp8_block the group runs in FP8, checked against the
// reference's FP8 math.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"
#include "mok/reference.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#if MOK_HAS_NCCL
#include "mok/comm.h"
#include "mok/ep_layer.h"
#include "mok/testing/ep_baseline.h"
#endif

namespace mok::cli {

#if MOK_HAS_NCCL

namespace {

struct RankRun {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::unique_ptr<mok::DeviceProblem> problem;
};

}  // namespace

int run_ep(const RunOptions& options, const mok::MoeShape& shape) {
  constexpr double kTolerance = 1e-2;
  const int32_t num_ranks = shape.num_ranks;
  int device_count = 0;
  CLI_CUDA_CHECK(cudaGetDeviceCount(&device_count));
  if (device_count < num_ranks)
    throw mok::Error(mok::ErrorCode::kInvalidArgument, "--gpus " + std::to_string(num_ranks) +
                                                           ": this machine has " +
                                                           std::to_string(device_count) + " GPUs");
  const mok::RoutingKind routing = mok::routing_kind_from_name(options.routing);
  mok::HostProblem problem = mok::HostProblem::make(shape, routing, options.seed);
  const FlopCount flop = count_flop(problem);
  const int64_t routed_pairs = flop.routed_pairs;
  const double forward_flop = flop.forward / num_ranks;  // per GPU: the group's, shared

  // The reference on a slice of every rank's tokens (token-local outputs depend on that token
  // only): the single-rank equivalent holds all ranks' tokens in rank order.
  // 32 tokens per rank by default; 8 with many experts (at `dsv3` the slice's routes reach most
  // of the 256 experts, each 88 MB of weights, and the CPU reference's time grows with them).
  const int64_t default_check = shape.num_experts > 64 ? 8 : 32;
  const int64_t per_rank = std::min<int64_t>(
      shape.num_tokens, options.check_tokens >= 0 ? options.check_tokens : default_check);
  std::vector<int64_t> slice_tokens;
  for (int32_t rank = 0; rank < num_ranks; ++rank)
    for (int64_t i = 0; i < per_rank; ++i)
      slice_tokens.push_back(rank * shape.num_tokens + i * shape.num_tokens / per_rank);
  // In FP8 the layer is checked against the reference's FP8 math and the bf16 baseline against
  // its bf16 math.
  const mok::MoeConfig config = config_from_options(options, shape);
  const bool fp8 = config.precision == mok::Precision::kFP8Block;
  auto reference_slice = [&](mok::Precision precision) {
    mok::HostProblem slice = problem.reference_slice(slice_tokens);
    mok::reference::Options reference_options;
    reference_options.precision = precision;
    mok::reference::forward(slice.shape, slice.forward_args(0), reference_options);
    mok::reference::backward(slice.shape, slice.backward_args(0), reference_options);
    return slice;
  };
  const mok::HostProblem slice = reference_slice(config.precision);

  std::vector<int> devices;
  for (int32_t rank = 0; rank < num_ranks; ++rank) devices.push_back(rank);
  auto communicators = mok::Communicator::create_all(devices);
  std::vector<mok::Communicator*> ranks_here;
  for (auto& communicator : communicators) ranks_here.push_back(communicator.get());
  std::vector<RankRun> runs(static_cast<size_t>(num_ranks));
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    CLI_CUDA_CHECK(cudaSetDevice(devices[rank]));
    runs[rank].device = devices[rank];
    CLI_CUDA_CHECK(cudaStreamCreate(&runs[rank].stream));
    runs[rank].problem = std::make_unique<mok::DeviceProblem>(problem, rank);
  }
  mok::EpLayer layer(shape, config, ranks_here);
  std::unique_ptr<mok::EpBaseline> baseline;
  if (!shape.has_shared_expert()) baseline = std::make_unique<mok::EpBaseline>(shape, ranks_here);
  std::vector<cudaStream_t> streams;
  std::vector<mok::ForwardArgs> forward_args;
  std::vector<mok::BackwardArgs> backward_args;
  for (RankRun& run : runs) {
    CLI_CUDA_CHECK(cudaSetDevice(run.device));
    streams.push_back(run.stream);
    forward_args.push_back(run.problem->forward_args());
    backward_args.push_back(run.problem->backward_args());
  }
  auto forward = [&] { layer.forward(forward_args, streams); };
  // A training step of `of`: its forward, then its backward from the context or recomputing.
  auto step_of = [&](mok::EpLayer& of, bool with_context) {
    const std::vector<mok::ForwardContext> contexts = of.forward(forward_args, streams);
    of.backward(backward_args, streams, with_context ? &contexts : nullptr);
  };
  auto step = [&](bool with_context) { step_of(layer, with_context); };
  auto synchronize = [&] { layer.synchronize(streams).throw_if_error(); };

  auto synchronize_all = [&] {
    for (RankRun& run : runs) {
      CLI_CUDA_CHECK(cudaSetDevice(run.device));
      CLI_CUDA_CHECK(cudaStreamSynchronize(run.stream));
    }
    CLI_CUDA_CHECK(cudaSetDevice(runs[0].device));  // the timing's events live on rank 0's device
  };
  auto baseline_forward = [&] { baseline->forward(forward_args, streams); };
  auto baseline_step = [&] {
    baseline->forward(forward_args, streams);
    baseline->backward(backward_args, streams);
  };
  // Every rank's outputs after `run` and `wait`, poisoned before it.
  auto outputs_after = [&](const auto& run, const auto& wait) {
    for (RankRun& rank_run : runs) {
      CLI_CUDA_CHECK(cudaSetDevice(rank_run.device));
      rank_run.problem->poison_outputs();
      CLI_CUDA_CHECK(cudaDeviceSynchronize());
    }
    run();
    wait();
    std::vector<mok::HostRank> outputs;
    for (int32_t rank = 0; rank < num_ranks; ++rank) {
      CLI_CUDA_CHECK(cudaSetDevice(runs[rank].device));
      outputs.push_back(mok::output_buffers(shape));
      runs[rank].problem->download_outputs(outputs.back());
    }
    return outputs;
  };
  // Correctness: a step with the context, one recomputing, and the baseline's.
  std::vector<std::vector<mok::HostRank>> results;
  results.push_back(outputs_after([&] { step(true); }, synchronize));
  results.push_back(outputs_after([&] { step(false); }, synchronize));
  if (baseline) results.push_back(outputs_after(baseline_step, synchronize_all));
  bool deterministic = true;
  for (int32_t rank = 0; rank < num_ranks; ++rank)
    deterministic &= mok::outputs_equal(results[0][rank], results[1][rank]);
  // The communication inside the GEMMs flipped (MoeConfig::ep_dispatch_in_gemm, where the config
  // allows it: bf16, the producer-warps local dispatch): a step of its own layer, checked
  // bitwise against the layer's, then timed beside it.
  mok::MoeConfig in_gemm_config = config;
  in_gemm_config.ep_dispatch_in_gemm = !config.ep_dispatch_in_gemm;
  if (in_gemm_config.ep_dispatch_in_gemm) in_gemm_config.ep_push_dispatch = false;
  std::unique_ptr<mok::EpLayer> in_gemm_layer;
  bool in_gemm_bitwise = true;
  if (mok::can_implement(in_gemm_config, shape).ok()) {
    in_gemm_layer = std::make_unique<mok::EpLayer>(shape, in_gemm_config, ranks_here);
    const std::vector<mok::HostRank> got =
        outputs_after([&] { step_of(*in_gemm_layer, true); },
                      [&] { in_gemm_layer->synchronize(streams).throw_if_error(); });
    for (int32_t rank = 0; rank < num_ranks; ++rank)
      in_gemm_bitwise &= mok::outputs_equal(got[rank], results[0][rank]);
  }
  // Token-local outputs of `got` (one entry per rank) against the reference slice.
  auto slice_errors = [&](const std::vector<mok::HostRank>& got, const mok::HostProblem& against,
                          const std::string& who) {
    ErrorAccumulator out_error, dx_error, drw_error;
    const mok::HostRank& want = against.ranks[0];
    const int64_t H = shape.hidden, K = shape.top_k;
    for (size_t i = 0; i < slice_tokens.size(); ++i) {
      const int64_t rank = slice_tokens[i] / shape.num_tokens;
      const int64_t token = slice_tokens[i] % shape.num_tokens;
      const mok::HostRank& mine = got[rank];
      for (int64_t c = 0; c < H; ++c) {
        out_error.add(value_of(mine.out[token * H + c]), value_of(want.out[i * H + c]));
        dx_error.add(value_of(mine.d_x[token * H + c]), value_of(want.d_x[i * H + c]));
      }
      for (int64_t k = 0; k < K; ++k)
        drw_error.add(mine.d_router_weights[token * K + k], want.d_router_weights[i * K + k]);
    }
    return std::vector<Comparison>{out_error.result(who + " out"), dx_error.result(who + " d_x"),
                                   drw_error.result(who + " d_router_weights")};
  };
  std::vector<Comparison> errors = slice_errors(results[0], slice, fp8 ? "mok fp8" : "mok");
  if (baseline) {
    const mok::HostProblem bf16_slice = fp8 ? reference_slice(mok::Precision::kBF16) : slice;
    for (const Comparison& error : slice_errors(results[2], bf16_slice, "baseline"))
      errors.push_back(error);
  }

  // Interleaved rounds in shuffled orders (the cards run into their power limit: docs/perf.md).
  // The layer with the bulk-copy data movement (same bits, see the tests), timed beside it.
  // And the other dispatch (push against pull, measured before push becomes the default).
  mok::MoeConfig bulk_config = config;
  bulk_config.ep_bulk_copies = !config.ep_bulk_copies;
  mok::EpLayer bulk_layer(shape, bulk_config, ranks_here);
  mok::MoeConfig push_config = config;
  push_config.ep_push_dispatch = !config.ep_push_dispatch;
  if (push_config.ep_push_dispatch) push_config.ep_dispatch_in_gemm = false;  // a pull
  mok::EpLayer push_layer(shape, push_config, ranks_here);
  std::vector<std::function<void()>> bodies = {forward, [&] { step(true); },
                                               [&] { bulk_layer.forward(forward_args, streams); },
                                               [&] { push_layer.forward(forward_args, streams); }};
  const size_t in_gemm_index = bodies.size();
  if (in_gemm_layer) {
    bodies.push_back([&] { in_gemm_layer->forward(forward_args, streams); });
    bodies.push_back([&] { step_of(*in_gemm_layer, true); });
  }
  const size_t baseline_index = bodies.size();
  if (baseline) {
    bodies.push_back(baseline_forward);
    bodies.push_back(baseline_step);
  }
  // Timed on rank 0's stream; every rank finishes before each timed call.
  CLI_CUDA_CHECK(cudaSetDevice(runs[0].device));
  const std::vector<double> medians = interleaved_median_ms(
      bodies, runs[0].stream, static_cast<int>(bodies.size()), 5, synchronize_all);
  const double forward_ms = medians[0], step_ms = medians[1];
  const double bulk_forward_ms = medians[2], push_forward_ms = medians[3];
  const double in_gemm_forward_ms = in_gemm_layer ? medians[in_gemm_index] : 0,
               in_gemm_step_ms = in_gemm_layer ? medians[in_gemm_index + 1] : 0;
  const double base_forward_ms = baseline ? medians[baseline_index] : 0,
               base_step_ms = baseline ? medians[baseline_index + 1] : 0;

  bool passed = deterministic && in_gemm_bitwise;
  for (const Comparison& error : errors) passed &= error.finite && error.rel <= kTolerance;
  std::printf(
      "mok run: expert-parallel forward and backward on %d GPUs (one process), %s, %s dispatch, "
      "%s copies\n",
      num_ranks, mok::precision_name(config.precision),
      config.ep_push_dispatch      ? "push"
      : config.ep_dispatch_in_gemm ? "in-GEMM pull"
                                   : "pull",
      config.ep_bulk_copies ? "bulk" : "warp");
  std::printf("  shape     %s (%s), routing %s, seed %llu\n", options.shape_name.c_str(),
              shape.to_string().c_str(), options.routing.c_str(),
              static_cast<unsigned long long>(options.seed));
  std::printf("  work      %lld routed pairs in the group, %.1f GFLOP forward per GPU\n",
              static_cast<long long>(routed_pairs), forward_flop / 1e9);
  std::printf(
      "  times on rank 0's stream, every rank launched, median of %zu rounds x 5, shuffled:\n",
      bodies.size());
  std::printf("    %-18s %10s %9s %10s %9s %8s\n", "", "mok ms", "TFLOP/s", "base ms", "TFLOP/s",
              "speedup");
  auto row = [&](const char* name, double flop, double mok_ms, double base_ms) {
    if (baseline)
      std::printf("    %-18s %10.3f %9.1f %10.3f %9.1f %7.2fx\n", name, mok_ms, flop / mok_ms / 1e9,
                  base_ms, flop / base_ms / 1e9, base_ms / mok_ms);
    else
      std::printf("    %-18s %10.3f %9.1f   (no baseline with a shared expert)\n", name, mok_ms,
                  flop / mok_ms / 1e9);
  };
  row("forward", forward_flop, forward_ms, base_forward_ms);
  row("forward+backward", 3 * forward_flop, step_ms, base_step_ms);
  std::printf("    forward with %s dispatch/combine: %.3f ms (%.1f TFLOP/s per GPU)\n",
              bulk_config.ep_bulk_copies ? "bulk-copy" : "warp-copy", bulk_forward_ms,
              forward_flop / bulk_forward_ms / 1e9);
  std::printf("    forward with %s dispatch:              %.3f ms (%.1f TFLOP/s per GPU)\n",
              push_config.ep_push_dispatch ? "push" : "pull", push_forward_ms,
              forward_flop / push_forward_ms / 1e9);
  if (in_gemm_layer)
    std::printf(
        "    %s: forward %.3f ms (%.2fx), forward+backward %.3f ms (%.2fx), bitwise equal: %s\n",
        in_gemm_config.ep_dispatch_in_gemm ? "pull and push inside the GEMMs"
                                           : "pull and push as kernels around the GEMMs",
        in_gemm_forward_ms, in_gemm_forward_ms / forward_ms, in_gemm_step_ms,
        in_gemm_step_ms / step_ms, in_gemm_bitwise ? "yes" : "NO");
  std::printf(
      "  (TFLOP/s per GPU: the group's useful FLOPs / GPUs; baseline = NCCL all-to-all with "
      "host split sizes around mok's single-GPU GEMMs, in bf16)\n");
  std::printf("  against the CPU reference%s on %lld tokens of each rank (tolerance %.0e):\n",
              fp8 ? " (mok: its FP8 math; the baseline: bf16)" : "",
              static_cast<long long>(per_rank), kTolerance);
  print_comparisons(errors, 18);
  std::printf("  bitwise identical with and without the forward context, every rank: %s\n",
              deterministic ? "yes" : "NO");
  std::printf("%s\n", passed ? "PASS" : "FAIL");
  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    json << "{\"gpus\": " << num_ranks << ", \"shape_name\": \"" << options.shape_name
         << "\", \"shape\": \"" << shape.to_string() << "\", \"precision\": \""
         << mok::precision_name(config.precision) << "\", \"routing\": \"" << options.routing
         << "\", \"forward_ms\": " << forward_ms << ", \"forward_backward_ms\": " << step_ms
         << ", \"push_dispatch\": " << (config.ep_push_dispatch ? "true" : "false")
         << ", \"bulk_copies\": " << (config.ep_bulk_copies ? "true" : "false")
         << ", \"macrobatch_size\": " << config.macrobatch_size
         << ", \"other_copies_forward_ms\": " << bulk_forward_ms
         << ", \"other_dispatch_forward_ms\": " << push_forward_ms
         << ", \"dispatch_in_gemm\": " << (config.ep_dispatch_in_gemm ? "true" : "false")
         << ", \"other_in_gemm_forward_ms\": " << in_gemm_forward_ms
         << ", \"other_in_gemm_forward_backward_ms\": " << in_gemm_step_ms
         << ", \"other_in_gemm_bitwise\": " << (in_gemm_bitwise ? "true" : "false")
         << ", \"baseline_forward_ms\": " << base_forward_ms
         << ", \"baseline_forward_backward_ms\": " << base_step_ms
         << ", \"forward_tflops_per_gpu\": " << forward_flop / forward_ms / 1e9
         << ", \"errors\": {";
    for (size_t i = 0; i < errors.size(); ++i)
      json << (i ? ", " : "") << "\"" << errors[i].name << "\": " << errors[i].rel;
    json << "}, \"deterministic\": " << (deterministic ? "true" : "false")
         << ", \"passed\": " << (passed ? "true" : "false") << "}\n";
  }
  for (RankRun& run : runs) {
    cudaSetDevice(run.device);
    cudaStreamDestroy(run.stream);
  }
  return passed ? 0 : 1;
}

#else

int run_ep(const RunOptions&, const mok::MoeShape&) {
  throw mok::Error(mok::ErrorCode::kUnsupported,
                   "--gpus: this mok was built without NCCL (set MOK_NCCL_HOME and rebuild)");
}

#endif

}  // namespace mok::cli
