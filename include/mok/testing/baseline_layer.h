// The unfused baseline a user writes today, on one GPU: sort tokens by expert (with the host
// reading the per-expert counts: one synchronization), permute, one cuBLAS GEMM per expert for
// gate, up and down, SwiGLU, unpermute with the weighted sum. Same inputs, same rounding points
// as mok, so it also serves as a second GPU oracle. mok's benchmarks time it in the same run.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "mok/layer_args.h"
#include "mok/shape.h"

namespace mok {

class BaselineLayer {
 public:
  explicit BaselineLayer(const MoeShape& shape);  // shape.num_ranks must be 1
  ~BaselineLayer();
  BaselineLayer(const BaselineLayer&) = delete;
  BaselineLayer& operator=(const BaselineLayer&) = delete;

  // Runs on `stream`; synchronizes once to read the expert counts, as the PyTorch pipeline does.
  void forward(const ForwardArgs& args, cudaStream_t stream);
  // The backward the same way, one cuBLAS call per expert and GEMM. With saved_activations it
  // reuses the last forward's split sizes, permuted x and gate/up outputs, as autograd keeps
  // them (args must be that forward's inputs); without, it recomputes them.
  void backward(const BackwardArgs& args, cudaStream_t stream, bool saved_activations = false);

  struct State;  // opaque (src/baseline_layer.cpp)

 private:
  std::unique_ptr<State> state_;
};

}  // namespace mok
