// The per-rank plan (memory_plan.h): exact figures of the formula, and the plan checked
// while training (FullyShardedRoot::check_plan) on ranks as threads for every strategy at
// W = 1, 2, 3, 4: parameters, gradients, optimizer state and traffic within [0.95, 1.05]
// of the plan, the whole peak within [0.90, 1.10].
#include "fsdp/core/memory_plan.h"

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/fused_adamw.h"
#include "fsdp/core/testing/mlp_model.h"
#include "fsdp/core/tracking_allocator.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

// Root 9 elements, unit "a" 120, W = 2: shards 5 and 60, padded 10 and 120.
std::vector<PlanUnit> two_units() { return {{"", 9, 0, true}, {"a", 120, 0, false}}; }

TEST(MemoryPlanTest, FullShardTermsAndTrafficAreExact) {
  const MemoryPlan plan = plan_memory(two_units(), MemoryPlanOptions().world_size(2));
  EXPECT_EQ(plan.term_bytes(PlanTerm::kShardedParameters), 4 * 65);
  EXPECT_EQ(plan.term_bytes(PlanTerm::kShardedGradients), 4 * 65);
  EXPECT_EQ(plan.term_bytes(PlanTerm::kOptimizerState), 8 * 65);
  // Forward: 2 all-gathers; backward: "a" again (the root stays); 2 reduce-scatters.
  EXPECT_EQ(plan.traffic_of(CollectiveKind::kAllGather).calls, 3);
  EXPECT_EQ(plan.traffic_of(CollectiveKind::kAllGather).bytes_sent, 4 * (5 + 60 + 60));
  EXPECT_EQ(plan.traffic_of(CollectiveKind::kReduceScatter).calls, 2);
  EXPECT_EQ(plan.traffic_of(CollectiveKind::kReduceScatter).bytes_sent, 4 * 65);
  EXPECT_EQ(plan.traffic_of(CollectiveKind::kAllReduce).calls, 0);
  // Peak: the backward of "a": state (param 65, Adam 130) + root unsharded (10) and its
  // gradients (9) + "a" unsharded (120) and its gradients (120), in bytes x 4.
  EXPECT_EQ(plan.peak_bytes, 4 * (65 + 130 + 10 + 9 + 120 + 120));
  EXPECT_EQ(plan.at_peak_bytes[static_cast<int>(PlanTerm::kUnshardedParameters)], 4 * 130);
  EXPECT_EQ(plan.peak_event, "backward of unit 'a'");
  // Over the step: the flat gradient of "a" (120) and its reduced shard (60) at once.
  EXPECT_EQ(plan.term_bytes(PlanTerm::kReductionBuffers), 4 * 180);
  EXPECT_EQ(plan.term_bytes(PlanTerm::kOptimizerTemporaries), 2 * 4 * 60);
}

// A unit's activation_bytes leave the activations once its gradients are counted: "b"
// (after "a" in forward) saved 60 of the 100 bytes, so the backward of "a", the peak,
// holds 40; the plan refuses units that save more than the total.
TEST(MemoryPlanTest, AUnitsActivationsAreFreedByItsBackward) {
  std::vector<PlanUnit> units = {{"", 9, 0, true}, {"a", 120, 0, false}, {"b", 20, 0, false}};
  units[2].activation_bytes = 60;
  const MemoryPlan plan =
      plan_memory(units, MemoryPlanOptions().world_size(2).activation_bytes(100));
  EXPECT_EQ(plan.peak_event, "backward of unit 'a'");
  EXPECT_EQ(plan.at_peak_bytes[static_cast<int>(PlanTerm::kActivations)], 40);
  EXPECT_EQ(plan.term_bytes(PlanTerm::kActivations), 100);
  units[1].activation_bytes = 41;
  try {
    plan_memory(units, MemoryPlanOptions().world_size(2).activation_bytes(100));
    ADD_FAILURE() << "expected a c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("the units' activation_bytes add up to 101, more than "
                          "MemoryPlanOptions::activation_bytes (100)"));
  }
}

TEST(MemoryPlanTest, StrategiesAtOneRankPlanAsNoShardWithoutTraffic) {
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kHybridShard}) {
    const MemoryPlan plan = plan_memory(two_units(), MemoryPlanOptions().sharding_strategy(s));
    EXPECT_EQ(plan.effective_strategy, ShardingStrategy::kNoShard);
    EXPECT_EQ(plan.bytes_sent(), 0);
    EXPECT_EQ(plan.term_bytes(PlanTerm::kShardedParameters), 4 * 129);
    EXPECT_EQ(plan.term_bytes(PlanTerm::kUnshardedParameters), 0);  // the shard is the parameter
  }
}

