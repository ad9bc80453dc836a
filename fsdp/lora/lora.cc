#include "fsdp/lora/lora.h"

#include <cmath>
#include <map>
#include <ostream>
#include <regex>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include "fsdp/base/names.h"
#include "fsdp/formats/nf4.h"

namespace fsdp::lora {

LoraLinearImpl::LoraLinearImpl(const torch::nn::LinearOptions& options_,
                               at::TensorOptions tensor_options)
    : options(options_) {
  // torch::nn::Linear's parameters and initialisation (LinearImpl::reset_parameters).
  weight = register_parameter(
      "weight", at::empty({options.out_features(), options.in_features()}, tensor_options));
  if (options.bias()) {
    bias = register_parameter("bias", at::empty({options.out_features()}, tensor_options));
  }
  if (!tensor_options.device().is_meta()) reset_parameters();
}

void LoraLinearImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = options.in_features() > 0 ? 1.0 / std::sqrt(options.in_features()) : 0;
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

namespace {

// store_weight_nf4's weight: the module's packed tensors (its own at::Tensor handles, which
// FSDP points at the gathered values) dequantized on use.
class Nf4Weight : public StoredWeight {
 public:
  Nf4Weight(std::vector<int64_t> shape, at::Tensor codes, at::Tensor absmax,
            at::Tensor nested_absmax, at::Tensor nested_code, at::Tensor offset)
      : shape_(std::move(shape)),
        codes_(std::move(codes)),
        absmax_(std::move(absmax)),
        nested_absmax_(std::move(nested_absmax)),
        nested_code_(std::move(nested_code)),
        offset_(std::move(offset)) {}

  at::Tensor unpack(c10::ScalarType dtype) const override {
    return dequantize_nf4_entries(shape_, dtype, codes_, absmax_, nested_absmax_, nested_code_,
                                  offset_);
  }
  std::vector<int64_t> shape() const override { return shape_; }

 private:
  std::vector<int64_t> shape_;
  at::Tensor codes_, absmax_, nested_absmax_, nested_code_, offset_;
};

}  // namespace

namespace {

// A float32 tensor as the bytes it is stored in (Note [NF4 scales as bytes]).
at::Tensor as_bytes(const at::Tensor& values) { return values.contiguous().view(at::kByte); }

// ... and back; a copy, since a view of other elements than 4-byte aligned ones (a slice of
// a gathered flat parameter) cannot be viewed as float32 in place.
at::Tensor from_bytes(const at::Tensor& bytes) { return bytes.clone().view(at::kFloat); }

}  // namespace

// Note [NF4 scales as bytes]
// The double quantization's float32 tensors (nested_absmax, the nested code table, the
// offset) are stored values, exact as bitsandbytes computed them: cast to bf16 they would
// dequantize to other weights. FSDP casts floating parameters to MixedPrecision::
// param_dtype and gathers other dtypes as they are (Note [Flat parameters of several
// dtypes] in fsdp/core/flat_param.cc), so store_weight_nf4 registers them as their bytes
// (uint8, 4 per value) and views them back as float32 on use.
void LoraLinearImpl::store_weight_nf4() {
  TORCH_CHECK(!stores_weight(),
              "LoraLinear::store_weight_nf4: the weight is stored in NF4 already");
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()),
              "LoraLinear::store_weight_nf4: expected a floating weight, got ",
              weight.scalar_type());
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> shape = weight.sizes().vec();
  std::vector<std::pair<std::string, at::Tensor>> entries;
  if (weight.is_meta()) {  // shapes only: a reader fills them (nf4_weight_entries)
    Nf4Tensor q;
    q.shape = shape;
    const auto bytes = weight.options().requires_grad(false).dtype(at::kByte);
    const int64_t nested = (q.blocks() + q.nested_blocksize - 1) / q.nested_blocksize;
    entries = {{"weight", at::empty({(q.numel() + 1) / 2}, bytes)},
               {"weight_absmax", at::empty({q.blocks()}, bytes)},
               {"weight_nested_absmax", at::empty({4 * nested}, bytes)},
               {"weight_nested_quant_map", at::empty({4 * 256}, bytes)},
               {"weight_nested_offset", at::empty({4}, bytes)}};
  } else {
    entries = nf4_weight_entries(weight.detach());
  }
  weight.set_requires_grad(false);
  weight.set_data(entries[0].second);
  weight_absmax = register_parameter(entries[1].first, entries[1].second, /*requires_grad=*/false);
  weight_nested_absmax =
      register_parameter(entries[2].first, entries[2].second, /*requires_grad=*/false);
  weight_nested_quant_map =
      register_parameter(entries[3].first, entries[3].second, /*requires_grad=*/false);
  weight_nested_offset =
      register_parameter(entries[4].first, entries[4].second, /*requires_grad=*/false);
  stored_weight_ =
      c10::make_intrusive<Nf4Weight>(shape, weight, weight_absmax, weight_nested_absmax,
                                     weight_nested_quant_map, weight_nested_offset);
}

