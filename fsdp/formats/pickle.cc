#include "fsdp/formats/pickle.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>

namespace fsdp {
namespace {

using Kind = PickleValue::Kind;

// Note [The pickle reader]
// The reader runs Python's pickle machine (a stack, MARKs, a memo) over the opcodes of
// protocols 2 to 5 and the binary ones of protocols 0 and 1: about 50 opcodes, which is
// everything pickle.dumps, torch.save and LibTorch's pickler emit for data. The text
// opcodes of protocol 0 (INT, STRING, PUT, GET, ...), out-of-band buffers (protocol 5's
// NEXT_BUFFER) and INST/OBJ are refused. Sets are read as lists (EMPTY_SET, ADDITEMS) and
// frozensets as tuples. Nothing is ever called: a class is a tag. A container can be made
// to contain itself through the memo; such a value is refused, and the shared_ptr cycles
// of an unfinished read are taken apart in the destructor so nothing leaks.
//
// Note [A bounded pickle reader]
// Every opcode costs time and memory proportional to the bytes it consumes, or to the
// values it takes off the stack (each pushed once), so a read is O(n) plus hashing:
// - a memo reference (BINGET, DUP) pushes a pointer to the value it names; nothing is
//   ever expanded, so a "memo bomb" (a list of n references to a list of n references
//   ...) costs n pointers, not n^depth values;
// - REDUCE/NEWOBJ copy the argument tuple into the object they make; a tuple reused
//   through the memo would make that quadratic, so the items copied are counted and
//   may not exceed the pickle's size (every item of a tuple written once took a byte);
// - a length is compared with the bytes left before anything is allocated;
// - GLOBAL and STACK_GLOBAL names are at most 256 bytes.
// Depth is measured once, at STOP, by one walk over the finished value (iterative, each
// value visited once however often it is shared), together with the cycle check; a
// value nested deeper than kMaxPickleDepth is refused, so the recursive code that
// walks a value afterwards (consumers, write_pickle) stays bounded. Destruction is
// iterative (~PickleValue), so even a refused 300,000-deep list is taken apart safely.
class Reader {
 public:
  Reader(std::string_view bytes, const PickleHooks& hooks, const std::string& name)
      : data_(bytes), hooks_(hooks), name_(name) {}

  ~Reader() {
    if (finished_) return;
    for (const PickleValuePtr& value : made_) {
      value->items.clear();
      value->state.reset();
    }
  }

  PickleValuePtr run() {
    while (true) {
      op_pos_ = pos_;
      const uint8_t op = byte();
      if (op == '.') break;  // STOP
      step(op);
    }
    check(stack_.size() == 1 && marks_.empty(), "it does not end with exactly one value");
    check_shape(stack_[0]);
    finished_ = true;
    return stack_[0];
  }

 private:
  template <typename... Args>
  void check(bool condition, const Args&... what) const {
    TORCH_CHECK(condition, "cannot read the pickle '", name_, "' at byte ", op_pos_, ": ", what...);
  }

