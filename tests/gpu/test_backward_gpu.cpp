// The single-GPU backward against the CPU reference: d_x, d_router_weights and every weight
// gradient within bf16 tolerance, outputs poisoned before each run, no NaN, bitwise identical
// across repeated runs; shared expert, clamp, zero and negative router weights, empty experts,
// adversarial routings.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "device_memory.h"
#include "gpu_step.h"
#include "mok/gpu_layer.h"
#include "mok/reference.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;

constexpr double kTolerance = 1e-2;

void check_backward(const char* name, const MoeShape& shape, RoutingKind routing, uint64_t seed,
                    bool signed_router_weights = false, const MoeConfig& config = {}) {
  SCOPED_TRACE(std::string(name) + " " + shape.to_string() + " routing " +
               routing_kind_name(routing));
  HostProblem problem = HostProblem::make(shape, routing, seed);
  if (signed_router_weights) {
    std::vector<float>& weights = problem.ranks[0].router_weights;
    for (size_t i = 0; i < weights.size(); ++i)
      weights[i] = i % 3 == 0 ? 0.0f : i % 3 == 1 ? -weights[i] : weights[i];
  }
  problem.poison_outputs();
  reference::backward(problem.shape, problem.backward_args(0));
  const HostRank& want = problem.ranks[0];
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, config);
  const HostRank got = test::gpu_step(layer, device, problem, /*with_context=*/true);

  struct Output {
    const char* name;
    double error;
    bool finite;
  };
  std::vector<Output> outputs;
  test::for_each_output(got, want, [&](const char* output, const auto& g, const auto& w) {
    if (w.empty() || std::string(output) == "out") return;
    outputs.push_back({output, test::relative_error(g, w), test::all_finite(g)});
  });
  std::printf("  %-20s %-40s %-10s", name, shape.to_string().c_str(), routing_kind_name(routing));
  for (const Output& output : outputs) {
    std::printf(" %s %.1e", output.name, output.error);
    EXPECT_TRUE(output.finite) << output.name << " has NaN or Inf (an unwritten element?)";
    EXPECT_LE(output.error, kTolerance) << output.name;
  }
  std::printf("\n");

  const HostRank again = test::gpu_step(layer, device, problem, /*with_context=*/false);
  test::for_each_output(again, got, [&](const char* output, const auto& a, const auto& b) {
    EXPECT_TRUE(test::bitwise_equal(a, b))
        << output
        << ": the step recomputing the forward differs bitwise from the step using the context";
  });
}

using test::expect_same_steps;

TEST(BackwardGpu, MatchesReference) {
  uint64_t seed = 300;
  check_backward("tiny", named_shape("tiny"), RoutingKind::kUniform, ++seed);
  check_backward("tiny shared+clamp", make_shape(64, 256, 128, 8, 2, 1, 192, 0.3f),
                 RoutingKind::kUniform, ++seed);
  check_backward("signed router weights", make_shape(96, 256, 128, 8, 2, 1, 64),
                 RoutingKind::kUniform, ++seed, true);
  check_backward("one token", make_shape(1, 256, 128, 8, 2, 1, 64), RoutingKind::kUniform, ++seed);
  check_backward("medium holes", make_shape(333, 1024, 384, 16, 4), RoutingKind::kHoles, ++seed);
  check_backward("medium skewed shared", make_shape(333, 1024, 384, 16, 4, 1, 128, 0.5f),
                 RoutingKind::kSkewed, ++seed);
  check_backward("all to one expert", make_shape(200, 512, 256, 8, 4), RoutingKind::kOneExpert,
                 ++seed);
  check_backward("no routes", make_shape(130, 512, 256, 8, 4, 1, 64), RoutingKind::kNoRoutes,
                 ++seed);
  check_backward("zero tokens", make_shape(0, 512, 256, 8, 4, 1, 64), RoutingKind::kUniform,
                 ++seed);
  check_backward("many experts", make_shape(257, 768, 256, 64, 8), RoutingKind::kUniform, ++seed);
  check_backward("wide", make_shape(512, 2048, 768, 8, 2, 1, 256), RoutingKind::kUniform, ++seed);
  // More than the d_x combine's eight rows in flight: a second round of rows, with holes.
  check_backward("top 10 with holes", make_shape(200, 768, 256, 16, 10), RoutingKind::kHoles,
                 ++seed);
}

