// The architecture of a Hugging Face decoder-only model folder: its config.json as
// transformers writes it (save_pretrained), read into one DecoderConfig whose fields are the
// per-family options of the decoder (decoder.h). Families (`model_type`):
//
//   "llama"        Llama 1-3.x, SmolLM, TinyLlama (attention_bias, mlp_bias read)
//   "mistral"      sliding-window attention in every layer (sliding_window, or null)
//   "qwen2"        biases on q/k/v; sliding window switched on by use_sliding_window for the
//                  layers from max_window_layers on (or as layer_types says)
//   "qwen3"        per-head RMSNorm on queries and keys, explicit head_dim
//   "gemma2"       Gemma: sqrt(hidden) embedding scale, (1 + w) RMSNorm, norms before and
//                  after attention and MLP, query_pre_attn_scalar, GeLU-tanh MLP,
//                  layer_types sliding/full; attention and final logit soft-caps
//   "gemma3_text"  Gemma 3's language model: as gemma2 with (1 + w) q/k norms and RoPE
//                  parameters per layer type (sliding layers: rope_local_base_freq)
//   "granite"      Llama with four scalars: embedding_multiplier, attention_multiplier (the
//                  attention scale), residual_multiplier, logits_scaling (logits divided)
//   "olmo2"        norms after each sublayer only (x + norm(attn(x))), RMSNorm on the
//                  full width of the query and key projections, weight applied in fp32
//   "phi3"         Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary
//                  embeddings, longrope; sliding_window in every layer when set
//
// Mixture of experts (the MLP of the sparse layers is a router and experts: moe.h):
//
//   "qwen3_moe"    Qwen3's attention (per-head q/k norms); num_experts (or 5.x's
//                  num_local_experts) experts of moe_intermediate_size, norm_topk_prob,
//                  decoder_sparse_step and mlp_only_layers (those layers dense, of
//                  intermediate_size)
//   "mixtral"      Mistral's attention; num_local_experts experts of intermediate_size,
//                  top-k weights always renormalised (kept in fp32); the checkpoint's
//                  block_sparse_moe.experts.E.w1/w3/w2
//   "olmoe"        Llama's layer with full-width q/k norms (as olmo2's, norms before the
//                  sublayers); num_experts experts of intermediate_size, norm_topk_prob
//   "qwen2_moe"    Qwen2's attention (q/k/v biases as qkv_bias); as qwen3_moe plus a
//                  dense shared expert (shared_expert_intermediate_size) scaled by
//                  sigmoid(shared_expert_gate(x))
//   "gpt_oss"      gpt-oss in its bf16 layout (unsloth/gpt-oss-20b-BF16): attention sinks,
//                  q/k/v/o biases, sliding and full layers alternating, YaRN; a router
//                  with a bias (softmax over its top-k logits), num_local_experts experts
//                  of intermediate_size with biases and the clamped SwiGLU (swiglu_limit),
//                  fused on disk as in memory ([E, H, 2 I], gate and up interleaved)
//   "deepseek_v3"  DeepSeek-V3 and Kimi K2 (bf16 folders): multi-head latent attention
//                  (q_lora_rank, kv_lora_rank, qk_nope_head_dim + qk_rope_head_dim, v_head_dim;
//                  RoPE on the qk_rope_head_dim part only, interleaved with rope_interleave;
//                  YaRN's mscale_all_dim in the attention scale); the first
//                  first_k_dense_replace layers dense, then n_routed_experts experts of
//                  moe_intermediate_size chosen by sigmoid scores plus the checkpoint's
//                  e_score_correction_bias among the best topk_group of n_group groups,
//                  weighted by routed_scaling_factor, and n_shared_experts shared experts
//                  (one gated MLP, ungated). No load-balancing loss, as in transformers.
//
//   const fsdp::models::DecoderConfig config =
//       fsdp::models::load_decoder_config("/models/mistral-7b-v0.1/config.json");
//   config.model_type;      // "mistral"
//   config.layer_types[3];  // LayerType::kSliding: attends to the last sliding_window
//                           // tokens (4096 here), itself included
//
// Both spellings transformers has used are read: 5.x's "rope_parameters" (flat, or nested
// per layer type as {"full_attention": {...}, "sliding_attention": {...}}) and 4.x's
// "rope_theta" + "rope_scaling" (+ Gemma 3's "rope_local_base_freq"), with the rope type
// under "rope_type" or "type"; 5.x's "layer_types" and 4.x's "sliding_window_pattern".
// RoPE types: "default", "linear", "llama3", "yarn", "longrope".
// PyTorch/transformers counterpart: AutoConfig.from_pretrained, then the family's
// RotaryEmbedding and attention masks.
//
// Errors (c10::Error, one line naming the file, the field and its value, and what is
// supported): a file that cannot be read or is not a JSON object; a missing or mistyped
// required field; anything the decoder does not implement, refused by name, never
// ignored: another model_type (mixture-of-experts families other than the four above,
// such as "deepseek_v2"; multimodal "gemma3" folders whose vision tower is not carried),
// experts fields (num_local_experts, num_experts) in a dense family, n_routed_experts
// outside deepseek_v3, sliding windows in the MoE families but gpt_oss, gpt-oss's MXFP4
// folders (quant_method "mxfp4", how openai/gpt-oss-20b ships) and DeepSeek-V3's FP8
// block-scaled ones (quant_method "fp8", as the Hub ships it): the messages say how to get
// the bf16 layout; deepseek_v3's rope types other than default and yarn, DeepSeek's
// remote-code routing other than V3's (scoring_func, topk_method, moe_layer_freq); OLMoE's
// clip_qkv, Mixtral's router_jitter_noise, linear-attention layer types, rope types such as
// "dynamic", quantised weights other than bitsandbytes' 4-bit NF4 with double quantization
// (quantization_config; see load_in_4bit), another activation, attention dropout, ...
#ifndef FSDP_MODELS_CONFIG_H_
#define FSDP_MODELS_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::models {

