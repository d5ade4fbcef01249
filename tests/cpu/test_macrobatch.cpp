// The macrobatch ring's arithmetic (src/kernels/macrobatch.h): row ranges tile the schedule, and
// the weight-gradient slices with their partial slots reproduce the one-pass fp32 reduction bit
// for bit, whatever the macrobatch size.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/common/macrobatch.h"
#include "mok/testing/routing.h"

namespace mok::kernels {
namespace {

// Expert segments like a schedule's: each a multiple of 128 rows (0 allowed), contiguous.
std::vector<int64_t> random_offsets(SplitMix64& rng, int32_t experts, int32_t max_tiles) {
  std::vector<int64_t> offsets{0};
  for (int32_t e = 0; e < experts; ++e)
    offsets.push_back(offsets.back() + 128 * static_cast<int64_t>(rng.below(max_tiles + 1)));
  return offsets;
}

TEST(Macrobatch, RowRangesTileTheFilledRows) {
  for (const int64_t total : {0, 128, 1280, 4096, 5120})
    for (const int64_t m_rows : {128, 512, 1024, 4096, 1 << 20}) {
      const int32_t used = macrobatches_used(total, m_rows);
      int64_t next = 0;
      for (int32_t m = 0; m < used + 2; ++m) {
        const RowRange range = macrobatch_rows(m, m_rows, total);
        if (m < used) {
          EXPECT_EQ(range.begin, next);
          EXPECT_GT(range.end, range.begin);
          EXPECT_LE(range.end - range.begin, m_rows);
          next = range.end;
        } else {
          EXPECT_EQ(range.begin, range.end) << "macrobatch " << m << " past the rows is empty";
        }
      }
      EXPECT_EQ(next, total);
    }
}

// One weight-gradient element of each expert: the one-pass reduction (fp32, row order) against
// the macrobatched one (slices in order m = 0, 1, ..., partials through two slots, stores of
// one macrobatch made after its loads), over random segments and values.
TEST(Macrobatch, WeightGradSlicesKeepTheOnePassBits) {
  SplitMix64 rng(31);
  for (int trial = 0; trial < 40; ++trial) {
    const int32_t experts = 1 + static_cast<int32_t>(rng.below(12));
    const std::vector<int64_t> offsets = random_offsets(rng, experts, trial % 5 == 0 ? 40 : 6);
    const int64_t total = offsets.back();
    std::vector<float> values(static_cast<size_t>(total));
    for (float& value : values) value = static_cast<float>(rng.uniform() * 2.0 - 1.0) * 3.7f;
    std::vector<float> one_pass(static_cast<size_t>(experts), 0.0f);
    for (int32_t e = 0; e < experts; ++e)
      for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) one_pass[e] += values[row];

    for (const int64_t m_rows : {128, 256, 384, 1024, 4096}) {
      SCOPED_TRACE("trial " + std::to_string(trial) + ", M = " + std::to_string(m_rows));
      const int32_t launched = macrobatches_used(total, m_rows) + 1;  // the host launches more
      std::vector<float> result(static_cast<size_t>(experts), -1.0f);
      std::vector<int> final_stores(static_cast<size_t>(experts), 0);
      float slots[2] = {0.0f, 0.0f};
      for (int32_t m = 0; m < std::max(launched, 1); ++m) {
        float pending_slot[2];
        bool pending[2] = {false, false};
        int32_t partial_stores = 0;
        for (int32_t e = 0; e < experts; ++e) {
          const WeightGradSlice slice = weight_grad_slice(offsets[e], offsets[e + 1], m, m_rows);
          if (!slice.active) continue;
          ASSERT_LE(slice.k_begin, slice.k_end);
          const RowRange range = macrobatch_rows(m, m_rows, total);
          if (slice.k_end > slice.k_begin) {
            ASSERT_GE(slice.k_begin, range.begin);
            ASSERT_LE(slice.k_end, range.end);
          }
          float accumulator = slice.load_partial ? slots[slice.load_slot] : 0.0f;
          for (int64_t row = slice.k_begin; row < slice.k_end; ++row) accumulator += values[row];
          if (slice.store_final) {
            result[e] = accumulator;
            ++final_stores[e];
          } else {
            ASSERT_FALSE(pending[slice.store_slot]) << "two partials in one slot";
            pending[slice.store_slot] = true;
            pending_slot[slice.store_slot] = accumulator;
            ++partial_stores;
          }
        }
        EXPECT_LE(partial_stores, 1) << "a boundary cuts at most one segment";
        for (int slot = 0; slot < 2; ++slot)
          if (pending[slot]) slots[slot] = pending_slot[slot];
      }
      for (int32_t e = 0; e < experts; ++e) {
        EXPECT_EQ(final_stores[e], 1) << "expert " << e;
        EXPECT_EQ(result[e], one_pass[e])
            << "expert " << e << " rows [" << offsets[e] << ", " << offsets[e + 1] << ")";
      }
    }
  }
}

}  // namespace
}  // namespace mok::kernels
