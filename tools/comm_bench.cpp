// `mok comm-bench`: the expert-parallel data movement alone on the GPUs of this machine, one
// process. For one routing of a shape (T tokens per rank, H hidden), every rank's schedule is
// built, then each variant moves the same rows, all ranks at once, and the table gives time and
// the bytes that cross NVLink per GPU and direction (rows whose source and destination ranks
// differ), median of 20:
//   pull dispatch    launch_pull_rows / launch_pull_rows_bulk with C communication CTAs (one row
//                    per (token, rank)): warp copies, and the bulk-copy engine
//   push combine     launch_push_rows / _bulk of the expert rows into the source ranks' slots,
//                    + the wait for every rank
//   copy ceiling     a contiguous 16-byte copy through the same peer pointers, same bytes
//   NCCL all-to-all  grouped ncclSend / ncclRecv of the same per-peer byte counts
#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"
#include "mok/routing.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#if MOK_HAS_NCCL
#include <nccl.h>

#include "kernels/launchers.h"
#include "mok/comm.h"
#endif

namespace mok::cli {

#if MOK_HAS_NCCL

namespace {

struct BenchRank {
  int device = 0;
  cudaStream_t stream = nullptr;
  ScheduleLayout layout;
  void* schedule = nullptr;
  void* received = nullptr;  // [R*T, H]
  void* rows = nullptr;      // [max_rows, H] expert rows (push source)
  void* copy_target = nullptr;
  unsigned long long* counters = nullptr;  // [0] push epoch, [1] push done
  int64_t remote_rows_in = 0;              // rows pulled from other ranks
  int64_t remote_rows_out = 0;             // rows pushed to other ranks
  std::vector<int64_t> rows_from;          // per source rank
};

void check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess)
    throw mok::Error(mok::ErrorCode::kCudaError, what + ": " + cudaGetErrorString(status));
}

}  // namespace