std::vector<std::pair<std::string, at::Tensor>> nf4_weight_entries(const at::Tensor& weight) {
  const Nf4Tensor q = quantize_nf4(weight, /*double_quant=*/true);
  return {{"weight", q.codes},
          {"weight_absmax", q.absmax},
          {"weight_nested_absmax", as_bytes(q.nested_absmax)},
          {"weight_nested_quant_map", as_bytes(q.nested_code)},
          {"weight_nested_offset", as_bytes(q.offset)}};
}

at::Tensor dequantize_nf4_entries(const std::vector<int64_t>& shape, at::ScalarType dtype,
                                  const at::Tensor& codes, const at::Tensor& absmax,
                                  const at::Tensor& nested_absmax, const at::Tensor& nested_code,
                                  const at::Tensor& offset) {
  Nf4Tensor q;
  q.shape = shape;
  q.dtype = dtype;
  q.codes = codes;
  q.absmax = absmax;
  q.nested_absmax = from_bytes(nested_absmax);
  q.nested_code = from_bytes(nested_code);
  q.offset = from_bytes(offset);
  return dequantize_nf4(q);
}

std::map<std::string, std::vector<int64_t>> nf4_modules(const torch::nn::Module& root) {
  std::map<std::string, std::vector<int64_t>> modules;
  const auto add = [&](const std::string& fqn, const torch::nn::Module& module) {
    const auto* layer = dynamic_cast<const LoraLinearImpl*>(&module);
    if (layer == nullptr || !layer->stores_weight()) return;
    modules.emplace(clean_tensor_name(fqn), std::vector<int64_t>{layer->options.out_features(),
                                                                 layer->options.in_features()});
  };
  add("", root);
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    add(item.key(), *item.value());
  }
  return modules;
}

at::Tensor LoraLinearImpl::dense_weight(c10::ScalarType dtype) const {
  return stores_weight() ? stored_weight_->unpack(dtype) : weight.to(dtype);
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& input) {
  at::Tensor output = stores_weight() ? stored_linear(input, stored_weight_, bias)
                                      : torch::nn::functional::linear(input, weight, bias);
  if (!has_adapter()) return output;
  // PEFT's Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling, x cast to the
  // adapter's dtype and the sum to the result's.
  const c10::ScalarType adapter = lora_A->weight.scalar_type();
  if (input.scalar_type() == adapter)
    return output + lora_B(lora_A(lora_dropout(input))) * scaling_;
  return (output + lora_B(lora_A(lora_dropout(input.to(adapter)))) * scaling_)
      .to(output.scalar_type());
}

