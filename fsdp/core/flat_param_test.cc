#include "fsdp/core/flat_param.h"

#include <functional>
#include <memory>
#include <string>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/fake.h"
#include "fsdp/comm/testing/forwarding.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

MATCHER_P3(Covers, fqn, start, end, "") {
  return arg.fqn == fqn && arg.start == start && arg.end == end;
}

std::vector<FlatParamInfo> three_weights() {
  return {{"0.weight", {10, 10}, 100, 0},
          {"2.weight", {10, 10}, 100, 100},
          {"4.weight", {10, 10}, 100, 200}};
}

TEST(ShardParamInfosTest, ReferenceExamples) {
  const auto infos = three_weights();
  EXPECT_THAT(shard_param_infos(infos, 0, 50), ElementsAre(Covers("0.weight", 0, 50)));
  EXPECT_THAT(shard_param_infos(infos, 50, 149),
              ElementsAre(Covers("0.weight", 50, 99), Covers("2.weight", 0, 49)));
  EXPECT_THAT(shard_param_infos(infos, 99, 199),
              ElementsAre(Covers("0.weight", 99, 99), Covers("2.weight", 0, 99)));
  EXPECT_THAT(shard_param_infos(infos, 100, 1000),
              ElementsAre(Covers("2.weight", 0, 99), Covers("4.weight", 0, 99)));
  EXPECT_THAT(shard_param_infos(infos, 299, 299), ElementsAre(Covers("4.weight", 99, 99)));
  EXPECT_TRUE(shard_param_infos(infos, 300, 310).empty());  // padding only
}

// Parameters with recognisable values: param i holds 1000 i + arange(numel).
std::vector<NamedParam> make_params(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<NamedParam> params;
  for (size_t i = 0; i < shapes.size(); ++i) {
    at::Tensor p = at::ones(shapes[i]);
    p = (at::arange(p.numel(), at::kFloat) + 1000.0 * i).view(shapes[i]);
    p.set_requires_grad(true);
    params.push_back({"p" + std::to_string(i), p});
  }
  return params;
}

class FlatParamHandleTest : public ::testing::TestWithParam<int> {};

