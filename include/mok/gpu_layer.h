// The MoE layer on one GPU (EP = 1): the host runtime that owns the workspace and launches the
// device kernels. By default each direction runs as a short sequence of kernels (forward:
// schedule, gate/up GEMM with the local dispatch and SwiGLU fused, down GEMM, combine;
// backward: d_out gather, down dgrad, SwiGLU backward with the router-weight gradient, gate/up
// dgrad, weight gradients, d_x combine; without a forward context also the schedule and the
// gate/up recompute). MoeConfig::persistent_forward / persistent_backward run each direction's
// GEMMs (and the backward's gathers and SwiGLU) as one persistent kernel instead, behind the
// same API and with the same bits.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mok/config.h"
#include "mok/error.h"
#include "mok/layer_args.h"
#include "mok/shape.h"
#include "mok/task_trace.h"

namespace mok {

// Names the intermediates a forward left in the layer's workspace (the routing schedule, the
// gathered x rows, and bf16 g and u of every row), which a
// backward of the same inputs can start from instead of recomputing them. Valid until the next
// forward, or the next backward without a context (it recomputes into the same workspace), on
// the same layer.
struct ForwardContext {
  uint64_t generation = 0;
};

// One stage of a profile (GpuLayer::profile_forward / profile_backward): the median of its
// times over the runs, and the median of its SM clocks. A stage's SM clock is measured on the
// device, by a probe before and after it: each SM's cycles over the nanoseconds between them,
// the median over the SMs (0 when the probes could not pair an SM). Under the card's power
// limit it falls below the boost clock; a stage slower in the layer than alone at a lower clock
// pays for the energy of the work around it.
struct StageTime {
  std::string name;
  float ms = 0;
  float sm_clock_ghz = 0;
};

class GpuLayer {
 public:
  // Allocates the workspace for `shape` on the current CUDA device; throws mok::Error if the
  // shape or config cannot be implemented (naming the field) or memory runs out.
  GpuLayer(const MoeShape& shape, const MoeConfig& config);
  ~GpuLayer();
  GpuLayer(const GpuLayer&) = delete;
  GpuLayer& operator=(const GpuLayer&) = delete;

  // Runs the forward on `stream` with CUDA tensors; validates the arguments on the host first
  // and launches nothing if they are wrong. No host synchronization.
  ForwardContext forward(const ForwardArgs& args, cudaStream_t stream);

  // Runs the backward on `stream` with CUDA tensors: d_x, d_router_weights and every weight
  // gradient. args.forward holds the forward's inputs. With the context of the latest forward
  // (of these same inputs) it starts from the kept intermediates; without one it recomputes
  // them. A stale context is an error. Validates first; no host synchronization.
  void backward(const BackwardArgs& args, cudaStream_t stream,
                const ForwardContext* context = nullptr);

  // True when `context` is the latest forward's and its intermediates are still in the workspace
  // (a backward may start from it); false once another forward, or a backward without a context,
  // replaced them. Front ends that cannot order calls (autograd) ask before passing a context.
  bool holds_context(const ForwardContext& context) const;

  // Runs the forward `iterations` times with CUDA events between its stages and returns each
  // stage's median time and SM clock (StageTime), then "total". Synchronizes.
  std::vector<StageTime> profile_forward(const ForwardArgs& args, cudaStream_t stream,
                                         int iterations);

  std::vector<StageTime> profile_backward(const BackwardArgs& args, cudaStream_t stream,
                                          int iterations, const ForwardContext* context = nullptr);

  // Waits for `stream` and reports what the device found: bad expert ids (naming rank, token,
  // slot and value), a timed-out device wait (with its diagnosis), or a CUDA error.
  Status synchronize(cudaStream_t stream);

  // The task traces of the latest launch of each persistent kernel that ran since the layer was
  // built with MoeConfig::trace_tasks (none otherwise). Synchronizes `stream`.
  std::vector<TaskTrace> task_traces(cudaStream_t stream);

  const MoeShape& shape() const;
  // The config the layer runs with: the one it was built with, its automatic choices made
  // (minibatch_size, and gemm_auto_lockstep's four stages and lead).
  const MoeConfig& config() const;
  // Bytes of device memory the workspace holds.
  int64_t workspace_bytes() const;
  // With MoeConfig::gemm_l2_placement: what the layer's probe found of the L2's partitions and
  // whether the expert GEMMs walk by them; "" without the knob.
  std::string l2_placement_report() const;
  // The diagnosis of a device wait of this layer that timed out (who waited for what), or ""
  // when none did. synchronize() reports it; a launch that fails after such a timeout sees only
  // the CUDA error of the aborted kernel, and this names its cause.
  std::string timed_out_wait() const;

  struct State;  // opaque: workspace, exchange, engines (src/layer/gpu_layer_state.h)
  // A layer over a state that mok built (the expert-parallel layer's ranks: EpLayer). State is
  // opaque outside mok's runtime, so a user builds layers with the constructor above.
  explicit GpuLayer(std::unique_ptr<State> state);

 private:
  std::unique_ptr<State> state_;
};

}  // namespace mok
