#include "fsdp/core/fused_adamw.h"

#include <sstream>
#include <vector>

#include <gtest/gtest.h>
#include <torch/serialize.h>

namespace fsdp {
namespace {

// Parameters of the given dtype: a matrix, a vector, and one that never gets a gradient.
std::vector<torch::Tensor> make_params(torch::ScalarType dtype) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> params;
  for (auto shape :
       {std::vector<int64_t>{7, 5}, std::vector<int64_t>{11}, std::vector<int64_t>{3}}) {
    params.push_back(torch::randn(shape).to(dtype).requires_grad_());
  }
  return params;
}

// Gives every parameter but the last a gradient that depends on the step, its values
// representable in `values` (so that a bf16 run and its float reference see the same).
void set_grads(std::vector<torch::Tensor>& params, int step,
               torch::ScalarType values = torch::kDouble) {
  for (size_t i = 0; i + 1 < params.size(); ++i) {
    const torch::Tensor x = torch::arange(params[i].numel(), torch::kDouble) * 0.37 * (i + 1);
    params[i].mutable_grad() =
        (x + step).sin().to(values).to(params[i].scalar_type()).reshape(params[i].sizes());
  }
}

// Runs `steps` steps of torch::optim::AdamW and of FusedAdamW from the same parameters
// and checks parameters and state after each. The reference runs in `ref_dtype`: for
// bf16 parameters in float, since torch::optim::AdamW rounds to bf16 after each of its
// eight operations and the fused kernel once, in float arithmetic.
void expect_same_as_adamw(torch::ScalarType dtype, torch::ScalarType ref_dtype,
                          torch::optim::AdamWOptions options, double rtol, double atol) {
  std::vector<torch::Tensor> ref = make_params(dtype), fused = make_params(dtype);
  for (torch::Tensor& p : ref) p = p.detach().to(ref_dtype).requires_grad_();
  const torch::Tensor untouched = fused.back().detach().clone();
  torch::optim::AdamW ref_adamw(ref, options);
  FusedAdamW fused_adamw(fused, options);
  const auto close = [&](const torch::Tensor& got, const torch::Tensor& want) {
    return torch::allclose(got.to(torch::kDouble), want.to(torch::kDouble), rtol, atol);
  };
  for (int step = 0; step < 5; ++step) {
    set_grads(ref, step, dtype);
    set_grads(fused, step, dtype);
    ref_adamw.step();
    fused_adamw.step();
    for (size_t i = 0; i + 1 < ref.size(); ++i) {
      EXPECT_TRUE(close(fused[i], ref[i]))
          << "parameter " << i << " after step " << step + 1 << ": max difference "
          << (fused[i].to(torch::kDouble) - ref[i].to(torch::kDouble)).abs().max().item<double>();
      const auto& r = static_cast<torch::optim::AdamWParamState&>(
          *ref_adamw.state().at(ref[i].unsafeGetTensorImpl()));
      const auto& f = static_cast<torch::optim::AdamWParamState&>(
          *fused_adamw.state().at(fused[i].unsafeGetTensorImpl()));
      EXPECT_EQ(f.step(), step + 1);
      EXPECT_EQ(f.exp_avg().scalar_type(), dtype);
      EXPECT_TRUE(close(f.exp_avg(), r.exp_avg())) << "exp_avg of parameter " << i;
      EXPECT_TRUE(close(f.exp_avg_sq(), r.exp_avg_sq())) << "exp_avg_sq of parameter " << i;
      EXPECT_EQ(f.max_exp_avg_sq().defined(), options.amsgrad());
    }
  }
  // A parameter without a gradient is neither updated nor given state.
  EXPECT_TRUE(torch::equal(fused.back(), untouched));
  EXPECT_EQ(fused_adamw.state().count(fused.back().unsafeGetTensorImpl()), 0u);
}

TEST(FusedAdamWTest, MatchesAdamWInFloat) {
  expect_same_as_adamw(torch::kFloat, torch::kFloat,
                       torch::optim::AdamWOptions(1e-2).weight_decay(0.1), 1e-5, 1e-6);
}

TEST(FusedAdamWTest, MatchesAdamWInDoubleWithAmsgradAndOtherBetas) {
  expect_same_as_adamw(torch::kDouble, torch::kDouble,
                       torch::optim::AdamWOptions(3e-2).betas({0.8, 0.95}).eps(1e-6).amsgrad(true),
                       1e-12, 1e-14);
}

TEST(FusedAdamWTest, MatchesAdamWInBFloat16) {
  // Within a few roundings to bf16 (8 significant bits: 2^-8 relative each) of the float
  // computation, while 5 steps at lr 0.1 move each parameter by up to 0.5.
  expect_same_as_adamw(torch::kBFloat16, torch::kFloat,
                       torch::optim::AdamWOptions(0.1).weight_decay(0.01), 1.0 / 64, 1.0 / 64);
}

TEST(FusedAdamWTest, ContinuesFromAdamWState) {
  // AdamW's saved state loads into FusedAdamW (it is an AdamW) and the run continues.
  std::vector<torch::Tensor> ref = make_params(torch::kDouble), fused = make_params(torch::kDouble);
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.05);
  torch::optim::AdamW ref_adamw(ref, options);
  for (int step = 0; step < 3; ++step) {
    set_grads(ref, step);
    ref_adamw.step();
  }
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ref.size(); ++i) fused[i].copy_(ref[i]);
  }
  std::stringstream saved;
  torch::save(ref_adamw, saved);
  FusedAdamW fused_adamw(fused, options);
  torch::load(fused_adamw, saved);
  for (int step = 3; step < 6; ++step) {
    set_grads(ref, step);
    set_grads(fused, step);
    ref_adamw.step();
    fused_adamw.step();
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(torch::allclose(fused[i], ref[i], 1e-12, 1e-14)) << "parameter " << i;
  }
  EXPECT_EQ(static_cast<torch::optim::AdamWParamState&>(
                *fused_adamw.state().at(fused[0].unsafeGetTensorImpl()))
                .step(),
            6);
}

TEST(FusedAdamWTest, RefusesAGradientOfAnotherDtype) {
  torch::Tensor p = torch::zeros({4}).requires_grad_();
  p.mutable_grad() = torch::ones({4}, torch::kDouble);
  FusedAdamW adamw(std::vector<torch::Tensor>{p});
  EXPECT_THROW(
      {
        try {
          adamw.step();
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what_without_backtrace()).find("a gradient of dtype Double"),
                    std::string::npos)
              << e.what_without_backtrace();
          throw;
        }
      },
      c10::Error);
}

}  // namespace
}  // namespace fsdp
