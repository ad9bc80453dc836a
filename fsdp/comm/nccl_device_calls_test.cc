// The NCCL backend's host logic against a stand-in for CUDA and NCCL (Note [A seam for the
// device calls] in internal/device_calls.cc), so that it runs in every CI run without a
// GPU: every CUDA and NCCL call is made with its communicator's device current, whatever
// the thread (the watchdog's included); an abort after a hung or killed peer runs without
// the lock that polls and issues take, and shutdown returns within seconds; barrier()
// blocks the host until the device completed it; host groups are Gloo groups that make no
// device call.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "fsdp/comm/internal/device_calls.h"
#include "fsdp/comm/nccl.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using Clock = std::chrono::steady_clock;

// --- the stand-in device ------------------------------------------------------------------

// Work queued on a stream: a collective, done at once unless the device is told to hang.
struct Op {
  std::atomic<bool> done{false};
};
// Each object remembers the device that was current when it was made.
struct Stream {
  int device;
  std::shared_ptr<Op> last;  // the newest work queued on it
};
struct Event {
  int device;
  std::shared_ptr<Op> op;  // what it waits for (null: nothing)
};
struct Comm {
  int device;
  std::vector<std::shared_ptr<Op>> ops;
};

thread_local int current_device = 0;  // the CUDA runtime's default on a new thread

// One CUDA device per rank and an NCCL that plays along. It records every call (name,
// thread, current device) and every call made with another device current than that of
// the stream, event, memory or communicator it is made on, or that makes one on a device
// no rank owns.
class FakeDevice {
 public:
  explicit FakeDevice(std::set<int> rank_devices) : rank_devices_(std::move(rank_devices)) {}