// The GEMMs in CTA pairs (MoeConfig::gemm_cta_pairs) against the reference: pairs of one expert
// multicasting B (wide: 4 row tiles per expert), pairs across experts, odd tile counts, phantom
// weight-gradient tiles (I = 384, the shared experts), no rows at all.
TEST(BackwardGpu, CtaPairsMatchReference) {
  MoeConfig pairs;
  pairs.gemm_cta_pairs = true;
  uint64_t seed = 900;
  check_backward("tiny shared+clamp", make_shape(64, 256, 128, 8, 2, 1, 192, 0.3f),
                 RoutingKind::kUniform, ++seed, false, pairs);
  check_backward("medium skewed shared", make_shape(333, 1024, 384, 16, 4, 1, 128, 0.5f),
                 RoutingKind::kSkewed, ++seed, false, pairs);
  check_backward("all to one expert", make_shape(200, 512, 256, 8, 4), RoutingKind::kOneExpert,
                 ++seed, false, pairs);
  check_backward("zero tokens", make_shape(0, 512, 256, 8, 4, 1, 64), RoutingKind::kUniform, ++seed,
                 false, pairs);
  check_backward("wide", make_shape(512, 2048, 768, 8, 2, 1, 256), RoutingKind::kUniform, ++seed,
                 false, pairs);
}

// The weight gradients in ping-pong (MoeConfig::weight_grad_pingpong) against the reference and
// bitwise against the default tiles: 128 x 128 tiles with partial ones (the shared expert's
// Is = 192: M and N of 192), experts without rows (all to one expert), several tiles per CTA
// (wide), no tokens at all.
TEST(BackwardGpu, WeightGradPingPongMatchesReference) {
  MoeConfig pingpong;
  pingpong.weight_grad_pingpong = true;
  uint64_t seed = 1300;
  struct Case {
    const char* name;
    MoeShape shape;
    RoutingKind routing;
  };
  const Case cases[] = {
      {"tiny shared+clamp", make_shape(64, 256, 128, 8, 2, 1, 192, 0.3f), RoutingKind::kUniform},
      {"medium skewed shared", make_shape(333, 1024, 384, 16, 4, 1, 128, 0.5f),
       RoutingKind::kSkewed},
      {"all to one expert", make_shape(200, 512, 256, 8, 4), RoutingKind::kOneExpert},
      {"zero tokens", make_shape(0, 512, 256, 8, 4, 1, 64), RoutingKind::kUniform},
      {"wide", make_shape(512, 2048, 768, 8, 2, 1, 256), RoutingKind::kUniform},
  };
  for (const Case& c : cases) {
    check_backward(c.name, c.shape, c.routing, ++seed, false, pingpong);
    HostProblem problem = HostProblem::make(c.shape, c.routing, seed);
    DeviceProblem device(problem, 0);
    GpuLayer default_layer(c.shape, MoeConfig{});
    GpuLayer pingpong_layer(c.shape, pingpong);
    const HostRank want = test::gpu_step(default_layer, device, problem, /*with_context=*/true);
    const HostRank got = test::gpu_step(pingpong_layer, device, problem, /*with_context=*/true);
    test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
      EXPECT_TRUE(test::bitwise_equal(a, b)) << c.name << ": " << output;
    });
  }
}

