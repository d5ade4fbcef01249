// One process per rank for the GPU tests (rank_process.h).
#include "rank_process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

extern char** environ;

namespace mok::test {

pid_t spawn_self(const std::string& test_name, const std::vector<std::string>& extra_environment,
                 bool wrapped) {
  std::vector<std::string> arguments;
  const char* wrapper = std::getenv("MOK_TEST_RANK_WRAPPER");
  if (wrapped && wrapper != nullptr) {
    std::istringstream words(wrapper);
    for (std::string word; words >> word;) arguments.push_back(word);
  }
  // The wrapper needs the binary's real path; /proc/self/exe would name the wrapper's own.
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return -1;
  arguments.push_back(self.string());
  arguments.push_back("--gtest_filter=" + test_name);
  arguments.push_back("--gtest_also_run_disabled_tests");
  std::vector<std::string> environment = extra_environment;
  for (char** variable = environ; *variable != nullptr; ++variable)
    environment.push_back(*variable);
  std::vector<char*> argv, envp;
  for (std::string& argument : arguments) argv.push_back(argument.data());
  argv.push_back(nullptr);
  for (std::string& variable : environment) envp.push_back(variable.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  if (::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()) != 0) return -1;
  return pid;
}

std::vector<int> wait_for_children(const std::vector<pid_t>& children, int seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  std::vector<int> status(children.size(), -1);
  std::vector<bool> done(children.size(), false);
  size_t finished = 0;
  while (finished < children.size() && std::chrono::steady_clock::now() < deadline) {
    for (size_t i = 0; i < children.size(); ++i) {
      if (done[i]) continue;
      int child_status = 0;
      if (::waitpid(children[i], &child_status, WNOHANG) == children[i]) {
        status[i] = WIFEXITED(child_status) ? WEXITSTATUS(child_status) : 128;
        done[i] = true;
        ++finished;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (size_t i = 0; i < children.size(); ++i) {
    if (done[i]) continue;
    ::kill(children[i], SIGKILL);
    ::waitpid(children[i], nullptr, 0);
  }
  return status;
}

void run_rank_processes(const std::string& child_test, int num_ranks, int seconds) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("mok_rank_test_" + std::to_string(::getpid())))
          .string();
  std::filesystem::remove(path);
  std::vector<pid_t> children;
  for (int rank = 0; rank < num_ranks; ++rank) {
    const pid_t pid =
        spawn_self(child_test,
                   {"MOK_TEST_RANK=" + std::to_string(rank),
                    "MOK_TEST_RANKS=" + std::to_string(num_ranks), "MOK_TEST_ID_PATH=" + path},
                   true);
    EXPECT_GT(pid, 0) << "posix_spawn failed for rank " << rank;
    if (pid > 0) children.push_back(pid);
  }
  const std::vector<int> status = wait_for_children(children, seconds);
  for (size_t i = 0; i < children.size(); ++i)
    EXPECT_EQ(status[i], 0) << child_test << " rank " << i
                            << (status[i] == -1 ? " did not finish in time" : " failed");
  std::filesystem::remove(path);
}

std::optional<RankEnvironment> rank_environment() {
  const char* rank = std::getenv("MOK_TEST_RANK");
  const char* ranks = std::getenv("MOK_TEST_RANKS");
  const char* path = std::getenv("MOK_TEST_ID_PATH");
  if (rank == nullptr || ranks == nullptr || path == nullptr) return std::nullopt;
  return RankEnvironment{std::atoi(rank), std::atoi(ranks), path};
}

}  // namespace mok::test
