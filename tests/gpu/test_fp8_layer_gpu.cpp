// The single-GPU layer in FP8 (MoeConfig::precision = kFP8Block): every output against the CPU
// reference's FP8 math (the same quantization, summed in another order) at the bf16 tolerance,
// on uniform and adversarial routings, with a shared expert and a clamp; bitwise across runs and
// with or without the forward context; and the distance to the bf16 layer printed. Shapes the
// FP8 path does not run are refused by name before anything runs. Pre-quantized weights give
// the bits of the bf16 weights they came from, and every walk of the GEMMs' tiles the same bits.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <initializer_list>
#include <string>

#include "gpu_step.h"
#include "mok/gpu_layer.h"
#include "mok/reference.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;

// The bf16 tolerance. The GPU's FP8 GEMMs sum each 128-long block on the tensor cores, whose
// FP8 accumulation keeps fewer bits than the reference's fp32, so a g, u, dh or d_g can land one
// bf16 ulp away. With amax / 448 scales that moved its group's scale whenever it was the
// group's amax, and requantized the whole group: one weight gradient reached 1.0e-2 on H200
// (session 11). Power-of-two scales move only when amax crosses a power of two (design.md,
// "FP8 against its reference").
constexpr double kFp8ReferenceTolerance = 1e-2;

MoeConfig fp8_config() {
  MoeConfig config;
  config.precision = Precision::kFP8Block;
  return config;
}

// Every output of `got` bit for bit `want`'s; `note` says which run `got` was.
void expect_same_bits(const HostRank& got, const HostRank& want, const std::string& note) {
  test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
    EXPECT_TRUE(test::bitwise_equal(a, b)) << output << " " << note;
  });
}

// The problems the bits-against-a-variant tests share: skewed routing (experts of 1 to ~20 row
// tiles) and experts without rows, with a shared expert (FP8 then takes whole 128-token tiles).
// `check(routing, shape, problem, device)` for each.
template <typename Check>
void for_each_bits_problem(uint64_t seed, Check check) {
  for (const RoutingKind routing : {RoutingKind::kSkewed, RoutingKind::kHoles}) {
    const MoeShape shape = make_shape(1280, 512, 256, 16, 4, 1, 128);
    HostProblem problem = HostProblem::make(shape, routing, seed);
    DeviceProblem device(problem, 0);
    check(routing, shape, problem, device);
  }
}

void check_fp8(const char* name, const MoeShape& shape, RoutingKind routing, uint64_t seed) {
  SCOPED_TRACE(std::string(name) + " " + shape.to_string() + " routing " +
               routing_kind_name(routing));
  HostProblem problem = HostProblem::make(shape, routing, seed);
  HostProblem bf16 = problem;
  problem.poison_outputs();
  reference::Options options;
  options.precision = Precision::kFP8Block;
  reference::forward(problem.shape, problem.forward_args(0), options);
  reference::backward(problem.shape, problem.backward_args(0), options);
  reference::forward(bf16.shape, bf16.forward_args(0));
  reference::backward(bf16.shape, bf16.backward_args(0));
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, fp8_config());
  const HostRank got = test::gpu_step(layer, device, problem, /*with_context=*/true);
  test::expect_near_reference(got, problem.ranks[0], kFp8ReferenceTolerance);
  std::printf("  %-22s %-40s %-10s", name, shape.to_string().c_str(), routing_kind_name(routing));
  test::for_each_output(got, problem.ranks[0],
                        [&](const char* output, const auto& g, const auto& w) {
                          if (w.empty()) return;
                          std::printf(" %s %.1e", output, test::relative_error(g, w));
                        });
  std::printf("\n  %-22s against bf16:", "");
  test::for_each_output(got, bf16.ranks[0], [&](const char* output, const auto& g, const auto& w) {
    if (!w.empty()) std::printf(" %s %.1e", output, test::relative_error(g, w));
  });
  std::printf("\n");
  for (const bool with_context : {true, false}) {
    expect_same_bits(test::gpu_step(layer, device, problem, with_context), got,
                     with_context ? "differs across runs" : "differs when recomputing");
  }
}

