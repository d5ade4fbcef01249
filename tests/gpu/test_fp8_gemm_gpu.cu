// The FP8 block-scaled grouped GEMM (src/kernels/gemm/fp8_gemm.cu) against the host: A and B
// quantized by the host quantizers (mok/fp8.h), the expected product summed per 128-long K-block
// in double and scaled as the recipe says; the GPU's bf16 output within bf16 rounding of it, the
// same bits on a second run, and rows of different experts in one launch. Then its TFLOP/s at
// the dsv3_local gate/up GEMM, free-running and kept in step, and at the layer's other FP8 GEMMs
// of that shape, on constant and on random operands, per call and sustained, with the default
// walk, in groups of one expert's tiles and in 192-row tiles, each with the SM clock it ran at
// (printed; issue 17's bar is 1,100 for the FP8 GEMMs).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/fp8_rows192_walk.h"
#include "kernels/stages/fp8_quantize.h"
#include "kernels/stages/launch.h"
#include "layer/tma.h"
#include "mok/fp8.h"
#include "mok/schedule.h"
#include "mok/sm_clock.h"
#include "mok/testing/routing.h"
#include "test_util.h"
#include "wait_record.h"

namespace mok {
namespace {

// Device copies of one problem and the kernel's maps.
struct Fp8GemmProblem {
  int64_t rows = 0, n = 0, k = 0, experts = 0;
  void *a = nullptr, *b = nullptr, *out = nullptr;
  float *a_scales = nullptr, *b_scales = nullptr;
  int32_t* tile_expert = nullptr;
  int32_t* expert_offsets = nullptr;  // rows, for the expert groups' walk
  ScheduleHeader* header = nullptr;
  kernels::Fp8GemmMaps maps{};
  kernels::Fp8GemmParams params{};

  Fp8GemmProblem(int64_t rows_, int64_t n_, int64_t k_, int64_t experts_)
      : rows(rows_), n(n_), k(k_), experts(experts_) {
    EXPECT_EQ(cudaMalloc(&a, rows * k), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&b, experts * n * k), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&out, rows * n * 2), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&a_scales, rows * (k / 128) * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&b_scales, experts * (n / 128) * (k / 128) * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&tile_expert, rows / 128 * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&expert_offsets, (experts + 1) * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&header, sizeof(ScheduleHeader)), cudaSuccess);
    ScheduleHeader host_header{};
    host_header.total_rows = static_cast<int32_t>(rows);
    host_header.num_tiles = static_cast<int32_t>(rows / 128);
    EXPECT_EQ(cudaMemcpy(header, &host_header, sizeof(host_header), cudaMemcpyHostToDevice),
              cudaSuccess);
    const int64_t a_dims[2] = {k, rows}, a_strides[1] = {k};
    const int32_t tile_box[2] = {128, 128};
    maps.a = make_tensor_map(a, TmaElement::kE4M3, 2, a_dims, a_strides, tile_box, true, "A");
    const int64_t b_dims[3] = {k, n, experts}, b_strides[2] = {k, n * k};
    const int32_t b_box[3] = {128, 128, 1};
    maps.b = make_tensor_map(b, TmaElement::kE4M3, 3, b_dims, b_strides, b_box, true, "B");
    const int64_t s_dims[2] = {rows, k / 128}, s_strides[1] = {rows * 4};
    const int32_t s_box[2] = {128, 1};
    maps.a_scales =
        make_tensor_map(a_scales, TmaElement::kF32, 2, s_dims, s_strides, s_box, false, "A scales");
    maps.out = make_tensor_map_3d(out, n, rows, 1, 64, 128, "out");
    maps.out2 = maps.out;
    params.header = header;
    params.tile_expert = tile_expert;
    params.expert_offsets = expert_offsets;
    params.b_scales = b_scales;
    params.n_extent = static_cast<int32_t>(n);
    params.k_extent = static_cast<int32_t>(k);
    params.wait = test::test_wait_context();
  }
  ~Fp8GemmProblem() {
    for (void* p : {a, b, out, static_cast<void*>(a_scales), static_cast<void*>(b_scales),
                    static_cast<void*>(tile_expert), static_cast<void*>(expert_offsets),
                    static_cast<void*>(header)})
      cudaFree(p);
  }
  cudaError_t run(cudaStream_t stream = nullptr) {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return kernels::launch_fp8_grouped_gemm(maps, params, sms, stream);
  }
};

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

