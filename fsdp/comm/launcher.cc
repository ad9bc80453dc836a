#include "fsdp/comm/launcher.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

extern char** environ;

namespace fsdp {

// Note [Signals and the self-pipe]
// launch() waits in one poll() loop for three kinds of events: output on the ranks' pipes,
// SIGINT/SIGTERM sent to the launcher, and ranks exiting (SIGCHLD). A signal handler may
// only make async-signal-safe calls, so ours does the least it can: it writes the signal
// number as one byte into a non-blocking pipe whose read end is in the poll set (the
// self-pipe trick). A signal that arrives after the loop checked for exits but before it
// entered poll() leaves its byte in the pipe, so poll() returns at once: no lost wake-up,
// no busy waiting, no thread. The byte is only a wake-up for SIGCHLD: exits are collected
// with waitpid(pid, WNOHANG) for each rank, never waitpid(-1), so children the host program
// started itself are left alone. Handlers are per process, hence one launch() at a time;
// they are installed for launch()'s duration and the previous ones restored afterwards.
// signalfd would need SIGINT/SIGTERM blocked in every thread of the host program, which a
// library cannot promise; the self-pipe works whichever thread the kernel picks.
//
// Note [After fork]
// The host program may have other threads (the tests call launch() from one), and a forked
// child inherits their locks in whatever state they were, malloc's included. So between
// fork() and execvpe() the child only makes async-signal-safe calls on memory prepared
// before fork(): no allocation, no iostreams, no Abseil. The parent blocks SIGINT, SIGTERM
// and SIGCHLD around fork() so that no handler of ours can run in the child (it would
// write into the parent's self-pipe); the child resets them to SIG_DFL and unblocks every
// signal before it executes the command, so forwarded signals reach it even if the
// launcher was started with them ignored or blocked.
//
// Note [Process groups]
// Each rank leads its own process group (setpgid in the child and, against the race with
// the first kill, in the parent too), and signals go to the group (kill(-pgid, ...)), so
// whatever a rank started (a shell's children, data-loader workers) gets them as well. A
// terminal's Ctrl-C reaches only the terminal's foreground group, which holds the launcher
// but no rank, so each rank gets SIGINT exactly once, from the launcher.

namespace {

constexpr char kErrorPrefix[] = "fsdp_run: ";
constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};
constexpr int64_t kMaxGracePeriodMs = 24 * 60 * 60 * 1000;
// A rank's line longer than this is forwarded in pieces of this size (bounds memory).
constexpr size_t kMaxLineBytes = 1 << 20;

using Clock = std::chrono::steady_clock;

std::string error_text(int error) {
  char buffer[256];
  return strerror_r(error, buffer, sizeof buffer);  // GNU strerror_r returns the text
}

absl::Status errno_status(absl::string_view call) {
  return absl::InternalError(absl::StrCat(call, " failed: ", error_text(errno)));
}

// An owned file descriptor, closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    reset(std::exchange(other.fd_, -1));
    return *this;
  }
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

struct Pipe {
  Fd read;
  Fd write;
};

// Both ends close-on-exec: a rank that inherited another rank's write end would keep it
// open, and the launcher would never see EOF on it.
absl::StatusOr<Pipe> make_pipe() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return errno_status("pipe2");
  return Pipe{Fd(fds[0]), Fd(fds[1])};
}

absl::Status set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) return errno_status("fcntl");
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// Signals. See Note [Signals and the self-pipe].

std::atomic<int> g_signal_pipe_write_fd{-1};
static_assert(std::atomic<int>::is_always_lock_free, "used from a signal handler");

void write_signal_byte(int signo) {
  const int saved_errno = errno;
  const int fd = g_signal_pipe_write_fd.load();
  if (fd >= 0) {
    const unsigned char byte = static_cast<unsigned char>(signo);
    // A full pipe (EAGAIN) already holds bytes that will wake the loop.
    const ssize_t ignored = write(fd, &byte, 1);
    (void)ignored;
  }
  errno = saved_errno;
}

