// Properties of the routing schedule (contract: include/mok/schedule.h), checked on the host
// builder over random and adversarial routings. The checker below recomputes everything from
// the routing on its own (it shares no code with the builder), and a test corrupts built
// schedules to show that it catches each kind of mistake.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "mok/schedule.h"
#include "mok/testing/routing.h"
#include "test_util.h"

namespace mok {
namespace {

constexpr uint8_t kPoisonByte = 0xAB;

std::string describe(const ScheduleParams& p) {
  return "R=" + std::to_string(p.num_ranks) + " T=" + std::to_string(p.tokens_per_rank) +
         " K=" + std::to_string(p.top_k) + " E=" + std::to_string(p.num_experts) +
         " local_rank=" + std::to_string(p.local_rank) +
         " row_align=" + std::to_string(p.row_align);
}

ScheduleParams make_params(int32_t ranks, int32_t tokens, int32_t top_k, int32_t local_experts,
                           int32_t local_rank, int32_t row_align) {
  ScheduleParams params;
  params.num_ranks = ranks;
  params.tokens_per_rank = tokens;
  params.top_k = top_k;
  params.num_experts = ranks * local_experts;
  params.local_rank = local_rank;
  params.row_align = row_align;
  return params;
}

// A schedule built on the host into a poisoned buffer of output_bytes.
struct HostSchedule {
  ScheduleLayout layout;
  std::vector<uint8_t> bytes;

