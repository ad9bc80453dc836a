// The Llama architecture of a Hugging Face model folder: its config.json as transformers'
// LlamaConfig writes it (save_pretrained), checked for what examples/llama supports.
//
//   fsdp::llama::LlamaConfig config = fsdp::llama::load_llama_config("/models/tiny/config.json");
//   config.num_key_value_heads;   // e.g. 2 of 4 attention heads (grouped-query attention)
//
// Both spellings transformers has used for the rotary base are read: 5.x's
// "rope_parameters": {"rope_type": "default", "rope_theta": T} and 4.x's top-level
// "rope_theta" with "rope_scaling": null. PyTorch/transformers counterpart:
// transformers.LlamaConfig.from_pretrained.
//
// Errors (c10::Error, one line): a file that cannot be read or is not a JSON object; a
// missing or mistyped required field; a field whose value the model does not support
// (model_type other than "llama", a rope type other than "default", attention_bias or
// mlp_bias true, hidden_act other than "silu", attention_dropout other than 0,
// num_attention_heads not a multiple of num_key_value_heads, an odd head_dim, ...). Each
// names the file, the field and the value found, and says what is supported.
#ifndef FSDP_EXAMPLES_LLAMA_CONFIG_H_
#define FSDP_EXAMPLES_LLAMA_CONFIG_H_

#include <cstdint>
#include <string>

namespace fsdp::llama {

struct LlamaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // the SwiGLU MLP's inner width
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // default num_attention_heads; must divide it
  int64_t head_dim = 0;             // default hidden_size / num_attention_heads; even
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;  // lm_head.weight is model.embed_tokens.weight
  std::string dtype = "float32";     // "dtype" (or 4.x's "torch_dtype"): the weights' dtype
};

// Parses and checks the text of a config.json; `source` names it in errors.
LlamaConfig parse_llama_config(const std::string& json_text, const std::string& source);

// Reads and checks `path` (an HF folder's config.json).
LlamaConfig load_llama_config(const std::string& path);

}  // namespace fsdp::llama

#endif  // FSDP_EXAMPLES_LLAMA_CONFIG_H_
