// FullyShardedDataParallel on a CUDA device: W = 1, 2 and 4 ranks as threads on cuda:0
// (the fake communicator on CUDA tensors, each rank on its own stream; on_cuda_ranks in
// testing/cuda_testing.h) against the single-process CPU reference (REFERENCE §7), the
// features beyond plain training, and the caching allocator's memory against REFERENCE
// §5. Every case skips without a CUDA device, naming why.
#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "fsdp/base/names.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/checkpoint_wrapper.h"
#include "fsdp/core/device_handle.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/testing/cuda_testing.h"
#include "fsdp/core/testing/mlp_model.h"
#include "fsdp/core/testing/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using Ranks = std::function<void(std::shared_ptr<Communicator>)>;

// ---- The fake communicator on CUDA buffers (Note [Fake collectives on device buffers]).

// Each rank's inputs are produced by kernels still queued on its own stream when it
// issues the collective (16 passes over 64 MiB), its output is read on another stream
// right after, and the in-place all-gather's input is a chunk of its output: exact values
// show that every input was complete before a peer read it, no input was overwritten
// while read, and every output was complete when the call returned.
class FakeCudaCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(FakeCudaCollectivesTest, EachRanksStreamIsOrderedAroundItsCollectives) {
  FSDP_SKIP_WITHOUT_GPU();
  const int w = GetParam();
  on_cuda_ranks(w, [w](std::shared_ptr<Communicator> comm) {
    constexpr int64_t kNumel = int64_t{1} << 24;
    const int64_t chunk = kNumel / w;
    const double r = comm->rank();
    const auto on_cuda = at::TensorOptions().dtype(at::kFloat).device(kCudaDevice);
    // Compares on another stream without waiting for the rank's: the expected values are
    // made on that stream too.
    c10::cuda::CUDAStream other = c10::cuda::getStreamFromPool(false, kCudaDevice.index());
    const auto equals_on_other_stream = [&](const at::Tensor& got,
                                            const std::function<at::Tensor()>& want) {
      c10::cuda::CUDAStreamGuard guard(other);
      return at::equal(got, want());
    };

    at::Tensor sum = at::ones({kNumel}, on_cuda);
    for (int i = 0; i < 16; ++i) sum.mul_(2);
    sum.add_(r);  // 65536 + r
    comm->all_reduce(sum);
    EXPECT_TRUE(equals_on_other_stream(
        sum, [&] { return at::full({kNumel}, 65536.0 * w + w * (w - 1) / 2.0, on_cuda); }));

    at::Tensor gathered = at::empty({kNumel}, on_cuda);
    at::Tensor mine = gathered.narrow(0, comm->rank() * chunk, chunk);
    mine.fill_(r + 1).mul_(3);
    comm->all_gather_into_tensor(gathered, mine);
    EXPECT_TRUE(equals_on_other_stream(gathered, [&] {  // chunk k: 3 (k + 1)
      return (at::arange(kNumel, on_cuda).div(chunk, "floor") + 1).mul_(3);
    }));

    at::Tensor input = at::arange(kNumel, on_cuda).remainder_(1000).mul_(r + 1);
    at::Tensor reduced = at::empty({chunk}, on_cuda);
    comm->reduce_scatter_tensor(reduced, input);
    EXPECT_TRUE(equals_on_other_stream(reduced, [&] {
      return at::arange(comm->rank() * chunk, (comm->rank() + 1) * chunk, on_cuda)
          .remainder_(1000)
          .mul_(w * (w + 1) / 2.0);
    }));

    at::Tensor broadcast = at::full({kNumel}, r, on_cuda).mul_(2);
    comm->broadcast(broadcast, w - 1);
    EXPECT_TRUE(equals_on_other_stream(broadcast,
                                       [&] { return at::full({kNumel}, 2.0 * (w - 1), on_cuda); }));
    comm->barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FakeCudaCollectivesTest, ::testing::Values(1, 2, 4));

// ---- Parity with the single-process reference (fully_sharded_test.cc's cases on CUDA).

using OptionsOf = std::function<FullyShardedDataParallelOptions(std::shared_ptr<Communicator>)>;

OptionsOf with_strategy(ShardingStrategy strategy) {
  return [strategy](std::shared_ptr<Communicator> comm) {
    return FullyShardedDataParallelOptions(std::move(comm)).sharding_strategy(strategy);
  };
}

// Trains Net on W CUDA ranks with the options `options_of` gives each rank, against
// `want` (expect_parity_on on kCudaDevice).
template <typename Net>
void expect_cuda_parity(int world_size, const Reference& want, bool adam,
                        const OptionsOf& options_of, const AfterStep<Net>& after_step = nullptr,
                        const std::function<std::shared_ptr<Net>()>& build_net = make<Net>,
                        double tolerance = 0) {
  on_cuda_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
    expect_parity_on<Net>(comm, want, options_of(comm), adam, after_step, build_net, kCudaDevice,
                          tolerance);
  });
}

