#include "fsdp/comm/internal/nccl_utils.h"

#include <atomic>
#include <cstring>
#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fsdp {
namespace comm_internal {

ncclDataType_t to_nccl_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return ncclFloat32;
    case c10::kDouble:
      return ncclFloat64;
    case c10::kHalf:
      return ncclFloat16;
    case c10::kBFloat16:
      return ncclBfloat16;
    case c10::kLong:
      return ncclInt64;
    case c10::kInt:
      return ncclInt32;
    case c10::kByte:
      return ncclUint8;
    default:
      TORCH_CHECK(false, "the nccl backend cannot move dtype ", c10::toString(dtype),
                  "; expected float32, float64, float16, bfloat16, int64, int32 or uint8");
  }
}

ncclRedOp_t to_nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp ", static_cast<int>(op));
}

const char* nccl_result_name(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      return "unknown ncclResult_t";
  }
}

std::string describe_nccl_failure(const char* call, ncclResult_t result, const char* last_error) {
  std::string message = absl::StrCat(call, " failed: ", ncclGetErrorString(result), " [",
                                     nccl_result_name(result), "]");
  if (last_error != nullptr && last_error[0] != '\0') {
    absl::StrAppend(&message, "; last NCCL error: ", last_error);
  }
  return message;
}

std::string describe_cuda_failure(const char* call, cudaError_t result) {
  return absl::StrCat(call, " failed: ", cudaGetErrorString(result), " [", cudaGetErrorName(result),
                      "]");
}

void check_nccl(ncclResult_t result, const char* call) {
  if (result == ncclSuccess || result == ncclInProgress) return;
  // ncclGetLastError ignores its argument and reports this thread's last error.
  throw NcclCallError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                      describe_nccl_failure(call, result, ncclGetLastError(nullptr)));
}

void check_cuda(cudaError_t result, const char* call) {
  if (result == cudaSuccess) return;
  throw NcclCallError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                      describe_cuda_failure(call, result));
}

std::string unique_id_key(const std::string& prefix) {
  return absl::StrCat(prefix, "/nccl_unique_id");
}

namespace {

std::vector<uint8_t> fetch_bytes(c10d::Store& store, const std::string& key, int rank) {
  try {
    return store.get(key);
  } catch (const std::exception& error) {
    TORCH_CHECK(false, "rank ", rank, " could not fetch the NCCL unique id from store key \"", key,
                "\" within the store's timeout of ", store.getTimeout().count(),
                " ms (rank 0 publishes it; is rank 0 up and using the same store and "
                "prefix?): ",
                error.what());
  }
}

}  // namespace

ncclUniqueId exchange_unique_id(c10d::Store& store, const std::string& key, int rank,
                                const std::function<ncclUniqueId()>& make_id) {
  ncclUniqueId id;
  if (rank == 0) {
    id = make_id();
    const auto* bytes = reinterpret_cast<const uint8_t*>(id.internal);
    store.set(key, std::vector<uint8_t>(bytes, bytes + sizeof(id.internal)));
    return id;
  }
  const std::vector<uint8_t> bytes = fetch_bytes(store, key, rank);
  TORCH_CHECK(bytes.size() == sizeof(id.internal), "rank ", rank, ": store key \"", key,
              "\" holds ", bytes.size(), " bytes, expected an NCCL unique id of ",
              sizeof(id.internal),
              " bytes; another program may be using the same key (set a distinct "
              "NcclOptions::store_prefix)");
  std::memcpy(id.internal, bytes.data(), bytes.size());
  return id;
}

namespace {
std::atomic<int64_t> size_check_fault{0};
}  // namespace

void inject_size_check_fault(int64_t numel_offset) { size_check_fault = numel_offset; }

int64_t take_size_check_fault() { return size_check_fault.exchange(0); }

}  // namespace comm_internal
}  // namespace fsdp
