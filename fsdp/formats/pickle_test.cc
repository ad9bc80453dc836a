#include "fsdp/formats/pickle.h"

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/formats/testing/python_testing.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using Kind = PickleValue::Kind;
using namespace std::string_literals;

using formats_testing::read_bytes;
using formats_testing::run_python;
using formats_testing::scratch_path;

bool dcp_classes(const std::string& name) {
  return name.rfind("torch.distributed.checkpoint.metadata.", 0) == 0 || name == "torch.Size";
}

PickleValuePtr read(const std::string& bytes) {
  PickleHooks hooks;
  hooks.allow_global = dcp_classes;
  return read_pickle(bytes, hooks, "test.pkl");
}

constexpr const char* kPythonValue = R"(
import pickle, sys, torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
shared = [7, 8]
value = {"small": 5, "medium": 40000, "negative": -70000, "huge": 2**62, "float": -0.375,
         "text": "h\u00e9llo", "bytes": b"\x00\x01\xff", "tuple": (1, 2.5, None, True, False),
         "nested": [[], {}, ()], "a": shared, "b": shared, "set": {3},
         "chunk": ChunkStorageMetadata(offsets=torch.Size([1, 2]), sizes=torch.Size([3, 4]))}
for protocol in (2, 3, 4, 5):
    v = dict(value)
    if protocol < 3:
        del v["bytes"]  # written as a call of _codecs.encode
    if protocol < 4:
        del v["set"]  # written as a call of builtins.set
    with open(sys.argv[0] + f".{protocol}", "wb") as f:
        pickle.dump(v, f, protocol=protocol)
)";

void expect_python_value(const PickleValuePtr& v) {
  ASSERT_EQ(v->kind, Kind::kDict);
  EXPECT_EQ(v->get("small")->integer, 5);
  EXPECT_EQ(v->get("medium")->integer, 40000);
  EXPECT_EQ(v->get("negative")->integer, -70000);
  EXPECT_EQ(v->get("huge")->integer, int64_t{1} << 62);
  EXPECT_EQ(v->get("float")->real, -0.375);
  EXPECT_EQ(v->get("text")->string, "h\xc3\xa9llo");
  const PickleValuePtr tuple = v->get("tuple");
  ASSERT_EQ(tuple->kind, Kind::kTuple);
  ASSERT_EQ(tuple->items.size(), 5u);
  EXPECT_EQ(tuple->items[0]->integer, 1);
  EXPECT_EQ(tuple->items[1]->real, 2.5);
  EXPECT_EQ(tuple->items[2]->kind, Kind::kNone);
  EXPECT_EQ(tuple->items[3]->kind, Kind::kBool);
  EXPECT_EQ(tuple->items[3]->integer, 1);
  EXPECT_EQ(tuple->items[4]->integer, 0);
  const PickleValuePtr nested = v->get("nested");
  ASSERT_EQ(nested->items.size(), 3u);
  EXPECT_EQ(nested->items[0]->kind, Kind::kList);
  EXPECT_EQ(nested->items[1]->kind, Kind::kDict);
  EXPECT_EQ(nested->items[2]->kind, Kind::kTuple);
  EXPECT_EQ(v->get("a"), v->get("b"));  // one list, through the memo
  EXPECT_EQ(v->get("a")->items[1]->integer, 8);
  const PickleValuePtr chunk = v->get("chunk");
  ASSERT_EQ(chunk->kind, Kind::kObject);
  EXPECT_EQ(chunk->string, "torch.distributed.checkpoint.metadata.ChunkStorageMetadata");
  ASSERT_NE(chunk->state, nullptr);
  const PickleValuePtr offsets = chunk->state->get("offsets");
  ASSERT_EQ(offsets->kind, Kind::kObject);
  EXPECT_EQ(offsets->string, "torch.Size");
  ASSERT_EQ(offsets->items.size(), 1u);
  ASSERT_EQ(offsets->items[0]->items.size(), 2u);
  EXPECT_EQ(offsets->items[0]->items[1]->integer, 2);
  EXPECT_EQ(chunk->state->get("sizes")->items[0]->items[0]->integer, 3);
}

TEST(ReadPickle, EveryProtocolPythonWrites) {
  const std::string script = scratch_path("values.py");
  run_python(absl::StrCat("import sys; sys.argv[0] = '", script, "'\n", kPythonValue));
  for (int protocol : {2, 3, 4, 5}) {
    SCOPED_TRACE(protocol);
    const std::string bytes = read_bytes(absl::StrCat(script, ".", protocol));
    PickleValuePtr value = read(bytes);
    expect_python_value(value);
    // Older protocols write bytes and sets as calls: the script leaves them out.
    EXPECT_EQ(value->items.size(), 2u * (11 + (protocol >= 3) + (protocol >= 4)));
    if (protocol >= 3) {
      EXPECT_EQ(value->get("bytes")->string, std::string("\x00\x01\xff", 3));
    }
    if (protocol >= 4) {
      ASSERT_EQ(value->get("set")->items.size(), 1u);
      EXPECT_EQ(value->get("set")->items[0]->integer, 3);
    }
  }
}

