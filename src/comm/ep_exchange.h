// The expert-parallel token exchange (layer/token_exchange.h) of one rank of an EpLayer, and
// the group's buffers it works on. The layer's ordering across ranks is in ep_exchange.cpp.
#pragma once

#include <memory>

#include "kernels/comm/launch.h"
#include "kernels/common/counter_layouts.h"
#include "layer/cuda_buffer.h"
#include "layer/token_exchange.h"
#include "mok/comm.h"

namespace mok {

// The group's symmetric buffers (one SymmetricMemory each, over the ranks of this process).
struct EpSymmetric {
  std::unique_ptr<SymmetricMemory> x, d_out, routing, weights, slots, d_rw, exchange_flags,
      push_flags;
  // Push dispatch only (MoeConfig::ep_push_dispatch).
  std::unique_ptr<SymmetricMemory> received_x, received_d_out, dispatch_flags;
};

// One rank's share of the group: its piece of every symmetric buffer and its local
// communication state.
struct EpRank {
  int32_t rank = 0, num_ranks = 1;
  int comm_ctas = 24;
  kernels::RowCopy row_copy = kernels::RowCopy::kWarp;  // MoeConfig::ep_bulk_copies
  bool push_dispatch = false;                           // MoeConfig::ep_push_dispatch
  // MoeConfig::ep_dispatch_in_gemm: the forward's x rows pulled by the gate/up GEMM's producer
  // warps (a bf16 layer with the producer-warps local dispatch), not by a dispatch kernel; and
  // the backward's d_out rows by the down dgrad GEMM's (the kernel sequence).
  bool dispatch_in_gemm = false;
  const EpSymmetric* memory = nullptr;
  int32_t piece = 0;            // this rank's index among the process's pieces
  DeviceBuffer received;        // [R*T, H] bf16: pulled x rows, one per receive entry (pull only)
  DeviceBuffer received_d_out;  // [R*T, H] bf16: pulled d_out rows (pull only)
  DeviceBuffer send_entry;      // int32 [R*T]: this rank's tokens' receive entries (push only)
  DeviceBuffer slot_index;      // int32 [T*K]: the combine's index over the slots
  DeviceBuffer counters;        // kernels::EpCounter words: the barriers' epochs and counts

  // This rank's buffer of `buffer`, and the table of every rank's, as this GPU addresses them.
  template <typename T = void>
  T* local(const std::unique_ptr<SymmetricMemory>& buffer) const {
    return static_cast<T*>(buffer->local(piece));
  }
  template <typename T = void>
  T* const* peers(const std::unique_ptr<SymmetricMemory>& buffer) const {
    return reinterpret_cast<T* const*>(buffer->device_peers(piece));
  }
};

// The exchange of rank `ep` (which the EpLayer keeps alive as long as its GpuLayer).
std::unique_ptr<TokenExchange> make_ep_exchange(EpRank& ep);

}  // namespace mok
