// The routing schedule (DESIGN.md section 2.1): for the experts one rank owns, where every
// routed (source rank, token, k) lands in the expert-grouped row buffer. The layout below is
// shared by the host builder (build_schedule_host), the GPU builder (src/kernels/schedule.cu)
// and every consumer, so all of them compute the same offsets.
//
// Definitions, for local rank r of R ranks, T tokens per rank, K slots, E experts,
// E_loc = E / R local experts (global ids [r*E_loc, (r+1)*E_loc)):
//   pair index     p = (src_rank * T + token) * K + k, for every slot of every rank's routing
//   routed pair    a pair whose expert id is one of the local experts
//   segment e      the rows of local expert e: rows [expert_offsets[e], expert_offsets[e+1])
//
// Row order (documented contract): segments in local expert order; each segment starts at a
// multiple of row_align (the GEMM tile height); inside a segment the routed pairs are sorted by
// (src_rank, token, k) ascending, followed by padding rows up to the next multiple of row_align.
// Padding rows have row_pair = -1 and row_recv = -1. Rows at and after header.total_rows are
// not part of the schedule and their contents are unspecified.
//
// Receive list (for pull dispatch, one NVLink crossing per (token, rank)): the (src_rank, token)
// pairs with at least one routed slot, sorted by (src_rank, token); entries
// [recv_offsets[s], recv_offsets[s+1]) come from rank s and hold token indices of rank s.
// row_recv[row] is the receive-list entry of the token in that row.
//
// Size: the table is sized for the true worst case, every pair of every rank routed here, so
// no capacity parameter exists and nothing is ever dropped: max_rows = R*T*K + E_loc*(row_align-1)
// rounded up to row_align.
//
// Errors: an expert id outside [-1, E) is treated as -1 (never read or written out of bounds) and
// the first such pair (lowest pair index) is recorded in the header.
#pragma once

#include <cstdint>

#include "mok/dtype.h"
#include "mok/error.h"

namespace mok {

inline constexpr int32_t kDefaultRowAlign = 128;     // = BLOCK_M of the grouped GEMM
inline constexpr int32_t kScheduleChunkTokens = 64;  // tokens per chunk of the GPU builder's walk

enum class ScheduleStatus : int32_t {
  kOk = 0,
  kBadExpertId = 1,  // header.error_pair / error_value name the first bad entry
};

struct ScheduleParams {
  int32_t num_ranks = 1;        // R
  int32_t tokens_per_rank = 0;  // T
  int32_t top_k = 0;            // K
  int32_t num_experts = 0;      // E (global)
  int32_t local_rank = 0;       // r, owner of the experts this schedule is for
  int32_t row_align = kDefaultRowAlign;

  MOK_HOST_DEVICE int32_t num_local_experts() const { return num_experts / num_ranks; }
  MOK_HOST_DEVICE int32_t first_local_expert() const { return local_rank * num_local_experts(); }
  MOK_HOST_DEVICE int64_t num_pairs() const {
    return static_cast<int64_t>(num_ranks) * tokens_per_rank * top_k;
  }
  MOK_HOST_DEVICE int32_t chunks_per_rank() const {
    return (tokens_per_rank + kScheduleChunkTokens - 1) / kScheduleChunkTokens;
  }
  MOK_HOST_DEVICE int32_t num_chunks() const { return num_ranks * chunks_per_rank(); }
  MOK_HOST_DEVICE int64_t max_rows() const {
    int64_t rows = num_pairs() + static_cast<int64_t>(num_local_experts()) * (row_align - 1);
    return (rows + row_align - 1) / row_align * row_align;
  }
  MOK_HOST_DEVICE int64_t max_tiles() const { return max_rows() / row_align; }
};

// Checks ranges (ranks, experts divisible by ranks, local rank, row_align a power of two in
// [16, 1024], R*T*K and max_rows within int32). The message names the field and value.
Status validate_schedule_params(const ScheduleParams& params);

struct ScheduleHeader {
  int32_t total_rows;   // rows used, including padding; a multiple of row_align
  int32_t num_tiles;    // total_rows / row_align
  int32_t total_recv;   // entries of the receive list
  int32_t status;       // ScheduleStatus
  int32_t error_pair;   // first pair index with a bad expert id, or -1
  int32_t error_value;  // its expert id, saturated to the int32 range for int64 input
  int32_t reserved[2];
};
static_assert(sizeof(ScheduleHeader) == 32, "ScheduleHeader is shared by host and device");

// Byte offsets of every array inside one schedule buffer (256-byte aligned each). The output
// arrays come first; `scratch_*` arrays are used only by the GPU builder.
struct ScheduleLayout {
  ScheduleParams params;
  int64_t header = 0;                // ScheduleHeader
  int64_t expert_counts = 0;         // int32 [E_loc]: routed pairs per local expert
  int64_t expert_source_counts = 0;  // int32 [E_loc][R]: routed pairs per (expert, source rank)
  int64_t expert_offsets = 0;        // int32 [E_loc + 1]: segment starts; [E_loc] = total_rows
  int64_t tile_expert = 0;           // int32 [max_tiles]: local expert of each row tile
  int64_t row_pair = 0;              // int32 [max_rows]: pair index of each row, -1 = padding
  int64_t row_recv = 0;              // int32 [max_rows]: receive-list entry of each row
  int64_t pair_row = 0;              // int32 [R*T*K]: row of each pair, -1 = not routed here
  int64_t recv_offsets = 0;          // int32 [R + 1]
  int64_t recv_tokens = 0;           // int32 [R*T]: token index (within its source rank)
  int64_t scratch_chunk_counts = 0;  // int32 [num_chunks][E_loc]: pairs per (chunk, expert)
  int64_t scratch_chunk_prefix = 0;  // int32 [num_chunks][E_loc]: in-segment start of a chunk
  int64_t scratch_chunk_recv = 0;    // int32 [num_chunks]: receive entries of a chunk
  int64_t scratch_chunk_recv_prefix = 0;  // int32 [num_chunks]
  int64_t scratch_chunk_bad = 0;          // int32 [num_chunks]: first bad pair in the chunk, or -1
  int64_t output_bytes = 0;               // bytes of the output arrays (header .. recv_tokens)
  int64_t total_bytes = 0;                // bytes of the whole buffer, scratch included

