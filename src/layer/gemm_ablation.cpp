// MOK_GEMM_ABLATION (gemm_ablation.h).
#include "layer/gemm_ablation.h"

#include <cstdlib>
#include <string>

#include "mok/error.h"

namespace mok {

kernels::GemmAblation parse_gemm_ablation(const char* value) {
  const std::string name = value != nullptr ? value : "";
  if (name.empty() || name == "none") return kernels::GemmAblation::kNone;
  if (name == "no-loads") return kernels::GemmAblation::kNoLoads;
  if (name == "no-math") return kernels::GemmAblation::kNoMath;
  if (name == "no-swiglu") return kernels::GemmAblation::kNoSwiglu;
  throw Error(ErrorCode::kInvalidArgument,
              "MOK_GEMM_ABLATION='" + name + "': valid are none, no-loads, no-math and no-swiglu");
}

kernels::GemmAblation gemm_ablation_from_env() {
  static const kernels::GemmAblation ablation =
      parse_gemm_ablation(std::getenv("MOK_GEMM_ABLATION"));
  return ablation;
}

}  // namespace mok
