// Rendezvous: who am I, how many are we, where do we meet. Reads the variables the usual
// launchers set, connects a c10d store, checks that every rank arrived with the same
// world size, and makes the Gloo communicator.
//
//   // Under fsdp_run, torchrun, mpirun or srun:
//   std::shared_ptr<fsdp::Communicator> comm = fsdp::init_from_environment();
//
// Variables, first match wins: torchrun/fsdp_run (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE), Open MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE),
// MPICH (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), Slurm (SLURM_PROCID,
// SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE). The meeting point is
// MASTER_ADDR:MASTER_PORT (rank 0 hosts a TCPStore there; Slurm falls back to
// SLURM_LAUNCH_NODE_IPADDR) or, with RendezvousOptions::file_store_path, a FileStore.
// With no variables at all the process is rank 0 of 1.
//
// Errors (c10::Error, one clear sentence each): unparsable or inconsistent variables,
// an unreachable master, a port rank 0 cannot listen on, ranks missing after the
// timeout (named), ranks started with different world sizes (named).
//
// Threading: call once per process (or per rank thread with distinct environments).
#ifndef FSDP_COMM_RENDEZVOUS_H_
#define FSDP_COMM_RENDEZVOUS_H_

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp/comm/communicator.h"
#include "fsdp/comm/gloo.h"

namespace fsdp {

// Where this process sits in the job.
struct LaunchEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // "" if not set
  int master_port = 0;      // 0 if not set
  std::string launcher;     // "torchrun", "Open MPI", "MPICH", "Slurm" or "none"
};

// Returns the value of an environment variable, or nullopt if unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Reads the variables through `lookup` (the process environment by default). Throws
// c10::Error naming the variable if a value is not an integer or out of range.
LaunchEnvironment read_launch_environment(const EnvLookup& lookup = nullptr);

struct RendezvousOptions {
  // How long to wait for every rank to join, and the default collective timeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  // Meet through a FileStore at this path (on a file system all ranks share) instead of
  // a TCPStore at MASTER_ADDR:MASTER_PORT.
  TORCH_ARG(std::string, file_store_path) = "";
};

// Connects this rank to the job's store and waits until all world_size ranks joined with
// the same world size. Every rank calls it.
c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnvironment& env,
                                              const RendezvousOptions& options = {});

// connect_store, then a Gloo communicator over all ranks (bound to loopback when the
// master is local, else to this host's address). PyTorch:
// dist.init_process_group("gloo", init_method="env://").
std::shared_ptr<Communicator> init_from_environment(const RendezvousOptions& options = {});
std::shared_ptr<Communicator> init_communicator(const LaunchEnvironment& env,
                                                const RendezvousOptions& options = {});

}  // namespace fsdp

#endif  // FSDP_COMM_RENDEZVOUS_H_
