// Collective schedule checks (Communicator::enable_schedule_checks): ranks that diverge at
// step 1, at step 7 and in the last step stop with one error naming the step, the first
// differing collective and what each rank ran, on the fake backend (ranks as threads) and
// on Gloo (ranks as processes), within the communicator's timeout.
#include "fsdp/comm/internal/schedule.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/fake.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/multiprocess.h"

namespace fsdp {
namespace {

using comm_internal::describe;
using comm_internal::RankOutcome;
using comm_internal::run_test_as_ranks;
using ::testing::HasSubstr;

enum class Divergence {
  kExtraAllReduce,  // rank 1 all-reduces one more value at the end of the step
  kOtherDtype,      // rank 1's second all-gather moves int32 instead of float32 (same bytes)
  kSkipLast,        // rank 1 skips the step's reduce-scatter
};

struct Scenario {
  int diverge_step;
  Divergence how;
  int every;  // check every N steps, and once after the last
  int steps;
};

// Each step: all-gathers of 4, 6 and 8 float32 per rank, then a reduce-scatter of
// 8 x world_size float32 into 8.
// Returns the CommError's message, or "" if none.
std::string run_steps(Communicator& comm, const Scenario& s) {
  comm.enable_schedule_checks();
  const int w = comm.world_size();
  try {
    for (int step = 1; step <= s.steps; ++step) {
      const bool diverge = comm.rank() == 1 && step == s.diverge_step;
      for (int64_t n : {4, 6, 8}) {
        const c10::ScalarType dtype =
            diverge && s.how == Divergence::kOtherDtype && n == 6 ? at::kInt : at::kFloat;
        comm.all_gather_into_tensor(at::zeros({n * w}, dtype), at::ones({n}, dtype));
      }
      if (!(diverge && s.how == Divergence::kSkipLast)) {
        comm.reduce_scatter_tensor(at::empty({8}), at::ones({8 * w}));
      }
      if (diverge && s.how == Divergence::kExtraAllReduce) comm.all_reduce(at::ones({1}));
      comm.end_schedule_step();
      if (step % s.every == 0) comm.check_collective_schedule();
    }
    comm.check_collective_schedule();
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

// The description every rank must give (ranks 0 and 2 agree with each other; rank 1
// diverged), after "... failed on rank R (peer rank P): ".
std::string expected_mismatch(const Scenario& s, int world_size) {
  std::string rank0, rank1;
  int index = 0;
  int count0 = 4, count1 = 4;
  switch (s.how) {
    case Divergence::kExtraAllReduce:
      index = 4;
      rank0 = "issued no collective there";
      rank1 = "ran all_reduce of 1 Float in the world";
      count1 = 5;
      break;
    case Divergence::kOtherDtype:
      index = 1;
      rank0 =
          "ran all_gather_into_tensor of 6 Float in the world (then all_gather_into_tensor of 8 "
          "Float in the world, reduce_scatter_tensor of " +
          std::to_string(8 * world_size) + " Float in the world)";
      rank1 =
          "ran all_gather_into_tensor of 6 Int in the world (then all_gather_into_tensor of 8 "
          "Float in the world, reduce_scatter_tensor of " +
          std::to_string(8 * world_size) + " Float in the world)";
      break;
    case Divergence::kSkipLast:
      index = 3;
      rank0 =
          "ran reduce_scatter_tensor of " + std::to_string(8 * world_size) + " Float in the world";
      rank1 = "issued no collective there";
      count1 = 3;
      break;
  }
  const std::string d = std::to_string(s.diverge_step);
  std::string ran = "rank 0 " + rank0 + ", rank 1 " + rank1;
  std::string issued =
      "rank 0 issued " + std::to_string(count0) + ", rank 1 issued " + std::to_string(count1);
  for (int r = 2; r < world_size; ++r) {
    ran += ", rank " + std::to_string(r) + " " + rank0;
    issued += ", rank " + std::to_string(r) + " issued " + std::to_string(count0);
  }
  return "the ranks ran different collectives in step " + d + ", first at its collective #" +
         std::to_string(index) + ": " + ran + "; in step " + d + " " + issued +
         " collectives (steps counted from 1; every rank must issue the same collectives in "
         "the same order)";
}

// The three divergences of the issue: at step 1 (checked every step: rank 1's extra
// all-reduce would otherwise hang), at step 7 (a silent one, found by the check after
// step 8), in the last step (found by the check after the loop, while rank 0 waits in
// the reduce-scatter rank 1 skipped).
const Scenario kAtStep1{1, Divergence::kExtraAllReduce, 1, 3};
const Scenario kAtStep7{7, Divergence::kOtherDtype, 4, 10};
const Scenario kInLastStep{10, Divergence::kSkipLast, 4, 10};

TEST(ScheduleTest, GroupCodesNameSizeAndStride) {
  EXPECT_EQ(comm_internal::group_code({0, 1, 2, 3}), (int64_t{4} << 32) | 1);
  EXPECT_EQ(comm_internal::group_code({2, 3}), comm_internal::group_code({0, 1}));
  EXPECT_EQ(comm_internal::group_code({1, 3}), (int64_t{2} << 32) | 2);
  EXPECT_EQ(comm_internal::group_code({0, 1, 3}), int64_t{3} << 32);
  comm_internal::ScheduleRecord record{
      1, 0, 0, static_cast<int64_t>(at::kBFloat16), 10, comm_internal::group_code({1, 3})};
  EXPECT_EQ(comm_internal::describe_record(record, 4),
            "all_gather_into_tensor of 10 BFloat16 in a group of 2 ranks (stride 2)");
}

TEST(ScheduleTest, ReportsSurviveThePackedLayout) {
  comm_internal::ScheduleReport report;
  report.failed = true;
  report.checked_step = 4;
  report.steps = {{5, 3, -7}, {6, 1, 42}};
  report.records = {{6, 0, 2, 6, 1, (int64_t{2} << 32) | 1}};
  std::vector<int64_t> packed(comm_internal::ScheduleReport::kSize);
  report.pack(packed.data());
  const comm_internal::ScheduleReport back = comm_internal::ScheduleReport::unpack(packed.data());
  EXPECT_TRUE(back.failed);
  EXPECT_EQ(back.checked_step, 4);
  ASSERT_EQ(back.steps.size(), 2u);
  EXPECT_EQ(back.steps[0].hash, -7);
  EXPECT_EQ(back.steps[1].count, 1);
  ASSERT_EQ(back.records.size(), 1u);
  EXPECT_EQ(back.records[0].numel, 1);
  EXPECT_EQ(comm_internal::describe_schedule_mismatch({report, back}, {0, 1}), "");
}

TEST(ScheduleTest, AgreeingRanksPassEveryCheck) {
  FakeWorld::run(FakeWorld::create(3), [](Communicator& comm) {
    EXPECT_EQ(run_steps(comm, {0, Divergence::kOtherDtype, 2, 5}), "");
    EXPECT_EQ(comm.schedule_step(), 6);
  });
}

TEST(ScheduleTest, ChecksNeedEnablingOnTheRoot) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    EXPECT_EQ(comm.schedule_step(), 0);
    EXPECT_THAT([&] { comm.check_collective_schedule(); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("call enable_schedule_checks()")));
    std::shared_ptr<Communicator> sub = comm.new_subgroup({0, 1});
    EXPECT_THAT([&] { sub->enable_schedule_checks(); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("got a subgroup of ranks [0, 1]")));
  });
}

// Subgroups made before the checks are enabled record into the family's schedule.
TEST(ScheduleTest, SubgroupCollectivesAreNamedByTheirGroup) {
  std::vector<std::string> messages(4);
  FakeWorld::run(FakeWorld::create(4, std::chrono::milliseconds(500)), [&](Communicator& comm) {
    HybridGroups groups = comm.split_hybrid(2);
    comm.enable_schedule_checks();
    try {
      groups.shard_group->all_reduce(at::ones({3}));
      // Rank 3 all-reduces over its replicate group where the others use their shard group.
      Communicator& next = comm.rank() == 3 ? *groups.replicate_group : *groups.shard_group;
      next.all_reduce(at::ones({2}));
      comm.end_schedule_step();
      comm.check_collective_schedule();
    } catch (const CommError& e) {
      messages[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(messages[r],
                HasSubstr("the ranks ran different collectives in step 1, first at its "
                          "collective #1: rank 0 ran all_reduce of 2 Float in a group of 2 ranks "
                          "(stride 1), rank 1 ran all_reduce of 2 Float in a group of 2 ranks "
                          "(stride 1), rank 2 ran all_reduce of 2 Float in a group of 2 ranks "
                          "(stride 1), rank 3 ran all_reduce of 2 Float in a group of 2 ranks "
                          "(stride 2)"))
        << "rank " << r;
  }
}

// A host group (an asynchronous checkpoint's) may run its collectives at another point on
// each rank: the family's checks still pass, and its own collectives are not counted.
TEST(ScheduleTest, AHostGroupIsNotCompared) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> io = comm.new_host_subgroup({0, 1});
    comm.enable_schedule_checks();
    comm.all_reduce(at::ones({3}));
    // Recorded, the group's all-reduce would fall in step 2 on rank 0, in step 1 on rank 1.
    if (comm.rank() == 0) comm.end_schedule_step();
    io->all_reduce(at::ones({4}));
    if (comm.rank() == 1) comm.end_schedule_step();
    comm.all_reduce(at::ones({2}));
    comm.end_schedule_step();
    EXPECT_NO_THROW(comm.check_collective_schedule());
  });
}

class FakeDivergenceTest : public ::testing::TestWithParam<Scenario> {};

TEST_P(FakeDivergenceTest, EveryRankNamesTheDivergenceWithinTheTimeout) {
  constexpr int kWorld = 3;
  const auto timeout = std::chrono::milliseconds(1000);
  std::vector<std::string> messages(kWorld);
  const auto start = std::chrono::steady_clock::now();
  FakeWorld::run(FakeWorld::create(kWorld, timeout),
                 [&](Communicator& comm) { messages[comm.rank()] = run_steps(comm, GetParam()); });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(messages[r], HasSubstr("schedule_check #"));
    EXPECT_THAT(messages[r], HasSubstr(expected_mismatch(GetParam(), kWorld))) << "rank " << r;
  }
  // At most one timeout of a collective and a side-channel exchange.
  EXPECT_LT(seconds, 3.0 * timeout.count() / 1000);
}

