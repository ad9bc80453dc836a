#include "fsdp/comm/fake.h"

#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace comm_internal {

// What one rank brings to a collective.
struct Arrival {
  CollectiveKind kind;
  CommBuffer input;
  int64_t numel;
  int root;
};

// The ranks of one (sub)group meeting at numbered collectives. Each collective is two
// barriers: after the first every rank reads all inputs into a private result; after the
// second (nobody reads any more) each writes its result, so in-place ops are safe.
//
// Note [Fake collectives on device buffers]
// On a device (CUDA), ranks are threads that each queue work on their own current stream
// (FakeWorld's callers set one per thread), and a collective runs on the thread of each
// rank that issues it, as a blocking one: (1) before arriving, a rank synchronizes its
// current stream, so its input is complete when peers read it (NCCL's equivalent: the
// collective starts after an event recorded on the issuing stream); (2) each rank reads
// the peers' inputs into its private result on its own stream and synchronizes before
// the second meeting, so no peer overwrites an input still being read; (3) it copies the
// result into its output on its own stream and synchronizes, so the returned work is
// complete, and so is the output for every stream. Slow (three host synchronizations a
// collective), exact and simple: for tests. CPU buffers skip the synchronizations.
class FakeGroup {
 public:
  // What FakeWorld::calls() returns: one log for a world and its subgroups.
  class CallLog {
   public:
    void add(FakeWorld::Call call) {
      std::lock_guard<std::mutex> lock(mutex_);
      calls_.push_back(std::move(call));
    }
    std::vector<FakeWorld::Call> calls() const {
      std::lock_guard<std::mutex> lock(mutex_);
      return calls_;
    }

   private:
    mutable std::mutex mutex_;
    std::vector<FakeWorld::Call> calls_;
  };

  // `global_ranks`: a subgroup's members as world ranks; empty for the world. `log`: the
  // world's (null: a world of its own, with a new log).
  FakeGroup(int world_size, std::chrono::milliseconds timeout, std::vector<int> global_ranks = {},
            std::shared_ptr<CallLog> log = nullptr)
      : world_size_(world_size),
        timeout_(timeout),
        global_ranks_(std::move(global_ranks)),
        log_(log != nullptr ? std::move(log) : std::make_shared<CallLog>()) {}

  int world_size() const { return world_size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  CallLog& log() { return *log_; }

  // Blocks until every rank arrived at `sequence` (phase 0) or finished reading (phase
  // 1). Returns all arrivals. Throws CommError naming a missing or mismatched rank (see
  // Note [Communication errors]: in global ranks).
  std::vector<Arrival> meet(int rank, int64_t sequence, int phase, const Arrival& mine) {
    std::unique_lock<std::mutex> lock(mutex_);
    Meeting& meeting = meetings_[{sequence, phase}];
    if (meeting.arrivals.empty()) meeting.arrivals.resize(world_size_);
    meeting.arrivals[rank] = mine;
    meeting.present.insert(rank);
    cv_.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const std::string name = collective_name(mine.kind);
    while (static_cast<int>(meeting.present.size()) < world_size_) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
          static_cast<int>(meeting.present.size()) < world_size_) {
        std::vector<int> missing;
        for (int r = 0; r < world_size_; ++r) {
          if (meeting.present.count(r) == 0) missing.push_back(global(r));
        }
        throw CommError(name, sequence, global(rank), missing.front(),
                        absl::StrCat("rank(s) ", absl::StrJoin(missing, ", "),
                                     " did not reach it within ", timeout_.count(), " ms"),
                        global_ranks_);
      }
    }
    std::vector<Arrival> all = meeting.arrivals;
    if (++meeting.departed == world_size_) meetings_.erase({sequence, phase});
    for (int r = 0; r < world_size_; ++r) {
      if (all[r].kind != mine.kind || all[r].numel != mine.numel || all[r].root != mine.root) {
        throw CommError(name, sequence, global(rank), global(r),
                        absl::StrCat("rank ", global(r), " issued ", collective_name(all[r].kind),
                                     " of ", all[r].numel, " elements (root ", all[r].root,
                                     ") at the same point; every rank must issue the same "
                                     "collectives in the same order"),
                        global_ranks_);
      }
    }
    return all;
  }

  // The subgroup `tag` (made by the first member that asks). `timeout`: the group's, if
  // not this one's. `own_log`: a world of its own (a host group), else it shares this
  // group's log.
  std::shared_ptr<FakeGroup> subgroup(const std::string& tag, const std::vector<int>& global_ranks,
                                      std::optional<std::chrono::milliseconds> timeout = {},
                                      bool own_log = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& group = subgroups_[tag];
    if (!group) {
      group = std::make_shared<FakeGroup>(static_cast<int>(global_ranks.size()),
                                          timeout.value_or(timeout_), global_ranks,
                                          own_log ? nullptr : log_);
    }
    return group;
  }

  void inject_failure(int rank, int64_t sequence) {
    std::lock_guard<std::mutex> lock(mutex_);
    failures_.insert({rank, sequence});
  }
  bool should_fail(int rank, int64_t sequence) {
    std::lock_guard<std::mutex> lock(mutex_);
    return failures_.count({rank, sequence}) > 0;
  }

 private:
  int global(int rank) const { return global_ranks_.empty() ? rank : global_ranks_[rank]; }

  struct Meeting {
    std::vector<Arrival> arrivals;
    std::set<int> present;
    int departed = 0;
  };
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  const std::vector<int> global_ranks_;
  const std::shared_ptr<CallLog> log_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::pair<int64_t, int>, Meeting> meetings_;
  std::map<std::string, std::shared_ptr<FakeGroup>> subgroups_;
  std::set<std::pair<int, int64_t>> failures_;
};

