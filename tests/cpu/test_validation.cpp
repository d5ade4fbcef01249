// Input validation: every bad shape, config, tensor and expert id gets its own specific error,
// raised before anything runs, and nothing is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "mok/config.h"
#include "mok/fp8.h"
#include "mok/layer_args.h"
#include "mok/reference.h"
#include "mok/schedule.h"
#include "mok/shape.h"

namespace mok {
namespace {

// Owns zero-filled buffers of the tiny shape and hands out valid args; tests break one thing.
struct TinyCall {
  MoeShape shape = named_shape("tiny");
  std::vector<bf16> x, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down, out, d_out,
      d_x, d_w_gate, d_w_up, d_w_down, d_w_shared_gate, d_w_shared_up, d_w_shared_down;
  std::vector<int32_t> top_experts;
  std::vector<float> router_weights, d_router_weights;

  explicit TinyCall(int64_t shared_intermediate = 0) {
    shape.shared_intermediate = shared_intermediate;
    const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate, K = shape.top_k,
                  E = shape.num_local_experts(), Is = shape.shared_intermediate;
    x.resize(T * H);
    out.resize(T * H);
    d_out.resize(T * H);
    d_x.resize(T * H);
    for (auto* w : {&w_gate, &w_up, &w_down, &d_w_gate, &d_w_up, &d_w_down}) w->resize(E * I * H);
    for (auto* w : {&w_shared_gate, &w_shared_up, &w_shared_down, &d_w_shared_gate, &d_w_shared_up,
                    &d_w_shared_down})
      w->resize(Is * H);
    top_experts.resize(T * K);
    for (int64_t i = 0; i < T * K; ++i)
      top_experts[i] = static_cast<int32_t>(i % shape.num_experts);
    router_weights.assign(T * K, 0.5f);
    d_router_weights.resize(T * K);
  }

  LayerPointers pointers() {
    LayerPointers p;
    p.x = x.data();
    p.top_experts = top_experts.data();
    p.router_weights = router_weights.data();
    p.w_gate = w_gate.data();
    p.w_up = w_up.data();
    p.w_down = w_down.data();
    p.w_shared_gate = w_shared_gate.data();
    p.w_shared_up = w_shared_up.data();
    p.w_shared_down = w_shared_down.data();
    p.out = out.data();
    p.d_out = d_out.data();
    p.d_x = d_x.data();
    p.d_router_weights = d_router_weights.data();
    p.d_w_gate = d_w_gate.data();
    p.d_w_up = d_w_up.data();
    p.d_w_down = d_w_down.data();
    p.d_w_shared_gate = d_w_shared_gate.data();
    p.d_w_shared_up = d_w_shared_up.data();
    p.d_w_shared_down = d_w_shared_down.data();
    return p;
  }
  ForwardArgs forward_args() { return make_forward_args(shape, pointers(), DeviceType::kCPU); }
  BackwardArgs backward_args() { return make_backward_args(shape, pointers(), DeviceType::kCPU); }
};

void expect_error(const Status& status, ErrorCode code, const std::vector<std::string>& fragments) {
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code, code) << status.message;
  for (const auto& fragment : fragments)
    EXPECT_NE(status.message.find(fragment), std::string::npos)
        << "message \"" << status.message << "\" lacks \"" << fragment << "\"";
}

// An integer knob of MoeConfig (`field`, named `name`) on `config`: each of `valid` taken by the
// knob checks, each of `invalid` refused, naming "<name> = <value>" and `what_is_valid`.
void expect_int_knob_range(MoeConfig config, int32_t MoeConfig::*field, const std::string& name,
                           std::initializer_list<int32_t> valid,
                           std::initializer_list<int32_t> invalid,
                           const std::string& what_is_valid) {
  for (const int32_t value : valid) {
    config.*field = value;
    EXPECT_TRUE(can_implement_knobs(config, 1).ok()) << name << " = " << value;
  }
  for (const int32_t value : invalid) {
    config.*field = value;
    expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
                 {name + " = " + std::to_string(value), what_is_valid});
  }
}

TEST(ShapeValidation, NamedShapesAreValid) {
  for (const auto& name : named_shape_names()) {
    for (int32_t ranks : {1, 2, 8}) {
      Status status = can_implement(named_shape(name, ranks));
      EXPECT_TRUE(status.ok()) << name << " R=" << ranks << ": " << status.message;
    }
  }
  EXPECT_EQ(named_shape("kimi_slice", 4).num_experts, 32);
  EXPECT_EQ(named_shape("dsv3").num_experts, 256);
}

TEST(ShapeValidation, UnknownNameListsTheKnownOnes) {
  try {
    named_shape("dsv4");
    FAIL() << "no error for an unknown shape name";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("'dsv4'"), std::string::npos);
    EXPECT_NE(std::string(error.what()).find("qwen3"), std::string::npos);
  }
}