template <typename Net>
void expect_cuda_parity(int world_size, ShardingStrategy strategy, bool adam) {
  expect_cuda_parity<Net>(world_size, reference<Net>(world_size, adam), adam,
                          with_strategy(strategy));
}

class CudaParityTest : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy, bool>> {};

TEST_P(CudaParityTest, NestedLinears) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy, adam] = GetParam();
  expect_cuda_parity<NestedImpl>(w, strategy, adam);
}
TEST_P(CudaParityTest, TiedEmbeddingLanguageModel) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy, adam] = GetParam();
  expect_cuda_parity<TinyLmImpl>(w, strategy, adam);
}
TEST_P(CudaParityTest, UnitSkippedOnSomeIterations) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy, adam] = GetParam();
  expect_cuda_parity<SkipImpl>(w, strategy, adam);
}
TEST_P(CudaParityTest, BiasSharedByAUnitAndTheUnitInsideIt) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy, adam] = GetParam();
  expect_cuda_parity<SharedBiasImpl>(w, strategy, adam);
}
TEST_P(CudaParityTest, WeightSharedBySiblingUnits) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy, adam] = GetParam();
  expect_cuda_parity<TiedUnitsImpl>(w, strategy, adam);
}
TEST_P(CudaParityTest, EmbeddingUnitTiedToTheRootsHead) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy, adam] = GetParam();
  expect_cuda_parity<EmbeddingUnitLmImpl>(w, strategy, adam);
}

INSTANTIATE_TEST_SUITE_P(WorldSizesStrategiesOptimizers, CudaParityTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard),
                                            ::testing::Bool()));

// Backward and forward prefetching (PrefetchParityTest of fully_sharded_test.cc): the
// next unit is gathered while the current one computes, on the rank's stream.
class CudaPrefetchParityTest
    : public ::testing::TestWithParam<std::tuple<int, BackwardPrefetch, bool>> {};

TEST_P(CudaPrefetchParityTest, NestedLinearsAndAUnitSkippedOnSomeIterations) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, backward, forward] = GetParam();
  const OptionsOf prefetching = [backward = backward,
                                 forward = forward](std::shared_ptr<Communicator> comm) {
    return FullyShardedDataParallelOptions(std::move(comm))
        .backward_prefetch(backward)
        .forward_prefetch(forward);
  };
  expect_cuda_parity<NestedImpl>(w, reference<NestedImpl>(w, /*adam=*/false), /*adam=*/false,
                                 prefetching);
  expect_cuda_parity<SkipImpl>(w, reference<SkipImpl>(w, /*adam=*/false), /*adam=*/false,
                               prefetching);
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndPrefetching, CudaPrefetchParityTest,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values(BackwardPrefetch::kNone,
                                                              BackwardPrefetch::kBackwardPre,
                                                              BackwardPrefetch::kBackwardPost),
                                            ::testing::Bool()));

// SGD only, as SgdParityTest in fully_sharded_test.cc says why.
class CudaSgdParityTest : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy>> {};

TEST_P(CudaSgdParityTest, BatchNormInAUnit) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy] = GetParam();
  expect_cuda_parity<NormedImpl>(w, strategy, /*adam=*/false);
}