namespace {

// Blocks until the work queued so far on the calling thread's current stream of
// `device` has finished. CPU: returns at once (ops ran synchronously). Other devices go
// through c10's device-generic guard, which dispatches to the device's runtime (CUDA's
// once libc10_cuda is loaded), so this target needs no CUDA headers.
void synchronize_current_stream(const c10::Device& device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
}

// A work that already finished, successfully or with an error.
class DoneWork : public Work {
 public:
  DoneWork(std::chrono::milliseconds timeout, std::exception_ptr error)
      : Work(timeout), error_(std::move(error)) {}
  void wait(std::chrono::milliseconds) override {
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override { return true; }

 private:
  std::exception_ptr error_;
};

class FakeCommunicator : public Communicator {
 public:
  FakeCommunicator(std::shared_ptr<FakeGroup> group, int rank, std::vector<int> global_ranks = {})
      : Communicator(rank, group->world_size(), group->timeout(), std::move(global_ranks)),
        group_(std::move(group)) {}

  std::string backend_name() const override { return "fake"; }

 protected:
  bool supports_device(const c10::Device& device) const override {
    return device.is_cpu() || device.is_cuda();
  }

  WorkHandle do_all_gather(const CommBuffer& output, const CommBuffer& input,
                           int64_t sequence) override {
    return run(
        {CollectiveKind::kAllGather, input, input.numel, -1}, sequence,
        [&](const std::vector<Arrival>& all) {
          std::vector<at::Tensor> parts;
          for (const Arrival& a : all) parts.push_back(a.input.as_tensor().clone());
          return at::cat(parts);
        },
        output);
  }

  WorkHandle do_reduce_scatter(const CommBuffer& output, const CommBuffer& input, ReduceOp op,
                               int64_t sequence) override {
    return run(
        {CollectiveKind::kReduceScatter, input, input.numel, -1}, sequence,
        [&](const std::vector<Arrival>& all) {
          return reduce(all, op, rank() * output.numel, output.numel);
        },
        output);
  }

  WorkHandle do_all_reduce(const CommBuffer& tensor, ReduceOp op, int64_t sequence) override {
    return run(
        {CollectiveKind::kAllReduce, tensor, tensor.numel, -1}, sequence,
        [&](const std::vector<Arrival>& all) { return reduce(all, op, 0, tensor.numel); }, tensor);
  }

  WorkHandle do_broadcast(const CommBuffer& tensor, int root, int64_t sequence) override {
    return run(
        {CollectiveKind::kBroadcast, tensor, tensor.numel, root}, sequence,
        [&](const std::vector<Arrival>& all) { return all[root].input.as_tensor().clone(); },
        tensor);
  }

  WorkHandle do_barrier(int64_t sequence) override {
    return run(
        {CollectiveKind::kBarrier, CommBuffer{}, 0, -1}, sequence,
        [](const std::vector<Arrival>&) { return at::Tensor(); }, CommBuffer{});
  }

