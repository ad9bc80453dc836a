// safetensors files and folders: exact bytes written, round trips of every dtype, byte
// ranges, the Hugging Face split and index, and every bad input with its exact message.
#include "fsdp/formats/safetensors.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_replace.h"
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;

std::string temp_dir() {
  std::string pattern = testing::TempDir() + "safetensors_XXXXXX";
  TORCH_INTERNAL_ASSERT(::mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

// The temporary file a writer of `path` writes until commit() (atomic_file.h).
std::string temporary_of(const std::string& path) {
  return path + ".tmp-" + std::to_string(::getpid());
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A file: the 8-byte length of `header`, `header`, then `data`.
std::string file_bytes(const std::string& header, const std::string& data) {
  const uint64_t n = header.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &n, 8);
  return bytes + header + data;
}

// The message of the c10::Error `fn` throws ("" when it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "";
}

// Opens a file made of `header` and `data`; returns the error message, the file's path
// written as <file>.
std::string open_error_at(const std::string& path) {
  return absl::StrReplaceAll(error_of([&] { SafetensorsFile::open(path); }), {{path, "<file>"}});
}
std::string open_error(const std::string& header, const std::string& data) {
  const std::string path = temp_dir() + "/bad.safetensors";
  spit(path, file_bytes(header, data));
  return open_error_at(path);
}

TEST(SafetensorsDtype, NamesRoundTrip) {
  for (const char* name : {"F32", "F64", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"}) {
    EXPECT_EQ(safetensors_dtype_name(safetensors_dtype(name)), name);
  }
  EXPECT_EQ(safetensors_dtype("BF16"), at::kBFloat16);
  EXPECT_EQ(error_of([] { safetensors_dtype("U16"); }),
            "safetensors dtype 'U16' is not supported; expected one of F32, F64, F16, BF16, I64, "
            "I32, I16, I8, U8, BOOL");
}

TEST(SafetensorsWriter, WritesTheExactBytesSafetensorsWrites) {
  const std::string path = temp_dir() + "/a.safetensors";
  save_safetensors_file(path, {{"b", at::arange(3, at::kShort)}, {"a", at::arange(2, at::kByte)}});
  // Keys sorted, data in the order given, header padded with spaces to 8 bytes.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"data_offsets":[6,8],"dtype":"U8","shape":[2]},)"
      R"("b":{"data_offsets":[0,6],"dtype":"I16","shape":[3]}}       )";
  ASSERT_EQ(header.size() % 8, 0u);
  EXPECT_EQ(slurp(path), file_bytes(header, std::string("\0\0\1\0\2\0\0\1", 8)));
  EXPECT_FALSE(fs::exists(temporary_of(path)));
}

TEST(SafetensorsFile, EveryDtypeRoundTripsWholeAndByRange) {
  const std::string path = temp_dir() + "/all.safetensors";
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,
                               at::kInt, at::kShort, at::kChar, at::kByte}) {
    tensors.emplace_back(safetensors_dtype_name(dtype), at::arange(12, dtype).reshape({3, 4}));
  }
  tensors.emplace_back("BOOL", at::arange(12).reshape({3, 4}).remainder(3).eq(0));
  tensors.emplace_back("empty", at::arange(0, at::kFloat).reshape({0, 5}));
  save_safetensors_file(path, tensors);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.header().metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(file.header().tensors.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    SCOPED_TRACE(name);
    const at::Tensor got = file.read(name);
    EXPECT_EQ(got.scalar_type(), tensor.scalar_type());
    EXPECT_EQ(got.sizes(), tensor.sizes());
    EXPECT_TRUE(at::equal(got, tensor));
    if (tensor.numel() == 0) continue;
    EXPECT_TRUE(at::equal(file.read_range(name, 5, 4), tensor.reshape({-1}).narrow(0, 5, 4)));
  }
  EXPECT_EQ(
      error_of([&] { file.read_range("F32", 10, 3); }),
      "safetensors file '" + path + "': elements [10, 13) are outside tensor 'F32' (12 elements)");
  EXPECT_EQ(error_of([&] { file.read_range_into("F32", 0, 2, at::arange(2, at::kDouble)); }),
            "safetensors file '" + path +
                "': reading tensor 'F32' needs a contiguous CPU tensor of Float with 2 elements to "
                "read into, got Double on cpu with 2 elements");
  EXPECT_EQ(error_of([&] { file.read("nope"); }),
            "safetensors file '" + path + "' holds no tensor 'nope'");
}

