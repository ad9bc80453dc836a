#include "fsdp/comm/testing/multiprocess.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace fsdp::comm_internal {
namespace {

std::string temp_dir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream content;
  content << in.rdbuf();
  return content.str();
}

}  // namespace

std::vector<RankOutcome> run_test_as_ranks(
    int world_size, const std::string& test_name, std::chrono::seconds deadline,
    const std::function<void(int rank, Environment& env)>& customize) {
  LaunchOptions options;
  options.nproc_per_node(world_size);
  absl::StatusOr<int> port = pick_free_port("127.0.0.1");
  TORCH_CHECK(port.ok(), "no free port: ", port.status().ToString());
  options.master_port(*port);

  const std::vector<std::string> args = {"/proc/self/exe",
                                         absl::StrCat("--gtest_filter=", test_name),
                                         "--gtest_also_run_disabled_tests"};
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);

  const auto start = std::chrono::steady_clock::now();
  std::vector<pid_t> pids(world_size);
  std::vector<std::string> logs(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    Environment env = rank_environment(options, rank, current_environment());
    // The children are not the test Bazel runs: they must not write its result files.
    for (const char* name : {"TEST_PREMATURE_EXIT_FILE", "XML_OUTPUT_FILE", "GTEST_OUTPUT",
                             "TEST_SHARD_STATUS_FILE"}) {
      env.erase(name);
    }
    if (customize) customize(rank, env);
    std::vector<std::string> entries;
    for (const auto& [name, value] : env) entries.push_back(absl::StrCat(name, "=", value));
    std::vector<char*> envp;
    for (std::string& entry : entries) envp.push_back(entry.data());
    envp.push_back(nullptr);

    logs[rank] = absl::StrCat(temp_dir(), "/rank", rank, "_", *port, ".log");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, logs[rank].c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    const int error =
        posix_spawn(&pids[rank], argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    TORCH_CHECK(error == 0, "posix_spawn failed: ", std::strerror(error));
  }

  std::vector<RankOutcome> outcomes(world_size);
  std::vector<bool> done(world_size, false);
  int remaining = world_size;
  while (remaining > 0) {
    const bool late = std::chrono::steady_clock::now() - start > deadline;
    for (int rank = 0; rank < world_size; ++rank) {
      if (done[rank]) continue;
      if (late) kill(pids[rank], SIGKILL);
      int status = 0;
      if (waitpid(pids[rank], &status, late ? 0 : WNOHANG) != pids[rank]) continue;
      done[rank] = true;
      --remaining;
      RankOutcome& outcome = outcomes[rank];
      outcome.seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (WIFEXITED(status)) outcome.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) outcome.term_signal = WTERMSIG(status);
      outcome.output = read_file(logs[rank]);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return outcomes;
}

std::string describe(const std::vector<RankOutcome>& ranks) {
  std::string out;
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const RankOutcome& r = ranks[rank];
    absl::StrAppend(&out, "rank ", rank, ": ",
                    r.term_signal != 0 ? absl::StrCat("killed by signal ", r.term_signal)
                                       : absl::StrCat("exited ", r.exit_code),
                    " after ", r.seconds, " s\n", r.output, "\n");
  }
  return out;
}

void expect_ranks_passed(const std::vector<RankOutcome>& ranks) {
  for (const RankOutcome& rank : ranks) {
    ASSERT_EQ(rank.exit_code, 0) << describe(ranks);
    ASSERT_THAT(rank.output, ::testing::HasSubstr("[  PASSED  ] 1 test")) << describe(ranks);
  }
}

}  // namespace fsdp::comm_internal
