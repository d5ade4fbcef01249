// What the tests of the weight gradients' other forms share (BackwardArgs: d_w_* in fp32,
// accumulate_weight_grads; precision fp8_block), on the CPU reference and on the GPU layer alike:
// the six gradients' names, shapes and views, their values held in either dtype, random old
// values to accumulate into, and the checks against a plain run. A run that writes fp32 gives
// the sums the bf16 run rounds (so each rounds to the bf16 run's bits), and a run that
// accumulates gives round(old + sum) with the fp32 run's sums, element by element.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "mok/dtype.h"
#include "mok/layer_args.h"
#include "mok/shape.h"
#include "mok/testing/host_problem.h"
#include "mok/testing/routing.h"

namespace mok::test {

constexpr int kNumWeightGrads = 6;
constexpr std::array<const char*, kNumWeightGrads> kWeightGradNames = {
    "d_w_gate", "d_w_up", "d_w_down", "d_w_shared_gate", "d_w_shared_up", "d_w_shared_down"};

// Gradient `index`'s dims (the shared ones: absent, {}, without a shared expert).
inline std::vector<int64_t> weight_grad_dims(const MoeShape& shape, int index) {
  const int64_t E = shape.num_local_experts(), I = shape.intermediate, H = shape.hidden,
                Is = shape.shared_intermediate;
  if (index >= 3 && Is == 0) return {};
  switch (index) {
    case 0:
    case 1:
      return {E, I, H};
    case 2:
      return {E, H, I};
    case 3:
    case 4:
      return {Is, H};
    default:
      return {H, Is};
  }
}

// A row-major view of `dims` (none: absent) over `data`.
inline TensorView dense_view(void* data, DType dtype, const std::vector<int64_t>& dims,
                             DeviceType device_type) {
  return dims.empty() ? TensorView{} : TensorView::contiguous(data, dtype, dims, device_type);
}

inline TensorView* weight_grad_view(BackwardArgs& args, int index) {
  const std::array<TensorView*, kNumWeightGrads> views = {
      &args.d_w_gate,        &args.d_w_up,        &args.d_w_down,
      &args.d_w_shared_gate, &args.d_w_shared_up, &args.d_w_shared_down};
  return views[index];
}

inline const std::vector<bf16>& weight_grad_of(const HostRank& rank, int index) {
  const std::array<const std::vector<bf16>*, kNumWeightGrads> grads = {
      &rank.d_w_gate,        &rank.d_w_up,        &rank.d_w_down,
      &rank.d_w_shared_gate, &rank.d_w_shared_up, &rank.d_w_shared_down};
  return *grads[index];
}

// One gradient's values in its dtype (bf16 or fp32).
struct GradValues {
  DType dtype = DType::kFloat32;
  std::vector<float> f32;
  std::vector<bf16> b16;

  GradValues() = default;
  GradValues(DType type, int64_t count) : dtype(type) {
    if (dtype == DType::kFloat32)
      f32.assign(static_cast<size_t>(count), 0.0f);
    else
      b16.assign(static_cast<size_t>(count), bf16{});
  }
  int64_t size() const {
    return static_cast<int64_t>(dtype == DType::kFloat32 ? f32.size() : b16.size());
  }
  size_t bytes() const { return static_cast<size_t>(size()) * dtype_size(dtype); }
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : b16.data(); }
  const void* data() const {
    return dtype == DType::kFloat32 ? static_cast<const void*>(f32.data()) : b16.data();
  }
  float value(int64_t i) const { return dtype == DType::kFloat32 ? f32[i] : bf16_to_float(b16[i]); }
  uint32_t bits(int64_t i) const {
    if (dtype != DType::kFloat32) return b16[i].bits;
    uint32_t word;
    std::memcpy(&word, &f32[i], sizeof(word));
    return word;
  }
};

// Old values to accumulate into: random of mixed signs and magnitudes around the gradients'
// (exact zeros and -0 among them), in `dtype`.
inline GradValues random_old_values(DType dtype, int64_t count, uint64_t seed) {
  GradValues old(dtype, count);
  SplitMix64 rng(seed);
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t pick = rng.below(16);
    float value = static_cast<float>((rng.uniform() - 0.5) * (pick < 8 ? 1e-2 : 4.0));
    if (pick == 14) value = 0.0f;
    if (pick == 15) value = -0.0f;
    if (dtype == DType::kFloat32)
      old.f32[i] = value;
    else
      old.b16[i] = float_to_bf16(value);
  }
  return old;
}

// Every fp32 sum rounds to the bf16 run's bits.
inline void expect_rounds_to(const GradValues& sums, const std::vector<bf16>& bf16_run,
                             const std::string& what) {
  ASSERT_EQ(sums.size(), static_cast<int64_t>(bf16_run.size())) << what;
  for (int64_t i = 0; i < sums.size(); ++i)
    if (float_to_bf16(sums.value(i)).bits != bf16_run[i].bits) {
      ADD_FAILURE() << what << ": element " << i << " holds " << sums.value(i)
                    << ", which does not round to the bf16 run's " << bf16_to_float(bf16_run[i]);
      return;
    }
}

// got = round(old + sum) in got's dtype, bit for bit.
inline void expect_accumulated(const GradValues& got, const GradValues& old, const GradValues& sums,
                               const std::string& what) {
  ASSERT_EQ(got.size(), old.size()) << what;
  ASSERT_EQ(got.size(), sums.size()) << what;
  for (int64_t i = 0; i < got.size(); ++i) {
    const float want = old.value(i) + sums.value(i);
    const uint32_t want_bits = [&] {
      if (got.dtype != DType::kFloat32) return static_cast<uint32_t>(float_to_bf16(want).bits);
      uint32_t word;
      std::memcpy(&word, &want, sizeof(word));
      return word;
    }();
    if (got.bits(i) != want_bits) {
      ADD_FAILURE() << what << ": element " << i << " holds " << got.value(i) << ", expected "
                    << old.value(i) << " + " << sums.value(i) << " = " << want;
      return;
    }
  }
}

}  // namespace mok::test
