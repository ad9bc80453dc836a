// LoRA (Hu et al., 2021) for LibTorch models, as Hugging Face PEFT's LoraModel does it:
// a low-rank update lora_B(lora_A(dropout(x))) x (lora_alpha / r) added to chosen
// Linear layers, whose base weights are frozen, so that only the adapters train. Works
// with FullyShardedDataParallel: a unit then mixes frozen and trainable parameters
// (fully_sharded.h, "Frozen parameters"), and only the adapters are reduced and stepped.
// Saving (adapter_file.h) writes PEFT's layout (adapter_model.safetensors +
// adapter_config.json), which peft.PeftModel.from_pretrained loads, and merging gives
// the full model's weights.
//
//   // The model holds fsdp::lora::LoraLinear where it would hold torch::nn::Linear
//   // (same parameters and names: a plain Linear until an adapter is added).
//   auto net = std::make_shared<MyLlama>(config);           // q_proj, v_proj: LoraLinear
//   fsdp::lora::LoraConfig lora;
//   lora.r(8).lora_alpha(16).target_modules({"q_proj", "v_proj"});
//   fsdp::lora::apply_lora(*net, lora);                     // adds adapters, freezes the rest
//   fsdp::FullyShardedDataParallel<MyLlama> model(net, options);
//   ... train with model->parameters() (the adapters' flat shards) ...
//   fsdp::StateDict full = fsdp::full_state_dict(*model, {});  // every rank calls it
//   if (rank == 0) fsdp::lora::save_adapter(full, lora, "out/adapter");  // adapter_file.h
//   fsdp::StateDict merged = fsdp::lora::merged_state_dict(full, lora);  // W + s B A
//
// Names. A LoraLinear's base parameters keep a Linear's names ("<fqn>.weight",
// "<fqn>.bias"); its adapter adds "<fqn>.lora_A.weight" (r x in_features) and
// "<fqn>.lora_B.weight" (out_features x r). In the adapter file they are
// "base_model.model.<fqn>.lora_A.weight" / "...lora_B.weight", as PEFT's save_pretrained
// writes them (PeftModel's own names carry the adapter name "default" and
// "base_layer"; the saved file has neither).
//
// Threading: none of its own; modules follow LibTorch's rules. Errors: c10::Error saying
// what was expected, what was found and what to do.
#ifndef FSDP_LORA_LORA_H_
#define FSDP_LORA_LORA_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include "fsdp/core/stored_weight.h"

namespace fsdp::lora {

// Cleaned FQN -> tensor (the same type as fsdp::StateDict in fsdp/state/state_dict.h).
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

// PyTorch PEFT: peft.LoraConfig (the fields it saves that this implementation uses;
// bias "none", no rsLoRA, no DoRA, fan_in_fan_out false).
struct LoraConfig {
  // The rank r of the update (>= 1).
  TORCH_ARG(int64_t, r) = 8;
  // The update is scaled by lora_alpha / r (PEFT: scaling).
  TORCH_ARG(double, lora_alpha) = 8;
  // Dropout on the adapter's input, in [0, 1); only in training mode.
  TORCH_ARG(double, lora_dropout) = 0.0;
  // Module names: a LoraLinear is adapted if its FQN equals one of them or ends with
  // "." + one of them (PEFT's matching of a list: "q_proj" adapts
  // "model.layers.0.self_attn.q_proj").
  TORCH_ARG(std::vector<std::string>, target_modules);
  // Instead of target_modules: a regular expression (ECMAScript) the whole FQN must
  // match (PEFT: target_modules given as one string, re.fullmatch).
  TORCH_ARG(std::string, target_regex);
  // Written to adapter_config.json (PEFT uses it to find the base model).
  TORCH_ARG(std::string, base_model_name_or_path);
  // adapter_config.json's task_type ("CAUSAL_LM" makes PEFT build a
  // PeftModelForCausalLM; empty: null).
  TORCH_ARG(std::string, task_type) = "CAUSAL_LM";
  // Adapters of a float16 or bfloat16 base weight are made in float32, as PEFT's
  // get_peft_model(autocast_adapter_dtype=True) does by default: the adapters, their
  // gradients and optimizer state stay in full precision while the frozen base keeps its
  // 16-bit size. false: the adapters take the base weight's dtype.
  TORCH_ARG(bool, autocast_adapter_dtype) = true;

