// The GPU schedule builder (src/kernels/schedule.cu) against the host builder: every output
// array must be equal bit for bit, on random and adversarial routings, int32 and int64 ids, bad
// ids, with the device buffer poisoned before each build. Also: rebuilding over an old schedule
// (no reset pass), replaying a captured CUDA graph with new routing contents, argument errors,
// and the build time at the default shapes (written to $MOK_RESULTS_DIR/schedule_timing.json).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "device_memory.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "mok/testing/routing.h"

namespace mok {
namespace {

constexpr int kPoisonByte = 0xAB;

using test::DeviceMemory;

struct Shape {
  int32_t ranks, tokens, top_k, local_experts, local_rank, row_align;
};

ScheduleParams to_params(const Shape& s) {
  ScheduleParams params;
  params.num_ranks = s.ranks;
  params.tokens_per_rank = s.tokens;
  params.top_k = s.top_k;
  params.num_experts = s.ranks * s.local_experts;
  params.local_rank = s.local_rank;
  params.row_align = s.row_align;
  return params;
}

std::string describe(const ScheduleParams& p) {
  return "R=" + std::to_string(p.num_ranks) + " T=" + std::to_string(p.tokens_per_rank) +
         " K=" + std::to_string(p.top_k) + " E=" + std::to_string(p.num_experts) +
         " local_rank=" + std::to_string(p.local_rank) +
         " row_align=" + std::to_string(p.row_align);
}

// Expert ids of either width, kept as int64 on the host and narrowed when uploaded as int32.
struct Routing {
  std::vector<int64_t> ids;
  DType dtype = DType::kInt32;

  std::vector<uint8_t> bytes() const {
    const size_t width = static_cast<size_t>(dtype_size(dtype));
    std::vector<uint8_t> out(ids.size() * width);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (dtype == DType::kInt64) {
        std::memcpy(out.data() + i * width, &ids[i], width);
      } else {
        const int32_t narrow = static_cast<int32_t>(ids[i]);
        std::memcpy(out.data() + i * width, &narrow, width);
      }
    }
    return out;
  }
};

Routing make_routing(RoutingKind kind, const ScheduleParams& p, uint64_t seed, DType dtype) {
  const std::vector<int32_t> ids =
      generate_routing(kind, p.num_ranks, p.tokens_per_rank, p.top_k, p.num_experts, seed);
  return Routing{std::vector<int64_t>(ids.begin(), ids.end()), dtype};
}

std::vector<uint8_t> build_on_host(const ScheduleLayout& layout, const Routing& routing) {
  std::vector<uint8_t> out(static_cast<size_t>(layout.output_bytes), 0xCD);
  const std::vector<uint8_t> ids = routing.bytes();
  build_schedule_host(layout, ids.data(), routing.dtype, out.data());
  return out;
}

void upload(const Routing& routing, DeviceMemory& device_ids) {
  const std::vector<uint8_t> ids = routing.bytes();
  if (ids.size() > device_ids.bytes()) throw std::runtime_error("routing buffer too small");
  if (!ids.empty())
    CUDA_CHECK(cudaMemcpy(device_ids.get(), ids.data(), ids.size(), cudaMemcpyHostToDevice));
  // A copy from pageable memory may still be in flight, and non-blocking streams do not wait
  // for the legacy stream.
  CUDA_CHECK(cudaDeviceSynchronize());
}

std::vector<uint8_t> download(const ScheduleLayout& layout, const DeviceMemory& buffer) {
  std::vector<uint8_t> out(static_cast<size_t>(layout.output_bytes));
  CUDA_CHECK(cudaMemcpy(out.data(), buffer.get(), out.size(), cudaMemcpyDeviceToHost));
  return out;
}

// Compares the arrays the contract specifies, naming the first differing element.
::testing::AssertionResult same_schedule(const ScheduleLayout& layout,
                                         const std::vector<uint8_t>& want,
                                         const std::vector<uint8_t>& got) {
  const ScheduleParams& p = layout.params;
  const ScheduleView w = ScheduleView::at(const_cast<uint8_t*>(want.data()), layout);
  const ScheduleView g = ScheduleView::at(const_cast<uint8_t*>(got.data()), layout);
  const ScheduleHeader& header = *w.header;
  struct Array {
    const char* name;
    const int32_t* want;
    const int32_t* got;
    int64_t count;
  };
  const int64_t local_experts = p.num_local_experts();
  const Array arrays[] = {
      {"header", reinterpret_cast<const int32_t*>(w.header),
       reinterpret_cast<const int32_t*>(g.header),
       static_cast<int64_t>(sizeof(ScheduleHeader) / sizeof(int32_t))},
      {"expert_counts", w.expert_counts, g.expert_counts, local_experts},
      {"expert_source_counts", w.expert_source_counts, g.expert_source_counts,
       local_experts * p.num_ranks},
      {"expert_offsets", w.expert_offsets, g.expert_offsets, local_experts + 1},
      {"tile_expert", w.tile_expert, g.tile_expert, header.num_tiles},
      {"row_pair", w.row_pair, g.row_pair, header.total_rows},
      {"row_recv", w.row_recv, g.row_recv, header.total_rows},
      {"pair_row", w.pair_row, g.pair_row, p.num_pairs()},
      {"recv_offsets", w.recv_offsets, g.recv_offsets, p.num_ranks + 1},
      {"recv_tokens", w.recv_tokens, g.recv_tokens, header.total_recv},
  };
  for (const Array& array : arrays)
    for (int64_t i = 0; i < array.count; ++i)
      if (array.want[i] != array.got[i]) {
        int64_t differing = 0;
        for (int64_t j = i; j < array.count; ++j) differing += array.want[j] != array.got[j];
        return ::testing::AssertionFailure()
               << describe(p) << ": " << array.name << "[" << i << "] is " << array.got[i]
               << " on the GPU, " << array.want[i] << " on the host (" << differing << " of "
               << array.count << " elements differ)";
      }
  return ::testing::AssertionSuccess();
}

// One device schedule buffer and routing buffer of a fixed shape.
struct DeviceSchedule {
  ScheduleLayout layout;
  DeviceMemory ids;
  DeviceMemory buffer;

