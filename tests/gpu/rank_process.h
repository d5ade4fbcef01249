// Tests that run each rank of an expert-parallel group as its own process (the deployment
// PyTorch uses, and the one in which compute-sanitizer can check a group: one process driving
// several GPUs needs every launch to return while earlier kernels spin, and under memcheck a
// launch can wait for them, so rank 0's spin waits for a rank 1 launch that waits for rank 0).
//
// The parent test starts one copy of this test binary per rank with a child test's filter and
// MOK_TEST_RANK, MOK_TEST_RANKS and MOK_TEST_ID_PATH (the bootstrap file of the unique id) in
// the environment, then waits for them with a deadline. With MOK_TEST_RANK_WRAPPER set (a
// command prefix split on spaces, e.g. "compute-sanitizer --tool memcheck --error-exitcode 1")
// every rank process runs under it.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

namespace mok::test {

// Starts this test binary with `--gtest_filter=test_name` (disabled tests allowed) and the
// extra environment; the child's pid, or -1 if it could not be started. `wrapped` runs it under
// MOK_TEST_RANK_WRAPPER when that is set.
pid_t spawn_self(const std::string& test_name, const std::vector<std::string>& extra_environment,
                 bool wrapped = false);

// Waits for the children at most `seconds` (a child stuck in NCCL's init or a spin must fail the
// test, not hang it); their exit codes, -1 for one killed at the deadline, 128 for one killed by
// a signal.
std::vector<int> wait_for_children(const std::vector<pid_t>& children, int seconds);

// Runs `child_test` once per rank of a group of `num_ranks` processes (rank r on GPU r) and
// expects every one to exit 0 within `seconds`.
void run_rank_processes(const std::string& child_test, int num_ranks, int seconds);

// What a rank process was started with; nullopt outside run_rank_processes.
struct RankEnvironment {
  int rank = 0;
  int num_ranks = 0;
  std::string id_path;
};
std::optional<RankEnvironment> rank_environment();

}  // namespace mok::test