TEST(MemoryPlanTest, TrafficFollowsReferenceSectionFourForEveryStrategy) {
  // Psi = 129 elements of 4 bytes, W = 4: shards 3 and 30 (padded 12 and 120).
  auto sent = [](ShardingStrategy s, int64_t group) {
    return plan_memory(
               two_units(),
               MemoryPlanOptions().world_size(4).sharding_strategy(s).hybrid_shard_group_size(
                   group))
        .bytes_sent();
  };
  EXPECT_EQ(sent(ShardingStrategy::kFullShard, 0), 4 * 3 * (3 + 30 + 30 + 3 + 30));
  EXPECT_EQ(sent(ShardingStrategy::kShardGradOp, 0), 4 * 3 * (3 + 30 + 3 + 30));
  // NO_SHARD: all-reduce of 9 and 120 elements: 2 (W - 1) ceil(n / W) each.
  EXPECT_EQ(sent(ShardingStrategy::kNoShard, 0), 4 * 2 * 3 * (3 + 30));
  // HYBRID, F = 2, R = 2: shards 5 and 60 inside the group, their all-reduce across it.
  EXPECT_EQ(sent(ShardingStrategy::kHybridShard, 2),
            4 * (1 * (5 + 60 + 60) + 1 * (5 + 60) + 2 * 1 * (3 + 30)));
  EXPECT_THROW(sent(ShardingStrategy::kHybridShard, 3), c10::Error);
}

TEST(MemoryPlanTest, MixedPrecisionFrozenParametersAndOptimizers) {
  const std::vector<PlanUnit> units = {{"", 0, 0, true}, {"a", 100, 60, false}};
  const MemoryPlan plan = plan_memory(units, MemoryPlanOptions()
                                                 .world_size(2)
                                                 .param_dtype(c10::ScalarType::BFloat16)
                                                 .reduce_dtype(c10::ScalarType::Float)
                                                 .optimizer(OptimizerSpec::sgd(true)));
  EXPECT_EQ(plan.term_bytes(PlanTerm::kShardedParameters), 4 * (50 + 30));
  EXPECT_EQ(plan.term_bytes(PlanTerm::kOptimizerState), 4 * 50);  // momentum, trainable only
  EXPECT_EQ(plan.term_bytes(PlanTerm::kShardedGradients), 4 * 50);
  // Each all-gather's input: the shard cast to bf16 (trainable 50 then frozen 30).
  EXPECT_EQ(plan.term_bytes(PlanTerm::kMixedPrecisionCopies), 2 * (50 + 30));
  // bf16 all-gathers of both flat parameters twice; an fp32 reduce-scatter of the trainable.
  EXPECT_EQ(plan.traffic_of(CollectiveKind::kAllGather).bytes_sent, 2 * 2 * (50 + 30));
  EXPECT_EQ(plan.traffic_of(CollectiveKind::kReduceScatter).bytes_sent, 4 * 50);
  EXPECT_EQ(parse_optimizer_spec("adagrad")->states_per_element, 1);
  EXPECT_FALSE(parse_optimizer_spec("lamb").has_value());
}

// fsdp::FusedAdamW keeps AdamW's two moments and makes no temporary in its step;
// optimizer_spec_of tells it from the AdamW it derives from.
TEST(MemoryPlanTest, FusedAdamWPlansNoStepTemporaries) {
  const OptimizerSpec fused = *parse_optimizer_spec("fused_adamw");
  EXPECT_EQ(fused.name, "fused_adamw");
  const std::vector<at::Tensor> params = {at::zeros({3}).requires_grad_()};
  const OptimizerSpec of_fused = optimizer_spec_of(FusedAdamW(params));
  EXPECT_EQ(of_fused.name, "fused_adamw");
  EXPECT_EQ(of_fused.states_per_element, 2);
  EXPECT_EQ(of_fused.step_temporaries, 0);
  EXPECT_EQ(optimizer_spec_of(FusedAdamW(params, torch::optim::AdamWOptions().amsgrad(true)))
                .states_per_element,
            3);
  const OptimizerSpec of_adamw = optimizer_spec_of(torch::optim::AdamW(params));
  EXPECT_EQ(of_adamw.name, "adamw");
  EXPECT_EQ(of_adamw.step_temporaries, 2);
  const MemoryPlan plan =
      plan_memory(two_units(), MemoryPlanOptions().world_size(2).optimizer(fused));
  EXPECT_EQ(plan.term_bytes(PlanTerm::kOptimizerState), 8 * 65);
  EXPECT_EQ(plan.term_bytes(PlanTerm::kOptimizerTemporaries), 0);
}

