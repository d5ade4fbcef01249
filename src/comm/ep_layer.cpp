// The expert-parallel layer (include/mok/ep_layer.h; built with NCCL): the group's symmetric
// buffers, one GpuLayer per local rank, and the steps run_forward / run_backward call for each rank
// (gpu_layer_state.h, namespace ep).
//
// Symmetric buffers (one per rank, every rank's addressable from every GPU; SymmetricMemory):
//   x, d_out          [T, H] bf16   published by their rank before its exchange; peers pull rows
//   routing_all       [R, T, K]     every rank's top_experts (int32 or int64), by the exchange
//   weights_all       [R, T, K] f32 every rank's router weights, by the same exchange
//   slots             [T*K, H] bf16 expert outputs (backward: dx rows) pushed by the expert ranks
//   d_router_weights  [T*K] f32     router-weight gradients written by the expert ranks
//   exchange / push flags [R] u64   the two signal families (peer_barrier.cuh), with epochs
// With MoeConfig::ep_push_dispatch, x and d_out are not published; instead
//   received_x, received_d_out  [R*T, H] bf16  rows pushed by their source ranks at the entries
//                                              of this rank's receive list
//   dispatch flags    [R] u64       the push dispatch's signals
// Ordering across ranks, per layer call and rank r: r publishes its inputs, then the exchange
// (or, in a backward with a context, the same kernel without payload as a barrier) signals
// every rank and waits for every rank: after it, every rank's inputs of this call are
// published and every rank has finished the previous call's combine (which read its slots), so
// pulls and pushes that follow are safe. The push's last CTA signals every rank once all rows
// are stored; the combine waits for every rank's push before it reads its slots. A rank
// publishes its next inputs only after that wait, by which time every rank finished pulling
// from the current ones. The push dispatch writes into a rank's receive buffer only after the
// call's exchange, which that rank entered after it expanded the previous call's rows; x and
// d_out have a receive buffer each, so a backward without context pushes both after one
// exchange.
#include "mok/ep_layer.h"

#include <algorithm>
#include <string>

#include "kernels/comm/launch.h"
#include "layer/cuda_buffer.h"
#include "layer/gpu_layer_state.h"
#include "layer/wait_report.h"
#include "mok/schedule_gpu.h"

namespace mok {

// The group's symmetric buffers (one SymmetricMemory each, over the ranks of this process).
struct EpSymmetric {
  std::unique_ptr<SymmetricMemory> x, d_out, routing, weights, slots, d_rw, exchange_flags,
      push_flags;
  // Push dispatch only (MoeConfig::ep_push_dispatch).
  std::unique_ptr<SymmetricMemory> received_x, received_d_out, dispatch_flags;
};

// One rank's share of the group: its piece of every symmetric buffer and its local
// communication state.
struct EpRank {
  int32_t rank = 0, num_ranks = 1;
  int comm_ctas = 24;
  kernels::RowCopy row_copy = kernels::RowCopy::kWarp;  // MoeConfig::ep_bulk_copies
  bool push_dispatch = false;                           // MoeConfig::ep_push_dispatch
  const EpSymmetric* memory = nullptr;
  int32_t piece = 0;            // this rank's index among the process's pieces
  DeviceBuffer received;        // [R*T, H] bf16: pulled x rows, one per receive entry (pull only)
  DeviceBuffer received_d_out;  // [R*T, H] bf16: pulled d_out rows (pull only)
  DeviceBuffer send_entry;      // int32 [R*T]: this rank's tokens' receive entries (push only)
  DeviceBuffer slot_index;      // int32 [T*K]: the combine's index over the slots
  // [0] exchange epoch, [1] push epoch, [2] push CTAs done, [3] dispatch epoch, [4] dispatch
  // CTAs done
  DeviceBuffer counters;

  // This rank's buffer of `buffer`, and the table of every rank's, as this GPU addresses them.
  template <typename T = void>
  T* local(const std::unique_ptr<SymmetricMemory>& buffer) const {
    return static_cast<T*>(buffer->local(piece));
  }
  template <typename T = void>
  T* const* peers(const std::unique_ptr<SymmetricMemory>& buffer) const {
    return reinterpret_cast<T* const*>(buffer->device_peers(piece));
  }
};

struct EpLayer::Impl {
  MoeShape shape;
  std::vector<Communicator*> ranks_here;
  EpSymmetric memory;
  std::vector<std::unique_ptr<EpRank>> ranks;
  std::vector<std::unique_ptr<GpuLayer>> layers;
};

namespace {

unsigned long long* counter(EpRank& ep, int index) {
  return ep.counters.as<unsigned long long>() + index;
}

void check_local_count(const char* call, size_t got, size_t want) {
  if (got != want)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("EpLayer::") + call + ": " + std::to_string(got) +
                    " entries; valid: one per local rank (" + std::to_string(want) + ")");
}

}  // namespace