// Every tuning knob leaves the bits alone (DESIGN.md §7): forward and backward outputs are
// bitwise identical across minibatch / macrobatch sizes and the fused local dispatch.
// Every output, bit for bit, whatever the minibatch and macrobatch sizes, the local dispatch
// and the forward kernel. Macrobatches of 256 rows cut this shape's worst case (4864 rows) into
// 19: the ring buffers hold one at a time, the backward recomputes all but macrobatch 0, and the
// weight gradients cross macrobatch boundaries through their fp32 partials; the persistent
// forward runs once per macrobatch (512-row ones in the last config). Routings: skewed
// (expert 0's segment spans several macrobatches), everything to one expert (one segment spans
// all of them, the other experts get zero gradients), holes.
TEST(BackwardGpu, BitwiseInvariantToConfig) {
  const MoeShape shape = make_shape(700, 1024, 384, 16, 4, 1, 128, 0.5f);
  std::vector<MoeConfig> configs(43);
  configs[0].minibatch_size = 128;
  configs[0].macrobatch_size = 256;
  configs[1].minibatch_size = 1024;
  configs[1].macrobatch_size = 4096;
  configs[2].local_dispatch = LocalDispatch::kGatherKernel;
  configs[3].persistent_forward = true;
  configs[3].minibatch_size = 256;
  configs[4].minibatch_size = 128;
  configs[4].macrobatch_size = 384;
  configs[4].local_dispatch = LocalDispatch::kGatherKernel;
  configs[5].persistent_forward = true;
  configs[5].minibatch_size = 128;
  configs[5].macrobatch_size = 512;
  // The persistent backward (its spare warps gathering the rows): the default pipeline (one
  // minibatch here), a deep one, with the persistent forward, and traced (MoeConfig::trace_tasks).
  configs[6].persistent_backward = true;
  configs[7].persistent_backward = true;
  configs[7].minibatch_size = 128;
  configs[8].persistent_backward = true;
  configs[8].persistent_forward = true;
  configs[8].minibatch_size = 256;
  configs[9].persistent_backward = true;
  configs[9].trace_tasks = true;
  configs[9].minibatch_size = 128;
  // The persistent backward with its rows gathered before the launch (the gather-kernel local
  // dispatch) instead of by its spare warps.
  configs[10].persistent_backward = true;
  configs[10].local_dispatch = LocalDispatch::kGatherKernel;
  // CTA pairs multicasting B (MoeConfig::gemm_cta_pairs): row-tile pairs across two experts and
  // odd tile counts (I = 384: three weight-gradient row tiles; the shared expert's one), with
  // macrobatches (weight gradients resumed from partials, experts without rows in a macrobatch)
  // and with the gather kernel.
  configs[11].gemm_cta_pairs = true;
  configs[12].gemm_cta_pairs = true;
  configs[12].minibatch_size = 128;
  configs[12].macrobatch_size = 256;
  configs[13].gemm_cta_pairs = true;
  configs[13].local_dispatch = LocalDispatch::kGatherKernel;
  // Every row tile at 128 rows and every weight gradient over whole segments, alone and with
  // macrobatches (MoeConfig::skip_padding_rows; the default skips what it can).
  configs[14].skip_padding_rows = false;
  configs[15].skip_padding_rows = false;
  configs[15].minibatch_size = 128;
  configs[15].macrobatch_size = 256;
  // The weight gradients in ping-pong (one macrobatch; with macrobatches the launcher runs the
  // 128 x 256 tiles, so config 17 checks that fallback), with and without the padding cut.
  configs[16].weight_grad_pingpong = true;
  configs[16].skip_padding_rows = false;
  configs[17].weight_grad_pingpong = true;
  configs[17].minibatch_size = 128;
  configs[17].macrobatch_size = 512;
  // The forward's GEMMs and both dgrads in 256 x 192 tiles (MoeConfig::gemm_wide_tiles; H = 1024
  // ends in a clipped column tile, I = 384 in exact ones): alone (gate/up with the fused
  // gather), with 3-tile macrobatches (a pair and a lone tile in each window, pairs restarting
  // at each window, h, g, u and dh_raw in the ring), and with the gather kernel and every
  // padding row.
  configs[18].gemm_wide_tiles = true;
  configs[19].gemm_wide_tiles = true;
  configs[19].minibatch_size = 128;
  configs[19].macrobatch_size = 384;
  configs[20].gemm_wide_tiles = true;
  configs[20].local_dispatch = LocalDispatch::kGatherKernel;
  configs[20].skip_padding_rows = false;
  // The expert GEMMs' walk in other groups (MoeConfig::gemm_tile_group): each row tile's columns
  // in turn, and groups of 3 in CTA pairs and in the 256 x 192 tiles.
  configs[21].gemm_tile_group = 1;
  configs[22].gemm_tile_group = 3;
  configs[22].gemm_cta_pairs = true;
  // The expert GEMMs' row tiles split between the L2 partitions the layer's probe finds
  // (MoeConfig::gemm_l2_placement; the block walk where it finds none).
  configs[23].gemm_l2_placement = true;
  // The forward's row-tile GEMMs on four stages, their outputs in two rounds of 128 columns
  // (MoeConfig::gemm_four_stages): with 64-row tiles (this shape's experts average 175 rows), in
  // 3-tile macrobatches (outputs at ring rows), and with the gather kernel and every padding row.
  configs[24].gemm_four_stages = true;
  configs[25].gemm_four_stages = true;
  configs[25].minibatch_size = 128;
  configs[25].macrobatch_size = 384;
  configs[26].gemm_four_stages = true;
  configs[26].local_dispatch = LocalDispatch::kGatherKernel;
  configs[26].skip_padding_rows = false;
  // The row-tile GEMMs' CTAs kept within 8 K-blocks of the slowest
  // (MoeConfig::gemm_lockstep_k_blocks): timing only.
  configs[27].gemm_lockstep_k_blocks = 8;
  // The row-tile GEMMs' tiles by ticket (MoeConfig::gemm_tiles_by_ticket), on three stages with
  // 64-row tiles, and on four stages in 3-tile macrobatches.
  configs[28].gemm_tiles_by_ticket = true;
  configs[29].gemm_tiles_by_ticket = true;
  configs[29].gemm_four_stages = true;
  configs[29].minibatch_size = 128;
  configs[29].macrobatch_size = 384;
  // Groups that start where an expert does (MoeConfig::gemm_expert_aligned_groups): in groups of
  // 3 (so most groups move), and of 8 on four stages in step, in 3-tile macrobatches.
  configs[30].gemm_expert_aligned_groups = true;
  configs[30].gemm_tile_group = 3;
  configs[31].gemm_expert_aligned_groups = true;
  configs[31].gemm_four_stages = true;
  configs[31].gemm_lockstep_k_blocks = 8;
  configs[31].minibatch_size = 128;
  configs[31].macrobatch_size = 384;
  // The dgrads' 64-row tiles (MoeConfig::gemm_dgrad_half_row_tiles), free-running on three
  // stages, and on four in step.
  configs[32].gemm_dgrad_half_row_tiles = true;
  configs[33].gemm_dgrad_half_row_tiles = true;
  configs[33].gemm_four_stages = true;
  configs[33].gemm_lockstep_k_blocks = 16;
  // The SwiGLU backward in the down dgrad's epilogue (MoeConfig::swiglu_backward_in_dgrad;
  // I = 384 ends in a 128-column tile, the shared expert's 128 is one): alone, in 2-tile
  // macrobatches (its router-weight partials at ring rows), and beside the CTA pairs and the
  // four stages in step that the down dgrad then sets aside.
  configs[34].swiglu_backward_in_dgrad = true;
  configs[35].swiglu_backward_in_dgrad = true;
  configs[35].minibatch_size = 128;
  configs[35].macrobatch_size = 256;
  configs[36].swiglu_backward_in_dgrad = true;
  configs[36].gemm_cta_pairs = true;
  configs[37].swiglu_backward_in_dgrad = true;
  configs[37].gemm_four_stages = true;
  configs[37].gemm_lockstep_k_blocks = 8;
  // The launches overlapped (MoeConfig::overlap_kernel_launches): every kernel of the sequence
  // waits for the one before; alone, in macrobatches (the gathers' windows), with the gather
  // kernel, with the SwiGLU epilogue's partial sum and the lockstep's epochs, with CTA pairs
  // (clusters launched overlapped).
  for (int c = 38; c < 43; ++c) configs[c].overlap_kernel_launches = true;
  configs[39].minibatch_size = 128;
  configs[39].macrobatch_size = 256;
  configs[40].local_dispatch = LocalDispatch::kGatherKernel;
  configs[41].swiglu_backward_in_dgrad = true;
  configs[41].gemm_four_stages = true;
  configs[41].gemm_lockstep_k_blocks = 8;
  configs[42].gemm_cta_pairs = true;
  uint64_t seed = 41;
  for (const RoutingKind routing :
       {RoutingKind::kSkewed, RoutingKind::kOneExpert, RoutingKind::kHoles}) {
    HostProblem problem = HostProblem::make(shape, routing, seed++);
    DeviceProblem device(problem, 0);
    GpuLayer reference_layer(shape, MoeConfig{});
    const HostRank want = test::gpu_step(reference_layer, device, problem, /*with_context=*/true);
    for (const MoeConfig& config : configs) {
      GpuLayer layer(shape, config);
      for (const bool with_context : {true, false}) {
        SCOPED_TRACE(testing::Message()
                     << routing_kind_name(routing) << ", minibatch " << config.minibatch_size
                     << " macrobatch " << config.macrobatch_size << " local dispatch "
                     << local_dispatch_name(config.local_dispatch) << " persistent forward "
                     << config.persistent_forward << " persistent backward "
                     << config.persistent_backward << " CTA pairs " << config.gemm_cta_pairs
                     << " skip padding " << config.skip_padding_rows << " ping-pong weight grads "
                     << config.weight_grad_pingpong << " 256 x 192 tiles " << config.gemm_wide_tiles
                     << " tile group " << config.gemm_tile_group << " L2 placement "
                     << config.gemm_l2_placement << " four stages " << config.gemm_four_stages
                     << " lockstep " << config.gemm_lockstep_k_blocks << " by ticket "
                     << config.gemm_tiles_by_ticket << " aligned groups "
                     << config.gemm_expert_aligned_groups << " dgrad half tiles "
                     << config.gemm_dgrad_half_row_tiles << " SwiGLU in dgrad "
                     << config.swiglu_backward_in_dgrad << " overlapped "
                     << config.overlap_kernel_launches << (with_context ? "" : ", no context"));
        const HostRank got = test::gpu_step(layer, device, problem, with_context);
        test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
          EXPECT_TRUE(test::bitwise_equal(a, b)) << output;
        });
      }
    }
  }
}

