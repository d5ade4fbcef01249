// The expert-parallel layer on every GPU of the machine, one process driving them (a group of 1
// on a one-GPU machine still runs the whole expert-parallel path through its own peer
// pointers): forward and backward against the CPU reference's R-rank emulation on the
// adversarial routings of DESIGN.md §4, outputs poisoned first, bitwise identical across
// repeated steps, with or without the forward context, with the bulk-copy and push-dispatch
// data movement, with the forward's communication inside its GEMMs, with macrobatches, and with
// the persistent backward; in FP8 too. Then the same
// layer with one process per GPU (Communicator::create_rank), the form compute-sanitizer checks
// (rank_process.h).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#if MOK_HAS_NCCL
#include "mok/bootstrap.h"
#include "mok/comm.h"
#include "mok/ep_layer.h"
#include "mok/reference.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/ep_baseline.h"
#include "mok/testing/host_problem.h"
#include "mok/testing/routing.h"
#include "non_finite.h"
#include "rank_process.h"
#include "test_util.h"
#endif

namespace mok {
namespace {

#if MOK_HAS_NCCL

using test::make_shape;

struct Group {
  std::vector<int> devices;
  std::vector<std::unique_ptr<Communicator>> communicators;
  std::vector<Communicator*> ranks;
};

Group make_group() {
  int count = 0;
  EXPECT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  Group group;
  for (int device = 0; device < count; ++device) group.devices.push_back(device);
  group.communicators = Communicator::create_all(group.devices);
  for (auto& communicator : group.communicators) group.ranks.push_back(communicator.get());
  return group;
}

// Every rank's inputs and output buffers of `problem`, each on its rank's GPU.
std::vector<std::unique_ptr<DeviceProblem>> upload_ranks(const Group& group,
                                                         const HostProblem& problem) {
  std::vector<std::unique_ptr<DeviceProblem>> device;
  for (int32_t rank = 0; rank < problem.shape.num_ranks; ++rank) {
    EXPECT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
    device.push_back(std::make_unique<DeviceProblem>(problem, rank));
  }
  return device;
}

// Frees them, each on its own GPU.
void free_ranks(const Group& group, std::vector<std::unique_ptr<DeviceProblem>>& device) {
  for (size_t rank = 0; rank < device.size(); ++rank) {
    cudaSetDevice(group.devices[rank]);
    device[rank].reset();
  }
}

// One training step of every rank (forward, then backward with or without the context); the
// outputs of every rank.
std::vector<HostRank> ep_step(EpLayer& layer, std::vector<std::unique_ptr<DeviceProblem>>& device,
                              const HostProblem& problem, bool with_context) {
  const int32_t ranks = layer.num_local_ranks();
  std::vector<ForwardArgs> forward_args;
  std::vector<BackwardArgs> backward_args;
  std::vector<cudaStream_t> streams(static_cast<size_t>(ranks), nullptr);
  for (int32_t rank = 0; rank < ranks; ++rank) {
    EXPECT_EQ(cudaSetDevice(layer.rank_device(rank)), cudaSuccess);
    device[rank]->poison_outputs();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    forward_args.push_back(device[rank]->forward_args());
    backward_args.push_back(device[rank]->backward_args());
  }
  const std::vector<ForwardContext> contexts = layer.forward(forward_args, streams);
  layer.backward(backward_args, streams, with_context ? &contexts : nullptr);
  const Status status = layer.synchronize(streams);
  EXPECT_TRUE(status.ok()) << status.message;
  std::vector<HostRank> results;
  for (int32_t rank = 0; rank < ranks; ++rank) {
    EXPECT_EQ(cudaSetDevice(layer.rank_device(rank)), cudaSuccess);
    HostRank result = output_buffers(problem.shape);
    device[rank]->download_outputs(result);
    results.push_back(std::move(result));
  }
  return results;
}

// Prints each output's relative error against the emulation and expects it finite and within
// bf16 tolerance.
void expect_matches_reference(const std::string& label, int32_t rank, const HostRank& got,
                              const HostRank& want) {
  std::printf("  %s rank %d:", label.c_str(), rank);
  test::for_each_output(got, want,
                        [&](const char* output, const auto& value, const auto& expected) {
                          if (expected.empty()) return;
                          const double error = test::relative_error(value, expected);
                          std::printf(" %s %.1e", output, error);
                          EXPECT_TRUE(test::all_finite(value)) << "rank " << rank << " " << output;
                          EXPECT_LE(error, 1e-2) << "rank " << rank << " " << output;
                        });
  std::printf("\n");
}

void check_ep(const char* name, const MoeShape& base_shape, RoutingKind routing, uint64_t seed,
              Precision precision = Precision::kBF16) {
  Group group = make_group();
  MoeShape shape = base_shape;
  shape.num_ranks = static_cast<int32_t>(group.devices.size());
  shape.num_experts = base_shape.num_experts * shape.num_ranks;
  SCOPED_TRACE(std::string(name) + " " + shape.to_string() + " routing " +
               routing_kind_name(routing));
  HostProblem problem = HostProblem::make(shape, routing, seed);
  problem.poison_outputs();
  reference::Options options;
  options.precision = precision;
  reference::forward_ep(shape, problem.all_forward_args(), options);
  reference::backward_ep(shape, problem.all_backward_args(), options);
  std::vector<std::unique_ptr<DeviceProblem>> device = upload_ranks(group, problem);
  MoeConfig config;
  config.wait_timeout_s = 20;
  config.precision = precision;
  const bool fp8 = precision == Precision::kFP8Block;
  EpLayer layer(shape, config, group.ranks);
  const std::vector<HostRank> first = ep_step(layer, device, problem, true);
  // The bulk-copy data movement and the push dispatch give the same bits (the push dispatch
  // with and without the forward context: the backward recomputing pushes x and d_out).
  // Macrobatches of 128 rows: the ring, the recompute from the kept received rows, the weight
  // gradients' partials across boundaries (pull and push dispatch).
  // The persistent backward: its SwiGLU tasks write the router-weight gradients into the
  // source ranks' buffers.
  // The communication inside the GEMMs (the gate/up GEMM's producer warps pull the rows from
  // the peers' published x, the down GEMM's epilogue pushes the rows into their slots, the down
  // dgrad's producer warps pull the d_out rows, the gate/up dgrad's epilogue pushes the dx rows),
  // alone, with macrobatches (the backward then pulls x for the recomputed ones and d_out per
  // macrobatch), and with the persistent backward (whose spare warps pull d_out, and x when it
  // recomputes).
  // The forward GEMMs and the dgrads in 256 x 192 tiles (MoeConfig::gemm_wide_tiles) on each
  // rank.
  // FP8 holds one macrobatch and runs the kernel sequences: its variants are the data movement.
  for (const std::string variant :
       {"bulk copies", "push dispatch", "macrobatches", "push dispatch + macrobatches",
        "persistent backward", "in-GEMM communication", "in-GEMM communication + macrobatches",
        "in-GEMM communication + persistent backward", "256 x 192 tiles"}) {
    if (fp8 && variant != "bulk copies" && variant != "push dispatch") continue;
    MoeConfig variant_config = config;
    const bool push = variant.find("push") != std::string::npos;
    const bool macrobatches = variant.find("macrobatches") != std::string::npos;
    variant_config.ep_bulk_copies = variant == "bulk copies";
    variant_config.ep_push_dispatch = push;
    variant_config.ep_dispatch_in_gemm = variant.find("in-GEMM") != std::string::npos;
    variant_config.persistent_backward = variant.find("persistent backward") != std::string::npos;
    variant_config.gemm_wide_tiles = variant == "256 x 192 tiles";
    if (macrobatches) {
      variant_config.minibatch_size = 128;
      variant_config.macrobatch_size = 128;
    }
    EpLayer variant_layer(shape, variant_config, group.ranks);
    for (const bool with_context : {true, false}) {
      if (variant == "bulk copies" && !with_context) continue;
      const std::vector<HostRank> got = ep_step(variant_layer, device, problem, with_context);
      for (int32_t rank = 0; rank < shape.num_ranks; ++rank)
        test::for_each_output(got[rank], first[rank],
                              [&](const char* output, const auto& a, const auto& b) {
                                EXPECT_TRUE(test::bitwise_equal(a, b))
                                    << "rank " << rank << " " << output << " differs with "
                                    << variant << (with_context ? "" : " (no forward context)");
                              });
    }
  }
  char label[128];
  std::snprintf(label, sizeof(label), "%-14s %-44s %-11s", name, shape.to_string().c_str(),
                routing_kind_name(routing));
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank)
    expect_matches_reference(label, rank, first[rank], problem.ranks[rank]);
  const std::vector<HostRank> again = ep_step(layer, device, problem, true);
  const std::vector<HostRank> recomputed = ep_step(layer, device, problem, false);
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
    test::for_each_output(again[rank], first[rank],
                          [&](const char* output, const auto& a, const auto& b) {
                            EXPECT_TRUE(test::bitwise_equal(a, b))
                                << "rank " << rank << " " << output << " differs between steps";
                          });
    test::for_each_output(
        recomputed[rank], first[rank], [&](const char* output, const auto& a, const auto& b) {
          EXPECT_TRUE(test::bitwise_equal(a, b))
              << "rank " << rank << " " << output << " differs without the forward context";
        });
  }
  free_ranks(group, device);
}

// Experts per rank are given; the group size is the machine's GPU count.
TEST(EpLayerGpu, MatchesReferenceEmulation) {
  uint64_t seed = 900;
  check_ep("uniform", make_shape(257, 768, 256, 8, 4, 1, 128, 0.5f), RoutingKind::kUniform, ++seed);
  check_ep("one rank", make_shape(200, 512, 256, 8, 4), RoutingKind::kOneRank, ++seed);
  check_ep("empty rank", make_shape(200, 512, 256, 8, 4, 1, 64), RoutingKind::kEmptyRank, ++seed);
  check_ep("holes", make_shape(333, 1024, 384, 4, 4), RoutingKind::kHoles, ++seed);
  check_ep("skewed", make_shape(300, 512, 256, 8, 8), RoutingKind::kSkewed, ++seed);
  check_ep("no routes", make_shape(130, 512, 256, 4, 4, 1, 64), RoutingKind::kNoRoutes, ++seed);
  check_ep("one token", make_shape(1, 256, 128, 4, 2), RoutingKind::kUniform, ++seed);
}

// FP8 (precision fp8_block) across the group: the exchange delivers bf16 rows, each rank
// quantizes its own; against the R-rank emulation's FP8 at the bf16 tolerance, and bitwise
// across steps, with and without the context, and with the bulk-copy and push data movement.
TEST(EpLayerGpu, Fp8MatchesReferenceEmulation) {
  uint64_t seed = 960;
  const Precision fp8 = Precision::kFP8Block;
  check_ep("fp8 uniform", make_shape(256, 512, 256, 8, 4, 1, 128, 0.5f), RoutingKind::kUniform,
           ++seed, fp8);
  check_ep("fp8 one rank", make_shape(200, 512, 256, 8, 4), RoutingKind::kOneRank, ++seed, fp8);
  check_ep("fp8 empty rank", make_shape(256, 512, 256, 8, 4, 1, 128), RoutingKind::kEmptyRank,
           ++seed, fp8);
  check_ep("fp8 skewed", make_shape(300, 512, 256, 8, 8), RoutingKind::kSkewed, ++seed, fp8);
}

