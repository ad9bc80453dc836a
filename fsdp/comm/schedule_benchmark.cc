// What the collective schedule adds to each collective (Communicator::enable_schedule_checks):
//   BM_ScheduleRecord          CollectiveSchedule::record alone (hash and ring), ns
//   BM_FakeAllReduce/checks:C  a 1-element all-reduce on the fake backend at W = 1, with
//                              schedule checks off (C = 0) and on (C = 1): the difference is
//                              the recording and the watched work of one collective
// bazel run -c opt //fsdp/comm:schedule_benchmark
#include <memory>

#include <ATen/Functions.h>
#include <benchmark/benchmark.h>

#include "fsdp/comm/fake.h"
#include "fsdp/comm/internal/schedule.h"

namespace fsdp {
namespace {

void BM_ScheduleRecord(benchmark::State& state) {
  std::shared_ptr<Communicator> side = FakeWorld::create(1)->communicator(0);
  comm_internal::CollectiveSchedule schedule(side, {0});
  int64_t numel = 0;
  for (auto _ : state) {
    schedule.record(CollectiveKind::kAllGather, comm_internal::group_code({0, 1}), ++numel,
                    at::kFloat);
  }
}
BENCHMARK(BM_ScheduleRecord);

void BM_FakeAllReduce(benchmark::State& state) {
  std::shared_ptr<Communicator> comm = FakeWorld::create(1)->communicator(0);
  if (state.range(0) != 0) comm->enable_schedule_checks();
  const at::Tensor one = at::ones({1});
  for (auto _ : state) comm->all_reduce(one);
}
BENCHMARK(BM_FakeAllReduce)->ArgName("checks")->Arg(0)->Arg(1);

}  // namespace
}  // namespace fsdp
