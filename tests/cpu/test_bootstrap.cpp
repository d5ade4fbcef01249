// The unique-id exchange of a multi-process group through a file (include/mok/bootstrap.h):
// real processes (fork), a real NCCL id, a missing rank 0 ending in a bounded timeout, and the
// guards against another job's file.
#include <gtest/gtest.h>

#if MOK_HAS_NCCL

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "mok/bootstrap.h"
#include "mok/error.h"

namespace mok {
namespace {

std::string fresh_path(const std::string& name) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("mok_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove(path);
  std::filesystem::remove(path.string() + ".tmp");
  return path.string();
}

TEST(Bootstrap, RanksInSeparateProcessesGetRankZerosId) {
  constexpr int kRanks = 4;
  const std::string path = fresh_path("group");
  std::vector<int> pipes(kRanks);
  std::vector<pid_t> children;
  // Ranks 3, 2, 1 start first and wait; rank 0 publishes last.
  for (int rank = kRanks - 1; rank >= 0; --rank) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      int status = 0;
      try {
        if (rank == 0) ::usleep(100 * 1000);
        const UniqueId id = exchange_unique_id(path, rank, kRanks, 30.0);
        if (::write(fds[1], id.bytes.data(), id.bytes.size()) !=
            static_cast<ssize_t>(id.bytes.size()))
          status = 2;
      } catch (const std::exception& error) {
        std::fprintf(stderr, "rank %d: %s\n", rank, error.what());
        status = 1;
      }
      ::close(fds[1]);
      ::_exit(status);
    }
    ::close(fds[1]);
    pipes[rank] = fds[0];
    children.push_back(pid);
  }
  std::vector<UniqueId> ids(kRanks);
  for (int rank = 0; rank < kRanks; ++rank) {
    size_t got = 0;
    while (got < ids[rank].bytes.size()) {
      const ssize_t n =
          ::read(pipes[rank], ids[rank].bytes.data() + got, ids[rank].bytes.size() - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(pipes[rank]);
    EXPECT_EQ(got, ids[rank].bytes.size()) << "rank " << rank << " sent no id";
  }
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  for (int rank = 1; rank < kRanks; ++rank)
    EXPECT_EQ(ids[rank].bytes, ids[0].bytes) << "rank " << rank;
  EXPECT_NE(ids[0].bytes, UniqueId{}.bytes) << "NCCL returned an all-zero id";
  std::filesystem::remove(path);
}

TEST(Bootstrap, MissingRankZeroTimesOutWithTheReason) {
  const std::string path = fresh_path("missing");
  const auto start = std::chrono::steady_clock::now();
  try {
    wait_for_unique_id(path, 2, 0.2);
    FAIL() << "no timeout";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(error.what()).find("for rank 0 to publish '" + path + "'"),
              std::string::npos)
        << error.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

TEST(Bootstrap, AnotherJobsFileIsRefused) {
  const std::string path = fresh_path("stale");
  const UniqueId id = make_unique_id();
  publish_unique_id(path, id, 8);
  try {  // rank 0 of a new job must not overwrite it
    publish_unique_id(path, id, 8);
    FAIL() << "an existing id file was overwritten";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("already exists"), std::string::npos) << error.what();
  }
  try {  // a reader of another group size notices
    wait_for_unique_id(path, 4, 1.0);
    FAIL() << "a file of another group size was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("group of 8 ranks; this rank expects 4"),
              std::string::npos)
        << error.what();
  }
  EXPECT_EQ(wait_for_unique_id(path, 8, 1.0).bytes, id.bytes);
  std::filesystem::remove(path);
  std::ofstream(path) << "not an id";
  EXPECT_THROW(wait_for_unique_id(path, 8, 1.0), Error);
  std::filesystem::remove(path);
  EXPECT_THROW(exchange_unique_id(path, 3, 2, 1.0), Error);  // rank out of range
}

}  // namespace
}  // namespace mok

#else

TEST(Bootstrap, SkippedWithoutNccl) { GTEST_SKIP() << "built without NCCL (set MOK_NCCL_HOME)"; }

#endif