void LoraLinearImpl::add_adapter(const LoraConfig& config) {
  TORCH_CHECK(!has_adapter(), "LoraLinear: the layer has an adapter already; add one adapter");
  TORCH_CHECK(config.r() >= 1, "LoraLinear: expected LoRA rank r >= 1, got ", config.r());
  TORCH_CHECK(config.lora_dropout() >= 0 && config.lora_dropout() < 1,
              "LoraLinear: expected lora_dropout in [0, 1), got ", config.lora_dropout());
  // On the CPU for a base weight on the meta device: see the header.
  const bool half = weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16;
  const auto like_weight =
      weight.options()
          .device(weight.is_meta() ? c10::Device(c10::kCPU) : weight.device())
          .dtype(half && config.autocast_adapter_dtype() ? at::kFloat : weight.scalar_type())
          .requires_grad(false);
  lora_dropout = register_module(
      "lora_dropout", torch::nn::Dropout(torch::nn::DropoutOptions(config.lora_dropout())));
  lora_A = register_module(
      "lora_A",
      torch::nn::Linear(torch::nn::LinearOptions(options.in_features(), config.r()).bias(false)));
  lora_B = register_module(
      "lora_B",
      torch::nn::Linear(torch::nn::LinearOptions(config.r(), options.out_features()).bias(false)));
  {
    torch::NoGradGuard no_grad;
    // PEFT's reset_lora_parameters with init_lora_weights=True.
    lora_A->weight.set_data(at::empty(lora_A->weight.sizes(), like_weight));
    torch::nn::init::kaiming_uniform_(lora_A->weight, std::sqrt(5.0));
    lora_B->weight.set_data(at::zeros(lora_B->weight.sizes(), like_weight));
  }
  weight.set_requires_grad(false);
  if (bias.defined()) bias.set_requires_grad(false);
  scaling_ = config.scaling();
}

at::Tensor LoraLinearImpl::delta_weight() const {
  TORCH_CHECK(has_adapter(), "LoraLinear::delta_weight: the layer has no adapter");
  return at::matmul(lora_B->weight, lora_A->weight) * scaling_;
}

void LoraLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::lora::LoraLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << options.bias();
  if (has_adapter()) stream << ", r=" << lora_A->options.out_features() << ", scaling=" << scaling_;
  stream << ")";
}

bool is_target(const std::string& fqn, const LoraConfig& config) {
  const bool by_names = !config.target_modules().empty();
  TORCH_CHECK(by_names != !config.target_regex().empty(),
              "LoraConfig: give target_modules (module names, e.g. {\"q_proj\", \"v_proj\"}) "
              "or target_regex, exactly one; got ",
              by_names ? "both" : "neither");
  if (!by_names) return std::regex_match(fqn, std::regex(config.target_regex()));
  for (const std::string& name : config.target_modules()) {
    if (fqn == name || absl::EndsWith(fqn, "." + name)) return true;
  }
  return false;
}

std::vector<std::string> apply_lora(torch::nn::Module& model, const LoraConfig& config) {
  std::vector<std::string> adapted, candidates;
  std::vector<LoraLinearImpl*> targets;
  // The model itself too (named_modules() lists it only through a shared_ptr, which a
  // module applying LoRA in its constructor does not have yet).
  std::vector<std::pair<std::string, torch::nn::Module*>> modules = {{"", &model}};
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    modules.emplace_back(clean_tensor_name(item.key()), item.value().get());
  }
  for (const auto& [fqn, module] : modules) {
    auto* lora = dynamic_cast<LoraLinearImpl*>(module);
    if (lora != nullptr) candidates.push_back(fqn);
    // Modules inside an adapter (lora_A, lora_B) are never targets.
    if (absl::StrContains(fqn, ".lora_A") || absl::StrContains(fqn, ".lora_B")) continue;
    if (!is_target(fqn, config)) continue;
    TORCH_CHECK(dynamic_cast<torch::nn::LinearImpl*>(module) == nullptr, "apply_lora: '", fqn,
                "' is a target but a torch::nn::Linear, which cannot carry an "
                "adapter; hold an fsdp::lora::LoraLinear there instead (the same parameters "
                "and names)");
    if (lora == nullptr) continue;  // a parent module whose name matches, as PEFT skips
    TORCH_CHECK(!lora->has_adapter(), "apply_lora: '", fqn, "' has an adapter already");
    targets.push_back(lora);
    adapted.push_back(fqn);
  }
  TORCH_CHECK(!targets.empty(), "apply_lora: no LoraLinear matches ",
              config.target_modules().empty()
                  ? "target_regex '" + config.target_regex() + "'"
                  : "target_modules [" + absl::StrJoin(config.target_modules(), ", ") + "]",
              "; the model's LoraLinear modules are [", absl::StrJoin(candidates, ", "), "]");
  for (at::Tensor& p : model.parameters()) p.set_requires_grad(false);
  for (LoraLinearImpl* lora : targets) lora->add_adapter(config);
  return adapted;
}