// The handlers of kHandledSignals and their pipe, for the lifetime of the object.
class SignalPipe {
 public:
  static absl::StatusOr<std::unique_ptr<SignalPipe>> install() {
    absl::StatusOr<Pipe> pipe = make_pipe();
    if (!pipe.ok()) return pipe.status();
    for (int fd : {pipe->read.get(), pipe->write.get()}) {
      if (absl::Status status = set_nonblocking(fd); !status.ok()) return status;
    }
    int expected = -1;
    if (!g_signal_pipe_write_fd.compare_exchange_strong(expected, pipe->write.get())) {
      return absl::FailedPreconditionError(
          "launch() is already running in this process; run one job at a time");
    }
    std::unique_ptr<SignalPipe> signals(new SignalPipe(std::move(*pipe)));
    struct sigaction action = {};
    action.sa_handler = write_signal_byte;
    sigemptyset(&action.sa_mask);
    // SA_RESTART: reads and writes (of `out`, say) resume after the handler; poll() still
    // returns EINTR. SA_NOCLDSTOP: wake up for exits, not for stops.
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
      sigaction(kHandledSignals[i], &action, &signals->previous_[i]);
    }
    return signals;
  }

  ~SignalPipe() {
    for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
      sigaction(kHandledSignals[i], &previous_[i], nullptr);
    }
    g_signal_pipe_write_fd.store(-1);
  }

  int read_fd() const { return pipe_.read.get(); }

  // The signals received since the last call, oldest first.
  std::vector<int> take() {
    std::vector<int> signals;
    unsigned char bytes[64];
    ssize_t n;
    while ((n = read(read_fd(), bytes, sizeof bytes)) > 0) {
      signals.insert(signals.end(), bytes, bytes + n);
    }
    return signals;
  }

 private:
  explicit SignalPipe(Pipe pipe) : pipe_(std::move(pipe)) {}

  Pipe pipe_;
  struct sigaction previous_[std::size(kHandledSignals)] = {};
};

// Blocks kHandledSignals in the calling thread for the lifetime of the object.
class ScopedSignalBlock {
 public:
  ScopedSignalBlock() {
    sigset_t set;
    sigemptyset(&set);
    for (int signo : kHandledSignals) sigaddset(&set, signo);
    pthread_sigmask(SIG_BLOCK, &set, &previous_);
  }
  ~ScopedSignalBlock() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }

 private:
  sigset_t previous_;
};

std::string describe_signal(int signo) {
  return absl::StrFormat("signal %d (%s)", signo, strsignal(signo));
}

// ---------------------------------------------------------------------------------------
// Output forwarding.

// One rank's stdout or stderr: bytes from a non-blocking pipe, written to `sink` one
// complete line at a time behind the rank's prefix.
class LineForwarder {
 public:
  LineForwarder(Fd fd, std::string prefix, std::ostream& sink)
      : fd_(std::move(fd)), prefix_(std::move(prefix)), sink_(sink) {}

  int fd() const { return fd_.get(); }
  bool is_open() const { return fd_.valid(); }

  // One read(); forwards the lines it completes. At EOF or on an error, forwards the last
  // partial line and closes. Returns true iff more bytes may be waiting.
  bool read_some() {
    char buffer[64 * 1024];
    const ssize_t n = read(fd_.get(), buffer, sizeof buffer);
    if (n > 0) {
      pending_.append(buffer, static_cast<size_t>(n));
      forward_complete_lines();
      return true;
    }
    if (n < 0 && errno == EINTR) return true;
    if (n < 0 && errno == EAGAIN) return false;
    close_stream();
    return false;
  }

  // Forwards what is in the pipe now, without waiting for more (the rank has exited; its
  // background processes may still hold the write end), then closes.
  void drain_and_close() {
    while (is_open() && read_some()) {
    }
    if (is_open()) close_stream();
  }

 private:
  void forward_complete_lines() {
    size_t start = 0;
    for (size_t newline; (newline = pending_.find('\n', start)) != std::string::npos;
         start = newline + 1) {
      sink_ << prefix_ << absl::string_view(pending_).substr(start, newline + 1 - start);
    }
    pending_.erase(0, start);
    if (pending_.size() >= kMaxLineBytes) {
      sink_ << prefix_ << pending_ << '\n';
      pending_.clear();
    }
    sink_.flush();
  }