TEST(SafetensorsShards, SplitsAsHuggingFaceDoes) {
  auto spec = [](const std::string& name, int64_t floats) {
    return SafetensorsTensorSpec{name, at::kFloat, {floats}};
  };
  // 40, 40, 100 (more than the 64-byte limit: alone), 8, 24, 40 bytes.
  const std::vector<SafetensorsTensorSpec> specs = {spec("a", 10), spec("b", 10), spec("c", 25),
                                                    spec("d", 2),  spec("e", 6),  spec("f", 10)};
  EXPECT_THAT(plan_safetensors_shards(specs, 64),
              ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2), ElementsAre(3, 4),
                          ElementsAre(5)));
  EXPECT_THAT(plan_safetensors_shards(specs, 1000), ElementsAre(ElementsAre(0, 1, 2, 3, 4, 5)));
  EXPECT_THAT(plan_safetensors_shards({}, 10), ElementsAre(ElementsAre()));
  EXPECT_EQ(safetensors_shard_name(1, 12), "model-00002-of-00012.safetensors");
  EXPECT_EQ(safetensors_shard_name(0, 1), "model.safetensors");
}

TEST(SafetensorsFolder, WritesShardsAndAnIndexThatReadBack) {
  const std::string dir = temp_dir() + "/model";
  std::vector<SafetensorsTensorSpec> specs;
  std::vector<at::Tensor> values;
  for (int i = 0; i < 5; ++i) {
    values.push_back(at::arange(i * 10, i * 10 + 6, at::kFloat).reshape({2, 3}));
    specs.push_back({"layers." + std::to_string(i) + ".w", at::kFloat, {2, 3}});
  }
  SafetensorsFolderWriter writer(dir, specs, SafetensorsWriteOptions().max_shard_size(50));
  for (int i = 0; i < 5; ++i) writer.write(specs[i].name, values[i]);
  EXPECT_THAT(writer.commit(),
              ElementsAre("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                          "model-00003-of-00003.safetensors"));
  EXPECT_EQ(slurp(dir + "/model.safetensors.index.json"), R"({
  "metadata": {
    "total_size": 120
  },
  "weight_map": {
    "layers.0.w": "model-00001-of-00003.safetensors",
    "layers.1.w": "model-00001-of-00003.safetensors",
    "layers.2.w": "model-00002-of-00003.safetensors",
    "layers.3.w": "model-00002-of-00003.safetensors",
    "layers.4.w": "model-00003-of-00003.safetensors"
  }
}
)");
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  EXPECT_EQ(ckpt.files().size(), 3u);
  EXPECT_EQ(ckpt.names().size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(at::equal(ckpt.read(specs[i].name), values[i]));
  EXPECT_TRUE(at::equal(ckpt.read_range("layers.3.w", 2, 3), at::arange(32, 35, at::kFloat)));
  // A single file when everything fits; a folder with only model.safetensors reads too.
  const std::string single = temp_dir() + "/one";
  SafetensorsFolderWriter one(single, {specs[0]});
  one.write(specs[0].name, values[0]);
  EXPECT_THAT(one.commit(), ElementsAre("model.safetensors"));
  EXPECT_FALSE(fs::exists(single + "/model.safetensors.index.json"));
  EXPECT_TRUE(at::equal(SafetensorsCheckpoint::open(single).read("layers.0.w"), values[0]));
}

TEST(SafetensorsWriter, WrongTensorAndUncommittedWriterLeaveNoFile) {
  const std::string path = temp_dir() + "/w.safetensors";
  {
    SafetensorsWriter writer(path, {{"a", at::kFloat, {2}}});
    EXPECT_EQ(error_of([&] { writer.write("b", at::arange(2, at::kFloat)); }),
              "safetensors file '" + path + "': expected tensor 'a' next, got 'b'");
    EXPECT_EQ(error_of([&] { writer.write("a", at::arange(3, at::kFloat)); }),
              "safetensors file '" + path + "': tensor 'a' was listed as Float [2], got Float [3]");
    EXPECT_TRUE(fs::exists(temporary_of(path)));
  }
  EXPECT_FALSE(fs::exists(temporary_of(path)));
  EXPECT_FALSE(fs::exists(path));
}

// ---- Every bad input of issue 26 item 1, each with its exact message. ----

const std::string kOne = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

TEST(SafetensorsBadInput, TruncatedFile) {
  const std::string path = temp_dir() + "/short.safetensors";
  spit(path, "abc");
  EXPECT_EQ(open_error_at(path),
            "safetensors file '<file>' is truncated: it has 3 bytes, fewer than the 8-byte header "
            "length every "
            "safetensors file starts with");
  EXPECT_EQ(open_error(kOne, std::string(5, '\0')),
            "safetensors file '<file>' is truncated: its tensors need 8 bytes after the header, "
            "the file has 5");
}

TEST(SafetensorsBadInput, HeaderLengthPastTheEnd) {
  const std::string path = temp_dir() + "/long.safetensors";
  std::string bytes = file_bytes(kOne, std::string(8, '\0'));
  const uint64_t n = 1000;
  std::memcpy(bytes.data(), &n, 8);
  spit(path, bytes);
  EXPECT_EQ(open_error_at(path),
            "safetensors file '<file>': header length 1000 runs past the end of the file (" +
                std::to_string(bytes.size()) + " bytes): the file is truncated or not safetensors");
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(bytes.data(), &huge, 8);
  spit(path, bytes);
  EXPECT_EQ(open_error_at(path),
            "safetensors file '<file>': header length 1099511627776 is larger than the format's "
            "limit of 100000000 "
            "bytes; the file is not safetensors or is corrupt");
}

TEST(SafetensorsBadInput, OverlappingOffsets) {
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                       std::string(12, '\0')),
            "safetensors file '<file>': tensor 'b' (data_offsets [4, 12]) overlaps tensor 'a' "
            "(ending at 8); expected "
            "each tensor to start where the previous one ends");
}