  // New collectives stay incomplete until complete_all() (a peer that never arrives).
  void hang(bool on) { hang_ = on; }
  void complete_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [handle, comm] : comms_) {
      for (const auto& op : comm->ops) op->done = true;
    }
  }
  // From now on every communicator reports `error` from ncclCommGetAsyncError (a killed
  // peer: NCCL sees its connection close).
  void fail_asynchronously(ncclResult_t error) { async_error_ = error; }
  // ncclCommAbort blocks until release_abort(), or `at_most` (a driver draining kernels).
  void slow_abort(std::chrono::milliseconds at_most) { abort_at_most_ = at_most; }
  void release_abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    abort_released_ = true;
    cv_.notify_all();
  }
  // Blocks until an ncclCommAbort started (true) or `timeout` passed (false).
  bool wait_for_abort(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return aborts_started_ > 0; });
  }
  int aborts_finished() {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborts_finished_;
  }

  std::vector<std::string> violations() {
    std::lock_guard<std::mutex> lock(mutex_);
    return violations_;
  }
  // The threads that made call `name`.
  std::set<std::thread::id> threads_of(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    return threads_[name];
  }
  // Calls made by the calling thread so far.
  int64_t calls_by_this_thread() {
    std::lock_guard<std::mutex> lock(mutex_);
    return per_thread_[std::this_thread::get_id()];
  }

  // A stream on `device`, made as a rank's compute stream would be.
  cudaStream_t new_stream(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    streams_.push_back(std::make_unique<Stream>(Stream{device, nullptr}));
    return reinterpret_cast<cudaStream_t>(streams_.back().get());
  }

  static const comm_internal::DeviceCalls& calls() {
    static const comm_internal::DeviceCalls table = {
        &GetDevice,
        &SetDevice,
        &StreamCreate,
        &StreamDestroy,
        &StreamWaitEvent,
        &StreamSync,
        &EventCreate,
        &EventDestroy,
        &EventRecord,
        &EventQuery,
        &Malloc,
        &Free,
        &Memset,
        &MemcpyAsync,
        &GetUniqueId,
        &CommInit,
        &CommGetAsyncError,
        &CommFinalize,
        &CommDestroy,
        &CommAbort,
        &AllGather,
        &ReduceScatter,
        &AllReduce,
        &Broadcast,
    };
    return table;
  }

  static FakeDevice* installed;

 private:
  // Records call `name`; `device` is the device of the object it is made on (-1: none).
  void note(const char* name, int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::thread::id thread = std::this_thread::get_id();
    threads_[name].insert(thread);
    ++per_thread_[thread];
    std::ostringstream who;
    who << "thread " << thread;
    if (device >= 0 && current_device != device) {
      violations_.push_back(absl::StrCat(name, " on ", who.str(), " with device ", current_device,
                                         " current, on an object of device ", device));
    }
    if (device < 0 && rank_devices_.count(current_device) == 0) {
      violations_.push_back(absl::StrCat(name, " on ", who.str(), " with device ", current_device,
                                         " current, which no rank owns"));
    }
  }
  static FakeDevice& self() { return *installed; }
  static Stream* stream_of(cudaStream_t s) { return reinterpret_cast<Stream*>(s); }
  static Event* event_of(cudaEvent_t e) { return reinterpret_cast<Event*>(e); }
  static Comm* comm_of(ncclComm_t c) { return reinterpret_cast<Comm*>(c); }
  // A null stream is the legacy default stream of the current device: nothing queued.
  static int device_of(cudaStream_t s) { return s ? stream_of(s)->device : current_device; }

  static cudaError_t GetDevice(int* device) {
    *device = current_device;
    return cudaSuccess;
  }
  static cudaError_t SetDevice(int device) {
    if (device < 0 || device >= 8) return cudaErrorInvalidDevice;
    current_device = device;
    return cudaSuccess;
  }
  static cudaError_t StreamCreate(cudaStream_t* stream, unsigned int) {
    self().note("cudaStreamCreateWithFlags", -1);
    *stream = self().new_stream(current_device);
    return cudaSuccess;
  }
  static cudaError_t StreamDestroy(cudaStream_t stream) {
    self().note("cudaStreamDestroy", device_of(stream));
    return cudaSuccess;  // kept until the device goes (a test's compute stream outlives it)
  }
  static cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
    self().note("cudaStreamWaitEvent", device_of(stream));
    self().note("cudaStreamWaitEvent", event_of(event)->device);
    return cudaSuccess;
  }
  static cudaError_t StreamSync(cudaStream_t stream) {
    self().note("cudaStreamSynchronize", device_of(stream));
    return cudaSuccess;
  }
  static cudaError_t EventCreate(cudaEvent_t* event, unsigned int) {
    self().note("cudaEventCreateWithFlags", -1);
    *event = reinterpret_cast<cudaEvent_t>(new Event{current_device, nullptr});
    return cudaSuccess;
  }
  static cudaError_t EventDestroy(cudaEvent_t event) {
    self().note("cudaEventDestroy", event_of(event)->device);
    delete event_of(event);
    return cudaSuccess;
  }
  static cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) {
    self().note("cudaEventRecord", event_of(event)->device);
    self().note("cudaEventRecord", device_of(stream));
    std::lock_guard<std::mutex> lock(self().mutex_);
    event_of(event)->op = stream ? stream_of(stream)->last : nullptr;
    return cudaSuccess;
  }
  static cudaError_t EventQuery(cudaEvent_t event) {
    self().note("cudaEventQuery", event_of(event)->device);
    std::lock_guard<std::mutex> lock(self().mutex_);
    const std::shared_ptr<Op>& op = event_of(event)->op;
    return op == nullptr || op->done ? cudaSuccess : cudaErrorNotReady;
  }
  static cudaError_t Malloc(void** pointer, size_t bytes) {
    self().note("cudaMalloc", -1);
    *pointer = std::calloc(bytes, 1);
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().memory_[*pointer] = current_device;
    return cudaSuccess;
  }
  static int memory_device(const void* pointer) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    auto it = self().memory_.find(pointer);
    return it == self().memory_.end() ? current_device : it->second;  // host memory
  }
  static cudaError_t Free(void* pointer) {
    self().note("cudaFree", memory_device(pointer));
    std::free(pointer);
    return cudaSuccess;
  }
  static cudaError_t Memset(void* pointer, int value, size_t bytes) {
    self().note("cudaMemset", memory_device(pointer));
    std::memset(pointer, value, bytes);
    return cudaSuccess;
  }
  static cudaError_t MemcpyAsync(void* to, const void* from, size_t bytes, cudaMemcpyKind,
                                 cudaStream_t stream) {
    self().note("cudaMemcpyAsync", device_of(stream));
    std::memcpy(to, from, bytes);
    return cudaSuccess;
  }
  static ncclResult_t GetUniqueId(ncclUniqueId* id) {
    std::memset(id->internal, 7, sizeof(id->internal));
    return ncclSuccess;
  }
  static ncclResult_t CommInit(ncclComm_t* comm, int, ncclUniqueId, int, ncclConfig_t*) {
    self().note("ncclCommInitRankConfig", -1);
    auto made = std::make_unique<Comm>(Comm{current_device, {}});
    *comm = reinterpret_cast<ncclComm_t>(made.get());
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().comms_[*comm] = std::move(made);
    return ncclSuccess;
  }
  static ncclResult_t CommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
    self().note("ncclCommGetAsyncError", comm_of(comm)->device);
    *state = self().async_error_.load();
    return ncclSuccess;
  }
  static ncclResult_t CommFinalize(ncclComm_t comm) {
    self().note("ncclCommFinalize", comm_of(comm)->device);
    return ncclSuccess;
  }
  static ncclResult_t CommDestroy(ncclComm_t comm) {
    self().note("ncclCommDestroy", comm_of(comm)->device);
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().comms_.erase(comm);
    return ncclSuccess;
  }
  static ncclResult_t CommAbort(ncclComm_t comm) {
    FakeDevice& d = self();
    d.note("ncclCommAbort", comm_of(comm)->device);
    std::unique_lock<std::mutex> lock(d.mutex_);
    ++d.aborts_started_;
    d.cv_.notify_all();
    d.cv_.wait_for(lock, d.abort_at_most_, [&] { return d.abort_released_; });
    for (const auto& op : comm_of(comm)->ops) op->done = true;  // its kernels end
    d.comms_.erase(comm);
    ++d.aborts_finished_;
    return ncclSuccess;
  }
  static ncclResult_t collective(const char* name, ncclComm_t comm, cudaStream_t stream) {
    FakeDevice& d = self();
    d.note(name, comm_of(comm)->device);
    d.note(name, device_of(stream));
    auto op = std::make_shared<Op>();
    op->done = !d.hang_;
    std::lock_guard<std::mutex> lock(d.mutex_);
    comm_of(comm)->ops.push_back(op);
    if (stream != nullptr) stream_of(stream)->last = op;
    return ncclSuccess;
  }
  static ncclResult_t AllGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t comm,
                                cudaStream_t stream) {
    return collective("ncclAllGather", comm, stream);
  }
  static ncclResult_t ReduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                    ncclComm_t comm, cudaStream_t stream) {
    return collective("ncclReduceScatter", comm, stream);
  }
  static ncclResult_t AllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                ncclComm_t comm, cudaStream_t stream) {
    return collective("ncclAllReduce", comm, stream);
  }
  static ncclResult_t Broadcast(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t comm,
                                cudaStream_t stream) {
    return collective("ncclBroadcast", comm, stream);
  }

  const std::set<int> rank_devices_;
  std::atomic<bool> hang_{false};
  std::atomic<ncclResult_t> async_error_{ncclSuccess};
  std::chrono::milliseconds abort_at_most_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool abort_released_ = false;
  int aborts_started_ = 0;
  int aborts_finished_ = 0;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::map<ncclComm_t, std::unique_ptr<Comm>> comms_;
  std::map<const void*, int> memory_;
  std::vector<std::string> violations_;
  std::map<std::string, std::set<std::thread::id>> threads_;
  std::map<std::thread::id, int64_t> per_thread_;
};