TEST(MemoryPlanTest, CheckNamesTheTermAboveItsTolerance) {
  const MemoryPlan plan = plan_memory(two_units(), MemoryPlanOptions().world_size(2));
  PlanMeasurement measured;
  measured.sharded_parameter_bytes = plan.term_bytes(PlanTerm::kShardedParameters);
  measured.sharded_gradient_bytes = plan.term_bytes(PlanTerm::kShardedGradients);
  measured.optimizer_state_bytes = plan.term_bytes(PlanTerm::kOptimizerState) * 106 / 100;
  measured.traffic = plan.traffic;
  measured.peak_bytes = plan.peak_bytes * 2;  // not enforced: activations not planned
  const PlanCheckResult result = compare_with_plan(plan, measured);
  ASSERT_NE(result.first_exceeded(), nullptr);
  EXPECT_EQ(result.first_exceeded()->what, "optimizer_state");
  EXPECT_EQ(result.summary(),
            "plan: params 1.000 grads 1.000 optim 1.060 traffic 1.000 peak 2.000 (no "
            "activations)");
}

// ---- Checked while training: ranks as threads on the fake backend. ----

constexpr int64_t kDim = 32;
constexpr int kBlocks = 4;
constexpr int64_t kOut = 10;
constexpr int64_t kRows = 2;
constexpr int kSteps = 4;
using ModelImpl = core_internal::MlpModelImpl;

// What autograd keeps per step (fp32): per block fc1's input, relu's output, fc2's and the
// residual's (kRows x (dim + 4 dim + dim)), the head's input and output, the loss.
constexpr int64_t kActivationBytes = 4 * kRows * (kBlocks * 6 * kDim + kDim + kOut);

struct Run {
  ShardingStrategy strategy;
  int world_size;
  bool sgd = false;
  bool bf16 = false;    // MixedPrecision: bf16 parameters, fp32 reduction
  bool frozen = false;  // every block's fc1 frozen: units with a frozen flat parameter
  // Blocks 0 and 2 and the root's head wholly frozen, as in a LoRA model: block 0 is
  // outside autograd (its input needs no gradient; the plan takes a trainable root to come
  // first), block 2 a frozen unit between trainable ones.
  bool frozen_blocks = false;
  bool fused_adamw = false;  // fsdp::FusedAdamW instead of Adam
};

std::string name_of(const Run& run) {
  return absl::StrFormat("%s W=%d %s%s%s%s", sharding_strategy_name(run.strategy), run.world_size,
                         run.sgd           ? "SGD(momentum)"
                         : run.fused_adamw ? "FusedAdamW"
                                           : "Adam",
                         run.bf16 ? " bf16" : "", run.frozen ? " frozen fc1" : "",
                         run.frozen_blocks ? " frozen head, blocks 0 and 2" : "");
}

