// Optimizer state dicts of FSDP models on ranks as threads: values against the
// single-process optimizer, round trips inside training (REFERENCE §7), and errors.
#include "fsdp/state/optim_state_dict.h"

#include <algorithm>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "fsdp/base/torch_compat.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/state/state_dict.h"

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
    torch::optim::LBFGS lbfgs(model->parameters(), torch::optim::LBFGSOptions(0.1));
    const auto unsupported = ::testing::ThrowsMessage<c10::Error>(
        HasSubstr("optimizer torch::optim::LBFGS is not supported; fsdp translates the state of "
                  "torch::optim::SGD, Adam, AdamW, Adagrad and RMSprop"));
    EXPECT_THAT([&] { full_optim_state_dict(*model, lbfgs); }, unsupported);
    EXPECT_THAT([&] { sharded_optim_state_dict(*model, lbfgs); }, unsupported);
    EXPECT_THAT([&] { load_full_optim_state_dict(*model, lbfgs, saved); }, unsupported);
  });
}

// Issue 38: a step of -10^12 (or one that is not a whole number) in a loaded optimizer
// state is refused with the parameter, the value and the range.
TEST(Errors, StepsMustBeCounts) {
  on_ranks(1, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    train_step(model, adamw, 0, comm->rank(), 1);
    OptimStateDict saved = full_optim_state_dict(*model, adamw);
    saved["l1.weight"]["step"] = at::scalar_tensor(int64_t{-1'000'000'000'000}, at::kLong);
    EXPECT_THAT([&] { load_full_optim_state_dict(*model, adamw, saved); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "the step of 'l1.weight' is -1000000000000; expected an integer in [0, 2^53) "
                    "(the file is damaged or was edited: use another checkpoint)")));
    saved["l1.weight"]["step"] = at::scalar_tensor(2.5, at::kFloat);
    EXPECT_THAT([&] { load_full_optim_state_dict(*model, adamw, saved); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("the step of 'l1.weight' is 2.5; expected an integer in [0, 2^53)")));
  });
}

// Adagrad and RMSprop (momentum, centered): an optimizer over `params`, named for messages.
struct OptimizerCase {
  const char* name;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> make;
  std::vector<std::string> state_names;  // as PyTorch's optimizer.state_dict() has them
};

std::vector<OptimizerCase> adagrad_rmsprop_cases() {
  return {
      {"Adagrad",
       [](std::vector<at::Tensor> params) {
         return std::make_unique<torch::optim::Adagrad>(
             params, torch::optim::AdagradOptions(0.05).initial_accumulator_value(0.1));
       },
       {"sum", "step"}},
      {"RMSprop",
       [](std::vector<at::Tensor> params) {
         return std::make_unique<torch::optim::RMSprop>(params, torch::optim::RMSpropOptions(0.01));
       },
       {"square_avg", "step"}},
      {"RMSprop(momentum, centered)",
       [](std::vector<at::Tensor> params) {
         return std::make_unique<torch::optim::RMSprop>(
             params, torch::optim::RMSpropOptions(0.01).momentum(0.9).centered(true));
       },
       {"square_avg", "momentum_buffer", "grad_avg", "step"}},
  };
}

// The reference: TinyLm trained `steps` steps on the global batch of `world_size` ranks.
void train_reference(torch::optim::Optimizer& optimizer, const std::shared_ptr<TinyLmImpl>& net,
                     int steps, int world_size) {
  for (int step = 0; step < steps; ++step) {
    const Batch batch = TinyLmImpl::batch(step, kBatchPerRank * world_size);
    optimizer.zero_grad();
    at::Tensor loss = at::zeros({});
    for (int r = 0; r < world_size; ++r) {
      loss = loss +
             TinyLmImpl::loss(net->forward(batch.input.narrow(0, r * kBatchPerRank, kBatchPerRank)),
                              batch.target.narrow(0, r * kBatchPerRank, kBatchPerRank));
    }
    (loss / world_size).backward();
    optimizer.step();
  }
}

