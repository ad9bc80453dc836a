// FullyShardedDataParallel against single-process training (REFERENCE §7), with exact
// collective counts (REFERENCE §4), on ranks as threads (the fake communicator).
#include "fsdp/core/fully_sharded.h"

#include <mutex>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "fsdp/comm/fake.h"
#include "fsdp/state/fqn.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Nested linears: two units (l1, l2) and the root's own head; 3 units with parameters.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", make_unit(torch::nn::Linear(4, 8)));
    l2 = register_module("l2", make_unit(torch::nn::Linear(8, 7)));
    head = register_module("head", torch::nn::Linear(7, 3));
  }
  at::Tensor forward(at::Tensor x) {
    namespace F = torch::nn::functional;
    return head(F::relu(l2(F::relu(l1(x)))));
  }
  Unit<torch::nn::LinearImpl> l1{nullptr}, l2{nullptr};
  torch::nn::Linear head{nullptr};
};

// Identical initial weights on every rank and in the reference.
std::shared_ptr<NetImpl> make_net() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(0);
  return std::make_shared<NetImpl>();
}

constexpr int kBatchPerRank = 2;
constexpr int kSteps = 3;

at::Tensor inputs(int step, int64_t rows) {
  return at::sin(at::arange(rows * 4, at::kFloat).view({rows, 4}) * 0.37 + step);
}
at::Tensor targets(int step, int64_t rows) {
  return at::cos(at::arange(rows * 3, at::kFloat).view({rows, 3}) * 0.21 - step);
}

// Losses and final parameters (name -> value) of plain training on the global batch.
std::pair<std::vector<float>, std::map<std::string, at::Tensor>> reference(int world_size) {
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  std::vector<float> losses;
  const int64_t rows = kBatchPerRank * world_size;
  for (int step = 0; step < kSteps; ++step) {
    sgd.zero_grad();
    at::Tensor loss = torch::nn::functional::mse_loss(net->forward(inputs(step, rows)),
                                                      targets(step, rows));
    loss.backward();
    sgd.step();
    losses.push_back(loss.item<float>());
  }
  std::map<std::string, at::Tensor> params;
  for (const auto& item : net->named_parameters()) {
    params[clean_tensor_name(item.key())] = item.value().detach().clone();
  }
  return {losses, params};
}

class ParityTest
    : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy>> {};

