// The single-GPU token exchange (layer/token_exchange.h): the routing schedule of this GPU's
// own tokens, the gathers of their x and d_out rows into the ring (a gather kernel, or the
// fused gathers the GEMMs' producer warps run: MoeConfig::local_dispatch), and the combine of
// the expert rows, which stay where the GEMMs left them.
#include <cuda_bf16.h>

#include "kernels/stages/launch.h"
#include "layer/gpu_layer_state.h"
#include "layer/token_exchange.h"
#include "mok/schedule_gpu.h"

namespace mok {

namespace {

// A gather for the expert stages to run: the routed rows of `source` [T, H] for schedule rows
// [row_begin, row_begin + row_count) into `rows` (at row - row_begin). The FP8 stages take it
// as it is (they quantize the rows as they gather them); fused_gather adds the counters.
kernels::FusedGather stage_gather(const GpuLayer::State& s, const TensorView& source,
                                  const DeviceBuffer& rows, int64_t row_begin, int64_t row_count) {
  kernels::FusedGather gather{};
  gather.x = source.data_as<const __nv_bfloat16>();
  gather.rows = rows.as<__nv_bfloat16>();
  gather.hidden = static_cast<int32_t>(s.shape.hidden);
  gather.top_k = s.shape.top_k;
  gather.row_begin = row_begin;
  gather.row_end = row_begin + row_count;
  return gather;
}

}  // namespace

kernels::FusedGather fused_gather(const GpuLayer::State& s, const TensorView& source,
                                  const DeviceBuffer& rows, unsigned long long* counters,
                                  int64_t row_begin, int64_t row_count) {
  const kernels::GatherCounterLayout layout = s.gather_counters;
  kernels::FusedGather gather = stage_gather(s, source, rows, row_begin, row_count);
  gather.ticket = counters + layout.ticket();
  gather.epoch = counters + layout.epoch();
  gather.tile_rows_done = counters + layout.tile_rows_done();
  return gather;
}

namespace {

// Walked by token: each token's row is read once (docs/design.md, "The gathers").
void gather_rows(const GpuLayer::State& s, const TensorView& source, const DeviceBuffer& rows,
                 int64_t row_begin, cudaStream_t stream, const char* what) {
  const ScheduleView view = s.routed.view();
  cuda_check(kernels::launch_gather_rows_by_token(
                 view.header, view.row_pair, view.pair_row, source.data, s.shape.num_tokens,
                 s.shape.hidden, s.shape.top_k, rows.pointer, s.ring_rows, s.on(stream), row_begin),
             what);
}

class LocalExchange final : public TokenExchange {
 public:
  // `stage_gathers`: the expert stages gather the rows themselves (FP8: quantized as gathered).
  LocalExchange(LocalDispatch dispatch, bool stage_gathers)
      : dispatch_(dispatch), stage_gathers_(stage_gathers) {}

  void route_forward(GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                     const StageMarker& mark) override {
    build_schedule(s, args.top_experts, stream);
    mark("schedule");
  }

  kernels::FusedGather forward_rows(GpuLayer::State& s, const ForwardArgs& args, int32_t m,
                                    cudaStream_t stream, const StageMarker& mark) override {
    const int64_t row_begin = m * s.ring_rows;
    if (stage_gathers_ && s.shape.num_tokens > 0)  // with the counters: fp8_gather_in_gate_up
      return fused_gather(s, args.x, s.rows, s.gather_state.as<unsigned long long>(), row_begin,
                          s.ring_rows);
    if (dispatch_ == LocalDispatch::kProducerWarps && s.shape.num_tokens > 0)
      return fused_gather(s, args.x, s.rows, s.gather_state.as<unsigned long long>(), row_begin,
                          s.ring_rows);
    gather_rows(s, args.x, s.rows, row_begin, stream, "gather launch");
    mark("gather");
    return {};
  }

