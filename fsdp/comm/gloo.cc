#include "fsdp/comm/gloo.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <gloo/common/logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "fsdp/comm/internal/gloo_group.h"
#include "fsdp/comm/internal/size_checks.h"

namespace fsdp {
namespace {

using comm_internal::describe_mismatched_collectives;

// Note [Gloo collectives]
// Every collective goes through c10d's ProcessGroupGloo (LibTorch 2.11): fsdp never calls
// Gloo's algorithms itself, because the Gloo compiled into libtorch_cpu is newer than any
// Gloo headers we could compile against, and its option structs may differ.
// - all-gather: a direct exchange over c10d's point-to-point send and recv on kByte views
//   (any dtype): each rank sends its input to every peer and receives every peer's into
//   its slice of the output, (W - 1) x input bytes each way, as in a ring all-gather, but
//   in one round instead of W - 1 steps that each wait for the next rank.
// - reduce-scatter: the same exchange of the input's W equal chunks (rank r receives
//   every rank's chunk r: (W - 1)/W of the input each way, as a ring reduce-scatter), then
//   a local sum in the buffer's dtype, the same on every rank: ((c0 + c1) + c2) + ...
//   One peer's chunk (rank 1's on rank 0, rank 0's elsewhere) is received straight into
//   the output and the other of c0, c1 added to it, which is c0 + c1 exactly (IEEE
//   addition commutes); the other W - 2 are received into a buffer of (W - 2)/W of the
//   input, none at W = 2. (c10d's `_reduce_scatter_base` for Gloo all-reduces the whole
//   input, twice the bytes, and ignores the reduce op.)
// - all-reduce: Gloo's ring all-reduce (every floating dtype, bfloat16 included), sum;
//   average divides afterwards.
// - broadcast and barrier: Gloo's own.
// Everything is issued on the caller's thread, with no thread of fsdp's own in between:
// sends and receives are moved by Gloo's transport thread, c10d's collectives run in
// issue order on c10d's one worker thread, and what completes a collective (the local
// sum, an average's division, the copy back of a staged device buffer) runs in the first
// Work::wait. Gloo's timeout (the communicator's) bounds every wait. On 2 cores with 4
// ranks each hand-off to a thread waits for a core, so the two hops saved per collective
// (to a worker of fsdp's and back) and the one round of the exchange are what made
// FULL_SHARD's 14 collectives a step cheaper (benchmarks/PROFILE.md).

// Note [Gloo on device tensors]
// Gloo moves host memory. A collective on CUDA buffers (ranks that train on a GPU but
// talk over Gloo, e.g. several ranks on one GPU, where NCCL refuses them) is staged through
// host tensors: when it is issued, on the caller's thread, each input is copied to the host
// with a blocking copy on the caller's current stream, which waits for every kernel queued
// there before it (those that wrote the input, and those that still read the output's old
// contents); the host collective runs as for CPU buffers, and the waiter copies the result
// into the device buffer with a blocking copy before Work::wait returns. So after
// Work::wait() the result is in place for every stream, with no event to wait on. The
// price: the issuing thread waits for its stream, and each collective adds a
// device-to-host and a host-to-device copy of its buffers. PyTorch's ProcessGroupGloo
// also stages CUDA tensors through host memory (pinned, with events on the streams).

// Gloo writes to its TCP pairs with writev, which raises SIGPIPE when the peer has closed
// the connection; the default action kills the process before Gloo can report the lost
// peer (seen as "killed by signal 13" on a survivor). Python ignores SIGPIPE at start-up,
// so PyTorch users never meet this; a C++ program that left it at its default gets the
// same behaviour here. A handler the program installed itself is kept.
void ignore_sigpipe_by_default() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

// First line of an exception message (c10::Error appends a C++ stack trace).
std::string first_line(const std::string& what) { return what.substr(0, what.find('\n')); }

// Note [Gloo terminations]
// Gloo checks a received message's length on its transport thread, inside libtorch_cpu,
// where no caller can catch what it throws: a peer that sends more bytes than this rank
// posted for (ranks running different collectives, or the same ones with other sizes)
// throws gloo::EnforceNotMet there ("op.preamble.length <= op.nbytes. 64 vs 40") and the
// process terminates, naming neither the collective nor the cause. Size checks
// (Communicator::set_size_checks) turn that into a CommError on every rank, at the price
// of one small all-gather per collective; where they are off, make_gloo_communicator
// installs a terminate handler (unless the program set its own) that, for a
// gloo::EnforceNotMet, first prints one line naming this rank's last started collective
// and the cause, e.g.
//   fsdp: Gloo terminates rank 0 in all_gather_into_tensor #8: a peer sent a message of 64
//   bytes where this rank expected 40: the ranks are not running the same units in the
//   same order (...)
// and then hands over to the handler it replaced (libstdc++'s prints the exception and
// aborts). libstdc++ marks an exception that finds no handler as caught before calling
// the terminate handler, so std::current_exception sees it there.
struct LastCollective {
  std::mutex mutex;
  std::string name;           // "all_gather_into_tensor #8", "... in group [0, 2]"; "" before any
  std::atomic<int> rank{-1};  // this process's global rank, once a communicator exists
};

LastCollective& last_collective() {
  static auto* last = new LastCollective;  // never destroyed: read while terminating
  return *last;
}

// The issuing thread, as each collective starts.
// `group`: "" for a root communicator, " in group [0, 2]" for a subgroup.
void record_started(CollectiveKind kind, int64_t sequence, const std::string& group) {
  std::string name = absl::StrCat(collective_name(kind), " #", sequence, group);
  LastCollective& last = last_collective();
  std::lock_guard<std::mutex> lock(last.mutex);
  last.name = std::move(name);
}

std::terminate_handler replaced_terminate_handler = nullptr;

// "a peer sent a message of R bytes where this rank expected E" from Gloo's length check
// (one message of the collective's algorithm, not the whole buffer), or "" for any other
// enforcement.
std::string length_mismatch(const std::string& what) {
  const std::string check = "op.preamble.length <= op.nbytes. ";
  const size_t at = what.find(check);
  if (at == std::string::npos) return "";
  long long received = 0, expected = 0;
  if (std::sscanf(what.c_str() + at + check.size(), "%lld vs %lld", &received, &expected) != 2) {
    return "";
  }
  return absl::StrCat("a peer sent a message of ", received, " bytes where this rank expected ",
                      expected);
}

void name_gloo_termination() {
  if (std::exception_ptr current = std::current_exception()) {
    try {
      std::rethrow_exception(current);
    } catch (const ::gloo::EnforceNotMet& e) {
      LastCollective& last = last_collective();
      std::string where = "before its first collective";
      if (last.mutex.try_lock()) {
        if (!last.name.empty()) where = "in " + last.name;
        last.mutex.unlock();
      }
      const std::string what = e.what();
      const std::string mismatch = length_mismatch(what);
      const std::string cause =
          mismatch.empty()
              ? absl::StrCat("Gloo reported: ", first_line(what))
              : absl::StrCat(mismatch,
                             ": the ranks are not running the same units in the same order "
                             "(FullyShardedDataParallelOptions::validate_execution_order "
                             "size-checks every collective, making this a CommError on every "
                             "rank)");
      std::fprintf(stderr, "fsdp: Gloo terminates rank %d %s: %s\n", last.rank.load(),
                   where.c_str(), cause.c_str());
      std::fflush(stderr);
    } catch (...) {
    }
  }
  if (replaced_terminate_handler != nullptr) replaced_terminate_handler();
  std::abort();
}

// See Note [Gloo terminations]. Only over libstdc++'s default handler.
void name_gloo_terminations_by_default() {
  static std::once_flag once;
  std::call_once(once, [] {
    const std::terminate_handler current = std::get_terminate();
    if (current != &__gnu_cxx::__verbose_terminate_handler) return;  // the program's own
    replaced_terminate_handler = current;
    std::set_terminate(&name_gloo_termination);
  });
}

// Whether two buffers share memory.
bool overlaps(const CommBuffer& a, const CommBuffer& b) {
  const char* a_begin = static_cast<const char*>(a.data);
  const char* b_begin = static_cast<const char*>(b.data);
  return a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
}

// The host side of a collective's buffer (see Note [Gloo on device tensors]): the buffer
// itself on the CPU; for a device buffer, a host tensor holding a copy of it (`copy_in`:
// made on the calling thread, ordered after the kernels of its current stream) or fresh
// memory, and, once the host collective is done, copy_out() moves the result back.
//
// tensor() owns a staged copy: c10d's send and receive works keep the tensors they are
// given until they complete, so the host copy of an input lives as long as a send that
// reads it, whether or not the HostStage (a local of the issuing call) still does. A view
// made with CommBuffer::as_tensor() owns nothing: the first GPU run sent freed memory
// (the host copy of an all-gather's input died when the issuing call returned, before
// Gloo's transport read it) and summed it in reduce-scatter's waiter.
class HostStage {
 public:
  HostStage(const CommBuffer& buffer, bool copy_in) : buffer_(buffer) {
    if (buffer.device.is_cpu()) {
      tensor_ = buffer.as_tensor();  // the caller's memory, kept alive by the caller
      return;
    }
    tensor_ = copy_in ? buffer.as_tensor().to(at::kCPU)
                      : at::empty({buffer.numel}, at::TensorOptions().dtype(buffer.dtype));
    staged_ = true;
  }
  // The host memory the collective reads and writes ([numel], the buffer's dtype).
  const at::Tensor& tensor() const { return tensor_; }
  CommBuffer host() const { return CommBuffer::of(tensor_, "the host side of a buffer"); }
  // Blocking host-to-device copy of the result (the waiter). No-op on the CPU.
  void copy_out() const {
    if (staged_) buffer_.as_tensor().copy_(tensor_);
  }