// The 64-row tiles and the weight gradients cut to the routed rows (MoeConfig::skip_padding_rows)
// give the bits of whole tiles, forward and backward, with and without the context, and within
// the reference's tolerance. 138 routed rows per expert on average (64-row tiles run below 256),
// so most segments end in a 64-row tile (checked on the routing): the forward's GEMMs and the
// backward's recompute run them. Every weight gradient stops at its routed rows, the shared
// expert's too (T % 128 = 40).
TEST(BackwardGpu, SkipPaddingRowsKeepsTheBits) {
  const MoeShape shape = make_shape(552, 1024, 512, 32, 8, 1, 256, 0.5f);
  uint64_t seed = 1200;
  for (const RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kSkewed}) {
    HostProblem problem = HostProblem::make(shape, routing, ++seed);
    std::vector<int64_t> counts(shape.num_experts, 0);
    for (const int32_t expert : problem.ranks[0].top_experts)
      if (expert >= 0) ++counts[expert];
    const int64_t half_tiles = std::count_if(counts.begin(), counts.end(), [](int64_t count) {
      return count % 128 > 0 && count % 128 <= 64;
    });
    SCOPED_TRACE(testing::Message() << routing_kind_name(routing) << ", " << half_tiles
                                    << " experts end in a 64-row tile");
    EXPECT_GE(half_tiles, 4);
    DeviceProblem device(problem, 0);
    MoeConfig whole;
    whole.skip_padding_rows = false;
    GpuLayer whole_layer(shape, whole);
    GpuLayer skipping_layer(shape, MoeConfig{});
    expect_same_steps(whole_layer, skipping_layer, device, problem);
    check_backward("skip padding rows", shape, routing, seed);
  }
}

