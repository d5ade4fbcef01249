// `mok run --precision fp8_block` on a GPU: the layer in FP8 against the CPU reference's FP8 math
// on a slice of tokens (out, d_x, d_router_weights, at the bf16 tolerance), bitwise across runs
// and with or without the forward context; then the FP8 and the bf16 layer timed interleaved
// (forward, and a training step from the forward's context), with the distance between them;
// with --compare, FP8 layers with a knob flipped, checked bitwise and timed beside it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cli.h"
#include "mok/gpu_layer.h"
#include "mok/reference.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"

namespace mok::cli {

int run_gpu_fp8(const RunOptions& options, const mok::MoeShape& shape,
                const std::string& device_name) {
  constexpr double kGpuTolerance = 1e-2;
  const mok::RoutingKind routing = mok::routing_kind_from_name(options.routing);
  mok::HostProblem problem = mok::HostProblem::make(shape, routing, options.seed);
  const double forward_flop = count_flop(problem).forward;

  mok::DeviceProblem device(problem, 0);
  const mok::MoeConfig config = config_from_options(options, shape);
  const mok::MoeConfig bf16_config = config_from_options(bf16_options_of(options), shape);
  mok::GpuLayer layer(shape, config), bf16_layer(shape, bf16_config);
  cudaStream_t stream;
  CLI_CUDA_CHECK(cudaStreamCreate(&stream));
  const mok::ForwardArgs args = device.forward_args();
  const mok::BackwardArgs backward_args = device.backward_args();

  // One training step of `which` (with its forward context, or recomputing it), every output
  // downloaded.
  auto step_outputs = [&](mok::GpuLayer& which, bool with_context) {
    mok::HostRank outputs = mok::output_buffers(shape);
    device.poison_outputs();
    const mok::ForwardContext context = which.forward(args, stream);
    which.backward(backward_args, stream, with_context ? &context : nullptr);
    which.synchronize(stream).throw_if_error();
    device.download_outputs(outputs);
    return outputs;
  };
  // The output of a forward that keeps no context (no backward follows): the same bits as a
  // training forward's, whichever place MoeConfig::fp8_swiglu gives the SwiGLU there.
  auto forward_only_equal = [&](mok::GpuLayer& which, const mok::HostRank& want) {
    mok::ForwardArgs no_context = args;
    no_context.keep_context = false;
    mok::HostRank outputs = mok::output_buffers(shape);
    device.poison_outputs();
    which.forward(no_context, stream);
    which.synchronize(stream).throw_if_error();
    device.download_outputs(outputs);
    return outputs.out.size() == want.out.size() &&
           std::memcmp(outputs.out.data(), want.out.data(),
                       want.out.size() * sizeof(want.out[0])) == 0;
  };
  // FP8 with the forward context, FP8 recomputing it, bf16.
  const std::vector<mok::HostRank> results = {step_outputs(layer, true), step_outputs(layer, false),
                                              step_outputs(bf16_layer, true)};
  const bool deterministic =
      mok::outputs_equal(results[0], results[1]) && forward_only_equal(layer, results[0]);
  // --compare: each knob flipped on an FP8 layer of its own (flip_knob), checked bitwise against
  // the first run and timed beside it with the weights kept.
  struct ComparedKnob {
    std::string knob;
    std::unique_ptr<mok::GpuLayer> layer;
    bool bitwise = false;
  };
  std::vector<ComparedKnob> compared;
  for (const std::string& knob : options.compare) {
    const mok::MoeConfig flipped_config = flip_knob(config, knob);
    set_up_compared_knob(knob, options.compare.size(), [&] {
      auto flipped = std::make_unique<mok::GpuLayer>(shape, flipped_config);
      const bool bitwise = mok::outputs_equal(step_outputs(*flipped, true), results[0]) &&
                           forward_only_equal(*flipped, results[0]);
      compared.push_back({knob, std::move(flipped), bitwise});
    });
  }

  // The FP8 reference on a slice of tokens (the weight gradients depend on every token: they
  // are compared with bf16's below, printed).
  const TokenSliceReference reference(problem, options.check_tokens, options.threads,
                                      mok::Precision::kFP8Block);
  const int64_t check_count = reference.count();
  const mok::HostRank& fp8 = results[0];
  const std::vector<Comparison> errors = reference.compare(fp8, "");
  const mok::HostRank& bf16 = results[2];
  const std::vector<Comparison> against_bf16 = {
      compare_all("out", fp8.out, bf16.out), compare_all("d_x", fp8.d_x, bf16.d_x),
      compare_all("d_w_gate", fp8.d_w_gate, bf16.d_w_gate),
      compare_all("d_w_up", fp8.d_w_up, bf16.d_w_up),
      compare_all("d_w_down", fp8.d_w_down, bf16.d_w_down)};

  // Interleaved rounds (the card's clock follows its power limit): FP8 and bf16, forward and a
  // training step from the forward's context.
  // The FP8 layer both ways: quantizing the weights in every call (version 0), and keeping
  // them (a nonzero ForwardArgs::weights_version: micro-batches between optimizer steps).
  mok::ForwardArgs kept_args = args;
  kept_args.weights_version = 1;
  // The forward with no backward to follow (inference, a no_grad forward: what the Python
  // benchmark times as the forward), where MoeConfig::fp8_swiglu's default place differs.
  mok::ForwardArgs no_context_args = kept_args;
  no_context_args.keep_context = false;
  mok::ForwardArgs bf16_no_context_args = args;
  bf16_no_context_args.keep_context = false;
  mok::BackwardArgs kept_backward = backward_args;
  kept_backward.forward.weights_version = 1;
  std::vector<std::function<void()>> timed = {
      [&] { layer.forward(args, stream); },
      [&] { bf16_layer.forward(args, stream); },
      [&] {
        const mok::ForwardContext step = layer.forward(args, stream);
        layer.backward(backward_args, stream, &step);
      },
      [&] {
        const mok::ForwardContext step = bf16_layer.forward(args, stream);
        bf16_layer.backward(backward_args, stream, &step);
      },
      [&] { layer.forward(kept_args, stream); },
      [&] {
        const mok::ForwardContext step = layer.forward(kept_args, stream);
        layer.backward(kept_backward, stream, &step);
      },
      [&] { layer.forward(no_context_args, stream); },
      [&] { bf16_layer.forward(bf16_no_context_args, stream); }};
  for (ComparedKnob& knob : compared) {
    mok::GpuLayer& flipped = *knob.layer;
    timed.push_back([&] { flipped.forward(kept_args, stream); });
    timed.push_back([&] { flipped.forward(no_context_args, stream); });
    timed.push_back([&] {
      const mok::ForwardContext step = flipped.forward(kept_args, stream);
      flipped.backward(kept_backward, stream, &step);
    });
  }
  const std::vector<double> medians = interleaved_median_ms(timed, stream, 8, 4);
  // Where the FP8 time goes, with the weights kept (their quantization is a stage only when
  // they change) and quantized every call.
  const auto forward_stages = layer.profile_forward(kept_args, stream, 10);
  const mok::ForwardContext stage_context = layer.forward(kept_args, stream);
  const auto backward_stages = layer.profile_backward(kept_backward, stream, 10, &stage_context);
  const auto requantizing_stages = layer.profile_forward(args, stream, 10);
  layer.synchronize(stream).throw_if_error();
  CLI_CUDA_CHECK(cudaStreamDestroy(stream));

  bool passed = deterministic;
  for (const ComparedKnob& knob : compared) passed &= knob.bitwise;
  for (const Comparison& error : errors) passed &= error.finite && error.rel <= kGpuTolerance;
  std::printf("mok run: FP8 (fp8_block) on %s (EP = 1)\n", device_name.c_str());
  std::printf("  shape     %s (%s), routing %s, seed %llu\n", options.shape_name.c_str(),
              shape.to_string().c_str(), options.routing.c_str(),
              static_cast<unsigned long long>(options.seed));
  std::printf("  row-tile GEMMs in %d-row tiles (fp8_row_tile_rows_for)\n",
              config.fp8_row_tile_rows);
  if (config.fp8_row_tile_rows == 192 || config.gemm_expert_groups == 0)
    std::printf("  SwiGLU: %s (fp8_swiglu)\n", mok::fp8_swiglu_place_name(config.fp8_swiglu));
  if (config.fp8_weight_grad_staging_tiles == 2)
    std::printf("  weight gradients with two staging tiles (fp8_weight_grad_staging_tiles)\n");
  std::printf(
      "  times: median of 32 calls, FP8 and bf16 interleaved in 8 rounds of shuffled order\n");
  std::printf("  %-22s %10s %10s %10s %10s %9s\n", "", "fp8 ms", "TFLOP/s", "bf16 ms", "TFLOP/s",
              "speedup");
  const double flops[2] = {forward_flop, 3 * forward_flop};
  const char* names[2] = {"forward", "forward+backward"};
  for (int d = 0; d < 2; ++d)
    std::printf("  %-22s %10.3f %10.1f %10.3f %10.1f %8.2fx\n", names[d], medians[2 * d],
                flops[d] / medians[2 * d] / 1e9, medians[2 * d + 1],
                flops[d] / medians[2 * d + 1] / 1e9, medians[2 * d + 1] / medians[2 * d]);
  // With the weights kept: the forward, the forward keeping no context, the step (rows 0-2);
  // each row's FP8 and bf16 medians.
  const char* kept_names[3] = {"forward", "forward, no context", "forward+backward"};
  const double kept_flops[3] = {forward_flop, forward_flop, 3 * forward_flop};
  const double kept_fp8[3] = {medians[4], medians[6], medians[5]};
  const double kept_bf16[3] = {medians[1], medians[7], medians[3]};
  std::printf("  with the quantized weights kept between calls (weights_version):\n");
  for (int d = 0; d < 3; ++d)
    std::printf("  %-22s %10.3f %10.1f %10.3f %10.1f %8.2fx\n", kept_names[d], kept_fp8[d],
                kept_flops[d] / kept_fp8[d] / 1e9, kept_bf16[d], kept_flops[d] / kept_bf16[d] / 1e9,
                kept_bf16[d] / kept_fp8[d]);
  // Compared knob i's medians: 8 + 3 i + row (the rows above).
  auto compared_ms = [&](size_t i, int row) { return medians[8 + 3 * i + row]; };
  for (size_t i = 0; i < compared.size(); ++i) {
    std::printf("  --compare %s (weights kept; same bits as the layer: %s):\n",
                compared[i].knob.c_str(), compared[i].bitwise ? "yes" : "NO");
    for (int d = 0; d < 3; ++d) {
      const double ms = compared_ms(i, d);
      std::printf("  %-22s %10.3f %10.1f %10.3f %10s %8.3fx the layer's time\n", kept_names[d], ms,
                  kept_flops[d] / ms / 1e9, kept_fp8[d], "", ms / kept_fp8[d]);
    }
  }
  const std::pair<const char*, const std::vector<mok::StageTime>*> stage_lists[] = {
      {"forward, weights kept", &forward_stages},
      {"backward, weights kept", &backward_stages},
      {"forward, weights quantized", &requantizing_stages}};
  for (const auto& [title, stages] : stage_lists) {
    std::printf("  FP8 %s: stages (median of 10, events between stages; SM clock):\n", title);
    print_stages(*stages, 44);
  }
  std::printf("  against the CPU reference's FP8 on %lld of %lld tokens (tolerance %.0e):\n",
              static_cast<long long>(check_count), static_cast<long long>(shape.num_tokens),
              kGpuTolerance);
  print_comparisons(errors, 22);
  std::printf("  FP8 against the bf16 layer, whole shape (not a bound: the format's error):\n");
  print_comparisons(against_bf16, 22);
  std::printf(
      "  bitwise identical across runs, with and without the forward context, and the output of "
      "a forward keeping none: %s\n",
      deterministic ? "yes" : "NO");
  std::printf("%s\n", passed ? "PASS" : "FAIL");
  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    json << "{\n  \"device\": \"" << json_escape(device_name) << "\", \"precision\": \"fp8_block\""
         << ", \"shape_name\": \"" << options.shape_name << "\", \"shape\": \"" << shape.to_string()
         << "\", \"routing\": \"" << options.routing << "\",\n"
         << "  \"forward_gflop\": " << forward_flop / 1e9 << ",\n"
         << "  \"fp8_ms\": {\"forward\": " << medians[0] << ", \"forward_backward\": " << medians[2]
         << "},\n  \"fp8_kept_weights_ms\": {\"forward\": " << kept_fp8[0]
         << ", \"forward_no_context\": " << kept_fp8[1] << ", \"forward_backward\": " << kept_fp8[2]
         << "},\n  \"bf16_ms\": {\"forward\": " << medians[1]
         << ", \"forward_no_context\": " << kept_bf16[1] << ", \"forward_backward\": " << medians[3]
         << "},\n  \"compare\": {";
    for (size_t i = 0; i < compared.size(); ++i)
      json << (i ? ", " : "") << "\"" << compared[i].knob
           << "\": {\"forward\": " << compared_ms(i, 0)
           << ", \"forward_no_context\": " << compared_ms(i, 1)
           << ", \"forward_backward\": " << compared_ms(i, 2)
           << ", \"bitwise\": " << (compared[i].bitwise ? "true" : "false") << "}";
    json << "},\n  \"errors\": {";
    for (size_t i = 0; i < errors.size(); ++i)
      json << (i ? ", " : "") << "\"" << errors[i].name << "\": " << errors[i].rel;
    json << "},\n  \"against_bf16\": {";
    for (size_t i = 0; i < against_bf16.size(); ++i)
      json << (i ? ", " : "") << "\"" << against_bf16[i].name << "\": " << against_bf16[i].rel;
    json << "},\n  \"deterministic\": " << (deterministic ? "true" : "false")
         << ", \"passed\": " << (passed ? "true" : "false") << "\n}\n";
  }
  return passed ? 0 : 1;
}

}  // namespace mok::cli
