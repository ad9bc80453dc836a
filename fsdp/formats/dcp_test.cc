#include "fsdp/formats/dcp.h"

#include <sys/stat.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <ATen/ops/arange.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "fsdp/formats/files.h"
#include "fsdp/formats/testing/python_testing.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using formats_testing::read_bytes;
using formats_testing::run_python;
using formats_testing::scratch_path;
using formats_testing::write_bytes;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// A folder dcp.save wrote in one process: a float tensor, a bf16 tensor, an int and a
// tuple of floats.
std::string python_folder() {
  const std::string dir = scratch_path("python_dcp");
  fs::remove_all(dir);
  run_python(absl::StrCat(R"(
import torch, torch.distributed.checkpoint as dcp
w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
b = torch.arange(3, dtype=torch.bfloat16)
dcp.save({"model": {"w": w, "b": b}, "step": 7, "betas": (0.9, 0.999)}, checkpoint_id=")",
                          dir, "\")\n"));
  return dir;
}

TEST(DcpMetadata, ReadsWhatDcpSaveWrote) {
  const std::string dir = python_folder();
  const DcpMetadata md = read_dcp_metadata(dir);
  EXPECT_EQ(md.version, "1.0.0");
  ASSERT_EQ(md.entries.size(), 4u);
  const DcpEntryMetadata* w = md.find("model.w");
  ASSERT_NE(w, nullptr);
  EXPECT_TRUE(w->is_tensor);
  EXPECT_EQ(w->dtype, c10::ScalarType::Float);
  EXPECT_EQ(w->size, (std::vector<int64_t>{4, 3}));
  ASSERT_EQ(w->chunks.size(), 1u);
  EXPECT_EQ(w->chunks[0].offsets, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(w->chunks[0].sizes, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(w->path, (std::vector<DcpPathElement>{std::string("model"), std::string("w")}));
  EXPECT_EQ(md.find("model.b")->dtype, c10::ScalarType::BFloat16);
  EXPECT_FALSE(md.find("step")->is_tensor);
  EXPECT_EQ(md.find("step")->path, (std::vector<DcpPathElement>{std::string("step")}));
  ASSERT_EQ(md.storage.size(), 4u);
  const DcpStorageInfo* sw = md.find_storage("model.w", std::vector<int64_t>{0, 0});
  ASSERT_NE(sw, nullptr);
  EXPECT_EQ(sw->relative_path, "__0_0.distcp");
  EXPECT_EQ(sw->index, 0);
  const DcpStorageInfo* step = md.find_storage("step", std::nullopt);
  ASSERT_NE(step, nullptr);
  EXPECT_FALSE(step->index.has_value());
  // Each entry is a whole torch.save archive at its byte range.
  const std::string file = read_bytes(dir + "/__0_0.distcp");
  int64_t total = 0;
  for (const DcpStorageInfo& s : md.storage) {
    const std::string entry = read_dcp_entry(dir, s);
    EXPECT_EQ(entry, file.substr(s.offset, s.length));
    EXPECT_EQ(entry.substr(0, 2), "PK");
    total += s.length;
  }
  EXPECT_EQ(total, static_cast<int64_t>(file.size()));
  // Our writer's pickle of it parses to the same metadata.
  const DcpMetadata again = parse_dcp_metadata(serialize_dcp_metadata(md), "again");
  EXPECT_EQ(serialize_dcp_metadata(again), serialize_dcp_metadata(md));
}

// A tensor split into two chunks over two files, a bf16 tensor and an int: dcp.load and
// dcp_to_torch_save read the folder.
TEST(DcpMetadata, DcpLoadReadsWhatWeWrite) {
  const std::string dir = scratch_path("our_dcp");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const at::Tensor w = at::arange(12, at::kFloat).reshape({4, 3});
  const at::Tensor b = at::arange(3, at::kBFloat16);
  DcpMetadata md;
  md.entries.push_back({"model.w",
                        true,
                        c10::ScalarType::Float,
                        false,
                        {4, 3},
                        {{{0, 0}, {3, 3}}, {{3, 0}, {1, 3}}},
                        {std::string("model"), std::string("w")}});
  md.entries.push_back({"model.b",
                        true,
                        c10::ScalarType::BFloat16,
                        false,
                        {3},
                        {{{0}, {3}}},
                        {std::string("model"), std::string("b")}});
  md.entries.push_back({"step", false, {}, false, {}, {}, {std::string("step")}});
  std::string files[2];
  auto add = [&](int rank, const std::string& fqn, std::optional<std::vector<int64_t>> offsets,
                 const c10::IValue& value) {
    const std::vector<char> bytes = torch::jit::pickle_save(value);
    md.storage.push_back({fqn, offsets, offsets ? std::optional<int64_t>(0) : std::nullopt,
                          dcp_data_file(rank), static_cast<int64_t>(files[rank].size()),
                          static_cast<int64_t>(bytes.size())});
    files[rank].append(bytes.begin(), bytes.end());
  };
  add(0, "model.w", std::vector<int64_t>{0, 0}, w.slice(0, 0, 3).clone());
  add(1, "model.w", std::vector<int64_t>{3, 0}, w.slice(0, 3, 4).clone());
  add(1, "model.b", std::vector<int64_t>{0}, b);
  add(0, "step", std::nullopt, int64_t{42});
  md.storage[1].index = 1;
  write_bytes(dir + "/" + dcp_data_file(0), files[0]);
  write_bytes(dir + "/" + dcp_data_file(1), files[1]);
  write_bytes(dir + "/" + kDcpMetadataFile, serialize_dcp_metadata(md));
  EXPECT_EQ(run_python(absl::StrCat(R"(
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
sd = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0}
dcp.load(sd, checkpoint_id=")",
                                    dir, R"(")
print(sd["model"]["w"].flatten().tolist(), sd["model"]["b"].tolist(), sd["step"])
dcp_to_torch_save(")",
                                    dir, R"(", ")", dir, R"(/full.pt")
full = torch.load(")",
                                    dir, R"(/full.pt")
print(sorted(full), full["model"]["w"].sum().item(), full["step"])
)")),
            "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0] [0.0, 1.0, 2.0] 42\n"
            "['model', 'step'] 66.0 42\n");
}

TEST(DcpMetadata, BadInputIsOneClearError) {
  const std::string dir = python_folder();
  const DcpMetadata md = read_dcp_metadata(dir);
  // A chunk outside its tensor.
  DcpMetadata bad = md;
  bad.entries[0].chunks[0].offsets[0] = 1;
  EXPECT_THAT(
      [&] { parse_dcp_metadata(serialize_dcp_metadata(bad), "bad"); },
      ThrowsMessage<c10::Error>(HasSubstr(
          "'bad' is not Distributed Checkpoint metadata fsdp can read: a chunk of 'model.w' "
          "at offsets (1, 0) with sizes (4, 3) lies outside its tensor of size (4, 3)")));
  // A record of a key the metadata does not list.
  bad = md;
  bad.storage[0].fqn = "model.other";
  EXPECT_THAT([&] { parse_dcp_metadata(serialize_dcp_metadata(bad), "bad"); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "storage_data has a record for 'model.other', which state_dict_metadata does "
                  "not list")));
  // An unexpected class.
  EXPECT_THAT([&] { parse_dcp_metadata("\x80\x02\x63os\nsystem\n)R.", "evil"); },
              ThrowsMessage<c10::Error>(HasSubstr("an unexpected class or function 'os.system'")));
  // Not a Metadata object.
  EXPECT_THAT([&] { parse_dcp_metadata("\x80\x02}.", "dict"); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("'dict' is not Distributed Checkpoint metadata fsdp can read: the "
                            "file must be a Metadata, found a dict")));
  // A truncated .distcp file, then a missing one.
  const DcpStorageInfo& last = md.storage.back();
  const std::string file = dir + "/" + last.relative_path;
  const std::string bytes = read_bytes(file);
  write_bytes(file, bytes.substr(0, bytes.size() - 1));
  EXPECT_THAT([&] { read_dcp_entry(dir, last); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  absl::StrCat("has ", bytes.size() - 1, " bytes, but .metadata puts '", last.fqn,
                               "' at bytes [", last.offset, ", ", last.offset + last.length,
                               "): the file is truncated or belongs to another checkpoint"))));
  fs::remove(file);
  EXPECT_THAT([&] { read_dcp_entry(dir, last); },
              ThrowsMessage<c10::Error>(HasSubstr(absl::StrCat(
                  "is not a complete Distributed Checkpoint: its .metadata says '", last.fqn,
                  "' is in '__0_0.distcp': cannot open Distributed Checkpoint data '", file,
                  "': No such file or directory"))));
  fs::remove(dir + "/.metadata");
  EXPECT_THAT([&] { read_dcp_metadata(dir); },
              ThrowsMessage<c10::Error>(HasSubstr(absl::StrCat(
                  "'", dir, "' is not a complete Distributed Checkpoint: cannot open Distributed ",
                  "Checkpoint metadata '", dir, "/.metadata': No such file or directory"))));
}

// Metadata of one float tensor of `size` stored as `chunks` (offsets, sizes).
DcpMetadata one_tensor(std::vector<int64_t> size, std::vector<DcpChunk> chunks) {
  DcpMetadata md;
  md.entries.push_back({"model.w",
                        true,
                        c10::ScalarType::Float,
                        false,
                        std::move(size),
                        std::move(chunks),
                        {std::string("model"), std::string("w")}});
  return md;
}

std::string cover_error(std::vector<int64_t> size, std::vector<DcpChunk> chunks) {
  try {
    parse_dcp_metadata(serialize_dcp_metadata(one_tensor(std::move(size), std::move(chunks))), "x");
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Issue 38: chunks whose element counts add up but that overlap (rows 74..109 once,
// 76..79 twice, 110..113 never) were read with rows 110..113 left uninitialised.
TEST(DcpMetadata, ChunksMustCoverTheTensorExactlyOnce) {
  EXPECT_EQ(cover_error({114, 4}, {{{0, 0}, {74, 4}}, {{74, 0}, {36, 4}}, {{76, 0}, {4, 4}}}),
            "'x' is not Distributed Checkpoint metadata fsdp can read: the 3 chunks of 'model.w' "
            "hold 456 elements of its tensor of size (114, 4) with 456 elements: some elements "
            "are stored twice and others not at all; the checkpoint is damaged or was edited");
  EXPECT_EQ(cover_error({114, 4}, {{{0, 0}, {74, 4}}, {{74, 0}, {36, 4}}}),
            "'x' is not Distributed Checkpoint metadata fsdp can read: the 2 chunks of 'model.w' "
            "hold 440 elements of its tensor of size (114, 4) with 456 elements: some elements "
            "are not stored; the checkpoint is damaged or was edited");
  EXPECT_THAT(cover_error({4, 4}, {{{0, 0}, {4, 4}}, {{1, 1}, {1, 1}}}),
              HasSubstr("hold 17 elements of its tensor of size (4, 4) with 16 elements: some "
                        "elements are stored twice"));
  // Two columns swapped in the second half: counts and rows agree, columns do not.
  EXPECT_THAT(cover_error({4, 4}, {{{0, 0}, {2, 4}}, {{2, 0}, {2, 2}}, {{2, 0}, {2, 2}}}),
              HasSubstr("stored twice and others not at all"));
  // Layouts that tile: row slabs, column slabs (tensor parallel), a brick wall, empty
  // chunks, a 0-dim tensor, a tensor with no elements.
  EXPECT_EQ(cover_error({4, 4}, {{{0, 0}, {1, 4}}, {{1, 0}, {3, 4}}}), "");
  EXPECT_EQ(cover_error({4, 4}, {{{0, 0}, {4, 1}}, {{0, 1}, {4, 3}}}), "");
  EXPECT_EQ(cover_error({4, 4, 2}, {{{0, 0, 0}, {2, 4, 2}},
                                    {{2, 0, 0}, {2, 1, 2}},
                                    {{2, 1, 0}, {2, 3, 2}},
                                    {{4, 0, 0}, {0, 4, 2}}}),
            "");
  EXPECT_EQ(cover_error({}, {{{}, {}}}), "");
  EXPECT_THAT(cover_error({}, {{{}, {}}, {{}, {}}}), HasSubstr("stored twice"));
  EXPECT_EQ(cover_error({0, 3}, {}), "");
  EXPECT_THAT(cover_error({3}, {}), HasSubstr("hold 0 elements"));
}

// Issue 38: .metadata as /dev/zero read until the OOM killer came; as a FIFO it hung.
TEST(DcpMetadata, MetadataMustBeARegularFile) {
  const std::string dir = scratch_path("dcp_special");
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink("/dev/zero", dir + "/.metadata");
  EXPECT_THAT([&] { read_dcp_metadata(dir); },
              ThrowsMessage<c10::Error>(HasSubstr(absl::StrCat(
                  "'", dir, "' is not a complete Distributed Checkpoint: '", dir,
                  "/.metadata' is a character device; Distributed Checkpoint metadata must be a "
                  "regular file (or a symlink to one)"))));
  fs::remove(dir + "/.metadata");
  ASSERT_EQ(::mkfifo((dir + "/.metadata").c_str(), 0600), 0);
  EXPECT_THAT([&] { read_dcp_metadata(dir); },
              ThrowsMessage<c10::Error>(HasSubstr(absl::StrCat(
                  "'", dir,
                  "/.metadata' is a FIFO (named pipe); Distributed Checkpoint metadata "
                  "must be a regular file (or a symlink to one)"))));
  // A symlink to a regular file is read.
  fs::remove(dir + "/.metadata");
  write_bytes(dir + "/real", serialize_dcp_metadata(one_tensor({2}, {{{0}, {2}}})));
  fs::create_symlink(dir + "/real", dir + "/.metadata");
  EXPECT_EQ(read_dcp_metadata(dir).entries.size(), 1u);
  // A .metadata over kMaxMetadataBytes (sparse: no disk) is refused before it is read.
  fs::remove(dir + "/.metadata");
  write_bytes(dir + "/.metadata", "");
  fs::resize_file(dir + "/.metadata", kMaxMetadataBytes + 1);
  EXPECT_THAT([&] { read_dcp_metadata(dir); },
              ThrowsMessage<c10::Error>(HasSubstr(absl::StrCat(
                  "'", dir,
                  "' is not a complete Distributed Checkpoint: Distributed Checkpoint "
                  "metadata '",
                  dir,
                  "/.metadata' has 1073741825 bytes, more than the 1073741824 "
                  "fsdp reads for it; it is not Distributed Checkpoint metadata or is damaged"))));
}

// Issue 38: a .metadata holding a list nested 300,000 deep crashed the reader (SIGSEGV).
TEST(DcpMetadata, DeeplyNestedMetadataIsRefused) {
  std::string bytes = "\x80\x02";
  bytes.append(300'000, ']');
  bytes.append(299'999, 'a');
  bytes.push_back('.');
  EXPECT_THAT([&] { parse_dcp_metadata(bytes, "deep"); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "cannot read the pickle 'deep' at byte 600001: it nests containers deeper "
                  "than 1000 levels, which fsdp does not read")));
}

}  // namespace
}  // namespace fsdp
