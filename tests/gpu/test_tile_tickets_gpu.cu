// MoeConfig::gemm_tiles_by_ticket (src/kernels/gemm/tile_tickets.h): the row-tile GEMMs taking
// their tiles by ticket give the bits of the static walk, on three and four stages, with the
// gather kernel and with macrobatches, with and without the forward context; and a step ends
// with those bits while another stream holds all but 8 SMs (the tickets go to whichever CTAs
// run).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu_step.h"
#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "sm_hold.cuh"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;

MoeConfig by_ticket() {
  MoeConfig config;
  config.gemm_tiles_by_ticket = true;
  return config;
}

TEST(TileTicketsGpu, SameBitsAsTheStaticWalk) {
  const MoeShape shape = make_shape(700, 1024, 384, 16, 4, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 83);
  DeviceProblem device(problem, 0);
  GpuLayer reference(shape, MoeConfig{});
  std::vector<MoeConfig> configs(4, by_ticket());
  configs[1].gemm_four_stages = true;
  configs[2].local_dispatch = LocalDispatch::kGatherKernel;
  configs[3].minibatch_size = 128;
  configs[3].macrobatch_size = 384;
  for (const MoeConfig& config : configs) {
    GpuLayer layer(shape, config);
    test::expect_same_steps(reference, layer, device, problem,
                            ", four stages " + std::to_string(config.gemm_four_stages) +
                                " local dispatch " + local_dispatch_name(config.local_dispatch) +
                                " macrobatch " + std::to_string(config.macrobatch_size));
  }
}

TEST(TileTicketsGpu, FinishesOnTheSmsLeftToIt) {
  test::expect_config_finishes_on_held_sms(by_ticket(), 89);
}

}  // namespace
}  // namespace mok