EpLayer::EpLayer(const MoeShape& shape, const MoeConfig& config,
                 const std::vector<Communicator*>& ranks_here)
    : impl_(std::make_unique<Impl>()) {
  can_implement(config, shape).throw_if_error();
  if (ranks_here.empty())
    throw Error(ErrorCode::kInvalidArgument,
                "EpLayer: ranks_here is empty; pass the group's ranks this process drives");
  for (Communicator* communicator : ranks_here)
    if (communicator->num_ranks() != shape.num_ranks)
      throw Error(ErrorCode::kInvalidArgument,
                  "EpLayer: shape.num_ranks = " + std::to_string(shape.num_ranks) +
                      " but the communicator of rank " + std::to_string(communicator->rank()) +
                      " has " + std::to_string(communicator->num_ranks()) +
                      " ranks; valid: the group size");
  Impl& m = *impl_;
  m.shape = shape;
  m.ranks_here = ranks_here;
  const int64_t T = shape.num_tokens, H = shape.hidden, K = shape.top_k, R = shape.num_ranks;
  auto symmetric = [&](int64_t bytes, const char* what, bool zero) {
    return std::make_unique<SymmetricMemory>(ranks_here, std::max<int64_t>(bytes, 16), what, zero);
  };
  if (config.ep_push_dispatch) {
    m.memory.received_x = symmetric(R * T * H * 2, "pushed x rows", false);
    m.memory.received_d_out = symmetric(R * T * H * 2, "pushed d_out rows", false);
    m.memory.dispatch_flags = symmetric(R * 8, "dispatch flags", true);
  } else {
    m.memory.x = symmetric(T * H * 2, "published x", false);
    m.memory.d_out = symmetric(T * H * 2, "published d_out", false);
  }
  m.memory.routing = symmetric(R * T * K * 8, "routing of every rank", false);
  m.memory.weights = symmetric(R * T * K * 4, "router weights of every rank", false);
  m.memory.slots = symmetric(T * K * H * 2, "combine slots", false);
  m.memory.d_rw = symmetric(T * K * 4, "router-weight gradients", false);
  m.memory.exchange_flags = symmetric(R * 8, "exchange flags", true);
  m.memory.push_flags = symmetric(R * 8, "push flags", true);
  for (int32_t i = 0; i < static_cast<int32_t>(ranks_here.size()); ++i) {
    DeviceScope scope(ranks_here[i]->device());
    auto ep = std::make_unique<EpRank>();
    ep->rank = ranks_here[i]->rank();
    ep->num_ranks = static_cast<int32_t>(R);
    ep->comm_ctas = std::max(config.fwd_num_comm_sms, 1);
    ep->row_copy = config.ep_bulk_copies ? kernels::RowCopy::kBulk : kernels::RowCopy::kWarp;
    ep->push_dispatch = config.ep_push_dispatch;
    ep->memory = &m.memory;
    ep->piece = i;
    if (config.ep_push_dispatch)
      ep->send_entry.allocate(std::max<int64_t>(R * T * 4, 4), "send entries");
    else {
      ep->received.allocate(R * T * H * 2, "pulled x rows");
      ep->received_d_out.allocate(R * T * H * 2, "pulled d_out rows");
    }
    ep->slot_index.allocate(T * K * 4, "slot index");
    ep->counters.allocate(5 * 8, "expert-parallel counters");
    cuda_check(cudaMemset(ep->counters.pointer, 0, ep->counters.bytes), "zero EP counters");
    m.layers.push_back(std::unique_ptr<GpuLayer>(new GpuLayer(shape, config, ep->rank, ep.get())));
    m.ranks.push_back(std::move(ep));
  }
}

EpLayer::~EpLayer() = default;

int32_t EpLayer::num_local_ranks() const { return static_cast<int32_t>(impl_->layers.size()); }

GpuLayer& EpLayer::rank_layer(int32_t i) { return *impl_->layers.at(i); }

int EpLayer::rank_device(int32_t i) const { return impl_->ranks_here.at(i)->device(); }

