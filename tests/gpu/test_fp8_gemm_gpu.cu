// The FP8 block-scaled grouped GEMM (src/kernels/gemm/fp8_gemm.cu) against the host: A and B
// quantized by the host quantizers (mok/fp8.h), the expected product summed per 128-long K-block
// in double and scaled as the recipe says; the GPU's bf16 output within bf16 rounding of it, the
// same bits on a second run, and rows of different experts in one launch; the 192-row tiles and
// the weight-gradient form likewise. test_fp8_gemm_rate_gpu.cu times them.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "fp8_gemm_problem.h"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/stages/fp8_quantize.h"
#include "kernels/stages/launch.h"
#include "kernels/stages/swiglu_quantize.h"
#include "layer/tma.h"
#include "mok/fp8.h"
#include "mok/schedule.h"
#include "test_util.h"

namespace mok {
namespace {

using test::Fp8GemmProblem;
using test::Fp8WeightGradProblem;
using test::rows_192_maps;

std::vector<bf16> random_bf16(int64_t count, uint64_t seed, float scale) {
  SplitMix64 rng(seed);
  std::vector<bf16> values(count);
  for (bf16& v : values)
    v = float_to_bf16(scale * (static_cast<float>(rng.next() % 20001) / 10000.0f - 1.0f));
  return values;
}

// The host quantizers' codes and scales of a row-tile problem's A (bf16 [rows, k], row groups)
// and B (bf16 [experts, n, k], blocks per expert), uploaded with its tile experts.
struct QuantizedOperands {
  std::vector<e4m3> a_q, b_q;
  std::vector<float> a_scales, b_scales;  // a_scales [rows, K / 128] (the host's layout)
};
QuantizedOperands quantize_and_upload(Fp8GemmProblem& problem, const std::vector<bf16>& a,
                                      const std::vector<bf16>& b,
                                      const std::vector<int32_t>& tile_expert) {
  const int64_t rows = problem.rows, n = problem.n, k = problem.k, experts = problem.experts;
  QuantizedOperands q;
  q.a_q.resize(rows * k);
  q.b_q.resize(experts * n * k);
  q.a_scales.resize(rows * (k / 128));
  q.b_scales.resize(experts * (n / 128) * (k / 128));
  quantize_fp8_rows(a.data(), rows, k, q.a_q.data(), q.a_scales.data());
  for (int64_t e = 0; e < experts; ++e)
    quantize_fp8_blocks(b.data() + e * n * k, n, k, q.b_q.data() + e * n * k,
                        q.b_scales.data() + e * (n / 128) * (k / 128));
  std::vector<float> a_scales_t(q.a_scales.size());  // [K / 128, rows], as the GEMM reads them
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / 128; ++g) a_scales_t[g * rows + r] = q.a_scales[r * (k / 128) + g];
  EXPECT_EQ(cudaMemcpy(problem.a, q.a_q.data(), q.a_q.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(problem.b, q.b_q.data(), q.b_q.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(problem.a_scales, a_scales_t.data(), a_scales_t.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(problem.b_scales, q.b_scales.data(), q.b_scales.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(problem.tile_expert, tile_expert.data(), tile_expert.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  return q;
}

// The row-tile form over a K of `k` against the product in double; then the same bits from
// GPU-quantized operands, split columns and a split K.
void expect_block_scaled_product(int64_t k) {
  const int64_t rows = 128 * 7, n = 384, experts = 3;
  // Rows of different magnitudes per row (the row scales differ), experts of different sizes.
  std::vector<bf16> a = random_bf16(rows * k, 5, 1.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c)
      a[r * k + c] = float_to_bf16(bf16_to_float(a[r * k + c]) * std::ldexp(1.0f, r % 9 - 4));
  const std::vector<bf16> b = random_bf16(experts * n * k, 6, 0.05f);
  const std::vector<int32_t> tile_expert = {0, 0, 2, 1, 1, 1, 2};
  Fp8GemmProblem problem(rows, n, k, experts);
  const QuantizedOperands q = quantize_and_upload(problem, a, b, tile_expert);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::vector<e4m3>& a_q = q.a_q;
  const std::vector<e4m3>& b_q = q.b_q;
  const std::vector<float>& a_scales = q.a_scales;
  const std::vector<float>& b_scales = q.b_scales;
  ASSERT_EQ(cudaMemset(problem.out, 0xff, rows * n * 2), cudaSuccess);  // NaN where unwritten
  ASSERT_EQ(problem.run(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<bf16> got(rows * n), again(rows * n);
  ASSERT_EQ(cudaMemcpy(got.data(), problem.out, got.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(problem.run(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(again.data(), problem.out, again.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 2), 0) << "not bitwise repeatable";
  // On a few CTAs each walks many tiles of different experts and column tiles: each tile's B
  // scales, read while the previous tile runs, must be its own (the same bits).
  for (const int ctas : {1, 2, 5}) {
    ASSERT_EQ(cudaMemset(problem.out, 0xff, rows * n * 2), cudaSuccess);
    ASSERT_EQ(kernels::launch_fp8_grouped_gemm(problem.maps, problem.params, ctas, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(again.data(), problem.out, again.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 2), 0) << ctas << " CTAs";
  }

  double error_sq = 0, want_sq = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t e = tile_expert[r / 128];
    for (int64_t c = 0; c < n; ++c) {
      double want = 0;
      for (int64_t g = 0; g < k / 128; ++g) {
        double block = 0;
        for (int64_t i = g * 128; i < g * 128 + 128; ++i)
          block += static_cast<double>(e4m3_to_float(a_q[r * k + i])) *
                   e4m3_to_float(b_q[(e * n + c) * k + i]);
        want += block * a_scales[r * (k / 128) + g] *
                b_scales[(e * (n / 128) + c / 128) * (k / 128) + g];
      }
      const double value = bf16_to_float(got[r * n + c]);
      ASSERT_TRUE(std::isfinite(value)) << "row " << r << " column " << c << " unwritten";
      error_sq += (value - want) * (value - want);
      want_sq += want * want;
    }
  }
  const double relative = std::sqrt(error_sq / want_sq);
  std::printf("  fp8 grouped GEMM vs the block-scaled product: relative error %.2e\n", relative);
  EXPECT_LT(relative, 4e-3) << "bf16 output rounding is ~2e-3 RMS";

  // The chain the layer will run: the operands quantized on the GPU (row groups with their
  // scales group-major, blocks per expert) give the same output bits.
  void* a_bf16 = test::upload(problem.device, a);
  void* b_bf16 = test::upload(problem.device, b);
  ASSERT_EQ(kernels::launch_quantize_fp8(a_bf16, rows, k, kernels::Fp8QuantizeForm::kRowGroups,
                                         problem.a, problem.a_scales, nullptr),
            cudaSuccess);
  for (int64_t e = 0; e < experts; ++e)
    ASSERT_EQ(kernels::launch_quantize_fp8(static_cast<char*>(b_bf16) + e * n * k * 2, n, k,
                                           kernels::Fp8QuantizeForm::kBlocks,
                                           static_cast<char*>(problem.b) + e * n * k,
                                           problem.b_scales + e * (n / 128) * (k / 128), nullptr),
              cudaSuccess);
  ASSERT_EQ(cudaMemset(problem.out, 0xff, rows * n * 2), cudaSuccess);
  ASSERT_EQ(problem.run(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(again.data(), problem.out, again.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 2), 0)
      << "GPU-quantized operands give other bits than the host-quantized ones";

  // Split columns (the gate/up GEMM: Wg and Wu, g and u): columns [0, 128) from B's first 128
  // rows of each expert to out [rows, 128], columns [128, 384) from B2 = the other 256 rows to
  // out2 [rows, 256], each part with its own dense block scales: the same bits as before.
  void* first = problem.device.allocate(rows * 128 * 2);
  void* second = problem.device.allocate(rows * 256 * 2);
  const int64_t k_groups = k / 128;
  std::vector<float> scales_first, scales_second;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t nb = 0; nb < n / 128; ++nb)
      for (int64_t g = 0; g < k_groups; ++g)
        (nb == 0 ? scales_first : scales_second)
            .push_back(b_scales[(e * (n / 128) + nb) * k_groups + g]);
  float* first_scales = test::upload(problem.device, scales_first);
  float* second_scales = test::upload(problem.device, scales_second);
  const int64_t b2_dims[3] = {k, 256, experts}, b2_strides[2] = {k, n * k};
  const int32_t b2_box[3] = {128, 128, 1};
  problem.maps.b2 = make_tensor_map(static_cast<char*>(problem.b) + 128 * k, TmaElement::kE4M3, 3,
                                    b2_dims, b2_strides, b2_box, true, "B2");
  problem.params.b_scales = first_scales;
  problem.params.b2_scales = second_scales;
  problem.maps.out = make_tensor_map_3d(first, 128, rows, 1, 64, 128, "out (first columns)");
  problem.maps.out2 = make_tensor_map_3d(second, 256, rows, 1, 64, 128, "out2 (the rest)");
  problem.params.n_split = 128;
  ASSERT_EQ(problem.run(), cudaSuccess);
  std::vector<bf16> got_first(rows * 128), got_second(rows * 256);
  ASSERT_EQ(cudaMemcpy(got_first.data(), first, got_first.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got_second.data(), second, got_second.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  int64_t differ = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const bf16 value = c < 128 ? got_first[r * 128 + c] : got_second[r * 256 + c - 128];
      differ += std::memcmp(&value, &got[r * n + c], 2) != 0;
    }
  EXPECT_EQ(differ, 0) << "split outputs differ from the single output";
  problem.params.n_split = 100;
  EXPECT_EQ(problem.run(), cudaErrorInvalidValue);
  problem.params.n_split = 0;
  problem.params.b_scales = problem.b_scales;
  problem.maps.out = problem.maps.out2 =
      make_tensor_map_3d(problem.out, n, rows, 1, 64, 128, "out");

  // Split K (the gate/up dgrad: [d_g | d_u] times [Wg; Wu]): K-blocks [0, 256) from A and B,
  // [256, K) from A2 and B2 (the same tensors at a K offset; each part with its own scales):
  // the same bits as one K.
  const int64_t k_first = 256, k_second = k - k_first;
  const int64_t a2_dims[2] = {k_second, rows}, a2_strides[1] = {k};
  problem.maps.a2 = make_tensor_map(static_cast<char*>(problem.a) + k_first, TmaElement::kE4M3, 2,
                                    a2_dims, a2_strides, b2_box, true, "A2");
  const int64_t b2k_dims[3] = {k_second, n, experts}, b2k_strides[2] = {k, n * k};
  problem.maps.b2 = make_tensor_map(static_cast<char*>(problem.b) + k_first, TmaElement::kE4M3, 3,
                                    b2k_dims, b2k_strides, b2_box, true, "B2 (K)");
  const int64_t s2_dims[2] = {rows, k_second / 128}, s2_strides[1] = {rows * 4};
  const int32_t s_box[2] = {128, 1};
  problem.maps.a2_scales =
      make_tensor_map(problem.a_scales + (k_first / 128) * rows, TmaElement::kF32, 2, s2_dims,
                      s2_strides, s_box, false, "A2 scales");
  std::vector<float> k_scales_first, k_scales_second;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t nb = 0; nb < n / 128; ++nb)
      for (int64_t g = 0; g < k_groups; ++g)
        (g < k_first / 128 ? k_scales_first : k_scales_second)
            .push_back(b_scales[(e * (n / 128) + nb) * k_groups + g]);
  // More than the n split's first scales: every N-block.
  float* k_first_scales = test::upload(problem.device, k_scales_first);
  float* k_second_scales = test::upload(problem.device, k_scales_second);
  problem.params.b_scales = k_first_scales;
  problem.params.b2_scales = k_second_scales;
  problem.params.k_split = static_cast<int32_t>(k_first);
  ASSERT_EQ(cudaMemset(problem.out, 0xff, rows * n * 2), cudaSuccess);
  ASSERT_EQ(problem.run(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(again.data(), problem.out, again.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 2), 0)
      << "a split K gives other bits than one K";
}

// K of 5 K-blocks (a tile's blocks within one turn of the stage ring) and of 18 (the ring wrapped
// within each tile, as at every layer shape).
TEST(Fp8GemmGpu, MatchesTheBlockScaledProduct) {
  for (const int64_t k : {640, 2304}) {
    SCOPED_TRACE("K = " + std::to_string(k));
    expect_block_scaled_product(k);
    if (HasFatalFailure()) return;
  }
}

// The 192-row tiles (MoeConfig::fp8_row_tile_rows = 192, fp8_gemm_192_rows.cu) give the
// 128-row tiles' bits: experts of 256, 0, 384, 128 and 640 rows (so the last tiles of an expert
// hold 1, 2 or 3 chunks of 64 rows, and one expert none), at K of 5 and 18 K-blocks, on every SM
// and on 1, 2 and 5 CTAs (each walking tiles of several experts), plain and with the output
// columns split (the gate/up GEMM's g and u) and with K split (the gate/up dgrad's d_g, d_u).
// With the routed counts (190, 0, 300, 64 and 577 rows), the chunks of padding alone are left
// unwritten and every other row keeps its bits. All of it in the static walk and with the tiles
// taken by ticket (each launch from its own epoch's tickets).
TEST(Fp8GemmGpu, Rows192TilesGiveTheSameBits) {
  const std::vector<int32_t> expert_rows = {256, 0, 384, 128, 640};
  const std::vector<int32_t> expert_counts = {190, 0, 300, 64, 577};
  const int64_t experts = static_cast<int64_t>(expert_rows.size()), n = 384;
  std::vector<int32_t> offsets{0}, tile_expert;
  for (int64_t e = 0; e < experts; ++e) {
    offsets.push_back(offsets.back() + expert_rows[e]);
    tile_expert.insert(tile_expert.end(), expert_rows[e] / 128, static_cast<int32_t>(e));
  }
  const int64_t rows = offsets.back();
  for (const int64_t k : {640, 2304}) {
    SCOPED_TRACE("K = " + std::to_string(k));
    const std::vector<bf16> a = random_bf16(rows * k, 47, 1.0f);
    const std::vector<bf16> b = random_bf16(experts * n * k, 48, 0.05f);
    Fp8GemmProblem problem(rows, n, k, experts);
    quantize_and_upload(problem, a, b, tile_expert);
    ASSERT_FALSE(HasFailure());
    ASSERT_EQ(cudaMemcpy(problem.expert_offsets, offsets.data(), offsets.size() * 4,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    int32_t* device_counts = test::upload(problem.device, expert_counts);
    // Whether row r lies in a chunk of padding alone (past its expert's routed rows' chunks).
    std::vector<bool> skipped(rows, false);
    for (int64_t e = 0; e < experts; ++e)
      for (int32_t r = offsets[e] + (expert_counts[e] + 63) / 64 * 64; r < offsets[e + 1]; ++r)
        skipped[r] = true;
    // The split forms read B (and A) as two tensors: here the same ones, split in two places.
    problem.maps.a2 = problem.maps.a;
    problem.maps.a2_scales = problem.maps.a_scales;
    problem.maps.b2 = problem.maps.b;
    problem.params.b2_scales = problem.b_scales;
    const kernels::Fp8GemmMaps maps128 = problem.maps;
    kernels::Fp8GemmMaps maps192 = rows_192_maps(problem);
    maps192.a2 = maps192.a;
    maps192.a2_scales = maps192.a_scales;
    // With the columns split at 256, columns [256, 384) go to out2 [rows, 128].
    void* out2 = problem.device.allocate(rows * 128 * 2);
    const CUtensorMap out2_128 = make_tensor_map_3d(out2, 128, rows, 1, 64, 128, "out2");
    const CUtensorMap out2_192 = make_tensor_map_3d(out2, 128, rows, 1, 64, 64, "out2");
    struct Split {
      const char* name;
      int32_t n_split, k_split;
    };
    for (const Split split : {Split{"plain", 0, 0}, Split{"columns split", 256, 0},
                              Split{"K split", 0, static_cast<int32_t>(k / 2 / 128 * 128)}}) {
      SCOPED_TRACE(split.name);
      problem.params.n_split = split.n_split;
      problem.params.k_split = split.k_split;
      // Both outputs after a run (out2 only with the columns split).
      auto outputs = [&] {
        std::vector<bf16> values(rows * n + rows * 128);
        EXPECT_EQ(cudaMemcpy(values.data(), problem.out, rows * n * 2, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        EXPECT_EQ(
            cudaMemcpy(values.data() + rows * n, out2, rows * 128 * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
        return values;
      };
      auto clear = [&] {
        ASSERT_EQ(cudaMemset(problem.out, 0xff, rows * n * 2), cudaSuccess);
        ASSERT_EQ(cudaMemset(out2, 0xff, rows * 128 * 2), cudaSuccess);
      };
      problem.maps = maps128;
      if (split.n_split > 0) problem.maps.out2 = out2_128;
      problem.params.tile_rows = 128;
      clear();
      ASSERT_EQ(problem.run(), cudaSuccess);
      const std::vector<bf16> want = outputs();
      problem.maps = maps192;
      if (split.n_split > 0) problem.maps.out2 = out2_192;
      problem.params.tile_rows = 192;
      problem.params.num_experts = static_cast<int32_t>(experts);
      for (const bool by_ticket : {false, true}) {
        SCOPED_TRACE(by_ticket ? "tiles by ticket" : "static walk");
        problem.params.tile_tickets = by_ticket ? problem.tickets : kernels::GemmTickets{};
        for (const int ctas : {0, 1, 2, 5}) {
          clear();
          ASSERT_EQ(problem.run(nullptr, ctas), cudaSuccess);
          const std::vector<bf16> got = outputs();
          EXPECT_EQ(std::memcmp(want.data(), got.data(), got.size() * 2), 0)
              << (ctas == 0 ? std::string("every SM") : std::to_string(ctas) + " CTAs");
        }
        // With the routed counts: the skipped chunks' rows keep the 0xff fill, the others the
        // bits.
        problem.params.expert_counts = device_counts;
        clear();
        ASSERT_EQ(problem.run(), cudaSuccess);
        const std::vector<bf16> got = outputs();
        problem.params.expert_counts = nullptr;
        int64_t wrong = 0, first_wrong = -1;
        for (int64_t r = 0; r < rows; ++r)
          for (const auto [base, width] :
               {std::pair{int64_t{0}, n}, std::pair{rows * n, int64_t{128}}})
            for (int64_t c = 0; c < width; ++c) {
              const int64_t at = base + r * width + c;
              const bool same = skipped[r] ? got[at].bits == 0xffff : got[at].bits == want[at].bits;
              if (!same && wrong++ == 0) first_wrong = r;
            }
        EXPECT_EQ(wrong, 0) << "with the routed counts; first at row " << first_wrong
                            << (first_wrong >= 0 && skipped[first_wrong] ? " (skipped)" : "");
        problem.expect_ticket_epochs();
      }
      problem.params.tile_tickets = {};
    }
    if (HasFailure()) return;
  }
}

// Device buffers read or filled as one run of bytes, in order.
struct DeviceBytes {
  void* pointer;
  int64_t count;
};
std::vector<uint8_t> download_bytes(std::initializer_list<DeviceBytes> regions) {
  int64_t total = 0;
  for (const DeviceBytes& region : regions) total += region.count;
  std::vector<uint8_t> bytes(total);
  uint8_t* at = bytes.data();
  for (const DeviceBytes& region : regions) {
    EXPECT_EQ(cudaMemcpy(at, region.pointer, region.count, cudaMemcpyDeviceToHost), cudaSuccess);
    at += region.count;
  }
  return bytes;
}
void fill_bytes(std::initializer_list<DeviceBytes> regions) {  // with 0xff
  for (const DeviceBytes& region : regions)
    ASSERT_EQ(cudaMemset(region.pointer, 0xff, region.count), cudaSuccess);
}

// The gate/up GEMM over two problems of `inter` columns: `gate` carries the launch, with `up`'s
// weights and scales as B2 and `up`'s output as out2 (n_split at inter); its maps for the 128-
// and the 192-row tiles.
void join_gate_up(Fp8GemmProblem& gate, const Fp8GemmProblem& up, int64_t inter,
                  kernels::Fp8GemmMaps* maps128, kernels::Fp8GemmMaps* maps192) {
  gate.maps.b2 = up.maps.b;
  gate.params.b2_scales = up.b_scales;
  gate.params.n_extent = static_cast<int32_t>(2 * inter);
  gate.params.n_split = static_cast<int32_t>(inter);
  gate.params.num_experts = static_cast<int32_t>(gate.experts);
  *maps128 = gate.maps;
  *maps192 = rows_192_maps(gate);
  maps128->out2 = make_tensor_map_3d(up.out, inter, gate.rows, 1, 64, 128, "up");
  maps192->b2 = up.maps.b;
  maps192->out2 = make_tensor_map_3d(up.out, inter, gate.rows, 1, 64, kernels::kRows192Chunk, "up");
}

// SwiGLU and h's quantization in the gate/up GEMM's epilogue (Fp8GemmParams::swiglu_h_codes,
// MoeConfig::fp8_swiglu) give the pass's bits (launch_swiglu_quantize_fp8 over the
// GEMM's own g and u): h's codes and scales, and g and u when stored; with swiglu_stores_gate_up
// 0 neither is written. Experts as in Rows192TilesGiveTheSameBits, I = 256 (two groups of h a
// row), a clamp that cuts, and a row of x with a NaN (its g, u and h NaN: the scale's NaN bits
// are the pass's). 128- and 192-row tiles, on every SM and on 1, 2 and 5 CTAs; the 192-row ones
// static and by ticket, and with the routed counts (the rows of a chunk of padding alone keep
// their fill, the others the bits).
TEST(Fp8GemmGpu, SwigluInTheGateUpEpilogueMatchesThePass) {
  const std::vector<int32_t> expert_rows = {256, 0, 384, 128, 640};
  const std::vector<int32_t> expert_counts = {190, 0, 300, 64, 577};
  const int64_t experts = static_cast<int64_t>(expert_rows.size()), inter = 256, k = 640;
  const float limit = 1.25f;
  std::vector<int32_t> offsets{0}, tile_expert;
  for (int64_t e = 0; e < experts; ++e) {
    offsets.push_back(offsets.back() + expert_rows[e]);
    tile_expert.insert(tile_expert.end(), expert_rows[e] / 128, static_cast<int32_t>(e));
  }
  const int64_t rows = offsets.back();
  std::vector<bf16> x = random_bf16(rows * k, 53, 1.0f);
  x[5 * k + 3] = float_to_bf16(std::nanf(""));
  // g's GEMM carries the launch; u's problem holds Wu, its scales and the u output.
  Fp8GemmProblem gate(rows, inter, k, experts), up(rows, inter, k, experts);
  quantize_and_upload(gate, x, random_bf16(experts * inter * k, 54, 0.05f), tile_expert);
  quantize_and_upload(up, x, random_bf16(experts * inter * k, 55, 0.05f), tile_expert);
  ASSERT_FALSE(HasFailure());
  ASSERT_EQ(
      cudaMemcpy(gate.expert_offsets, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  int32_t* device_counts = test::upload(gate.device, expert_counts);
  std::vector<bool> skipped(rows, false);  // row r in a chunk of padding alone
  for (int64_t e = 0; e < experts; ++e)
    for (int32_t r = offsets[e] + (expert_counts[e] + 63) / 64 * 64; r < offsets[e + 1]; ++r)
      skipped[r] = true;
  kernels::Fp8GemmMaps maps128, maps192;
  join_gate_up(gate, up, inter, &maps128, &maps192);
  uint8_t* codes = gate.device.allocate<uint8_t>(rows * inter);
  float* scales = gate.device.allocate<float>(rows * (inter / 128) * 4);
  const int64_t bf16_bytes = rows * inter * 2, code_bytes = rows * inter,
                scale_bytes = rows * (inter / 128) * 4;
  // g, u, h's codes and h's scales, as bytes.
  const std::initializer_list<DeviceBytes> regions = {
      {gate.out, bf16_bytes}, {up.out, bf16_bytes}, {codes, code_bytes}, {scales, scale_bytes}};
  auto outputs = [&] { return download_bytes(regions); };
  auto clear = [&] { fill_bytes(regions); };
  gate.maps = maps128;
  clear();
  ASSERT_EQ(gate.run(), cudaSuccess);
  ASSERT_EQ(kernels::launch_swiglu_quantize_fp8(gate.out, up.out, rows, inter, limit, codes, scales,
                                                nullptr),
            cudaSuccess);
  const std::vector<uint8_t> want = outputs();
  {  // the test's reach: some h clamped by the limit, and the NaN row's scale NaN
    std::vector<bf16> g(rows * inter);
    std::memcpy(g.data(), want.data(), bf16_bytes);
    EXPECT_TRUE(std::any_of(g.begin(), g.end(), [&](bf16 v) { return bf16_to_float(v) > limit; }));
    float nan_scale;
    std::memcpy(&nan_scale, want.data() + 2 * bf16_bytes + code_bytes + 5 * 4, 4);
    EXPECT_TRUE(std::isnan(nan_scale));
  }
  gate.params.swiglu_h_codes = codes;
  gate.params.swiglu_h_scales = scales;
  gate.params.swiglu_h_rows = rows;
  gate.params.swiglu_limit = limit;
  // The row of byte `at` of outputs(), and whether the byte is g's or u's.
  auto row_of = [&](int64_t at, int64_t* row) {
    if (at < 2 * bf16_bytes) {
      *row = (at % bf16_bytes) / (inter * 2);
      return true;
    }
    at -= 2 * bf16_bytes;
    *row = at < code_bytes ? at / inter : ((at - code_bytes) / 4) % rows;
    return false;
  };
  for (const int tile_rows : {128, 192}) {
    gate.maps = tile_rows == 128 ? maps128 : maps192;
    gate.params.tile_rows = tile_rows;
    for (const bool stores : {true, false}) {
      gate.params.swiglu_stores_gate_up = stores ? 1 : 0;
      for (const bool by_ticket : {false, true}) {
        if (by_ticket && tile_rows == 128) continue;  // the 192-row tiles' tickets
        gate.params.tile_tickets = by_ticket ? gate.tickets : kernels::GemmTickets{};
        for (const bool counted : {false, true}) {
          if (counted && tile_rows == 128) continue;  // the 192-row tiles' skipped chunks
          gate.params.expert_counts = counted ? device_counts : nullptr;
          for (const int ctas : {0, 1, 2, 5}) {
            SCOPED_TRACE(std::to_string(tile_rows) + "-row tiles, " +
                         (stores ? "g and u stored, " : "g and u not stored, ") +
                         (by_ticket ? "by ticket, " : "static walk, ") +
                         (counted ? "routed counts, " : "") +
                         (ctas == 0 ? std::string("every SM") : std::to_string(ctas) + " CTAs"));
            clear();
            ASSERT_EQ(gate.run(nullptr, ctas), cudaSuccess);
            const std::vector<uint8_t> got = outputs();
            int64_t wrong = 0, first_wrong = -1;
            for (int64_t at = 0; at < static_cast<int64_t>(got.size()); ++at) {
              int64_t row = 0;
              const bool gate_up = row_of(at, &row);
              const bool filled = (gate_up && !stores) || (counted && skipped[row]);
              if (got[at] != (filled ? 0xff : want[at]) && wrong++ == 0) first_wrong = at;
            }
            EXPECT_EQ(wrong, 0) << "first wrong byte " << first_wrong;
          }
        }
      }
    }
  }
  gate.expect_ticket_epochs();
}

// x's rows gathered and quantized inside the row-tile GEMM (Fp8GemmParams::row_gather,
// MoeConfig::fp8_gather_in_gate_up) give the gather pass's bits (launch_gather_quantize_fp8's
// row groups) and the GEMM's outputs over them: routed rows from random tokens (one with a NaN,
// one all zeros), padding rows between the experts' routed rows, an expert without rows; 128-
// and 192-row tiles (static and by ticket), SwiGLU in the epilogue or not, on every SM and on 1,
// 2 and 5 CTAs (the gatherers of the CTAs that run feed every tile), the launches one after
// another on one set of counters (each launch its own epoch).
TEST(Fp8GemmGpu, GatherInTheGemmMatchesTheGatherPass) {
  const std::vector<int32_t> expert_rows = {256, 0, 384, 128, 640};
  const std::vector<int32_t> expert_counts = {190, 0, 300, 64, 577};
  const int64_t experts = static_cast<int64_t>(expert_rows.size()), inter = 256, k = 640;
  const int64_t tokens = 300;
  const int32_t top_k = 4;
  std::vector<int32_t> offsets{0}, tile_expert, row_pair;
  for (int64_t e = 0; e < experts; ++e) {
    offsets.push_back(offsets.back() + expert_rows[e]);
    tile_expert.insert(tile_expert.end(), expert_rows[e] / 128, static_cast<int32_t>(e));
    for (int32_t r = 0; r < expert_rows[e]; ++r)  // token (r * 37 + e) % T, slot e % K
      row_pair.push_back(r < expert_counts[e]
                             ? static_cast<int32_t>(((r * 37 + e) % tokens) * top_k + e % top_k)
                             : -1);
  }
  const int64_t rows = offsets.back();
  std::vector<bf16> x = random_bf16(tokens * k, 61, 1.0f);
  x[7 * k + 200] = float_to_bf16(std::nanf(""));
  std::fill(x.begin() + 11 * k, x.begin() + 12 * k, float_to_bf16(0.0f));
  Fp8GemmProblem gate(rows, inter, k, experts), up(rows, inter, k, experts);
  // A is written below (by the pass, then by the GEMM); the weights are quantized here.
  quantize_and_upload(gate, std::vector<bf16>(rows * k),
                      random_bf16(experts * inter * k, 62, 0.05f), tile_expert);
  quantize_and_upload(up, std::vector<bf16>(rows * k), random_bf16(experts * inter * k, 63, 0.05f),
                      tile_expert);
  ASSERT_FALSE(HasFailure());
  ASSERT_EQ(
      cudaMemcpy(gate.expert_offsets, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  const bf16* device_x = test::upload(gate.device, x);
  const int32_t* device_row_pair = test::upload(gate.device, row_pair);
  kernels::Fp8GemmMaps maps128, maps192;
  join_gate_up(gate, up, inter, &maps128, &maps192);
  uint8_t* h_codes = gate.device.allocate<uint8_t>(rows * inter);
  float* h_scales = gate.device.allocate<float>(rows * (inter / 128) * 4);
  // The gather's counters: ticket, epoch, one count per 64-row chunk.
  auto* counters = gate.device.allocate<unsigned long long>((2 + rows / 64) * 8);
  ASSERT_EQ(cudaMemset(counters, 0, (2 + rows / 64) * 8), cudaSuccess);
  const int64_t code_bytes = rows * k, scale_bytes = rows * (k / 128) * 4,
                out_bytes = rows * inter * 2, h_bytes = rows * inter + rows * (inter / 128) * 4;
  // A's codes and scales, g, u, and h's codes and scales, as bytes.
  const std::initializer_list<DeviceBytes> regions = {
      {gate.a, code_bytes}, {gate.a_scales, scale_bytes}, {gate.out, out_bytes},
      {up.out, out_bytes},  {h_codes, rows * inter},      {h_scales, rows * (inter / 128) * 4}};
  auto outputs = [&] { return download_bytes(regions); };
  auto clear = [&] { fill_bytes(regions); };
  // The pass, then the GEMM over its rows (with SwiGLU in the epilogue: h too).
  kernels::Fp8GatherQuantize pass;
  pass.header = gate.header;
  pass.row_pair = device_row_pair;
  pass.top_k = top_k;
  pass.tokens = device_x;
  pass.cols = k;
  pass.capacity_rows = rows;
  pass.row_codes = gate.a;
  pass.row_scales = gate.a_scales;
  gate.params.swiglu_h_codes = h_codes;
  gate.params.swiglu_h_scales = h_scales;
  gate.params.swiglu_h_rows = rows;
  gate.params.swiglu_limit = 1.25f;
  clear();
  ASSERT_EQ(kernels::launch_gather_quantize_fp8(pass, nullptr), cudaSuccess);
  gate.maps = maps128;
  ASSERT_EQ(gate.run(), cudaSuccess);
  const std::vector<uint8_t> want = outputs();
  {  // the test's reach: the NaN token's scale is NaN in some routed row
    std::vector<float> scales(scale_bytes / 4);
    std::memcpy(scales.data(), want.data() + code_bytes, scale_bytes);
    EXPECT_TRUE(std::any_of(scales.begin(), scales.end(), [](float v) { return std::isnan(v); }));
  }
  kernels::Fp8RowGather& gather = gate.params.row_gather;
  gather.tokens = device_x;
  gather.row_pair = device_row_pair;
  gather.top_k = top_k;
  gather.codes = static_cast<uint8_t*>(gate.a);
  gather.scales = gate.a_scales;
  gather.capacity_rows = rows;
  gather.ticket = counters;
  gather.epoch = counters + 1;
  gather.chunk_rows_done = counters + 2;
  int64_t launches = 0;
  for (const int tile_rows : {128, 192}) {
    gate.maps = tile_rows == 128 ? maps128 : maps192;
    gate.params.tile_rows = tile_rows;
    for (const bool swiglu : {true, false}) {
      gate.params.swiglu_h_codes = swiglu ? h_codes : nullptr;
      for (const bool by_ticket : {false, true}) {
        if (by_ticket && tile_rows == 128) continue;  // the 192-row tiles' tickets
        gate.params.tile_tickets = by_ticket ? gate.tickets : kernels::GemmTickets{};
        for (const int ctas : {0, 1, 2, 5}) {
          SCOPED_TRACE(std::to_string(tile_rows) + "-row tiles, " +
                       (swiglu ? "SwiGLU in the epilogue, " : "") +
                       (by_ticket ? "by ticket, " : "static walk, ") +
                       (ctas == 0 ? std::string("every SM") : std::to_string(ctas) + " CTAs"));
          clear();
          ASSERT_EQ(gate.run(nullptr, ctas), cudaSuccess);
          ASSERT_EQ(kernels::launch_advance_epoch(gather.epoch, nullptr), cudaSuccess);
          ++launches;
          const std::vector<uint8_t> got = outputs();
          const int64_t checked = swiglu ? static_cast<int64_t>(got.size()) : got.size() - h_bytes;
          int64_t wrong = 0, first_wrong = -1;
          for (int64_t at = 0; at < checked; ++at)
            if (got[at] != want[at] && wrong++ == 0) first_wrong = at;
          EXPECT_EQ(wrong, 0) << "first wrong byte " << first_wrong;
        }
      }
    }
  }
  unsigned long long words[2] = {0, 0};  // the ticket, the epoch
  ASSERT_EQ(cudaMemcpy(words, counters, sizeof(words), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(words[1], static_cast<unsigned long long>(launches)) << "the epoch";
  // The last launch's tickets: every row once, and one past the end for each gatherer warp.
  EXPECT_EQ(words[0] >> 32, static_cast<unsigned long long>(launches)) << "the ticket's epoch";
  EXPECT_GE(words[0] & 0xffffffffull, static_cast<unsigned long long>(rows)) << "the rows claimed";
  gate.expect_ticket_epochs();
}

// Quantizes [rows, cols] bf16 along its rows' direction transposed, as the weight gradients'
// operands are: codes [cols, rows] in groups of 128 rows, scales group-major [rows / 128, cols].
void quantize_columns(const std::vector<bf16>& values, int64_t rows, int64_t cols,
                      std::vector<e4m3>& codes, std::vector<float>& scales) {
  std::vector<bf16> transposed(values.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) transposed[c * rows + r] = values[r * cols + c];
  codes.resize(values.size());
  std::vector<float> line_scales(values.size() / 128);
  quantize_fp8_rows(transposed.data(), cols, rows, codes.data(), line_scales.data());
  scales.resize(line_scales.size());
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t g = 0; g < rows / 128; ++g)
      scales[g * cols + c] = line_scales[c * (rows / 128) + g];
}

// The weight-gradient form: per expert over its rows (one expert without rows: zeros), both
// operands with per-line scales; against the product in double, and the GPU quantizer's operands
// give the same bits.
TEST(Fp8GemmGpu, WeightGradientMatchesTheBlockScaledProduct) {
  const int64_t rows = 640, m = 256, n = 384, experts = 3;
  const std::vector<int32_t> offsets = {0, 256, 256, 640};
  std::vector<bf16> a = random_bf16(rows * m, 11, 1.0f), b = random_bf16(rows * n, 12, 0.5f);
  for (int64_t r = 0; r < rows; ++r)  // rows of different magnitudes: each group its own scale
    for (int64_t c = 0; c < m; ++c)
      a[r * m + c] = float_to_bf16(bf16_to_float(a[r * m + c]) * std::ldexp(1.0f, r % 7 - 3));
  // Columns of different magnitudes: each B column its own scale, so that a column scale read
  // from the wrong column (the consumers' fragment-order copy) shows in the error.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c)
      b[r * n + c] = float_to_bf16(bf16_to_float(b[r * n + c]) * std::ldexp(1.0f, c % 5 - 2));
  std::vector<e4m3> a_q, b_q;
  std::vector<float> a_scales, b_scales;
  quantize_columns(a, rows, m, a_q, a_scales);
  quantize_columns(b, rows, n, b_q, b_scales);

  Fp8WeightGradProblem problem(rows, m, n, experts);
  ASSERT_EQ(cudaMemcpy(problem.a_codes, a_q.data(), a_q.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(problem.b_codes, b_q.data(), b_q.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(problem.a_scales, a_scales.data(), a_scales.size() * 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(problem.b_scales, b_scales.data(), b_scales.size() * 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  ASSERT_EQ(cudaMemcpy(problem.offsets, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(problem.out, 0xff, experts * m * n * 2), cudaSuccess);
  ASSERT_EQ(problem.run(), cudaSuccess);
  std::vector<bf16> got(experts * m * n);
  ASSERT_EQ(cudaMemcpy(got.data(), problem.out, got.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);

  double error_sq = 0, want_sq = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = 0;
        for (int64_t g = offsets[e] / 128; g < offsets[e + 1] / 128; ++g) {
          double block = 0;
          for (int64_t r = g * 128; r < g * 128 + 128; ++r)
            block += static_cast<double>(e4m3_to_float(a_q[i * rows + r])) *
                     e4m3_to_float(b_q[j * rows + r]);
          want += block * a_scales[g * m + i] * b_scales[g * n + j];
        }
        const double value = bf16_to_float(got[(e * m + i) * n + j]);
        ASSERT_TRUE(std::isfinite(value)) << "expert " << e << " (" << i << ", " << j << ")";
        if (e == 1) ASSERT_EQ(value, 0.0) << "the expert without rows";
        error_sq += (value - want) * (value - want);
        want_sq += want * want;
      }
  const double relative = std::sqrt(error_sq / want_sq);
  std::printf("  fp8 weight gradients vs the block-scaled product: relative error %.2e\n",
              relative);
  EXPECT_LT(relative, 4e-3);
  // On a few CTAs each walks the experts' tiles in turn, the one without rows among them; with
  // two staging tiles (weight_grad_staging_tiles) a CTA's tiles alternate between them.
  for (const int staging_tiles : {1, 2})
    for (const int ctas : {1, 3, 0}) {
      std::vector<bf16> walked(got.size());
      problem.params.weight_grad_staging_tiles = staging_tiles;
      ASSERT_EQ(cudaMemset(problem.out, 0xff, experts * m * n * 2), cudaSuccess);
      ASSERT_EQ(problem.run(ctas), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(walked.data(), problem.out, walked.size() * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(std::memcmp(got.data(), walked.data(), got.size() * 2), 0)
          << ctas << " CTAs (0: one per SM), " << staging_tiles << " staging tiles";
    }
  problem.params.weight_grad_staging_tiles = 3;
  EXPECT_EQ(problem.run(), cudaErrorInvalidValue);
  problem.params.weight_grad_staging_tiles = 1;

  // The column-group quantizer's operands: the same bits.
  void* a_bf16 = test::upload(problem.device, a);
  void* b_bf16 = test::upload(problem.device, b);
  ASSERT_EQ(kernels::launch_quantize_fp8(a_bf16, rows, m, kernels::Fp8QuantizeForm::kColumnGroups,
                                         problem.a_codes, problem.a_scales, nullptr),
            cudaSuccess);
  ASSERT_EQ(kernels::launch_quantize_fp8(b_bf16, rows, n, kernels::Fp8QuantizeForm::kColumnGroups,
                                         problem.b_codes, problem.b_scales, nullptr),
            cudaSuccess);
  ASSERT_EQ(problem.run(), cudaSuccess);
  std::vector<bf16> again(got.size());
  ASSERT_EQ(cudaMemcpy(again.data(), problem.out, again.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 2), 0);
}

}  // namespace
}  // namespace mok
