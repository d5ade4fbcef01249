// How the tokens of a layer call reach this rank's experts and how the experts' rows leave:
// the part of the layer's pipeline (gpu_layer.cpp) that differs between one GPU on its own and
// a rank of an expert-parallel group. The layer picks one when it is built:
//   LocalExchange (local_exchange.cpp)  the schedule of this GPU's routing, the gather of x and
//                                       d_out rows (a kernel, or the fused gathers of the GEMMs'
//                                       producer warps), the combine of the expert rows
//   EpExchange (src/comm/ep_exchange.h) the routing all-gather and this rank's schedule, the
//                                       pull (or push) dispatch and the expansion of the
//                                       received rows, the push combine into the source ranks'
//                                       slots and the combine of this rank's slots
// Every function enqueues work on `stream` and never synchronizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/gemm/expert_gemm_params.h"
#include "layer/gpu_layer_state.h"
#include "mok/layer_args.h"

namespace mok {

// The rows of one macrobatch the backward's GEMMs read: gathered into the ring before them, or
// gathered inside the persistent backward by the gathers whose `x` is set.
struct BackwardRows {
  kernels::FusedGather d_out{};  // x null: nothing to gather in the kernel
  kernels::FusedGather x{};
};

class TokenExchange {
 public:
  virtual ~TokenExchange() = default;

  // Forward: this rank's schedule of the call's routing (and, expert parallel, the routed rows
  // of every rank brought here).
  virtual void route_forward(GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                             const StageMarker& mark) = 0;
  // The x rows of macrobatch m into s.rows; or the fused gather the gate/up GEMM runs instead.
  virtual kernels::FusedGather forward_rows(GpuLayer::State& s, const ForwardArgs& args, int32_t m,
                                            cudaStream_t stream, const StageMarker& mark) = 0;

  // Backward: the schedule again without a context, the d_out rows (and x rows) brought here,
  // d_router_weights prepared; returns where the SwiGLU backward reads router weights and
  // writes their gradients.
  virtual RouterWeightRoute route_backward(GpuLayer::State& s, const BackwardArgs& args,
                                           bool use_context, cudaStream_t stream,
                                           const StageMarker& mark) = 0;
  // The d_out rows of macrobatch m into s.d_out_rows, and the x rows into s.rows when
  // `recompute`; with `in_kernel` (the engine gathers rows inside its kernel: see
  // gathers_in_kernel) the gathers to run there instead.
  virtual BackwardRows backward_rows(GpuLayer::State& s, const BackwardArgs& args, int32_t m,
                                     bool recompute, bool in_kernel, cudaStream_t stream,
                                     const StageMarker& mark) = 0;
  // Whether the rows can be gathered inside the persistent backward kernel (this GPU's own
  // tensors, with the producer warps' local dispatch).
  virtual bool gathers_in_kernel() const = 0;

  // The push the GEMM that makes the next return_rows's rows runs in its epilogue (the
  // forward's down GEMM, the backward's gate/up dgrad: the rows of other ranks' pairs into
  // their slots), or none: return_rows pushes them after the GEMMs (on one GPU nothing moves).
  virtual kernels::RowPush gemm_push(GpuLayer::State& s) = 0;
  // After the routed experts' GEMMs: their rows (s.expert_out) go to the ranks that sent them
  // (nothing to do on one GPU; after GEMMs that pushed them, gemm_push, only the signal).
  virtual void return_rows(GpuLayer::State& s, cudaStream_t stream, const StageMarker& mark,
                           const char* name) = 0;
  // The fixed-order sum of the routed pairs' rows (weighted by `weights`, null = 1) after the
  // shared expert's rows (`shared`, or null) into `out` [T, H].
  virtual void combine(GpuLayer::State& s, const TensorView& top_experts, const void* shared,
                       const float* weights, void* out, cudaStream_t stream) = 0;
  // The backward's last step: the router-weight gradients into args.d_router_weights where
  // they were written elsewhere.
  virtual void finish_backward(GpuLayer::State& s, const BackwardArgs& args,
                               cudaStream_t stream) = 0;
  // Whether stage profiles may run (a rank of a group waits for every rank in each call).
  virtual bool profiles() const = 0;
};

// The fused gather (dispatch_local.cuh) of `source`'s routed rows [T, H] for schedule rows
// [row_begin, row_begin + row_count) into `rows` (at row - row_begin), with its ticket, epoch
// and per-tile counts at `counters` (a GatherCounterLayout of the schedule's tiles; the forward's
// are s.gather_state). local_exchange.cpp; the expert-parallel exchange adds the peer sources.
kernels::FusedGather fused_gather(const GpuLayer::State& s, const TensorView& source,
                                  const DeviceBuffer& rows, unsigned long long* counters,
                                  int64_t row_begin, int64_t row_count);

// The single-GPU exchange (local_exchange.cpp).
std::unique_ptr<TokenExchange> make_local_exchange(const MoeConfig& config);

}  // namespace mok
