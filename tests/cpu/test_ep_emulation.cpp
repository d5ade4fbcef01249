// Expert-parallel emulation equals single-rank math, bitwise: R ranks exchanging rows through
// their schedules produce exactly the bits of one rank holding every expert and the ranks'
// tokens concatenated (rows are summed in (source rank, token, k) order on both sides); in bf16
// and in FP8.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "mok/reference.h"
#include "mok/testing/host_problem.h"
#include "mok/testing/routing.h"
#include "test_util.h"

namespace mok {
namespace {

struct EpCase {
  int32_t num_ranks;
  RoutingKind routing;
};

void PrintTo(const EpCase& value, std::ostream* os) {
  *os << "R=" << value.num_ranks << ", routing " << routing_kind_name(value.routing);
}

class EpEmulation : public ::testing::TestWithParam<EpCase> {};

template <typename T>
void expect_bitwise(const char* name, int32_t rank, const std::vector<T>& actual,
                    const std::vector<T>& expected) {
  EXPECT_FALSE(test::has_nan(actual)) << name << " of rank " << rank << " has unwritten elements";
  EXPECT_TRUE(test::bitwise_equal(actual, expected))
      << name << " of rank " << rank << " differs from the single-rank run at element "
      << test::first_difference(actual, expected);
}

// Every rank's routed outputs of `problem` (already run) against its slice of `single` (the
// single-rank equivalent, run): tokens in rank order, experts in rank order.
void expect_routed_outputs_equal(const HostProblem& problem, const HostProblem& single) {
  const MoeShape& shape = problem.shape;
  const HostRank& all = single.ranks[0];
  const int64_t T = shape.num_tokens, H = shape.hidden, K = shape.top_k;
  const int64_t expert_weights = shape.num_local_experts() * shape.intermediate * H;
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
    const HostRank& mine = problem.ranks[rank];
    expect_bitwise("out", rank, mine.out, test::slice(all.out, rank * T * H, T * H));
    expect_bitwise("d_x", rank, mine.d_x, test::slice(all.d_x, rank * T * H, T * H));
    expect_bitwise("d_router_weights", rank, mine.d_router_weights,
                   test::slice(all.d_router_weights, rank * T * K, T * K));
    expect_bitwise("d_w_gate", rank, mine.d_w_gate,
                   test::slice(all.d_w_gate, rank * expert_weights, expert_weights));
    expect_bitwise("d_w_up", rank, mine.d_w_up,
                   test::slice(all.d_w_up, rank * expert_weights, expert_weights));
    expect_bitwise("d_w_down", rank, mine.d_w_down,
                   test::slice(all.d_w_down, rank * expert_weights, expert_weights));
  }
  // The comparison has to mean something: some gradient is non-zero.
  EXPECT_GT(test::norm2(all.d_x), 0.0);
}

TEST_P(EpEmulation, EqualsSingleRankBitwise) {
  const EpCase& param = GetParam();
  // E = 8 experts, so R = 8 leaves one expert per rank; Is != I, clamp on.
  const MoeShape shape = test::make_shape(40, 128, 64, 8, 3, param.num_ranks, 128, 0.4f);
  HostProblem problem = HostProblem::make(shape, param.routing, 77 + param.num_ranks);
  HostProblem single = problem.single_rank_equivalent();
  test::run_reference(problem);
  test::run_reference(single);
  expect_routed_outputs_equal(problem, single);
  for (int32_t rank = 0; rank < param.num_ranks; ++rank) {
    // The shared expert is replicated: each rank's gradient covers its own tokens only.
    const HostRank& mine = problem.ranks[rank];
    HostProblem alone = problem.rank_alone(rank);
    test::run_reference(alone);
    expect_bitwise("d_w_shared_gate", rank, mine.d_w_shared_gate, alone.ranks[0].d_w_shared_gate);
    expect_bitwise("d_w_shared_up", rank, mine.d_w_shared_up, alone.ranks[0].d_w_shared_up);
    expect_bitwise("d_w_shared_down", rank, mine.d_w_shared_down, alone.ranks[0].d_w_shared_down);
  }
}

std::vector<EpCase> ep_cases() {
  std::vector<EpCase> cases;
  for (int32_t ranks : {1, 2, 4, 8})
    for (RoutingKind kind :
         {RoutingKind::kUniform, RoutingKind::kHoles, RoutingKind::kSkewed, RoutingKind::kOneExpert,
          RoutingKind::kOneRank, RoutingKind::kEmptyRank})
      cases.push_back({ranks, kind});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpEmulation, ::testing::ValuesIn(ep_cases()),
                         [](const ::testing::TestParamInfo<EpCase>& info) {
                           return "R" + std::to_string(info.param.num_ranks) + "_" +
                                  routing_kind_name(info.param.routing);
                         });

// FP8 (precision fp8_block) across the group: the R-rank emulation quantizes each owner's rows
// as the single-rank run quantizes the same rows (row groups per row; the weight gradients'
// groups of 128 rows from each expert's first row, whose rows keep their order), so the bits
// are the single rank's too.
TEST(EpEmulationFp8, EqualsSingleRankBitwise) {
  for (const int32_t ranks : {2, 4})
    for (const RoutingKind routing :
         {RoutingKind::kUniform, RoutingKind::kSkewed, RoutingKind::kEmptyRank}) {
      SCOPED_TRACE("R=" + std::to_string(ranks) + " routing " + routing_kind_name(routing));
      const MoeShape shape = test::make_shape(128, 256, 128, 8, 3, ranks, 128, 0.4f);
      HostProblem problem = HostProblem::make(shape, routing, 31 + ranks);
      HostProblem single = problem.single_rank_equivalent();
      reference::Options options;
      options.precision = Precision::kFP8Block;
      for (HostProblem* p : {&problem, &single}) {
        p->poison_outputs();
        reference::forward_ep(p->shape, p->all_forward_args(), options);
        reference::backward_ep(p->shape, p->all_backward_args(), options);
      }
      expect_routed_outputs_equal(problem, single);
    }
}

// The emulation with several threads gives the same bits as with one.
TEST(EpEmulationDeterminism, ThreadCountDoesNotMatter) {
  const MoeShape shape = test::make_shape(40, 128, 64, 8, 2, 4, 64, 0.4f);
  HostProblem one_thread = HostProblem::make(shape, RoutingKind::kSkewed, 3);
  HostProblem three_threads = HostProblem::make(shape, RoutingKind::kSkewed, 3);
  test::run_reference(one_thread, 1);
  test::run_reference(three_threads, 3);
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank)
    test::for_each_output(three_threads.ranks[rank], one_thread.ranks[rank],
                          [&](const char* name, const auto& actual, const auto& expected) {
                            expect_bitwise(name, rank, actual, expected);
                          });
}