TEST(SafetensorsBadInput, OffsetsWithGaps) {
  EXPECT_EQ(open_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                       std::string(12, '\0')),
            "safetensors file '<file>': tensor 'b' starts at byte 8 of the data, leaving a gap "
            "after tensor 'a' "
            "(which ends at 4); expected each tensor to start where the previous one ends");
  EXPECT_EQ(
      open_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0')),
      "safetensors file '<file>': tensor 'a' starts at byte 4 of the data, leaving a gap after the "
      "header "
      "(which ends at 0); expected each tensor to start where the previous one ends");
  EXPECT_EQ(open_error(kOne, std::string(10, '\0')),
            "safetensors file '<file>' has 2 bytes after its last tensor's data; expected the "
            "tensors to end the file");
}

TEST(SafetensorsBadInput, ShapeBytesDifferFromOffsets) {
  EXPECT_EQ(open_error(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
                       std::string(20, '\0')),
            "safetensors file '<file>': tensor 'w': shape [2, 3] of F32 needs 24 bytes, but its "
            "data_offsets [0, 20] "
            "hold 20");
  EXPECT_EQ(
      open_error(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                 std::string(8, '\0')),
      "safetensors file '<file>': tensor 'w': shape [4294967296, 4294967296] of F32 needs more "
      "than 2^64 bytes, but "
      "its data_offsets [0, 8] hold 8");
}

TEST(SafetensorsBadInput, UnknownDtype) {
  EXPECT_EQ(open_error(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})",
                       std::string(2, '\0')),
            "safetensors file '<file>': tensor 'w' has dtype 'F8_E4M3', which fsdp does not read; "
            "expected one of "
            "F32, F64, F16, BF16, I64, I32, I16, I8, U8, BOOL");
}

