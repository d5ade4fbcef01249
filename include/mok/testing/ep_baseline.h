// The expert-parallel baseline a user writes today (for `mok run --gpus N`): NCCL all-to-all
// with host-side split sizes around the same grouped GEMMs. Per rank: bucket its (token, k)
// pairs by destination rank on the GPU, read the bucket sizes on the host (a synchronization,
// as torch's .tolist() of the split sizes), exchange rows, local expert ids and router weights
// with grouped ncclSend / ncclRecv, run the received rows through mok's single-GPU layer as
// tokens with one route each (a layer sized by the received count, rounded up to 128 rows, made
// on first use of that count), send the outputs back the same way, and sum them per token in k
// order with the router weights. The backward sends d_out rows, runs the inner layer's
// backward, and sends dx rows and router-weight gradients back. One process driving every rank
// (Communicator::create_all); no shared expert. Built with NCCL (MOK_HAS_NCCL).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "mok/comm.h"
#include "mok/layer_args.h"
#include "mok/shape.h"

namespace mok {

class EpBaseline {
 public:
  // `group`: every rank of the group, all driven by this process, in rank order.
  EpBaseline(const MoeShape& shape, const std::vector<Communicator*>& group);
  ~EpBaseline();
  EpBaseline(const EpBaseline&) = delete;
  EpBaseline& operator=(const EpBaseline&) = delete;

  // One call per layer step for the whole group (args[r], streams[r] of rank r). Synchronizes
  // the host with every rank's stream once per direction (the split sizes).
  void forward(const std::vector<ForwardArgs>& args, const std::vector<cudaStream_t>& streams);
  // After a forward (it reuses that forward's buckets and received rows).
  void backward(const std::vector<BackwardArgs>& args, const std::vector<cudaStream_t>& streams);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok
