#include "fsdp/formats/torch_tensor_record.h"

#include "absl/container/flat_hash_map.h"
#include <c10/util/Exception.h>

namespace fsdp {
namespace {

using Kind = PickleValue::Kind;

// Sizes and strides past this are refused: no real tensor has 2^40 elements in a dimension.
constexpr int64_t kMaxDim = int64_t{1} << 40;

const PickleValuePtr& arg(const std::vector<PickleValuePtr>& args, size_t i, Kind kind,
                          const char* what) {
  TORCH_CHECK(i < args.size() && args[i]->kind == kind, what, ": argument ", i, " must be a ",
              pickle_kind_name(kind));
  return args[i];
}

std::vector<int64_t> int_tuple(const PickleValuePtr& value, const char* what) {
  std::vector<int64_t> ints;
  ints.reserve(value->items.size());
  for (const PickleValuePtr& item : value->items) {
    TORCH_CHECK(item->kind == Kind::kInt, what, ": sizes and strides must be ints");
    ints.push_back(item->integer);
  }
  return ints;
}

}  // namespace

std::optional<at::ScalarType> torch_storage_dtype(const std::string& class_name) {
  static const auto* kTypes = new absl::flat_hash_map<std::string, at::ScalarType>{
      {"torch.FloatStorage", at::kFloat}, {"torch.DoubleStorage", at::kDouble},
      {"torch.HalfStorage", at::kHalf},   {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},   {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort}, {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},   {"torch.BoolStorage", at::kBool},
  };
  const auto it = kTypes->find(class_name);
  if (it == kTypes->end()) return std::nullopt;
  return it->second;
}

TorchStorageId read_torch_storage_id(const PickleValue& pid) {
  constexpr const char* kWhat = "persistent id";
  TORCH_CHECK(pid.kind == Kind::kTuple && pid.items.size() == 5 &&
                  pid.items[0]->kind == Kind::kString && pid.items[0]->string == "storage",
              "the pickle has a persistent id that is not a tensor storage");
  const std::string& type = arg(pid.items, 1, Kind::kGlobal, kWhat)->string;
  const std::optional<at::ScalarType> dtype = torch_storage_dtype(type);
  TORCH_CHECK(dtype.has_value(), "unsupported storage type ", type);
  TorchStorageId id;
  id.key = arg(pid.items, 2, Kind::kString, kWhat)->string;
  id.dtype = *dtype;
  id.numel = arg(pid.items, 4, Kind::kInt, kWhat)->integer;
  TORCH_CHECK(id.numel >= 0, "the storage '", id.key, "' has a negative size (", id.numel,
              " elements)");
  return id;
}

int64_t torch_storage_bytes(const TorchStorageId& id) {
  const auto itemsize = static_cast<int64_t>(c10::elementSize(id.dtype));
  TORCH_CHECK(id.numel <= INT64_MAX / itemsize, "the storage '", id.key, "' of ", id.numel,
              " elements of ", c10::toString(id.dtype), " is larger than any file");
  return id.numel * itemsize;
}

TorchTensorView read_torch_tensor_view(const std::vector<PickleValuePtr>& args,
                                       int64_t storage_numel, const char* what) {
  TorchTensorView view;
  view.offset = arg(args, 1, Kind::kInt, what)->integer;
  view.sizes = int_tuple(arg(args, 2, Kind::kTuple, what), what);
  view.strides = int_tuple(arg(args, 3, Kind::kTuple, what), what);
  TORCH_CHECK(view.sizes.size() == view.strides.size() && view.offset >= 0, what,
              ": sizes and strides differ in length or the offset is negative");
  int64_t last = view.offset;  // the last element the view reaches
  int64_t numel = 1;
  for (size_t i = 0; i < view.sizes.size(); ++i) {
    const int64_t size = view.sizes[i];
    const int64_t stride = view.strides[i];
    TORCH_CHECK(size >= 0 && stride >= 0 && size < kMaxDim && stride < kMaxDim, what,
                ": invalid size or stride");
    if (size == 0) {
      numel = 0;
      continue;
    }
    TORCH_CHECK(stride == 0 || size - 1 <= (INT64_MAX - last) / stride, what,
                ": the tensor reaches past the end of any storage");
    last += (size - 1) * stride;
    TORCH_CHECK(numel <= INT64_MAX / size, what, ": the tensor has more than 2^63 elements");
    numel *= size;
  }
  TORCH_CHECK(numel == 0 || last < storage_numel, what, ": the tensor reaches element ", last,
              " of a storage of ", storage_numel);
  view.numel = numel;
  return view;
}

}  // namespace fsdp