  void close_stream() {
    if (!pending_.empty()) {
      sink_ << prefix_ << pending_ << '\n';
      sink_.flush();
      pending_.clear();
    }
    fd_.reset();
  }

  Fd fd_;
  const std::string prefix_;
  std::ostream& sink_;
  std::string pending_;  // a partial line
};

// ---------------------------------------------------------------------------------------
// Starting ranks. See Note [After fork].

// Null-terminated char* array over owned strings, as execvpe wants argv and envp.
class CStringArray {
 public:
  explicit CStringArray(std::vector<std::string> strings) : strings_(std::move(strings)) {
    for (std::string& s : strings_) pointers_.push_back(s.data());
    pointers_.push_back(nullptr);
  }
  char* const* data() const { return pointers_.data(); }

 private:
  std::vector<std::string> strings_;
  std::vector<char*> pointers_;
};

std::vector<std::string> environment_strings(const Environment& environment) {
  std::vector<std::string> strings;
  for (const auto& [name, value] : environment) strings.push_back(absl::StrCat(name, "=", value));
  return strings;
}

// The descriptors a child puts in place of its stdin (-1: inherit), stdout and stderr,
// and the pipe on which it reports a failed execvpe.
struct ChildFds {
  int stdin_fd;
  int stdout_fd;
  int stderr_fd;
  int exec_error_fd;
};

// In the child only (async-signal-safe).
void move_fd(int fd, int target) {
  // dup2() onto itself would leave close-on-exec set; clear it so `target` survives exec.
  if (fd == target) {
    fcntl(fd, F_SETFD, 0);
  } else {
    dup2(fd, target);
  }
}

// In the child only, between fork() and exec: async-signal-safe calls only.
[[noreturn]] void exec_rank(const ChildFds& fds, pid_t launcher, char* const argv[],
                            char* const envp[]) {
  setpgid(0, 0);  // See Note [Process groups].
  // A launcher killed outright (SIGKILL) takes its ranks with it. If it died before
  // prctl, getppid() no longer names it.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) _exit(128 + SIGKILL);
  struct sigaction default_action = {};
  default_action.sa_handler = SIG_DFL;
  for (int signo : kHandledSignals) sigaction(signo, &default_action, nullptr);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  if (fds.stdin_fd >= 0) move_fd(fds.stdin_fd, STDIN_FILENO);
  move_fd(fds.stdout_fd, STDOUT_FILENO);
  move_fd(fds.stderr_fd, STDERR_FILENO);
  execvpe(argv[0], argv, envp);
  const int error = errno;
  const ssize_t ignored = write(fds.exec_error_fd, &error, sizeof error);
  (void)ignored;
  _exit(error == ENOENT ? 127 : 126);
}

// NotFound (shell status 127) or PermissionDenied (126) naming the program.
absl::Status exec_error_status(absl::string_view program, int error) {
  std::string message = absl::StrCat("cannot execute '", program, "': ", error_text(error));
  if (error == ENOENT) {
    absl::StrAppend(&message, absl::StrContains(program, '/')
                                  ? "; expected an executable file at that path"
                                  : "; expected a program in PATH (or give its path)");
    return absl::NotFoundError(message);
  }
  if (error == EACCES) absl::StrAppend(&message, "; expected a file with execute permission");
  return absl::PermissionDeniedError(message);
}

int exit_status_of(const absl::Status& start_error) {
  if (absl::IsNotFound(start_error)) return 127;
  if (absl::IsPermissionDenied(start_error)) return 126;
  return 1;
}

struct StartedRank {
  pid_t pid;
  Fd stdout_read;
  Fd stderr_read;
};