  void step(uint8_t op) {
    switch (op) {
      case 0x80:  // PROTO
        check(byte() <= 5, "protocol above 5");
        return;
      case 0x95:  // FRAME
        bytes(8);
        return;
      case '(':  // MARK
        marks_.push_back(stack_.size());
        return;
      case '0':  // POP
        pop();
        return;
      case '1':  // POP_MARK
        pop_mark();
        return;
      case '2':  // DUP
        push(top());
        return;
      case '}':  // EMPTY_DICT
        push(PickleValue::make(Kind::kDict));
        return;
      case ']':   // EMPTY_LIST
      case 0x8f:  // EMPTY_SET
        push(PickleValue::make(Kind::kList));
        return;
      case ')':  // EMPTY_TUPLE
        push(PickleValue::make(Kind::kTuple));
        return;
      case 't':   // TUPLE
      case 0x91:  // FROZENSET
        push(PickleValue::tuple(pop_mark()));
        return;
      case 0x85:  // TUPLE1
      case 0x86:  // TUPLE2
      case 0x87:  // TUPLE3
        push(PickleValue::tuple(pop_n(op - 0x84)));
        return;
      case 'l':  // LIST
        push(PickleValue::list(pop_mark()));
        return;
      case 'd': {  // DICT
        std::vector<PickleValuePtr> items = pop_mark();
        check(items.size() % 2 == 0, "DICT with an odd number of items");
        push(PickleValue::dict(std::move(items)));
        return;
      }
      case 'N':  // NONE
        push(PickleValue::none());
        return;
      case 0x88:  // NEWTRUE
      case 0x89:  // NEWFALSE
        push(PickleValue::boolean(op == 0x88));
        return;
      case 'K':  // BININT1
        push(PickleValue::integer_value(little_endian(1, false)));
        return;
      case 'M':  // BININT2
        push(PickleValue::integer_value(little_endian(2, false)));
        return;
      case 'J':  // BININT
        push(PickleValue::integer_value(little_endian(4, true)));
        return;
      case 0x8a:  // LONG1
        push(PickleValue::integer_value(little_endian(byte(), true)));
        return;
      case 0x8b:  // LONG4
        push(PickleValue::integer_value(little_endian(length(4), true)));
        return;
      case 'G':  // BINFLOAT
        push(real());
        return;
      case 'X':  // BINUNICODE
      case 'T':  // BINSTRING
        push(text(Kind::kString, length(4)));
        return;
      case 0x8c:  // SHORT_BINUNICODE
      case 'U':   // SHORT_BINSTRING
        push(text(Kind::kString, byte()));
        return;
      case 0x8d:  // BINUNICODE8
        push(text(Kind::kString, length(8)));
        return;
      case 'B':  // BINBYTES
        push(text(Kind::kBytes, length(4)));
        return;
      case 'C':  // SHORT_BINBYTES
        push(text(Kind::kBytes, byte()));
        return;
      case 0x8e:  // BINBYTES8
      case 0x96:  // BYTEARRAY8
        push(text(Kind::kBytes, length(8)));
        return;
      case 'c': {  // GLOBAL
        std::string module = line();
        global(std::move(module), line());
        return;
      }
      case 0x93: {  // STACK_GLOBAL
        const PickleValuePtr name = pop();
        const PickleValuePtr module = pop();
        check(module->kind == Kind::kString && name->kind == Kind::kString,
              "STACK_GLOBAL needs two strings");
        check(module->string.size() < kMaxName && name->string.size() < kMaxName,
              "an overlong STACK_GLOBAL name");
        global(module->string, name->string);
        return;
      }
      case 'q':  // BINPUT
        memo_[byte()] = top();
        return;
      case 'r':  // LONG_BINPUT
        memo_[little_endian(4, false)] = top();
        return;
      case 0x94:  // MEMOIZE
        memo_[static_cast<int64_t>(memo_.size())] = top();
        return;
      case 'h':  // BINGET
        push(memo(byte()));
        return;
      case 'j':  // LONG_BINGET
        push(memo(little_endian(4, false)));
        return;
      case 'R': {  // REDUCE
        const PickleValuePtr args = pop();
        call(pop(), args, "REDUCE");
        return;
      }
      case 0x81: {  // NEWOBJ
        const PickleValuePtr args = pop();
        call(pop(), args, "NEWOBJ");
        return;
      }
      case 0x92: {  // NEWOBJ_EX
        const PickleValuePtr kwargs = pop();
        const PickleValuePtr args = pop();
        check(kwargs->kind == Kind::kDict && kwargs->items.empty(),
              "NEWOBJ_EX with keyword arguments");
        call(pop(), args, "NEWOBJ_EX");
        return;
      }
      case 'b':  // BUILD
        build(pop());
        return;
      case 'Q':  // BINPERSID
        check(static_cast<bool>(hooks_.persistent_load),
              "a persistent id (BINPERSID), which this file may not hold");
        push(checked(hooks_.persistent_load(pop()), "persistent_load"));
        return;
      case 's': {  // SETITEM
        std::vector<PickleValuePtr> items = pop_n(2);
        add_items(Kind::kDict, items, "SETITEM");
        return;
      }
      case 'u':  // SETITEMS
        add_items(Kind::kDict, pop_mark(), "SETITEMS");
        return;
      case 'a':  // APPEND
        add_items(Kind::kList, pop_n(1), "APPEND");
        return;
      case 'e':   // APPENDS
      case 0x90:  // ADDITEMS
        add_items(Kind::kList, pop_mark(), op == 'e' ? "APPENDS" : "ADDITEMS");
        return;
      default:
        check(false, "unsupported opcode ", absl::StrCat("0x", absl::Hex(op, absl::kZeroPad2)),
              " (the text opcodes of protocol 0, INST, OBJ and out-of-band buffers are not "
              "read; write the file with protocol 2 or later)");
    }
  }

