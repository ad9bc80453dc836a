#include "models/config.h"

#include <algorithm>
#include <string_view>

#include "absl/strings/str_join.h"
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp/formats/files.h"
#include "fsdp/formats/json.h"
#include "models/internal/config_families.h"
#include "models/internal/config_fields.h"

namespace fsdp::models {
namespace {

using models_internal::ConfigFields;
using nlohmann::json;

// Which count of experts a family reads; the others' are refused.
enum class ExpertsField {
  kNone,           // a dense family: no experts
  kNumExperts,     // num_experts or num_local_experts (Qwen's, Mixtral's, OLMoE's, gpt-oss's)
  kRoutedExperts,  // n_routed_experts (DeepSeek's)
};

// The families the decoder builds: model_type to its reader (config_families.h).
struct Family {
  const char* model_type;
  models_internal::FamilyReader read;
  ExpertsField experts = ExpertsField::kNone;
};

constexpr Family kFamilies[] = {
    {"llama", models_internal::read_llama_config},
    {"mistral", models_internal::read_mistral_config},
    {"qwen2", models_internal::read_qwen2_config},
    {"qwen3", models_internal::read_qwen3_config},
    {"gemma2", models_internal::read_gemma2_config},
    {"gemma3_text", models_internal::read_gemma3_text_config},
    {"granite", models_internal::read_granite_config},
    {"olmo2", models_internal::read_olmo2_config},
    {"phi3", models_internal::read_phi3_config},
    {"qwen3_moe", models_internal::read_qwen3_moe_config, ExpertsField::kNumExperts},
    {"mixtral", models_internal::read_mixtral_config, ExpertsField::kNumExperts},
    {"olmoe", models_internal::read_olmoe_config, ExpertsField::kNumExperts},
    {"qwen2_moe", models_internal::read_qwen2_moe_config, ExpertsField::kNumExperts},
    {"gpt_oss", models_internal::read_gpt_oss_config, ExpertsField::kNumExperts},
    {"deepseek_v3", models_internal::read_deepseek_v3_config, ExpertsField::kRoutedExperts},
};

// The whole text of a config.json as a JSON object, parsed with its nesting bounded
// (fsdp/formats/json.h). The one place a config file is parsed.
json parse_json_object(const std::string& json_text, const std::string& source) {
  json object = parse_untrusted_json(json_text, source,
                                     "expected the config.json of a Hugging Face model folder");
  TORCH_CHECK(object.is_object(), source, ": expected a JSON object, found ", object.type_name());
  return object;
}

// The family of `model_type`; known families the decoder does not build are refused with
// the reason, any other with the list of supported ones.
const Family& family_of(const ConfigFields& fields, const std::string& model_type) {
  const std::string supported = "fsdp's decoder builds " + supported_model_types();
  TORCH_CHECK(model_type != "deepseek_v2", fields.source(),
              ": \"model_type\" = \"deepseek_v2\" is not supported: DeepSeek-V2's routing "
              "(softmax scores, greedy or group-limited top-k, its load-balancing losses) is not "
              "implemented; ",
              supported);
  TORCH_CHECK(model_type != "gemma3", fields.source(),
              ": \"model_type\" = \"gemma3\" is not supported: a multimodal Gemma 3 folder (vision "
              "tower and text_config); fsdp's decoder builds its language model only from a "
              "\"gemma3_text\" folder (Gemma3ForCausalLM), and does not carry the vision tower");
  const auto* family = std::find_if(std::begin(kFamilies), std::end(kFamilies),
                                    [&](const Family& f) { return model_type == f.model_type; });
  TORCH_CHECK(family != std::end(kFamilies), fields.source(), ": \"model_type\" = \"", model_type,
              "\" is not supported: ", supported);
  return *family;
}

// Refuses fields of architectures the decoder does not build, whatever the family (the
// experts fields in the dense families).
void refuse_other_architectures(const ConfigFields& fields, const Family& family) {
  fields.refuse("text_config", "a multimodal folder; fsdp's decoder builds text models only");
  fields.refuse("vision_config", "a multimodal folder; fsdp's decoder builds text models only");
  for (const char* experts : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    const bool routed = std::string_view(experts) == "n_routed_experts";
    if (family.experts == ExpertsField::kNumExperts && !routed) continue;
    if (family.experts == ExpertsField::kRoutedExperts) continue;  // its reader's
    const json* value = fields.find(experts);
    TORCH_CHECK(value == nullptr || (value->is_number_integer() && value->get<int64_t>() == 0),
                fields.source(), ": \"", experts, "\" = ", value == nullptr ? "" : value->dump(),
                " is not supported: ",
                routed ? "n_routed_experts counts the experts of model type deepseek_v3 only"
                       : "mixture-of-experts layers are built for the model types qwen3_moe, "
                         "mixtral, olmoe, qwen2_moe, gpt_oss and deepseek_v3 only",
                "; a ", family.model_type,
                family.experts == ExpertsField::kNone ? " decoder has one dense MLP per layer"
                                                      : " decoder counts its experts in "
                                                        "num_experts or num_local_experts");
  }
  fields.require("use_bidirectional_attention", false,
                 "fsdp's decoder is causal (use_bidirectional_attention false)");
}

// gpt-oss as openai ships it (the experts in MXFP4: gate_up_proj_blocks, _scales) and
// DeepSeek-V3 / Kimi K2 as the Hub ships them (FP8 weights with a scale per
// weight_block_size block: *.weight_scale_inv), refused with how to get the bf16 layout
// fsdp reads. Checked before the family's reader.
void refuse_mxfp4_and_fp8(const ConfigFields& fields) {
  const json* object = fields.object("quantization_config");
  if (object == nullptr) return;
  const ConfigFields quantization(*object, fields.source(), "quantization_config.");
  const std::string method = quantization.string("quant_method", "");
  TORCH_CHECK(method != "mxfp4", fields.source(),
              ": \"quantization_config.quant_method\" = \"mxfp4\" is not supported: MXFP4 "
              "experts (gpt-oss as openai/gpt-oss-20b ships) are not implemented; fsdp reads "
              "gpt-oss in its bf16 layout: a *-BF16 folder (such as unsloth/gpt-oss-20b-BF16), "
              "or the folder transformers' save_pretrained writes after from_pretrained(..., "
              "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16)");
  TORCH_CHECK(method != "fp8", fields.source(),
              ": \"quantization_config.quant_method\" = \"fp8\" is not supported: FP8 "
              "block-scaled weights (weight_block_size ",
              quantization.find("weight_block_size") == nullptr
                  ? std::string("unset")
                  : quantization.find("weight_block_size")->dump(),
              "; DeepSeek-V3 and Kimi K2 as the Hub ships them) are not implemented; fsdp reads "
              "the bf16 layout: a *-BF16 folder, or the folder transformers' save_pretrained "
              "writes after from_pretrained(..., quantization_config=FineGrainedFP8Config("
              "dequantize=True), dtype=torch.bfloat16)");
}

// Note [A bitsandbytes 4-bit folder's quantization_config]
// A folder transformers saved after loading a model with BitsAndBytesConfig(load_in_4bit=True,
// bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True) holds its quantized weights in
// the layout of fsdp's NF4 base (models/hf_checkpoint.h), which is read as it is. Every
// other quantization is refused by name: other quant_methods, 8-bit weights, FP4, NF4
// without double quantization, codes stored in another dtype than uint8. A field left out
// takes transformers' default (load_in_4bit false, bnb_4bit_quant_type "fp4", ...). The
// compute dtype changes no stored byte and is not used: the weights dequantize to the
// folder's dtype and fsdp computes as --mixed_precision says (bf16 for a bf16 folder), as
// for the folder's other weights. Which modules are quantized is the
// folder's tensors' to say (llm_int8_skip_modules is not read); the 8-bit and loading
// options (llm_int8_threshold, llm_int8_has_fp16_weight, ...) do not apply to a 4-bit folder.
void read_quantization_config(const ConfigFields& fields, DecoderConfig& config) {
  const json* object = fields.object("quantization_config");
  if (object == nullptr) return;
  static const std::string kNf4 =
      "fsdp reads bitsandbytes' 4-bit NF4 with double quantization (load_in_4bit true, "
      "bnb_4bit_quant_type \"nf4\", bnb_4bit_use_double_quant true)";
  const ConfigFields quantization(*object, fields.source(), "quantization_config.");
  TORCH_CHECK(quantization.string("quant_method", "") == "bitsandbytes", fields.source(),
              ": \"quantization_config\" = ", object->dump(),
              " is not supported: quantised weights other than bitsandbytes' (FP8, GPTQ, AWQ, "
              "...) are not implemented; ",
              kNf4);
  const auto expect = [&](const char* name, const json& fallback, const json& supported,
                          const std::string& why) {
    const json* found = quantization.find(name);
    const json& value = found == nullptr ? fallback : *found;
    TORCH_CHECK(value == supported, fields.source(), ": \"quantization_config.", name,
                "\" = ", value.dump(), found == nullptr ? " (transformers' default)" : "",
                " is not supported: ", why);
  };
  expect("load_in_8bit", false, false, "8-bit weights (LLM.int8) are not implemented; " + kNf4);
  expect("load_in_4bit", false, true, kNf4);
  expect("bnb_4bit_quant_type", "fp4", "nf4", kNf4);
  expect("bnb_4bit_use_double_quant", false, true, kNf4);
  expect("bnb_4bit_quant_storage", "uint8", "uint8",
         "fsdp reads the 4-bit codes packed two to a byte (uint8)");
  const json* compute = quantization.find("bnb_4bit_compute_dtype");
  TORCH_CHECK(compute == nullptr || compute->is_null() ||
                  (compute->is_string() &&
                   (*compute == "float32" || *compute == "bfloat16" || *compute == "float16")),
              fields.source(), ": \"quantization_config.bnb_4bit_compute_dtype\" = ",
              compute == nullptr ? "" : compute->dump(),
              " is not a dtype bitsandbytes computes in: expected \"float32\", \"bfloat16\" "
              "or \"float16\"");
  config.load_in_4bit = true;
}

}  // namespace

DecoderConfig parse_decoder_config(const std::string& json_text, const std::string& source) {
  const json object = parse_json_object(json_text, source);
  const ConfigFields fields(object, source);
  const json* model_type = fields.find("model_type");
  TORCH_CHECK(model_type != nullptr && model_type->is_string(), source,
              ": the field \"model_type\" is missing; expected one of ", supported_model_types(),
              " (a config saved by transformers)");
  DecoderConfig config;
  config.model_type = model_type->get<std::string>();
  const Family& family = family_of(fields, config.model_type);
  refuse_other_architectures(fields, family);
  refuse_mxfp4_and_fp8(fields);
  family.read(fields, config);
  read_quantization_config(fields, config);  // after the family's: it needs the dtype
  return config;
}

DecoderConfig load_decoder_config(const std::string& path) {
  std::string text;
  try {
    text = read_regular_file(path, "config.json", kMaxJsonBytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.what_without_backtrace(),
                "; expected the config.json of a Hugging Face model folder, as "
                "save_pretrained writes it");
  }
  return parse_decoder_config(text, path);
}

std::string supported_model_types() {
  return absl::StrJoin(
      std::begin(kFamilies), std::end(kFamilies), ", ",
      [](std::string* out, const Family& family) { out->append(family.model_type); });
}

bool DecoderConfig::has_sliding_layers() const {
  return sliding_window > 0 && std::find(layer_types.begin(), layer_types.end(),
                                         LayerType::kSliding) != layer_types.end();
}

}  // namespace fsdp::models