 private:
  CommBuffer buffer_;
  at::Tensor tensor_;
  bool staged_ = false;
};

// Note [Naming the lost peer]
// Gloo reports a lost connection by socket address, not by rank. After a failure, each
// survivor marks itself alive in the root communicator's store and waits up to
// kProbeTime for the others; the lowest global rank that never shows up is named as the
// peer, whichever communicator (root or subgroup) failed: under hybrid sharding a rank
// may fail in its replicate group because a member of another shard group is gone. The
// mark is per process, not per collective: a survivor may fail one collective behind
// another (its own reduce-scatter still in flight), and it fails only once.
// If the store cannot be reached, its host (rank 0) is the one gone. A failure where
// every rank is alive (e.g. mismatched collectives) names no peer.
// A survivor may be blocked on another survivor rather than on the lost rank (rank 0 in
// a ring all-reduce waiting for rank 1, which is stuck in the collective before, or in
// another group); it would only notice when that survivor exits, too late to answer its
// probe, and be named in place of the lost rank. So as soon as a collective fails, the
// process closes the connections of all its communicators (as PyTorch aborts a failed
// NCCL communicator): every survivor blocked on it fails within milliseconds and probes
// at the same time. Closing means dropping every reference to the Gloo context: the
// process group's, and those of the collectives in flight (their c10d works), whose
// pending sends and receives are aborted first so that no waiter blocks on them. Rank 0
// (the store's host) keeps the store up for another probe time before it goes, so that
// the others can finish their probes.
constexpr auto kProbeTime = std::chrono::milliseconds(1500);

// Thrown on the issuing thread when a size check finds ranks running different collectives
// (see Communicator::set_size_checks); its message names every rank's.
class MismatchedCollectives : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class GlooCommunicator;

// What a root communicator and the subgroups made from it share in one process: the
// root's store, this process's global rank, and the failure. See Note [Naming the lost
// peer]. Thread-safe.
class GlooFamily {
 public:
  // `ranks`: the global ranks that probe in find_lost_peer (every rank of the root; the
  // members of a host group, make_gloo_group). `parent`: for the side channel of schedule
  // checks, the family it watches; a failed side channel then keeps rank 0's store up at
  // exit only if the parent did not already.
  GlooFamily(c10::intrusive_ptr<c10d::Store> store, int global_rank, std::vector<int> ranks,
             std::shared_ptr<GlooFamily> parent = nullptr)
      : store_(std::move(store)),
        global_rank_(global_rank),
        ranks_(std::move(ranks)),
        parent_(std::move(parent)) {}
  ~GlooFamily() {
    if (failed_ && global_rank_ == 0 && !(parent_ && parent_->failed_)) {
      std::this_thread::sleep_for(kProbeTime + std::chrono::milliseconds(500));
    }
  }