// The 256 x 192 tiles (MoeConfig::gemm_wide_tiles) alone, small enough for the sanitizers:
// the forward's gate/up (with the fused gather) and down GEMMs and both dgrads give the bits of
// the 128 x 256 tiles, with and without the context, walked in the default groups and in groups
// of 3 (MoeConfig::gemm_tile_group). I = 320 ends the gate/up GEMM in a 32-column tile and the
// down dgrad in a tile of two MN-major chunks; H = 448 ends the down GEMM and the gate/up dgrad
// in a 64-column tile. The skewed routing gives experts of one tile (lone
// units), of two (pairs) and of many (pairs and an odd tile).
TEST(BackwardGpu, WideTilesKeepTheBits) {
  const MoeShape shape = make_shape(300, 448, 320, 8, 4);
  uint64_t seed = 1300;
  for (const RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kSkewed}) {
    SCOPED_TRACE(routing_kind_name(routing));
    HostProblem problem = HostProblem::make(shape, routing, ++seed);
    DeviceProblem device(problem, 0);
    GpuLayer narrow_layer(shape, MoeConfig{});
    for (const int32_t group : {MoeConfig{}.gemm_tile_group, 3}) {
      MoeConfig wide;
      wide.gemm_wide_tiles = true;
      wide.gemm_tile_group = group;
      GpuLayer wide_layer(shape, wide);
      expect_same_steps(narrow_layer, wide_layer, device, problem,
                        ", groups of " + std::to_string(group));
    }
  }
}

// The four-stage ring (MoeConfig::gemm_four_stages) alone, small enough for the sanitizers: the
// forward's gate/up (with the fused gather) and down GEMMs, the backward's recompute (without the
// context) and both dgrads, their outputs stored in two rounds of 128 columns, give the bits of
// the three-stage ring. I = 320 ends the gate/up GEMM and the down dgrad in a 64-column tile
// (the second round stores nothing), H = 448 the down GEMM and the gate/up dgrad in a
// 192-column one (the second round one chunk); the uniform routing's experts of ~150 rows end in
// 64-row tiles, the skewed one's in both kinds.
TEST(BackwardGpu, FourStagesKeepTheBits) {
  const MoeShape shape = make_shape(300, 448, 320, 8, 4);
  uint64_t seed = 1400;
  for (const RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kSkewed}) {
    SCOPED_TRACE(routing_kind_name(routing));
    HostProblem problem = HostProblem::make(shape, routing, ++seed);
    DeviceProblem device(problem, 0);
    GpuLayer three_layer(shape, MoeConfig{});
    MoeConfig four;
    four.gemm_four_stages = true;
    GpuLayer four_layer(shape, four);
    expect_same_steps(three_layer, four_layer, device, problem);
  }
}

