#include "models/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include <c10/util/Exception.h>

#include "fsdp/base/names.h"
#include "models/moe.h"

namespace fsdp::models {
namespace {

// Note [The decoder's activations]
// What LibTorch 2.11's autograd saves in the decoder's forward (decoder.cc), per token of
// the micro-batch, with c the compute dtype's size and fp32 = 4 (measured with the
// tracking allocator; models:memory_plan_test holds it to the byte for every family,
// packed or not, but for a 4-byte scalar Gemma 2's eager attention allocates in backward):
// - An RMSNorm over `width` saves its input in fp32 (the input itself when c = 4, else a
//   fp32 copy), one fp32 rsqrt per row, and the normalised values its weight multiplies
//   (Llama style: in the compute dtype; Gemma and OLMo: in fp32). Its output is saved by
//   whatever consumes it: a projection whose weight or adapter trains (a linear saves its
//   input only when its weight needs a gradient), nothing when it is added to the
//   residual stream (post norms).
// - Rotary embeddings save only cos and sin (per sequence, shared by every layer), so a
//   projection's output is freed after rotation unless a per-head norm saved it.
// - scaled_dot_product_attention (the CPU's flash kernel) saves q, k, v, its output and a
//   fp32 log-sum-exp per head; its output is laid out so that o_proj's input is a view of
//   it. Eager attention (soft-capped scores, Gemma 2) saves q and the keys and values
//   repeated to every head, tanh's output and the fp32 softmax per score ([heads, context]
//   per token), the probabilities again in the compute dtype when it is not fp32, and the
//   reshaped output when o_proj trains. With sinks (gpt-oss) instead of a soft-cap: no
//   tanh; the max over each query's scores and its sink saves its int64 index per head,
//   and the softmax, in the compute dtype, its output of context + 1 per head.
// - The gated MLP saves gate, up, the activation's output and the product (down_proj's
//   input, when down_proj trains).
// - A LoRA adapter saves lora_A's output ([r] per token) for lora_B.
// - The loss saves the fp32 log-softmax over the vocabulary; backward starts by holding
//   two more fp32 tensors of that size (the log-softmax's and the logits' gradients): for
//   any real vocabulary this is the peak of backward.
// - A checkpointed layer (fsdp::checkpoint) saves its input and the CPU generator's state
//   (kCpuRngStateBytes) and recomputes the rest in backward, one layer at a time: planned
//   as its saved bytes. A recomputed sparse layer's backward holds more (the gradients of
//   its k T pairs, about as much again), which only a small vocabulary lets exceed the
//   loss's gradients (2 x 4 x vocab bytes a token; memory_plan_test's checkpointed MoE case
//   uses 4000 tokens).
// - Packed rows (PackedRowsScope) give cos and sin per row, and every layer's attention a
//   mask per row: scaled_dot_product_attention saves it in the compute dtype, eager
//   attention as booleans; a checkpointed layer saves the rows' boolean mask, one input
//   shared by all.
// - Gemma's norms multiply by (1 + weight): each saves that fp32 [width] tensor once.
// - A sparse layer's MoE block (moe.cc; tokens T, top-k k, E experts of width I) keeps its
//   router logits [T, E] in the compute dtype (held by the block until the next forward),
//   the router's input when the router trains, softmax's fp32 probabilities [T, E], the
//   top-k's int64 indices [T, k] (with norm_topk_prob also the fp32 weights and their sums
//   that renormalise them), the k T (token, expert) pairs' order and tokens (int64), the
//   gathered tokens [k T, H] when the experts train, per pair gate and up [2 I], the
//   activation's output and the product (down's input, when the experts train), the
//   experts' outputs [k T, H] before and after the router's weights (those index_add_
//   adds into the tokens) and the pairs' weights (fp32 with router_weights_fp32 or fp32
//   compute). gpt-oss's router keeps no softmax over the experts but the
//   softmax [T, k] in the compute dtype, and its clamped SwiGLU saves per pair gate and up
//   [2 I], the clamped gate, its sigmoid, their product and up + 1 (6 I in all).
//   Qwen2-MoE's shared expert adds a gated MLP of its own width, its
//   gate's sigmoid and its output. A checkpointed sparse layer keeps its router logits
//   beside its input (Note [Router logits out of a checkpointed layer] in decoder.cc).
//   DeepSeek-V3's router keeps no logits but its fp32 sigmoid scores [T, E], and when the
//   compute dtype is not fp32 the fp32 copies of its input (when it trains) and of its
//   weight ([E, H] per sparse layer); its shared experts are a gated MLP without a gate.
//   In bf16 and fp16 each expert's rows are padded with zero rows to a multiple of 8 (Note
//   [Expert rows in multiples of 8] in moe.cc): each zero row saves a pair's gate, up and
//   activation tensors (and, when the experts train, its gathered token and down's input).
//   How many there are depends on the routing, so the plan counts the most: 7 per expert
//   that can have tokens (min(E, k T)), unless told how many there were.
// - DeepSeek-V3's latent attention (Note [Multi-head latent attention] in attention.cc):
//   the norms of the q and kv latents (kv_a_layernorm's input, a view, keeps all of
//   kv_a_proj_with_mqa's output in fp32), q_b_proj's and kv_b_proj's inputs when they
//   train, and scaled_dot_product_attention's q, k, v padded to qk_head_dim, its padded
//   output and log-sum-exp; o_proj's input is then a copy of the output's first
//   v_head_dim.
// - With DecoderUnits::kSublayer each sublayer is checkpointed inside its unit and the
//   norms run outside: a checkpointed layer saves each sublayer's input (its normed input,
//   2 c H per token in all) and a CPU generator state each, and its norms' tensors as an
//   unchecked layer's norms save them (Gemma's (1 + weight) included): with Llama-style
//   norms, fp32, about 2 x (4 H + 4 + 4 H) more per token than the layer's input alone.
//   Recomputation holds one sublayer at a time. Without checkpointing the split saves what
//   the layer saves: the same operations run.
// In LoRA the first layer's input needs no gradient, so its first norm saves nothing.
constexpr int64_t kFp32 = 4;
constexpr int64_t kCpuRngStateBytes = 5056;  // at::CPUGeneratorImpl's get_state()

bool contains(const std::vector<std::string>& names, const char* name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

struct LayerBytes {
  const DecoderConfig& config;
  const TrainedWeights& trained;
  int64_t c;  // compute dtype's size
  int64_t context;
  int64_t batch;
  bool packed;

  bool full() const { return trained.lora_rank == 0; }
  // Whether projection `name` has something that trains (its weight, or an adapter).
  bool trains(const char* name) const { return full() || contains(trained.lora_targets, name); }
  int64_t adapter(const char* name) const {
    return !full() && contains(trained.lora_targets, name) ? c * trained.lora_rank : 0;
  }
  // An RMSNorm over `width` per row, `rows` rows per token; without its output. What its
  // weight multiplies is saved only when the weight trains.
  int64_t norm(int64_t width, int64_t rows = 1) const {
    const int64_t weighted = !full() ? 0 : config.norm_style == NormStyle::kLlama ? c : kFp32;
    return kFp32 * width + kFp32 * rows + weighted * width;
  }
  // Gemma's norms multiply by (1 + weight), an fp32 [width] tensor that each norm saves
  // once, whatever the tokens: a layer's (LoRA's first layer's input norm saves nothing).
  // `qk_norms`: with the attention's q and k norms.
  int64_t gemma_norm_weights(bool first, bool qk_norms = true) const {
    if (config.norm_style != NormStyle::kGemma) return 0;
    const int64_t h = config.hidden_size;
    const int64_t q = config.num_attention_heads * config.head_dim;
    const int64_t kv = config.num_key_value_heads * config.head_dim;
    int64_t width = 0;
    if (!config.post_norms && (full() || !first)) width += h;  // before attention
    if (config.qk_norm && qk_norms) width += 2 * config.head_dim;
    if (config.qk_norm_full_width && qk_norms) width += q + kv;
    if (config.sandwich_norms || config.post_norms) width += 2 * h;  // after each sublayer
    if (!config.post_norms) width += h;                              // before the MLP
    return kFp32 * width;
  }

  // The mask a layer builds for its attention: eager attention's boolean mask; for
  // scaled_dot_product_attention, a sliding layer's mask in the compute dtype. One
  // [context, context] for every sequence, or with packed rows one per row, in every layer.
  int64_t mask(LayerType type) const {
    const int64_t each = context * context * (packed ? batch : 1);
    if (config.attn_logit_softcapping > 0 || config.attention_sinks) return each;
    return packed || type == LayerType::kSliding ? c * each : 0;
  }

  // The other families' attention after the input norm, bytes per token, o_proj's adapter
  // left out: the q/k/v adapters and norms, and what the attention kernel saves.
  int64_t projected_attention() const {
    const int64_t heads = config.num_attention_heads;
    const int64_t q = heads * config.head_dim, kv = config.num_key_value_heads * config.head_dim;
    const bool fused = config.fused_projections;
    int64_t bytes =
        fused ? adapter("qkv_proj") : adapter("q_proj") + adapter("k_proj") + adapter("v_proj");
    if (config.qk_norm) bytes += norm(q, heads) + norm(kv, config.num_key_value_heads);
    if (config.qk_norm_full_width) bytes += norm(q) + norm(kv);
    if (config.attention_sinks) {  // eager: q, keys and values per head, softmax, max's index
      const bool gqa = kv != q;
      bytes += c * (q + 2 * (gqa ? q : kv)) + c * heads * (context + 1) + 8 * heads;
      if (trains("o_proj")) bytes += c * q;
    } else if (config.attn_logit_softcapping > 0) {
      const bool gqa = kv != q;
      const int64_t scores = heads * context;
      bytes += c * (q + 2 * (gqa ? q : kv)) + (c + kFp32) * scores + (c != kFp32 ? c * scores : 0);
      if (trains("o_proj")) bytes += c * q;
    } else if (fused) {  // v, a view of qkv_proj's output, keeps all of it
      bytes += c * (q + kv) + c * (q + 2 * kv) + c * q + kFp32 * heads;
    } else {
      bytes += c * (2 * q + 2 * kv) + kFp32 * heads;
    }
    return bytes;
  }

  // Latent attention after the input norm, bytes per token, o_proj's adapter left out;
  // `input_grad`: whether the layer's input needs a gradient (see the Note).
  int64_t latent_attention(bool input_grad) const {
    const int64_t n = config.num_attention_heads, qk = config.qk_head_dim();
    const int64_t lq = config.q_lora_rank, lk = config.kv_lora_rank, v = config.v_head_dim;
    int64_t bytes = adapter("kv_a_proj_with_mqa") + adapter("kv_b_proj");
    if (lq > 0) {
      bytes += adapter("q_a_proj") + adapter("q_b_proj");
      if (input_grad || trains("q_a_proj")) bytes += norm(lq);
      if (trains("q_b_proj")) bytes += c * lq;
    } else {
      bytes += adapter("q_proj");
    }
    if (input_grad || trains("kv_a_proj_with_mqa")) {
      bytes += norm(lk) + (c == kFp32 ? kFp32 * config.head_dim : 0);
    }
    if (trains("kv_b_proj")) bytes += c * lk;
    // q, k; v padded (or, as wide as q, a view keeping kv_b_proj's output); the output.
    bytes += 2 * c * n * qk + (v != qk ? c * n * qk : c * n * (config.qk_nope_head_dim + v));
    bytes += c * n * qk + kFp32 * n;
    if (v != qk && trains("o_proj")) bytes += c * n * v;
    return bytes;
  }

  // A sparse layer's MoE block after its norm, bytes per token (see the Note).
  int64_t sparse_mlp() const {
    const int64_t h = config.hidden_size, e = config.num_experts;
    const int64_t k = config.num_experts_per_tok, inner = config.moe_intermediate_size;
    const int64_t weights = config.router_weights_fp32 || c == kFp32 ? kFp32 : c;
    // Router logits, probabilities (gpt_oss: of the top-k only; deepseek_v3: its sigmoid
    // scores, and its input's fp32 copy), top-k indices.
    int64_t bytes = config.router_sigmoid_groups
                        ? kFp32 * e + (full() && c != kFp32 ? kFp32 * h : 0)
                        : c * e + (config.router_bias_topk_softmax ? c * k : kFp32 * e);
    bytes += 8 * k;
    if (config.norm_topk_prob) bytes += kFp32 * (k + 1);
    bytes += 2 * 8 * k;                        // the pairs' order and tokens
    if (full()) bytes += k * c * (h + inner);  // the gathered tokens, down's input
    bytes += k * c * (expert_activation() + 2 * h) + k * weights;
    const int64_t shared = config.shared_expert_intermediate_size;
    if (shared > 0) {
      bytes += adapter("gate_proj") + adapter("up_proj") + adapter("down_proj");
      bytes += 3 * c * shared + (trains("down_proj") ? c * shared : 0);
      if (!config.shared_experts_ungated) bytes += c + c * h;  // the gate's sigmoid, the product
    }
    return bytes;
  }

  // Per (token, expert) pair, the elements the experts' activation saves: gate and up, and
  // silu's output or the clamped SwiGLU's four tensors (see the Note).
  int64_t expert_activation() const {
    const int64_t inner = config.moe_intermediate_size;
    return config.swiglu_limit > 0 ? 6 * inner : 3 * inner;
  }

  // What one zero row of a sparse layer's experts saves (Note [Expert rows in multiples
  // of 8] in moe.cc; bf16 and fp16 only): a pair's tensors up to the experts' outputs,
  // which are narrowed back to the real rows.
  int64_t expert_padded_row() const {
    if (c != 2) return 0;
    const int64_t down_input = full() ? config.hidden_size + config.moe_intermediate_size : 0;
    return c * (expert_activation() + down_input);
  }

  // The most zero rows a sparse layer's experts add: kExpertRowMultiple - 1 for each
  // expert that has tokens.
  int64_t most_padded_rows() const {
    if (expert_padded_row() == 0) return 0;
    return std::min(config.num_experts, config.num_experts_per_tok * batch * context) *
           (kExpertRowMultiple - 1);
  }

  // ... of its attention: from the layer's input to o_proj.
  int64_t attention(bool first) const {
    const int64_t h = config.hidden_size;
    const bool fused = config.fused_projections;
    const bool attention_trains =
        config.latent_attention()
            ? trains("q_a_proj") || trains("q_proj") || trains("kv_a_proj_with_mqa")
        : fused ? trains("qkv_proj")
                : trains("q_proj") || trains("k_proj") || trains("v_proj");
    int64_t bytes = 0;
    // Input norm (or, for post norms, the layer input the projections read).
    if (config.post_norms) {
      if (attention_trains) bytes += c * h;
    } else {
      if (full() || !first) bytes += norm(h);
      if (attention_trains) bytes += c * h;
    }
    bytes += config.latent_attention() ? latent_attention(full() || !first) : projected_attention();
    bytes += adapter("o_proj");
    return bytes;
  }

  // ... of its feed-forward block, from after attention to the layer's output (the norms
  // between included).
  int64_t feed_forward(bool sparse) const {
    const int64_t h = config.hidden_size, inner = config.intermediate_size;
    const bool fused = config.fused_projections;
    const bool gate_up_trains =
        fused ? trains("gate_up_proj") : trains("gate_proj") || trains("up_proj");
    int64_t bytes = 0;
    // After attention: a post norm on its output, then the norm before the MLP.
    if (config.sandwich_norms || config.post_norms) bytes += norm(h);
    // The MLP's input, saved by what trains (a sparse layer's router or shared expert).
    const bool input_saved =
        sparse ? full() || (config.shared_expert_intermediate_size > 0 && gate_up_trains)
               : gate_up_trains;
    if (!config.post_norms) bytes += norm(h);
    if (input_saved) bytes += c * h;
    if (sparse) {
      bytes += sparse_mlp();
    } else {
      bytes += fused ? adapter("gate_up_proj") : adapter("gate_proj") + adapter("up_proj");
      bytes += 3 * c * inner + (trains("down_proj") ? c * inner : 0) + adapter("down_proj");
    }
    if (config.sandwich_norms || config.post_norms) bytes += norm(h);
    return bytes;
  }

  // DecoderUnits::kSublayer, checkpointed: per token, what the attention's part of a
  // layer saves (the norm before it, its input) and the feed-forward block's (the norms
  // after attention, before and after the block, its input). See the Note.
  int64_t checkpointed_attention(bool first) const {
    const int64_t h = config.hidden_size;
    return c * h + (!config.post_norms && (full() || !first) ? norm(h) : 0);
  }
  int64_t checkpointed_feed_forward() const {
    const int64_t h = config.hidden_size;
    const int64_t norms =
        (config.sandwich_norms || config.post_norms ? 2 : 0) + (config.post_norms ? 0 : 1);
    return c * h + norms * norm(h);
  }
};

int64_t element_size(at::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

}  // namespace

ActivationBytes decoder_activation_bytes(const DecoderConfig& config, int64_t batch,
                                         int64_t context, at::ScalarType compute_dtype,
                                         bool checkpoint_layers, const TrainedWeights& trained,
                                         bool packed_rows, bool router_aux_loss, DecoderUnits units,
                                         const std::vector<int64_t>& expert_padded_rows) {
  TORCH_CHECK(batch >= 1 && context >= 1,
              "decoder_activation_bytes: expected a batch and a "
              "context of at least 1, got ",
              batch, " and ", context);
  const int64_t c = element_size(compute_dtype);
  const int64_t tokens = batch * context;
  const LayerBytes layer{config, trained, c, context, batch, packed_rows};
  const int64_t layers = config.num_hidden_layers;
  ActivationBytes result;
  const auto sparse = [&](int64_t i) {
    return config.is_moe() && config.sparse_layers.at(static_cast<size_t>(i));
  };
  TORCH_CHECK(expert_padded_rows.empty() ||
                  static_cast<int64_t>(expert_padded_rows.size()) == config.num_hidden_layers,
              "decoder_activation_bytes: expected the padded expert rows of each of the ",
              config.num_hidden_layers, " layers, got ", expert_padded_rows.size());
  const bool split = units == DecoderUnits::kSublayer;
  // A sparse layer's feed-forward block, with its experts' zero rows (as given, or the most).
  const auto feed_forward = [&](int64_t i) {
    if (!sparse(i)) return tokens * layer.feed_forward(false);
    const int64_t padded = expert_padded_rows.empty() ? layer.most_padded_rows()
                                                      : expert_padded_rows[static_cast<size_t>(i)];
    return tokens * layer.feed_forward(true) + padded * layer.expert_padded_row();
  };
  // What layer i's recomputation holds: the layer's, or with kSublayer a sublayer's.
  const auto recomputed = [&](int64_t i, bool first) {
    const int64_t attention = tokens * layer.attention(first);
    return split ? std::max(attention, feed_forward(i)) : attention + feed_forward(i);
  };
  int64_t largest = layers == 1 ? recomputed(0, /*first=*/true) : 0;
  for (int64_t i = 0; i < layers; ++i) largest = std::max(largest, recomputed(i, false));
  result.per_layer = largest + (packed_rows ? layer.mask(LayerType::kFull) : 0);
  for (int64_t i = 0; i < layers; ++i) {
    // A sparse layer's router logits held by its block, and the load-balancing loss's
    // softmax of them (deepseek_v3's router keeps none, but in a compute dtype other than
    // fp32 an fp32 copy of its weight).
    const bool sigmoid = config.router_sigmoid_groups;
    const int64_t router =
        sparse(i) && !sigmoid ? tokens * c * config.num_experts * (router_aux_loss ? 2 : 1) : 0;
    const int64_t router_weight =
        sparse(i) && sigmoid && c != kFp32 ? kFp32 * config.num_experts * config.hidden_size : 0;
    const int64_t aux_softmax = router_aux_loss && sparse(i) ? tokens * c * config.num_experts : 0;
    if (checkpoint_layers && split) {
      const int64_t feed_forward =
          tokens * layer.checkpointed_feed_forward() + kCpuRngStateBytes + router;
      result.feed_forward.push_back(feed_forward);
      result.layers.push_back(feed_forward + tokens * layer.checkpointed_attention(i == 0) +
                              kCpuRngStateBytes +
                              layer.gemma_norm_weights(i == 0, /*qk_norms=*/false));
    } else if (checkpoint_layers) {
      result.layers.push_back(tokens * c * config.hidden_size + kCpuRngStateBytes + router);
    } else {
      if (split) result.feed_forward.push_back(feed_forward(i) + aux_softmax + router_weight);
      result.layers.push_back(tokens * layer.attention(i == 0) + feed_forward(i) + aux_softmax +
                              layer.mask(config.layer_types[i]) + layer.gemma_norm_weights(i == 0) +
                              router_weight);
    }
  }
  int64_t saved = std::accumulate(result.layers.begin(), result.layers.end(), int64_t{0});
  // The load-balancing loss's scalars, which its backward frees before the loss's
  // gradients peak.
  const int64_t aux_scalars = router_aux_loss && config.is_moe() ? 36 : 0;
  saved += aux_scalars;
  // Packed rows, checkpointed: the rows' boolean mask, an input of every layer.
  if (packed_rows && checkpoint_layers) saved += batch * context * context;
  // The final norm (its output saved when the head trains), cos and sin per rotary
  // embedding (per row with packed rows), the logits' soft cap and the loss's fp32
  // log-softmax.
  const int64_t h = config.hidden_size, vocab = config.vocab_size;
  const bool head_trains = trained.lora_rank == 0;
  saved += tokens * layer.norm(h) + (config.norm_style == NormStyle::kGemma ? kFp32 * h : 0);
  result.head = tokens * (head_trains ? c * h : 0);
  const int64_t ropes = config.rope_per_layer_type && config.has_sliding_layers() ? 2 : 1;
  saved += ropes * 2 * (packed_rows ? batch : 1) * context * config.rotary_dim * c;
  if (config.final_logit_softcapping > 0) result.head += tokens * c * vocab;
  if (config.scale_embeddings) saved += c;            // the embedding scale, a scalar tensor
  result.head += tokens * kFp32 * vocab + 2 * kFp32;  // log-softmax; the loss and its weight
  saved += result.head;
  result.saved_bytes = saved;
  // The loss's gradients start backward; a checkpointed layer's recomputation comes later.
  const int64_t loss_gradients = 2 * tokens * kFp32 * vocab;
  result.peak_bytes = saved - aux_scalars +
                      std::max(loss_gradients, checkpoint_layers ? result.per_layer : int64_t{0});
  // A checkpointed layer's recomputation comes after the head's backward: held to the end.
  if (!checkpoint_layers) result.head += loss_gradients;
  return result;
}

namespace {

// Adds `p` to `unit`: to its trainable or frozen elements if it has the plan's dtype
// `dtype`, else to its frozen elements of p's dtype (Note [Flat parameters of several
// dtypes] in fsdp/core/flat_param.cc); `sign` -1 takes it away.
void count_param(const at::Tensor& p, at::ScalarType dtype, PlanUnit& unit, int64_t sign = 1) {
  if (p.scalar_type() == dtype) {
    (p.requires_grad() ? unit.trainable_numel : unit.frozen_numel) += sign * p.numel();
    return;
  }
  for (PlanFrozen& other : unit.frozen_other_dtypes) {
    if (other.dtype == p.scalar_type()) {
      other.numel += sign * p.numel();
      return;
    }
  }
  unit.frozen_other_dtypes.push_back({p.scalar_type(), sign * p.numel(), c10::nullopt});
}

}  // namespace

std::vector<PlanUnit> plan_units(CausalLMImpl& net) { return plan_units(net, net.model->units); }

std::vector<PlanUnit> plan_units(CausalLMImpl& net, DecoderUnits decoder_units) {
  const std::vector<at::Tensor> params = net.parameters();
  // The plan's dtype: the trainable parameters' (else the first parameter's).
  at::ScalarType dtype = params.empty() ? at::kFloat : params.front().scalar_type();
  for (const at::Tensor& p : params) {
    if (p.requires_grad()) {
      dtype = p.scalar_type();
      break;
    }
  }
  std::vector<PlanUnit> units(1);
  units[0].is_root = true;
  for (const at::Tensor& p : params) count_param(p, dtype, units[0]);  // less the units' below
  const auto add_unit = [&](std::string fqn, const torch::nn::Module& module) {
    PlanUnit planned;
    planned.fqn = std::move(fqn);
    for (const at::Tensor& p : module.parameters()) {
      count_param(p, dtype, planned);
      count_param(p, dtype, units[0], -1);
    }
    units.push_back(planned);
  };
  // The units in forward order (pre-order: the embeddings, the layers, the head), each
  // layer's as `decoder_units` makes them, whatever `net` was built with.
  for (const auto& item : net.named_modules()) {
    const torch::nn::Module& module = *item.value();
    if (const auto* layer = dynamic_cast<const DecoderLayerImpl*>(&module)) {
      // The layer's own key ends in its unit's wrapper name with kLayer: cleaned as a prefix.
      std::string fqn = clean_tensor_name(absl::StrCat(item.key(), "."));
      fqn.pop_back();
      if (decoder_units == DecoderUnits::kLayer) {
        add_unit(fqn, *layer);
      } else {
        add_unit(fqn + ".self_attn", *layer->self_attn);
        add_unit(fqn + ".mlp",
                 layer->moe ? static_cast<const torch::nn::Module&>(*layer->moe) : *layer->mlp);
      }
      continue;
    }
    const auto* unit = dynamic_cast<const UnitBase*>(&module);
    if (unit == nullptr) continue;
    const torch::nn::Module& wrapped = *unit->wrapped_module();
    const bool layer_or_sublayer = dynamic_cast<const DecoderLayerImpl*>(&wrapped) ||
                                   dynamic_cast<const AttentionImpl*>(&wrapped) ||
                                   dynamic_cast<const MLPImpl*>(&wrapped) ||
                                   dynamic_cast<const SparseMoeBlockImpl*>(&wrapped);
    if (!layer_or_sublayer) add_unit(item.key(), wrapped);  // the layers': above
  }
  return units;
}

FinetunePlan plan_finetune(const DecoderConfig& config, const std::vector<PlanUnit>& units,
                           const FinetunePlanOptions& options) {
  TORCH_CHECK(options.micro_batch() >= 1,
              "plan_finetune: expected a micro-batch of at least 1 "
              "window, got ",
              options.micro_batch());
  FinetunePlan plan;
  plan.options = options;
  const at::ScalarType compute = options.param_dtype().value_or(options.dtype());
  plan.activations = decoder_activation_bytes(
      config, options.micro_batch(), options.context(), compute, options.activation_checkpointing(),
      options.trained(), options.packed_rows(), options.router_aux_loss(), options.decoder_units());
  MemoryPlanOptions step;
  step.world_size(options.world_size())
      .sharding_strategy(options.sharding_strategy())
      .hybrid_shard_group_size(options.hybrid_shard_group_size())
      .dtype(options.dtype())
      .param_dtype(options.param_dtype())
      .reduce_dtype(options.param_dtype() ? c10::optional<at::ScalarType>(options.dtype())
                                          : c10::nullopt)
      .optimizer(OptimizerSpec::fused_adamw())  // the trainer's fsdp::FusedAdamW
      .cpu_offload(options.cpu_offload())
      .host_is_tracked(options.device() == c10::DeviceType::CPU)
      .backend(options.backend())
      .activation_bytes(plan.activations.peak_bytes);
  // Each layer's and the head's activations are freed by their unit's backward.
  std::vector<PlanUnit> with_activations = units;
  for (PlanUnit& unit : with_activations) {
    absl::string_view name = unit.fqn;
    if (name == "lm_head") {
      unit.activation_bytes = plan.activations.head;
      continue;
    }
    // "model.layers.N", or its sublayers "model.layers.N.self_attn" and "model.layers.N.mlp".
    if (!absl::ConsumePrefix(&name, "model.layers.")) continue;
    const size_t dot = name.find('.');
    const absl::string_view sublayer = dot == name.npos ? "" : name.substr(dot + 1);
    int64_t layer = 0;
    if (!absl::SimpleAtoi(name.substr(0, dot), &layer) || layer < 0 ||
        layer >= static_cast<int64_t>(plan.activations.layers.size())) {
      continue;
    }
    const int64_t feed_forward = plan.activations.feed_forward.empty()
                                     ? 0
                                     : plan.activations.feed_forward[static_cast<size_t>(layer)];
    const int64_t whole = plan.activations.layers[static_cast<size_t>(layer)];
    if (sublayer.empty()) unit.activation_bytes = whole;
    if (sublayer == "self_attn") unit.activation_bytes = whole - feed_forward;
    if (sublayer == "mlp") unit.activation_bytes = feed_forward;
  }
  plan.step = plan_memory(with_activations, step);
  const auto at_peak = [&](PlanTerm term) {
    return plan.step.at_peak_bytes[static_cast<int>(term)];
  };
  plan.parameters = at_peak(PlanTerm::kShardedParameters);
  plan.gradients = at_peak(PlanTerm::kShardedGradients);
  plan.optimizer_state = at_peak(PlanTerm::kOptimizerState);
  plan.activations_held = at_peak(PlanTerm::kActivations);
  plan.gathered_units = plan.step.peak_bytes - plan.parameters - plan.gradients -
                        plan.optimizer_state - plan.activations_held;
  if (config.is_moe()) {
    plan.experts_per_layer = config.num_experts * 3 * config.moe_intermediate_size *
                             config.hidden_size * element_size(compute);
  }
  // Saving gathers one unit at a time, each flat parameter in its dtype, and casts its
  // floating values to the folder's.
  const auto gathered_and_cast = [&](at::ScalarType dtype, int64_t numel) {
    const bool cast = c10::isFloatingType(dtype) && dtype != options.save_dtype();
    return numel * (element_size(dtype) + (cast ? element_size(options.save_dtype()) : 0));
  };
  for (const PlanUnit& unit : units) {
    int64_t bytes = gathered_and_cast(options.dtype(), unit.trainable_numel + unit.frozen_numel);
    for (const PlanFrozen& other : unit.frozen_other_dtypes) {
      bytes += gathered_and_cast(other.dtype, other.numel);
    }
    plan.saving = std::max(plan.saving, bytes);
  }
  // What stays on the tracked device between steps (nothing with offload to an untracked
  // host).
  const int64_t steady = plan.step.host_bytes > 0
                             ? 0
                             : plan.step.term_bytes(PlanTerm::kShardedParameters) +
                                   plan.step.term_bytes(PlanTerm::kShardedGradients) +
                                   plan.step.term_bytes(PlanTerm::kOptimizerState);
  plan.host_bytes = plan.step.host_bytes;
  plan.runtime = options.runtime_bytes();
  const int64_t tensors = std::max(plan.step.peak_bytes, steady + plan.saving);
  plan.peak_bytes =
      plan.runtime + static_cast<int64_t>(std::ceil(tensors * (1 + kAllocatorOverhead)));
  return plan;
}

int64_t micro_batch_of(int64_t global_batch, int64_t world_size, int64_t grad_accumulation_steps) {
  return std::max<int64_t>(1, global_batch / world_size / grad_accumulation_steps);
}

int64_t smallest_world_size(const DecoderConfig& config, const std::vector<PlanUnit>& units,
                            const FinetunePlanOptions& options, int64_t global_batch,
                            int64_t grad_accumulation_steps, int64_t budget, int64_t first,
                            int64_t last, FinetunePlan* plan) {
  const int64_t group = options.hybrid_shard_group_size();
  for (int64_t world = std::max<int64_t>(first, 1); world <= last; ++world) {
    if (global_batch % (world * grad_accumulation_steps) != 0) continue;
    if (group > 0 && world % group != 0) continue;
    FinetunePlanOptions wider = options;
    wider.world_size(world).micro_batch(
        micro_batch_of(global_batch, world, grad_accumulation_steps));
    FinetunePlan fitting = plan_finetune(config, units, wider);
    if (fitting.peak_bytes <= budget) {
      if (plan != nullptr) *plan = std::move(fitting);
      return world;
    }
  }
  return 0;
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.0f MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return absl::StrFormat("%.0f KiB", b / (1 << 10));
  return absl::StrCat(bytes, " B");
}

std::string experts_gathered_line(const DecoderConfig& config, const FinetunePlan& plan,
                                  const FinetunePlan& other) {
  if (!config.is_moe()) return "";
  const bool split = plan.options.decoder_units() == DecoderUnits::kSublayer;
  const std::string mine = format_bytes(plan.peak_bytes), theirs = format_bytes(other.peak_bytes);
  // Peaks the same as printed (the experts a small part of either) are said to be.
  return absl::StrCat(
      "mixture of experts: each sparse layer's ", split ? "feed-forward " : "", "unit gathers all ",
      config.num_experts, " experts, ", format_bytes(plan.experts_per_layer), " in ",
      c10::toString(plan.options.param_dtype().value_or(plan.options.dtype())),
      ", though each token uses ", config.num_experts_per_tok, " of them; ",
      split ? absl::StrCat("peak ", mine,
                           mine == theirs ? ", as" : absl::StrCat(" instead of ", theirs),
                           " with --moe_units=layer")
            : absl::StrCat("--moe_units=sublayer (attention and experts units of their own) ",
                           "would peak at ", theirs,
                           mine == theirs ? " as well" : absl::StrCat(" instead of ", mine)));
}

std::string FinetunePlan::summary() const {
  return absl::StrCat(
      "parameters ", format_bytes(parameters), " + gradients ", format_bytes(gradients),
      " + optimizer state ", format_bytes(optimizer_state), " + gathered units ",
      format_bytes(gathered_units), " + activations ", format_bytes(activations_held),
      " (saving: ", format_bytes(saving), " above the shards) + allocator ",
      absl::StrFormat("%.0f%%", kAllocatorOverhead * 100), " + runtime ", format_bytes(runtime),
      " = peak ", format_bytes(peak_bytes), absl::StrFormat(" (%d MiB)", peak_bytes >> 20),
      " per rank", options.device() == c10::DeviceType::CPU ? "" : " on the GPU",
      host_bytes > 0 ? absl::StrCat(", ", format_bytes(host_bytes), " offloaded to the host") : "");
}

}  // namespace fsdp::models
