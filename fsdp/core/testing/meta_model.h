// A Llama-shaped LM whose code takes tensor options, for tests of initialisation on the
// meta device (fully_sharded.h: "Models built on the meta device"): built on c10::kMeta it
// has shapes only, built on the CPU each module initialises itself as it is built, and
// reset_parameters_of is the init function FullyShardedRoot::init_parameters takes.
#ifndef FSDP_CORE_TESTING_META_MODEL_H_
#define FSDP_CORE_TESTING_META_MODEL_H_

#include <cmath>
#include <memory>
#include <mutex>

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/wrap/policy.h"

namespace fsdp::core_testing {

constexpr int64_t kMetaVocab = 16;
constexpr int64_t kMetaHidden = 8;
constexpr int64_t kMetaHeads = 2;
constexpr int64_t kMetaHeadDim = kMetaHidden / kMetaHeads;
constexpr int64_t kMetaMlp = 24;
constexpr int64_t kMetaLayers = 3;
constexpr int64_t kMetaContext = 5;

// Model code that takes tensor options, as a decoder package writes it: on a real device
// each module initialises itself as it is built; on c10::kMeta it only has shapes, and
// reset_parameters() gives the same values later.
struct MetaLinearImpl : torch::nn::Module {
  MetaLinearImpl(int64_t in, int64_t out, at::TensorOptions options) {
    weight = register_parameter("weight", at::empty({out, in}, options));
    bias = register_parameter("bias", at::empty({out}, options));
    if (!options.device().is_meta()) reset_parameters();
  }
  // An output head tied to `weight` (an embedding's): no values of its own.
  explicit MetaLinearImpl(const at::Tensor& tied) : tied_(true) {
    weight = register_parameter("weight", tied);
  }
  void reset_parameters() {
    if (tied_) return;
    at::NoGradGuard no_grad;
    const double bound = 1.0 / std::sqrt(static_cast<double>(weight.size(1)));
    weight.uniform_(-bound, bound);
    bias.uniform_(-bound, bound);
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight, bias); }
  at::Tensor weight, bias;
  bool tied_ = false;
};
TORCH_MODULE(MetaLinear);

struct MetaEmbeddingImpl : torch::nn::Module {
  explicit MetaEmbeddingImpl(at::TensorOptions options) {
    weight = register_parameter("weight", at::empty({kMetaVocab, kMetaHidden}, options));
    if (!options.device().is_meta()) reset_parameters();
  }
  void reset_parameters() {
    at::NoGradGuard no_grad;
    weight.normal_();
  }
  at::Tensor forward(const at::Tensor& tokens) { return at::embedding(weight, tokens); }
  at::Tensor weight;
};
TORCH_MODULE(MetaEmbedding);

struct RmsNormImpl : torch::nn::Module {
  explicit RmsNormImpl(at::TensorOptions options) {
    weight = register_parameter("weight", at::empty({kMetaHidden}, options));
    if (!options.device().is_meta()) reset_parameters();
  }
  void reset_parameters() {
    at::NoGradGuard no_grad;
    weight.fill_(1.0);
  }
  at::Tensor forward(const at::Tensor& x) {
    return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-6) * weight;
  }
  at::Tensor weight;
};
TORCH_MODULE(RmsNorm);

// Rotary embeddings: inv_freq is computed, not learned (PyTorch registers it with
// persistent=False: in no checkpoint).
struct RopeImpl : torch::nn::Module {
  explicit RopeImpl(at::TensorOptions options) {
    inv_freq = register_buffer("inv_freq", at::empty({kMetaHeadDim / 2}, options));
    if (!options.device().is_meta()) reset_parameters();
  }
  void reset_parameters() {
    at::NoGradGuard no_grad;
    inv_freq.copy_(1.0 /
                   at::pow(10000.0, at::arange(0, kMetaHeadDim, 2, at::kFloat) / kMetaHeadDim));
  }
  // x: [batch, time, heads, head_dim].
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor angles =
        at::outer(at::arange(x.size(1), inv_freq.options()), inv_freq).view({1, x.size(1), 1, -1});
    const at::Tensor cos = at::cos(angles), sin = at::sin(angles);
    const at::Tensor a = x.narrow(-1, 0, kMetaHeadDim / 2),
                     b = x.narrow(-1, kMetaHeadDim / 2, kMetaHeadDim / 2);
    return at::cat({a * cos - b * sin, a * sin + b * cos}, -1);
  }
  at::Tensor inv_freq;
};
TORCH_MODULE(Rope);