int run_comm_bench(const RunOptions& options, const mok::MoeShape& shape) {
  const int32_t R = shape.num_ranks;
  const int64_t T = shape.num_tokens, H = shape.hidden, K = shape.top_k;
  std::vector<int> devices;
  for (int32_t rank = 0; rank < R; ++rank) devices.push_back(rank);
  auto communicators = mok::Communicator::create_all(devices);
  std::vector<mok::Communicator*> group;
  for (auto& communicator : communicators) group.push_back(communicator.get());
  const std::vector<int32_t> routing = mok::generate_routing(
      mok::routing_kind_from_name(options.routing), R, static_cast<int32_t>(T), shape.top_k,
      static_cast<int32_t>(shape.num_experts), options.seed);
  mok::SymmetricMemory x(group, T * H * 2, "x");
  mok::SymmetricMemory slots(group, T * K * H * 2, "slots");
  mok::SymmetricMemory flags(group, R * 8, "push flags", true);
  std::vector<BenchRank> ranks(static_cast<size_t>(R));
  for (int32_t rank = 0; rank < R; ++rank) {
    BenchRank& bench = ranks[rank];
    bench.device = devices[rank];
    check(cudaSetDevice(bench.device), "cudaSetDevice");
    check(cudaStreamCreate(&bench.stream), "stream");
    ScheduleParams params;
    params.num_ranks = R;
    params.tokens_per_rank = static_cast<int32_t>(T);
    params.top_k = shape.top_k;
    params.num_experts = static_cast<int32_t>(shape.num_experts);
    params.local_rank = rank;
    bench.layout = ScheduleLayout::make(params);
    std::vector<char> host(bench.layout.output_bytes);
    build_schedule_host(bench.layout, routing.data(), DType::kInt32, host.data());
    const ScheduleView view = ScheduleView::at(host.data(), bench.layout);
    bench.rows_from.assign(R, 0);
    for (int32_t source = 0; source < R; ++source)
      bench.rows_from[source] = view.recv_offsets[source + 1] - view.recv_offsets[source];
    for (int32_t source = 0; source < R; ++source)
      if (source != rank) bench.remote_rows_in += bench.rows_from[source];
    for (int32_t row = 0; row < view.header->total_rows; ++row)
      if (view.row_pair[row] >= 0 && view.row_pair[row] / (T * K) != rank) ++bench.remote_rows_out;
    check(cudaMalloc(&bench.schedule, bench.layout.total_bytes), "schedule");
    check(cudaMemcpy(bench.schedule, host.data(), host.size(), cudaMemcpyHostToDevice), "schedule");
    check(cudaMalloc(&bench.received, std::max<int64_t>(R * T * H * 2, 16)), "received");
    check(cudaMalloc(&bench.rows, std::max<int64_t>(params.max_rows() * H * 2, 16)), "rows");
    check(cudaMemset(bench.rows, 0, std::max<int64_t>(params.max_rows() * H * 2, 16)), "rows");
    check(cudaMalloc(&bench.copy_target, std::max<int64_t>(R * T * H * 2, 16)), "copy target");
    check(cudaMalloc(&bench.counters, 16), "counters");
    check(cudaMemset(bench.counters, 0, 16), "counters");
  }
  auto synchronize = [&] {
    for (BenchRank& bench : ranks) {
      check(cudaSetDevice(bench.device), "cudaSetDevice");
      check(cudaStreamSynchronize(bench.stream), "synchronize");
    }
  };
  // Median over 20 of the slowest rank's time: every rank's start event, then every rank's
  // launches, then every rank's stop event.
  auto median_ms = [&](const std::function<void(int32_t)>& launch_rank) {
    std::vector<cudaEvent_t> start(R), stop(R);
    for (int32_t rank = 0; rank < R; ++rank) {
      check(cudaSetDevice(ranks[rank].device), "cudaSetDevice");
      check(cudaEventCreate(&start[rank]), "event");
      check(cudaEventCreate(&stop[rank]), "event");
    }
    std::vector<float> times;
    for (int iteration = 0; iteration < 23; ++iteration) {
      for (int32_t rank = 0; rank < R; ++rank) {
        check(cudaSetDevice(ranks[rank].device), "cudaSetDevice");
        check(cudaEventRecord(start[rank], ranks[rank].stream), "event");
      }
      for (int32_t rank = 0; rank < R; ++rank) {
        check(cudaSetDevice(ranks[rank].device), "cudaSetDevice");
        launch_rank(rank);
      }
      for (int32_t rank = 0; rank < R; ++rank) {
        check(cudaSetDevice(ranks[rank].device), "cudaSetDevice");
        check(cudaEventRecord(stop[rank], ranks[rank].stream), "event");
      }
      synchronize();
      float slowest = 0;
      for (int32_t rank = 0; rank < R; ++rank) {
        float ms = 0;
        check(cudaEventElapsedTime(&ms, start[rank], stop[rank]), "elapsed");
        slowest = std::max(slowest, ms);
      }
      if (iteration >= 3) times.push_back(slowest);
    }
    for (int32_t rank = 0; rank < R; ++rank) {
      cudaEventDestroy(start[rank]);
      cudaEventDestroy(stop[rank]);
    }
    std::sort(times.begin(), times.end());
    return static_cast<double>(times[times.size() / 2]);
  };
  int64_t max_in = 0, max_out = 0;
  for (const BenchRank& bench : ranks) {
    max_in = std::max(max_in, bench.remote_rows_in);
    max_out = std::max(max_out, bench.remote_rows_out);
  }
  const double bytes_in = static_cast<double>(max_in) * H * 2;
  const double bytes_out = static_cast<double>(max_out) * H * 2;
  std::printf("mok comm-bench: %d GPUs, T=%lld H=%lld K=%lld E=%lld, routing %s\n", R,
              static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(K),
              static_cast<long long>(shape.num_experts), options.routing.c_str());
  std::printf("  NVLink rows per GPU (the busiest): %lld pulled in, %lld pushed out\n",
              static_cast<long long>(max_in), static_cast<long long>(max_out));
  std::printf("  %-34s %8s %10s %12s\n", "variant", "CTAs", "us", "GB/s per GPU");
  auto report = [&](const char* name, int ctas, double ms, double bytes) {
    std::printf("  %-34s %8d %10.1f %12.1f\n", name, ctas, ms * 1e3, bytes / ms / 1e6);
  };
  for (int ctas : {4, 8, 16, 24, 32, 64}) {
    const double pull_ms = median_ms([&](int32_t rank) {
      BenchRank& bench = ranks[rank];
      const ScheduleView view = ScheduleView::at(bench.schedule, bench.layout);
      kernels::PullRowsArgs pull;
      pull.header = view.header;
      pull.recv_offsets = view.recv_offsets;
      pull.recv_tokens = view.recv_tokens;
      pull.source_peers = x.device_peers(rank);
      pull.vectors_per_row = H / 8;
      pull.num_ranks = R;
      pull.received = bench.received;
      check(kernels::launch_pull_rows(pull, ctas, bench.stream), "pull");
    });
    report("pull dispatch (warp copies)", ctas, pull_ms, bytes_in);
    const double pull_bulk_ms = median_ms([&](int32_t rank) {
      BenchRank& bench = ranks[rank];
      const ScheduleView view = ScheduleView::at(bench.schedule, bench.layout);
      kernels::PullRowsArgs pull;
      pull.header = view.header;
      pull.recv_offsets = view.recv_offsets;
      pull.recv_tokens = view.recv_tokens;
      pull.source_peers = x.device_peers(rank);
      pull.vectors_per_row = H / 8;
      pull.num_ranks = R;
      pull.received = bench.received;
      check(kernels::launch_pull_rows_bulk(
                pull, kernels::WaitContext{20'000'000'000ull, rank, nullptr}, ctas, bench.stream),
            "pull (bulk)");
    });
    report("pull dispatch (bulk copies)", ctas, pull_bulk_ms, bytes_in);
    for (const bool bulk_push : {false, true}) {
      const double push_ms = median_ms([&](int32_t rank) {
        BenchRank& bench = ranks[rank];
        const ScheduleView view = ScheduleView::at(bench.schedule, bench.layout);
        kernels::PushRowsArgs push;
        push.header = view.header;
        push.row_pair = view.row_pair;
        push.rows = bench.rows;
        push.vectors_per_row = H / 8;
        push.pairs_per_rank = static_cast<int32_t>(T * K);
        push.slot_peers = slots.device_peers(rank);
        push.flag_peers = reinterpret_cast<uint64_t* const*>(flags.device_peers(rank));
        push.rank = rank;
        push.num_ranks = R;
        push.done = bench.counters + 1;
        push.epoch = bench.counters;
        check(bulk_push ? kernels::launch_push_rows_bulk(
                              push, kernels::WaitContext{20'000'000'000ull, rank, nullptr}, ctas,
                              bench.stream)
                        : kernels::launch_push_rows(push, ctas, bench.stream),
              "push");
        check(kernels::launch_wait_for_peers(
                  static_cast<const uint64_t*>(flags.local(rank)), R, bench.counters,
                  kernels::WaitContext{20'000'000'000ull, rank, nullptr}, bench.stream),
              "wait");
        check(kernels::launch_advance_epoch(bench.counters, bench.stream), "epoch");
      });
      report(
          bulk_push ? "push combine, bulk copies (+ wait)" : "push combine, warp copies (+ wait)",
          ctas, push_ms, bytes_out);
    }
    const double copy_ms = median_ms([&](int32_t rank) {
      BenchRank& bench = ranks[rank];
      const int32_t peer = (rank + 1) % R;
      check(
          kernels::launch_copy_contiguous(x.peer(rank, peer), bench.copy_target,
                                          std::min<int64_t>(max_in, T) * H * 2, ctas, bench.stream),
          "copy");
    });
    report("copy ceiling (contiguous, pull)", ctas, copy_ms,
           static_cast<double>(std::min<int64_t>(max_in, T)) * H * 2);
  }
  const double nccl_ms = median_ms([&](int32_t rank) {
    if (rank != 0) return;  // one group call launches every rank
    ncclGroupStart();
    for (int32_t r = 0; r < R; ++r) {
      check(cudaSetDevice(ranks[r].device), "cudaSetDevice");
      ncclComm_t comm = static_cast<ncclComm_t>(group[r]->nccl_handle());
      for (int32_t peer = 0; peer < R; ++peer) {
        if (peer == r) continue;
        const size_t to_peer = static_cast<size_t>(ranks[peer].rows_from[r] * H);
        const size_t from_peer = static_cast<size_t>(ranks[r].rows_from[peer] * H);
        if (to_peer > 0)
          ncclSend(static_cast<const char*>(x.local(r)), to_peer, ncclBfloat16, peer, comm,
                   ranks[r].stream);
        if (from_peer > 0)
          ncclRecv(ranks[r].received, from_peer, ncclBfloat16, peer, comm, ranks[r].stream);
      }
    }
    ncclGroupEnd();
    check(cudaSetDevice(ranks[0].device), "cudaSetDevice");
  });
  report("NCCL all-to-all (send/recv)", 0, nccl_ms, bytes_in);
  for (BenchRank& bench : ranks) {
    cudaSetDevice(bench.device);
    for (void* pointer : {bench.schedule, bench.received, bench.rows, bench.copy_target,
                          static_cast<void*>(bench.counters)})
      cudaFree(pointer);
    cudaStreamDestroy(bench.stream);
  }
  return 0;
}

#else

int run_comm_bench(const RunOptions&, const mok::MoeShape&) {
  throw mok::Error(mok::ErrorCode::kUnsupported,
                   "comm-bench: this mok was built without NCCL (set MOK_NCCL_HOME and rebuild)");
}

#endif

}  // namespace mok::cli
