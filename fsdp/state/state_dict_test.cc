// Model state dicts of FSDP models on ranks as threads (the fake communicator): keys,
// values, round trips inside training (REFERENCE §7), plain-model interop, and errors.
#include "fsdp/state/state_dict.h"

#include <type_traits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/state/testing/state_dict_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;   // NOLINT: the shared test models
using namespace ::fsdp::state_testing;  // NOLINT: the shared round trips
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

template <typename Net>
FullyShardedDataParallel<Net> wrap(std::shared_ptr<Communicator> comm,
                                   ShardingStrategy strategy = ShardingStrategy::kFullShard) {
  return FullyShardedDataParallel<Net>(
      make<Net>(), FullyShardedDataParallelOptions(comm).sharding_strategy(strategy));
}

TEST(FullStateDict, KeysAreTheUnwrappedModelsInStateDictOrder) {
  const std::vector<std::string> want = module_state_dict(*make<NormedImpl>()).keys();
  EXPECT_THAT(want, ElementsAre("first.weight", "first.bias", "norm.weight", "norm.bias",
                                "norm.running_mean", "norm.running_var", "norm.num_batches_tracked",
                                "head.weight", "head.bias"));
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NormedImpl>(comm);
    EXPECT_EQ(full_state_dict(*model).keys(), want);
    EXPECT_EQ(sharded_state_dict(*model).keys(), want);
  });
}

// ignored_states: single parameters left out of the units keep their names and values in
// full and sharded state dicts, and load back.
TEST(FullStateDict, IgnoredParametersKeepTheirNames) {
  const StateDict want = module_state_dict(*make<NormedImpl>());
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto net = make<NormedImpl>();
    FullyShardedDataParallel<NormedImpl> model(
        net, FullyShardedDataParallelOptions(comm).ignored_states(
                 {net->first->module()->bias, net->head->weight}));
    const StateDict got = full_state_dict(*model);
    ASSERT_EQ(got.keys(), want.keys());
    for (const auto& item : want) EXPECT_TRUE(at::equal(got[item.key()], item.value()));
    EXPECT_EQ(sharded_state_dict(*model).keys(), want.keys());
    {
      torch::NoGradGuard no_grad;
      net->head->weight.zero_();
    }
    load_full_state_dict(*model, got);
    EXPECT_TRUE(at::equal(net->head->weight, want["head.weight"]));
  });
}

TEST(FullStateDict, ValuesEqualTheUnwrappedModelAtEveryWorldSize) {
  const StateDict want = module_state_dict(*make<TinyLmImpl>());
  for (int w : {1, 2, 3}) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      on_ranks(w, [&](std::shared_ptr<Communicator> comm) {
        auto model = wrap<TinyLmImpl>(comm, strategy);
        const StateDict got = full_state_dict(*model);
        ASSERT_EQ(got.keys(), want.keys());
        for (const auto& item : want) {
          EXPECT_TRUE(at::equal(got[item.key()], item.value())) << item.key() << " W=" << w;
        }
        if (w > 1 && strategy == ShardingStrategy::kFullShard) {
          EXPECT_FALSE(model->units()[1]->handle()->is_unsharded()) << "left unsharded";
        }
      });
    }
  }
}

TEST(FullStateDict, Rank0OnlyLeavesTheOtherRanksEmpty) {
  on_ranks(3, [](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    const StateDict got = full_state_dict(*model, FullStateDictOptions().rank0_only(true));
    if (comm->rank() == 0) {
      EXPECT_EQ(got.size(), 6u);
    } else {
      EXPECT_THAT(got.keys(), IsEmpty());
    }
  });
}

// Linear without bias over a given weight, to tie it to another module's.
struct TiedLinearImpl : torch::nn::Module {
  explicit TiedLinearImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor forward(at::Tensor x) { return at::matmul(x, weight.t()); }
  at::Tensor weight;
};

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    a = register_module("a", torch::nn::Linear(3, 3));
    b = register_module("b", Unit<TiedLinearImpl>(std::make_shared<TiedLinearImpl>(a->weight)));
  }
  at::Tensor forward(at::Tensor x) { return b(a(x)); }
  torch::nn::Linear a{nullptr};
  Unit<TiedLinearImpl> b{nullptr};
};

TEST(FullStateDict, TiedParameterAppearsUnderEveryName) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto net = make<TiedImpl>();
    const at::Tensor weight = net->a->weight.detach().clone();
    FullyShardedDataParallel<TiedImpl> model(net, FullyShardedDataParallelOptions(comm));
    const StateDict got = full_state_dict(*model);
    EXPECT_THAT(got.keys(), ElementsAre("a.weight", "a.bias", "b.weight"));
    EXPECT_TRUE(at::equal(got["a.weight"], weight));
    EXPECT_TRUE(at::equal(got["b.weight"], weight));
    load_full_state_dict(*model, got);
  });
}

