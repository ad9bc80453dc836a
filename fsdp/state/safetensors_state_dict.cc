#include "fsdp/state/safetensors_state_dict.h"

#include <algorithm>
#include <functional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/formats/safetensors.h"
#include "fsdp/state/internal/model_layout.h"

namespace fsdp {
namespace {

using state_internal::Entry;
using state_internal::ModelLayout;

// Note [Tied tensors in safetensors]
// A tensor registered under several names (lm_head.weight tied to
// model.embed_tokens.weight) is one group of entries: saving writes it once, under the
// group's first name in state-dict order (what transformers and safetensors' save_model
// keep), and loading needs any one of its names in the files; a file holding several of
// them is accepted (the first present is read).
struct Group {
  std::vector<size_t> entries;     // positions in the entries, state-dict order
  std::vector<std::string> names;  // their names in the files
  std::string chosen;              // the name read (load) or written (save)
  // A split entry (SafetensorsSplit): the tensors in the files holding it, and where each
  // begins among the entry's elements; empty otherwise.
  std::vector<SafetensorsPiece> pieces;
  std::vector<int64_t> offsets;
  c10::optional<SafetensorsDerived> derived;  // load only: LoadSafetensorsOptions::derive
};

// The entry's shape and dtype in the model.
std::pair<std::vector<int64_t>, at::ScalarType> model_spec(const Entry& entry) {
  if (entry.handle == nullptr) return {entry.tensor.sizes().vec(), entry.tensor.scalar_type()};
  return {entry.handle->param_infos()[entry.info].shape,
          entry.handle->sharded_flat_param().scalar_type()};
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t size : shape) n *= size;
  return n;
}

// Gives `group` the pieces `split` holds its entry in, if any.
void split_group(Group& group, const std::vector<Entry>& entries, const SafetensorsSplit& split) {
  const Entry& entry = entries[group.entries.front()];
  const std::vector<int64_t> shape = model_spec(entry).first;
  group.pieces = split(entry.fqn, shape);
  if (group.pieces.empty()) return;
  TORCH_CHECK(group.entries.size() == 1, "safetensors: '", entry.fqn,
              "' is tied to another entry and cannot be split into pieces; split only untied "
              "entries");
  int64_t offset = 0;
  for (const SafetensorsPiece& piece : group.pieces) {
    group.offsets.push_back(offset);
    offset += numel_of(piece.shape);
  }
  TORCH_CHECK(offset == numel_of(shape), "safetensors: the pieces of '", entry.fqn, "' hold ",
              offset, " elements but the entry has ", numel_of(shape), " (shape ",
              state_internal::shape_string(shape), "); the split must cover it exactly");
}

std::vector<Group> groups_of(const std::vector<Entry>& entries, const SafetensorsRename& rename,
                             const SafetensorsSkip& skip, const SafetensorsSplit& split) {
  std::vector<Group> groups;
  absl::flat_hash_map<std::pair<const void*, size_t>, size_t> group_of;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& entry = entries[i];
    const std::pair<const void*, size_t> key =
        entry.handle != nullptr
            ? std::make_pair(static_cast<const void*>(entry.handle), entry.info)
            : std::make_pair(static_cast<const void*>(entry.tensor.unsafeGetTensorImpl()),
                             size_t{0});
    auto [it, added] = group_of.emplace(key, groups.size());
    if (added) groups.emplace_back();
    Group& group = groups[it->second];
    group.entries.push_back(i);
    group.names.push_back(rename ? rename(entry.fqn) : entry.fqn);
  }
  for (Group& group : groups) group.chosen = group.names.front();
  if (skip) {
    groups.erase(std::remove_if(
                     groups.begin(), groups.end(),
                     [&](const Group& group) { return skip(entries[group.entries.front()].fqn); }),
                 groups.end());
  }
  if (split) {
    for (Group& group : groups) split_group(group, entries, split);
  }
  return groups;
}

