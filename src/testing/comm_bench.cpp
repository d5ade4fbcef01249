// The communication benchmark behind `mok comm-bench` (mok/testing/comm_bench.h): the
// expert-parallel data movement alone on the GPUs of this machine, one
// process. For one routing of a shape (T tokens per rank, H hidden), every rank's schedule is
// built, then each variant moves the same rows, all ranks at once, and the table gives time and
// the bytes that cross NVLink per GPU and direction (rows whose source and destination ranks
// differ), median of 20:
//   pull dispatch    launch_pull_rows with C communication CTAs (one row per (token, rank)),
//                    with warp copies and with the bulk-copy engine
//   push dispatch    launch_push_dispatch: the source writes the same rows into the
//                    destinations' (symmetric) receive buffers at their receive-list entries
//                    (launch_send_entries, timed once), + the wait for every rank; checked to
//                    leave the same bytes as the pull
//   push combine     launch_push_rows of the expert rows into the source ranks' slots (both
//                    copy ways), + the wait for every rank
//   copy ceilings    a contiguous 16-byte copy through the same peer pointers, same bytes:
//                    pull (read from the peer) and push (write to the peer)
//   NCCL all-to-all  grouped ncclSend / ncclRecv of the same per-peer byte counts
//   exchange + schedule  the routing and router-weight all-gather, then this rank's schedule
//                    build: what the layer runs before its dispatch (its share of the forward
//                    at `dsv3` is one of the targets)
#include "mok/testing/comm_bench.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "layer/cuda_buffer.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "mok/testing/routing.h"
#if MOK_HAS_NCCL
#include <nccl.h>

#include "kernels/comm/launch.h"
#include "kernels/stages/launch.h"
#include "mok/comm.h"
#endif

