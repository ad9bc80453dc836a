#include "fsdp/state/internal/torch_file.h"

#include <cstring>
#include <exception>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

namespace fsdp::state_internal {
namespace {

// Internal kinds beside PyValue::Kind: a global (module.name) and a storage; they never
// leave the reader.
constexpr auto kGlobal = static_cast<PyValue::Kind>(100);
constexpr auto kStorage = static_cast<PyValue::Kind>(101);

PyValuePtr make(PyValue::Kind kind) {
  auto value = std::make_shared<PyValue>();
  value->kind = kind;
  return value;
}

at::ScalarType storage_dtype(const std::string& global) {
  static const auto* kTypes = new absl::flat_hash_map<std::string, at::ScalarType>{
      {"torch.FloatStorage", at::kFloat}, {"torch.DoubleStorage", at::kDouble},
      {"torch.HalfStorage", at::kHalf},   {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},   {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort}, {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},   {"torch.BoolStorage", at::kBool},
  };
  auto it = kTypes->find(global);
  TORCH_CHECK(it != kTypes->end(), "unsupported storage type ", global);
  return it->second;
}

class Unpickler {
 public:
  Unpickler(const char* data, size_t size, caffe2::serialize::PyTorchStreamReader& archive)
      : data_(data), size_(size), archive_(archive) {}

  // A malicious pickle can put a container inside itself (through the memo); those
  // shared_ptr cycles would leak, so whatever is left unfinished is taken apart.
  ~Unpickler() {
    if (finished_) return;
    for (const PyValuePtr& container : containers_) container->items.clear();
  }

  PyValuePtr run() {
    while (true) {
      const uint8_t op = byte();
      if (op == '.') break;  // STOP
      step(op);
    }
    TORCH_CHECK(stack_.size() == 1 && stack_[0]->kind != kGlobal && stack_[0]->kind != kStorage,
                "the pickle does not end with one value");
    TORCH_CHECK(!has_cycle(stack_[0]), "the pickle holds a container that contains itself");
    finished_ = true;
    return stack_[0];
  }

 private:
  void step(uint8_t op) {
    switch (op) {
      case 0x80:
        byte();
        return;  // PROTO
      case 0x95:
        bytes(8);
        return;  // FRAME
      case '(':
        marks_.push_back(stack_.size());
        return;  // MARK
      case '}':
        push(make(PyValue::Kind::kDict));
        return;
      case ']':
        push(make(PyValue::Kind::kList));
        return;
      case ')':
        push(make(PyValue::Kind::kTuple));
        return;
      case 't':
        push(tuple(pop_mark()));
        return;
      case 0x85:
        push(tuple(pop_n(1)));
        return;  // TUPLE1
      case 0x86:
        push(tuple(pop_n(2)));
        return;  // TUPLE2
      case 0x87:
        push(tuple(pop_n(3)));
        return;  // TUPLE3
      case 'N':
        push(make(PyValue::Kind::kNone));
        return;
      case 0x88:
        push(boolean(true));
        return;  // NEWTRUE
      case 0x89:
        push(boolean(false));
        return;  // NEWFALSE
      case 'K':
        push(integer(byte()));
        return;  // BININT1
      case 'M':
        push(integer(little_endian(2, false)));
        return;  // BININT2
      case 'J':
        push(integer(little_endian(4, true)));
        return;  // BININT
      case 0x8a:
        push(integer(little_endian(byte(), true)));
        return;  // LONG1
      case 'G':
        push(real());
        return;  // BINFLOAT
      case 'X':
      case 'T':
        push(string(little_endian(4, false)));
        return;  // BINUNICODE
      case 0x8c:
      case 'U':
        push(string(byte()));
        return;  // SHORT_BINUNICODE / _BINSTRING
      case 'c':
        push_global();
        return;
      case 'q':
        memo_[byte()] = top();
        return;  // BINPUT
      case 'r':
        memo_[little_endian(4, false)] = top();
        return;  // LONG_BINPUT
      case 0x94:
        memo_[memo_.size()] = top();
        return;  // MEMOIZE
      case 'h':
        push(memo(byte()));
        return;  // BINGET
      case 'j':
        push(memo(little_endian(4, false)));
        return;  // LONG_BINGET
      case 'R':
        reduce();
        return;
      case 'b':
        build();
        return;
      case 'Q':
        persistent_load();
        return;  // BINPERSID
      case 's':
        set_items(pop_n(2));
        return;  // SETITEM
      case 'u':
        set_items(pop_mark());
        return;  // SETITEMS
      case 'a':
        append(pop_n(1));
        return;  // APPEND
      case 'e':
        append(pop_mark());
        return;  // APPENDS
      default:
        TORCH_CHECK(false, "unsupported pickle opcode ", absl::StrCat("0x", absl::Hex(op)),
                    " at byte ", pos_ - 1, " (only state dicts of tensors are read)");
    }
  }

