// The engines of layer/expert_engine.h: which stages (layer/expert_stages.cpp) run each
// direction's expert GEMMs.
#include "layer/expert_engine.h"

namespace mok {

namespace {

void no_marks(const char*) {}

class TwoKernelForward final : public ForwardEngine {
 public:
  void macrobatch(const GpuLayer::State& s, const ExpertSetForward& routed, const ExpertSetForward*,
                  const kernels::FusedGather& gather, int32_t m, cudaStream_t stream,
                  const StageMarker& mark) override {
    stages::forward_experts(s, routed, gather, stream, mark, s.macrobatch(m));
  }
  void shared_expert(const GpuLayer::State& s, const ExpertSetForward* shared, cudaStream_t stream,
                     const StageMarker& mark) override {
    if (shared == nullptr) return;
    stages::forward_experts(s, *shared, kernels::FusedGather{}, stream, no_marks);
    mark("shared expert");
  }
};

class PersistentForward final : public ForwardEngine {
 public:
  void macrobatch(const GpuLayer::State& s, const ExpertSetForward& routed,
                  const ExpertSetForward* shared, const kernels::FusedGather& gather, int32_t m,
                  cudaStream_t stream, const StageMarker& mark) override {
    stages::forward_experts_persistent(s, routed, shared, gather, s.macrobatch(m), stream, mark);
  }
  void shared_expert(const GpuLayer::State&, const ExpertSetForward*, cudaStream_t,
                     const StageMarker&) override {}  // ran with macrobatch 0's tiles
};

class SequenceBackward final : public BackwardEngine {
 public:
  bool gathers_in_kernel() const override { return false; }
  bool dgrad_gathers_d_out() const override { return true; }
  void macrobatch(const GpuLayer::State& s, const ExpertSetBackward& routed,
                  const ExpertSetBackward*, bool recompute, const BackwardRows& rows, int32_t m,
                  cudaStream_t stream, const StageMarker& mark) override {
    stages::backward_experts(s, routed, recompute, stream, mark, s.num_macrobatches > 1 ? m : -1,
                             rows.d_out);
  }
  void shared_expert(const GpuLayer::State& s, const ExpertSetBackward* shared, bool recompute,
                     cudaStream_t stream, const StageMarker& mark) override {
    if (shared == nullptr) return;
    stages::backward_experts(s, *shared, recompute, stream, no_marks);
    mark("shared expert");
  }
};

class PersistentBackward final : public BackwardEngine {
 public:
  explicit PersistentBackward(bool gathers) : gathers_(gathers) {}
  bool gathers_in_kernel() const override { return gathers_; }
  // Its weight-gradient tiles are tasks of the one launch's order.
  bool skips_weight_gradients() const override { return false; }
  void macrobatch(const GpuLayer::State& s, const ExpertSetBackward& routed,
                  const ExpertSetBackward* shared, bool recompute, const BackwardRows& rows,
                  int32_t, cudaStream_t stream, const StageMarker& mark) override {
    stages::backward_experts_persistent(s, routed, shared, recompute, rows.d_out, rows.x, stream,
                                        mark);
  }
  void shared_expert(const GpuLayer::State&, const ExpertSetBackward*, bool, cudaStream_t,
                     const StageMarker&) override {}  // ran in the same launch

 private:
  bool gathers_;
};

// MoeConfig::precision = kFP8Block: the kernel sequences on FP8 operands, one macrobatch
// (can_implement), the shared expert after the routed rows went back.
class Fp8Forward final : public ForwardEngine {
 public:
  void macrobatch(const GpuLayer::State& s, const ExpertSetForward& routed, const ExpertSetForward*,
                  const kernels::FusedGather& gather, int32_t, cudaStream_t stream,
                  const StageMarker& mark) override {
    stages::forward_experts_fp8(s, routed, gather, s.fp8_routed, stream, mark);
  }
  void shared_expert(const GpuLayer::State& s, const ExpertSetForward* shared, cudaStream_t stream,
                     const StageMarker& mark) override {
    if (shared == nullptr) return;
    stages::forward_experts_fp8(s, *shared, kernels::FusedGather{}, s.fp8_shared, stream, no_marks);
    mark("shared expert");
  }
};

class Fp8Backward final : public BackwardEngine {
 public:
  bool gathers_in_kernel() const override { return false; }
  void macrobatch(const GpuLayer::State& s, const ExpertSetBackward& routed,
                  const ExpertSetBackward*, bool recompute, const BackwardRows& rows, int32_t,
                  cudaStream_t stream, const StageMarker& mark) override {
    stages::backward_experts_fp8(s, routed, recompute, rows.d_out, rows.x, s.fp8_routed, stream,
                                 mark);
  }
  void shared_expert(const GpuLayer::State& s, const ExpertSetBackward* shared, bool recompute,
                     cudaStream_t stream, const StageMarker& mark) override {
    if (shared == nullptr) return;
    stages::backward_experts_fp8(s, *shared, recompute, kernels::FusedGather{},
                                 kernels::FusedGather{}, s.fp8_shared, stream, no_marks);
    mark("shared expert");
  }
};

}  // namespace

std::unique_ptr<ForwardEngine> make_forward_engine(const GpuLayer::State& s) {
  if (s.config.precision == Precision::kFP8Block) return std::make_unique<Fp8Forward>();
  if (s.config.persistent_forward) return std::make_unique<PersistentForward>();
  return std::make_unique<TwoKernelForward>();
}

std::unique_ptr<BackwardEngine> make_backward_engine(const GpuLayer::State& s,
                                                     const TokenExchange& exchange) {
  if (s.config.precision == Precision::kFP8Block) return std::make_unique<Fp8Backward>();
  // The persistent backward holds one macrobatch; with more the sequence runs (same bits).
  if (s.config.persistent_backward && s.num_macrobatches == 1)
    return std::make_unique<PersistentBackward>(exchange.gathers_in_kernel());
  return std::make_unique<SequenceBackward>();
}

}  // namespace mok