TEST(AdagradRmsprop, StateEqualsTheSingleProcessOneAndRoundTripsKeepTraining) {
  constexpr int kWorld = 3;
  constexpr int kSteps = 3;
  for (const OptimizerCase& c : adagrad_rmsprop_cases()) {
    SCOPED_TRACE(c.name);
    std::shared_ptr<TinyLmImpl> net = make<TinyLmImpl>();
    std::unique_ptr<torch::optim::Optimizer> reference = c.make(net->parameters());
    train_reference(*reference, net, kSteps, kWorld);
    on_ranks(kWorld, [&](std::shared_ptr<Communicator> comm) {
      FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                                 FullyShardedDataParallelOptions(comm));
      std::unique_ptr<torch::optim::Optimizer> optimizer = c.make(model->parameters());
      // Step 0, a full round trip, step 1, a sharded round trip, step 2.
      train_step(model, *optimizer, 0, comm->rank(), kWorld);
      const OptimStateDict full = full_optim_state_dict(*model, *optimizer);
      optimizer->state().clear();
      load_full_optim_state_dict(*model, *optimizer, full);
      train_step(model, *optimizer, 1, comm->rank(), kWorld);
      const ShardedOptimStateDict sharded = sharded_optim_state_dict(*model, *optimizer);
      optimizer->state().clear();
      load_sharded_optim_state_dict(*model, *optimizer, sharded);
      train_step(model, *optimizer, 2, comm->rank(), kWorld);

      const OptimStateDict got = full_optim_state_dict(*model, *optimizer);
      EXPECT_EQ(got.size(), net->parameters().size());
      const StateDict params = full_state_dict(*model);
      for (const auto& item : net->named_parameters()) {
        const std::string fqn = clean_tensor_name(item.key());
        const ParamOptimState& state = got[fqn];
        EXPECT_EQ(state.keys(), c.state_names) << fqn;
        // PyTorch's Adagrad and RMSprop keep the step as a 0-dim float32 tensor.
        EXPECT_EQ(state["step"].dim(), 0);
        EXPECT_EQ(state["step"].scalar_type(), at::kFloat);
        EXPECT_EQ(state["step"].item<float>(), kSteps);
        const torch::optim::OptimizerParamState& want =
            *reference->state().at(compat::optimizer_state_key(item.value()));
        std::vector<std::pair<std::string, at::Tensor>> tensors;
        if (auto* adagrad = dynamic_cast<const torch::optim::AdagradParamState*>(&want)) {
          tensors = {{"sum", adagrad->sum()}};
        } else {
          const auto& rms = static_cast<const torch::optim::RMSpropParamState&>(want);
          tensors = {{"square_avg", rms.square_avg()},
                     {"momentum_buffer", rms.momentum_buffer()},
                     {"grad_avg", rms.grad_avg()}};
        }
        for (const auto& [name, tensor] : tensors) {
          if (!tensor.defined()) continue;
          // Absolute tolerance on the tensor's scale: sharded and whole gradients round
          // differently (the sums run in another order; MKL's AVX-512 kernels differ from
          // its AVX2 ones), by a few ulps of the largest value, not of each element.
          const double scale = std::max(1.0, tensor.abs().max().item<double>());
          EXPECT_TRUE(at::allclose(state[name], tensor, 1e-4, 1e-6 * scale))
              << fqn << " " << name << ": largest difference "
              << (state[name] - tensor).abs().max().item<double>() << " of largest value "
              << tensor.abs().max().item<double>();
        }
        EXPECT_TRUE(at::allclose(params[fqn], item.value(), 1e-4, 1e-6)) << fqn;
      }
    });
  }
}

