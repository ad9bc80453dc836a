// Hugging Face checkpoints (safetensors) in and out of a sharded FSDP model.
//
//   fsdp::load_safetensors(*model, "llama/");  // each rank reads only its shards' bytes
//   fsdp::save_safetensors(*model, "out/hf/", fsdp::SaveSafetensorsOptions()
//                                                  .max_shard_size(2'000'000'000));
//
// Names: a model entry's cleaned FQN (state_dict.h) is looked up in the files as
// `rename(fqn)` (identity by default; e.g. prepend "model." when the module tree lacks
// transformers' outer module). Tied parameters (one tensor under several names, e.g.
// lm_head.weight tied to model.embed_tokens.weight): one name present in the files is
// enough, as transformers writes them; saving writes only the first name in state-dict
// order (transformers drops lm_head.weight the same way).
//
// PyTorch / Hugging Face: PreTrainedModel.from_pretrained / save_pretrained with
// safetensors (each rank loading only its shard: FSDP's sharded load of a full checkpoint,
// e.g. torch.distributed.checkpoint's HF storage reader).
//
// Collectives: save_safetensors (one all-gather per unit); load_safetensors communicates
// nothing. Every rank calls them in the same order. Threading: one call at a time per
// model. Errors: c10::Error naming the file, the tensor and what was expected (fsdp
// formats/safetensors.h for a malformed file), tensors missing from the files or that the
// model lacks (with `allow_unexpected` off), a shape or dtype that differs from the
// model's (no silent casts: convert the file or the model first, or ask for the cast with
// LoadSafetensorsOptions::cast_floating / SaveSafetensorsOptions::dtype).
#ifndef FSDP_STATE_SAFETENSORS_STATE_DICT_H_
#define FSDP_STATE_SAFETENSORS_STATE_DICT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include "fsdp/core/fully_sharded.h"

