#include "fsdp/comm/nccl.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "fsdp/comm/internal/device_calls.h"
#include "fsdp/comm/internal/gloo_group.h"
#include "fsdp/comm/internal/nccl_utils.h"
#include "fsdp/comm/internal/size_checks.h"

namespace fsdp {
namespace comm_internal {
namespace {

// Every CUDA and NCCL call below goes through this table. See Note [A seam for the device
// calls] in internal/device_calls.cc.
const DeviceCalls& api() { return device_calls(); }

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

// Makes `device` the current CUDA device for a scope and restores the caller's. See Note
// [Every call on the communicator's device].
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    check_cuda(api().cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device_) check_cuda(api().cudaSetDevice(device_), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ == device_) return;
    best_effort([&] { check_cuda(api().cudaSetDevice(previous_), "cudaSetDevice"); });
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
  const cudaError_t result = api().cudaEventQuery(event);
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

// Note [Non-blocking NCCL calls]
// Communicators are created non-blocking (ncclConfig_t::blocking = 0), so that creation
// has a deadline: ncclCommInitRankConfig returns at once with ncclInProgress, and the
// communicator's state, read with ncclCommGetAsyncError, stays ncclInProgress until every
// rank joined. A peer that died after the unique-id exchange leaves it there forever; we
// poll it until NcclOptions::timeout and then abort the communicator (ncclCommAbort, as
// ProcessGroupNCCL does with TORCH_NCCL_USE_COMM_NONBLOCKING). On a non-blocking
// communicator any NCCL call may return ncclInProgress (a collective still being
// enqueued, e.g. while NCCL connects peers lazily), and the next call on it, or an event
// recorded after it, may come only once the state left ncclInProgress: settle() polls it
// under the same deadline. The host waits there for the enqueue, never for the kernels.
ncclResult_t settle(ncclComm_t comm, ncclResult_t result,
                    std::chrono::steady_clock::time_point deadline) {
  auto pause = std::chrono::microseconds(10);
  while (result == ncclInProgress) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = api().ncclCommGetAsyncError(comm, &state);
    if (query != ncclSuccess) return query;
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() >= deadline) return ncclInProgress;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  return result;
}

// check_nccl for a settled call: ncclInProgress here means the deadline passed.
void check_settled(ncclResult_t result, const char* call, std::chrono::milliseconds timeout) {
  if (result == ncclInProgress) {
    throw NcclCallError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                        absl::StrCat(call, " did not finish within ", timeout.count(),
                                     " ms (the NCCL communicator stayed ncclInProgress: a "
                                     "peer may have died or not joined)"));
  }
  check_nccl(result, call);
}

// Note [The compute stream]
// The stream a collective is ordered against: NcclOptions::compute_stream when given,
// else the calling thread's current CUDA stream of the communicator's device at the time
// of the call (c10's, as at::cuda::CUDAStreamGuard and the autograd engine set it; the
// legacy default stream unless one was set), which is where FSDP queues its casts and
// copies. Read through c10's device-guard registry, which LibTorch's CUDA half fills when
// it is loaded; without it no thread can have set a current stream, and the legacy
// default stream is the current one.
cudaStream_t compute_stream_of(cudaStream_t fixed, int device) {
  if (fixed != nullptr) return fixed;
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) return nullptr;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::kCUDA);
  return static_cast<cudaStream_t>(
      cuda->getStreamNativeHandle(cuda->getStream(c10::Device(c10::kCUDA, device))));
}

// How often the watchdog looks at the pending collectives. See Note [The NCCL watchdog].
constexpr auto kWatchdogPeriod = std::chrono::milliseconds(2);

// One issued collective: its completion event and outcome. Guarded by the owning
// NcclResources' mutex.
struct WorkRecord {
  WorkRecord(CollectiveKind kind, int64_t sequence, int device)
      : kind(kind), sequence(sequence), device(device) {}
  ~WorkRecord() {
    if (done == nullptr) return;
    // Whichever thread drops the last reference. See Note [Every call on the
    // communicator's device].
    best_effort([&] {
      DeviceGuard guard(device);
      check_cuda(api().cudaEventDestroy(done), "cudaEventDestroy");
    });
  }
  WorkRecord(const WorkRecord&) = delete;
  WorkRecord& operator=(const WorkRecord&) = delete;