FakeDevice* FakeDevice::installed = nullptr;

// Installs a FakeDevice whose ranks own `rank_devices` for the test's scope.
class OnFakeDevice {
 public:
  explicit OnFakeDevice(std::set<int> rank_devices)
      : device_(std::move(rank_devices)), scope_(FakeDevice::calls()) {
    FakeDevice::installed = &device_;
  }
  ~OnFakeDevice() { FakeDevice::installed = nullptr; }
  FakeDevice& operator*() { return device_; }
  FakeDevice* operator->() { return &device_; }

 private:
  FakeDevice device_;
  comm_internal::ScopedDeviceCalls scope_;
};

// A device buffer of one float on `device` (the stand-in never reads it).
CommBuffer device_float(int device) {
  static float stand_in = 0;
  return {&stand_in, 1, c10::kFloat, c10::Device(c10::kCUDA, device)};
}

// Rank `rank` of `world_size` on cuda:`device`, its compute stream made by the stand-in.
std::shared_ptr<Communicator> nccl_rank(FakeDevice& device,
                                        const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                        int world_size, int cuda_index,
                                        std::chrono::milliseconds timeout) {
  return make_nccl_communicator(
      store, rank, world_size,
      NcclOptions()
          .device_index(cuda_index)
          .timeout(timeout)
          .compute_stream(device.new_stream(cuda_index))
          .host_group_options(
              GlooOptions().hostname("127.0.0.1").timeout(std::chrono::seconds(10))));
}