// REFERENCE §7: save -> zero -> load the state dict after every step; training still
// matches the single-process reference.

// Net: NormedImpl (buffers) with SGD; TinyLmImpl (tied embedding) with Adam (see
// SgdParityTest in fully_sharded_test.cc for why not BatchNorm with Adam).
template <typename Net>
void expect_round_trips_keep_parity(Kind kind, int world_size, ShardingStrategy strategy,
                                    bool adam) {
  const Reference want = reference<Net>(world_size, adam);
  on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
    expect_parity_on<Net>(comm, want,
                          FullyShardedDataParallelOptions(comm).sharding_strategy(strategy), adam,
                          save_zero_load<Net>(kind));
  });
}

class RoundTripTest
    : public ::testing::TestWithParam<std::tuple<Kind, int, ShardingStrategy, bool>> {};

TEST_P(RoundTripTest, SaveZeroLoadEveryStepKeepsParity) {
  const auto [kind, w, strategy, adam] = GetParam();
  if (adam) {
    expect_round_trips_keep_parity<TinyLmImpl>(kind, w, strategy, adam);
  } else {
    expect_round_trips_keep_parity<NormedImpl>(kind, w, strategy, adam);
  }
}

INSTANTIATE_TEST_SUITE_P(KindsStrategies, RoundTripTest,
                         ::testing::Combine(::testing::Values(Kind::kFull, Kind::kSharded,
                                                              Kind::kLocal),
                                            ::testing::Values(2, 3),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard),
                                            ::testing::Bool()));

// CPU offload (fsdp/core/cpu_offload_test.cc): state dicts read and write the host
// shards. The full state dict of an offloaded model equals the unwrapped model's, and
// save -> zero -> load every step keeps parity, optimizer state on the host included.
TEST(CpuOffload, FullStateDictEqualsTheUnwrappedModel) {
  const StateDict want = module_state_dict(*make<TinyLmImpl>());
  for (int w : {1, 2, 3}) {
    on_ranks(w, [&](std::shared_ptr<Communicator> comm) {
      FullyShardedDataParallel<TinyLmImpl> model(
          make<TinyLmImpl>(), FullyShardedDataParallelOptions(comm).cpu_offload(true));
      const StateDict got = full_state_dict(*model);
      ASSERT_EQ(got.keys(), want.keys());
      for (const auto& item : want) {
        EXPECT_TRUE(at::equal(got[item.key()], item.value())) << item.key() << " W=" << w;
      }
    });
  }
}

class OffloadRoundTripTest
    : public ::testing::TestWithParam<std::tuple<Kind, int, ShardingStrategy>> {};

TEST_P(OffloadRoundTripTest, SaveZeroLoadEveryStepKeepsParity) {
  const auto [kind, w, strategy] = GetParam();
  const Reference want = reference<TinyLmImpl>(w, /*adam=*/true);
  on_ranks(w, [&, kind = kind, strategy = strategy](std::shared_ptr<Communicator> comm) {
    expect_parity_on<TinyLmImpl>(
        comm, want,
        FullyShardedDataParallelOptions(comm).sharding_strategy(strategy).cpu_offload(true),
        /*adam=*/true, save_zero_load<TinyLmImpl>(kind));
  });
}

INSTANTIATE_TEST_SUITE_P(KindsStrategies, OffloadRoundTripTest,
                         ::testing::Combine(::testing::Values(Kind::kFull, Kind::kSharded,
                                                              Kind::kLocal),
                                            ::testing::Values(2, 3),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kNoShard)));

TEST(ShardedStateDict, PiecesAreTheRanksShardOfEachParameter) {
  // NestedImpl at W = 2: unit l1 holds l1.weight (32) + l1.bias (8) = 40 -> 20 per rank.
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    const ShardedStateDict got = sharded_state_dict(*model);
    const ShardedTensor& weight = got["l1.weight"];
    const ShardedTensor& bias = got["l1.bias"];
    EXPECT_THAT(weight.global_shape, ElementsAre(8, 4));
    if (comm->rank() == 0) {
      EXPECT_EQ(weight.offset, 0);
      EXPECT_EQ(weight.local.numel(), 20);
      EXPECT_EQ(bias.local.numel(), 0);
    } else {
      EXPECT_EQ(weight.offset, 20);
      EXPECT_EQ(weight.local.numel(), 12);
      EXPECT_EQ(bias.offset, 0);
      EXPECT_EQ(bias.local.numel(), 8);
    }
    const at::Tensor full = make<NestedImpl>()->l1->module()->weight.detach().reshape({-1});
    EXPECT_TRUE(at::equal(weight.local, full.narrow(0, weight.offset, weight.local.numel())));
  });
}