  const CollectiveKind kind;
  const int64_t sequence;
  const int device;  // the communicator's, which owns `done`
  // Past it, the watchdog fails the work (issue time + timeout; wait(timeout) may move it
  // earlier).
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::chrono::milliseconds timeout{0};  // what `deadline` was set from, for the message
  cudaEvent_t done = nullptr;            // recorded on the collective's stream after the NCCL call
  bool finished = false;                 // `done` fired while the NCCL communicator was alive
  std::optional<CommError> error;
};

enum class WorkState { kPending, kDone, kFailed };

// Which of the communicator's streams a collective runs on. See Note [NCCL streams and
// events].
enum StreamIndex { kAllGatherStream = 0, kReduceScatterStream, kOtherStream, kNumStreams };

// Note [The NCCL watchdog]
// Each communicator has a thread that, while collectives are pending, looks at them every
// kWatchdogPeriod: it queries their completion events, reads ncclCommGetAsyncError, and
// checks each one's deadline (issue time + NcclOptions::timeout, or earlier through
// wait(timeout)). An asynchronous error or an expired deadline aborts the NCCL
// communicator (which ends its kernels, so no stream stays blocked behind a collective
// whose peer is gone), fails every pending work with a CommError naming the collective,
// this rank and the group, and marks the Communicator broken (Communicator::mark_broken),
// so that the next call or wait() on it throws. That happens on every survivor within its
// timeout, whether or not the host is waiting for a collective: without blocking_wait the
// host does not wait for collectives at all. PyTorch: ProcessGroupNCCL's watchdog thread
// (ncclCommWatchdog) with TORCH_NCCL_ASYNC_ERROR_HANDLING, which aborts the communicator;
// it also tears down the process, which we leave to the caller, who gets the CommError.
// The thread sleeps on a condition variable while nothing is pending. Every NCCL and CUDA
// call of a communicator that uses its NCCL communicator, the watchdog's included, is
// made under its mutex; the abort is not (Note [Aborting outside the lock]). The thread
// makes its rank's device current before anything else (Note [Every call on the
// communicator's device]).
//
// Note [Every call on the communicator's device]
// The CUDA runtime binds a thread to a device: its first call that needs a context makes
// the primary context of the thread's current device, which is device 0 on a new thread.
// A watchdog that queried events from a thread with no device set would put a context
// (hundreds of MB) on GPU 0 for every rank of the node, and so would any thread that
// polls or waits on a Work, or drops the last reference to one (its event is destroyed
// there). So every path that calls CUDA or NCCL makes the communicator's device current
// first and restores the caller's afterwards (DeviceGuard), and the watchdog sets it once
// when it starts (cudaSetDevice, as ProcessGroupNCCL's watchdog does with
// c10::cuda::set_device). nccl_device_calls_test.cc checks it: every call on a stream,
// event or NCCL communicator is made with that object's device current.
//
// Note [Aborting outside the lock]
// ncclCommAbort can block: it stops NCCL's proxy threads and waits for the communicator's
// kernels to end, which, with a peer hung or gone, may take seconds. Every issuing call,
// every poll of a Work and the watchdog take the communicator's mutex, so an abort made
// under it would stall them all (a training thread that only asked is_completed(), or
// its next collective, which should fail at once). So the mutex only detaches the NCCL
// communicator: under it, whichever thread saw the failure fails every pending work and
// moves the handle from `comm_` to `detached_` (every thread checks `comm_` under the
// mutex before using the handle, so none uses it from then on, and each finds the
// communicator aborted), and wakes the watchdog, which takes the detached handle and
// calls ncclCommAbort with the mutex released. The thread that saw the failure returns
// at once (a Work's wait() throws the CommError). If the watchdog is gone (close()),
// close() aborts what is left the same way; a creation that fails aborts before anyone
// else knows the communicator. Destruction likewise calls ncclCommFinalize and
// ncclCommDestroy, and frees the streams, events and buffers, after releasing the mutex
// (cudaFree may wait for the device). PyTorch: ProcessGroupNCCL's watchdog aborts the
// communicators of a failed work, without the lock its collectives take.

// The NCCL communicator and CUDA objects of one NcclCommunicator, shared with its works
// (which may outlive it). Everything is guarded by `mutex_`.
class NcclResources {
 public:
  // `rank`: in the NCCL communicator; `global_rank` and `error_group` label CommErrors
  // (Communicator::comm_error). `compute`: NcclOptions::compute_stream (nullptr: the
  // caller's current stream, Note [The compute stream]).
  NcclResources(int rank, int device, cudaStream_t compute, std::chrono::milliseconds timeout,
                int global_rank, std::vector<int> error_group)
      : rank_(rank),
        device_(device),
        compute_(compute),
        timeout_(timeout),
        global_rank_(global_rank),
        error_group_(std::move(error_group)) {}
  ~NcclResources() { close(); }
  NcclResources(const NcclResources&) = delete;
  NcclResources& operator=(const NcclResources&) = delete;

