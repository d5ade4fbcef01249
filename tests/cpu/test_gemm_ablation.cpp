// MOK_GEMM_ABLATION's values (src/layer/gemm_ablation.h): unset and "none" leave the GEMMs
// whole, "no-loads", "no-math" and "no-swiglu" name their ablations, anything else is refused with
// the value and the valid ones.
#include <gtest/gtest.h>

#include <string>

#include "layer/gemm_ablation.h"
#include "mok/error.h"

namespace mok {
namespace {

using kernels::GemmAblation;

TEST(GemmAblation, NamesEachAblation) {
  EXPECT_EQ(parse_gemm_ablation(nullptr), GemmAblation::kNone);
  EXPECT_EQ(parse_gemm_ablation(""), GemmAblation::kNone);
  EXPECT_EQ(parse_gemm_ablation("none"), GemmAblation::kNone);
  EXPECT_EQ(parse_gemm_ablation("no-loads"), GemmAblation::kNoLoads);
  EXPECT_EQ(parse_gemm_ablation("no-math"), GemmAblation::kNoMath);
  EXPECT_EQ(parse_gemm_ablation("no-swiglu"), GemmAblation::kNoSwiglu);
}

TEST(GemmAblation, RefusesOtherValuesNamingThem) {
  for (const char* value : {"no_loads", "No-Math", "1", "no-loads "}) {
    try {
      parse_gemm_ablation(value);
      ADD_FAILURE() << "accepted '" << value << "'";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      const std::string message = error.what();
      EXPECT_NE(message.find(std::string("'") + value + "'"), std::string::npos) << message;
      EXPECT_NE(message.find("no-loads"), std::string::npos) << message;
      EXPECT_NE(message.find("no-math"), std::string::npos) << message;
      EXPECT_NE(message.find("no-swiglu"), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace mok