  uint8_t byte() {
    check(pos_ < data_.size(), "it is truncated");
    return static_cast<uint8_t>(data_[pos_++]);
  }
  std::string_view bytes(uint64_t n) {
    check(n <= data_.size() - pos_, "it is truncated (", n, " bytes expected, ",
          data_.size() - pos_, " left)");
    const std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  int64_t little_endian(uint64_t n, bool is_signed) {
    check(n <= 8, "an integer of ", n, " bytes (at most 8 are read)");
    const std::string_view raw = bytes(n);
    uint64_t value = 0;
    for (size_t i = 0; i < n; ++i) value |= uint64_t(static_cast<uint8_t>(raw[i])) << (8 * i);
    if (is_signed && n > 0 && n < 8 && (static_cast<uint8_t>(raw[n - 1]) & 0x80)) {
      value |= ~uint64_t(0) << (8 * n);
    }
    return static_cast<int64_t>(value);
  }
  uint64_t length(int width) { return static_cast<uint64_t>(little_endian(width, false)); }
  PickleValuePtr real() {
    const std::string_view raw = bytes(8);
    uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(raw[i]);  // big-endian
    double value = 0;
    std::memcpy(&value, &bits, sizeof(bits));
    return PickleValue::real_value(value);
  }
  PickleValuePtr text(Kind kind, uint64_t n) {
    PickleValuePtr value = PickleValue::make(kind);
    value->string = std::string(bytes(n));
    return value;
  }
  std::string line() {
    std::string out;
    for (char c = static_cast<char>(byte()); c != '\n'; c = static_cast<char>(byte())) {
      out.push_back(c);
      check(out.size() < kMaxName, "an overlong GLOBAL name");
    }
    return out;
  }
  void global(const std::string& module, const std::string& name) {
    const std::string full = absl::StrCat(module, ".", name);
    check(hooks_.allow_global && hooks_.allow_global(full), "an unexpected class or function '",
          full, "' (only plain data and the classes of this file format are read)");
    push(PickleValue::global(full));
  }

  PickleValuePtr checked(PickleValuePtr value, const char* hook) {
    TORCH_INTERNAL_ASSERT(value != nullptr, "the ", hook, " hook returned no value");
    return value;
  }
  void call(const PickleValuePtr& callable, const PickleValuePtr& args, const char* op) {
    check(callable->kind == Kind::kGlobal, op, " calls a ", pickle_kind_name(callable->kind),
          ", not a class or function");
    check(args->kind == Kind::kTuple, op, " arguments must be a tuple, found a ",
          pickle_kind_name(args->kind));
    PickleValuePtr value;
    if (hooks_.reduce) value = hooks_.reduce(callable->string, args->items);
    if (!value) {
      // See Note [A bounded pickle reader].
      copied_ += args->items.size();
      check(copied_ <= data_.size(), "its calls copy ", copied_,
            " arguments, more than its size allows (an argument tuple reused through the memo)");
      value = PickleValue::object(callable->string, args->items);
    }
    push(std::move(value));
  }
  void build(PickleValuePtr state) {
    const PickleValuePtr& target = top();
    if (target->kind == Kind::kObject) {
      target->state = std::move(state);
      return;
    }
    check(target->kind == Kind::kDict && hooks_.ignore_dict_state, "BUILD on a ",
          pickle_kind_name(target->kind));
  }
  void add_items(Kind kind, const std::vector<PickleValuePtr>& items, const char* op) {
    const PickleValuePtr& target = top();
    check(target->kind == kind, op, " on a ", pickle_kind_name(target->kind));
    check(kind != Kind::kDict || items.size() % 2 == 0, op, " with an odd number of items");
    target->items.insert(target->items.end(), items.begin(), items.end());
  }

  void push(PickleValuePtr value) {
    if (value->kind == Kind::kDict || value->kind == Kind::kList || value->kind == Kind::kTuple ||
        value->kind == Kind::kObject) {
      made_.push_back(value);
    }
    stack_.push_back(std::move(value));
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  const PickleValuePtr& top() {
    check(stack_.size() > floor(), "it reads past the bottom of the stack (or of a MARK)");
    return stack_.back();
  }
  std::vector<PickleValuePtr> pop_n(size_t n) {
    check(stack_.size() >= floor() + n, "it reads past the bottom of the stack (or of a MARK)");
    std::vector<PickleValuePtr> items(stack_.end() - n, stack_.end());
    stack_.resize(stack_.size() - n);
    return items;
  }
  PickleValuePtr pop() { return pop_n(1)[0]; }
  std::vector<PickleValuePtr> pop_mark() {
    check(!marks_.empty(), "it pops a MARK it never pushed");
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<PickleValuePtr> items(stack_.begin() + mark, stack_.end());
    stack_.resize(mark);
    return items;
  }
  PickleValuePtr memo(int64_t index) {
    auto it = memo_.find(index);
    check(it != memo_.end(), "memo entry ", index, " is read but was never stored (", memo_.size(),
          " entries stored)");
    return it->second;
  }

  // One depth-first walk over items and states, without recursion: refuses a cycle and
  // a value nested deeper than kMaxPickleDepth. See Note [A bounded pickle reader].
  void check_shape(const PickleValuePtr& root) const {
    auto is_container = [](const PickleValue* v) {
      return v->kind == Kind::kTuple || v->kind == Kind::kList || v->kind == Kind::kDict ||
             v->kind == Kind::kObject;
    };
    auto children = [](const PickleValue* v) { return v->items.size() + (v->state ? 1 : 0); };
    auto child = [](const PickleValue* v, size_t i) {
      return i < v->items.size() ? v->items[i].get() : v->state.get();
    };
    constexpr int kOnPath = -1;
    absl::flat_hash_map<const PickleValue*, int> depth;  // kOnPath until finished
    struct Frame {
      const PickleValue* node;
      size_t next;
      int deepest_child;
    };
    std::vector<Frame> path = {{root.get(), 0, 0}};
    depth[root.get()] = kOnPath;
    while (!path.empty()) {
      Frame& frame = path.back();
      if (frame.next == children(frame.node)) {
        const int d = frame.deepest_child + (is_container(frame.node) ? 1 : 0);
        check(d <= kMaxPickleDepth, "it nests containers deeper than ", kMaxPickleDepth,
              " levels, which fsdp does not read");
        depth[frame.node] = d;
        path.pop_back();
        if (!path.empty()) path.back().deepest_child = std::max(path.back().deepest_child, d);
        continue;
      }
      const PickleValue* c = child(frame.node, frame.next++);
      auto [it, first] = depth.try_emplace(c, kOnPath);
      if (first) {
        // Every value on the path holds the next, so all are containers: refuse at once
        // rather than walk the rest of a deep value.
        check(!is_container(c) || path.size() < static_cast<size_t>(kMaxPickleDepth),
              "it nests containers deeper than ", kMaxPickleDepth,
              " levels, which fsdp does not read");
        path.push_back({c, 0, 0});
      } else {
        check(it->second != kOnPath, "it holds a container that contains itself");
        frame.deepest_child = std::max(frame.deepest_child, it->second);
      }
    }
  }

  static constexpr size_t kMaxName = 256;
  std::string_view data_;
  const PickleHooks& hooks_;
  const std::string& name_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  std::vector<PickleValuePtr> stack_;
  std::vector<size_t> marks_;
  absl::flat_hash_map<int64_t, PickleValuePtr> memo_;
  std::vector<PickleValuePtr> made_;  // every container and object made
  size_t copied_ = 0;                 // argument items copied by REDUCE/NEWOBJ
  bool finished_ = false;
};

class Writer {
 public:
  std::string finish(const PickleValue& value) {
    out_ = "\x80\x02";  // PROTO 2
    write(value);
    out_.push_back('.');
    return std::move(out_);
  }

 private:
  void le(uint64_t value, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      out_.push_back('K');
      le(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      out_.push_back('M');
      le(static_cast<uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_.push_back('J');
      le(static_cast<uint64_t>(v), 4);
    } else {
      out_ += "\x8a\x08";  // LONG1 of 8 bytes, two's complement
      le(static_cast<uint64_t>(v), 8);
    }
  }
  void real(double v) {
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(bits));
    out_.push_back('G');
    for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }
  void str(const std::string& s) {
    out_.push_back('X');  // BINUNICODE
    le(s.size(), 4);
    out_ += s;
  }
  void global(const std::string& name) {
    const size_t dot = name.rfind('.');
    TORCH_CHECK(dot != std::string::npos && dot > 0 && dot + 1 < name.size(),
                "write_pickle: a global must be named 'module.name', found '", name, "'");
    absl::StrAppend(&out_, "c", name.substr(0, dot), "\n", name.substr(dot + 1), "\n");
  }
  void items(const std::vector<PickleValuePtr>& values) {
    for (const PickleValuePtr& v : values) {
      TORCH_CHECK(v != nullptr, "write_pickle: a null value");
      write(*v);
    }
  }
  void tuple(const std::vector<PickleValuePtr>& values) {
    if (values.empty()) {
      out_.push_back(')');
    } else if (values.size() <= 3) {
      items(values);
      out_.push_back(static_cast<char>(0x84 + values.size()));  // TUPLE1..3
    } else {
      out_.push_back('(');
      items(values);
      out_.push_back('t');
    }
  }
  void write(const PickleValue& v) {
    switch (v.kind) {
      case Kind::kNone:
        out_.push_back('N');
        return;
      case Kind::kBool:
        out_.push_back(v.integer ? '\x88' : '\x89');
        return;
      case Kind::kInt:
        integer(v.integer);
        return;
      case Kind::kFloat:
        real(v.real);
        return;
      case Kind::kString:
        str(v.string);
        return;
      case Kind::kTuple:
        tuple(v.items);
        return;
      case Kind::kList:
      case Kind::kDict:
        TORCH_CHECK(v.kind == Kind::kList || v.items.size() % 2 == 0,
                    "write_pickle: a dict with an odd number of items");
        out_.push_back(v.kind == Kind::kList ? ']' : '}');
        if (v.items.empty()) return;
        out_.push_back('(');
        items(v.items);
        out_.push_back(v.kind == Kind::kList ? 'e' : 'u');
        return;
      case Kind::kGlobal:
        global(v.string);
        return;
      case Kind::kObject:
        global(v.string);
        tuple(v.items);
        if (!v.state) {
          out_.push_back('R');  // REDUCE
          return;
        }
        out_.push_back('\x81');  // NEWOBJ
        write(*v.state);
        out_.push_back('b');  // BUILD
        return;
      case Kind::kBytes:
      case Kind::kTensor:
        TORCH_CHECK(false, "write_pickle: a ", pickle_kind_name(v.kind),
                    " cannot be written as protocol 2 (write tensors with torch::pickle_save)");
    }
  }

  std::string out_;
};

}  // namespace

// Note [Taking a value tree apart]
// The default destructor of a 300,000-deep list recurses 300,000 times and overflows the
// stack. Instead each value moves its children into a local worklist and destroys them
// one at a time, first moving out the children of any it owns alone (use_count 1), so
// every value is destroyed with no children left and the recursion is at most two deep.
// A child someone else still holds is only released; its last owner takes it apart.
PickleValue::~PickleValue() {
  if (items.empty() && state == nullptr) return;
  std::vector<PickleValuePtr> pending = std::move(items);
  if (state != nullptr) pending.push_back(std::move(state));
  while (!pending.empty()) {
    PickleValuePtr value = std::move(pending.back());
    pending.pop_back();
    if (value != nullptr && value.use_count() == 1) {
      for (PickleValuePtr& child : value->items) pending.push_back(std::move(child));
      value->items.clear();
      if (value->state != nullptr) pending.push_back(std::move(value->state));
    }
  }
}

PickleValuePtr PickleValue::make(Kind kind) {
  auto value = std::make_shared<PickleValue>();
  value->kind = kind;
  return value;
}
PickleValuePtr PickleValue::none() { return make(Kind::kNone); }
PickleValuePtr PickleValue::boolean(bool value) {
  PickleValuePtr v = make(Kind::kBool);
  v->integer = value ? 1 : 0;
  return v;
}
PickleValuePtr PickleValue::integer_value(int64_t value) {
  PickleValuePtr v = make(Kind::kInt);
  v->integer = value;
  return v;
}
PickleValuePtr PickleValue::real_value(double value) {
  PickleValuePtr v = make(Kind::kFloat);
  v->real = value;
  return v;
}
PickleValuePtr PickleValue::str(std::string value) {
  PickleValuePtr v = make(Kind::kString);
  v->string = std::move(value);
  return v;
}
PickleValuePtr PickleValue::tuple(std::vector<PickleValuePtr> items) {
  PickleValuePtr v = make(Kind::kTuple);
  v->items = std::move(items);
  return v;
}
PickleValuePtr PickleValue::list(std::vector<PickleValuePtr> items) {
  PickleValuePtr v = make(Kind::kList);
  v->items = std::move(items);
  return v;
}
PickleValuePtr PickleValue::dict(std::vector<PickleValuePtr> keys_and_values) {
  PickleValuePtr v = make(Kind::kDict);
  v->items = std::move(keys_and_values);
  return v;
}
PickleValuePtr PickleValue::global(std::string name) {
  PickleValuePtr v = make(Kind::kGlobal);
  v->string = std::move(name);
  return v;
}
PickleValuePtr PickleValue::object(std::string name, std::vector<PickleValuePtr> args,
                                   PickleValuePtr state) {
  PickleValuePtr v = make(Kind::kObject);
  v->string = std::move(name);
  v->items = std::move(args);
  v->state = std::move(state);
  return v;
}

PickleValuePtr PickleValue::get(std::string_view key) const {
  if (kind != Kind::kDict) return nullptr;
  for (size_t i = 0; i + 1 < items.size(); i += 2) {
    if (items[i]->kind == Kind::kString && items[i]->string == key) return items[i + 1];
  }
  return nullptr;
}

const char* pickle_kind_name(PickleValue::Kind kind) {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kTensor:
      return "Tensor";
    case Kind::kGlobal:
      return "global";
    case Kind::kObject:
      return "object";
  }
  return "unknown";
}

PickleValuePtr read_pickle(std::string_view bytes, const PickleHooks& hooks,
                           const std::string& name) {
  return Reader(bytes, hooks, name).run();
}

std::string write_pickle(const PickleValue& value) { return Writer().finish(value); }

}  // namespace fsdp