// Forks and executes one rank. Returns once the rank runs the command, or with the reason
// it could not (the failed child is reaped).
absl::StatusOr<StartedRank> start_rank(const CStringArray& argv, const CStringArray& envp,
                                       int stdin_fd) {
  absl::StatusOr<Pipe> out = make_pipe();
  absl::StatusOr<Pipe> err = make_pipe();
  absl::StatusOr<Pipe> exec_error = make_pipe();
  for (const auto* pipe : {&out, &err, &exec_error}) {
    if (!pipe->ok()) return pipe->status();
  }
  for (int fd : {out->read.get(), err->read.get()}) {
    if (absl::Status status = set_nonblocking(fd); !status.ok()) return status;
  }
  pid_t pid;
  const pid_t launcher = getpid();
  {
    const ScopedSignalBlock block;
    pid = fork();
    if (pid == 0) {
      exec_rank({stdin_fd, out->write.get(), err->write.get(), exec_error->write.get()}, launcher,
                argv.data(), envp.data());
    }
  }
  if (pid < 0) return errno_status("fork");
  setpgid(pid, pid);  // EACCES once the child has executed: it has done it itself.
  out->write.reset();
  err->write.reset();
  exec_error->write.reset();
  // EOF: execvpe succeeded and closed the pipe (close-on-exec). Otherwise the child's
  // errno.
  int exec_errno = 0;
  ssize_t n;
  do {
    n = read(exec_error->read.get(), &exec_errno, sizeof exec_errno);
  } while (n < 0 && errno == EINTR);
  if (n == sizeof exec_errno) {
    waitpid(pid, nullptr, 0);
    return exec_error_status(argv.data()[0], exec_errno);
  }
  return StartedRank{pid, std::move(out->read), std::move(err->read)};
}

// ---------------------------------------------------------------------------------------
// The job.

int exit_status_of_wait(int wait_status) {
  return WIFSIGNALED(wait_status) ? 128 + WTERMSIG(wait_status) : WEXITSTATUS(wait_status);
}

std::string describe_wait(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    return absl::StrCat("was killed by ", describe_signal(WTERMSIG(wait_status)));
  }
  return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
}

std::string plural(int count, absl::string_view noun) {
  return absl::StrCat(count, " ", noun, count == 1 ? "" : "s");
}

struct Rank {
  Rank(int rank, StartedRank started, std::ostream& out, std::ostream& err)
      : rank(rank),
        pid(started.pid),
        out(std::move(started.stdout_read), absl::StrCat("[rank ", rank, "] "), out),
        err(std::move(started.stderr_read), absl::StrCat("[rank ", rank, "] "), err) {}

  const int rank;  // global
  const pid_t pid;
  bool running = true;
  LineForwarder out;
  LineForwarder err;
};

// Why the job is stopping, and how far it got.
struct Stop {
  int exit_status = 0;           // launch()'s result
  std::string reason;            // for the summary line
  bool launcher_signal = false;  // the launcher got SIGINT/SIGTERM (vs. a rank failed)
  Clock::time_point deadline;    // SIGKILL for the ranks still running after this
  int signalled = 0;             // ranks running when the stop began
  int killed = 0;                // ranks still running when SIGKILL was sent
  bool kill_sent = false;
};

class Job {
 public:
  Job(const LaunchOptions& options, std::ostream& out, std::ostream& err, SignalPipe& signals)
      : options_(options), out_(out), err_(err), signals_(signals) {}

  int run() {
    start_ranks();
    while (running_count() > 0) {
      poll_and_forward();
      handle_signals();
      reap_exited_ranks();
      kill_if_grace_expired();
    }
    if (!stop_) return 0;
    print_summary();
    return stop_->exit_status;
  }