namespace {

constexpr char kPeftPrefix[] = "base_model.model.";
constexpr char kLoraA[] = ".lora_A.weight";
constexpr char kLoraB[] = ".lora_B.weight";

std::string shape_of(const at::Tensor& t) { return "[" + absl::StrJoin(t.sizes(), ", ") + "]"; }

}  // namespace

bool is_adapter_key(const std::string& key) {
  return absl::EndsWith(key, kLoraA) || absl::EndsWith(key, kLoraB);
}

StateDict adapter_state_dict(const StateDict& state_dict) {
  StateDict adapter;
  for (const auto& item : state_dict) {
    if (is_adapter_key(item.key())) adapter.insert(kPeftPrefix + item.key(), item.value());
  }
  TORCH_CHECK(!adapter.is_empty(),
              "adapter_state_dict: the state dict has no adapter entries "
              "('<module>.lora_A.weight', '<module>.lora_B.weight'); call apply_lora on the "
              "model before training and pass its full state dict");
  return adapter;
}

StateDict merged_state_dict(const StateDict& state_dict, const LoraConfig& config) {
  StateDict merged;
  for (const auto& item : state_dict) {
    if (!is_adapter_key(item.key())) merged.insert(item.key(), item.value());
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : state_dict) {
    if (!absl::EndsWith(item.key(), kLoraA)) continue;
    const std::string module = item.key().substr(0, item.key().size() - sizeof(kLoraA) + 1);
    const at::Tensor* b = state_dict.find(module + kLoraB);
    at::Tensor* weight = merged.find(module + ".weight");
    TORCH_CHECK(b != nullptr && weight != nullptr, "merged_state_dict: '", item.key(), "' needs '",
                module, kLoraB, "' and '", module,
                ".weight' beside it in the state dict; pass the model's full state dict");
    *weight = merged_weight(module, *weight, item.value(), *b, config);
  }
  return merged;
}

at::Tensor merged_weight(const std::string& module, const at::Tensor& weight,
                         const at::Tensor& lora_A, const at::Tensor& lora_B,
                         const LoraConfig& config) {
  const at::Tensor& a = lora_A;
  const at::Tensor& b = lora_B;
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == config.r() && b.size(1) == config.r() &&
                  weight.dim() == 2 && weight.size(0) == b.size(0) && weight.size(1) == a.size(1),
              "merged_weight: for '", module, "' expected lora_A [r, in], lora_B [out, r] ",
              "and weight [out, in] with r = ", config.r(), ", got ", shape_of(a), ", ",
              shape_of(b), " and ", shape_of(weight),
              "; pass the LoraConfig the adapters were made with");
  torch::NoGradGuard no_grad;
  const at::Tensor delta = at::matmul(b.to(at::kFloat), a.to(at::kFloat)) * config.scaling();
  return (weight.to(at::kFloat) + delta.to(weight.device())).to(weight.scalar_type());
}

}  // namespace fsdp::lora