  ScheduleView view() const { return ScheduleView::at(const_cast<uint8_t*>(bytes.data()), layout); }
  const ScheduleHeader& header() const {
    return *reinterpret_cast<const ScheduleHeader*>(bytes.data() + layout.header);
  }
};

template <typename ExpertId>
HostSchedule build(const ScheduleParams& params, const std::vector<ExpertId>& routing,
                   uint8_t poison = kPoisonByte) {
  HostSchedule schedule;
  schedule.layout = ScheduleLayout::make(params);
  schedule.bytes.assign(static_cast<size_t>(schedule.layout.output_bytes), poison);
  const DType dtype = sizeof(ExpertId) == 8 ? DType::kInt64 : DType::kInt32;
  build_schedule_host(schedule.layout, routing.data(), dtype, schedule.bytes.data());
  return schedule;
}

std::vector<int64_t> widen(const std::vector<int32_t>& routing) {
  return std::vector<int64_t>(routing.begin(), routing.end());
}

// Checks every property of the contract against an independent recount of `routing`. Returns
// an empty string when all hold, else the first violation. Never indexes out of bounds, however
// corrupt the schedule is.
std::string check_schedule(const ScheduleLayout& layout, const std::vector<int64_t>& routing,
                           const uint8_t* buffer) {
  const ScheduleParams& p = layout.params;
  const ScheduleView v = ScheduleView::at(const_cast<uint8_t*>(buffer), layout);
  const ScheduleHeader& header = *v.header;
  const int32_t local_experts = p.num_local_experts();
  const int32_t first_expert = p.first_local_expert();
  const int32_t ranks = p.num_ranks;
  const int64_t num_pairs = p.num_pairs();
  const int64_t pairs_per_rank = static_cast<int64_t>(p.tokens_per_rank) * p.top_k;
  const int64_t align = p.row_align;
  auto at = [](const char* what, int64_t index) {
    return std::string(what) + "[" + std::to_string(index) + "]";
  };

  // Independent recount: the local expert of each pair, counts, and the first bad id.
  std::vector<int32_t> local_of(static_cast<size_t>(num_pairs), -1);
  std::vector<int64_t> counts(static_cast<size_t>(local_experts) * ranks, 0);
  int64_t first_bad = -1;
  for (int64_t pair = 0; pair < num_pairs; ++pair) {
    const int64_t expert = routing[pair];
    if (expert < -1 || expert >= p.num_experts) {
      if (first_bad < 0) first_bad = pair;
      continue;
    }
    if (expert < first_expert || expert >= first_expert + local_experts) continue;
    local_of[pair] = static_cast<int32_t>(expert - first_expert);
    ++counts[local_of[pair] * ranks + pair / pairs_per_rank];
  }

  if (first_bad < 0) {
    if (header.status != static_cast<int32_t>(ScheduleStatus::kOk) || header.error_pair != -1 ||
        header.error_value != 0)
      return "header reports an error (status " + std::to_string(header.status) + ", pair " +
             std::to_string(header.error_pair) + ") for a valid routing";
  } else {
    if (header.status != static_cast<int32_t>(ScheduleStatus::kBadExpertId))
      return "header status " + std::to_string(header.status) + " misses bad pair " +
             std::to_string(first_bad);
    if (header.error_pair != first_bad)
      return "header.error_pair = " + std::to_string(header.error_pair) +
             "; the first bad pair is " + std::to_string(first_bad);
    if (header.error_value != saturate_expert_id(routing[first_bad]))
      return "header.error_value = " + std::to_string(header.error_value) + "; routing has " +
             std::to_string(routing[first_bad]);
  }

  // Counts per expert and per (expert, source rank).
  for (int32_t e = 0; e < local_experts; ++e) {
    int64_t total = 0;
    for (int32_t s = 0; s < ranks; ++s) {
      const int64_t want = counts[e * ranks + s];
      total += want;
      if (v.expert_source_counts[e * ranks + s] != want)
        return at("expert_source_counts", e * ranks + s) + " = " +
               std::to_string(v.expert_source_counts[e * ranks + s]) + "; recount gives " +
               std::to_string(want);
    }
    if (v.expert_counts[e] != total)
      return at("expert_counts", e) + " = " + std::to_string(v.expert_counts[e]) +
             "; recount gives " + std::to_string(total);
  }

  // Segments: consecutive, each starting at a multiple of row_align, exactly the count rounded
  // up to row_align long.
  if (v.expert_offsets[0] != 0) return "expert_offsets[0] = " + std::to_string(v.expert_offsets[0]);
  for (int32_t e = 0; e < local_experts; ++e) {
    const int64_t length = static_cast<int64_t>(v.expert_offsets[e + 1]) - v.expert_offsets[e];
    const int64_t want = (v.expert_counts[e] + align - 1) / align * align;
    if (v.expert_offsets[e] % align != 0)
      return at("expert_offsets", e) + " = " + std::to_string(v.expert_offsets[e]) +
             " is not a multiple of row_align";
    if (length != want)
      return "segment " + std::to_string(e) + " has " + std::to_string(length) + " rows; count " +
             std::to_string(v.expert_counts[e]) + " rounded up gives " + std::to_string(want);
  }
  const int64_t total_rows = header.total_rows;
  if (v.expert_offsets[local_experts] != total_rows)
    return "expert_offsets[E_loc] = " + std::to_string(v.expert_offsets[local_experts]) +
           "; header.total_rows = " + std::to_string(total_rows);
  if (total_rows < 0 || total_rows > p.max_rows() || total_rows % align != 0)
    return "header.total_rows = " + std::to_string(total_rows) + " (max_rows " +
           std::to_string(p.max_rows()) + ")";
  if (static_cast<int64_t>(header.num_tiles) * align != total_rows)
    return "header.num_tiles = " + std::to_string(header.num_tiles) + " for " +
           std::to_string(total_rows) + " rows";

  for (int32_t e = 0; e < local_experts; ++e)
    for (int64_t tile = v.expert_offsets[e] / align; tile < v.expert_offsets[e + 1] / align; ++tile)
      if (v.tile_expert[tile] != e)
        return at("tile_expert", tile) + " = " + std::to_string(v.tile_expert[tile]) +
               "; the tile lies in segment " + std::to_string(e);

  // Receive list, recomputed: the (src, token) with a routed slot, in (src, token) order.
  std::vector<int32_t> entry_of_token(static_cast<size_t>(ranks) * p.tokens_per_rank, -1);
  int32_t entries = 0;
  for (int32_t s = 0; s < ranks; ++s) {
    if (v.recv_offsets[s] != entries)
      return at("recv_offsets", s) + " = " + std::to_string(v.recv_offsets[s]) +
             "; recount gives " + std::to_string(entries);
    for (int32_t t = 0; t < p.tokens_per_rank; ++t) {
      const int64_t global_token = static_cast<int64_t>(s) * p.tokens_per_rank + t;
      bool routed = false;
      for (int32_t k = 0; k < p.top_k; ++k) routed |= local_of[global_token * p.top_k + k] >= 0;
      if (!routed) continue;
      if (v.recv_tokens[entries] != t)
        return at("recv_tokens", entries) + " = " + std::to_string(v.recv_tokens[entries]) +
               "; expected token " + std::to_string(t) + " of rank " + std::to_string(s);
      entry_of_token[global_token] = entries++;
    }
  }
  if (v.recv_offsets[ranks] != entries || header.total_recv != entries)
    return "recv_offsets[R] = " + std::to_string(v.recv_offsets[ranks]) +
           ", header.total_recv = " + std::to_string(header.total_recv) + "; recount gives " +
           std::to_string(entries);

  // Rows: every routed pair once, in increasing pair order inside its segment; padding after.
  std::vector<int32_t> times_seen(static_cast<size_t>(num_pairs), 0);
  for (int32_t e = 0; e < local_experts; ++e) {
    const int64_t begin = v.expert_offsets[e];
    const int64_t routed_end = begin + v.expert_counts[e];
    int64_t previous = -1;
    for (int64_t row = begin; row < routed_end; ++row) {
      const int64_t pair = v.row_pair[row];
      if (pair < 0 || pair >= num_pairs)
        return at("row_pair", row) + " = " + std::to_string(pair) + " is not a pair of segment " +
               std::to_string(e);
      if (local_of[pair] != e)
        return at("row_pair", row) + " = " + std::to_string(pair) + " belongs to local expert " +
               std::to_string(local_of[pair]) + ", not segment " + std::to_string(e);
      if (pair <= previous)
        return "segment " + std::to_string(e) + " is not in increasing pair order at row " +
               std::to_string(row);
      previous = pair;
      ++times_seen[pair];
      if (v.pair_row[pair] != row)
        return at("pair_row", pair) + " = " + std::to_string(v.pair_row[pair]) +
               "; row_pair places it in row " + std::to_string(row);
      const int32_t want_entry = entry_of_token[pair / p.top_k];
      if (v.row_recv[row] != want_entry)
        return at("row_recv", row) + " = " + std::to_string(v.row_recv[row]) +
               "; the token's receive entry is " + std::to_string(want_entry);
      // What the pull inside the gate/up GEMM reads for this row: the source rank's token.
      const int64_t pairs_per_rank = static_cast<int64_t>(p.tokens_per_rank) * p.top_k;
      const int32_t source = recv_source_rank(v.recv_offsets, ranks, want_entry);
      if (source != pair / pairs_per_rank ||
          v.recv_tokens[want_entry] != pair % pairs_per_rank / p.top_k)
        return at("row_recv", row) + " = " + std::to_string(want_entry) + " decodes to rank " +
               std::to_string(source) + ", token " + std::to_string(v.recv_tokens[want_entry]) +
               "; the row's pair " + std::to_string(pair) + " is of rank " +
               std::to_string(pair / pairs_per_rank);
    }
    for (int64_t row = routed_end; row < v.expert_offsets[e + 1]; ++row)
      if (v.row_pair[row] != -1 || v.row_recv[row] != -1)
        return "padding row " + std::to_string(row) + " has row_pair " +
               std::to_string(v.row_pair[row]) + ", row_recv " + std::to_string(v.row_recv[row]);
  }
  for (int64_t pair = 0; pair < num_pairs; ++pair) {
    if (local_of[pair] < 0) {
      if (v.pair_row[pair] != -1)
        return at("pair_row", pair) + " = " + std::to_string(v.pair_row[pair]) +
               " for a pair not routed here";
    } else if (times_seen[pair] != 1) {
      return "routed pair " + std::to_string(pair) + " appears in " +
             std::to_string(times_seen[pair]) + " rows";
    }
  }
  return "";
}

// The words of a schedule that the contract specifies (rows past total_rows, tiles past
// num_tiles and receive entries past total_recv are unspecified), for comparing two builds.
std::vector<int32_t> specified_words(const ScheduleLayout& layout, const uint8_t* buffer) {
  const ScheduleParams& p = layout.params;
  const ScheduleView v = ScheduleView::at(const_cast<uint8_t*>(buffer), layout);
  const ScheduleHeader& h = *v.header;
  std::vector<int32_t> words;
  auto append = [&words](const int32_t* data, int64_t count) {
    words.insert(words.end(), data, data + count);
  };
  append(reinterpret_cast<const int32_t*>(v.header), sizeof(ScheduleHeader) / sizeof(int32_t));
  append(v.expert_counts, p.num_local_experts());
  append(v.expert_source_counts, static_cast<int64_t>(p.num_local_experts()) * p.num_ranks);
  append(v.expert_offsets, p.num_local_experts() + 1);
  append(v.tile_expert, std::clamp<int64_t>(h.num_tiles, 0, p.max_tiles()));
  append(v.row_pair, std::clamp<int64_t>(h.total_rows, 0, p.max_rows()));
  append(v.row_recv, std::clamp<int64_t>(h.total_rows, 0, p.max_rows()));
  append(v.pair_row, p.num_pairs());
  append(v.recv_offsets, p.num_ranks + 1);
  append(v.recv_tokens, std::clamp<int64_t>(h.total_recv, 0,
                                            static_cast<int64_t>(p.num_ranks) * p.tokens_per_rank));
  return words;
}

// ---------------------------------------------------------------------------------------------

TEST(ScheduleLayoutTest, ArraysAreAlignedOrderedAndDisjoint) {
  for (const ScheduleParams& params :
       {make_params(1, 0, 1, 1, 0, 128), make_params(3, 65, 6, 8, 2, 64),
        make_params(8, 4096, 8, 32, 5, 128), make_params(4, 1000, 32, 2048, 0, 1024)}) {
    SCOPED_TRACE(describe(params));
    const ScheduleLayout l = ScheduleLayout::make(params);
    const int64_t e = params.num_local_experts(), chunks = params.num_chunks();
    const int64_t tokens = static_cast<int64_t>(params.num_ranks) * params.tokens_per_rank;
    const std::vector<std::pair<int64_t, int64_t>> arrays = {
        {l.header, sizeof(ScheduleHeader)},
        {l.expert_counts, 4 * e},
        {l.expert_source_counts, 4 * e * params.num_ranks},
        {l.expert_offsets, 4 * (e + 1)},
        {l.tile_expert, 4 * params.max_tiles()},
        {l.row_pair, 4 * params.max_rows()},
        {l.row_recv, 4 * params.max_rows()},
        {l.pair_row, 4 * params.num_pairs()},
        {l.recv_offsets, 4 * (params.num_ranks + 1)},
        {l.recv_tokens, 4 * tokens},
        {l.scratch_chunk_counts, 4 * chunks * e},
        {l.scratch_chunk_prefix, 4 * chunks * e},
        {l.scratch_chunk_recv, 4 * chunks},
        {l.scratch_chunk_recv_prefix, 4 * chunks},
        {l.scratch_chunk_bad, 4 * chunks}};
    int64_t end = 0;
    for (size_t i = 0; i < arrays.size(); ++i) {
      EXPECT_EQ(arrays[i].first % 256, 0) << "array " << i;
      EXPECT_GE(arrays[i].first, end) << "array " << i << " overlaps the one before";
      end = arrays[i].first + arrays[i].second;
      if (i == 9) EXPECT_LE(end, l.output_bytes) << "recv_tokens runs past output_bytes";
    }
    EXPECT_LE(l.output_bytes, l.scratch_chunk_counts);
    EXPECT_LE(end, l.total_bytes);
  }
}

TEST(ScheduleLayoutTest, MaxRowsFollowsTheFormula) {
  const ScheduleParams params = make_params(8, 4096, 8, 32, 0, 128);
  EXPECT_EQ(params.max_rows(), (8LL * 4096 * 8 + 32 * 127 + 127) / 128 * 128);
  EXPECT_EQ(params.max_tiles() * 128, params.max_rows());
  EXPECT_EQ(params.chunks_per_rank(), 64);
  EXPECT_EQ(make_params(2, 65, 1, 1, 0, 128).chunks_per_rank(), 2);
  EXPECT_EQ(make_params(2, 0, 1, 1, 0, 128).num_chunks(), 0);
}

TEST(ScheduleParamsValidation, EachBadFieldIsNamed) {
  struct Case {
    ScheduleParams params;
    const char* expect;
  };
  ScheduleParams huge = make_params(1024, 1 << 20, 32, 1, 0, 128);
  const Case cases[] = {
      {make_params(0, 64, 2, 1, 0, 128), "num_ranks = 0"},
      {make_params(1025, 64, 2, 1, 0, 128), "num_ranks = 1025"},
      {[] {
         ScheduleParams p = make_params(4, 64, 2, 2, 0, 128);
         p.num_experts = 10;
         return p;
       }(),
       "num_experts = 10"},
      {[] {
         ScheduleParams p = make_params(4, 64, 2, 2, 0, 128);
         p.num_experts = 0;
         return p;
       }(),
       "num_experts = 0"},
      {make_params(4, 64, 2, 2, 4, 128), "local_rank = 4"},
      {make_params(4, 64, 2, 2, -1, 128), "local_rank = -1"},
      {make_params(4, -1, 2, 2, 0, 128), "tokens_per_rank = -1"},
      {make_params(4, 64, 0, 2, 0, 128), "top_k = 0"},
      {make_params(4, 64, 2, 2, 0, 100), "row_align = 100"},
      {make_params(4, 64, 2, 2, 0, 8), "row_align = 8"},
      {make_params(4, 64, 2, 2, 0, 2048), "row_align = 2048"},
      {huge, "R*T*K"},
  };
  for (const Case& c : cases) {
    const Status status = validate_schedule_params(c.params);
    EXPECT_EQ(status.code, ErrorCode::kInvalidArgument) << c.expect;
    EXPECT_NE(status.message.find(c.expect), std::string::npos)
        << "message '" << status.message << "' does not name '" << c.expect << "'";
    EXPECT_THROW(ScheduleLayout::make(c.params), Error) << c.expect;
  }
  EXPECT_TRUE(validate_schedule_params(make_params(1024, 1, 32, 1, 1023, 1024)).ok());
  EXPECT_TRUE(validate_schedule_params(make_params(1, 0, 1, 1, 0, 16)).ok());
}

// Every RoutingKind over a grid of shapes: all properties hold, int64 ids give the same
// schedule, and a second build gives the same bytes.
class ScheduleProperties : public ::testing::TestWithParam<RoutingKind> {};

TEST_P(ScheduleProperties, HoldOnEveryShape) {
  const RoutingKind kind = GetParam();
  uint64_t seed = 1000 + static_cast<uint64_t>(kind);
  int checked = 0;
  for (int32_t ranks : {1, 2, 3, 4, 8})
    for (int32_t tokens : {0, 1, 63, 64, 65, 200})
      for (int32_t top_k : {1, 2, 6, 8})
        for (int32_t local_experts : {1, 2, 8, 32})
          for (int32_t row_align : {128, 64}) {
            const std::vector<int32_t> routing =
                generate_routing(kind, ranks, tokens, top_k, ranks * local_experts, ++seed);
            const std::vector<int64_t> wide = widen(routing);
            std::vector<int32_t> local_ranks = {0, ranks / 2, ranks - 1};
            local_ranks.erase(std::unique(local_ranks.begin(), local_ranks.end()),
                              local_ranks.end());
            for (int32_t local_rank : local_ranks) {
              const ScheduleParams params =
                  make_params(ranks, tokens, top_k, local_experts, local_rank, row_align);
              SCOPED_TRACE(std::string(routing_kind_name(kind)) + " " + describe(params));
              const HostSchedule schedule = build(params, routing);
              const std::string problem =
                  check_schedule(schedule.layout, wide, schedule.bytes.data());
              ASSERT_EQ(problem, "");
              const HostSchedule again = build(params, routing);
              ASSERT_EQ(schedule.bytes, again.bytes) << "a second build differs";
              const HostSchedule from_int64 = build(params, wide, 0x5C);
              ASSERT_EQ(specified_words(schedule.layout, schedule.bytes.data()),
                        specified_words(from_int64.layout, from_int64.bytes.data()))
                  << "int64 ids give another schedule";
              ++checked;
            }
          }
  EXPECT_GT(checked, 1000);
}

INSTANTIATE_TEST_SUITE_P(AllRoutingKinds, ScheduleProperties,
                         ::testing::ValuesIn(all_routing_kinds()),
                         [](const ::testing::TestParamInfo<RoutingKind>& info) {
                           return std::string(routing_kind_name(info.param));
                         });

TEST(ScheduleWorstCase, AllPairsToOneExpertFit) {
  for (int32_t local_experts : {1, 2, 8, 32}) {
    const ScheduleParams params = make_params(8, 200, 8, local_experts, 0, 128);
    SCOPED_TRACE(describe(params));
    const std::vector<int32_t> routing =
        generate_routing(RoutingKind::kOneExpert, 8, 200, 8, 8 * local_experts, 7);
    const HostSchedule schedule = build(params, routing);
    ASSERT_EQ(check_schedule(schedule.layout, widen(routing), schedule.bytes.data()), "");
    const int64_t all_pairs = params.num_pairs();
    EXPECT_EQ(schedule.header().total_rows, (all_pairs + 127) / 128 * 128);
    EXPECT_LE(schedule.header().total_rows, params.max_rows());
    EXPECT_EQ(schedule.view().expert_counts[0], all_pairs);
    EXPECT_EQ(schedule.header().total_recv, 8 * 200);
  }
}

// Every pair routed here, and every segment one row past a multiple of row_align: the most
// padding possible, which is exactly what max_rows is sized for.
TEST(ScheduleWorstCase, MaximalPaddingReachesMaxRowsExactly) {
  constexpr int32_t kExperts = 8, kAlign = 64, kPerExpert = kAlign + 1;
  const ScheduleParams params = make_params(1, kExperts * kPerExpert, 1, kExperts, 0, kAlign);
  std::vector<int32_t> routing(static_cast<size_t>(params.num_pairs()));
  for (size_t t = 0; t < routing.size(); ++t) routing[t] = static_cast<int32_t>(t / kPerExpert);
  const HostSchedule schedule = build(params, routing);
  ASSERT_EQ(check_schedule(schedule.layout, widen(routing), schedule.bytes.data()), "");
  EXPECT_EQ(schedule.header().total_rows, params.max_rows());
  EXPECT_EQ(schedule.header().total_rows, kExperts * 2 * kAlign);
}

// Over all ranks' schedules, each valid routed slot is received exactly once: nothing dropped.
TEST(ScheduleAcrossRanks, EveryRoutedPairLandsOnExactlyOneRank) {
  for (RoutingKind kind : all_routing_kinds()) {
    const int32_t ranks = 4, tokens = 130, top_k = 6, local_experts = 8;
    const std::vector<int32_t> routing =
        generate_routing(kind, ranks, tokens, top_k, ranks * local_experts, 99);
    std::vector<int32_t> owners(routing.size(), 0);
    for (int32_t r = 0; r < ranks; ++r) {
      const HostSchedule schedule =
          build(make_params(ranks, tokens, top_k, local_experts, r, 128), routing);
      const int32_t* pair_row = schedule.view().pair_row;
      for (size_t pair = 0; pair < routing.size(); ++pair) owners[pair] += pair_row[pair] >= 0;
    }
    for (size_t pair = 0; pair < routing.size(); ++pair)
      ASSERT_EQ(owners[pair], routing[pair] >= 0 ? 1 : 0)
          << routing_kind_name(kind) << " pair " << pair << " expert " << routing[pair];
  }
}

// The send side agrees with every destination's receive list: source s's token t sits at
// entry send_entry[d * T + t] of d's list exactly when it routes to d, and every entry of d's
// list from s is some token's send entry.
TEST(SendEntries, MatchEveryDestinationsReceiveList) {
  for (RoutingKind kind : all_routing_kinds()) {
    const int32_t ranks = 4, tokens = 130, top_k = 6, local_experts = 8;
    std::vector<int32_t> routing =
        generate_routing(kind, ranks, tokens, top_k, ranks * local_experts, 7);
    routing[5] = ranks * local_experts + 3;  // a bad id counts as unrouted
    std::vector<HostSchedule> schedules;
    for (int32_t d = 0; d < ranks; ++d)
      schedules.push_back(build(make_params(ranks, tokens, top_k, local_experts, d, 128), routing));
    for (int32_t source = 0; source < ranks; ++source) {
      std::vector<int32_t> send(static_cast<size_t>(ranks) * tokens, -2);
      build_send_entries_host(make_params(ranks, tokens, top_k, local_experts, source, 128),
                              routing.data(), DType::kInt32, send.data());
      for (int32_t d = 0; d < ranks; ++d) {
        const ScheduleView view = schedules[d].view();
        int32_t matched = 0;
        for (int32_t token = 0; token < tokens; ++token) {
          const int32_t entry = send[static_cast<size_t>(d) * tokens + token];
          bool routes_to_d = false;
          for (int32_t k = 0; k < top_k; ++k) {
            const int32_t expert =
                routing[(static_cast<size_t>(source) * tokens + token) * top_k + k];
            routes_to_d |=
                expert >= 0 && expert < ranks * local_experts && expert / local_experts == d;
          }
          ASSERT_EQ(entry >= 0, routes_to_d) << routing_kind_name(kind) << " source " << source
                                             << " token " << token << " destination " << d;
          if (entry < 0) continue;
          ++matched;
          ASSERT_GE(entry, view.recv_offsets[source]);
          ASSERT_LT(entry, view.recv_offsets[source + 1]);
          ASSERT_EQ(view.recv_tokens[entry], token)
              << routing_kind_name(kind) << " source " << source << " destination " << d;
        }
        EXPECT_EQ(matched, view.recv_offsets[source + 1] - view.recv_offsets[source]);
      }
    }
  }
}

TEST(ScheduleDeterminism, OutputDoesNotDependOnPriorBufferContents) {
  const ScheduleParams params = make_params(3, 200, 6, 8, 1, 128);
  const std::vector<int32_t> routing = generate_routing(RoutingKind::kSkewed, 3, 200, 6, 24, 5);
  const HostSchedule a = build(params, routing, 0x00);
  const HostSchedule b = build(params, routing, 0xFF);
  EXPECT_EQ(specified_words(a.layout, a.bytes.data()), specified_words(b.layout, b.bytes.data()));

  // Rebuilding over an older schedule of another routing gives the fresh result.
  HostSchedule reused = build(params, generate_routing(RoutingKind::kOneExpert, 3, 200, 6, 24, 6));
  build_schedule_host(reused.layout, routing.data(), DType::kInt32, reused.bytes.data());
  EXPECT_EQ(specified_words(a.layout, a.bytes.data()),
            specified_words(reused.layout, reused.bytes.data()));
}

// The checker must fail when the schedule is wrong; each corruption below breaks one property.
TEST(ScheduleChecker, CatchesEachKindOfCorruption) {
  const ScheduleParams params = make_params(2, 100, 4, 4, 1, 64);
  const std::vector<int32_t> routing = generate_routing(RoutingKind::kHoles, 2, 100, 4, 8, 3);
  const std::vector<int64_t> wide = widen(routing);
  const HostSchedule good = build(params, routing);
  ASSERT_EQ(check_schedule(good.layout, wide, good.bytes.data()), "");
  ASSERT_GT(good.header().total_recv, 2);

  struct Corruption {
    const char* name;
    void (*apply)(ScheduleView&);
  };
  const Corruption corruptions[] = {
      {"swap two rows", [](ScheduleView& v) { std::swap(v.row_pair[0], v.row_pair[1]); }},
      {"drop a pair", [](ScheduleView& v) { v.row_pair[0] = -1; }},
      {"duplicate a pair", [](ScheduleView& v) { v.row_pair[1] = v.row_pair[0]; }},
      {"pair_row off", [](ScheduleView& v) { v.pair_row[v.row_pair[0]] += 1; }},
      {"unrouted pair with a row",
       [](ScheduleView& v) {
         for (int32_t pair = 0;; ++pair)
           if (v.pair_row[pair] < 0) {
             v.pair_row[pair] = 0;
             return;
           }
       }},
      {"count off", [](ScheduleView& v) { v.expert_counts[1] += 1; }},
      {"source count off", [](ScheduleView& v) { v.expert_source_counts[1] -= 1; }},
      {"misaligned segment", [](ScheduleView& v) { v.expert_offsets[1] += 1; }},
      {"wrong tile owner", [](ScheduleView& v) { v.tile_expert[0] = 3; }},
      {"padding not -1",
       [](ScheduleView& v) { v.row_recv[v.expert_offsets[0] + v.expert_counts[0]] = 0; }},
      {"receive token off", [](ScheduleView& v) { v.recv_tokens[1] += 1; }},
      {"receive offset off", [](ScheduleView& v) { v.recv_offsets[1] += 1; }},
      {"row_recv off", [](ScheduleView& v) { v.row_recv[0] += 1; }},
      {"false error", [](ScheduleView& v) { v.header->error_pair = 0; }},
      {"total_rows off", [](ScheduleView& v) { v.header->total_rows += 64; }},
  };
  for (const Corruption& corruption : corruptions) {
    HostSchedule bad = good;
    ScheduleView view = bad.view();
    ASSERT_GT(view.expert_counts[0], 1);
    ASSERT_NE(view.expert_counts[0] % 64, 0) << "segment 0 needs a padding row";
    corruption.apply(view);
    EXPECT_NE(check_schedule(bad.layout, wide, bad.bytes.data()), "")
        << "the checker missed: " << corruption.name;
  }
}

TEST(ScheduleBadIds, LowestBadPairIsReportedAndTreatedAsUnrouted) {
  const int32_t ranks = 3, tokens = 70, top_k = 4, local_experts = 4;
  const int32_t experts = ranks * local_experts;
  const ScheduleParams params = make_params(ranks, tokens, top_k, local_experts, 1, 64);
  const std::vector<int32_t> clean =
      generate_routing(RoutingKind::kUniform, ranks, tokens, top_k, experts, 11);
  auto pair_index = [&](int32_t rank, int32_t token, int32_t k) {
    return (static_cast<size_t>(rank) * tokens + token) * top_k + k;
  };

  // Several bad ids; the lowest pair index (rank 1, token 5, k 2) is the one reported.
  std::vector<int32_t> routing = clean;
  routing[pair_index(2, 0, 0)] = experts;
  routing[pair_index(1, 5, 2)] = -2;
  routing[pair_index(1, 9, 0)] = 1 << 30;
  std::vector<int32_t> as_unrouted = routing;
  for (int32_t& id : as_unrouted)
    if (id < -1 || id >= experts) id = -1;

  const HostSchedule schedule = build(params, routing);
  ASSERT_EQ(check_schedule(schedule.layout, widen(routing), schedule.bytes.data()), "");
  EXPECT_EQ(schedule.header().status, static_cast<int32_t>(ScheduleStatus::kBadExpertId));
  EXPECT_EQ(schedule.header().error_pair, static_cast<int32_t>(pair_index(1, 5, 2)));
  EXPECT_EQ(schedule.header().error_value, -2);
  const Status status = schedule_status(params, schedule.header());
  EXPECT_EQ(status.code, ErrorCode::kInvalidArgument);
  for (const char* part : {"rank 1", "token 5", "k 2", "= -2", "[0, 12)"})
    EXPECT_NE(status.message.find(part), std::string::npos)
        << "message '" << status.message << "' lacks '" << part << "'";

  // Apart from the header, the schedule is that of the routing with bad ids set to -1.
  const HostSchedule reference = build(params, as_unrouted);
  std::vector<int32_t> got = specified_words(schedule.layout, schedule.bytes.data());
  std::vector<int32_t> want = specified_words(reference.layout, reference.bytes.data());
  constexpr size_t kHeaderWords = sizeof(ScheduleHeader) / sizeof(int32_t);
  got.erase(got.begin() + 3, got.begin() + kHeaderWords);  // status, error_pair, error_value, ...
  want.erase(want.begin() + 3, want.begin() + kHeaderWords);
  EXPECT_EQ(got, want);
}

TEST(ScheduleBadIds, Int64IdsOutsideInt32AreCaught) {
  const ScheduleParams params = make_params(2, 64, 2, 4, 0, 128);
  const std::vector<int32_t> clean = generate_routing(RoutingKind::kUniform, 2, 64, 2, 8, 12);
  for (int64_t bad : {int64_t{8}, int64_t{-2}, int64_t{1} << 40, -(int64_t{1} << 33) - 3,
                      std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE("bad id " + std::to_string(bad));
    std::vector<int64_t> routing = widen(clean);
    routing[200] = bad;
    routing[201] = 9;  // a later bad pair is not the one reported
    const HostSchedule schedule = build(params, routing);
    ASSERT_EQ(check_schedule(schedule.layout, routing, schedule.bytes.data()), "");
    EXPECT_EQ(schedule.header().error_pair, 200);
    EXPECT_EQ(schedule.header().error_value, saturate_expert_id(bad));
    EXPECT_TRUE(bad < 0 || schedule.header().error_value >= 8)
        << "a huge id must not read back as a valid one";
    const Status status = schedule_status(params, schedule.header());
    EXPECT_FALSE(status.ok());
    EXPECT_NE(status.message.find("rank 1, token 36, k 0"), std::string::npos) << status.message;
  }
}

TEST(ScheduleBadIds, StatusWordsDecode) {
  const ScheduleParams params = make_params(2, 64, 2, 4, 0, 128);
  ScheduleHeader header{};
  header.status = static_cast<int32_t>(ScheduleStatus::kOk);
  header.error_pair = -1;
  EXPECT_TRUE(schedule_status(params, header).ok());
  header.status = 12345;
  const Status unknown = schedule_status(params, header);
  EXPECT_EQ(unknown.code, ErrorCode::kInternal);
  EXPECT_NE(unknown.message.find("12345"), std::string::npos);
}

TEST(ScheduleBuildHost, RejectsNonIntegerIds) {
  const ScheduleParams params = make_params(1, 4, 1, 2, 0, 128);
  const ScheduleLayout layout = ScheduleLayout::make(params);
  std::vector<uint8_t> buffer(static_cast<size_t>(layout.output_bytes));
  const std::vector<float> routing(4, 0.0f);
  test::expect_invalid_argument(
      [&] { build_schedule_host(layout, routing.data(), DType::kFloat32, buffer.data()); },
      "int32, int64");
}

}  // namespace
}  // namespace mok
