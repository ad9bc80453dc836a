// A tiny distributed program for launcher tests: rendezvous from the environment, then
// every rank checks an all-reduce and an all-gather against closed forms and prints one
// line. Exit status 0 iff the results are right.
//   fsdp_run --nproc_per_node=3 -- comm_smoke
//   torchrun --standalone --nproc_per_node=3 -r 1 -t 1 --no_python comm_smoke
#include <cstdio>

#include <ATen/Functions.h>

#include "fsdp/comm/rendezvous.h"

int main() {
  const fsdp::LaunchEnvironment env = fsdp::read_launch_environment();
  std::shared_ptr<fsdp::Communicator> comm = fsdp::init_communicator(
      env,
      fsdp::RendezvousOptions().timeout(std::chrono::seconds(60)).backend(fsdp::Backend::kGloo));
  const int w = comm->world_size();
  at::Tensor sum = at::full({4}, static_cast<double>(comm->rank() + 1));
  comm->all_reduce(sum);
  at::Tensor gathered = at::empty({w});
  comm->all_gather_into_tensor(gathered, at::full({1}, static_cast<double>(comm->rank())));
  const bool ok =
      sum[0].item<double>() == w * (w + 1) / 2 && at::equal(gathered, at::arange(w, at::kFloat));
  std::printf("rank %d of %d (local %d of %d, launcher %s): %s\n", comm->rank(), w, env.local_rank,
              env.local_world_size, env.launcher.c_str(), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
