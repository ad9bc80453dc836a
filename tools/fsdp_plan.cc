// fsdp_plan: which FSDP units a policy makes of a real model, and what each sharding
// strategy would cost per rank; or, with --config, what one rank of a decoder fine-tune
// (examples/llama:finetune) will hold, from a Hugging Face config.json alone, and the
// smallest world size that fits a memory per rank (tools/decoder_plan.h).
//
//   fsdp_plan --config=Llama-3.1-8B/config.json --world_size=8 --batch_size=16
//       --context=2048 --activation_checkpointing --memory_per_rank=80GiB
//
//   fsdp_plan --model=resnet18.pt --policy=size --min_num_params=1000000 --world_size=8
//   fsdp_plan --model=gpt.pt --policy=transformer --format=json
//       --layer_cls=torch.nn.modules.transformer.TransformerEncoderLayer
//
// The model is a .pt2 archive (torch.export.save(ep, path)) or a TorchScript file
// (torch.jit.script(model).save(path)), told apart by content; a state dict or checkpoint
// from torch.save, a folder, an empty or a truncated file is named as such, and a .pt2
// archive that cannot be read says why (exported_program.h). A TorchScript file is read
// as data, running none of its code (torchscript_tree.h); --trust_torchscript loads it
// with torch::jit::load instead, which runs the file's code. Bad input prints one line on
// stderr and exits with status 2 (an unknown flag name is Abseil's to reject, with status 1).
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include "fsdp/comm/launcher.h"
#include "fsdp/core/memory_plan.h"
#include "fsdp/wrap/exported_program_tree.h"
#include "fsdp/wrap/module_tree.h"
#include "fsdp/wrap/plan.h"
#include "fsdp/wrap/policy.h"
#include "fsdp/wrap/torchscript_tree.h"
#include "models/decoder.h"
#include "models/hf_checkpoint.h"
#include "tools/decoder_plan.h"
#include "tools/plan_report.h"

ABSL_FLAG(std::string, model, "",
          "the model: a .pt2 archive (torch.export.save) or a TorchScript file (required)");
ABSL_FLAG(std::string, policy, "size",
          "auto-wrap policy: size, always, transformer or module (ModuleWrapPolicy)");
ABSL_FLAG(std::string, min_num_params, "1e8",
          "size policy: a module is large iff its unwrapped numel >= this (elements; "
          "an integer, also written like 1e8)");
ABSL_FLAG(std::vector<std::string>, layer_cls, {},
          "transformer policy: Python class paths of the layers to wrap, comma-separated");
ABSL_FLAG(std::vector<std::string>, force_leaf, {},
          "size policy: class paths never recursed into (default: MultiheadAttention)");
ABSL_FLAG(std::vector<std::string>, exclude, {},
          "size policy: class paths never wrapped (default: ModuleList, ModuleDict)");
ABSL_FLAG(std::vector<std::string>, ignored_modules, {},
          "FQNs of modules FSDP leaves alone, comma-separated");
ABSL_FLAG(std::string, world_size, "1", "number of ranks to shard over, 1 ... 1048576");
ABSL_FLAG(std::string, format, "table", "output: table or json");
ABSL_FLAG(std::string, optimizer, "adam",
          "optimizer of the plan: adam, adamw, fused_adamw (fsdp::FusedAdamW), sgd, "
          "sgd_momentum, adagrad or rmsprop");
ABSL_FLAG(std::string, param_dtype, "fp32",
          "dtype of unsharded parameters (mixed precision): fp32, bf16 or fp16; gradients "
          "are reduced in fp32");
ABSL_FLAG(std::string, hybrid_shard_group_size, "0",
          "ranks per shard group: also plan HYBRID_SHARD (0: not planned)");
ABSL_FLAG(std::string, backward_prefetch, "pre", "backward prefetch: pre, post or none");
ABSL_FLAG(bool, cpu_offload, false, "plan CPUOffload(offload_params) on a CUDA device");
ABSL_FLAG(std::string, config, "",
          "a Hugging Face decoder's config.json: plan a fine-tune of it (examples/llama:finetune) "
          "instead of --model's units; the flags below and --world_size, "
          "--hybrid_shard_group_size, --cpu_offload, --format apply");