// A whole training step of every rank (forward, then backward from its context) captured once
// per rank into a CUDA graph and replayed with new routing contents: the routing exchange, the
// schedule, the dispatch and combine keep their epochs and counts in device memory, so every
// replay is a fresh, correct step on every rank (checked against the emulation).
TEST(EpLayerGpu, StepGraphReplayWithNewRouting) {
  Group group = make_group();
  MoeShape shape = make_shape(200, 512, 256, 8, 4, 1, 64);
  shape.num_ranks = static_cast<int32_t>(group.devices.size());
  shape.num_experts *= shape.num_ranks;
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 970);
  std::vector<std::unique_ptr<DeviceProblem>> device;
  std::vector<cudaStream_t> streams(group.devices.size());
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
    ASSERT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
    device.push_back(std::make_unique<DeviceProblem>(problem, rank));
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[rank], cudaStreamNonBlocking), cudaSuccess);
  }
  MoeConfig config;
  config.wait_timeout_s = 20;
  EpLayer layer(shape, config, group.ranks);
  std::vector<ForwardArgs> forward_args;
  std::vector<BackwardArgs> backward_args;
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
    forward_args.push_back(device[rank]->forward_args());
    backward_args.push_back(device[rank]->backward_args());
  }
  // A first step outside the capture sets the kernels' attributes.
  std::vector<ForwardContext> contexts = layer.forward(forward_args, streams);
  layer.backward(backward_args, streams, &contexts);
  ASSERT_TRUE(layer.synchronize(streams).ok());
  // One host thread captures every rank's stream at once (relaxed: the launches interleave).
  std::vector<cudaGraph_t> graphs(streams.size());
  std::vector<cudaGraphExec_t> execs(streams.size());
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
    ASSERT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
    ASSERT_EQ(cudaStreamBeginCapture(streams[rank], cudaStreamCaptureModeRelaxed), cudaSuccess);
  }
  contexts = layer.forward(forward_args, streams);
  layer.backward(backward_args, streams, &contexts);
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
    ASSERT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(streams[rank], &graphs[rank]), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&execs[rank], graphs[rank], 0), cudaSuccess);
  }
  uint64_t seed = 980;
  for (const RoutingKind routing :
       {RoutingKind::kSkewed, RoutingKind::kOneRank, RoutingKind::kHoles}) {
    SCOPED_TRACE(routing_kind_name(routing));
    HostProblem next = problem;
    const std::vector<int32_t> all =
        generate_routing(routing, shape.num_ranks, static_cast<int32_t>(shape.num_tokens),
                         shape.top_k, static_cast<int32_t>(shape.num_experts), ++seed);
    const size_t per_rank = static_cast<size_t>(shape.num_tokens) * shape.top_k;
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank)
      next.ranks[rank].top_experts.assign(all.begin() + rank * per_rank,
                                          all.begin() + (rank + 1) * per_rank);
    next.poison_outputs();
    reference::forward_ep(shape, next.all_forward_args());
    reference::backward_ep(shape, next.all_backward_args());
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
      device[rank]->upload_routing(next.ranks[rank].top_experts);
      device[rank]->poison_outputs();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the memsets ran on the legacy stream
    }
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(execs[rank], streams[rank]), cudaSuccess);
    }
    const Status status = layer.synchronize(streams);
    ASSERT_TRUE(status.ok()) << status.message;
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      ASSERT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
      HostRank got = output_buffers(shape);
      device[rank]->download_outputs(got);
      expect_matches_reference(std::string("graph replay ") + routing_kind_name(routing), rank, got,
                               next.ranks[rank]);
    }
  }
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
    cudaSetDevice(group.devices[rank]);
    cudaGraphExecDestroy(execs[rank]);
    cudaGraphDestroy(graphs[rank]);
    cudaStreamDestroy(streams[rank]);
    device[rank].reset();
  }
}

// One rank of a group of processes (run by EpLayerGpu.OneProcessPerGpu): each process joins the
// group from the bootstrap file, builds the same problem (every rank's inputs and the
// emulation), runs its own rank's layer and checks its outputs against the emulation, then a
// step without the forward context, one with the push dispatch and one with the forward's
// communication inside its GEMMs, bitwise equal to the first.
// Small shapes: under compute-sanitizer every kernel runs many times slower.
TEST(EpLayerGpu, DISABLED_RankProcess) {
  const std::optional<test::RankEnvironment> environment = test::rank_environment();
  ASSERT_TRUE(environment.has_value()) << "run by EpLayerGpu.OneProcessPerGpu only";
  const int32_t rank = environment->rank;
  const UniqueId id = exchange_unique_id(environment->id_path, rank, environment->num_ranks, 60.0);
  std::unique_ptr<Communicator> communicator =
      Communicator::create_rank(id, environment->num_ranks, rank, rank);
  ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
  uint64_t seed = 950;
  for (const RoutingKind routing : {RoutingKind::kSkewed, RoutingKind::kEmptyRank}) {
    MoeShape shape = make_shape(96, 256, 128, 4, 4, 1, routing == RoutingKind::kSkewed ? 64 : 0);
    shape.num_ranks = environment->num_ranks;
    shape.num_experts *= shape.num_ranks;
    SCOPED_TRACE(shape.to_string() + " routing " + routing_kind_name(routing));
    HostProblem problem = HostProblem::make(shape, routing, ++seed);
    problem.poison_outputs();
    reference::forward_ep(shape, problem.all_forward_args());
    reference::backward_ep(shape, problem.all_backward_args());
    std::vector<std::unique_ptr<DeviceProblem>> device;
    device.push_back(std::make_unique<DeviceProblem>(problem, rank));
    MoeConfig config;
    config.wait_timeout_s = 120;  // a rank under the sanitizer may start its kernels much later
    std::vector<HostRank> first;
    {
      EpLayer layer(shape, config, {communicator.get()});
      first = ep_step(layer, device, problem, true);
      expect_matches_reference(routing_kind_name(routing), rank, first[0], problem.ranks[rank]);
      const std::vector<HostRank> recomputed = ep_step(layer, device, problem, false);
      test::for_each_output(
          recomputed[0], first[0], [&](const char* output, const auto& a, const auto& b) {
            EXPECT_TRUE(test::bitwise_equal(a, b))
                << "rank " << rank << " " << output << " differs without the forward context";
          });
    }
    for (const bool in_gemm : {false, true}) {
      MoeConfig other_config = config;
      other_config.ep_push_dispatch = !in_gemm;
      other_config.ep_dispatch_in_gemm = in_gemm;
      EpLayer other_layer(shape, other_config, {communicator.get()});
      const std::vector<HostRank> other = ep_step(other_layer, device, problem, true);
      test::for_each_output(
          other[0], first[0], [&](const char* output, const auto& a, const auto& b) {
            EXPECT_TRUE(test::bitwise_equal(a, b))
                << "rank " << rank << " " << output << " differs with "
                << (in_gemm ? "the communication in the GEMMs" : "the push dispatch");
          });
    }
  }
}

