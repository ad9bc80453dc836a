#include "models/decoder.h"

#include <cmath>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tanh.h>
#include <c10/util/Exception.h>

#include "fsdp/core/checkpoint_wrapper.h"
#include "models/internal/projection.h"
#include "models/rotary.h"

namespace fsdp::models {

DecoderUnits parse_decoder_units(const std::string& flag, const DecoderConfig& config) {
  TORCH_CHECK(flag == "layer" || flag == "sublayer", "--moe_units=", flag,
              ": expected layer (each decoder layer one FSDP unit) or sublayer (its attention "
              "and its feed-forward block two)");
  TORCH_CHECK(flag == "layer" || config.is_moe(), "--moe_units=sublayer: a ", config.model_type,
              " decoder has no experts to gather apart; it is for the mixture-of-experts "
              "families (qwen3_moe, mixtral, olmoe, qwen2_moe, gpt_oss, deepseek_v3)");
  return flag == "layer" ? DecoderUnits::kLayer : DecoderUnits::kSublayer;
}

using models_internal::projection;

// Note [Where the decoder's tensors are created]
// Every parameter is created with the tensor options the CausalLMImpl constructor takes,
// in three kinds of module: RMSNormImpl (its weight), fsdp::lora::LoraLinear (projections
// and head, through models_internal::projection) and torch::nn::Embedding, given its
// weight through EmbeddingOptions::_weight (its own constructor would allocate on the CPU
// in the default dtype). On a real device each module initialises itself as it is built, in
// construction order, so the values equal the decoder's before it took tensor options (fp32 on the
// CPU: torch::nn::Embedding's and Linear's own initialisation). On c10::kMeta nothing is
// allocated or drawn, and reset_decoder_parameters, passed to
// FullyShardedRoot::init_parameters, gives each module what its constructor would have:
// init_parameters visits the modules in pre-order, the order the constructors run in, so
// with the same seed a meta build equals a CPU build. The decoder has no non-persistent
// buffers: RoPE's cos and sin and Gemma's embedding scale are computed in forward from the
// config, so a checkpoint load leaves nothing uncomputed. Its one (persistent) buffer,
// deepseek_v3's e_score_correction_bias, is read from the checkpoint, or zeroed by
// reset_decoder_parameters as transformers initialises it.

namespace {

using CheckpointedFunction = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// Note [Router logits out of a checkpointed layer]
// A checkpointed layer runs its forward without recording a graph (fsdp::checkpoint is
// reentrant), so the router logits a sparse layer keeps for the load-balancing loss would
// have no path back to the router, and the aux loss would train nothing. With grad mode
// on, the checkpointed function of a sparse layer therefore returns its router logits
// beside its output, [tokens, hidden + num_experts] (both in the compute dtype), and the
// two are split after it: backward then reaches the recomputed router through the
// checkpoint from either, as it does without checkpointing (moe_test holds the gradients
// equal). The split copies the layer's output once. The same holds for a MoE block
// checkpointed in its own unit (DecoderUnits::kSublayer).
//
// fsdp::checkpoint of `function` (an output [.., hidden] of inputs[0]'s shape) over
// `inputs` and `params`; undefined inputs (no mask) are passed on undefined, not saved.
// `moe`: the MoE block whose router logits `function` sets, or null.
at::Tensor checkpoint_with_router(CheckpointedFunction function,
                                  const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& params, SparseMoeBlockImpl* moe) {
  std::vector<at::Tensor> saved;
  std::vector<size_t> positions;  // of the saved inputs among `inputs`
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    saved.push_back(inputs[i]);
    positions.push_back(i);
  }
  // deepseek_v3's router keeps no logits: it has no load-balancing loss.
  const bool with_router = moe != nullptr && !moe->group_router && at::GradMode::is_enabled();
  const at::Tensor out = checkpoint(
      [function = std::move(function), positions, count = inputs.size(), moe,
       with_router](const std::vector<at::Tensor>& in) {
        std::vector<at::Tensor> all(count);
        for (size_t k = 0; k < in.size(); ++k) all[positions[k]] = in[k];
        const at::Tensor y = function(all);
        if (!with_router) return y;
        return at::cat({y.reshape({-1, y.size(-1)}), moe->router_logits.to(y.scalar_type())}, -1);
      },
      saved, params);
  if (!with_router) return out;
  const int64_t hidden = inputs[0].size(-1);
  moe->router_logits = out.narrow(-1, hidden, out.size(-1) - hidden).contiguous();
  return out.narrow(-1, 0, hidden).contiguous().view(inputs[0].sizes());
}

template <size_t... I>
auto tuple_of(const std::vector<at::Tensor>& in, std::index_sequence<I...>) {
  return std::make_tuple(in[I]...);
}
// in[0], ..., in[N - 1] as a tuple.
template <size_t N>
auto tensors_of(const std::vector<at::Tensor>& in) {
  return tuple_of(in, std::make_index_sequence<N>{});
}

// The module a layer holds as `name`: itself, or with DecoderUnits::kSublayer a unit
// around it.
template <typename Block, typename Sublayer>
std::shared_ptr<Block> register_sublayer(torch::nn::Module& layer, const char* name,
                                         std::shared_ptr<Sublayer> sublayer, DecoderUnits units) {
  if (units == DecoderUnits::kSublayer) {
    layer.register_module(name, Unit<Sublayer>(sublayer));
  } else {
    layer.register_module(name, sublayer);
  }
  return sublayer;
}

}  // namespace