  explicit DeviceSchedule(const ScheduleParams& params)
      : layout(ScheduleLayout::make(params)),
        ids(static_cast<size_t>(params.num_pairs()) * sizeof(int64_t)),
        buffer(static_cast<size_t>(layout.total_bytes)) {}

  // Fills the whole buffer, scratch included, and waits (builds may run on another stream).
  void poison() {
    CUDA_CHECK(cudaMemset(buffer.get(), kPoisonByte, buffer.bytes()));
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Uploads the routing, builds on `stream`, waits, and returns the output bytes.
  std::vector<uint8_t> build(const Routing& routing, cudaStream_t stream = nullptr) {
    upload(routing, ids);
    const Status status =
        launch_build_schedule(layout, ids.get(), routing.dtype, buffer.get(), stream);
    if (!status.ok()) throw std::runtime_error("launch_build_schedule: " + status.message);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaGetLastError());
    return download(layout, buffer);
  }
};

const Shape kShapes[] = {
    {1, 0, 2, 8, 0, 128},                                  // no tokens
    {3, 0, 4, 4, 2, 64},                                   // no tokens, several ranks
    {1, 1, 1, 1, 0, 128},                                  // one token, one expert
    {2, 63, 2, 8, 1, 64},                                  // T one short of a chunk
    {3, 65, 6, 4, 2, 128},                                 // T one past a chunk
    {4, 200, 8, 32, 3, 64},     {1, 4096, 8, 32, 0, 128},  // dsv3_local
    {8, 4096, 8, 32, 0, 128},                              // dsv3 at EP=8, rank 0
    {8, 4096, 8, 32, 5, 128},                              // dsv3 at EP=8, rank 5
    {16, 130, 32, 4, 7, 16},                               // K = 32: a full warp step per token
    {1, 3000, 4, 1, 0, 1024},                              // E_loc = 1, the largest tile
    {2, 1000, 8, 2048, 1, 128},                            // E_loc = 2048
    {1, 300, 4, 4000, 0, 128},  // counters too large for 4 warps per block in 48 KB
    {1, 100, 2, 13000, 0, 16},  // counters need the opt-in shared memory limit
};

TEST(ScheduleGpu, MatchesHostOnAllRoutingsAndShapes) {
  uint64_t seed = 1;
  for (const Shape& shape : kShapes) {
    const ScheduleParams params = to_params(shape);
    DeviceSchedule device(params);
    for (RoutingKind kind : all_routing_kinds())
      for (DType dtype : {DType::kInt32, DType::kInt64}) {
        SCOPED_TRACE(std::string(routing_kind_name(kind)) + " " + dtype_name(dtype) + " " +
                     describe(params));
        const Routing routing = make_routing(kind, params, ++seed, dtype);
        device.poison();
        ASSERT_TRUE(same_schedule(device.layout, build_on_host(device.layout, routing),
                                  device.build(routing)));
      }
  }
}

TEST(ScheduleGpu, BadIdsMatchHost) {
  const ScheduleParams params = to_params({4, 200, 6, 8, 1, 64});
  DeviceSchedule device(params);
  SplitMix64 rng(77);
  const int64_t num_pairs = params.num_pairs();
  const int64_t bad_values[] = {
      params.num_experts,     -2, -1000, int64_t{1} << 40, std::numeric_limits<int64_t>::min(),
      -(int64_t{1} << 33) - 3};
  for (int trial = 0; trial < 60; ++trial)
    for (DType dtype : {DType::kInt32, DType::kInt64}) {
      Routing routing = make_routing(RoutingKind::kHoles, params, 500 + trial, dtype);
      const int bad_count = 1 + static_cast<int>(rng.below(4));
      for (int i = 0; i < bad_count; ++i) {
        int64_t value = bad_values[rng.below(std::size(bad_values))];
        if (dtype == DType::kInt32 && static_cast<int32_t>(value) >= -1 &&
            static_cast<int32_t>(value) < params.num_experts)
          value = -7;  // narrowed, this one would be a valid id; keep it bad
        routing.ids[rng.below(static_cast<uint64_t>(num_pairs))] = value;
      }
      SCOPED_TRACE("trial " + std::to_string(trial) + " " + dtype_name(dtype));
      device.poison();
      const std::vector<uint8_t> want = build_on_host(device.layout, routing);
      const std::vector<uint8_t> got = device.build(routing);
      ASSERT_TRUE(same_schedule(device.layout, want, got));
      const ScheduleHeader* header = reinterpret_cast<const ScheduleHeader*>(got.data());
      EXPECT_EQ(header->status, static_cast<int32_t>(ScheduleStatus::kBadExpertId));
      EXPECT_FALSE(schedule_status(params, *header).ok());
    }
}

// The lowest bad pair wins even when a higher chunk, or a higher lane of the same step, holds
// another bad id: the reduction over chunks must not pick by chunk completion order.
TEST(ScheduleGpu, LowestBadPairAcrossChunksAndLanes) {
  const ScheduleParams params = to_params({2, 640, 4, 4, 0, 128});
  DeviceSchedule device(params);
  const int64_t positions[][2] = {{5000, 31}, {4000, 4003}, {2559, 2560}, {0, 5119}};
  for (const auto& pair : positions) {
    Routing routing = make_routing(RoutingKind::kUniform, params, 3, DType::kInt32);
    routing.ids[pair[0]] = -5;
    routing.ids[pair[1]] = params.num_experts + 1;
    device.poison();
    const std::vector<uint8_t> got = device.build(routing);
    ASSERT_TRUE(same_schedule(device.layout, build_on_host(device.layout, routing), got));
    const ScheduleHeader* header = reinterpret_cast<const ScheduleHeader*>(got.data());
    EXPECT_EQ(header->error_pair, std::min(pair[0], pair[1]));
  }
}

TEST(ScheduleGpu, RebuildOverAnOldScheduleNeedsNoReset) {
  for (const Shape& shape : {Shape{8, 4096, 8, 32, 0, 128}, Shape{3, 65, 6, 4, 2, 128}}) {
    const ScheduleParams params = to_params(shape);
    SCOPED_TRACE(describe(params));
    DeviceSchedule device(params);
    device.poison();
    uint64_t seed = 40;
    // Alternate a routing that fills the whole table with ones that use a part of it.
    for (RoutingKind kind : {RoutingKind::kOneExpert, RoutingKind::kUniform, RoutingKind::kOneRank,
                             RoutingKind::kNoRoutes, RoutingKind::kSkewed, RoutingKind::kOneExpert,
                             RoutingKind::kHoles}) {
      const Routing routing = make_routing(kind, params, ++seed, DType::kInt32);
      ASSERT_TRUE(same_schedule(device.layout, build_on_host(device.layout, routing),
                                device.build(routing)))
          << "after rebuilding with " << routing_kind_name(kind);
    }
  }
}

TEST(ScheduleGpu, GraphReplayWithNewRoutingContents) {
  for (const Shape& shape : {Shape{8, 4096, 8, 32, 3, 128}, Shape{1, 100, 2, 13000, 0, 16}}) {
    const ScheduleParams params = to_params(shape);
    SCOPED_TRACE(describe(params));
    DeviceSchedule device(params);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const Status status = launch_build_schedule(device.layout, device.ids.get(), DType::kInt32,
                                                device.buffer.get(), stream);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(status.ok()) << status.message;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    uint64_t seed = 900;
    for (RoutingKind kind : {RoutingKind::kUniform, RoutingKind::kOneExpert, RoutingKind::kHoles,
                             RoutingKind::kEmptyRank, RoutingKind::kSkewed}) {
      Routing routing = make_routing(kind, params, ++seed, DType::kInt32);
      if (kind == RoutingKind::kHoles) routing.ids[routing.ids.size() / 2] = params.num_experts;
      upload(routing, device.ids);
      device.poison();
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      ASSERT_TRUE(same_schedule(device.layout, build_on_host(device.layout, routing),
                                download(device.layout, device.buffer)))
          << "graph replay with " << routing_kind_name(kind);
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

TEST(ScheduleGpu, RejectsBadArgumentsBeforeLaunching) {
  const ScheduleParams params = to_params({2, 64, 2, 4, 0, 128});
  DeviceSchedule device(params);
  device.poison();
  auto expect_invalid = [&](const Status& status, const char* names) {
    EXPECT_EQ(status.code, ErrorCode::kInvalidArgument) << status.message;
    EXPECT_NE(status.message.find(names), std::string::npos)
        << "message '" << status.message << "' does not name '" << names << "'";
  };
  expect_invalid(launch_build_schedule(device.layout, device.ids.get(), DType::kFloat32,
                                       device.buffer.get(), nullptr),
                 "expert_dtype");
  expect_invalid(
      launch_build_schedule(device.layout, device.ids.get(), DType::kInt32, nullptr, nullptr),
      "buffer");
  expect_invalid(
      launch_build_schedule(device.layout, nullptr, DType::kInt32, device.buffer.get(), nullptr),
      "top_experts_all");
  expect_invalid(launch_build_schedule(device.layout, static_cast<char*>(device.ids.get()) + 4,
                                       DType::kInt64, device.buffer.get(), nullptr),
                 "top_experts_all");
  ScheduleLayout shifted = device.layout;
  shifted.row_pair += 256;
  expect_invalid(
      launch_build_schedule(shifted, device.ids.get(), DType::kInt32, device.buffer.get(), nullptr),
      "row_pair");
  ScheduleLayout bad_params = device.layout;
  bad_params.params.row_align = 100;
  expect_invalid(launch_build_schedule(bad_params, device.ids.get(), DType::kInt32,
                                       device.buffer.get(), nullptr),
                 "row_align = 100");
  // Nothing was launched: the buffer still holds the poison.
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> bytes = download(device.layout, device.buffer);
  EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == kPoisonByte; }));
}

// Build time at the default shapes: median of 100 timed launches, each bracketed by events, both
// as plain stream launches and as replays of a captured graph (no CPU launch gaps).
float median_us(std::vector<float> times_ms) {
  std::sort(times_ms.begin(), times_ms.end());
  return 1000.0f * times_ms[times_ms.size() / 2];
}

TEST(ScheduleGpu, Timing) {
  constexpr int kWarmup = 20, kRuns = 100;
  const Shape shapes[] = {{8, 4096, 8, 32, 0, 128}, {1, 4096, 8, 32, 0, 128}};
  std::string json = "{\n  \"schedule_build\": [";
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const test::TimingEvents events;
  for (size_t s = 0; s < std::size(shapes); ++s) {
    const ScheduleParams params = to_params(shapes[s]);
    DeviceSchedule device(params);
    const Routing routing = make_routing(RoutingKind::kUniform, params, 2024, DType::kInt32);
    upload(routing, device.ids);
    auto launch = [&] {
      const Status status = launch_build_schedule(device.layout, device.ids.get(), DType::kInt32,
                                                  device.buffer.get(), stream);
      if (!status.ok()) throw std::runtime_error(status.message);
    };
    for (int i = 0; i < kWarmup; ++i) launch();
    std::vector<float> stream_ms, graph_ms;
    for (int i = 0; i < kRuns; ++i) {
      CUDA_CHECK(cudaEventRecord(events.start, stream));
      launch();
      CUDA_CHECK(cudaEventRecord(events.stop, stream));
      CUDA_CHECK(cudaEventSynchronize(events.stop));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, events.start, events.stop));
      stream_ms.push_back(ms);
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    launch();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < kWarmup; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
    for (int i = 0; i < kRuns; ++i) {
      CUDA_CHECK(cudaEventRecord(events.start, stream));
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaEventRecord(events.stop, stream));
      CUDA_CHECK(cudaEventSynchronize(events.stop));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, events.start, events.stop));
      graph_ms.push_back(ms);
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    ASSERT_TRUE(same_schedule(device.layout, build_on_host(device.layout, routing),
                              download(device.layout, device.buffer)));

    const float stream_us = median_us(stream_ms), graph_us = median_us(graph_ms);
    std::printf(
        "schedule build %s (uniform routing): median %.1f us per stream launch, %.1f us "
        "per graph replay (%d runs)\n",
        describe(params).c_str(), stream_us, graph_us, kRuns);
    char entry[512];
    std::snprintf(entry, sizeof(entry),
                  "%s\n    {\"R\": %d, \"T\": %d, \"K\": %d, \"E\": %d, \"local_rank\": %d, "
                  "\"routing\": \"uniform\", \"runs\": %d, \"stream_median_us\": %.2f, "
                  "\"graph_median_us\": %.2f}",
                  s == 0 ? "" : ",", params.num_ranks, params.tokens_per_rank, params.top_k,
                  params.num_experts, params.local_rank, kRuns, stream_us, graph_us);
    json += entry;
  }
  json += "\n  ]\n}\n";
  CUDA_CHECK(cudaStreamDestroy(stream));
  if (const char* dir = std::getenv("MOK_RESULTS_DIR"); dir != nullptr && *dir != '\0') {
    const std::string path = std::string(dir) + "/schedule_timing.json";
    std::ofstream file(path);
    file << json;
    EXPECT_TRUE(file.good()) << "could not write " << path;
    std::printf("wrote %s\n", path.c_str());
  }
}

}  // namespace
}  // namespace mok
