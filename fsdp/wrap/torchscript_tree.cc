#include "fsdp/wrap/torchscript_tree.h"

#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/import.h>

#include "fsdp/formats/files.h"
#include "fsdp/formats/pickle.h"
#include "fsdp/formats/torch_tensor_record.h"
#include "fsdp/formats/torch_zip.h"

namespace fsdp {
namespace {

constexpr char kExpected[] = "expected a file written by torch.jit.script(model).save(path)";
constexpr char kTrust[] =
    "fsdp reads TorchScript archives as data and never runs their code; if you trust the "
    "file, --trust_torchscript (load_torchscript_tree_trusted) loads it with "
    "torch::jit::load, which runs that code";

// Caps on what one archive may make the reader allocate (bytes of data.pkl, of all code
// files together, modules in the tree): far above any real model, far below the memory
// of the machine.
constexpr int64_t kMaxPickleBytes = int64_t{256} << 20;
constexpr int64_t kMaxCodeBytes = int64_t{256} << 20;
constexpr int kMaxModules = 1 << 20;
// The walk over module objects is bounded by what it builds, not only by the file: a module
// object may be reached through many paths (each becomes a node, as torch::jit::load's
// named_children gives it), so a small file could otherwise ask for a huge tree.
constexpr int kMaxDepth = 1000;                       // modules from the root
constexpr int64_t kMaxAttributes = int64_t{1} << 24;  // attributes examined, all nodes
constexpr int64_t kMaxFqnBytes = int64_t{256} << 20;  // FQN characters, all nodes

// The first non-empty line of an error: PyTorch's messages may start with a newline and
// end with a C++ stack trace.
std::string first_line(const char* what) {
  absl::string_view line = absl::StripLeadingAsciiWhitespace(what);
  line = line.substr(0, line.find('\n'));
  return line.empty() ? std::string("no reason given") : std::string(line);
}

std::string type_name_of(const torch::jit::Module& module) {
  return normalize_torchscript_type_name(module.type()->name()->qualifiedName());
}

// What a class declaration in the archive's code/ says about the class.
struct ClassDecl {
  bool is_module = false;                       // declared as `class NAME(Module):`
  bool has_setstate = false;                    // has `def __setstate__(`
  absl::flat_hash_set<std::string> parameters;  // from `__parameters__ = ["a", "b", ]`
};
using ClassDecls = absl::flat_hash_map<std::string, ClassDecl>;

// Note [TorchScript archives as data]
// torch.jit.script(model).save(path) writes a zip archive with
//   data.pkl           the module as a pickle: each module an object of its (mangled)
//                      class, e.g. GLOBAL "__torch__.torch.nn.modules.linear.___torch_mangle_3
//                      Linear" + NEWOBJ + BUILD with a dict of every attribute in slot order
//                      (submodules, parameters, buffers, plain values); tensors are
//                      torch._utils._rebuild_tensor_v2 over storages named by persistent ids
//                      (fsdp/formats/torch_tensor_record.h), one memo entry per tensor, so a
//                      parameter shared by two modules is one pickle value;
//   data/<key>         the storages' bytes;
//   code/<module>.py   each class's declaration as TorchScript source text, starting
//                        class Linear(Module):
//                          __parameters__ = ["weight", "bias", ]
//                          __buffers__ = []
//                          weight : Tensor
//                          ...
//                          def forward(self: ..., input: Tensor) -> Tensor:
//                      in code/__torch__/torch/nn/modules/linear/___torch_mangle_3.py for
//                      the class __torch__.torch.nn.modules.linear.___torch_mangle_3.Linear.
// torch::jit::load compiles that source and runs the unpickler, which calls a class's
// __setstate__ (code the file carries: it may write files) on its saved state. Here the
// pickle is read with classes as tags (nothing is called) and the declarations are read as
// text, only the header lines above: the class line (a module's base is `Module`), the
// __parameters__ list and whether a `def __setstate__(` line exists. A module attribute is
// a child when its value is an object of a module class, a parameter when its name is in
// its class's __parameters__ and its value is a tensor (a None parameter, like Linear's
// bias=False, is skipped as named_parameters skips it), so the tree equals the one
// torch::jit::load's Module gives. A module with its own __setstate__ saved its
// __getstate__'s result instead of its attributes, which only its code can interpret: it
// is refused. Sizes come from the tensor records, each checked against its storage, and
// each storage against the size of its record in the archive. A module object may be
// reached through many paths (each becomes a node, as with torch::jit::load), so the walk
// is bounded by what it builds (modules, depth, attributes examined, bytes of FQNs) as well
// as by the bytes it reads.

// `["weight", "bias", ]` -> {"weight", "bias"}.
absl::flat_hash_set<std::string> name_list(absl::string_view text, const std::string& where) {
  text = absl::StripAsciiWhitespace(text);
  TORCH_CHECK(absl::ConsumePrefix(&text, "[") && absl::ConsumeSuffix(&text, "]"), where,
              ": a __parameters__ line is not a list of names (", text, "); ", kExpected);
  absl::flat_hash_set<std::string> names;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    TORCH_CHECK(
        item.size() >= 2 && absl::ConsumePrefix(&item, "\"") && absl::ConsumeSuffix(&item, "\""),
        where, ": a __parameters__ entry is not a quoted name (", item, "); ", kExpected);
    names.emplace(item);
  }
  return names;
}

// Reads the class headers of one code file (`module` is its dotted path, e.g.
// "__torch__.torch.nn.modules.linear"). See Note [TorchScript archives as data].
void read_class_decls(absl::string_view text, absl::string_view module, const std::string& where,
                      ClassDecls& decls) {
  ClassDecl* current = nullptr;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, "class ")) {
      const size_t end = line.find_first_of("(:");
      TORCH_CHECK(end != absl::string_view::npos && end > 0, where, ": a malformed class line; ",
                  kExpected);
      const std::string name = absl::StrCat(module, ".", line.substr(0, end));
      const auto [decl, inserted] = decls.try_emplace(name);
      TORCH_CHECK(inserted, where, ": class ", name, " is declared twice; ", kExpected);
      current = &decl->second;
      current->is_module = absl::StartsWith(line.substr(end), "(Module)");
    } else if (!absl::StartsWith(line, " ")) {
      current = nullptr;  // a top-level function or blank line ends the class
    } else if (current != nullptr) {
      if (absl::ConsumePrefix(&line, "  __parameters__ = ")) {
        current->parameters = name_list(line, where);
      } else if (absl::StartsWith(line, "  def __setstate__(")) {
        current->has_setstate = true;
      }
    }
  }
}