  std::shared_ptr<Communicator> do_new_subgroup(const SubgroupSpec& spec) override {
    return std::make_shared<FakeCommunicator>(group_->subgroup(spec.tag, spec.global_ranks),
                                              spec.rank, spec.global_ranks);
  }

  // A world of its own. See "Host groups" in fake.h.
  std::shared_ptr<Communicator> do_new_host_subgroup(const SubgroupSpec& spec) override {
    return std::make_shared<FakeCommunicator>(
        group_->subgroup(spec.tag, spec.global_ranks, std::nullopt, /*own_log=*/true), spec.rank,
        spec.global_ranks);
  }

  std::shared_ptr<Communicator> do_new_side_channel(const SubgroupSpec& spec,
                                                    std::chrono::milliseconds timeout) override {
    return std::make_shared<FakeCommunicator>(
        group_->subgroup(spec.tag, spec.global_ranks, timeout), spec.rank, spec.global_ranks);
  }

 private:
  // Sums chunk [offset, offset + numel) of every rank's input in rank order.
  static at::Tensor reduce(const std::vector<Arrival>& all, ReduceOp op, int64_t offset,
                           int64_t numel) {
    at::Tensor sum = all[0].input.as_tensor().narrow(0, offset, numel).clone();
    for (size_t r = 1; r < all.size(); ++r) {
      sum.add_(all[r].input.as_tensor().narrow(0, offset, numel));
    }
    if (op == ReduceOp::kAvg) sum.div_(static_cast<double>(all.size()));
    return sum;
  }

  template <typename Compute>
  WorkHandle run(const Arrival& mine, int64_t sequence, Compute compute, const CommBuffer& output) {
    group_->log().add(
        {global_rank(), mine.kind, error_group(), std::this_thread::get_id(), mine.input.device});
    try {
      if (group_->should_fail(rank(), sequence)) {
        throw comm_error(mine.kind, sequence, -1, "injected failure (FakeWorld::inject_failure)");
      }
      // Note [Fake collectives on device buffers]: this rank's input is complete before
      // any peer reads it.
      synchronize_current_stream(mine.input.device);
      at::Tensor result = compute(group_->meet(rank(), sequence, 0, mine));
      // This rank's reads of its peers' inputs are done before any peer writes its output
      // (which may be its input) after the second meeting.
      synchronize_current_stream(mine.input.device);
      group_->meet(rank(), sequence, 1, mine);  // everyone has read the inputs
      if (result.defined()) {
        output.as_tensor().copy_(result);
        synchronize_current_stream(output.device);  // the output is complete: the work is done
      }
      return std::make_shared<DoneWork>(timeout(), nullptr);
    } catch (const CommError& error) {
      mark_broken(error);
      return std::make_shared<DoneWork>(timeout(), std::current_exception());
    }
  }

  std::shared_ptr<FakeGroup> group_;
};

}  // namespace
}  // namespace comm_internal

FakeWorld::FakeWorld(std::shared_ptr<comm_internal::FakeGroup> group) : group_(std::move(group)) {}

std::shared_ptr<FakeWorld> FakeWorld::create(int world_size, std::chrono::milliseconds timeout) {
  TORCH_CHECK(world_size >= 1, "FakeWorld: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(timeout.count() > 0, "FakeWorld: timeout must be positive");
  return std::shared_ptr<FakeWorld>(
      new FakeWorld(std::make_shared<comm_internal::FakeGroup>(world_size, timeout)));
}

std::shared_ptr<Communicator> FakeWorld::communicator(int rank) {
  return std::make_shared<comm_internal::FakeCommunicator>(group_, rank);
}

void FakeWorld::inject_failure(int rank, int64_t sequence) {
  group_->inject_failure(rank, sequence);
}

int FakeWorld::world_size() const { return group_->world_size(); }

std::vector<FakeWorld::Call> FakeWorld::calls() const { return group_->log().calls(); }

void FakeWorld::run(const std::shared_ptr<FakeWorld>& world,
                    const std::function<void(Communicator&)>& fn) {
  const int n = world->world_size();
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < n; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        std::shared_ptr<Communicator> comm = world->communicator(rank);
        fn(*comm);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

}  // namespace fsdp