template <typename Block, typename... Args>
at::Tensor SublayerImpl<Block, Args...>::forward(Args... args, bool checkpointed) {
  if (!checkpointed) return Block::forward(args...);
  SparseMoeBlockImpl* moe = nullptr;
  if constexpr (std::is_same_v<Block, SparseMoeBlockImpl>) moe = this;
  return checkpoint_with_router(
      [this](const std::vector<at::Tensor>& in) {
        return std::apply([this](const auto&... each) { return Block::forward(each...); },
                          tensors_of<sizeof...(Args)>(in));
      },
      {args...}, this->parameters(), moe);
}

template struct SublayerImpl<AttentionImpl, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&>;
template struct SublayerImpl<MLPImpl, const at::Tensor&>;
template struct SublayerImpl<SparseMoeBlockImpl, const at::Tensor&>;

DecoderLayerImpl::DecoderLayerImpl(const DecoderConfig& config, int64_t index,
                                   const at::TensorOptions& options, DecoderUnits units)
    : type(config.layer_types.at(index)),
      residual_multiplier(config.residual_multiplier),
      units(units) {
  const auto norm = [&](const char* name) {
    return register_module(
        name, RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style, options));
  };
  self_attn = Attention(register_sublayer<AttentionImpl>(
      *this, "self_attn", std::make_shared<AttentionSublayerImpl>(config, type, options), units));
  if (config.is_moe() && config.sparse_layers.at(index)) {
    moe = SparseMoeBlock(register_sublayer<SparseMoeBlockImpl>(
        *this, "mlp", std::make_shared<MoeSublayerImpl>(config, options), units));
  } else {
    mlp = MLP(register_sublayer<MLPImpl>(
        *this, "mlp", std::make_shared<MLPSublayerImpl>(config, options), units));
  }
  if (!config.post_norms) input_layernorm = norm("input_layernorm");
  post_attention_layernorm = norm("post_attention_layernorm");
  if (config.sandwich_norms) pre_feedforward_layernorm = norm("pre_feedforward_layernorm");
  if (config.sandwich_norms || config.post_norms) {
    post_feedforward_layernorm = norm("post_feedforward_layernorm");
  }
}

// See Note [Router logits out of a checkpointed layer].
at::Tensor DecoderLayerImpl::forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                     at::Tensor mask) {
  // With kSublayer the sublayers checkpoint themselves, inside their units.
  if (!checkpoint_activations || units == DecoderUnits::kSublayer) {
    return compute(x, cos, sin, mask);
  }
  return checkpoint_with_router(
      [this](const std::vector<at::Tensor>& in) { return compute(in[0], in[1], in[2], in[3]); },
      {x, cos, sin, mask}, parameters(), moe ? moe.get() : nullptr);
}

at::Tensor DecoderLayerImpl::attention(const at::Tensor& x, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& mask) {
  return forward_as<AttentionSublayerImpl>(self_attn.ptr(), x, cos, sin, mask,
                                           sublayers_checkpointed());
}

at::Tensor DecoderLayerImpl::feed_forward(const at::Tensor& x) {
  if (moe) return forward_as<MoeSublayerImpl>(moe.ptr(), x, sublayers_checkpointed());
  return forward_as<MLPSublayerImpl>(mlp.ptr(), x, sublayers_checkpointed());
}

