// `mok run` on one GPU: mok's forward and backward against the unfused cuBLAS baseline in the
// same run; outputs checked against the CPU reference on a slice of tokens (out, d_x and
// d_router_weights of a token depend on that token only), weight gradients against the
// baseline's on the whole shape, mok bitwise against itself with and without the forward
// context; ms, TFLOP/s and speedups per direction, and the stages of each direction.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"
#include "mok/gpu_layer.h"
#include "mok/reference.h"
#include "mok/task_trace.h"
#include "mok/testing/baseline_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"

namespace mok::cli {

namespace {

// ", GEMM tiles walked in groups of N" where the group is not the default.
std::string tile_group_name(const mok::MoeConfig& config) {
  return config.gemm_tile_group == mok::MoeConfig{}.gemm_tile_group
             ? ""
             : ", GEMM tiles walked in groups of " + std::to_string(config.gemm_tile_group);
}

// ", CTAs in step within N K-blocks" where they are; "(automatic)" where MoeConfig's
// gemm_auto_lockstep chose it for the shape.
std::string lockstep_name(const mok::MoeConfig& config, const mok::MoeShape& shape) {
  const mok::MoeConfig runs = mok::with_auto_choices(config, shape);
  if (runs.gemm_lockstep_k_blocks == 0) return "";
  return ", CTAs in step within " + std::to_string(runs.gemm_lockstep_k_blocks) + " K-blocks" +
         (mok::auto_lockstep_engages(config, shape) ? " (automatic)" : "");
}

// "local dispatch <mode>, <persistent | two> forward GEMM kernel(s)[, check_finite scan]...",
// of the config a layer of `shape` runs with.
std::string variant_name(const mok::MoeConfig& config, const mok::MoeShape& shape) {
  const bool four_stages = mok::with_auto_choices(config, shape).gemm_four_stages;
  return std::string("local dispatch ") + mok::local_dispatch_name(config.local_dispatch) +
         (config.persistent_forward ? ", persistent forward GEMM kernel"
                                    : ", two forward GEMM kernels") +
         (config.check_finite ? ", check_finite scan" : "") +
         (config.overlap_kernel_launches ? ", launches overlapped" : "") +
         (config.gemm_cta_pairs ? ", CTA pairs" : "") +
         (config.gemm_wide_tiles ? ", GEMMs in 256 x 192 tiles" : "") + tile_group_name(config) +
         (config.gemm_l2_placement ? ", GEMMs by L2 partition" : "") +
         (config.gemm_expert_aligned_groups ? ", groups aligned to experts" : "") +
         (four_stages ? ", four-stage ring" : "") + lockstep_name(config, shape) +
         (config.gemm_tiles_by_ticket ? ", GEMM tiles by ticket" : "") +
         (config.skip_padding_rows ? "" : ", padding rows computed");
}

// "kernel sequence" or "persistent kernel", and the knobs of the backward's GEMMs.
std::string backward_name(const mok::MoeConfig& config, const mok::MoeShape& shape) {
  return std::string(config.persistent_backward ? "persistent kernel" : "kernel sequence") +
         (config.gemm_cta_pairs ? ", CTA pairs" : "") +
         (config.gemm_wide_tiles ? ", dgrads in 256 x 192 tiles" : "") + tile_group_name(config) +
         (config.gemm_l2_placement ? ", GEMMs by L2 partition" : "") +
         (config.gemm_expert_aligned_groups ? ", groups aligned to experts" : "") +
         lockstep_name(config, shape) +
         (config.gemm_tiles_by_ticket ? ", GEMM tiles by ticket" : "") +
         (config.skip_padding_rows ? "" : ", padding rows computed") +
         (config.gemm_dgrad_half_row_tiles ? ", 64-row dgrad tiles" : "") +
         (config.swiglu_backward_in_dgrad ? ", SwiGLU backward in the down dgrad" : "") +
         (config.weight_grad_pingpong ? ", weight gradients in ping-pong" : "") +
         (config.overlap_kernel_launches ? ", launches overlapped" : "");
}

// Runs forward and backward once more on a layer of each config that has a persistent kernel,
// with MoeConfig::trace_tasks, prints each kernel's summary and writes every trace to `path`.
void trace_persistent_kernels(const std::string& path, const mok::MoeShape& shape,
                              const std::vector<mok::MoeConfig>& configs,
                              mok::DeviceProblem& device) {
  cudaStream_t stream;
  CLI_CUDA_CHECK(cudaStreamCreate(&stream));
  std::vector<mok::TaskTrace> traces;
  std::printf("  task traces (%s):\n", path.c_str());
  for (mok::MoeConfig config : configs) {
    if (!config.persistent_forward && !config.persistent_backward) continue;
    config.trace_tasks = true;
    mok::GpuLayer layer(shape, config);
    for (int run = 0; run < 2; ++run) {  // the first warms up
      const mok::ForwardContext context = layer.forward(device.forward_args(), stream);
      layer.backward(device.backward_args(), stream, &context);
    }
    layer.synchronize(stream).throw_if_error();
    for (mok::TaskTrace& trace : layer.task_traces(stream)) {
      const bool forward = trace.kernel == "persistent forward";
      // Only the kernel this config varies: a forward trace of a persistent-forward config, a
      // backward trace of a persistent-backward one (once each).
      const std::string label =
          forward ? variant_name(config, shape) : backward_name(config, shape);
      const bool seen = std::any_of(traces.begin(), traces.end(), [&](const mok::TaskTrace& t) {
        return t.kernel == trace.kernel + " (" + label + ")";
      });
      if (seen) continue;
      trace.kernel += " (" + label + ")";
      std::printf("%s", mok::summarize_task_trace(trace).c_str());
      traces.push_back(std::move(trace));
    }
  }
  CLI_CUDA_CHECK(cudaStreamDestroy(stream));
  mok::write_chrome_trace(traces, path);
}

// Dense bf16 tensor-core FLOP per clock per SM on Hopper (sm_90): H100 SXM's 989 TFLOP/s are
// 132 SMs x 4096 x 1830 MHz.
constexpr double kBf16FlopPerClockPerSm = 4096;

struct Peak {
  int sms = 0;
  double clock_mhz = 0;
  double tflops = 0;
};

// The roofline of `mok run`: the tensor peak of device 0 at its top SM clock.
Peak bf16_peak() {
  Peak peak;
  int clock_khz = 0;
  CLI_CUDA_CHECK(cudaDeviceGetAttribute(&peak.sms, cudaDevAttrMultiProcessorCount, 0));
  CLI_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  peak.clock_mhz = clock_khz / 1e3;
  peak.tflops = peak.sms * kBf16FlopPerClockPerSm * clock_khz * 1e3 / 1e12;
  return peak;
}

}  // namespace

// The GPU path of `mok run` (one GPU): mok's forward and backward against the unfused cuBLAS
// baseline in the same run; outputs checked against the CPU reference on a slice of tokens
// (out, d_x, d_router_weights: each token's depend on that token only), weight gradients
// against the baseline's on the whole shape, mok bitwise against itself across runs.
int run_gpu(const RunOptions& options, const mok::MoeShape& shape, const std::string& device_name) {
  constexpr double kGpuTolerance = 1e-2;
  const mok::RoutingKind routing = mok::routing_kind_from_name(options.routing);
  mok::HostProblem problem = mok::HostProblem::make(shape, routing, options.seed);
  const FlopCount flop = count_flop(problem);
  const int64_t routed_pairs = flop.routed_pairs;
  const double forward_flop = flop.forward;
  const double backward_flop = 2 * forward_flop;

  mok::DeviceProblem device(problem, 0);
  const mok::MoeConfig config = config_from_options(options, shape);
  mok::GpuLayer layer(shape, config);
  if (config.gemm_l2_placement)
    std::printf("  L2 placement: %s\n", layer.l2_placement_report().c_str());
  mok::BaselineLayer baseline(shape);
  cudaStream_t stream;
  CLI_CUDA_CHECK(cudaStreamCreate(&stream));
  const mok::ForwardArgs args = device.forward_args();
  const mok::BackwardArgs backward_args = device.backward_args();

  // Correctness first, outputs poisoned before each run: mok with the forward context, mok
  // recomputing the forward in the backward (must give the same bits), the baseline. Two host
  // copies of the outputs, no more: at `dsv3` each holds 22.5 GB of weight gradients.
  mok::HostRank first = mok::output_buffers(shape), scratch = mok::output_buffers(shape);
  bool deterministic = false;
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
    device.download_outputs(run == 0 ? first : scratch);
    if (run == 1) deterministic = mok::outputs_equal(first, scratch);
  }
  // The baseline's outputs (in scratch) are compared now: the variants below reuse the buffer.
  const TokenSliceReference reference(problem, options.check_tokens, options.threads,
                                      mok::Precision::kBF16);
  const int64_t check_count = reference.count();
  std::vector<Comparison> errors = reference.compare(first, "mok ");
  for (const Comparison& error : reference.compare(scratch, "baseline ")) errors.push_back(error);
  std::vector<Comparison> grad_errors = {compare_all("d_w_gate", first.d_w_gate, scratch.d_w_gate),
                                         compare_all("d_w_up", first.d_w_up, scratch.d_w_up),
                                         compare_all("d_w_down", first.d_w_down, scratch.d_w_down)};
  if (shape.has_shared_expert()) {
    grad_errors.push_back(
        compare_all("d_w_shared_gate", first.d_w_shared_gate, scratch.d_w_shared_gate));
    grad_errors.push_back(compare_all("d_w_shared_up", first.d_w_shared_up, scratch.d_w_shared_up));
    grad_errors.push_back(
        compare_all("d_w_shared_down", first.d_w_shared_down, scratch.d_w_shared_down));
  }