ABSL_FLAG(std::string, sharding_strategy, "full_shard",
          "--config: full_shard, shard_grad_op, no_shard, hybrid_shard or _hybrid_shard_zero2");
ABSL_FLAG(std::string, mixed_precision, "auto",
          "--config: as finetune's flag: auto (bf16 for a 16-bit config dtype), bf16 (bf16 "
          "compute, fp32 master weights), pure_bf16 or none (fp32)");
ABSL_FLAG(std::string, batch_size, "8", "--config: the global batch, in windows");
ABSL_FLAG(std::string, context, "128", "--config: tokens per window");
ABSL_FLAG(std::string, grad_accumulation_steps, "1", "--config: micro-batches per step");
ABSL_FLAG(bool, activation_checkpointing, false, "--config: each layer recomputes its forward");
ABSL_FLAG(std::string, lora_rank, "0", "--config: 0 (full fine-tuning) or the LoRA rank");
ABSL_FLAG(std::string, moe_units, "layer",
          "--config: as finetune's flag, for the mixture-of-experts families: layer (each "
          "decoder layer one FSDP unit) or sublayer (its attention and its experts two)");
ABSL_FLAG(std::vector<std::string>, lora_target_modules, {},
          "--config: the modules with adapters (default: the family's, as finetune)");
ABSL_FLAG(std::string, lora_base_dtype, "auto",
          "--config: as finetune's flag: auto (a LoRA run's frozen base in the config's 16-bit "
          "dtype under bf16 mixed precision) or float32");
ABSL_FLAG(std::string, quantize, "none",
          "--config: as finetune's flag: none, or nf4 (QLoRA: each layer's projections in NF4; "
          "needs --lora_rank)");
ABSL_FLAG(std::string, device, "cpu",
          "--config: cpu (the process's resident set, Gloo) or cuda (one GPU's memory, NCCL; "
          "with --cpu_offload the offloaded state is the host's)");
ABSL_FLAG(std::string, memory_per_rank, "",
          "--config: also find the smallest world size whose peak fits this (bytes, or "
          "KB/MB/GB/KiB/MiB/GiB)");
ABSL_FLAG(std::string, runtime_bytes, "",
          "--config: the process before loading (default: the CPU trainer's, measured; on "
          "--device=cuda the GPU's before the first tensor, 512 MiB)");
ABSL_FLAG(bool, trust_torchscript, false,
          "load a TorchScript --model with torch::jit::load, which RUNS CODE FROM THE FILE (its "
          "classes' __setstate__): only for a file from a trusted source that cannot be read "
          "as data (a module class with its own __setstate__)");