TEST(ShapeValidation, EachBadFieldIsNamed) {
  const MoeShape good = named_shape("tiny");
  ASSERT_TRUE(can_implement(good).ok());
  struct Case {
    void (*mutate)(MoeShape&);
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {[](MoeShape& s) { s.hidden = 100; }, {"hidden = 100", "multiple of 64"}},
      {[](MoeShape& s) { s.hidden = 0; }, {"hidden = 0"}},
      {[](MoeShape& s) { s.intermediate = 96; }, {"intermediate = 96"}},
      {[](MoeShape& s) { s.shared_intermediate = 65; }, {"shared_intermediate = 65", "0 (none)"}},
      {[](MoeShape& s) { s.num_tokens = -1; }, {"num_tokens = -1"}},
      {[](MoeShape& s) { s.top_k = 0; }, {"top_k = 0"}},
      {[](MoeShape& s) { s.top_k = 33; }, {"top_k = 33", "[1, 32]"}},
      {[](MoeShape& s) { s.num_ranks = 3; }, {"num_experts = 8", "multiple of num_ranks = 3"}},
      {[](MoeShape& s) { s.num_ranks = 0; }, {"num_ranks = 0"}},
      {[](MoeShape& s) { s.num_experts = 4096; }, {"num_experts = 4096"}},
      {[](MoeShape& s) { s.swiglu_limit = 0.0f; }, {"swiglu_limit"}},
      {[](MoeShape& s) { s.swiglu_limit = std::nanf(""); }, {"swiglu_limit"}},
      {[](MoeShape& s) {
         s.num_tokens = 1 << 20;
         s.top_k = 32;
         s.num_ranks = 64;
         s.num_experts = 64;
       },
       {"int32"}},
  };
  for (const auto& test_case : cases) {
    MoeShape shape = good;
    test_case.mutate(shape);
    expect_error(can_implement(shape), ErrorCode::kInvalidArgument, test_case.fragments);
  }
}

TEST(ConfigValidation, EachBadKnobIsNamed) {
  const MoeShape shape = named_shape("tiny", 2);
  MoeConfig good;
  ASSERT_TRUE(can_implement(good, shape).ok());
  MoeConfig config = good;
  config.minibatch_size = 100;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"minibatch_size = 100", "128"});
  config = good;
  config.minibatch_size = 4096;
  config.macrobatch_size = 6144;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"macrobatch_size = 6144", "minibatch_size = 4096"});
  config = good;  // an automatic minibatch: the macrobatch has to be whole row tiles
  config.macrobatch_size = 200;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"macrobatch_size = 200", "multiple of 128"});
  config = good;
  config.fwd_num_comm_sms = 0;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument, {"fwd_num_comm_sms = 0"});
  EXPECT_TRUE(can_implement(config, named_shape("tiny", 1)).ok()) << "one rank needs no comm SMs";
  config = good;
  config.bwd_num_comm_sms = 1000;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"bwd_num_comm_sms = 1000"});
  config = good;
  config.wait_timeout_s = -1;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument, {"wait_timeout_s"});
  config = good;
  config.local_dispatch = static_cast<LocalDispatch>(7);
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"local_dispatch = 7", "gather-kernel", "producer-warps"});
  // The dispatch inside the gate/up GEMM is a pull, run by the producer warps, in bf16.
  config = good;
  config.ep_dispatch_in_gemm = true;
  EXPECT_TRUE(can_implement(config, shape).ok());
  config.ep_push_dispatch = true;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"ep_dispatch_in_gemm = true with ep_push_dispatch = true", "a pull"});
  config = good;
  config.ep_dispatch_in_gemm = true;
  config.local_dispatch = LocalDispatch::kGatherKernel;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"ep_dispatch_in_gemm = true with local_dispatch = gather-kernel",
                "local_dispatch = producer-warps"});
  config = good;
  config.ep_dispatch_in_gemm = true;
  config.precision = Precision::kFP8Block;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"ep_dispatch_in_gemm = true with precision = fp8_block", "precision = bf16"});
}

// The 256 x 192 tiles (MoeConfig::gemm_wide_tiles) with what they do not run, each named;
// alone they run at every named shape.
TEST(ConfigValidation, WideTilesNameWhatExcludesThem) {
  MoeConfig wide;
  wide.gemm_wide_tiles = true;
  for (const std::string& name : named_shape_names())
    EXPECT_TRUE(can_implement(wide, named_shape(name)).ok()) << name;
  const MoeShape shape = named_shape("tiny");
  MoeConfig config = wide;
  config.gemm_cta_pairs = true;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"gemm_wide_tiles = true with gemm_cta_pairs = true"});
  config = wide;
  config.persistent_forward = true;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"gemm_wide_tiles = true with persistent_forward = true"});
  config = wide;
  config.persistent_backward = true;
  expect_error(can_implement(config, shape), ErrorCode::kInvalidArgument,
               {"gemm_wide_tiles = true with persistent_backward = true"});
  config = wide;
  config.ep_dispatch_in_gemm = true;
  expect_error(can_implement_knobs(config, 2), ErrorCode::kInvalidArgument,
               {"gemm_wide_tiles = true with ep_dispatch_in_gemm = true"});
  config = wide;
  config.precision = Precision::kFP8Block;
  expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
               {"gemm_wide_tiles = true with precision = fp8_block"});
  MoeShape many = shape;
  many.num_experts = 2048;
  many.top_k = 2;
  expect_error(can_implement(wide, many), ErrorCode::kUnsupported,
               {"gemm_wide_tiles = true with 2048 local experts", "at most 1024"});
}