struct MetaBlockImpl : torch::nn::Module {
  explicit MetaBlockImpl(at::TensorOptions options) {
    norm1 = register_module("norm1", RmsNorm(options));
    q = register_module("q", MetaLinear(kMetaHidden, kMetaHidden, options));
    k = register_module("k", MetaLinear(kMetaHidden, kMetaHidden, options));
    v = register_module("v", MetaLinear(kMetaHidden, kMetaHidden, options));
    o = register_module("o", MetaLinear(kMetaHidden, kMetaHidden, options));
    rope = register_module("rope", Rope(options));
    norm2 = register_module("norm2", RmsNorm(options));
    up = register_module("up", MetaLinear(kMetaHidden, kMetaMlp, options));
    down = register_module("down", MetaLinear(kMetaMlp, kMetaHidden, options));
  }
  at::Tensor forward(at::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1);
    const at::Tensor h = norm1(x);
    const auto heads = [&](const at::Tensor& y) {
      return y.view({b, t, kMetaHeads, kMetaHeadDim});
    };
    const at::Tensor attn = at::scaled_dot_product_attention(
        rope(heads(q(h))).transpose(1, 2), rope(heads(k(h))).transpose(1, 2),
        heads(v(h)).transpose(1, 2), /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
    x = x + o(attn.transpose(1, 2).reshape({b, t, kMetaHidden}));
    return x + down(torch::nn::functional::silu(up(norm2(x))));
  }
  RmsNorm norm1{nullptr}, norm2{nullptr};
  MetaLinear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, up{nullptr}, down{nullptr};
  Rope rope{nullptr};
};

// A Llama-shaped LM: blocks in a ModuleList (called through fsdp::forward_as), a final
// norm, an output head tied to the embedding, and `extra`, a projection left to tests of
// ignored modules (unused by forward).
struct MetaLmImpl : torch::nn::Module {
  explicit MetaLmImpl(at::TensorOptions options) {
    embed = register_module("embed", MetaEmbedding(options));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < kMetaLayers; ++i)
      layers->push_back(std::make_shared<MetaBlockImpl>(options));
    norm = register_module("norm", RmsNorm(options));
    head = register_module("head", MetaLinear(embed->weight));
    extra = register_module("extra", MetaLinear(kMetaHidden, 4, options));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = embed(tokens);
    for (const auto& layer : *layers) x = fsdp::forward_as<MetaBlockImpl>(layer, x);
    return at::matmul(norm(x), head->weight.t());
  }
  static at::Tensor tokens(int step, int64_t rows) {
    return (at::arange(rows * (kMetaContext + 1), at::kLong).view({rows, kMetaContext + 1}) * 5 +
            step) %
           kMetaVocab;
  }
  // The next-token loss of `model` (the LM itself or its FSDP root) on `tokens`.
  template <typename Model>
  static at::Tensor loss(Model& model, const at::Tensor& tokens) {
    const at::Tensor logits = model.forward(tokens.narrow(1, 0, kMetaContext));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kMetaVocab}),
                                                tokens.narrow(1, 1, kMetaContext).reshape({-1}));
  }
  MetaEmbedding embed{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RmsNorm norm{nullptr};
  MetaLinear head{nullptr}, extra{nullptr};
};
TORCH_MODULE(MetaLm);

// The init function a user of these modules writes.
inline void reset_parameters_of(torch::nn::Module& module) {
  if (auto* m = module.as<MetaLinearImpl>()) return m->reset_parameters();
  if (auto* m = module.as<MetaEmbeddingImpl>()) return m->reset_parameters();
  if (auto* m = module.as<RmsNormImpl>()) return m->reset_parameters();
  if (auto* m = module.as<RopeImpl>()) return m->reset_parameters();
}

// The one-process build: every module initialised as it is built, from seed 0.
inline std::shared_ptr<MetaLmImpl> build_on_cpu() {
  std::lock_guard<std::mutex> lock(seed_mutex());
  torch::manual_seed(0);
  return std::make_shared<MetaLmImpl>(at::TensorOptions());
}

inline std::shared_ptr<MetaLmImpl> build_on_meta() {
  return std::make_shared<MetaLmImpl>(at::TensorOptions().device(c10::kMeta));
}

inline void init_from_seed(FullyShardedRoot& model) {
  std::lock_guard<std::mutex> lock(seed_mutex());
  torch::manual_seed(0);
  model.init_parameters(reset_parameters_of);
}

// Each block a unit (the transformer policy); HYBRID strategies with one rank per shard group.
inline FullyShardedDataParallelOptions meta_layer_policy(std::shared_ptr<Communicator> comm,
                                                         ShardingStrategy strategy) {
  return FullyShardedDataParallelOptions(std::move(comm))
      .sharding_strategy(strategy)
      .hybrid_shard_group_size(1)
      .auto_wrap_policy(transformer_auto_wrap_policy({ModuleType::of<MetaBlockImpl>()}));
}

}  // namespace fsdp::core_testing

#endif  // FSDP_CORE_TESTING_META_MODEL_H_
