// The expert-parallel token exchange of one rank (ep_exchange.h): what the layer's pipeline
// (src/layer/gpu_layer.cpp) runs where a single GPU gathers and combines locally.
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
// With MoeConfig::ep_dispatch_in_gemm no dispatch kernel runs in the forward: the gate/up
// GEMM's producer warps read each row from its source rank's published x (forward_rows: the
// fused gather with peer sources). Those reads sit where the pull did, after the exchange and
// before this rank's push combine, so the ordering above holds. The received rows are then not
// filled: a backward that recomputes a macrobatch pulls x first (route_backward). The push
// combine moves into the down GEMM's epilogue too (gemm_push): each tile's rows of other
// ranks' pairs go to their slots as the tile is stored, after the call's exchange as the push
// kernel's did, and return_rows launches only the push's signal, behind the GEMMs on the
// stream. The backward's dx rows leave the gate/up dgrad's epilogue the same way, after the
// backward's exchange (or barrier), which every rank enters after its forward's combine; and
// the d_out rows are pulled from the source ranks' published d_out after that same barrier, by
// the down dgrad GEMM's producer warps (the kernel sequence) or the persistent backward's spare
// warps, which also pull the x rows when they recompute (backward_rows). A rank publishes its
// next d_out only in its next backward, after the next forward's exchange, which every rank
// enters only once this backward is done.
#include "comm/ep_exchange.h"

#include <string>

#include "kernels/stages/launch.h"
#include "layer/expert_engine.h"
#include "layer/gpu_layer_state.h"
#include "mok/schedule_gpu.h"

namespace mok {

namespace {

using kernels::EpCounter;

void publish(void* destination, const TensorView& source, cudaStream_t stream, const char* what) {
  cuda_check(cudaMemcpyAsync(destination, source.data, static_cast<size_t>(source.nbytes()),
                             cudaMemcpyDeviceToDevice, stream),
             std::string("publish ") + what);
}

class EpExchange final : public TokenExchange {
 public:
  explicit EpExchange(EpRank& ep) : ep_(ep) {}

  void route_forward(GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                     const StageMarker& mark) override {
    if (!ep_.push_dispatch) publish(ep_.local(ep_.memory->x), args.x, stream, "x");
    // The exchange is also the barrier after which every rank's published x may be read.
    exchange(s, &args.top_experts, args.router_weights.data_as<const float>(), stream);
    build_schedule(s, args.top_experts, stream);
    mark("routing exchange + schedule");
    if (ep_.dispatch_in_gemm) return;  // the gate/up GEMM pulls the rows (forward_rows)
    receive_rows(s, args.x, ep_.memory->x, ep_.received, ep_.memory->received_x, stream);
    mark(ep_.push_dispatch ? "push dispatch" : "pull dispatch");
  }

  kernels::FusedGather forward_rows(GpuLayer::State& s, const ForwardArgs& args, int32_t m,
                                    cudaStream_t stream, const StageMarker&) override {
    if (gemms_move_rows(s))
      return pull_gather(s, args.x, ep_.memory->x, s.rows, s.gather_state.as<unsigned long long>(),
                         m * s.ring_rows, s.ring_rows);
    expand_received(s, false, args.x.data, s.rows.pointer, m * s.ring_rows, stream);
    return {};
  }

  RouterWeightRoute route_backward(GpuLayer::State& s, const BackwardArgs& args, bool use_context,
                                   cudaStream_t stream, const StageMarker& mark) override {
    const ForwardArgs& fwd = args.forward;
    // Pairs not routed anywhere keep 0; the expert ranks write the routed ones after the barrier.
    cuda_check(cudaMemsetAsync(ep_.local<float>(ep_.memory->d_rw), 0,
                               static_cast<size_t>(s.shape.num_tokens * s.shape.top_k * 4), stream),
               "zero router-weight gradients");
    if (!ep_.push_dispatch) publish(ep_.local(ep_.memory->d_out), args.d_out, stream, "d_out");
    if (use_context) {
      // A barrier: every rank published its d_out (pull), or finished reading its receive
      // buffers (push).
      exchange(s, nullptr, nullptr, stream);
    } else {
      if (!ep_.push_dispatch) publish(ep_.local(ep_.memory->x), fwd.x, stream, "x");
      exchange(s, &fwd.top_experts, fwd.router_weights.data_as<const float>(), stream);
      build_schedule(s, fwd.top_experts, stream);
    }
    const bool pulls = pulls_d_out(s);
    if (!pulls)  // else the down dgrad GEMM or the persistent backward pulls them (backward_rows)
      receive_rows(s, args.d_out, ep_.memory->d_out, ep_.received_d_out, ep_.memory->received_d_out,
                   stream);
    // With the context, the forward's received x rows are still here: the macrobatches the
    // backward recomputes expand them again. A forward that pulled its rows inside the GEMM
    // left none: they are pulled now if a macrobatch is recomputed (the published x is still
    // the context's: a later forward would have replaced the context), by the persistent
    // backward itself where it runs.
    if ((!use_context || (ep_.dispatch_in_gemm && s.num_macrobatches > 1)) && !pulls_in_kernel(s))
      receive_rows(s, fwd.x, ep_.memory->x, ep_.received, ep_.memory->received_x, stream);
    mark(use_context ? (pulls ? "barrier" : "barrier + d_out dispatch")
                     : (pulls ? "routing exchange + schedule + x dispatch"
                              : "routing exchange + schedule + d_out, x dispatch"));
    // Each pair's gradient goes to its source rank's buffer; the weights are every rank's,
    // gathered by the exchange.
    RouterWeightRoute route;
    route.weights = ep_.local<float>(ep_.memory->weights);
    route.grad_peers = ep_.peers<float>(ep_.memory->d_rw);
    route.pairs_per_rank = static_cast<int32_t>(s.shape.num_tokens * s.shape.top_k);
    return route;
  }