 public:
  double scaling() const { return lora_alpha_ / static_cast<double>(r_); }
};

// A Linear layer (y = x W^T + b; W: out_features x in_features) that can carry one LoRA
// adapter: then y = x W^T + b + lora_B(lora_A(lora_dropout(x))) x scaling. Without an
// adapter it is exactly torch::nn::Linear, with the same parameter names and
// initialisation. PyTorch PEFT: peft.tuners.lora.Linear around an nn.Linear.
class LoraLinearImpl : public torch::nn::Module {
 public:
  LoraLinearImpl(int64_t in_features, int64_t out_features)
      : LoraLinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  // weight and bias are created with `tensor_options` (default: the CPU, the default
  // dtype) and initialised by reset_parameters(), except on c10::kMeta, where they have a
  // shape and a dtype only (fsdp/core/fully_sharded.h, "Models built on the meta
  // device": FullyShardedRoot::init_parameters or a checkpoint reader gives them values).
  explicit LoraLinearImpl(const torch::nn::LinearOptions& options,
                          at::TensorOptions tensor_options = {});

  // input: (*, in_features); output: (*, out_features), in the base output's dtype. An
  // adapter of another dtype than the input (float32 adapters beside a bfloat16 base)
  // gets the input cast to its dtype and its update cast back, as PEFT's Linear.forward.
  at::Tensor forward(const at::Tensor& input);

  // torch::nn::Linear's initialisation of weight and bias, in place: weight
  // kaiming_uniform_ with a = sqrt(5), bias uniform in +-1 / sqrt(in_features). Draws from
  // the default generator; leaves the adapter alone. PyTorch: nn.Linear.reset_parameters.
  void reset_parameters();

  // Adds the adapter: lora_A (r x in_features, kaiming_uniform_ with a = sqrt(5), as
  // PEFT's init_lora_weights=True), lora_B (out_features x r, zeros: the layer's output
  // is unchanged until it trains), both in the base weight's dtype (float32 for a 16-bit
  // one with config.autocast_adapter_dtype) on its device (on the
  // CPU when the base weight is on c10::kMeta: the adapter is small and gets its values
  // now, so a layer built on the meta device gets the adapter one built on the CPU gets
  // from the same generator state) and requiring grad; freezes weight and bias. Draws
  // from the default generator. Throws if the layer has an adapter already, r < 1, or
  // lora_dropout is outside [0, 1).
  void add_adapter(const LoraConfig& config);
  bool has_adapter() const { return !lora_A.is_empty(); }

  // QLoRA's base: stores the base weight in NF4 (fsdp/formats/nf4.h: bitsandbytes'
  // quantize_4bit, blocks of 64, double quantization), frozen. `weight` becomes the packed
  // 4-bit codes (uint8 [ceil(out_features x in_features / 2)]) and weight_absmax (uint8
  // [blocks]), weight_nested_absmax (float32 [ceil(blocks / 256)]), weight_nested_quant_map
  // (float32 [256]) and weight_nested_offset (float32 [1]) join it as frozen parameters, the
  // float32 ones held as their bytes (uint8, 4 a value, so that mixed precision never casts
  // them: Note [NF4 scales as bytes] in lora.cc): what FSDP shards and all-gathers, byte
  // for byte (about 4.13 bits a weight). forward() then multiplies by the
  // weight dequantized in the input's dtype right before use, and again in backward, never
  // held in between (fsdp::stored_linear, fsdp/core/stored_weight.h). Call it
  // before or after add_adapter. On c10::kMeta the parameters get their shapes only, for a
  // reader to fill (nf4_weight_entries below). PyTorch: bitsandbytes'
  // Linear4bit(quant_type="nf4", compress_statistics=True) under PEFT's lora.Linear4bit.
  // Throws c10::Error for a non-floating weight or if the weight is stored already.
  void store_weight_nf4();
  bool stores_weight() const { return stored_weight_ != nullptr; }
  // The base weight [out_features, in_features] in `dtype`: `weight` cast, or the NF4
  // weight dequantized (bit for bit bitsandbytes' dequantize_4bit).
  at::Tensor dense_weight(c10::ScalarType dtype) const;
  // lora_alpha / r of the adapter (0 without one).
  double scaling() const { return scaling_; }
  // The update the adapter adds to the weight: lora_B.weight @ lora_A.weight x scaling
  // (out_features x in_features). Throws without an adapter.
  at::Tensor delta_weight() const;

