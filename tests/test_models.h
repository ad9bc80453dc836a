// Small module trees shared by the unit tests (testonly).
#ifndef FSDP_TESTS_TEST_MODELS_H_
#define FSDP_TESTS_TEST_MODELS_H_

#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

namespace fsdp::testing {

// A container registering `children` under "0", "1", ... like Python's nn.Sequential (a
// C++ Sequential cannot hold another Sequential).
inline std::shared_ptr<torch::nn::Module> seq(
    const std::vector<std::shared_ptr<torch::nn::Module>>& children) {
  auto module = std::make_shared<torch::nn::Module>();
  for (size_t i = 0; i < children.size(); ++i) {
    module->register_module(std::to_string(i), children[i]);
  }
  return module;
}

// Linear(n, n): n * n + n parameters.
inline std::shared_ptr<torch::nn::Module> linear(int64_t n) {
  return torch::nn::Linear(n, n).ptr();
}

// A linear layer over a given weight, to tie it to another module's weight.
struct TiedLinear : torch::nn::Module {
  explicit TiedLinear(const torch::Tensor& w) {
    weight = register_parameter("weight", w);
    bias = register_parameter("bias", torch::zeros({w.size(0)}));
  }
  torch::Tensor weight, bias;
};

// REFERENCE §1's model N: Seq(Linear(5,5), Linear(5,5), Seq(Linear(5,5), Linear(5,5))),
// 4 x 30 = 120 parameters.
inline std::shared_ptr<torch::nn::Module> reference_model_n() {
  return seq({linear(5), linear(5), seq({linear(5), linear(5)})});
}

// The module at `fqn` ("" for the root) below `root`.
inline std::shared_ptr<torch::nn::Module> submodule(const std::shared_ptr<torch::nn::Module>& root,
                                                    const std::string& fqn) {
  if (fqn.empty()) return root;
  for (const auto& item : root->named_modules()) {
    if (item.key() == fqn) return item.value();
  }
  return nullptr;
}

}  // namespace fsdp::testing

#endif  // FSDP_TESTS_TEST_MODELS_H_