  // The macrobatch ring (MoeConfig::macrobatch_size) cutting the worst case into about four
  // macrobatches: the same bits, and (timed below) what the backward's recompute of all but the
  // first costs.
  const int64_t max_rows = mok::schedule_params(shape, 0).max_rows();
  mok::MoeConfig ring_config = config;
  ring_config.minibatch_size = mok::kAutoMinibatch;  // one that divides the macrobatch
  ring_config.macrobatch_size = std::max<int64_t>(1, (max_rows / 4 + 127) / 128) * 128;
  const int64_t ring_macrobatches =
      (max_rows + ring_config.macrobatch_size - 1) / ring_config.macrobatch_size;
  // --quick: the layer against the baseline only (no ring, variants or stages; A/B runs).
  const bool full = !options.quick;
  std::unique_ptr<mok::GpuLayer> ring_layer;
  if (full) ring_layer = std::make_unique<mok::GpuLayer>(shape, ring_config);
  // The backward the other way (same bits): the kernel sequence or the persistent kernel.
  struct BackwardVariant {
    mok::MoeConfig config;
    std::unique_ptr<mok::GpuLayer> layer;
    bool bitwise = false;
  };
  std::vector<BackwardVariant> backward_variants;
  if (full) {
    // Each knob flipped on a layer of its own (flip_knob, which turns off what excludes it): the
    // backward as the persistent kernel or the sequence; the expert GEMMs in CTA pairs
    // multicasting B, or alone; the padding rows skipped or computed; the weight gradients in
    // ping-pong; the forward GEMMs and the dgrads in 256 x 192 tiles. The forward variants below
    // time [1], [2] and [4] too.
    for (const char* knob : {"persistent-backward", "cta-pairs", "skip-padding-rows",
                             "weight-grad-pingpong", "wide-tiles"}) {
      mok::MoeConfig flipped = flip_knob(config, knob);
      if (flipped.persistent_backward != config.persistent_backward)
        flipped.wait_timeout_s = std::min(config.wait_timeout_s, 10.0);
      backward_variants.push_back({flipped, std::make_unique<mok::GpuLayer>(shape, flipped)});
    }
  }
  auto same_bits_as_first = [&](mok::GpuLayer& other) {
    device.poison_outputs();
    const mok::ForwardContext context = other.forward(args, stream);
    other.backward(backward_args, stream, &context);
    other.synchronize(stream).throw_if_error();
    device.download_outputs(scratch);
    return mok::outputs_equal(scratch, first);
  };
  const bool ring_bitwise = !full || same_bits_as_first(*ring_layer);
  // --quick --compare: each named knob flipped on a layer of its own (flip_knob), checked
  // bitwise against the first run and timed beside the layer (forward, training step).
  struct ComparedKnob {
    std::string knob;
    mok::MoeConfig config;
    std::unique_ptr<mok::GpuLayer> layer;
    bool bitwise = false;
  };
  std::vector<ComparedKnob> compared;
  for (const std::string& knob : options.compare) {
    const mok::MoeConfig flipped = flip_knob(config, knob);
    set_up_compared_knob(knob, options.compare.size(), [&] {
      compared.push_back({knob, flipped, std::make_unique<mok::GpuLayer>(shape, flipped)});
      if (flipped.gemm_l2_placement && !config.gemm_l2_placement)
        std::printf("  --compare %s: %s\n", knob.c_str(),
                    compared.back().layer->l2_placement_report().c_str());
      compared.back().bitwise = same_bits_as_first(*compared.back().layer);
    });
  }
  bool backward_variants_bitwise = true;
  for (BackwardVariant& variant : backward_variants) {
    variant.bitwise = same_bits_as_first(*variant.layer);
    backward_variants_bitwise &= variant.bitwise;
  }