// The SwiGLU backward in the down dgrad's epilogue (MoeConfig::swiglu_backward_in_dgrad) gives
// the bits of the standalone pass, with and without the context, and stays within the
// reference's tolerance with every output written. I = 320 ends the down dgrad in a 64-column
// tile (a partial tile of g and u subtiles and router-weight partials), the shared expert's
// Is = 192 is one partial tile (weight 1, no router gradient); a clamp; router weights zero,
// negative and positive. I = 512: two whole tiles, no clamp, no shared expert. No tokens at all.
TEST(BackwardGpu, SwigluInDgradKeepsTheBits) {
  struct Case {
    const char* name;
    MoeShape shape;
    RoutingKind routing;
  };
  const Case cases[] = {
      {"I 320 shared+clamp", make_shape(300, 448, 320, 8, 4, 1, 192, 0.5f), RoutingKind::kUniform},
      {"I 320 skewed shared+clamp", make_shape(300, 448, 320, 8, 4, 1, 192, 0.5f),
       RoutingKind::kSkewed},
      {"I 512", make_shape(200, 512, 512, 8, 4), RoutingKind::kUniform},
      {"zero tokens", make_shape(0, 512, 320, 8, 4, 1, 64), RoutingKind::kUniform},
  };
  MoeConfig dgated;
  dgated.swiglu_backward_in_dgrad = true;
  uint64_t seed = 1500;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    HostProblem problem = HostProblem::make(c.shape, c.routing, ++seed);
    std::vector<float>& weights = problem.ranks[0].router_weights;
    for (size_t i = 0; i < weights.size(); ++i)
      weights[i] = i % 3 == 0 ? 0.0f : i % 3 == 1 ? -weights[i] : weights[i];
    DeviceProblem device(problem, 0);
    GpuLayer standalone_layer(c.shape, MoeConfig{});
    GpuLayer dgated_layer(c.shape, dgated);
    expect_same_steps(standalone_layer, dgated_layer, device, problem);
    check_backward(c.name, c.shape, c.routing, seed, /*signed_router_weights=*/true, dgated);
  }
}

// The ring bounds the routed intermediates: with 256-row macrobatches the workspace holds 256
// rows of x, d_out (H each) and g, u, h, d_g, d_u (I each) instead of the worst case's 4864, plus
// the weight gradients' fp32 partial slots.
TEST(BackwardGpu, MacrobatchesBoundTheWorkspace) {
  const MoeShape shape = make_shape(700, 1024, 384, 16, 4);
  MoeConfig ring;
  ring.minibatch_size = 128;
  ring.macrobatch_size = 256;
  const int64_t whole = GpuLayer(shape, MoeConfig{}).workspace_bytes();
  const int64_t bounded = GpuLayer(shape, ring).workspace_bytes();
  const int64_t H = shape.hidden, I = shape.intermediate;
  const int64_t row_bytes = (2 * H + 5 * I) * 2;
  const int64_t partials = 3 * 2 *
                           std::max((I + 127) / 128 * 128 * ((H + 255) / 256 * 256),
                                    (H + 127) / 128 * 128 * ((I + 255) / 256 * 256)) *
                           4;
  EXPECT_EQ(whole - bounded, (4864 - 256) * row_bytes - partials);
}

// Ten training steps give the same bits (issue 3's acceptance: repeated runs): alternating the
// backward from the forward context and recomputing it, every third step on a fresh layer (a
// fresh workspace and fresh epochs), outputs poisoned before each.
TEST(BackwardGpu, TenStepsGiveTheSameBits) {
  const MoeShape shape = make_shape(333, 1024, 384, 16, 4, 1, 128, 0.5f);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 77);
  DeviceProblem device(problem, 0);
  auto layer = std::make_unique<GpuLayer>(shape, MoeConfig{});
  const HostRank first = test::gpu_step(*layer, device, problem, /*with_context=*/true);
  for (int step = 1; step < 10; ++step) {
    if (step % 3 == 0) layer = std::make_unique<GpuLayer>(shape, MoeConfig{});
    const HostRank again = test::gpu_step(*layer, device, problem, /*with_context=*/step % 2 == 0);
    test::for_each_output(again, first, [&](const char* output, const auto& a, const auto& b) {
      EXPECT_TRUE(test::bitwise_equal(a, b)) << output << " differs in step " << step + 1;
    });
  }
}

TEST(BackwardGpu, StaleContextIsRejected) {
  const MoeShape shape = named_shape("tiny");
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 9);
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, MoeConfig{});
  const ForwardContext first = layer.forward(device.forward_args(), nullptr);
  layer.forward(device.forward_args(), nullptr);
  try {
    layer.backward(device.backward_args(), nullptr, &first);
    FAIL() << "a stale context was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what())
                  .find("context #1 is stale: the layer's workspace holds context #2"),
              std::string::npos)
        << error.what();
  }
  // A backward without a context recomputes into the workspace: the context before it is stale.
  const ForwardContext latest = layer.forward(device.forward_args(), nullptr);
  layer.backward(device.backward_args(), nullptr);
  EXPECT_THROW(layer.backward(device.backward_args(), nullptr, &latest), Error);
}

