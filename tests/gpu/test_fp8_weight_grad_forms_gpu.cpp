// FP8's weight gradients in their other forms on the GPU layer (BackwardArgs: d_w_* in fp32,
// accumulate_weight_grads; the weight-gradient kernels of fp8_weight_grad_epilogue.cuh): written
// in fp32 they are the sums the bf16 step rounds, and accumulated they are round(old + sum) in
// each matrix's own dtype (the six alternating fp32 and bf16), bit for bit; every other output
// keeps the bf16 step's bits. On skewed routing and with experts without rows, with a shared
// expert, a step from the forward's context and one that recomputes, launches plain and
// overlapped, with the knob of two staging tiles set (these forms take one). The gate and up
// gradients in fp32 come as the two halves of one [E, 2I, H] tensor, as the gradient of a fused
// gate/up weight does. The kernel alone does the same on 1, 3 and all CTAs (a CTA's next tiles'
// old values loaded while it works), an expert without rows among the tiles.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "device_memory.h"
#include "fp8_gemm_problem.h"
#include "gpu_step.h"
#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "mok/testing/routing.h"
#include "test_util.h"
#include "weight_grad_forms.h"

namespace mok {
namespace {

using test::GradValues;
using test::kNumWeightGrads;

// The six weight gradients in device memory in the given dtypes; with `fused_gate_up` (both
// fp32) gate and up are the halves of one [E, 2I, H] allocation, each view strided by 2IH.
class DeviceWeightGrads {
 public:
  DeviceWeightGrads(const MoeShape& shape, const std::array<DType, kNumWeightGrads>& dtypes,
                    bool fused_gate_up)
      : fused_(fused_gate_up) {
    for (int g = 0; g < kNumWeightGrads; ++g) {
      TensorView& view = views_[g];
      view =
          test::dense_view(nullptr, dtypes[g], test::weight_grad_dims(shape, g), DeviceType::kCUDA);
      if (!view.present()) continue;
      if (fused_ && g <= 1) {
        view.strides[0] = 2 * shape.intermediate * shape.hidden;
        if (g == 0) view.data = memory_.allocate(2 * view.nbytes());
        if (g == 1) view.data = static_cast<char*>(views_[0].data) + matrix_bytes(0);
        continue;
      }
      view.data = memory_.allocate(view.nbytes());
    }
  }

  // Every byte 0xFF (NaN in either dtype), so that an element left unwritten shows.
  void poison() const {
    for (int g = 0; g < kNumWeightGrads; ++g)
      if (views_[g].present())
        CUDA_CHECK(
            cudaMemset2D(views_[g].data, pitch(g), 0xFF, matrix_bytes(g), views_[g].shape[0]));
  }
  void set(BackwardArgs& args) const {
    for (int g = 0; g < kNumWeightGrads; ++g) *test::weight_grad_view(args, g) = views_[g];
  }
  void upload(const std::vector<GradValues>& values) const {
    for (int g = 0; g < kNumWeightGrads; ++g)
      if (views_[g].present())
        CUDA_CHECK(cudaMemcpy2D(views_[g].data, pitch(g), values[g].data(), matrix_bytes(g),
                                matrix_bytes(g), views_[g].shape[0], cudaMemcpyHostToDevice));
  }
  std::vector<GradValues> download() const {
    std::vector<GradValues> values;
    for (int g = 0; g < kNumWeightGrads; ++g) {
      values.emplace_back(views_[g].dtype, views_[g].present() ? views_[g].numel() : 0);
      if (views_[g].present())
        CUDA_CHECK(cudaMemcpy2D(values[g].data(), matrix_bytes(g), views_[g].data, pitch(g),
                                matrix_bytes(g), views_[g].shape[0], cudaMemcpyDeviceToHost));
    }
    return values;
  }

 private:
  // One index of the first dimension: its dense bytes, and the distance to the next.
  size_t matrix_bytes(int g) const {
    const TensorView& view = views_[g];
    return static_cast<size_t>(view.numel() / view.shape[0] * dtype_size(view.dtype));
  }
  size_t pitch(int g) const {
    return static_cast<size_t>(views_[g].strides[0] * dtype_size(views_[g].dtype));
  }