// The archive's records, read with their sizes checked first (TorchZipArchive: a
// regular file, a bounded number of records, none larger than the archive).
class Archive {
 public:
  explicit Archive(const std::string& path) : path_(path) {
    try {
      archive_.emplace(TorchZipArchive::open_file(ReadableFile::open(path, "TorchScript archive")));
      records_ = archive_->reader().getAllRecords();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "'", path, "' is not a readable TorchScript archive (",
                  first_line(e.what()), "); ", kExpected);
    }
  }

  const std::vector<std::string>& records() const { return records_; }
  bool has(const std::string& name) const { return archive_->has(name); }

  int64_t size(const std::string& name) const { return archive_->record_size(name); }

  std::string read(const std::string& name, int64_t cap) const {
    TORCH_CHECK(has(name), "'", path_, "' has no ", name, "; ", kExpected);
    const int64_t bytes = size(name);
    TORCH_CHECK(bytes <= cap, "'", path_, "': ", name, " holds ", bytes, " bytes, more than the ",
                cap, " this reader accepts; ", kExpected);
    try {
      return archive_->read(name);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "'", path_, "': ", name, " cannot be read (", first_line(e.what()), "); ",
                  kExpected);
    }
  }

 private:
  std::string path_;
  std::optional<TorchZipArchive> archive_;
  std::vector<std::string> records_;
};

// Every class declaration in the archive's code/ folder.
ClassDecls read_code(const Archive& archive, const std::string& path) {
  ClassDecls decls;
  int64_t total = 0;
  for (const std::string& record : archive.records()) {
    absl::string_view name = record;
    if (!absl::ConsumePrefix(&name, "code/") || !absl::ConsumeSuffix(&name, ".py")) continue;
    total += archive.size(record);
    TORCH_CHECK(total <= kMaxCodeBytes, "'", path, "': the code/ files hold more than ",
                kMaxCodeBytes, " bytes; ", kExpected);
    const std::string text = archive.read(record, kMaxCodeBytes);
    read_class_decls(text, absl::StrReplaceAll(name, {{"/", "."}}),
                     absl::StrCat("'", path, "': ", record), decls);
  }
  return decls;
}