INSTANTIATE_TEST_SUITE_P(Steps, FakeDivergenceTest,
                         ::testing::Values(kAtStep1, kAtStep7, kInLastStep));

// A rank that stops answering (SIGSTOP, or stuck outside collectives): its peer's
// collective times out after T, then the peer's schedule check waits for it 2 T more on
// the side channel, and the error says both waits.
TEST(ScheduleTest, ARankThatStopsAnsweringIsNamedWithBothWaits) {
  const auto timeout = std::chrono::milliseconds(200);
  std::string message;
  std::atomic<bool> done{false};
  FakeWorld::run(FakeWorld::create(2, timeout), [&](Communicator& comm) {
    comm.enable_schedule_checks();
    if (comm.rank() == 1) {  // stopped until rank 0 has its error (a minute at most)
      for (int i = 0; i < 6000 && !done; ++i) std::this_thread::sleep_for(timeout / 20);
      return;
    }
    try {
      comm.all_reduce(at::ones({1}));
    } catch (const CommError& e) {
      message = e.what_without_backtrace();
    }
    done = true;
  });
  EXPECT_EQ(message,
            "all_reduce #0 failed on rank 0 (peer rank 1): rank(s) 1 did not reach it within 200 "
            "ms (then the ranks' collective schedules could not be compared either: "
            "all_gather_into_tensor #0 in group [0, 1] failed on rank 0 (peer rank 1): rank(s) "
            "1 did not reach it within 400 ms)");
}