std::vector<ForwardContext> EpLayer::forward(const std::vector<ForwardArgs>& args,
                                             const std::vector<cudaStream_t>& streams) {
  check_local_count("forward (args)", args.size(), impl_->layers.size());
  check_local_count("forward (streams)", streams.size(), impl_->layers.size());
  std::vector<ForwardContext> contexts;
  try {
    for (int32_t i = 0; i < num_local_ranks(); ++i) {
      DeviceScope scope(rank_device(i));
      contexts.push_back(impl_->layers[i]->forward(args[i], streams[i]));
    }
  } catch (const Error& error) {
    rethrow_with_wait_diagnosis(error);
  }
  return contexts;
}

void EpLayer::rethrow_with_wait_diagnosis(const Error& error) const {
  if (error.code() == ErrorCode::kCudaError)
    for (size_t i = 0; i < impl_->layers.size(); ++i) {
      const kernels::WaitDiagnosis& record = *impl_->layers[i]->state_->diagnosis;
      if (record.timed_out != 0)
        throw Error(ErrorCode::kTimeout,
                    std::string(error.what()) + "; " + describe_wait_diagnosis(record));
    }
  throw error;
}

void EpLayer::backward(const std::vector<BackwardArgs>& args,
                       const std::vector<cudaStream_t>& streams,
                       const std::vector<ForwardContext>* contexts) {
  check_local_count("backward (args)", args.size(), impl_->layers.size());
  check_local_count("backward (streams)", streams.size(), impl_->layers.size());
  if (contexts != nullptr) check_local_count("backward (contexts)", contexts->size(), args.size());
  try {
    for (int32_t i = 0; i < num_local_ranks(); ++i) {
      DeviceScope scope(rank_device(i));
      impl_->layers[i]->backward(args[i], streams[i], contexts ? &(*contexts)[i] : nullptr);
    }
  } catch (const Error& error) {
    rethrow_with_wait_diagnosis(error);
  }
}

Status EpLayer::synchronize(const std::vector<cudaStream_t>& streams) {
  check_local_count("synchronize (streams)", streams.size(), impl_->layers.size());
  Status first = Status::Ok();
  for (int32_t i = 0; i < num_local_ranks(); ++i) {
    DeviceScope scope(rank_device(i));
    Status status = impl_->layers[i]->synchronize(streams[i]);
    if (!status.ok() && first.ok())
      first = Status{status.code, "rank " + std::to_string(impl_->ranks_here[i]->rank()) + ": " +
                                      status.message};
  }
  return first;
}

int64_t EpLayer::workspace_bytes_per_rank() const {
  const Impl& m = *impl_;
  const EpRank& rank = *m.ranks.front();
  int64_t bytes = m.layers.front()->workspace_bytes() + rank.received.bytes +
                  rank.received_d_out.bytes + rank.send_entry.bytes + rank.slot_index.bytes +
                  rank.counters.bytes;
  const EpSymmetric& b = m.memory;
  for (const auto* memory :
       {&b.x, &b.d_out, &b.routing, &b.weights, &b.slots, &b.d_rw, &b.exchange_flags, &b.push_flags,
        &b.received_x, &b.received_d_out, &b.dispatch_flags})
    if (*memory != nullptr) bytes += (*memory)->bytes();
  return bytes;
}