namespace {

using fsdp::ModuleTree;
using fsdp::ModuleType;

// Bad input: one line on stderr, status 2.
[[noreturn]] void fail(const std::string& message) {
  std::cerr << "fsdp_plan: " << message << "\n";
  std::exit(2);
}

// An integer flag: digits, or a float literal with an integral value (1e8), in
// [min, max].
int64_t count_flag(const char* flag, const std::string& text, int64_t min, int64_t max) {
  int64_t value = 0;
  double real = 0;
  const bool ok = absl::SimpleAtoi(text, &value) ||
                  (absl::SimpleAtod(text, &real) && real >= -9e15 && real <= 9e15 &&
                   real == static_cast<double>(value = static_cast<int64_t>(real)));
  if (!ok || value < min || value > max) {
    fail(absl::StrCat("--", flag, " must be an integer in [", min, ", ", max, "], got '", text,
                      "'"));
  }
  return value;
}

// A comma-separated list flag without empty entries (a trailing comma is a mistake).
std::vector<std::string> list_flag(const char* flag, const std::vector<std::string>& items) {
  for (const std::string& item : items) {
    if (item.empty()) fail(absl::StrCat("--", flag, " has an empty entry; remove the extra comma"));
  }
  return items;
}

constexpr char kExpected[] =
    "expected a .pt2 archive written by torch.export.save(ep, path) or a TorchScript file "
    "written by torch.jit.script(model).save(path)";

// The two kinds of model file fsdp_plan reads.
enum class ModelFormat { kTorchScript, kExportedProgram };

// What the model file is, when it is neither a .pt2 nor a TorchScript archive: "" if it
// may be one (`format` says which). Recognised before PyTorch's loader reads it, so that
// the message leads with what the file is (PyTorch's own text ends with its hint after a
// miniz error code).
std::string not_a_model(const std::string& path, ModelFormat& format) {
  format = ModelFormat::kTorchScript;
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return absl::StrCat("cannot be read (", std::strerror(errno), ")");
  char head[16] = {};
  in.read(head, sizeof(head));
  const std::string start(head, static_cast<size_t>(in.gcount()));
  if (start.empty()) return "is empty (0 bytes)";
  // torch.save's legacy format: a pickle (protocol 2) of its magic number first.
  if (absl::StartsWith(start,
                       std::string("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8", 12))) {
    return "was written by torch.save in its legacy (non-zip) format: a state dict or a "
           "pickled object, not a TorchScript module";
  }
  if (!absl::StartsWith(start, "PK\x03\x04")) {
    return absl::StrCat("is not a PyTorch file (not a zip archive; it starts with '",
                        absl::CHexEscape(start.substr(0, 8)), "')");
  }
  std::vector<std::string> records;
  try {
    records = caffe2::serialize::PyTorchStreamReader(path).getAllRecords();
  } catch (const std::exception&) {
    return "is a truncated or damaged zip archive (its directory of files cannot be read)";
  }
  const std::set<std::string> names(records.begin(), records.end());
  if (fsdp::is_exported_program_records(records)) {
    format = ModelFormat::kExportedProgram;
    return "";
  }
  if (names.count("constants.pkl") == 0 && names.count("data.pkl") > 0) {
    return "was written by torch.save (a state dict, a checkpoint or a pickled module): it "
           "holds tensors, not a TorchScript module's structure";
  }
  if (names.count("data.pkl") == 0) return "is a zip archive without PyTorch's data.pkl";
  return "";
}

// The model file must be a .pt2 or TorchScript archive: a folder, a FIFO, an empty or
// truncated file, a torch.save file is named as such.
ModelFormat check_model_file(const std::string& path) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (error || !std::filesystem::exists(status)) {
    fail(absl::StrCat("cannot open '", path, "': no such file; ", kExpected));
  }
  if (std::filesystem::is_directory(status)) {
    const bool checkpoint = std::filesystem::exists(std::filesystem::path(path) / "metadata.pt");
    fail(
        absl::StrCat("'", path, "' is a directory",
                     checkpoint ? " (a sharded checkpoint, as save_sharded_checkpoint writes)" : "",
                     "; ", kExpected));
  }
  if (!std::filesystem::is_regular_file(status)) {
    fail(absl::StrCat("'", path, "' is not a regular file; ", kExpected));
  }
  ModelFormat format = ModelFormat::kTorchScript;
  if (const std::string what = not_a_model(path, format); !what.empty()) {
    fail(absl::StrCat("'", path, "' ", what, "; ", kExpected));
  }
  return format;
}

// The model's tree, from either kind of file, and a line on what a .pt2 archive holds.
struct LoadedModel {
  std::optional<fsdp::ExportedProgramTree> exported;
  ModuleTree torchscript;
  const ModuleTree& tree() const { return exported ? exported->tree : torchscript; }
};

LoadedModel load_model(const std::string& path) {
  LoadedModel model;
  if (check_model_file(path) == ModelFormat::kExportedProgram) {
    model.exported = fsdp::load_exported_program_tree(path);
  } else {
    // See fsdp/wrap/torchscript_tree.h: read as data unless the user vouches for the file.
    model.torchscript = absl::GetFlag(FLAGS_trust_torchscript)
                            ? fsdp::load_torchscript_tree_trusted(path)
                            : fsdp::load_torchscript_tree(path);
  }
  return model;
}