  void add(GlooCommunicator* member) {
    std::lock_guard<std::mutex> lock(mutex_);
    members_.push_back(member);
  }
  void remove(GlooCommunicator* member) {
    std::lock_guard<std::mutex> lock(mutex_);
    members_.erase(std::find(members_.begin(), members_.end(), member));
  }

  // A collective of `source` failed: closes the connections of every other member
  // (`source` closes its own first, in GlooCommunicator::fail).
  void on_failure(GlooCommunicator* source);

  // See Communicator::set_size_checks: read when a collective is issued.
  void set_size_checks(bool enabled) { size_checks_ = enabled; }
  bool size_checks() const { return size_checks_; }

  // Which global rank is gone? Returns -1 if every rank answered.
  int find_lost_peer() {
    const std::string prefix = "alive/";
    try {
      store_->set(absl::StrCat(prefix, global_rank_), std::vector<uint8_t>{1});
      const auto deadline = std::chrono::steady_clock::now() + kProbeTime;
      while (true) {
        int missing = -1;
        for (auto r = ranks_.rbegin(); r != ranks_.rend(); ++r) {
          if (!store_->check({absl::StrCat(prefix, *r)})) missing = *r;
        }
        if (missing < 0 || std::chrono::steady_clock::now() > deadline) return missing;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const std::exception&) {
      return 0;  // the store itself is gone, and rank 0 hosts it
    }
  }

 private:
  const c10::intrusive_ptr<c10d::Store> store_;
  const int global_rank_;
  const std::vector<int> ranks_;
  const std::shared_ptr<GlooFamily> parent_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> size_checks_{false};
  std::mutex mutex_;
  std::vector<GlooCommunicator*> members_;
};

// One collective: the c10d works it posted and what completes it once they are done (the
// local sum of a reduce-scatter, the division of an average, the copy back of a device
// buffer). Made on the issuing thread; wait() may be called from any thread and more than
// once (the first waiter completes it). See Note [Gloo collectives].
class GlooWork : public Work {
 public:
  GlooWork(std::weak_ptr<GlooCommunicator> comm, CollectiveKind kind, int64_t sequence,
           int global_rank, std::chrono::milliseconds timeout)
      : Work(timeout),
        comm_(std::move(comm)),
        kind_(kind),
        sequence_(sequence),
        global_rank_(global_rank) {}