  uint8_t byte() {
    TORCH_CHECK(pos_ < size_, "the pickle is truncated");
    return static_cast<uint8_t>(data_[pos_++]);
  }
  const char* bytes(size_t n) {
    TORCH_CHECK(n <= size_ - pos_, "the pickle is truncated");
    const char* start = data_ + pos_;
    pos_ += n;
    return start;
  }
  int64_t little_endian(size_t n, bool is_signed) {
    TORCH_CHECK(n <= 8, "integer of ", n, " bytes is too large");
    const auto* p = reinterpret_cast<const uint8_t*>(bytes(n));
    uint64_t value = 0;
    for (size_t i = 0; i < n; ++i) value |= uint64_t(p[i]) << (8 * i);
    if (is_signed && n > 0 && n < 8 && (p[n - 1] & 0x80)) value |= ~uint64_t(0) << (8 * n);
    return static_cast<int64_t>(value);
  }

  void push(PyValuePtr value) {
    if (value->kind == PyValue::Kind::kDict || value->kind == PyValue::Kind::kList ||
        value->kind == PyValue::Kind::kTuple) {
      containers_.push_back(value);
    }
    stack_.push_back(std::move(value));
  }

  // Depth-first, without recursion (nesting may be deep).
  static bool has_cycle(const PyValuePtr& root) {
    absl::flat_hash_map<const PyValue*, bool> on_path;  // false: finished
    std::vector<std::pair<const PyValue*, size_t>> path = {{root.get(), 0}};
    on_path[root.get()] = true;
    while (!path.empty()) {
      const PyValue* node = path.back().first;
      const size_t next = path.back().second++;
      if (next == node->items.size()) {
        on_path[node] = false;
        path.pop_back();
        continue;
      }
      const PyValue* child = node->items[next].get();
      auto [it, first] = on_path.try_emplace(child, true);
      if (first) {
        path.emplace_back(child, 0);
      } else if (it->second) {
        return true;
      }
    }
    return false;
  }
  const PyValuePtr& top() {
    TORCH_CHECK(!stack_.empty(), "the pickle reads an empty stack");
    return stack_.back();
  }
  PyValuePtr memo(int64_t index) {
    auto it = memo_.find(index);
    TORCH_CHECK(it != memo_.end(), "the pickle refers to a memo entry ", index, " never stored");
    return it->second;
  }
  std::vector<PyValuePtr> pop_n(size_t n) {
    TORCH_CHECK(stack_.size() >= n + (marks_.empty() ? 0 : marks_.back()),
                "the pickle reads an empty stack");
    std::vector<PyValuePtr> items(stack_.end() - n, stack_.end());
    stack_.resize(stack_.size() - n);
    return items;
  }
  std::vector<PyValuePtr> pop_mark() {
    TORCH_CHECK(!marks_.empty(), "the pickle pops a MARK it never pushed");
    const size_t mark = marks_.back();
    marks_.pop_back();
    TORCH_CHECK(mark <= stack_.size(), "the pickle's MARK is past the stack");
    std::vector<PyValuePtr> items(stack_.begin() + mark, stack_.end());
    stack_.resize(mark);
    return items;
  }
  PyValuePtr pop() { return pop_n(1)[0]; }