// NaN and infinities across the group (docs/design.md, "Non-finite values"): one value at a
// time in rank 0's x, its experts' weights, its shared expert, d_out or router weights; every
// output of every rank holds NaN and +-inf where the R-rank emulation's do, element for element
// (rank 0's x rows reach the other ranks' experts and come back through the combines); the
// persistent backward and the macrobatch ring give the same bits. Then check_finite on a rank.
TEST(EpLayerGpu, NonFiniteMatchesReferenceEmulation) {
  Group group = make_group();
  MoeShape shape = make_shape(200, 512, 256, 8, 4, 1, 64);
  shape.num_ranks = static_cast<int32_t>(group.devices.size());
  shape.num_experts *= shape.num_ranks;
  MoeConfig config;
  config.wait_timeout_s = 20;
  EpLayer layer(shape, config, group.ranks);
  MoeConfig variant = config;
  variant.persistent_backward = true;
  EpLayer persistent(shape, variant, group.ranks);
  MoeConfig ring = config;
  ring.minibatch_size = 128;
  ring.macrobatch_size = 128;
  EpLayer ring_layer(shape, ring, group.ranks);
  uint64_t seed = 1200;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (test::NonFiniteSite site : test::non_finite_sites(shape)) {
    for (float value : {nan, inf}) {
      HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, ++seed);
      test::add_duplicate_route_and_hole(problem);
      const std::string label =
          std::to_string(value) + " in rank 0's " + test::place_non_finite(problem, site, value);
      SCOPED_TRACE(label);
      problem.poison_outputs();
      reference::forward_ep(shape, problem.all_forward_args());
      reference::backward_ep(shape, problem.all_backward_args());
      std::vector<std::unique_ptr<DeviceProblem>> device = upload_ranks(group, problem);
      const std::vector<HostRank> got = ep_step(layer, device, problem, true);
      int64_t non_finite = 0;
      for (int32_t rank = 0; rank < shape.num_ranks; ++rank)
        test::for_each_output(
            got[rank], problem.ranks[rank], [&](const char* output, const auto& a, const auto& b) {
              if (b.empty()) return;
              non_finite += test::expect_same_pattern(
                  label + ": rank " + std::to_string(rank) + " " + output, a, b, 1e-2);
            });
      if (site == test::NonFiniteSite::kUnroutedRouterWeight)
        EXPECT_EQ(non_finite, 0);
      else
        EXPECT_GT(non_finite, 0);
      for (EpLayer* other : {&persistent, &ring_layer}) {
        const std::vector<HostRank> again = ep_step(*other, device, problem, false);
        for (int32_t rank = 0; rank < shape.num_ranks; ++rank)
          test::for_each_output(
              again[rank], got[rank], [&](const char* output, const auto& a, const auto& b) {
                EXPECT_TRUE(test::bitwise_equal(a, b))
                    << "rank " << rank << " " << output << " differs with "
                    << (other == &persistent ? "the persistent backward" : "macrobatches");
              });
      }
      free_ranks(group, device);
    }
  }
  std::printf("  every site, NaN and +inf: every rank matches the emulation's pattern (%d ranks)\n",
              shape.num_ranks);

  // check_finite on a group: the rank and the element.
  MoeConfig checked = config;
  checked.check_finite = true;
  EpLayer checked_layer(shape, checked, group.ranks);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 1300);
  test::add_duplicate_route_and_hole(problem);
  test::place_non_finite(problem, test::NonFiniteSite::kX, nan);
  std::vector<std::unique_ptr<DeviceProblem>> device = upload_ranks(group, problem);
  std::vector<ForwardArgs> forward_args;
  for (const auto& rank : device) forward_args.push_back(rank->forward_args());
  const std::vector<cudaStream_t> streams(group.devices.size(), nullptr);
  checked_layer.forward(forward_args, streams);
  const Status status = checked_layer.synchronize(streams);
  EXPECT_EQ(status.code, ErrorCode::kDeviceFault);
  EXPECT_NE(status.message.find("rank 0: check_finite: x[token 1, column " +
                                std::to_string(shape.hidden / 3) + "] = nan"),
            std::string::npos)
      << status.message;
  free_ranks(group, device);
}

