// Expert-parallel plumbing of the CPU reference: validation of every rank's arguments, the
// gathered routing, each owner rank's schedule (built by build_schedule_host, the same table
// the GPU layer uses), and the row movements of pull dispatch.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/layer_args.h"
#include "mok/reference.h"
#include "mok/schedule.h"
#include "thread_pool.h"

namespace mok::reference::detail {

// Checks rank_args.size() == shape.num_ranks, check_forward_args / check_backward_args,
// check_weight_precision (the backward: check_backward_precision) and check_top_experts on every
// rank, and that no output of one rank overlaps a tensor of another rank. Throws mok::Error
// naming the call, the rank and the argument.
void validate_forward_ranks(const char* call, const MoeShape& shape,
                            const std::vector<ForwardArgs>& rank_args, Precision precision);
void validate_backward_ranks(const char* call, const MoeShape& shape,
                             const std::vector<BackwardArgs>& rank_args, Precision precision);

// Throws unless shape.num_ranks == 1 (the single-rank forms).
void require_single_rank(const char* call, const MoeShape& shape);

// The routing of all ranks, [R, T, K] int64: what the GPU layer all-gathers.
std::vector<int64_t> gather_routing(const MoeShape& shape,
                                    const std::vector<const ForwardArgs*>& rank_args);

// One owner rank's schedule.
class OwnerSchedule {
 public:
  OwnerSchedule(const MoeShape& shape, const std::vector<int64_t>& routing, int32_t owner_rank);

  int64_t segment_begin(int64_t local_expert) const { return view_.expert_offsets[local_expert]; }
  // Routed rows of the segment (padding rows excluded).
  int64_t routed_rows(int64_t local_expert) const { return view_.expert_counts[local_expert]; }
  PairCoord pair_of_row(int64_t row) const {
    return decode_pair(layout_.params, view_.row_pair[row]);
  }
  int64_t recv_entry_of_row(int64_t row) const { return view_.row_recv[row]; }
  int64_t total_recv() const { return view_.header->total_recv; }
  // Source rank and token of receive-list entry `entry`.
  int32_t recv_source(int64_t entry) const;
  int32_t recv_token(int64_t entry) const { return view_.recv_tokens[entry]; }

 private:
  ScheduleLayout layout_;
  std::vector<int32_t> storage_;  // the schedule buffer; int32 keeps every array aligned
  ScheduleView view_;
};

// Pull dispatch: copies the row of every receive-list entry out of its source rank's [T, width]
// bf16 tensor into a [total_recv, width] buffer, one copy per (source rank, token).
std::vector<bf16> pull_rows(ThreadPool& pool, const OwnerSchedule& schedule,
                            const std::vector<const bf16*>& source_rows, int64_t width);

// Expands a segment of the expert-grouped buffer: out[i] = received row of schedule row
// segment_begin + i, as fp32, for i < rows.
void gather_segment(ThreadPool& pool, const OwnerSchedule& schedule, const bf16* received,
                    int64_t segment_begin, int64_t rows, int64_t width, float* out);

}  // namespace mok::reference::detail