TEST_P(FlatParamHandleTest, ShardsUnshardsReshardsAndReducesGradients) {
  const int w = GetParam();
  FakeWorld::run(FakeWorld::create(w), [w](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    // 9 + 4 = 13 elements: padding for W = 2, 3.
    std::vector<NamedParam> params = make_params({{3, 3}, {4}});
    const at::Tensor expected0 = params[0].param.detach().clone();
    FlatParamHandle handle(params, self, ShardingStrategy::kFullShard);
    const int64_t shard = (13 + w - 1) / w;
    EXPECT_EQ(handle.numel(), 13);
    EXPECT_EQ(handle.shard_numel(), shard);
    EXPECT_EQ(handle.padding(), shard * w - 13);
    EXPECT_EQ(handle.sharded_flat_param().numel(), shard);
    // This rank's shard metadata covers flat elements [rank x shard, (rank + 1) x shard).
    const std::vector<FlatParamInfo> infos = {{"p0", {3, 3}, 9, 0}, {"p1", {4}, 4, 9}};
    const std::vector<ShardParamInfo> local = handle.local_shard_param_infos();
    const std::vector<ShardParamInfo> want =
        shard_param_infos(infos, comm.rank() * shard, (comm.rank() + 1) * shard - 1);
    ASSERT_EQ(local.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(local[i].fqn, want[i].fqn);
      EXPECT_EQ(local[i].start, want[i].start);
      EXPECT_EQ(local[i].end, want[i].end);
    }
    EXPECT_TRUE(handle.sharded_flat_param().requires_grad());
    EXPECT_TRUE(handle.sharded_flat_param().is_leaf());
    // Sharded from the start; unsharded, the original parameters are views with their
    // old values and shapes.
    EXPECT_FALSE(handle.is_unsharded());
    EXPECT_EQ(params[0].param.storage().nbytes(), 0u);
    handle.unshard();
    EXPECT_TRUE(at::equal(handle.original_params()[0], expected0));
    EXPECT_EQ(params[1].param.sizes(), c10::IntArrayRef({4}));

    handle.reshard();
    EXPECT_FALSE(handle.is_unsharded());
    EXPECT_EQ(params[0].param.storage().nbytes(), 0u);  // memory freed
    // Edit the shard, unshard: the views see the gathered values.
    handle.sharded_flat_param().detach().add_(1.0);
    handle.unshard();
    EXPECT_TRUE(at::equal(params[0].param, expected0 + 1.0));
    EXPECT_TRUE(at::equal(handle.full_flat_param().narrow(0, 0, 9), (expected0 + 1).view({-1})));

    // Gradients: rank r contributes r + 1 everywhere; the average is (W + 1) / 2.
    const double value = comm.rank() + 1.0;
    handle.reduce_grad({at::full({3, 3}, value), at::Tensor()});
    handle.reduce_grad({at::full({3, 3}, value), at::full({4}, value)});
    const at::Tensor grad = handle.sharded_flat_param().grad();
    ASSERT_TRUE(grad.defined());
    for (int64_t i = 0; i < shard; ++i) {
      const int64_t flat = comm.rank() * shard + i;
      const double mean = (w + 1) / 2.0;
      const double want = flat < 9 ? 2 * mean : flat < 13 ? mean : 0.0;
      EXPECT_DOUBLE_EQ(grad[i].item<double>(), want) << "flat element " << flat;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FlatParamHandleTest, ::testing::Values(1, 2, 3));

TEST(FlatParamHandleNoShardTest, KeepsEverythingAndAllReduces) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    std::vector<NamedParam> params = make_params({{5}});
    FlatParamHandle handle(params, self, ShardingStrategy::kNoShard);
    EXPECT_EQ(handle.shard_numel(), 5);
    EXPECT_EQ(handle.padding(), 0);
    handle.reshard();  // no-op
    EXPECT_TRUE(handle.is_unsharded());
    // The optimizer's in-place update is what the module sees.
    handle.sharded_flat_param().detach().mul_(2.0);
    EXPECT_EQ(params[0].param[1].item<float>(), 2.0f);
    handle.reduce_grad({at::full({5}, comm.rank() * 2.0)});
    EXPECT_TRUE(at::equal(handle.sharded_flat_param().grad(), at::full({5}, 1.0)));
    EXPECT_EQ(comm.counters().get(CollectiveKind::kAllReduce).calls, 1);
    EXPECT_EQ(comm.counters().get(CollectiveKind::kAllGather).calls, 0);
  });
}

// start_reduce_grad issues the collective and returns; the result reaches .grad only at
// finish_reduce_grad, and a second start before it is refused.
TEST(FlatParamHandleAsyncReductionTest, ResultArrivesAtFinish) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    FlatParamHandle handle(make_params({{5}}), self, ShardingStrategy::kFullShard);
    handle.start_reduce_grad({at::full({5}, comm.rank() * 2.0)});
    EXPECT_TRUE(handle.reduction_pending());
    EXPECT_FALSE(handle.sharded_flat_param().grad().defined());
    EXPECT_EQ(comm.counters().get(CollectiveKind::kReduceScatter).calls, 1);
    EXPECT_THAT([&] { handle.start_reduce_grad({at::ones({5})}); },
                ThrowsMessage<c10::Error>(HasSubstr("previous reduction of 'p0' is pending")));
    handle.finish_reduce_grad();
    EXPECT_FALSE(handle.reduction_pending());
    // Shard of 3 elements (5 padded to 6): the mean of 0 and 2 where real, 0 in the padding.
    const std::vector<float> want =
        comm.rank() == 0 ? std::vector<float>{1, 1, 1} : std::vector<float>{1, 1, 0};
    EXPECT_TRUE(at::equal(handle.sharded_flat_param().grad(), at::tensor(want)));
    EXPECT_THAT([&] { handle.finish_reduce_grad(); },
                ThrowsMessage<c10::Error>(HasSubstr("finish_reduce_grad without a reduction")));
  });
}