// Marks the groups `derive` computes from a source tensor.
void derive_groups(std::vector<Group>& groups, const std::vector<Entry>& entries,
                   const SafetensorsDerive& derive) {
  if (!derive) return;
  for (Group& group : groups) {
    group.derived = derive(entries[group.entries.front()].fqn);
    if (!group.derived) continue;
    TORCH_CHECK(group.pieces.empty() && group.derived->value, "safetensors: '",
                entries[group.entries.front()].fqn,
                "' is derived from a source tensor and so can be neither split nor derived by an "
                "empty function");
    group.chosen = group.derived->source;
  }
}

// Picks each group's name in `ckpt` and checks names, shapes and dtypes.
void match(std::vector<Group>& groups, const std::vector<Entry>& entries,
           const SafetensorsCheckpoint& ckpt, const std::string& path,
           const LoadSafetensorsOptions& options, const std::string& what) {
  std::vector<std::string> expected;
  absl::flat_hash_set<std::string> known;
  for (Group& group : groups) {
    if (group.derived) {  // several entries may derive from one source
      if (known.insert(group.chosen).second) expected.push_back(group.chosen);
      continue;
    }
    if (!group.pieces.empty()) {
      for (const SafetensorsPiece& piece : group.pieces) {
        known.insert(piece.name);
        expected.push_back(piece.name);
      }
      continue;
    }
    for (const std::string& name : group.names) {
      known.insert(name);
      if (ckpt.contains(name) && !ckpt.contains(group.chosen)) group.chosen = name;
    }
    expected.push_back(group.chosen);
  }
  std::vector<std::string> found;
  const absl::flat_hash_set<std::string> chosen(expected.begin(), expected.end());
  for (const std::string& name : ckpt.names()) {
    // A tied alias beside the chosen name is fine; a name the model lacks is unexpected.
    const bool unread = options.unread() && options.unread()(name);
    if (chosen.contains(name) ||
        (!known.contains(name) && !unread && !options.allow_unexpected())) {
      found.push_back(name);
    }
  }
  state_internal::check_same_keys(expected, found, what + ": '" + path + "'");
  const auto check = [&](const Entry& entry, const std::string& name,
                         const std::vector<int64_t>& shape, at::ScalarType dtype) {
    const SafetensorsTensorInfo& info = ckpt.info(name);
    const std::string where = absl::StrCat("'", entry.fqn, "' (tensor '", name, "' in '",
                                           ckpt.file_of(name).path(), "')");
    TORCH_CHECK(info.shape == shape, what, ": size mismatch for ", where, ": the file has shape ",
                state_internal::shape_string(info.shape), ", the model has ",
                state_internal::shape_string(shape));
    const bool cast =
        options.cast_floating() && at::isFloatingType(info.dtype) && at::isFloatingType(dtype);
    TORCH_CHECK(info.dtype == dtype || cast, what, ": dtype mismatch for ", where,
                ": the file has ", safetensors_dtype_name(info.dtype), ", the model has ",
                c10::toString(dtype),
                "; convert one of them first, or load with "
                "LoadSafetensorsOptions().cast_floating(true) (fsdp does not cast silently)");
  };
  for (const Group& group : groups) {
    const Entry& entry = entries[group.entries.front()];
    const auto [shape, dtype] = model_spec(entry);
    if (group.derived) continue;  // its value is checked as it is computed (load_groups)
    if (group.pieces.empty()) check(entry, group.chosen, shape, dtype);
    for (const SafetensorsPiece& piece : group.pieces) check(entry, piece.name, piece.shape, dtype);
  }
}

// Reads `name`'s elements [begin, begin + numel) into `out` (any device; another
// floating dtype than the file's is converted, as match allowed).
void read_into(const SafetensorsCheckpoint& ckpt, const std::string& name, int64_t begin,
               int64_t numel, const at::Tensor& out) {
  if (out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == ckpt.info(name).dtype) {
    ckpt.read_range_into(name, begin, numel, out);
  } else {
    out.copy_(ckpt.read_range(name, begin, numel).view(out.sizes()));
  }
}