// The SwiGLU backward in the down dgrad's epilogue (MoeConfig::swiglu_backward_in_dgrad) with
// what has no such epilogue, each named; beside the GEMM variants it sets aside in that GEMM
// (CTA pairs, four stages, tiles by ticket) and the persistent forward it runs.
TEST(ConfigValidation, SwigluInDgradNamesWhatExcludesIt) {
  MoeConfig dgated;
  dgated.swiglu_backward_in_dgrad = true;
  for (const std::string& name : named_shape_names())
    EXPECT_TRUE(can_implement(dgated, named_shape(name)).ok()) << name;
  for (auto knob : {&MoeConfig::gemm_cta_pairs, &MoeConfig::gemm_four_stages,
                    &MoeConfig::gemm_tiles_by_ticket, &MoeConfig::persistent_forward}) {
    MoeConfig config = dgated;
    config.*knob = true;
    EXPECT_TRUE(can_implement_knobs(config, 1).ok());
  }
  const std::string with = "swiglu_backward_in_dgrad = true with ";
  MoeConfig config = dgated;
  config.persistent_backward = true;
  expect_error(can_implement(config, named_shape("tiny")), ErrorCode::kInvalidArgument,
               {with + "persistent_backward = true", "its own SwiGLU task"});
  config = dgated;
  config.precision = Precision::kFP8Block;
  expect_error(can_implement(config, named_shape("tiny")), ErrorCode::kInvalidArgument,
               {with + "precision = fp8_block", "valid: precision = bf16"});
  config = dgated;
  config.gemm_wide_tiles = true;
  expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
               {with + "gemm_wide_tiles = true", "256 x 192"});
  config = dgated;
  config.ep_dispatch_in_gemm = true;
  expect_error(can_implement_knobs(config, 2), ErrorCode::kInvalidArgument,
               {with + "ep_dispatch_in_gemm = true", "valid: at most one of them"});
}

// The variants of the bf16 128 x 256 GEMMs without CTA pairs (MoeConfig::gemm_l2_placement,
// gemm_four_stages, gemm_expert_aligned_groups, gemm_dgrad_half_row_tiles,
// gemm_tiles_by_ticket) with what they do not run, each named; the
// four-stage ring beside the persistent forward too (the kernel sequences' GEMMs take it, the
// others keep three stages).
TEST(ConfigValidation, GemmVariantsNameWhatExcludesThem) {
  for (const auto& [name, knob] :
       {std::pair{"gemm_l2_placement", &MoeConfig::gemm_l2_placement},
        std::pair{"gemm_four_stages", &MoeConfig::gemm_four_stages},
        std::pair{"gemm_expert_aligned_groups", &MoeConfig::gemm_expert_aligned_groups},
        std::pair{"gemm_dgrad_half_row_tiles", &MoeConfig::gemm_dgrad_half_row_tiles},
        std::pair{"gemm_tiles_by_ticket", &MoeConfig::gemm_tiles_by_ticket}}) {
    SCOPED_TRACE(name);
    MoeConfig variant;
    variant.*knob = true;
    EXPECT_TRUE(can_implement_knobs(variant, 1).ok());
    const std::string with = std::string(name) + " = true with ";
    MoeConfig config = variant;
    config.gemm_cta_pairs = true;
    expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
                 {with + "gemm_cta_pairs = true"});
    config = variant;
    config.gemm_wide_tiles = true;
    expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
                 {with + "gemm_wide_tiles = true"});
    config = variant;
    config.precision = Precision::kFP8Block;
    expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
                 {with + "precision = fp8_block"});
  }
  MoeConfig deep;
  deep.gemm_four_stages = true;
  deep.persistent_forward = true;
  EXPECT_TRUE(can_implement_knobs(deep, 1).ok());
}

// MoeConfig::gemm_expert_groups: 0 (off) or 1 to kMaxTileGroup row tiles, on the FP8 GEMMs;
// the bf16 layer refuses it by name.
TEST(ConfigValidation, ExpertGroupsAreFp8RowTileGroups) {
  MoeConfig config;
  config.precision = Precision::kFP8Block;
  expect_int_knob_range(config, &MoeConfig::gemm_expert_groups, "gemm_expert_groups",
                        {0, 1, 16, kMaxTileGroup}, {-1, kMaxTileGroup + 1},
                        "valid: 0 (fixed groups of 8)");
  MoeConfig bf16;
  bf16.gemm_expert_groups = 16;
  expect_error(can_implement_knobs(bf16, 1), ErrorCode::kInvalidArgument,
               {"gemm_expert_groups = 16 with precision = bf16", "valid: gemm_expert_groups = 0"});
}

// MoeConfig::fp8_row_tile_rows: 0 (automatic), 128 or 192, the 192-row tiles on the FP8 GEMMs
// only and not with the expert groups walk, each refusal naming the value and what is valid.
TEST(ConfigValidation, Fp8RowTileRowsAreAutomatic128Or192) {
  MoeConfig config;
  EXPECT_EQ(config.fp8_row_tile_rows, kAutoFp8RowTileRows);
  config.precision = Precision::kFP8Block;
  expect_int_knob_range(config, &MoeConfig::fp8_row_tile_rows, "fp8_row_tile_rows",
                        {kAutoFp8RowTileRows, 128, 192}, {-1, 64, 256},
                        "valid: 0 (automatic), 128 or 192");
  config.fp8_row_tile_rows = 192;
  config.gemm_expert_groups = 16;
  expect_error(
      can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
      {"fp8_row_tile_rows = 192 with gemm_expert_groups = 16", "valid: gemm_expert_groups = 0"});
  MoeConfig bf16;
  bf16.fp8_row_tile_rows = 192;
  expect_error(can_implement_knobs(bf16, 1), ErrorCode::kInvalidArgument,
               {"fp8_row_tile_rows = 192 with precision = bf16", "valid: fp8_row_tile_rows = 128"});
}