at::Tensor DecoderLayerImpl::compute(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& mask) {
  if (!input_layernorm) {  // post_norms (olmo2): norms after the sublayers only
    x = x + post_attention_layernorm(attention(x, cos, sin, mask));
    return x + post_feedforward_layernorm(feed_forward(x));
  }
  if (!pre_feedforward_layernorm) {    // without sandwich_norms
    if (residual_multiplier != 1.0) {  // granite
      x = x + attention(input_layernorm(x), cos, sin, mask) * residual_multiplier;
      return x + feed_forward(post_attention_layernorm(x)) * residual_multiplier;
    }
    x = x + attention(input_layernorm(x), cos, sin, mask);
    return x + feed_forward(post_attention_layernorm(x));
  }
  // sandwich_norms (gemma)
  x = x + post_attention_layernorm(attention(input_layernorm(x), cos, sin, mask));
  return x + post_feedforward_layernorm(feed_forward(pre_feedforward_layernorm(x)));
}

// Note [The embeddings and the head are units]
// With untied embeddings, embed_tokens and lm_head are FSDP units of their own, as each
// decoder layer is (torchtitan shards them apart from the root too): each is gathered only
// while it runs, forward and backward, and freed after, instead of both staying gathered
// in the root from the start of forward to the end of backward. For a Llama with a 32000
// vocabulary and hidden size 2048 that is 250 MiB gathered at a time instead of 500 MiB
// (fp32), and the head's unsharded gradient is reduced as soon as backward leaves it. Tied
// embeddings stay in the root: one parameter serves both ends. The names are unchanged
// (FSDP's names drop the unit's wrapper: fsdp/base/names.h).
DecoderModelImpl::DecoderModelImpl(const DecoderConfig& config, const at::TensorOptions& options,
                                   DecoderUnits units)
    : config(config), units(units) {
  // See Note [Where the decoder's tensors are created].
  torch::nn::EmbeddingOptions embedding(config.vocab_size, config.hidden_size);
  if (config.pad_token_id >= 0) embedding.padding_idx(config.pad_token_id);
  embedding._weight(at::empty({config.vocab_size, config.hidden_size}, options));
  embed_tokens = torch::nn::Embedding(embedding);
  if (!options.device().is_meta()) embed_tokens->reset_parameters();
  // See Note [The embeddings and the head are units].
  if (config.tie_word_embeddings) {
    register_module("embed_tokens", embed_tokens);
  } else {
    embed_unit =
        register_module("embed_tokens", Unit<torch::nn::EmbeddingImpl>(embed_tokens.ptr()));
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    decoder_layers.emplace_back(config, i, options, units);
    if (units == DecoderUnits::kLayer) {
      layers->push_back(Unit<DecoderLayerImpl>(decoder_layers.back().ptr()));
    } else {
      layers->push_back(decoder_layers.back());
    }
  }
  norm = register_module(
      "norm", RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style, options));
}

std::pair<at::Tensor, at::Tensor> DecoderModelImpl::rotary(const RopeConfig& rope, int64_t time,
                                                           c10::Device device,
                                                           at::ScalarType dtype) const {
  return rotary_cos_sin(rope, config.rotary_dim, time, device, dtype);
}

