// FullyShardedDataParallel in real processes that share one GPU (tagged "gpu"; skips
// without a CUDA device, naming why):
// - Gloo on CUDA tensors (Note [Gloo on device tensors] in fsdp/comm/gloo.cc) at W = 2
//   and 4, every rank on cuda:0: the parity models against one process, every strategy,
//   SGD and Adam.
// - NCCL at W = 1 on cuda:0: the same parity (one rank runs as NO_SHARD, so the
//   collectives through NCCL are the construction fingerprint and the loss average).
// - NCCL at W = 2 with both ranks on cuda:0: NCCL refuses two ranks of one communicator on
//   one device (ncclInvalidUsage), and each rank raises an error saying so instead of
//   hanging. That is why many ranks on one GPU are tested over Gloo or as threads.
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/multiprocess.h"
#include "fsdp/core/testing/cuda_testing.h"
#include "fsdp/core/testing/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::HasSubstr;

Backend backend_from_environment() {
  const char* name = std::getenv("FSDP_TEST_BACKEND");
  return name != nullptr && std::string(name) == "nccl" ? Backend::kNccl : Backend::kGloo;
}

TEST(DISABLED_CudaProcessWorker, Parity) {
  std::shared_ptr<Communicator> comm = init_from_environment(
      RendezvousOptions().timeout(std::chrono::seconds(60)).backend(backend_from_environment()));
  expect_parity_for_all_strategies<NestedImpl>(comm, kCudaDevice);
  expect_parity_for_all_strategies<TinyLmImpl>(comm, kCudaDevice);
  expect_parity_for_all_strategies<SkipImpl>(comm, kCudaDevice);
}

void expect_parity_on_processes(int world_size, const std::string& backend) {
  comm_internal::expect_ranks_passed(comm_internal::run_test_as_ranks(
      world_size, "DISABLED_CudaProcessWorker.Parity", std::chrono::seconds(300),
      [&](int /*rank*/, Environment& env) { env["FSDP_TEST_BACKEND"] = backend; }));
}

TEST(CudaProcessTest, GlooOnCudaTensorsAtTwoRanks) {
  FSDP_SKIP_WITHOUT_GPU();
  expect_parity_on_processes(2, "gloo");
}

TEST(CudaProcessTest, GlooOnCudaTensorsAtFourRanks) {
  FSDP_SKIP_WITHOUT_GPU();
  expect_parity_on_processes(4, "gloo");
}

TEST(CudaProcessTest, NcclAtOneRank) {
  FSDP_SKIP_WITHOUT_GPU();
  expect_parity_on_processes(1, "nccl");
}

TEST(DISABLED_CudaProcessWorker, NcclTwoRanksOnOneDevice) {
  try {
    std::shared_ptr<Communicator> comm = init_from_environment(
        RendezvousOptions().timeout(std::chrono::seconds(60)).backend(Backend::kNccl));
    comm->barrier();  // the first collective; no ordering needed
    ADD_FAILURE() << "NCCL made a communicator of two ranks on one device";
  } catch (const c10::Error& e) {  // CommError included
    std::cout << "nccl error: " << e.what_without_backtrace() << std::endl;
  }
}

TEST(CudaProcessTest, NcclRefusesTwoRanksOnOneDevice) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto ranks = comm_internal::run_test_as_ranks(
      2, "DISABLED_CudaProcessWorker.NcclTwoRanksOnOneDevice", std::chrono::seconds(120),
      [](int /*rank*/, Environment& env) { env["LOCAL_RANK"] = "0"; });  // both on cuda:0
  comm_internal::expect_ranks_passed(ranks);
  for (const comm_internal::RankOutcome& rank : ranks) {
    EXPECT_THAT(rank.output, HasSubstr("nccl error: ")) << comm_internal::describe(ranks);
    EXPECT_THAT(rank.output, HasSubstr("ncclInvalidUsage")) << comm_internal::describe(ranks);
  }
}

}  // namespace
}  // namespace fsdp