// MoeConfig::fp8_weight_grad_staging_tiles: 1 or 2, two on the FP8 weight gradients only, each
// refusal naming the value and what is valid.
TEST(ConfigValidation, Fp8WeightGradStagingTilesAreOneOrTwo) {
  MoeConfig config;
  EXPECT_EQ(config.fp8_weight_grad_staging_tiles, 1);
  config.precision = Precision::kFP8Block;
  expect_int_knob_range(config, &MoeConfig::fp8_weight_grad_staging_tiles,
                        "fp8_weight_grad_staging_tiles", {1, 2}, {0, 3, -1}, "valid: 1 or 2");
  MoeConfig bf16;
  bf16.fp8_weight_grad_staging_tiles = 2;
  expect_error(can_implement_knobs(bf16, 1), ErrorCode::kInvalidArgument,
               {"fp8_weight_grad_staging_tiles = 2 with precision = bf16",
                "valid: fp8_weight_grad_staging_tiles = 1"});
}

// MoeConfig::fp8_row_tile_rows left automatic: 192-row tiles where the experts average at least
// 768 routed rows and I is at least 2048 (`dsv3_local`, `kimi_slice` and `dsv3` on eight ranks of
// the named shapes), 128 elsewhere, under bf16 and under the expert groups walk; a caller's choice
// stands; what with_auto_choices makes is a config can_implement takes.
TEST(ConfigValidation, AutoFp8RowTilesFollowTheRowsPerExpertAndI) {
  MoeConfig fp8;
  fp8.precision = Precision::kFP8Block;
  for (const std::string& name : named_shape_names()) {
    const MoeShape shape = named_shape(name);
    const bool tall = name == "dsv3_local" || name == "kimi_slice";
    EXPECT_EQ(fp8_row_tile_rows_for(fp8, shape), tall ? 192 : 128) << name;
    const MoeConfig runs = with_auto_choices(fp8, shape);
    EXPECT_EQ(runs.fp8_row_tile_rows, tall ? 192 : 128) << name;
    EXPECT_TRUE(can_implement(runs, shape).ok()) << name;
    EXPECT_EQ(with_auto_choices(MoeConfig{}, shape).fp8_row_tile_rows, 128) << name;
  }
  const MoeShape dsv3_local = named_shape("dsv3_local");
  // dsv3 on eight ranks: 1024 rows per expert, as at dsv3_local; on two, 256.
  EXPECT_EQ(fp8_row_tile_rows_for(fp8, named_shape("dsv3", 8)), 192);
  EXPECT_EQ(fp8_row_tile_rows_for(fp8, named_shape("dsv3", 2)), 128);
  // Just under and at the row bound (T * K * R / E = 768), and I just under 2048.
  MoeShape edge = dsv3_local;
  edge.num_tokens = 768 * 32 / 8 - 1;
  EXPECT_EQ(fp8_row_tile_rows_for(fp8, edge), 128);
  edge.num_tokens = 768 * 32 / 8;
  EXPECT_EQ(fp8_row_tile_rows_for(fp8, edge), 192);
  edge.intermediate = 1920;
  EXPECT_EQ(fp8_row_tile_rows_for(fp8, edge), 128);
  MoeConfig groups = fp8;
  groups.gemm_expert_groups = 16;
  EXPECT_EQ(fp8_row_tile_rows_for(groups, dsv3_local), 128);
  MoeConfig chosen = fp8;
  chosen.fp8_row_tile_rows = 128;
  EXPECT_EQ(with_auto_choices(chosen, dsv3_local).fp8_row_tile_rows, 128);
  chosen.fp8_row_tile_rows = 192;
  EXPECT_EQ(with_auto_choices(chosen, named_shape("qwen3")).fp8_row_tile_rows, 192);
}

// The row-tile GEMMs' lockstep (MoeConfig::gemm_lockstep_k_blocks): 0 (off) or 2 to
// kMaxLockstepKBlocks K-blocks, with the four-stage ring, the L2 placement, the 256 x 192 tiles
// and FP8, not with CTA pairs (named).
TEST(ConfigValidation, LockstepIsOffOrALeadOfK_blocks) {
  MoeConfig config;
  expect_int_knob_range(config, &MoeConfig::gemm_lockstep_k_blocks, "gemm_lockstep_k_blocks",
                        {0, 2, 16, kMaxLockstepKBlocks}, {1, -4, kMaxLockstepKBlocks + 1},
                        "valid: 0 (off) or 2 to");
  MoeConfig lockstep;
  lockstep.gemm_lockstep_k_blocks = 16;
  lockstep.gemm_four_stages = true;
  lockstep.gemm_l2_placement = true;
  EXPECT_TRUE(can_implement_knobs(lockstep, 1).ok());
  lockstep.gemm_four_stages = false;
  lockstep.gemm_l2_placement = false;
  config = lockstep;
  config.gemm_cta_pairs = true;
  expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
               {"gemm_lockstep_k_blocks = 16 with gemm_cta_pairs = true"});
  config = lockstep;
  config.gemm_wide_tiles = true;
  EXPECT_TRUE(can_implement_knobs(config, 1).ok());
  config = lockstep;
  config.precision = Precision::kFP8Block;
  EXPECT_TRUE(can_implement_knobs(config, 1).ok());
}