  static ScheduleLayout make(const ScheduleParams& params);
};

// Typed pointers into one schedule buffer; valid on the host or the device, wherever the
// buffer lives.
struct ScheduleView {
  ScheduleHeader* header;
  int32_t* expert_counts;
  int32_t* expert_source_counts;
  int32_t* expert_offsets;
  int32_t* tile_expert;
  int32_t* row_pair;
  int32_t* row_recv;
  int32_t* pair_row;
  int32_t* recv_offsets;
  int32_t* recv_tokens;
  int32_t* scratch_chunk_counts;
  int32_t* scratch_chunk_prefix;
  int32_t* scratch_chunk_recv;
  int32_t* scratch_chunk_recv_prefix;
  int32_t* scratch_chunk_bad;

  MOK_HOST_DEVICE static ScheduleView at(void* base, const ScheduleLayout& layout) {
    char* bytes = static_cast<char*>(base);
    auto i32 = [bytes](int64_t offset) { return reinterpret_cast<int32_t*>(bytes + offset); };
    ScheduleView view;
    view.header = reinterpret_cast<ScheduleHeader*>(bytes + layout.header);
    view.expert_counts = i32(layout.expert_counts);
    view.expert_source_counts = i32(layout.expert_source_counts);
    view.expert_offsets = i32(layout.expert_offsets);
    view.tile_expert = i32(layout.tile_expert);
    view.row_pair = i32(layout.row_pair);
    view.row_recv = i32(layout.row_recv);
    view.pair_row = i32(layout.pair_row);
    view.recv_offsets = i32(layout.recv_offsets);
    view.recv_tokens = i32(layout.recv_tokens);
    view.scratch_chunk_counts = i32(layout.scratch_chunk_counts);
    view.scratch_chunk_prefix = i32(layout.scratch_chunk_prefix);
    view.scratch_chunk_recv = i32(layout.scratch_chunk_recv);
    view.scratch_chunk_recv_prefix = i32(layout.scratch_chunk_recv_prefix);
    view.scratch_chunk_bad = i32(layout.scratch_chunk_bad);
    return view;
  }
};

// The source rank of receive-list entry `entry` (0 <= entry < recv_offsets[num_ranks]): the s
// with recv_offsets[s] <= entry < recv_offsets[s + 1], ranks with no entries skipped. The pull
// inside the gate/up GEMM finds a row's source this way (dispatch_local.cuh).
MOK_HOST_DEVICE inline int32_t recv_source_rank(const int32_t* recv_offsets, int32_t num_ranks,
                                                int32_t entry) {
  int32_t source = 0;
  while (source + 1 < num_ranks && recv_offsets[source + 1] <= entry) ++source;
  return source;
}

// An expert id as the header stores it: int64 ids outside the int32 range saturate, so a huge
// bad id never reads back as a valid one.
MOK_HOST_DEVICE inline int32_t saturate_expert_id(int64_t expert) {
  return expert > INT32_MAX   ? INT32_MAX
         : expert < INT32_MIN ? INT32_MIN
                              : static_cast<int32_t>(expert);
}

// Decodes a pair index.
struct PairCoord {
  int32_t src_rank;
  int32_t token;
  int32_t k;
};
MOK_HOST_DEVICE inline PairCoord decode_pair(const ScheduleParams& params, int32_t pair) {
  PairCoord coord;
  coord.k = pair % params.top_k;
  int32_t global_token = pair / params.top_k;
  coord.token = global_token % params.tokens_per_rank;
  coord.src_rank = global_token / params.tokens_per_rank;
  return coord;
}

// Builds the schedule on the host. `top_experts_all` is the gathered routing of all ranks,
// [R, T, K] row-major, int32 or int64. `buffer` holds layout.output_bytes (or more) bytes.
// Never fails on bad expert ids: it records them in the header (see schedule_status).
void build_schedule_host(const ScheduleLayout& layout, const void* top_experts_all,
                         DType expert_dtype, void* buffer);

// The send side of the receive lists, for a push dispatch (the source writes each row into the
// destination's receive buffer): for source rank params.local_rank, send_entry[d * T + t] is the
// entry token t takes in destination rank d's receive list, or -1 when t routes to no expert of
// d. By the receive list's order that entry is (tokens of ranks s < local_rank routed to d) +
// (tokens t' < t of local_rank routed to d). Ids outside [0, E) count as unrouted, as in the
// schedule. `send_entry` holds R * T entries.
void build_send_entries_host(const ScheduleParams& params, const void* top_experts_all,
                             DType expert_dtype, int32_t* send_entry);

// Compares the defined parts of two built schedules of the same layout (header, counts, offsets,
// tile_expert below num_tiles, row arrays below total_rows, pair_row, the receive list); ok when
// bit-identical, else names the first difference.
Status compare_schedules(const ScheduleLayout& layout, const void* expected, const void* actual);

// Turns the header's status into a Status naming the first bad entry (rank, token, slot, value).
Status schedule_status(const ScheduleParams& params, const ScheduleHeader& header);

}  // namespace mok