// One line on what a .pt2 archive holds (distinct parameters, tied names, frozen ones,
// elements by dtype, buffers, modules without a class), printed above the table.
std::string describe_exported(const fsdp::ExportedProgramTree& exported) {
  const fsdp::ExportedProgramInfo& info = exported.info;
  std::map<std::string, int64_t> numel_by_dtype;
  int64_t distinct = 0;
  int64_t frozen = 0;
  int64_t frozen_numel = 0;
  for (const fsdp::ExportedTensorInfo& param : info.parameters) {
    if (!param.tied_to.empty()) continue;
    ++distinct;
    numel_by_dtype[c10::toString(param.dtype)] += param.numel();
    if (!param.requires_grad) {
      ++frozen;
      frozen_numel += param.numel();
    }
  }
  int unknown = 0;
  for (const fsdp::ModuleNode& node : exported.tree.nodes()) {
    unknown += node.type_name == fsdp::kUnknownModuleClass ? 1 : 0;
  }
  std::vector<std::string> dtypes;
  for (const auto& [dtype, numel] : numel_by_dtype) {
    dtypes.push_back(absl::StrCat(dtype, " ", numel));
  }
  return absl::StrCat(
      "torch.export archive (schema ", info.schema_major, ".", info.schema_minor,
      info.torch_version.empty() ? "" : absl::StrCat(", torch ", info.torch_version),
      info.meta ? ", exported on the meta device" : "", "): ", distinct, " parameters + ",
      static_cast<int64_t>(info.parameters.size()) - distinct, " tied names, ", frozen, " frozen (",
      frozen_numel, " elements); elements by dtype: ", absl::StrJoin(dtypes, ", "), "; ",
      info.buffers.size(), " buffers; ", unknown, " modules never called (class ",
      fsdp::kUnknownModuleClass, ")\n");
}

// Class paths must name a type in the model or a torch.nn type: catches typos that would
// otherwise silently match nothing.
std::vector<ModuleType> class_paths(const ModuleTree& tree, const char* flag,
                                    const std::vector<std::string>& paths) {
  list_flag(flag, paths);
  std::set<std::string> present;
  for (const fsdp::ModuleNode& node : tree.nodes()) present.insert(node.type_name);
  std::vector<ModuleType> types;
  for (const std::string& path : paths) {
    if (present.count(path) == 0 && !fsdp::is_known_torch_class_path(path)) {
      fail(absl::StrCat("unknown class path '", path, "' in --", flag,
                        ": not a torch.nn module type and no module of the model has it; "
                        "the model's types are: ",
                        absl::StrJoin(present, ", ")));
    }
    types.push_back(ModuleType::named(path));
  }
  return types;
}

