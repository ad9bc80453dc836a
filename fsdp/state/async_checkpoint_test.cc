// Asynchronous saves on ranks as threads: what is written is what was staged while
// training goes on, saves are ordered, errors reach the caller once, exit waits. The
// crash safety of a save killed mid-write is tested with real processes in
// tests/async_save_kill_test.sh.
#include "fsdp/state/async_checkpoint.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/state/testing/state_dict_testing.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using ::fsdp::state_testing::scratch;

void train(FullyShardedDataParallel<TinyLmImpl>& model, torch::optim::Optimizer& optimizer,
           int first_step, int steps, const Communicator& comm) {
  for (int step = first_step; step < first_step + steps; ++step) {
    const Batch batch = TinyLmImpl::batch(step, kBatchPerRank * comm.world_size());
    optimizer.zero_grad();
    TinyLmImpl::loss(
        model->forward(batch.input.narrow(0, kBatchPerRank * comm.rank(), kBatchPerRank)),
        batch.target.narrow(0, kBatchPerRank * comm.rank(), kBatchPerRank))
        .backward();
    optimizer.step();
  }
}

void expect_equal(const StateDict& got, const StateDict& want) {
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& item : want) EXPECT_TRUE(got[item.key()].equal(item.value())) << item.key();
}

TEST(AsyncSave, WritesWhatWasStagedWhileTrainingGoesOnAndLoadsAtOtherWorldSizes) {
  const fs::path root = scratch("async_staged");
  const std::string dir = (root / "step_00000002").string();
  const SchedulerState scheduler{2, {0.01, 0.005}};
  StateDict want_model;
  OptimStateDict want_optim;
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::Adagrad adagrad(model->parameters(), torch::optim::AdagradOptions(0.05));
    train(model, adagrad, 0, 2, *comm);
    const StateDict full = full_state_dict(*model);
    const OptimStateDict optim = full_optim_state_dict(*model, adagrad);
    if (comm->rank() == 0) {
      want_model = full;
      want_optim = optim;
    }
    AsyncSave save = async_save_sharded_checkpoint(*model, &adagrad, dir, &scheduler);
    train(model, adagrad, 2, 2, *comm);  // changes the model while the write may run
    save.wait();
    EXPECT_TRUE(save.ready());
    EXPECT_FALSE(full_state_dict(*model)["embedding.weight"].equal(full["embedding.weight"]));
  });
  EXPECT_EQ(std::distance(fs::directory_iterator(root), fs::directory_iterator()), 1)
      << "no partial directory left";
  for (int w : {3, 1}) {
    on_ranks(w, [&](std::shared_ptr<Communicator> comm) {
      FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                                 FullyShardedDataParallelOptions(comm));
      torch::optim::Adagrad adagrad(model->parameters(), torch::optim::AdagradOptions(0.05));
      const std::optional<SchedulerState> loaded = load_sharded_checkpoint(*model, &adagrad, dir);
      ASSERT_TRUE(loaded.has_value());
      EXPECT_EQ(*loaded, scheduler);
      expect_equal(full_state_dict(*model), want_model);
      const OptimStateDict optim = full_optim_state_dict(*model, adagrad);
      ASSERT_EQ(optim.keys(), want_optim.keys());
      for (const auto& item : want_optim) expect_equal(optim[item.key()], item.value());
    });
  }
}

TEST(AsyncSave, SchedulerStateIsOptionalAndLoadLatestReturnsIt) {
  const fs::path root = scratch("async_scheduler");
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    save_sharded_checkpoint(*model, nullptr, (root / "a").string());
    EXPECT_FALSE(load_sharded_checkpoint(*model, nullptr, (root / "a").string()).has_value());
    const SchedulerState scheduler{7, {}};  // no param groups: no "scheduler/last_lr" piece
    save_sharded_checkpoint(*model, nullptr, (root / "b").string(), &scheduler);
    const std::optional<LoadedCheckpoint> latest =
        load_latest_sharded_checkpoint(*model, nullptr, root.string());
    ASSERT_TRUE(latest.has_value());
    EXPECT_EQ(latest->dir, (root / "b").string());
    ASSERT_TRUE(latest->scheduler.has_value());
    EXPECT_EQ(*latest->scheduler, scheduler);
  });
}

