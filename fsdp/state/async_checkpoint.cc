#include "fsdp/state/async_checkpoint.h"

#include <atomic>
#include <exception>
#include <future>
#include <iostream>
#include <mutex>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include <c10/util/Exception.h>

namespace fsdp {

struct AsyncSave::State {
  std::shared_future<void> done;
  // Whether a wait() has raised (or returned) the outcome: the next save and
  // wait_for_async_saves rethrow an error only when nobody saw it.
  std::atomic<bool> observed{false};
};

void AsyncSave::wait() const {
  if (state_ == nullptr) return;
  state_->observed = true;
  state_->done.get();
}

bool AsyncSave::ready() const {
  return state_ == nullptr ||
         state_->done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

namespace {

// The asynchronous save in flight on one communicator (one per process, except where
// ranks are threads of one process: then one per rank, so that no rank waits for
// another's save).
class Slot {
 public:
  // Waits for the save in flight; rethrows its error unless a wait() saw it.
  void finish() {
    std::shared_ptr<AsyncSave::State> last = std::exchange(last_, nullptr);
    if (last == nullptr) return;
    last->done.wait();
    if (!last->observed.exchange(true)) last->done.get();
  }
  void start(std::shared_ptr<AsyncSave::State> state) { last_ = std::move(state); }
  std::mutex& mutex() { return mutex_; }

 private:
  std::mutex mutex_;  // held from a save's wait for the previous one to its start
  std::shared_ptr<AsyncSave::State> last_;
};

// Every slot of the process, by communicator. Its destructor (at exit) waits for them.
// A slot outlives its communicator: it holds only the future, and the write holds its
// own communicator.
class Registry {
 public:
  static Registry& get() {
    static Registry registry;
    return registry;
  }

  ~Registry() {
    for (const std::shared_ptr<Slot>& slot : slots()) {
      try {
        std::lock_guard<std::mutex> lock(slot->mutex());
        slot->finish();
      } catch (const std::exception& e) {
        const auto* error = dynamic_cast<const c10::Error*>(&e);
        std::cerr << "fsdp: an asynchronous checkpoint save in flight at exit failed: "
                  << (error != nullptr ? error->what_without_backtrace() : e.what()) << std::endl;
      }
    }
  }

  std::shared_ptr<Slot> slot(const Communicator& comm) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<Slot>& slot = slots_[&comm];
    if (slot == nullptr) slot = std::make_shared<Slot>();
    return slot;
  }

  std::vector<std::shared_ptr<Slot>> slots() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<Slot>> all;
    for (const auto& item : slots_) all.push_back(item.second);
    return all;
  }

 private:
  std::mutex mutex_;
  absl::flat_hash_map<const Communicator*, std::shared_ptr<Slot>> slots_;
};

}  // namespace

// Note [A communicator for checkpoint I/O]
// The background write runs collectives (the partial directory's token, "every rank
// wrote its file", the metadata records) while the training loop runs its own. On one
// communicator the two streams of collectives would interleave in a different order on
// different ranks, and a collective of one rank would meet another kind of collective
// (or another size) of its peer: a hang, corrupt data, or Gloo terminating the process.
// So each asynchronous save writes over a communicator of its own, made on the caller's
// thread at the same point on every rank (so every rank makes the same groups in the
// same order): once (make_checkpoint_communicator, passed as AsyncSaveOptions'
// communicator: what the GPT trainer does), or by each save, dropped when its write ends
// (no option: simple, but it costs a connection set-up per save, and a rank killed
// during that set-up is reported as a connect error rather than as a collective's). It is
// not cached behind the caller's back: a cache keyed by the communicator's address would
// hand a dead family's group to a new communicator at the same address.
//   It is a host group (Communicator::new_host_subgroup) and the write's collectives run
// on CPU tensors, whatever the model's device. Those collectives move a few bytes and
// need no GPU, and a device backend must not see them: with NCCL, a collective issued
// from the save thread would be ordered after that thread's current stream (the legacy
// default stream, which synchronizes with the training thread's blocking streams), and
// two NCCL communicators whose kernels the ranks launch in different orders can deadlock
// (NCCL's documentation on using several communicators at once). So for NCCL the host
// group is a Gloo group over the same store (Note [Host groups of the NCCL backend] in
// fsdp/comm/nccl.cc), and no NCCL call is ever made off the training thread. For Gloo it
// is a second Gloo group of the family over the same store (as dist.new_group makes one),
// for the fake backend a fake world of its own. PyTorch's dcp.async_save writes over the
// process_group it is given, and users give it dist.new_group(backend="gloo").
//   A store-only commit protocol was the other choice; it would duplicate the sync save's
// protocol (agreement on failure, the metadata gather), whereas this way the background
// thread runs exactly the code of save_sharded_checkpoint. Saves never overlap each other
// (a save waits for the previous one), so at most one such communicator exists at a
// time. A rank lost during the write fails the write's collectives (Gloo sees its
// connections close, or the timeout). A host group is outside the family's collective
// schedule (its collectives run at times that differ from rank to rank). With Gloo, size
// checks (Communicator::set_size_checks) are one switch for a whole family, the host
// group included; FSDP turns them on for its first iteration only (and for every one with
// validate_execution_order), so a save made before the first iteration has ended could
// see them switch mid-write on one rank and not yet on another: save after the first step
// (as the trainer does).