// The tiles by ticket (MoeConfig::gemm_tiles_by_ticket), beyond what every GEMM variant
// excludes (above): with the four-stage ring, not with the L2 placement or the lockstep, each
// named.
TEST(ConfigValidation, TilesByTicketNameWhatExcludesThem) {
  MoeConfig tickets;
  tickets.gemm_tiles_by_ticket = true;
  MoeConfig deep = tickets;
  deep.gemm_four_stages = true;
  EXPECT_TRUE(can_implement_knobs(deep, 1).ok());
  const std::string with = "gemm_tiles_by_ticket = true with ";
  MoeConfig config = tickets;
  config.gemm_l2_placement = true;
  expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
               {with + "gemm_l2_placement = true"});
  config = tickets;
  config.gemm_lockstep_k_blocks = 16;
  expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
               {with + "gemm_lockstep_k_blocks = 16"});
}

// The expert GEMMs' walk group (MoeConfig::gemm_tile_group): 1 to kMaxTileGroup row tiles.
TEST(ConfigValidation, TileGroupIsOneToTheMost) {
  MoeConfig config;
  expect_int_knob_range(config, &MoeConfig::gemm_tile_group, "gemm_tile_group",
                        {1, 3, 8, kMaxTileGroup}, {0, -2, kMaxTileGroup + 1},
                        "valid: 1 to 1024 row tiles");
}

// The knob checks alone (no sizes: what the Python package's CPU path runs) refuse what the
// full check refuses for the same knobs, with the same words.
TEST(ConfigValidation, KnobChecksNeedNoShape) {
  EXPECT_TRUE(can_implement_knobs(MoeConfig{}, 1).ok());
  MoeConfig config;
  config.minibatch_size = 100;
  expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
               {"minibatch_size = 100", "128"});
  config = MoeConfig{};
  config.fwd_num_comm_sms = 0;
  EXPECT_TRUE(can_implement_knobs(config, 1).ok()) << "one rank needs no comm SMs";
  expect_error(can_implement_knobs(config, 2), ErrorCode::kInvalidArgument,
               {"fwd_num_comm_sms = 0", "at least 1 with more than one rank"});
  config = MoeConfig{};
  config.wait_timeout_s = -1.0;
  const Status knobs = can_implement_knobs(config, 1);
  const Status full = can_implement(config, named_shape("tiny", 1));
  EXPECT_FALSE(knobs.ok());
  EXPECT_EQ(knobs.message, full.message);
}

// The default ring (kAutoMacrobatch): one macrobatch at every named shape, the byte budget's
// largest multiple of the minibatch beyond it, and an explicit size taken as given.
TEST(ConfigValidation, AutoMacrobatchFitsItsBudget) {
  constexpr int32_t kSms = 132;
  const MoeConfig config;
  ASSERT_EQ(config.macrobatch_size, kAutoMacrobatch);
  for (const std::string& name : named_shape_names()) {
    const MoeShape shape = named_shape(name);
    const int64_t max_rows = schedule_params(shape).max_rows();
    EXPECT_EQ(macrobatch_ring_rows(config, shape, max_rows, kSms), max_rows) << name;
  }
  const MoeShape sonic = named_shape("sonic_e128");
  EXPECT_EQ(macrobatch_ring_bytes_per_row(sonic), 2 * (2 * 4096 + 5 * 1024));
  const int64_t huge = 4 * schedule_params(sonic).max_rows();  // 29.6 GB of ring
  const int64_t rows = macrobatch_ring_rows(config, sonic, huge, kSms);
  const int64_t minibatch = minibatch_rows(config, sonic, kSms);
  EXPECT_EQ(rows % minibatch, 0);
  EXPECT_LE(rows * macrobatch_ring_bytes_per_row(sonic), kAutoMacrobatchRingBytes);
  EXPECT_GT((rows + minibatch) * macrobatch_ring_bytes_per_row(sonic), kAutoMacrobatchRingBytes);
  MoeConfig fixed;
  fixed.macrobatch_size = 8192;
  EXPECT_EQ(macrobatch_ring_rows(fixed, sonic, huge, kSms), 8192);
  EXPECT_EQ(macrobatch_ring_rows(fixed, sonic, 1024, kSms), 1024)
      << "never more than the worst case";
  EXPECT_TRUE(can_implement(fixed, sonic).ok());
}

// The automatic minibatch (kAutoMinibatch, the default): the fewest 128-row tiles that give the
// narrowest expert-grouped GEMM of a minibatch two full waves on the GPU's SMs; under an
// explicit macrobatch the smallest such size that divides it; an explicit size as given.
TEST(ConfigValidation, AutoMinibatchGivesEachGemmTwoWaves) {
  const MoeConfig config;
  ASSERT_EQ(config.minibatch_size, kAutoMinibatch);
  // The column tiles per row tile of the four row-tile GEMMs (the forward's gate/up: 128 of I;
  // down and the gate/up dgrad: 256 of H; the down dgrad: 256 of I).
  auto narrowest = [](const MoeShape& s) {
    return std::min(
        {(s.intermediate + 127) / 128, (s.hidden + 255) / 256, (s.intermediate + 255) / 256});
  };
  for (int32_t sms : {1, 78, 114, 132}) {
    for (const std::string& name : named_shape_names()) {
      const MoeShape shape = named_shape(name);
      const int64_t rows = minibatch_rows(config, shape, sms);
      ASSERT_EQ(rows % 128, 0) << name;
      const int64_t tiles = rows / 128 * narrowest(shape);
      EXPECT_GE(tiles, 2 * sms) << name << " on " << sms << " SMs: " << rows << " rows";
      EXPECT_LT(tiles - narrowest(shape), 2 * sms) << name << ": one row tile fewer would do";
    }
  }
  // The named shapes on an H100/H200 (132 SMs).
  EXPECT_EQ(minibatch_rows(config, named_shape("dsv3_local"), 132), 33 * 128);  // 8 tiles per row
  EXPECT_EQ(minibatch_rows(config, named_shape("qwen3"), 132), 88 * 128);       // 3 tiles per row
  MoeConfig ring;
  ring.macrobatch_size = 8192;  // 4224 rows does not divide it: 8192 does
  EXPECT_EQ(minibatch_rows(ring, named_shape("dsv3_local"), 132), 8192);
  ring.macrobatch_size = 128 * 99;  // 33 tiles divide 99
  EXPECT_EQ(minibatch_rows(ring, named_shape("dsv3_local"), 132), 33 * 128);
  ring.macrobatch_size = 256;  // smaller than the rule: the macrobatch itself
  EXPECT_EQ(minibatch_rows(ring, named_shape("dsv3_local"), 132), 256);
  EXPECT_TRUE(can_implement(ring, named_shape("dsv3_local")).ok());
  MoeConfig fixed;
  fixed.minibatch_size = 512;
  EXPECT_EQ(minibatch_rows(fixed, named_shape("dsv3_local"), 132), 512);
  expect_error(
      [&] {
        try {
          minibatch_rows(config, named_shape("tiny"), 0);
        } catch (const Error& error) {
          return Status{error.code(), error.what()};
        }
        return Status::Ok();
      }(),
      ErrorCode::kInvalidArgument, {"num_sms = 0"});
}