  bool fused_;
  test::DeviceAllocations memory_;
  std::array<TensorView, kNumWeightGrads> views_{};
};

TEST(Fp8WeightGradFormsGpu, Fp32AndAccumulatedGiveTheSumsBits) {
  for (const RoutingKind routing : {RoutingKind::kSkewed, RoutingKind::kHoles}) {
    const MoeShape shape = test::make_shape(1280, 512, 256, 16, 4, 1, 128);
    HostProblem problem = HostProblem::make(shape, routing, 103);
    DeviceProblem device(problem, 0);
    MoeConfig config;
    config.precision = Precision::kFP8Block;
    GpuLayer plain(shape, config);
    const HostRank want = test::gpu_step(plain, device, problem, /*with_context=*/true);
    for (const bool overlap : {false, true}) {
      config.overlap_kernel_launches = overlap;
      config.fp8_weight_grad_staging_tiles = 2;
      GpuLayer layer(shape, config);
      for (const bool with_context : {true, false}) {
        SCOPED_TRACE(std::string(routing_kind_name(routing)) + (overlap ? ", overlapped" : "") +
                     (with_context ? "" : ", recomputed"));
        // One step with the weight gradients in `grads`; every other output downloaded.
        auto step = [&](const DeviceWeightGrads& grads, bool accumulate) {
          device.poison_outputs();
          EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const ForwardContext context = layer.forward(device.forward_args(), nullptr);
          BackwardArgs args = device.backward_args();
          grads.set(args);
          args.accumulate_weight_grads = accumulate;
          layer.backward(args, nullptr, with_context ? &context : nullptr);
          const Status status = layer.synchronize(nullptr);
          EXPECT_TRUE(status.ok()) << status.message;
          const HostRank got = test::downloaded_outputs(device, problem);
          EXPECT_TRUE(test::bitwise_equal(got.out, want.out));
          EXPECT_TRUE(test::bitwise_equal(got.d_x, want.d_x));
          EXPECT_TRUE(test::bitwise_equal(got.d_router_weights, want.d_router_weights));
        };
        std::array<DType, kNumWeightGrads> all_fp32;
        all_fp32.fill(DType::kFloat32);
        const DeviceWeightGrads fp32(shape, all_fp32, /*fused_gate_up=*/true);
        fp32.poison();
        step(fp32, false);
        const std::vector<GradValues> sums = fp32.download();
        for (int g = 0; g < kNumWeightGrads; ++g)
          test::expect_rounds_to(sums[g], test::weight_grad_of(want, g), test::kWeightGradNames[g]);

        std::array<DType, kNumWeightGrads> mixed;
        std::vector<GradValues> old;
        for (int g = 0; g < kNumWeightGrads; ++g) {
          mixed[g] = g % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
          old.push_back(test::random_old_values(mixed[g], sums[g].size(), 50 + g));
        }
        const DeviceWeightGrads accumulated(shape, mixed, /*fused_gate_up=*/false);
        accumulated.upload(old);
        step(accumulated, true);
        const std::vector<GradValues> got = accumulated.download();
        for (int g = 0; g < kNumWeightGrads; ++g)
          test::expect_accumulated(got[g], old[g], sums[g],
                                   std::string(test::kWeightGradNames[g]) + " accumulated");
      }
    }
  }
}

// The weight-gradient kernel's forms alone (Fp8GemmParams::weight_grad_out), on random codes
// and power-of-two scales: 18 tiles of 3 experts (one without rows) on 1, 3 and all CTAs.
TEST(Fp8WeightGradFormsGpu, KernelFormsOnFewAndAllCtas) {
  using kernels::Fp8WeightGradOut;
  const int64_t rows = 640, m = 256, n = 384, experts = 3;
  test::Fp8WeightGradProblem problem(rows, m, n, experts);
  SplitMix64 rng(7);
  auto random_codes = [&](int64_t count) {
    std::vector<uint8_t> codes(static_cast<size_t>(count));
    for (uint8_t& code : codes) {
      code = static_cast<uint8_t>(rng.next());
      if ((code & 0x7f) == 0x7f) code ^= 1;  // no NaN
    }
    return codes;
  };
  auto random_scales = [&](int64_t count) {
    std::vector<float> scales(static_cast<size_t>(count));
    for (float& scale : scales) scale = std::ldexp(1.0f, static_cast<int>(rng.below(9)) - 12);
    return scales;
  };
  const std::vector<int32_t> offsets = {0, 256, 256, 640};
  CUDA_CHECK(
      cudaMemcpy(problem.a_codes, random_codes(m * rows).data(), m * rows, cudaMemcpyHostToDevice));
  CUDA_CHECK(
      cudaMemcpy(problem.b_codes, random_codes(n * rows).data(), n * rows, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(problem.a_scales, random_scales(m * rows / 128).data(), m * rows / 128 * 4,
                        cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(problem.b_scales, random_scales(n * rows / 128).data(), n * rows / 128 * 4,
                        cudaMemcpyHostToDevice));
  CUDA_CHECK(
      cudaMemcpy(problem.offsets, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
  const int64_t count = experts * m * n;
  std::vector<bf16> plain(static_cast<size_t>(count));
  CUDA_CHECK(cudaMemset(problem.out, 0xff, count * 2));
  ASSERT_EQ(problem.run(), cudaSuccess);
  CUDA_CHECK(cudaMemcpy(plain.data(), problem.out, count * 2, cudaMemcpyDeviceToHost));

  // fp32 out [E, m, n] in boxes of [128 rows x 32].
  float* out32 = problem.device.allocate<float>(count * 4);
  const int64_t dims[3] = {n, m, experts}, strides[2] = {n * 4, m * n * 4};
  const int32_t box[3] = {32, 128, 1};
  const CUtensorMap map32 =
      make_tensor_map(out32, TmaElement::kF32, 3, dims, strides, box, true, "fp32 gradients");
  const CUtensorMap map16 = problem.maps.out;
  // Runs `form` on `ctas` CTAs over `start` (copied to the output first); the output after.
  auto run = [&](Fp8WeightGradOut form, int ctas, const GradValues& start) {
    const bool f32 = start.dtype == DType::kFloat32;
    void* out = f32 ? static_cast<void*>(out32) : problem.out;
    problem.maps.out = f32 ? map32 : map16;
    problem.params.weight_grad_out = form;
    CUDA_CHECK(cudaMemcpy(out, start.data(), start.bytes(), cudaMemcpyHostToDevice));
    EXPECT_EQ(problem.run(ctas), cudaSuccess);
    GradValues got(start.dtype, count);
    CUDA_CHECK(cudaMemcpy(got.data(), out, got.bytes(), cudaMemcpyDeviceToHost));
    return got;
  };
  GradValues nan32(DType::kFloat32, count);
  for (float& value : nan32.f32) value = std::nanf("");
  const GradValues sums = run(Fp8WeightGradOut::kF32, 0, nan32);
  test::expect_rounds_to(sums, plain, "fp32 on one CTA per SM");
  const GradValues old32 = test::random_old_values(DType::kFloat32, count, 8);
  const GradValues old16 = test::random_old_values(DType::kBFloat16, count, 9);
  for (const int ctas : {1, 3, 0}) {
    SCOPED_TRACE(std::to_string(ctas) + " CTAs (0: one per SM)");
    const GradValues again = run(Fp8WeightGradOut::kF32, ctas, nan32);
    EXPECT_EQ(std::memcmp(again.data(), sums.data(), sums.bytes()), 0);
    test::expect_accumulated(run(Fp8WeightGradOut::kF32Accumulate, ctas, old32), old32, sums,
                             "fp32 accumulated");
    test::expect_accumulated(run(Fp8WeightGradOut::kBF16Accumulate, ctas, old16), old16, sums,
                             "bf16 accumulated");
  }
  problem.params.weight_grad_staging_tiles = 2;  // the second staging tile: plain bf16 only
  problem.params.weight_grad_out = Fp8WeightGradOut::kF32;
  problem.maps.out = map32;
  EXPECT_EQ(problem.run(), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace mok
