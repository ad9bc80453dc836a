#include "fsdp/comm/nccl.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "fsdp/comm/internal/nccl_utils.h"

namespace fsdp {
namespace comm_internal {
namespace {

// For destructors and cleanup: runs `step` (one checked call, see Note [Checking NCCL and
// CUDA results]) and turns a failure into a warning.
template <typename Step>
void best_effort(Step step) noexcept {
  try {
    step();
  } catch (const c10::Error& error) {
    try {
      TORCH_WARN("fsdp nccl backend: ", error.what_without_backtrace());
    } catch (...) {
    }
  }
}

// Makes `device` the current CUDA device for a scope and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ == device_) return;
    best_effort([&] { check_cuda(cudaSetDevice(previous_), "cudaSetDevice"); });
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

// True once every work captured by `event` ran, false while some is pending; throws
// NcclCallError if the query itself fails.
bool event_done(cudaEvent_t event) {
  const cudaError_t result = cudaEventQuery(event);
  if (result == cudaErrorNotReady) return false;
  check_cuda(result, "cudaEventQuery");
  return true;
}

// now + timeout, saturating instead of overflowing for huge timeouts.
std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = std::chrono::steady_clock::now();
  if (timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(
                     std::chrono::steady_clock::time_point::max() - now)) {
    return std::chrono::steady_clock::time_point::max();
  }
  return now + timeout;
}

// One issued collective: its completion event and outcome. Guarded by the owning
// NcclResources' mutex.
struct WorkRecord {
  WorkRecord(CollectiveKind kind, int64_t sequence) : kind(kind), sequence(sequence) {}
  ~WorkRecord() {
    if (done != nullptr)
      best_effort([&] { check_cuda(cudaEventDestroy(done), "cudaEventDestroy"); });
  }
  WorkRecord(const WorkRecord&) = delete;
  WorkRecord& operator=(const WorkRecord&) = delete;

  const CollectiveKind kind;
  const int64_t sequence;
  cudaEvent_t done = nullptr;  // recorded on the collective's stream after the NCCL call
  bool finished = false;       // `done` fired while the NCCL communicator was alive
  std::optional<CommError> error;
};

enum class WorkState { kPending, kDone, kFailed };

// Which of the communicator's streams a collective runs on. See Note [NCCL streams and
// events].
enum StreamIndex { kAllGatherStream = 0, kReduceScatterStream, kOtherStream, kNumStreams };

// The NCCL communicator and CUDA objects of one NcclCommunicator, shared with its works
// (which may outlive it). Everything is guarded by `mutex_`.
class NcclResources {
 public:
  // `rank`: in the NCCL communicator; `global_rank` and `error_group` label CommErrors
  // (Communicator::comm_error).
  NcclResources(int rank, int device, cudaStream_t compute, int global_rank,
                std::vector<int> error_group)
      : rank_(rank),
        device_(device),
        compute_(compute),
        global_rank_(global_rank),
        error_group_(std::move(error_group)) {}
  ~NcclResources() { close(); }
  NcclResources(const NcclResources&) = delete;
  NcclResources& operator=(const NcclResources&) = delete;