TEST(FlatParamHandleErrorsTest, BadInputIsNamed) {
  auto world = FakeWorld::create(1);
  std::shared_ptr<Communicator> comm = world->communicator(0);
  EXPECT_THAT([&] { FlatParamHandle({}, comm, ShardingStrategy::kFullShard); },
              ThrowsMessage<c10::Error>(HasSubstr("expected at least one parameter")));
  at::Tensor w = at::ones({2});
  EXPECT_THAT(
      [&] {
        FlatParamHandle({{"a.weight", w}, {"b.weight", w}}, comm, ShardingStrategy::kFullShard);
      },
      ThrowsMessage<c10::Error>(HasSubstr("'b.weight' is the same tensor as "
                                          "'a.weight'")));
  EXPECT_THAT(
      [&] {
        FlatParamHandle({{"a", at::ones({2})}, {"b", at::ones({2}, at::kDouble)}}, comm,
                        ShardingStrategy::kFullShard);
      },
      ThrowsMessage<c10::Error>(HasSubstr("need one dtype and device")));
  FlatParamHandle handle({{"a", at::ones({2})}}, comm, ShardingStrategy::kFullShard);
  EXPECT_THAT([&] { handle.reduce_grad({at::ones({3})}); },
              ThrowsMessage<c10::Error>(HasSubstr("gradient of 'a' has 3 elements, expected 2")));
}

TEST(GradientDivideFactorsTest, ReferenceTable) {
  // REFERENCE §6.
  const std::vector<int64_t> world_sizes = {1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 512};
  const std::vector<double> pre = {1, 2, 2, 2, 4, 4, 4, 8, 8, 16, 32};
  const std::vector<double> post = {1, 1, 1.5, 2, 1.5, 2, 4, 4, 8, 8, 16};
  for (size_t i = 0; i < world_sizes.size(); ++i) {
    EXPECT_EQ(gradient_predivide_factor(world_sizes[i]), pre[i]) << "W = " << world_sizes[i];
    EXPECT_EQ(gradient_postdivide_factor(world_sizes[i]), post[i]) << "W = " << world_sizes[i];
  }
}

// Records what reduce-scatters and all-reduces get.
class SpyCommunicator : public comm_internal::ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  std::vector<float> inputs;  // first input element of each reduction
  std::vector<ReduceOp> ops;

 protected:
  void issued(CollectiveKind kind, const CommBuffer& buffer, ReduceOp op) override {
    if (kind != CollectiveKind::kReduceScatter && kind != CollectiveKind::kAllReduce) return;
    inputs.push_back(*static_cast<const float*>(buffer.data));
    ops.push_back(op);
  }
};

class DivideFactorTest : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy>> {};

