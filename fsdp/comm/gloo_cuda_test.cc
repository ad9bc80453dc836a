// The Gloo backend on CUDA buffers (Note [Gloo on device tensors] in gloo.cc): real
// processes on loopback, every rank's buffers on cuda:0 (one GPU serves several ranks,
// which NCCL refuses), the same closed-form checks as every backend. Skips without a CUDA
// device, naming why.
#include <chrono>
#include <memory>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/collective_checks.h"
#include "fsdp/comm/testing/gpu_testing.h"
#include "fsdp/comm/testing/multiprocess.h"

namespace fsdp {
namespace {

TEST(DISABLED_GlooCudaWorker, Collectives) {
  std::shared_ptr<Communicator> comm = init_from_environment(
      RendezvousOptions().timeout(std::chrono::seconds(60)).backend(Backend::kGloo));
  const c10::Device cuda(c10::kCUDA, 0);
  for (c10::ScalarType dtype : {c10::kFloat, c10::kBFloat16, c10::kHalf, c10::kLong}) {
    comm_internal::expect_collectives_match_closed_forms(*comm, dtype, cuda);
  }
  comm_internal::expect_average_divides_by_world_size(*comm, cuda);
}

void expect_all_ranks_pass(int world_size) {
  comm_internal::expect_ranks_passed(comm_internal::run_test_as_ranks(
      world_size, "DISABLED_GlooCudaWorker.Collectives", std::chrono::seconds(120)));
}

TEST(GlooCudaTest, CollectivesOnTwoRanksOfOneGpu) {
  FSDP_SKIP_WITHOUT_GPU();
  expect_all_ranks_pass(2);
}

TEST(GlooCudaTest, CollectivesOnFourRanksOfOneGpu) {
  FSDP_SKIP_WITHOUT_GPU();
  expect_all_ranks_pass(4);
}

}  // namespace
}  // namespace fsdp