// --- Gloo: ranks as processes ---

constexpr auto kGlooTimeout = std::chrono::seconds(3);

Scenario scenario_from_environment() {
  const char* which = std::getenv("FSDP_TEST_SCENARIO");
  const std::string name = which == nullptr ? "" : which;
  if (name == "step7") return kAtStep7;
  if (name == "last") return kInLastStep;
  return kAtStep1;
}

TEST(DISABLED_ScheduleWorker, Diverge) {
  std::shared_ptr<Communicator> comm =
      init_from_environment(RendezvousOptions().timeout(kGlooTimeout).backend(Backend::kGloo));
  const Scenario s = scenario_from_environment();
  const std::string message = run_steps(*comm, s);
  std::cout << "schedule error: " << message << std::endl;
  EXPECT_THAT(message, HasSubstr(expected_mismatch(s, comm->world_size())));
}

class GlooDivergenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GlooDivergenceTest, EveryRankNamesTheDivergenceWithinTheTimeout) {
  const std::vector<RankOutcome> ranks = run_test_as_ranks(
      2, "DISABLED_ScheduleWorker.Diverge", std::chrono::seconds(60),
      [which = GetParam()](int, Environment& env) { env["FSDP_TEST_SCENARIO"] = which; });
  comm_internal::expect_ranks_passed(ranks);
  for (const RankOutcome& rank : ranks) {
    // Start-up, one timeout of a collective, the lost-peer probe and the exchange.
    EXPECT_LT(rank.seconds, 4.0 * kGlooTimeout.count()) << describe(ranks);
  }
  // Rank 0's error, for the log.
  const std::string& out = ranks[0].output;
  const size_t at = out.find("schedule error: ");
  if (at != std::string::npos) std::cout << out.substr(at, out.find('\n', at) - at) << "\n";
}

INSTANTIATE_TEST_SUITE_P(Steps, GlooDivergenceTest, ::testing::Values("step1", "step7", "last"));

}  // namespace
}  // namespace fsdp