  // Training step timing: forward, then the backward from the forward's saved activations
  // (mok's context; the baseline keeps its permuted x and gate/up outputs as autograd would).
  using Stages = std::vector<mok::StageTime>;
  Stages forward_stages, backward_stages;
  if (full) {
    forward_stages = layer.profile_forward(args, stream, 10);
    const mok::ForwardContext context = layer.forward(args, stream);
    backward_stages = layer.profile_backward(backward_args, stream, 10, &context);
  }
  // The other backward's stages too (the persistent kernel's, or the sequence's), on the same
  // card under the same load: the kernel's traced span leaves the launches out.
  std::vector<Stages> variant_stages;
  for (BackwardVariant& variant : backward_variants) {
    const mok::ForwardContext variant_context = variant.layer->forward(args, stream);
    variant_stages.push_back(
        variant.layer->profile_backward(backward_args, stream, 10, &variant_context));
  }
  // Forward variants on their own layers (same bits, see the tests): the other local dispatch
  // mode, and the GEMMs as one persistent kernel or as two.
  const mok::MoeConfig other_dispatch = flip_knob(config, "local-dispatch");
  mok::MoeConfig other_gemms = flip_knob(config, "persistent-forward");
  other_gemms.wait_timeout_s = std::min(config.wait_timeout_s, 10.0);
  // And the forward with MoeConfig::check_finite: what its input scan costs.
  mok::MoeConfig checked = config;
  checked.check_finite = true;
  std::unique_ptr<mok::GpuLayer> other_dispatch_layer, other_gemms_layer, checked_layer;
  if (full) {
    other_dispatch_layer = std::make_unique<mok::GpuLayer>(shape, other_dispatch);
    other_gemms_layer = std::make_unique<mok::GpuLayer>(shape, other_gemms);
    checked_layer = std::make_unique<mok::GpuLayer>(shape, checked);
  }
  // Interleaved rounds: the card runs into its power limit within a second of GEMM load and
  // lowers its clock (clocks.log of scripts/gpu-check.sh), so timing one side after the other
  // would hand the later one a slower card.
  std::vector<std::function<void()>> timed = {
      [&] { layer.forward(args, stream); },
      [&] { baseline.forward(args, stream); },
      [&] {
        const mok::ForwardContext step = layer.forward(args, stream);
        layer.backward(backward_args, stream, &step);
      },
      [&] {
        baseline.forward(args, stream);
        baseline.backward(backward_args, stream, true);
      },
      [&] { layer.backward(backward_args, stream); },
  };
  if (full) {
    timed.insert(timed.end(), {
                                  [&] { other_dispatch_layer->forward(args, stream); },
                                  [&] { other_gemms_layer->forward(args, stream); },
                                  [&] {
                                    const mok::ForwardContext step =
                                        ring_layer->forward(args, stream);
                                    ring_layer->backward(backward_args, stream, &step);
                                  },
                                  [&] { checked_layer->forward(args, stream); },
                                  // the CTA pairs, skip_padding_rows and the wide tiles
                                  // flipped
                                  [&] { backward_variants[1].layer->forward(args, stream); },
                                  [&] { backward_variants[2].layer->forward(args, stream); },
                                  [&] { backward_variants[4].layer->forward(args, stream); },
                              });
    for (BackwardVariant& variant : backward_variants)
      timed.push_back([&] {
        const mok::ForwardContext step = variant.layer->forward(args, stream);
        variant.layer->backward(backward_args, stream, &step);
      });
  }
  // The training step with frozen weights (no weight gradients asked for: a fine-tune of the
  // router, the attention or adapters), on this layer; the persistent backward refuses it.
  const mok::BackwardArgs frozen_args = mok::without_weight_gradients(backward_args);
  const bool times_frozen = full && !config.persistent_backward;
  const size_t frozen_index = timed.size();
  if (times_frozen)
    timed.push_back([&] {
      const mok::ForwardContext step = layer.forward(args, stream);
      layer.backward(frozen_args, stream, &step);
    });
  // The forward no backward follows (ForwardArgs::keep_context off: torch.no_grad, an
  // evaluation): the same bits (BackwardGpu.ForwardWithoutContextKeepsTheBits).
  mok::ForwardArgs no_context_args = args;
  no_context_args.keep_context = false;
  const size_t no_context_index = timed.size();
  if (full) timed.push_back([&] { layer.forward(no_context_args, stream); });
  const size_t first_compared = timed.size();
  for (ComparedKnob& knob : compared) {
    timed.push_back([&] { knob.layer->forward(args, stream); });
    timed.push_back([&] {
      const mok::ForwardContext step = knob.layer->forward(args, stream);
      knob.layer->backward(backward_args, stream, &step);
    });
  }
  const std::vector<double> medians = interleaved_median_ms(timed, stream, 8, 4);
  const double mok_forward_ms = medians[0], base_forward_ms = medians[1];
  const double mok_step_ms = medians[2], base_step_ms = medians[3];
  const double mok_recompute_ms = medians[4], ring_step_ms = full ? medians[7] : 0.0;
  const size_t first_backward_variant = 12;  // the closures above before the variants
  std::vector<std::pair<std::string, double>> forward_variants_ms = {
      {variant_name(config, shape), mok_forward_ms}};
  if (full)
    forward_variants_ms.insert(forward_variants_ms.end(),
                               {{variant_name(other_dispatch, shape), medians[5]},
                                {variant_name(other_gemms, shape), medians[6]},
                                {variant_name(checked, shape), medians[8]},
                                {variant_name(backward_variants[1].config, shape), medians[9]},
                                {variant_name(backward_variants[2].config, shape), medians[10]},
                                {variant_name(backward_variants[4].config, shape), medians[11]}});
  // The inputs are finite: the checked layer must have nothing to report.
  const mok::Status checked_status = full ? checked_layer->synchronize(stream) : mok::Status::Ok();
  if (!checked_status.ok())
    std::printf("  check_finite reported finite inputs: %s\n", checked_status.message.c_str());
  const double mok_backward_ms = mok_step_ms - mok_forward_ms;
  const double base_backward_ms = base_step_ms - base_forward_ms;
  CLI_CUDA_CHECK(cudaStreamDestroy(stream));