TEST(EpLayerGpu, OneProcessPerGpu) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  test::run_rank_processes("EpLayerGpu.DISABLED_RankProcess", count, 300);
}

// The all-to-all baseline of `mok run --gpus` against the same emulation: it is what mok is
// timed against, so it must compute the same layer. Two routings in turn on one baseline: the
// second has other received counts, so its inner layer is another one (made on first use).
TEST(EpBaselineGpu, MatchesReferenceEmulation) {
  Group group = make_group();
  MoeShape shape = make_shape(300, 512, 256, 8, 4);
  shape.num_ranks = static_cast<int32_t>(group.devices.size());
  shape.num_experts = 8 * shape.num_ranks;
  EpBaseline baseline(shape, group.ranks);
  {
    std::vector<BackwardArgs> none;
    std::vector<cudaStream_t> streams(group.devices.size(), nullptr);
    HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 5);
    std::vector<std::unique_ptr<DeviceProblem>> device;
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      EXPECT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
      device.push_back(std::make_unique<DeviceProblem>(problem, rank));
      none.push_back(device.back()->backward_args());
    }
    EXPECT_THROW(baseline.backward(none, streams), Error) << "a backward before any forward";
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      cudaSetDevice(group.devices[rank]);
      device[rank].reset();
    }
  }
  uint64_t seed = 40;
  for (const RoutingKind routing :
       {RoutingKind::kUniform, RoutingKind::kSkewed, RoutingKind::kHoles, RoutingKind::kOneRank}) {
    SCOPED_TRACE(std::string("routing ") + routing_kind_name(routing));
    HostProblem problem = HostProblem::make(shape, routing, ++seed);
    problem.poison_outputs();
    reference::forward_ep(shape, problem.all_forward_args());
    reference::backward_ep(shape, problem.all_backward_args());
    std::vector<std::unique_ptr<DeviceProblem>> device;
    std::vector<ForwardArgs> forward_args;
    std::vector<BackwardArgs> backward_args;
    std::vector<cudaStream_t> streams(static_cast<size_t>(shape.num_ranks), nullptr);
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      EXPECT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
      device.push_back(std::make_unique<DeviceProblem>(problem, rank));
      device.back()->poison_outputs();
      forward_args.push_back(device.back()->forward_args());
      backward_args.push_back(device.back()->backward_args());
    }
    baseline.forward(forward_args, streams);
    baseline.backward(backward_args, streams);
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      EXPECT_EQ(cudaSetDevice(group.devices[rank]), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      HostRank got = output_buffers(shape);
      device[rank]->download_outputs(got);
      expect_matches_reference(
          std::string("baseline ") + shape.to_string() + " " + routing_kind_name(routing), rank,
          got, problem.ranks[rank]);
    }
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      cudaSetDevice(group.devices[rank]);
      device[rank].reset();
    }
  }
}

#else

TEST(EpLayerGpu, NotBuilt) { GTEST_SKIP() << "mok was built without NCCL (set MOK_NCCL_HOME)"; }

#endif

}  // namespace
}  // namespace mok