INSTANTIATE_TEST_SUITE_P(WorldSizesStrategies, CudaSgdParityTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard)));

// HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 4 ranks in shard groups of 2 (as
// hybrid_shard_test.cc on threads).
class CudaHybridParityTest : public ::testing::TestWithParam<std::tuple<ShardingStrategy, bool>> {};

TEST_P(CudaHybridParityTest, MatchesTheReferenceOnFourRanks) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [strategy, adam] = GetParam();
  const OptionsOf hybrid = [strategy = strategy](std::shared_ptr<Communicator> comm) {
    return FullyShardedDataParallelOptions(std::move(comm))
        .sharding_strategy(strategy)
        .hybrid_shard_group_size(2);
  };
  expect_cuda_parity<NestedImpl>(4, reference<NestedImpl>(4, adam), adam, hybrid);
  expect_cuda_parity<TinyLmImpl>(4, reference<TinyLmImpl>(4, adam), adam, hybrid);
}

INSTANTIATE_TEST_SUITE_P(StrategiesOptimizers, CudaHybridParityTest,
                         ::testing::Combine(::testing::Values(ShardingStrategy::kHybridShard,
                                                              ShardingStrategy::kHybridShardZero2),
                                            ::testing::Bool()));

// ---- Mixed precision: bf16 parameters, fp32 or bf16 reduction.

// NestedImpl whose loss takes the root's bf16 output in fp32 (the reference's output is
// fp32 already; the same weights and batches).
struct Bf16OutputNestedImpl : NestedImpl {
  static at::Tensor loss(const at::Tensor& out, const at::Tensor& y) {
    return NestedImpl::loss(out.to(at::kFloat), y);
  }
};

// Against the fp32 reference. Tolerance 5e-3 absolute, for losses of about 0.5 (1%, the
// bound BFloat16TrainingTest in mixed_precision_test.cc states for bf16 against fp32 on
// the CPU): bf16 keeps 8 significant bits (relative rounding 2^-9) in every matmul and
// activation and, with reduce_dtype bf16, in the gradient sums; the fp32 master
// parameters move by at most a few 1e-2 in these 4 steps, so their error is far below it.
class CudaMixedPrecisionTest
    : public ::testing::TestWithParam<std::tuple<int, c10::ScalarType, ShardingStrategy>> {};

TEST_P(CudaMixedPrecisionTest, Bf16ParametersTrackTheFp32Reference) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, reduce_dtype, strategy] = GetParam();
  const OptionsOf mixed = [reduce_dtype = reduce_dtype,
                           strategy = strategy](std::shared_ptr<Communicator> comm) {
    return FullyShardedDataParallelOptions(std::move(comm))
        .sharding_strategy(strategy)
        .mixed_precision(MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(reduce_dtype));
  };
  const AfterStep<Bf16OutputNestedImpl> dtypes =
      [reduce_dtype = reduce_dtype](FullyShardedDataParallelImpl<Bf16OutputNestedImpl>& model,
                                    torch::optim::Optimizer&) {
        for (const auto& unit : model.units()) {
          EXPECT_EQ(unit->handle()->param_dtype(), at::kBFloat16) << unit->fqn();
          EXPECT_EQ(unit->handle()->reduce_dtype(), reduce_dtype) << unit->fqn();
        }
        for (const at::Tensor& p : model.parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
      };
  expect_cuda_parity<Bf16OutputNestedImpl>(w, reference<NestedImpl>(w, /*adam=*/false),
                                           /*adam=*/false, mixed, dtypes,
                                           make<Bf16OutputNestedImpl>, /*tolerance=*/5e-3);
}

INSTANTIATE_TEST_SUITE_P(WorldSizesReduceDtypesStrategies, CudaMixedPrecisionTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp)));

// ---- Activation checkpointing and shard-on-construction, against the reference.

class CudaCheckpointParityTest
    : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy>> {};

// Blocks wrapped in CheckpointWrapper recompute their forward in backward on the rank's
// stream; training equals the unwrapped reference (as CheckpointParityTest on the CPU).
TEST_P(CudaCheckpointParityTest, CheckpointedUnitsTrainLikeThePlainReference) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy] = GetParam();
  expect_cuda_parity<CheckpointedLmImpl>(w, reference<TinyLmImpl>(w, /*adam=*/true),
                                         /*adam=*/true, with_strategy(strategy));
}