// Rank r's gradient is 12 (r + 1) everywhere: predivided by f(W) before a sum-reduction,
// postdivided by W / f(W) after, the result is the mean 6 (W + 1).
TEST_P(DivideFactorTest, PredivideBeforeTheReductionPostdivideAfter) {
  const auto [w, strategy] = GetParam();
  FakeWorld::run(FakeWorld::create(w), [w = w, strategy = strategy](Communicator& comm) {
    auto spy = std::make_shared<SpyCommunicator>(
        std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    std::vector<NamedParam> params = make_params({{2, 3}});
    FlatParamHandle handle(params, spy, strategy);
    handle.reduce_grad({at::full({2, 3}, 12.0 * (comm.rank() + 1))});
    ASSERT_EQ(spy->inputs.size(), 1u);
    EXPECT_EQ(spy->ops[0], ReduceOp::kSum);
    EXPECT_EQ(spy->inputs[0], 12.0 * (comm.rank() + 1) / gradient_predivide_factor(w));
    const at::Tensor grad = handle.sharded_flat_param().grad();
    // The shard's elements that are not padding.
    const int64_t first = strategy == ShardingStrategy::kNoShard ? 0 : comm.rank() * grad.numel();
    const int64_t real = std::max<int64_t>(0, std::min<int64_t>(grad.numel(), 6 - first));
    EXPECT_TRUE(at::equal(grad.narrow(0, 0, real), at::full({real}, 6.0 * (w + 1)))) << grad;
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizesStrategies, DivideFactorTest,
                         ::testing::Combine(::testing::Values(2, 3, 4, 6),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kNoShard)));

// Parameters of 6 + 3 elements with values k / 8 (exact in bfloat16).
std::vector<NamedParam> eighths() {
  std::vector<NamedParam> params = {{"a.weight", (at::arange(6, at::kFloat) / 8).view({2, 3})},
                                    {"a.bias", at::arange(3, at::kFloat) / 8 + 1}};
  for (NamedParam& p : params) p.param.set_requires_grad(true);
  return params;
}

TEST(FlatParamMixedPrecisionTest, LowPrecisionCopiesOnlyWhileUnsharded) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    std::vector<NamedParam> params = eighths();
    FlatParamHandle handle(params, self, ShardingStrategy::kFullShard,
                           FlatParamOptions().param_dtype(at::kBFloat16));
    EXPECT_EQ(handle.param_dtype(), at::kBFloat16);
    EXPECT_EQ(handle.reduce_dtype(), at::kBFloat16);                   // inferred, as PyTorch
    EXPECT_EQ(handle.sharded_flat_param().scalar_type(), at::kFloat);  // the master shard
    EXPECT_EQ(params[0].param.storage().nbytes(), 0u);
    handle.unshard();
    EXPECT_EQ(params[0].param.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(
        at::equal(params[0].param.to(at::kFloat), (at::arange(6, at::kFloat) / 8).view({2, 3})));
    // The all-gather moves bfloat16: 2 bytes x shard numel 5 to the one peer.
    EXPECT_EQ(comm.counters().get(CollectiveKind::kAllGather).bytes_sent, 2 * 5);
    handle.reshard();
    EXPECT_EQ(params[0].param.storage().nbytes(), 0u);

    // summon_full_params: the master values, in float32; edits written back.
    handle.sharded_flat_param().detach().add_(1.0 / 1024);  // below bfloat16's resolution
    handle.unshard_full_precision();
    EXPECT_EQ(params[1].param.scalar_type(), at::kFloat);
    EXPECT_FLOAT_EQ(params[1].param[0].item<float>(), 1.0f + 1.0f / 1024);
    params[1].param.detach().add_(1.0);
    handle.write_back_shard();
    handle.reshard();
    EXPECT_EQ(params[1].param.scalar_type(), at::kBFloat16);
    EXPECT_EQ(params[1].param.storage().nbytes(), 0u);
    EXPECT_FLOAT_EQ(handle.full_flat_param()[6].item<float>(), 2.0f + 1.0f / 1024);

    // Reduction in bfloat16 (2 bytes x 5 to the peer), gradient cast to float32.
    handle.reduce_grad({at::full({2, 3}, 1.0, at::kBFloat16), at::full({3}, 3.0, at::kBFloat16)});
    EXPECT_EQ(comm.counters().get(CollectiveKind::kReduceScatter).bytes_sent, 2 * 5);
    EXPECT_EQ(handle.sharded_flat_param().grad().scalar_type(), at::kFloat);
  });
}