// What the GPU's FP8 path runs (one GPU or a group, the kernel sequences, one macrobatch,
// extents and, with a shared expert, tokens in multiples of 128; reductions up to
// kFp8MaxReduction) and what it refuses, by name.
TEST(ConfigValidation, Fp8RunsWhatItSupportsAndNamesTheRest) {
  MoeConfig fp8;
  fp8.precision = Precision::kFP8Block;
  MoeShape shape = named_shape("tiny");
  shape.hidden = 256;
  shape.intermediate = 128;
  EXPECT_TRUE(can_implement(fp8, shape).ok()) << can_implement(fp8, shape).message;
  EXPECT_TRUE(can_implement(fp8, named_shape("dsv3_local")).ok());
  EXPECT_TRUE(can_implement(fp8, named_shape("qwen3")).ok());
  MoeShape odd = shape;
  odd.hidden = 192;
  expect_error(can_implement(fp8, odd), ErrorCode::kUnsupported,
               {"precision = fp8_block", "hidden a multiple of 128", "192"});
  MoeShape wide = shape;  // a row tile's B scales along K live in shared memory
  wide.intermediate = kFp8MaxReduction / 2;
  EXPECT_TRUE(can_implement(fp8, wide).ok()) << can_implement(fp8, wide).message;
  wide.intermediate += 128;
  expect_error(can_implement(fp8, wide), ErrorCode::kUnsupported,
               {"precision = fp8_block", "2 * intermediate", "at most 32768", "33024"});
  wide = shape;
  wide.hidden = kFp8MaxReduction + 128;
  expect_error(can_implement(fp8, wide), ErrorCode::kUnsupported, {"hidden", "32896"});
  MoeShape group = shape;  // expert parallelism: the exchange's bf16 rows, quantized per rank
  group.num_ranks = 2;
  group.num_experts = 16;
  EXPECT_TRUE(can_implement(fp8, group).ok()) << can_implement(fp8, group).message;
  MoeConfig persistent = fp8;
  persistent.persistent_forward = true;
  expect_error(can_implement(persistent, shape), ErrorCode::kUnsupported, {"kernel sequences"});
  MoeConfig ring = fp8;
  ring.minibatch_size = 128;
  ring.macrobatch_size = 128;
  expect_error(can_implement(ring, shape), ErrorCode::kUnsupported,
               {"one macrobatch", "macrobatch_size = 128"});
  MoeShape shared = shape;
  shared.shared_intermediate = 128;
  shared.num_tokens = 200;
  expect_error(can_implement(fp8, shared), ErrorCode::kUnsupported,
               {"num_tokens a multiple of 128", "200"});
  shared.num_tokens = 256;
  EXPECT_TRUE(can_implement(fp8, shared).ok());
}

// MoeConfig::fp8_swiglu: in the gate/up GEMM's epilogue without a context by default; each
// place's name round-trips, and an unknown name or value is refused naming the valid ones.
TEST(ConfigValidation, Fp8SwigluPlaces) {
  EXPECT_EQ(MoeConfig{}.fp8_swiglu, Fp8SwigluPlace::kGateUpWithoutContext);
  MoeConfig config;
  config.precision = Precision::kFP8Block;
  for (Fp8SwigluPlace place :
       {Fp8SwigluPlace::kPass, Fp8SwigluPlace::kGateUpWithoutContext, Fp8SwigluPlace::kGateUp}) {
    EXPECT_EQ(fp8_swiglu_place_from_name(fp8_swiglu_place_name(place)), place);
    config.fp8_swiglu = place;
    EXPECT_TRUE(can_implement_knobs(config, 1).ok()) << fp8_swiglu_place_name(place);
  }
  config.fp8_swiglu = static_cast<Fp8SwigluPlace>(3);
  expect_error(can_implement_knobs(config, 1), ErrorCode::kInvalidArgument,
               {"fp8_swiglu = 3", "0 (pass)", "2 (gate-up)"});
  try {
    fp8_swiglu_place_from_name("epilogue");
    FAIL() << "an unknown name was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("'epilogue' is unknown; valid: pass, "),
              std::string::npos)
        << error.what();
  }
}

