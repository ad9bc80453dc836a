// The decoder-only transformer of Hugging Face transformers' LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM,
// Gemma3ForCausalLM, GraniteForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM and the
// mixture-of-experts Qwen3MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM,
// Qwen2MoeForCausalLM, GptOssForCausalLM and DeepseekV3ForCausalLM in LibTorch:
// one module tree whose per-family options come from a DecoderConfig (config.h), with the
// families' own module and parameter names, so a checkpoint's tensors load under their own
// names with no renaming:
//
//   model.embed_tokens.weight                        [vocab_size, hidden_size]
//   model.layers.N.self_attn.q_proj.weight           [heads * head_dim, hidden_size]
//   model.layers.N.self_attn.{k,v}_proj.weight       [kv_heads * head_dim, hidden_size]
//   model.layers.N.self_attn.o_proj.weight           [hidden_size, heads * head_dim]
//   model.layers.N.self_attn.{q,k,v}_proj.bias       qkv_bias (qwen2; attention_bias)
//   model.layers.N.self_attn.o_proj.bias             o_bias (attention_bias)
//   model.layers.N.self_attn.{q,k}_norm.weight       [head_dim] (qwen3, gemma3_text);
//                                                    olmo2: q [heads * head_dim],
//                                                    k [kv_heads * head_dim]
//   model.layers.N.mlp.{gate,up}_proj.weight         [intermediate_size, hidden_size]
//   model.layers.N.mlp.down_proj.weight              [hidden_size, intermediate_size]
//   model.layers.N.mlp.{gate,up,down}_proj.bias      mlp_bias (llama, granite)
//   model.layers.N.input_layernorm.weight            [hidden_size] (none in olmo2)
//   model.layers.N.post_attention_layernorm.weight   [hidden_size]
//   model.layers.N.pre_feedforward_layernorm.weight  [hidden_size] (gemma2, gemma3_text)
//   model.layers.N.post_feedforward_layernorm.weight [hidden_size] (gemma2, gemma3_text,
//                                                    olmo2)
//   model.norm.weight                                [hidden_size]
//   lm_head.weight                                   [vocab_size, hidden_size]; none when
//                                                    tie_word_embeddings
//
// The sparse layers of the MoE families hold a router and fused experts as their mlp
// (moe.h: mlp.gate.weight [E, hidden], mlp.experts.gate_up_proj [E, 2 I, hidden],
// mlp.experts.down_proj [E, hidden, I]; qwen2_moe mlp.shared_expert.* and
// mlp.shared_expert_gate.weight [1, hidden]); the checkpoints hold the experts one by one
// (hf_checkpoint.cc, Note [Experts one by one in the checkpoint]).
//
// deepseek_v3's attention is multi-head latent attention (attention.h, config.h):
//
//   model.layers.N.self_attn.q_a_proj.weight            [q_lora_rank, hidden_size] (+ bias
//                                                       with attention_bias)
//   model.layers.N.self_attn.q_a_layernorm.weight       [q_lora_rank]
//   model.layers.N.self_attn.q_b_proj.weight            [heads * qk_head_dim, q_lora_rank]
//                                                       (q_proj [heads * qk_head_dim, hidden]
//                                                       when q_lora_rank is null)
//   model.layers.N.self_attn.kv_a_proj_with_mqa.weight  [kv_lora_rank + qk_rope_head_dim,
//                                                       hidden_size] (+ bias)
//   model.layers.N.self_attn.kv_a_layernorm.weight      [kv_lora_rank]
//   model.layers.N.self_attn.kv_b_proj.weight           [heads * (qk_nope_head_dim +
//                                                       v_head_dim), kv_lora_rank]
//   model.layers.N.self_attn.o_proj.weight              [hidden_size, heads * v_head_dim]
//
// and its sparse layers' router mlp.gate.weight [E, hidden] with the buffer
// mlp.gate.e_score_correction_bias [E] (fp32), and mlp.shared_experts.*.
//
// phi3 holds q, k, v and gate, up fused instead:
//
//   model.layers.N.self_attn.qkv_proj.weight  [(heads + 2 kv_heads) * head_dim, hidden_size]
//   model.layers.N.mlp.gate_up_proj.weight    [2 intermediate_size, hidden_size]
//
//   auto model = std::make_shared<fsdp::models::CausalLMImpl>(config);
//   at::Tensor logits = model->forward(ids);   // ids [batch, time] int64
//
// Built on the meta device, no process holds the whole model (fsdp/core/fully_sharded.h,
// "Models built on the meta device"): every parameter is created with the constructor's
// tensor options, so on c10::kMeta it has a shape and a dtype but no memory, and FSDP
// allocates each rank's shards only; a checkpoint reader (hf_checkpoint.h) or
// init_parameters with reset_decoder_parameters then fills them:
//
//   auto net = std::make_shared<fsdp::models::CausalLMImpl>(
//       config, at::TensorOptions().device(c10::kMeta).dtype(at::kBFloat16));
//   fsdp::FullyShardedDataParallel<fsdp::models::CausalLMImpl> model(net, options);
//   fsdp::models::load_hf_weights(*model, dir);    // or, for random weights:
//   // torch::manual_seed(seed); model->init_parameters(fsdp::models::reset_decoder_parameters);
//
// Each decoder layer is an fsdp::Unit (one FSDP unit once a FullyShardedDataParallel root
// binds the model; embeddings, final norm and head stay in the root), or, built with
// DecoderUnits::kSublayer, each layer's attention and feed-forward block are two (see
// there). Per layer: pre-norm
// x + attn(norm(x)), x + mlp(norm(x)) (Gemma: the sublayer outputs are normed again before
// the residual add; OLMo 2: only they are; Granite: they are scaled by
// residual_multiplier, the embeddings by embedding_multiplier, the logits divided by
// logits_scaling). RMSNorm in fp32 (Gemma: x (1 + w), in fp32 before the cast). Rotary
// embeddings in HF's rotate_half convention with the layer type's RoPE (default, linear,
// llama3, yarn or longrope), on the first rotary_dim dimensions of each head.
// Grouped-query attention, causal, over the last sliding_window keys in sliding layers;
// scores scaled by attention_scale, soft-capped when attn_logit_softcapping (then computed
// eagerly, softmax in fp32, as transformers' eager attention) and otherwise through
// at::scaled_dot_product_attention. Gated MLP down(act(gate(x)) * up(x)), act SiLU or
// GeLU-tanh. No dropout, no KV cache. The projections and the head are
// fsdp::lora::LoraLinear (plain Linear until fsdp::lora::apply_lora adds an adapter;
// lora_targets.h lists each family's targets, the head is none of them). The decoder
// registers no non-persistent buffers: RoPE's cos and sin and Gemma's embedding scale are
// computed in each forward from the config, so nothing is left uncomputed after a build
// on the meta device. Its one buffer, deepseek_v3's mlp.gate.e_score_correction_bias
// (moe.h), is the checkpoint's (read and written with the parameters, never trained).
//
// The modules are declared in their own headers, included here: rms_norm.h, attention.h
// (with rotary.h's RoPE), mlp.h.
//
// Every module takes `options` (at::TensorOptions: device and dtype; default the CPU and
// the default dtype) and creates its parameters with them; on a real device each module
// initialises itself as it is built (torch::nn::Linear's and Embedding's initialisation,
// norms ones, Gemma's norms zeros), on c10::kMeta it has shapes only.
// Threading: as any LibTorch module (one forward at a time per instance).
#ifndef FSDP_MODELS_DECODER_H_
#define FSDP_MODELS_DECODER_H_

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