// Every transition of FlatParamState, with the all-gathers each one issues.
TEST(FlatParamStateTest, TransitionsAndTheirAllGathers) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    std::vector<NamedParam> params = make_params({{3, 3}, {4}});
    FlatParamHandle handle(params, self, ShardingStrategy::kFullShard,
                           FlatParamOptions().param_dtype(at::kBFloat16));
    const auto gathers = [&] { return comm.counters().get(CollectiveKind::kAllGather).calls; };
    EXPECT_EQ(handle.state(), FlatParamState::kSharded);
    handle.prefetch();
    EXPECT_EQ(handle.state(), FlatParamState::kUnsharding);
    handle.prefetch();  // already in flight: nothing more
    EXPECT_EQ(gathers(), 1);
    handle.reshard();  // waits for the all-gather, then frees
    EXPECT_EQ(handle.state(), FlatParamState::kSharded);
    EXPECT_EQ(params[0].param.storage().nbytes(), 0u);
    handle.unshard();
    EXPECT_EQ(handle.state(), FlatParamState::kUnsharded);
    EXPECT_EQ(params[0].param.scalar_type(), at::kBFloat16);
    handle.unshard();  // no-op
    EXPECT_EQ(gathers(), 2);
    handle.unshard_full_precision();
    EXPECT_EQ(handle.state(), FlatParamState::kUnshardedFullPrecision);
    EXPECT_EQ(params[0].param.scalar_type(), at::kFloat);
    EXPECT_EQ(gathers(), 3);
    EXPECT_THAT([&] { handle.unshard(); },
                ThrowsMessage<c10::Error>(HasSubstr(
                    "FlatParamHandle of 'p0' (2 parameters): unshard() in state "
                    "UNSHARDED_FULL_PRECISION (inside summon_full_params); reshard() first")));
    handle.reshard();
    EXPECT_EQ(handle.state(), FlatParamState::kSharded);
    EXPECT_EQ(params[0].param.scalar_type(), at::kBFloat16);
    EXPECT_EQ(gathers(), 3);
  });
}

// The CPU handle, except that reallocate_storage throws c10::OutOfMemoryError (as the
// CUDA caching allocator does on a full device) while `fail` is set, and memory_free()
// reports a fixed 1000 bytes.
class OutOfMemoryDevice : public DeviceHandle {
 public:
  bool fail = true;
  int64_t reallocations = 0;  // that succeeded

  c10::Device device() const override { return cpu_->device(); }
  void free_storage(const at::Tensor& tensor) override { cpu_->free_storage(tensor); }
  void reallocate_storage(const at::Tensor& tensor) override {
    TORCH_CHECK_WITH(OutOfMemoryError, !fail, "injected: out of memory");
    cpu_->reallocate_storage(tensor);
    ++reallocations;
  }
  int64_t memory_allocated() const override { return cpu_->memory_allocated(); }
  int64_t max_memory_allocated() const override { return cpu_->max_memory_allocated(); }
  void reset_peak_memory_stats() override { cpu_->reset_peak_memory_stats(); }
  int64_t memory_free() const override { return 1000; }
  void synchronize() override { cpu_->synchronize(); }
  c10::Stream current_stream() const override { return cpu_->current_stream(); }
  c10::Stream side_stream(const std::string& name) override { return cpu_->side_stream(name); }
  std::unique_ptr<DeviceEvent> record_event(c10::Stream stream) override {
    return cpu_->record_event(stream);
  }
  void wait_event(c10::Stream stream, const DeviceEvent& event) override {
    cpu_->wait_event(stream, event);
  }

 private:
  std::shared_ptr<DeviceHandle> cpu_ = DeviceHandle::for_device(at::kCPU);
};

// The message of the c10::OutOfMemoryError `call` throws (fails the test if it throws
// nothing or something else).
std::string out_of_memory_message(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::OutOfMemoryError& error) {
    return error.msg();
  }
  ADD_FAILURE() << "expected a c10::OutOfMemoryError";
  return "";
}