TEST(PlainModules, FullStateDictLoadsIntoAnUnwrappedModelAndBack) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto model = wrap<TinyLmImpl>(comm);
    {
      torch::NoGradGuard no_grad;
      for (at::Tensor shard : model->parameters()) shard.mul_(2);  // differ from make<>()
    }
    auto plain = make<TinyLmImpl>();
    load_module_state_dict(*plain, full_state_dict(*model));
    const StateDict got = full_state_dict(*model);
    for (const auto& item : module_state_dict(*plain)) {
      EXPECT_TRUE(at::equal(item.value(), got[item.key()])) << item.key();
    }
    auto other = make<TinyLmImpl>();  // original values
    load_full_state_dict(*model, module_state_dict(*other));
    const StateDict back = full_state_dict(*model);
    for (const auto& item : module_state_dict(*other)) {
      EXPECT_TRUE(at::equal(item.value(), back[item.key()])) << item.key();
    }
  });
}

TEST(Errors, MissingUnexpectedAndPrefixedKeysAreNamed) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    StateDict bad = full_state_dict(*model);
    bad.erase("l2.bias");
    bad.insert("l3.weight", at::zeros({1}));
    EXPECT_THAT([&] { load_full_state_dict(*model, bad); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "load_full_state_dict: the keys do not match the model's; missing keys (1): "
                    "'l2.bias'; unexpected keys (1): 'l3.weight'")));
    StateDict prefixed;
    for (const auto& item : full_state_dict(*model)) {
      prefixed.insert((item.key() == "head.weight" ? "" : "_fsdp_wrapped_module.") + item.key(),
                      item.value());
    }
    EXPECT_THAT([&] { load_full_state_dict(*model, prefixed); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("remove them with fsdp::clean_tensor_name")));
  });
}

TEST(Errors, ShapeAndDtypeMismatchesNameTheParameter) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    StateDict shape = full_state_dict(*model);
    shape["l1.weight"] = at::zeros({4, 8});
    EXPECT_THAT([&] { load_full_state_dict(*model, shape); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "size mismatch for 'l1.weight': the state dict has shape [4, 8], the model "
                    "has [8, 4]")));
    StateDict dtype = full_state_dict(*model);
    dtype["head.bias"] = dtype["head.bias"].to(at::kDouble);
    EXPECT_THAT([&] { load_full_state_dict(*model, dtype); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "dtype mismatch for 'head.bias': the state dict has Double, the model has "
                    "Float")));
  });
}

TEST(Errors, LocalStateDictFromAnotherWorldSize) {
  LocalStateDict saved;
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    if (comm->rank() == 0) saved = local_state_dict(*model);
  });
  on_ranks(3, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    EXPECT_THAT([&] { load_local_state_dict(*model, saved); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("made by rank 0 of 2, this is rank " + std::to_string(comm->rank()) +
                              " of 3; a LOCAL state dict loads only at the world size")));
  });
}

TEST(Errors, ShardedStateDictFromAnotherWorldSize) {
  ShardedStateDict saved;
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    if (comm->rank() == 1) saved = sharded_state_dict(*model);
  });
  on_ranks(3, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    if (comm->rank() != 0) return;
    EXPECT_THAT([&] { load_sharded_state_dict(*model, saved); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("'l1.weight' holds elements [20, 32) but rank 0 needs [0, 14)")));
  });
}

TEST(Errors, OnlyTheIdleRootHasAStateDict) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NestedImpl>(comm);
    // Only the root is a FullyShardedRoot: passing a unit inside it to full_state_dict
    // does not compile (before FullyShardedRoot it was a run-time error).
    using Root = std::remove_reference_t<decltype(*model)>;
    using Unit = std::remove_reference_t<decltype(*model->module()->l1)>;
    static_assert(std::is_convertible_v<Root&, FullyShardedRoot&>);
    static_assert(!std::is_convertible_v<Unit&, FullyShardedRoot&>);
    auto summon = model->summon_full_params(SummonFullParamsOptions().writeback(false));
    EXPECT_THAT([&] { sharded_state_dict(*model); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("sharded_state_dict")));
  });
}

}  // namespace
}  // namespace fsdp
