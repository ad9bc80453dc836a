// Token files: checked once when opened, then read window by window at the ids' width.
#include "examples/llama/token_file.h"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace fsdp::models {
namespace {

using testing::HasSubstr;
using testing::ThrowsMessage;

std::string temp_path(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
}

// `ids` as little-endian ids of `bytes` bytes each.
std::string write_ids(const std::string& name, const std::vector<uint32_t>& ids, int bytes) {
  const std::string path = temp_path(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (uint32_t id : ids)
    for (int b = 0; b < bytes; ++b) out.put(static_cast<char>((id >> (8 * b)) & 0xff));
  return path;
}

std::vector<int64_t> values(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

TEST(TokenFileTest, WindowsOfBothWidths) {
  // 70000 does not fit 16 bits: only the uint32 file holds it.
  const std::vector<uint32_t> ids = {3, 65535, 7, 70000, 1, 0, 42};
  const TokenFile wide(write_ids("wide.bin", ids, 4), 4, 100000);
  EXPECT_EQ(wide.size(), 7);
  auto [x, y] = wide.windows(at::tensor({0, 3, 4}, at::kLong), 2);
  EXPECT_EQ(x.sizes(), at::IntArrayRef({3, 2}));
  EXPECT_EQ(x.scalar_type(), at::kLong);
  EXPECT_EQ(values(x), (std::vector<int64_t>{3, 65535, 70000, 1, 1, 0}));
  EXPECT_EQ(values(y), (std::vector<int64_t>{65535, 7, 1, 0, 0, 42}));

  const TokenFile narrow(write_ids("narrow.bin", {3, 65535, 7, 9, 1}, 2), 2, 65536);
  EXPECT_EQ(narrow.size(), 5);
  auto [a, b] = narrow.windows(at::tensor({1, 0}, at::kLong), 3);
  EXPECT_EQ(values(a), (std::vector<int64_t>{65535, 7, 9, 3, 65535, 7}));
  EXPECT_EQ(values(b), (std::vector<int64_t>{7, 9, 1, 65535, 7, 9}));
}

// 4-byte ids read as 2-byte ones: every second id is 0 (the high halves).
TEST(TokenFileTest, TellsFourByteIdsReadAsTwoByteOnes) {
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 32; ++i) ids.push_back(1 + i % 7);
  const std::string wide = write_ids("wide32.bin", ids, 4);
  EXPECT_TRUE(TokenFile(wide, 2, 100).looks_like_4_byte_ids());
  EXPECT_FALSE(TokenFile(wide, 4, 100).looks_like_4_byte_ids());
  ids.pop_back();  // 62 two-byte ids: too few to tell
  EXPECT_FALSE(TokenFile(write_ids("short32.bin", ids, 4), 2, 100).looks_like_4_byte_ids());
  ids.push_back(1);  // the same ids as 2-byte ones
  EXPECT_FALSE(TokenFile(write_ids("narrow16.bin", ids, 2), 2, 100).looks_like_4_byte_ids());
  EXPECT_FALSE(TokenFile(write_ids("zeros.bin", std::vector<uint32_t>(64, 0), 2), 2, 100)
                   .looks_like_4_byte_ids());
}

TEST(TokenFileTest, RefusesWhatItCannotTrainOn) {
  const std::string odd = temp_path("odd.bin");
  std::ofstream(odd, std::ios::binary) << "abc";
  EXPECT_THAT([&] { TokenFile(odd, 2, 10); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "3 bytes is not a whole number of 2-byte token ids; check --data_dtype")));
  // The id at index 2 is the first one not below the vocabulary.
  const std::string big = write_ids("big.bin", {1, 2, 500, 600}, 2);
  EXPECT_THAT([&] { TokenFile(big, 2, 500); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "'" + big + "': token 2 is 500, not below the model's vocab_size 500")));
  // Checked as read instead: opening passes, the window holding the id does not.
  const TokenFile unchecked(big, 2, 500, TokenFile::IdCheck::kAsRead);
  EXPECT_EQ(unchecked.windows(at::tensor({0}, at::kLong), 1).first.item<int64_t>(), 1);
  EXPECT_THAT([&] { unchecked.windows(at::tensor({1}, at::kLong), 1); },
              ThrowsMessage<c10::Error>(HasSubstr("token 2 is now 500, not below vocab_size 500")));
  EXPECT_THAT([&] { TokenFile(temp_path("missing.bin"), 2, 10); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot open token file")));
  EXPECT_THAT(
      [&] { TokenFile(temp_path(""), 2, 10); },
      ThrowsMessage<c10::Error>(HasSubstr("is a directory; token file must be a regular file")));
}

TEST(TokenFileTest, RefusesWindowsOutsideTheFileAndAChangedFile) {
  const std::string path = write_ids("changed.bin", {1, 2, 3, 4, 5}, 2);
  const TokenFile file(path, 2, 10);
  EXPECT_THAT([&] { file.windows(at::tensor({3}, at::kLong), 2); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("a window of 3 tokens at 3 does not lie in its 5 tokens")));
  EXPECT_THAT([&] { file.windows(at::tensor({-1}, at::kLong), 2); },
              ThrowsMessage<c10::Error>(HasSubstr("at -1 does not lie")));
  write_ids("changed.bin", {1, 2, 30, 4, 5}, 2);
  EXPECT_THAT([&] { file.windows(at::tensor({1}, at::kLong), 2); },
              ThrowsMessage<c10::Error>(HasSubstr("token 2 is now 30, not below vocab_size 10")));
  write_ids("changed.bin", {1, 2}, 2);
  EXPECT_THAT([&] { file.windows(at::tensor({2}, at::kLong), 2); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("token file '" + path +
                            "' is cut short at byte 4: the file shrank after it was opened")));
}

}  // namespace
}  // namespace fsdp::models