namespace ep {

namespace {

// The exchange kernel: the routing and router weights of this call when `top_experts` is set,
// else no payload (a barrier of the group).
void exchange(GpuLayer::State& s, const TensorView* top_experts, const float* router_weights,
              cudaStream_t stream) {
  EpRank& ep = *s.ep;
  const int64_t pairs = s.shape.num_tokens * s.shape.top_k;
  kernels::RoutingExchangeArgs args;
  args.top_experts = top_experts != nullptr ? top_experts->data : nullptr;
  args.bytes_per_rank = top_experts != nullptr ? pairs * dtype_size(top_experts->dtype) : 0;
  args.routing_peers = ep.peers(ep.memory->routing);
  args.weights = router_weights;
  args.weight_bytes_per_rank = router_weights != nullptr ? pairs * 4 : 0;
  args.weight_peers = ep.peers(ep.memory->weights);
  args.flag_peers = ep.peers<uint64_t>(ep.memory->exchange_flags);
  args.rank = ep.rank;
  args.num_ranks = ep.num_ranks;
  args.epoch = counter(ep, 0);
  args.wait = s.wait_context();
  cuda_check(kernels::launch_routing_exchange(args, stream), "routing exchange launch");
  cuda_check(kernels::launch_advance_epoch(counter(ep, 0), stream), "advance the exchange epoch");
}

// Brings the routed rows of every rank's `source` (x or d_out) to this rank, one per receive
// entry. Pull: read from the peers' published copies (`published`, filled before the exchange)
// into the local `pulled` buffer. Push: every rank writes its own rows into the receivers'
// `pushed` buffers (send entries from this call's routing), then waits for every rank's signal.
void receive_rows(GpuLayer::State& s, const TensorView& source,
                  const std::unique_ptr<SymmetricMemory>& published, DeviceBuffer& pulled,
                  const std::unique_ptr<SymmetricMemory>& pushed, cudaStream_t stream) {
  EpRank& ep = *s.ep;
  if (ep.push_dispatch) {
    kernels::PushDispatchArgs push;
    push.send_entry = ep.send_entry.as<int32_t>();
    push.source = source.data;
    push.received_peers = ep.peers(pushed);
    push.vectors_per_row = s.shape.hidden / 8;
    push.num_tokens = static_cast<int32_t>(s.shape.num_tokens);
    push.rank = ep.rank;
    push.num_ranks = ep.num_ranks;
    push.flag_peers = ep.peers<uint64_t>(ep.memory->dispatch_flags);
    push.done = counter(ep, 4);
    push.epoch = counter(ep, 3);
    cuda_check(kernels::launch_push_dispatch(push, ep.comm_ctas, stream), "push dispatch launch");
    cuda_check(
        kernels::launch_wait_for_peers(ep.local<uint64_t>(ep.memory->dispatch_flags), ep.num_ranks,
                                       counter(ep, 3), s.wait_context(), stream),
        "wait for every rank's dispatch");
    cuda_check(kernels::launch_advance_epoch(counter(ep, 3), stream), "advance the dispatch epoch");
  } else {
    const kernels::PullRowsArgs pull =
        kernels::pull_rows_args(s.routed.view(), ep.peers(published), s.shape.hidden, ep.rank,
                                ep.num_ranks, pulled.pointer);
    cuda_check(kernels::launch_pull_rows(pull, ep.row_copy, ep.comm_ctas, s.wait_context(), stream),
               "pull dispatch launch");
  }
}

// After the exchange: the schedule and, for a push dispatch, this rank's send entries.
void build_schedule(GpuLayer::State& s, const TensorView& top_experts, cudaStream_t stream) {
  EpRank& ep = *s.ep;
  launch_build_schedule(s.routed.layout, ep.local(ep.memory->routing), top_experts.dtype,
                        s.routed.schedule.pointer, stream)
      .throw_if_error();
  if (ep.push_dispatch)
    cuda_check(kernels::launch_send_entries(s.routed.layout.params, ep.local(ep.memory->routing),
                                            top_experts.dtype, ep.send_entry.as<int32_t>(), stream),
               "send entries launch");
}

void publish(void* destination, const TensorView& source, cudaStream_t stream, const char* what) {
  cuda_check(cudaMemcpyAsync(destination, source.data, static_cast<size_t>(source.nbytes()),
                             cudaMemcpyDeviceToDevice, stream),
             std::string("publish ") + what);
}

}  // namespace

void dispatch_forward(GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                      const StageMarker& mark) {
  EpRank& ep = *s.ep;
  if (!ep.push_dispatch) publish(ep.local(ep.memory->x), args.x, stream, "x");
  exchange(s, &args.top_experts, args.router_weights.data_as<const float>(), stream);
  build_schedule(s, args.top_experts, stream);
  mark("routing exchange + schedule");
  receive_rows(s, args.x, ep.memory->x, ep.received, ep.memory->received_x, stream);
  mark(ep.push_dispatch ? "push dispatch" : "pull dispatch");
}

void expand_received(GpuLayer::State& s, bool d_out, const void* local_source, void* rows,
                     int64_t row_begin, int64_t row_count, cudaStream_t stream) {
  EpRank& ep = *s.ep;
  const void* received = ep.push_dispatch
                             ? ep.local(d_out ? ep.memory->received_d_out : ep.memory->received_x)
                             : (d_out ? ep.received_d_out : ep.received).pointer;
  cuda_check(kernels::launch_expand_received(
                 kernels::expand_received_args(s.routed.view(), received, local_source,
                                               s.shape.hidden, ep.rank, rows, row_begin, row_count),
                 stream),
             "expand received rows");
}

void dispatch_backward(GpuLayer::State& s, const BackwardArgs& args, bool use_context,
                       cudaStream_t stream, const StageMarker& mark) {
  EpRank& ep = *s.ep;
  const ForwardArgs& fwd = args.forward;
  // Pairs not routed anywhere keep 0; the expert ranks write the routed ones after the barrier.
  cuda_check(cudaMemsetAsync(ep.local<float>(ep.memory->d_rw), 0,
                             static_cast<size_t>(s.shape.num_tokens * s.shape.top_k * 4), stream),
             "zero router-weight gradients");
  if (!ep.push_dispatch) publish(ep.local(ep.memory->d_out), args.d_out, stream, "d_out");
  if (use_context) {
    // A barrier: every rank published its d_out (pull), or finished reading its receive buffers
    // (push).
    exchange(s, nullptr, nullptr, stream);
  } else {
    if (!ep.push_dispatch) publish(ep.local(ep.memory->x), fwd.x, stream, "x");
    exchange(s, &fwd.top_experts, fwd.router_weights.data_as<const float>(), stream);
    build_schedule(s, fwd.top_experts, stream);
  }
  receive_rows(s, args.d_out, ep.memory->d_out, ep.received_d_out, ep.memory->received_d_out,
               stream);
  // With the context, the forward's received x rows are still here: the macrobatches the
  // backward recomputes expand them again.
  if (!use_context)
    receive_rows(s, fwd.x, ep.memory->x, ep.received, ep.memory->received_x, stream);
  mark(use_context ? "barrier + d_out dispatch"
                   : "routing exchange + schedule + d_out, x dispatch");
}

void push_rows(GpuLayer::State& s, cudaStream_t stream, const StageMarker& mark, const char* name) {
  EpRank& ep = *s.ep;
  const ScheduleView view = s.routed.view();
  const kernels::PushRowsArgs push = kernels::push_rows_args(
      view, s.expert_out.pointer, s.shape.hidden,
      static_cast<int32_t>(s.shape.num_tokens * s.shape.top_k), ep.peers(ep.memory->slots),
      ep.peers<uint64_t>(ep.memory->push_flags), ep.rank, ep.num_ranks, counter(ep, 1));
  cuda_check(kernels::launch_push_rows(push, ep.row_copy, ep.comm_ctas, s.wait_context(), stream),
             "push combine launch");
  cuda_check(kernels::launch_wait_for_peers(ep.local<uint64_t>(ep.memory->push_flags), ep.num_ranks,
                                            counter(ep, 1), s.wait_context(), stream),
             "wait for every rank's push");
  cuda_check(kernels::launch_advance_epoch(counter(ep, 1), stream), "advance the push epoch");
  mark(name);
}

void combine_slots(GpuLayer::State& s, const TensorView& top_experts, const void* shared,
                   const float* weights, void* out, cudaStream_t stream) {
  EpRank& ep = *s.ep;
  const int64_t T = s.shape.num_tokens, K = s.shape.top_k;
  // This rank's own pairs are read from the expert rows in place (the push skipped them).
  const int32_t* own_pair_row = s.routed.view().pair_row + static_cast<int64_t>(ep.rank) * T * K;
  cuda_check(
      kernels::launch_slot_index(top_experts.data, top_experts.dtype, T * K, s.shape.num_experts,
                                 own_pair_row, ep.slot_index.as<int32_t>(), stream),
      "slot index launch");
  cuda_check(kernels::launch_combine(ep.local(ep.memory->slots), ep.slot_index.as<int32_t>(),
                                     shared, weights, T, s.shape.hidden, s.shape.top_k, out, stream,
                                     s.expert_out.pointer),
             "combine launch");
}

const float* gathered_router_weights(const GpuLayer::State& s) {
  return s.ep->local<float>(s.ep->memory->weights);
}

float* const* router_weight_grad_peers(const GpuLayer::State& s) {
  return s.ep->peers<float>(s.ep->memory->d_rw);
}

void copy_router_weight_grads(GpuLayer::State& s, const TensorView& d_router_weights,
                              cudaStream_t stream) {
  cuda_check(cudaMemcpyAsync(d_router_weights.data, s.ep->local<float>(s.ep->memory->d_rw),
                             static_cast<size_t>(d_router_weights.nbytes()),
                             cudaMemcpyDeviceToDevice, stream),
             "copy router-weight gradients");
}

}  // namespace ep
}  // namespace mok