INSTANTIATE_TEST_SUITE_P(WorldSizesStrategies, CudaCheckpointParityTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard)));

class CudaShardOnConstructionTest : public ::testing::TestWithParam<int> {};

// Deferred initialisation: units built inside EnableWrap(shard_on_construction) with
// device_id cuda:0 move and shard their parameters as they are built; training equals the
// reference, and every unit's flat parameter lives on the device.
TEST_P(CudaShardOnConstructionTest, UnitsShardedAsTheyAreBuiltTrainLikeTheReference) {
  FSDP_SKIP_WITHOUT_GPU();
  const int w = GetParam();
  const Reference want = reference<NestedImpl>(w, /*adam=*/false);
  on_cuda_ranks(w, [&](std::shared_ptr<Communicator> comm) {
    const auto build = [&] {
      std::lock_guard<std::mutex> lock(seed_mutex());  // the seed is process-wide
      torch::manual_seed(0);
      EnableWrap scope(FullyShardedDataParallelOptions(comm).device_id(kCudaDevice),
                       EnableWrapOptions().shard_on_construction(true));
      return std::make_shared<NestedImpl>();
    };
    const AfterStep<NestedImpl> on_device = [](FullyShardedDataParallelImpl<NestedImpl>& model,
                                               torch::optim::Optimizer&) {
      for (const auto& unit : model.units()) {
        EXPECT_EQ(unit->handle()->device(), kCudaDevice) << unit->fqn();
        EXPECT_EQ(unit->handle()->sharded_flat_param().device(), kCudaDevice) << unit->fqn();
      }
    };
    expect_parity_on<NestedImpl>(comm, want, FullyShardedDataParallelOptions(comm),
                                 /*adam=*/false, on_device, build, kCudaDevice);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CudaShardOnConstructionTest, ::testing::Values(1, 2, 4));

// ---- clip_grad_norm_, no_sync, summon_full_params, execution-order validation.

// `handle`'s gradient gathered to its padded length, on the CPU (every rank calls it).
at::Tensor full_grad(const FlatParamHandle& handle, Communicator& comm) {
  const at::Tensor grad = handle.sharded_flat_param().grad();
  at::Tensor full = at::empty({handle.padded_numel()}, grad.options());
  if (handle.strategy() == ShardingStrategy::kNoShard) {
    full.copy_(grad);
  } else {
    comm.all_gather_into_tensor(full, grad);
  }
  return full.cpu();
}

struct Clipped {
  float total_norm = 0;
  std::vector<at::Tensor> grads;  // per unit, full length, on the CPU (rank 0's)
};

// One backward of NestedImpl on W ranks on `device` (each rank its share of the batch),
// then clip_grad_norm_(1e-2, norm_type): rank 0's total norm and clipped gradients.
Clipped clip_on(int world_size, ShardingStrategy strategy, double norm_type,
                const c10::Device& device) {
  Clipped clipped;
  const Ranks train = [&](std::shared_ptr<Communicator> comm) {
    auto options = FullyShardedDataParallelOptions(comm).sharding_strategy(strategy);
    if (!device.is_cpu()) options.device_id(device);
    FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(), options);
    const Batch batch = NestedImpl::batch(0, kBatchPerRank * world_size);
    const int64_t first = comm->rank() * kBatchPerRank;
    NestedImpl::loss(model->forward(batch.input.narrow(0, first, kBatchPerRank).to(device)),
                     batch.target.narrow(0, first, kBatchPerRank).to(device))
        .backward();
    const at::Tensor total = model->clip_grad_norm_(1e-2, norm_type);
    EXPECT_EQ(total.device(), model->device_handle().device());
    std::vector<at::Tensor> grads;
    for (const auto& unit : model->units()) grads.push_back(full_grad(*unit->handle(), *comm));
    if (comm->rank() == 0) clipped = {total.item<float>(), grads};
  };
  if (device.is_cpu()) {
    on_ranks(world_size, train);
  } else {
    on_cuda_ranks(world_size, train);
  }
  return clipped;
}

class CudaClipGradNormTest
    : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy, double>> {};

// The total norm and the clipped gradients equal the CPU run's (relative 1e-5: the GPU
// sums the squares in another order); the norm exceeds 1e-2, so clipping happened.
TEST_P(CudaClipGradNormTest, EqualsTheCpuRun) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto [w, strategy, norm_type] = GetParam();
  const Clipped cpu = clip_on(w, strategy, norm_type, c10::Device(c10::kCPU));
  const Clipped gpu = clip_on(w, strategy, norm_type, kCudaDevice);
  EXPECT_GT(cpu.total_norm, 1e-2);
  EXPECT_NEAR(gpu.total_norm, cpu.total_norm, 1e-5 * cpu.total_norm);
  ASSERT_EQ(gpu.grads.size(), cpu.grads.size());
  for (size_t i = 0; i < cpu.grads.size(); ++i) {
    EXPECT_TRUE(at::allclose(gpu.grads[i], cpu.grads[i], /*rtol=*/1e-5, /*atol=*/1e-8))
        << "unit " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizesStrategiesNorms, CudaClipGradNormTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kNoShard),
                                            ::testing::Values(2.0, INFINITY)));