  static PyValuePtr tuple(std::vector<PyValuePtr> items) {
    PyValuePtr value = make(PyValue::Kind::kTuple);
    value->items = std::move(items);
    return value;
  }
  static PyValuePtr boolean(bool b) {
    PyValuePtr value = make(PyValue::Kind::kBool);
    value->integer = b;
    return value;
  }
  static PyValuePtr integer(int64_t i) {
    PyValuePtr value = make(PyValue::Kind::kInt);
    value->integer = i;
    return value;
  }
  PyValuePtr real() {
    const auto* p = reinterpret_cast<const uint8_t*>(bytes(8));
    uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];  // big-endian
    PyValuePtr value = make(PyValue::Kind::kFloat);
    std::memcpy(&value->real, &bits, sizeof(bits));
    return value;
  }
  PyValuePtr string(int64_t length) {
    TORCH_CHECK(length >= 0, "negative string length");
    PyValuePtr value = make(PyValue::Kind::kString);
    value->string.assign(bytes(static_cast<size_t>(length)), static_cast<size_t>(length));
    return value;
  }
  std::string line() {
    std::string text;
    for (char c = static_cast<char>(byte()); c != '\n'; c = static_cast<char>(byte())) {
      text.push_back(c);
      TORCH_CHECK(text.size() < 256, "the pickle has an overlong global name");
    }
    return text;
  }
  void push_global() {
    PyValuePtr value = make(kGlobal);
    const std::string module = line();
    value->string = absl::StrCat(module, ".", line());
    push(std::move(value));
  }

  static const PyValuePtr& arg(const std::vector<PyValuePtr>& args, size_t i, PyValue::Kind kind,
                               const char* what) {
    TORCH_CHECK(i < args.size() && args[i]->kind == kind, what, ": argument ", i, " must be a ",
                kind_name(kind));
    return args[i];
  }
  static std::vector<int64_t> int_tuple(const PyValuePtr& value, const char* what) {
    std::vector<int64_t> ints;
    for (const PyValuePtr& item : value->items) {
      TORCH_CHECK(item->kind == PyValue::Kind::kInt, what, ": sizes and strides must be ints");
      ints.push_back(item->integer);
    }
    return ints;
  }

  void reduce() {
    const PyValuePtr args = pop();
    const PyValuePtr callable = pop();
    TORCH_CHECK(callable->kind == kGlobal && args->kind == PyValue::Kind::kTuple,
                "the pickle calls something that is not a global");
    const std::string& name = callable->string;
    if (name == "collections.OrderedDict") {
      push(make(PyValue::Kind::kDict));
    } else if (name == "torch._utils._rebuild_tensor_v2") {
      push(rebuild_tensor(args->items));
    } else if (name == "torch.jit._pickle.restore_type_tag") {
      TORCH_CHECK(!args->items.empty(), name, " without arguments");
      push(args->items[0]);  // LibTorch's type annotation of a dict or list
    } else if (name == "torch.jit._pickle.build_intlist" ||
               name == "torch.jit._pickle.build_doublelist" ||
               name == "torch.jit._pickle.build_boollist" ||
               name == "torch.jit._pickle.build_tensorlist") {
      push(arg(args->items, 0, PyValue::Kind::kList, name.c_str()));  // LibTorch's typed lists
    } else if (name == "torch._utils._rebuild_parameter") {
      push(arg(args->items, 0, PyValue::Kind::kTensor, "_rebuild_parameter"));
    } else {
      TORCH_CHECK(false, "the file holds a ", name,
                  " object; only dicts, lists, scalars and "
                  "tensors are read (save a state dict: torch.save(model.state_dict(), path))");
    }
  }

  PyValuePtr rebuild_tensor(const std::vector<PyValuePtr>& args) {
    constexpr const char* kWhat = "_rebuild_tensor_v2";
    const at::Tensor& storage = arg(args, 0, kStorage, kWhat)->tensor;
    const int64_t offset = arg(args, 1, PyValue::Kind::kInt, kWhat)->integer;
    const std::vector<int64_t> sizes = int_tuple(arg(args, 2, PyValue::Kind::kTuple, kWhat), kWhat);
    const std::vector<int64_t> strides =
        int_tuple(arg(args, 3, PyValue::Kind::kTuple, kWhat), kWhat);
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
    PyValuePtr value = make(PyValue::Kind::kTensor);
    value->tensor =
        empty ? at::empty(sizes, storage.options()) : storage.as_strided(sizes, strides, offset);
    return value;
  }