// The rotary embedding of one layer type (transformers' rope_parameters entry).
struct RopeConfig {
  std::string type = "default";  // default, linear, llama3, yarn or longrope
  double theta = 10000.0;        // rope_theta
  double factor = 1.0;           // linear, llama3, yarn: the context extension factor
  // llama3: frequencies below original_max_position_embeddings / low_freq_factor
  // wavelengths are divided by factor, those above .. / high_freq_factor kept, smoothed
  // in between.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;  // llama3, yarn (default max_position_embeddings)
  // yarn (transformers' defaults): the correction range's rotations and the cos/sin
  // scale (attention_factor; 0: from factor, mscale and mscale_all_dim).
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double attention_factor = 0.0;
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  bool truncate = true;
  // longrope (Phi-3): the frequency divisors per rotated pair, long_factor when the sequence
  // is longer than original_max_position_embeddings, else short_factor; cos and sin scaled
  // by attention_factor (sqrt(1 + ln(factor) / ln(original)) unless given).
  std::vector<double> long_factor, short_factor;
  // The fraction of each head that is rotated (its first dimensions; Phi-4-mini 0.75).
  double partial_rotary_factor = 1.0;
};

enum class LayerType { kFull, kSliding };

// How an RMSNorm applies its weight w to n = x / rms(x) (computed in fp32): kLlama
// w * n.to(dtype); kOlmo (w * n).to(dtype); kGemma (n * (1 + w)).to(dtype).
enum class NormStyle { kLlama, kOlmo, kGemma };

// The gated MLP's activation: SiLU (hidden_act "silu") or GeLU with the tanh
// approximation (Gemma's hidden_activation "gelu_pytorch_tanh").
enum class Activation { kSilu, kGeluTanh };

// The decoder's architecture. Each family's reader (one per model_type) sets the
// behaviour switches below; the decoder reads the switches, never model_type, so a new
// family is a reader that sets them.
struct DecoderConfig {
  std::string model_type;  // one of supported_model_types()
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // the gated MLP's inner width
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // default num_attention_heads; must divide it
  int64_t head_dim = 0;             // even
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;  // lm_head.weight is model.embed_tokens.weight
  // The embedding's padding_idx (-1: none): its row gets no gradient through the lookup,
  // as transformers' nn.Embedding(vocab, hidden, pad_token_id).
  int64_t pad_token_id = -1;
  std::string dtype = "float32";  // "dtype" (or 4.x's "torch_dtype"): the weights' dtype
  // quantization_config: bitsandbytes' 4-bit NF4 with double quantization (transformers'
  // BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  // bnb_4bit_use_double_quant=True), bnb_4bit_compute_dtype the dtype above). The folder
  // holds some projections' weights so (hf_checkpoint.h: store_hf_nf4_weights), frozen:
  // they train only through LoRA.
  bool load_in_4bit = false;