TEST(ConfigValidation, LocalDispatchNamesRoundTrip) {
  for (LocalDispatch mode : {LocalDispatch::kGatherKernel, LocalDispatch::kProducerWarps})
    EXPECT_EQ(local_dispatch_from_name(local_dispatch_name(mode)), mode);
  try {
    local_dispatch_from_name("tma");
    FAIL() << "an unknown name was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("'tma' is unknown; valid: gather-kernel"),
              std::string::npos)
        << error.what();
  }
}

TEST(ArgsValidation, ValidArgsPass) {
  for (int64_t shared : {0, 64}) {
    TinyCall call(shared);
    EXPECT_TRUE(check_forward_args(call.shape, call.forward_args(), DeviceType::kCPU).ok());
    Status status = check_backward_args(call.shape, call.backward_args(), DeviceType::kCPU);
    EXPECT_TRUE(status.ok()) << status.message;
  }
}

TEST(ArgsValidation, EachBadTensorIsNamed) {
  TinyCall call(64);
  auto check = [&](auto mutate, ErrorCode code, std::vector<std::string> fragments) {
    ForwardArgs args = call.forward_args();
    mutate(args);
    expect_error(check_forward_args(call.shape, args, DeviceType::kCPU), code, fragments);
  };
  const auto bad = ErrorCode::kInvalidArgument;
  check([](ForwardArgs& a) { a.x = TensorView(); }, bad, {"`x` is missing", "[T=64, H=256] bf16"});
  check([](ForwardArgs& a) { a.router_weights.dtype = DType::kBFloat16; }, bad,
        {"`router_weights` has dtype bf16; expected fp32"});
  check([](ForwardArgs& a) { a.top_experts.dtype = DType::kFloat32; }, bad,
        {"`top_experts` has dtype fp32; expected int32 or int64"});
  check([](ForwardArgs& a) { std::swap(a.w_gate.shape[1], a.w_gate.shape[2]); }, bad,
        {"`w_gate` has shape [8, 256, 128]", "[E_loc=8, I=128, H=256]"});
  check([](ForwardArgs& a) { a.w_down.ndim = 2; }, bad, {"`w_down` has shape [8, 256]"});
  check([](ForwardArgs& a) { a.x.strides[0] = 512; }, bad, {"`x` is not contiguous", "[512, 1]"});
  check([](ForwardArgs& a) { a.out.device_type = DeviceType::kCUDA; }, bad,
        {"`out` is on cuda; expected a cpu tensor"});
  check([](ForwardArgs& a) { a.w_shared_up.shape[0] = 128; }, bad,
        {"`w_shared_up` has shape [128, 256]"});
  check([](ForwardArgs& a) { a.out.data = a.x.data; }, bad, {"output `out` overlaps input `x`"});
  check([](ForwardArgs& a) { a.router_weights.data = nullptr; }, bad,
        {"`router_weights` has a null data pointer"});

  TinyCall routed_only(0);
  ForwardArgs args = routed_only.forward_args();
  args.w_shared_gate = call.forward_args().w_shared_gate;
  expect_error(check_forward_args(routed_only.shape, args, DeviceType::kCPU), bad,
               {"`w_shared_gate` was given", "no shared expert"});
}

// MoeConfig::gemm_auto_lockstep engages where the weights stream (over 1 GiB) and the experts
// average under 192 rows: at `dsv3` only of the named shapes, never under a knob that sets or
// excludes the four stages and the lockstep, and what it makes is a config can_implement takes.
TEST(ConfigValidation, AutoLockstepEngagesWhereTheWeightsStream) {
  const MoeConfig config;
  for (const std::string& name : named_shape_names()) {
    const MoeShape shape = named_shape(name);
    const bool engages = auto_lockstep_engages(config, shape);
    EXPECT_EQ(engages, name == "dsv3") << name;
    const MoeConfig runs = with_auto_choices(config, shape);
    EXPECT_EQ(runs.gemm_four_stages, engages) << name;
    EXPECT_EQ(runs.gemm_lockstep_k_blocks, engages ? kAutoLockstepKBlocks : 0) << name;
    EXPECT_TRUE(can_implement(runs, shape).ok()) << name;
  }
  // dsv3 on two ranks: 256 rows per expert, as at dsv3_e128.
  EXPECT_FALSE(auto_lockstep_engages(config, named_shape("dsv3", 2)));
  const MoeShape dsv3 = named_shape("dsv3");
  // Just under and at the row bound (T * K * R / E = 192 rows is out).
  MoeShape edge = dsv3;
  edge.num_tokens = 192 * 256 / 8;
  EXPECT_FALSE(auto_lockstep_engages(config, edge));
  edge.num_tokens -= 1;
  EXPECT_TRUE(auto_lockstep_engages(config, edge));
  // Weights of at most 1 GiB stay where they are (dsv3's rows, 8 experts of 7168 x 2048: 0.7 GB).
  MoeShape small = dsv3;
  small.num_experts = 8;
  small.num_tokens = 128;
  EXPECT_FALSE(auto_lockstep_engages(config, small));
  std::vector<MoeConfig> off(9, config);
  off[0].gemm_auto_lockstep = false;
  off[1].gemm_four_stages = true;
  off[2].gemm_lockstep_k_blocks = 8;
  off[3].precision = Precision::kFP8Block;
  off[4].gemm_cta_pairs = true;
  off[5].gemm_wide_tiles = true;
  off[6].gemm_l2_placement = true;
  off[7].gemm_tiles_by_ticket = true;
  off[8].ep_dispatch_in_gemm = true;
  for (size_t i = 0; i < off.size(); ++i) {
    EXPECT_FALSE(auto_lockstep_engages(off[i], dsv3)) << i;
    const MoeConfig runs = with_auto_choices(off[i], dsv3);
    EXPECT_EQ(runs.gemm_four_stages, off[i].gemm_four_stages) << i;
    EXPECT_EQ(runs.gemm_lockstep_k_blocks, off[i].gemm_lockstep_k_blocks) << i;
  }
}