TEST(WritePickle, PythonReadsItBack) {
  auto size = [](std::vector<int64_t> dims) {
    std::vector<PickleValuePtr> items;
    for (int64_t d : dims) items.push_back(PickleValue::integer_value(d));
    return PickleValue::object("torch.Size", {PickleValue::tuple(std::move(items))});
  };
  const PickleValuePtr chunk =
      PickleValue::object("torch.distributed.checkpoint.metadata.ChunkStorageMetadata", {},
                          PickleValue::dict({PickleValue::str("offsets"), size({0, 4}),
                                             PickleValue::str("sizes"), size({2, 3})}));
  const PickleValuePtr value = PickleValue::dict({
      PickleValue::str("ints"),
      PickleValue::list({PickleValue::integer_value(0), PickleValue::integer_value(255),
                         PickleValue::integer_value(256), PickleValue::integer_value(65536),
                         PickleValue::integer_value(-1), PickleValue::integer_value(-(1LL << 40)),
                         PickleValue::integer_value(1LL << 62)}),
      PickleValue::str("t"),
      PickleValue::tuple({PickleValue::real_value(0.1), PickleValue::none(),
                          PickleValue::boolean(true), PickleValue::str("h\xc3\xa9"),
                          PickleValue::tuple({})}),
      PickleValue::str("dtype"),
      PickleValue::global("torch.bfloat16"),
      PickleValue::str("chunk"),
      chunk,
  });
  const std::string path = scratch_path("ours.pkl");
  std::ofstream(path, std::ios::binary) << write_pickle(*value);
  EXPECT_EQ(run_python(absl::StrCat("import pickle, torch\nv = pickle.load(open('", path,
                                    "', 'rb'))\nprint(v)\n")),
            "{'ints': [0, 255, 256, 65536, -1, -1099511627776, 4611686018427387904], 't': "
            "(0.1, None, True, 'h\xc3\xa9', ()), 'dtype': torch.bfloat16, 'chunk': "
            "ChunkStorageMetadata(offsets=torch.Size([0, 4]), sizes=torch.Size([2, 3]))}\n");
  // And our reader reads what our writer wrote.
  PickleHooks hooks;
  hooks.allow_global = [](const std::string&) { return true; };
  const PickleValuePtr again = read_pickle(read_bytes(path), hooks, "ours.pkl");
  EXPECT_EQ(write_pickle(*again), write_pickle(*value));
}

TEST(WritePickle, RefusesWhatProtocolTwoCannotHold) {
  PickleValue bytes;
  bytes.kind = Kind::kBytes;
  EXPECT_THAT([&] { write_pickle(bytes); },
              ThrowsMessage<c10::Error>(HasSubstr("a bytes cannot be written as protocol 2")));
  EXPECT_THAT([&] { write_pickle(*PickleValue::global("nodot")); },
              ThrowsMessage<c10::Error>(HasSubstr("must be named 'module.name', found 'nodot'")));
}

// The literal's bytes, NULs included.
template <size_t N>
void expect_error(const char (&literal)[N], const std::string& message) {
  const std::string bytes(literal, N - 1);
  EXPECT_THAT([&] { read(bytes); }, ThrowsMessage<c10::Error>(HasSubstr(message)));
}
void expect_error(const std::string& bytes, const std::string& message) {
  EXPECT_THAT([&] { read(bytes); }, ThrowsMessage<c10::Error>(HasSubstr(message)));
}