 private:
  void start_ranks() {
    const CStringArray argv(options_.command());
    const Environment parent = current_environment();
    // See the stdin contract in launcher.h.
    Fd dev_null;
    if (isatty(STDIN_FILENO)) dev_null.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
    for (int local_rank = 0; local_rank < options_.nproc_per_node() && !stop_; ++local_rank) {
      const CStringArray envp(environment_strings(rank_environment(options_, local_rank, parent)));
      absl::StatusOr<StartedRank> started = start_rank(argv, envp, dev_null.get());
      const int rank = options_.node_rank() * options_.nproc_per_node() + local_rank;
      if (!started.ok()) {
        const int status = exit_status_of(started.status());
        // Exec errors are the same for every rank; others (fork, pipe) may be this rank's.
        begin_stop(status,
                   status == 1
                       ? absl::StrCat("cannot start rank ", rank, ": ", started.status().message())
                       : std::string(started.status().message()),
                   SIGTERM, /*launcher_signal=*/false);
        break;
      }
      ranks_.push_back(std::make_unique<Rank>(rank, std::move(*started), out_, err_));
      handle_signals();  // Ctrl-C while ranks start stops at once, with those started
    }
  }

  int running_count() const {
    return static_cast<int>(std::count_if(ranks_.begin(), ranks_.end(),
                                          [](const auto& rank) { return rank->running; }));
  }

  // Waits for output, a signal or the grace deadline, and forwards the output.
  void poll_and_forward() {
    std::vector<pollfd> fds = {{signals_.read_fd(), POLLIN, 0}};
    std::vector<LineForwarder*> streams = {nullptr};
    for (const auto& rank : ranks_) {
      for (LineForwarder* stream : {&rank->out, &rank->err}) {
        if (!stream->is_open()) continue;
        fds.push_back({stream->fd(), POLLIN, 0});
        streams.push_back(stream);
      }
    }
    // EINTR: the handler's byte is in the signal pipe; handled on the next steps.
    if (poll(fds.data(), fds.size(), poll_timeout_ms()) <= 0) return;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) streams[i]->read_some();
    }
  }

  int poll_timeout_ms() const {
    if (!stop_ || stop_->kill_sent) return -1;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(stop_->deadline - Clock::now());
    return static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT_MAX));
  }

  void handle_signals() {
    for (int signo : signals_.take()) {
      if (signo == SIGCHLD) continue;  // a wake-up: reap_exited_ranks() looks at each rank
      // Once stopping, further signals change nothing: tools such as timeout(1) deliver
      // the same signal twice (to the launcher and to their process group).
      if (!stop_) {
        begin_stop(128 + signo, absl::StrCat("got ", describe_signal(signo)), signo,
                   /*launcher_signal=*/true);
      }
    }
  }

  void reap_exited_ranks() {
    for (const auto& rank : ranks_) {
      if (!rank->running) continue;
      int wait_status = 0;
      const pid_t pid = waitpid(rank->pid, &wait_status, WNOHANG);
      const int wait_errno = errno;
      if (pid == 0) continue;
      rank->running = false;
      rank->out.drain_and_close();
      rank->err.drain_and_close();
      if (stop_) continue;
      if (pid < 0) {  // ECHILD: someone else in this process collected it
        begin_stop(1,
                   absl::StrFormat("rank %d (pid %d) could not be waited for: %s", rank->rank,
                                   rank->pid, error_text(wait_errno)),
                   SIGTERM, /*launcher_signal=*/false);
      } else if (wait_status != 0) {
        begin_stop(exit_status_of_wait(wait_status),
                   absl::StrFormat("rank %d (pid %d) %s", rank->rank, rank->pid,
                                   describe_wait(wait_status)),
                   SIGTERM, /*launcher_signal=*/false);
      }
    }
  }

  // Sends `signo` to every running rank's process group; the rest waits for the deadline.
  void begin_stop(int exit_status, std::string reason, int signo, bool launcher_signal) {
    stop_.emplace();
    stop_->exit_status = exit_status;
    stop_->reason = std::move(reason);
    stop_->launcher_signal = launcher_signal;
    stop_->deadline = Clock::now() + options_.grace_period();
    for (const auto& rank : ranks_) {
      if (!rank->running) continue;
      kill(-rank->pid, signo);  // See Note [Process groups].
      ++stop_->signalled;
    }
  }

  void kill_if_grace_expired() {
    if (stop_ && !stop_->kill_sent && Clock::now() >= stop_->deadline) kill_running_ranks();
  }

  void kill_running_ranks() {
    for (const auto& rank : ranks_) {
      if (!rank->running) continue;
      kill(-rank->pid, SIGKILL);
      ++stop_->killed;
    }
    stop_->kill_sent = true;
  }

  // "fsdp_run: rank 1 (pid 1234) exited with status 3; stopped 2 other ranks".
  void print_summary() {
    std::string line = absl::StrCat(kErrorPrefix, stop_->reason);
    if (stop_->signalled > 0) {
      absl::StrAppend(
          &line, stop_->launcher_signal ? "; forwarded it to " : "; stopped ",
          plural(stop_->signalled, stop_->launcher_signal ? "running rank" : "other rank"));
    }
    if (stop_->killed > 0) {
      absl::StrAppend(&line, " (", stop_->killed, " killed with SIGKILL after the ",
                      options_.grace_period().count(), " ms grace period)");
    }
    err_ << line << "\n";
    err_.flush();
  }

  const LaunchOptions& options_;
  std::ostream& out_;
  std::ostream& err_;
  SignalPipe& signals_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::optional<Stop> stop_;
};

}  // namespace