// A DCP folder written in the background (the GPT trainer's default): what was staged,
// the extras and the scheduler state ("lr_scheduler.last_epoch", "lr_scheduler._last_lr"),
// which load_latest_sharded_checkpoint gives back; Adagrad state and param_groups at W = 3.
TEST(AsyncSave, DcpFolderWithTheSchedulerLoadsAtAnotherWorldSize) {
  const fs::path root = scratch("async_dcp");
  const std::string dir = (root / "step_00000002").string();
  const SchedulerState scheduler{2, {0.01, 0.005}};
  StateDict want_model;
  OptimStateDict want_optim;
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::Adagrad adagrad(model->parameters(),
                                  torch::optim::AdagradOptions(0.05).lr_decay(0.1));
    train(model, adagrad, 0, 2, *comm);
    const StateDict full = full_state_dict(*model);
    const OptimStateDict optim = full_optim_state_dict(*model, adagrad);
    if (comm->rank() == 0) {
      want_model = full;
      want_optim = optim;
    }
    AsyncSave save = async_save_dcp_checkpoint(
        *model, &adagrad, dir, DcpCheckpointOptions().extras({{"step", int64_t{2}}}), &scheduler);
    train(model, adagrad, 2, 2, *comm);  // changes the model while the write may run
    save.wait();
  });
  EXPECT_TRUE(fs::exists(fs::path(dir) / ".metadata"));
  on_ranks(3, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::Adagrad adagrad(model->parameters(), torch::optim::AdagradOptions(1.0));
    const std::optional<LoadedCheckpoint> latest =
        load_latest_sharded_checkpoint(*model, &adagrad, root.string());
    ASSERT_TRUE(latest.has_value());
    ASSERT_TRUE(latest->scheduler.has_value());
    EXPECT_EQ(*latest->scheduler, scheduler);
    ASSERT_EQ(latest->extras.size(), 3u);
    EXPECT_EQ(latest->extras[0].first, "step");
    EXPECT_EQ(latest->extras[1].first, "lr_scheduler.last_epoch");
    EXPECT_EQ(latest->extras[2].first, "lr_scheduler._last_lr");
    expect_equal(full_state_dict(*model), want_model);
    const OptimStateDict optim = full_optim_state_dict(*model, adagrad);
    ASSERT_EQ(optim.keys(), want_optim.keys());
    for (const auto& item : want_optim) expect_equal(optim[item.key()], item.value());
    const auto& options =
        static_cast<const torch::optim::AdagradOptions&>(adagrad.param_groups()[0].options());
    EXPECT_EQ(options.lr(), 0.05);
    EXPECT_EQ(options.lr_decay(), 0.1);
  });
  EXPECT_THAT(
      [] {
        scheduler_from_dcp_extras({{"lr_scheduler.last_epoch", 2.5}});
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr(
          "'lr_scheduler.last_epoch' (an int) and 'lr_scheduler._last_lr' (a list of "
          "floats)")));
}

// Note [A communicator for checkpoint I/O]: the writes' collectives go over a host group
// on CPU tensors, so no collective of the model's communicator family (with NCCL: no
// NCCL call) is issued by any thread but the rank's own while asynchronous saves (both
// formats, with and without a given communicator) run beside training, at W = 2 and 4.
TEST(AsyncSave, NoCollectiveOfTheModelsCommunicatorLeavesItsRanksThread) {
  for (const int w : {2, 4}) {
    const fs::path root = scratch(absl::StrCat("async_threads_", w));
    const auto world = FakeWorld::create(w);
    std::vector<std::thread::id> owners(w);
    FakeWorld::run(world, [&](Communicator& rank_comm) {
      const std::shared_ptr<Communicator> comm(&rank_comm, [](Communicator*) {});
      owners[comm->rank()] = std::this_thread::get_id();
      FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                                 FullyShardedDataParallelOptions(comm));
      torch::optim::Adagrad adagrad(model->parameters(), torch::optim::AdagradOptions(0.05));
      train(model, adagrad, 0, 1, *comm);
      AsyncSave sharded =
          async_save_sharded_checkpoint(*model, &adagrad, (root / "sharded").string());
      train(model, adagrad, 1, 1, *comm);
      AsyncSave dcp = async_save_dcp_checkpoint(
          *model, &adagrad, (root / "dcp").string(), {}, nullptr,
          AsyncSaveOptions().communicator(make_checkpoint_communicator(*comm)));
      train(model, adagrad, 2, 1, *comm);
      sharded.wait();
      dcp.wait();
    });
    EXPECT_TRUE(fs::exists(root / "sharded" / "metadata.pt")) << "W = " << w;
    EXPECT_TRUE(fs::exists(root / "dcp" / ".metadata")) << "W = " << w;
    const std::vector<FakeWorld::Call> calls = world->calls();
    EXPECT_GT(calls.size(), 0u);
    int64_t elsewhere = 0;
    for (const FakeWorld::Call& call : calls) elsewhere += call.thread != owners[call.rank];
    EXPECT_EQ(elsewhere, 0) << "W = " << w << ": " << elsewhere << " of " << calls.size()
                            << " collectives of the model's communicator family were issued "
                               "off their rank's thread";
  }
}

