// The activation-checkpointing wrapper: same values and gradients as the plain module
// (dropout included), names as in PyTorch, parity inside FSDP units, and lower peak
// memory measured with the tracking allocator.
#include "fsdp/core/checkpoint_wrapper.h"

#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "fsdp/base/names.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/testing/mlp_model.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/core/tracking_allocator.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::ElementsAre;

// up(x), dropout, down: the dropout mask must be the same when recomputed.
struct DropoutBlockImpl : torch::nn::Module {
  DropoutBlockImpl() {
    up = register_module("up", torch::nn::Linear(4, 16));
    down = register_module("down", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(at::Tensor x) {
    return down(torch::nn::functional::dropout(
        up(x), torch::nn::functional::DropoutFuncOptions().p(0.5).training(true)));
  }
  torch::nn::Linear up{nullptr}, down{nullptr};
};

TEST(CheckpointWrapperTest, SameOutputAndGradientsAsThePlainModuleDropoutIncluded) {
  auto plain = make<DropoutBlockImpl>();
  CheckpointWrapper<DropoutBlockImpl> wrapped(make<DropoutBlockImpl>());
  const at::Tensor x = inputs(0, 8);
  at::Tensor x_plain = x.clone().requires_grad_(true), x_wrapped = x.clone().requires_grad_(true);
  torch::manual_seed(7);
  at::Tensor out_plain = plain->forward(x_plain);
  torch::manual_seed(7);
  at::Tensor out_wrapped = wrapped(x_wrapped);
  at::randn({100});  // moves the generator: the recomputation must not see this
  EXPECT_TRUE(at::equal(out_plain, out_wrapped));
  EXPECT_NE(out_wrapped.grad_fn()->name().find("CheckpointFunction"), std::string::npos);
  (out_plain * out_plain).sum().backward();
  (out_wrapped * out_wrapped).sum().backward();
  EXPECT_TRUE(at::equal(x_plain.grad(), x_wrapped.grad()));
  EXPECT_TRUE(at::equal(plain->up->weight.grad(), wrapped->module()->up->weight.grad()));
  EXPECT_TRUE(at::equal(plain->down->bias.grad(), wrapped->module()->down->bias.grad()));
  std::vector<std::string> names;
  for (const auto& item : wrapped->named_parameters()) {
    names.push_back(item.key() + " -> " + clean_tensor_name(item.key()));
  }
  EXPECT_THAT(names, ElementsAre("_checkpoint_wrapped_module.up.weight -> up.weight",
                                 "_checkpoint_wrapped_module.up.bias -> up.bias",
                                 "_checkpoint_wrapped_module.down.weight -> down.weight",
                                 "_checkpoint_wrapped_module.down.bias -> down.bias"));
}

TEST(CheckpointWrapperTest, WithoutGradModeItIsAPlainCall) {
  CheckpointWrapper<DropoutBlockImpl> wrapped(make<DropoutBlockImpl>());
  torch::NoGradGuard no_grad;
  EXPECT_EQ(wrapped(inputs(0, 2)).grad_fn(), nullptr);
}

// fsdp::checkpoint, the functional form: the same output and gradients as the plain call
// (a frozen parameter gets none, an input that does not require grad neither), the
// recomputation under the first run's random state; a plain call without grad mode.
TEST(CheckpointFunctionTest, SameOutputAndGradientsAsThePlainCall) {
  auto plain = make<DropoutBlockImpl>();
  auto block = make<DropoutBlockImpl>();
  for (auto* net : {plain.get(), block.get()}) net->down->bias.requires_grad_(false);
  const at::Tensor x = inputs(0, 8);
  const at::Tensor scale = at::full({4}, 0.5);  // an input without grad
  at::Tensor x_plain = x.clone().requires_grad_(true), x_block = x.clone().requires_grad_(true);
  torch::manual_seed(7);
  at::Tensor out_plain = plain->forward(x_plain) * scale;
  torch::manual_seed(7);
  at::Tensor out_block =
      checkpoint([&](const std::vector<at::Tensor>& in) { return block->forward(in[0]) * in[1]; },
                 {x_block, scale}, block->parameters());
  at::randn({100});  // moves the generator: the recomputation must not see this
  EXPECT_TRUE(at::equal(out_plain, out_block));
  EXPECT_NE(out_block.grad_fn()->name().find("CheckpointFunction"), std::string::npos);
  (out_plain * out_plain).sum().backward();
  (out_block * out_block).sum().backward();
  EXPECT_TRUE(at::equal(x_plain.grad(), x_block.grad()));
  EXPECT_TRUE(at::equal(plain->up->weight.grad(), block->up->weight.grad()));
  EXPECT_TRUE(at::equal(plain->down->weight.grad(), block->down->weight.grad()));
  EXPECT_FALSE(block->down->bias.grad().defined());
  EXPECT_FALSE(scale.grad().defined());
  torch::NoGradGuard no_grad;
  EXPECT_EQ(checkpoint([&](const std::vector<at::Tensor>& in) { return block->forward(in[0]); },
                       {x}, block->parameters())
                .grad_fn(),
            nullptr);
}

class CheckpointParityTest : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy>> {};

TEST_P(CheckpointParityTest, CheckpointedUnitsTrainLikeThePlainReference) {
  const auto [w, strategy] = GetParam();
  const Reference want = reference<TinyLmImpl>(w, /*adam=*/true);
  FakeWorld::run(FakeWorld::create(w), [&, strategy = strategy](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    expect_parity_on<CheckpointedLmImpl>(
        self, want, FullyShardedDataParallelOptions(self).sharding_strategy(strategy),
        /*adam=*/true);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizesStrategies, CheckpointParityTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard)));

// kBlocks residual MLP blocks (dim 32 -> 128 -> 32), each a unit, on kRows rows per rank.
constexpr int kBlocks = 12;
constexpr int64_t kDim = 32;
constexpr int64_t kRows = 256;
using MlpBlock = core_internal::MlpBlockImpl;

template <typename Block>
struct DeepImpl : torch::nn::Module {
  explicit DeepImpl(const std::function<std::shared_ptr<Block>()>& make_block) {
    for (int i = 0; i < kBlocks; ++i) {
      units.push_back(register_module("block" + std::to_string(i), Unit<Block>(make_block())));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& unit : units) x = unit(x);
    return x;
  }
  std::vector<Unit<Block>> units;
};

struct Measured {
  int64_t peak_bytes = 0;  // rank 0's, over forward + backward, above what it held before
  float loss = 0;
};

// Rank 0's peak memory for one forward and backward of DeepImpl<Block> on 2 ranks.
template <typename Block>
Measured measure(const std::function<std::shared_ptr<Block>()>& make_block) {
  Measured measured;
  MemoryTracker tracker;  // before the rank threads start
  FakeWorld::run(FakeWorld::create(2), [&](Communicator& comm) {
    MemoryTagGuard tag(comm.rank());
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    std::shared_ptr<DeepImpl<Block>> net;
    {
      std::lock_guard<std::mutex> lock(seed_mutex());  // the seed is process-wide
      torch::manual_seed(0);
      net = std::make_shared<DeepImpl<Block>>(make_block);
    }
    FullyShardedDataParallel<DeepImpl<Block>> model(net, FullyShardedDataParallelOptions(self));
    const at::Tensor x = at::sin(at::arange(kRows * kDim, at::kFloat).view({kRows, kDim}));
    const int64_t before = memory_allocated(comm.rank());
    reset_peak_memory_stats(comm.rank());
    at::Tensor loss = model->forward(x).pow(2).mean();
    loss.backward();
    if (comm.rank() == 0) {
      measured = {max_memory_allocated(comm.rank()) - before, loss.item<float>()};
    }
  });
  return measured;
}

// Without checkpointing each block keeps its input (kRows x kDim floats, 32 KB, saved by
// fc1) and the ReLU's output (kRows x 4 kDim, 128 KB, saved by the ReLU and fc2) until its
// backward. Checkpointed, only the inputs stay; a recomputing block briefly holds fc1's
// output and the ReLU's (2 x 128 KB) where the plain backward holds the ReLU's only: the
// peak drops by at least (kBlocks - 2) x 128 KB = 1.31 MB (measured: 2.31 MB -> 0.96 MB,
// 1.35 MB less; the rest, common to both, is the inputs and the gradients flowing back).
TEST(CheckpointMemoryTest, CheckpointedUnitsPeakLowerWithTheSameLoss) {
  const Measured plain = measure<MlpBlock>([] { return std::make_shared<MlpBlock>(kDim); });
  const Measured checkpointed = measure<CheckpointWrapperImpl<MlpBlock>>([] {
    return std::make_shared<CheckpointWrapperImpl<MlpBlock>>(std::make_shared<MlpBlock>(kDim),
                                                             /*preserve_rng_state=*/false);
  });
  std::cout << absl::StrFormat(
                   "activation checkpointing, %d blocks, %d rows: peak %.3f MB plain, %.3f MB "
                   "checkpointed (ratio %.3f)",
                   kBlocks, kRows, plain.peak_bytes / 1e6, checkpointed.peak_bytes / 1e6,
                   static_cast<double>(checkpointed.peak_bytes) / plain.peak_bytes)
            << std::endl;
  EXPECT_EQ(plain.loss, checkpointed.loss);
  const int64_t relu_output_bytes = kRows * 4 * kDim * 4;
  EXPECT_GE(plain.peak_bytes - checkpointed.peak_bytes, (kBlocks - 2) * relu_output_bytes);
  EXPECT_LT(checkpointed.peak_bytes, plain.peak_bytes / 2);
}

}  // namespace
}  // namespace fsdp