  bool qkv_bias = false;  // q/k/v_proj have biases (qwen2; attention_bias elsewhere)
  bool o_bias = false;    // o_proj has a bias (attention_bias; never for qwen2)
  bool mlp_bias = false;  // gate/up/down_proj have biases (llama's mlp_bias)
  bool qk_norm = false;   // RMSNorm over head_dim on queries and keys before RoPE (qwen3, gemma3)
  bool qk_norm_full_width = false;  // olmo2: over the whole q_proj / k_proj output instead
  // phi3: q, k, v in one qkv_proj [(heads + 2 kv_heads) * head_dim, hidden] and gate, up in
  // one gate_up_proj [2 intermediate, hidden], as the checkpoint holds them.
  bool fused_projections = false;
  // gpt_oss: a learned logit per head (self_attn.sinks [heads]) joins each query's softmax
  // over the keys and is dropped after it; attention then computed eagerly.
  bool attention_sinks = false;
  // deepseek_v3, kv_lora_rank > 0: multi-head latent attention. Queries through q_a_proj
  // [q_lora_rank, hidden], q_a_layernorm, q_b_proj [heads * qk_head_dim(), q_lora_rank]
  // (q_lora_rank 0: one q_proj [heads * qk_head_dim(), hidden]); keys and values through
  // kv_a_proj_with_mqa [kv_lora_rank + head_dim, hidden], whose first kv_lora_rank outputs
  // are normed (kv_a_layernorm) and expanded by kv_b_proj [heads * (qk_nope_head_dim +
  // v_head_dim), kv_lora_rank] into each head's unrotated key part and value, and whose
  // last head_dim (qk_rope_head_dim) are one rotated key part shared by the heads. head_dim
  // is the rotated part of a query or key (qk_rope_head_dim, as transformers sets it);
  // o_proj [hidden, heads * v_head_dim]. q_a_proj, kv_a_proj_with_mqa and o_proj have
  // biases with attention_bias (qkv_bias, o_bias), the others none.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;  // the unrotated part of a query or key
  int64_t v_head_dim = 0;
  // deepseek_v3: the rotated part's dimensions pair up interleaved ((0, 1), (2, 3), ...) and
  // come out of RoPE as the pairs' first halves, then their second ones (transformers'
  // apply_rotary_pos_emb_interleave); else rotate_half's halves.
  bool rope_interleave = false;
  bool latent_attention() const { return kv_lora_rank > 0; }
  int64_t qk_head_dim() const { return qk_nope_head_dim + head_dim; }
  int64_t rotary_dim = 0;  // head_dim x partial_rotary_factor: the rotated dimensions
  // The Gemma families (gemma2, gemma3_text), whose readers set scale_embeddings,
  // sandwich_norms, norm_style kGemma and activation kGeluTanh; the decoder reads those.
  bool gemma = false;
  bool scale_embeddings = false;  // gemma: embeddings x sqrt(hidden_size) (in their dtype)
  // gemma: four norms per layer, each sublayer's output normed before the residual add
  // (post_attention_layernorm, post_feedforward_layernorm) and pre_feedforward_layernorm
  // before the MLP.
  bool sandwich_norms = false;
  bool post_norms = false;  // olmo2: x + post_attention_layernorm(attn(x)), no input norm
  NormStyle norm_style = NormStyle::kLlama;
  Activation activation = Activation::kSilu;
  // query_pre_attn_scalar^-0.5 (gemma), attention_multiplier (granite), else head_dim^-0.5.
  double attention_scale = 0.0;
  double embedding_multiplier = 1.0;     // granite: embeddings times it
  double residual_multiplier = 1.0;      // granite: each sublayer's output times it
  double logits_scaling = 1.0;           // granite: logits divided by it
  double attn_logit_softcapping = 0.0;   // 0: none; else scores = cap * tanh(scores / cap)
  double final_logit_softcapping = 0.0;  // 0: none; else logits = cap * tanh(logits / cap)
  int64_t sliding_window = 0;            // tokens a sliding layer's query sees, itself included
  std::vector<LayerType> layer_types;    // one per layer
  // gemma3_text: sliding layers rotate with sliding_rope, full ones with rope; else every
  // layer with rope.
  bool rope_per_layer_type = false;
  RopeConfig rope;          // full-attention layers (every layer without rope_per_layer_type)
  RopeConfig sliding_rope;  // sliding layers with rope_per_layer_type; else equal to `rope`

  // Mixture of experts (qwen3_moe, mixtral, olmoe, qwen2_moe, gpt_oss, deepseek_v3; moe.h): the
  // sparse layers' MLP routes each token to its num_experts_per_tok best of num_experts experts. 0
  // experts: a dense family, every layer's MLP the gated MLP of intermediate_size.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;    // top-k
  int64_t moe_intermediate_size = 0;  // each expert's inner width
  bool norm_topk_prob = false;        // the top-k weights renormalised to sum to 1
  bool router_weights_fp32 =
      false;  // mixtral, deepseek_v3: top-k weights stay fp32 (else hidden dtype)
  int64_t shared_expert_intermediate_size = 0;  // the shared expert's width (0: none)
  std::vector<bool> sparse_layers;              // per layer: the MoE block (else the dense MLP)
  double router_aux_loss_coef = 0.0;            // the load-balancing loss's weight in the loss
  bool output_router_logits = false;            // transformers adds that loss in training when set
  // mixtral: the checkpoint names the block block_sparse_moe and the experts' projections
  // w1 (gate), w3 (up), w2 (down); else mlp and gate_proj, up_proj, down_proj.
  bool block_sparse_moe_names = false;
  // gpt_oss: the router is mlp.router, with a bias, and the weights are the softmax over
  // its top-k logits (else mlp.gate without one, top-k of the softmax over the experts).
  bool router_bias_topk_softmax = false;
  // gpt_oss: the experts in the checkpoint's layout, fused on disk too: gate_up_proj
  // [E, hidden, 2 I] (gate and up interleaved: even and odd columns), down_proj
  // [E, I, hidden], with gate_up_proj_bias [E, 2 I] and down_proj_bias [E, hidden].
  bool experts_transposed = false;
  // gpt_oss, > 0: the experts' clamped SwiGLU, gate.clamp(max=limit), up.clamp(+-limit),
  // (up + 1) * gate * sigmoid(swiglu_alpha * gate); 0: silu(gate) * up.
  double swiglu_limit = 0.0;
  double swiglu_alpha = 1.702;
  // deepseek_v3: the router mlp.gate (weight [E, hidden] and the checkpoint's fp32 buffer
  // e_score_correction_bias [E]) scores the experts with a sigmoid in fp32; each token's
  // experts are the top-k of score + bias among the topk_group best of n_group groups (a
  // group's score: the sum of its two best), weighted by their scores (renormalised with
  // norm_topk_prob) times routed_scaling_factor, in fp32. No load-balancing loss.
  bool router_sigmoid_groups = false;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  // deepseek_v3: the shared expert is mlp.shared_experts, added as it is (n_shared_experts x
  // moe_intermediate_size wide); else qwen2_moe's mlp.shared_expert scaled by
  // sigmoid(mlp.shared_expert_gate(x)).
  bool shared_experts_ungated = false;
  // deepseek_v3: num_nextn_predict_layers, the multi-token prediction layers a checkpoint
  // may hold after the decoder's (model.layers.num_hidden_layers ...), which transformers
  // neither builds nor reads: hf_checkpoint skips their tensors. No part of the model.
  int64_t mtp_layers = 0;

  bool has_sliding_layers() const;
  bool is_moe() const { return num_experts > 0; }
};

// Parses and checks the text of a config.json; `source` names it in errors.
DecoderConfig parse_decoder_config(const std::string& json_text, const std::string& source);

// Reads and checks `path` (an HF folder's config.json).
DecoderConfig load_decoder_config(const std::string& path);

// The families parse_decoder_config accepts, for messages: "llama, mistral, ...".
std::string supported_model_types();

}  // namespace fsdp::models

#endif  // FSDP_MODELS_CONFIG_H_