// NoSyncTest of fully_sharded_test.cc on the device: inside no_sync no reduction and the
// all-gathers of one iteration (REFERENCE §4, n = 3); the next backward reduces the sum,
// equal to two synced backward passes (1e-6 absolute: one device, two summation orders).
TEST(CudaNoSyncTest, AccumulatesWithoutCommunicationAndTheNextBackwardReducesTheSum) {
  FSDP_SKIP_WITHOUT_GPU();
  on_cuda_ranks(2, [](std::shared_ptr<Communicator> comm) {
    const auto options = FullyShardedDataParallelOptions(comm).device_id(kCudaDevice);
    FullyShardedDataParallel<NetImpl> model(make_net(), options);
    FullyShardedDataParallel<NetImpl> synced(make_net(), options);
    const at::Tensor a = inputs(comm->rank(), 2).to(kCudaDevice);
    const at::Tensor b = inputs(comm->rank() + 5, 2).to(kCudaDevice);
    comm->counters().reset();
    {
      auto no_sync = model->no_sync();
      model->forward(a).sum().backward();
    }
    EXPECT_EQ(comm->counters().get(CollectiveKind::kReduceScatter).calls, 0);
    EXPECT_EQ(comm->counters().get(CollectiveKind::kAllGather).calls, 3 + 2);
    for (const auto& unit : model->units()) {
      EXPECT_TRUE(unit->handle()->has_accumulated_grad());
      EXPECT_FALSE(unit->handle()->sharded_flat_param().grad().defined());
    }
    model->forward(b).sum().backward();
    EXPECT_EQ(comm->counters().get(CollectiveKind::kReduceScatter).calls, 3);
    synced->forward(a).sum().backward();
    synced->forward(b).sum().backward();
    for (size_t i = 0; i < model->units().size(); ++i) {
      const at::Tensor got = full_grad(*model->units()[i]->handle(), *comm);
      const at::Tensor want = full_grad(*synced->units()[i]->handle(), *comm);
      EXPECT_TRUE(at::allclose(got, want, 0, 1e-6)) << "unit " << i;
    }
  });
}

