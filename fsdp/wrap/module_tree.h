// A read-only, pre-order snapshot of a module hierarchy: what the wrap planner needs to
// know about a model (names, type names, parameters and their identities), independent of
// where the model came from: a LibTorch C++ frontend module, a TorchScript module exported
// by PyTorch (see torchscript_tree.h), or a synthetic tree built by hand.
//
//   torch::nn::Sequential net(torch::nn::Linear(5, 5), torch::nn::ReLU());
//   fsdp::ModuleTree tree = fsdp::ModuleTree::from_module(*net);
//   tree.node(1).fqn;        // "0"
//   tree.node(1).type_name;  // "torch.nn.modules.linear.Linear"
//
// Type names are Python class paths (PyTorch's `type(m).__module__ + "." +
// type(m).__qualname__`), so one policy matches a C++ module and the same module exported
// from Python: C++ frontend types map to their Python counterparts
// (torch::nn::LinearImpl -> torch.nn.modules.linear.Linear), other C++ types keep their
// demangled C++ name, and TorchScript names drop "__torch__." and "___torch_mangle_N".
//
// Threading: a ModuleTree is immutable once built; the snapshot does not follow later
// changes to the model it was built from.
#ifndef FSDP_WRAP_MODULE_TREE_H_
#define FSDP_WRAP_MODULE_TREE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include <torch/nn/module.h>

namespace fsdp {

// type_name of a module whose class its source does not record: a module that a
// torch.export graph never called (exported_program_tree.h).
inline constexpr char kUnknownModuleClass[] = "unknown";

// One parameter registered directly on a module.
struct ParamEntry {
  std::string name;  // local name, e.g. "weight"
  const void* key;   // identity: equal keys are the same (shared) parameter
  int64_t numel;     // number of elements
  int slot;          // dense index of the distinct parameter, in first-added order
};

// One module of the tree. Nodes are stored in pre-order; node 0 is the root.
struct ModuleNode {
  int index = 0;                   // position in pre-order
  int parent = -1;                 // index of the parent, -1 for the root
  int depth = 0;                   // 0 for the root
  std::string name;                // name under the parent, "" for the root
  std::string fqn;                 // dotted path from the root, "" for the root
  std::string type_name;           // Python class path (see the file comment)
  std::vector<int> children;       // indices, in registration order
  std::vector<ParamEntry> params;  // parameters registered on this module itself
  // The C++ module this node describes, or nullptr for TorchScript and synthetic trees.
  // Valid while the model it was taken from is alive.
  const torch::nn::Module* cpp_module = nullptr;
  // True for a module that is already an FSDP unit wrapper: it has a child named
  // "_fsdp_wrapped_module" (set when such a child is added).
  bool is_fsdp_wrapper = false;
};

// For a wrapper that changes nothing until it is activated (an fsdp::Unit before a root
// binds it): the module it wraps; for any other module: null.
using UnwrapFn = std::function<const torch::nn::Module*(const torch::nn::Module&)>;

class ModuleTree {
 public:
  // Snapshot of a C++ frontend module tree (registered children and parameters). With
  // `unwrap`, a wrapper it sees through is replaced by the module it wraps: the node keeps
  // the wrapper's name and FQN and takes the wrapped module's type, parameters, children
  // and address (cpp_module), as if the wrapper were not there.
  static ModuleTree from_module(const torch::nn::Module& root, const UnwrapFn& unwrap = nullptr);

  // Building by hand (synthetic trees, TorchScript): the root first, then every node
  // after its parent in pre-order, i.e. `parent` is the last added node or one of its
  // ancestors. Returns the new node's index. Throws c10::Error on an out-of-order parent.
  int add_root(std::string type_name);
  int add_child(int parent, std::string name, std::string type_name);
  void add_param(int node, std::string name, const void* key, int64_t numel);
  // Records the C++ module a hand-built node describes (for ModuleType::of<T> matching).
  void set_cpp_module(int node, const torch::nn::Module* module);

  int size() const { return static_cast<int>(nodes_.size()); }
  // Number of distinct parameters (slots); shared parameters count once.
  int num_param_slots() const { return static_cast<int>(slot_of_.size()); }
  // Slot of the parameter with this key, or -1 if the tree has no such parameter.
  int slot_of(const void* key) const;
  const ModuleNode& node(int index) const { return nodes_[index]; }
  const std::vector<ModuleNode>& nodes() const { return nodes_; }

  // Index of the node with this FQN, or -1.
  int find(absl::string_view fqn) const;

 private:
  std::vector<ModuleNode> nodes_;
  std::vector<int> path_;  // indices from the root to the last added node
  absl::flat_hash_map<const void*, int> slot_of_;
};

// Python class path of a C++ frontend module type name, e.g. "torch::nn::LinearImpl" ->
// "torch.nn.modules.linear.Linear"; any other name is returned unchanged.
std::string python_class_path_for_cpp(absl::string_view cpp_type_name);

// Python class path of a TorchScript qualified class name:
// "__torch__.torch.nn.modules.container.___torch_mangle_3.ModuleList" ->
// "torch.nn.modules.container.ModuleList". A class scripted from a Python main program
// ("__torch__.MyNet") becomes "__main__.MyNet", its Python path.
std::string normalize_torchscript_type_name(absl::string_view qualified_name);

// True iff `path` is the Python class path of a torch.nn module type that LibTorch's C++
// frontend also provides (the table behind python_class_path_for_cpp).
bool is_known_torch_class_path(absl::string_view path);

}  // namespace fsdp

#endif  // FSDP_WRAP_MODULE_TREE_H_
