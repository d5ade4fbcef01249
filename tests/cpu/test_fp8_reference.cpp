// The CPU reference in FP8 (reference::Options::precision = kFP8Block): against the bf16
// reference on the same problems, every output within the bounds that e4m3's 3 mantissa bits
// allow (docs/design.md, "FP8"): relative error below 8% and cosine similarity above 0.996 for
// the outputs and every gradient (and above 1%: the FP8 path did run); bitwise the same for any
// thread count; shapes whose H, I or Is is not a multiple of 128 refused, naming the field;
// pre-quantized weights giving the bits of the bf16 weights they came from, and checked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mok/error.h"
#include "mok/reference.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok {
namespace {

struct Similarity {
  double relative_error, cosine;
};

template <typename T>
double value_of(const T& v) {
  if constexpr (std::is_same_v<T, bf16>)
    return bf16_to_float(v);
  else
    return v;
}

template <typename T>
Similarity compare(const std::vector<T>& got, const std::vector<T>& want) {
  double diff = 0, norm = 0, dot = 0, got_norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double a = value_of(got[i]), b = value_of(want[i]);
    diff += (a - b) * (a - b);
    norm += b * b;
    got_norm += a * a;
    dot += a * b;
  }
  return {std::sqrt(diff / norm), dot / std::sqrt(norm * got_norm)};
}

HostRank run(const MoeShape& shape, RoutingKind routing, uint64_t seed, Precision precision,
             int threads) {
  HostProblem problem = HostProblem::make(shape, routing, seed);
  reference::Options options;
  options.precision = precision;
  options.num_threads = threads;
  reference::forward(shape, problem.forward_args(0), options);
  reference::backward(shape, problem.backward_args(0), options);
  return problem.ranks[0];
}

TEST(Fp8Reference, WithinTheFormatsBoundsOfTheBf16Layer) {
  const MoeShape shapes[] = {test::make_shape(200, 256, 128, 8, 2, 1, 128),
                             test::make_shape(130, 384, 256, 4, 3, 1, 0, 2.0f)};
  for (const MoeShape& shape : shapes) {
    for (const RoutingKind routing :
         {RoutingKind::kUniform, RoutingKind::kHoles, RoutingKind::kOneExpert}) {
      const HostRank fp8 = run(shape, routing, 11, Precision::kFP8Block, 2);
      const HostRank bf16 = run(shape, routing, 11, Precision::kBF16, 2);
      test::for_each_output(fp8, bf16, [&](const char* name, const auto& a, const auto& b) {
        if (b.empty()) return;
        const Similarity s = compare(a, b);
        std::printf("  %-40s %-10s %-18s relative %.2e cosine %.6f\n", shape.to_string().c_str(),
                    routing_kind_name(routing), name, s.relative_error, s.cosine);
        EXPECT_LT(s.relative_error, 0.08) << name;
        EXPECT_GT(s.relative_error, 0.01) << name << ": as close as bf16: the FP8 path did not run";
        EXPECT_GT(s.cosine, 0.996) << name;
      });
    }
  }
}

TEST(Fp8Reference, BitwiseForAnyThreadCount) {
  const MoeShape shape = test::make_shape(150, 256, 128, 6, 2, 1, 128);
  const HostRank one = run(shape, RoutingKind::kSkewed, 3, Precision::kFP8Block, 1);
  const HostRank two = run(shape, RoutingKind::kSkewed, 3, Precision::kFP8Block, 2);
  test::for_each_output(one, two, [&](const char* name, const auto& a, const auto& b) {
    EXPECT_TRUE(test::bitwise_equal(a, b)) << name;
  });
}

TEST(Fp8Reference, RefusesExtentsThatAreNotWholeGroups) {
  const MoeShape shape = test::make_shape(64, 192, 128, 4, 2);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 1);
  reference::Options options;
  options.precision = Precision::kFP8Block;
  test::expect_invalid_argument(
      [&] { reference::forward(shape, problem.forward_args(0), options); }, "hidden = 192");
}

// Weights given pre-quantized (ForwardArgs::w_*_fp8) in mok's own block layout: the same bits
// as bf16 weights that the reference quantizes, all six given or some, forward and backward.
TEST(Fp8Reference, PreQuantizedWeightsGiveTheSameBits) {
  const MoeShape shape = test::make_shape(150, 256, 128, 6, 2, 1, 128);
  HostProblem want = HostProblem::make(shape, RoutingKind::kSkewed, 5);
  reference::Options options;
  options.precision = Precision::kFP8Block;
  reference::forward(shape, want.forward_args(0), options);
  reference::backward(shape, want.backward_args(0), options);
  const HostFp8Weights quantized = HostFp8Weights::quantize(shape, want.ranks[0]);
  for (const unsigned which : {0x3fu, 0x04u, 0x38u}) {
    SCOPED_TRACE("pre-quantized weights mask " + std::to_string(which));
    HostProblem got = HostProblem::make(shape, RoutingKind::kSkewed, 5);
    got.poison_outputs();
    ForwardArgs forward = got.forward_args(0);
    give_fp8_weights(shape, forward, quantized, which);
    BackwardArgs backward = got.backward_args(0);
    give_fp8_weights(shape, backward.forward, quantized, which);
    reference::forward(shape, forward, options);
    reference::backward(shape, backward, options);
    test::for_each_output(got.ranks[0], want.ranks[0],
                          [&](const char* name, const auto& a, const auto& b) {
                            EXPECT_TRUE(test::bitwise_equal(a, b)) << name;
                          });
  }
}