  void pretty_print(std::ostream& stream) const override;

  torch::nn::LinearOptions options;
  at::Tensor weight;  // out_features x in_features
  at::Tensor bias;    // out_features, or undefined (options.bias(false))
  torch::nn::Linear lora_A{nullptr};
  torch::nn::Linear lora_B{nullptr};
  torch::nn::Dropout lora_dropout{nullptr};
  // store_weight_nf4's quantization state (undefined until then).
  at::Tensor weight_absmax, weight_nested_absmax, weight_nested_quant_map, weight_nested_offset;

 private:
  double scaling_ = 0;
  c10::intrusive_ptr<StoredWeight> stored_weight_;
};
TORCH_MODULE(LoraLinear);

// The parameters LoraLinearImpl::store_weight_nf4 makes of `weight` (floating [out, in],
// with values), by their names in the layer: "weight" (the codes), "weight_absmax",
// "weight_nested_absmax", "weight_nested_quant_map", "weight_nested_offset". Bit for bit
// bitsandbytes' quantize_4bit(quant_type="nf4", compress_statistics=True). What a reader
// copies each rank's slices from when it quantizes a checkpoint's weight as it reads it
// (models/hf_checkpoint.h).
std::vector<std::pair<std::string, at::Tensor>> nf4_weight_entries(const at::Tensor& weight);
// The weight of `shape` in `dtype` that store_weight_nf4's parameters (these five, in the
// order above) stand for: bitsandbytes' dequantize_4bit.
at::Tensor dequantize_nf4_entries(const std::vector<int64_t>& shape, at::ScalarType dtype,
                                  const at::Tensor& codes, const at::Tensor& absmax,
                                  const at::Tensor& nested_absmax, const at::Tensor& nested_code,
                                  const at::Tensor& offset);

// The LoraLinears under `root` whose base weight is stored in NF4 (store_weight_nf4): cleaned
// module FQN -> the weight's shape [out_features, in_features].
std::map<std::string, std::vector<int64_t>> nf4_modules(const torch::nn::Module& root);

// Whether `fqn` (a module's cleaned FQN) is a target of `config` (see target_modules and
// target_regex). Throws if the config gives both or neither.
bool is_target(const std::string& fqn, const LoraConfig& config);

// PEFT's get_peft_model for LoRA: adds an adapter (LoraLinearImpl::add_adapter) to every
// LoraLinear in `model` whose cleaned FQN is a target, and freezes every other parameter
// of `model` (requires_grad = false). Call it before wrapping the model in FSDP. Returns
// the adapted modules' FQNs in pre-order. Throws, naming the FQN, if a target is a
// torch::nn::Linear (it cannot take an adapter: use LoraLinear in the model) or already
// has an adapter; throws if nothing matches, listing the model's LoraLinear FQNs.
std::vector<std::string> apply_lora(torch::nn::Module& model, const LoraConfig& config);

// Whether a state-dict key is an adapter parameter ("...lora_A.weight",
// "...lora_B.weight").
bool is_adapter_key(const std::string& key);

// The adapter entries of a full state dict of the model (full_state_dict, or
// module_state_dict of an unwrapped model) under the names PEFT saves:
// "base_model.model." + key. The tensors are shared, not copied. Throws if there is none.
StateDict adapter_state_dict(const StateDict& state_dict);

// The base weight of LoraLinear `module` (its FQN, for errors) with its adapter merged
// in: weight + lora_B @ lora_A x config.scaling(), computed in float32 and cast back to
// the weight's dtype (PEFT: merge). weight [out, in], lora_A [r, in], lora_B [out, r], on
// any device (the result on the weight's). Throws naming the module if the shapes
// disagree with each other or with config.r().
at::Tensor merged_weight(const std::string& module, const at::Tensor& weight,
                         const at::Tensor& lora_A, const at::Tensor& lora_B,
                         const LoraConfig& config);

// The model's full state dict with every adapter merged into its base weight
// (merged_weight; PEFT: merge_and_unload) and the adapter entries dropped: the keys of
// the model without adapters. Throws if a lora_A has no lora_B or base weight beside it,
// or the shapes disagree with config.r().
StateDict merged_state_dict(const StateDict& state_dict, const LoraConfig& config);

}  // namespace fsdp::lora

#endif  // FSDP_LORA_LORA_H_