  // ncclCommInitRankConfig (non-blocking, Note [Non-blocking NCCL calls]) on the device,
  // polled until the timeout, then the streams, the event, the barrier and size-check
  // buffers, and the watchdog. Throws NcclCallError; a communicator that did not finish
  // in time is aborted, and close() frees whatever was made.
  void init(int world_size, const ncclUniqueId& id) {
    DeviceGuard device(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t started =
        api().ncclCommInitRankConfig(&comm, world_size, id, rank_, &config);
    if (comm == nullptr) check_nccl(started, "ncclCommInitRankConfig");
    comm_ = comm;  // from here on close() destroys it
    try {
      check_settled(settle(comm, started, deadline_after(timeout_)), "ncclCommInitRankConfig",
                    timeout_);
    } catch (const NcclCallError&) {
      // No other thread knows this communicator yet: nothing waits for the mutex.
      comm_ = nullptr;
      abort(comm);
      throw;
    }
    for (cudaStream_t& stream : cuda_.streams) {
      check_cuda(api().cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
    }
    check_cuda(api().cudaEventCreateWithFlags(&cuda_.ready, cudaEventDisableTiming),
               "cudaEventCreateWithFlags");
    check_cuda(api().cudaMalloc(reinterpret_cast<void**>(&cuda_.barrier_buffer), sizeof(float)),
               "cudaMalloc");
    check_cuda(api().cudaMemset(cuda_.barrier_buffer, 0, sizeof(float)), "cudaMemset");
    const size_t check_bytes = sizeof(int64_t) * 2 * static_cast<size_t>(world_size + 1);
    check_cuda(api().cudaMalloc(reinterpret_cast<void**>(&cuda_.size_check_buffer), check_bytes),
               "cudaMalloc");
    watchdog_ = std::thread([this] { watch(); });
  }

  // Called with every CommError that breaks the communicator (Communicator::mark_broken).
  void set_on_failure(std::function<void(const CommError&)> on_failure) {
    std::lock_guard<std::mutex> lock(mutex_);
    on_failure_ = std::move(on_failure);
  }

  float* barrier_buffer() const { return cuda_.barrier_buffer; }

  // Issues `call` on stream `which` (after the compute stream's queued work when
  // `after_compute`) and returns its record, watched from now on with the deadline
  // now + timeout; a failure is in record->error (the communicator is then aborted).
  std::shared_ptr<WorkRecord> launch(
      CollectiveKind kind, int64_t sequence, StreamIndex which, const char* call_name,
      const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& call,
      bool after_compute = true) {
    auto record = std::make_shared<WorkRecord>(kind, sequence, device_);
    record->timeout = timeout_;
    record->deadline = deadline_after(timeout_);
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ == nullptr) {
      set_error(*record, "the NCCL communicator was aborted or destroyed");
      return record;
    }
    try {
      DeviceGuard device(device_);
      forget_finished_locked();
      const cudaStream_t stream = cuda_.streams[which];
      check_cuda(api().cudaEventCreateWithFlags(&record->done, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags");
      if (after_compute) {
        check_cuda(api().cudaEventRecord(cuda_.ready, compute_stream_of(compute_, device_)),
                   "cudaEventRecord");
        check_cuda(api().cudaStreamWaitEvent(stream, cuda_.ready, 0), "cudaStreamWaitEvent");
      }
      check_settled(settle(comm_, call(comm_, stream), record->deadline), call_name, timeout_);
      check_cuda(api().cudaEventRecord(record->done, stream), "cudaEventRecord");
      pending_.push_back(record);
    } catch (const NcclCallError& error) {
      fail_locked(*record, error.what_without_backtrace());
    }
    watch_.notify_all();
    return record;
  }

  // Blocks the host while `limit` or more collectives of `kind` are pending (issued, not
  // known to be complete), so that at most `limit` are in flight once the caller issues
  // the next one (NcclOptions::max_in_flight_all_gathers). The watchdog ends the wait on a
  // failure or an expired deadline (the pending works are then failed). limit 0: no bound.
  void wait_for_slot(CollectiveKind kind, int limit) {
    if (limit <= 0) return;
    auto pause = std::chrono::microseconds(10);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        forget_finished_locked();
        const auto in_flight = std::count_if(
            pending_.begin(), pending_.end(),
            [&](const std::shared_ptr<WorkRecord>& record) { return record->kind == kind; });
        if (in_flight < limit) return;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  // The size check of collective `sequence` (see Note [NCCL size checks]): all-gathers
  // every rank's (kind, numel) on the other stream, waits for it on the host (deadline:
  // the timeout) and copies the records back. Returns a failed record when the check
  // fails or finds ranks that disagree (the communicator is then aborted), else nullptr.
  std::shared_ptr<WorkRecord> check_sizes(CollectiveKind kind, int64_t sequence, int64_t numel,
                                          const std::vector<int>& global_ranks,
                                          int64_t published_numel) {
    const int64_t mine[2] = {static_cast<int64_t>(kind), published_numel};
    int64_t* buffer = cuda_.size_check_buffer;
    std::shared_ptr<WorkRecord> gathered = launch(
        kind, sequence, kOtherStream, "ncclAllGather (size check)",
        [&](ncclComm_t comm, cudaStream_t stream) {
          check_cuda(
              api().cudaMemcpyAsync(buffer, mine, sizeof(mine), cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync");
          return api().ncclAllGather(buffer, buffer + 2, 2, ncclInt64, comm, stream);
        },
        /*after_compute=*/false);
    try {
      wait(*gathered, timeout_, /*blocking=*/true);
    } catch (const CommError&) {
      return gathered;
    }
    std::vector<int64_t> records(2 * global_ranks.size());
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      DeviceGuard device(device_);
      const cudaStream_t stream = cuda_.streams[kOtherStream];
      check_cuda(api().cudaMemcpyAsync(records.data(), buffer + 2, records.size() * sizeof(int64_t),
                                       cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpyAsync");
      check_cuda(api().cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    } catch (const NcclCallError& error) {
      fail_locked(*gathered, error.what_without_backtrace());
      return gathered;
    }
    const std::string mismatch =
        describe_mismatched_collectives(records.data(), global_ranks, kind, numel);
    if (mismatch.empty()) return nullptr;
    fail_locked(*gathered, absl::StrCat("size check: ", mismatch));
    return gathered;
  }

  // Non-blocking: whether `record` completed or failed. Checks the event, then NCCL's
  // asynchronous error; an error aborts the communicator.
  WorkState poll(WorkRecord& record) {
    std::lock_guard<std::mutex> lock(mutex_);
    return poll_locked(record);
  }

  // See Note [NCCL streams and events]. `blocking`: the host waits until the record
  // completed, failed or missed `timeout` (NcclOptions::blocking_wait, and every
  // barrier: Note [A barrier that blocks the host]); otherwise the compute stream waits
  // for its completion event and the watchdog enforces the deadline, moved to now +
  // timeout if that is earlier. Throws the record's CommError once it failed.
  void wait(WorkRecord& record, std::chrono::milliseconds timeout, bool blocking) {
    if (!blocking) {
      std::lock_guard<std::mutex> lock(mutex_);
      const WorkState state = poll_locked(record);
      if (record.error) throw *record.error;
      if (state == WorkState::kPending) {
        const auto deadline = deadline_after(timeout);
        if (deadline < record.deadline) {
          record.deadline = deadline;
          record.timeout = timeout;
        }
      }
      order_compute_after_locked(record);
      if (record.error) throw *record.error;
      return;
    }
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
          fail_locked(record, timed_out(timeout));
          throw *record.error;
        }
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  // Waits until no collective is pending (each completes, or the watchdog fails it at its
  // deadline), stops the watchdog, then, outside the mutex (Note [Aborting outside the
  // lock]), aborts the NCCL communicator if it failed or something is still pending, else
  // destroys it, and frees the CUDA objects. Idempotent.
  void close() {
    drain();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      on_failure_ = nullptr;
      if (closed_) return;
      closed_ = true;
    }
    watch_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    ncclComm_t detached = nullptr;
    ncclComm_t comm = nullptr;
    CudaObjects cuda;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      forget_finished_locked();
      if (!pending_.empty()) {
        abort_locked(absl::StrCat("the communicator was destroyed while ", pending_.size(),
                                  " collective(s) were pending; its NCCL communicator was "
                                  "aborted"));
      }
      detached = std::exchange(detached_, nullptr);
      comm = std::exchange(comm_, nullptr);
      cuda = std::exchange(cuda_, CudaObjects());
    }
    if (detached != nullptr) abort(detached);
    if (comm != nullptr) destroy(comm);
    free_cuda_objects(cuda);
  }

 private:
  // The CUDA objects a communicator owns (made by init, freed by close).
  struct CudaObjects {
    std::array<cudaStream_t, kNumStreams> streams{};
    cudaEvent_t ready = nullptr;  // re-recorded on the compute stream for every launch
    float* barrier_buffer = nullptr;
    int64_t* size_check_buffer = nullptr;  // this rank's record, then every rank's
  };

  // Returns once nothing is pending: without host waits a collective that was waited for
  // may still run on the device when its communicator goes, and aborting would cut it
  // short. Bounded by the deadlines the watchdog enforces.
  void drain() {
    auto pause = std::chrono::microseconds(10);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (closed_ || !watchdog_.joinable()) return;
        forget_finished_locked();
        if (pending_.empty()) return;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  static std::string timed_out(std::chrono::milliseconds timeout) {
    return absl::StrCat("did not complete within ", timeout.count(),
                        " ms (NCCL reported no error: a peer may not have issued it, or the "
                        "compute stream did not reach it)");
  }

  // See Note [The NCCL watchdog] and Note [Aborting outside the lock].
  void watch() {
    // See Note [Every call on the communicator's device]: before any other CUDA call.
    best_effort([&] { check_cuda(api().cudaSetDevice(device_), "cudaSetDevice"); });
    std::unique_lock<std::mutex> lock(mutex_);
    while (!closed_) {
      if (detached_ != nullptr) {
        const ncclComm_t comm = std::exchange(detached_, nullptr);
        lock.unlock();
        abort(comm);
        lock.lock();
        continue;
      }
      if (pending_.empty()) {
        watch_.wait(lock, [&] { return closed_ || !pending_.empty() || detached_ != nullptr; });
        continue;
      }
      check_pending_locked();
      if (detached_ == nullptr) watch_.wait_for(lock, kWatchdogPeriod);
    }
  }

  // One look of the watchdog at the pending works: the first that failed or is past its
  // deadline fails them all (fail_locked aborts the communicator).
  void check_pending_locked() {
    forget_finished_locked();
    const auto now = std::chrono::steady_clock::now();
    // A copy: failing a record clears pending_ (abort_locked).
    const std::vector<std::shared_ptr<WorkRecord>> pending = pending_;
    for (const std::shared_ptr<WorkRecord>& record : pending) {
      if (poll_locked(*record) == WorkState::kFailed) return;  // failed them all
      if (now >= record->deadline) {
        fail_locked(*record, timed_out(record->timeout));
        return;
      }
    }
  }

  WorkState poll_locked(WorkRecord& record) {
    if (record.error) return WorkState::kFailed;
    if (record.finished) return WorkState::kDone;
    try {
      DeviceGuard device(device_);
      if (event_done(record.done)) {
        record.finished = true;
        return WorkState::kDone;
      }
      TORCH_INTERNAL_ASSERT(comm_ != nullptr, "a pending work outlived its NCCL communicator");
      ncclResult_t async_error = ncclSuccess;
      check_nccl(api().ncclCommGetAsyncError(comm_, &async_error), "ncclCommGetAsyncError");
      check_nccl(async_error, "the NCCL kernel (ncclCommGetAsyncError)");
      return WorkState::kPending;
    } catch (const NcclCallError& error) {
      fail_locked(record, error.what_without_backtrace());
      return WorkState::kFailed;
    }
  }

  // Orders the caller's compute stream after `record` (a no-op on the device once it
  // completed).
  void order_compute_after_locked(WorkRecord& record) {
    try {
      DeviceGuard device(device_);
      check_cuda(api().cudaStreamWaitEvent(compute_stream_of(compute_, device_), record.done, 0),
                 "cudaStreamWaitEvent");
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

  // Fails every pending record that has not finished with `reason`, and detaches the NCCL
  // communicator for the watchdog to abort without the mutex (Note [Aborting outside the
  // lock]).
  void abort_locked(const std::string& reason) {
    forget_finished_locked();
    for (const std::shared_ptr<WorkRecord>& record : pending_) {
      if (!record->error) {
        set_error(*record, reason);
      }
    }
    pending_.clear();
    if (comm_ == nullptr) return;
    TORCH_INTERNAL_ASSERT(detached_ == nullptr, "two NCCL communicators detached at once");
    detached_ = std::exchange(comm_, nullptr);
    watch_.notify_all();
  }

  // Drops finished records from pending_ (a failed query leaves the record pending).
  void forget_finished_locked() {
    best_effort([&] {
      DeviceGuard device(device_);
      for (const std::shared_ptr<WorkRecord>& record : pending_) {
        if (!record->finished && !record->error) record->finished = event_done(record->done);
      }
    });
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [](const std::shared_ptr<WorkRecord>& record) {
                                    return record->finished || record->error;
                                  }),
                   pending_.end());
  }

  // Without the mutex: ncclCommAbort on a detached communicator.
  void abort(ncclComm_t comm) const noexcept {
    best_effort([&] {
      DeviceGuard device(device_);
      check_nccl(api().ncclCommAbort(comm), "ncclCommAbort");
    });
  }

  // Without the mutex: ncclCommFinalize (non-blocking: settled under the timeout), then
  // ncclCommDestroy; ncclCommAbort if finalizing fails or does not finish in time.
  void destroy(ncclComm_t comm) const noexcept {
    ncclResult_t finalized = ncclInternalError;
    best_effort([&] {
      DeviceGuard device(device_);
      finalized = settle(comm, api().ncclCommFinalize(comm), deadline_after(timeout_));
      if (finalized == ncclSuccess) check_nccl(api().ncclCommDestroy(comm), "ncclCommDestroy");
    });
    if (finalized != ncclSuccess) abort(comm);
  }

  // Without the mutex: nothing uses them any more.
  void free_cuda_objects(CudaObjects& cuda) const noexcept {
    if (cuda.barrier_buffer == nullptr && cuda.ready == nullptr && cuda.streams[0] == nullptr) {
      return;
    }
    std::optional<DeviceGuard> guard;
    best_effort([&] { guard.emplace(device_); });
    if (cuda.barrier_buffer != nullptr) {
      best_effort([&] { check_cuda(api().cudaFree(cuda.barrier_buffer), "cudaFree"); });
    }
    if (cuda.size_check_buffer != nullptr) {
      best_effort([&] { check_cuda(api().cudaFree(cuda.size_check_buffer), "cudaFree"); });
    }
    if (cuda.ready != nullptr) {
      best_effort([&] { check_cuda(api().cudaEventDestroy(cuda.ready), "cudaEventDestroy"); });
    }
    for (cudaStream_t stream : cuda.streams) {
      if (stream == nullptr) continue;
      best_effort([&] { check_cuda(api().cudaStreamDestroy(stream), "cudaStreamDestroy"); });
    }
  }

  void set_error(WorkRecord& record, const std::string& detail) const {
    record.error.emplace(collective_name(record.kind), record.sequence, global_rank_, -1, detail,
                         error_group_);
  }

  const int rank_;
  const int device_;
  const cudaStream_t compute_;  // nullptr: the caller's current stream
  const std::chrono::milliseconds timeout_;
  const int global_rank_;
  const std::vector<int> error_group_;
  std::mutex mutex_;
  std::condition_variable watch_;  // wakes the watchdog: a launch, a detach, or close()
  ncclComm_t comm_ = nullptr;      // null once detached (aborted) or destroyed
  ncclComm_t detached_ = nullptr;  // failed: the watchdog (or close()) aborts it
  CudaObjects cuda_;
  std::vector<std::shared_ptr<WorkRecord>> pending_;  // launched, not known to be done
  std::function<void(const CommError&)> on_failure_;
  bool closed_ = false;
  std::thread watchdog_;  // See Note [The NCCL watchdog]
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclResources> resources, std::shared_ptr<WorkRecord> record,
           std::chrono::milliseconds default_timeout, bool blocking)
      : Work(default_timeout),
        resources_(std::move(resources)),
        record_(std::move(record)),
        blocking_(blocking) {}

  void wait(std::chrono::milliseconds timeout) override {
    resources_->wait(*record_, timeout, blocking_);
  }
  bool is_completed() override { return resources_->poll(*record_) != WorkState::kPending; }

 private:
  std::shared_ptr<NcclResources> resources_;
  std::shared_ptr<WorkRecord> record_;
  const bool blocking_;
};

ncclUniqueId new_unique_id() {
  ncclUniqueId id;
  check_nccl(api().ncclGetUniqueId(&id), "ncclGetUniqueId");
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
  TORCH_CHECK(options.max_in_flight_all_gathers() >= 0,
              "make_nccl_communicator: NcclOptions::max_in_flight_all_gathers must be >= 0 (0: "
              "no bound), got ",
              options.max_in_flight_all_gathers());
}

class NcclCommunicator : public Communicator {
 public:
  // `size_checks`: shared by a root communicator and its subgroups (see
  // Communicator::set_size_checks); null for a root, which makes it.
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                   NcclOptions options, std::vector<int> global_ranks = {},
                   std::shared_ptr<std::atomic<bool>> size_checks = nullptr)
      : Communicator(rank, world_size, options.timeout(), std::move(global_ranks)),
        store_(std::move(store)),
        options_(std::move(options)),
        size_checks_(size_checks ? std::move(size_checks)
                                 : std::make_shared<std::atomic<bool>>(false)),
        resources_(std::make_shared<NcclResources>(
            rank, options_.device_index(), static_cast<cudaStream_t>(options_.compute_stream()),
            options_.timeout(), global_rank(), error_group())) {
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

  // See Communicator::set_size_checks and Note [NCCL size checks].
  void set_size_checks(bool enabled) override { *size_checks_ = enabled; }

 protected:
  bool supports_device(const c10::Device& device) const override {
    return device.is_cuda() && (!device.has_index() || device.index() == options_.device_index());
  }

  WorkHandle do_all_gather(const CommBuffer& output, const CommBuffer& input,
                           int64_t sequence) override {
    const ncclDataType_t type = to_nccl_dtype(input.dtype);
    return launch(CollectiveKind::kAllGather, sequence, input.numel, kAllGatherStream,
                  "ncclAllGather", [&](ncclComm_t comm, cudaStream_t stream) {
                    return api().ncclAllGather(input.data, output.data,
                                               static_cast<size_t>(input.numel), type, comm,
                                               stream);
                  });
  }

  WorkHandle do_reduce_scatter(const CommBuffer& output, const CommBuffer& input, ReduceOp op,
                               int64_t sequence) override {
    const ncclDataType_t type = to_nccl_dtype(input.dtype);
    const ncclRedOp_t nccl_op = to_nccl_op(op);
    return launch(CollectiveKind::kReduceScatter, sequence, input.numel, kReduceScatterStream,
                  "ncclReduceScatter", [&](ncclComm_t comm, cudaStream_t stream) {
                    return api().ncclReduceScatter(input.data, output.data,
                                                   static_cast<size_t>(output.numel), type, nccl_op,
                                                   comm, stream);
                  });
  }

  WorkHandle do_all_reduce(const CommBuffer& tensor, ReduceOp op, int64_t sequence) override {
    const ncclDataType_t type = to_nccl_dtype(tensor.dtype);
    const ncclRedOp_t nccl_op = to_nccl_op(op);
    return launch(CollectiveKind::kAllReduce, sequence, tensor.numel, kOtherStream, "ncclAllReduce",
                  [&](ncclComm_t comm, cudaStream_t stream) {
                    return api().ncclAllReduce(tensor.data, tensor.data,
                                               static_cast<size_t>(tensor.numel), type, nccl_op,
                                               comm, stream);
                  });
  }

  WorkHandle do_broadcast(const CommBuffer& tensor, int root, int64_t sequence) override {
    const ncclDataType_t type = to_nccl_dtype(tensor.dtype);
    return launch(CollectiveKind::kBroadcast, sequence, tensor.numel, kOtherStream, "ncclBroadcast",
                  [&](ncclComm_t comm, cudaStream_t stream) {
                    return api().ncclBroadcast(tensor.data, tensor.data,
                                               static_cast<size_t>(tensor.numel), type, root, comm,
                                               stream);
                  });
  }

  // Note [A barrier that blocks the host]
  // A one-element float all-reduce on a device buffer allocated at init, ordered after the
  // compute stream: its completion on this rank implies that every rank entered the
  // barrier and that the work queued on the compute stream before it ran. Its Work's
  // wait() (so barrier()) blocks the host until then, whatever NcclOptions::blocking_wait
  // says, under the timeout: callers use a barrier to order host-side effects between
  // ranks (a file written before a peer reads it, old checkpoints removed before a new one
  // is written, a timer started when every rank is ready), which a wait of the compute
  // stream alone would not order. PyTorch's dist.barrier() on NCCL blocks the same way
  // (its barrier work synchronizes the stream it ran on). Collectives that only order
  // device work stay stream waits.
  WorkHandle do_barrier(int64_t sequence) override {
    float* buffer = resources_->barrier_buffer();
    return launch(
        CollectiveKind::kBarrier, sequence, 0, kOtherStream, "ncclAllReduce",
        [&](ncclComm_t comm, cudaStream_t stream) {
          return api().ncclAllReduce(buffer, buffer, 1, ncclFloat32, ncclSum, comm, stream);
        },
        /*host_waits=*/true);
  }

  std::shared_ptr<Communicator> do_new_subgroup(const SubgroupSpec& spec) override {
    NcclOptions options = options_;
    options.store_prefix(absl::StrCat(options_.store_prefix(), "/", spec.tag));
    return std::make_shared<NcclCommunicator>(store_, spec.rank,
                                              static_cast<int>(spec.ranks.size()),
                                              std::move(options), spec.global_ranks, size_checks_);
  }

  // Note [Host groups of the NCCL backend]
  // new_host_subgroup serves bookkeeping that runs off the thread that owns this
  // communicator (an asynchronous checkpoint's writes: Note [A communicator for
  // checkpoint I/O] in fsdp/state/async_checkpoint.cc). An NCCL subgroup would not do:
  // its collectives, issued from another thread, are ordered after that thread's current
  // stream (the legacy default stream, which synchronizes with every blocking stream of
  // the device), and two NCCL communicators whose kernels different ranks launch in
  // different orders can deadlock each other (NCCL's documentation on using multiple
  // communicators concurrently). None of that bookkeeping needs the device: it moves a
  // few bytes. So a host group is a Gloo group over the same store, under
  // "<store_prefix>/<tag>", with NcclOptions::host_group_options, a family of its own
  // (its failures do not break this one, nor the other way round), on CPU buffers: no
  // CUDA or NCCL call is ever made for it. PyTorch: dist.new_group(backend="gloo"), which
  // dcp.async_save's users pass as its process_group.
  std::shared_ptr<Communicator> do_new_host_subgroup(const SubgroupSpec& spec) override {
    return make_gloo_group(c10::make_intrusive<c10d::PrefixStore>(
                               absl::StrCat(options_.store_prefix(), "/", spec.tag), store_),
                           spec.rank, spec.global_ranks, options_.host_group_options());
  }

 private:
  // Note [NCCL size checks]
  // As Gloo's (Note [Mismatched sizes] in gloo.cc): while size checks are on, each
  // collective is preceded by an all-gather of every rank's (kind, numel), 2 int64 per
  // rank, on the communicator's other stream (not ordered after the compute stream: it
  // reads only its own buffer), which the host waits for under the timeout, then copies
  // back. Ranks that disagree would otherwise hang in NCCL until the timeout, or let NCCL
  // read or write past a buffer when only the counts differ; instead every rank fails the
  // collective with a CommError naming each rank's collective and count, and aborts the
  // NCCL communicator. FSDP turns the checks on for its first iteration (and for every one
  // with validate_execution_order); they cost a host round trip per collective.
  //
  // Issues collective `sequence`: its size check if on, then, for an all-gather, a wait
  // for a slot (NcclOptions::max_in_flight_all_gathers), then the NCCL call. `host_waits`:
  // the Work's wait() blocks the host (as with NcclOptions::blocking_wait).
  WorkHandle launch(CollectiveKind kind, int64_t sequence, int64_t numel, StreamIndex which,
                    const char* call_name,
                    const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& call,
                    bool host_waits = false) {
    std::shared_ptr<WorkRecord> record;
    if (size_checks_->load()) {
      record = resources_->check_sizes(kind, sequence, numel, global_ranks(),
                                       numel + take_size_check_fault());
    }
    if (record == nullptr) {
      if (kind == CollectiveKind::kAllGather) {
        resources_->wait_for_slot(kind, options_.max_in_flight_all_gathers());
      }
      record = resources_->launch(kind, sequence, which, call_name, call);
    }
    return std::make_shared<NcclWork>(resources_, std::move(record), timeout(),
                                      host_waits || options_.blocking_wait());
  }

  c10::intrusive_ptr<c10d::Store> store_;
  NcclOptions options_;
  std::shared_ptr<std::atomic<bool>> size_checks_;
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