TEST(AdagradRmsprop, RmspropStateWithoutTheMomentumTheOptimizerNeedsIsAnError) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::RMSprop plain(model->parameters(), torch::optim::RMSpropOptions(0.01));
    train_step(model, plain, 0, comm->rank(), 2);
    const OptimStateDict saved = full_optim_state_dict(*model, plain);
    torch::optim::RMSprop momentum(model->parameters(),
                                   torch::optim::RMSpropOptions(0.01).momentum(0.9));
    EXPECT_THAT([&] { load_full_optim_state_dict(*model, momentum, saved); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("has no 'momentum_buffer'; the RMSprop optimizer has momentum > 0")));
    torch::optim::Adagrad adagrad(model->parameters(), torch::optim::AdagradOptions(0.01));
    EXPECT_THAT([&] { load_full_optim_state_dict(*model, adagrad, saved); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("has no 'sum'; it was made by another kind of optimizer")));
  });
}

// param_groups with PyTorch's names and values, FQN lists, a round trip, and errors.
TEST(OptimParamGroups, PyTorchNamesFqnsAndRoundTrip) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::AdamW adamw(model->parameters(),
                              torch::optim::AdamWOptions(0.02).betas({0.8, 0.95}));
    std::vector<OptimParamGroup> groups = optim_param_groups(*model, adamw);
    ASSERT_EQ(groups.size(), 1u);
    std::vector<std::string> names;
    for (const auto& option : groups[0].options) names.push_back(option.first);
    EXPECT_THAT(names,
                ElementsAre("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                            "capturable", "differentiable", "fused", "decoupled_weight_decay"));
    EXPECT_EQ(groups[0].find("lr")->toDouble(), 0.02);
    EXPECT_EQ(groups[0].find("betas")->toTupleRef().elements()[1].toDouble(), 0.95);
    EXPECT_EQ(groups[0].find("weight_decay")->toDouble(), 0.01);
    EXPECT_TRUE(groups[0].find("foreach")->isNone());
    EXPECT_TRUE(groups[0].find("decoupled_weight_decay")->toBool());
    EXPECT_EQ(groups[0].params, std::vector<std::string>({"l1.weight", "l1.bias", "l2.weight",
                                                          "l2.bias", "head.weight", "head.bias"}));

    torch::optim::AdamW other(model->parameters(), torch::optim::AdamWOptions(1.0));
    groups[0].options[0].second = 0.5;         // lr
    groups[0].options[4].second = true;        // amsgrad
    groups[0].options[3].second = int64_t{0};  // weight_decay as PyTorch's int 0
    load_optim_param_groups(*model, other, groups);
    const auto& o =
        static_cast<const torch::optim::AdamWOptions&>(other.param_groups()[0].options());
    EXPECT_EQ(o.lr(), 0.5);
    EXPECT_EQ(o.betas(), std::make_tuple(0.8, 0.95));
    EXPECT_TRUE(o.amsgrad());
    EXPECT_EQ(o.weight_decay(), 0.0);

    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    const std::vector<OptimParamGroup> sgd_groups = optim_param_groups(*model, sgd);
    names.clear();
    for (const auto& option : sgd_groups[0].options) names.push_back(option.first);
    EXPECT_THAT(names, ElementsAre("lr", "momentum", "dampening", "weight_decay", "nesterov",
                                   "maximize", "foreach", "differentiable", "fused"));
    EXPECT_EQ(sgd_groups[0].find("momentum")->toDouble(), 0.9);

    groups[0].options[5].second = true;  // maximize
    EXPECT_THAT([&] { load_optim_param_groups(*model, other, groups); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("load_optim_param_groups: param_groups[0]['maximize'] is Bool True; "
                              "LibTorch's optimizer has no such option and behaves as False")));
    groups[0].options[5].second = false;
    groups[0].params.pop_back();
    EXPECT_THAT([&] { load_optim_param_groups(*model, other, groups); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "param_groups[0] holds 'l1.weight', 'l1.bias', 'l2.weight', 'l2.bias', "
                    "'head.weight' but the optimizer's holds 'l1.weight', 'l1.bias', "
                    "'l2.weight', 'l2.bias', 'head.weight', 'head.bias'")));
    torch::optim::LBFGS lbfgs(model->parameters(), torch::optim::LBFGSOptions(0.1));
    EXPECT_THAT([&] { optim_param_groups(*model, lbfgs); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("LBFGSOptions are not supported")));
  });
}