// JSON nests at most kMaxJsonDepth levels (json.h): a deeper header is refused while it
// is parsed, one at the limit is only a header of the wrong shape.
TEST(SafetensorsBadInput, DeeplyNestedHeader) {
  const std::string deep = std::string(200'000, '[') + std::string(200'000, ']');
  EXPECT_EQ(open_error(deep, ""),
            "the header of safetensors file '<file>' nests arrays and objects deeper than 1000 "
            "levels, which fsdp does not read");
  const std::string limit = std::string(1000, '[') + std::string(1000, ']');
  EXPECT_EQ(open_error(limit, ""),
            "safetensors file '<file>': the header is a JSON array; expected an object of "
            "tensors");
}

// A number too large for a double is nlohmann's out_of_range, not a parse_error: the same
// one error (found by tools/fuzz.sh safetensors).
TEST(SafetensorsBadInput, NumberOverflowingADouble) {
  EXPECT_EQ(open_error(R"({"w":{"dtype":"F32","shape":[3e999],"data_offsets":[0,4]}})", ""),
            "the header of safetensors file '<file>' is not valid JSON: "
            "[json.exception.out_of_range.406] number overflow parsing '3e999'");
}

// Issue 38: a FIFO (or a device) in a model folder is refused by name, never opened.
TEST(SafetensorsBadInput, NotARegularFile) {
  const std::string path = temp_dir() + "/fifo.safetensors";
  ::unlink(path.c_str());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  EXPECT_EQ(open_error_at(path),
            "'<file>' is a FIFO (named pipe); safetensors file must be a regular file (or a "
            "symlink to one)");
  EXPECT_EQ(open_error_at("/dev/zero"),
            "'<file>' is a character device; safetensors file must be a regular file (or a "
            "symlink to one)");
}

TEST(SafetensorsBadInput, NonUtf8OrNonJsonHeader) {
  EXPECT_EQ(open_error("{\"w\xff\":1}", ""),
            "the header of safetensors file '<file>' is not valid JSON: "
            "[json.exception.parse_error.101] parse error at line 1, "
            "column 4: syntax error while parsing object key - invalid string: ill-formed "
            "UTF-8 byte; last read: '\"w\xff'; expected string literal");
  EXPECT_EQ(open_error("not json", ""),
            "the header of safetensors file '<file>' is not valid JSON: "
            "[json.exception.parse_error.101] parse error at line 1, "
            "column 2: syntax error while parsing value - invalid literal; last read: 'no'");
  EXPECT_EQ(open_error("[1, 2]", ""),
            "safetensors file '<file>': the header is a JSON array; expected an object of "
            "tensors");
  EXPECT_EQ(
      open_error(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", ""),
      "safetensors file '<file>': tensor 'w': shape must hold non-negative integers, found -2");
  EXPECT_EQ(open_error(R"({"w":{"dtype":"F32","shape":[2]}})", ""),
            "safetensors file '<file>': tensor 'w' has no 'data_offsets'; expected dtype, shape "
            "and data_offsets");
  EXPECT_EQ(open_error(R"({"__metadata__":{"format":1}})", ""),
            "safetensors file '<file>': __metadata__ 'format' must be a string, found 1");
}

TEST(SafetensorsBadInput, IndexNamingAMissingFileOrTensor) {
  const std::string dir = temp_dir();
  save_safetensors_file(dir + "/model-00001-of-00002.safetensors", {{"a", at::arange(2.0)}});
  spit(dir + "/model.safetensors.index.json",
       R"({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",)"
       R"( "b": "model-00002-of-00002.safetensors"}})");
  EXPECT_EQ(error_of([&] { SafetensorsCheckpoint::open(dir); }),
            "index '" + dir +
                "/model.safetensors.index.json' names file "
                "'model-00002-of-00002.safetensors' for tensor 'b', but '" +
                dir +
                "/model-00002-of-00002.safetensors' does not exist; expected every file "
                "of the index in '" +
                dir + "'");
  // A file outside the folder is refused as such, even when it exists.
  const std::string other = temp_dir();
  save_safetensors_file(other + "/model.safetensors", {{"b", at::arange(2.0)}});
  const std::string escape = "../" + fs::path(other).filename().string() + "/model.safetensors";
  spit(dir + "/model.safetensors.index.json",
       R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": ")" + escape + R"("}})");
  EXPECT_EQ(error_of([&] { SafetensorsCheckpoint::open(dir); }),
            "index '" + dir + "/model.safetensors.index.json' names file '" + escape +
                "' for tensor 'b', a path that leaves folder '" + dir +
                "' or enters another; expected the name of a file inside the folder, as "
                "save_pretrained writes");
  spit(dir + "/model.safetensors.index.json",
       R"({"weight_map": {"c": "model-00001-of-00002.safetensors"}})");
  EXPECT_EQ(error_of([&] { SafetensorsCheckpoint::open(dir); }),
            "index '" + dir + "/model.safetensors.index.json' puts tensor 'c' in '" + dir +
                "/model-00001-of-00002.safetensors', which holds no such tensor");
  spit(dir + "/model.safetensors.index.json", R"({"weight": {}})");
  EXPECT_EQ(error_of([&] { SafetensorsCheckpoint::open(dir); }),
            "index '" + dir +
                "/model.safetensors.index.json' has no \"weight_map\" object; expected "
                "{\"metadata\": {...}, \"weight_map\": {tensor: file}}");
  const std::string empty = temp_dir();
  EXPECT_EQ(error_of([&] { SafetensorsCheckpoint::open(empty); }),
            "folder '" + empty +
                "' holds neither model.safetensors.index.json nor model.safetensors; expected a "
                "Hugging Face model folder (save_pretrained)");
  EXPECT_EQ(error_of([&] { SafetensorsCheckpoint::open(empty + "/nothing"); }),
            "safetensors checkpoint '" + empty +
                "/nothing' does not exist; expected a .safetensors file or a folder with "
                "model.safetensors.index.json or model.safetensors");
}

}  // namespace
}  // namespace fsdp