#include "fsdp/core/unit.h"
#include "fsdp/lora/lora.h"
#include "models/attention.h"
#include "models/config.h"
#include "models/mlp.h"
#include "models/moe.h"
#include "models/rms_norm.h"

namespace fsdp::models {

// Which modules of a decoder are FSDP units (decided when it is built):
// - kLayer (the default): each decoder layer is one unit. A sparse layer's unit gathers
//   all its experts, and with backward prefetch (BACKWARD_PRE) the previous layer's unit
//   is gathered while it runs backward: two layers' experts at once.
// - kSublayer: each layer's attention (model.layers.N.self_attn) and feed-forward block
//   (model.layers.N.mlp: the MoE block, or the dense MLP) are two sibling units, and the
//   layer is none: its norms belong to the root unit (a few KiB). Backward prefetch then
//   gathers a layer's attention while its feed-forward block runs backward, and the
//   previous layer's feed-forward block only after this one's is resharded: one layer's
//   experts at a time. Names are unchanged (checkpoints load and save as with kLayer).
//   With checkpoint_activations each sublayer recomputes inside its own unit, the norms
//   outside (their saved tensors are kept: models/memory_plan.h plans them). The price:
//   two all-gathers and two reduce-scatters per layer and step instead of one each.
// PyTorch: FSDP2's fully_shard applied to each layer (kLayer), or to layer.self_attn and
// layer.mlp separately (kSublayer), as torchtitan's per-module wrapping allows.
enum class DecoderUnits { kLayer, kSublayer };

// The --moe_units flag of examples/llama:finetune and tools:fsdp_plan: "layer" is kLayer,
// "sublayer" kSublayer. Throws c10::Error for another value, and for "sublayer" with a
// dense family (config.is_moe() false: its layers have no experts to keep apart).
DecoderUnits parse_decoder_units(const std::string& flag, const DecoderConfig& config);

// A decoder layer's attention, dense MLP or MoE block (`Block`: AttentionImpl, MLPImpl or
// SparseMoeBlockImpl, whose forward takes `Args`) as DecoderLayerImpl holds it: the block
// itself (same parameters, names and forward arithmetic), with a forward that takes one
// more argument, `checkpointed`: true (DecoderUnits::kSublayer with checkpoint_activations,
// grad mode on) keeps only the block's inputs for backward and recomputes it there
// (fsdp::checkpoint), so that the recomputation runs inside the block's own unit, which it
// must (fsdp/core/checkpoint_wrapper.h); a MoE block's router logits keep their graph
// (Note [Router logits out of a checkpointed layer] in decoder.cc). Called through
// fsdp::forward_as<SublayerImpl<...>>, which runs the block's unit if it has one.
template <typename Block, typename... Args>
struct SublayerImpl : Block {
  using Block::Block;
  at::Tensor forward(Args... args, bool checkpointed);
};
using AttentionSublayerImpl = SublayerImpl<AttentionImpl, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&>;
using MLPSublayerImpl = SublayerImpl<MLPImpl, const at::Tensor&>;
using MoeSublayerImpl = SublayerImpl<SparseMoeBlockImpl, const at::Tensor&>;

// One decoder layer: one FSDP unit (DecoderUnits::kLayer), or the parent of two
// (kSublayer). Input and output [batch, time, hidden]. With checkpoint_activations
// (examples/llama/finetune's --activation_checkpointing), a forward with grad mode on keeps
// only its inputs for backward and recomputes the layer there (fsdp::checkpoint, inside the
// layer's unit; LoRA dropout draws the same masks again); with kSublayer each sublayer
// does so inside its own unit instead, the norms computed once.
struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl(const DecoderConfig& config, int64_t index,
                   const at::TensorOptions& options = {},
                   DecoderUnits units = DecoderUnits::kLayer);
  // `mask`: undefined, or packed rows' (AttentionImpl::forward).
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor mask = {});

  bool checkpoint_activations = false;

  LayerType type;
  double residual_multiplier;
  DecoderUnits units;
  // Each an AttentionSublayerImpl, MLPSublayerImpl or MoeSublayerImpl; with kSublayer
  // registered inside a Unit of its own.
  Attention self_attn{nullptr};
  // Registered as "mlp": the dense MLP, or in a sparse layer of a mixture-of-experts
  // family (config.sparse_layers) the MoE block; the other is null.
  MLP mlp{nullptr};
  SparseMoeBlock moe{nullptr};
  RMSNorm input_layernorm{nullptr};  // null with post_norms (norms after the sublayers only)
  RMSNorm post_attention_layernorm{nullptr};
  RMSNorm pre_feedforward_layernorm{nullptr};   // sandwich_norms
  RMSNorm post_feedforward_layernorm{nullptr};  // sandwich_norms or post_norms

 private:
  at::Tensor compute(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& mask);
  // The sublayers, through their units with kSublayer (each checkpointed there).
  bool sublayers_checkpointed() const {
    return checkpoint_activations && units == DecoderUnits::kSublayer;
  }
  at::Tensor attention(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& mask);
  at::Tensor feed_forward(const at::Tensor& x);
};
TORCH_MODULE(DecoderLayer);