  // While issuing. `point_to_point`: a send or receive, which release() must abort.
  void add(c10::intrusive_ptr<c10d::Work> work, bool point_to_point) {
    std::lock_guard<std::mutex> lock(mutex_);
    posted_.push_back({std::move(work), point_to_point});
  }
  void set_finish(std::function<void()> finish) { finish_ = std::move(finish); }
  // Issuing failed (a size check, closed connections): wait() raises it.
  void set_failed(std::exception_ptr failure) { failed_ = std::move(failure); }

  void wait(std::chrono::milliseconds timeout) override;

  // For all-gathers and reduce-scatters, true once wait() returned: their sends and
  // receives cannot be polled without completing them.
  bool is_completed() override {
    if (completed_) return true;
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_ || released_) return true;
    for (const Posted& posted : posted_) {
      if (posted.point_to_point || !posted.work->isCompleted()) return false;
    }
    return true;
  }

  bool done() const { return completed_; }

  // The connections are being closed (see Note [Naming the lost peer]): wakes a waiter
  // blocked in a send or receive and drops this collective's references to the Gloo
  // context, so that closing it closes its sockets. wait() then fails.
  void release() {
    std::vector<Posted> posted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      released_ = true;
      posted.swap(posted_);
    }
    for (Posted& p : posted) {
      if (p.point_to_point && !p.work->isCompleted()) p.work->abort();
    }
  }

 private:
  struct Posted {
    c10::intrusive_ptr<c10d::Work> work;
    bool point_to_point;
  };
  [[noreturn]] void fail(const std::string& detail);

