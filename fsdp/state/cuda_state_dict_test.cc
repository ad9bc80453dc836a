// Model state dicts of FSDP models on cuda:0, ranks as threads each on its own stream
// (on_cuda_ranks, fsdp/core/testing/cuda_testing.h): full (offloaded to the CPU and not),
// sharded and local state dicts saved from the GPU and loaded onto it inside training
// (REFERENCE §7), and a full state dict moving between a GPU and a CPU model. Every case
// skips without a CUDA device, naming why.
#include <memory>
#include <tuple>

#include <gtest/gtest.h>

#include "fsdp/core/testing/cuda_testing.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/state/state_dict.h"
#include "fsdp/state/testing/state_dict_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;   // NOLINT: the shared test models
using namespace ::fsdp::state_testing;  // NOLINT: the shared round trips

// RoundTripTest of state_dict_test.cc on the device: after every step the state dict is
// saved (a full one offloaded to the CPU), the model zeroed and the dict loaded back;
// training still matches the CPU reference (1e-5, as every GPU parity case).
template <typename Net>
void expect_round_trips_keep_parity_on_cuda(Kind kind, bool offload_to_cpu, int world_size,
                                            ShardingStrategy strategy, bool adam) {
  const Reference want = reference<Net>(world_size, adam);
  on_cuda_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
    expect_parity_on<Net>(comm, want,
                          FullyShardedDataParallelOptions(comm).sharding_strategy(strategy), adam,
                          save_zero_load<Net>(kind, offload_to_cpu), make<Net>, kCudaDevice);
  });
}

class CudaRoundTripTest
    : public ::testing::TestWithParam<std::tuple<Kind, int, ShardingStrategy, bool>> {};

// NormedImpl (buffers) with SGD, TinyLmImpl (tied embedding) with Adam, as on the CPU.
TEST_P(CudaRoundTripTest, SaveZeroLoadEveryStepKeepsParity) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [kind, w, strategy, adam] = GetParam();
  if (adam) {
    expect_round_trips_keep_parity_on_cuda<TinyLmImpl>(kind, /*offload_to_cpu=*/true, w, strategy,
                                                       adam);
  } else {
    expect_round_trips_keep_parity_on_cuda<NormedImpl>(kind, /*offload_to_cpu=*/true, w, strategy,
                                                       adam);
  }
}

INSTANTIATE_TEST_SUITE_P(KindsWorldSizesStrategies, CudaRoundTripTest,
                         ::testing::Combine(::testing::Values(Kind::kFull, Kind::kSharded,
                                                              Kind::kLocal),
                                            ::testing::Values(2, 4),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard),
                                            ::testing::Bool()));

// Without offload_to_cpu the full state dict's values stay on the device (save_zero_load
// EXPECTs it) and round trips still keep parity.
TEST(CudaFullStateDict, WithoutOffloadTheValuesStayOnTheDevice) {
  FSDP_SKIP_WITHOUT_GPU();
  expect_round_trips_keep_parity_on_cuda<NestedImpl>(Kind::kFull, /*offload_to_cpu=*/false, 2,
                                                     ShardingStrategy::kFullShard,
                                                     /*adam=*/false);
}

// A full state dict offloaded from the GPU model equals the CPU model's exactly (copies of
// the same initial values, same keys in the same order), and loaded onto a zeroed GPU
// model it restores them.
TEST(CudaFullStateDict, MovesBetweenAGpuAndACpuModel) {
  FSDP_SKIP_WITHOUT_GPU();
  StateDict from_cpu;
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> cpu(make<TinyLmImpl>(),
                                             FullyShardedDataParallelOptions(comm));
    StateDict mine = full_state_dict(*cpu);
    if (comm->rank() == 0) from_cpu = mine;
  });
  on_cuda_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> gpu(
        make<TinyLmImpl>(), FullyShardedDataParallelOptions(comm).device_id(kCudaDevice));
    const StateDict offloaded = full_state_dict(*gpu, FullStateDictOptions().offload_to_cpu(true));
    EXPECT_EQ(offloaded.keys(), from_cpu.keys());
    for (const auto& item : offloaded) {
      EXPECT_TRUE(item.value().device().is_cpu()) << item.key();
      EXPECT_TRUE(at::equal(item.value(), from_cpu[item.key()])) << item.key();
    }
    zero_model(*gpu);
    load_full_state_dict(*gpu, from_cpu);
    for (const auto& item : full_state_dict(*gpu)) {
      EXPECT_EQ(item.value().device(), kCudaDevice) << item.key();
      EXPECT_TRUE(at::equal(item.value().cpu(), from_cpu[item.key()])) << item.key();
    }
  });
}

}  // namespace
}  // namespace fsdp