at::Tensor DecoderModelImpl::forward(const at::Tensor& ids, const at::Tensor& positions,
                                     const at::Tensor& segments) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong,
              "DecoderModel: expected token ids [batch, time] of int64, got ", ids.sizes(), " of ",
              ids.scalar_type());
  const int64_t t = ids.size(1);
  const int64_t offset = cache != nullptr ? cache->length : 0;  // the cached tokens
  TORCH_CHECK(offset + t <= config.max_position_embeddings, "DecoderModel: a sequence of ",
              offset + t,
              " tokens is longer than max_position_embeddings = ", config.max_position_embeddings,
              "; use shorter windows or answers");
  TORCH_CHECK(cache == nullptr || !at::GradMode::is_enabled(),
              "DecoderModel: a forward with a KV cache runs without grad (torch::NoGradGuard)");
  at::Tensor x = embed_unit ? embed_unit(ids) : embed_tokens(ids);
  if (config.scale_embeddings) {  // transformers: a fp32 scalar sqrt(hidden), in the weights' dtype
    x = x * at::scalar_tensor(std::sqrt(double(config.hidden_size)), x.options().dtype(at::kFloat))
                .to(x.scalar_type());
  }
  if (config.embedding_multiplier != 1.0) x = x * config.embedding_multiplier;  // granite
  TORCH_CHECK(positions.defined() == segments.defined(),
              "DecoderModel: packed rows need both positions and segments");
  at::Tensor mask;
  const auto at_offset = [&](const RopeConfig& rope) {  // positions offset ... offset + t - 1
    auto [cos, sin] = rotary(rope, offset + t, x.device(), x.scalar_type());
    return std::pair(cos.narrow(0, offset, t), sin.narrow(0, offset, t));
  };
  std::pair<at::Tensor, at::Tensor> full = at_offset(config.rope);
  std::pair<at::Tensor, at::Tensor> sliding =
      config.rope_per_layer_type ? at_offset(config.sliding_rope) : full;
  if (positions.defined()) {
    // See Note [Packed rows].
    TORCH_CHECK(positions.sizes() == ids.sizes() && segments.sizes() == ids.sizes() &&
                    positions.scalar_type() == at::kLong && segments.scalar_type() == at::kLong,
                "DecoderModel: expected positions and segments [batch, time] of int64 as the ids ",
                ids.sizes(), ", got ", positions.sizes(), " and ", segments.sizes());
    mask = packed_attention_mask(segments);
    const auto at_positions = [&](std::pair<at::Tensor, at::Tensor>& cos_sin) {
      cos_sin = {cos_sin.first.index_select(0, positions.reshape(-1))
                     .view({ids.size(0), 1, t, cos_sin.first.size(-1)}),
                 cos_sin.second.index_select(0, positions.reshape(-1))
                     .view({ids.size(0), 1, t, cos_sin.second.size(-1)})};
    };
    at_positions(full);
    if (config.rope_per_layer_type) at_positions(sliding);
    if (!config.rope_per_layer_type) sliding = full;
  }
  for (size_t i = 0; i < decoder_layers.size(); ++i) {
    const auto& [cos, sin] = config.layer_types[i] == LayerType::kSliding ? sliding : full;
    // Through the layer's unit with DecoderUnits::kLayer; mask: undefined unless packed.
    x = forward_as<DecoderLayerImpl>(decoder_layers[i].ptr(), x, cos, sin, mask);
  }
  if (cache != nullptr) cache->length += t;
  return norm(x);
}

std::vector<at::Tensor> DecoderModelImpl::router_logits() const {
  std::vector<at::Tensor> logits;
  for (const DecoderLayer& layer : decoder_layers) {
    const SparseMoeBlock& moe = layer->moe;
    if (moe && moe->router_logits.defined()) logits.push_back(moe->router_logits);
  }
  return logits;
}

CausalLMImpl::CausalLMImpl(const DecoderConfig& config, const at::TensorOptions& options,
                           DecoderUnits units)
    : config(config) {
  try {
    model = register_module("model", DecoderModel(config, options, units));
    if (!config.tie_word_embeddings) {
      lm_head = projection(config.hidden_size, config.vocab_size, /*bias=*/false, options);
      head_unit = register_module("lm_head", Unit<lora::LoraLinearImpl>(lm_head.ptr()));
    }
  } catch (const c10::OutOfMemoryError&) {
    throw;  // memory, not sizes: a caller may catch it as such
  } catch (const c10::Error& e) {
    // A config whose sizes make a tensor past what a process can address ("Storage size
    // calculation overflowed") is named as the config's, not as a tensor's.
    TORCH_CHECK(false, "CausalLM: cannot build the ", config.model_type,
                " model its config describes (vocab_size ", config.vocab_size, ", hidden_size ",
                config.hidden_size, ", intermediate_size ", config.intermediate_size,
                ", num_hidden_layers ", config.num_hidden_layers, ", num_attention_heads ",
                config.num_attention_heads, ", head_dim ", config.head_dim,
                config.is_moe() ? absl::StrCat(", num_experts ", config.num_experts) : "",
                "): ", e.what_without_backtrace(), "; check the sizes in its config.json");
  }
}

