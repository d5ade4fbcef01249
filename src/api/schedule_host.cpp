// Host side of the routing schedule: the buffer layout, parameter checks, the host builder
// (the oracle the GPU builder is tested against, and the schedule of the CPU reference), and the
// decoding of the header's error word. Contract in include/mok/schedule.h.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "api/messages.h"
#include "mok/schedule.h"

namespace mok {

namespace {

constexpr int64_t kArrayAlign = 256;

int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

int64_t read_id(const void* data, DType dtype, int64_t index) {
  if (dtype == DType::kInt64) return static_cast<const int64_t*>(data)[index];
  return static_cast<const int32_t*>(data)[index];
}

}  // namespace

void build_send_entries_host(const ScheduleParams& p, const void* top_experts_all,
                             DType expert_dtype, int32_t* send_entry) {
  if (expert_dtype != DType::kInt32 && expert_dtype != DType::kInt64)
    throw Error(ErrorCode::kInvalidArgument, std::string("build_send_entries_host: expert dtype ") +
                                                 dtype_name(expert_dtype) +
                                                 " is not supported; valid: int32, int64");
  const int32_t R = p.num_ranks, T = p.tokens_per_rank, K = p.top_k;
  const int64_t local_experts = p.num_local_experts();
  std::vector<int32_t> next_entry(static_cast<size_t>(R), 0);
  std::vector<char> routed(static_cast<size_t>(R));
  for (int32_t source = 0; source <= p.local_rank; ++source)
    for (int32_t token = 0; token < T; ++token) {
      std::fill(routed.begin(), routed.end(), 0);
      for (int32_t k = 0; k < K; ++k) {
        const int64_t expert = read_id(top_experts_all, expert_dtype,
                                       (static_cast<int64_t>(source) * T + token) * K + k);
        if (expert >= 0 && expert < p.num_experts) routed[expert / local_experts] = 1;
      }
      for (int32_t d = 0; d < R; ++d) {
        const int32_t entry = routed[d] ? next_entry[d]++ : -1;
        if (source == p.local_rank) send_entry[static_cast<int64_t>(d) * T + token] = entry;
      }
    }
}

Status validate_schedule_params(const ScheduleParams& p) {
  auto bad = [](const std::string& what) { return Status::invalid("schedule: " + what); };
  if (p.num_ranks < 1 || p.num_ranks > 1024)
    return bad("num_ranks = " + std::to_string(p.num_ranks) + "; valid: 1..1024");
  if (p.num_experts < 1 || p.num_experts % p.num_ranks != 0)
    return bad("num_experts = " + std::to_string(p.num_experts) +
               "; must be a positive multiple of num_ranks = " + std::to_string(p.num_ranks));
  if (p.local_rank < 0 || p.local_rank >= p.num_ranks)
    return bad("local_rank = " + std::to_string(p.local_rank) + "; valid: 0.." +
               std::to_string(p.num_ranks - 1));
  if (p.tokens_per_rank < 0)
    return bad("tokens_per_rank = " + std::to_string(p.tokens_per_rank) + "; must be >= 0");
  if (p.top_k < 1) return bad("top_k = " + std::to_string(p.top_k) + "; must be >= 1");
  if (p.row_align < 16 || p.row_align > 1024 || (p.row_align & (p.row_align - 1)) != 0)
    return bad("row_align = " + std::to_string(p.row_align) +
               "; must be a power of two in [16, 1024]");
  if (p.max_rows() > std::numeric_limits<int32_t>::max())
    return bad("R*T*K = " + std::to_string(p.num_pairs()) + " routed pairs (max_rows " +
               std::to_string(p.max_rows()) + ") does not fit the int32 row index; reduce tokens");
  return Status::Ok();
}

ScheduleLayout ScheduleLayout::make(const ScheduleParams& params) {
  validate_schedule_params(params).throw_if_error();
  ScheduleLayout layout;
  layout.params = params;
  const int64_t local_experts = params.num_local_experts();
  const int64_t chunks = params.num_chunks();
  int64_t cursor = 0;
  auto place = [&cursor](int64_t bytes) {
    int64_t offset = cursor;
    cursor = align_up(cursor + bytes, kArrayAlign);
    return offset;
  };
  constexpr int64_t kI32 = sizeof(int32_t);
  layout.header = place(sizeof(ScheduleHeader));
  layout.expert_counts = place(local_experts * kI32);
  layout.expert_source_counts = place(local_experts * params.num_ranks * kI32);
  layout.expert_offsets = place((local_experts + 1) * kI32);
  layout.tile_expert = place(params.max_tiles() * kI32);
  layout.row_pair = place(params.max_rows() * kI32);
  layout.row_recv = place(params.max_rows() * kI32);
  layout.pair_row = place(params.num_pairs() * kI32);
  layout.recv_offsets = place((params.num_ranks + 1) * kI32);
  layout.recv_tokens =
      place(static_cast<int64_t>(params.num_ranks) * params.tokens_per_rank * kI32);
  layout.output_bytes = cursor;
  layout.scratch_chunk_counts = place(chunks * local_experts * kI32);
  layout.scratch_chunk_prefix = place(chunks * local_experts * kI32);
  layout.scratch_chunk_recv = place(chunks * kI32);
  layout.scratch_chunk_recv_prefix = place(chunks * kI32);
  layout.scratch_chunk_bad = place(chunks * kI32);
  layout.total_bytes = cursor;
  return layout;
}

void build_schedule_host(const ScheduleLayout& layout, const void* top_experts_all,
                         DType expert_dtype, void* buffer) {
  const ScheduleParams& p = layout.params;
  if (expert_dtype != DType::kInt32 && expert_dtype != DType::kInt64)
    throw Error(ErrorCode::kInvalidArgument, std::string("build_schedule_host: expert dtype ") +
                                                 dtype_name(expert_dtype) +
                                                 " is not supported; valid: int32, int64");
  ScheduleView view = ScheduleView::at(buffer, layout);
  const int32_t local_experts = p.num_local_experts();
  const int32_t first_expert = p.first_local_expert();
  const int64_t num_pairs = p.num_pairs();

  ScheduleHeader header{};
  header.status = static_cast<int32_t>(ScheduleStatus::kOk);
  header.error_pair = -1;
  header.error_value = 0;

  // Pass 1: counts per (expert, source rank), and the first bad id.
  std::vector<int32_t> local_of_pair(static_cast<size_t>(num_pairs), -1);
  std::fill(view.expert_source_counts, view.expert_source_counts + local_experts * p.num_ranks, 0);
  for (int64_t pair = 0; pair < num_pairs; ++pair) {
    int64_t expert = read_id(top_experts_all, expert_dtype, pair);
    if (expert < -1 || expert >= p.num_experts) {
      if (header.error_pair < 0) {
        header.status = static_cast<int32_t>(ScheduleStatus::kBadExpertId);
        header.error_pair = static_cast<int32_t>(pair);
        header.error_value = saturate_expert_id(expert);
      }
      continue;
    }
    if (expert < first_expert || expert >= first_expert + local_experts) continue;
    int32_t local = static_cast<int32_t>(expert - first_expert);
    local_of_pair[pair] = local;
    int32_t src_rank =
        static_cast<int32_t>(pair / (static_cast<int64_t>(p.tokens_per_rank) * p.top_k));
    ++view.expert_source_counts[local * p.num_ranks + src_rank];
  }

  // Segment offsets, aligned to the tile height.
  int32_t offset = 0;
  for (int32_t e = 0; e < local_experts; ++e) {
    int32_t count = 0;
    for (int32_t s = 0; s < p.num_ranks; ++s)
      count += view.expert_source_counts[e * p.num_ranks + s];
    view.expert_counts[e] = count;
    view.expert_offsets[e] = offset;
    offset += (count + p.row_align - 1) / p.row_align * p.row_align;
  }
  view.expert_offsets[local_experts] = offset;
  header.total_rows = offset;
  header.num_tiles = offset / p.row_align;
  for (int32_t e = 0; e < local_experts; ++e)
    for (int32_t tile = view.expert_offsets[e] / p.row_align;
         tile < view.expert_offsets[e + 1] / p.row_align; ++tile)
      view.tile_expert[tile] = e;

  // Receive list: (src, token) with at least one routed slot, in (src, token) order.
  std::vector<int32_t> recv_of_token(static_cast<size_t>(p.num_ranks) * p.tokens_per_rank, -1);
  int32_t recv = 0;
  for (int32_t s = 0; s < p.num_ranks; ++s) {
    view.recv_offsets[s] = recv;
    for (int32_t t = 0; t < p.tokens_per_rank; ++t) {
      int64_t global_token = static_cast<int64_t>(s) * p.tokens_per_rank + t;
      bool routed = false;
      for (int32_t k = 0; k < p.top_k; ++k)
        routed |= local_of_pair[global_token * p.top_k + k] >= 0;
      if (!routed) continue;
      recv_of_token[global_token] = recv;
      view.recv_tokens[recv++] = t;
    }
  }
  view.recv_offsets[p.num_ranks] = recv;
  header.total_recv = recv;

  // Placement: pairs in increasing pair index = (src, token, k) order, so each segment is sorted.
  std::vector<int32_t> fill(view.expert_offsets, view.expert_offsets + local_experts);
  for (int64_t pair = 0; pair < num_pairs; ++pair) {
    int32_t local = local_of_pair[pair];
    if (local < 0) {
      view.pair_row[pair] = -1;
      continue;
    }
    int32_t row = fill[local]++;
    view.row_pair[row] = static_cast<int32_t>(pair);
    view.row_recv[row] = recv_of_token[pair / p.top_k];
    view.pair_row[pair] = row;
  }
  for (int32_t e = 0; e < local_experts; ++e)
    for (int32_t row = fill[e]; row < view.expert_offsets[e + 1]; ++row) {
      view.row_pair[row] = -1;
      view.row_recv[row] = -1;
    }
  std::memcpy(view.header, &header, sizeof(header));
}

Status compare_schedules(const ScheduleLayout& layout, const void* expected, const void* actual) {
  const ScheduleParams& p = layout.params;
  ScheduleView want = ScheduleView::at(const_cast<void*>(expected), layout);
  ScheduleView got = ScheduleView::at(const_cast<void*>(actual), layout);
  if (std::memcmp(want.header, got.header, sizeof(ScheduleHeader)) != 0) {
    auto text = [](const ScheduleHeader& h) {
      return "{total_rows " + std::to_string(h.total_rows) + ", num_tiles " +
             std::to_string(h.num_tiles) + ", total_recv " + std::to_string(h.total_recv) +
             ", status " + std::to_string(h.status) + ", error_pair " +
             std::to_string(h.error_pair) + ", error_value " + std::to_string(h.error_value) + "}";
    };
    return Status{ErrorCode::kInternal, "schedule header differs: expected " + text(*want.header) +
                                            ", got " + text(*got.header)};
  }
  const int64_t local_experts = p.num_local_experts();
  struct Array {
    const char* name;
    const int32_t* want;
    const int32_t* got;
    int64_t count;
  };
  const Array arrays[] = {
      {"expert_counts", want.expert_counts, got.expert_counts, local_experts},
      {"expert_source_counts", want.expert_source_counts, got.expert_source_counts,
       local_experts * p.num_ranks},
      {"expert_offsets", want.expert_offsets, got.expert_offsets, local_experts + 1},
      {"tile_expert", want.tile_expert, got.tile_expert, want.header->num_tiles},
      {"row_pair", want.row_pair, got.row_pair, want.header->total_rows},
      {"row_recv", want.row_recv, got.row_recv, want.header->total_rows},
      {"pair_row", want.pair_row, got.pair_row, p.num_pairs()},
      {"recv_offsets", want.recv_offsets, got.recv_offsets, p.num_ranks + 1},
      {"recv_tokens", want.recv_tokens, got.recv_tokens, want.header->total_recv},
  };
  for (const Array& array : arrays)
    for (int64_t i = 0; i < array.count; ++i)
      if (array.want[i] != array.got[i])
        return Status{ErrorCode::kInternal, std::string("schedule ") + array.name + "[" +
                                                std::to_string(i) + "] differs: expected " +
                                                std::to_string(array.want[i]) + ", got " +
                                                std::to_string(array.got[i])};
  return Status::Ok();
}

Status schedule_status(const ScheduleParams& params, const ScheduleHeader& header) {
  if (header.status == static_cast<int32_t>(ScheduleStatus::kOk)) return Status::Ok();
  if (header.status == static_cast<int32_t>(ScheduleStatus::kBadExpertId)) {
    PairCoord coord = decode_pair(params, header.error_pair);
    return Status::invalid(bad_expert_id_message(coord.src_rank, coord.token, coord.k,
                                                 header.error_value, params.num_experts));
  }
  return Status{ErrorCode::kInternal,
                "schedule: unknown status word " + std::to_string(header.status)};
}

}  // namespace mok