  BackwardRows backward_rows(GpuLayer::State& s, const BackwardArgs& args, int32_t m,
                             bool recompute, bool in_kernel, cudaStream_t stream,
                             const StageMarker&) override {
    const int64_t row_begin = m * s.ring_rows;
    BackwardRows rows;
    if (in_kernel && gemms_move_rows(s)) {
      // The persistent backward (one macrobatch): its spare producer warps pull the d_out rows
      // and, recomputing, the x rows, each from its source rank's published buffer.
      const int64_t max_rows = s.routed.layout.params.max_rows();
      rows.d_out = pull_gather(
          s, args.d_out, ep_.memory->d_out, s.d_out_rows,
          s.counter(s.persistent_backward_state, s.backward_counters.d_out_gather()), 0, max_rows);
      if (recompute)
        rows.x = pull_gather(s, args.forward.x, ep_.memory->x, s.rows,
                             s.counter(s.persistent_backward_state, s.backward_counters.x_gather()),
                             0, max_rows);
      return rows;
    }
    if (pulls_d_out(s))
      rows.d_out = pull_gather(s, args.d_out, ep_.memory->d_out, s.d_out_rows,
                               s.gather_state.as<unsigned long long>(), row_begin, s.ring_rows);
    else
      expand_received(s, true, args.d_out.data, s.d_out_rows.pointer, row_begin, stream);
    if (recompute)
      expand_received(s, false, args.forward.x.data, s.rows.pointer, row_begin, stream);
    return rows;
  }

  // With the communication inside the GEMMs the persistent backward pulls its rows itself
  // (backward_rows); else they come expanded from the pull or push dispatch.
  bool gathers_in_kernel() const override { return ep_.dispatch_in_gemm; }

  kernels::RowPush gemm_push(GpuLayer::State& s) override {
    if (!gemms_move_rows(s)) return {};
    return {ep_.peers(ep_.memory->slots), s.routed.view().row_pair,
            static_cast<int32_t>(s.shape.num_tokens * s.shape.top_k), ep_.rank};
  }

  // Pushes s.expert_out's rows into their source ranks' slots and waits for every rank's pushes.
  void return_rows(GpuLayer::State& s, cudaStream_t stream, const StageMarker& mark,
                   const char* name) override {
    const ScheduleView view = s.routed.view();
    kernels::PushRowsArgs push = kernels::push_rows_args(
        view, s.expert_out.pointer, s.shape.hidden,
        static_cast<int32_t>(s.shape.num_tokens * s.shape.top_k), ep_.peers(ep_.memory->slots),
        ep_.peers<uint64_t>(ep_.memory->push_flags), ep_.rank, ep_.num_ranks,
        counter(EpCounter::kPushEpoch));
    // After GEMMs that pushed the rows (gemm_push), only the signal.
    push.signal_only = gemms_move_rows(s) ? 1 : 0;
    cuda_check(kernels::launch_push_rows(push, ep_.row_copy, push.signal_only ? 1 : ep_.comm_ctas,
                                         s.wait_context(), stream),
               "push combine launch");
    cuda_check(
        kernels::launch_wait_for_peers(ep_.local<uint64_t>(ep_.memory->push_flags), ep_.num_ranks,
                                       counter(EpCounter::kPushEpoch), s.wait_context(), stream),
        "wait for every rank's push");
    cuda_check(kernels::launch_advance_epoch(counter(EpCounter::kPushEpoch), stream),
               "advance the push epoch");
    mark(name);
  }