TEST(ArgsValidation, CudaTensorsMustShareADeviceAndBeAligned) {
  TinyCall call;
  ForwardArgs args = call.forward_args();
  for (TensorView* view : {&args.x, &args.top_experts, &args.router_weights, &args.w_gate,
                           &args.w_up, &args.w_down, &args.out}) {
    view->device_type = DeviceType::kCUDA;
    view->data =
        reinterpret_cast<void*>(uintptr_t{1} << 40 | reinterpret_cast<uintptr_t>(view->data));
  }
  ForwardArgs misaligned = args;
  misaligned.w_up.data = static_cast<char*>(misaligned.w_up.data) + 2;
  expect_error(check_forward_args(call.shape, misaligned, DeviceType::kCUDA),
               ErrorCode::kInvalidArgument, {"`w_up` data pointer is not 16-byte aligned"});
  ForwardArgs other_device = args;
  other_device.w_down.device_id = 1;
  expect_error(check_forward_args(call.shape, other_device, DeviceType::kCUDA),
               ErrorCode::kInvalidArgument, {"`w_down` is on cuda:1", "cuda:0"});
}

TEST(ArgsValidation, BackwardOutputsMustNotOverlap) {
  TinyCall call;
  BackwardArgs args = call.backward_args();
  args.d_w_up.data = args.d_w_gate.data;
  expect_error(check_backward_args(call.shape, args, DeviceType::kCPU), ErrorCode::kInvalidArgument,
               {"outputs `d_w_gate` and `d_w_up` overlap"});
  args = call.backward_args();
  args.d_router_weights.data = call.router_weights.data();
  expect_error(check_backward_args(call.shape, args, DeviceType::kCPU), ErrorCode::kInvalidArgument,
               {"output `d_router_weights` overlaps input `router_weights`"});
  args = call.backward_args();
  args.d_out = TensorView();
  expect_error(check_backward_args(call.shape, args, DeviceType::kCPU), ErrorCode::kInvalidArgument,
               {"`d_out` is missing"});
}

TEST(ExpertIdValidation, FirstBadEntryIsNamed) {
  TinyCall call;
  call.top_experts[3 * 2 + 1] = 8;
  call.top_experts[10 * 2 + 0] = -2;
  expect_error(check_top_experts(call.shape, call.forward_args().top_experts, 1),
               ErrorCode::kInvalidArgument,
               {"top_experts[rank 1, token 3, k 1] = 8 is out of range", "[0, 8)"});
  std::vector<int64_t> wide(call.top_experts.begin(), call.top_experts.end());
  wide[3 * 2 + 1] = 0;
  wide[5] = int64_t{1} << 40;
  TensorView view = TensorView::contiguous(wide.data(), DType::kInt64, {64, 2});
  expect_error(check_top_experts(call.shape, view, 0), ErrorCode::kInvalidArgument,
               {"top_experts[rank 0, token 2, k 1] = 1099511627776"});
}

TEST(ExpertIdValidation, ScheduleHeaderGivesTheSameMessage) {
  ScheduleParams params;
  params.num_ranks = 2;
  params.tokens_per_rank = 64;
  params.top_k = 2;
  params.num_experts = 8;
  ScheduleHeader header{};
  header.status = static_cast<int32_t>(ScheduleStatus::kBadExpertId);
  header.error_pair = (1 * 64 + 3) * 2 + 1;
  header.error_value = 8;
  expect_error(schedule_status(params, header), ErrorCode::kInvalidArgument,
               {"top_experts[rank 1, token 3, k 1] = 8 is out of range"});
}

// The reference validates everything before it writes anything: a bad call leaves the poisoned
// outputs untouched.
TEST(ReferenceValidation, NothingRunsOnBadInput) {
  TinyCall call;
  const bf16 poison{0x7fc1};
  std::fill(call.out.begin(), call.out.end(), poison);
  call.top_experts[7] = 99;
  EXPECT_THROW(reference::forward(call.shape, call.forward_args()), Error);
  for (const bf16 value : call.out) ASSERT_EQ(value.bits, poison.bits);

  call.top_experts[7] = 0;
  ForwardArgs args = call.forward_args();
  args.w_up.shape[2] = 128;
  EXPECT_THROW(reference::forward(call.shape, args), Error);
  for (const bf16 value : call.out) ASSERT_EQ(value.bits, poison.bits);

  std::fill(call.d_x.begin(), call.d_x.end(), poison);
  BackwardArgs backward = call.backward_args();
  backward.d_w_down.dtype = DType::kFloat32;
  EXPECT_THROW(reference::backward(call.shape, backward), Error);
  for (const bf16 value : call.d_x) ASSERT_EQ(value.bits, poison.bits);

  // A rank count that does not match the shape.
  EXPECT_THROW(reference::forward_ep(named_shape("tiny", 2), {call.forward_args()}), Error);
}

}  // namespace
}  // namespace mok