  // ncclCommInitRank on the current device, then the streams, the event and the barrier
  // buffer. Throws NcclCallError; close() frees whatever was made.
  void init(int world_size, const ncclUniqueId& id) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceGuard guard(device_);
    ncclComm_t comm = nullptr;
    check_nccl(ncclCommInitRank(&comm, world_size, id, rank_), "ncclCommInitRank");
    comm_ = comm;
    for (cudaStream_t& stream : streams_) {
      check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
    }
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming),
               "cudaEventCreateWithFlags");
    check_cuda(cudaMalloc(&barrier_buffer_, sizeof(float)), "cudaMalloc");
    check_cuda(cudaMemset(barrier_buffer_, 0, sizeof(float)), "cudaMemset");
  }

  // Called with every CommError that breaks the communicator (Communicator::mark_broken).
  void set_on_failure(std::function<void(const CommError&)> on_failure) {
    std::lock_guard<std::mutex> lock(mutex_);
    on_failure_ = std::move(on_failure);
  }

  float* barrier_buffer() const { return barrier_buffer_; }

  // Issues `call` on stream `which` after the compute stream's queued work and returns
  // its record; a failure is in record->error (the communicator is then aborted).
  std::shared_ptr<WorkRecord> launch(
      CollectiveKind kind, int64_t sequence, StreamIndex which, const char* call_name,
      const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& call) {
    auto record = std::make_shared<WorkRecord>(kind, sequence);
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ == nullptr) {
      set_error(*record, "the NCCL communicator was aborted or destroyed");
      return record;
    }
    forget_finished_locked();
    try {
      DeviceGuard guard(device_);
      check_cuda(cudaEventCreateWithFlags(&record->done, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags");
      check_cuda(cudaEventRecord(ready_, compute_), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(streams_[which], ready_, 0), "cudaStreamWaitEvent");
      check_nccl(call(comm_, streams_[which]), call_name);
      check_cuda(cudaEventRecord(record->done, streams_[which]), "cudaEventRecord");
      pending_.push_back(record);
    } catch (const NcclCallError& error) {
      fail_locked(*record, error.what_without_backtrace());
    }
    return record;
  }

  // Non-blocking: whether `record` completed or failed. Checks the event, then NCCL's
  // asynchronous error; an error aborts the communicator.
  WorkState poll(WorkRecord& record) {
    std::lock_guard<std::mutex> lock(mutex_);
    return poll_locked(record);
  }

  // See Note [NCCL streams and events]. Throws the record's CommError on failure or
  // timeout.
  void wait(WorkRecord& record, std::chrono::milliseconds timeout) {
    const auto deadline = deadline_after(timeout);
    auto pause = std::chrono::microseconds(10);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        const WorkState state = poll_locked(record);
        if (state == WorkState::kDone) order_compute_after_locked(record);
        if (record.error) throw *record.error;
        if (record.finished) return;
        if (std::chrono::steady_clock::now() >= deadline) {
          fail_locked(record, absl::StrCat("did not complete within ", timeout.count(),
                                           " ms (NCCL reported no error: a peer may not "
                                           "have issued it, or the compute stream did not "
                                           "reach it)"));
          throw *record.error;
        }
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  // Destroys the NCCL communicator if nothing is pending, else aborts it; frees the CUDA
  // objects. Never waits for a pending collective. Idempotent.
  void close() {
    std::lock_guard<std::mutex> lock(mutex_);
    on_failure_ = nullptr;
    if (closed_) return;
    closed_ = true;
    forget_finished_locked();
    if (!pending_.empty()) {
      abort_locked(absl::StrCat("the communicator was destroyed while ", pending_.size(),
                                " collective(s) were pending; its NCCL communicator was "
                                "aborted"));
    } else if (comm_ != nullptr) {
      best_effort([&] { check_nccl(ncclCommDestroy(comm_), "ncclCommDestroy"); });
      comm_ = nullptr;
    }
    free_cuda_objects_locked();
  }

 private:
  WorkState poll_locked(WorkRecord& record) {
    if (record.error) return WorkState::kFailed;
    if (record.finished) return WorkState::kDone;
    try {
      if (event_done(record.done)) {
        record.finished = true;
        return WorkState::kDone;
      }
      TORCH_INTERNAL_ASSERT(comm_ != nullptr, "a pending work outlived its NCCL communicator");
      ncclResult_t async_error = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_, &async_error), "ncclCommGetAsyncError");
      check_nccl(async_error, "the NCCL kernel (ncclCommGetAsyncError)");
      return WorkState::kPending;
    } catch (const NcclCallError& error) {
      fail_locked(record, error.what_without_backtrace());
      return WorkState::kFailed;
    }
  }

  // Orders the compute stream after a finished record.
  void order_compute_after_locked(WorkRecord& record) {
    try {
      DeviceGuard guard(device_);
      check_cuda(cudaStreamWaitEvent(compute_, record.done, 0), "cudaStreamWaitEvent");
    } catch (const NcclCallError& error) {
      record.finished = false;
      fail_locked(record, error.what_without_backtrace());
    }
  }

  // `record` failed: abort, fail every other pending work, break the communicator.
  void fail_locked(WorkRecord& record, const std::string& detail) {
    const bool was_alive = comm_ != nullptr;
    set_error(record,
              was_alive ? absl::StrCat(detail, "; the NCCL communicator was aborted") : detail);
    const CommError error = *record.error;
    abort_locked(absl::StrCat("aborted after an earlier failure: ", error.what()));
    if (on_failure_) on_failure_(error);
  }

  // Fails every pending record that has not finished with `reason`, then aborts the NCCL
  // communicator.
  void abort_locked(const std::string& reason) {
    forget_finished_locked();
    for (const std::shared_ptr<WorkRecord>& record : pending_) {
      if (!record->error) {
        set_error(*record, reason);
      }
    }
    pending_.clear();
    if (comm_ == nullptr) return;
    best_effort([&] { check_nccl(ncclCommAbort(comm_), "ncclCommAbort"); });
    comm_ = nullptr;
  }

  // Drops finished records from pending_ (a failed query leaves the record pending).
  void forget_finished_locked() {
    for (const std::shared_ptr<WorkRecord>& record : pending_) {
      if (!record->finished && !record->error) {
        best_effort([&] { record->finished = event_done(record->done); });
      }
    }
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [](const std::shared_ptr<WorkRecord>& record) {
                                    return record->finished || record->error;
                                  }),
                   pending_.end());
  }

  void free_cuda_objects_locked() {
    if (barrier_buffer_ == nullptr && ready_ == nullptr && streams_[0] == nullptr) return;
    std::optional<DeviceGuard> guard;
    best_effort([&] { guard.emplace(device_); });
    if (barrier_buffer_ != nullptr) {
      best_effort([&] { check_cuda(cudaFree(barrier_buffer_), "cudaFree"); });
      barrier_buffer_ = nullptr;
    }
    if (ready_ != nullptr) {
      best_effort([&] { check_cuda(cudaEventDestroy(ready_), "cudaEventDestroy"); });
      ready_ = nullptr;
    }
    for (cudaStream_t& stream : streams_) {
      if (stream == nullptr) continue;
      best_effort([&] { check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy"); });
      stream = nullptr;
    }
  }

  void set_error(WorkRecord& record, const std::string& detail) const {
    record.error.emplace(collective_name(record.kind), record.sequence, global_rank_, -1, detail,
                         error_group_);
  }

  const int rank_;
  const int device_;
  const cudaStream_t compute_;
  const int global_rank_;
  const std::vector<int> error_group_;
  std::mutex mutex_;
  ncclComm_t comm_ = nullptr;  // null once aborted or destroyed
  std::array<cudaStream_t, kNumStreams> streams_{};
  cudaEvent_t ready_ = nullptr;  // re-recorded on the compute stream for every launch
  float* barrier_buffer_ = nullptr;
  std::vector<std::shared_ptr<WorkRecord>> pending_;  // launched, not known to be done
  std::function<void(const CommError&)> on_failure_;
  bool closed_ = false;
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclResources> resources, std::shared_ptr<WorkRecord> record,
           std::chrono::milliseconds default_timeout)
      : Work(default_timeout), resources_(std::move(resources)), record_(std::move(record)) {}

  void wait(std::chrono::milliseconds timeout) override { resources_->wait(*record_, timeout); }
  bool is_completed() override { return resources_->poll(*record_) != WorkState::kPending; }

 private:
  std::shared_ptr<NcclResources> resources_;
  std::shared_ptr<WorkRecord> record_;
};