// Note [Packed rows]
// A row may hold several examples side by side (examples/llama's packing of
// conversations): `positions` restarts at 0 at each example's first token, so RoPE rotates
// each token by its place in its own example, and `segments` numbers the examples, so
// attention never crosses from one to another (packed_attention_mask: block-diagonal and
// causal; a sliding layer's window on top). Each example's logits are then those of the
// example run alone, as transformers computes them with position_ids and a padding-free
// batch. The positions must be below the row's length (an example fits in its row).
// CausalLMImpl takes them as state (PackedRowsScope), not as forward's arguments, so that
// its forward keeps the one signature FSDP's root and every caller use.
at::Tensor CausalLMImpl::forward(const at::Tensor& ids) {
  const at::Tensor hidden = model(ids, packed.positions, packed.segments);
  at::Tensor logits =
      head_unit ? head_unit(hidden) : at::linear(hidden, model->embed_tokens->weight);
  if (config.logits_scaling != 1.0) logits = logits / config.logits_scaling;  // granite
  if (config.final_logit_softcapping > 0) {
    logits = at::tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping;
  }
  return logits;
}

at::Tensor CausalLMImpl::aux_loss(const at::Tensor& token_mask) const {
  TORCH_CHECK(config.is_moe(), "aux_loss: a ", config.model_type,
              " decoder has no experts; the load-balancing loss is for the mixture-of-experts "
              "families (qwen3_moe, mixtral, olmoe, qwen2_moe, gpt_oss)");
  TORCH_CHECK(!config.router_sigmoid_groups, "aux_loss: a ", config.model_type,
              " decoder has no load-balancing loss (transformers' DeepseekV3 computes none: "
              "its routing is balanced by e_score_correction_bias)");
  return load_balancing_loss(model->router_logits(), config.num_experts, config.num_experts_per_tok,
                             token_mask);
}

PackedRowsScope::PackedRowsScope(CausalLMImpl& model, at::Tensor positions, at::Tensor segments)
    : model_(model) {
  TORCH_CHECK(positions.defined() && segments.defined(),
              "PackedRowsScope: expected positions and segments");
  TORCH_CHECK(!model_.packed.positions.defined(), "PackedRowsScope: the model is packed already");
  TORCH_CHECK(model_.model->cache == nullptr, "PackedRowsScope: the model has a KV cache");
  model_.packed = {std::move(positions), std::move(segments)};
}

PackedRowsScope::~PackedRowsScope() { model_.packed = {}; }

KVCacheScope::KVCacheScope(CausalLMImpl& model, KVCache& cache) : model_(model) {
  DecoderModelImpl& decoder = *model_.model;
  TORCH_CHECK(decoder.cache == nullptr, "KVCacheScope: the model has a KV cache already");
  TORCH_CHECK(!model_.packed.positions.defined(), "KVCacheScope: the model's rows are packed");
  cache.layers.resize(decoder.decoder_layers.size());
  decoder.cache = &cache;
  for (size_t i = 0; i < decoder.decoder_layers.size(); ++i) {
    decoder.decoder_layers[i]->self_attn->cache = &cache.layers[i];
  }
}

KVCacheScope::~KVCacheScope() {
  DecoderModelImpl& decoder = *model_.model;
  decoder.cache = nullptr;
  for (DecoderLayer& layer : decoder.decoder_layers) layer->self_attn->cache = nullptr;
}

void reset_decoder_parameters(torch::nn::Module& module) {
  if (auto* norm = module.as<RMSNormImpl>()) return norm->reset_parameters();
  if (auto* linear = module.as<lora::LoraLinearImpl>()) return linear->reset_parameters();
  if (auto* experts = module.as<ExpertsImpl>()) return experts->reset_parameters();
  if (auto* router = module.as<SigmoidGroupRouterImpl>()) return router->reset_parameters();
  if (auto* attention = module.as<AttentionImpl>()) return attention->reset_parameters();
  if (auto* embedding = module.as<torch::nn::EmbeddingImpl>()) embedding->reset_parameters();
}

at::ScalarType lora_base_dtype(at::ScalarType master, at::ScalarType folder, bool bf16_compute) {
  const bool sixteen_bit = folder == at::kBFloat16 || folder == at::kHalf;
  return bf16_compute && sixteen_bit ? folder : master;
}

int64_t store_projections_nf4(CausalLMImpl& net) {
  int64_t stored = 0;
  for (DecoderLayer& layer : net.model->decoder_layers) {
    for (const auto& item : layer->named_modules("", /*include_self=*/false)) {
      auto* layer = dynamic_cast<lora::LoraLinearImpl*>(item.value().get());
      if (layer == nullptr || !absl::EndsWith(item.key(), "_proj")) continue;
      layer->store_weight_nf4();
      ++stored;
    }
  }
  return stored;
}

}  // namespace fsdp::models
