// Optimizer state dicts of FSDP models on ranks as threads: values against the
// single-process optimizer, round trips inside training (REFERENCE §7), and errors.
#include "fsdp/state/optim_state_dict.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/rmsprop.h>

#include "fsdp/base/torch_compat.h"
#include "fsdp/core/internal/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// One training step of `model` on this rank's share of the global batch.
template <typename Model>
void train_step(Model& model, torch::optim::Optimizer& optimizer, int step, int rank,
                int world_size) {
  using Net = std::decay_t<decltype(*model->module())>;
  const Batch batch = Net::batch(step, kBatchPerRank * world_size);
  optimizer.zero_grad();
  Net::loss(model->forward(batch.input.narrow(0, rank * kBatchPerRank, kBatchPerRank)),
            batch.target.narrow(0, rank * kBatchPerRank, kBatchPerRank))
      .backward();
  optimizer.step();
}

TEST(FullOptimStateDict, EqualsTheSingleProcessAdamState) {
  // The reference: TinyLm trained on the global batch, its Adam state by FQN.
  constexpr int kWorld = 3;
  auto net = make<TinyLmImpl>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 2; ++step) {
    const Batch batch = TinyLmImpl::batch(step, kBatchPerRank * kWorld);
    adam.zero_grad();
    at::Tensor loss = at::zeros({});
    for (int r = 0; r < kWorld; ++r) {
      loss = loss +
             TinyLmImpl::loss(net->forward(batch.input.narrow(0, r * kBatchPerRank, kBatchPerRank)),
                              batch.target.narrow(0, r * kBatchPerRank, kBatchPerRank));
    }
    (loss / kWorld).backward();
    adam.step();
  }
  on_ranks(kWorld, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 2; ++step) train_step(model, optimizer, step, comm->rank(), kWorld);
    const OptimStateDict got = full_optim_state_dict(*model, optimizer);
    EXPECT_EQ(got.size(), net->parameters().size());
    for (const auto& item : net->named_parameters()) {
      const auto& want = static_cast<const torch::optim::AdamParamState&>(
          *adam.state().at(compat::optimizer_state_key(item.value())));
      const ParamOptimState& state = got[clean_tensor_name(item.key())];
      EXPECT_THAT(state.keys(), ElementsAre("exp_avg", "exp_avg_sq", "step"));
      EXPECT_EQ(state["step"].item<int64_t>(), 2);
      EXPECT_TRUE(at::allclose(state["exp_avg"], want.exp_avg(), 1e-5, 1e-7)) << item.key();
      EXPECT_TRUE(at::allclose(state["exp_avg_sq"], want.exp_avg_sq(), 1e-5, 1e-9)) << item.key();
    }
    const OptimStateDict rank0 =
        full_optim_state_dict(*model, optimizer, FullStateDictOptions().rank0_only(true));
    EXPECT_EQ(rank0.is_empty(), comm->rank() != 0);
  });
}

enum class Kind { kFull, kSharded };

// REFERENCE §7 with the optimizer: after every step, save the model and optimizer state,
// wipe both, load them back; training keeps matching the reference. `offload`: with
// cpu_offload, the optimizer state on the host.
template <typename Net>
void expect_round_trips_keep_parity(Kind kind, int world_size, ShardingStrategy strategy, bool adam,
                                    bool offload = false) {
  const Reference want = reference<Net>(world_size, adam);
  on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
    expect_parity_on<Net>(
        comm, want,
        FullyShardedDataParallelOptions(comm).sharding_strategy(strategy).cpu_offload(offload),
        adam, [&](FullyShardedDataParallelImpl<Net>& model, torch::optim::Optimizer& optimizer) {
          if (kind == Kind::kFull) {
            const OptimStateDict saved = full_optim_state_dict(model, optimizer);
            optimizer.state().clear();
            load_full_optim_state_dict(model, optimizer, saved);
          } else {
            const ShardedOptimStateDict saved = sharded_optim_state_dict(model, optimizer);
            optimizer.state().clear();
            load_sharded_optim_state_dict(model, optimizer, saved);
          }
        });
  });
}

class RoundTripTest
    : public ::testing::TestWithParam<std::tuple<Kind, int, ShardingStrategy, bool>> {};

TEST_P(RoundTripTest, SaveClearLoadEveryStepKeepsParity) {
  const auto [kind, w, strategy, adam] = GetParam();
  if (adam) {
    expect_round_trips_keep_parity<TinyLmImpl>(kind, w, strategy, adam);
  } else {
    expect_round_trips_keep_parity<NormedImpl>(kind, w, strategy, adam);
  }
}

INSTANTIATE_TEST_SUITE_P(
    KindsStrategies, RoundTripTest,
    ::testing::Combine(::testing::Values(Kind::kFull, Kind::kSharded), ::testing::Values(2, 3),
                       ::testing::Values(ShardingStrategy::kFullShard, ShardingStrategy::kNoShard),
                       ::testing::Bool()));

TEST(CpuOffload, SaveClearLoadEveryStepKeepsParityWithTheStateOnTheHost) {
  for (Kind kind : {Kind::kFull, Kind::kSharded}) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      expect_round_trips_keep_parity<TinyLmImpl>(kind, 3, strategy, /*adam=*/true,
                                                 /*offload=*/true);
    }
  }
}

TEST(FullOptimStateDict, NoStateBeforeTheFirstStep) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
    EXPECT_THAT(full_optim_state_dict(*model, optimizer).keys(), IsEmpty());
    load_full_optim_state_dict(*model, optimizer, OptimStateDict());
    EXPECT_TRUE(optimizer.state().empty());
  });
}

TEST(Errors, UnexpectedKeysWrongOptimizerAndUnsupportedOptimizer) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    train_step(model, sgd, 0, comm->rank(), 2);
    OptimStateDict saved = full_optim_state_dict(*model, sgd);
    EXPECT_THAT(saved["l1.weight"].keys(), ElementsAre("momentum_buffer"));

    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    EXPECT_THAT([&] { load_full_optim_state_dict(*model, adam, saved); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "the optimizer state of 'head.weight' has no 'exp_avg'; it was made by "
                    "another kind of optimizer")));
    OptimStateDict extra = saved;
    extra.insert("l9.weight", ParamOptimState());
    EXPECT_THAT([&] { load_full_optim_state_dict(*model, sgd, extra); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("load_full_optim_state_dict: some keys are not the model's "
                              "parameters; unexpected keys (1): 'l9.weight'. Optimizer "
                              "state is keyed by the model's parameter FQNs")));
    OptimStateDict partial = saved;
    partial.erase("l1.bias");
    EXPECT_THAT([&] { load_full_optim_state_dict(*model, sgd, partial); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "are in one flat parameter (unit 'l1') but have different optimizer state "
                    "names")));
    torch::optim::RMSprop rmsprop(model->parameters(), torch::optim::RMSpropOptions(0.1));
    train_step(model, rmsprop, 1, comm->rank(), 2);
    EXPECT_THAT([&] { full_optim_state_dict(*model, rmsprop); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "is not supported; fsdp translates the state of torch::optim::SGD, Adam and "
                    "AdamW")));
  });
}

}  // namespace
}  // namespace fsdp