TEST(Fp8Reference, PreQuantizedWeightsAreChecked) {
  const MoeShape shape = test::make_shape(64, 256, 128, 4, 2, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 1);
  const HostFp8Weights quantized = HostFp8Weights::quantize(shape, problem.ranks[0]);
  reference::Options fp8;
  fp8.precision = Precision::kFP8Block;
  auto expect_refused = [&](const ForwardArgs& args, const reference::Options& options,
                            const char* fragment) {
    test::expect_invalid_argument([&] { reference::forward(shape, args, options); }, fragment);
  };
  const ForwardArgs valid = [&] {
    ForwardArgs args = problem.forward_args(0);
    give_fp8_weights(shape, args, quantized);
    return args;
  }();
  ForwardArgs both = valid;
  both.w_gate = problem.forward_args(0).w_gate;
  expect_refused(both, fp8, "`w_gate` was given together with `w_gate_fp8`");
  ForwardArgs wrong_dtype = valid;
  wrong_dtype.w_down_fp8.codes.dtype = DType::kBFloat16;
  expect_refused(wrong_dtype, fp8, "`w_down_fp8.codes` has dtype bf16");
  ForwardArgs wrong_scales = valid;
  wrong_scales.w_up_fp8.scales.shape[2] = 1;
  expect_refused(wrong_scales, fp8, "`w_up_fp8.scales` has shape [4, 1, 1]");
  ForwardArgs missing_scales = valid;
  missing_scales.w_shared_down_fp8.scales = TensorView{};
  expect_refused(missing_scales, fp8, "`w_shared_down_fp8.scales` is missing");
  expect_refused(valid, reference::Options{}, "pre-quantized FP8 weights (w_*_fp8) were given");

  const MoeShape no_shared = test::make_shape(64, 256, 128, 4, 2);
  HostProblem plain = HostProblem::make(no_shared, RoutingKind::kUniform, 1);
  ForwardArgs stray = plain.forward_args(0);
  stray.w_shared_gate_fp8 = valid.w_shared_gate_fp8;
  try {
    reference::forward(no_shared, stray, fp8);
    ADD_FAILURE() << "a shared expert's FP8 weight was accepted without a shared expert";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("`w_shared_gate_fp8.codes` was given"),
              std::string::npos)
        << error.what();
  }
}

// Pre-quantized gate and up codes as the halves of one fused [E, 2I, H] tensor (as Hugging
// Face's FP8 checkpoints store gate_up_proj): expert-strided views with the bits of dense codes,
// forward and backward. A shared expert's codes, and any scales, must stay dense.
TEST(Fp8Reference, PreQuantizedFusedGateUpHalvesGiveTheSameBits) {
  const MoeShape shape = test::make_shape(150, 256, 128, 6, 2, 1, 128);
  HostProblem want = HostProblem::make(shape, RoutingKind::kSkewed, 7);
  const HostFp8Weights quantized = HostFp8Weights::quantize(shape, want.ranks[0]);
  reference::Options options;
  options.precision = Precision::kFP8Block;
  ForwardArgs dense_forward = want.forward_args(0);
  give_fp8_weights(shape, dense_forward, quantized);
  BackwardArgs dense_backward = want.backward_args(0);
  give_fp8_weights(shape, dense_backward.forward, quantized);
  reference::forward(shape, dense_forward, options);
  reference::backward(shape, dense_backward, options);

  const std::vector<e4m3> fused = fused_gate_up_codes(shape, quantized);
  HostProblem got = HostProblem::make(shape, RoutingKind::kSkewed, 7);
  got.poison_outputs();
  ForwardArgs forward = got.forward_args(0);
  give_fp8_weights(shape, forward, quantized);
  give_fused_gate_up_codes(shape, forward, fused.data());
  ASSERT_TRUE(forward.w_gate_fp8.codes.is_outer_strided() &&
              !forward.w_gate_fp8.codes.is_contiguous());
  BackwardArgs backward = got.backward_args(0);
  give_fp8_weights(shape, backward.forward, quantized);
  give_fused_gate_up_codes(shape, backward.forward, fused.data());
  reference::forward(shape, forward, options);
  reference::backward(shape, backward, options);
  test::for_each_output(got.ranks[0], want.ranks[0],
                        [&](const char* name, const auto& a, const auto& b) {
                          EXPECT_TRUE(test::bitwise_equal(a, b)) << name;
                        });

  ForwardArgs strided_shared = forward;
  strided_shared.w_shared_gate_fp8.codes = forward.w_gate_fp8.codes;
  strided_shared.w_shared_gate_fp8.codes.ndim = 2;  // [Is, H] with a row stride of 2H
  strided_shared.w_shared_gate_fp8.codes.shape[0] = shape.shared_intermediate;
  strided_shared.w_shared_gate_fp8.codes.shape[1] = shape.hidden;
  strided_shared.w_shared_gate_fp8.codes.strides[0] = 2 * shape.hidden;
  strided_shared.w_shared_gate_fp8.codes.strides[1] = 1;
  test::expect_invalid_argument([&] { reference::forward(shape, strided_shared, options); },
                                "`w_shared_gate_fp8.codes` is not contiguous");
  ForwardArgs strided_scales = forward;
  strided_scales.w_up_fp8.scales.strides[0] *= 2;
  test::expect_invalid_argument([&] { reference::forward(shape, strided_scales, options); },
                                "`w_up_fp8.scales` is not contiguous");
}

}  // namespace
}  // namespace mok