int max_ranks_per_node() {
  const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  int64_t most = cores * kMaxRanksPerCore;
  rlimit files = {};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
    most = std::min<int64_t>(most, (static_cast<int64_t>(files.rlim_cur) - 32) / 4);
  }
  return static_cast<int>(std::max<int64_t>(1, most));
}

absl::Status validate_launch_options(const LaunchOptions& options) {
  if (options.nproc_per_node() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nproc_per_node must be >= 1 (ranks to start on this node), got ",
                     options.nproc_per_node()));
  }
  if (options.nproc_per_node() > max_ranks_per_node()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nproc_per_node must be at most ", max_ranks_per_node(), " on this node (",
        sysconf(_SC_NPROCESSORS_ONLN), " cores x ", kMaxRanksPerCore,
        " ranks per core, within the open-file limit), got ", options.nproc_per_node()));
  }
  if (options.nnodes() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes must be >= 1, got ", options.nnodes()));
  }
  if (options.node_rank() < 0 || options.node_rank() >= options.nnodes()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--node_rank must be in [0, %d) (0 <= node_rank < --nnodes), got %d",
                        options.nnodes(), options.node_rank()));
  }
  if (options.master_addr().empty()) {
    return absl::InvalidArgumentError(
        "--master_addr must not be empty; expected rank 0's host, e.g. 127.0.0.1");
  }
  if (options.master_port() < 0 || options.master_port() > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--master_port must be in [0, 65535] (0 picks a free port), got ", options.master_port()));
  }
  if (options.master_port() == 0 && options.nnodes() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--master_port=0 (pick a free port) works only with --nnodes=1; with --nnodes=",
        options.nnodes(), " give every node the same port, e.g. --master_port=29500"));
  }
  const int64_t grace_period_ms = options.grace_period().count();
  if (grace_period_ms < 0 || grace_period_ms > kMaxGracePeriodMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grace_period_ms must be in [0, ", kMaxGracePeriodMs,
                     "] (milliseconds, at most a day), got ", grace_period_ms));
  }
  if (options.command().empty() || options.command()[0].empty()) {
    return absl::InvalidArgumentError(
        "no command to run; expected fsdp_run [flags] -- BINARY [ARGS...]");
  }
  return absl::OkStatus();
}

Environment current_environment() {
  Environment environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const absl::string_view variable(*entry);
    const size_t equals = variable.find('=');
    if (equals == absl::string_view::npos) continue;
    environment.emplace(variable.substr(0, equals), variable.substr(equals + 1));
  }
  return environment;
}

Environment rank_environment(const LaunchOptions& options, int local_rank,
                             const Environment& parent) {
  Environment environment = parent;
  const int nproc = options.nproc_per_node();
  environment["RANK"] = absl::StrCat(options.node_rank() * nproc + local_rank);
  environment["WORLD_SIZE"] = absl::StrCat(options.nnodes() * nproc);
  environment["LOCAL_RANK"] = absl::StrCat(local_rank);
  environment["LOCAL_WORLD_SIZE"] = absl::StrCat(nproc);
  environment["GROUP_RANK"] = absl::StrCat(options.node_rank());
  environment["MASTER_ADDR"] = options.master_addr();
  environment["MASTER_PORT"] = absl::StrCat(options.master_port());
  // One intra-op thread per rank: the node's ranks share its cores. Keeps the user's.
  environment.try_emplace("OMP_NUM_THREADS", "1");
  environment.try_emplace("MKL_NUM_THREADS", "1");
  return environment;
}

