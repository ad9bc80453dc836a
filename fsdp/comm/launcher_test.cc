#include "fsdp/comm/launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;
using Lines = std::vector<std::string>;

// The lines of `text` (each ending in '\n'), sorted: ranks print in any order.
Lines sorted_lines(const std::string& text) {
  Lines lines = absl::StrSplit(absl::StripSuffix(text, "\n"), '\n', absl::SkipEmpty());
  std::sort(lines.begin(), lines.end());
  return lines;
}

// A fresh directory for the files the ranks' scripts write.
std::string make_temp_dir() {
  std::string pattern = testing::TempDir() + "launcher_XXXXXX";
  EXPECT_NE(mkdtemp(pattern.data()), nullptr) << "mkdtemp: " << std::strerror(errno);
  return pattern;
}

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return std::string(absl::StripSuffix(text.str(), "\n"));
}

bool wait_for_files(const std::vector<std::string>& paths) {
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    if (std::all_of(paths.begin(), paths.end(), exists)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// The end of a script whose trap must see a signal. Not one long `sleep 30`: dash forks
// the sleep, and a signal that reaches the child before it executes sleep is caught by
// the child's copy of the trap and lost, so the sleep would outlive the signal. The shell
// itself gets the process group's signal too and runs its trap within 50 ms.
constexpr char kWaitForSignal[] = "while :; do sleep 0.05; done\n";

// `nproc` ranks, each running /bin/sh -c `script`.
LaunchOptions shell_job(int nproc, const std::string& script) {
  LaunchOptions options;
  options.nproc_per_node(nproc).command({"/bin/sh", "-c", script});
  return options;
}

struct Result {
  int status = -1;
  std::string out;
  std::string err;
  double seconds = 0;
};

Result run(const LaunchOptions& options) {
  std::ostringstream out, err;
  const Clock::time_point start = Clock::now();
  Result result;
  result.status = launch(options, out, err);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.out = out.str();
  result.err = err.str();
  return result;
}

// ---- rank_environment, current_environment --------------------------------------------

TEST(RankEnvironmentTest, SecondNodeOfTwoGetsGlobalRanksTwoAndThree) {
  LaunchOptions options;
  options.nproc_per_node(2).nnodes(2).node_rank(1).master_addr("10.0.0.1").master_port(29500);
  const Environment parent = {{"PATH", "/usr/bin"}, {"RANK", "99"}};
  EXPECT_EQ(rank_environment(options, 0, parent), (Environment{
                                                      {"GROUP_RANK", "1"},
                                                      {"LOCAL_RANK", "0"},
                                                      {"LOCAL_WORLD_SIZE", "2"},
                                                      {"MASTER_ADDR", "10.0.0.1"},
                                                      {"MASTER_PORT", "29500"},
                                                      {"MKL_NUM_THREADS", "1"},
                                                      {"OMP_NUM_THREADS", "1"},
                                                      {"PATH", "/usr/bin"},
                                                      {"RANK", "2"},
                                                      {"WORLD_SIZE", "4"},
                                                  }));
  EXPECT_EQ(rank_environment(options, 1, parent), (Environment{
                                                      {"GROUP_RANK", "1"},
                                                      {"LOCAL_RANK", "1"},
                                                      {"LOCAL_WORLD_SIZE", "2"},
                                                      {"MASTER_ADDR", "10.0.0.1"},
                                                      {"MASTER_PORT", "29500"},
                                                      {"MKL_NUM_THREADS", "1"},
                                                      {"OMP_NUM_THREADS", "1"},
                                                      {"PATH", "/usr/bin"},
                                                      {"RANK", "3"},
                                                      {"WORLD_SIZE", "4"},
                                                  }));
}

TEST(RankEnvironmentTest, KeepsTheUsersThreadCounts) {
  LaunchOptions options;
  options.master_port(1234);
  const Environment parent = {{"OMP_NUM_THREADS", "4"}};
  EXPECT_EQ(rank_environment(options, 0, parent), (Environment{
                                                      {"GROUP_RANK", "0"},
                                                      {"LOCAL_RANK", "0"},
                                                      {"LOCAL_WORLD_SIZE", "1"},
                                                      {"MASTER_ADDR", "127.0.0.1"},
                                                      {"MASTER_PORT", "1234"},
                                                      {"MKL_NUM_THREADS", "1"},
                                                      {"OMP_NUM_THREADS", "4"},
                                                      {"RANK", "0"},
                                                      {"WORLD_SIZE", "1"},
                                                  }));
  const Environment both = {{"OMP_NUM_THREADS", "4"}, {"MKL_NUM_THREADS", "2"}};
  EXPECT_EQ(rank_environment(options, 0, both).at("MKL_NUM_THREADS"), "2");
}

TEST(CurrentEnvironmentTest, SplitsAtTheFirstEquals) {
  ASSERT_EQ(setenv("FSDP_LAUNCHER_TEST_VARIABLE", "a=b", 1), 0);
  EXPECT_EQ(current_environment().at("FSDP_LAUNCHER_TEST_VARIABLE"), "a=b");
  unsetenv("FSDP_LAUNCHER_TEST_VARIABLE");
}

// ---- validate_launch_options ----------------------------------------------------------

TEST(ValidateLaunchOptionsTest, AcceptsDefaultsWithACommand) {
  EXPECT_TRUE(validate_launch_options(shell_job(1, "true")).ok());
}

TEST(ValidateLaunchOptionsTest, SaysWhatWasExpectedAndFound) {
  auto message = [](const LaunchOptions& options) {
    const absl::Status status = validate_launch_options(options);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    return std::string(status.message());
  };
  EXPECT_EQ(message(shell_job(0, "true")),
            "--nproc_per_node must be >= 1 (ranks to start on this node), got 0");
  EXPECT_EQ(message(shell_job(1, "true").nnodes(0)), "--nnodes must be >= 1, got 0");
  EXPECT_EQ(message(shell_job(1, "true").nnodes(2).node_rank(2).master_port(29500)),
            "--node_rank must be in [0, 2) (0 <= node_rank < --nnodes), got 2");
  EXPECT_EQ(message(shell_job(1, "true").node_rank(-1)),
            "--node_rank must be in [0, 1) (0 <= node_rank < --nnodes), got -1");
  EXPECT_EQ(message(shell_job(1, "true").master_addr("")),
            "--master_addr must not be empty; expected rank 0's host, e.g. 127.0.0.1");
  EXPECT_EQ(message(shell_job(1, "true").master_port(65536)),
            "--master_port must be in [0, 65535] (0 picks a free port), got 65536");
  EXPECT_EQ(message(shell_job(1, "true").nnodes(2)),
            "--master_port=0 (pick a free port) works only with --nnodes=1; with "
            "--nnodes=2 give every node the same port, e.g. --master_port=29500");
  EXPECT_EQ(message(shell_job(1, "true").grace_period(std::chrono::milliseconds(-1))),
            "--grace_period_ms must be in [0, 86400000] (milliseconds, at most a day), "
            "got -1");
  EXPECT_EQ(message(LaunchOptions()),
            "no command to run; expected fsdp_run [flags] -- BINARY [ARGS...]");
  // Issue 15: --nproc_per_node=20000 started thousands of ranks (13 GB in 35 s).
  EXPECT_THAT(message(shell_job(20000, "true")),
              ::testing::MatchesRegex("--nproc_per_node must be at most [0-9]+ on this node "
                                      "\\([0-9]+ cores x 4 ranks per core, within the "
                                      "open-file limit\\), got 20000"));
  EXPECT_GE(max_ranks_per_node(), 4);
}

TEST(LaunchTest, BadOptionsGiveOneLineAndStatusTwo) {
  const Result result = run(shell_job(0, "echo never"));
  EXPECT_EQ(result.status, 2);
  EXPECT_EQ(result.out, "");
  EXPECT_EQ(result.err,
            "fsdp_run: --nproc_per_node must be >= 1 (ranks to start on this node), got 0\n");
}

// ---- pick_free_port -------------------------------------------------------------------

TEST(PickFreePortTest, ReturnsABindablePortOnLoopback) {
  const absl::StatusOr<int> port = pick_free_port("127.0.0.1");
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_GE(*port, 1);
  EXPECT_LE(*port, 65535);
  const int sock = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(*port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(sock, reinterpret_cast<sockaddr*>(&address), sizeof address), 0)
      << std::strerror(errno);
  close(sock);
}

TEST(PickFreePortTest, RejectsAnAddressOfAnotherMachine) {
  // 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine.
  const absl::StatusOr<int> port = pick_free_port("192.0.2.1");
  EXPECT_TRUE(absl::IsUnavailable(port.status())) << port.status();
  EXPECT_EQ(port.status().message(),
            "cannot bind a TCP port on --master_addr '192.0.2.1': Cannot assign requested "
            "address; with --nnodes=1 rank 0 runs here, so expected an address of this "
            "machine, e.g. 127.0.0.1");
}

// ---- launch: output ---------------------------------------------------------------------

TEST(LaunchTest, AllRanksExitZeroWithPrefixedStdoutAndStderrKeptApart) {
  const Result result = run(shell_job(2, "echo hello $RANK; echo oops $RANK >&2"));
  EXPECT_EQ(result.status, 0);
  EXPECT_EQ(sorted_lines(result.out), (Lines{"[rank 0] hello 0", "[rank 1] hello 1"}));
  EXPECT_EQ(sorted_lines(result.err), (Lines{"[rank 0] oops 0", "[rank 1] oops 1"}));
}

TEST(LaunchTest, RanksSeeTheirEnvironment) {
  const Result result =
      run(shell_job(2,
                    "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK "
                    "$MASTER_ADDR $MASTER_PORT")
              .master_port(29511));
  EXPECT_EQ(result.status, 0);
  EXPECT_EQ(sorted_lines(result.out),
            (Lines{"[rank 0] 0 2 0 2 0 127.0.0.1 29511", "[rank 1] 1 2 1 2 0 127.0.0.1 29511"}));
}

TEST(LaunchTest, PortZeroGivesEveryRankTheSameFreePort) {
  const Result result = run(shell_job(2, "echo $MASTER_PORT"));
  EXPECT_EQ(result.status, 0);
  const Lines lines = sorted_lines(result.out);
  ASSERT_EQ(lines.size(), 2u);
  const std::string port(absl::StripPrefix(lines[0], "[rank 0] "));
  EXPECT_NE(port, "0");
  EXPECT_EQ(lines[1], "[rank 1] " + port);
}

TEST(LaunchTest, LastLineWithoutNewlineIsFlushedAtExit) {
  const Result result = run(shell_job(1, "printf 'no newline'; printf 'a\\nb' >&2"));
  EXPECT_EQ(result.status, 0);
  EXPECT_EQ(result.out, "[rank 0] no newline\n");
  EXPECT_EQ(result.err, "[rank 0] a\n[rank 0] b\n");
}

// ---- launch: failures -------------------------------------------------------------------

TEST(LaunchTest, FailingRankStopsTheOthersAndGivesItsStatus) {
  const std::string dir = make_temp_dir();
  const std::string script =
      absl::StrCat("cd '", dir, "'; echo $$ > pid.$RANK\n",
                   "if [ $RANK = 1 ]; then\n"
                   "  while [ ! -e ready.0 ] || [ ! -e ready.2 ]; do sleep 0.02; done\n"
                   "  exit 3\n"
                   "fi\n"
                   "trap 'echo got TERM > term.$RANK; exit 143' TERM\n"
                   "touch ready.$RANK\n",
                   kWaitForSignal);
  const Result result = run(shell_job(3, script));
  EXPECT_EQ(result.status, 3);
  EXPECT_LT(result.seconds, 10);
  // Before the summary, the stopped ranks' own stderr (dash reports "Terminated" for the
  // foreground sleep the group's SIGTERM killed).
  const Lines err = absl::StrSplit(absl::StripSuffix(result.err, "\n"), '\n');
  EXPECT_EQ(err.back(), absl::StrCat("fsdp_run: rank 1 (pid ", read_file(dir + "/pid.1"),
                                     ") exited with status 3; stopped 2 other ranks"));
  for (size_t i = 0; i + 1 < err.size(); ++i) {
    EXPECT_TRUE(absl::StartsWith(err[i], "[rank 0] ") || absl::StartsWith(err[i], "[rank 2] "))
        << err[i];
  }
  for (const int rank : {0, 2}) {
    EXPECT_EQ(read_file(absl::StrCat(dir, "/term.", rank)), "got TERM");
    const pid_t pid = std::atoi(read_file(absl::StrCat(dir, "/pid.", rank)).c_str());
    EXPECT_EQ(kill(pid, 0), -1) << "rank " << rank << " (pid " << pid << ") still exists";
    EXPECT_EQ(errno, ESRCH);
  }
}

TEST(LaunchTest, RanksThatIgnoreTermAreKilledAfterTheGracePeriod) {
  const std::string dir = make_temp_dir();
  const std::string script = absl::StrCat("cd '", dir, "'; echo $$ > pid.$RANK\n",
                                          "if [ $RANK = 1 ]; then\n"
                                          "  while [ ! -e ready.0 ]; do sleep 0.02; done\n"
                                          "  exit 5\n"
                                          "fi\n"
                                          "trap '' TERM\n"
                                          "touch ready.0\n"
                                          "sleep 30\n");
  const Result result = run(shell_job(2, script).grace_period(std::chrono::milliseconds(200)));
  EXPECT_EQ(result.status, 5);
  EXPECT_GE(result.seconds, 0.2);
  EXPECT_LT(result.seconds, 5);
  EXPECT_EQ(result.err, absl::StrCat("fsdp_run: rank 1 (pid ", read_file(dir + "/pid.1"),
                                     ") exited with status 5; stopped 1 other rank (1 killed with "
                                     "SIGKILL after the 200 ms grace period)\n"));
}

TEST(LaunchTest, RankKilledBySignalGivesOneHundredTwentyEightPlusSignal) {
  const std::string dir = make_temp_dir();
  const std::string script = absl::StrCat("cd '", dir, "'; echo $$ > pid.$RANK\n",
                                          "if [ $RANK = 0 ]; then kill -9 $$; fi\n"
                                          "sleep 30\n");
  const Result result = run(shell_job(2, script));
  EXPECT_EQ(result.status, 137);
  EXPECT_LT(result.seconds, 10);
  EXPECT_EQ(result.err, absl::StrCat("fsdp_run: rank 0 (pid ", read_file(dir + "/pid.0"),
                                     ") was killed by signal 9 (Killed); stopped 1 other "
                                     "rank\n"));
}

TEST(LaunchTest, MissingBinaryPathGives127AndSaysSo) {
  LaunchOptions options;
  options.nproc_per_node(2).command({"/nonexistent/fsdp_run_test_binary", "--flag"});
  const Result result = run(options);
  EXPECT_EQ(result.status, 127);
  EXPECT_LT(result.seconds, 10);
  EXPECT_EQ(result.out, "");
  EXPECT_EQ(result.err,
            "fsdp_run: cannot execute '/nonexistent/fsdp_run_test_binary': No such file or "
            "directory; expected an executable file at that path\n");
}

TEST(LaunchTest, BareNameIsLookedUpInPath) {
  LaunchOptions options;
  options.command({"fsdp_run_test_no_such_program"});
  const Result result = run(options);
  EXPECT_EQ(result.status, 127);
  EXPECT_EQ(result.err,
            "fsdp_run: cannot execute 'fsdp_run_test_no_such_program': No such file or "
            "directory; expected a program in PATH (or give its path)\n");

  options.command({"sh", "-c", "echo found"});
  EXPECT_EQ(run(options).out, "[rank 0] found\n");
}

TEST(LaunchTest, FileWithoutExecutePermissionGives126) {
  const std::string path = make_temp_dir() + "/not_executable";
  std::ofstream(path) << "#!/bin/sh\necho never\n";
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  LaunchOptions options;
  options.command({path});
  const Result result = run(options);
  EXPECT_EQ(result.status, 126);
  EXPECT_EQ(result.err, absl::StrCat("fsdp_run: cannot execute '", path,
                                     "': Permission denied; expected a file with execute "
                                     "permission\n"));
}

// ---- launch: signals --------------------------------------------------------------------

// Runs `options` on a thread; the test signals this process once `ready_files` exist (the
// ranks create them, so launch() has installed its handlers by then).
class BackgroundLaunch {
 public:
  explicit BackgroundLaunch(const LaunchOptions& options)
      : thread_([this, options] { result_ = run(options); }) {}
  Result join() {
    thread_.join();
    return result_;
  }

 private:
  Result result_;
  std::thread thread_;
};

TEST(LaunchTest, SigintIsForwardedToEveryRankAndGives130) {
  const std::string dir = make_temp_dir();
  BackgroundLaunch job(shell_job(2, absl::StrCat("trap 'echo got INT; exit 0' INT\n", "touch '",
                                                 dir, "/ready.'$RANK\n", kWaitForSignal)));
  EXPECT_TRUE(wait_for_files({dir + "/ready.0", dir + "/ready.1"}));
  ASSERT_EQ(kill(getpid(), SIGINT), 0);
  const Result result = job.join();
  EXPECT_EQ(result.status, 130);
  EXPECT_LT(result.seconds, 10);
  EXPECT_EQ(sorted_lines(result.out), (Lines{"[rank 0] got INT", "[rank 1] got INT"}));
  EXPECT_EQ(result.err, "fsdp_run: got signal 2 (Interrupt); forwarded it to 2 running ranks\n");
}

// timeout(1), for one, sends its signal to the launcher and again to its process group.
// The ranks hold the job open until the test has sent both signals (else the second one
// could arrive after launch() restored SIGINT's default action, and end the test).
TEST(LaunchTest, SignalRepeatedWhileStoppingIsNotForwardedAgain) {
  const std::string dir = make_temp_dir();
  BackgroundLaunch job(
      shell_job(2, absl::StrCat("cd '", dir, "'\n",
                                "trap 'echo got INT; while [ ! -e release ]; do sleep 0.02; done; "
                                "exit 0' INT\n",
                                "touch ready.$RANK\n", kWaitForSignal)));
  EXPECT_TRUE(wait_for_files({dir + "/ready.0", dir + "/ready.1"}));
  ASSERT_EQ(kill(getpid(), SIGINT), 0);
  ASSERT_EQ(kill(getpid(), SIGINT), 0);
  std::ofstream(dir + "/release").close();
  const Result result = job.join();
  EXPECT_EQ(result.status, 130);
  EXPECT_EQ(sorted_lines(result.out), (Lines{"[rank 0] got INT", "[rank 1] got INT"}));
  EXPECT_EQ(result.err, "fsdp_run: got signal 2 (Interrupt); forwarded it to 2 running ranks\n");
}

TEST(LaunchTest, SigtermIsForwardedAndAConcurrentLaunchIsRefused) {
  const std::string dir = make_temp_dir();
  BackgroundLaunch job(shell_job(1, absl::StrCat("touch '", dir, "/ready.'$RANK\n", "sleep 30\n")));
  EXPECT_TRUE(wait_for_files({dir + "/ready.0"}));

  const Result second = run(shell_job(1, "echo never"));
  EXPECT_EQ(second.status, 1);
  EXPECT_EQ(second.out, "");
  EXPECT_EQ(second.err,
            "fsdp_run: launch() is already running in this process; run one job at a time\n");

  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  const Result result = job.join();
  EXPECT_EQ(result.status, 143);
  EXPECT_EQ(result.err, "fsdp_run: got signal 15 (Terminated); forwarded it to 1 running rank\n");
}

// The working directory as getcwd gives it; "" on error.
std::string working_directory() {
  char path[PATH_MAX] = {};
  return getcwd(path, sizeof(path)) == nullptr ? "" : path;
}

// The status of enter_build_working_directory() with BUILD_WORKING_DIRECTORY=`value`
// (unset when nullptr); the working directory and the variable are restored.
absl::Status enter_with(const char* value, std::string* entered = nullptr) {
  const std::string before = working_directory();
  if (value == nullptr) {
    unsetenv("BUILD_WORKING_DIRECTORY");
  } else {
    setenv("BUILD_WORKING_DIRECTORY", value, 1);
  }
  absl::Status status = enter_build_working_directory();
  if (entered != nullptr) *entered = working_directory();
  unsetenv("BUILD_WORKING_DIRECTORY");
  EXPECT_EQ(chdir(before.c_str()), 0);
  return status;
}

TEST(EnterBuildWorkingDirectoryTest, EntersTheDirectoryBazelRunWasStartedFrom) {
  char resolved[PATH_MAX] = {};
  ASSERT_NE(realpath(make_temp_dir().c_str(), resolved), nullptr);
  const std::string dir = resolved;
  std::string entered;
  EXPECT_TRUE(enter_with(dir.c_str(), &entered).ok());
  EXPECT_EQ(entered, dir);
  // Idempotent: a rank started from there, with the variable inherited, stays there.
  ASSERT_EQ(chdir(dir.c_str()), 0);
  EXPECT_TRUE(enter_with(dir.c_str(), &entered).ok());
  EXPECT_EQ(entered, dir);
  // Unset or empty: the directory is left as it is.
  const std::string here = working_directory();
  EXPECT_TRUE(enter_with(nullptr, &entered).ok());
  EXPECT_EQ(entered, here);
  EXPECT_TRUE(enter_with("", &entered).ok());
  EXPECT_EQ(entered, here);
}

TEST(EnterBuildWorkingDirectoryTest, SaysWhatIsWrongWithTheValue) {
  EXPECT_EQ(enter_with("relative/dir"),
            absl::FailedPreconditionError(
                "BUILD_WORKING_DIRECTORY='relative/dir' (the directory `bazel run` was started "
                "from) is not an absolute path; unset it, or set it to the directory that "
                "relative paths on the command line are relative to"));
  const std::string missing = make_temp_dir() + "/missing";
  EXPECT_EQ(enter_with(missing.c_str()),
            absl::FailedPreconditionError(absl::StrCat(
                "BUILD_WORKING_DIRECTORY='", missing,
                "' (the directory `bazel run` was started from) cannot be entered: No such file "
                "or directory; run bazel from an existing directory, or give the program "
                "absolute paths and unset BUILD_WORKING_DIRECTORY")));
}

}  // namespace
}  // namespace fsdp
