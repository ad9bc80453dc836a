// The Fashion-MNIST classifier (examples/fashion_mnist): an MLP 784 -> 512 -> 256 -> 10 with
// ReLU, its two hidden blocks FSDP units, the head in the root. Header-only, so that the
// trainer and the CPU-side device check (tests/device_check_test.cc) build the same model.
//
//   auto net = std::make_shared<fsdp::examples::ClassifierImpl>();
//   at::Tensor logits = net->forward(images);  // [B, 784] float -> [B, 10]
#ifndef FSDP_EXAMPLES_FASHION_MNIST_MODEL_H_
#define FSDP_EXAMPLES_FASHION_MNIST_MODEL_H_

#include <cstdint>
#include <memory>

#include <ATen/Functions.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "fsdp/core/unit.h"

namespace fsdp::examples {

constexpr int64_t kNumClasses = 10;

// [B, in] -> relu(fc(x)) [B, out].
struct HiddenBlockImpl : torch::nn::Module {
  HiddenBlockImpl(int64_t in, int64_t out)
      : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  at::Tensor forward(at::Tensor x) { return at::relu(fc(x)); }
  torch::nn::Linear fc;
};

// input: float [B, 784]; output: logits [B, 10].
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl()
      : block1(register_module(
            "block1", fsdp::Unit<HiddenBlockImpl>(std::make_shared<HiddenBlockImpl>(784, 512)))),
        block2(register_module(
            "block2", fsdp::Unit<HiddenBlockImpl>(std::make_shared<HiddenBlockImpl>(512, 256)))),
        head(register_module("head", torch::nn::Linear(256, kNumClasses))) {}
  at::Tensor forward(at::Tensor x) { return head(block2(block1(x))); }
  fsdp::Unit<HiddenBlockImpl> block1, block2;
  torch::nn::Linear head;
};

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_FASHION_MNIST_MODEL_H_