// The tensors and storages of data.pkl: values the hooks made, known by address (a pickle
// cannot forge one).
struct TensorRecords {
  absl::flat_hash_map<const PickleValue*, TorchStorageId> storages;
  absl::flat_hash_map<const PickleValue*, int64_t> tensor_numel;
  absl::flat_hash_map<std::string, TorchStorageId> by_key;
};

PickleHooks data_hooks(const Archive& archive, const std::string& path, TensorRecords& records) {
  PickleHooks hooks;
  // Every class is a tag: nothing is called, so any name may appear.
  hooks.allow_global = [](const std::string&) { return true; };
  hooks.persistent_load = [&archive, &path, &records](const PickleValuePtr& pid) {
    const TorchStorageId id = read_torch_storage_id(*pid);
    const auto [seen, inserted] = records.by_key.try_emplace(id.key, id);
    if (inserted) {
      const std::string record = "data/" + id.key;
      TORCH_CHECK(archive.has(record), "'", path, "': the storage record ", record, " is missing; ",
                  kExpected);
      const int64_t bytes = torch_storage_bytes(id);
      TORCH_CHECK(archive.size(record) == bytes, "'", path, "': record ", record, " holds ",
                  archive.size(record), " bytes, not the ", bytes, " of ", id.numel,
                  " elements of ", c10::toString(id.dtype), "; ", kExpected);
    } else {
      TORCH_CHECK(seen->second.numel == id.numel && seen->second.dtype == id.dtype, "'", path,
                  "': storage ", id.key, " is named with two sizes or types; ", kExpected);
    }
    PickleValuePtr value = PickleValue::object("<storage>", {});
    records.storages.emplace(value.get(), id);
    return value;
  };
  hooks.reduce = [&records](const std::string& name,
                            const std::vector<PickleValuePtr>& args) -> PickleValuePtr {
    if (name != "torch._utils._rebuild_tensor_v2") return nullptr;  // kept as a tag
    constexpr const char* kWhat = "_rebuild_tensor_v2";
    TORCH_CHECK(!args.empty(), kWhat, ": no arguments");
    const auto storage = records.storages.find(args[0].get());
    TORCH_CHECK(storage != records.storages.end(), kWhat, ": argument 0 must be a storage");
    const TorchTensorView view = read_torch_tensor_view(args, storage->second.numel, kWhat);
    PickleValuePtr value = PickleValue::object("<tensor>", {});
    records.tensor_numel.emplace(value.get(), view.numel);
    return value;
  };
  return hooks;
}

}  // namespace

ModuleTree module_tree_from_torchscript(const torch::jit::Module& module) {
  ModuleTree tree;
  struct Frame {
    torch::jit::Module module;
    int parent;
    std::string name;
  };
  std::vector<Frame> stack = {{module, -1, ""}};
  while (!stack.empty()) {
    Frame frame = std::move(stack.back());
    stack.pop_back();
    const int index = frame.parent < 0
                          ? tree.add_root(type_name_of(frame.module))
                          : tree.add_child(frame.parent, frame.name, type_name_of(frame.module));
    for (const auto& param : frame.module.named_parameters(/*recurse=*/false)) {
      tree.add_param(index, param.name, param.value.unsafeGetTensorImpl(), param.value.numel());
    }
    std::vector<Frame> children;
    for (const auto& child : frame.module.named_children()) {
      children.push_back({child.value, index, child.name});
    }
    for (auto it = children.rbegin(); it != children.rend(); ++it) {
      stack.push_back(std::move(*it));
    }
  }
  return tree;
}