  // The fixed-order sum of this rank's slots (weights null = 1) with the shared expert's rows.
  void combine(GpuLayer::State& s, const TensorView& top_experts, const void* shared,
               const float* weights, void* out, cudaStream_t stream) override {
    const int64_t T = s.shape.num_tokens, K = s.shape.top_k;
    // This rank's own pairs are read from the expert rows in place (the push skipped them).
    const int32_t* own_pair_row = s.routed.view().pair_row + static_cast<int64_t>(ep_.rank) * T * K;
    cuda_check(
        kernels::launch_slot_index(top_experts.data, top_experts.dtype, T * K, s.shape.num_experts,
                                   own_pair_row, ep_.slot_index.as<int32_t>(), stream),
        "slot index launch");
    cuda_check(kernels::launch_combine(ep_.local(ep_.memory->slots), ep_.slot_index.as<int32_t>(),
                                       shared, weights, T, s.shape.hidden, s.shape.top_k, out,
                                       stream, s.expert_out.pointer),
               "combine launch");
  }

  // This rank's gathered router-weight gradients into the caller's tensor.
  void finish_backward(GpuLayer::State&, const BackwardArgs& args, cudaStream_t stream) override {
    cuda_check(cudaMemcpyAsync(args.d_router_weights.data, ep_.local<float>(ep_.memory->d_rw),
                               static_cast<size_t>(args.d_router_weights.nbytes()),
                               cudaMemcpyDeviceToDevice, stream),
               "copy router-weight gradients");
  }

  // A rank's calls wait for every rank, so one rank's synchronizing profile loop would wait for
  // the others until the device timeout.
  bool profiles() const override { return false; }

 private:
  unsigned long long* counter(EpCounter which) const {
    return ep_.counters.as<unsigned long long>() + static_cast<int32_t>(which);
  }

  // The exchange kernel: the routing and router weights of this call when `top_experts` is set,
  // else no payload (a barrier of the group).
  void exchange(GpuLayer::State& s, const TensorView* top_experts, const float* router_weights,
                cudaStream_t stream) {
    const int64_t pairs = s.shape.num_tokens * s.shape.top_k;
    kernels::RoutingExchangeArgs args;
    args.top_experts = top_experts != nullptr ? top_experts->data : nullptr;
    args.bytes_per_rank = top_experts != nullptr ? pairs * dtype_size(top_experts->dtype) : 0;
    args.routing_peers = ep_.peers(ep_.memory->routing);
    args.weights = router_weights;
    args.weight_bytes_per_rank = router_weights != nullptr ? pairs * 4 : 0;
    args.weight_peers = ep_.peers(ep_.memory->weights);
    args.flag_peers = ep_.peers<uint64_t>(ep_.memory->exchange_flags);
    args.rank = ep_.rank;
    args.num_ranks = ep_.num_ranks;
    args.epoch = counter(EpCounter::kExchangeEpoch);
    args.wait = s.wait_context();
    cuda_check(kernels::launch_routing_exchange(args, stream), "routing exchange launch");
    cuda_check(kernels::launch_advance_epoch(counter(EpCounter::kExchangeEpoch), stream),
               "advance the exchange epoch");
  }

  // Brings the routed rows of every rank's `source` (x or d_out) to this rank, one per receive
  // entry. Pull: read from the peers' published copies (`published`, filled before the
  // exchange) into the local `pulled` buffer. Push: every rank writes its own rows into the
  // receivers' `pushed` buffers (send entries from this call's routing), then waits for every
  // rank's signal.
  void receive_rows(GpuLayer::State& s, const TensorView& source,
                    const std::unique_ptr<SymmetricMemory>& published, DeviceBuffer& pulled,
                    const std::unique_ptr<SymmetricMemory>& pushed, cudaStream_t stream) {
    if (ep_.push_dispatch) {
      kernels::PushDispatchArgs push;
      push.send_entry = ep_.send_entry.as<int32_t>();
      push.source = source.data;
      push.received_peers = ep_.peers(pushed);
      push.vectors_per_row = s.shape.hidden / 8;
      push.num_tokens = static_cast<int32_t>(s.shape.num_tokens);
      push.rank = ep_.rank;
      push.num_ranks = ep_.num_ranks;
      push.flag_peers = ep_.peers<uint64_t>(ep_.memory->dispatch_flags);
      push.done = counter(EpCounter::kDispatchDone);
      push.epoch = counter(EpCounter::kDispatchEpoch);
      cuda_check(kernels::launch_push_dispatch(push, ep_.comm_ctas, stream),
                 "push dispatch launch");
      cuda_check(kernels::launch_wait_for_peers(ep_.local<uint64_t>(ep_.memory->dispatch_flags),
                                                ep_.num_ranks, counter(EpCounter::kDispatchEpoch),
                                                s.wait_context(), stream),
                 "wait for every rank's dispatch");
      cuda_check(kernels::launch_advance_epoch(counter(EpCounter::kDispatchEpoch), stream),
                 "advance the dispatch epoch");
    } else {
      const kernels::PullRowsArgs pull =
          kernels::pull_rows_args(s.routed.view(), ep_.peers(published), s.shape.hidden, ep_.rank,
                                  ep_.num_ranks, pulled.pointer);
      cuda_check(
          kernels::launch_pull_rows(pull, ep_.row_copy, ep_.comm_ctas, s.wait_context(), stream),
          "pull dispatch launch");
    }
  }

