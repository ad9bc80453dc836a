#include "fsdp/comm/internal/benchmark_ranks.h"

#include <cstdlib>
#include <iostream>

#include "fsdp/comm/launcher.h"

namespace fsdp::comm_internal {

std::optional<int> launch_self_as_ranks(int world_size, int argc, char** argv) {
  if (std::getenv("RANK") != nullptr) return std::nullopt;
  LaunchOptions options;
  options.nproc_per_node(world_size).command({"/proc/self/exe"});
  for (int i = 1; i < argc; ++i) options.command().push_back(argv[i]);
  return launch(options, std::cout, std::cerr);
}

}  // namespace fsdp::comm_internal
