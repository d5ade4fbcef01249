// The expert-parallel layer (include/mok/ep_layer.h; built with NCCL): the group's symmetric
// buffers and, per local rank, its EpRank (comm/ep_exchange.h) and its GpuLayer, whose token
// exchange is that rank's EpExchange; the buffers' roles and the ordering across ranks are
// described in comm/ep_exchange.cpp.
#include "mok/ep_layer.h"

#include <algorithm>
#include <string>

#include "comm/ep_exchange.h"
#include "layer/cuda_buffer.h"
#include "layer/gpu_layer_state.h"

namespace mok {

struct EpLayer::Impl {
  MoeShape shape;
  std::vector<Communicator*> ranks_here;
  EpSymmetric memory;
  std::vector<std::unique_ptr<EpRank>> ranks;
  std::vector<std::unique_ptr<GpuLayer>> layers;
};

namespace {

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
    ep->dispatch_in_gemm = config.ep_dispatch_in_gemm;  // can_implement checked its companions
    ep->memory = &m.memory;
    ep->piece = i;
    if (config.ep_push_dispatch)
      ep->send_entry.allocate(std::max<int64_t>(R * T * 4, 4), "send entries");
    else {
      ep->received.allocate(R * T * H * 2, "pulled x rows");
      ep->received_d_out.allocate(R * T * H * 2, "pulled d_out rows");
    }
    ep->slot_index.allocate(T * K * 4, "slot index");
    ep->counters.allocate(static_cast<int64_t>(kernels::EpCounter::kCount) * 8,
                          "expert-parallel counters");
    cuda_check(cudaMemset(ep->counters.pointer, 0, ep->counters.bytes), "zero EP counters");
    std::unique_ptr<GpuLayer::State> state = make_layer_state(shape, config, ep->rank);
    state->exchange = make_ep_exchange(*ep);
    m.layers.push_back(std::make_unique<GpuLayer>(std::move(state)));
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
    for (const std::unique_ptr<GpuLayer>& layer : impl_->layers) {
      const std::string diagnosis = layer->timed_out_wait();
      if (!diagnosis.empty())
        throw Error(ErrorCode::kTimeout, std::string(error.what()) + "; " + diagnosis);
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

}  // namespace mok