  // After the exchange: the schedule and, for a push dispatch, this rank's send entries.
  void build_schedule(GpuLayer::State& s, const TensorView& top_experts, cudaStream_t stream) {
    launch_build_schedule(s.routed.layout, ep_.local(ep_.memory->routing), top_experts.dtype,
                          s.routed.schedule.pointer, stream)
        .throw_if_error();
    if (ep_.push_dispatch)
      cuda_check(
          kernels::launch_send_entries(s.routed.layout.params, ep_.local(ep_.memory->routing),
                                       top_experts.dtype, ep_.send_entry.as<int32_t>(), stream),
          "send entries launch");
  }

  // The received x rows (d_out rows with `d_out`) of schedule rows [row_begin, row_begin +
  // ring_rows) into `rows` (a macrobatch's ring); this rank's own rows come from
  // `local_source` (its x or d_out), which no dispatch copies.
  void expand_received(GpuLayer::State& s, bool d_out, const void* local_source, void* rows,
                       int64_t row_begin, cudaStream_t stream) {
    const void* received =
        ep_.push_dispatch ? ep_.local(d_out ? ep_.memory->received_d_out : ep_.memory->received_x)
                          : (d_out ? ep_.received_d_out : ep_.received).pointer;
    cuda_check(
        kernels::launch_expand_received(
            kernels::expand_received_args(s.routed.view(), received, local_source, s.shape.hidden,
                                          ep_.rank, rows, row_begin, s.ring_rows),
            stream),
        "expand received rows");
  }

  // Whether the GEMMs pull and push the rows (MoeConfig::ep_dispatch_in_gemm), with rows to
  // move (T is the same on every rank).
  bool gemms_move_rows(const GpuLayer::State& s) const {
    return ep_.dispatch_in_gemm && s.shape.num_tokens > 0;
  }
  // Whether the backward's engine pulls the rows itself: the persistent backward's spare warps
  // (d_out, and x when it recomputes), or the kernel sequence's down dgrad GEMM (d_out).
  bool pulls_in_kernel(const GpuLayer::State& s) const {
    return gemms_move_rows(s) && s.backward_engine->gathers_in_kernel();
  }
  bool pulls_d_out(const GpuLayer::State& s) const {
    return gemms_move_rows(s) &&
           (s.backward_engine->gathers_in_kernel() || s.backward_engine->dgrad_gathers_d_out());
  }
  // The local exchange's fused gather of schedule rows [row_begin, row_begin + row_count) into
  // `rows` with `counters`, each row read from its source rank's published `symmetric` buffer
  // (x or d_out): the pull dispatch in a kernel's producer warps.
  kernels::FusedGather pull_gather(GpuLayer::State& s, const TensorView& source,
                                   const std::unique_ptr<SymmetricMemory>& symmetric,
                                   const DeviceBuffer& rows, unsigned long long* counters,
                                   int64_t row_begin, int64_t row_count) const {
    const ScheduleView view = s.routed.view();
    kernels::FusedGather gather = fused_gather(s, source, rows, counters, row_begin, row_count);
    gather.peer_x = ep_.peers<const __nv_bfloat16>(symmetric);
    gather.row_recv = view.row_recv;
    gather.recv_offsets = view.recv_offsets;
    gather.recv_tokens = view.recv_tokens;
    gather.num_ranks = ep_.num_ranks;
    return gather;
  }

  EpRank& ep_;
};

}  // namespace

std::unique_ptr<TokenExchange> make_ep_exchange(EpRank& ep) {
  return std::make_unique<EpExchange>(ep);
}

}  // namespace mok