// SummonFullParamsTest of fully_sharded_test.cc on the device: the full parameters are on
// cuda:0; writes reach the shards with writeback and not without; rank0_only gathers on
// rank 0 only.
TEST(CudaSummonFullParamsTest, WritebackEditsTheShardsOnTheDevice) {
  FSDP_SKIP_WITHOUT_GPU();
  on_cuda_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NetImpl> model(
        make_net(), FullyShardedDataParallelOptions(comm).device_id(kCudaDevice));
    const auto filled = [](const FlatParamHandle& handle, double value) {
      return at::full({handle.numel()}, value, at::TensorOptions().device(kCudaDevice));
    };
    {
      auto full = model->summon_full_params();
      torch::NoGradGuard no_grad;
      for (const auto& item : model->named_parameters()) {
        EXPECT_EQ(item.value().device(), kCudaDevice) << item.key();
        item.value().fill_(0.5);
      }
    }
    for (const auto& unit : model->units()) {
      EXPECT_FALSE(unit->handle()->is_unsharded());
      EXPECT_TRUE(at::equal(unit->handle()->full_flat_param(), filled(*unit->handle(), 0.5)));
    }
    {
      auto read_only = model->summon_full_params(SummonFullParamsOptions().writeback(false));
      torch::NoGradGuard no_grad;
      for (const auto& item : model->named_parameters()) item.value().fill_(2.0);
    }
    for (const auto& unit : model->units()) {
      EXPECT_TRUE(at::equal(unit->handle()->full_flat_param(), filled(*unit->handle(), 0.5)));
    }
    auto rank0 =
        model->summon_full_params(SummonFullParamsOptions().writeback(false).rank0_only(true));
    for (const auto& unit : model->units()) {
      EXPECT_EQ(unit->handle()->is_unsharded(), comm->rank() == 0);
    }
  });
}

// ExecutionOrderTest of fully_sharded_options_test.cc on the device.
TEST(CudaExecutionOrderTest, DifferentOrdersAcrossRanksRaiseNamingTheUnits) {
  FSDP_SKIP_WITHOUT_GPU();
  on_cuda_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto net = make<OrderImpl>();
    net->swap = comm->rank() == 1;
    FullyShardedDataParallel<OrderImpl> model(net, FullyShardedDataParallelOptions(comm)
                                                       .device_id(kCudaDevice)
                                                       .validate_execution_order(true));
    EXPECT_THAT(
        [&] {
          model->forward(at::ones({1, 3}, at::TensorOptions().device(kCudaDevice)));
        },
        ThrowsMessage<c10::Error>(
            HasSubstr("forward order differs across ranks at unit position 0 of the first "
                      "iteration: rank 0 runs 'a', rank 1 runs 'b'")));
  });
}

// ---- Memory: the caching allocator against REFERENCE §5.
//
// FULL_SHARD (NO_SHARD at W = 1, which FSDP runs as such) with Adam and no prefetching on
// memory_test.cc's model (8 units of Linear(128, 512) + Linear(512, 128), a root-owned
// Linear(128, 10)), ranks as threads on cuda:0. The caching allocator counts every
// block rounded up to a multiple of 512 bytes (block() below), and its statistics are the
// device's: with W ranks on one GPU the figures are the sum over ranks, whose peaks need
// not coincide, so the per-rank peak is not separable at W > 1. Asserted, from the
// model's unit sizes (per rank: state = sum_i 4 block(4 shard_numel_i), the flat shard,
// its gradient, Adam's exp_avg and exp_avg_sq; unit = block(4 max_i padded_numel_i)):
// - exactly, between steps (after Adam's step, before zero_grad): W x state;
// - the peak of each step after the first (Adam's state exists) at least W x state +
//   block(4 max_i shard_numel_i): every rank holds its state from its last reduction
//   until the next zero_grad, which follows a barrier, and Adam's step allocates a
//   denominator the size of a shard;
// - and at most W x (state + 3 unit + fake scratch) x 1.1, the bound of §5 with no
//   prefetching (the unit unsharded, its unsharded gradient, the flat gradient of the
//   reduction in flight) plus, at W > 1, the fake all-gather's private copies (2 unit:
//   the peers' shards and their concatenation); 10% as memory_test.cc for activations
//   (2 rows: about 0.2 MB) and the other temporaries.
// Before the baseline each rank's stream runs the model's layers once, so cuBLAS's
// workspaces (held by the caching allocator for each stream's handle until the process
// ends) exist before it.
int64_t block(int64_t bytes) { return bytes <= 512 ? 512 : (bytes + 511) / 512 * 512; }

class CudaMemoryTest : public ::testing::TestWithParam<int> {};

