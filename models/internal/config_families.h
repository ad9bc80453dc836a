// One config reader per family (model_type), each registered in config.cc's table: it
// sets the family's switches in DecoderConfig (the decoder reads those, never the family
// name), reads the shared fields with its transformers config class's defaults
// (config_fields.h) and then its own (multipliers, soft-caps, which layers slide). Adding
// a family is adding a reader here, a row in the table and a test in config_test.cc.
// Not a public API. Errors: as parse_decoder_config's (config.h).
#ifndef FSDP_MODELS_INTERNAL_CONFIG_FAMILIES_H_
#define FSDP_MODELS_INTERNAL_CONFIG_FAMILIES_H_

#include <string>

#include "models/config.h"
#include "models/internal/config_fields.h"

namespace fsdp::models_internal {

// Reads `fields` into `config`, whose model_type is already set.
using FamilyReader = void (*)(const ConfigFields& fields, models::DecoderConfig& config);

// What sets the SwiGLU families (Llama's and the mixtures of experts) apart from Gemma:
// hidden_act "silu" (`swiglu` says what it drives, in the refusal) and no soft-caps.
void read_swiglu_family(const ConfigFields& fields, const models::DecoderConfig& config,
                        const std::string& swiglu = "the MLP is SwiGLU");

// Llama and the families built like it (llama_configs.cc): SwiGLU MLP, RMSNorm before
// each sublayer (after it in OLMo 2).
void read_llama_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_granite_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_mistral_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_phi3_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_qwen2_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_qwen3_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_olmo2_config(const ConfigFields& fields, models::DecoderConfig& config);

// The mixture-of-experts families (moe_configs.cc).
void read_qwen3_moe_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_mixtral_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_olmoe_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_qwen2_moe_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_gpt_oss_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_deepseek_v3_config(const ConfigFields& fields, models::DecoderConfig& config);

// Gemma 2 and Gemma 3's language model (gemma_configs.cc).
void read_gemma2_config(const ConfigFields& fields, models::DecoderConfig& config);
void read_gemma3_text_config(const ConfigFields& fields, models::DecoderConfig& config);

}  // namespace fsdp::models_internal

#endif  // FSDP_MODELS_INTERNAL_CONFIG_FAMILIES_H_
