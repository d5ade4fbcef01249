// The local gathers (kernels/stages/dispatch_local.cu): the by-token walk the layer runs and the
// by-row walk the baseline runs write the same bytes, and both write what the schedule says: row
// r of the window holds x[row_pair[r] / top_k], zeros for a padding row, and rows past the
// schedule's end keep what was there. Every routing kind (holes: slots not routed; one expert:
// every slot on one expert), windows of a macrobatch ring, a hidden size that is not a multiple
// of the walks' 256 vectors. Also times both walks at `qwen3` and `sonic_e128` (printed).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "device_memory.h"
#include "kernels/stages/launch.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "mok/testing/routing.h"

namespace mok {
namespace {

using test::DeviceMemory;

constexpr int kPoisonByte = 0x5A;

// A schedule built on the GPU from a generated routing, x of random bits, and the host's copy
// of the schedule's arrays.
struct GatherProblem {
  ScheduleLayout layout;
  int32_t tokens, top_k;
  int64_t hidden;
  DeviceMemory ids, schedule, x;
  std::vector<uint8_t> host_schedule;
  std::vector<uint16_t> host_x;

  GatherProblem(RoutingKind kind, int32_t tokens_in, int32_t top_k_in, int32_t experts,
                int64_t hidden_in, uint64_t seed, bool keep_host_x = true)
      : layout(ScheduleLayout::make(params(tokens_in, top_k_in, experts))),
        tokens(tokens_in),
        top_k(top_k_in),
        hidden(hidden_in),
        ids(static_cast<size_t>(tokens_in) * top_k_in * sizeof(int32_t)),
        schedule(static_cast<size_t>(layout.total_bytes)),
        x(static_cast<size_t>(tokens_in) * hidden_in * 2) {
    const std::vector<int32_t> routing = generate_routing(kind, 1, tokens, top_k, experts, seed);
    if (!routing.empty())
      CUDA_CHECK(cudaMemcpy(ids.get(), routing.data(), routing.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice));
    const Status status =
        launch_build_schedule(layout, ids.get(), DType::kInt32, schedule.get(), nullptr);
    if (!status.ok()) throw std::runtime_error("launch_build_schedule: " + status.message);
    host_x.resize(static_cast<size_t>(tokens) * hidden);
    SplitMix64 random(seed * 7919 + 1);
    for (uint16_t& value : host_x) value = static_cast<uint16_t>(random.next());
    if (!host_x.empty())
      CUDA_CHECK(cudaMemcpy(x.get(), host_x.data(), host_x.size() * 2, cudaMemcpyHostToDevice));
    if (!keep_host_x) host_x = {};
    host_schedule.resize(static_cast<size_t>(layout.output_bytes));
    CUDA_CHECK(cudaMemcpy(host_schedule.data(), schedule.get(), host_schedule.size(),
                          cudaMemcpyDeviceToHost));
  }

  static ScheduleParams params(int32_t tokens, int32_t top_k, int32_t experts) {
    ScheduleParams p;
    p.num_ranks = 1;
    p.tokens_per_rank = tokens;
    p.top_k = top_k;
    p.num_experts = experts;
    p.local_rank = 0;
    p.row_align = 128;
    return p;
  }

