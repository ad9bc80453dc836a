#include "fsdp/comm/internal/device_calls.h"

#include <atomic>

namespace fsdp {
namespace comm_internal {

// Note [A seam for the device calls]
// The NCCL backend's logic is host code: which thread calls what, on which device, under
// which lock, and when the host waits. Its mistakes (a watchdog that runs on the wrong
// device, an abort that holds the lock every caller needs, a barrier that returns before
// the device got there) show only in the order and place of its CUDA and NCCL calls, and
// no CI machine has a GPU. So nccl.cc makes every such call through this table, and a
// test installs a stand-in (nccl_device_calls_test.cc) that records the calling thread and
// its current device and plays the device: events that fire when the test says so, a
// collective that never completes (a hung peer), an asynchronous error (a killed one),
// an abort that takes its time. The stand-in is a pointer swap: one atomic load per
// call, no branch in the backend.
const DeviceCalls& real_device_calls() {
  static const DeviceCalls calls = {
      &::cudaGetDevice,
      &::cudaSetDevice,
      &::cudaStreamCreateWithFlags,
      &::cudaStreamDestroy,
      &::cudaStreamWaitEvent,
      &::cudaStreamSynchronize,
      &::cudaEventCreateWithFlags,
      &::cudaEventDestroy,
      &::cudaEventRecord,
      &::cudaEventQuery,
      &::cudaMalloc,
      &::cudaFree,
      &::cudaMemset,
      &::cudaMemcpyAsync,
      &::ncclGetUniqueId,
      &::ncclCommInitRankConfig,
      &::ncclCommGetAsyncError,
      &::ncclCommFinalize,
      &::ncclCommDestroy,
      &::ncclCommAbort,
      &::ncclAllGather,
      &::ncclReduceScatter,
      &::ncclAllReduce,
      &::ncclBroadcast,
  };
  return calls;
}

namespace {
std::atomic<const DeviceCalls*> installed{nullptr};  // null: the real ones
}  // namespace

const DeviceCalls& device_calls() {
  const DeviceCalls* calls = installed.load(std::memory_order_acquire);
  return calls != nullptr ? *calls : real_device_calls();
}

ScopedDeviceCalls::ScopedDeviceCalls(const DeviceCalls& calls)
    : previous_(installed.exchange(&calls, std::memory_order_acq_rel)) {}

ScopedDeviceCalls::~ScopedDeviceCalls() { installed.store(previous_, std::memory_order_release); }

}  // namespace comm_internal
}  // namespace fsdp
