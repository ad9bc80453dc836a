// Units holding flat parameters of several dtypes (Note [Flat parameters of several dtypes]
// in flat_param.cc): which flat parameters a unit gets, what each rank holds, the
// collectives and bytes of one iteration against the memory plan's, training against one
// process, summon_full_params, CPU offload and meta initialisation.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/ScalarType.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/memory_plan.h"
#include "fsdp/core/testing/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::ElementsAre;

c10::ScalarType dtype_of(const FlatParamHandle& handle) {
  return handle.sharded_flat_param().scalar_type();
}

TEST(MixedDtypeTest, AUnitGetsOneFlatParameterPerKindAndDtype) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<MixedDtypeLmImpl> model(make<MixedDtypeLmImpl>(),
                                                     FullyShardedDataParallelOptions(comm));
    const auto& units = model->units();
    ASSERT_EQ(units.size(), 3u);
    const FullyShardedUnit& root = *units[0];
    EXPECT_THAT(fqns_of(*root.handle()), ElementsAre("embedding.weight"));
    ASSERT_EQ(root.frozen_handles().size(), 1u);
    EXPECT_THAT(fqns_of(*root.frozen_handles()[0]), ElementsAre("out_scale"));
    EXPECT_EQ(dtype_of(*root.frozen_handles()[0]), at::kBFloat16);
    const FullyShardedUnit& block = *units[1];
    EXPECT_THAT(fqns_of(*block.handle()),
                ElementsAre("blocks.0.up_bias", "blocks.0.down.weight", "blocks.0.down.bias"));
    ASSERT_EQ(block.frozen_handles().size(), 2u);
    const FlatParamHandle& bf16 = *block.frozen_handles()[0];
    const FlatParamHandle& codes = *block.frozen_handles()[1];
    EXPECT_THAT(fqns_of(bf16), ElementsAre("blocks.0.up_weight"));
    EXPECT_THAT(fqns_of(codes), ElementsAre("blocks.0.up_codes"));
    EXPECT_EQ(dtype_of(*block.handle()), at::kFloat);
    EXPECT_EQ(dtype_of(bf16), at::kBFloat16);
    EXPECT_EQ(dtype_of(codes), at::kByte);
    // Each flat parameter keeps its dtype in its shard: ceil(numel / 2) elements.
    EXPECT_EQ(block.handle()->shard_numel(), 76);
    EXPECT_EQ(bf16.shard_numel(), 64);
    EXPECT_EQ(codes.shard_numel(), 8);
    EXPECT_EQ(codes.param_dtype(), at::kByte);
    EXPECT_FALSE(bf16.sharded_flat_param().requires_grad());
    EXPECT_FALSE(codes.sharded_flat_param().requires_grad());
    // The optimizer's list: the trainable flat parameters only.
    const std::vector<at::Tensor> params = model->parameters();
    ASSERT_EQ(params.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_TRUE(params[k].is_same(units[k]->handle()->sharded_flat_param()));
    }
  });
}

// One FULL_SHARD iteration at W = 2: 8 all-gathers in forward (the root's 2, each block's
// 3) and 6 in backward (the root stays gathered), each moving its flat parameter's own
// dtype; 3 reduce-scatters of fp32 gradients. The memory plan's traffic is the same, call
// for call and byte for byte, and its sharded parameter bytes are what the ranks hold.
TEST(MixedDtypeTest, EachDtypeIsGatheredAsItIsAndOnlyGradientsAreReduced) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<MixedDtypeLmImpl> model(make<MixedDtypeLmImpl>(),
                                                     FullyShardedDataParallelOptions(comm));
    const Batch batch = MixedDtypeLmImpl::batch(0, 2);
    comm->counters().reset();
    MixedDtypeLmImpl::loss(model->forward(batch.input), batch.target).backward();
    const CollectiveTraffic gathered = comm->counters().get(CollectiveKind::kAllGather);
    EXPECT_EQ(gathered.calls, 8 + 6);
    // (W - 1) shards sent per all-gather: root 44 x 4 + 4 x 2 bytes, a block 76 x 4 +
    // 64 x 2 + 8 x 1; the blocks twice.
    const int64_t root_bytes = 44 * 4 + 4 * 2;
    const int64_t block_bytes = 76 * 4 + 64 * 2 + 8;
    EXPECT_EQ(gathered.bytes_sent, root_bytes + 4 * block_bytes);
    const CollectiveTraffic reduced = comm->counters().get(CollectiveKind::kReduceScatter);
    EXPECT_EQ(reduced.calls, 3);
    EXPECT_EQ(reduced.bytes_sent, (44 + 2 * 76) * 4);
    for (const auto& unit : model->units()) {
      for (FlatParamHandle* frozen : unit->frozen_handles()) {
        EXPECT_FALSE(frozen->sharded_flat_param().grad().defined()) << unit->fqn();
        EXPECT_EQ(frozen->state(), FlatParamState::kSharded) << unit->fqn();
      }
    }
    const MemoryPlan plan = model->memory_plan(OptimizerSpec::sgd(/*momentum=*/false));
    const CollectiveTraffic planned_gather =
        plan.traffic[static_cast<int>(CollectiveKind::kAllGather)];
    EXPECT_EQ(planned_gather.calls, gathered.calls);
    EXPECT_EQ(planned_gather.bytes_sent, gathered.bytes_sent);
    const CollectiveTraffic planned_reduce =
        plan.traffic[static_cast<int>(CollectiveKind::kReduceScatter)];
    EXPECT_EQ(planned_reduce.calls, reduced.calls);
    EXPECT_EQ(planned_reduce.bytes_sent, reduced.bytes_sent);
    EXPECT_EQ(plan.max_bytes[static_cast<int>(PlanTerm::kShardedParameters)],
              (44 * 4 + 4 * 2) + 2 * (76 * 4 + 64 * 2 + 8 * 1));
  });
}