  void persistent_load() {
    const PyValuePtr pid = pop();
    constexpr const char* kWhat = "persistent id";
    TORCH_CHECK(pid->kind == PyValue::Kind::kTuple && pid->items.size() == 5 &&
                    pid->items[0]->kind == PyValue::Kind::kString &&
                    pid->items[0]->string == "storage",
                "the pickle has a persistent id that is not a tensor storage");
    const at::ScalarType dtype = storage_dtype(arg(pid->items, 1, kGlobal, kWhat)->string);
    const std::string& key = arg(pid->items, 2, PyValue::Kind::kString, kWhat)->string;
    const int64_t numel = arg(pid->items, 4, PyValue::Kind::kInt, kWhat)->integer;
    auto cached = storages_.find(key);
    if (cached == storages_.end()) {
      const std::string record = "data/" + key;
      TORCH_CHECK(archive_.hasRecord(record), "the archive has no record '", record, "'");
      auto [data, size] = archive_.getRecord(record);
      const size_t itemsize = c10::elementSize(dtype);
      TORCH_CHECK(numel >= 0 && size % itemsize == 0 && int64_t(size / itemsize) == numel,
                  "record '", record, "' holds ", size, " bytes, not ", numel, " elements of ",
                  c10::toString(dtype));
      at::Tensor storage = at::empty({numel}, at::TensorOptions().dtype(dtype));
      if (size > 0) std::memcpy(storage.data_ptr(), data.get(), size);
      cached = storages_.emplace(key, storage).first;
    }
    PyValuePtr value = make(kStorage);
    value->tensor = cached->second;
    push(std::move(value));
  }

  void build() {
    pop();  // the state: an OrderedDict's attributes (state_dict's _metadata)
    TORCH_CHECK(top()->kind == PyValue::Kind::kDict,
                "the pickle sets the state of an object that is not a dict");
  }

  void set_items(const std::vector<PyValuePtr>& items) {
    TORCH_CHECK(items.size() % 2 == 0 && top()->kind == PyValue::Kind::kDict,
                "the pickle sets dict items on a ", kind_name(top()->kind));
    for (const PyValuePtr& item : items) top()->items.push_back(item);
  }
  void append(const std::vector<PyValuePtr>& items) {
    TORCH_CHECK(top()->kind == PyValue::Kind::kList, "the pickle appends to a ",
                kind_name(top()->kind));
    for (const PyValuePtr& item : items) top()->items.push_back(item);
  }

  const char* data_;
  size_t size_;
  size_t pos_ = 0;
  caffe2::serialize::PyTorchStreamReader& archive_;
  std::vector<PyValuePtr> stack_;
  std::vector<size_t> marks_;
  absl::flat_hash_map<int64_t, PyValuePtr> memo_;
  absl::flat_hash_map<std::string, at::Tensor> storages_;
  std::vector<PyValuePtr> containers_;  // every dict, list and tuple made
  bool finished_ = false;
};

}  // namespace

const char* kind_name(PyValue::Kind kind) {
  switch (kind) {
    case PyValue::Kind::kNone:
      return "None";
    case PyValue::Kind::kBool:
      return "bool";
    case PyValue::Kind::kInt:
      return "int";
    case PyValue::Kind::kFloat:
      return "float";
    case PyValue::Kind::kString:
      return "str";
    case PyValue::Kind::kTuple:
      return "tuple";
    case PyValue::Kind::kList:
      return "list";
    case PyValue::Kind::kDict:
      return "dict";
    case PyValue::Kind::kTensor:
      return "Tensor";
  }
  return kind == kGlobal ? "global" : "storage";
}

PyValuePtr read_torch_file(const std::string& bytes, const std::string& name) {
  try {
    auto adapter =
        std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), bytes.size());
    caffe2::serialize::PyTorchStreamReader archive(adapter);
    TORCH_CHECK(archive.hasRecord("data.pkl"), "the archive has no data.pkl");
    auto [data, size] = archive.getRecord("data.pkl");
    return Unpickler(static_cast<const char*>(data.get()), size, archive).run();
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