  const Peak peak = bf16_peak();
  bool passed = deterministic && ring_bitwise && backward_variants_bitwise && checked_status.ok();
  for (const ComparedKnob& knob : compared) passed &= knob.bitwise;
  for (const Comparison& error : errors) passed &= error.finite && error.rel <= kGpuTolerance;
  for (const Comparison& error : grad_errors) passed &= error.finite && error.rel <= kGpuTolerance;
  std::printf("mok run: forward and backward on %s (EP = 1), %s\n", device_name.c_str(),
              variant_name(config, shape).c_str());
  std::printf("  shape     %s (%s), routing %s, seed %llu\n", options.shape_name.c_str(),
              shape.to_string().c_str(), options.routing.c_str(),
              static_cast<unsigned long long>(options.seed));
  std::printf("  work      %lld routed pairs, %.1f GFLOP forward, %.1f GFLOP backward\n",
              static_cast<long long>(routed_pairs), forward_flop / 1e9, backward_flop / 1e9);
  const int64_t ring_rows = mok::macrobatch_ring_rows(config, shape, max_rows, peak.sms);
  std::printf(
      "  ring      %lld of %lld worst-case rows (%lld macrobatches, %.2f GB); minibatches of "
      "%lld rows\n",
      static_cast<long long>(ring_rows), static_cast<long long>(max_rows),
      static_cast<long long>((max_rows + ring_rows - 1) / ring_rows),
      ring_rows * mok::macrobatch_ring_bytes_per_row(shape) / 1e9,
      static_cast<long long>(mok::minibatch_rows(config, shape, peak.sms)));
  std::printf(
      "  times: median of 32 calls, mok and baseline interleaved in 8 rounds of shuffled order\n");
  std::printf(
      "  roofline: the dense bf16 tensor peak at the card's top clock, %.0f TFLOP/s (%d SMs x "
      "%.0f FLOP/clock x %.0f MHz); under its power limit the card runs lower\n",
      peak.tflops, peak.sms, kBf16FlopPerClockPerSm, peak.clock_mhz);
  std::printf("  %-22s %10s %10s %7s %10s %10s %9s\n", "", "mok ms", "TFLOP/s", "of peak",
              "base ms", "TFLOP/s", "speedup");
  auto row = [&](const char* name, double flop, double mok_ms, double base_ms) {
    const double tflops = flop / mok_ms / 1e9;
    std::printf("  %-22s %10.3f %10.1f %6.1f%% %10.3f %10.1f %8.2fx\n", name, mok_ms, tflops,
                100.0 * tflops / peak.tflops, base_ms, flop / base_ms / 1e9, base_ms / mok_ms);
  };
  row("forward", forward_flop, mok_forward_ms, base_forward_ms);
  row("backward", backward_flop, mok_backward_ms, base_backward_ms);
  row("forward+backward", forward_flop + backward_flop, mok_step_ms, base_step_ms);
  std::printf(
      "  (backward = forward+backward minus forward, both from saved activations; mok's backward\n"
      "   recomputing the forward instead: %.3f ms, %.1f TFLOP/s)\n",
      mok_recompute_ms, backward_flop / mok_recompute_ms / 1e9);
  if (!full) std::printf("  (--quick: no ring, variants or stages)\n");
  if (full) {
    std::printf(
        "  training step with %lld macrobatches of %lld rows (the ring; backward recomputes all\n"
        "   but the first): %.3f ms, %.1f TFLOP/s, bitwise equal to one macrobatch: %s\n",
        static_cast<long long>(ring_macrobatches),
        static_cast<long long>(ring_config.macrobatch_size), ring_step_ms,
        (forward_flop + backward_flop) / ring_step_ms / 1e9, ring_bitwise ? "yes" : "NO");
    std::printf("  backward variants (training steps; this run's backward: %s):\n",
                backward_name(config, shape).c_str());
  }
  for (size_t i = 0; i < backward_variants.size(); ++i) {
    const double ms = medians[first_backward_variant + i];
    std::printf("    %-44s %9.3f ms %8.1f TFLOP/s, bitwise equal: %s\n",
                backward_name(backward_variants[i].config, shape).c_str(), ms,
                (forward_flop + backward_flop) / ms / 1e9,
                backward_variants[i].bitwise ? "yes" : "NO");
  }
  if (!compared.empty())
    std::printf(
        "  knobs flipped (--compare), in the same rounds (ratio: the flipped layer's time "
        "over this run's):\n");
  for (size_t i = 0; i < compared.size(); ++i) {
    const double forward_ms = medians[first_compared + 2 * i];
    const double step_ms = medians[first_compared + 2 * i + 1];
    std::printf(
        "    %-24s forward %8.3f ms (%.3fx), forward+backward %8.3f ms (%.3fx), bitwise "
        "equal: %s\n      (%s; backward: %s)\n",
        compared[i].knob.c_str(), forward_ms, forward_ms / mok_forward_ms, step_ms,
        step_ms / mok_step_ms, compared[i].bitwise ? "yes" : "NO",
        variant_name(compared[i].config, shape).c_str(),
        backward_name(compared[i].config, shape).c_str());
  }
  if (times_frozen)
    std::printf("    %-44s %9.3f ms (%.2fx the step's time)\n",
                "frozen weights (no weight gradients)", medians[frozen_index],
                medians[frozen_index] / mok_step_ms);
  if (full)
    std::printf("    %-44s %9.3f ms (%.2fx the forward's time)\n",
                "forward keeping no context (torch.no_grad)", medians[no_context_index],
                medians[no_context_index] / mok_forward_ms);
  if (full) {
    std::printf("  forward variants (same bits):\n");
    for (const auto& [name, ms] : forward_variants_ms)
      std::printf("    %-44s %9.3f ms %8.1f TFLOP/s\n", name.c_str(), ms, forward_flop / ms / 1e9);
    for (const auto* stages : {&forward_stages, &backward_stages}) {
      std::printf("  mok %s stages (median of 10, events between stages; SM clock):\n",
                  stages == &forward_stages ? "forward" : "backward");
      print_stages(*stages, 30);
    }
  }
  for (size_t i = 0; i < backward_variants.size(); ++i) {
    std::printf("  backward stages, %s (median of 10):\n",
                backward_name(backward_variants[i].config, shape).c_str());
    print_stages(variant_stages[i], 30);
  }
  std::printf("  against the CPU reference on %lld of %lld tokens (tolerance %.0e):\n",
              static_cast<long long>(check_count), static_cast<long long>(shape.num_tokens),
              kGpuTolerance);
  print_comparisons(errors, 22);
  std::printf("  mok weight gradients against the baseline's, whole shape:\n");
  print_comparisons(grad_errors, 22);
  std::printf("  mok bitwise identical across runs, with and without the forward context: %s\n",
              deterministic ? "yes" : "NO");
  if (!options.trace_path.empty()) {
    std::vector<mok::MoeConfig> traced = {config, other_gemms};
    for (const BackwardVariant& variant : backward_variants) traced.push_back(variant.config);
    trace_persistent_kernels(options.trace_path, shape, traced, device);
  }
  std::printf("%s\n", passed ? "PASS" : "FAIL");

  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    json << "{\n  \"device\": \"" << json_escape(device_name) << "\", \"shape_name\": \""
         << options.shape_name << "\", \"shape\": \"" << shape.to_string() << "\", \"routing\": \""
         << options.routing << "\", \"local_dispatch\": \""
         << mok::local_dispatch_name(config.local_dispatch)
         << "\", \"persistent_forward\": " << (config.persistent_forward ? "true" : "false")
         << ", \"backward\": \"" << backward_name(config, shape) << "\""
         << ",\n"
         << "  \"forward_gflop\": " << forward_flop / 1e9 << ",\n"
         << "  \"mok_ms\": {\"forward\": " << mok_forward_ms
         << ", \"backward\": " << mok_backward_ms << ", \"forward_backward\": " << mok_step_ms
         << ", \"backward_recompute\": " << mok_recompute_ms << "},\n"
         << "  \"baseline_ms\": {\"forward\": " << base_forward_ms
         << ", \"backward\": " << base_backward_ms << ", \"forward_backward\": " << base_step_ms
         << "},\n"
         << "  \"peak_tflops\": " << peak.tflops << ",\n"
         << "  \"mok_tflops\": {\"forward\": " << forward_flop / mok_forward_ms / 1e9
         << ", \"forward_backward\": " << 3 * forward_flop / mok_step_ms / 1e9
         << "},\n  \"speedup\": {\"forward\": " << base_forward_ms / mok_forward_ms
         << ", \"forward_backward\": " << base_step_ms / mok_step_ms << "},\n  \"stages_ms\": {";
    bool first_stage = true;
    for (const auto* stages : {&forward_stages, &backward_stages})
      for (const mok::StageTime& stage : *stages) {
        json << (first_stage ? "" : ", ") << "\"" << (stages == &forward_stages ? "fwd " : "bwd ")
             << stage.name << "\": " << stage.ms;
        first_stage = false;
      }
    json << "},\n  \"stages_sm_clock_ghz\": {";
    first_stage = true;
    for (const auto* stages : {&forward_stages, &backward_stages})
      for (const mok::StageTime& stage : *stages) {
        json << (first_stage ? "" : ", ") << "\"" << (stages == &forward_stages ? "fwd " : "bwd ")
             << stage.name << "\": " << stage.sm_clock_ghz;
        first_stage = false;
      }
    json << "},\n  \"forward_ms_by_variant\": {";
    for (size_t i = 0; i < forward_variants_ms.size(); ++i)
      json << (i ? ", " : "") << "\"" << forward_variants_ms[i].first
           << "\": " << forward_variants_ms[i].second;
    json << "},\n  \"errors\": {";
    bool first_error = true;
    for (const auto* list : {&errors, &grad_errors})
      for (const Comparison& error : *list) {
        json << (first_error ? "" : ", ") << "\"" << error.name << "\": " << error.rel;
        first_error = false;
      }
    json << "},\n  \"macrobatches\": {\"count\": " << (full ? ring_macrobatches : 0)
         << ", \"rows\": " << ring_config.macrobatch_size << ", \"step_ms\": " << ring_step_ms
         << ", \"bitwise\": " << (ring_bitwise ? "true" : "false") << "}";
    json << ",\n  \"compared\": {";
    for (size_t i = 0; i < compared.size(); ++i)
      json << (i ? ", " : "") << "\"" << compared[i].knob
           << "\": {\"forward_ms\": " << medians[first_compared + 2 * i]
           << ", \"step_ms\": " << medians[first_compared + 2 * i + 1]
           << ", \"bitwise\": " << (compared[i].bitwise ? "true" : "false") << "}";
    json << "}";
    json << ",\n  \"backward_variants\": {";
    for (size_t i = 0; i < backward_variants.size(); ++i)
      json << (i ? ", " : "") << "\"" << backward_name(backward_variants[i].config, shape)
           << "\": {\"step_ms\": " << medians[first_backward_variant + i]
           << ", \"bitwise\": " << (backward_variants[i].bitwise ? "true" : "false") << "}";
    json << "}";
    json << ",\n  \"deterministic\": " << (deterministic ? "true" : "false")
         << ", \"passed\": " << (passed ? "true" : "false") << "\n}\n";
  }
  return passed ? 0 : 1;
}

}  // namespace mok::cli