// Milliseconds since `begin`.
int64_t since(Clock::time_point begin) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - begin).count();
}

// Runs fn(rank) for ranks 0 and 1 on threads of their own; an exception fails the test.
void on_two_ranks(const std::function<void(int)>& fn) {
  auto guarded = [&](int rank) {
    try {
      fn(rank);
    } catch (const std::exception& error) {
      ADD_FAILURE() << "rank " << rank << " threw: " << error.what();
    }
  };
  std::thread rank0(guarded, 0), rank1(guarded, 1);
  rank0.join();
  rank1.join();
}

// --- Note [Every call on the communicator's device] -------------------------------------

// Two ranks as threads on cuda:2 and cuda:3 issue collectives that stay pending for a
// while (the watchdog polls them), poll and drop their works from a thread that never set
// a device, run a barrier and shut down: every call on a stream, event, buffer or NCCL
// communicator is made with that object's device current, and nothing is made on a device
// no rank owns (the CUDA runtime's default, 0, on a new thread).
TEST(NcclDeviceCallsTest, EveryCallIsMadeOnTheRanksDeviceWhateverTheThread) {
  OnFakeDevice device({2, 3});
  auto store = c10::make_intrusive<c10d::HashStore>();
  device->hang(true);
  std::vector<std::thread::id> rank_threads(2), poller_threads(2);
  std::vector<std::promise<void>> issued(2);
  std::promise<void> completed;
  std::shared_future<void> go = completed.get_future().share();
  auto rank_main = [&](int rank) {
    rank_threads[rank] = std::this_thread::get_id();
    current_device = 2 + rank;  // as a rank's main thread sets it (c10::cuda::set_device)
    std::shared_ptr<Communicator> comm =
        nccl_rank(*device, store, rank, 2, 2 + rank, std::chrono::seconds(10));
    WorkHandle work = comm->all_reduce_async(device_float(2 + rank));
    work->wait();  // a stream wait: returns while the all-reduce is pending
    EXPECT_FALSE(work->is_completed());
    issued[rank].set_value();
    go.wait();
    // Another thread, whose current device is the runtime's default, polls the work until
    // it completed and drops the last reference to it (its event is destroyed there, once
    // the watchdog forgot it).
    std::thread poller([&, work = std::move(work)]() mutable {
      poller_threads[rank] = std::this_thread::get_id();
      while (!work->is_completed()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      work.reset();
    });
    poller.join();
    comm->barrier();
  };
  std::thread ranks([&] { on_two_ranks(rank_main); });
  for (auto& promise : issued) promise.get_future().wait();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the watchdogs poll
  device->hang(false);
  device->complete_all();
  completed.set_value();
  ranks.join();
  EXPECT_THAT(device->violations(), ::testing::IsEmpty());
  // The watchdogs queried events: some thread other than the ranks' and the pollers' did.
  std::set<std::thread::id> watchdogs = device->threads_of("cudaEventQuery");
  for (const auto& known : {rank_threads, poller_threads}) {
    for (const std::thread::id& id : known) watchdogs.erase(id);
  }
  EXPECT_FALSE(watchdogs.empty()) << "no watchdog thread queried an event";
}

// --- Note [Aborting outside the lock] ------------------------------------------------------

// A peer that never issues the all-reduce (it hangs): the watchdog fails it at the 300 ms
// deadline and aborts; the abort takes its time (a driver draining kernels), and while it
// runs, polling and waiting on the work return at once with the failure (nothing waits
// for the lock). Shutdown returns within seconds.
TEST(NcclDeviceCallsTest, AnAbortAfterAHungPeerLeavesTheLockFree) {
  OnFakeDevice device({1});
  device->hang(true);
  device->slow_abort(std::chrono::seconds(5));
  auto comm = nccl_rank(*device, c10::make_intrusive<c10d::HashStore>(), 0, 1, 1,
                        std::chrono::milliseconds(300));
  WorkHandle work = comm->all_reduce_async(device_float(1));
  ASSERT_TRUE(device->wait_for_abort(std::chrono::seconds(3))) << "the watchdog did not abort";
  const auto begin = Clock::now();
  EXPECT_TRUE(work->is_completed());
  EXPECT_THAT([&] { work->wait(); },
              ThrowsMessage<CommError>(HasSubstr("all_reduce #0 failed on rank 0")));
  EXPECT_LT(since(begin), 500) << "polling and waiting waited for the abort (ms)";
  EXPECT_EQ(device->aborts_finished(), 0) << "the abort was still running";
  device->release_abort();
  const auto shutdown = Clock::now();
  comm.reset();
  EXPECT_LT(since(shutdown), 3000);
  EXPECT_EQ(device->aborts_finished(), 1);
  EXPECT_THAT(device->violations(), ::testing::IsEmpty());
}

// A killed peer: NCCL reports an asynchronous error (ncclRemoteError). The watchdog aborts
// (1 s here); each poll of the work during the abort returns within 200 ms, the work
// fails with NCCL's words, and shutdown returns within seconds.
TEST(NcclDeviceCallsTest, AnAbortAfterAKilledPeerLeavesTheLockFreeAndShutdownReturns) {
  OnFakeDevice device({0});
  device->hang(true);
  device->slow_abort(std::chrono::seconds(1));
  auto comm =
      nccl_rank(*device, c10::make_intrusive<c10d::HashStore>(), 0, 1, 0, std::chrono::seconds(30));
  WorkHandle work = comm->all_reduce_async(device_float(0));
  const auto killed = Clock::now();
  device->fail_asynchronously(ncclRemoteError);
  int64_t longest_poll = 0;
  bool completed = false;
  while (!completed && since(killed) < 5000) {
    const auto begin = Clock::now();
    completed = work->is_completed();
    longest_poll = std::max(longest_poll, since(begin));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(completed);
  EXPECT_LT(longest_poll, 200) << "a poll waited for the abort (ms)";
  EXPECT_THAT([&] { work->wait(); }, ThrowsMessage<CommError>(HasSubstr("ncclRemoteError")));
  comm.reset();
  EXPECT_LT(since(killed), 4000);
  EXPECT_EQ(device->aborts_finished(), 1);
}

// --- Note [A barrier that blocks the host] -------------------------------------------------

// barrier() returns only once its all-reduce completed on the device; an all-reduce's
// wait() still returns at once (a stream wait).
TEST(NcclDeviceCallsTest, BarrierBlocksTheHostUntilTheDeviceCompletedIt) {
  OnFakeDevice device({0});
  auto comm =
      nccl_rank(*device, c10::make_intrusive<c10d::HashStore>(), 0, 1, 0, std::chrono::seconds(10));
  device->hang(true);
  const auto begin = Clock::now();
  comm->all_reduce_async(device_float(0))->wait();
  EXPECT_LT(since(begin), 100);
  std::future<void> barrier = std::async(std::launch::async, [&] {
    current_device = 0;
    comm->barrier();
  });
  EXPECT_EQ(barrier.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "barrier() returned before its all-reduce completed on the device";
  device->complete_all();
  EXPECT_EQ(barrier.wait_for(std::chrono::seconds(2)), std::future_status::ready);
  barrier.get();
}

// --- Note [Host groups of the NCCL backend] -------------------------------------------------

// A host group of NCCL ranks is a Gloo group over the same store: its collectives on CPU
// tensors are exact and make no CUDA or NCCL call; CommErrors name global ranks.
TEST(NcclDeviceCallsTest, HostGroupsAreGlooGroupsThatMakeNoDeviceCall) {
  OnFakeDevice device({0, 1});
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto rank_main = [&](int rank) {
    current_device = rank;
    std::shared_ptr<Communicator> comm =
        nccl_rank(*device, store, rank, 2, rank, std::chrono::seconds(10));
    std::shared_ptr<Communicator> host = comm->new_host_subgroup({0, 1});
    ASSERT_NE(host, nullptr);
    EXPECT_EQ(host->backend_name(), "gloo");
    EXPECT_EQ(host->global_ranks(), (std::vector<int>{0, 1}));
    EXPECT_TRUE(host->moves_buffers_on(c10::Device(c10::kCPU)));
    EXPECT_FALSE(comm->moves_buffers_on(c10::Device(c10::kCPU)));
    const int64_t before = device->calls_by_this_thread();
    at::Tensor t = at::full({3}, rank + 1.0);
    host->all_reduce(t);
    host->barrier();
    EXPECT_TRUE(t.equal(at::full({3}, 3.0)));
    EXPECT_EQ(device->calls_by_this_thread(), before) << "the host group called CUDA or NCCL";
  };
  on_two_ranks(rank_main);
  EXPECT_THAT(device->violations(), ::testing::IsEmpty());
}

}  // namespace
}  // namespace fsdp