fsdp::AutoWrapPolicy make_policy(const ModuleTree& tree) {
  const std::string policy = absl::GetFlag(FLAGS_policy);
  if (policy != "transformer" && policy != "module" && !absl::GetFlag(FLAGS_layer_cls).empty()) {
    fail("--layer_cls is used by --policy=transformer and --policy=module only");
  }
  if (policy != "size" &&
      (!absl::GetFlag(FLAGS_force_leaf).empty() || !absl::GetFlag(FLAGS_exclude).empty())) {
    fail("--force_leaf and --exclude are used by --policy=size only");
  }
  if (policy == "always") return fsdp::always_wrap_policy();
  if (policy == "module") {
    if (absl::GetFlag(FLAGS_layer_cls).empty()) {
      fail("--policy=module needs --layer_cls=PY.CLASS.PATH[,...]");
    }
    return fsdp::ModuleWrapPolicy(class_paths(tree, "layer_cls", absl::GetFlag(FLAGS_layer_cls)));
  }
  if (policy == "transformer") {
    if (absl::GetFlag(FLAGS_layer_cls).empty()) {
      fail("--policy=transformer needs --layer_cls=PY.CLASS.PATH[,...]");
    }
    return fsdp::transformer_auto_wrap_policy(
        class_paths(tree, "layer_cls", absl::GetFlag(FLAGS_layer_cls)));
  }
  if (policy == "size") {
    const int64_t min_num_params =
        count_flag("min_num_params", absl::GetFlag(FLAGS_min_num_params), 0, int64_t{1} << 53);
    fsdp::SizeBasedPolicyOptions options;
    options.min_num_params(min_num_params);
    if (!absl::GetFlag(FLAGS_force_leaf).empty()) {
      options.force_leaf_modules(class_paths(tree, "force_leaf", absl::GetFlag(FLAGS_force_leaf)));
    }
    if (!absl::GetFlag(FLAGS_exclude).empty()) {
      options.exclude_wrap_modules(class_paths(tree, "exclude", absl::GetFlag(FLAGS_exclude)));
    }
    return fsdp::size_based_auto_wrap_policy(options);
  }
  fail(absl::StrCat("unknown --policy '", policy,
                    "': expected size, always, transformer or module"));
}

// The plan's settings from the flags (fsdp/core/memory_plan.h).
fsdp::MemoryPlanOptions plan_options(int64_t world_size) {
  fsdp::MemoryPlanOptions options;
  const std::string optimizer = absl::GetFlag(FLAGS_optimizer);
  const c10::optional<fsdp::OptimizerSpec> spec = fsdp::parse_optimizer_spec(optimizer);
  if (!spec) {
    fail(absl::StrCat(
        "unknown --optimizer '", optimizer,
        "': expected adam, adamw, fused_adamw, sgd, sgd_momentum, adagrad or rmsprop"));
  }
  options.optimizer(*spec);
  const std::string dtype = absl::GetFlag(FLAGS_param_dtype);
  if (dtype == "bf16" || dtype == "fp16") {
    options.param_dtype(dtype == "bf16" ? c10::ScalarType::BFloat16 : c10::ScalarType::Half)
        .reduce_dtype(c10::ScalarType::Float);
  } else if (dtype != "fp32") {
    fail(absl::StrCat("unknown --param_dtype '", dtype, "': expected fp32, bf16 or fp16"));
  }
  const int64_t group = count_flag("hybrid_shard_group_size",
                                   absl::GetFlag(FLAGS_hybrid_shard_group_size), 0, world_size);
  if (group > 0 && world_size % group != 0) {
    fail(absl::StrCat("--hybrid_shard_group_size=", group,
                      " must divide --world_size=", world_size));
  }
  options.hybrid_shard_group_size(group);
  const std::string prefetch = absl::GetFlag(FLAGS_backward_prefetch);
  if (prefetch == "post") {
    options.backward_prefetch(fsdp::BackwardPrefetch::kBackwardPost);
  } else if (prefetch == "none") {
    options.backward_prefetch(fsdp::BackwardPrefetch::kNone);
  } else if (prefetch != "pre") {
    fail(absl::StrCat("unknown --backward_prefetch '", prefetch, "': expected pre, post or none"));
  }
  return options.cpu_offload(absl::GetFlag(FLAGS_cpu_offload))
      .host_is_tracked(!absl::GetFlag(FLAGS_cpu_offload));
}

// A byte count flag as finetune's --max_shard_size spells it.
int64_t bytes_flag(const char* flag, const std::string& text) {
  try {
    return fsdp::models::parse_shard_size(text, absl::StrCat("--", flag));
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace());
  }
}

