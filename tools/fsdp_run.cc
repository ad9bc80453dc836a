// fsdp_run: starts N local ranks of a training binary (PyTorch: torchrun with a static
// rendezvous), each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR and MASTER_PORT in its environment.
//
//   fsdp_run --nproc_per_node=4 -- bazel-bin/examples/train --steps=100
//   fsdp_run --nnodes=2 --node_rank=1 --nproc_per_node=8 --master_addr=node0
//       --master_port=29500 -- ./train
//
// Everything after the first "--" is the command, passed on untouched (even flags that
// share a name with ours). Output lines come back as "[rank R] ...". Ctrl-C (SIGINT) and
// SIGTERM are forwarded to the ranks; when a rank fails the others are stopped and fsdp_run
// exits with the failing rank's status. Bad flags print one line on stderr, status 2. See
// fsdp/comm/launcher.h for the whole contract.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"

#include "fsdp/comm/launcher.h"

ABSL_FLAG(int, nproc_per_node, 1, "ranks (processes) to start on this node, >= 1");
ABSL_FLAG(int, nnodes, 1, "nodes in the job, >= 1; each runs its own fsdp_run");
ABSL_FLAG(int, node_rank, 0, "this node's index in [0, nnodes)");
ABSL_FLAG(std::string, master_addr, "127.0.0.1", "host of the node that runs rank 0");
ABSL_FLAG(int, master_port, 0,
          "TCP port for the rendezvous on master_addr; 0 picks a free one (nnodes=1 only)");
ABSL_FLAG(int64_t, grace_period_ms, 5000,
          "after SIGTERM (or a forwarded signal), how long ranks get before SIGKILL (ms)");

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::cerr << "fsdp_run: " << message << "\n";
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Starts N local ranks of a command (torchrun-like).\n"
      "  fsdp_run --nproc_per_node=N [--nnodes=1] [--node_rank=0] "
      "[--master_addr=127.0.0.1]\n"
      "           [--master_port=0] [--grace_period_ms=5000] -- BINARY [ARGS...]");
  if (const absl::Status entered = fsdp::enter_build_working_directory(); !entered.ok()) {
    fail(std::string(entered.message()));
  }
  // Abseil sees only what is before the first "--"; the rest is the command.
  int separator = 1;
  while (separator < argc && std::strcmp(argv[separator], "--") != 0) ++separator;
  std::vector<char*> launcher_args(argv, argv + separator);
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(launcher_args.size()), launcher_args.data());
  if (positional.size() > 1) {
    fail(absl::StrCat("unexpected argument '", positional[1],
                      "' before '--'; expected fsdp_run [flags] -- BINARY [ARGS...]"));
  }
  fsdp::LaunchOptions options;
  options.nproc_per_node(absl::GetFlag(FLAGS_nproc_per_node))
      .nnodes(absl::GetFlag(FLAGS_nnodes))
      .node_rank(absl::GetFlag(FLAGS_node_rank))
      .master_addr(absl::GetFlag(FLAGS_master_addr))
      .master_port(absl::GetFlag(FLAGS_master_port))
      .grace_period(std::chrono::milliseconds(absl::GetFlag(FLAGS_grace_period_ms)))
      .command(separator < argc ? std::vector<std::string>(argv + separator + 1, argv + argc)
                                : std::vector<std::string>());
  return fsdp::launch(options, std::cout, std::cerr);
}
