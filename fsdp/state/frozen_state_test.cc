// State of models whose units mix frozen and trainable parameters (two flat parameters
// per unit; Note [Frozen parameters in a unit] in fsdp/core/internal/runtime.cc), and
// frozen parameters of several dtypes (bf16 and uint8 beside fp32: a flat parameter per
// dtype; Note [Flat parameters of several dtypes] in fsdp/core/flat_param.cc): every
// parameter keeps its own name and dtype in full, sharded and local state dicts, optimizer
// state covers the trainable ones only, and checkpoints reshard across world sizes.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/adam.h>

#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/dcp_checkpoint.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/state/safetensors_state_dict.h"
#include "fsdp/state/state_dict.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::ElementsAre;

template <typename Net>
FullyShardedDataParallel<Net> wrap(std::shared_ptr<Communicator> comm) {
  return FullyShardedDataParallel<Net>(make<Net>(), FullyShardedDataParallelOptions(comm));
}

// Both flat parameters of every unit zeroed (zero_model of state_dict_testing.h zeroes
// the optimizer's, the trainable ones only).
void zero_every_flat_param(FullyShardedRoot& model) {
  torch::NoGradGuard no_grad;
  for (const auto& unit : model.units()) {
    for (FlatParamHandle* handle : unit->handles()) handle->sharded_flat_param().zero_();
  }
}

TEST(FrozenStateTest, EveryParameterKeepsItsName) {
  const StateDict want = module_state_dict(*make<FrozenLmImpl>());
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<FrozenLmImpl>(comm);
    const StateDict full = full_state_dict(*model);
    ASSERT_EQ(full.keys(), want.keys());
    for (const auto& item : want) EXPECT_TRUE(at::equal(full[item.key()], item.value()));
    EXPECT_EQ(sharded_state_dict(*model).keys(), want.keys());
    EXPECT_THAT(local_state_dict(*model).tensors.keys(),
                ElementsAre("_flat_param", "_frozen_flat_param", "blocks.0._flat_param",
                            "blocks.0._frozen_flat_param", "blocks.1._flat_param",
                            "blocks.1._frozen_flat_param"));
    zero_every_flat_param(*model);
    load_full_state_dict(*model, full);
    const StateDict again = full_state_dict(*model);
    for (const auto& item : want) EXPECT_TRUE(at::equal(again[item.key()], item.value()));
  });
}

// REFERENCE §7's round trip: save, zero every flat parameter of every unit, load, after
// every step; training still matches one process with the same parameters frozen.
template <typename Net>
void expect_save_zero_load_parity(std::shared_ptr<Communicator> comm) {
  const Reference want = reference<Net>(2, /*adam=*/true);
  for (int kind = 0; kind < 3; ++kind) {
    SCOPED_TRACE(::testing::Message() << "kind " << kind);
    expect_parity_on<Net>(
        comm, want, FullyShardedDataParallelOptions(comm), /*adam=*/true,
        [kind](FullyShardedDataParallelImpl<Net>& model, torch::optim::Optimizer&) {
          if (kind == 0) {
            const StateDict saved = full_state_dict(model);
            zero_every_flat_param(model);
            load_full_state_dict(model, saved);
          } else if (kind == 1) {
            const ShardedStateDict saved = sharded_state_dict(model);
            zero_every_flat_param(model);
            load_sharded_state_dict(model, saved);
          } else {
            const LocalStateDict saved = local_state_dict(model);
            zero_every_flat_param(model);
            load_local_state_dict(model, saved);
          }
        });
  }
}

TEST(FrozenStateTest, SaveZeroLoadEveryStepKeepsParity) {
  on_ranks(2, expect_save_zero_load_parity<FrozenLmImpl>);
}

template <typename Net>
void train_step(FullyShardedDataParallelImpl<Net>& model, torch::optim::Optimizer& opt, int step,
                int rank) {
  const Batch batch = Net::batch(step, 4);  // this rank: rows 2 rank, 2 rank + 1
  opt.zero_grad();
  Net::loss(model.forward(batch.input.narrow(0, 2 * rank, 2)), batch.target.narrow(0, 2 * rank, 2))
      .backward();
  opt.step();
}

TEST(FrozenStateTest, OptimizerStateCoversTheTrainableParametersOnly) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto model = wrap<FrozenLmImpl>(comm);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    train_step(*model, adam, 0, comm->rank());
    const OptimStateDict state = full_optim_state_dict(*model, adam);
    EXPECT_THAT(state.keys(),
                ElementsAre("embedding.weight", "blocks.0.up.bias", "blocks.0.down.weight",
                            "blocks.0.down.bias", "blocks.1.up.bias", "blocks.1.down.weight",
                            "blocks.1.down.bias"));
    EXPECT_EQ(state["blocks.0.down.weight"]["exp_avg"].sizes(), (std::vector<int64_t>{8, 16}));
    auto other = wrap<FrozenLmImpl>(comm);
    torch::optim::Adam other_adam(other->parameters(), torch::optim::AdamOptions(1e-2));
    load_full_state_dict(*other, full_state_dict(*model));
    load_full_optim_state_dict(*other, other_adam, state);
    const OptimStateDict loaded = full_optim_state_dict(*other, other_adam);
    ASSERT_EQ(loaded.keys(), state.keys());
    for (const auto& item : state) {
      EXPECT_TRUE(at::equal(loaded[item.key()]["exp_avg_sq"], item.value()["exp_avg_sq"]))
          << item.key();
    }
  });
}