// Reads the entry's elements [begin, begin + numel) into `out` (flat), from the one tensor
// holding it or from the pieces holding them (each only for its overlap).
void read_group_range(const SafetensorsCheckpoint& ckpt, const Group& group, int64_t begin,
                      int64_t numel, const at::Tensor& out) {
  if (group.pieces.empty()) return read_into(ckpt, group.chosen, begin, numel, out);
  for (size_t i = 0; i < group.pieces.size(); ++i) {
    const int64_t piece_begin = group.offsets[i];
    const int64_t piece_end = piece_begin + numel_of(group.pieces[i].shape);
    const int64_t from = std::max(begin, piece_begin), to = std::min(begin + numel, piece_end);
    if (from >= to) continue;
    read_into(ckpt, group.pieces[i].name, from - piece_begin, to - from,
              out.narrow(0, from - begin, to - from));
  }
}

// A derived entry's full value (LoadSafetensorsOptions::derive), from its source, read
// whole unless it is `source` already (the previous derived entry's).
at::Tensor derived_value(const SafetensorsCheckpoint& ckpt, const Group& group, const Entry& entry,
                         std::pair<std::string, at::Tensor>& source) {
  if (source.first != group.derived->source || !source.second.defined()) {
    source = {group.derived->source, at::Tensor()};  // the old one goes first
    source.second = ckpt.read(group.derived->source);
  }
  const at::Tensor value = group.derived->value(source.second);
  const auto [shape, dtype] = model_spec(entry);
  TORCH_CHECK(
      value.defined() && value.sizes().vec() == shape && value.scalar_type() == dtype,
      "load_safetensors: '", entry.fqn, "' derived from '", group.derived->source, "' came out as ",
      value.defined() ? absl::StrCat(c10::toString(value.scalar_type()), " ",
                                     state_internal::shape_string(value.sizes().vec()))
                      : std::string("nothing"),
      " but the model holds ", c10::toString(dtype), " ", state_internal::shape_string(shape));
  return value.contiguous().view(-1);
}

void load_groups(const std::vector<Entry>& entries, const std::vector<Group>& groups,
                 const SafetensorsCheckpoint& ckpt) {
  torch::NoGradGuard no_grad;
  std::pair<std::string, at::Tensor> source;  // the last derived entries' source
  for (const Group& group : groups) {
    const Entry& entry = entries[group.entries.front()];
    if (group.derived) {
      const at::Tensor value = derived_value(ckpt, group, entry, source);
      if (entry.handle == nullptr) {
        entry.tensor.detach().copy_(value.view(entry.tensor.sizes()));
        continue;
      }
      const state_internal::ParamSlice slice =
          state_internal::param_slice(*entry.handle, entry.info);
      if (slice.numel == 0) continue;
      entry.handle->sharded_flat_param()
          .detach()
          .narrow(0, slice.shard_begin, slice.numel)
          .copy_(value.narrow(0, slice.param_begin, slice.numel));
      continue;
    }
    if (entry.handle == nullptr) {
      const at::Tensor target = entry.tensor.detach();
      if (group.pieces.empty()) {
        read_into(ckpt, group.chosen, 0, target.numel(), target);
      } else {
        const at::Tensor flat = target.contiguous().view(-1);
        read_group_range(ckpt, group, 0, flat.numel(), flat);
        if (!flat.is_same(target)) target.copy_(flat.view(target.sizes()));
      }
      continue;
    }
    const state_internal::ParamSlice slice = state_internal::param_slice(*entry.handle, entry.info);
    if (slice.numel == 0) continue;
    const at::Tensor shard =
        entry.handle->sharded_flat_param().detach().narrow(0, slice.shard_begin, slice.numel);
    read_group_range(ckpt, group, slice.param_begin, slice.numel, shard);
  }
}