TEST(AsyncSave, ASecondSaveWaitsForTheFirstAndWritesRunOffTheCallersThread) {
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    std::atomic<bool> first_written{false};
    const std::thread::id caller = std::this_thread::get_id();
    AsyncSave first = async_save(*comm, [&]() -> CheckpointWrite {
      return [&](Communicator& own) {
        EXPECT_NE(std::this_thread::get_id(), caller);
        EXPECT_NE(&own, comm.get());
        EXPECT_EQ(own.world_size(), 2);
        EXPECT_EQ(own.rank(), comm->rank());
        // Collectives of the write's own communicator run beside the caller's.
        at::Tensor x = at::ones({3});
        own.all_reduce(x);
        EXPECT_TRUE(x.equal(at::full({3}, 2.0)));
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        first_written = true;
      };
    });
    at::Tensor y = at::ones({2});
    comm->all_reduce(y);  // the training loop's collectives go on meanwhile
    EXPECT_TRUE(y.equal(at::full({2}, 2.0)));
    EXPECT_FALSE(first.ready());
    bool staged_after_first = false;
    AsyncSave second = async_save(*comm, [&]() -> CheckpointWrite {
      staged_after_first = first_written && first.ready();
      return [](Communicator&) {};
    });
    EXPECT_TRUE(staged_after_first);
    second.wait();
  });
}

TEST(AsyncSave, AGivenCommunicatorServesEveryWriteAndTheModelsOwnIsRefused) {
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    const std::shared_ptr<Communicator> own = make_checkpoint_communicator(*comm);
    ASSERT_NE(own, nullptr);
    EXPECT_EQ(own->world_size(), 2);
    EXPECT_EQ(own->rank(), comm->rank());
    for (int i = 0; i < 2; ++i) {
      AsyncSave save = async_save(
          *comm,
          [&]() -> CheckpointWrite {
            return [&](Communicator& got) {
              EXPECT_EQ(&got, own.get());
              got.barrier();
            };
          },
          AsyncSaveOptions().communicator(own));
      save.wait();
    }
    auto nothing = [] { return CheckpointWrite([](Communicator&) {}); };
    EXPECT_THAT([&] { (void)async_save(*comm, nothing, AsyncSaveOptions().communicator(comm)); },
                ThrowsMessage<c10::Error>(HasSubstr(
                    "AsyncSaveOptions::communicator is the model's communicator itself")));
    const std::shared_ptr<Communicator> alone = comm->new_subgroup({comm->rank()});
    EXPECT_THAT([&] { (void)async_save(*comm, nothing, AsyncSaveOptions().communicator(alone)); },
                ThrowsMessage<c10::Error>(HasSubstr(absl::StrCat(
                    "must span the model's ranks in their order; found rank 0 of 1 on rank ",
                    comm->rank(), " of 2"))));
  });
}

TEST(AsyncSave, AnErrorIsRethrownByWaitOrElseByTheNextSave) {
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto failing = []() -> CheckpointWrite {
      return [](Communicator&) { TORCH_CHECK(false, "no space left on device"); };
    };
    AsyncSave seen = async_save(*comm, failing);
    for (int i = 0; i < 2; ++i) {
      EXPECT_THAT([&] { seen.wait(); },
                  ThrowsMessage<c10::Error>(HasSubstr("no space left on device")));
    }
    // Seen by a wait(): the next save goes ahead.
    async_save(*comm, [] { return CheckpointWrite([](Communicator&) {}); }).wait();
    // Not seen: the next save raises it and starts nothing.
    AsyncSave unseen = async_save(*comm, failing);
    bool staged = false;
    EXPECT_THAT(
        [&] {
          AsyncSave next = async_save(*comm, [&] {
            staged = true;
            return CheckpointWrite([](Communicator&) {});
          });
        },
        ThrowsMessage<c10::Error>(HasSubstr("no space left on device")));
    EXPECT_FALSE(staged);
  });
  wait_for_async_saves();  // nothing left in flight, no error left unseen
}

TEST(AsyncSave, AFailedSaveRaisesOnEveryRankAndLeavesNothing) {
  const fs::path root = scratch("async_failed");
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    AsyncSave save =
        async_save_sharded_checkpoint(*model, nullptr, (root / "missing" / "step_1").string());
    EXPECT_THAT([&] { save.wait(); },
                ThrowsMessage<c10::Error>(HasSubstr("save_sharded_checkpoint: creating '")));
  });
  EXPECT_EQ(std::distance(fs::directory_iterator(root), fs::directory_iterator()), 0);
}

TEST(AsyncSaveDeathTest, ExitWaitsForTheWrite) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const fs::path root = scratch("async_exit");
  const fs::path file = root / "written";
  EXPECT_EXIT(
      {
        on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
          AsyncSave save = async_save(*comm, [&]() -> CheckpointWrite {
            return [&](Communicator&) {
              std::this_thread::sleep_for(std::chrono::milliseconds(300));
              std::ofstream(file) << "done";
            };
          });
        });
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_TRUE(fs::exists(file)) << "exit did not wait for the write";
}

}  // namespace
}  // namespace fsdp