TEST_P(ParityTest, LossesAndParametersMatchSingleProcessTraining) {
  const auto [world_size, strategy] = GetParam();
  const auto [want_losses, want_params] = reference(world_size);
  FakeWorld::run(FakeWorld::create(world_size), [&, world_size = world_size,
                                                 strategy = strategy](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    FullyShardedDataParallel<NetImpl> model(
        make_net(), FullyShardedDataParallelOptions(self).sharding_strategy(strategy));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      const int64_t rows = kBatchPerRank * world_size;
      at::Tensor x = inputs(step, rows).narrow(0, comm.rank() * kBatchPerRank, kBatchPerRank);
      at::Tensor y = targets(step, rows).narrow(0, comm.rank() * kBatchPerRank, kBatchPerRank);
      sgd.zero_grad();
      at::Tensor loss = torch::nn::functional::mse_loss(model->forward(x), y);
      loss.backward();
      sgd.step();
      at::Tensor global = loss.detach().clone();
      comm.all_reduce(global, ReduceOp::kAvg);
      EXPECT_NEAR(global.item<float>(), want_losses[step], 1e-6) << "step " << step;
      EXPECT_EQ(model->training_state(), TrainingState::kIdle);
    }
    // Gathered full parameters equal the reference's.
    for (const auto& unit : model->units()) {
      FlatParamHandle* handle = unit->handle();
      ASSERT_NE(handle, nullptr);
      at::Tensor full = handle->full_flat_param();
      for (const FlatParamInfo& info : handle->param_infos()) {
        at::Tensor got = full.narrow(0, info.offset, info.numel).view(info.shape);
        EXPECT_TRUE(at::allclose(got, want_params.at(info.fqn), /*rtol=*/0, /*atol=*/1e-6))
            << info.fqn << " on rank " << comm.rank();
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizesAndStrategies, ParityTest,
    ::testing::Combine(::testing::Values(1, 2, 3),
                       ::testing::Values(ShardingStrategy::kFullShard,
                                         ShardingStrategy::kShardGradOp,
                                         ShardingStrategy::kNoShard)));

struct Counts {
  int64_t all_gathers, reduce_scatters, all_reduces;
};

Counts one_iteration(ShardingStrategy strategy) {
  Counts counts{};
  FakeWorld::run(FakeWorld::create(2), [&](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    FullyShardedDataParallel<NetImpl> model(
        make_net(), FullyShardedDataParallelOptions(self).sharding_strategy(strategy));
    comm.counters().reset();
    model->forward(inputs(0, 2)).sum().backward();
    if (comm.rank() == 0) {
      counts = {comm.counters().get(CollectiveKind::kAllGather).calls,
                comm.counters().get(CollectiveKind::kReduceScatter).calls,
                comm.counters().get(CollectiveKind::kAllReduce).calls};
    }
  });
  return counts;
}

TEST(CollectiveCountsTest, PerIterationAsInReference) {
  // n = 3 units with parameters: l1, l2 and the root (head).
  Counts full = one_iteration(ShardingStrategy::kFullShard);
  EXPECT_EQ(full.all_gathers, 3 + 2);  // forward n, backward n - 1
  EXPECT_EQ(full.reduce_scatters, 3);
  EXPECT_EQ(full.all_reduces, 0);
  Counts zero2 = one_iteration(ShardingStrategy::kShardGradOp);
  EXPECT_EQ(zero2.all_gathers, 3);
  EXPECT_EQ(zero2.reduce_scatters, 3);
  Counts ddp = one_iteration(ShardingStrategy::kNoShard);
  EXPECT_EQ(ddp.all_gathers, 0);
  EXPECT_EQ(ddp.reduce_scatters, 0);
  EXPECT_EQ(ddp.all_reduces, 3);
}

TEST(FullyShardedTest, UnitsFlattenTheirParametersAndFreeThemAfterward) {
  auto world = FakeWorld::create(1);
  FullyShardedDataParallel<NetImpl> model(make_net(),
                                          FullyShardedDataParallelOptions(world->communicator(0)));
  std::vector<std::string> fqns;
  std::vector<int64_t> numels;
  for (const auto& unit : model->units()) {
    fqns.push_back(unit->fqn());
    numels.push_back(unit->handle()->numel());
  }
  EXPECT_THAT(fqns, ElementsAre("", "l1", "l2"));
  EXPECT_THAT(numels, ElementsAre(7 * 3 + 3, 4 * 8 + 8, 8 * 7 + 7));
  EXPECT_THAT(model->units()[1]->handle()->param_infos()[0].fqn, "l1.weight");
  // Names of the original parameters equal the unwrapped model's once cleaned.
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(clean_tensor_name(item.key()));
  EXPECT_THAT(names, ElementsAre("l1.weight", "l1.bias", "l2.weight", "l2.bias", "head.weight",
                                 "head.bias"));
  model->forward(inputs(0, 2)).sum().backward();
  for (const auto& unit : model->units()) {
    EXPECT_FALSE(unit->handle()->is_unsharded()) << unit->fqn();
  }
}

TEST(FullyShardedTest, UnitWithoutRootIsAPassThrough) {
  auto net = make_net();
  at::Tensor out = net->forward(inputs(0, 2));
  EXPECT_EQ(out.sizes(), c10::IntArrayRef({2, 3}));
  EXPECT_EQ(net->l1->state(), nullptr);
}

TEST(FullyShardedTest, NoGradForwardReshardsAndReturnsToIdle) {
  auto world = FakeWorld::create(1);
  FullyShardedDataParallel<NetImpl> model(make_net(),
                                          FullyShardedDataParallelOptions(world->communicator(0)));
  {
    torch::NoGradGuard no_grad;
    model->forward(inputs(0, 2));
  }
  EXPECT_EQ(model->training_state(), TrainingState::kIdle);
  for (const auto& unit : model->units()) EXPECT_FALSE(unit->handle()->is_unsharded());
}

struct TwiceImpl : torch::nn::Module {
  TwiceImpl() { block = register_module("block", make_unit(torch::nn::Linear(3, 3))); }
  at::Tensor forward(at::Tensor x) { return block(block(x)); }
  Unit<torch::nn::LinearImpl> block{nullptr};
};

TEST(FullyShardedTest, UnitUsedTwiceAndSeveralForwardsBeforeOneBackward) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    torch::manual_seed(1);
    auto plain = std::make_shared<TwiceImpl>();
    auto copy = std::make_shared<TwiceImpl>();
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < plain->parameters().size(); ++i) {
        copy->parameters()[i].copy_(plain->parameters()[i]);
      }
    }
    FullyShardedDataParallel<TwiceImpl> model(copy, FullyShardedDataParallelOptions(self));
    at::Tensor x = at::ones({2, 3});
    (model->forward(x).sum() + model->forward(2 * x).sum()).backward();
    (plain->forward(x).sum() + plain->forward(2 * x).sum()).backward();
    // Same input on both ranks: the averaged gradient is the plain one.
    at::Tensor want = at::cat({plain->block->module()->weight.grad().view({-1}),
                               plain->block->module()->bias.grad().view({-1})});
    FlatParamHandle* handle = model->units()[1]->handle();
    at::Tensor full = at::empty({handle->padded_numel()});
    comm.all_gather_into_tensor(full, handle->sharded_flat_param().grad());
    EXPECT_TRUE(at::allclose(full.narrow(0, 0, 12), want, 0, 1e-6));
  });
}

// y = x W^T with a given W (to tie it to another module's).
struct TiedLinearImpl : torch::nn::Module {
  explicit TiedLinearImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, weight.t()); }
  at::Tensor weight;
};

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    a = register_module("a", make_unit(torch::nn::Linear(3, 3)));
    b = register_module(
        "b", Unit<TiedLinearImpl>(std::make_shared<TiedLinearImpl>(a->module()->weight)));
  }
  at::Tensor forward(at::Tensor x) { return b(a(x)); }
  Unit<torch::nn::LinearImpl> a{nullptr};
  Unit<TiedLinearImpl> b{nullptr};
};

TEST(FullyShardedTest, ParameterSharedAcrossUnitsIsNamed) {
  auto world = FakeWorld::create(1);
  EXPECT_THAT([&] {
    FullyShardedDataParallel<TiedImpl> model(std::make_shared<TiedImpl>(),
                                             FullyShardedDataParallelOptions(world->communicator(0)));
  }, ThrowsMessage<c10::Error>(HasSubstr("'b.weight' (unit 'b') and 'a.weight' (unit 'a') are "
                                         "the same parameter in two units")));
}

}  // namespace
}  // namespace fsdp
