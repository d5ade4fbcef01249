// The communication layer on every GPU of the machine, one process driving all of them
// (Communicator::create_all; a group of 1 on a one-GPU machine): symmetric memory whose peer
// stores land, unicast-flag signals with epochs across repeated rounds, the routing all-gather
// followed by each rank's schedule build (bit-identical to the host builder on the gathered
// routing), and a rank that never arrives ending in a diagnosed timeout (needs 2 GPUs).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#if MOK_HAS_NCCL
#include "kernels/launchers.h"
#include "kernels/peer_barrier.cuh"
#include "mok/comm.h"
#include "mok/routing.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "wait_report.h"
#endif

namespace mok {
namespace {

#if MOK_HAS_NCCL

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

std::vector<int> all_devices() {
  std::vector<int> devices;
  for (int device = 0; device < device_count(); ++device) devices.push_back(device);
  return devices;
}

std::vector<Communicator*> raw(const std::vector<std::unique_ptr<Communicator>>& group) {
  std::vector<Communicator*> pointers;
  for (const auto& communicator : group) pointers.push_back(communicator.get());
  return pointers;
}

constexpr int kWordsPerPair = 256;

// CTA p writes this rank's words for rank p into p's buffer (block `rank`), signals p, and
// waits for p's signal; afterwards this rank's buffer holds every rank's words.
__global__ void peer_store_kernel(int32_t* const* data_peers, uint64_t* const* flag_peers,
                                  int32_t rank, uint64_t epoch, kernels::WaitContext wait) {
  const int32_t peer = static_cast<int32_t>(blockIdx.x);
  int32_t* block = data_peers[peer] + rank * kWordsPerPair;
  for (int i = threadIdx.x; i < kWordsPerPair; i += blockDim.x)
    block[i] = static_cast<int32_t>(epoch) * 1000000 + rank * 1000 + peer * 10 + i % 7;
  __syncthreads();
  if (threadIdx.x == 0) {
    kernels::signal_peer(flag_peers[peer], rank, epoch);
    kernels::wait_for_peer(wait, flag_peers[rank], peer, epoch);
  }
}

TEST(CommGpu, PeerStoresLandAndSignalsCarryEpochs) {
  const std::vector<int> devices = all_devices();
  ASSERT_GE(devices.size(), 1u);
  auto group = Communicator::create_all(devices);
  const int32_t num_ranks = static_cast<int32_t>(group.size());
  SymmetricMemory data(raw(group), int64_t{4} * kWordsPerPair * num_ranks, "test data");
  SymmetricMemory flags(raw(group), int64_t{8} * num_ranks, "test flags", /*zero_fill=*/true);
  const kernels::WaitContext wait{10'000'000'000ull, 0, nullptr};
  for (uint64_t epoch = 1; epoch <= 3; ++epoch) {
    for (int32_t rank = 0; rank < num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
      peer_store_kernel<<<num_ranks, 128>>>(
          reinterpret_cast<int32_t* const*>(data.device_peers(rank)),
          reinterpret_cast<uint64_t* const*>(flags.device_peers(rank)), rank, epoch,
          kernels::WaitContext{wait.timeout_ns, rank, nullptr});
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    }
    for (int32_t rank = 0; rank < num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "rank " << rank << ", epoch " << epoch;
      std::vector<int32_t> got(static_cast<size_t>(kWordsPerPair) * num_ranks);
      ASSERT_EQ(cudaMemcpy(got.data(), data.local(rank), got.size() * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (int32_t source = 0; source < num_ranks; ++source)
        for (int i = 0; i < kWordsPerPair; ++i)
          ASSERT_EQ(got[source * kWordsPerPair + i],
                    static_cast<int32_t>(epoch) * 1000000 + source * 1000 + rank * 10 + i % 7)
              << "rank " << rank << " from rank " << source << ", word " << i << ", epoch "
              << epoch;
    }
  }
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
}

TEST(CommGpu, RoutingAllGatherThenScheduleOnEveryRank) {
  const std::vector<int> devices = all_devices();
  auto group = Communicator::create_all(devices);
  const int32_t num_ranks = static_cast<int32_t>(group.size());
  constexpr int32_t kTokens = 333, kTopK = 4;
  const int32_t num_experts = 8 * num_ranks;
  const int64_t bytes_per_rank = int64_t{4} * kTokens * kTopK;
  SymmetricMemory routing_all(raw(group), bytes_per_rank * num_ranks, "routing_all");
  SymmetricMemory flags(raw(group), int64_t{8} * num_ranks, "exchange flags", true);

  struct RankState {
    int32_t* top_experts = nullptr;
    unsigned long long* epoch = nullptr;
    void* schedule = nullptr;
    ScheduleLayout layout;
  };
  std::vector<RankState> ranks(static_cast<size_t>(num_ranks));
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
    RankState& state = ranks[rank];
    ScheduleParams params;
    params.num_ranks = num_ranks;
    params.tokens_per_rank = kTokens;
    params.top_k = kTopK;
    params.num_experts = num_experts;
    params.local_rank = rank;
    state.layout = ScheduleLayout::make(params);
    ASSERT_EQ(cudaMalloc(&state.top_experts, bytes_per_rank), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.epoch, 8), cudaSuccess);
    ASSERT_EQ(cudaMemset(state.epoch, 0, 8), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.schedule, state.layout.total_bytes), cudaSuccess);
  }
  for (RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kOneRank, RoutingKind::kHoles}) {
    SCOPED_TRACE(routing_kind_name(routing));
    const std::vector<int32_t> all =
        generate_routing(routing, num_ranks, kTokens, kTopK, num_experts, 17);
    for (int32_t rank = 0; rank < num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(ranks[rank].top_experts, all.data() + int64_t{rank} * kTokens * kTopK,
                           bytes_per_rank, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    for (int32_t rank = 0; rank < num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
      kernels::RoutingExchangeArgs args;
      args.top_experts = ranks[rank].top_experts;
      args.bytes_per_rank = bytes_per_rank;
      args.routing_peers = routing_all.device_peers(rank);
      args.flag_peers = reinterpret_cast<uint64_t* const*>(flags.device_peers(rank));
      args.rank = rank;
      args.num_ranks = num_ranks;
      args.epoch = ranks[rank].epoch;
      args.wait = kernels::WaitContext{10'000'000'000ull, rank, nullptr};
      ASSERT_EQ(kernels::launch_routing_exchange(args, nullptr), cudaSuccess);
      ASSERT_EQ(kernels::launch_advance_epoch(ranks[rank].epoch, nullptr), cudaSuccess);
      ASSERT_TRUE(launch_build_schedule(ranks[rank].layout, routing_all.local(rank), DType::kInt32,
                                        ranks[rank].schedule, nullptr)
                      .ok());
    }
    for (int32_t rank = 0; rank < num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "rank " << rank;
      std::vector<int32_t> gathered(all.size());
      ASSERT_EQ(cudaMemcpy(gathered.data(), routing_all.local(rank), gathered.size() * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(gathered, all) << "rank " << rank << "'s routing_all";
      std::vector<char> want(ranks[rank].layout.output_bytes), got(want.size());
      build_schedule_host(ranks[rank].layout, all.data(), DType::kInt32, want.data());
      ASSERT_EQ(cudaMemcpy(got.data(), ranks[rank].schedule, got.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      const Status same = compare_schedules(ranks[rank].layout, want.data(), got.data());
      EXPECT_TRUE(same.ok()) << "rank " << rank << ": " << same.message;
    }
  }
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    cudaSetDevice(devices[rank]);
    cudaFree(ranks[rank].top_experts);
    cudaFree(ranks[rank].epoch);
    cudaFree(ranks[rank].schedule);
  }
}

// Child process: a group of 2 where only rank 0 runs the exchange; rank 0's wait for rank 1 must
// end in the diagnosis (block 1 = the missing peer) within the timeout. Exits 3 on success.
void run_exchange_without_rank_1() {
  auto group = Communicator::create_all({0, 1});
  SymmetricMemory routing_all(raw(group), 4096, "routing_all");
  SymmetricMemory flags(raw(group), 16, "exchange flags", true);
  cudaSetDevice(0);
  kernels::WaitDiagnosis* record = nullptr;
  kernels::WaitDiagnosis* record_device = nullptr;
  int32_t* top_experts = nullptr;
  unsigned long long* epoch = nullptr;
  if (cudaHostAlloc(reinterpret_cast<void**>(&record), sizeof(*record), cudaHostAllocMapped) !=
          cudaSuccess ||
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&record_device), record, 0) !=
          cudaSuccess ||
      cudaMalloc(&top_experts, 2048) != cudaSuccess || cudaMalloc(&epoch, 8) != cudaSuccess ||
      cudaMemset(epoch, 0, 8) != cudaSuccess || cudaMemset(top_experts, 0, 2048) != cudaSuccess)
    std::exit(10);
  *record = kernels::WaitDiagnosis{};
  kernels::RoutingExchangeArgs args;
  args.top_experts = top_experts;
  args.bytes_per_rank = 2048;
  args.routing_peers = routing_all.device_peers(0);
  args.flag_peers = reinterpret_cast<uint64_t* const*>(flags.device_peers(0));
  args.rank = 0;
  args.num_ranks = 2;
  args.epoch = epoch;
  args.wait = kernels::WaitContext{300'000'000ull, 0, record_device};
  const auto start = std::chrono::steady_clock::now();
  if (kernels::launch_routing_exchange(args, nullptr) != cudaSuccess) std::exit(11);
  const cudaError_t status = cudaDeviceSynchronize();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (status == cudaSuccess || record->timed_out != 1 || seconds > 30) std::exit(12);
  std::fprintf(stderr, "%s\n", describe_wait_diagnosis(*record).c_str());
  std::_Exit(3);  // the context is gone: skip destructors that would call into it
}

TEST(CommGpu, MissingRankEndsInDiagnosis) {
  if (device_count() < 2) GTEST_SKIP() << "needs 2 GPUs; this machine has " << device_count();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_exchange_without_rank_1(), ::testing::ExitedWithCode(3),
              "device wait timed out after 0\\.[0-9]+ s: rank 0, SM [0-9]+, block 1, thread 0, "
              "a signal from another GPU");
}

#else

TEST(CommGpu, NotBuilt) { GTEST_SKIP() << "mok was built without NCCL (set MOK_NCCL_HOME)"; }

#endif

}  // namespace
}  // namespace mok