  const std::weak_ptr<GlooCommunicator> comm_;
  const CollectiveKind kind_;
  const int64_t sequence_;
  const int global_rank_;  // for a failure seen after the communicator is gone
  std::function<void()> finish_;
  std::exception_ptr failed_;
  std::mutex wait_mutex_;     // held by the waiter that completes it
  std::exception_ptr error_;  // the CommError of a failed wait, raised again (wait_mutex_)
  std::atomic<bool> completed_{false};
  std::mutex mutex_;  // guards posted_ and released_
  std::vector<Posted> posted_;
  bool released_ = false;
};

class GlooCommunicator : public Communicator,
                         public std::enable_shared_from_this<GlooCommunicator> {
 public:
  // `global_ranks`: empty for the root communicator, whose rank and world size the
  // family was made with; a subgroup's members otherwise.
  GlooCommunicator(std::shared_ptr<GlooFamily> family, c10::intrusive_ptr<c10d::Store> store,
                   int rank, int world_size, const GlooOptions& options,
                   std::vector<int> global_ranks = {})
      : Communicator(rank, world_size, options.timeout(), std::move(global_ranks)),
        family_(std::move(family)),
        store_(std::move(store)),
        options_(options) {
    auto pg_options = c10d::ProcessGroupGloo::Options::create(options.timeout());
    pg_options->devices.push_back(make_device(options));
    pg_options->threads = 1;
    try {
      group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank, world_size, pg_options);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "Gloo: rank ", rank, " of ", world_size,
                  " could not connect to its peers within ", options.timeout().count(),
                  " ms: ", first_line(e.what()));
    }
    const std::vector<int> group = error_group();
    if (!group.empty()) group_name_ = absl::StrCat(" in group [", absl::StrJoin(group, ", "), "]");
    family_->add(this);
  }

  ~GlooCommunicator() override { family_->remove(this); }

  std::string backend_name() const override { return "gloo"; }

  void set_size_checks(bool enabled) override { family_->set_size_checks(enabled); }

  // For GlooWork, which sees failures when they are waited on: closes the connections,
  // names the lost rank and breaks the communicator. See Note [Naming the lost peer].
  CommError fail(CollectiveKind kind, int64_t sequence, const std::string& detail) {
    close_connections();
    family_->on_failure(this);
    const CommError error = comm_error(kind, sequence, family_->find_lost_peer(), detail);
    mark_broken(error);
    return error;
  }

  // Releases the collectives in flight and the process group: once nothing references
  // the Gloo context, its sockets close. The group's destructor waits for the collective
  // c10d is running, which fails fast once peers have closed (or at Gloo's timeout).
  void close_connections() {
    std::vector<std::weak_ptr<GlooWork>> in_flight;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_flight.swap(in_flight_);
      group = std::move(group_);
    }
    for (const std::weak_ptr<GlooWork>& weak : in_flight) {
      if (std::shared_ptr<GlooWork> work = weak.lock()) work->release();
    }
  }

 protected:
  // CUDA buffers are staged through host memory: see Note [Gloo on device tensors].
  bool supports_device(const c10::Device& device) const override {
    return device.is_cpu() || device.is_cuda();
  }

  WorkHandle do_all_gather(const CommBuffer& output, const CommBuffer& input,
                           int64_t sequence) override {
    HostStage out(output, /*copy_in=*/false), in(input, /*copy_in=*/true);
    return start(CollectiveKind::kAllGather, sequence, input.numel,
                 [&](c10d::ProcessGroupGloo& group, GlooWork& work) {
                   at::Tensor output_bytes = out.tensor().view(at::kByte);
                   at::Tensor input_bytes = in.tensor().view(at::kByte);
                   const int64_t n = input_bytes.numel();
                   output_bytes.narrow(0, rank() * n, n).copy_(input_bytes);
                   exchange(
                       group, work, sequence, [&](int /*to*/) { return input_bytes; },
                       [&](int from) { return output_bytes.narrow(0, from * n, n); });
                   return [out] { out.copy_out(); };
                 });
  }

  WorkHandle do_reduce_scatter(const CommBuffer& output, const CommBuffer& input, ReduceOp op,
                               int64_t sequence) override {
    HostStage out(output, /*copy_in=*/false), in(input, /*copy_in=*/true);
    return start(CollectiveKind::kReduceScatter, sequence, input.numel,
                 [&](c10d::ProcessGroupGloo& group, GlooWork& work) {
                   at::Tensor input_chunks = in.tensor();
                   at::Tensor output_tensor = out.tensor();
                   const int64_t n = output_tensor.numel();
                   const int me = rank(), world = world_size();
                   // The output receives a chunk itself, so an output inside the input (in place,
                   // as NCCL allows) would be overwritten before it is read: read a copy instead.
                   if (overlaps(out.host(), in.host())) input_chunks = input_chunks.clone();
                   // Peer `first`'s chunk lands in the output, the others' in `received`, in rank
                   // order. See Note [Gloo collectives] for the order of the sum.
                   const int first = me == 0 ? 1 : 0;
                   auto slot = [me, first](int r) { return r - (r > me) - (r > first); };
                   at::Tensor received =
                       at::empty({std::max(world - 2, 0) * n}, input_chunks.options());
                   auto chunk = [=](int r) {
                     return r == me      ? input_chunks.narrow(0, me * n, n)
                            : r == first ? output_tensor
                                         : received.narrow(0, slot(r) * n, n);
                   };
                   exchange(
                       group, work, sequence,
                       [&](int to) { return input_chunks.narrow(0, to * n, n).view(at::kByte); },
                       [&](int from) { return chunk(from).view(at::kByte); });
                   return [out, output_tensor, chunk, first, me, world, op] {
                     if (world == 1) {
                       output_tensor.copy_(chunk(me));
                     } else {
                       output_tensor.add_(chunk(1 - first));
                       for (int r = 2; r < world; ++r) output_tensor.add_(chunk(r));
                     }
                     if (op == ReduceOp::kAvg) output_tensor.div_(static_cast<double>(world));
                     out.copy_out();
                   };
                 });
  }

  WorkHandle do_all_reduce(const CommBuffer& tensor, ReduceOp op, int64_t sequence) override {
    HostStage stage(tensor, /*copy_in=*/true);
    return start(CollectiveKind::kAllReduce, sequence, tensor.numel,
                 [&](c10d::ProcessGroupGloo& group, GlooWork& work) {
                   std::vector<at::Tensor> tensors = {stage.tensor()};
                   work.add(group.allreduce(tensors), /*point_to_point=*/false);
                   const int world = world_size();
                   return [stage, result = tensors[0], op, world] {
                     if (op == ReduceOp::kAvg) result.div_(static_cast<double>(world));
                     stage.copy_out();
                   };
                 });
  }

  WorkHandle do_broadcast(const CommBuffer& tensor, int root, int64_t sequence) override {
    // Every rank copies in: the copy is what orders the collective after its stream.
    HostStage stage(tensor, /*copy_in=*/true);
    return start(CollectiveKind::kBroadcast, sequence, tensor.numel,
                 [&](c10d::ProcessGroupGloo& group, GlooWork& work) {
                   std::vector<at::Tensor> tensors = {stage.tensor().view(at::kByte)};
                   c10d::BroadcastOptions options;
                   options.rootRank = root;
                   work.add(group.broadcast(tensors, options), /*point_to_point=*/false);
                   return [stage] { stage.copy_out(); };
                 });
  }

  WorkHandle do_barrier(int64_t sequence) override {
    return start(CollectiveKind::kBarrier, sequence, 0,
                 [](c10d::ProcessGroupGloo& group, GlooWork& work) {
                   work.add(group.barrier(), /*point_to_point=*/false);
                   return [] {};
                 });
  }

  std::shared_ptr<Communicator> do_new_subgroup(const SubgroupSpec& spec) override {
    return std::make_shared<GlooCommunicator>(
        family_, c10::make_intrusive<c10d::PrefixStore>(spec.tag, store_), spec.rank,
        static_cast<int>(spec.ranks.size()), options_, spec.global_ranks);
  }

  // A family of its own: the failures of this family do not close it.
  std::shared_ptr<Communicator> do_new_side_channel(const SubgroupSpec& spec,
                                                    std::chrono::milliseconds timeout) override {
    GlooOptions options = options_;
    options.timeout(timeout);
    return std::make_shared<GlooCommunicator>(
        std::make_shared<GlooFamily>(store_, global_rank(), global_ranks(), family_),
        c10::make_intrusive<c10d::PrefixStore>(spec.tag, store_), spec.rank,
        static_cast<int>(spec.ranks.size()), options, spec.global_ranks);
  }

 private:
  static std::shared_ptr<::gloo::transport::Device> make_device(const GlooOptions& options) {
    if (!options.interface().empty()) {
      return c10d::ProcessGroupGloo::createDeviceForInterface(options.interface());
    }
    if (!options.hostname().empty()) {
      return c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname());
    }
    return c10d::ProcessGroupGloo::createDefaultDevice();
  }

  // Posts collective `sequence`'s direct exchange: to each peer, send(peer) (bytes); from
  // each, into receive(peer) (bytes of the same size). Peers in ring order (the next rank
  // first), so that no two ranks start with the same peer. The tag comes from the sequence
  // (every rank numbers its collectives alike: one message per pair and tag), at or above
  // 2^30, where no slot of c10d's collectives on the same Gloo context lies.
  template <typename SendFn, typename ReceiveFn>
  void exchange(c10d::ProcessGroupGloo& group, GlooWork& work, int64_t sequence, const SendFn& send,
                const ReceiveFn& receive) {
    constexpr int64_t kTagBase = int64_t{1} << 30;
    const int tag = static_cast<int>(kTagBase + sequence % kTagBase);
    const int world = world_size();
    for (int step = 1; step < world; ++step) {
      const int from = (rank() - step + world) % world;
      const int to = (rank() + step) % world;
      std::vector<at::Tensor> into = {receive(from)};
      work.add(group.recv(into, from, tag), /*point_to_point=*/true);
      std::vector<at::Tensor> what = {send(to)};
      work.add(group.send(what, to, tag), /*point_to_point=*/true);
    }
  }

  // Note [Mismatched sizes]
  // Ranks that pass different sizes to one collective (ranks running different units,
  // or in another order) make Gloo corrupt data silently or terminate the receiving
  // process from its transport thread (a message longer than expected), naming no cause.
  // With size checks on (Communicator::set_size_checks; FSDP turns them on for its first
  // iteration, and for every iteration with validate_execution_order), every collective
  // first all-gathers each rank's (kind, numel), blocking the issuing thread, and all
  // ranks raise the same error naming them. Without them see Note [Gloo terminations].
  void check_same_collective(c10d::ProcessGroupGloo& group, CollectiveKind kind, int64_t numel) {
    at::Tensor mine = at::empty({2}, at::kLong);
    mine.data_ptr<int64_t>()[0] = static_cast<int64_t>(kind);
    mine.data_ptr<int64_t>()[1] = numel;
    at::Tensor all = at::empty({2 * world_size()}, at::kLong);
    group._allgather_base(all, mine)->wait();
    const std::string mismatch =
        describe_mismatched_collectives(all.data_ptr<int64_t>(), global_ranks(), kind, numel);
    if (!mismatch.empty()) throw MismatchedCollectives(mismatch);
  }

  // Starts collective `sequence` on the issuing thread: records it (Note [Gloo
  // terminations]), checks sizes if asked, then `post` posts its c10d works on the
  // GlooWork and returns what completes it. A failure of any step is raised by wait().
  template <typename PostFn>
  WorkHandle start(CollectiveKind kind, int64_t sequence, int64_t numel, const PostFn& post) {
    auto work =
        std::make_shared<GlooWork>(weak_from_this(), kind, sequence, global_rank(), timeout());
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      group = group_;
      // Forget the collectives that are done or gone; keep this one for close_connections.
      in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(),
                                      [](const std::weak_ptr<GlooWork>& weak) {
                                        std::shared_ptr<GlooWork> w = weak.lock();
                                        return !w || w->done();
                                      }),
                       in_flight_.end());
      if (group) in_flight_.push_back(work);
    }
    record_started(kind, sequence, group_name_);
    try {
      TORCH_CHECK(group,
                  "the connections were closed after an earlier collective of this process "
                  "failed");
      if (family_->size_checks()) check_same_collective(*group, kind, numel);
      work->set_finish(post(*group, *work));
    } catch (...) {
      work->set_failed(std::current_exception());
    }
    return work;
  }

  std::shared_ptr<GlooFamily> family_;  // first: outlives the group (rank 0's store)
  c10::intrusive_ptr<c10d::Store> store_;
  GlooOptions options_;
  std::string group_name_;  // " in group [0, 2]" for a subgroup, for record_started
  std::mutex mutex_;        // guards group_ and in_flight_
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;  // null once the connections are closed
  std::vector<std::weak_ptr<GlooWork>> in_flight_;    // issued, not yet waited for
};

