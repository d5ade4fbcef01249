// The FP8 block-scaled grouped GEMM's (src/kernels/gemm/fp8_gemm.cu) TFLOP/s: at the dsv3_local
// gate/up GEMM, free-running and kept in step, and at the layer's other FP8 GEMMs of that shape
// and of dsv3_e128, on constant and on random operands, per call and sustained, with the default
// walk, in groups of one expert's tiles and in 192-row tiles (static, counted, by ticket), each
// with the SM clock it ran at (printed; issue 17's bar is 1,100 for the FP8 GEMMs). Each timed
// form's output is checked too: constant operands give K / 2 everywhere, random ones match
// sampled sums in double. test_fp8_gemm_gpu.cu checks the forms' bits against the host.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <vector>

#include "device_memory.h"
#include "fp8_gemm_problem.h"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/lockstep.h"
#include "kernels/stages/launch.h"
#include "mok/fp8.h"
#include "mok/sm_clock.h"
#include "test_util.h"

namespace mok {
namespace {

using test::Fp8GemmProblem;
using test::Fp8WeightGradProblem;
using test::rows_192_maps;

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
  const test::TimingEvents events;
  SmClockWindow window;
  std::vector<float> times;
  std::vector<double> clocks;
  for (int i = 0; i < 12; ++i) {
    window.open(nullptr);
    cudaEventRecord(events.start);
    EXPECT_EQ(launch(), cudaSuccess);
    cudaEventRecord(events.stop);
    window.close(nullptr);
    EXPECT_EQ(cudaEventSynchronize(events.stop), cudaSuccess);
    float ms = 0;
    cudaEventElapsedTime(&ms, events.start, events.stop);
    if (i >= 2) {
      times.push_back(ms);
      clocks.push_back(window.ghz());
    }
  }
  std::sort(times.begin(), times.end());
  std::sort(clocks.begin(), clocks.end());
  return {times[times.size() / 2], clocks[clocks.size() / 2]};
}

// Calls queued back to back, one synchronization at the end, as a training loop runs them: the
// mean milliseconds of 20 after 2 warm-ups, and the clock over the 20.
template <typename Launch>
Timed sustained_ms(Launch launch) {
  const test::TimingEvents events;
  SmClockWindow window;
  for (int i = 0; i < 2; ++i) EXPECT_EQ(launch(), cudaSuccess);
  constexpr int kCalls = 20;
  window.open(nullptr);
  cudaEventRecord(events.start);
  for (int i = 0; i < kCalls; ++i) EXPECT_EQ(launch(), cudaSuccess);
  cudaEventRecord(events.stop);
  window.close(nullptr);
  EXPECT_EQ(cudaEventSynchronize(events.stop), cudaSuccess);
  float ms = 0;
  cudaEventElapsedTime(&ms, events.start, events.stop);
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
// tiles' to the bit (the problem's output on entry), each launch by its own epoch's tickets. With
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
  int32_t* counts = problem.device.allocate<int32_t>(problem.experts * 4);
  if (routed_rows > 0) {
    ASSERT_LE(routed_rows, expert_rows);
    upload(counts, std::vector<int32_t>(problem.experts, routed_rows));
  }
  auto run = [&] { return problem.run(); };
  for (const bool counted : {false, true}) {
    if (counted && routed_rows == 0) break;
    problem.params.expert_counts = counted ? counts : nullptr;
    for (const bool by_ticket : {false, true}) {
      problem.params.tile_tickets = by_ticket ? problem.tickets : kernels::GemmTickets{};
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
      if (by_ticket) {
        SCOPED_TRACE(label + walk);
        problem.expect_ticket_epochs();
      }
    }
  }
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
  unsigned long long* counters = problem.device.allocate<unsigned long long>(
      (kernels::kLockstepTicks + 2) * sizeof(unsigned long long));
  ASSERT_EQ(cudaMemset(counters, 0, (kernels::kLockstepTicks + 2) * sizeof(unsigned long long)),
            cudaSuccess);
  const test::TimingEvents events;
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
      cudaEventRecord(events.start);
      ASSERT_EQ(problem.run(), cudaSuccess);
      cudaEventRecord(events.stop);
      if (lead > 0)
        ASSERT_EQ(kernels::launch_advance_epoch(problem.params.lockstep.epoch, nullptr),
                  cudaSuccess);
      ASSERT_EQ(cudaEventSynchronize(events.stop), cudaSuccess);
      float ms = 0;
      cudaEventElapsedTime(&ms, events.start, events.stop);
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
    // Two staging tiles in four stages (Fp8GemmParams::weight_grad_staging_tiles): a tile's
    // staging waits for the store two tiles back; the same bits (checked below).
    wgrad.params.weight_grad_staging_tiles = 2;
    t = median_ms([&] { return wgrad.run(); });
    print((label + ", random codes, two staging tiles").c_str(), t, flop, bytes_note(t.ms).c_str());
    t = sustained_ms([&] { return wgrad.run(); });
    print((label + ", random codes, two staging tiles, sustained").c_str(), t, flop,
          bytes_note(t.ms).c_str());
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