// Mixed precision casts the floating flat parameters (the frozen bf16 ones too, to
// param_dtype) and never the stored uint8 codes.
TEST(MixedDtypeTest, MixedPrecisionLeavesStoredValuesAlone) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<MixedDtypeLmImpl> model(
        make<MixedDtypeLmImpl>(),
        FullyShardedDataParallelOptions(comm).mixed_precision(
            MixedPrecision().param_dtype(at::kHalf).reduce_dtype(at::kFloat)));
    const FullyShardedUnit& block = *model->units()[1];
    EXPECT_EQ(block.handle()->param_dtype(), at::kHalf);
    EXPECT_EQ(block.frozen_handles()[0]->param_dtype(), at::kHalf);
    EXPECT_EQ(block.frozen_handles()[1]->param_dtype(), at::kByte);
    const Batch batch = MixedDtypeLmImpl::batch(0, 2);
    at::Tensor loss = MixedDtypeLmImpl::loss(model->forward(batch.input), batch.target);
    loss.backward();
    EXPECT_TRUE(std::isfinite(loss.item<float>()));
    auto summon = model->summon_full_params(SummonFullParamsOptions().writeback(false));
    auto reference = make<MixedDtypeLmImpl>();
    auto& inner = *model->module()->blocks[1]->as<UnitImpl<MixedDtypeBlockImpl>>()->module();
    auto& want = *reference->blocks[1]->as<UnitImpl<MixedDtypeBlockImpl>>()->module();
    EXPECT_EQ(inner.up_codes.scalar_type(), at::kByte);
    EXPECT_TRUE(at::equal(inner.up_codes, want.up_codes));
    EXPECT_TRUE(at::equal(inner.up_weight, want.up_weight));
  });
}

// Training equals one process with the same weights at W = 1, 2, 3 under every strategy
// (SGD and Adam); the frozen bf16 and uint8 values end as they began, bit for bit.
TEST(MixedDtypeTest, ParityWithOneProcessEveryStrategy) {
  for (int world_size : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "W = " << world_size);
    on_ranks(world_size, [](std::shared_ptr<Communicator> comm) {
      expect_parity_for_all_strategies<MixedDtypeLmImpl>(comm);
    });
  }
}

TEST(MixedDtypeTest, ParityWithCpuOffload) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    const Reference want = reference<MixedDtypeLmImpl>(2, /*adam=*/true);
    expect_parity_on<MixedDtypeLmImpl>(
        comm, want,
        FullyShardedDataParallelOptions(comm).cpu_offload(CPUOffload().offload_params(true)),
        /*adam=*/true);
  });
}

// Gradients of one unit are reduced together: trainable parameters of two dtypes in one
// unit are refused, naming both.
TEST(MixedDtypeTest, TrainableParametersOfTwoDtypesAreRefusedByName) {
  on_ranks(1, [](std::shared_ptr<Communicator> comm) {
    auto net = make<MixedDtypeLmImpl>();
    net->blocks[0]->as<UnitImpl<MixedDtypeBlockImpl>>()->module()->up_weight.set_requires_grad(
        true);
    EXPECT_THAT(
        [&] {
          FullyShardedDataParallel<MixedDtypeLmImpl> model(net,
                                                           FullyShardedDataParallelOptions(comm));
        },
        ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr(
            "the trainable parameters of unit 'blocks.0' must share one dtype (their gradients "
            "are reduced together, as in PyTorch's FSDP), but 'blocks.0.up_weight' is BFloat16 "
            "and 'blocks.0.up_bias' is Float")));
  });
}

}  // namespace
}  // namespace fsdp
