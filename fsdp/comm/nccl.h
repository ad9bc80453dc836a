// The NCCL backend: collectives between GPUs through the NCCL C API, on raw device buffers
// (PyTorch: ProcessGroupNCCL). Callers pass CommBuffers that point into device memory
// (cudaMalloc'ed, or the data_ptr() of a CUDA tensor), with device =
// c10::Device(c10::kCUDA, i). Built by default; NCCL and the CUDA runtime are the torch
// wheel's own (Note [One NCCL per process] in bazel/libtorch.bzl).
//
//   auto store = c10::make_intrusive<c10d::TCPStore>(master_addr, store_options);
//   fsdp::NcclOptions options;
//   options.device_index(local_rank).compute_stream(my_stream);   // a cudaStream_t
//   std::shared_ptr<fsdp::Communicator> comm =
//       fsdp::make_nccl_communicator(store, rank, world_size, options);
//   const c10::Device gpu(c10::kCUDA, local_rank);
//   float *shard, *full;                       // n and n * world_size floats on `gpu`
//   // ... a kernel on my_stream writes `shard` ...
//   fsdp::WorkHandle work = comm->all_gather_into_tensor_async(
//       {full, n * world_size, c10::kFloat, gpu}, {shard, n, c10::kFloat, gpu});
//   work->wait();   // done; kernels queued on my_stream from now on see `full`
//
// Buffers: Communicator checks shapes, dtypes (float32, float64, float16, bfloat16,
// int64, int32, uint8) and devices (c10::Device(c10::kCUDA, options.device_index), or
// kCUDA without an index) before any traffic. It cannot check that a pointer is device
// memory of that size: NCCL rejects some bad pointers (a CommError), others are undefined
// behaviour, as in NCCL.
//
// Note [NCCL streams and events]
// A communicator owns three CUDA streams on its device, created non-blocking so that they
// never synchronize implicitly with the legacy default stream: one for all-gather, one
// for reduce-scatter, and a third shared by all-reduce, broadcast and barrier (kept off
// the first two so that those stay free of unrelated waits, as in PyTorch FSDP's
// all-gather and reduce-scatter streams). Issuing a collective
//   1. records an event on the compute stream (NcclOptions::compute_stream) and makes the
//      collective's stream wait on it, so the collective sees everything the caller
//      queued on the compute stream before the call (e.g. the kernel that wrote its input);
//   2. launches the NCCL call on the collective's stream and records a completion event.
// The host does not wait for the device. NCCL itself runs the kernels of one communicator
// in issue order, whatever their stream, so the streams order collectives against
// compute, not against each other. The compute stream is the caller's current stream at
// the call unless NcclOptions::compute_stream fixes one.
//   Work::is_completed() queries the completion event without blocking (true also once
// the work failed; wait() then throws). Work::wait(timeout) makes the compute stream (the
// caller's current one at the wait) wait for the completion event (cudaStreamWaitEvent)
// and returns without waiting on the host, as ProcessGroupNCCL's wait does, so the host
// queues the next kernels while the collective runs; it throws if the work already
// failed, and moves the work's deadline to now + timeout if that is earlier. The host
// blocks only to bound the all-gathers in flight (NcclOptions::
// max_in_flight_all_gathers, when set) and in size checks; with NcclOptions::blocking_wait, wait()
// blocks until the collective completed. A barrier's wait() (so barrier()) always blocks
// the host until the barrier completed on the device, after the work queued on the
// compute stream before it, as dist.barrier() does (Note [A barrier that blocks the
// host] in nccl.cc). Every buffer a collective touches must be
// allocated on the compute stream (as FSDP does), so that memory freed after wait() is
// reused only by work queued behind the collective.
//   A watchdog thread per communicator polls the pending collectives' events and
// ncclCommGetAsyncError; on an error or a missed deadline (issue time + timeout) it aborts
// the NCCL communicator (ncclCommAbort, which also ends the kernels a stream would
// otherwise wait on forever; made without holding the lock that issuing and polling take,
// so a slow abort stalls neither), fails every pending work of this communicator, and marks
// the communicator broken: wait(), and any later call, throws a CommError naming the
// collective, its sequence number, this rank, the group and what NCCL (or CUDA)
// reported. Peers see the failure as an error or a timeout of their own.
//   The caller keeps inputs unchanged and outputs unread (on other streams) and every
// buffer allocated until the work completed, as with c10d.
//
// Threading: collectives of one communicator are issued from one thread at a time (see
// communicator.h); its works may be waited on or polled from any thread. Every call
// that reaches CUDA or NCCL, on any thread (a poll, a wait, the watchdog, the release of
// the last reference to a Work), makes options.device_index the current CUDA device while
// it runs and restores the caller's afterwards; the watchdog thread sets it when it
// starts. Host-side work on another thread (an asynchronous checkpoint's writes) goes
// over new_host_subgroup, a Gloo group over the same store: no NCCL call is made for it.
#ifndef FSDP_COMM_NCCL_H_
#define FSDP_COMM_NCCL_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp/comm/communicator.h"
#include "fsdp/comm/gloo.h"

