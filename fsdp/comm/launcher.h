// The fsdp_run launcher (PyTorch: torchrun / torch.distributed.run, static rendezvous):
// starts nproc_per_node local ranks of one command, gives each its rank through the
// environment, forwards their output line by line with a "[rank R] " prefix, forwards
// SIGINT/SIGTERM to them, and stops the whole job when one rank fails.
//
//   fsdp::LaunchOptions options;
//   options.nproc_per_node(2).command({"/bin/sh", "-c", "echo $RANK/$WORLD_SIZE"});
//   int status = fsdp::launch(options, std::cout, std::cerr);
//   // stdout: "[rank 0] 0/2" and "[rank 1] 1/2" (in either order); status 0.
//
// Exit status of launch() (and of fsdp_run):
//   0        every rank exited 0;
//   s        the first rank to fail exited with status s (128 + n if signal n killed it);
//   128 + n  the launcher got signal n (SIGINT -> 130, SIGTERM -> 143);
//   2        invalid options, or no free port on master_addr (not this machine's);
//   1        the job could not be set up (pipe, fork) or launch() is already running;
//   127/126  the command was not found / could not be executed (as in a shell).
// Every error is one line on `err` starting "fsdp_run: ".
//
// Requires POSIX (Linux): fork, execvpe, poll, process groups. No LibTorch.
#ifndef FSDP_COMM_LAUNCHER_H_
#define FSDP_COMM_LAUNCHER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp {

// A field `name_` with TORCH_ARG's accessors: `name()` reads it, `name(value)` sets it and
// returns *this, so options chain as in torch::nn::LinearOptions. (TORCH_ARG itself is in
// LibTorch, which this library does not depend on.)
#define FSDP_LAUNCH_ARG(T, name)                     \
 public:                                             \
  LaunchOptions& name(T new_##name) {                \
    name##_ = std::move(new_##name);                 \
    return *this;                                    \
  }                                                  \
  const T& name() const noexcept { return name##_; } \
  T& name() noexcept { return name##_; }             \
                                                     \
 private:                                            \
  T name##_

// What fsdp_run's flags say; field names are the flag names (grace_period:
// --grace_period_ms).
class LaunchOptions {
  // Ranks (processes) to start on this node, 1 <= nproc_per_node <= max_ranks_per_node().
  FSDP_LAUNCH_ARG(int, nproc_per_node) = 1;
  // Nodes in the job, >= 1; every node runs its own launcher with the same options except
  // node_rank.
  FSDP_LAUNCH_ARG(int, nnodes) = 1;
  // This node's index, 0 <= node_rank < nnodes. Global rank = node_rank *
  // nproc_per_node + local rank.
  FSDP_LAUNCH_ARG(int, node_rank) = 0;
  // Host (name or numeric IPv4/IPv6 address) of the node that runs global rank 0.
  FSDP_LAUNCH_ARG(std::string, master_addr) = "127.0.0.1";
  // TCP port on master_addr for the ranks' rendezvous, in [0, 65535]. 0 (only with
  // nnodes == 1): launch() picks a free port with pick_free_port(master_addr).
  FSDP_LAUNCH_ARG(int, master_port) = 0;
  // How long ranks get to exit after SIGTERM (or a forwarded SIGINT/SIGTERM) before they
  // are killed with SIGKILL, in [0, 1 day].
  FSDP_LAUNCH_ARG(std::chrono::milliseconds, grace_period) = std::chrono::seconds(5);
  // The program and its arguments, run with execvp semantics: a name without '/' is
  // looked up in PATH. Required.
  FSDP_LAUNCH_ARG(std::vector<std::string>, command);
};

#undef FSDP_LAUNCH_ARG

// An environment as name -> value.
using Environment = std::map<std::string, std::string>;

// OK, or InvalidArgument whose message (naming the fsdp_run flag) says what was expected
// and what was found, for the first violated rule of the field comments above.
absl::Status validate_launch_options(const LaunchOptions& options);

// Ranks per core a launcher starts at most: each rank is a process with its own LibTorch
// (about 200 MB resident), and ranks sharing a core run one intra-op thread each.
inline constexpr int kMaxRanksPerCore = 4;

// The most ranks one node may run: cores x kMaxRanksPerCore, and no more than the
// open-file limit leaves room for (the launcher holds 4 descriptors per rank).
int max_ranks_per_node();

// The calling process's environment (`environ`).
Environment current_environment();

// The complete environment of local rank `local_rank` (0 <= local_rank <
// nproc_per_node): `parent` plus, overriding it,
//   RANK = node_rank * nproc_per_node + local_rank, WORLD_SIZE = nnodes * nproc_per_node,
//   LOCAL_RANK = local_rank, LOCAL_WORLD_SIZE = nproc_per_node, GROUP_RANK = node_rank,
//   MASTER_ADDR, MASTER_PORT (as given: resolve 0 first);
// and OMP_NUM_THREADS = MKL_NUM_THREADS = 1 (one intra-op thread per rank) unless
// `parent` already sets them, in which case the parent's values are kept.
// Pure. PyTorch: the worker environment of torch.distributed.elastic's LocalElasticAgent.
Environment rank_environment(const LaunchOptions& options, int local_rank,
                             const Environment& parent);

// A TCP port that is free on `address` right now (1..65535): binds a socket to port 0 on
// the address, reads the port the kernel chose (getsockname) and closes the socket.
// Another process may take the port before the ranks bind it (torchrun has the same
// race). Returns InvalidArgument if the address does not resolve, Unavailable if nothing
// can be bound on it (e.g. the address is not one of this machine's).
absl::StatusOr<int> pick_free_port(const std::string& address);

// Runs the job to completion and returns the exit status listed at the top of this file.
//
// Each rank runs `command` in its own process group with rank_environment(options,
// local_rank, current_environment()); its stdout and stderr are pipes whose complete
// lines are written to `out` / `err` with the prefix "[rank R] " (R = global rank); a
// last line without '\n' is written (with '\n') when the rank exits. Output a rank's
// background processes write after the rank itself exited is dropped. Stdin is inherited,
// except that a terminal is replaced by /dev/null (a rank outside the terminal's
// foreground process group that read it would be stopped by SIGTTIN and hang the job).
//
// When a rank exits non-zero or is killed by a signal, the other running ranks' process
// groups get SIGTERM; those still running after grace_period get SIGKILL; a summary
// line on `err` names the rank, its pid and its status. SIGINT/SIGTERM sent to this
// process are forwarded the same way (the same signal, then SIGKILL after the grace
// period); signals that arrive while the job is already stopping are not forwarded again.
//
// Threading and signals: see Note [Signals and the self-pipe] in launcher.cc. launch()
// installs handlers for SIGINT, SIGTERM and SIGCHLD for its duration and restores the
// previous ones before returning; so one launch() may run at a time per process (a
// concurrent call returns 1 with an error). It may be called from any thread; it only
// waits for the children it started (never waitpid(-1)). `out` and `err` are written from
// the calling thread only, and flushed after each batch of lines.
int launch(const LaunchOptions& options, std::ostream& out, std::ostream& err);

// launch() of `nproc_per_node` copies of the running program (/proc/self/exe) with its
// own arguments argv[1..argc), output to std::cout / std::cerr: how a program that is
// not already a rank starts its own ranks (the examples, the benchmarks). Returns the
// job's exit status as launch() does.
int launch_self(int nproc_per_node, int argc, char** argv);

// Under `bazel run`, changes the working directory to $BUILD_WORKING_DIRECTORY, the
// directory bazel was run from, so that relative paths on the command line (--out_dir=out,
// ./my_binary) mean what they mean there: Bazel starts the program in its runfiles
// folder. Does nothing when the variable is unset or empty. Idempotent: ranks the program
// starts inherit the variable and the new directory, and changing to it again is a no-op.
// Every user-facing binary (fsdp_run, fsdp_plan, the trainers) calls it first thing in
// main(), before reading a path (a relative --flagfile too). Returns FailedPrecondition
// when the value is not an absolute path or cannot be entered, saying what to do.
absl::Status enter_build_working_directory();

}  // namespace fsdp

#endif  // FSDP_COMM_LAUNCHER_H_