// The keys and values of every decoder layer for the tokens run so far: generation runs
// the prompt once, then one token a forward, each attending to the cache instead of
// recomputing the sequence. PyTorch/transformers: DynamicCache (past_key_values).
struct KVCache {
  std::vector<KVCacheLayer> layers;  // one per decoder layer
  int64_t length = 0;                // tokens run so far: the next forward's first position
};

// Token ids [batch, time] (int64) -> final hidden states [batch, time, hidden]. For
// packed rows, `positions` and `segments` (both [batch, time] int64, or both undefined):
// see Note [Packed rows] in decoder.cc. With `cache` set (KVCacheScope), the ids follow
// the cache's tokens: positions cache->length ... cache->length + time - 1.
struct DecoderModelImpl : torch::nn::Module {
  explicit DecoderModelImpl(const DecoderConfig& config, const at::TensorOptions& options = {},
                            DecoderUnits units = DecoderUnits::kLayer);
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions = {},
                     const at::Tensor& segments = {});
  // cos and sin of `rope` at positions 0..time-1: [time, rotary_dim] each, in `dtype`
  // (rotary.h's rotary_cos_sin with the config's rotary_dim).
  std::pair<at::Tensor, at::Tensor> rotary(const RopeConfig& rope, int64_t time, c10::Device device,
                                           at::ScalarType dtype) const;

  DecoderConfig config;
  torch::nn::Embedding embed_tokens{nullptr};
  // Untied embeddings: embed_tokens in an FSDP unit of its own, registered under its name
  // (see Note [The embeddings and the head are units] in decoder.cc); null when tied.
  Unit<torch::nn::EmbeddingImpl> embed_unit{nullptr};
  DecoderUnits units;
  // Each layer, or with DecoderUnits::kLayer a Unit around it.
  torch::nn::ModuleList layers{nullptr};
  std::vector<DecoderLayer> decoder_layers;  // the layers, typed (either way)
  RMSNorm norm{nullptr};
  // Mixture-of-experts families: the sparse layers' router logits of the last forward
  // ([batch * time, num_experts] each, with their graph), for load_balancing_loss.
  std::vector<at::Tensor> router_logits() const;
  KVCache* cache = nullptr;  // set by KVCacheScope while it lives
};
TORCH_MODULE(DecoderModel);

