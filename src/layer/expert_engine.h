// How a layer's expert GEMMs run, per direction, chosen once when the layer is built
// (make_forward_engine / make_backward_engine, from MoeConfig):
//   forward   TwoKernelForward: the gate/up GEMM with SwiGLU, then the down GEMM, per expert set
//             and macrobatch, the shared expert's after the routed rows went back;
//             PersistentForward (MoeConfig::persistent_forward): both GEMMs of every tile of a
//             macrobatch in one persistent kernel, the shared expert's tiles in the last launch
//   backward  SequenceBackward: recompute, down dgrad, SwiGLU backward, gate/up dgrad and weight
//             gradients as a kernel sequence per expert set and macrobatch;
//             PersistentBackward (MoeConfig::persistent_backward, one macrobatch): all of them
//             in one persistent kernel, the shared expert's tasks in the same ticket stream and,
//             where the exchange allows, the row gathers on its spare warps. With several
//             macrobatches the layer runs the SequenceBackward (design.md says why).
//   FP8 (MoeConfig::precision = kFP8Block): Fp8Forward / Fp8Backward, the kernel sequences on
//             e4m3 operands with block scales (layer/fp8_stages.cpp), one macrobatch
// Same bits whichever bf16 engine runs (tests). Every function enqueues work on `stream`.
#pragma once

#include <memory>

#include "layer/gpu_layer_state.h"
#include "layer/token_exchange.h"

namespace mok {

class ForwardEngine {
 public:
  virtual ~ForwardEngine() = default;
  // Macrobatch m of the routed experts from the rows (or the fused gather) the exchange gave;
  // `shared` is the shared expert on macrobatch 0 (null otherwise, or without one or tokens):
  // an engine that runs it with the routed tiles does it here.
  virtual void macrobatch(const GpuLayer::State& s, const ExpertSetForward& routed,
                          const ExpertSetForward* shared, const kernels::FusedGather& gather,
                          int32_t m, cudaStream_t stream, const StageMarker& mark) = 0;
  // After the routed rows went back: the shared expert, if this engine runs it apart.
  virtual void shared_expert(const GpuLayer::State& s, const ExpertSetForward* shared,
                             cudaStream_t stream, const StageMarker& mark) = 0;
};

class BackwardEngine {
 public:
  virtual ~BackwardEngine() = default;
  // Whether this engine gathers the macrobatch's rows inside its kernel (BackwardRows).
  virtual bool gathers_in_kernel() const = 0;
  // Whether a backward without weight gradients (frozen weights, BackwardArgs) can skip them.
  virtual bool skips_weight_gradients() const { return true; }
  // Whether the down dgrad GEMM runs BackwardRows::d_out's gather in its producer warps (the
  // kernel sequence; the expert-parallel exchange's pull under MoeConfig::ep_dispatch_in_gemm).
  virtual bool dgrad_gathers_d_out() const { return false; }
  // Macrobatch m of the routed experts (`recompute`: g and u again first); `shared` as in
  // ForwardEngine::macrobatch.
  virtual void macrobatch(const GpuLayer::State& s, const ExpertSetBackward& routed,
                          const ExpertSetBackward* shared, bool recompute, const BackwardRows& rows,
                          int32_t m, cudaStream_t stream, const StageMarker& mark) = 0;
  // After the routed dx rows went back: the shared expert, if this engine runs it apart.
  virtual void shared_expert(const GpuLayer::State& s, const ExpertSetBackward* shared,
                             bool recompute, cudaStream_t stream, const StageMarker& mark) = 0;
};

std::unique_ptr<ForwardEngine> make_forward_engine(const GpuLayer::State& s);
// `exchange` says whether the rows can be gathered inside the persistent backward.
std::unique_ptr<BackwardEngine> make_backward_engine(const GpuLayer::State& s,
                                                     const TokenExchange& exchange);

}  // namespace mok
