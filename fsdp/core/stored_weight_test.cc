// stored_linear over a stored weight that is not NF4 (int8 values with a float scale per
// row, the shape of an fp8 all-gather's): outputs and gradients equal a Linear over the
// unpacked weight, and between forward and backward only the packed bytes are held.
#include "fsdp/core/stored_weight.h"

#include <cstdint>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/core/tracking_allocator.h"

namespace fsdp {
namespace {

// W = values (int8 [out, in]) x scale (float32 [out, 1]).
class ScaledInt8Weight : public StoredWeight {
 public:
  ScaledInt8Weight(at::Tensor values, at::Tensor scale)
      : values_(std::move(values)), scale_(std::move(scale)) {}
  at::Tensor unpack(c10::ScalarType dtype) const override {
    return (values_.to(at::kFloat) * scale_).to(dtype);
  }
  std::vector<int64_t> shape() const override { return values_.sizes().vec(); }

 private:
  at::Tensor values_, scale_;
};

TEST(StoredWeightTest, StoredLinearEqualsALinearOverTheUnpackedWeight) {
  at::manual_seed(0);
  const at::Tensor values = at::randint(-127, 128, {48, 32}, at::kChar);
  const at::Tensor scale = at::rand({48, 1}) * 0.01;
  auto weight = c10::make_intrusive<ScaledInt8Weight>(values, scale);
  const at::Tensor dense = weight->unpack(at::kFloat);
  const at::Tensor bias = at::randn({48}).requires_grad_(true);
  const at::Tensor bias2 = bias.detach().clone().requires_grad_(true);
  const at::Tensor x = at::randn({4, 3, 32});
  const at::Tensor x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
  const at::Tensor y1 = stored_linear(x1, weight, bias);
  const at::Tensor y2 = at::linear(x2, dense, bias2);
  EXPECT_EQ(y1.sizes(), (std::vector<int64_t>{4, 3, 48}));
  EXPECT_TRUE(at::allclose(y1, y2, 0, 1e-5));
  (y1 * y1).sum().backward();
  (y2 * y2).sum().backward();
  EXPECT_TRUE(at::allclose(x1.grad(), x2.grad(), 0, 1e-5));
  EXPECT_TRUE(at::allclose(bias.grad(), bias2.grad(), 0, 1e-4));
  // Without a bias, and a weight of another width: the error says what was expected.
  EXPECT_TRUE(at::allclose(stored_linear(x, weight), at::linear(x, dense), 0, 1e-5));
  EXPECT_THAT(
      [&] {
        stored_linear(at::randn({2, 31}), weight);
      },
      ::testing::ThrowsMessage<c10::Error>(
          ::testing::HasSubstr("expected an input of [*, 32] for a weight of shape "
                               "[48, 32], got [2, 31]")));
}

// A Linear saves its weight for the input's gradient; stored_linear saves nothing of it:
// after forward the graph holds the input only (the unpacked weight, 4 bytes a weight, is
// freed as soon as the product is computed).
TEST(StoredWeightTest, TheUnpackedWeightIsNotHeldBetweenForwardAndBackward) {
  at::set_num_threads(1);
  at::manual_seed(0);
  const at::Tensor values = at::randint(-127, 128, {256, 128}, at::kChar);
  auto weight = c10::make_intrusive<ScaledInt8Weight>(values, at::rand({256, 1}) * 0.01);
  const at::Tensor x = at::randn({2, 128}).requires_grad_(true);
  MemoryTracker tracker;
  const int64_t before = memory_allocated();
  at::Tensor y = stored_linear(x, weight);
  const int64_t held = memory_allocated() - before;
  EXPECT_EQ(held, 2 * 256 * 4);  // the output only
  at::Tensor dense = weight->unpack(at::kFloat);
  const int64_t with_dense = memory_allocated();
  at::Tensor y2 = at::linear(x, dense);
  dense = at::Tensor();  // autograd keeps it for backward
  EXPECT_EQ(memory_allocated() - with_dense, 2 * 256 * 4);
  y.sum().backward();
  y2.sum().backward();
}

}  // namespace
}  // namespace fsdp