TEST(ReadPickle, BadInputIsOneClearError) {
  expect_error("\x80\x02]q\x00(K\x01K\x02",
               "cannot read the pickle 'test.pkl' at byte 10: it is truncated");
  expect_error(
      "\x80\x02X\x09\x00\x00\x00"
      "abc",
      "at byte 2: it is truncated (9 bytes expected, 3 left)");
  expect_error("\x80\x02I12\n.", "at byte 2: unsupported opcode 0x49");
  expect_error("\x80\x02\x97.", "at byte 2: unsupported opcode 0x97");
  expect_error("\x80\x02\x63os\nsystem\n.",
               "at byte 2: an unexpected class or function 'os.system'");
  expect_error("\x80\x02h\x05.",
               "at byte 2: memo entry 5 is read but was never stored (0 "
               "entries stored)");
  expect_error("\x80\x02K\x01K\x02.", "at byte 6: it does not end with exactly one value");
  expect_error("\x80\x02(K\x01.", "it does not end with exactly one value");
  expect_error(
      "\x80\x02"
      "a.",
      "at byte 2: it reads past the bottom of the stack");
  expect_error("\x80\x02K\x01u.", "at byte 4: it pops a MARK it never pushed");
  expect_error("\x80\x02K\x01K\x02s.", "at byte 6: it reads past the bottom of the stack");
  expect_error(
      "\x80\x02}K\x01"
      "a.",
      "at byte 5: APPEND on a dict");
  expect_error("\x80\x02K\x01)R.", "at byte 5: REDUCE calls a int, not a class or function");
  expect_error("\x80\x02K\x01Q.", "a persistent id (BINPERSID), which this file may not hold");
  expect_error("\x80\x06.", "at byte 0: protocol above 5");
  // A list that holds itself (through the memo) is refused, and nothing leaks (ASan).
  expect_error(
      "\x80\x02]q\x00h\x00"
      "a.",
      "it holds a container that contains itself");
}

// A list nested `depth` deep: `depth` EMPTY_LISTs, then APPENDs folding each into the
// one below (a valid pickle Python reads back as [[[...]]]).
std::string nested_lists(int depth) {
  std::string bytes = "\x80\x02";
  bytes.append(depth, ']');
  bytes.append(depth - 1, 'a');
  bytes.push_back('.');
  return bytes;
}

int depth_of(PickleValuePtr v) {
  int depth = 0;
  for (; v->kind == Kind::kList; v = v->items.empty() ? PickleValue::none() : v->items[0]) ++depth;
  return depth;
}

TEST(ReadPickle, NestingIsBounded) {
  EXPECT_EQ(depth_of(read(nested_lists(kMaxPickleDepth))), kMaxPickleDepth);
  // 300,000 deep (a .metadata of 600 KB): refused with a message, no stack overflow
  // reading it or taking it apart.
  expect_error(nested_lists(300'000),
               "cannot read the pickle 'test.pkl' at byte 600001: it nests containers deeper "
               "than 1000 levels, which fsdp does not read");
  expect_error(nested_lists(kMaxPickleDepth + 1), "deeper than 1000 levels");
}

TEST(PickleValue, DestroyingADeepTreeDoesNotRecurse) {
  PickleValuePtr root = PickleValue::list({});
  PickleValue* leaf = root.get();
  for (int i = 0; i < 300'000; ++i) {
    leaf->items.push_back(PickleValue::list({}));
    leaf = leaf->items.back().get();
  }
  leaf->state = PickleValue::str("end");
  root.reset();  // would overflow the stack with a recursive destructor
  SUCCEED();
}

TEST(ReadPickle, MemoReferencesAreSharedNotCopied) {
  // l0 = [1]; l(i+1) = [l(i), l(i)] 40 times: 2^40 leaves if expanded, 81 values shared.
  std::string bytes = "\x80\x02]q\x00K\x01"s + "a0";
  for (int i = 0; i < 40; ++i) {
    absl::StrAppend(&bytes, "](h", std::string(1, char(i)), "h", std::string(1, char(i)), "eq",
                    std::string(1, char(i + 1)), "0");
  }
  bytes += "h\x28.";  // memo entry 40
  PickleValuePtr v = read(bytes);
  int depth = 0;
  for (; v->kind == Kind::kList && v->items.size() == 2; v = v->items[0]) {
    EXPECT_EQ(v->items[0].get(), v->items[1].get());
    ++depth;
  }
  EXPECT_EQ(depth, 40);
}

TEST(ReadPickle, ReusedCallArgumentsAreBounded) {
  // One 1000-item argument tuple, memoized, then the same call 2000 times: 2 million
  // copied items from a 20 KB pickle.
  std::string bytes = "\x80\x02(";
  bytes.append(1000, 'N');
  bytes += "tq\x00("s;
  for (int i = 0; i < 2000; ++i) bytes += "ctorch\nSize\nh\x00R"s;
  bytes += "l.";
  expect_error(bytes, "its calls copy ");
  expect_error(bytes, "arguments, more than its size allows");
}

TEST(ReadPickle, OverlongNamesAreRefused) {
  std::string bytes = "\x80\x02X\x00\x01\x00\x00"s;
  bytes.append(256, 'm');
  bytes += "\x8c\x04Size\x93.";
  expect_error(bytes, "at byte 269: an overlong STACK_GLOBAL name");
}

}  // namespace
}  // namespace fsdp