// A sharded checkpoint (fsdp's own, or a Distributed Checkpoint folder) saved at W = 2
// and loaded at W = 3: every parameter and the optimizer state of the `optimized`
// trainable ones come back.
template <typename Net>
void expect_checkpoint_reshards(bool dcp, size_t optimized) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = (std::filesystem::path(tmp != nullptr ? tmp : "/tmp") /
                           (dcp ? "frozen_dcp" : "frozen_checkpoint"))
                              .string();
  std::filesystem::remove_all(dir);
  StateDict saved;
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<Net>(comm);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    train_step(*model, adam, 0, comm->rank());
    if (dcp) {
      save_dcp_checkpoint(*model, &adam, dir);
    } else {
      save_sharded_checkpoint(*model, &adam, dir);
    }
    const StateDict full = full_state_dict(*model);
    if (comm->rank() == 0) saved = full;
  });
  on_ranks(3, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<Net>(comm);
    zero_every_flat_param(*model);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    if (dcp) {
      EXPECT_TRUE(load_dcp_checkpoint(*model, &adam, dir).empty());
    } else {
      load_sharded_checkpoint(*model, &adam, dir);
    }
    const StateDict full = full_state_dict(*model);
    ASSERT_EQ(full.keys(), saved.keys());
    for (const auto& item : saved) {
      EXPECT_EQ(full[item.key()].scalar_type(), item.value().scalar_type()) << item.key();
      EXPECT_TRUE(at::equal(full[item.key()], item.value())) << item.key();
    }
    EXPECT_EQ(full_optim_state_dict(*model, adam).size(), optimized);
  });
}

TEST(FrozenStateTest, ShardedCheckpointReshardsFromTwoRanksToThree) {
  expect_checkpoint_reshards<FrozenLmImpl>(/*dcp=*/false, 7);
}

TEST(FrozenStateTest, DcpCheckpointReshardsFromTwoRanksToThree) {
  expect_checkpoint_reshards<FrozenLmImpl>(/*dcp=*/true, 7);
}

// Hugging Face safetensors out of and into models with mixed units: every parameter
// under its own name and in its own dtype, each rank reading its shards of every flat
// parameter.
template <typename Net>
void expect_safetensors_round_trip() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      (std::filesystem::path(tmp != nullptr ? tmp : "/tmp") / "frozen_safetensors").string();
  std::filesystem::remove_all(dir);
  const StateDict want = module_state_dict(*make<Net>());
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) { save_safetensors(*wrap<Net>(comm), dir); });
  on_ranks(3, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<Net>(comm);
    zero_every_flat_param(*model);
    load_safetensors(*model, dir);
    const StateDict full = full_state_dict(*model);
    ASSERT_EQ(full.keys(), want.keys());
    for (const auto& item : want) {
      EXPECT_EQ(full[item.key()].scalar_type(), item.value().scalar_type()) << item.key();
      EXPECT_TRUE(at::equal(full[item.key()], item.value())) << item.key();
    }
  });
}

TEST(FrozenStateTest, SafetensorsRoundTripAcrossWorldSizes) {
  expect_safetensors_round_trip<FrozenLmImpl>();
}

TEST(MixedDtypeStateTest, EveryParameterKeepsItsNameAndDtype) {
  const StateDict want = module_state_dict(*make<MixedDtypeLmImpl>());
  EXPECT_EQ(want["blocks.0.up_weight"].scalar_type(), at::kBFloat16);
  EXPECT_EQ(want["blocks.0.up_codes"].scalar_type(), at::kByte);
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<MixedDtypeLmImpl>(comm);
    const StateDict full = full_state_dict(*model);
    ASSERT_EQ(full.keys(), want.keys());
    for (const auto& item : want) {
      EXPECT_EQ(full[item.key()].scalar_type(), item.value().scalar_type()) << item.key();
      EXPECT_TRUE(at::equal(full[item.key()], item.value())) << item.key();
    }
    const ShardedStateDict sharded = sharded_state_dict(*model);
    EXPECT_EQ(sharded.keys(), want.keys());
    EXPECT_EQ(sharded["blocks.0.up_codes"].local.scalar_type(), at::kByte);
    const LocalStateDict local = local_state_dict(*model);
    EXPECT_THAT(local.tensors.keys(),
                ElementsAre("_flat_param", "_frozen_flat_param", "blocks.0._flat_param",
                            "blocks.0._frozen_flat_param", "blocks.0._frozen_flat_param_1",
                            "blocks.1._flat_param", "blocks.1._frozen_flat_param",
                            "blocks.1._frozen_flat_param_1"));
    EXPECT_EQ(local.tensors["blocks.0._frozen_flat_param"].scalar_type(), at::kBFloat16);
    EXPECT_EQ(local.tensors["blocks.0._frozen_flat_param_1"].numel(), 8);
    zero_every_flat_param(*model);
    load_full_state_dict(*model, full);
    const StateDict again = full_state_dict(*model);
    for (const auto& item : want) EXPECT_TRUE(at::equal(again[item.key()], item.value()));
  });
}

TEST(MixedDtypeStateTest, SaveZeroLoadEveryStepKeepsParity) {
  on_ranks(2, expect_save_zero_load_parity<MixedDtypeLmImpl>);
}

TEST(MixedDtypeStateTest, CheckpointsReshardFromTwoRanksToThree) {
  expect_checkpoint_reshards<MixedDtypeLmImpl>(/*dcp=*/false, 7);
  expect_checkpoint_reshards<MixedDtypeLmImpl>(/*dcp=*/true, 7);
}

TEST(MixedDtypeStateTest, SafetensorsRoundTripAcrossWorldSizes) {
  expect_safetensors_round_trip<MixedDtypeLmImpl>();
}

}  // namespace
}  // namespace fsdp