// The dtype entry `fqn`, of `tensor_dtype`, is written in under `options`.
at::ScalarType written_dtype(const std::string& fqn, at::ScalarType tensor_dtype,
                             const SaveSafetensorsOptions& options) {
  const bool kept = options.keep_dtype() && options.keep_dtype()(fqn);
  return options.dtype() && at::isFloatingType(tensor_dtype) && !kept ? *options.dtype()
                                                                      : tensor_dtype;
}

// What `group` is written as: one tensor, or its pieces.
void add_specs(const Group& group, const Entry& entry, const SaveSafetensorsOptions& options,
               std::vector<SafetensorsTensorSpec>& specs) {
  auto [shape, dtype] = model_spec(entry);
  if (options.written_as()) {
    if (const c10::optional<SafetensorsWrittenAs> as = options.written_as()(entry.fqn)) {
      shape = as->shape;
      dtype = as->dtype;
    }
  }
  if (group.pieces.empty()) {
    specs.push_back({group.chosen, written_dtype(entry.fqn, dtype, options), std::move(shape)});
  }
  for (const SafetensorsPiece& piece : group.pieces) {
    specs.push_back({piece.name, written_dtype(entry.fqn, dtype, options), piece.shape});
  }
}

// Writes `value` (entry `fqn`'s, already transformed) as `group`: one tensor, or its pieces.
void write_group(SafetensorsFolderWriter& writer, const Group& group, const std::string& fqn,
                 const at::Tensor& value, const SaveSafetensorsOptions& options) {
  const auto as_written = [&](const at::Tensor& tensor) {
    return tensor.to(written_dtype(fqn, tensor.scalar_type(), options));
  };
  if (group.pieces.empty()) return writer.write(group.chosen, as_written(value));
  const at::Tensor flat = value.reshape(-1);
  for (size_t i = 0; i < group.pieces.size(); ++i) {
    const SafetensorsPiece& piece = group.pieces[i];
    writer.write(
        piece.name,
        as_written(flat.narrow(0, group.offsets[i], numel_of(piece.shape)).view(piece.shape)));
  }
}

}  // namespace

void load_safetensors(FullyShardedRoot& model, const std::string& path,
                      const LoadSafetensorsOptions& options) {
  static const std::string kWhat = "load_safetensors";
  const ModelLayout layout = state_internal::model_layout(model, kWhat.c_str());
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(path);
  std::vector<Group> groups =
      groups_of(layout.entries, options.rename(), options.skip(), options.split());
  derive_groups(groups, layout.entries, options.derive());
  match(groups, layout.entries, ckpt, path, options, kWhat);
  load_groups(layout.entries, groups, ckpt);
}

void load_module_safetensors(torch::nn::Module& module, const std::string& path,
                             const LoadSafetensorsOptions& options) {
  static const std::string kWhat = "load_module_safetensors";
  const std::vector<Entry> entries = state_internal::module_entries(module);
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(path);
  std::vector<Group> groups = groups_of(entries, options.rename(), options.skip(), options.split());
  derive_groups(groups, entries, options.derive());
  match(groups, entries, ckpt, path, options, kWhat);
  load_groups(entries, groups, ckpt);
}

