// The communication layer on every GPU of the machine, one process driving all of them
// (Communicator::create_all; a group of 1 on a one-GPU machine): symmetric memory whose peer
// stores land, unicast-flag signals with epochs across repeated rounds, the routing all-gather
// followed by each rank's schedule build (bit-identical to the host builder on the gathered
// routing), and a rank that never arrives ending in a diagnosed timeout (needs 2 GPUs).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#if MOK_HAS_NCCL
#include "kernels/comm/launch.h"
#include "kernels/comm/peer_barrier.cuh"
#include "kernels/stages/launch.h"
#include "mok/bootstrap.h"
#include "mok/comm.h"
#include "mok/dtype.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "mok/testing/routing.h"
#include "rank_process.h"
#include "test_util.h"
#include "wait_record.h"
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
  for (uint64_t epoch = 1; epoch <= 3; ++epoch) {
    for (int32_t rank = 0; rank < num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
      peer_store_kernel<<<num_ranks, 128>>>(
          reinterpret_cast<int32_t* const*>(data.device_peers(rank)),
          reinterpret_cast<uint64_t* const*>(flags.device_peers(rank)), rank, epoch,
          test::test_wait_context(rank));
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
    const ScheduleParams params =
        schedule_params(test::make_shape(kTokens, 64, 64, num_experts, kTopK, num_ranks), rank);
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
      args.wait = test::test_wait_context(rank);
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

// The data path of the unfused multi-GPU layer with an identity expert (y = x), with the warp-copy
// and the bulk-copy pull / push kernels: routing
// all-gather, schedule, pull dispatch of x (one NVLink crossing per (token, rank)), expansion
// into the expert-grouped rows, push of the rows into the source ranks' slots, the wait, and
// the fixed-order combine. Each rank's rows must hold the routed x rows of every rank, and each
// rank's output must equal, bit for bit, the host's fmaf sum of its routed slots in k order.
TEST(CommGpu, PullDispatchAndPushCombineAcrossRanks) {
  const std::vector<int> devices = all_devices();
  auto group = Communicator::create_all(devices);
  const int32_t num_ranks = static_cast<int32_t>(group.size());
  constexpr int32_t kTokens = 300, kTopK = 4, kHidden = 512;
  const int32_t num_experts = 8 * num_ranks;
  const int64_t pairs = int64_t{kTokens} * kTopK;
  SymmetricMemory routing_all(raw(group), 4 * pairs * num_ranks, "routing_all");
  SymmetricMemory exchange_flags(raw(group), int64_t{8} * num_ranks, "exchange flags", true);
  SymmetricMemory push_flags(raw(group), int64_t{8} * num_ranks, "push flags", true);
  SymmetricMemory x_sym(raw(group), int64_t{2} * kTokens * kHidden, "x");
  SymmetricMemory slots(raw(group), int64_t{2} * pairs * kHidden, "combine slots");

  struct RankState {
    ScheduleLayout layout;
    void* schedule = nullptr;
    int32_t* top_experts = nullptr;
    float* weights = nullptr;
    void* received = nullptr;
    void* rows = nullptr;
    int32_t* slot_index = nullptr;
    void* out = nullptr;
    unsigned long long* counters = nullptr;  // [0] exchange epoch, [1] push epoch, [2] push done
  };
  std::vector<RankState> ranks(static_cast<size_t>(num_ranks));
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
    RankState& state = ranks[rank];
    const ScheduleParams params = schedule_params(
        test::make_shape(kTokens, kHidden, 64, num_experts, kTopK, num_ranks), rank);
    state.layout = ScheduleLayout::make(params);
    const int64_t max_rows = params.max_rows();
    ASSERT_EQ(cudaMalloc(&state.schedule, state.layout.total_bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.top_experts, 4 * pairs), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.weights, 4 * pairs), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.received, int64_t{2} * num_ranks * kTokens * kHidden), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.rows, 2 * max_rows * kHidden), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.slot_index, 4 * pairs), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.out, int64_t{2} * kTokens * kHidden), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state.counters, 3 * 8), cudaSuccess);
    ASSERT_EQ(cudaMemset(state.counters, 0, 3 * 8), cudaSuccess);
  }
  SplitMix64 rng(5);
  for (const bool bulk : {false, true})
    for (RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kOneRank, RoutingKind::kHoles,
                                RoutingKind::kSkewed}) {
      SCOPED_TRACE(std::string(routing_kind_name(routing)) +
                   (bulk ? ", bulk-copy kernels" : ", warp-copy kernels"));
      const std::vector<int32_t> all =
          generate_routing(routing, num_ranks, kTokens, kTopK, num_experts, rng.next());
      std::vector<std::vector<bf16>> x(static_cast<size_t>(num_ranks));
      std::vector<std::vector<float>> weights(static_cast<size_t>(num_ranks));
      for (int32_t rank = 0; rank < num_ranks; ++rank) {
        for (int64_t i = 0; i < int64_t{kTokens} * kHidden; ++i)
          x[rank].push_back(float_to_bf16(static_cast<float>(rng.below(2001)) / 1000.0f - 1.0f));
        for (int64_t i = 0; i < pairs; ++i)
          weights[rank].push_back(static_cast<float>(rng.below(1000)) / 1000.0f);
      }
      for (int32_t rank = 0; rank < num_ranks; ++rank) {
        ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
        RankState& state = ranks[rank];
        ASSERT_EQ(cudaMemcpy(state.top_experts, all.data() + rank * pairs, 4 * pairs,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(
            cudaMemcpy(state.weights, weights[rank].data(), 4 * pairs, cudaMemcpyHostToDevice),
            cudaSuccess);
        ASSERT_EQ(cudaMemcpy(x_sym.local(rank), x[rank].data(), x[rank].size() * 2,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      // Every rank's sequence, launched on every GPU before any waits.
      for (int32_t rank = 0; rank < num_ranks; ++rank) {
        ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
        RankState& state = ranks[rank];
        const kernels::WaitContext wait = test::test_wait_context(rank);
        kernels::RoutingExchangeArgs exchange;
        exchange.top_experts = state.top_experts;
        exchange.bytes_per_rank = 4 * pairs;
        exchange.routing_peers = routing_all.device_peers(rank);
        exchange.flag_peers = reinterpret_cast<uint64_t* const*>(exchange_flags.device_peers(rank));
        exchange.rank = rank;
        exchange.num_ranks = num_ranks;
        exchange.epoch = state.counters;
        exchange.wait = wait;
        ASSERT_EQ(kernels::launch_routing_exchange(exchange, nullptr), cudaSuccess);
        ASSERT_EQ(kernels::launch_advance_epoch(state.counters, nullptr), cudaSuccess);
        ASSERT_TRUE(launch_build_schedule(state.layout, routing_all.local(rank), DType::kInt32,
                                          state.schedule, nullptr)
                        .ok());
        const ScheduleView view = ScheduleView::at(state.schedule, state.layout);
        const kernels::RowCopy copy = bulk ? kernels::RowCopy::kBulk : kernels::RowCopy::kWarp;
        const kernels::PullRowsArgs pull = kernels::pull_rows_args(
            view, x_sym.device_peers(rank), kHidden, rank, num_ranks, state.received);
        ASSERT_EQ(kernels::launch_pull_rows(pull, copy, 24, wait, nullptr), cudaSuccess);
        // Other ranks' rows from the pulled ones, this rank's own straight from its x.
        ASSERT_EQ(
            kernels::launch_expand_received(
                kernels::expand_received_args(view, state.received, x_sym.local(rank), kHidden,
                                              rank, state.rows, 0, state.layout.params.max_rows()),
                nullptr),
            cudaSuccess);
        const kernels::PushRowsArgs push = kernels::push_rows_args(
            view, state.rows, kHidden, static_cast<int32_t>(pairs), slots.device_peers(rank),
            reinterpret_cast<uint64_t* const*>(push_flags.device_peers(rank)), rank, num_ranks,
            state.counters + 1);
        ASSERT_EQ(kernels::launch_push_rows(push, copy, 24, wait, nullptr), cudaSuccess);
        ASSERT_EQ(
            kernels::launch_wait_for_peers(static_cast<const uint64_t*>(push_flags.local(rank)),
                                           num_ranks, state.counters + 1, wait, nullptr),
            cudaSuccess);
        ASSERT_EQ(kernels::launch_advance_epoch(state.counters + 1, nullptr), cudaSuccess);
        // This rank's own pairs stay in its expert rows (the push skips them).
        ASSERT_EQ(kernels::launch_slot_index(state.top_experts, DType::kInt32, pairs, num_experts,
                                             view.pair_row + static_cast<int64_t>(rank) * pairs,
                                             state.slot_index, nullptr),
                  cudaSuccess);
        ASSERT_EQ(
            kernels::launch_combine(slots.local(rank), state.slot_index, nullptr, state.weights,
                                    kTokens, kHidden, kTopK, state.out, nullptr, state.rows),
            cudaSuccess);
      }
      for (int32_t rank = 0; rank < num_ranks; ++rank) {
        ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "rank " << rank;
        const RankState& state = ranks[rank];
        // The expert-grouped rows: the routed x rows of every rank, zeros on padding.
        std::vector<char> schedule(state.layout.output_bytes);
        build_schedule_host(state.layout, all.data(), DType::kInt32, schedule.data());
        const ScheduleView view = ScheduleView::at(schedule.data(), state.layout);
        const int32_t total_rows = view.header->total_rows;
        std::vector<bf16> rows(static_cast<size_t>(total_rows) * kHidden);
        ASSERT_EQ(cudaMemcpy(rows.data(), state.rows, rows.size() * 2, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        for (int32_t row = 0; row < total_rows; ++row) {
          const int32_t pair = view.row_pair[row];
          for (int32_t c = 0; c < kHidden; ++c) {
            const float got = bf16_to_float(rows[static_cast<size_t>(row) * kHidden + c]);
            const PairCoord coord =
                pair < 0 ? PairCoord{0, 0, 0} : decode_pair(state.layout.params, pair);
            const float want =
                pair < 0 ? 0.0f
                         : bf16_to_float(
                               x[coord.src_rank][static_cast<size_t>(coord.token) * kHidden + c]);
            ASSERT_EQ(got, want) << "rank " << rank << ", row " << row << ", column " << c;
          }
        }
        // The combine: bf16(sum over routed k of fmaf(w, x[t], acc)), in k order.
        std::vector<bf16> out(static_cast<size_t>(kTokens) * kHidden);
        ASSERT_EQ(cudaMemcpy(out.data(), state.out, out.size() * 2, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        for (int32_t token = 0; token < kTokens; ++token)
          for (int32_t c = 0; c < kHidden; ++c) {
            float acc = 0.0f;
            for (int32_t k = 0; k < kTopK; ++k) {
              const int32_t expert = all[rank * pairs + token * kTopK + k];
              if (expert < 0 || expert >= num_experts) continue;
              acc =
                  std::fmaf(weights[rank][token * kTopK + k],
                            bf16_to_float(x[rank][static_cast<size_t>(token) * kHidden + c]), acc);
            }
            ASSERT_EQ(bf16_to_float(out[static_cast<size_t>(token) * kHidden + c]),
                      round_to_bf16(acc))
                << "rank " << rank << ", token " << token << ", column " << c;
          }
      }
    }
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    cudaSetDevice(devices[rank]);
    RankState& state = ranks[rank];
    for (void* pointer :
         {state.schedule, static_cast<void*>(state.top_experts), static_cast<void*>(state.weights),
          state.received, state.rows, static_cast<void*>(state.slot_index), state.out,
          static_cast<void*>(state.counters)})
      cudaFree(pointer);
  }
}

// One process per GPU (Communicator::create_rank from the bootstrap file): the parent test
// starts one copy of this binary per GPU, running DISABLED_RankProcess with its rank in the
// environment; each joins the group, allocates symmetric memory, stores into every rank and
// checks what every rank stored into it.
TEST(CommGpu, DISABLED_RankProcess) {
  const std::optional<test::RankEnvironment> environment = test::rank_environment();
  ASSERT_TRUE(environment.has_value()) << "run by CommGpu.OneProcessPerGpu only";
  const int32_t rank = environment->rank, num_ranks = environment->num_ranks;
  const UniqueId id = exchange_unique_id(environment->id_path, rank, num_ranks, 60.0);
  auto communicator = Communicator::create_rank(id, num_ranks, rank, rank);
  ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
  SymmetricMemory data({communicator.get()}, int64_t{4} * kWordsPerPair * num_ranks, "data");
  SymmetricMemory flags({communicator.get()}, int64_t{8} * num_ranks, "flags", true);
  for (uint64_t epoch = 1; epoch <= 2; ++epoch) {
    peer_store_kernel<<<num_ranks, 128>>>(reinterpret_cast<int32_t* const*>(data.device_peers(0)),
                                          reinterpret_cast<uint64_t* const*>(flags.device_peers(0)),
                                          rank, epoch,
                                          test::test_wait_context(rank, 20'000'000'000ull));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int32_t> got(static_cast<size_t>(kWordsPerPair) * num_ranks);
    ASSERT_EQ(cudaMemcpy(got.data(), data.local(0), got.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int32_t source = 0; source < num_ranks; ++source)
      for (int i = 0; i < kWordsPerPair; ++i)
        ASSERT_EQ(got[source * kWordsPerPair + i],
                  static_cast<int32_t>(epoch) * 1000000 + source * 1000 + rank * 10 + i % 7)
            << "rank " << rank << " from rank " << source << ", word " << i;
  }
}

// The push dispatch: every rank's send entries from the GPU equal the host's, and after every
// rank pushed its x rows (and waited for every rank), each rank's receive buffer holds x row
// recv_tokens[e] of the entry's source rank at every entry e of another rank in its receive
// list (where a pull would have put it), and nothing at its own entries. Two calls per routing,
// so the second runs on grown epochs.
TEST(CommGpu, PushDispatchLandsWhereThePullWould) {
  const std::vector<int> devices = all_devices();
  auto group = Communicator::create_all(devices);
  const int32_t num_ranks = static_cast<int32_t>(group.size());
  constexpr int32_t kTokens = 257, kTopK = 4, kHidden = 256;
  const int32_t num_experts = 4 * num_ranks;
  const MoeShape shape = test::make_shape(kTokens, kHidden, 64, num_experts, kTopK, num_ranks);
  SymmetricMemory received(raw(group), int64_t{2} * num_ranks * kTokens * kHidden, "received");
  SymmetricMemory flags(raw(group), int64_t{8} * num_ranks, "dispatch flags", true);
  struct RankState {
    int32_t* routing_all = nullptr;
    int32_t* send_entry = nullptr;
    void* x = nullptr;
    unsigned long long* counters = nullptr;  // [0] epoch, [1] done
  };
  std::vector<RankState> ranks(static_cast<size_t>(num_ranks));
  const int64_t all_pairs = int64_t{num_ranks} * kTokens * kTopK;
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&ranks[rank].routing_all, 4 * all_pairs), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&ranks[rank].send_entry, int64_t{4} * num_ranks * kTokens), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&ranks[rank].x, int64_t{2} * kTokens * kHidden), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&ranks[rank].counters, 16), cudaSuccess);
    ASSERT_EQ(cudaMemset(ranks[rank].counters, 0, 16), cudaSuccess);
  }
  SplitMix64 rng(23);
  for (RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kHoles, RoutingKind::kOneRank,
                              RoutingKind::kEmptyRank, RoutingKind::kSkewed})
    for (int call = 0; call < 2; ++call) {
      SCOPED_TRACE(std::string(routing_kind_name(routing)) + ", call " + std::to_string(call));
      const std::vector<int32_t> all =
          generate_routing(routing, num_ranks, kTokens, kTopK, num_experts, rng.next());
      std::vector<std::vector<bf16>> x(static_cast<size_t>(num_ranks));
      for (int32_t rank = 0; rank < num_ranks; ++rank) {
        for (int64_t i = 0; i < int64_t{kTokens} * kHidden; ++i)
          x[rank].push_back(float_to_bf16(static_cast<float>(rng.below(2001)) / 1000.0f - 1.0f));
        ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
        ASSERT_EQ(
            cudaMemcpy(ranks[rank].routing_all, all.data(), 4 * all_pairs, cudaMemcpyHostToDevice),
            cudaSuccess);
        ASSERT_EQ(
            cudaMemcpy(ranks[rank].x, x[rank].data(), x[rank].size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
        ASSERT_EQ(cudaMemset(received.local(rank), 0xFF, received.bytes()), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      for (int32_t rank = 0; rank < num_ranks; ++rank) {
        ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
        RankState& state = ranks[rank];
        ASSERT_EQ(kernels::launch_send_entries(schedule_params(shape, rank), state.routing_all,
                                               DType::kInt32, state.send_entry, nullptr),
                  cudaSuccess);
        kernels::PushDispatchArgs push;
        push.send_entry = state.send_entry;
        push.source = state.x;
        push.received_peers = received.device_peers(rank);
        push.vectors_per_row = kHidden / 8;
        push.num_tokens = kTokens;
        push.rank = rank;
        push.num_ranks = num_ranks;
        push.flag_peers = reinterpret_cast<uint64_t* const*>(flags.device_peers(rank));
        push.done = state.counters + 1;
        push.epoch = state.counters;
        ASSERT_EQ(kernels::launch_push_dispatch(push, 24, nullptr), cudaSuccess);
        ASSERT_EQ(kernels::launch_wait_for_peers(static_cast<const uint64_t*>(flags.local(rank)),
                                                 num_ranks, state.counters,
                                                 test::test_wait_context(rank), nullptr),
                  cudaSuccess);
        ASSERT_EQ(kernels::launch_advance_epoch(state.counters, nullptr), cudaSuccess);
      }
      for (int32_t rank = 0; rank < num_ranks; ++rank) {
        ASSERT_EQ(cudaSetDevice(devices[rank]), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "rank " << rank;
        const ScheduleParams params = schedule_params(shape, rank);
        std::vector<int32_t> want_entries(static_cast<size_t>(num_ranks) * kTokens);
        build_send_entries_host(params, all.data(), DType::kInt32, want_entries.data());
        std::vector<int32_t> got_entries(want_entries.size());
        ASSERT_EQ(cudaMemcpy(got_entries.data(), ranks[rank].send_entry, got_entries.size() * 4,
                             cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(got_entries, want_entries) << "rank " << rank << "'s send entries";
        const ScheduleLayout layout = ScheduleLayout::make(params);
        std::vector<char> schedule(layout.output_bytes);
        build_schedule_host(layout, all.data(), DType::kInt32, schedule.data());
        const ScheduleView view = ScheduleView::at(schedule.data(), layout);
        const int32_t total = view.header->total_recv;
        std::vector<uint16_t> got(static_cast<size_t>(total) * kHidden);
        ASSERT_EQ(
            cudaMemcpy(got.data(), received.local(rank), got.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
        // Another rank's entries hold its rows; this rank's own stay untouched (poisoned): the
        // expansion reads them from the local x.
        for (int32_t source = 0; source < num_ranks; ++source)
          for (int32_t entry = view.recv_offsets[source]; entry < view.recv_offsets[source + 1];
               ++entry)
            for (int32_t c = 0; c < kHidden; ++c)
              ASSERT_EQ(
                  got[static_cast<size_t>(entry) * kHidden + c],
                  source == rank
                      ? uint16_t{0xFFFF}
                      : x[source][static_cast<size_t>(view.recv_tokens[entry]) * kHidden + c].bits)
                  << "rank " << rank << " entry " << entry << " (source " << source << ", token "
                  << view.recv_tokens[entry] << ") column " << c;
      }
    }
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    RankState& state = ranks[rank];
    cudaSetDevice(devices[rank]);
    cudaFree(state.routing_all);
    cudaFree(state.send_entry);
    cudaFree(state.x);
    cudaFree(state.counters);
  }
}

TEST(CommGpu, OneProcessPerGpu) {
  test::run_rank_processes("CommGpu.DISABLED_RankProcess", device_count(), 180);
}

// One process driving every GPU, in a fresh process with CUDA's lazy kernel loading: no kernel
// of the group has been launched before, so each first launch would load it. Without the
// communicator's preload (kernel_preload.h) the host thread's launch on rank 0 waits for rank
// 0's spinning exchange kernel, which waits for rank 1's launch: the spin times out (seen on
// 2 x H200). Each test runs in its own fresh process.
TEST(CommGpu, FreshProcessWithLazyLoadingNeverDeadlocks) {
  if (device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (one GPU has no peer to wait for)";
  for (const char* test_name : {"CommGpu.RoutingAllGatherThenScheduleOnEveryRank",
                                "CommGpu.PullDispatchAndPushCombineAcrossRanks"}) {
    const pid_t pid = test::spawn_self(test_name, {"CUDA_MODULE_LOADING=LAZY"});
    ASSERT_GT(pid, 0) << "posix_spawn failed";
    const int status = test::wait_for_children({pid}, 120)[0];
    EXPECT_EQ(status, 0) << test_name << " in a fresh process"
                         << (status == -1 ? " did not finish in 120 s" : " failed");
  }
}

// Child process: a group of 2 where only rank 0 runs the exchange; rank 0's wait for rank 1 must
// end in the diagnosis (block 1 = the missing peer) within the timeout. Exits 3 on success.
void run_exchange_without_rank_1() {
  auto group = Communicator::create_all({0, 1});
  SymmetricMemory routing_all(raw(group), 4096, "routing_all");
  SymmetricMemory flags(raw(group), 16, "exchange flags", true);
  cudaSetDevice(0);
  const test::WaitRecord record;
  int32_t* top_experts = nullptr;
  unsigned long long* epoch = nullptr;
  if (cudaMalloc(&top_experts, 2048) != cudaSuccess || cudaMalloc(&epoch, 8) != cudaSuccess ||
      cudaMemset(epoch, 0, 8) != cudaSuccess || cudaMemset(top_experts, 0, 2048) != cudaSuccess)
    std::exit(10);
  kernels::RoutingExchangeArgs args;
  args.top_experts = top_experts;
  args.bytes_per_rank = 2048;
  args.routing_peers = routing_all.device_peers(0);
  args.flag_peers = reinterpret_cast<uint64_t* const*>(flags.device_peers(0));
  args.rank = 0;
  args.num_ranks = 2;
  args.epoch = epoch;
  args.wait = record.context(300'000'000ull, 0);
  const auto start = std::chrono::steady_clock::now();
  if (kernels::launch_routing_exchange(args, nullptr) != cudaSuccess) std::exit(11);
  const cudaError_t status = cudaDeviceSynchronize();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (status == cudaSuccess || !record.timed_out() || seconds > 30) std::exit(12);
  std::fprintf(stderr, "%s\n", record.report().c_str());
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
