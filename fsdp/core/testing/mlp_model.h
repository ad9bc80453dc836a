// The residual-MLP model of the memory test and the step benchmark: `blocks` units of
// x + fc2(relu(fc1(x))) (fc1: dim -> 4 dim, fc2: 4 dim -> dim), then a root-owned head
// Linear(dim, out). Unbound, it is plain LibTorch (units are pass-throughs).
#ifndef FSDP_CORE_TESTING_MLP_MODEL_H_
#define FSDP_CORE_TESTING_MLP_MODEL_H_

#include <memory>
#include <vector>

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "fsdp/core/unit.h"

namespace fsdp::core_internal {

struct MlpBlockImpl : torch::nn::Module {
  explicit MlpBlockImpl(int64_t dim)
      : fc1(register_module("fc1", torch::nn::Linear(dim, 4 * dim))),
        fc2(register_module("fc2", torch::nn::Linear(4 * dim, dim))) {}
  at::Tensor forward(at::Tensor x) { return x + fc2(torch::nn::functional::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

struct MlpModelImpl : torch::nn::Module {
  MlpModelImpl(int64_t dim, int num_blocks, int64_t out) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < num_blocks; ++i) {
      units.push_back(Unit<MlpBlockImpl>(std::make_shared<MlpBlockImpl>(dim)));
      blocks->push_back(units.back());
    }
    head = register_module("head", torch::nn::Linear(dim, out));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& unit : units) x = unit(x);
    return head(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  std::vector<Unit<MlpBlockImpl>> units;
  torch::nn::Linear head{nullptr};
};

}  // namespace fsdp::core_internal

#endif  // FSDP_CORE_TESTING_MLP_MODEL_H_