  kernels::RowPush gemm_push(GpuLayer::State&) override { return {}; }

  RouterWeightRoute route_backward(GpuLayer::State& s, const BackwardArgs& args, bool use_context,
                                   cudaStream_t stream, const StageMarker& mark) override {
    if (!use_context) {
      build_schedule(s, args.forward.top_experts, stream);
      mark("schedule");
    }
    // Pairs not routed here (expert -1) keep 0; the SwiGLU backward writes the routed ones.
    cuda_check(
        cudaMemsetAsync(args.d_router_weights.data, 0, args.d_router_weights.nbytes(), stream),
        "zero d_router_weights");
    RouterWeightRoute route;
    route.weights = args.forward.router_weights.data_as<const float>();
    route.grads = args.d_router_weights.data_as<float>();
    return route;
  }

  BackwardRows backward_rows(GpuLayer::State& s, const BackwardArgs& args, int32_t m,
                             bool recompute, bool in_kernel, cudaStream_t stream,
                             const StageMarker& mark) override {
    BackwardRows rows;
    if (stage_gathers_ && s.shape.num_tokens > 0) {  // one macrobatch (FP8)
      const int64_t max_rows = s.routed.layout.params.max_rows();
      rows.d_out = stage_gather(s, args.d_out, s.d_out_rows, 0, max_rows);
      if (recompute) rows.x = stage_gather(s, args.forward.x, s.rows, 0, max_rows);
      return rows;
    }
    if (in_kernel) {
      // One macrobatch: the whole schedule.
      const int64_t max_rows = s.routed.layout.params.max_rows();
      rows.d_out = fused_gather(
          s, args.d_out, s.d_out_rows,
          s.counter(s.persistent_backward_state, s.backward_counters.d_out_gather()), 0, max_rows);
      if (recompute)
        rows.x = fused_gather(
            s, args.forward.x, s.rows,
            s.counter(s.persistent_backward_state, s.backward_counters.x_gather()), 0, max_rows);
      return rows;
    }
    const int64_t row_begin = m * s.ring_rows;
    if (recompute) gather_rows(s, args.forward.x, s.rows, row_begin, stream, "gather launch");
    gather_rows(s, args.d_out, s.d_out_rows, row_begin, stream, "gather d_out launch");
    mark(recompute ? "gather x, d_out" : "gather d_out");
    return rows;
  }

  bool gathers_in_kernel() const override { return dispatch_ == LocalDispatch::kProducerWarps; }

  void return_rows(GpuLayer::State&, cudaStream_t, const StageMarker&, const char*) override {}

  void combine(GpuLayer::State& s, const TensorView&, const void* shared, const float* weights,
               void* out, cudaStream_t stream) override {
    cuda_check(kernels::launch_combine(s.expert_out.pointer, s.routed.view().pair_row, shared,
                                       weights, s.shape.num_tokens, s.shape.hidden, s.shape.top_k,
                                       out, s.on(stream)),
               "combine launch");
  }

  void finish_backward(GpuLayer::State&, const BackwardArgs&, cudaStream_t) override {}

  bool profiles() const override { return true; }

 private:
  static void build_schedule(GpuLayer::State& s, const TensorView& top_experts,
                             cudaStream_t stream) {
    launch_build_schedule(s.routed.layout, top_experts.data, top_experts.dtype,
                          s.routed.schedule.pointer, stream)
        .throw_if_error();
  }

  LocalDispatch dispatch_;
  bool stage_gathers_;
};

}  // namespace

std::unique_ptr<TokenExchange> make_local_exchange(const MoeConfig& config) {
  // The FP8 GEMMs read quantized rows: the FP8 stages quantize the rows as they gather them.
  if (config.precision == Precision::kFP8Block)
    return std::make_unique<LocalExchange>(LocalDispatch::kGatherKernel, true);
  return std::make_unique<LocalExchange>(config.local_dispatch, false);
}

}  // namespace mok
