// The expert-parallel baseline: NCCL all-to-all around the same grouped GEMMs (see
// include/mok/ep_baseline.h). The expert compute of each rank is a single-GPU GpuLayer whose
// "tokens" are the rows the rank received, each with one route: its local expert, router
// weight 1 in the forward (the outputs go back unweighted and the source applies the weights,
// as mok does) and the pair's router weight in the backward (which scales the SwiGLU backward,
// as mok's does). The inner layer is sized by the received count the host already read (rounded
// up to 128 rows), as a user's grouped GEMM over the received rows would be: a layer sized for
// the worst case (R*T*K rows) would spend its dispatch and combine on empty rows.
#include "mok/testing/ep_baseline.h"

#include <nccl.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <string>

#include "kernels/stages/launch.h"
#include "layer/cuda_buffer.h"
#include "mok/gpu_layer.h"
#include "testing/baseline_kernels.h"

namespace mok {

namespace {

void nccl_check(ncclResult_t result, const std::string& what) {
  if (result != ncclSuccess)
    throw Error(ErrorCode::kCommError, what + " failed: " + ncclGetErrorString(result));
}

}  // namespace

struct EpBaseline::Impl {
  struct Rank {
    Communicator* communicator = nullptr;
    // Inner layers by token count (a few distinct counts in practice: the routing of a run).
    std::map<int64_t, std::unique_ptr<GpuLayer>> inner_layers;
    GpuLayer* inner = nullptr;  // the one the last forward used (its context feeds the backward)
    MoeShape inner_shape;       // and its shape
    DeviceBuffer counts, perm, pos;                                // bucketing
    DeviceBuffer send_rows, send_expert, send_weight;              // [T*K] in bucket order
    DeviceBuffer recv_rows, recv_expert, recv_weight;              // [R*T*K] received
    DeviceBuffer inner_top, ones, inner_out, inner_dx, inner_drw;  // the inner layer's tensors
    DeviceBuffer back_rows, back_drw;                              // [T*K] returned, bucket order
    int32_t* host_counts = nullptr;                                // pinned [R]
    ForwardContext inner_context;
    std::vector<int64_t> send_offsets, recv_offsets;  // [R + 1] rows, per peer
    int32_t received = 0;
    ~Rank() {
      if (host_counts != nullptr) cudaFreeHost(host_counts);
    }
  };
  MoeShape shape, inner_shape;  // inner_shape: the worst case (R*T*K tokens, one route each)
  std::vector<std::unique_ptr<Rank>> ranks;

  // Selects (creating it on first use) the inner layer for `received` rows on `rank`'s device.
  void select_inner_layer(Rank& rank) {
    constexpr int64_t kRowsRounding = 128;
    constexpr size_t kMaxInnerLayers = 4;
    const int64_t tokens = std::min(inner_shape.num_tokens, (rank.received + kRowsRounding - 1) /
                                                                kRowsRounding * kRowsRounding);
    auto found = rank.inner_layers.find(tokens);
    if (found == rank.inner_layers.end()) {
      // Bound the memory when the routing keeps changing: drop every layer but the current one.
      if (rank.inner_layers.size() >= kMaxInnerLayers)
        for (auto it = rank.inner_layers.begin(); it != rank.inner_layers.end();)
          it = it->second.get() == rank.inner ? std::next(it) : rank.inner_layers.erase(it);
      MoeShape layer_shape = inner_shape;
      layer_shape.num_tokens = tokens;
      found =
          rank.inner_layers.emplace(tokens, std::make_unique<GpuLayer>(layer_shape, MoeConfig{}))
              .first;
    }
    rank.inner = found->second.get();
    rank.inner_shape = inner_shape;
    rank.inner_shape.num_tokens = tokens;
  }

  LayerPointers inner_pointers(Rank& rank, const ForwardArgs& outer, bool backward) const {
    LayerPointers pointers;
    pointers.x = rank.recv_rows.pointer;
    pointers.top_experts = rank.inner_top.pointer;
    pointers.router_weights = backward ? rank.recv_weight.pointer : rank.ones.pointer;
    pointers.w_gate = outer.w_gate.data;
    pointers.w_up = outer.w_up.data;
    pointers.w_down = outer.w_down.data;
    pointers.out = rank.inner_out.pointer;
    return pointers;
  }

