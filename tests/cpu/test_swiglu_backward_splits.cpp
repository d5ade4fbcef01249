// How the FP8 SwiGLU backward splits each row tile's I over CTAs
// (kernels::swiglu_backward_quantize_splits): the choice at the layer's shapes, and the rules it
// keeps (a divisor of the groups, one CTA a tile where the tiles fill their waves).
#include <gtest/gtest.h>

#include "kernels/stages/swiglu_backward_quantize.h"

namespace mok {
namespace {

using kernels::swiglu_backward_quantize_splits;

constexpr int64_t kSlots = 2 * 132;  // two CTAs an SM on an H100 or H200

TEST(SwigluBackwardSplits, LayerShapes) {
  // dsv3_local: 288 row tiles (36,864 rows) of I = 2048, eight 256-column groups. One CTA a tile
  // leaves 24 CTAs a second wave; eight runs of one group make nine short waves.
  EXPECT_EQ(swiglu_backward_quantize_splits(288, 8, kSlots), 8);
  // qwen3: 512 tiles of I = 768 (three groups) fill two waves nearly whole: no split.
  EXPECT_EQ(swiglu_backward_quantize_splits(512, 3, kSlots), 1);
  // sonic_e128: 2,048+ tiles of four groups: eight waves already, no split.
  EXPECT_EQ(swiglu_backward_quantize_splits(2112, 4, kSlots), 1);
  // A handful of tiles (a small batch): every group its own CTA.
  EXPECT_EQ(swiglu_backward_quantize_splits(6, 3, kSlots), 3);
}

TEST(SwigluBackwardSplits, DividesTheGroupsAndHandlesTheEdges) {
  for (int64_t tiles : {1, 7, 100, 264, 265, 300, 1000, 5000})
    for (int32_t groups : {1, 2, 3, 4, 5, 6, 8, 12, 16}) {
      const int32_t splits = swiglu_backward_quantize_splits(tiles, groups, kSlots);
      EXPECT_GE(splits, 1);
      EXPECT_LE(splits, groups);
      EXPECT_EQ(groups % splits, 0) << tiles << " tiles, " << groups << " groups";
    }
  EXPECT_EQ(swiglu_backward_quantize_splits(0, 8, kSlots), 1);
  EXPECT_EQ(swiglu_backward_quantize_splits(288, 1, kSlots), 1);
  EXPECT_EQ(swiglu_backward_quantize_splits(288, 8, 0), 1);
  // Exactly one wave of tiles: splitting only adds starts.
  EXPECT_EQ(swiglu_backward_quantize_splits(kSlots, 8, kSlots), 1);
}

}  // namespace
}  // namespace mok