// A forward with ForwardArgs::keep_context off (no backward follows: torch.no_grad) skips g and u
// (FP8: x's column groups too): the same output bits; its context is one no backward accepts,
// and the one before it is stale; a backward without a context after it recomputes to the bits
// of a step from a kept context. In the kernel sequence (its two epilogue forms: one staging
// round and the four-stage ring's two), the persistent forward, with a shared expert, in FP8.
TEST(BackwardGpu, ForwardWithoutContextKeepsTheBits) {
  struct Variant {
    const char* name;
    MoeConfig config;
  };
  MoeConfig four_stages, persistent, fp8;
  four_stages.gemm_four_stages = true;
  persistent.persistent_forward = true;
  fp8.precision = Precision::kFP8Block;
  // 384 tokens: FP8's shared expert runs whole 128-row tiles.
  const MoeShape shape = make_shape(384, 1024, 384, 16, 4, 1, 256, 0.5f);
  for (const Variant& variant :
       {Variant{"kernel sequence", MoeConfig{}}, Variant{"four stages", four_stages},
        Variant{"persistent forward", persistent}, Variant{"fp8_block", fp8}}) {
    SCOPED_TRACE(variant.name);
    HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 41);
    DeviceProblem device(problem, 0);
    GpuLayer layer(shape, variant.config);
    const HostRank want = test::gpu_step(layer, device, problem, /*with_context=*/true);
    const ForwardContext kept = layer.forward(device.forward_args(), nullptr);

    device.poison_outputs();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ForwardArgs args = device.forward_args();
    args.keep_context = false;
    const ForwardContext none = layer.forward(args, nullptr);
    ASSERT_TRUE(layer.synchronize(nullptr).ok());
    const HostRank forward_only = test::downloaded_outputs(device, problem);
    EXPECT_TRUE(test::bitwise_equal(forward_only.out, want.out));
    EXPECT_EQ(none.generation, 0u);
    EXPECT_FALSE(layer.holds_context(none));
    EXPECT_FALSE(layer.holds_context(kept));
    EXPECT_THROW(layer.backward(device.backward_args(), nullptr, &none), Error);
    EXPECT_THROW(layer.backward(device.backward_args(), nullptr, &kept), Error);

    device.poison_outputs();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    args = device.forward_args();
    args.keep_context = false;
    layer.forward(args, nullptr);
    layer.backward(device.backward_args(), nullptr);
    ASSERT_TRUE(layer.synchronize(nullptr).ok());
    const HostRank got = test::downloaded_outputs(device, problem);
    test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
      EXPECT_TRUE(test::bitwise_equal(a, b)) << output;
    });
  }
}

// Frozen weights (every weight gradient absent): d_x and d_router_weights bitwise those of the
// full backward, the weight-gradient buffers untouched, with the kernel sequence, several
// macrobatches and in FP8; the persistent backward refuses, naming the way out.
// One frozen step against the full one on the same layer: d_x and d_router_weights bitwise
// equal, and the weight gradients never written (the poison stays).
void expect_frozen_step_matches(const MoeShape& shape, const MoeConfig& config, RoutingKind routing,
                                uint64_t seed) {
  HostProblem problem = HostProblem::make(shape, routing, seed);
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, config);
  const HostRank want = test::gpu_step(layer, device, problem, /*with_context=*/true);
  const HostRank got = test::gpu_step(layer, device, problem, /*with_context=*/true, nullptr,
                                      /*weight_gradients=*/false);
  EXPECT_TRUE(test::bitwise_equal(got.d_x, want.d_x));
  EXPECT_TRUE(test::bitwise_equal(got.d_router_weights, want.d_router_weights));
  for (const auto* grad : {&got.d_w_gate, &got.d_w_down, &got.d_w_shared_up})
    for (bf16 value : *grad) ASSERT_EQ(value.bits, kDevicePoisonBf16Bits);
}

