#include "fsdp/wrap/module_tree.h"

#include <typeinfo>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include <c10/util/Exception.h>
#include <c10/util/Type.h>

#include "fsdp/base/names.h"

namespace fsdp {
namespace {

// C++ frontend class (without the "torch::nn::" prefix and "Impl" suffix) -> Python
// module path. Only types that both frontends provide.
const absl::flat_hash_map<std::string, std::string>& cpp_to_python_module() {
  static const auto* table = new absl::flat_hash_map<std::string, std::string>{
      {"Linear", "linear"},
      {"Bilinear", "linear"},
      {"Identity", "linear"},
      {"Conv1d", "conv"},
      {"Conv2d", "conv"},
      {"Conv3d", "conv"},
      {"ConvTranspose1d", "conv"},
      {"ConvTranspose2d", "conv"},
      {"ConvTranspose3d", "conv"},
      {"BatchNorm1d", "batchnorm"},
      {"BatchNorm2d", "batchnorm"},
      {"BatchNorm3d", "batchnorm"},
      {"InstanceNorm1d", "instancenorm"},
      {"InstanceNorm2d", "instancenorm"},
      {"InstanceNorm3d", "instancenorm"},
      {"LayerNorm", "normalization"},
      {"GroupNorm", "normalization"},
      {"LocalResponseNorm", "normalization"},
      {"Embedding", "sparse"},
      {"EmbeddingBag", "sparse"},
      {"MultiheadAttention", "activation"},
      {"ReLU", "activation"},
      {"ReLU6", "activation"},
      {"GELU", "activation"},
      {"SiLU", "activation"},
      {"Mish", "activation"},
      {"Tanh", "activation"},
      {"Sigmoid", "activation"},
      {"Softmax", "activation"},
      {"LogSoftmax", "activation"},
      {"LeakyReLU", "activation"},
      {"ELU", "activation"},
      {"PReLU", "activation"},
      {"Dropout", "dropout"},
      {"Dropout2d", "dropout"},
      {"Dropout3d", "dropout"},
      {"Sequential", "container"},
      {"ModuleList", "container"},
      {"ModuleDict", "container"},
      {"ParameterList", "container"},
      {"ParameterDict", "container"},
      {"Transformer", "transformer"},
      {"TransformerEncoder", "transformer"},
      {"TransformerDecoder", "transformer"},
      {"TransformerEncoderLayer", "transformer"},
      {"TransformerDecoderLayer", "transformer"},
      {"LSTM", "rnn"},
      {"GRU", "rnn"},
      {"RNN", "rnn"},
      {"LSTMCell", "rnn"},
      {"GRUCell", "rnn"},
      {"RNNCell", "rnn"},
      {"MaxPool1d", "pooling"},
      {"MaxPool2d", "pooling"},
      {"MaxPool3d", "pooling"},
      {"AvgPool1d", "pooling"},
      {"AvgPool2d", "pooling"},
      {"AvgPool3d", "pooling"},
      {"AdaptiveAvgPool1d", "pooling"},
      {"AdaptiveAvgPool2d", "pooling"},
      {"AdaptiveAvgPool3d", "pooling"},
      {"AdaptiveMaxPool2d", "pooling"},
      {"Flatten", "flatten"},
      {"Unflatten", "flatten"},
  };
  return *table;
}

}  // namespace

std::string python_class_path_for_cpp(absl::string_view cpp_type_name) {
  absl::string_view name = cpp_type_name;
  if (absl::ConsumePrefix(&name, "torch::nn::") && absl::ConsumeSuffix(&name, "Impl")) {
    const auto& table = cpp_to_python_module();
    auto it = table.find(name);
    if (it != table.end()) return absl::StrCat("torch.nn.modules.", it->second, ".", name);
  }
  return std::string(cpp_type_name);
}

bool is_known_torch_class_path(absl::string_view path) {
  std::vector<absl::string_view> parts = absl::StrSplit(path, '.');
  if (parts.size() != 5 || !absl::StartsWith(path, "torch.nn.modules.")) return false;
  const auto& table = cpp_to_python_module();
  auto it = table.find(parts[4]);
  return it != table.end() && it->second == parts[3];
}

std::string normalize_torchscript_type_name(absl::string_view qualified_name) {
  std::vector<absl::string_view> kept;
  for (absl::string_view part : absl::StrSplit(qualified_name, '.')) {
    if (!absl::StartsWith(part, "___torch_mangle_")) kept.push_back(part);
  }
  if (!kept.empty() && kept.front() == "__torch__") {
    // "__torch__.Net" is a class of a Python main program; "__torch__.a.b.Net" is a.b.Net.
    if (kept.size() == 2) return absl::StrCat("__main__.", kept[1]);
    kept.erase(kept.begin());
  }
  return absl::StrJoin(kept, ".");
}

int ModuleTree::add_root(std::string type_name) {
  TORCH_CHECK(nodes_.empty(), "ModuleTree::add_root: the tree already has a root");
  ModuleNode root;
  root.type_name = std::move(type_name);
  nodes_.push_back(std::move(root));
  path_ = {0};
  return 0;
}

int ModuleTree::add_child(int parent, std::string name, std::string type_name) {
  TORCH_CHECK(!nodes_.empty(), "ModuleTree::add_child: add the root first");
  // Pre-order: the parent is on the path from the root to the last added node.
  while (!path_.empty() && path_.back() != parent) path_.pop_back();
  TORCH_CHECK(!path_.empty(), "ModuleTree::add_child: parent ", parent,
              " is not the last added node or one of its ancestors; add nodes in "
              "pre-order");
  ModuleNode child;
  child.index = size();
  child.parent = parent;
  child.depth = nodes_[parent].depth + 1;
  child.fqn = parent == 0 ? name : absl::StrCat(nodes_[parent].fqn, ".", name);
  if (name == kFsdpWrappedModule) nodes_[parent].is_fsdp_wrapper = true;
  child.name = std::move(name);
  child.type_name = std::move(type_name);
  nodes_[parent].children.push_back(child.index);
  nodes_.push_back(std::move(child));
  path_.push_back(size() - 1);
  return size() - 1;
}

void ModuleTree::add_param(int node, std::string name, const void* key, int64_t numel) {
  TORCH_CHECK(node >= 0 && node < size(), "ModuleTree::add_param: no node ", node);
  auto [it, first] = slot_of_.try_emplace(key, num_param_slots());
  nodes_[node].params.push_back({std::move(name), key, numel, it->second});
}

void ModuleTree::set_cpp_module(int node, const torch::nn::Module* module) {
  TORCH_CHECK(node >= 0 && node < size(), "ModuleTree::set_cpp_module: no node ", node);
  nodes_[node].cpp_module = module;
}

int ModuleTree::slot_of(const void* key) const {
  auto it = slot_of_.find(key);
  return it == slot_of_.end() ? -1 : it->second;
}

int ModuleTree::find(absl::string_view fqn) const {
  for (const ModuleNode& node : nodes_) {
    if (node.fqn == fqn) return node.index;
  }
  return -1;
}

ModuleTree ModuleTree::from_module(const torch::nn::Module& root, const UnwrapFn& unwrap) {
  struct Pending {
    const torch::nn::Module* module;
    std::string name;  // under the parent; "" for the root
    int parent;        // node index; -1 for the root
  };
  ModuleTree tree;
  std::vector<Pending> stack = {{&root, "", -1}};
  while (!stack.empty()) {
    Pending next = std::move(stack.back());
    stack.pop_back();
    const torch::nn::Module* module = next.module;
    while (unwrap) {
      const torch::nn::Module* inner = unwrap(*module);
      if (inner == nullptr) break;
      module = inner;
    }
    std::string type_name = python_class_path_for_cpp(c10::demangle(typeid(*module).name()));
    const int index = next.parent < 0
                          ? tree.add_root(std::move(type_name))
                          : tree.add_child(next.parent, std::move(next.name), std::move(type_name));
    tree.set_cpp_module(index, module);
    for (const auto& item : module->named_parameters(/*recurse=*/false)) {
      tree.add_param(index, item.key(), param_key(item.value()), item.value().numel());
    }
    const auto children = module->named_children();
    for (auto it = children.end(); it != children.begin();) {  // first child on top
      --it;
      stack.push_back({it->value().get(), it->key(), index});
    }
  }
  return tree;
}

}  // namespace fsdp
