// CPU offload with a CUDA compute device (cuda:0): the device memory it saves, counted
// by the caching allocator, pinned host shards and gradients, and parity with the
// single-process CPU reference at W = 2 ranks as threads (each on its own stream, so the
// copy stream's ordering against the compute stream is exercised). Every case skips
// without a CUDA device, naming why; cpu_offload_test.cc covers the same path on the CPU.
#include <iostream>
#include <memory>

#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/device_handle.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/testing/cuda_testing.h"
#include "fsdp/core/testing/mlp_model.h"
#include "fsdp/core/testing/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using core_internal::MlpModelImpl;

constexpr int64_t kDim = 256;
constexpr int kBlocks = 4;

// Device bytes (caching allocator, cuda:0) held by one W = 1 model with Adam, relative to
// before it was made.
struct DeviceBytes {
  int64_t after_construction = 0;  // the model alone
  int64_t after_step = 0;          // + gradients and Adam state, activations released
  int64_t peak = 0;                // over construction and one step
  int64_t param_numel = 0;
};

DeviceBytes measure(bool offload) {
  auto world = FakeWorld::create(1);
  std::shared_ptr<DeviceHandle> device = DeviceHandle::for_device(kCudaDevice);
  const at::Tensor x = at::randn({8, kDim}, at::TensorOptions().device(kCudaDevice));
  device->synchronize();
  const int64_t base = device->memory_allocated();
  device->reset_peak_memory_stats();
  DeviceBytes bytes;
  torch::manual_seed(0);
  FullyShardedDataParallel<MlpModelImpl> model(
      std::make_shared<MlpModelImpl>(kDim, kBlocks, kDim),
      FullyShardedDataParallelOptions(world->communicator(0))
          .device_id(kCudaDevice)
          .cpu_offload(CPUOffload(offload)));
  device->synchronize();
  bytes.after_construction = device->memory_allocated() - base;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  for (const at::Tensor& p : model->parameters()) bytes.param_numel += p.numel();
  model->forward(x).pow(2).mean().backward();
  optimizer.step();
  device->synchronize();
  bytes.after_step = device->memory_allocated() - base;
  bytes.peak = device->max_memory_allocated() - base;
  for (const at::Tensor& p : model->parameters()) {
    EXPECT_EQ(p.device().is_cpu(), offload);
    EXPECT_EQ(p.is_pinned(), offload);
    EXPECT_EQ(p.grad().is_pinned(), offload);
  }
  std::cout << "cpu_offload=" << offload << ": device bytes after construction "
            << bytes.after_construction << ", after one Adam step " << bytes.after_step << ", peak "
            << bytes.peak << " (" << bytes.param_numel << " parameters)\n";
  return bytes;
}

TEST(CudaOffloadTest, ShardsGradientsAndAdamStateLeaveTheDevice) {
  FSDP_SKIP_WITHOUT_GPU();
  const DeviceBytes on_device = measure(/*offload=*/false);
  const DeviceBytes offloaded = measure(/*offload=*/true);
  const int64_t psi = on_device.param_numel;
  // Without offload: the parameters (4 psi), then also gradients (4 psi) and Adam's two
  // moments (8 psi), at the allocator's 512-byte rounding per tensor.
  EXPECT_GE(on_device.after_construction, 4 * psi);
  EXPECT_GE(on_device.after_step, 16 * psi);
  // With offload nothing stays on the device between steps.
  EXPECT_EQ(offloaded.after_construction, 0);
  EXPECT_EQ(offloaded.after_step, 0);
  // In flight: unsharded units and their reductions (REFERENCE §5), not the model state.
  // Without offload the step holds parameters, gradients and Adam state (>= 16 psi) at
  // once; with it, at most the unsharded model (W = 1) and one unit's gradients.
  EXPECT_LE(offloaded.peak, on_device.peak - 8 * psi);
}

TEST(CudaOffloadTest, MatchesTheReferenceOnRanksAsThreads) {
  FSDP_SKIP_WITHOUT_GPU();
  for (bool adam : {false, true}) {
    const Reference want = reference<TinyLmImpl>(2, adam);
    on_cuda_ranks(2, [&](std::shared_ptr<Communicator> comm) {
      for (ShardingStrategy strategy :
           {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
            ShardingStrategy::kNoShard}) {
        SCOPED_TRACE(sharding_strategy_name(strategy));
        FullyShardedDataParallelOptions options(comm);
        options.sharding_strategy(strategy).forward_prefetch(true).cpu_offload(true);
        expect_parity_on<TinyLmImpl>(comm, want, options, adam, nullptr, make<TinyLmImpl>,
                                     kCudaDevice);
      }
    });
  }
}

}  // namespace
}  // namespace fsdp