// Token ids [batch, time] (int64, time <= max_position_embeddings) -> logits
// [batch, time, vocab_size] in the parameters' dtype. PyTorch: transformers'
// AutoModelForCausalLM.from_config(config)(input_ids).logits (attn_implementation "eager");
// on c10::kMeta: from_config under torch.device("meta").
// Within a PackedRowsScope the rows are packed, within a KVCacheScope they follow the
// cache's tokens (see there).
// `units`: which modules are FSDP units (DecoderUnits).
struct CausalLMImpl : torch::nn::Module {
  explicit CausalLMImpl(const DecoderConfig& config, const at::TensorOptions& options = {},
                        DecoderUnits units = DecoderUnits::kLayer);
  at::Tensor forward(const at::Tensor& ids);
  // Mixture-of-experts families: the last forward's load-balancing loss (moe.h's
  // load_balancing_loss over every sparse layer's router logits, the config's top-k), a
  // 0-dim fp32 tensor with grad to the routers (with checkpoint_activations too: see Note
  // [Router logits out of a checkpointed layer] in decoder.cc); the trainer adds
  // config.router_aux_loss_coef times it to the loss. `token_mask`: undefined (every token
  // counts) or the forward's [batch, time] attention mask (1 where a token counts),
  // as load_balancing_loss takes it. transformers: the output's aux_loss with
  // output_router_logits=True (and attention_mask). Throws c10::Error for a dense model,
  // before a forward, or for a mask of another shape.
  at::Tensor aux_loss(const at::Tensor& token_mask = {}) const;

  // Set by PackedRowsScope (both undefined outside one).
  struct PackedRows {
    at::Tensor positions, segments;
  } packed;

  DecoderConfig config;
  DecoderModel model{nullptr};
  // [vocab_size, hidden_size], no bias; null when tie_word_embeddings (the logits then use
  // model.embed_tokens.weight: one parameter, whose gradient sums both uses).
  lora::LoraLinear lm_head{nullptr};
  Unit<lora::LoraLinearImpl> head_unit{nullptr};  // lm_head's own unit (untied)
};