// fsdp_plan --config: see tools/decoder_plan.h.
int run_config(const std::string& format) {
  const std::string path = absl::GetFlag(FLAGS_config);
  if (!absl::GetFlag(FLAGS_model).empty()) fail("give --config or --model, not both");
  const int64_t world = count_flag("world_size", absl::GetFlag(FLAGS_world_size), 1, 1 << 20);
  const int64_t group = count_flag("hybrid_shard_group_size",
                                   absl::GetFlag(FLAGS_hybrid_shard_group_size), 0, 1 << 20);
  const c10::optional<fsdp::ShardingStrategy> strategy =
      fsdp::parse_sharding_strategy(absl::GetFlag(FLAGS_sharding_strategy));
  if (!strategy) {
    fail(absl::StrCat("unknown --sharding_strategy '", absl::GetFlag(FLAGS_sharding_strategy),
                      "': expected full_shard, shard_grad_op, no_shard, hybrid_shard or "
                      "_hybrid_shard_zero2"));
  }
  if (fsdp::is_hybrid(*strategy) && (group < 1 || world % group != 0)) {
    fail(absl::StrCat("--sharding_strategy=", absl::GetFlag(FLAGS_sharding_strategy),
                      " needs --hybrid_shard_group_size dividing --world_size=", world));
  }
  fsdp::models::FinetunePlanOptions options;
  options.world_size(world)
      .sharding_strategy(*strategy)
      .hybrid_shard_group_size(fsdp::is_hybrid(*strategy) ? group : 0)
      .context(count_flag("context", absl::GetFlag(FLAGS_context), 1, 1 << 24))
      .activation_checkpointing(absl::GetFlag(FLAGS_activation_checkpointing))
      .cpu_offload(absl::GetFlag(FLAGS_cpu_offload))
      .runtime_bytes(!absl::GetFlag(FLAGS_runtime_bytes).empty()
                         ? bytes_flag("runtime_bytes", absl::GetFlag(FLAGS_runtime_bytes))
                     : absl::GetFlag(FLAGS_device) == "cuda"
                         ? fsdp::models::kDefaultCudaRuntimeBytes
                         : fsdp::models::kDefaultRuntimeBytes);
  // --mixed_precision as the trainer resolves it on the CPU (examples/trainer/levers.h).
  std::string precision = absl::GetFlag(FLAGS_mixed_precision);
  const fsdp::models::DecoderConfig config = fsdp::models::load_decoder_config(path);
  if (precision == "auto") {
    precision = config.dtype == "bfloat16" || config.dtype == "float16" ? "bf16" : "none";
  }
  // OUT/hf is written in the config's dtype, as the trainer writes the folder's.
  if (config.dtype == "bfloat16" || config.dtype == "float16") {
    options.save_dtype(config.dtype == "bfloat16" ? c10::ScalarType::BFloat16
                                                  : c10::ScalarType::Half);
  }
  if (precision == "bf16") {
    options.param_dtype(c10::ScalarType::BFloat16);
  } else if (precision == "pure_bf16") {
    options.dtype(c10::ScalarType::BFloat16);
  } else if (precision != "none") {
    fail(absl::StrCat("unknown --mixed_precision '", precision,
                      "': expected auto, bf16, pure_bf16 or none"));
  }
  fsdp::models::TrainedWeights trained;
  trained.lora_rank = count_flag("lora_rank", absl::GetFlag(FLAGS_lora_rank), 0, 1 << 20);
  trained.lora_targets = list_flag("lora_target_modules", absl::GetFlag(FLAGS_lora_target_modules));
  options.trained(trained);
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device == "cuda") {
    options.device(c10::DeviceType::CUDA).backend(fsdp::PlanBackend::kNccl);
  } else if (device != "cpu") {
    fail(absl::StrCat("unknown --device '", device, "': expected cpu or cuda"));
  }
  fsdp::tools::DecoderWeights weights;
  const std::string base = absl::GetFlag(FLAGS_lora_base_dtype);
  if (base != "auto" && base != "float32") {
    fail(absl::StrCat("unknown --lora_base_dtype '", base, "': expected auto or float32"));
  }
  weights.lora_fp32_base = base == "float32";
  const std::string quantize = absl::GetFlag(FLAGS_quantize);
  if (quantize != "none" && quantize != "nf4") {
    fail(absl::StrCat("unknown --quantize '", quantize, "': expected none or nf4"));
  }
  weights.nf4 = quantize == "nf4";
  if (weights.nf4 && trained.lora_rank == 0) {
    fail("--quantize=nf4 freezes the base weights in 4 bits (QLoRA): give --lora_rank too");
  }
  // The MoE families' load-balancing loss, on as examples/llama:finetune has it by default.
  options.router_aux_loss(config.is_moe() && config.router_aux_loss_coef > 0);
  options.decoder_units(fsdp::models::parse_decoder_units(absl::GetFlag(FLAGS_moe_units), config));
  const std::string memory = absl::GetFlag(FLAGS_memory_per_rank);
  const fsdp::tools::DecoderPlanReport report = fsdp::tools::make_decoder_report(
      config, path, options, weights,
      count_flag("batch_size", absl::GetFlag(FLAGS_batch_size), 1, 1 << 24),
      count_flag("grad_accumulation_steps", absl::GetFlag(FLAGS_grad_accumulation_steps), 1,
                 1 << 24),
      memory.empty() ? 0 : bytes_flag("memory_per_rank", memory));
  std::cout << (format == "json" ? fsdp::tools::to_json(report) : fsdp::tools::to_table(report));
  return 0;
}

