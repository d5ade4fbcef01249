// Expert-parallel plumbing of the CPU reference: validation across ranks, schedules, pull
// dispatch. See ep_exchange.h.
#include "ep_exchange.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "mok/error.h"

namespace mok::reference::detail {

namespace {

// The per-rank checks cover overlaps inside one rank; here outputs are checked against every
// tensor of the other ranks, since the emulation reads other ranks' inputs while it writes.
void check_cross_rank_overlap(const char* call,
                              const std::vector<std::vector<NamedTensor>>& rank_inputs,
                              const std::vector<std::vector<NamedTensor>>& rank_outputs) {
  const size_t num_ranks = rank_outputs.size();
  for (size_t rank = 0; rank < num_ranks; ++rank)
    for (const NamedTensor& output : rank_outputs[rank])
      for (size_t other = 0; other < num_ranks; ++other) {
        if (other == rank) continue;
        for (const auto* group : {&rank_inputs[other], &rank_outputs[other]})
          for (const NamedTensor& tensor : *group)
            if (tensors_overlap(*output.view, *tensor.view))
              throw Error(ErrorCode::kInvalidArgument,
                          std::string(call) + ": output `" + output.name + "` of rank " +
                              std::to_string(rank) + " overlaps `" + tensor.name + "` of rank " +
                              std::to_string(other) + "; every rank needs its own output memory");
      }
}

void check_rank_count(const char* call, const MoeShape& shape, size_t count) {
  if (count != static_cast<size_t>(shape.num_ranks))
    throw Error(ErrorCode::kInvalidArgument,
                std::string(call) + ": rank_args has " + std::to_string(count) +
                    " entries; expected one per rank, shape.num_ranks = " +
                    std::to_string(shape.num_ranks));
}

void throw_for_rank(const Status& status, const char* call, size_t rank, size_t num_ranks) {
  if (status.ok()) return;
  if (num_ranks == 1) status.throw_if_error();
  throw Error(status.code,
              std::string(call) + ", rank " + std::to_string(rank) + ": " + status.message);
}

}  // namespace

void validate_forward_ranks(const char* call, const MoeShape& shape,
                            const std::vector<ForwardArgs>& rank_args, Precision precision) {
  check_rank_count(call, shape, rank_args.size());
  std::vector<std::vector<NamedTensor>> inputs, outputs;
  for (size_t rank = 0; rank < rank_args.size(); ++rank) {
    const ForwardArgs& args = rank_args[rank];
    throw_for_rank(check_forward_args(shape, args, DeviceType::kCPU), call, rank, rank_args.size());
    throw_for_rank(check_weight_precision(call, args, precision), call, rank, rank_args.size());
    check_top_experts(shape, args.top_experts, static_cast<int32_t>(rank)).throw_if_error();
    inputs.push_back(named_inputs(args));
    outputs.push_back({{"out", &args.out}});
  }
  check_cross_rank_overlap(call, inputs, outputs);
}

void validate_backward_ranks(const char* call, const MoeShape& shape,
                             const std::vector<BackwardArgs>& rank_args, Precision precision) {
  check_rank_count(call, shape, rank_args.size());
  std::vector<std::vector<NamedTensor>> inputs, outputs;
  for (size_t rank = 0; rank < rank_args.size(); ++rank) {
    const BackwardArgs& args = rank_args[rank];
    throw_for_rank(check_backward_args(shape, args, DeviceType::kCPU), call, rank,
                   rank_args.size());
    throw_for_rank(check_backward_precision(call, args, precision), call, rank, rank_args.size());
    check_top_experts(shape, args.forward.top_experts, static_cast<int32_t>(rank)).throw_if_error();
    inputs.push_back(named_inputs(args.forward));
    inputs.back().push_back({"d_out", &args.d_out});
    outputs.push_back(named_outputs(args));
  }
  check_cross_rank_overlap(call, inputs, outputs);
}

void require_single_rank(const char* call, const MoeShape& shape) {
  if (shape.num_ranks != 1)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(call) + ": shape.num_ranks = " + std::to_string(shape.num_ranks) +
                    "; the single-rank form needs 1 (use the _ep form for several ranks)");
}

std::vector<int64_t> gather_routing(const MoeShape& shape,
                                    const std::vector<const ForwardArgs*>& rank_args) {
  const int64_t slots_per_rank = shape.num_tokens * shape.top_k;
  std::vector<int64_t> routing(static_cast<size_t>(slots_per_rank * shape.num_ranks));
  for (size_t rank = 0; rank < rank_args.size(); ++rank)
    for (int64_t slot = 0; slot < slots_per_rank; ++slot)
      routing[rank * slots_per_rank + slot] = read_expert_id(rank_args[rank]->top_experts, slot);
  return routing;
}

OwnerSchedule::OwnerSchedule(const MoeShape& shape, const std::vector<int64_t>& routing,
                             int32_t owner_rank) {
  ScheduleParams params;
  params.num_ranks = shape.num_ranks;
  params.tokens_per_rank = static_cast<int32_t>(shape.num_tokens);
  params.top_k = shape.top_k;
  params.num_experts = static_cast<int32_t>(shape.num_experts);
  params.local_rank = owner_rank;
  layout_ = ScheduleLayout::make(params);
  storage_.assign(static_cast<size_t>((layout_.output_bytes + 3) / 4), 0);
  build_schedule_host(layout_, routing.data(), DType::kInt64, storage_.data());
  view_ = ScheduleView::at(storage_.data(), layout_);
  // Ids were validated before: a bad id here is a bug of the reference, not of the caller.
  Status status = schedule_status(params, *view_.header);
  if (!status.ok())
    throw Error(ErrorCode::kInternal, "reference: schedule of rank " + std::to_string(owner_rank) +
                                          ": " + status.message);
}

int32_t OwnerSchedule::recv_source(int64_t entry) const {
  const int32_t* offsets = view_.recv_offsets;
  const int32_t* end = offsets + layout_.params.num_ranks + 1;
  // The last rank whose range starts at or before `entry`.
  return static_cast<int32_t>(std::upper_bound(offsets, end, entry) - offsets) - 1;
}

std::vector<bf16> pull_rows(ThreadPool& pool, const OwnerSchedule& schedule,
                            const std::vector<const bf16*>& source_rows, int64_t width) {
  const int64_t entries = schedule.total_recv();
  std::vector<bf16> received(static_cast<size_t>(entries * width));
  pool.parallel_for(entries, [&](int64_t entry) {
    const bf16* row = source_rows[schedule.recv_source(entry)] +
                      static_cast<int64_t>(schedule.recv_token(entry)) * width;
    std::memcpy(received.data() + entry * width, row, static_cast<size_t>(width) * sizeof(bf16));
  });
  return received;
}

void gather_segment(ThreadPool& pool, const OwnerSchedule& schedule, const bf16* received,
                    int64_t segment_begin, int64_t rows, int64_t width, float* out) {
  pool.parallel_for(rows, [&](int64_t i) {
    const bf16* row = received + schedule.recv_entry_of_row(segment_begin + i) * width;
    float* dst = out + i * width;
    for (int64_t col = 0; col < width; ++col) dst[col] = bf16_to_float(row[col]);
  });
}

}  // namespace mok::reference::detail
