// The MoE layer over an expert-parallel group of GPUs in one NVLink domain (EP = R ranks, each
// owning E / R experts), unfused: per layer call, the routing all-gather and each rank's
// schedule, the pull dispatch of routed rows, the expert GEMMs of the single-GPU layer, the push
// combine into the source ranks' slots and the fixed-order sum there; the backward mirrors it
// (pull d_out, push dx rows and router-weight gradients). No host synchronization; every wait is
// a device wait with a timeout and a diagnosis (a missing rank ends in kTimeout at synchronize).
// Built with NCCL (MOK_HAS_NCCL). The persistent fused kernel replaces this sequence later.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "mok/comm.h"
#include "mok/config.h"
#include "mok/error.h"
#include "mok/gpu_layer.h"
#include "mok/layer_args.h"
#include "mok/shape.h"

namespace mok {

class EpLayer {
 public:
  // The layer for the group's ranks this process drives: all of them after
  // Communicator::create_all, its own one after create_rank. shape.num_ranks must be the group
  // size, shape.num_tokens the tokens per rank. Collective: every process constructs it with
  // the same shape and config (symmetric memory is allocated across the group).
  EpLayer(const MoeShape& shape, const MoeConfig& config,
          const std::vector<Communicator*>& ranks_here);
  ~EpLayer();
  EpLayer(const EpLayer&) = delete;
  EpLayer& operator=(const EpLayer&) = delete;

  int32_t num_local_ranks() const;
  // The layer of ranks_here[i]. Call its forward / backward / synchronize with the current
  // device set to rank_device(i) and that rank's tensors; every rank of the group must make the
  // same sequence of calls (each call signals and waits for the other ranks).
  GpuLayer& rank_layer(int32_t i);
  int rank_device(int32_t i) const;

  // One process driving several ranks: the call for every local rank (args[i], streams[i] for
  // ranks_here[i]), launched rank by rank without host synchronization.
  std::vector<ForwardContext> forward(const std::vector<ForwardArgs>& args,
                                      const std::vector<cudaStream_t>& streams);
  void backward(const std::vector<BackwardArgs>& args, const std::vector<cudaStream_t>& streams,
                const std::vector<ForwardContext>* contexts = nullptr);
  // Waits for every local rank's stream; the first problem found (naming the rank) or Ok.
  Status synchronize(const std::vector<cudaStream_t>& streams);

  // Device memory of one rank: its workspace and its share of the symmetric buffers.
  int64_t workspace_bytes_per_rank() const;

 private:
  // A launch that fails because an earlier kernel of the group aborted in a timed-out wait sees
  // only the CUDA error of the abort (an illegal address); this rethrows it as kTimeout with the
  // wait's diagnosis.
  [[noreturn]] void rethrow_with_wait_diagnosis(const Error& error) const;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok
