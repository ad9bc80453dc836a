#include "models/hf_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp/base/names.h"
#include "fsdp/formats/atomic_file.h"
#include "fsdp/formats/json.h"
#include "fsdp/formats/nf4.h"
#include "fsdp/formats/safetensors.h"
#include "fsdp/lora/adapter_file.h"
#include "fsdp/state/safetensors_state_dict.h"
#include "models/config.h"

namespace fsdp::models {
namespace {

// The files of an HF folder that describe the model besides its weights (save_hf_folder in
// hf_checkpoint.h): the config, the generation config, and every file transformers 4.4x
// and 5.x save a tokenizer as (tokenizer.json, or a BPE's vocab.json and merges.txt, or
// SentencePiece's tokenizer.model; the chat template: chat_template.jinja in 5.x,
// chat_template.json in 4.4x).
constexpr const char* kModelFiles[] = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
};

// Copies those of kModelFiles that `from_dir` holds. A config.json with a
// quantization_config is written without it (the weights are written dequantized: Note [A
// bitsandbytes 4-bit folder]), as transformers writes a config (indent 2, sorted keys).
void copy_model_files(const std::string& from_dir, const std::string& out_dir) {
  for (const char* name : kModelFiles) {
    const std::filesystem::path from = std::filesystem::path(from_dir) / name;
    const std::filesystem::path to = std::filesystem::path(out_dir) / name;
    if (!std::filesystem::exists(from)) continue;
    if (std::string(name) == "config.json") {
      nlohmann::json config = read_json_file(from.string(), "config.json", "");
      if (config.is_object() && config.erase("quantization_config") > 0) {
        write_file_atomically(to.string(), config.dump(2) + "\n");
        continue;
      }
    }
    std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
  }
}

// Removes the weight files a previous save left in `out_dir` (other shard counts would
// stay beside the new files, and a stale index would win over a new model.safetensors).
void remove_old_weights(const std::string& out_dir) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(out_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (absl::EndsWith(name, ".safetensors") || name == kSafetensorsIndexName) {
      std::filesystem::remove(entry.path());
    }
  }
}

// Note [Experts one by one in the checkpoint]
// The decoder holds a sparse layer's experts fused, as transformers 5.x does in memory
// (moe.h): mlp.experts.gate_up_proj [E, 2 I, H] and mlp.experts.down_proj [E, H, I]. The
// checkpoints on the Hub, and those transformers 5.x's save_pretrained writes (its
// conversion_mapping's WeightConverters run backwards), hold them one by one:
// mlp.experts.E.gate_proj.weight [I, H], up_proj, down_proj [H, I] (Mixtral:
// block_sparse_moe.experts.E.w1 (gate), w3 (up), w2 (down), and block_sparse_moe.gate
// for the router). Expert e's gate rows, then its up rows, are contiguous in the fused
// tensor's elements, as is its down matrix, so each per-expert tensor is one contiguous
// run of the fused parameter's elements: a SafetensorsSplit, read by each rank only where
// it overlaps the rank's shards and written back piece by piece from the gathered unit,
// bit for bit. No renaming table beyond this: every other name is the module's own.
// gpt-oss's checkpoints hold its experts fused, as the decoder does (experts_transposed):
// read and written as they are.
struct ExpertNames {
  std::string block = "mlp", gate = "gate_proj", up = "up_proj", down = "down_proj";
  bool fused = false;  // on disk as in memory
};

// The decoder's config of `dir` (its config.json), if it has one.
std::optional<DecoderConfig> folder_config(const std::string& dir) {
  const std::filesystem::path config = std::filesystem::path(dir) / "config.json";
  if (!std::filesystem::exists(config)) return std::nullopt;
  return load_decoder_config(config.string());
}

// The names of the experts of a folder of `config` (Qwen's when it has none).
ExpertNames expert_names(const std::optional<DecoderConfig>& config) {
  if (config && config->experts_transposed) {
    ExpertNames fused;
    fused.fused = true;
    return fused;
  }
  if (!config || !config->block_sparse_moe_names) return {};
  return {"block_sparse_moe", "w1", "w3", "w2"};
}

// Mixtral: the block's name on disk.
SafetensorsRename rename_of(const ExpertNames& names) {
  if (names.block == "mlp") return nullptr;
  return [block = "." + names.block + "."](const std::string& fqn) {
    const size_t at = fqn.find(".mlp.");
    return at == std::string::npos ? fqn : fqn.substr(0, at) + block + fqn.substr(at + 5);
  };
}

SafetensorsSplit split_of(const ExpertNames& names) {
  return [names](const std::string& fqn, c10::IntArrayRef shape) {
    std::vector<SafetensorsPiece> pieces;
    static constexpr char kFused[] = ".mlp.experts.";
    const size_t at = fqn.rfind(kFused);
    if (names.fused || at == std::string::npos || shape.size() != 3) return pieces;
    const std::string tensor = fqn.substr(at + sizeof(kFused) - 1);
    const std::string prefix = fqn.substr(0, at) + "." + names.block + ".experts.";
    const auto piece = [&](int64_t e, const std::string& name, int64_t rows) {
      pieces.push_back({prefix + std::to_string(e) + "." + name + ".weight", {rows, shape[2]}});
    };
    for (int64_t e = 0; e < shape[0]; ++e) {
      if (tensor == "gate_up_proj") {
        piece(e, names.gate, shape[1] / 2);
        piece(e, names.up, shape[1] / 2);
      } else if (tensor == "down_proj") {
        piece(e, names.down, shape[1]);
      }
    }
    return pieces;
  };
}

// Note [NF4 base weights in an HF folder]
// A LoraLinear whose base weight is stored in NF4 (lora::LoraLinearImpl::store_weight_nf4:
// the trainer's --quantize=nf4) holds five parameters where the folder holds one weight:
// "<module>.weight" (the codes), "<module>.weight_absmax", "..._nested_absmax",
// "..._nested_quant_map" and "..._nested_offset". Reading, each of them is derived from the
// folder's "<module>.weight" (LoadSafetensorsOptions::derive): every rank reads that weight
// whole, one weight at a time, quantizes it (lora::nf4_weight_entries, bit for bit
// bitsandbytes' quantize_4bit: the whole tensor's absmax mean enters the double
// quantization, so a rank cannot quantize its slice alone) and keeps the bytes of its
// shards. Writing, the codes entry is written as "<module>.weight" dequantized (fp32, then
// the folder's dtype: bitsandbytes' dequantize_4bit, plus the LoRA update when merging) and
// the other four are left out, so OUT/hf holds the weights the run computed with, in the
// folder's layout. (PEFT's merge_and_unload on a 4-bit base instead quantizes the merged
// weight again, to 4 bits.)
constexpr const char* kNf4Aux[] = {"weight_absmax", "weight_nested_absmax",
                                   "weight_nested_quant_map", "weight_nested_offset"};

// The module and the parameter of an entry of an NF4 module ("weight" or one of kNf4Aux),
// if it is one.
std::optional<std::pair<std::string, std::string>> nf4_entry(
    const std::map<std::string, std::vector<int64_t>>& modules, const std::string& fqn) {
  const size_t dot = fqn.rfind('.');
  if (dot == std::string::npos || !modules.count(fqn.substr(0, dot))) return std::nullopt;
  const std::string name = fqn.substr(dot + 1);
  if (name != "weight" &&
      std::find(std::begin(kNf4Aux), std::end(kNf4Aux), name) == std::end(kNf4Aux)) {
    return std::nullopt;
  }
  return std::make_pair(fqn.substr(0, dot), name);
}

// Note [A bitsandbytes 4-bit folder]
// transformers' save_pretrained of a model loaded with BitsAndBytesConfig(load_in_4bit=True,
// bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True) (the Hub's "*-bnb-4bit"
// folders) holds six tensors for each Linear it quantized, where a float folder holds
// "<module>.weight" [out, in] (n = out x in elements, blocks = ceil(n / 64)):
//   <module>.weight                                uint8 [ceil(n / 2), 1]: the 4-bit codes
//   <module>.weight.absmax                         uint8 [blocks]: each block's absmax, 8 bits
//   <module>.weight.nested_absmax                  float32 [ceil(blocks / 256)]
//   <module>.weight.nested_quant_map               float32 [256]: the absmax bytes' values
//   <module>.weight.quant_map                      float32 [16]: the NF4 code table
//   <module>.weight.quant_state.bitsandbytes__nf4  uint8: the JSON of the rest (quant_type,
//       blocksize, dtype, shape, nested_blocksize, nested_dtype, nested_offset)
// Those are the parameters of fsdp's NF4 base (lora::LoraLinearImpl::store_weight_nf4), read
// as they are, no float copy of the 4-bit bytes ever made: the codes and the absmax bytes by
// each rank for its shards only (a one-piece SafetensorsSplit, a rename); nested_absmax and
// nested_quant_map whole (a few bytes: LoadSafetensorsOptions::derive), their float32
// values taken as their bytes (Note [NF4 scales as bytes] in fsdp/lora/lora.cc);
// weight_nested_offset from the JSON's nested_offset (a float32 written as a decimal that
// reads back exactly). The quant_map feeds no parameter (LoadSafetensorsOptions::unread):
// it must be fsdp's NF4 table. Which modules are quantized is the folder's to say (a weight
// with a quant_state beside it): lm_head never is, and some folders (unsloth's "dynamic"
// ones) leave some layers' projections in the folder's dtype. Every quantized module is
// checked before any weight is read (check_nf4_weight): the JSON against fsdp's NF4 (so
// FP4, another blocksize or no double quantization is refused by name rather than by a size
// mismatch later) and against the module's shape and the folder's dtype, then each
// tensor's dtype and shape, then the quant_map's values. Writing, the weights are written
// dequantized, as any NF4 base's (Note [NF4 base weights in an HF folder]), and config.json
// without its quantization_config.
constexpr char kQuantState[] = ".quant_state.bitsandbytes__";  // after the weight's name
// The most bytes of a quant_state's JSON (transformers writes about 170).
constexpr int64_t kMaxQuantStateBytes = 4096;
constexpr char kNf4Folder[] =
    "fsdp reads bitsandbytes' 4-bit NF4 with double quantization (blocksize 64, "
    "nested_blocksize 256), as transformers saves a model loaded with "
    "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", "
    "bnb_4bit_use_double_quant=True)";

// The weights `checkpoint` holds in bitsandbytes' 4-bit layout, by their names there, with
// the quant type their quant_state's name gives ("nf4", "fp4").
std::map<std::string, std::string> bnb_4bit_weights(const SafetensorsCheckpoint& checkpoint) {
  std::map<std::string, std::string> weights;
  for (const std::string& name : checkpoint.names()) {
    const size_t at = name.find(kQuantState);
    if (at != std::string::npos) {
      weights.emplace(name.substr(0, at), name.substr(at + sizeof(kQuantState) - 1));
    }
  }
  return weights;
}

// Note [Tensors kept in fp32]
// transformers keeps DeepSeek-V3's router bias (mlp.gate.e_score_correction_bias) in fp32
// in every checkpoint, a bf16 one included (DeepseekV3PreTrainedModel's
// _keep_in_fp32_modules_strict), and the decoder holds it in fp32 whatever its dtype
// (moe.h). It is therefore no part of the folder's one dtype (hf_weights_dtype), and a save
// writes it in fp32 (SaveSafetensorsOptions::keep_dtype), bit for bit.
bool kept_in_fp32(const std::string& name) {
  return absl::EndsWith(name, ".e_score_correction_bias");
}

// Note [Multi-token prediction layers]
// DeepSeek-V3's checkpoints may hold its multi-token prediction layers after the decoder's
// (num_nextn_predict_layers of them: model.layers.61.* in DeepSeek-V3's bf16 conversions),
// which transformers neither builds nor reads (DeepseekV3PreTrainedModel's
// _keys_to_ignore_on_load_unexpected) nor writes. The reader leaves their tensors unread
// and a save leaves them out, as save_pretrained does.
bool mtp_tensor(const std::optional<DecoderConfig>& config, const std::string& name) {
  if (!config || config->mtp_layers == 0) return false;
  absl::string_view rest = name;
  int64_t layer = 0;
  return absl::ConsumePrefix(&rest, "model.layers.") &&
         absl::SimpleAtoi(rest.substr(0, rest.find('.')), &layer) &&
         layer >= config->num_hidden_layers &&
         layer < config->num_hidden_layers + config->mtp_layers;
}

// Note [A tied head stored anyway]
// A folder whose config ties the head to the embeddings (tie_word_embeddings) may still
// hold lm_head.weight (some Qwen and Llama conversions on the Hub). transformers 5.x ties
// them when the stored head equals the embeddings, leaving it unread; when it differs,
// transformers loads the two untied, against the config (with a warning). The reader
// takes the first case as transformers does, once the stored head's shape and values are
// checked against the embeddings' (both read in blocks of 1 M elements: no whole tensor
// is held), and refuses the second, saying how to make the folder say what it holds. The
// model holds no head of its own (decoder.h), so a save writes none, as save_pretrained
// does.
constexpr char kHeadName[] = "lm_head.weight";

bool stored_tied_head(const std::optional<DecoderConfig>& config, const std::string& name) {
  return config && config->tie_word_embeddings && name == kHeadName;
}

// Refuses a stored tied head whose shape, dtype or values are not the embeddings'.
void check_stored_tied_head(const DecoderConfig& config, const std::string& dir) {
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(dir);
  if (!checkpoint.contains(kHeadName)) return;
  constexpr char kEmbeddings[] = "model.embed_tokens.weight";
  const std::vector<int64_t> embeddings = {config.vocab_size, config.hidden_size};
  const SafetensorsTensorInfo& head = checkpoint.info(kHeadName);
  TORCH_CHECK(head.shape == embeddings, dir, ": tensor '", kHeadName, "' has shape ",
              c10::IntArrayRef(head.shape),
              " but config.json ties the head to the embeddings (tie_word_embeddings), of shape ",
              c10::IntArrayRef(embeddings),
              "; expected the head in that shape or no head (is config.json the folder's own?)");
  const auto untied = [&](const std::string& how) {
    TORCH_CHECK(false, dir,
                ": config.json ties the head to the embeddings (tie_word_embeddings) "
                "but the folder's '",
                kHeadName, "' ", how, " '", kEmbeddings,
                "', so transformers loads the two untied; set \"tie_word_embeddings\": false in "
                "config.json to train them untied, or remove '",
                kHeadName, "' to tie them");
  };
  if (!checkpoint.contains(kEmbeddings) || checkpoint.info(kEmbeddings).shape != head.shape ||
      checkpoint.info(kEmbeddings).dtype != head.dtype) {
    untied("is not stored like");
  }
  constexpr int64_t kBlock = int64_t{1} << 20;
  const int64_t numel = config.vocab_size * config.hidden_size;
  for (int64_t begin = 0; begin < numel; begin += kBlock) {
    const int64_t count = std::min(kBlock, numel - begin);
    // Bytes, not values: a NaN equals its own copy.
    if (!at::equal(checkpoint.read_range(kHeadName, begin, count).view(at::kByte),
                   checkpoint.read_range(kEmbeddings, begin, count).view(at::kByte))) {
      untied("differs from");
    }
  }
}

// hf_weights_dtype of an opened folder.
at::ScalarType weights_dtype(const SafetensorsCheckpoint& checkpoint, const std::string& dir) {
  const auto quantized = bnb_4bit_weights(checkpoint);
  std::string first;
  at::ScalarType dtype = at::kFloat;
  for (const std::string& name : checkpoint.names()) {
    const at::ScalarType found = checkpoint.info(name).dtype;
    const size_t state = name.find(".weight.");  // "<module>.weight.absmax", ...
    if (!c10::isFloatingType(found) || kept_in_fp32(name) ||
        (state != std::string::npos && quantized.count(name.substr(0, state + 7)))) {
      continue;
    }
    if (first.empty()) {
      first = name;
      dtype = found;
    }
    TORCH_CHECK(found == dtype, dir, ": tensor ", name, " is ", found, " but ", first, " is ",
                dtype, "; fsdp's decoder trains one dtype (convert the folder first)");
  }
  return dtype;
}

// "'NAME' in 'FILE'", for errors.
std::string tensor_in(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  return "'" + name + "' in '" + checkpoint.file_of(name).path() + "'";
}

std::string spec_string(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  return safetensors_dtype_name(dtype) + " [" + absl::StrJoin(shape, ", ") + "]";
}

// The nested_offset of a quant_state (`bytes`: the JSON bitsandbytes' QuantState.as_dict(
// packed=True) writes; `where` names it in errors), after checking that it describes fsdp's
// NF4 of a weight of `shape` dequantizing to `dtype`.
float nf4_nested_offset(const at::Tensor& bytes, const std::string& where,
                        const std::vector<int64_t>& shape, at::ScalarType dtype) {
  const at::Tensor text = bytes.contiguous();
  const nlohmann::json state = parse_untrusted_json(
      std::string_view(static_cast<const char*>(text.data_ptr()), text.numel()), where,
      "expected the JSON of bitsandbytes' quant_state");
  TORCH_CHECK(state.is_object(), where, ": expected a JSON object, found ", state.type_name());
  const auto field = [&](const char* name) -> const nlohmann::json& {
    const auto it = state.find(name);
    TORCH_CHECK(it != state.end(), where, ": \"", name, "\" is missing; ", kNf4Folder);
    return *it;
  };
  const auto expect = [&](const char* name, const nlohmann::json& supported) {
    TORCH_CHECK(field(name) == supported, where, ": \"", name, "\" = ", field(name).dump(),
                " is not supported: ", kNf4Folder);
  };
  expect("quant_type", "nf4");
  expect("blocksize", 64);
  TORCH_CHECK(state.contains("nested_blocksize"), where,
              ": no \"nested_blocksize\": the weight is not double quantized "
              "(bnb_4bit_use_double_quant=False); ",
              kNf4Folder);
  expect("nested_blocksize", 256);
  expect("nested_dtype", "float32");
  TORCH_CHECK(field("shape") == nlohmann::json(shape), where,
              ": \"shape\" = ", field("shape").dump(), " but the model's weight is [",
              absl::StrJoin(shape, ", "),
              "] (out_features, in_features); is config.json the folder's own?");
  static const std::map<std::string, at::ScalarType> kDtypes = {
      {"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf}};
  const nlohmann::json& dequantized = field("dtype");
  const auto known =
      dequantized.is_string() ? kDtypes.find(dequantized.get<std::string>()) : kDtypes.end();
  TORCH_CHECK(known != kDtypes.end() && known->second == dtype, where,
              ": \"dtype\" = ", dequantized.dump(), " but the folder's other floating tensors are ",
              dtype, "; fsdp's decoder trains one dtype");
  const nlohmann::json& offset = field("nested_offset");
  TORCH_CHECK(offset.is_number() && std::isfinite(offset.get<double>()), where,
              ": \"nested_offset\" = ", offset.dump(), ": expected a finite number");
  return offset.get<float>();
}

// Checks the 4-bit weight `weight` (its name in `checkpoint`; `quant_type` from its
// quant_state's name) against fsdp's NF4 of a weight of `shape` dequantizing to `dtype` (Note
// [A bitsandbytes 4-bit folder]): the quant_state's JSON, every tensor's dtype and shape, the
// quant_map's values. Reads the quant_state and the quant_map; returns the nested_offset.
float check_nf4_weight(const SafetensorsCheckpoint& checkpoint, const std::string& weight,
                       const std::string& quant_type, const std::vector<int64_t>& shape,
                       at::ScalarType dtype) {
  const std::string state = weight + kQuantState + quant_type;
  TORCH_CHECK(quant_type == "nf4", tensor_in(checkpoint, state),
              ": the weight is stored in bitsandbytes' 4-bit \"", quant_type,
              "\" (bnb_4bit_quant_type), not NF4; ", kNf4Folder);
  const SafetensorsTensorInfo& info = checkpoint.info(state);
  TORCH_CHECK(
      info.dtype == at::kByte && info.shape.size() == 1 && info.numel() <= kMaxQuantStateBytes,
      tensor_in(checkpoint, state), " is ", spec_string(info.dtype, info.shape),
      "; expected U8 [at most ", kMaxQuantStateBytes, "]: the bytes of a JSON object");
  const float offset =
      nf4_nested_offset(checkpoint.read(state), tensor_in(checkpoint, state), shape, dtype);
  const auto check = [&](const std::string& name, at::ScalarType want_dtype,
                         const std::vector<int64_t>& want_shape, const std::string& what) {
    TORCH_CHECK(checkpoint.contains(name), "'", name, "' (", what, ") is missing beside ",
                tensor_in(checkpoint, state), "; ", kNf4Folder);
    const SafetensorsTensorInfo& found = checkpoint.info(name);
    TORCH_CHECK(found.dtype == want_dtype && found.shape == want_shape, tensor_in(checkpoint, name),
                " is ", spec_string(found.dtype, found.shape), "; expected ",
                spec_string(want_dtype, want_shape), " (", what, ")");
  };
  Nf4Tensor q;
  q.shape = shape;
  const std::string of = " of bitsandbytes' NF4 of a [" + absl::StrJoin(shape, ", ") + "] weight";
  check(weight, at::kByte, {(q.numel() + 1) / 2, 1}, "the 4-bit codes, two a byte," + of);
  check(weight + ".absmax", at::kByte, {q.blocks()}, "each block's absmax, 8 bits," + of);
  check(weight + ".nested_absmax", at::kFloat,
        {(q.blocks() + q.nested_blocksize - 1) / q.nested_blocksize},
        "the absmax of each 256 absmax," + of);
  check(weight + ".nested_quant_map", at::kFloat, {256}, "the absmax bytes' values," + of);
  check(weight + ".quant_map", at::kFloat, {16}, "the NF4 code table");
  TORCH_CHECK(at::equal(checkpoint.read(weight + ".quant_map"), nf4_code()),
              tensor_in(checkpoint, weight + ".quant_map"),
              " is not the NF4 code table (bitsandbytes' get_4bit_type(\"nf4\")), so the weight "
              "would dequantize to other values; ",
              kNf4Folder);
  return offset;
}

// The modules of `candidates` (cleaned FQN -> weight shape [out, in]) whose weight
// `checkpoint` (of `dir`, with names as `rename` gives them) holds in bitsandbytes' 4-bit
// layout, each checked (check_nf4_weight): FQN -> its nested_offset. Throws naming a 4-bit
// weight of the folder that is no candidate, saying that the model holds `missing`.
std::map<std::string, float> bnb_nf4_modules_of(
    const SafetensorsCheckpoint& checkpoint, const std::string& dir,
    const std::map<std::string, std::vector<int64_t>>& candidates, const SafetensorsRename& rename,
    const std::string& missing) {
  std::map<std::string, std::string> quantized = bnb_4bit_weights(checkpoint);
  const at::ScalarType dtype = weights_dtype(checkpoint, dir);
  std::map<std::string, float> offsets;
  for (const auto& [fqn, shape] : candidates) {
    const auto it = quantized.find(rename ? rename(fqn + ".weight") : fqn + ".weight");
    if (it == quantized.end()) continue;
    offsets.emplace(fqn, check_nf4_weight(checkpoint, it->first, it->second, shape, dtype));
    quantized.erase(it);
  }
  TORCH_CHECK(quantized.empty(), dir, ": '", quantized.begin()->first,
              "' is stored in 4 bits (beside it: '", quantized.begin()->first, kQuantState,
              quantized.begin()->second, "') but the model holds ", missing);
  return offsets;
}

}  // namespace

at::ScalarType hf_weights_dtype(const std::string& dir) {
  return weights_dtype(SafetensorsCheckpoint::open(dir), dir);
}

std::vector<std::string> store_hf_nf4_weights(torch::nn::Module& model, const std::string& dir) {
  std::map<std::string, lora::LoraLinearImpl*> layers;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto* layer = dynamic_cast<lora::LoraLinearImpl*>(item.value().get())) {
      const std::string fqn = clean_tensor_name(item.key());
      layers.emplace(fqn, layer);
      shapes.emplace(
          fqn, std::vector<int64_t>{layer->options.out_features(), layer->options.in_features()});
    }
  }
  // See Note [A bitsandbytes 4-bit folder].
  const auto stored = bnb_nf4_modules_of(
      SafetensorsCheckpoint::open(dir), dir, shapes, rename_of(expert_names(folder_config(dir))),
      "no LoraLinear of that name; is config.json the folder's own?");
  std::vector<std::string> fqns;
  for (const auto& item : stored) {
    layers.at(item.first)->store_weight_nf4();
    fqns.push_back(item.first);
  }
  return fqns;
}

void load_hf_weights(FullyShardedRoot& model, const std::string& dir) {
  const std::optional<DecoderConfig> config = folder_config(dir);
  // See Note [Experts one by one in the checkpoint].
  const ExpertNames names = expert_names(config);
  const SafetensorsRename rename = rename_of(names);
  const auto name_of = [rename](const std::string& fqn) { return rename ? rename(fqn) : fqn; };
  // See Note [NF4 base weights in an HF folder]: the last weight quantized, by source name.
  const auto modules = lora::nf4_modules(model.root_module());
  auto quantized = std::make_shared<std::pair<std::string, lora::StateDict>>();
  // See Note [A bitsandbytes 4-bit folder]: the NF4 modules the folder holds so, read as
  // they are (the others are quantized as they are read), and their quant_maps.
  std::map<std::string, float> stored;
  std::set<std::string> quant_maps;
  if (!modules.empty() || (config && config->load_in_4bit)) {
    stored = bnb_nf4_modules_of(SafetensorsCheckpoint::open(dir), dir, modules, rename,
                                "no NF4 LoraLinear of that name to read it into; call "
                                "fsdp::models::store_hf_nf4_weights(model, dir) on the model "
                                "before wrapping it");
    for (const auto& item : stored) quant_maps.insert(name_of(item.first + ".weight.quant_map"));
  }
  const auto stored_entry = [&](const std::string& fqn, const char* name) {
    const auto entry = nf4_entry(modules, fqn);
    return entry && entry->second == name && stored.count(entry->first) > 0;
  };
  const SafetensorsDerive derive =
      [&](const std::string& fqn) -> c10::optional<SafetensorsDerived> {
    const auto entry = nf4_entry(modules, fqn);
    if (!entry) return c10::nullopt;
    const std::string weight = name_of(entry->first + ".weight");
    if (const auto offset = stored.find(entry->first); offset != stored.end()) {
      if (entry->second == "weight_nested_absmax" || entry->second == "weight_nested_quant_map") {
        // weight.nested_absmax, weight.nested_quant_map: float32 values taken as their bytes.
        return SafetensorsDerived{
            weight + "." + entry->second.substr(7),
            [](const at::Tensor& value) { return value.contiguous().view(at::kByte); }};
      }
      if (entry->second == "weight_nested_offset") {
        // The quant_state's nested_offset, read when the weight was checked.
        return SafetensorsDerived{weight + kQuantState + "nf4",
                                  [value = offset->second](const at::Tensor&) {
                                    return at::tensor({value}).view(at::kByte);
                                  }};
      }
      return c10::nullopt;  // the codes and the absmax bytes: read by range (split, rename)
    }
    return SafetensorsDerived{weight, [=](const at::Tensor& value) {
                                if (quantized->first != weight) {
                                  quantized->first = weight;
                                  quantized->second = lora::StateDict();
                                  for (auto& [name, t] : lora::nf4_weight_entries(value)) {
                                    quantized->second.insert(name, t);
                                  }
                                }
                                return quantized->second[entry->second];
                              }};
  };
  const SafetensorsSplit experts = split_of(names);
  // See Note [A tied head stored anyway].
  if (config && config->tie_word_embeddings) check_stored_tied_head(*config, dir);
  load_safetensors(
      model, dir,
      LoadSafetensorsOptions()
          .skip(lora::is_adapter_key)
          .cast_floating(true)
          .rename([&](const std::string& fqn) {
            return stored_entry(fqn, "weight_absmax")
                       ? name_of(fqn.substr(0, fqn.size() - 7) + ".absmax")  // less "_absmax"
                       : name_of(fqn);
          })
          .split([&](const std::string& fqn, c10::IntArrayRef shape) {
            if (!stored_entry(fqn, "weight")) return experts(fqn, shape);
            return std::vector<SafetensorsPiece>{{name_of(fqn), {shape[0], 1}}};
          })
          .derive(modules.empty() ? nullptr : derive)
          .unread([&quant_maps, &config](const std::string& name) {
            // See Note [Multi-token prediction layers] and Note [A tied head stored anyway].
            return quant_maps.count(name) > 0 || mtp_tensor(config, name) ||
                   stored_tied_head(config, name);
          }));
}

void save_hf_folder(FullyShardedRoot& model, const std::string& from_dir,
                    const std::string& out_dir, int64_t max_shard_size) {
  TORCH_CHECK(max_shard_size > 0, "max_shard_size must be positive, got ", max_shard_size);
  if (model.communicator().rank() == 0) prepare_hf_folder(from_dir, out_dir);
  const ExpertNames names = expert_names(folder_config(from_dir));
  save_safetensors(model, out_dir,
                   SaveSafetensorsOptions()
                       .max_shard_size(max_shard_size)
                       .dtype(hf_weights_dtype(from_dir))
                       .keep_dtype(kept_in_fp32)
                       .rename(rename_of(names))
                       .split(split_of(names)));
}

// Note [Merging LoRA adapters one unit at a time]
// save_safetensors gathers a unit's flat parameters together (the frozen one, holding
// the base weights, with the trainable one, holding the adapters), skips the adapter
// entries, and hands each base weight with its unit's gathered entries to the transform
// below, which returns weight + B A x scaling when the unit holds that module's lora_A
// and lora_B. The adapters are copied on rank 0 as they go by (r (in + out) elements per
// module), so the adapter file needs no second gather. The merged values are those of
// fsdp::lora::merged_state_dict over a full state dict, computed one weight at a time.
void save_lora_hf_folders(FullyShardedRoot& model, const lora::LoraConfig& config,
                          const std::string& from_dir, const std::string& out_dir,
                          const std::string& adapter_dir, int64_t max_shard_size) {
  TORCH_CHECK(max_shard_size > 0, "max_shard_size must be positive, got ", max_shard_size);
  const bool lead = model.communicator().rank() == 0;
  if (lead) prepare_hf_folder(from_dir, out_dir);
  lora::StateDict adapters;  // rank 0: copies, in module order
  const ExpertNames names = expert_names(folder_config(from_dir));
  const auto modules =
      lora::nf4_modules(model.root_module());  // See Note [NF4 base weights in an HF folder]
  const auto merge = [&](const std::string& fqn, const at::Tensor& stored,
                         const torch::OrderedDict<std::string, at::Tensor>& unit) {
    static constexpr char kWeight[] = ".weight";
    if (!absl::EndsWith(fqn, kWeight)) return stored;
    const std::string module = fqn.substr(0, fqn.size() - (sizeof(kWeight) - 1));
    at::Tensor value = stored;
    if (const auto nf4 = modules.find(module); nf4 != modules.end()) {
      const auto aux = [&](const char* name) { return unit[module + "." + name]; };
      value = lora::dequantize_nf4_entries(nf4->second, at::kFloat, stored, aux(kNf4Aux[0]),
                                           aux(kNf4Aux[1]), aux(kNf4Aux[2]), aux(kNf4Aux[3]));
    }
    const at::Tensor* a = unit.find(module + ".lora_A.weight");
    const at::Tensor* b = unit.find(module + ".lora_B.weight");
    if (a == nullptr) return value;
    TORCH_INTERNAL_ASSERT(b != nullptr, "'", module, "' has lora_A but no lora_B in its unit");
    adapters.insert(module + ".lora_A.weight", a->clone());
    adapters.insert(module + ".lora_B.weight", b->clone());
    return lora::merged_weight(module, value, *a, *b, config);
  };
  save_safetensors(
      model, out_dir,
      SaveSafetensorsOptions()
          .max_shard_size(max_shard_size)
          .dtype(hf_weights_dtype(from_dir))
          .keep_dtype(kept_in_fp32)
          .skip([&modules](const std::string& fqn) {
            const auto nf4 = nf4_entry(modules, fqn);
            return lora::is_adapter_key(fqn) || (nf4 && nf4->second != "weight");
          })
          .transform(merge)
          .written_as([&modules](const std::string& fqn) -> c10::optional<SafetensorsWrittenAs> {
            const auto nf4 = nf4_entry(modules, fqn);
            if (!nf4 || nf4->second != "weight") return c10::nullopt;
            return SafetensorsWrittenAs{modules.at(nf4->first), at::kFloat};
          })
          .rename(rename_of(names))
          .split(split_of(names)));
  if (lead) lora::save_adapter(adapters, config, adapter_dir);
}

void prepare_hf_folder(const std::string& from_dir, const std::string& out_dir) {
  std::filesystem::create_directories(out_dir);
  remove_old_weights(out_dir);
  copy_model_files(from_dir, out_dir);
}

int64_t parse_shard_size(const std::string& text, std::string_view flag) {
  static const std::pair<const char*, int64_t> kUnits[] = {
      {"KiB", int64_t{1} << 10}, {"MiB", int64_t{1} << 20},
      {"GiB", int64_t{1} << 30}, {"KB", 1000},
      {"MB", 1000 * 1000},       {"GB", 1000 * 1000 * 1000},
  };
  std::string number = text;
  int64_t unit = 1;
  for (const auto& [suffix, bytes] : kUnits) {
    if (absl::EndsWithIgnoreCase(text, suffix)) {  // "5gib", "5gB" too, as save_pretrained
      number = text.substr(0, text.size() - std::string(suffix).size());
      unit = bytes;
      break;
    }
  }
  // save_pretrained reads "5gb" and "5Gb" as gigabits (625000000 bytes): too easily
  // mistaken for bytes to take either way.
  TORCH_CHECK(unit % 1000 != 0 || text.back() != 'b', flag, "=", text,
              ": a final lowercase b means bits to save_pretrained; write ", number,
              absl::AsciiStrToUpper(text.substr(number.size())), " for bytes");
  int64_t value = 0;
  TORCH_CHECK(absl::SimpleAtoi(number, &value) && value > 0 && value <= INT64_MAX / unit, flag, "=",
              text,
              ": expected a positive size in bytes, or with KB, MB, GB, KiB, MiB or GiB "
              "(e.g. 5GB)");
  return value * unit;
}

}  // namespace fsdp::models