void GlooFamily::on_failure(GlooCommunicator* source) {
  failed_ = true;
  std::lock_guard<std::mutex> lock(mutex_);
  for (GlooCommunicator* member : members_) {
    if (member != source) member->close_connections();
  }
}

void GlooWork::wait(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> waiting(wait_mutex_);
  if (completed_) return;
  if (error_) std::rethrow_exception(error_);
  std::vector<Posted> posted;
  bool released = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    posted = posted_;
    released = released_;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string detail;
  try {
    if (failed_) std::rethrow_exception(failed_);
    for (const Posted& p : posted) {
      if (released) break;
      // c10d reads a zero timeout as none.
      const auto left = std::max(std::chrono::milliseconds(1),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     deadline - std::chrono::steady_clock::now()));
      if (!p.work->wait(left)) {  // a send or receive aborted by release()
        released = true;
      }
    }
    if (released) {
      detail = "the connections were closed after a collective of this process failed";
    } else {
      finish_();
      // Let go of the buffers now (the c10d works and the completion hold views of
      // them), not when the caller drops this work: freed memory is reused sooner.
      finish_ = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        posted_.clear();
      }
      completed_ = true;
      return;
    }
  } catch (const CommError&) {
    throw;
  } catch (const MismatchedCollectives& e) {
    detail = e.what();
  } catch (const std::exception& e) {
    detail = std::chrono::steady_clock::now() >= deadline
                 ? absl::StrCat("did not complete within ", timeout.count(), " ms")
                 : first_line(e.what());
  }
  posted.clear();  // so that closing the connections closes them
  try {
    fail(detail);
  } catch (const CommError&) {
    error_ = std::current_exception();
    throw;
  }
}

