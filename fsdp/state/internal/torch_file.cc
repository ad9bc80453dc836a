#include "fsdp/state/internal/torch_file.h"

#include <exception>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/in_memory_adapter.h>

#include "fsdp/formats/torch_zip.h"

namespace fsdp::state_internal {
namespace {

using Kind = PyValue::Kind;

// A storage never leaves the reader: an object with this tag (no pickle can name it, it
// is not a "module.name" the hooks allow) holding a 1-D tensor.
constexpr const char* kStorageTag = "<storage>";

const absl::flat_hash_map<std::string, at::ScalarType>& storage_types() {
  static const auto* kTypes = new absl::flat_hash_map<std::string, at::ScalarType>{
      {"torch.FloatStorage", at::kFloat}, {"torch.DoubleStorage", at::kDouble},
      {"torch.HalfStorage", at::kHalf},   {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},   {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort}, {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},   {"torch.BoolStorage", at::kBool},
  };
  return *kTypes;
}

bool allowed(const std::string& name) {
  static const auto* kCalls = new absl::flat_hash_set<std::string>{
      "collections.OrderedDict",          "torch._utils._rebuild_tensor_v2",
      "torch._utils._rebuild_parameter",  "torch.jit._pickle.restore_type_tag",
      "torch.jit._pickle.build_intlist",  "torch.jit._pickle.build_doublelist",
      "torch.jit._pickle.build_boollist", "torch.jit._pickle.build_tensorlist",
  };
  return kCalls->contains(name) || storage_types().contains(name);
}

const PyValuePtr& arg(const std::vector<PyValuePtr>& args, size_t i, Kind kind,
                      const std::string& what) {
  TORCH_CHECK(i < args.size() && args[i]->kind == kind, what, ": argument ", i, " must be a ",
              kind_name(kind));
  return args[i];
}

std::vector<int64_t> int_tuple(const PyValuePtr& value, const char* what) {
  std::vector<int64_t> ints;
  for (const PyValuePtr& item : value->items) {
    TORCH_CHECK(item->kind == Kind::kInt, what, ": sizes and strides must be ints");
    ints.push_back(item->integer);
  }
  return ints;
}

PyValuePtr rebuild_tensor(const std::vector<PyValuePtr>& args) {
  constexpr const char* kWhat = "_rebuild_tensor_v2";
  const PyValuePtr& storage_value = arg(args, 0, Kind::kObject, kWhat);
  TORCH_CHECK(storage_value->string == kStorageTag, kWhat, ": argument 0 must be a storage");
  const at::Tensor& storage = storage_value->tensor;
  const int64_t offset = arg(args, 1, Kind::kInt, kWhat)->integer;
  const std::vector<int64_t> sizes = int_tuple(arg(args, 2, Kind::kTuple, kWhat), kWhat);
  const std::vector<int64_t> strides = int_tuple(arg(args, 3, Kind::kTuple, kWhat), kWhat);
  TORCH_CHECK(sizes.size() == strides.size() && offset >= 0, kWhat,
              ": sizes and strides differ in length or the offset is negative");
  int64_t last = offset;  // the last element the view reaches
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] >= 0 && strides[i] >= 0 && sizes[i] < (int64_t(1) << 40) &&
                    strides[i] < (int64_t(1) << 40),
                kWhat, ": invalid size or stride");
    empty = empty || sizes[i] == 0;
    if (sizes[i] > 0) last += (sizes[i] - 1) * strides[i];
  }
  TORCH_CHECK(empty || last < storage.numel(), kWhat, ": the tensor reaches element ", last,
              " of a storage of ", storage.numel());
  PyValuePtr value = PyValue::make(Kind::kTensor);
  value->tensor =
      empty ? at::empty(sizes, storage.options()) : storage.as_strided(sizes, strides, offset);
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
    constexpr const char* kWhat = "persistent id";
    TORCH_CHECK(pid->kind == Kind::kTuple && pid->items.size() == 5 &&
                    pid->items[0]->kind == Kind::kString && pid->items[0]->string == "storage",
                "the pickle has a persistent id that is not a tensor storage");
    const std::string& type = arg(pid->items, 1, Kind::kGlobal, kWhat)->string;
    auto dtype = storage_types().find(type);
    TORCH_CHECK(dtype != storage_types().end(), "unsupported storage type ", type);
    const std::string& key = arg(pid->items, 2, Kind::kString, kWhat)->string;
    const int64_t numel = arg(pid->items, 4, Kind::kInt, kWhat)->integer;
    auto cached = storages_.find(key);
    if (cached == storages_.end()) {
      cached = storages_.emplace(key, load(key, dtype->second, numel)).first;
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