  ScheduleView device_view() const { return ScheduleView::at(schedule.get(), layout); }
  ScheduleView host_view() { return ScheduleView::at(host_schedule.data(), layout); }
};

enum class Walk { kByRow, kByToken };

cudaError_t gather(const GatherProblem& problem, Walk walk, void* rows, int64_t window_rows,
                   int64_t row_begin, cudaStream_t stream = nullptr) {
  const ScheduleView view = problem.device_view();
  if (walk == Walk::kByRow)
    return kernels::launch_gather_rows(view.header, view.row_pair, problem.x.get(), problem.hidden,
                                       problem.top_k, rows, window_rows, stream, row_begin);
  return kernels::launch_gather_rows_by_token(view.header, view.row_pair, view.pair_row,
                                              problem.x.get(), problem.tokens, problem.hidden,
                                              problem.top_k, rows, window_rows, stream, row_begin);
}

// The window's rows after one walk, over a poisoned buffer.
std::vector<uint16_t> gathered(const GatherProblem& problem, Walk walk, int64_t window_rows,
                               int64_t row_begin) {
  const size_t elements = static_cast<size_t>(window_rows) * problem.hidden;
  DeviceMemory rows(elements * 2);
  if (elements > 0) CUDA_CHECK(cudaMemset(rows.get(), kPoisonByte, elements * 2));
  CUDA_CHECK(gather(problem, walk, rows.get(), window_rows, row_begin));
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(elements);
  if (elements > 0)
    CUDA_CHECK(cudaMemcpy(out.data(), rows.get(), elements * 2, cudaMemcpyDeviceToHost));
  return out;
}

// What the schedule says the window holds.
std::vector<uint16_t> expected(GatherProblem& problem, int64_t window_rows, int64_t row_begin) {
  const ScheduleView view = problem.host_view();
  const int64_t H = problem.hidden;
  uint16_t poison;
  std::memset(&poison, kPoisonByte, sizeof(poison));
  std::vector<uint16_t> out(static_cast<size_t>(window_rows) * H, poison);
  const int64_t end = std::min<int64_t>(view.header->total_rows, row_begin + window_rows);
  for (int64_t row = row_begin; row < end; ++row) {
    uint16_t* dst = out.data() + (row - row_begin) * H;
    const int32_t pair = view.row_pair[row];
    if (pair < 0)
      std::fill(dst, dst + H, uint16_t{0});
    else
      std::copy_n(problem.host_x.data() + static_cast<int64_t>(pair / problem.top_k) * H, H, dst);
  }
  return out;
}

// The first differing element, named, or success.
::testing::AssertionResult same_rows(const std::vector<uint16_t>& got,
                                     const std::vector<uint16_t>& want, int64_t hidden) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return ::testing::AssertionFailure()
             << "row " << i / hidden << " column " << i % hidden << ": 0x" << std::hex << got[i]
             << ", expected 0x" << want[i];
  return ::testing::AssertionSuccess();
}

TEST(GatherGpu, BothWalksWriteWhatTheScheduleSays) {
  struct Case {
    int32_t tokens, top_k, experts;
    int64_t hidden;
  };
  const Case cases[] = {
      {300, 8, 16, 1024}, {257, 4, 8, 2056}, {1, 1, 4, 64}, {0, 2, 4, 128}, {513, 32, 64, 512}};
  uint64_t seed = 11;
  for (const Case& c : cases)
    for (RoutingKind kind : all_routing_kinds()) {
      if (kind == RoutingKind::kOneRank || kind == RoutingKind::kEmptyRank) continue;
      SCOPED_TRACE(std::string(routing_kind_name(kind)) + " T=" + std::to_string(c.tokens) +
                   " K=" + std::to_string(c.top_k) + " H=" + std::to_string(c.hidden));
      GatherProblem problem(kind, c.tokens, c.top_k, c.experts, c.hidden, ++seed);
      const int64_t max_rows = problem.layout.params.max_rows();
      // The whole schedule, then windows of a ring that do not divide it.
      const std::vector<std::pair<int64_t, int64_t>> windows = {
          {max_rows, 0}, {384, 0}, {384, 384}, {384, 768}, {256, max_rows - 128}};
      for (const auto& [window_rows, row_begin] : windows) {
        if (row_begin < 0 || window_rows <= 0) continue;
        SCOPED_TRACE("window of " + std::to_string(window_rows) + " rows at " +
                     std::to_string(row_begin));
        const std::vector<uint16_t> want = expected(problem, window_rows, row_begin);
        EXPECT_TRUE(
            same_rows(gathered(problem, Walk::kByToken, window_rows, row_begin), want, c.hidden));
        EXPECT_TRUE(
            same_rows(gathered(problem, Walk::kByRow, window_rows, row_begin), want, c.hidden));
      }
    }
}

TEST(GatherGpu, ByTokenRefusesWhatItCannotWalk) {
  GatherProblem problem(RoutingKind::kUniform, 16, 2, 4, 64, 3);
  const ScheduleView view = problem.device_view();
  DeviceMemory rows(1 << 20);
  EXPECT_EQ(
      kernels::launch_gather_rows_by_token(view.header, view.row_pair, view.pair_row,
                                           problem.x.get(), 16, 64, 33, rows.get(), 128, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      kernels::launch_gather_rows_by_token(view.header, view.row_pair, view.pair_row,
                                           problem.x.get(), 16, 60, 2, rows.get(), 128, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(kernels::launch_gather_rows_by_token(view.header, view.row_pair, view.pair_row,
                                                 problem.x.get(), 16, 64, 2, rows.get(), 128,
                                                 nullptr, -1),
            cudaErrorInvalidValue);
}

// Both walks at the layer's shapes, each timed as the median of 9 launches after a warm-up, the
// two checked equal on the device's bytes. A record, not a bound: printed for docs/perf.md.
TEST(GatherGpu, WalksTimedAtTheLayersShapes) {
  struct Shape {
    const char* name;
    int32_t tokens, top_k, experts;
    int64_t hidden;
  };
  for (const Shape& shape :
       {Shape{"qwen3", 8192, 8, 128, 2048}, Shape{"sonic_e128", 32768, 8, 128, 4096}}) {
    SCOPED_TRACE(shape.name);
    GatherProblem problem(RoutingKind::kUniform, shape.tokens, shape.top_k, shape.experts,
                          shape.hidden, 5, /*keep_host_x=*/false);
    const int64_t max_rows = problem.layout.params.max_rows();
    const size_t bytes = static_cast<size_t>(max_rows) * shape.hidden * 2;
    DeviceMemory by_row(bytes), by_token(bytes);
    CUDA_CHECK(cudaMemset(by_row.get(), kPoisonByte, bytes));
    CUDA_CHECK(cudaMemset(by_token.get(), kPoisonByte, bytes));
    const test::TimingEvents events;
    const int32_t total_rows = problem.host_view().header->total_rows;
    for (Walk walk : {Walk::kByRow, Walk::kByToken}) {
      void* rows = walk == Walk::kByRow ? by_row.get() : by_token.get();
      CUDA_CHECK(gather(problem, walk, rows, max_rows, 0));
      std::vector<float> times;
      for (int launch = 0; launch < 9; ++launch) {
        CUDA_CHECK(cudaEventRecord(events.start));
        CUDA_CHECK(gather(problem, walk, rows, max_rows, 0));
        CUDA_CHECK(cudaEventRecord(events.stop));
        CUDA_CHECK(cudaEventSynchronize(events.stop));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, events.start, events.stop));
        times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      const double written = static_cast<double>(total_rows) * shape.hidden * 2;
      std::printf("[ gather ] %s %s: %.1f us (%.0f GB/s of rows written)\n", shape.name,
                  walk == Walk::kByRow ? "by row  " : "by token", times[4] * 1e3,
                  written / (times[4] * 1e-3) / 1e9);
    }
    std::vector<uint8_t> a(bytes), b(bytes);
    CUDA_CHECK(cudaMemcpy(a.data(), by_row.get(), bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), by_token.get(), bytes, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(a == b) << "the two walks wrote different bytes";
  }
}

}  // namespace
}  // namespace mok
