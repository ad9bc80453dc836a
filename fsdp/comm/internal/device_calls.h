// The CUDA runtime and NCCL calls of the NCCL backend (nccl.cc), made through one table of
// function pointers: the real functions, or a test's stand-in for the device (see Note [A
// seam for the device calls] in device_calls.cc).
//
// Internal to fsdp/comm: this header includes <nccl.h> and <cuda_runtime_api.h>, which
// no public header may do.
#ifndef FSDP_COMM_INTERNAL_DEVICE_CALLS_H_
#define FSDP_COMM_INTERNAL_DEVICE_CALLS_H_

#include <cstddef>

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace fsdp {
namespace comm_internal {

// One member per call the backend makes, named and typed as the function it stands for.
struct DeviceCalls {
  // CUDA runtime.
  cudaError_t (*cudaGetDevice)(int* device);
  cudaError_t (*cudaSetDevice)(int device);
  cudaError_t (*cudaStreamCreateWithFlags)(cudaStream_t* stream, unsigned int flags);
  cudaError_t (*cudaStreamDestroy)(cudaStream_t stream);
  cudaError_t (*cudaStreamWaitEvent)(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
  cudaError_t (*cudaStreamSynchronize)(cudaStream_t stream);
  cudaError_t (*cudaEventCreateWithFlags)(cudaEvent_t* event, unsigned int flags);
  cudaError_t (*cudaEventDestroy)(cudaEvent_t event);
  cudaError_t (*cudaEventRecord)(cudaEvent_t event, cudaStream_t stream);
  cudaError_t (*cudaEventQuery)(cudaEvent_t event);
  cudaError_t (*cudaMalloc)(void** pointer, size_t bytes);
  cudaError_t (*cudaFree)(void* pointer);
  cudaError_t (*cudaMemset)(void* pointer, int value, size_t bytes);
  cudaError_t (*cudaMemcpyAsync)(void* to, const void* from, size_t bytes, cudaMemcpyKind kind,
                                 cudaStream_t stream);
  // NCCL.
  ncclResult_t (*ncclGetUniqueId)(ncclUniqueId* id);
  ncclResult_t (*ncclCommInitRankConfig)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                         ncclConfig_t* config);
  ncclResult_t (*ncclCommGetAsyncError)(ncclComm_t comm, ncclResult_t* state);
  ncclResult_t (*ncclCommFinalize)(ncclComm_t comm);
  ncclResult_t (*ncclCommDestroy)(ncclComm_t comm);
  ncclResult_t (*ncclCommAbort)(ncclComm_t comm);
  ncclResult_t (*ncclAllGather)(const void* send, void* receive, size_t count, ncclDataType_t type,
                                ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*ncclReduceScatter)(const void* send, void* receive, size_t count,
                                    ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                    cudaStream_t stream);
  ncclResult_t (*ncclAllReduce)(const void* send, void* receive, size_t count, ncclDataType_t type,
                                ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*ncclBroadcast)(const void* send, void* receive, size_t count, ncclDataType_t type,
                                int root, ncclComm_t comm, cudaStream_t stream);
};

// The CUDA runtime's and NCCL's own functions.
const DeviceCalls& real_device_calls();

// The table the backend calls through: real_device_calls() unless a
// ScopedDeviceCalls replaced it. Thread-safe.
const DeviceCalls& device_calls();

// Tests only: every NCCL communicator made while it lives calls `calls` (which must
// outlive them) instead of the real functions; restores the previous table when it
// goes. Make and destroy the communicators inside its scope.
class ScopedDeviceCalls {
 public:
  explicit ScopedDeviceCalls(const DeviceCalls& calls);
  ~ScopedDeviceCalls();
  ScopedDeviceCalls(const ScopedDeviceCalls&) = delete;
  ScopedDeviceCalls& operator=(const ScopedDeviceCalls&) = delete;

 private:
  const DeviceCalls* previous_;
};

}  // namespace comm_internal
}  // namespace fsdp

#endif  // FSDP_COMM_INTERNAL_DEVICE_CALLS_H_