void train_and_check(const Run& run) {
  MemoryTracker tracker;  // before the rank threads start
  FakeWorld::run(FakeWorld::create(run.world_size), [&](Communicator& comm_ref) {
    MemoryTagGuard tag(comm_ref.rank());
    std::shared_ptr<Communicator> comm(&comm_ref, [](Communicator*) {});
    torch::manual_seed(0);
    auto net = std::make_shared<ModelImpl>(kDim, kBlocks, kOut);
    for (auto& param : net->named_parameters()) {
      const std::string& fqn = param.key();
      if ((run.frozen && fqn.find("fc1") != std::string::npos) ||
          (run.frozen_blocks &&
           (absl::StartsWith(fqn, "blocks.0.") || absl::StartsWith(fqn, "blocks.2.") ||
            absl::StartsWith(fqn, "head.")))) {
        param.value().requires_grad_(false);
      }
    }
    FullyShardedDataParallelOptions options =
        FullyShardedDataParallelOptions(comm)
            .sharding_strategy(run.strategy)
            .hybrid_shard_group_size(
                is_hybrid(run.strategy) ? (run.world_size % 2 == 0 ? 2 : run.world_size) : 0)
            .plan_check(true);
    if (run.bf16) {
      options.mixed_precision(MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
    }
    FullyShardedDataParallel<ModelImpl> model(net, options);
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (run.sgd) {
      optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                      torch::optim::SGDOptions(1e-2).momentum(0.9));
    } else if (run.fused_adamw) {
      optimizer =
          std::make_unique<FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
    } else {
      optimizer = std::make_unique<torch::optim::Adam>(model->parameters(),
                                                       torch::optim::AdamOptions(1e-3));
    }
    torch::manual_seed(1 + comm->rank());
    for (int step = 0; step < kSteps; ++step) {
      const at::Tensor x = at::randn({kRows, kDim});
      optimizer->zero_grad();
      model->forward(x).pow(2).mean().backward();
      optimizer->step();
      const PlanCheckResult result = model->check_plan(*optimizer, kActivationBytes);
      if (step == 0) continue;  // Adam's and momentum's state appear in step 0
      if (comm->rank() == 0 && step == kSteps - 1) {
        std::cout << name_of(run) << ": " << result.summary() << "\n";
      }
      for (const PlanComparison& row : result.rows) {
        SCOPED_TRACE(absl::StrFormat("%s rank %d step %d: %s %d of %d", name_of(run), comm->rank(),
                                     step, row.what, row.measured, row.planned));
        const double low = row.what == "peak" ? 0.90 : 0.95;
        const double high = row.what == "peak" ? 1.10 : 1.05;
        EXPECT_GE(row.ratio(), low);
        EXPECT_LE(row.ratio(), high);
      }
    }
  });
}

class PlanCheckTest : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(PlanCheckTest, MeasuredWithinTheBoundsAtOneToFourRanks) {
  for (int w = 1; w <= 4; ++w) train_and_check({GetParam(), w});
  train_and_check({GetParam(), 2, /*sgd=*/true});
  train_and_check({GetParam(), 2, /*sgd=*/false, /*bf16=*/false, /*frozen=*/false,
                   /*frozen_blocks=*/false, /*fused_adamw=*/true});
}

TEST_P(PlanCheckTest, MixedPrecisionAndFrozenParametersWithinTheBounds) {
  train_and_check({GetParam(), 2, /*sgd=*/false, /*bf16=*/true});
  train_and_check({GetParam(), 4, /*sgd=*/false, /*bf16=*/false, /*frozen=*/true});
  train_and_check({GetParam(), 2, /*sgd=*/false, /*bf16=*/false, /*frozen=*/false,
                   /*frozen_blocks=*/true});
}

INSTANTIATE_TEST_SUITE_P(EveryStrategy, PlanCheckTest,
                         ::testing::Values(ShardingStrategy::kFullShard,
                                           ShardingStrategy::kShardGradOp,
                                           ShardingStrategy::kNoShard,
                                           ShardingStrategy::kHybridShard),
                         [](const ::testing::TestParamInfo<ShardingStrategy>& info) {
                           std::string name = sharding_strategy_name(info.param);
                           name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
                           return name;
                         });

TEST(PlanCheckTest, ATrafficAboveThePlanNamesTheCollective) {
  MemoryTracker tracker;
  FakeWorld::run(FakeWorld::create(2), [&](Communicator& comm_ref) {
    MemoryTagGuard tag(comm_ref.rank());
    std::shared_ptr<Communicator> comm(&comm_ref, [](Communicator*) {});
    FullyShardedDataParallel<ModelImpl> model(
        std::make_shared<ModelImpl>(kDim, kBlocks, kOut),
        FullyShardedDataParallelOptions(comm).plan_check(true));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
    EXPECT_THAT([&] { model->check_plan(adam); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("no step to check")));
    model->forward(at::randn({kRows, kDim})).sum().backward();
    adam.step();
    at::Tensor extra = at::ones({100000});
    comm->all_reduce(extra);  // outside the model, inside the window
    EXPECT_THAT([&] { model->check_plan(adam); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr(absl::StrFormat("plan check on rank %d: all_reduce bytes_sent "
                                              "measured 400000 bytes, the plan says 0",
                                              comm->rank()))));
  });
}

}  // namespace
}  // namespace fsdp