TEST(BackwardGpu, FrozenWeightsSkipTheirGradients) {
  const MoeShape shape = make_shape(300, 256, 192, 6, 2, 1, 128);
  MoeConfig macrobatches;
  macrobatches.minibatch_size = 128;
  macrobatches.macrobatch_size = 256;
  for (const MoeConfig& config : {MoeConfig{}, macrobatches}) {
    SCOPED_TRACE(testing::Message() << "macrobatch " << config.macrobatch_size);
    expect_frozen_step_matches(shape, config, RoutingKind::kSkewed, 78);
  }
  {
    SCOPED_TRACE("fp8_block");  // on its own shape: sizes multiples of 128
    MoeConfig fp8;
    fp8.precision = Precision::kFP8Block;
    expect_frozen_step_matches(make_shape(96, 256, 128, 8, 2), fp8, RoutingKind::kUniform, 79);
  }
  MoeConfig persistent;
  persistent.persistent_backward = true;
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 78);
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, persistent);
  try {
    layer.backward(without_weight_gradients(device.backward_args()), nullptr, nullptr);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("persistent_backward"), std::string::npos)
        << error.what();
  }
}

// The routed gate and up weights as the two halves of one fused [E, 2I, H] tensor (Hugging Face's
// gate_up_proj), their gradients written into the halves of one fused gradient: expert-strided
// views, read and written through TMA maps with the larger expert stride. The same bits as
// separate dense tensors, with the kernel sequence, several macrobatches (the weight gradients'
// fp32 partials) and the persistent kernels.
TEST(BackwardGpu, FusedGateUpViewsGiveTheSameBits) {
  const MoeShape shape = make_shape(300, 256, 192, 6, 2, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 77);
  DeviceProblem device(problem, 0);
  const int64_t E = shape.num_local_experts(), I = shape.intermediate, H = shape.hidden;
  const size_t matrix_bytes = static_cast<size_t>(I * H) * sizeof(bf16);
  test::DeviceAllocations memory;
  void* gate_up = memory.allocate(2 * E * matrix_bytes);
  void* d_gate_up = memory.allocate(2 * E * matrix_bytes);
  const ForwardArgs dense = device.forward_args();
  // Expert e: gate rows at 2e * I * H, up rows right after them.
  ASSERT_EQ(cudaMemcpy2D(gate_up, 2 * matrix_bytes, dense.w_gate.data, matrix_bytes, matrix_bytes,
                         E, cudaMemcpyDeviceToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy2D(static_cast<char*>(gate_up) + matrix_bytes, 2 * matrix_bytes,
                         dense.w_up.data, matrix_bytes, matrix_bytes, E, cudaMemcpyDeviceToDevice),
            cudaSuccess);
  auto half = [&](void* base, int which) {
    TensorView view = TensorView::contiguous(static_cast<char*>(base) + which * matrix_bytes,
                                             DType::kBFloat16, {E, I, H}, DeviceType::kCUDA);
    view.strides[0] = 2 * I * H;
    return view;
  };
  std::vector<MoeConfig> configs(3);
  configs[1].minibatch_size = 128;
  configs[1].macrobatch_size = 256;
  configs[2].persistent_forward = true;
  configs[2].persistent_backward = true;
  for (const MoeConfig& config : configs) {
    SCOPED_TRACE(testing::Message() << "macrobatch " << config.macrobatch_size << " persistent "
                                    << config.persistent_forward);
    GpuLayer layer(shape, config);
    const HostRank want = test::gpu_step(layer, device, problem, /*with_context=*/true);
    device.poison_outputs();
    ASSERT_EQ(cudaMemset(d_gate_up, 0xff, 2 * E * matrix_bytes), cudaSuccess);
    ForwardArgs forward = device.forward_args();
    forward.w_gate = half(gate_up, 0);
    forward.w_up = half(gate_up, 1);
    BackwardArgs backward = device.backward_args();
    backward.forward.w_gate = forward.w_gate;
    backward.forward.w_up = forward.w_up;
    backward.d_w_gate = half(d_gate_up, 0);
    backward.d_w_up = half(d_gate_up, 1);
    const ForwardContext context = layer.forward(forward, nullptr);
    layer.backward(backward, nullptr, &context);
    const Status status = layer.synchronize(nullptr);
    ASSERT_TRUE(status.ok()) << status.message;
    HostRank got = output_buffers(shape);
    device.download_outputs(got);
    std::vector<bf16> fused(static_cast<size_t>(2 * E * I * H));
    ASSERT_EQ(cudaMemcpy(fused.data(), d_gate_up, 2 * E * matrix_bytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int64_t e = 0; e < E; ++e) {
      std::memcpy(&got.d_w_gate[e * I * H], &fused[2 * e * I * H], matrix_bytes);
      std::memcpy(&got.d_w_up[e * I * H], &fused[(2 * e + 1) * I * H], matrix_bytes);
    }
    test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
      EXPECT_TRUE(test::bitwise_equal(a, b)) << output;
    });
  }
}

}  // namespace
}  // namespace mok