void GlooWork::fail(const std::string& detail) {
  std::shared_ptr<GlooCommunicator> comm = comm_.lock();
  if (!comm) throw CommError(collective_name(kind_), sequence_, global_rank_, -1, detail);
  throw comm->fail(kind_, sequence_, detail);
}

}  // namespace

std::shared_ptr<Communicator> make_gloo_communicator(c10::intrusive_ptr<c10d::Store> store,
                                                     int rank, int world_size,
                                                     const GlooOptions& options) {
  TORCH_CHECK(store, "make_gloo_communicator: store is null");
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
              "make_gloo_communicator: expected 0 <= rank < world_size, got rank ", rank,
              " and world_size ", world_size);
  ignore_sigpipe_by_default();
  last_collective().rank = rank;
  name_gloo_terminations_by_default();
  std::vector<int> ranks(world_size);
  std::iota(ranks.begin(), ranks.end(), 0);
  auto family = std::make_shared<GlooFamily>(store, rank, std::move(ranks));
  return std::make_shared<GlooCommunicator>(std::move(family), std::move(store), rank, world_size,
                                            options);
}

namespace comm_internal {

std::shared_ptr<Communicator> make_gloo_group(c10::intrusive_ptr<c10d::Store> store, int rank,
                                              std::vector<int> global_ranks,
                                              const GlooOptions& options) {
  TORCH_CHECK(store, "make_gloo_group: store is null");
  const int world_size = static_cast<int>(global_ranks.size());
  TORCH_INTERNAL_ASSERT(rank >= 0 && rank < world_size, "make_gloo_group: rank ", rank,
                        " of a group of ", world_size);
  ignore_sigpipe_by_default();
  name_gloo_terminations_by_default();
  auto family = std::make_shared<GlooFamily>(store, global_ranks[rank], global_ranks);
  return std::make_shared<GlooCommunicator>(std::move(family), std::move(store), rank, world_size,
                                            options, std::move(global_ranks));
}

}  // namespace comm_internal
}  // namespace fsdp
