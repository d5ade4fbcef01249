// Expert-strided weights (TensorView::is_outer_strided): the routed experts' weights and their
// gradients may be views with a larger expert stride, e.g. the gate and up halves of one fused
// [E, 2I, H] gate/up tensor as Hugging Face models store it. Checked here: the view predicates,
// the overlap test on interleaved views (the two halves are disjoint, an overlapping pair is
// found), validation (accepted where allowed, refused elsewhere and for strides TMA cannot
// take, naming the argument), and the CPU reference over fused tensors bitwise equal to the
// reference over separate ones.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "mok/layer_args.h"
#include "mok/reference.h"
#include "mok/shape.h"
#include "mok/testing/host_problem.h"

namespace mok {
namespace {

// [E, rows, cols] views at `offset` elements into a [E, 2 * rows, cols] tensor.
TensorView half_of(void* fused, int64_t E, int64_t rows, int64_t cols, int64_t offset) {
  TensorView view =
      TensorView::contiguous(static_cast<bf16*>(fused) + offset, DType::kBFloat16, {E, rows, cols});
  view.strides[0] = 2 * rows * cols;
  return view;
}

TEST(StridedWeights, ViewPredicates) {
  std::vector<bf16> fused(4 * 2 * 64 * 128);
  const TensorView gate = half_of(fused.data(), 4, 64, 128, 0);
  EXPECT_FALSE(gate.is_contiguous());
  EXPECT_TRUE(gate.is_outer_strided());
  EXPECT_EQ(gate.outer_stride(), 2 * 64 * 128);
  const TensorView dense = TensorView::contiguous(fused.data(), DType::kBFloat16, {4, 64, 128});
  EXPECT_TRUE(dense.is_outer_strided());
  EXPECT_EQ(dense.outer_stride(), 64 * 128);
  TensorView transposed = dense;
  std::swap(transposed.strides[1], transposed.strides[2]);
  std::swap(transposed.shape[1], transposed.shape[2]);
  EXPECT_FALSE(transposed.is_outer_strided());
  TensorView squeezed = dense;  // experts closer than a matrix: they would overlap
  squeezed.strides[0] = 64;
  EXPECT_FALSE(squeezed.is_outer_strided());
}

TEST(StridedWeights, InterleavedHalvesDoNotOverlapButShiftedOnesDo) {
  const int64_t E = 3, I = 64, H = 128;
  std::vector<bf16> fused(E * 2 * I * H);
  const TensorView gate = half_of(fused.data(), E, I, H, 0);
  const TensorView up = half_of(fused.data(), E, I, H, I * H);
  EXPECT_FALSE(tensors_overlap(gate, up));
  EXPECT_FALSE(tensors_overlap(up, gate));
  const TensorView shifted = half_of(fused.data(), E, I, H, I * H - 1);  // one element into gate
  EXPECT_TRUE(tensors_overlap(gate, shifted));
  // A dense tensor over the whole fused buffer overlaps both halves; one past its end neither.
  const TensorView whole = TensorView::contiguous(fused.data(), DType::kBFloat16, {E, 2 * I, H});
  EXPECT_TRUE(tensors_overlap(whole, up));
  std::vector<bf16> other(16);
  EXPECT_FALSE(
      tensors_overlap(whole, TensorView::contiguous(other.data(), DType::kBFloat16, {16})));
}

MoeShape small_shape() {
  MoeShape shape;
  shape.num_tokens = 40;
  shape.hidden = 128;
  shape.intermediate = 64;
  shape.num_experts = 4;
  shape.top_k = 2;
  shape.shared_intermediate = 64;
  return shape;
}

// Copies rank 0's gate and up weights (and gives their gradients) as halves of fused tensors.
struct Fused {
  std::vector<bf16> gate_up, d_gate_up;
  ForwardArgs forward;
  BackwardArgs backward;
};

Fused fuse(HostProblem& problem) {
  const MoeShape& s = problem.shape;
  const int64_t E = s.num_local_experts(), I = s.intermediate, H = s.hidden;
  Fused f;
  f.gate_up.resize(E * 2 * I * H);
  f.d_gate_up.resize(E * 2 * I * H);
  HostRank& rank = problem.ranks[0];
  for (int64_t e = 0; e < E; ++e) {
    std::memcpy(&f.gate_up[e * 2 * I * H], &rank.w_gate[e * I * H], I * H * sizeof(bf16));
    std::memcpy(&f.gate_up[e * 2 * I * H + I * H], &rank.w_up[e * I * H], I * H * sizeof(bf16));
  }
  f.forward = problem.forward_args(0);
  f.forward.w_gate = half_of(f.gate_up.data(), E, I, H, 0);
  f.forward.w_up = half_of(f.gate_up.data(), E, I, H, I * H);
  f.backward = problem.backward_args(0);
  f.backward.forward = f.forward;
  f.backward.forward.out = TensorView{};
  f.backward.d_w_gate = half_of(f.d_gate_up.data(), E, I, H, 0);
  f.backward.d_w_up = half_of(f.d_gate_up.data(), E, I, H, I * H);
  return f;
}

TEST(StridedWeights, ValidationAcceptsTheRoutedWeightsAndTheirGradientsOnly) {
  HostProblem problem = HostProblem::make(small_shape(), RoutingKind::kUniform, 3);
  Fused f = fuse(problem);
  EXPECT_TRUE(check_forward_args(problem.shape, f.forward, DeviceType::kCPU).ok());
  EXPECT_TRUE(check_backward_args(problem.shape, f.backward, DeviceType::kCPU).ok());

  ForwardArgs strided_x = f.forward;  // tokens must stay contiguous
  std::vector<bf16> wide(2 * problem.shape.num_tokens * problem.shape.hidden);
  strided_x.x = TensorView::contiguous(wide.data(), DType::kBFloat16,
                                       {problem.shape.num_tokens, problem.shape.hidden});
  strided_x.x.strides[0] = 2 * problem.shape.hidden;
  const Status x_status = check_forward_args(problem.shape, strided_x, DeviceType::kCPU);
  EXPECT_FALSE(x_status.ok());
  EXPECT_NE(x_status.message.find("`x` is not contiguous"), std::string::npos) << x_status.message;

  ForwardArgs odd = f.forward;  // an expert stride of 8 bytes more than a multiple of 16
  odd.w_gate.strides[0] += 4;
  const Status odd_status = check_forward_args(problem.shape, odd, DeviceType::kCPU);
  EXPECT_FALSE(odd_status.ok());
  EXPECT_NE(odd_status.message.find("`w_gate` has an expert stride"), std::string::npos)
      << odd_status.message;

  BackwardArgs aliased = f.backward;  // both gradients into the same half
  aliased.d_w_up = aliased.d_w_gate;
  const Status alias_status = check_backward_args(problem.shape, aliased, DeviceType::kCPU);
  EXPECT_FALSE(alias_status.ok());
  EXPECT_NE(alias_status.message.find("overlap"), std::string::npos) << alias_status.message;
}

TEST(StridedWeights, ReferenceOverFusedTensorsIsBitwiseTheSame) {
  HostProblem problem = HostProblem::make(small_shape(), RoutingKind::kUniform, 5);
  reference::forward(problem.shape, problem.forward_args(0));
  reference::backward(problem.shape, problem.backward_args(0));
  const HostRank expected = problem.ranks[0];

  Fused f = fuse(problem);
  std::vector<bf16> out(expected.out.size());
  f.forward.out = TensorView::contiguous(out.data(), DType::kBFloat16,
                                         {problem.shape.num_tokens, problem.shape.hidden});
  reference::forward(problem.shape, f.forward);
  reference::backward(problem.shape, f.backward);
  EXPECT_EQ(std::memcmp(out.data(), expected.out.data(), out.size() * sizeof(bf16)), 0);
  const int64_t E = problem.shape.num_local_experts(), I = problem.shape.intermediate,
                H = problem.shape.hidden;
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(std::memcmp(&f.d_gate_up[e * 2 * I * H], &expected.d_w_gate[e * I * H],
                          I * H * sizeof(bf16)),
              0);
    EXPECT_EQ(std::memcmp(&f.d_gate_up[e * 2 * I * H + I * H], &expected.d_w_up[e * I * H],
                          I * H * sizeof(bf16)),
              0);
  }
  EXPECT_EQ(std::memcmp(problem.ranks[0].d_x.data(), expected.d_x.data(),
                        expected.d_x.size() * sizeof(bf16)),
            0);
  EXPECT_EQ(std::memcmp(problem.ranks[0].d_w_down.data(), expected.d_w_down.data(),
                        expected.d_w_down.size() * sizeof(bf16)),
            0);
}

}  // namespace
}  // namespace mok
