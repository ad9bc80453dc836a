// Python pickles without Python: a reader of protocols 0 (binary opcodes only) to 5 and
// a protocol-2 writer, over a small value tree (None, bool, int, float, str, bytes, tuple,
// list, dict, tensors made by a hook, globals and objects kept as class-name tags).
// torch.save archives (torch_file) and Distributed Checkpoint metadata (dcp.h) are read
// and written through it.
//
//   fsdp::PickleHooks hooks;
//   hooks.allow_global = [](const std::string& name) { return name == "torch.Size"; };
//   fsdp::PickleValuePtr v = fsdp::read_pickle(bytes, hooks, "x.pkl");
//   std::string again = fsdp::write_pickle(*v);  // pickle.loads(again) in Python
//
// Classes are never run: GLOBAL/STACK_GLOBAL push a kGlobal tag, REDUCE/NEWOBJ make a
// kObject holding the tag and the arguments (or what the reduce hook returns), BUILD
// stores its state in the object. A global the hooks do not allow is an error, as
// torch.load(weights_only=True) refuses one.
//
// A pickle is hostile data: the reader's work and memory are O(n log n) in its size n
// whatever it holds (a memo reference shares a value, never copies it), values nest at
// most kMaxPickleDepth containers deep, and a value tree of any depth is destroyed
// without recursion.
//
// Errors: c10::Error naming the input, the byte offset and what is wrong (truncated,
// unsupported opcode, a class not allowed, a memo entry never stored, a stack or MARK
// misuse, a container that contains itself, nesting deeper than kMaxPickleDepth).
// Threading: functions are reentrant.
// PyTorch counterpart: Python's pickle module (pickle.load / pickle.dumps(protocol=2)).
#ifndef FSDP_FORMATS_PICKLE_H_
#define FSDP_FORMATS_PICKLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

// The deepest nesting of containers (tuple, list, dict, object) read_pickle accepts: a
// value that is not a container has depth 0, a list of them depth 1. Python's own
// pickle.dumps cannot write deeper values (its recursion limit is 1000).
constexpr int kMaxPickleDepth = 1000;

struct PickleValue;
using PickleValuePtr = std::shared_ptr<PickleValue>;

struct PickleValue {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kBytes,
    kTuple,
    kList,
    kDict,
    kTensor,
    kGlobal,  // a class or function named by GLOBAL/STACK_GLOBAL, not called
    kObject,  // the result of calling a global (REDUCE, NEWOBJ), kept as a tag
  };
  Kind kind = Kind::kNone;
  int64_t integer = 0;  // kBool (0 or 1), kInt
  double real = 0;      // kFloat
  // kString, kBytes: the text or bytes; kGlobal, kObject: the class "module.name" (the
  // writer splits module and name at the last dot).
  std::string string;
  // kTuple, kList: the elements; kDict: key, value, key, value, ... in insertion order;
  // kObject: the arguments the global was called with.
  std::vector<PickleValuePtr> items;
  // kObject: what BUILD gave it (Python's __setstate__ argument); nullptr when none. The
  // writer writes an object with a state as NEWOBJ + BUILD, one without as REDUCE.
  PickleValuePtr state;
  at::Tensor tensor;  // kTensor (only a hook makes one)

  PickleValue() = default;
  PickleValue(const PickleValue&) = default;
  PickleValue(PickleValue&&) = default;
  PickleValue& operator=(const PickleValue&) = default;
  PickleValue& operator=(PickleValue&&) = default;
  // Takes the tree below apart without recursion, however deep it is.
  ~PickleValue();

  static PickleValuePtr make(Kind kind);
  static PickleValuePtr none();
  static PickleValuePtr boolean(bool value);
  static PickleValuePtr integer_value(int64_t value);
  static PickleValuePtr real_value(double value);
  static PickleValuePtr str(std::string value);
  static PickleValuePtr tuple(std::vector<PickleValuePtr> items);
  static PickleValuePtr list(std::vector<PickleValuePtr> items);
  static PickleValuePtr dict(std::vector<PickleValuePtr> keys_and_values);
  static PickleValuePtr global(std::string name);
  static PickleValuePtr object(std::string name, std::vector<PickleValuePtr> args,
                               PickleValuePtr state = nullptr);

  // kDict with string keys: the value of `key`, or nullptr.
  PickleValuePtr get(std::string_view key) const;
};

// "dict", "int", "object", ... for messages.
const char* pickle_kind_name(PickleValue::Kind kind);

struct PickleHooks {
  // Whether GLOBAL/STACK_GLOBAL may name `name` ("module.name"). Unset: none may.
  std::function<bool(const std::string& name)> allow_global;
  // REDUCE/NEWOBJ of the allowed global `name` with `args`: the value it stands for, or
  // nullptr to keep a kObject. Unset: every call is kept as a kObject.
  std::function<PickleValuePtr(const std::string& name, const std::vector<PickleValuePtr>& args)>
      reduce;
  // BINPERSID: the value a persistent id stands for. Unset: a persistent id is an error.
  std::function<PickleValuePtr(const PickleValuePtr& pid)> persistent_load;
  // BUILD on a dict (an OrderedDict's attributes): dropped when true, an error when false.
  bool ignore_dict_state = true;
};

// Reads the pickle in `bytes` (one value ending in STOP). `name` is used in messages.
// Throws c10::Error on bad input (see above), never reads past `bytes`.
PickleValuePtr read_pickle(std::string_view bytes, const PickleHooks& hooks,
                           const std::string& name);

// Writes `value` as a protocol-2 pickle that Python's pickle.loads reads back. Handles
// None, bool, int, float, str, tuple, list, dict, kGlobal and kObject; kBytes and kTensor
// are an error (protocol 2 has no bytes opcode; write tensors with torch::pickle_save).
std::string write_pickle(const PickleValue& value);

}  // namespace fsdp

#endif  // FSDP_FORMATS_PICKLE_H_