TEST(Fp8LayerGpu, MatchesTheFp8Reference) {
  uint64_t seed = 700;
  check_fp8("small", make_shape(96, 256, 128, 8, 2), RoutingKind::kUniform, ++seed);
  check_fp8("shared + clamp", make_shape(256, 512, 256, 8, 2, 1, 128, 0.5f), RoutingKind::kUniform,
            ++seed);
  check_fp8("skewed", make_shape(333, 1024, 384, 16, 4), RoutingKind::kSkewed, ++seed);
  check_fp8("holes", make_shape(200, 512, 256, 8, 4), RoutingKind::kHoles, ++seed);
  check_fp8("all to one expert", make_shape(200, 512, 256, 8, 4), RoutingKind::kOneExpert, ++seed);
  check_fp8("no routes", make_shape(130, 512, 256, 8, 4), RoutingKind::kNoRoutes, ++seed);
  check_fp8("wide", make_shape(512, 2048, 768, 8, 2, 1, 256), RoutingKind::kUniform, ++seed);
}

// ForwardArgs::weights_version: a layer that keeps its quantized weights between calls gives the
// bits of one that quantizes every call, and quantizes again when the version changes (weights
// rescaled in place, as an optimizer step does).
TEST(Fp8LayerGpu, KeptWeightsGiveTheSameBits) {
  const MoeShape shape = make_shape(256, 512, 256, 8, 2, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 77);
  DeviceProblem device(problem, 0);
  GpuLayer every_call(shape, fp8_config()), keeping(shape, fp8_config());
  auto step = [&](GpuLayer& layer, uint64_t version) {
    device.poison_outputs();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ForwardArgs args = device.forward_args();
    args.weights_version = version;
    BackwardArgs backward_args = device.backward_args();
    backward_args.forward.weights_version = version;
    const ForwardContext context = layer.forward(args, nullptr);
    layer.backward(backward_args, nullptr, &context);
    EXPECT_TRUE(layer.synchronize(nullptr).ok());
    HostRank result = output_buffers(shape);
    device.download_outputs(result);
    return result;
  };
  const HostRank want = step(every_call, 0);
  expect_same_bits(step(keeping, 5), want, "(first call of version 5)");
  expect_same_bits(step(keeping, 5), want, "(version 5 kept)");
  // Halve w_down in place (a bf16 halving is exact), as a new version of the weights.
  const ForwardArgs args = device.forward_args();
  std::vector<bf16> down(args.w_down.nbytes() / 2);
  ASSERT_EQ(cudaMemcpy(down.data(), args.w_down.data, args.w_down.nbytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (bf16& v : down) v = float_to_bf16(0.5f * bf16_to_float(v));
  ASSERT_EQ(cudaMemcpy(args.w_down.data, down.data(), args.w_down.nbytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  const HostRank changed = step(every_call, 0);
  expect_same_bits(step(keeping, 6), changed, "(version 6 after the weights changed)");
}

// The FP8 row-tile GEMMs' walk (MoeConfig::gemm_tile_group, gemm_expert_groups) reorders
// tiles only: every walk gives the default walk's bits, on skewed routing (experts of 1 to ~20
// row tiles) and with experts that have no rows.
TEST(Fp8LayerGpu, WalkGroupsGiveTheSameBits) {
  for_each_bits_problem(79, [](RoutingKind routing, const MoeShape& shape, HostProblem& problem,
                               DeviceProblem& device) {
    GpuLayer default_walk(shape, fp8_config());
    const HostRank want = test::gpu_step(default_walk, device, problem, /*with_context=*/true);
    struct Walk {
      const char* name;
      int32_t tile_group, expert_groups;
    };
    for (const Walk& walk :
         {Walk{"groups of 1", 1, 0}, Walk{"groups of 3", 3, 0}, Walk{"groups of 1024", 1024, 0},
          Walk{"expert groups of 1", 8, 1}, Walk{"expert groups of 3", 8, 3},
          Walk{"expert groups of 16", 8, 16}}) {
      SCOPED_TRACE(std::string(walk.name) + ", routing " + routing_kind_name(routing));
      MoeConfig config = fp8_config();
      config.gemm_tile_group = walk.tile_group;
      config.gemm_expert_groups = walk.expert_groups;
      GpuLayer layer(shape, config);
      expect_same_bits(test::gpu_step(layer, device, problem, /*with_context=*/true), want,
                       "differs from the default walk's");
    }
  });
}

// The FP8 row-tile GEMMs in 192-row tiles (MoeConfig::fp8_row_tile_rows): each output is summed
// as in the 128-row tiles, so the layer's bits are the default's, on skewed routing (experts
// whose last 192-row tile holds one, two or three chunks of 64 rows) and with empty experts, with
// and without the forward context, launches plain and overlapped.
TEST(Fp8LayerGpu, Rows192TilesGiveTheSameBits) {
  for_each_bits_problem(89, [](RoutingKind routing, const MoeShape& shape, HostProblem& problem,
                               DeviceProblem& device) {
    MoeConfig config_128 = fp8_config();
    config_128.fp8_row_tile_rows = 128;
    GpuLayer tiles_128(shape, config_128);
    for (const bool overlap : {false, true}) {
      MoeConfig config = fp8_config();
      config.fp8_row_tile_rows = 192;
      config.overlap_kernel_launches = overlap;
      GpuLayer tiles_192(shape, config);
      for (const bool with_context : {true, false}) {
        SCOPED_TRACE(std::string(routing_kind_name(routing)) + (overlap ? ", overlapped" : "") +
                     (with_context ? "" : ", recomputed"));
        expect_same_bits(test::gpu_step(tiles_192, device, problem, with_context),
                         test::gpu_step(tiles_128, device, problem, with_context),
                         "differs from the 128-row tiles'");
      }
    }
  });
}

// The FP8 weight gradients with two staging tiles (MoeConfig::fp8_weight_grad_staging_tiles):
// only where each tile waits for its store changes, so the bits are one staging tile's, on
// skewed routing (experts of 1 to ~20 row tiles: weight-gradient tiles of 1 to ~20 K-blocks) and
// with empty experts, launches plain and overlapped: the knob's path through the layer. (Here
// 128 weight-gradient tiles a launch leave most CTAs one tile; the alternation itself is
// checked on 1 and 3 CTAs by Fp8GemmGpu.WeightGradientMatchesTheBlockScaledProduct.)
TEST(Fp8LayerGpu, TwoWeightGradStagingTilesGiveTheSameBits) {
  for_each_bits_problem(97, [](RoutingKind routing, const MoeShape& shape, HostProblem& problem,
                               DeviceProblem& device) {
    GpuLayer one_tile(shape, fp8_config());
    const HostRank want = test::gpu_step(one_tile, device, problem, /*with_context=*/true);
    for (const bool overlap : {false, true}) {
      SCOPED_TRACE(std::string(routing_kind_name(routing)) + (overlap ? ", overlapped" : ""));
      MoeConfig config = fp8_config();
      config.fp8_weight_grad_staging_tiles = 2;
      config.overlap_kernel_launches = overlap;
      GpuLayer two_tiles(shape, config);
      expect_same_bits(test::gpu_step(two_tiles, device, problem, /*with_context=*/true), want,
                       "differs from one staging tile's");
    }
  });
}

// `check(config, trace)` for `base` with each of `places` as MoeConfig::fp8_swiglu, its launches
// plain and overlapped.
template <typename Check>
void for_each_swiglu_variant(const MoeConfig& base, std::initializer_list<Fp8SwigluPlace> places,
                             Check check) {
  for (const Fp8SwigluPlace place : places)
    for (const bool overlap : {false, true}) {
      MoeConfig config = base;
      config.fp8_swiglu = place;
      config.overlap_kernel_launches = overlap;
      check(config, std::to_string(base.fp8_row_tile_rows) + "-row tiles, SwiGLU " +
                        fp8_swiglu_place_name(place) + (overlap ? ", overlapped" : ""));
    }
}

// for_each_bits_problem on 128- and 192-row tiles: `check(routing, shape, problem, device, base,
// forward_only)`, with `base` the FP8 config at that height and `forward_only(layer)` the out of
// a forward that keeps no context.
template <typename Check>
void for_each_tile_height_problem(uint64_t seed, Check check) {
  for_each_bits_problem(seed, [&](RoutingKind routing, const MoeShape& shape, HostProblem& problem,
                                  DeviceProblem& device) {
    auto forward_only = [&](GpuLayer& layer) {
      return test::forward_without_context(layer, device, problem);
    };
    for (const int32_t tile_rows : {128, 192}) {
      MoeConfig base = fp8_config();
      base.fp8_row_tile_rows = tile_rows;
      check(routing, shape, problem, device, base, forward_only);
    }
  });
}

// FP8's SwiGLU in the gate/up GEMM's epilogue (MoeConfig::fp8_swiglu): h's codes and scales are
// the pass's, so the layer's bits are the same in every place, on 128- and 192-row tiles, for a
// step from the forward's context and one that recomputes it, and for a forward that keeps no
// context (the default place's epilogue, which writes neither g nor u), on skewed routing and
// with empty experts, launches plain and overlapped. (The epilogue itself against the pass, on 1
// to all CTAs: Fp8GemmGpu.SwigluInTheGateUpEpilogueMatchesThePass.)
TEST(Fp8LayerGpu, SwigluInTheGateUpEpilogueGivesTheSameBits) {
  for_each_tile_height_problem(
      101, [](RoutingKind routing, const MoeShape& shape, HostProblem& problem,
              DeviceProblem& device, const MoeConfig& base, auto forward_only) {
        MoeConfig config_pass = base;
        config_pass.fp8_swiglu = Fp8SwigluPlace::kPass;
        GpuLayer pass(shape, config_pass);
        const HostRank want_step = test::gpu_step(pass, device, problem, /*with_context=*/true);
        const HostRank want_recomputed = test::gpu_step(pass, device, problem, false);
        const auto want_out = forward_only(pass);
        EXPECT_TRUE(test::bitwise_equal(want_out, want_step.out)) << "the pass, no context";
        for_each_swiglu_variant(
            config_pass, {Fp8SwigluPlace::kGateUp, Fp8SwigluPlace::kGateUpWithoutContext},
            [&](const MoeConfig& config, const std::string& variant) {
              SCOPED_TRACE(std::string(routing_kind_name(routing)) + ", " + variant);
              GpuLayer fused(shape, config);
              expect_same_bits(test::gpu_step(fused, device, problem, true), want_step,
                               "differs from the SwiGLU pass's");
              expect_same_bits(test::gpu_step(fused, device, problem, false), want_recomputed,
                               "differs from the SwiGLU pass's (recomputed)");
              EXPECT_TRUE(test::bitwise_equal(forward_only(fused), want_out))
                  << "out of a forward without a context differs from the SwiGLU pass's";
            });
      });
}

// FP8's x rows gathered and quantized in the gate/up GEMM (MoeConfig::fp8_gather_in_gate_up, a
// forward without a context): the output bits of the pass's layer, on 128- and 192-row tiles,
// with SwiGLU in a pass or in the epilogue, launches plain and overlapped, twice in a row (each
// launch its own epoch of the counters) and after a training step (which keeps the pass); the
// steps' bits unchanged. (The GEMM against the pass on 1 to all CTAs:
// Fp8GemmGpu.GatherInTheGemmMatchesTheGatherPass.)
TEST(Fp8LayerGpu, GatherInTheGateUpGivesTheSameBits) {
  for_each_tile_height_problem(
      103, [](RoutingKind routing, const MoeShape& shape, HostProblem& problem,
              DeviceProblem& device, const MoeConfig& config_pass, auto forward_only) {
        GpuLayer pass(shape, config_pass);
        const HostRank want = test::gpu_step(pass, device, problem, /*with_context=*/true);
        MoeConfig config_gather = config_pass;
        config_gather.fp8_gather_in_gate_up = true;
        for_each_swiglu_variant(
            config_gather, {Fp8SwigluPlace::kPass, Fp8SwigluPlace::kGateUpWithoutContext},
            [&](const MoeConfig& config, const std::string& variant) {
              SCOPED_TRACE(std::string(routing_kind_name(routing)) + ", " + variant);
              GpuLayer gathered(shape, config);
              for (int call = 0; call < 2; ++call)
                EXPECT_TRUE(test::bitwise_equal(forward_only(gathered), want.out))
                    << "out of a forward without a context, call " << call;
              expect_same_bits(test::gpu_step(gathered, device, problem, true), want,
                               "differs from the pass's step");
              EXPECT_TRUE(test::bitwise_equal(forward_only(gathered), want.out))
                  << "out of a forward without a context after a step";
            });
      });
}

// The FP8 layer's launches overlapped (MoeConfig::overlap_kernel_launches): every kernel waits
// for the one before, so the bits are the plain launches', with and without the forward context
// (the recompute's gather, quantization and GEMM), on skewed routing and with empty experts.
TEST(Fp8LayerGpu, OverlappedLaunchesGiveTheSameBits) {
  for_each_bits_problem(83, [](RoutingKind routing, const MoeShape& shape, HostProblem& problem,
                               DeviceProblem& device) {
    GpuLayer plain(shape, fp8_config());
    MoeConfig config = fp8_config();
    config.overlap_kernel_launches = true;
    GpuLayer overlapped(shape, config);
    for (const bool with_context : {true, false}) {
      SCOPED_TRACE(std::string(routing_kind_name(routing)) + (with_context ? "" : ", recomputed"));
      const HostRank want = test::gpu_step(plain, device, problem, with_context);
      for (int call = 0; call < 2; ++call)
        expect_same_bits(test::gpu_step(overlapped, device, problem, with_context), want,
                         "(call " + std::to_string(call) + ")");
    }
  });
}

// Weights given pre-quantized (ForwardArgs::w_*_fp8): the bits of the same weights given as
// bf16, all six pre-quantized or only some, with and without the forward context, and kept
// across calls of one weights_version. A bf16 layer refuses them by name.
TEST(Fp8LayerGpu, PreQuantizedWeightsGiveTheSameBits) {
  const MoeShape shape = make_shape(256, 512, 256, 8, 2, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 78);
  const HostFp8Weights quantized = HostFp8Weights::quantize(shape, problem.ranks[0]);
  DeviceProblem bf16_weights(problem, 0);
  GpuLayer layer(shape, fp8_config());
  const HostRank want = test::gpu_step(layer, bf16_weights, problem, /*with_context=*/true);
  for (const unsigned which : {0x3fu, 0x04u, 0x38u}) {
    SCOPED_TRACE("pre-quantized weights mask " + std::to_string(which));
    DeviceProblem device(problem, 0);
    device.upload_fp8_weights(quantized, which);
    GpuLayer given(shape, fp8_config());
    for (const bool with_context : {true, false}) {
      expect_same_bits(test::gpu_step(given, device, problem, with_context), want,
                       with_context ? "" : "(recomputed)");
    }
    for (int call = 0; call < 2; ++call) {  // the transposed copies kept for version 3
      device.poison_outputs();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ForwardArgs args = device.forward_args();
      args.weights_version = 3;
      BackwardArgs backward = device.backward_args();
      backward.forward.weights_version = 3;
      const ForwardContext context = given.forward(args, nullptr);
      given.backward(backward, nullptr, &context);
      ASSERT_TRUE(given.synchronize(nullptr).ok());
      HostRank got = output_buffers(shape);
      device.download_outputs(got);
      expect_same_bits(got, want, "(version 3, call " + std::to_string(call) + ")");
    }
  }
  DeviceProblem device(problem, 0);
  device.upload_fp8_weights(quantized);
  GpuLayer bf16_layer(shape, MoeConfig{});
  try {
    bf16_layer.forward(device.forward_args(), nullptr);
    ADD_FAILURE() << "a bf16 layer accepted pre-quantized weights";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("pre-quantized FP8 weights"), std::string::npos)
        << error.what();
  }
}

// Pre-quantized gate and up codes as the halves of one fused [E, 2I, H] tensor (Hugging Face's
// FP8 checkpoints store gate_up_proj so): read in place through expert-strided views (the
// forward's TMA maps and the dgrads' transposition take the stride), with the bits of dense
// codes, with and without the forward context, quantized every call (version 0) and kept
// across calls of one version.
TEST(Fp8LayerGpu, PreQuantizedFusedGateUpHalvesGiveTheSameBits) {
  const MoeShape shape = make_shape(256, 512, 256, 8, 2, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 79);
  const HostFp8Weights quantized = HostFp8Weights::quantize(shape, problem.ranks[0]);
  DeviceProblem device(problem, 0);
  device.upload_fp8_weights(quantized);
  GpuLayer dense(shape, fp8_config());
  const HostRank want = test::gpu_step(dense, device, problem, /*with_context=*/true);

  const std::vector<e4m3> fused = fused_gate_up_codes(shape, quantized);
  void* fused_device = nullptr;
  ASSERT_EQ(cudaMalloc(&fused_device, fused.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(fused_device, fused.data(), fused.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  GpuLayer given(shape, fp8_config());
  int call = 0;
  for (const uint64_t version : {0, 5, 5}) {
    for (const bool with_context : {true, false}) {
      device.poison_outputs();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ForwardArgs args = device.forward_args();
      give_fused_gate_up_codes(shape, args, fused_device);
      args.weights_version = version;
      BackwardArgs backward = device.backward_args();
      give_fused_gate_up_codes(shape, backward.forward, fused_device);
      backward.forward.weights_version = version;
      const ForwardContext context = given.forward(args, nullptr);
      given.backward(backward, nullptr, with_context ? &context : nullptr);
      ASSERT_TRUE(given.synchronize(nullptr).ok());
      HostRank got = output_buffers(shape);
      device.download_outputs(got);
      expect_same_bits(got, want,
                       "(version " + std::to_string(version) +
                           (with_context ? "" : ", recomputed") + ", call " +
                           std::to_string(call++) + ")");
    }
  }
  EXPECT_EQ(cudaFree(fused_device), cudaSuccess);
}

TEST(Fp8LayerGpu, RefusesWhatItDoesNotRun) {
  MoeConfig config = fp8_config();
  auto refused = [&](const MoeShape& shape, const MoeConfig& c, const char* text) {
    const Status status = can_implement(c, shape);
    EXPECT_EQ(status.code, ErrorCode::kUnsupported) << text;
    EXPECT_NE(status.message.find(text), std::string::npos) << status.message;
    EXPECT_THROW(GpuLayer(shape, c), Error);
  };
  refused(make_shape(64, 192, 128, 8, 2), config, "hidden a multiple of 128");
  refused(make_shape(100, 256, 128, 8, 2, 1, 128), config, "num_tokens a multiple of 128");
  MoeConfig persistent = config;
  persistent.persistent_backward = true;
  refused(make_shape(64, 256, 128, 8, 2), persistent, "kernel sequences");
  MoeConfig ring = config;
  ring.minibatch_size = 128;
  ring.macrobatch_size = 128;
  refused(make_shape(64, 256, 128, 8, 2), ring, "one macrobatch");
}

}  // namespace
}  // namespace mok
