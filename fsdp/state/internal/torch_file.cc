#include "fsdp/state/internal/torch_file.h"

#include <exception>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/in_memory_adapter.h>

#include "fsdp/formats/torch_tensor_record.h"
#include "fsdp/formats/torch_zip.h"

namespace fsdp::state_internal {
namespace {

using Kind = PyValue::Kind;

// A storage never leaves the reader: an object with this tag (no pickle can name it, it
// is not a "module.name" the hooks allow) holding a 1-D tensor.
constexpr const char* kStorageTag = "<storage>";

bool allowed(const std::string& name) {
  static const auto* kCalls = new absl::flat_hash_set<std::string>{
      "collections.OrderedDict",          "torch._utils._rebuild_tensor_v2",
      "torch._utils._rebuild_parameter",  "torch.jit._pickle.restore_type_tag",
      "torch.jit._pickle.build_intlist",  "torch.jit._pickle.build_doublelist",
      "torch.jit._pickle.build_boollist", "torch.jit._pickle.build_tensorlist",
  };
  return kCalls->contains(name) || torch_storage_dtype(name).has_value();
}

const PyValuePtr& arg(const std::vector<PyValuePtr>& args, size_t i, Kind kind,
                      const std::string& what) {
  TORCH_CHECK(i < args.size() && args[i]->kind == kind, what, ": argument ", i, " must be a ",
              kind_name(kind));
  return args[i];
}

PyValuePtr rebuild_tensor(const std::vector<PyValuePtr>& args) {
  constexpr const char* kWhat = "_rebuild_tensor_v2";
  const PyValuePtr& storage_value = arg(args, 0, Kind::kObject, kWhat);
  TORCH_CHECK(storage_value->string == kStorageTag, kWhat, ": argument 0 must be a storage");
  const at::Tensor& storage = storage_value->tensor;
  const TorchTensorView view = read_torch_tensor_view(args, storage.numel(), kWhat);
  PyValuePtr value = PyValue::make(Kind::kTensor);
  value->tensor = view.numel == 0 ? at::empty(view.sizes, storage.options())
                                  : storage.as_strided(view.sizes, view.strides, view.offset);
  return value;
}

PyValuePtr reduce(const std::string& name, const std::vector<PyValuePtr>& args) {
  if (name == "collections.OrderedDict") return PyValue::make(Kind::kDict);
  if (name == "torch._utils._rebuild_tensor_v2") return rebuild_tensor(args);
  if (name == "torch.jit._pickle.restore_type_tag") {
    TORCH_CHECK(!args.empty(), name, " without arguments");
    return args[0];  // LibTorch's type annotation of a dict or list
  }
  if (name == "torch._utils._rebuild_parameter") {
    return arg(args, 0, Kind::kTensor, "_rebuild_parameter");
  }
  if (name.rfind("torch.jit._pickle.build_", 0) == 0) {
    return arg(args, 0, Kind::kList, name);  // LibTorch's typed lists
  }
  TORCH_CHECK(false, "the file holds a ", name,
              " object; only dicts, lists, scalars and tensors are read (save a state dict: "
              "torch.save(model.state_dict(), path))");
}

class StorageLoader {
 public:
  explicit StorageLoader(const TorchZipArchive& archive) : archive_(archive) {}

  PyValuePtr operator()(const PyValuePtr& pid) {
    const TorchStorageId id = read_torch_storage_id(*pid);
    const std::string& key = id.key;
    auto cached = storages_.find(key);
    if (cached == storages_.end()) {
      cached = storages_.emplace(key, load(key, id.dtype, id.numel)).first;
    }
    PyValuePtr value = PyValue::object(kStorageTag, {});
    value->tensor = cached->second;
    return value;
  }

 private:
  at::Tensor load(const std::string& key, at::ScalarType dtype, int64_t numel) {
    const std::string record = "data/" + key;
    // Checked against the archive's size (Note [Zip records are no larger than their
    // archive]) and against numel before the storage is allocated.
    const int64_t size = archive_.record_size(record);
    const auto itemsize = static_cast<int64_t>(c10::elementSize(dtype));
    TORCH_CHECK(numel >= 0 && size % itemsize == 0 && size / itemsize == numel, "record '", record,
                "' holds ", size, " bytes, not ", numel, " elements of ", c10::toString(dtype));
    at::Tensor storage = at::empty({numel}, at::TensorOptions().dtype(dtype));
    archive_.read_into(record, storage.data_ptr(), size);
    return storage;
  }

  const TorchZipArchive& archive_;
  absl::flat_hash_map<std::string, at::Tensor> storages_;
};

}  // namespace

PyValuePtr read_torch_file(std::string_view bytes, const std::string& name) {
  try {
    const TorchZipArchive archive = TorchZipArchive::open(
        std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), bytes.size()),
        "the archive");
    const std::string pickle = archive.read("data.pkl");
    PickleHooks hooks;
    hooks.allow_global = allowed;
    hooks.reduce = reduce;
    hooks.persistent_load = StorageLoader(archive);
    PyValuePtr root = read_pickle(pickle, hooks, "data.pkl");
    TORCH_CHECK(root->kind != Kind::kGlobal && root->kind != Kind::kObject,
                "the pickle does not end with one value");
    return root;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    what = what.substr(0, what.find(". This is an internal miniz error"));
    // Our words first: PyTorch's reader ends its text with its hint ("... your
    // checkpoint file is corrupted") after a miniz error code.
    TORCH_CHECK(false, "cannot read '", name,
                "': it is truncated or damaged, or not a file torch.save (zip format) or fsdp "
                "wrote (reading it failed: ",
                what, ")");
  }
}

}  // namespace fsdp::state_internal
