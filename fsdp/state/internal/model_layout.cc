#include "fsdp/state/internal/model_layout.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <c10/util/Exception.h>

#include "fsdp/base/names.h"

namespace fsdp::state_internal {

std::vector<Entry> module_entries(const torch::nn::Module& module) {
  std::vector<Entry> entries;
  apply_to_modules(
      module, [&](const torch::nn::Module& m, const std::string& prefix, int /*depth*/) {
        for (const auto& item : m.named_parameters(/*recurse=*/false)) {
          entries.push_back({clean_tensor_name(prefix + item.key()), nullptr, 0, item.value(),
                             /*is_param=*/true});
        }
        for (const auto& item : m.named_buffers(/*recurse=*/false)) {
          entries.push_back({clean_tensor_name(prefix + item.key()), nullptr, 0, item.value(),
                             /*is_param=*/false});
        }
      });
  return entries;
}

namespace {

std::atomic<int64_t> layout_builds{0};

}  // namespace

ModelLayout model_layout(FullyShardedRoot& model, const char* what) {
  model.check_idle(what);
  layout_builds.fetch_add(1, std::memory_order_relaxed);
  ModelLayout layout;
  layout.root = &model;
  layout.rank = model.communicator().rank();
  layout.world_size = model.communicator().world_size();
  absl::flat_hash_map<const c10::TensorImpl*, std::pair<FlatParamHandle*, size_t>> owner;
  for (const auto& unit : model.units()) {
    const std::vector<FlatParamHandle*> handles = unit->handles();
    for (size_t h = 0; h < handles.size(); ++h) {
      FlatParamHandle* handle = handles[h];
      // handles() is handle() then frozen_handles().
      layout.flat_params.push_back({unit->fqn(), handle, static_cast<int>(h) - 1});
      const std::vector<at::Tensor>& originals = handle->original_params();
      for (size_t i = 0; i < originals.size(); ++i) {
        owner.emplace(originals[i].unsafeGetTensorImpl(), std::make_pair(handle, i));
      }
    }
  }
  layout.entries = module_entries(model.root_module());
  for (Entry& entry : layout.entries) {
    auto it = entry.is_param ? owner.find(entry.tensor.unsafeGetTensorImpl()) : owner.end();
    if (it == owner.end()) continue;
    std::tie(entry.handle, entry.info) = it->second;
    entry.tensor = at::Tensor();
  }
  return layout;
}

int64_t model_layout_builds() { return layout_builds.load(std::memory_order_relaxed); }

ParamSlice param_slice(const FlatParamHandle& handle, size_t info) {
  const FlatParamInfo& param = handle.param_infos()[info];
  const int64_t shard_start = handle.shard_offset();
  const int64_t begin = std::max(param.offset, shard_start);
  const int64_t end = std::min(param.offset + param.numel, shard_start + handle.shard_numel());
  if (begin >= end) return {};
  return {begin - param.offset, begin - shard_start, end - begin};
}

namespace {

std::string quoted_list(const std::vector<std::string>& names) {
  constexpr size_t kShown = 10;
  std::vector<std::string> shown;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) shown.push_back("'" + names[i] + "'");
  std::string text = absl::StrJoin(shown, ", ");
  if (names.size() > kShown) absl::StrAppend(&text, ", ... (", names.size() - kShown, " more)");
  return text;
}

}  // namespace

void check_same_keys(const std::vector<std::string>& expected,
                     const std::vector<std::string>& found, const std::string& what,
                     KeySet key_set) {
  const absl::flat_hash_set<std::string> want(expected.begin(), expected.end());
  const absl::flat_hash_set<std::string> have(found.begin(), found.end());
  std::vector<std::string> missing, unexpected;
  for (const std::string& key : expected) {
    if (key_set == KeySet::kStateDict && !have.contains(key)) missing.push_back(key);
  }
  bool prefixed = false;
  for (const std::string& key : found) {
    if (want.contains(key)) continue;
    unexpected.push_back(key);
    prefixed = prefixed || clean_tensor_name(key) != key;
  }
  if (missing.empty() && unexpected.empty()) return;
  std::string message = absl::StrCat(what, key_set == KeySet::kStateDict
                                               ? ": the keys do not match the model's"
                                               : ": some keys are not the model's parameters");
  if (!missing.empty()) {
    absl::StrAppend(&message, "; missing keys (", missing.size(), "): ", quoted_list(missing));
  }
  if (!unexpected.empty()) {
    absl::StrAppend(&message, "; unexpected keys (", unexpected.size(),
                    "): ", quoted_list(unexpected));
  }
  if (prefixed) {
    absl::StrAppend(&message,
                    ". Some keys carry wrapper prefixes ('_fsdp_wrapped_module.', "
                    "'_checkpoint_wrapped_module.'): remove them with fsdp::clean_tensor_name");
  } else if (key_set == KeySet::kOptimState) {
    absl::StrAppend(&message,
                    ". Optimizer state is keyed by the model's parameter FQNs (a tied parameter "
                    "by its first name in pre-order)");
  } else {
    absl::StrAppend(&message, ". Load a state dict saved from the same model architecture");
  }
  TORCH_CHECK(false, message);
}

torch::NoGradGuard begin_load(const std::vector<std::string>& expected,
                              const std::vector<std::string>& found, const std::string& what,
                              KeySet key_set) {
  check_same_keys(expected, found, what, key_set);
  return torch::NoGradGuard();
}

std::vector<std::string> keys_of(const std::vector<Entry>& entries) {
  std::vector<std::string> keys;
  keys.reserve(entries.size());
  for (const Entry& entry : entries) keys.push_back(entry.fqn);
  return keys;
}

void check_tensor(const std::string& what, const std::string& fqn, at::IntArrayRef shape,
                  at::ScalarType dtype, const at::Tensor& value, const std::string& source) {
  TORCH_CHECK(value.defined(), what, ": '", fqn, "' in ", source, " is not a tensor");
  TORCH_CHECK(value.sizes() == shape, what, ": size mismatch for '", fqn, "': ", source,
              " has shape ", shape_string(value.sizes()), ", the model has ", shape_string(shape));
  TORCH_CHECK(value.scalar_type() == dtype, what, ": dtype mismatch for '", fqn, "': ", source,
              " has ", c10::toString(value.scalar_type()), ", the model has ", c10::toString(dtype),
              "; convert it with .to() before loading");
}

bool writes_pieces(const FlatParamHandle& handle, const ModelLayout& layout) {
  return handle.communicator().rank() == layout.rank;
}

absl::flat_hash_set<std::string> pieces_written_elsewhere(const ModelLayout& layout) {
  absl::flat_hash_set<std::string> fqns;
  for (const Entry& entry : layout.entries) {
    if (entry.handle != nullptr && !writes_pieces(*entry.handle, layout)) fqns.insert(entry.fqn);
  }
  return fqns;
}

std::string shape_string(at::IntArrayRef shape) { return "[" + absl::StrJoin(shape, ", ") + "]"; }

}  // namespace fsdp::state_internal