// While it lives, `model`'s forwards take packed rows, several examples side by side in
// each row, each attending only to itself: `positions` [batch, time] (int64, restarting at
// 0 at each example's first token, each below time) and `segments` [batch, time] (int64:
// each position's example within its row, -1 for padding), for ids of that shape. See
// Note [Packed rows] in decoder.cc. Throws c10::Error if either is undefined or the
// model is in another scope; a forward throws if the ids' shape differs. PyTorch:
// transformers' forward(input_ids, position_ids=...) of a padding-free packed batch
// (DataCollatorWithFlattening), each example's logits as if run alone.
//
//   fsdp::models::PackedRowsScope packed(*net, rows.positions, rows.segments);
//   at::Tensor logits = model->forward(rows.inputs);
class PackedRowsScope {
 public:
  PackedRowsScope(CausalLMImpl& model, at::Tensor positions, at::Tensor segments);
  ~PackedRowsScope();
  PackedRowsScope(const PackedRowsScope&) = delete;
  PackedRowsScope& operator=(const PackedRowsScope&) = delete;

 private:
  CausalLMImpl& model_;
};

// While it lives, `model`'s forwards run after the tokens in `cache` (empty at first) and
// append theirs to it: greedy or sampled generation runs the prompt [batch, P], then each
// new token [batch, 1], and every forward's logits are those of the whole sequence so far
// at its last positions (decoder_test: equal to a forward of the whole sequence). Forwards
// run without grad (torch::NoGradGuard; a forward with grad mode on throws), the sequence
// stays within max_position_embeddings (throws past it), and the batch is the prompt's.
// Memory: 2 x layers x batch x kv_heads x head_dim values per token, in the model's
// dtype. Throws c10::Error if the model is in another scope. The cache outlives the scope
// and may be resumed by another. PyTorch/transformers: model(input_ids,
// past_key_values=DynamicCache(), use_cache=True), as generate() runs it.
//
//   fsdp::models::KVCache cache;
//   fsdp::models::KVCacheScope scope(*net, cache);
//   at::Tensor logits = model->forward(prompt);        // [1, P, vocab]
//   logits = model->forward(next_token.view({1, 1}));  // [1, 1, vocab], position P
class KVCacheScope {
 public:
  KVCacheScope(CausalLMImpl& model, KVCache& cache);
  ~KVCacheScope();
  KVCacheScope(const KVCacheScope&) = delete;
  KVCacheScope& operator=(const KVCacheScope&) = delete;

 private:
  CausalLMImpl& model_;
};

// The dtype a LoRA run builds its frozen base in (Note [The frozen base of a LoRA run] in
// examples/llama/finetune.cc): a 16-bit folder's own dtype (`folder` bf16 or fp16) under bf16
// compute, else `master`, the master weights' dtype. PyTorch/PEFT: the base as
// from_pretrained(dtype=the folder's) loads it, the adapters fp32 (autocast_adapter_dtype).
at::ScalarType lora_base_dtype(at::ScalarType master, at::ScalarType folder, bool bf16_compute);

// QLoRA's base (examples/llama:finetune --quantize=nf4): holds every LoraLinear named
// "*_proj" inside a decoder layer (attention's and the MLP's projections, shared
// experts' included; not the MoE routers, the fused routed experts, the embeddings, the
// norms or the head, which QLoRA leaves as they are) in NF4 with double quantization
// (lora::LoraLinearImpl::store_weight_nf4), on the meta device or any other. Returns how
// many it stored. PyTorch: transformers' from_pretrained with BitsAndBytesConfig(
// load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True), which
// swaps every Linear but lm_head for bitsandbytes' Linear4bit.
int64_t store_projections_nf4(CausalLMImpl& net);

// The init function for FullyShardedRoot::init_parameters of a decoder built on the meta
// device: gives `module`'s own parameters, in place, the values its constructor gives on
// a real device (RMSNormImpl, LoraLinearImpl, ExpertsImpl and torch::nn::EmbeddingImpl
// each by its reset_parameters; other modules have no parameters of their own). With the same seed
// (torch::manual_seed before init_parameters) the shards equal a CPU build's chunks.
// Adapters (lora_A, lora_B) are not the decoder's: apply_lora gives them values.
void reset_decoder_parameters(torch::nn::Module& module);

}  // namespace fsdp::models

#endif  // FSDP_MODELS_DECODER_H_