namespace fsdp {

// A cudaStream_t, as void* so that this header needs no CUDA header.
using CudaStreamHandle = void*;

struct NcclOptions {
  // The CUDA device of this rank (usually LOCAL_RANK), >= 0. Every buffer must be on it.
  TORCH_ARG(int, device_index) = 0;
  // Default deadline of Work::wait() and of the blocking calls, > 0 (as GlooOptions'
  // timeout). ProcessGroupNCCL's default is 10 minutes as well.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(10);
  // The compute stream, a cudaStream_t of device_index; nullptr (the default): the
  // calling thread's current CUDA stream of device_index at each call (LibTorch's
  // c10::cuda::getCurrentCUDAStream, the legacy default stream unless the caller set
  // another), as ProcessGroupNCCL does. Collectives start after the work queued on it
  // before the call; Work::wait() orders it after the collective. See Note [NCCL streams
  // and events].
  TORCH_ARG(CudaStreamHandle, compute_stream) = nullptr;
  // Work::wait() blocks the host until the collective completed (or failed, or missed
  // its timeout), as before issue 29; false (the default): it only orders the compute
  // stream after the collective and returns, and the watchdog enforces the timeout.
  // PyTorch: TORCH_NCCL_BLOCKING_WAIT=1.
  TORCH_ARG(bool, blocking_wait) = false;
  // At most this many all-gathers in flight (issued, not complete on the device): issuing
  // one more blocks the host until the oldest completes, so the host runs at most that
  // far ahead of the device. >= 0; 0 (the default): no bound, as ProcessGroupNCCL. FSDP
  // bounds the host per unit instead, whatever a unit's number of all-gathers (Note
  // [Limiting all-gathers] in fsdp/core/internal/runtime.cc: PyTorch FSDP1's
  // limit_all_gathers).
  TORCH_ARG(int, max_in_flight_all_gathers) = 0;
  // Namespace of this communicator's keys in the store: the NCCL unique id is published
  // under "<store_prefix>/nccl_unique_id", a subgroup's under "<store_prefix>/<tag>/...".
  // Keys are never deleted: every communicator made from one store needs its own prefix.
  TORCH_ARG(std::string, store_prefix) = "fsdp/nccl";
  // How the Gloo groups of new_host_subgroup connect: their timeout and network
  // interface or host name (rendezvous.h's init_communicator passes those of its Gloo
  // communicator). PyTorch: the options of dist.new_group(backend="gloo").
  TORCH_ARG(GlooOptions, host_group_options) = {};
};

// Makes this rank's NCCL communicator of `world_size` ranks (PyTorch:
// ProcessGroupNCCL(store, rank, size)). Collective over the ranks: blocks until all of
// them called it with the same store, world_size and store_prefix. Rank 0 creates the
// NCCL unique id (ncclGetUniqueId) and publishes it through `store`; the other ranks
// wait for it in store->get (under the store's timeout). Then every rank creates a
// non-blocking NCCL communicator (ncclCommInitRankConfig, blocking = 0) on
// options.device_index and polls it until it is ready or options.timeout passed; then it
// aborts it and throws (a peer that died after the unique-id exchange cannot hang it).
// Size checks (Communicator::set_size_checks) are supported.
//
// new_subgroup() makes a new NCCL communicator among the members (same device, timeout
// and compute stream, its own streams), exchanging its unique id through the same store
// under "<store_prefix>/<tag>". Not ncclCommSplit: that is collective over every rank of
// the parent, while new_subgroup is called by the members only. new_host_subgroup()
// makes a Gloo group (make_gloo_communicator's backend, NcclOptions::host_group_options)
// over the same store under "<store_prefix>/<tag>", on CPU buffers.
//
// Destruction first waits until no collective is pending (each completes, or the watchdog
// fails it at its deadline: Work::wait() does not wait on the host, so a collective may
// still run on the device), then calls ncclCommFinalize and ncclCommDestroy, or
// ncclCommAbort if the communicator is broken (pending works then throw a CommError from
// wait()). Then it destroys the streams and events and frees the barrier buffer (cudaFree
// may wait for kernels already running on the device). None of this holds the lock
// that works polled from other threads take.
//
// Throws c10::Error if `store` is null, rank/world_size/options are out of range, the id
// cannot be exchanged (e.g. rank 0 did not publish it within the store's timeout), or a
// CUDA or NCCL setup call fails or does not finish within the timeout (no device, an
// invalid device index, ncclCommInitRankConfig); the message names the failing call.
std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::Store> store,
                                                     int rank, int world_size,
                                                     NcclOptions options = {});

// The CUDA devices this process can use (cudaGetDeviceCount, so CUDA_VISIBLE_DEVICES
// applies). 0 when there is no device or no usable driver; then `why_none`, if not null,
// receives the CUDA runtime's words, e.g. "cudaGetDeviceCount: cudaErrorNoDevice: no
// CUDA-capable device is detected" (cleared otherwise). Never throws.
int cuda_device_count(std::string* why_none = nullptr);

}  // namespace fsdp

#endif  // FSDP_COMM_NCCL_H_