namespace {

// Binds a TCP socket to port 0 of `address` and returns the port the kernel chose, or
// -errno.
int bind_any_port(const addrinfo& address) {
  const Fd sock(socket(address.ai_family, address.ai_socktype | SOCK_CLOEXEC, address.ai_protocol));
  if (!sock.valid()) return -errno;
  if (bind(sock.get(), address.ai_addr, address.ai_addrlen) != 0) return -errno;
  sockaddr_storage bound = {};
  socklen_t length = sizeof bound;
  if (getsockname(sock.get(), reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    return -errno;
  }
  if (bound.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in&>(bound).sin_port);
  }
  if (bound.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6&>(bound).sin6_port);
  }
  return -EAFNOSUPPORT;
}

}  // namespace

absl::StatusOr<int> pick_free_port(const std::string& address) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(address.c_str(), "0", &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve --master_addr '", address, "': ", gai_strerror(rc),
                     "; expected a host name or IP address of this machine"));
  }
  const std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owner(found, &freeaddrinfo);
  int last_error = EADDRNOTAVAIL;
  for (const addrinfo* candidate = found; candidate != nullptr; candidate = candidate->ai_next) {
    const int port = bind_any_port(*candidate);
    if (port > 0) return port;
    last_error = -port;
  }
  return absl::UnavailableError(absl::StrCat(
      "cannot bind a TCP port on --master_addr '", address, "': ", error_text(last_error),
      "; with --nnodes=1 rank 0 runs here, so expected an address of this machine, e.g. "
      "127.0.0.1"));
}

int launch(const LaunchOptions& options, std::ostream& out, std::ostream& err) {
  if (absl::Status status = validate_launch_options(options); !status.ok()) {
    err << kErrorPrefix << status.message() << "\n";
    return 2;
  }
  LaunchOptions resolved = options;
  if (resolved.master_port() == 0) {
    absl::StatusOr<int> port = pick_free_port(resolved.master_addr());
    if (!port.ok()) {  // a --master_addr that is not this machine's: bad input
      err << kErrorPrefix << port.status().message() << "\n";
      return 2;
    }
    resolved.master_port(*port);
  }
  absl::StatusOr<std::unique_ptr<SignalPipe>> signals = SignalPipe::install();
  if (!signals.ok()) {
    err << kErrorPrefix << signals.status().message() << "\n";
    return 1;
  }
  return Job(resolved, out, err, **signals).run();
}

int launch_self(int nproc_per_node, int argc, char** argv) {
  LaunchOptions options;
  options.nproc_per_node(nproc_per_node).command({"/proc/self/exe"});
  for (int i = 1; i < argc; ++i) options.command().push_back(argv[i]);
  return launch(options, std::cout, std::cerr);
}

absl::Status enter_build_working_directory() {
  const char* directory = std::getenv("BUILD_WORKING_DIRECTORY");
  if (directory == nullptr || *directory == '\0') return absl::OkStatus();
  const std::string what = absl::StrCat("BUILD_WORKING_DIRECTORY='", directory,
                                        "' (the directory `bazel run` was started from)");
  if (directory[0] != '/') {
    return absl::FailedPreconditionError(
        absl::StrCat(what,
                     " is not an absolute path; unset it, or set it to the directory that relative "
                     "paths on the command line are relative to"));
  }
  if (chdir(directory) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " cannot be entered: ", std::strerror(errno),
        "; run bazel from an existing directory, or give the program absolute paths and unset "
        "BUILD_WORKING_DIRECTORY"));
  }
  return absl::OkStatus();
}

}  // namespace fsdp