TEST_P(CudaMemoryTest, FullShardAdamAgainstTheFormula) {
  FSDP_SKIP_WITHOUT_GPU();
  constexpr int64_t kDim = 128;
  constexpr int kBlocks = 8;
  constexpr int kMemorySteps = 3;
  using ModelImpl = core_internal::MlpModelImpl;
  const int w = GetParam();
  std::shared_ptr<DeviceHandle> device = DeviceHandle::for_device(kCudaDevice);
  int64_t baseline = 0, state = 0, unit = 0, shard = 0, peak = 0, lowest_peak = -1;
  std::vector<int64_t> between_steps;
  on_cuda_ranks(w, [&](std::shared_ptr<Communicator> comm) {
    const bool first = comm->rank() == 0;
    {
      std::shared_ptr<ModelImpl> warm;
      {
        std::lock_guard<std::mutex> lock(seed_mutex());
        warm = std::make_shared<ModelImpl>(kDim, 1, 10);
      }
      warm->to(kCudaDevice);
      warm->forward(at::ones({2, kDim}, at::TensorOptions().device(kCudaDevice))).sum().backward();
    }
    const at::Tensor x =
        at::sin(at::arange(2 * kDim, at::kFloat).view({2, kDim}) + comm->rank()).to(kCudaDevice);
    comm->barrier();
    if (first) baseline = device->memory_allocated();
    comm->barrier();
    std::shared_ptr<ModelImpl> net;
    {
      std::lock_guard<std::mutex> lock(seed_mutex());
      torch::manual_seed(0);
      net = std::make_shared<ModelImpl>(kDim, kBlocks, 10);
    }
    FullyShardedDataParallel<ModelImpl> model(net,
                                              FullyShardedDataParallelOptions(comm)
                                                  .sharding_strategy(ShardingStrategy::kFullShard)
                                                  .backward_prefetch(BackwardPrefetch::kNone)
                                                  .device_id(kCudaDevice));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
    if (first) {
      for (const auto& u : model->units()) {
        const FlatParamHandle* handle = u->handle();
        if (handle == nullptr) continue;
        state += 4 * block(4 * handle->shard_numel());
        unit = std::max(unit, block(4 * handle->padded_numel()));
        shard = std::max(shard, block(4 * handle->shard_numel()));
      }
    }
    for (int step = 0; step < kMemorySteps; ++step) {
      comm->barrier();
      if (first) device->reset_peak_memory_stats();
      comm->barrier();
      adam.zero_grad();
      model->forward(x).pow(2).mean().backward();
      adam.step();
      comm->barrier();
      if (first && step > 0) {
        const int64_t step_peak = device->max_memory_allocated() - baseline;
        peak = std::max(peak, step_peak);
        lowest_peak = lowest_peak < 0 ? step_peak : std::min(lowest_peak, step_peak);
        between_steps.push_back(device->memory_allocated() - baseline);
      }
      comm->barrier();
    }
  });
  const int64_t scratch = w > 1 ? 2 * unit : 0;
  const int64_t bound = w * (state + 3 * unit + scratch);
  std::cout << absl::StrFormat(
                   "cuda memory W = %d: between steps %s B (formula W x state = %d B); peak %d B "
                   "(formula: at least %d B, at most %d B = W x (state %d + 3 x unit %d + "
                   "scratch %d) x 1.1); peak / (W x (state + 3 unit)) = %.4f",
                   w, absl::StrJoin(between_steps, ", "), w * state, peak, w * state + shard,
                   static_cast<int64_t>(1.1 * bound), state, unit, scratch,
                   static_cast<double>(peak) / (w * (state + 3 * unit)))
            << std::endl;
  ASSERT_EQ(between_steps.size(), static_cast<size_t>(kMemorySteps - 1));
  for (int64_t bytes : between_steps) EXPECT_EQ(bytes, w * state);
  EXPECT_GE(lowest_peak, w * state + shard);
  EXPECT_LE(peak, static_cast<int64_t>(1.1 * bound));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CudaMemoryTest, ::testing::Values(1, 2, 4));

// ---- W = 1 without the fake world's threads (the original cases).