std::vector<std::string> save_safetensors(FullyShardedRoot& model, const std::string& dir,
                                          const SaveSafetensorsOptions& options) {
  const ModelLayout layout = state_internal::model_layout(model, "save_safetensors");
  const std::vector<Group> groups =
      groups_of(layout.entries, options.rename(), options.skip(), options.split());
  // Written in gathering order: tensors outside the units, then each unit's parameters
  // (its flat parameters in order).
  std::vector<const Group*> order;
  for (const Group& group : groups) {
    if (layout.entries[group.entries.front()].handle == nullptr) order.push_back(&group);
  }
  for (const state_internal::FlatParam& flat : layout.flat_params) {
    for (const Group& group : groups) {
      if (layout.entries[group.entries.front()].handle == flat.handle) order.push_back(&group);
    }
  }
  std::unique_ptr<SafetensorsFolderWriter> writer;
  if (layout.rank == 0) {
    std::vector<SafetensorsTensorSpec> specs;
    for (const Group* group : order) {
      add_specs(*group, layout.entries[group->entries.front()], options, specs);
    }
    writer = std::make_unique<SafetensorsFolderWriter>(
        dir, std::move(specs), SafetensorsWriteOptions().max_shard_size(options.max_shard_size()));
  }
  // The full value of an entry whose unit (if any) is unsharded.
  const auto value_of = [](const Entry& entry) {
    return entry.handle == nullptr ? entry.tensor : entry.handle->original_params()[entry.info];
  };
  // Writes order[next...] while `in_unit` holds for them; `unit`: the unit's entries.
  size_t next = 0;
  const auto write_while = [&](const std::function<bool(const Entry&)>& in_unit,
                               const torch::OrderedDict<std::string, at::Tensor>& unit) {
    for (; next < order.size(); ++next) {
      const Entry& entry = layout.entries[order[next]->entries.front()];
      if (!in_unit(entry)) break;
      if (!writer) continue;
      const at::Tensor value = value_of(entry);
      write_group(*writer, *order[next], entry.fqn,
                  options.transform() ? options.transform()(entry.fqn, value, unit) : value,
                  options);
    }
  };
  // The entries (all names) of the unit `handles` belong to, or outside the units.
  const auto unit_entries = [&](const std::vector<FlatParamHandle*>& handles) {
    torch::OrderedDict<std::string, at::Tensor> unit;
    if (!writer || !options.transform()) return unit;
    for (const Entry& entry : layout.entries) {
      if (std::find(handles.begin(), handles.end(), entry.handle) != handles.end()) {
        unit.insert(entry.fqn, value_of(entry));
      }
    }
    return unit;
  };
  write_while([](const Entry& entry) { return entry.handle == nullptr; }, unit_entries({nullptr}));
  // One unit unsharded at a time, all its flat parameters together, in full precision (as
  // full_state_dict).
  for (size_t first = 0; first < layout.flat_params.size();) {
    std::vector<FlatParamHandle*> handles;
    size_t end = first;
    for (; end < layout.flat_params.size() &&
           layout.flat_params[end].unit_fqn == layout.flat_params[first].unit_fqn;
         ++end) {
      handles.push_back(layout.flat_params[end].handle);
    }
    for (FlatParamHandle* handle : handles) handle->unshard_full_precision();
    const torch::OrderedDict<std::string, at::Tensor> unit = unit_entries(handles);
    write_while(
        [&](const Entry& entry) {
          return std::find(handles.begin(), handles.end(), entry.handle) != handles.end();
        },
        unit);
    for (FlatParamHandle* handle : handles) handle->reshard();
    first = end;
  }
  TORCH_INTERNAL_ASSERT(next == order.size());
  return writer ? writer->commit() : std::vector<std::string>{};
}

std::vector<std::string> save_module_safetensors(const torch::nn::Module& module,
                                                 const std::string& dir,
                                                 const SaveSafetensorsOptions& options) {
  const std::vector<Entry> entries = state_internal::module_entries(module);
  const std::vector<Group> groups =
      groups_of(entries, options.rename(), options.skip(), options.split());
  std::vector<SafetensorsTensorSpec> specs;
  for (const Group& group : groups) {
    add_specs(group, entries[group.entries.front()], options, specs);
  }
  SafetensorsFolderWriter writer(
      dir, std::move(specs), SafetensorsWriteOptions().max_shard_size(options.max_shard_size()));
  torch::OrderedDict<std::string, at::Tensor> all;
  if (options.transform()) {
    for (const Entry& entry : entries) all.insert(entry.fqn, entry.tensor);
  }
  for (const Group& group : groups) {
    const Entry& entry = entries[group.entries.front()];
    write_group(
        writer, group, entry.fqn,
        options.transform() ? options.transform()(entry.fqn, entry.tensor, all) : entry.tensor,
        options);
  }
  return writer.commit();
}

}  // namespace fsdp