// Note [Out of memory while unsharding]: the unit, the bytes and the remedies; the handle
// stays as it was and works once memory is there.
TEST(FlatParamOutOfMemoryTest, NamesTheUnitAndTheBytesAndStaysUsable) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    auto device = std::make_shared<OutOfMemoryDevice>();
    std::vector<NamedParam> params = make_params({{3, 3}, {4}});  // 13 elements, padded 14
    const at::Tensor expected0 = params[0].param.detach().clone();
    FlatParamHandle handle(params, self, ShardingStrategy::kFullShard,
                           FlatParamOptions().param_dtype(at::kBFloat16).device_handle(device));
    const std::string remedies =
        " bytes free). To fit, make the unit smaller (a wrap policy that puts fewer "
        "parameters in each unit), shard over more ranks (a larger world size), or unshard in "
        "a smaller dtype (MixedPrecision::param_dtype). Allocator: injected: out of memory";
    // 14 elements x 2 bytes of bfloat16.
    const std::string unsharding =
        "FlatParamHandle of 'p0' (2 parameters): unsharding needs 28 bytes on cpu for the "
        "unsharded flat parameter (14 elements of BFloat16) and the device is out of memory "
        "(1000" +
        remedies;
    EXPECT_EQ(out_of_memory_message([&] { handle.prefetch(); }), unsharding);
    EXPECT_EQ(out_of_memory_message([&] { handle.unshard(); }), unsharding);
    EXPECT_EQ(handle.state(), FlatParamState::kSharded);
    EXPECT_EQ(params[0].param.storage().nbytes(), 0u);
    EXPECT_EQ(comm.counters().get(CollectiveKind::kAllGather).calls, 0);  // none issued

    device->fail = false;
    handle.unshard();
    EXPECT_EQ(handle.state(), FlatParamState::kUnsharded);
    EXPECT_TRUE(at::equal(params[0].param, expected0.to(at::kBFloat16)));
    handle.reshard();

    // summon_full_params' way back: reshard() reallocates the low-precision buffer to
    // point the views at it; out of memory there, the handle stays summoned.
    handle.unshard_full_precision();
    device->fail = true;
    EXPECT_EQ(out_of_memory_message([&] { handle.reshard(); }),
              "FlatParamHandle of 'p0' (2 parameters): reshard() (back from "
              "unshard_full_precision) needs 28 bytes on cpu for the unsharded flat parameter "
              "(14 elements of BFloat16) and the device is out of memory (1000" +
                  remedies);
    EXPECT_EQ(handle.state(), FlatParamState::kUnshardedFullPrecision);
    EXPECT_TRUE(at::equal(params[0].param, expected0));  // still the full-precision values
    device->fail = false;
    handle.reshard();
    EXPECT_EQ(handle.state(), FlatParamState::kSharded);
    EXPECT_EQ(device->reallocations, 2);
  });
}

TEST(FlatParamStateTest, NoShardWithoutMixedPrecisionStaysUnsharded) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    FlatParamHandle handle(make_params({{5}}), self, ShardingStrategy::kNoShard);
    EXPECT_EQ(handle.state(), FlatParamState::kUnsharded);
    handle.reshard();
    EXPECT_EQ(handle.state(), FlatParamState::kUnsharded);
    EXPECT_STREQ(flat_param_state_name(handle.state()), "UNSHARDED");
  });
}

TEST(FlatParamMixedPrecisionTest, ReduceDtypeAndKeepLowPrecisionGrads) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    std::vector<NamedParam> a = eighths(), b = eighths();
    FlatParamHandle fp32_reduce(
        a, self, ShardingStrategy::kFullShard,
        FlatParamOptions().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
    fp32_reduce.reduce_grad({at::ones({2, 3}, at::kBFloat16), at::ones({3}, at::kBFloat16)});
    EXPECT_EQ(comm.counters().get(CollectiveKind::kReduceScatter).bytes_sent, 4 * 5);
    FlatParamHandle keep(
        b, self, ShardingStrategy::kFullShard,
        FlatParamOptions().param_dtype(at::kBFloat16).keep_low_precision_grads(true));
    keep.reduce_grad({at::ones({2, 3}, at::kBFloat16), at::ones({3}, at::kBFloat16)});
    EXPECT_EQ(keep.sharded_flat_param().grad().scalar_type(), at::kBFloat16);
  });
}