// The compact reference slice (only the experts the slice routes to) gives the token outputs of
// the slice of the single-rank equivalent, bit for bit, on routings with holes and skew.
TEST(ReferenceSlice, EqualsTokenSliceOfTheSingleRankEquivalent) {
  for (const int32_t num_ranks : {1, 2, 4})
    for (const RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kHoles,
                                      RoutingKind::kSkewed, RoutingKind::kNoRoutes}) {
      SCOPED_TRACE(std::string("R=") + std::to_string(num_ranks) + ", " +
                   routing_kind_name(routing));
      const MoeShape shape = test::make_shape(24, 128, 64, 16, 3, num_ranks, 64, 0.4f);
      const HostProblem problem = HostProblem::make(shape, routing, 11);
      std::vector<int64_t> tokens;
      for (int64_t token = 0; token < shape.num_tokens * num_ranks; token += 5)
        tokens.push_back(token);
      tokens.push_back(shape.num_tokens * num_ranks - 1);
      HostProblem compact = problem.reference_slice(tokens);
      HostProblem full = problem.single_rank_equivalent().token_slice(tokens);
      EXPECT_LE(compact.shape.num_experts, shape.num_experts);
      for (HostProblem* slice : {&compact, &full}) {
        reference::forward(slice->shape, slice->forward_args(0));
        reference::backward(slice->shape, slice->backward_args(0));
      }
      expect_bitwise("out", 0, compact.ranks[0].out, full.ranks[0].out);
      expect_bitwise("d_x", 0, compact.ranks[0].d_x, full.ranks[0].d_x);
      expect_bitwise("d_router_weights", 0, compact.ranks[0].d_router_weights,
                     full.ranks[0].d_router_weights);
    }
}

TEST(ReferenceSlice, RejectsTokensOutsideTheGroup) {
  const MoeShape shape = test::make_shape(8, 128, 64, 8, 2, 2);
  const HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 1);
  EXPECT_THROW(problem.reference_slice({16}), Error);
  EXPECT_THROW(problem.reference_slice({-1}), Error);
}

}  // namespace
}  // namespace mok
