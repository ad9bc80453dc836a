// Rendezvous: who am I, how many are we, where do we meet. Reads the variables the usual
// launchers set, connects a c10d store, checks that every rank arrived with the same
// world size, and makes the communicator: NCCL on cuda:LOCAL_RANK where this process sees
// a CUDA device, Gloo otherwise (Note [Choosing the backend]).
//
//   // Under fsdp_run, torchrun, mpirun or srun:
//   std::shared_ptr<fsdp::Communicator> comm = fsdp::init_from_environment();
//   // Tensors on the CPU on any host (PyTorch: init_process_group("gloo")):
//   auto cpu_comm = fsdp::init_from_environment(
//       fsdp::RendezvousOptions().backend(fsdp::Backend::kGloo));
//
// Variables, first match wins: torchrun/fsdp_run (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE), Open MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE),
// MPICH (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), Slurm (SLURM_PROCID,
// SLURM_NTASKS, SLURM_LOCALID, and this node's count in SLURM_STEP_TASKS_PER_NODE at
// SLURM_NODEID, else SLURM_NTASKS_PER_NODE). The meeting point is
// MASTER_ADDR:MASTER_PORT (rank 0 hosts a TCPStore there; Slurm falls back to
// SLURM_LAUNCH_NODE_IPADDR) or, with RendezvousOptions::file_store_path, a FileStore.
// With no variables at all the process is rank 0 of 1.
//
// Errors (c10::Error, one clear sentence each): unparsable or inconsistent variables,
// torchrun's variables set only in part (RANK without WORLD_SIZE, or the reverse; Note [A
// partial torchrun environment] in rendezvous.cc), a MASTER_ADDR that does not resolve
// (at once, with the resolver's words), an unreachable master, a port rank 0 cannot listen on,
// ranks missing after the timeout (named), ranks started with different world sizes (named), a
// backend that cannot run here or differs from rank 0's (named).
//
// Note [Choosing the backend]
// As in PyTorch's init_process_group(backend=...), the program names the backend with
// RendezvousOptions::backend, and the default is chosen by the compute device. That
// device is cuda:LOCAL_RANK (torchrun's convention) when this process sees a CUDA device,
// so Backend::kDefault means NCCL there and Gloo on a host without one; kGloo and kNccl
// force a backend. (PyTorch's backend=None makes both, each serving its own device type;
// an fsdp communicator has one backend, so the default picks the one for the compute
// device.) A program whose tensors stay on the CPU asks for kGloo: on a GPU host the
// default is NCCL, which refuses CPU buffers. There is no environment variable: PyTorch
// has none, and the program, not its launcher, knows where its tensors live.
//   Every rank must end up with the same backend, or the job hangs in two different
// connection protocols. So a rank whose LOCAL_RANK has no device (more ranks on a host
// than devices) is an error under kDefault as under kNccl, not a fallback to Gloo, and
// every rank checks its choice against rank 0's through the store before connecting.
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
// c10::Error naming the variable if a value is not an integer or out of range, and naming
// what is set and what is missing if no launcher's variables are complete but some of
// torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) are set.
LaunchEnvironment read_launch_environment(const EnvLookup& lookup = nullptr);

// The communicator init_from_environment makes. PyTorch: init_process_group's `backend`.
enum class Backend {
  kDefault,  // by the compute device: NCCL with a CUDA device, else Gloo (see the Note)
  kGloo,     // CPU tensors (make_gloo_communicator, gloo.h)
  kNccl,     // CUDA tensors on cuda:LOCAL_RANK (make_nccl_communicator, nccl.h)
};

// "default", "gloo", "nccl".
const char* backend_name(Backend backend);

// The backend of a rank that requested `requested`, sees `cuda_device_count` CUDA devices
// and has LOCAL_RANK `local_rank` (Note [Choosing the backend]): kGloo or kNccl, never
// kDefault. Throws c10::Error if NCCL is requested without a CUDA device (the message
// ends with `why_no_cuda`, the CUDA runtime's words, when not empty) or if NCCL is
// chosen (requested or by default) and device `local_rank` does not exist. Pure.
Backend choose_backend(Backend requested, int cuda_device_count, int local_rank,
                       const std::string& why_no_cuda = "");

struct RendezvousOptions {
  // How long to wait for every rank to join, and the default collective timeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  // Which communicator to make (Note [Choosing the backend]).
  TORCH_ARG(Backend, backend) = Backend::kDefault;
  // Meet through a FileStore at this path (on a file system all ranks share) instead of
  // a TCPStore at MASTER_ADDR:MASTER_PORT.
  TORCH_ARG(std::string, file_store_path) = "";
};

// Connects this rank to the job's store and waits until all world_size ranks joined with
// the same world size. Every rank calls it.
c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnvironment& env,
                                              const RendezvousOptions& options = {});

// choose_backend (with this process's CUDA device count), connect_store, then the
// communicator over all ranks: NCCL on cuda:LOCAL_RANK (NcclOptions with this timeout;
// blocking_wait when TORCH_NCCL_BLOCKING_WAIT=1, PyTorch's variable; its host groups bound
// as the Gloo communicator would be), or Gloo (bound to loopback when the master is local,
// else to this host's address, or to GLOO_SOCKET_IFNAME). With kGloo no CUDA call is made. PyTorch:
// dist.init_process_group(backend, init_method="env://"). It also reports uncaught errors as
// report_uncaught_errors(env.rank) does.
std::shared_ptr<Communicator> init_from_environment(const RendezvousOptions& options = {});
std::shared_ptr<Communicator> init_communicator(const LaunchEnvironment& env,
                                                const RendezvousOptions& options = {});

// Makes a c10::Error (CommError among them) that no catch handles end this process with
// one line on stderr, "fsdp: rank R failed: <the error without its C++ backtrace>", and
// exit status 1, instead of libstdc++'s "terminate called after throwing an instance of
// 'c10::Error'" with the backtrace and SIGABRT; with TORCH_SHOW_CPP_STACKTRACES=1 (PyTorch's
// variable) the line carries the backtrace. Other exceptions go to the terminate handler
// it replaced (Gloo's: Note [Gloo terminations] in gloo.cc). The launcher's summary then
// names the rank ("rank R (pid P) exited with status 1"). Idempotent; the rank of the last
// call is printed. Threading: any thread. PyTorch: torchrun's per-rank error summary.
void report_uncaught_errors(int rank);

}  // namespace fsdp

#endif  // FSDP_COMM_RENDEZVOUS_H_