ModuleTree load_torchscript_tree(const std::string& path) {
  const Archive archive(path);
  TORCH_CHECK(archive.has("data.pkl") && archive.has("constants.pkl"), "'", path,
              "' is a zip archive without TorchScript's data.pkl and constants.pkl; ", kExpected);
  const ClassDecls decls = read_code(archive, path);
  TensorRecords records;
  const PickleHooks hooks = data_hooks(archive, path, records);
  PickleValuePtr root;
  try {
    root = read_pickle(archive.read("data.pkl", kMaxPickleBytes), hooks, "data.pkl");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "'", path, "': ", first_line(e.what_without_backtrace()), "; ", kExpected);
  }

  // The module objects, in pre-order. See Note [TorchScript archives as data].
  auto module_class = [&](const PickleValue& value) -> const ClassDecl* {
    if (value.kind != PickleValue::Kind::kObject) return nullptr;
    const auto decl = decls.find(value.string);
    return decl != decls.end() && decl->second.is_module ? &decl->second : nullptr;
  };
  TORCH_CHECK(
      module_class(*root) != nullptr, "'", path, "': data.pkl holds a ",
      root->kind == PickleValue::Kind::kObject ? root->string : pickle_kind_name(root->kind),
      ", not an object of a module class declared in code/; ", kExpected);
  ModuleTree tree;
  struct Frame {
    const PickleValue* module;
    int parent;
    const std::string* name;  // the key in the parent's attributes (alive with `root`)
    int depth;
    int64_t fqn_bytes;
  };
  std::vector<Frame> stack = {{root.get(), -1, nullptr, 0, 0}};
  int64_t attributes = 0;
  int64_t fqn_bytes = 0;
  while (!stack.empty()) {
    Frame frame = std::move(stack.back());
    stack.pop_back();
    const std::string& class_name = frame.module->string;
    const ClassDecl& decl = *module_class(*frame.module);
    fqn_bytes += frame.fqn_bytes;
    TORCH_CHECK(tree.size() < kMaxModules && frame.depth <= kMaxDepth && fqn_bytes <= kMaxFqnBytes,
                "'", path, "' makes a module tree larger than this reader accepts (", kMaxModules,
                " modules, ", kMaxDepth, " levels, ", kMaxFqnBytes,
                " bytes of names; a module object reached through many paths?); ", kExpected);
    TORCH_CHECK(!decl.has_setstate, "'", path, "': module class ",
                normalize_torchscript_type_name(class_name),
                " restores its attributes with its own __setstate__, code the archive carries; ",
                kTrust);
    const PickleValue* state = frame.module->state.get();
    TORCH_CHECK(state != nullptr && state->kind == PickleValue::Kind::kDict, "'", path,
                "': the module object of class ", class_name,
                " does not hold a dict of its attributes; ", kExpected);
    const std::string type_name = normalize_torchscript_type_name(class_name);
    const int index = frame.parent < 0 ? tree.add_root(type_name)
                                       : tree.add_child(frame.parent, *frame.name, type_name);
    attributes += static_cast<int64_t>(state->items.size() / 2);
    TORCH_CHECK(attributes <= kMaxAttributes, "'", path, "': its modules have more than ",
                kMaxAttributes, " attributes in all; ", kExpected);
    std::vector<Frame> children;
    for (size_t i = 0; i + 1 < state->items.size(); i += 2) {
      const PickleValue& key = *state->items[i];
      const PickleValue& value = *state->items[i + 1];
      TORCH_CHECK(key.kind == PickleValue::Kind::kString, "'", path, "': an attribute of ",
                  class_name, " is named by a ", pickle_kind_name(key.kind), "; ", kExpected);
      if (decl.parameters.contains(key.string)) {
        if (value.kind == PickleValue::Kind::kNone) continue;  // e.g. Linear(bias=False)
        const auto numel = records.tensor_numel.find(&value);
        TORCH_CHECK(numel != records.tensor_numel.end(), "'", path, "': parameter ", key.string,
                    " of ", class_name, " is not a dense tensor record; ", kExpected);
        tree.add_param(index, key.string, &value, numel->second);
      } else if (module_class(value) != nullptr) {
        const int64_t child_fqn_bytes =
            frame.fqn_bytes + static_cast<int64_t>(key.string.size()) + 1;
        children.push_back({&value, index, &key.string, frame.depth + 1, child_fqn_bytes});
      }
    }
    for (auto it = children.rbegin(); it != children.rend(); ++it) {
      stack.push_back(std::move(*it));
    }
  }
  TORCH_CHECK(!absl::EndsWith(tree.node(0).type_name, "PlaceholderModule"), "'", path,
              "' holds a scripted function, not a module; save a module with "
              "torch.jit.script(model).save(path)");
  return tree;
}

ModuleTree load_torchscript_tree_trusted(const std::string& path) {
  TORCH_CHECK(std::ifstream(path).good(), "cannot open '", path, "': ", kExpected);
  torch::jit::Module module;
  try {
    module = torch::jit::load(path, c10::Device(c10::kCPU));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "'", path, "' is not a readable TorchScript archive (", first_line(e.what()),
                "); ", kExpected);
  }
  ModuleTree tree = module_tree_from_torchscript(module);
  TORCH_CHECK(!absl::EndsWith(tree.node(0).type_name, "PlaceholderModule"), "'", path,
              "' holds a scripted function, not a module; save a module with "
              "torch.jit.script(model).save(path)");
  return tree;
}

}  // namespace fsdp