int run() {
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "table" && format != "json") {
    fail(absl::StrCat("unknown --format '", format, "': expected table or json"));
  }
  if (!absl::GetFlag(FLAGS_config).empty()) return run_config(format);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) {
    fail(
        "--model=FILE is required (a .pt2 archive from torch.export.save or a TorchScript "
        "file), or --config=config.json for a decoder fine-tune's memory plan");
  }
  const int64_t world_size =
      count_flag("world_size", absl::GetFlag(FLAGS_world_size), 1, int64_t{1} << 20);

  const LoadedModel loaded = load_model(model);
  const ModuleTree& tree = loaded.tree();
  const fsdp::AutoWrapPolicy policy = make_policy(tree);
  fsdp::WrapPlanOptions options;
  for (const std::string& fqn :
       list_flag("ignored_modules", absl::GetFlag(FLAGS_ignored_modules))) {
    const int index = tree.find(fqn);
    if (index < 0) fail(absl::StrCat("--ignored_modules: no module '", fqn, "' in ", model));
    options.ignored_modules().push_back(index);
  }
  const fsdp::tools::PlanReport report = fsdp::tools::make_report(
      fsdp::plan_fsdp_units(tree, policy, options), world_size, plan_options(world_size));
  if (format == "json") {
    std::cout << fsdp::tools::to_json(report);
  } else {
    if (loaded.exported) std::cout << describe_exported(*loaded.exported);
    std::cout << fsdp::tools::to_table(
        report, absl::StrCat(model, " (", tree.node(0).type_name, "), policy ",
                             absl::GetFlag(FLAGS_policy)));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Plans FSDP units for a model exported by PyTorch (.pt2 or TorchScript).\n"
      "  fsdp_plan --model=FILE.pt2|FILE.pt --policy=size|always|transformer [--min_num_params=N]\n"
      "            [--layer_cls=PY.CLASS.PATH,...] [--force_leaf=...] [--exclude=...]\n"
      "            [--ignored_modules=FQN,...] [--world_size=W] [--format=table|json]\n"
      "  fsdp_plan --config=config.json [--world_size=W] [--batch_size=B] [--context=T]\n"
      "            [--mixed_precision=...] [--lora_rank=R] [--activation_checkpointing]\n"
      "            [--lora_base_dtype=auto|float32] [--quantize=none|nf4] [--device=cpu|cuda]\n"
      "            [--moe_units=layer|sublayer]\n"
      "            [--grad_accumulation_steps=K] [--memory_per_rank=80GiB] [--format=...]");
  if (const absl::Status entered = fsdp::enter_build_working_directory(); !entered.ok()) {
    fail(std::string(entered.message()));
  }
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    fail(absl::StrCat("unexpected argument '", positional[1], "'; see --help"));
  }
  try {
    return run();
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(e.what());
  }
}