std::shared_ptr<Communicator> make_checkpoint_communicator(Communicator& comm) {
  std::vector<int> ranks(comm.world_size());
  std::iota(ranks.begin(), ranks.end(), 0);
  return comm.new_host_subgroup(ranks);
}

AsyncSave async_save(Communicator& comm, const std::function<CheckpointWrite()>& stage,
                     const AsyncSaveOptions& options) {
  const std::shared_ptr<Communicator>& given = options.communicator();
  if (given != nullptr) {
    TORCH_CHECK(given.get() != &comm,
                "async_save: AsyncSaveOptions::communicator is the model's communicator "
                "itself; the writes' collectives would interleave with training's: pass "
                "make_checkpoint_communicator(comm)");
    TORCH_CHECK(given->world_size() == comm.world_size() && given->rank() == comm.rank(),
                "async_save: AsyncSaveOptions::communicator must span the model's ranks in "
                "their order; found rank ",
                given->rank(), " of ", given->world_size(), " on rank ", comm.rank(), " of ",
                comm.world_size(), ": pass make_checkpoint_communicator(comm)");
    TORCH_CHECK(given->moves_buffers_on(at::kCPU),
                "async_save: AsyncSaveOptions::communicator must move CPU buffers (the "
                "writes' collectives run on CPU tensors); the ",
                given->backend_name(),
                " backend's does not: pass make_checkpoint_communicator(comm)");
  }
  const std::shared_ptr<Slot> slot = Registry::get().slot(comm);
  std::lock_guard<std::mutex> lock(slot->mutex());
  slot->finish();
  CheckpointWrite write = stage();
  TORCH_CHECK(write, "async_save: the stage function returned no write");
  // See Note [A communicator for checkpoint I/O].
  std::shared_ptr<Communicator> own = given != nullptr ? given : make_checkpoint_communicator(comm);
  auto state = std::make_shared<AsyncSave::State>();
  state->done = std::async(std::launch::async, [write = std::move(write), own]() mutable {
                  write(*own);
                  own.reset();
                }).share();
  slot->start(state);
  return AsyncSave(state);
}

AsyncSave async_save_sharded_checkpoint(FullyShardedRoot& model,
                                        const torch::optim::Optimizer* optimizer,
                                        const std::string& dir, const SchedulerState* scheduler,
                                        const AsyncSaveOptions& options) {
  return async_save(
      model.communicator(),
      [&]() -> CheckpointWrite {
        StagedShardedCheckpoint staged_here = stage_sharded_checkpoint(model, optimizer, scheduler);
        staged_here.device = at::kCPU;  // See Note [A communicator for checkpoint I/O].
        auto staged = std::make_shared<const StagedShardedCheckpoint>(std::move(staged_here));
        return [staged, dir](Communicator& comm) { write_sharded_checkpoint(*staged, dir, comm); };
      },
      options);
}

AsyncSave async_save_dcp_checkpoint(FullyShardedRoot& model,
                                    const torch::optim::Optimizer* optimizer,
                                    const std::string& dir, const DcpCheckpointOptions& dcp_options,
                                    const SchedulerState* scheduler,
                                    const AsyncSaveOptions& options) {
  return async_save(
      model.communicator(),
      [&]() -> CheckpointWrite {
        DcpCheckpointOptions with_scheduler = dcp_options;
        if (scheduler != nullptr)
          with_scheduler.extras().push_back(scheduler_dcp_extra(*scheduler));
        StagedDcpCheckpoint staged_here = stage_dcp_checkpoint(model, optimizer, with_scheduler);
        staged_here.collective_device = at::kCPU;  // See Note [A communicator for checkpoint I/O].
        auto staged = std::make_shared<const StagedDcpCheckpoint>(std::move(staged_here));
        return [staged, dir](Communicator& comm) { write_dcp_checkpoint(*staged, dir, comm); };
      },
      options);
}

void wait_for_async_saves() {
  std::exception_ptr first_error;
  for (const std::shared_ptr<Slot>& slot : Registry::get().slots()) {
    try {
      std::lock_guard<std::mutex> lock(slot->mutex());
      slot->finish();
    } catch (...) {
      if (first_error == nullptr) first_error = std::current_exception();
    }
  }
  if (first_error != nullptr) std::rethrow_exception(first_error);
}

}  // namespace fsdp
