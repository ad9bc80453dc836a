// Host-side helpers of the NCCL backend (nccl.h), kept apart so that they can be tested
// without a GPU: dtype and op mapping, the one place NCCL and CUDA results are checked,
// and the exchange of the NCCL unique id through a c10d store.
//
// Internal to fsdp/comm: this header includes <nccl.h> and <cuda_runtime_api.h>, which
// no public header may do.
#ifndef FSDP_COMM_INTERNAL_NCCL_UTILS_H_
#define FSDP_COMM_INTERNAL_NCCL_UTILS_H_

#include <cstdint>
#include <functional>
#include <string>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp/comm/communicator.h"

namespace fsdp {
namespace comm_internal {

// float32, float64, float16, bfloat16, int64, int32, uint8 -> the NCCL type of the same
// width. Throws c10::Error for any other dtype.
ncclDataType_t to_nccl_dtype(c10::ScalarType dtype);

// kSum -> ncclSum, kAvg -> ncclAvg.
ncclRedOp_t to_nccl_op(ReduceOp op);

// "ncclSystemError", "ncclInvalidUsage", ... ("unknown ncclResult_t" otherwise).
const char* nccl_result_name(ncclResult_t result);

// Note [Checking NCCL and CUDA results]
// Every NCCL and CUDA call of the backend passes its result to check_nccl or check_cuda,
// and nowhere else is a result looked at. A failure becomes one NcclCallError (a
// c10::Error) whose message names the call and says what NCCL or CUDA reported:
//
//   ncclAllGather failed: unhandled system error (run with NCCL_DEBUG=INFO for details)
//   [ncclSystemError]; last NCCL error: socket closed by peer
//
// Setup code (make_nccl_communicator, new_subgroup) lets it propagate as the c10::Error
// it is; collectives catch it, abort the NCCL communicator, mark the Communicator broken
// and report it as a CommError (see Note [Communication errors]).
class NcclCallError : public c10::Error {
 public:
  using c10::Error::Error;
};

// The message of a failed NCCL call: "<call> failed: <ncclGetErrorString> [<code name>]",
// then "; last NCCL error: <last_error>" when last_error is neither null nor empty.
std::string describe_nccl_failure(const char* call, ncclResult_t result, const char* last_error);

// The message of a failed CUDA runtime call: "<call> failed: <cudaGetErrorString>
// [<cudaGetErrorName>]".
std::string describe_cuda_failure(const char* call, cudaError_t result);

// Throw NcclCallError (with ncclGetLastError's text for NCCL) unless the call succeeded.
// ncclInProgress counts as success: it only means "not finished yet" (non-blocking
// communicators), never a failure.
void check_nccl(ncclResult_t result, const char* call);
void check_cuda(cudaError_t result, const char* call);

// The store key of a communicator's unique id: "<prefix>/nccl_unique_id". Subgroups use
// "<parent prefix>/<tag>" as their prefix, so every communicator has its own key.
std::string unique_id_key(const std::string& prefix);

// The unique id of the communicator whose store key is `key`. The root (rank 0 of that
// communicator) calls `make_id` and publishes the 128 bytes under `key`; every other
// rank blocks in store.get(key) (the store's own timeout applies) and checks the size.
// All ranks return identical bytes. Throws c10::Error naming the key and the rank if the
// id cannot be fetched or has the wrong size; make_id's errors propagate.
ncclUniqueId exchange_unique_id(c10d::Store& store, const std::string& key, int rank,
                                const std::function<ncclUniqueId()>& make_id);

// Fault injection for tests (nccl_test.cc): the next size check of this process
// publishes numel + `numel_offset` as its element count, as a rank running another
// collective would (see Note [NCCL size checks] in nccl.cc). take_size_check_fault()
// returns the offset and clears it (0: none). Thread-safe.
void inject_size_check_fault(int64_t numel_offset);
int64_t take_size_check_fault();

}  // namespace comm_internal
}  // namespace fsdp

#endif  // FSDP_COMM_INTERNAL_NCCL_UTILS_H_
