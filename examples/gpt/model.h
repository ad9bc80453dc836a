// A GPT-style character model: token + position embeddings, pre-norm transformer blocks
// (causal self-attention, MLP), a final norm and an output head tied to the token
// embedding. Each block is an FSDP unit; embeddings, final norm and head stay in the root.
#ifndef FSDP_EXAMPLES_GPT_MODEL_H_
#define FSDP_EXAMPLES_GPT_MODEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "fsdp/core/unit.h"

namespace fsdp::examples {

struct GptOptions {
  TORCH_ARG(int64_t, vocab_size) = 128;
  TORCH_ARG(int64_t, context) = 64;
  TORCH_ARG(int64_t, width) = 128;
  TORCH_ARG(int64_t, heads) = 4;
  TORCH_ARG(int64_t, layers) = 4;
};

// x + attention(norm(x)), then x + mlp(norm(x)). Input and output [batch, time, width].
// With checkpoint_activations (the trainers' --activation_checkpointing), a forward with
// grad mode on keeps only x for backward and recomputes the block there (fsdp::checkpoint,
// inside the block's unit).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GptOptions& options);
  at::Tensor forward(at::Tensor x);

  int64_t heads;
  bool checkpoint_activations = false;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};

 private:
  at::Tensor compute(const at::Tensor& x);
};

// Token ids [batch, time <= context] (int64) -> logits [batch, time, vocab_size].
struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptOptions& options);
  at::Tensor forward(at::Tensor tokens);

  GptOptions options;
  torch::nn::Embedding token{nullptr}, position{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<Unit<BlockImpl>> units;
  torch::nn::LayerNorm norm{nullptr};
};

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_GPT_MODEL_H_