// `problem`'s maps for the 192-row tiles (MoeConfig::fp8_row_tile_rows = 192, as the layer
// makes them): A's codes and the output in 64-row chunks, A's line scales in boxes of 192.
kernels::Fp8GemmMaps rows_192_maps(const Fp8GemmProblem& problem) {
  kernels::Fp8GemmMaps maps = problem.maps;
  const int64_t a_dims[2] = {problem.k, problem.rows}, a_strides[1] = {problem.k};
  const int32_t a_box[2] = {128, kernels::kRows192Chunk};
  maps.a = make_tensor_map(problem.a, TmaElement::kE4M3, 2, a_dims, a_strides, a_box, true, "A");
  const int64_t s_dims[2] = {problem.rows, problem.k / 128}, s_strides[1] = {problem.rows * 4};
  const int32_t s_box[2] = {kernels::kRows192, 1};
  maps.a_scales = make_tensor_map(problem.a_scales, TmaElement::kF32, 2, s_dims, s_strides, s_box,
                                  false, "A scales");
  maps.out = maps.out2 = make_tensor_map_3d(problem.out, problem.n, problem.rows, 1, 64,
                                            kernels::kRows192Chunk, "out");
  return maps;
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
  void* a_bf16 = nullptr;
  void* b_bf16 = nullptr;
  ASSERT_EQ(cudaMalloc(&a_bf16, a.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b_bf16, b.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a_bf16, a.data(), a.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b_bf16, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
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
  cudaFree(a_bf16);
  cudaFree(b_bf16);

  // Split columns (the gate/up GEMM: Wg and Wu, g and u): columns [0, 128) from B's first 128
  // rows of each expert to out [rows, 128], columns [128, 384) from B2 = the other 256 rows to
  // out2 [rows, 256], each part with its own dense block scales: the same bits as before.
  void *first = nullptr, *second = nullptr;
  float *first_scales = nullptr, *second_scales = nullptr;
  ASSERT_EQ(cudaMalloc(&first, rows * 128 * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&second, rows * 256 * 2), cudaSuccess);
  const int64_t k_groups = k / 128;
  std::vector<float> scales_first, scales_second;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t nb = 0; nb < n / 128; ++nb)
      for (int64_t g = 0; g < k_groups; ++g)
        (nb == 0 ? scales_first : scales_second)
            .push_back(b_scales[(e * (n / 128) + nb) * k_groups + g]);
  ASSERT_EQ(cudaMalloc(&first_scales, scales_first.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&second_scales, scales_second.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(first_scales, scales_first.data(), scales_first.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(second_scales, scales_second.data(), scales_second.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
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
  float* k_first_scales = nullptr;  // more than the n split's first scales: every N-block
  ASSERT_EQ(cudaMalloc(&k_first_scales, k_scales_first.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(k_first_scales, k_scales_first.data(), k_scales_first.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  float* k_second_scales = nullptr;
  ASSERT_EQ(cudaMalloc(&k_second_scales, k_scales_second.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(k_second_scales, k_scales_second.data(), k_scales_second.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  problem.params.b_scales = k_first_scales;
  problem.params.b2_scales = k_second_scales;
  problem.params.k_split = static_cast<int32_t>(k_first);
  ASSERT_EQ(cudaMemset(problem.out, 0xff, rows * n * 2), cudaSuccess);
  ASSERT_EQ(problem.run(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(again.data(), problem.out, again.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 2), 0)
      << "a split K gives other bits than one K";
  for (void* p :
       {first, second, static_cast<void*>(first_scales), static_cast<void*>(second_scales),
        static_cast<void*>(k_first_scales), static_cast<void*>(k_second_scales)})
    cudaFree(p);
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
// taken by ticket (each launch leaving the counters zero).
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
    int32_t* device_counts = nullptr;
    ASSERT_EQ(cudaMalloc(&device_counts, expert_counts.size() * 4), cudaSuccess);
    unsigned int* tickets = nullptr;  // Fp8GemmParams::tile_tickets
    ASSERT_EQ(cudaMalloc(&tickets, 2 * sizeof(unsigned int)), cudaSuccess);
    ASSERT_EQ(cudaMemset(tickets, 0, 2 * sizeof(unsigned int)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(device_counts, expert_counts.data(), expert_counts.size() * 4,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
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
    void* out2 = nullptr;
    ASSERT_EQ(cudaMalloc(&out2, rows * 128 * 2), cudaSuccess);
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
        problem.params.tile_tickets = by_ticket ? tickets : nullptr;
        for (const int ctas : {0, 1, 2, 5}) {
          clear();
          if (ctas == 0)
            ASSERT_EQ(problem.run(), cudaSuccess);
          else
            ASSERT_EQ(kernels::launch_fp8_grouped_gemm(problem.maps, problem.params, ctas, nullptr),
                      cudaSuccess);
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
        // Each launch by ticket leaves its counters zero for the next.
        unsigned int left[2] = {1, 1};
        ASSERT_EQ(cudaMemcpy(left, tickets, sizeof(left), cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(left[0], 0u) << "the tiles-taken counter";
        EXPECT_EQ(left[1], 0u) << "the CTAs-done counter";
      }
      problem.params.tile_tickets = nullptr;
    }
    cudaFree(out2);
    cudaFree(device_counts);
    cudaFree(tickets);
    if (HasFailure()) return;
  }
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
// Device buffers, maps and parameters of one weight-gradient problem: per expert e,
// out[e] [m, n] over the expert's rows [offsets[e], offsets[e + 1]) of A [m, rows] and B
// [n, rows] (both column-group codes, scales [rows / 128, m or n]).
struct Fp8WeightGradProblem {
  int64_t rows = 0, m = 0, n = 0, experts = 0;
  void *a_codes = nullptr, *b_codes = nullptr, *out = nullptr;
  float *a_scales = nullptr, *b_scales = nullptr;
  int32_t* offsets = nullptr;
  kernels::Fp8GemmMaps maps{};
  kernels::Fp8GemmParams params{};

  Fp8WeightGradProblem(int64_t rows_, int64_t m_, int64_t n_, int64_t experts_)
      : rows(rows_), m(m_), n(n_), experts(experts_) {
    EXPECT_EQ(cudaMalloc(&a_codes, m * rows), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&b_codes, n * rows), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&out, experts * m * n * 2), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&a_scales, m * (rows / 128) * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&b_scales, n * (rows / 128) * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&offsets, (experts + 1) * 4), cudaSuccess);
    const int32_t tile_box[2] = {128, 128}, scale_box[2] = {128, 1};
    const int64_t a_dims[2] = {rows, m}, b_dims[2] = {rows, n}, row_strides[1] = {rows};
    maps.a =
        make_tensor_map(a_codes, TmaElement::kE4M3, 2, a_dims, row_strides, tile_box, true, "A");
    maps.b =
        make_tensor_map(b_codes, TmaElement::kE4M3, 2, b_dims, row_strides, tile_box, true, "B");
    const int64_t sa_dims[2] = {m, rows / 128}, sa_strides[1] = {m * 4};
    const int64_t sb_dims[2] = {n, rows / 128}, sb_strides[1] = {n * 4};
    maps.a_scales = make_tensor_map(a_scales, TmaElement::kF32, 2, sa_dims, sa_strides, scale_box,
                                    false, "A scales");
    maps.b_scales = make_tensor_map(b_scales, TmaElement::kF32, 2, sb_dims, sb_strides, scale_box,
                                    false, "B scales");
    maps.out = make_tensor_map_3d(out, n, m, experts, 64, 128, "weight gradients");
    params.form = kernels::Fp8GemmForm::kWeightGrad;
    params.expert_offsets = offsets;
    params.num_experts = static_cast<int32_t>(experts);
    params.m_extent = static_cast<int32_t>(m);
    params.n_extent = static_cast<int32_t>(n);
    params.wait = test::test_wait_context();
  }
  ~Fp8WeightGradProblem() {
    for (void* p : {a_codes, b_codes, out, static_cast<void*>(a_scales),
                    static_cast<void*>(b_scales), static_cast<void*>(offsets)})
      cudaFree(p);
  }
  // On `ctas` CTAs, or one per SM (0).
  cudaError_t run(int ctas = 0) {
    if (ctas == 0) cudaDeviceGetAttribute(&ctas, cudaDevAttrMultiProcessorCount, 0);
    return kernels::launch_fp8_grouped_gemm(maps, params, ctas, nullptr);
  }
};

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
  // On a few CTAs each walks the experts' tiles in turn, the one without rows among them.
  for (const int ctas : {1, 3}) {
    std::vector<bf16> walked(got.size());
    ASSERT_EQ(cudaMemset(problem.out, 0xff, experts * m * n * 2), cudaSuccess);
    ASSERT_EQ(problem.run(ctas), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(walked.data(), problem.out, walked.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(std::memcmp(got.data(), walked.data(), got.size() * 2), 0) << ctas << " CTAs";
  }

  // The column-group quantizer's operands: the same bits.
  void *a_bf16 = nullptr, *b_bf16 = nullptr;
  ASSERT_EQ(cudaMalloc(&a_bf16, a.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b_bf16, b.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a_bf16, a.data(), a.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b_bf16, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
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
  for (void* p : {a_bf16, b_bf16}) cudaFree(p);
}

// The timing problems' operands: every A code 1.0, every B code 0.5, every scale 1, and
// `tiles_per_expert` row tiles per expert, so every output is K / 2 exactly.
void fill_constant_operands(Fp8GemmProblem& problem, int64_t tiles_per_expert) {
  const int64_t rows = problem.rows, n = problem.n, k = problem.k, experts = problem.experts;
  ASSERT_EQ(cudaMemset(problem.a, 0x38, rows * k), cudaSuccess);         // 1.0 in e4m3
  ASSERT_EQ(cudaMemset(problem.b, 0x30, experts * n * k), cudaSuccess);  // 0.5
  const std::vector<float> ones(std::max(rows * (k / 128), experts * (n / 128) * (k / 128)), 1.0f);
  ASSERT_EQ(cudaMemcpy(problem.a_scales, ones.data(), rows * (k / 128) * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(problem.b_scales, ones.data(), experts * (n / 128) * (k / 128) * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<int32_t> tile_expert(rows / 128);
  for (size_t t = 0; t < tile_expert.size(); ++t)
    tile_expert[t] = static_cast<int32_t>(t / tiles_per_expert);
  ASSERT_EQ(cudaMemcpy(problem.tile_expert, tile_expert.data(), tile_expert.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<int32_t> offsets(experts + 1);
  for (int64_t e = 0; e <= experts; ++e)
    offsets[e] = static_cast<int32_t>(std::min(e * tiles_per_expert * 128, rows));
  ASSERT_EQ(cudaMemcpy(problem.expert_offsets, offsets.data(), offsets.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
}

// A launch's (or a run of launches') milliseconds and the SM clock it ran at (clock probes
// around it, mok/sm_clock.h): on the power-limited card a form's rate is its work
// per cycle times the clock its power draw leaves, and the two are read apart.
struct Timed {
  double ms = 0;
  double ghz = 0;
};

// Median milliseconds of 10 launches after 2 warm-ups, and their median clock.
template <typename Launch>
Timed median_ms(Launch launch) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  SmClockWindow window;
  std::vector<float> times;
  std::vector<double> clocks;
  for (int i = 0; i < 12; ++i) {
    window.open(nullptr);
    cudaEventRecord(start);
    EXPECT_EQ(launch(), cudaSuccess);
    cudaEventRecord(stop);
    window.close(nullptr);
    EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 2) {
      times.push_back(ms);
      clocks.push_back(window.ghz());
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  std::sort(clocks.begin(), clocks.end());
  return {times[times.size() / 2], clocks[clocks.size() / 2]};
}

// Calls queued back to back, one synchronization at the end, as a training loop runs them: the
// mean milliseconds of 20 after 2 warm-ups, and the clock over the 20.
template <typename Launch>
Timed sustained_ms(Launch launch) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  SmClockWindow window;
  for (int i = 0; i < 2; ++i) EXPECT_EQ(launch(), cudaSuccess);
  constexpr int kCalls = 20;
  window.open(nullptr);
  cudaEventRecord(start);
  for (int i = 0; i < kCalls; ++i) EXPECT_EQ(launch(), cudaSuccess);
  cudaEventRecord(stop);
  window.close(nullptr);
  EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return {ms / kCalls, window.ghz()};
}

// Random operands for the rates: a card at its power limit clocks lower on random bits than on
// constants, and the layer's GEMMs run on quantized tensors, which use every code. Every byte
// but e4m3's NaNs (S.1111.111); scales uniform in [0.5, 2).
std::vector<uint8_t> random_codes(int64_t count, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<uint8_t> codes(count);
  for (int64_t i = 0; i < count; i += 8) {
    const uint64_t word = rng.next();
    for (int64_t b = 0; b < 8 && i + b < count; ++b) {
      const uint8_t code = static_cast<uint8_t>(word >> (8 * b));
      codes[i + b] = (code & 0x7f) == 0x7f ? code ^ 1 : code;
    }
  }
  return codes;
}
std::vector<float> random_scales(int64_t count, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> scales(count);
  for (float& s : scales) s = static_cast<float>(0.5 + 1.5 * rng.uniform());
  return scales;
}
template <typename T>
void upload(void* device, const std::vector<T>& host) {
  ASSERT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
}

// One output of a random-operand problem against the block-scaled sum in double: within bf16's
// rounding of it plus 2^-10 of the sum of the terms' magnitudes (FP8 products summed in the
// tensor cores per 128-long block), which at these K is a few percent of a typical output, so
// a wrong operand, block, scale or expert fails it.
struct SampledSum {
  double sum = 0, magnitude = 0;
  // One 128-long K-block: the products of the codes a[0..127] and b[0..127], times `factor`
  // (the block's two scales).
  void add_block(const uint8_t* a, const uint8_t* b, double factor) {
    double block = 0, block_magnitude = 0;
    for (int i = 0; i < 128; ++i) {
      const double term =
          static_cast<double>(e4m3_to_float(e4m3{a[i]})) * e4m3_to_float(e4m3{b[i]});
      block += term;
      block_magnitude += std::abs(term);
    }
    sum += block * factor;
    magnitude += block_magnitude * std::abs(factor);
  }
};
void expect_near_sum(const void* device_out, int64_t index, const SampledSum& want,
                     const char* what) {
  bf16 got{};
  ASSERT_EQ(
      cudaMemcpy(&got, static_cast<const char*>(device_out) + index * 2, 2, cudaMemcpyDeviceToHost),
      cudaSuccess);
  const double error = std::abs(static_cast<double>(bf16_to_float(got)) - want.sum);
  EXPECT_LE(error, std::ldexp(std::abs(want.sum), -7) + std::ldexp(want.magnitude, -10))
      << what << ": output " << index << " is " << bf16_to_float(got) << ", want " << want.sum;
}

// A row-tile problem's operands as random codes and scales; the host keeps them for the check.
struct RandomRowTileOperands {
  std::vector<uint8_t> a, b;
  std::vector<float> a_scales, b_scales;
};
RandomRowTileOperands upload_random_operands(Fp8GemmProblem& problem, uint64_t seed) {
  const int64_t k_blocks = problem.k / 128;
  RandomRowTileOperands o{random_codes(problem.rows * problem.k, seed),
                          random_codes(problem.experts * problem.n * problem.k, seed + 1),
                          random_scales(problem.rows * k_blocks, seed + 2),
                          random_scales(problem.experts * (problem.n / 128) * k_blocks, seed + 3)};
  upload(problem.a, o.a);
  upload(problem.b, o.b);
  upload(problem.a_scales, o.a_scales);
  upload(problem.b_scales, o.b_scales);
  return o;
}

// 64 outputs of a row-tile problem on random operands (tiles_per_expert row tiles per expert).
void expect_row_tile_samples(const Fp8GemmProblem& problem, const RandomRowTileOperands& o,
                             int64_t tiles_per_expert, const char* what) {
  const int64_t rows = problem.rows, n = problem.n, k = problem.k, k_blocks = k / 128;
  SplitMix64 pick(75);
  for (int sample = 0; sample < 64; ++sample) {
    const int64_t r = static_cast<int64_t>(pick.below(rows)), c = pick.below(n);
    const int64_t e = r / 128 / tiles_per_expert;
    SampledSum want;
    for (int64_t kb = 0; kb < k_blocks; ++kb)
      want.add_block(&o.a[r * k + kb * 128], &o.b[(e * n + c) * k + kb * 128],
                     static_cast<double>(o.a_scales[kb * rows + r]) *
                         o.b_scales[(e * (n / 128) + c / 128) * k_blocks + kb]);
    expect_near_sum(problem.out, r * n + c, want, what);
  }
}

// The walk in groups of one expert's row tiles (MoeConfig::gemm_expert_groups) at each of
// `mosts`, timed per call and sustained beside the default walk's lines; every expert holds
// tiles_per_expert = 9 row tiles in these problems, so fixed groups of 8 split each in two.
// Each walk gives the default walk's bits (the problem's output on entry).
void time_expert_groups(Fp8GemmProblem& problem, const std::string& label,
                        std::initializer_list<int32_t> mosts) {
  const int64_t count = problem.rows * problem.n;
  const double flop = 2.0 * problem.rows * problem.n * problem.k;
  std::vector<bf16> default_walk(count), walked(count);
  ASSERT_EQ(cudaMemcpy(default_walk.data(), problem.out, count * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  auto run = [&] { return problem.run(); };
  for (const int32_t most : mosts) {
    problem.params.expert_groups = most;
    ASSERT_EQ(cudaMemset(problem.out, 0xff, count * 2), cudaSuccess);
    for (const bool sustained : {false, true}) {
      const Timed t = sustained ? sustained_ms(run) : median_ms(run);
      std::printf(
          "  %s, random codes, expert groups of at most %d%s: %.3f ms, %.0f TFLOP/s, %.2f GHz\n",
          label.c_str(), most, sustained ? ", sustained" : "", t.ms, flop / t.ms / 1e9, t.ghz);
    }
    ASSERT_EQ(cudaMemcpy(walked.data(), problem.out, count * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_TRUE(test::bitwise_equal(walked, default_walk))
        << label << ", expert groups of " << most;
  }
  problem.params.expert_groups = 0;
}

// The same GEMM in 192-row tiles (MoeConfig::fp8_row_tile_rows = 192; the problem's experts
// padded to 128 rows, all of one size, its expert offsets uploaded), in the static walk and by
// ticket (Fp8GemmParams::tile_tickets): each timed per call and sustained, its output the 128-row
// tiles' to the bit (the problem's output on entry), and the tickets' counters left zero. With
// `routed_rows` > 0, both walks again with each expert's routed count at that (a 64-row chunk
// of padding alone skipped), in the same process, so that the counted walk's cost is read apart
// from the layer's passes; the counted rows' outputs are the 128-row tiles' bits, the skipped
// ones unwritten. The maps and parameters are restored after.
void time_rows_192(Fp8GemmProblem& problem, const std::string& label, int32_t routed_rows = 0) {
  const int64_t count = problem.rows * problem.n;
  const double flop = 2.0 * problem.rows * problem.n * problem.k;
  const int64_t expert_rows = problem.rows / problem.experts;
  std::vector<bf16> tiles_128(count), tiles_192(count);
  ASSERT_EQ(cudaMemcpy(tiles_128.data(), problem.out, count * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  const kernels::Fp8GemmMaps maps = problem.maps;
  const kernels::Fp8GemmParams params = problem.params;
  problem.maps = rows_192_maps(problem);
  problem.params.tile_rows = 192;
  problem.params.num_experts = static_cast<int32_t>(problem.experts);
  problem.params.lockstep = {};
  unsigned int* tickets = nullptr;
  int32_t* counts = nullptr;
  ASSERT_EQ(cudaMalloc(&tickets, 2 * sizeof(unsigned int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(tickets, 0, 2 * sizeof(unsigned int)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&counts, problem.experts * 4), cudaSuccess);
  if (routed_rows > 0) {
    ASSERT_LE(routed_rows, expert_rows);
    upload(counts, std::vector<int32_t>(problem.experts, routed_rows));
  }
  auto run = [&] { return problem.run(); };
  for (const bool counted : {false, true}) {
    if (counted && routed_rows == 0) break;
    problem.params.expert_counts = counted ? counts : nullptr;
    for (const bool by_ticket : {false, true}) {
      problem.params.tile_tickets = by_ticket ? tickets : nullptr;
      std::string walk = ", 192-row tiles";
      if (counted) walk += ", counted (" + std::to_string(routed_rows) + " routed rows an expert)";
      if (by_ticket) walk += ", by ticket";
      ASSERT_EQ(cudaMemset(problem.out, 0xff, count * 2), cudaSuccess);
      for (const bool sustained : {false, true}) {
        const Timed t = sustained ? sustained_ms(run) : median_ms(run);
        std::printf("  %s, random codes%s%s: %.3f ms, %.0f TFLOP/s of the padded rows, %.2f GHz\n",
                    label.c_str(), walk.c_str(), sustained ? ", sustained" : "", t.ms,
                    flop / t.ms / 1e9, t.ghz);
      }
      ASSERT_EQ(cudaMemcpy(tiles_192.data(), problem.out, count * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      // Without counts every row is the 128-row tiles'; with them the counted chunks' rows are,
      // and the skipped ones are unwritten.
      const int64_t kept = counted ? (routed_rows + 63) / 64 * 64 : expert_rows;
      int64_t wrong = 0;
      for (int64_t r = 0; r < problem.rows; ++r) {
        const bool computed = r % expert_rows < kept;
        for (int64_t c = 0; c < problem.n; ++c) {
          const uint16_t got = tiles_192[r * problem.n + c].bits;
          wrong += computed ? got != tiles_128[r * problem.n + c].bits : got != 0xffff;
        }
      }
      EXPECT_EQ(wrong, 0) << label << walk << ": outputs unlike the 128-row tiles' (computed rows) "
                          << "or written (skipped rows)";
      unsigned int left[2] = {1, 1};
      ASSERT_EQ(cudaMemcpy(left, tickets, sizeof(left), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(left[0], 0u) << label << walk << ": the tiles-taken counter after the launches";
      EXPECT_EQ(left[1], 0u) << label << walk << ": the CTAs-done counter after the launches";
    }
  }
  cudaFree(tickets);
  cudaFree(counts);
  problem.maps = maps;
  problem.params = params;
}

// The dsv3_local gate/up GEMM in FP8: 36864 rows (32 experts x 9 tiles), N = 2 I = 4096,
// K = H = 7168; median of 10 launches, TFLOP/s printed, free-running and with the CTAs kept
// within 8, 16 and 32 K-blocks of the slowest (MoeConfig::gemm_lockstep_k_blocks), whose output
// is the free-running one's to the bit; then free-running on random operands.
TEST(Fp8GemmGpu, Throughput) {
  const int64_t experts = 32, rows = experts * 9 * 128, n = 4096, k = 7168;
  Fp8GemmProblem problem(rows, n, k, experts);
  fill_constant_operands(problem, 9);
  ASSERT_FALSE(HasFatalFailure());
  // The lockstep's counters, zeroed once; the epoch advanced after each launch, as the layer does.
  unsigned long long* counters = nullptr;
  ASSERT_EQ(cudaMalloc(&counters, (kernels::kLockstepTicks + 2) * sizeof(unsigned long long)),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(counters, 0, (kernels::kLockstepTicks + 2) * sizeof(unsigned long long)),
            cudaSuccess);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<bf16> free_running(rows * n), in_step(rows * n);
  for (const int32_t lead : {0, 8, 16, 32}) {
    problem.params.lockstep = {};
    if (lead > 0)
      problem.params.lockstep = {counters, counters + kernels::kLockstepTicks,
                                 counters + kernels::kLockstepTicks + 1, lead};
    // Poisoned first: every tile of each lead's runs is written by them.
    ASSERT_EQ(cudaMemset(problem.out, 0xff, rows * n * 2), cudaSuccess);
    std::vector<float> times;
    for (int i = 0; i < 12; ++i) {
      cudaEventRecord(start);
      ASSERT_EQ(problem.run(), cudaSuccess);
      cudaEventRecord(stop);
      if (lead > 0)
        ASSERT_EQ(kernels::launch_advance_epoch(problem.params.lockstep.epoch, nullptr),
                  cudaSuccess);
      ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (i >= 2) times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    const double ms = times[times.size() / 2];
    std::printf(
        "  fp8 grouped GEMM, dsv3_local gate/up (%lld x %lld x %lld), %s: %.3f ms, %.0f "
        "TFLOP/s\n",
        static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(k),
        lead == 0 ? "free-running" : ("in step within " + std::to_string(lead)).c_str(), ms,
        2.0 * rows * n * k / ms / 1e9);
    std::vector<bf16>& got = lead == 0 ? free_running : in_step;
    ASSERT_EQ(cudaMemcpy(got.data(), problem.out, got.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    if (lead > 0) EXPECT_TRUE(test::bitwise_equal(in_step, free_running)) << "lead " << lead;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(counters);

  // Free-running on random operands (the codes a quantized layer feeds it), per call and
  // sustained.
  problem.params.lockstep = {};
  const RandomRowTileOperands operands = upload_random_operands(problem, 61);
  ASSERT_FALSE(HasFatalFailure());
  auto run = [&] { return problem.run(); };
  for (const bool sustained : {false, true}) {
    const Timed t = sustained ? sustained_ms(run) : median_ms(run);
    std::printf(
        "  fp8 grouped GEMM, dsv3_local gate/up (%lld x %lld x %lld), free-running, random "
        "codes%s: %.3f ms, %.0f TFLOP/s, %.2f GHz\n",
        static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(k),
        sustained ? ", sustained" : "", t.ms, 2.0 * rows * n * k / t.ms / 1e9, t.ghz);
  }
  expect_row_tile_samples(problem, operands, 9, "gate/up");
  const std::string label = "fp8 grouped GEMM, dsv3_local gate/up (" + std::to_string(rows) +
                            " x " + std::to_string(n) + " x " + std::to_string(k) +
                            "), free-running";
  time_expert_groups(problem, label, {16, 5});
  time_rows_192(problem, label);
}

// Every element of a bf16 output of `count` values equals `want`: the tiles were all written.
void expect_all_equal(const void* device_out, int64_t count, float want, const char* what) {
  std::vector<bf16> got(count);
  ASSERT_EQ(cudaMemcpy(got.data(), device_out, count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  int64_t wrong = 0, first = -1;
  for (int64_t i = 0; i < count; ++i)
    if (bf16_to_float(got[i]) != want && wrong++ == 0) first = i;
  EXPECT_EQ(wrong, 0) << what << ": " << wrong << " of " << count << " values differ from " << want
                      << ", the first at " << first;
}

// Issue 17's bar covers every FP8 GEMM of the layer at dsv3_local, not only the gate/up: the
// other three row-tile GEMMs (down; the dgrads, with the weights transposed) and the weight
// gradients ([2048 x 7168] per expert: 32 experts of 1,024 rows, and dsv3_e128's 128 of 256).
// Each is timed on constant operands (every A code 1.0, every B code 0.5, scales 1: every output
// is K / 2 exactly, checked in full) and on random ones (64 outputs checked), per call and
// sustained; TFLOP/s printed.
TEST(Fp8GemmGpu, EveryFormsRateAtDsv3Shapes) {
  auto print = [](const char* what, const Timed& t, double flop, const char* extra = "") {
    std::printf("  %s: %.3f ms, %.0f TFLOP/s, %.2f GHz%s\n", what, t.ms, flop / t.ms / 1e9, t.ghz,
                extra);
  };
  const int64_t experts = 32, tiles_per_expert = 9, rows = experts * tiles_per_expert * 128;
  struct RowTileGemm {
    const char* name;
    int64_t n, k;
  };
  for (const RowTileGemm& gemm :
       {RowTileGemm{"down", 7168, 2048}, RowTileGemm{"down dgrad", 2048, 7168},
        RowTileGemm{"gate/up dgrad", 7168, 4096}}) {
    const int64_t n = gemm.n, k = gemm.k;
    const double flop = 2.0 * rows * n * k;
    Fp8GemmProblem problem(rows, n, k, experts);
    fill_constant_operands(problem, tiles_per_expert);
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_EQ(cudaMemset(problem.out, 0xff, rows * n * 2), cudaSuccess);
    const std::string label = std::string("fp8 grouped GEMM, dsv3_local ") + gemm.name + " (" +
                              std::to_string(rows) + " x " + std::to_string(n) + " x " +
                              std::to_string(k) + ")";
    print((label + ", constant codes").c_str(), median_ms([&] { return problem.run(); }), flop);
    expect_all_equal(problem.out, rows * n, 0.5f * static_cast<float>(k), gemm.name);

    const RandomRowTileOperands operands = upload_random_operands(problem, 71);
    ASSERT_FALSE(HasFatalFailure());
    print((label + ", random codes").c_str(), median_ms([&] { return problem.run(); }), flop);
    print((label + ", random codes, sustained").c_str(),
          sustained_ms([&] { return problem.run(); }), flop);
    expect_row_tile_samples(problem, operands, tiles_per_expert, gemm.name);
    time_expert_groups(problem, label, {16});
    // 1,052 routed rows an expert: 17 chunks (tiles of 3 x 5 + 2) against the padded 18 (3 x 6).
    time_rows_192(problem, label, tiles_per_expert * 128 - 100);
  }

  // dsv3_e128's down GEMM (128 experts, ~256 routed rows each): experts of 300 routed rows padded
  // to 384, whose 192-row tiles are 3 + 3 chunks padded and 3 + 2 counted, the walk that
  // measured 1.14x the 128-row tiles' time in the layer (docs/perf.md, session 50).
  {
    const int64_t e128_experts = 128, e128_tiles = 3, e128_rows = e128_experts * e128_tiles * 128;
    const int64_t n = 7168, k = 2048;
    const double flop = 2.0 * e128_rows * n * k;
    Fp8GemmProblem problem(e128_rows, n, k, e128_experts);
    fill_constant_operands(problem, e128_tiles);
    ASSERT_FALSE(HasFatalFailure());
    const RandomRowTileOperands operands = upload_random_operands(problem, 91);
    ASSERT_FALSE(HasFatalFailure());
    const std::string label = "fp8 grouped GEMM, dsv3_e128 down (" + std::to_string(e128_rows) +
                              " x " + std::to_string(n) + " x " + std::to_string(k) + ")";
    print((label + ", random codes").c_str(), median_ms([&] { return problem.run(); }), flop);
    print((label + ", random codes, sustained").c_str(),
          sustained_ms([&] { return problem.run(); }), flop);
    expect_row_tile_samples(problem, operands, e128_tiles, "dsv3_e128 down");
    time_rows_192(problem, label, 300);
  }

  // The weight gradients: out[e] = A_e^T-rows x B_e over the expert's rows, at dsv3_local's
  // 1,024 rows per expert (8 K-blocks a tile) and dsv3_e128's 256 (2 K-blocks: the epilogue and
  // the 3.8 GB of bf16 written weigh most there).
  struct WeightGrad {
    const char* name;
    int64_t experts, expert_rows;
  };
  const int64_t m = 2048, n = 7168;
  for (const WeightGrad& shape :
       {WeightGrad{"dsv3_local", 32, 1024}, WeightGrad{"dsv3_e128", 128, 256}}) {
    const int64_t total_rows = shape.experts * shape.expert_rows, k_blocks = total_rows / 128;
    const double flop = 2.0 * total_rows * m * n;
    Fp8WeightGradProblem wgrad(total_rows, m, n, shape.experts);
    ASSERT_EQ(cudaMemset(wgrad.a_codes, 0x38, m * total_rows), cudaSuccess);
    ASSERT_EQ(cudaMemset(wgrad.b_codes, 0x30, n * total_rows), cudaSuccess);
    upload(wgrad.a_scales, std::vector<float>(m * k_blocks, 1.0f));
    upload(wgrad.b_scales, std::vector<float>(n * k_blocks, 1.0f));
    std::vector<int32_t> offsets(shape.experts + 1);
    for (int64_t e = 0; e <= shape.experts; ++e)
      offsets[e] = static_cast<int32_t>(e * shape.expert_rows);
    upload(wgrad.offsets, offsets);
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_EQ(cudaMemset(wgrad.out, 0xff, shape.experts * m * n * 2), cudaSuccess);
    const std::string label = std::string("fp8 weight gradient, ") + shape.name + " (" +
                              std::to_string(shape.experts) + " experts x [" + std::to_string(m) +
                              " x " + std::to_string(n) + "], " +
                              std::to_string(shape.expert_rows) + " rows each)";
    const double written = 2.0 * shape.experts * m * n;
    auto bytes_note = [&](double ms) {
      char note[64];
      std::snprintf(note, sizeof(note), ", %.2f TB/s of bf16 written", written / ms / 1e9);
      return std::string(note);
    };
    Timed t = median_ms([&] { return wgrad.run(); });
    print((label + ", constant codes").c_str(), t, flop, bytes_note(t.ms).c_str());
    expect_all_equal(wgrad.out, shape.experts * m * n, 0.5f * static_cast<float>(shape.expert_rows),
                     "weight gradient");

    const std::vector<uint8_t> a = random_codes(m * total_rows, 81);
    const std::vector<uint8_t> b = random_codes(n * total_rows, 82);
    const std::vector<float> a_scales = random_scales(m * k_blocks, 83);
    const std::vector<float> b_scales = random_scales(n * k_blocks, 84);
    upload(wgrad.a_codes, a);
    upload(wgrad.b_codes, b);
    upload(wgrad.a_scales, a_scales);
    upload(wgrad.b_scales, b_scales);
    ASSERT_FALSE(HasFatalFailure());
    t = median_ms([&] { return wgrad.run(); });
    print((label + ", random codes").c_str(), t, flop, bytes_note(t.ms).c_str());
    t = sustained_ms([&] { return wgrad.run(); });
    print((label + ", random codes, sustained").c_str(), t, flop, bytes_note(t.ms).c_str());
    SplitMix64 pick(85);
    for (int sample = 0; sample < 64; ++sample) {
      const int64_t e = pick.below(shape.experts), i = pick.below(m), j = pick.below(n);
      SampledSum want;
      for (int64_t kb = e * shape.expert_rows / 128; kb < (e + 1) * shape.expert_rows / 128; ++kb)
        want.add_block(&a[i * total_rows + kb * 128], &b[j * total_rows + kb * 128],
                       static_cast<double>(a_scales[kb * m + i]) * b_scales[kb * n + j]);
      expect_near_sum(wgrad.out, (e * m + i) * n + j, want, "weight gradient");
    }
  }
}

}  // namespace
}  // namespace mok
