// FullyShardedDataParallel on a CUDA device (FullyShardedDataParallelOptions::device_id):
// the model is moved at construction and trains as one process does, at W = 1. Skips
// without a CUDA device, naming why.
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <ATen/Functions.h>

#include "fsdp/base/names.h"
#include "fsdp/comm/fake.h"
#include "fsdp/comm/nccl.h"  // cuda_device_count
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/internal/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models

#define SKIP_WITHOUT_GPU()                         \
  do {                                             \
    std::string why;                               \
    if (cuda_device_count(&why) == 0) {            \
      GTEST_SKIP() << "needs a CUDA GPU: " << why; \
    }                                              \
  } while (false)

TEST(CudaParityTest, DeviceIdMovesTheModelAndTrainsAsOneProcessAtW1) {
  SKIP_WITHOUT_GPU();
  const c10::Device cuda("cuda:0");
  const Reference want = reference<NestedImpl>(1, /*adam=*/false);
  auto world = FakeWorld::create(1);
  FullyShardedDataParallel<NestedImpl> model(
      make<NestedImpl>(), FullyShardedDataParallelOptions(world->communicator(0)).device_id(cuda));
  EXPECT_EQ(model->device_handle().device(), cuda);
  for (const at::Tensor& p : model->parameters()) EXPECT_EQ(p.device(), cuda);
  auto optimizer = make_optimizer(model->parameters(), /*adam=*/false);
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = NestedImpl::batch(step, kBatchPerRank);
    optimizer->zero_grad();
    at::Tensor loss = NestedImpl::loss(model->forward(batch.input.to(cuda)), batch.target.to(cuda));
    loss.backward();
    optimizer->step();
    // GPU kernels sum in another order than the CPU reference.
    EXPECT_NEAR(loss.item<float>(), want.losses[step], 1e-5) << "step " << step;
  }
  auto summon = model->summon_full_params(/*writeback=*/false);
  for (const auto& item : model->named_parameters()) {
    const std::string fqn = clean_tensor_name(item.key());
    EXPECT_EQ(item.value().device(), cuda) << fqn;
    EXPECT_TRUE(at::allclose(item.value().cpu(), want.params.at(fqn), /*rtol=*/0, /*atol=*/1e-5))
        << fqn;
  }
}

TEST(CudaParityTest, ClipGradNormOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const c10::Device cuda("cuda:0");
  auto world = FakeWorld::create(1);
  FullyShardedDataParallel<NestedImpl> model(
      make<NestedImpl>(), FullyShardedDataParallelOptions(world->communicator(0)).device_id(cuda));
  const Batch batch = NestedImpl::batch(0, kBatchPerRank);
  NestedImpl::loss(model->forward(batch.input.to(cuda)), batch.target.to(cuda)).backward();
  const at::Tensor norm = model->clip_grad_norm_(1e-3);
  EXPECT_EQ(norm.device(), cuda);
  EXPECT_GT(norm.item<float>(), 0.0f);
}

}  // namespace
}  // namespace fsdp