  // Grouped ncclSend / ncclRecv over every rank: rank i sends its `send` buffer's rows for peer
  // p (at send_offsets) and receives peer p's rows into its `receive` buffer (at recv_offsets);
  // `reverse` swaps the directions (the way back). `row_elements` elements of `type` per row.
  void all_to_all(DeviceBuffer Rank::*send, DeviceBuffer Rank::*receive, int64_t row_elements,
                  ncclDataType_t type, size_t element_bytes, bool reverse,
                  const std::vector<cudaStream_t>& streams, const char* what) {
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (size_t i = 0; i < ranks.size(); ++i) {
      Rank& rank = *ranks[i];
      ncclComm_t comm = static_cast<ncclComm_t>(rank.communicator->nccl_handle());
      const std::vector<int64_t>& out_offsets = reverse ? rank.recv_offsets : rank.send_offsets;
      const std::vector<int64_t>& in_offsets = reverse ? rank.send_offsets : rank.recv_offsets;
      const char* send_base = static_cast<const char*>((rank.*send).pointer);
      char* receive_base = static_cast<char*>((rank.*receive).pointer);
      for (int32_t peer = 0; peer < static_cast<int32_t>(ranks.size()); ++peer) {
        const int64_t out_rows = out_offsets[peer + 1] - out_offsets[peer];
        const int64_t in_rows = in_offsets[peer + 1] - in_offsets[peer];
        if (out_rows > 0)
          nccl_check(
              ncclSend(send_base + out_offsets[peer] * row_elements * element_bytes,
                       static_cast<size_t>(out_rows * row_elements), type, peer, comm, streams[i]),
              std::string("ncclSend of ") + what);
        if (in_rows > 0)
          nccl_check(
              ncclRecv(receive_base + in_offsets[peer] * row_elements * element_bytes,
                       static_cast<size_t>(in_rows * row_elements), type, peer, comm, streams[i]),
              std::string("ncclRecv of ") + what);
      }
    }
    nccl_check(ncclGroupEnd(), std::string("ncclGroupEnd after ") + what);
  }
};

EpBaseline::EpBaseline(const MoeShape& shape, const std::vector<Communicator*>& group)
    : impl_(std::make_unique<Impl>()) {
  can_implement(shape).throw_if_error();
  if (static_cast<int32_t>(group.size()) != shape.num_ranks)
    throw Error(ErrorCode::kInvalidArgument,
                "EpBaseline: " + std::to_string(group.size()) +
                    " ranks given for num_ranks = " + std::to_string(shape.num_ranks) +
                    "; valid: every rank of the group, driven by this process");
  if (shape.has_shared_expert())
    throw Error(ErrorCode::kUnsupported,
                "EpBaseline: shared_intermediate = " + std::to_string(shape.shared_intermediate) +
                    "; the all-to-all baseline has no shared expert (valid: 0)");
  Impl& m = *impl_;
  m.shape = shape;
  const int64_t T = shape.num_tokens, H = shape.hidden, K = shape.top_k, R = shape.num_ranks;
  const int64_t pairs = T * K, capacity = R * pairs;
  m.inner_shape = shape;
  m.inner_shape.num_ranks = 1;
  m.inner_shape.num_tokens = capacity;
  m.inner_shape.num_experts = shape.num_local_experts();
  m.inner_shape.top_k = 1;
  for (Communicator* communicator : group) {
    DeviceScope scope(communicator->device());
    auto rank = std::make_unique<Impl::Rank>();
    rank->communicator = communicator;
    rank->counts.allocate(R * 4, "bucket counts");
    rank->perm.allocate(pairs * 4, "bucket order");
    rank->pos.allocate(pairs * 4, "bucket places");
    rank->send_rows.allocate(pairs * H * 2, "send rows");
    rank->send_expert.allocate(pairs * 4, "send experts");
    rank->send_weight.allocate(pairs * 4, "send weights");
    rank->recv_rows.allocate(capacity * H * 2, "received rows");
    rank->recv_expert.allocate(capacity * 4, "received experts");
    rank->recv_weight.allocate(capacity * 4, "received weights");
    rank->inner_top.allocate(capacity * 4, "inner routing");
    rank->ones.allocate(capacity * 4, "unit router weights");
    rank->inner_out.allocate(capacity * H * 2, "inner outputs");
    rank->inner_dx.allocate(capacity * H * 2, "inner dx");
    rank->inner_drw.allocate(capacity * 4, "inner router-weight gradients");
    rank->back_rows.allocate(pairs * H * 2, "returned rows");
    rank->back_drw.allocate(pairs * 4, "returned router-weight gradients");
    std::vector<float> ones(static_cast<size_t>(capacity), 1.0f);
    cuda_check(cudaMemcpy(rank->ones.pointer, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice),
               "unit router weights");
    cuda_check(cudaMemset(rank->recv_weight.pointer, 0, rank->recv_weight.bytes),
               "received weights");
    cuda_check(
        cudaHostAlloc(reinterpret_cast<void**>(&rank->host_counts), R * 4, cudaHostAllocDefault),
        "pinned bucket counts");
    m.ranks.push_back(std::move(rank));
  }
}

EpBaseline::~EpBaseline() = default;

void EpBaseline::forward(const std::vector<ForwardArgs>& args,
                         const std::vector<cudaStream_t>& streams) {
  Impl& m = *impl_;
  const MoeShape& shape = m.shape;
  const int32_t R = shape.num_ranks;
  const int64_t T = shape.num_tokens, H = shape.hidden, K = shape.top_k, pairs = T * K;
  const int32_t experts_per_rank = static_cast<int32_t>(shape.num_local_experts());
  // Bucket sizes, read on the host: the synchronization a user's all-to-all needs.
  for (int32_t i = 0; i < R; ++i) {
    Impl::Rank& rank = *m.ranks[i];
    DeviceScope scope(rank.communicator->device());
    cuda_check(kernels::launch_bucket_pairs(
                   args[i].top_experts.data, args[i].top_experts.dtype, static_cast<int32_t>(pairs),
                   experts_per_rank, R, rank.counts.as<int32_t>(), nullptr, nullptr, streams[i]),
               "bucket count");
    cuda_check(cudaMemcpyAsync(rank.host_counts, rank.counts.pointer, R * 4, cudaMemcpyDeviceToHost,
                               streams[i]),
               "read bucket counts");
  }
  for (int32_t i = 0; i < R; ++i) {
    DeviceScope scope(m.ranks[i]->communicator->device());
    cuda_check(cudaStreamSynchronize(streams[i]), "synchronize for the split sizes");
  }
  for (int32_t i = 0; i < R; ++i) {
    Impl::Rank& rank = *m.ranks[i];
    rank.send_offsets.assign(R + 1, 0);
    rank.recv_offsets.assign(R + 1, 0);
    for (int32_t peer = 0; peer < R; ++peer) {
      rank.send_offsets[peer + 1] = rank.send_offsets[peer] + rank.host_counts[peer];
      rank.recv_offsets[peer + 1] = rank.recv_offsets[peer] + m.ranks[peer]->host_counts[i];
    }
    rank.received = static_cast<int32_t>(rank.recv_offsets[R]);
  }
  for (int32_t i = 0; i < R; ++i) {
    Impl::Rank& rank = *m.ranks[i];
    DeviceScope scope(rank.communicator->device());
    const int32_t routed = static_cast<int32_t>(rank.send_offsets[R]);
    cuda_check(cudaMemsetAsync(rank.pos.pointer, 0xFF, rank.pos.bytes, streams[i]), "clear places");
    cuda_check(kernels::launch_bucket_pairs(args[i].top_experts.data, args[i].top_experts.dtype,
                                            static_cast<int32_t>(pairs), experts_per_rank, R,
                                            rank.counts.as<int32_t>(), rank.perm.as<int32_t>(),
                                            rank.pos.as<int32_t>(), streams[i]),
               "bucket place");
    cuda_check(
        kernels::launch_gather_pair_rows(rank.perm.as<int32_t>(), routed, static_cast<int32_t>(K),
                                         args[i].x.data, H, rank.send_rows.pointer, streams[i]),
        "gather send rows");
    cuda_check(kernels::launch_gather_pair_meta(rank.perm.as<int32_t>(), routed,
                                                args[i].top_experts.data, args[i].top_experts.dtype,
                                                args[i].router_weights.data_as<const float>(),
                                                experts_per_rank, rank.send_expert.as<int32_t>(),
                                                rank.send_weight.as<float>(), streams[i]),
               "gather send metadata");
  }
  using Rank = Impl::Rank;
  m.all_to_all(&Rank::send_rows, &Rank::recv_rows, H, ncclBfloat16, 2, false, streams, "rows");
  m.all_to_all(&Rank::send_expert, &Rank::recv_expert, 1, ncclInt32, 4, false, streams,
               "expert ids");
  m.all_to_all(&Rank::send_weight, &Rank::recv_weight, 1, ncclFloat32, 4, false, streams,
               "router weights");
  for (int32_t i = 0; i < R; ++i) {
    Impl::Rank& rank = *m.ranks[i];
    DeviceScope scope(rank.communicator->device());
    m.select_inner_layer(rank);
    cuda_check(kernels::launch_inner_routing(rank.recv_expert.as<int32_t>(), rank.received,
                                             static_cast<int32_t>(rank.inner_shape.num_tokens),
                                             rank.inner_top.as<int32_t>(), streams[i]),
               "inner routing");
    const ForwardArgs inner_args =
        make_forward_args(rank.inner_shape, m.inner_pointers(rank, args[i], false),
                          DeviceType::kCUDA, rank.communicator->device());
    rank.inner_context = rank.inner->forward(inner_args, streams[i]);
  }
  m.all_to_all(&Rank::inner_out, &Rank::back_rows, H, ncclBfloat16, 2, true, streams,
               "expert outputs");
  for (int32_t i = 0; i < R; ++i) {
    Impl::Rank& rank = *m.ranks[i];
    DeviceScope scope(rank.communicator->device());
    cuda_check(kernels::launch_combine(rank.back_rows.pointer, rank.pos.as<int32_t>(), nullptr,
                                       args[i].router_weights.data_as<const float>(), T, H,
                                       shape.top_k, args[i].out.data, streams[i]),
               "weighted sum");
  }
}

void EpBaseline::backward(const std::vector<BackwardArgs>& args,
                          const std::vector<cudaStream_t>& streams) {
  Impl& m = *impl_;
  const MoeShape& shape = m.shape;
  const int32_t R = shape.num_ranks;
  const int64_t T = shape.num_tokens, H = shape.hidden, K = shape.top_k, pairs = T * K;
  // The forward's buckets and received rows are this step's (saved activations).
  for (const auto& rank : m.ranks)
    if (rank->inner == nullptr)
      throw Error(ErrorCode::kInvalidArgument,
                  "EpBaseline::backward: no forward ran; valid: a backward after a forward");
  for (int32_t i = 0; i < R; ++i) {
    Impl::Rank& rank = *m.ranks[i];
    DeviceScope scope(rank.communicator->device());
    cuda_check(kernels::launch_gather_pair_rows(rank.perm.as<int32_t>(),
                                                static_cast<int32_t>(rank.send_offsets[R]),
                                                static_cast<int32_t>(K), args[i].d_out.data, H,
                                                rank.send_rows.pointer, streams[i]),
               "gather d_out rows");
  }
  // Buffer reuse (the forward's outputs went back already): received d_out rows go to inner_dx,
  // the inner backward's dx rows to inner_out; the received x rows stay for the inner layer.
  using Rank = Impl::Rank;
  m.all_to_all(&Rank::send_rows, &Rank::inner_dx, H, ncclBfloat16, 2, false, streams, "d_out rows");
  for (int32_t i = 0; i < R; ++i) {
    Impl::Rank& rank = *m.ranks[i];
    DeviceScope scope(rank.communicator->device());
    LayerPointers pointers = m.inner_pointers(rank, args[i].forward, true);
    pointers.d_out = rank.inner_dx.pointer;
    pointers.d_x = rank.inner_out.pointer;
    pointers.d_router_weights = rank.inner_drw.pointer;
    pointers.d_w_gate = args[i].d_w_gate.data;
    pointers.d_w_up = args[i].d_w_up.data;
    pointers.d_w_down = args[i].d_w_down.data;
    const BackwardArgs inner_args = make_backward_args(
        rank.inner_shape, pointers, DeviceType::kCUDA, rank.communicator->device());
    rank.inner->backward(inner_args, streams[i], &rank.inner_context);
  }
  m.all_to_all(&Rank::inner_out, &Rank::back_rows, H, ncclBfloat16, 2, true, streams, "dx rows");
  m.all_to_all(&Rank::inner_drw, &Rank::back_drw, 1, ncclFloat32, 4, true, streams,
               "router-weight gradients");
  for (int32_t i = 0; i < R; ++i) {
    Impl::Rank& rank = *m.ranks[i];
    DeviceScope scope(rank.communicator->device());
    cuda_check(kernels::launch_combine(rank.back_rows.pointer, rank.pos.as<int32_t>(), nullptr,
                                       nullptr, T, H, shape.top_k, args[i].d_x.data, streams[i]),
               "d_x sum");
    cuda_check(kernels::launch_scatter_by_pair(
                   rank.pos.as<int32_t>(), static_cast<int32_t>(pairs), rank.back_drw.as<float>(),
                   args[i].d_router_weights.data_as<float>(), streams[i]),
               "router-weight gradients");
  }
}

}  // namespace mok