TEST(FlatParamMixedPrecisionTest, NoShardMakesAndFreesTheLowPrecisionCopy) {
  auto world = FakeWorld::create(1);
  std::vector<NamedParam> params = eighths();
  FlatParamHandle handle(params, world->communicator(0), ShardingStrategy::kNoShard,
                         FlatParamOptions().param_dtype(at::kHalf));
  EXPECT_FALSE(handle.is_unsharded());
  handle.unshard();
  EXPECT_EQ(params[0].param.scalar_type(), at::kHalf);
  EXPECT_FLOAT_EQ(params[1].param[2].item<float>(), 1.25f);
  handle.reshard();
  EXPECT_EQ(params[0].param.storage().nbytes(), 0u);
  EXPECT_EQ(handle.sharded_flat_param().numel(), 9);
}

TEST(FlatParamHybridTest, ReduceScatterInTheShardGroupThenAllReduceAcross) {
  FakeWorld::run(FakeWorld::create(4), [](Communicator& comm) {
    HybridGroups groups = comm.split_hybrid(2);
    std::vector<NamedParam> params = make_params({{3, 3}});
    FlatParamHandle handle(params, groups.shard_group, ShardingStrategy::kHybridShard,
                           FlatParamOptions().replicate_communicator(groups.replicate_group));
    EXPECT_EQ(handle.shard_numel(), 5);  // sharded over F = 2, not W = 4
    handle.unshard();
    EXPECT_TRUE(at::equal(params[0].param.view({-1}), at::arange(9, at::kFloat)));
    // Rank r contributes 4 (r + 1): the mean over all 4 ranks is 10.
    handle.reduce_grad({at::full({3, 3}, 4.0 * (comm.rank() + 1))});
    const at::Tensor grad = handle.sharded_flat_param().grad();
    const int64_t real = groups.shard_group->rank() == 0 ? 5 : 4;
    EXPECT_TRUE(at::equal(grad.narrow(0, 0, real), at::full({real}, 10.0))) << grad;
    EXPECT_EQ(groups.shard_group->counters().get(CollectiveKind::kReduceScatter).calls, 1);
    EXPECT_EQ(groups.replicate_group->counters().get(CollectiveKind::kAllReduce).calls, 1);
    EXPECT_EQ(comm.counters().total().calls, 0);
  });
  auto world = FakeWorld::create(1);
  EXPECT_THAT(
      [&] {
        FlatParamHandle(make_params({{2}}), world->communicator(0), ShardingStrategy::kHybridShard);
      },
      ThrowsMessage<c10::Error>(HasSubstr("needs options.replicate_communicator")));
}

TEST(FlatParamFrozenTest, AllFrozenIsAFrozenFlatParameterMixedIsAnError) {
  auto world = FakeWorld::create(1);
  std::vector<NamedParam> frozen = make_params({{2}, {3}});
  for (NamedParam& p : frozen) p.param.set_requires_grad(false);
  FlatParamHandle handle(frozen, world->communicator(0), ShardingStrategy::kFullShard);
  EXPECT_FALSE(handle.sharded_flat_param().requires_grad());
  std::vector<NamedParam> mixed = make_params({{2}, {3}, {4}});
  mixed[1].param.set_requires_grad(false);
  EXPECT_THAT([&] { FlatParamHandle(mixed, world->communicator(0), ShardingStrategy::kFullShard); },
              ThrowsMessage<c10::Error>(HasSubstr("[p0, p2] require grad and [p1] do not")));
}

}  // namespace
}  // namespace fsdp