ncclUniqueId new_unique_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return id;
}

void check_options(const c10::intrusive_ptr<c10d::Store>& store, const NcclOptions& options) {
  TORCH_CHECK(store, "make_nccl_communicator: expected a c10d store, got null");
  TORCH_CHECK(options.device_index() >= 0,
              "make_nccl_communicator: NcclOptions::device_index must be >= 0, got ",
              options.device_index());
  TORCH_CHECK(options.timeout().count() > 0,
              "make_nccl_communicator: NcclOptions::timeout must be positive, got ",
              options.timeout().count(), " ms");
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                   NcclOptions options, std::vector<int> global_ranks = {})
      : Communicator(rank, world_size, options.timeout(), std::move(global_ranks)),
        store_(std::move(store)),
        options_(std::move(options)),
        resources_(std::make_shared<NcclResources>(
            rank, options_.device_index(), static_cast<cudaStream_t>(options_.compute_stream()),
            global_rank(), error_group())) {
    try {
      const ncclUniqueId id =
          exchange_unique_id(*store_, unique_id_key(options_.store_prefix()), rank, new_unique_id);
      resources_->init(world_size, id);
    } catch (const CommError&) {
      throw;  // already names the collective and ranks
    } catch (const c10::Error& error) {
      TORCH_CHECK(false, "make_nccl_communicator (rank ", rank, " of ", world_size,
                  ", cuda:", options_.device_index(), ", store prefix \"", options_.store_prefix(),
                  "\"): ", error.what_without_backtrace());
    }
    resources_->set_on_failure([this](const CommError& error) { mark_broken(error); });
  }

  ~NcclCommunicator() override { resources_->close(); }

  std::string backend_name() const override { return "nccl"; }

 protected:
  bool supports_device(const c10::Device& device) const override {
    return device.is_cuda() && (!device.has_index() || device.index() == options_.device_index());
  }

  WorkHandle do_all_gather(const CommBuffer& output, const CommBuffer& input,
                           int64_t sequence) override {
    const ncclDataType_t type = to_nccl_dtype(input.dtype);
    return launch(CollectiveKind::kAllGather, sequence, kAllGatherStream, "ncclAllGather",
                  [&](ncclComm_t comm, cudaStream_t stream) {
                    return ncclAllGather(input.data, output.data, static_cast<size_t>(input.numel),
                                         type, comm, stream);
                  });
  }

  WorkHandle do_reduce_scatter(const CommBuffer& output, const CommBuffer& input, ReduceOp op,
                               int64_t sequence) override {
    const ncclDataType_t type = to_nccl_dtype(input.dtype);
    const ncclRedOp_t nccl_op = to_nccl_op(op);
    return launch(CollectiveKind::kReduceScatter, sequence, kReduceScatterStream,
                  "ncclReduceScatter", [&](ncclComm_t comm, cudaStream_t stream) {
                    return ncclReduceScatter(input.data, output.data,
                                             static_cast<size_t>(output.numel), type, nccl_op, comm,
                                             stream);
                  });
  }

  WorkHandle do_all_reduce(const CommBuffer& tensor, ReduceOp op, int64_t sequence) override {
    const ncclDataType_t type = to_nccl_dtype(tensor.dtype);
    const ncclRedOp_t nccl_op = to_nccl_op(op);
    return launch(CollectiveKind::kAllReduce, sequence, kOtherStream, "ncclAllReduce",
                  [&](ncclComm_t comm, cudaStream_t stream) {
                    return ncclAllReduce(tensor.data, tensor.data,
                                         static_cast<size_t>(tensor.numel), type, nccl_op, comm,
                                         stream);
                  });
  }

  WorkHandle do_broadcast(const CommBuffer& tensor, int root, int64_t sequence) override {
    const ncclDataType_t type = to_nccl_dtype(tensor.dtype);
    return launch(CollectiveKind::kBroadcast, sequence, kOtherStream, "ncclBroadcast",
                  [&](ncclComm_t comm, cudaStream_t stream) {
                    return ncclBroadcast(tensor.data, tensor.data,
                                         static_cast<size_t>(tensor.numel), type, root, comm,
                                         stream);
                  });
  }

  // A one-element float all-reduce on a device buffer allocated at init: its completion
  // on this rank implies that every rank entered the barrier.
  WorkHandle do_barrier(int64_t sequence) override {
    float* buffer = resources_->barrier_buffer();
    return launch(CollectiveKind::kBarrier, sequence, kOtherStream, "ncclAllReduce",
                  [&](ncclComm_t comm, cudaStream_t stream) {
                    return ncclAllReduce(buffer, buffer, 1, ncclFloat32, ncclSum, comm, stream);
                  });
  }

  std::shared_ptr<Communicator> do_new_subgroup(const SubgroupSpec& spec) override {
    NcclOptions options = options_;
    options.store_prefix(absl::StrCat(options_.store_prefix(), "/", spec.tag));
    return std::make_shared<NcclCommunicator>(store_, spec.rank,
                                              static_cast<int>(spec.ranks.size()),
                                              std::move(options), spec.global_ranks);
  }

 private:
  WorkHandle launch(CollectiveKind kind, int64_t sequence, StreamIndex which, const char* call_name,
                    const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& call) {
    return std::make_shared<NcclWork>(
        resources_, resources_->launch(kind, sequence, which, call_name, call), timeout());
  }

  c10::intrusive_ptr<c10d::Store> store_;
  NcclOptions options_;
  std::shared_ptr<NcclResources> resources_;
};

}  // namespace
}  // namespace comm_internal

std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::Store> store,
                                                     int rank, int world_size,
                                                     NcclOptions options) {
  comm_internal::check_options(store, options);
  return std::make_shared<comm_internal::NcclCommunicator>(std::move(store), rank, world_size,
                                                           std::move(options));
}

int cuda_device_count(std::string* why_none) {
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  std::string why;
  if (result != cudaSuccess) {
    why = absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorName(result), ": ",
                       cudaGetErrorString(result));
    count = 0;
    cudaGetLastError();  // reset the runtime's last error (this one is not sticky)
  } else if (count == 0) {
    why = "cudaGetDeviceCount found 0 devices";
  }
  if (why_none != nullptr) *why_none = why;
  return count;
}

}  // namespace fsdp