namespace mok {

// A failed CUDA call ends the benchmark with an error naming it.
#define BENCH_CUDA_CHECK(call) cuda_check((call), #call)

#if MOK_HAS_NCCL

namespace {

struct BenchRank {
  int device = 0;
  cudaStream_t stream = nullptr;
  ScheduleLayout layout;
  mok::DeviceBuffer schedule;
  mok::DeviceBuffer received;      // [R*T, H]
  mok::DeviceBuffer rows;          // [max_rows, H] expert rows (push source)
  mok::DeviceBuffer copy_target;   // [R*T, H]
  mok::DeviceBuffer counters;      // [0] push epoch, [1] push done, [2] exchange epoch,
                                   // [3] dispatch epoch, [4] dispatch done
  mok::DeviceBuffer routing_all;   // [R, T, K] every rank's routing (for the send entries)
  mok::DeviceBuffer send_entry;    // [R, T] this rank's send entries
  int64_t remote_rows_sent = 0;    // rows a push dispatch sends to other ranks
  mok::DeviceBuffer top_experts;   // this rank's [T, K] routing
  mok::DeviceBuffer weights;       // this rank's [T, K] router weights
  mok::DeviceBuffer built;         // the schedule the timed build writes
  int64_t remote_rows_in = 0;      // rows pulled from other ranks
  int64_t remote_rows_out = 0;     // rows pushed to other ranks
  std::vector<int64_t> rows_from;  // per source rank
};

}  // namespace

int run_comm_bench(const MoeShape& shape, RoutingKind routing_kind, uint64_t seed) {
  const int32_t R = shape.num_ranks;
  const int64_t T = shape.num_tokens, H = shape.hidden, K = shape.top_k;
  std::vector<int> devices;
  for (int32_t rank = 0; rank < R; ++rank) devices.push_back(rank);
  auto communicators = mok::Communicator::create_all(devices);
  std::vector<mok::Communicator*> group;
  for (auto& communicator : communicators) group.push_back(communicator.get());
  const std::vector<int32_t> routing =
      mok::generate_routing(routing_kind, R, static_cast<int32_t>(T), shape.top_k,
                            static_cast<int32_t>(shape.num_experts), seed);
  mok::SymmetricMemory x(group, T * H * 2, "x");
  mok::SymmetricMemory slots(group, T * K * H * 2, "slots");
  mok::SymmetricMemory flags(group, R * 8, "push flags", true);
  mok::SymmetricMemory routing_all(group, R * T * K * 4, "routing of every rank");
  mok::SymmetricMemory weights_all(group, R * T * K * 4, "router weights of every rank");
  mok::SymmetricMemory exchange_flags(group, R * 8, "exchange flags", true);
  mok::SymmetricMemory received_sym(group, R * T * H * 2, "push-dispatch receive buffers");
  mok::SymmetricMemory dispatch_flags(group, R * 8, "dispatch flags", true);
  std::vector<BenchRank> ranks(static_cast<size_t>(R));
  for (int32_t rank = 0; rank < R; ++rank) {
    BenchRank& bench = ranks[rank];
    bench.device = devices[rank];
    BENCH_CUDA_CHECK(cudaSetDevice(bench.device));
    BENCH_CUDA_CHECK(cudaStreamCreate(&bench.stream));
    const ScheduleParams params = schedule_params(shape, rank);
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
    bench.schedule.allocate(bench.layout.total_bytes, "schedule");
    BENCH_CUDA_CHECK(
        cudaMemcpy(bench.schedule.pointer, host.data(), host.size(), cudaMemcpyHostToDevice));
    bench.received.allocate(R * T * H * 2, "pulled rows");
    bench.rows.allocate(params.max_rows() * H * 2, "expert rows");
    BENCH_CUDA_CHECK(cudaMemset(bench.rows.pointer, 0, bench.rows.bytes));
    bench.copy_target.allocate(R * T * H * 2, "copy target");
    bench.counters.allocate(40, "epochs and counters");
    BENCH_CUDA_CHECK(cudaMemset(bench.counters.pointer, 0, 40));
    std::vector<int32_t> send_host(static_cast<size_t>(R * T));
    build_send_entries_host(params, routing.data(), DType::kInt32, send_host.data());
    for (int64_t i = 0; i < R * T; ++i)
      if (send_host[i] >= 0 && i / T != rank) ++bench.remote_rows_sent;
    bench.routing_all.allocate(R * T * K * 4, "routing of every rank");
    BENCH_CUDA_CHECK(cudaMemcpy(bench.routing_all.pointer, routing.data(), R * T * K * 4,
                                cudaMemcpyHostToDevice));
    bench.send_entry.allocate(R * T * 4, "send entries");
    BENCH_CUDA_CHECK(kernels::launch_send_entries(params, bench.routing_all.pointer, DType::kInt32,
                                                  bench.send_entry.as<int32_t>(), nullptr));
    std::vector<int32_t> send_device(send_host.size());
    BENCH_CUDA_CHECK(cudaMemcpy(send_device.data(), bench.send_entry.pointer,
                                send_device.size() * 4, cudaMemcpyDeviceToHost));
    if (send_device != send_host)
      throw Error(ErrorCode::kInternal, "comm-bench: rank " + std::to_string(rank) +
                                            "'s send entries from the GPU differ from the host's");
    bench.top_experts.allocate(T * K * 4, "routing");
    BENCH_CUDA_CHECK(cudaMemcpy(bench.top_experts.pointer, routing.data() + rank * T * K, T * K * 4,
                                cudaMemcpyHostToDevice));
    bench.weights.allocate(T * K * 4, "router weights");
    BENCH_CUDA_CHECK(cudaMemset(bench.weights.pointer, 0, T * K * 4));
    bench.built.allocate(bench.layout.total_bytes, "timed schedule");
  }
  auto synchronize = [&] {
    for (BenchRank& bench : ranks) {
      BENCH_CUDA_CHECK(cudaSetDevice(bench.device));
      BENCH_CUDA_CHECK(cudaStreamSynchronize(bench.stream));
    }
  };
  // Median over 20 of the slowest rank's time: every rank's start event, then every rank's
  // launches, then every rank's stop event.
  auto median_ms = [&](const std::function<void(int32_t)>& launch_rank) {
    std::vector<cudaEvent_t> start(R), stop(R);
    for (int32_t rank = 0; rank < R; ++rank) {
      BENCH_CUDA_CHECK(cudaSetDevice(ranks[rank].device));
      BENCH_CUDA_CHECK(cudaEventCreate(&start[rank]));
      BENCH_CUDA_CHECK(cudaEventCreate(&stop[rank]));
    }
    std::vector<float> times;
    for (int iteration = 0; iteration < 23; ++iteration) {
      for (int32_t rank = 0; rank < R; ++rank) {
        BENCH_CUDA_CHECK(cudaSetDevice(ranks[rank].device));
        BENCH_CUDA_CHECK(cudaEventRecord(start[rank], ranks[rank].stream));
      }
      for (int32_t rank = 0; rank < R; ++rank) {
        BENCH_CUDA_CHECK(cudaSetDevice(ranks[rank].device));
        launch_rank(rank);
      }
      for (int32_t rank = 0; rank < R; ++rank) {
        BENCH_CUDA_CHECK(cudaSetDevice(ranks[rank].device));
        BENCH_CUDA_CHECK(cudaEventRecord(stop[rank], ranks[rank].stream));
      }
      synchronize();
      float slowest = 0;
      for (int32_t rank = 0; rank < R; ++rank) {
        float ms = 0;
        BENCH_CUDA_CHECK(cudaEventElapsedTime(&ms, start[rank], stop[rank]));
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
  int64_t max_sent = 0;
  for (const BenchRank& bench : ranks) max_sent = std::max(max_sent, bench.remote_rows_sent);
  const double bytes_sent = static_cast<double>(max_sent) * H * 2;
  std::printf("mok comm-bench: %d GPUs, T=%lld H=%lld K=%lld E=%lld, routing %s\n", R,
              static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(K),
              static_cast<long long>(shape.num_experts), routing_kind_name(routing_kind));
  std::printf(
      "  NVLink rows per GPU (the busiest): %lld pulled in (or sent by a push dispatch: %lld), "
      "%lld pushed out\n",
      static_cast<long long>(max_in), static_cast<long long>(max_sent),
      static_cast<long long>(max_out));
  std::printf("  %-34s %6s %8s %10s %12s\n", "variant", "CTAs", "threads", "us", "GB/s per GPU");
  auto wait_of = [](int32_t rank) {
    return kernels::WaitContext{20'000'000'000ull, rank, nullptr};
  };
  auto report = [&](const char* name, int ctas, int threads, double ms, double bytes) {
    std::printf("  %-34s %6d %8d %10.1f %12.1f\n", name, ctas, threads, ms * 1e3, bytes / ms / 1e6);
  };
  auto pull_ms = [&](kernels::RowCopy copy, int ctas, int threads) {
    return median_ms([&](int32_t rank) {
      BenchRank& bench = ranks[rank];
      const kernels::PullRowsArgs pull =
          kernels::pull_rows_args(ScheduleView::at(bench.schedule.pointer, bench.layout),
                                  x.device_peers(rank), H, rank, R, bench.received.pointer);
      BENCH_CUDA_CHECK(
          kernels::launch_pull_rows(pull, copy, ctas, wait_of(rank), bench.stream, threads));
    });
  };
  auto push_ms = [&](kernels::RowCopy copy, int ctas, int threads) {
    return median_ms([&](int32_t rank) {
      BenchRank& bench = ranks[rank];
      const kernels::PushRowsArgs push = kernels::push_rows_args(
          ScheduleView::at(bench.schedule.pointer, bench.layout), bench.rows.pointer, H,
          static_cast<int32_t>(T * K), slots.device_peers(rank),
          reinterpret_cast<uint64_t* const*>(flags.device_peers(rank)), rank, R,
          bench.counters.as<unsigned long long>());
      BENCH_CUDA_CHECK(
          kernels::launch_push_rows(push, copy, ctas, wait_of(rank), bench.stream, threads));
      BENCH_CUDA_CHECK(kernels::launch_wait_for_peers(
          static_cast<const uint64_t*>(flags.local(rank)), R,
          bench.counters.as<unsigned long long>(), wait_of(rank), bench.stream));
      BENCH_CUDA_CHECK(
          kernels::launch_advance_epoch(bench.counters.as<unsigned long long>(), bench.stream));
    });
  };
  // Warp copies with 256 and 512 threads per CTA (the library's kNvlinkCopyThreads is one of
  // them), the bulk copies with their one thread per CTA.
  for (int ctas : {4, 8, 16, 24, 32, 64}) {
    for (int threads : {256, 512}) {
      report("pull dispatch (warp copies)", ctas, threads,
             pull_ms(kernels::RowCopy::kWarp, ctas, threads), bytes_in);
      report("push combine, warp copies (+ wait)", ctas, threads,
             push_ms(kernels::RowCopy::kWarp, ctas, threads), bytes_out);
      const double push_dispatch_ms = median_ms([&](int32_t rank) {
        BenchRank& bench = ranks[rank];
        kernels::PushDispatchArgs push;
        push.send_entry = bench.send_entry.as<int32_t>();
        push.source = x.local(rank);
        push.received_peers = received_sym.device_peers(rank);
        push.vectors_per_row = H / 8;
        push.num_tokens = static_cast<int32_t>(T);
        push.rank = rank;
        push.num_ranks = R;
        push.flag_peers = reinterpret_cast<uint64_t* const*>(dispatch_flags.device_peers(rank));
        push.done = bench.counters.as<unsigned long long>() + 4;
        push.epoch = bench.counters.as<unsigned long long>() + 3;
        BENCH_CUDA_CHECK(kernels::launch_push_dispatch(push, ctas, bench.stream, threads));
        BENCH_CUDA_CHECK(kernels::launch_wait_for_peers(
            static_cast<const uint64_t*>(dispatch_flags.local(rank)), R,
            bench.counters.as<unsigned long long>() + 3, wait_of(rank), bench.stream));
        BENCH_CUDA_CHECK(kernels::launch_advance_epoch(bench.counters.as<unsigned long long>() + 3,
                                                       bench.stream));
      });
      report("push dispatch (warp copies, + wait)", ctas, threads, push_dispatch_ms, bytes_sent);
      const double copy_ms = median_ms([&](int32_t rank) {
        BenchRank& bench = ranks[rank];
        const int32_t peer = (rank + 1) % R;
        BENCH_CUDA_CHECK(kernels::launch_copy_contiguous(
            x.peer(rank, peer), bench.copy_target.pointer, std::min<int64_t>(max_in, T) * H * 2,
            ctas, bench.stream, threads));
      });
      report("copy ceiling (contiguous, pull)", ctas, threads, copy_ms,
             static_cast<double>(std::min<int64_t>(max_in, T)) * H * 2);
      const int64_t push_bytes = std::min<int64_t>(max_out, T * K) * H * 2;
      const double push_copy_ms = median_ms([&](int32_t rank) {
        BenchRank& bench = ranks[rank];
        const int32_t peer = (rank + 1) % R;
        BENCH_CUDA_CHECK(kernels::launch_copy_contiguous(
            bench.rows.pointer, slots.peer(rank, peer),
            std::min<int64_t>(push_bytes, bench.rows.bytes), ctas, bench.stream, threads));
      });
      report("copy ceiling (contiguous, push)", ctas, threads, push_copy_ms,
             static_cast<double>(std::min<int64_t>(push_bytes, ranks[0].rows.bytes)));
    }
    report("pull dispatch (bulk copies)", ctas, 1, pull_ms(kernels::RowCopy::kBulk, ctas, 1),
           bytes_in);
    report("push combine, bulk copies (+ wait)", ctas, 1, push_ms(kernels::RowCopy::kBulk, ctas, 1),
           bytes_out);
  }
  const double exchange_ms = median_ms([&](int32_t rank) {
    BenchRank& bench = ranks[rank];
    kernels::RoutingExchangeArgs args;
    args.top_experts = bench.top_experts.pointer;
    args.bytes_per_rank = T * K * 4;
    args.routing_peers = routing_all.device_peers(rank);
    args.weights = bench.weights.as<float>();
    args.weight_bytes_per_rank = T * K * 4;
    args.weight_peers = weights_all.device_peers(rank);
    args.flag_peers = reinterpret_cast<uint64_t* const*>(exchange_flags.device_peers(rank));
    args.rank = rank;
    args.num_ranks = R;
    args.epoch = bench.counters.as<unsigned long long>() + 2;
    args.wait = wait_of(rank);
    BENCH_CUDA_CHECK(kernels::launch_routing_exchange(args, bench.stream));
    BENCH_CUDA_CHECK(
        kernels::launch_advance_epoch(bench.counters.as<unsigned long long>() + 2, bench.stream));
    launch_build_schedule(bench.layout, routing_all.local(rank), DType::kInt32, bench.built.pointer,
                          bench.stream)
        .throw_if_error();
  });
  // The push dispatch left every rank's receive buffer as the pull did (the same rows at the
  // same entries of the other ranks; neither copies the rank's own rows).
  for (int32_t rank = 0; rank < R; ++rank) {
    BenchRank& bench = ranks[rank];
    BENCH_CUDA_CHECK(cudaSetDevice(bench.device));
    const ScheduleView view = ScheduleView::at(bench.schedule.pointer, bench.layout);
    ScheduleHeader header{};
    BENCH_CUDA_CHECK(cudaMemcpy(&header, view.header, sizeof(header), cudaMemcpyDeviceToHost));
    const size_t bytes = static_cast<size_t>(header.total_recv) * H * 2;
    std::vector<char> pulled(bytes), pushed(bytes);
    BENCH_CUDA_CHECK(
        cudaMemcpy(pulled.data(), bench.received.pointer, bytes, cudaMemcpyDeviceToHost));
    BENCH_CUDA_CHECK(
        cudaMemcpy(pushed.data(), received_sym.local(rank), bytes, cudaMemcpyDeviceToHost));
    int32_t own[2] = {0, 0};
    BENCH_CUDA_CHECK(
        cudaMemcpy(own, view.recv_offsets + rank, sizeof(own), cudaMemcpyDeviceToHost));
    const size_t own_begin = static_cast<size_t>(own[0]) * H * 2;
    const size_t own_end = static_cast<size_t>(own[1]) * H * 2;
    if (!std::equal(pulled.begin(), pulled.begin() + own_begin, pushed.begin()) ||
        !std::equal(pulled.begin() + own_end, pulled.end(), pushed.begin() + own_end))
      throw Error(ErrorCode::kInternal, "comm-bench: rank " + std::to_string(rank) +
                                            "'s rows after the push dispatch differ from the "
                                            "pull's");
  }
  // The timed build must be the real one: every rank's schedule equals the host's.
  for (int32_t rank = 0; rank < R; ++rank) {
    BenchRank& bench = ranks[rank];
    std::vector<char> want(bench.layout.output_bytes), got(bench.layout.output_bytes);
    BENCH_CUDA_CHECK(cudaSetDevice(bench.device));
    BENCH_CUDA_CHECK(
        cudaMemcpy(want.data(), bench.schedule.pointer, want.size(), cudaMemcpyDeviceToHost));
    BENCH_CUDA_CHECK(
        cudaMemcpy(got.data(), bench.built.pointer, got.size(), cudaMemcpyDeviceToHost));
    const Status same = compare_schedules(bench.layout, want.data(), got.data());
    if (!same.ok())
      throw Error(ErrorCode::kInternal, "comm-bench: rank " + std::to_string(rank) +
                                            "'s schedule after the exchange differs from the "
                                            "host's: " +
                                            same.message);
  }
  std::printf("  routing exchange + schedule build: %.1f us (T=%lld K=%lld per rank, E=%lld)\n",
              exchange_ms * 1e3, static_cast<long long>(T), static_cast<long long>(K),
              static_cast<long long>(shape.num_experts));
  const double nccl_ms = median_ms([&](int32_t rank) {
    if (rank != 0) return;  // one group call launches every rank
    ncclGroupStart();
    for (int32_t r = 0; r < R; ++r) {
      BENCH_CUDA_CHECK(cudaSetDevice(ranks[r].device));
      ncclComm_t comm = static_cast<ncclComm_t>(group[r]->nccl_handle());
      for (int32_t peer = 0; peer < R; ++peer) {
        if (peer == r) continue;
        const size_t to_peer = static_cast<size_t>(ranks[peer].rows_from[r] * H);
        const size_t from_peer = static_cast<size_t>(ranks[r].rows_from[peer] * H);
        // From plain device memory, as a user's all-to-all sends its activations (a send out of
        // the registered symmetric window never completed on 2 x H200, NCCL 2.28.3).
        if (to_peer > 0)
          ncclSend(ranks[r].copy_target.pointer, to_peer, ncclBfloat16, peer, comm,
                   ranks[r].stream);
        if (from_peer > 0)
          ncclRecv(ranks[r].received.pointer, from_peer, ncclBfloat16, peer, comm, ranks[r].stream);
      }
    }
    ncclGroupEnd();
    BENCH_CUDA_CHECK(cudaSetDevice(ranks[0].device));
  });
  report("NCCL all-to-all (send/recv)", 0, 0, nccl_ms, bytes_in);
  for (BenchRank& bench : ranks) {
    cudaSetDevice(bench.device);
    cudaStreamDestroy(bench.stream);
  }
  return 0;
}

#else

int run_comm_bench(const MoeShape&, RoutingKind, uint64_t) {
  throw mok::Error(mok::ErrorCode::kUnsupported,
                   "comm-bench: this mok was built without NCCL (set MOK_NCCL_HOME and rebuild)");
}

#endif

}  // namespace mok