TEST(CudaParityTest, DeviceIdMovesTheModelAndTrainsAsOneProcessAtW1) {
  FSDP_SKIP_WITHOUT_GPU();
  const Reference want = reference<NestedImpl>(1, /*adam=*/false);
  auto world = FakeWorld::create(1);
  FullyShardedDataParallel<NestedImpl> model(
      make<NestedImpl>(),
      FullyShardedDataParallelOptions(world->communicator(0)).device_id(kCudaDevice));
  EXPECT_EQ(model->device_handle().device(), kCudaDevice);
  for (const at::Tensor& p : model->parameters()) EXPECT_EQ(p.device(), kCudaDevice);
  auto optimizer = make_optimizer(model->parameters(), /*adam=*/false);
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = NestedImpl::batch(step, kBatchPerRank);
    optimizer->zero_grad();
    at::Tensor loss =
        NestedImpl::loss(model->forward(batch.input.to(kCudaDevice)), batch.target.to(kCudaDevice));
    loss.backward();
    optimizer->step();
    // GPU kernels sum in another order than the CPU reference.
    EXPECT_NEAR(loss.item<float>(), want.losses[step], 1e-5) << "step " << step;
  }
  auto summon = model->summon_full_params(SummonFullParamsOptions().writeback(false));
  for (const auto& item : model->named_parameters()) {
    const std::string fqn = clean_tensor_name(item.key());
    EXPECT_EQ(item.value().device(), kCudaDevice) << fqn;
    EXPECT_TRUE(at::allclose(item.value().cpu(), want.params.at(fqn), /*rtol=*/0, /*atol=*/1e-5))
        << fqn;
  }
}

// ---- Activation checkpointing with dropout on the device (issue 29 item 5).

struct DropoutBlockImpl : torch::nn::Module {
  DropoutBlockImpl() { fc = register_module("fc", torch::nn::Linear(64, 64)); }
  at::Tensor forward(at::Tensor x) { return at::dropout(fc(x), 0.5, /*train=*/true); }
  torch::nn::Linear fc{nullptr};
};

// The weight's gradient of sum(block(x)^2) drawn after torch::manual_seed(7) (seeds the
// CPU and every CUDA generator), through `forward`.
template <typename Forward>
at::Tensor weight_grad(DropoutBlockImpl& block, const Forward& forward) {
  block.zero_grad();
  torch::manual_seed(7);
  forward().square().sum().backward();
  return block.fc->weight.grad().clone();
}

TEST(CudaCheckpointWrapperTest, RecomputesTheFirstRunsDropoutMaskOnTheDevice) {
  FSDP_SKIP_WITHOUT_GPU();
  torch::manual_seed(0);
  auto block = std::make_shared<DropoutBlockImpl>();
  block->to(kCudaDevice);
  const at::Tensor x = at::randn({8, 64}, at::device(kCudaDevice));
  const at::Tensor plain = weight_grad(*block, [&] { return block->forward(x); });
  CheckpointWrapperImpl<DropoutBlockImpl> preserved(block);
  const at::Tensor same = weight_grad(*block, [&] { return preserved.forward(x); });
  EXPECT_TRUE(at::allclose(same, plain, /*rtol=*/0, /*atol=*/1e-6))
      << "max difference " << (same - plain).abs().max().item<float>();
  // Without the device's state the recomputation draws the next mask: another gradient.
  CheckpointWrapperImpl<DropoutBlockImpl> fresh(block, /*preserve_rng_state=*/false);
  const at::Tensor other = weight_grad(*block, [&] { return fresh.forward(x); });
  EXPECT_GT((other - plain).abs().max().item<float>(), 1e-3);
  // The device's generator resumes where the first run left it: the next draw after a
  // checkpointed step equals the next draw after a plain step.
  weight_grad(*block, [&] { return block->forward(x); });
  const at::Tensor after_plain = at::rand({4}, at::device(kCudaDevice));
  weight_grad(*block, [&] { return preserved.forward(x); });
  const at::Tensor after_checkpointed = at::rand({4}, at::device(kCudaDevice));
  EXPECT_TRUE(at::equal(after_checkpointed, after_plain));
}

}  // namespace
}  // namespace fsdp