// The option names of one group, in order.
std::vector<std::string> option_names(const OptimParamGroup& group) {
  std::vector<std::string> names;
  for (const auto& option : group.options) names.push_back(option.first);
  return names;
}

// Adagrad's and RMSprop's param_groups: torch 2.11's names in its order (what
// torch.optim.Adagrad / RMSprop(...).state_dict()["param_groups"] hold), and a round trip.
TEST(OptimParamGroups, AdagradAndRmspropByPyTorchNames) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    torch::optim::Adagrad adagrad(
        model->parameters(),
        torch::optim::AdagradOptions(0.02).lr_decay(0.1).initial_accumulator_value(0.5));
    std::vector<OptimParamGroup> groups = optim_param_groups(*model, adagrad);
    ASSERT_EQ(groups.size(), 1u);
    EXPECT_THAT(option_names(groups[0]),
                ElementsAre("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value",
                            "foreach", "maximize", "differentiable", "fused"));
    EXPECT_EQ(groups[0].find("lr_decay")->toDouble(), 0.1);
    EXPECT_EQ(groups[0].find("eps")->toDouble(), 1e-10);
    EXPECT_EQ(groups[0].find("initial_accumulator_value")->toDouble(), 0.5);
    EXPECT_TRUE(groups[0].find("fused")->isNone());
    EXPECT_EQ(groups[0].params.size(), 6u);
    torch::optim::Adagrad other_adagrad(model->parameters(), torch::optim::AdagradOptions(1.0));
    groups[0].options[3].second = 0.25;  // weight_decay
    load_optim_param_groups(*model, other_adagrad, groups);
    const auto& a =
        static_cast<const torch::optim::AdagradOptions&>(other_adagrad.param_groups()[0].options());
    EXPECT_EQ(a.lr(), 0.02);
    EXPECT_EQ(a.lr_decay(), 0.1);
    EXPECT_EQ(a.weight_decay(), 0.25);
    EXPECT_EQ(a.initial_accumulator_value(), 0.5);

    torch::optim::RMSprop rmsprop(
        model->parameters(),
        torch::optim::RMSpropOptions(0.03).alpha(0.9).momentum(0.5).centered(true));
    groups = optim_param_groups(*model, rmsprop);
    EXPECT_THAT(option_names(groups[0]),
                ElementsAre("lr", "momentum", "alpha", "eps", "centered", "weight_decay",
                            "capturable", "foreach", "maximize", "differentiable"));
    EXPECT_EQ(groups[0].find("alpha")->toDouble(), 0.9);
    EXPECT_EQ(groups[0].find("momentum")->toDouble(), 0.5);
    EXPECT_TRUE(groups[0].find("centered")->toBool());
    EXPECT_FALSE(groups[0].find("capturable")->toBool());
    torch::optim::RMSprop other_rmsprop(model->parameters(), torch::optim::RMSpropOptions(1.0));
    load_optim_param_groups(*model, other_rmsprop, groups);
    const auto& r =
        static_cast<const torch::optim::RMSpropOptions&>(other_rmsprop.param_groups()[0].options());
    EXPECT_EQ(r.lr(), 0.03);
    EXPECT_EQ(r.alpha(), 0.9);
    EXPECT_EQ(r.momentum(), 0.5);
    EXPECT_TRUE(r.centered());
    groups[0].options[8].second = true;  // maximize
    EXPECT_THAT([&] { load_optim_param_groups(*model, other_rmsprop, groups); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("param_groups[0]['maximize'] is Bool True; LibTorch's optimizer has "
                              "no such option and behaves as False")));
  });
}

}  // namespace
}  // namespace fsdp