namespace fsdp {

// Model FQN -> tensor name in the files.
using SafetensorsRename = std::function<std::string(const std::string& fqn)>;
// Model FQN (cleaned) -> whether the entry is left out.
using SafetensorsSkip = std::function<bool(const std::string& fqn)>;

// One tensor in the files holding a contiguous run of a model entry's elements.
struct SafetensorsPiece {
  std::string name;            // its name in the files
  std::vector<int64_t> shape;  // its shape there
};
// Model FQN (cleaned) and shape -> the tensors in the files that hold the entry, in order:
// their elements, each flattened and concatenated, are the entry's flattened. Empty: the
// entry is the one tensor rename(fqn) of its own shape. E.g. a mixture-of-experts layer's
// experts fused in the model as gate_up_proj [E, 2 I, H] held per expert in the files
// (gate [I, H], then up [I, H], of expert 0, then of expert 1, ...): models/hf_checkpoint.h.
// A split entry cannot be tied to another. transformers: the WeightConverter of a
// family's conversion_mapping (MergeModulelist, Concatenate) in both directions.
using SafetensorsSplit =
    std::function<std::vector<SafetensorsPiece>(const std::string& fqn, c10::IntArrayRef shape)>;

// A model entry computed from a tensor in the files rather than read from its own (a base
// weight quantized to NF4 as it is read: models/hf_checkpoint.h). `value` gets the
// source's full value (in the file's dtype) and returns the entry's full value, of the
// entry's shape and dtype in the model.
struct SafetensorsDerived {
  std::string source;  // the tensor's name in the files
  std::function<at::Tensor(const at::Tensor& source)> value;
};
// Model FQN (cleaned) -> how the entry is derived, or nullopt: read as usual.
using SafetensorsDerive = std::function<c10::optional<SafetensorsDerived>(const std::string& fqn)>;

struct LoadSafetensorsOptions {
  TORCH_ARG(SafetensorsRename, rename) = nullptr;
  // Tensors in the files that the model lacks are skipped instead of an error.
  TORCH_ARG(bool, allow_unexpected) = false;
  // Tensors in the files (by their names there) that no model entry reads and that are not
  // unexpected either: the caller checks them itself (a bitsandbytes 4-bit folder's
  // quant_map: models/hf_checkpoint.h).
  TORCH_ARG(std::function<bool(const std::string& name)>, unread) = nullptr;
  // Model entries not read (and not looked for in the files): they keep the values they
  // hold, e.g. LoRA adapters added to a model built on the meta device before its base
  // weights are read (fsdp::lora::is_adapter_key). A tied group is skipped when its first
  // name is.
  TORCH_ARG(SafetensorsSkip, skip) = nullptr;
  // A floating tensor whose dtype in the files differs from the model's floating dtype is
  // converted as it is read (a bf16 checkpoint into fp32 master parameters: exact; the
  // other way rounds to nearest): each piece is read in the file's dtype, then copied,
  // so the peak rises by that piece too. Other dtype differences stay errors.
  // transformers: from_pretrained(torch_dtype=...).
  TORCH_ARG(bool, cast_floating) = false;
  // Entries held in the files as several tensors (rename is not applied to them): each
  // rank reads only the pieces' bytes within its shards.
  TORCH_ARG(SafetensorsSplit, split) = nullptr;
  // Entries derived from a source tensor (applied after skip, instead of split and rename):
  // every rank reads the source whole, one source at a time (kept while the entries that
  // follow derive from it too, so list them together), computes the entry's value and
  // keeps the elements in its shards. The rank's peak then rises by one whole source and
  // the values derived from it.
  TORCH_ARG(SafetensorsDerive, derive) = nullptr;
};

// Loads a .safetensors file or a Hugging Face folder (safetensors.h) into `model`: each
// rank reads with pread only the byte ranges of the parameters' elements in its own
// flat-parameter shards (straight into the shards, no staging copy), plus whole buffers
// and parameters FSDP leaves alone. A rank's peak memory rises by at most one such
// tensor beyond what the model already holds. No communication.
void load_safetensors(FullyShardedRoot& model, const std::string& path,
                      const LoadSafetensorsOptions& options = {});

// Called on rank 0 for each tensor save_safetensors writes, with its cleaned FQN, its full
// value and the full values of every entry of its unit (cleaned FQN -> tensor, all
// gathered at that moment; for tensors outside the units, those tensors; for
// save_module_safetensors, the whole module's); returns what to write instead, of the
// same shape and dtype (or of SaveSafetensorsOptions::written_as's). The tensors are the
// model's: read them, do not write them.
using SafetensorsTransform =
    std::function<at::Tensor(const std::string& fqn, const at::Tensor& value,
                             const torch::OrderedDict<std::string, at::Tensor>& unit)>;

// The shape and dtype `transform` turns an entry into (e.g. an NF4 base weight's packed
// codes written as the dequantized weight: models/hf_checkpoint.h); nullopt: the entry's.
struct SafetensorsWrittenAs {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
};
using SafetensorsWrittenAsOf =
    std::function<c10::optional<SafetensorsWrittenAs>(const std::string& fqn)>;

struct SaveSafetensorsOptions {
  TORCH_ARG(SafetensorsRename, rename) = nullptr;
  // Bytes per file at most (save_pretrained's max_shard_size; transformers' default).
  TORCH_ARG(int64_t, max_shard_size) = 50'000'000'000;
  // Model entries not written (e.g. LoRA adapters: fsdp::lora::is_adapter_key). A tied
  // group is skipped when its first name is.
  TORCH_ARG(SafetensorsSkip, skip) = nullptr;
  // What is written for each tensor (nullptr: the values themselves), e.g. a base weight
  // with its LoRA adapter merged in (models/hf_checkpoint.h: save_lora_hf_folders).
  TORCH_ARG(SafetensorsTransform, transform) = nullptr;
  // The dtype of the floating tensors in the files (fp32 master parameters written back
  // as the bf16 checkpoint they came from, rounded to nearest); none: the model's own.
  // Other tensors keep theirs.
  TORCH_ARG(c10::optional<at::ScalarType>, dtype) = c10::nullopt;
  // Entries (model FQNs) written in the model's own dtype whatever `dtype` says, as
  // transformers' _keep_in_fp32_modules keeps some tensors of a bf16 checkpoint in fp32
  // (DeepSeek-V3's e_score_correction_bias); nullptr: none.
  TORCH_ARG(std::function<bool(const std::string&)>, keep_dtype) = nullptr;
  // Entries written as several tensors (after `transform`; rename is not applied to them).
  TORCH_ARG(SafetensorsSplit, split) = nullptr;
  // Entries `transform` writes in another shape or dtype than the model holds them in
  // (`dtype` above applies to a floating one, as to any).
  TORCH_ARG(SafetensorsWrittenAsOf, written_as) = nullptr;
};

// Writes the full model to the folder `dir` as save_pretrained does (safetensors.h:
// model.safetensors or sharded files with the index, __metadata__ {"format": "pt"},
// each file atomically). Collective: the units are gathered one at a time (all flat
// parameters of a unit together: the frozen one beside the trainable one), in full
// precision, and rank 0 writes each unit's tensors before the next is gathered (peak: one
// unit unsharded); the other ranks write nothing. Returns the file names on rank 0 (empty
// elsewhere).
std::vector<std::string> save_safetensors(FullyShardedRoot& model, const std::string& dir,
                                          const SaveSafetensorsOptions& options = {});

// The same for an unwrapped module (PyTorch: safetensors.torch.load_model /
// save_model, strict): whole tensors, no communication.
void load_module_safetensors(torch::nn::Module& module, const std::string& path,
                             const LoadSafetensorsOptions& options = {});
std::vector<std::string> save_module_safetensors(const torch::nn::Module& module,
                                                 const std::string& dir,
                                                 const SaveSafetensorsOptions& options = {});

}  // namespace fsdp

#endif  // FSDP_STATE_SAFETENSORS_STATE_DICT_H_
