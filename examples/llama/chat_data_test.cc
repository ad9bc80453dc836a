// Conversation files: read and checked, then packed best-fit decreasing or one example a
// row, with position ids restarting at each example and targets only where they count.
#include "examples/llama/chat_data.h"

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/formats/safetensors.h"

namespace fsdp::models {
namespace {

std::string temp_path(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
}

// Examples of lengths 5, 3, 6 and 2 (ids 10 + token index); each counts its last two
// tokens (a one-turn answer), the 2-token one its last.
std::string write_file(const std::string& name, std::string format = "fsdp-chat-v1") {
  const std::vector<int64_t> offsets = {0, 5, 8, 14, 16};
  at::Tensor ids = at::arange(10, 26, at::kInt);
  at::Tensor mask = at::zeros({16}, at::kByte);
  for (int64_t i : {3, 4, 6, 7, 12, 13, 15}) mask[i] = 1;
  const std::string path = temp_path(name);
  save_safetensors_file(path,
                        {{"input_ids", ids},
                         {"loss_mask", mask},
                         {"example_offsets", at::tensor(offsets, at::kLong)}},
                        {{"format", format}});
  return path;
}

std::vector<int64_t> row(const at::Tensor& t, int64_t r) {
  const at::Tensor x = t[r].contiguous();
  return std::vector<int64_t>(x.data_ptr<int64_t>(), x.data_ptr<int64_t>() + x.numel());
}

TEST(ChatDataTest, ReadsTheExamples) {
  const ChatExamples examples = read_chat_file(write_file("ok.safetensors"), 64);
  EXPECT_EQ(examples.size(), 4);
  EXPECT_EQ(examples.offsets, (std::vector<int64_t>{0, 5, 8, 14, 16}));
  EXPECT_EQ(examples.length(2), 6);
  EXPECT_EQ(examples.ids[13].item<int64_t>(), 23);
  EXPECT_EQ(examples.counted.sum().item<int64_t>(), 7);
}

TEST(ChatDataTest, BadFilesAreNamed) {
  const std::string path = write_file("pt.safetensors", "pt");
  EXPECT_THAT([&] { read_chat_file(path, 64); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr(
                  ": __metadata__ format is 'pt'; expected fsdp-chat-v1, a conversation file "
                  "from examples/llama/prepare_chat.py")));
  EXPECT_THAT([&] { read_chat_file(write_file("v.safetensors"), 20); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr(
                  ": token 10 is 20, not in [0, vocab_size 20); was the file made with this "
                  "model's tokenizer?")));
  const std::string first = temp_path("first.safetensors");
  at::Tensor mask = at::zeros({4}, at::kByte);
  mask[2] = 1;
  save_safetensors_file(first,
                        {{"input_ids", at::arange(4, at::kInt)},
                         {"loss_mask", mask},
                         {"example_offsets", at::tensor(std::vector<int64_t>{0, 2, 4}, at::kLong)}},
                        {{"format", "fsdp-chat-v1"}});
  EXPECT_THAT([&] { read_chat_file(first, 64); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr(
                  ": example 1's first token is marked as counted; nothing predicts it")));
  const std::string wrong = temp_path("wrong.safetensors");
  save_safetensors_file(wrong,
                        {{"input_ids", at::arange(4, at::kLong)},
                         {"loss_mask", mask},
                         {"example_offsets", at::tensor(std::vector<int64_t>{0, 4}, at::kLong)}},
                        {{"format", "fsdp-chat-v1"}});
  EXPECT_THAT([&] { read_chat_file(wrong, 64); },
              testing::ThrowsMessage<c10::Error>(
                  testing::HasSubstr(": 'input_ids' is I64 of 1 dimensions; expected a 1-D I32 "
                                     "tensor")));
}

// Best-fit decreasing in rows of 8: 6 opens row 0, 5 opens row 1, 3 joins row 1 (room 3),
// 2 joins row 0 (room 2).
TEST(ChatDataTest, PackingIsBestFitDecreasing) {
  const ChatRows rows = pack_chat_rows(read_chat_file(write_file("p.safetensors"), 64), 8,
                                       ChatPacking::kPacked, LongExamples::kCut);
  ASSERT_EQ(rows.rows(), 2);
  EXPECT_EQ(row(rows.inputs, 0), (std::vector<int64_t>{18, 19, 20, 21, 22, 23, 24, 25}));
  EXPECT_EQ(row(rows.positions, 0), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 0, 1}));
  EXPECT_EQ(row(rows.segments, 0), (std::vector<int64_t>{0, 0, 0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(row(rows.targets, 0), (std::vector<int64_t>{-100, -100, -100, 22, 23, -100, 25, -100}));
  EXPECT_EQ(row(rows.inputs, 1), (std::vector<int64_t>{10, 11, 12, 13, 14, 15, 16, 17}));
  EXPECT_EQ(row(rows.positions, 1), (std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1, 2}));
  EXPECT_EQ(row(rows.targets, 1), (std::vector<int64_t>{-100, -100, 13, 14, -100, 16, 17, -100}));
  EXPECT_EQ(rows.examples, 4);
  EXPECT_EQ(rows.counted, 7);
  EXPECT_DOUBLE_EQ(rows.padding(), 0.0);
}

TEST(ChatDataTest, OneExampleARowIsPadded) {
  const ChatRows rows = pack_chat_rows(read_chat_file(write_file("r.safetensors"), 64), 6,
                                       ChatPacking::kPerRow, LongExamples::kCut);
  ASSERT_EQ(rows.rows(), 4);
  EXPECT_EQ(row(rows.inputs, 1), (std::vector<int64_t>{15, 16, 17, 0, 0, 0}));
  EXPECT_EQ(row(rows.segments, 1), (std::vector<int64_t>{0, 0, 0, -1, -1, -1}));
  EXPECT_EQ(row(rows.targets, 1), (std::vector<int64_t>{16, 17, -100, -100, -100, -100}));
  EXPECT_DOUBLE_EQ(rows.padding(), (1 + 3 + 0 + 4) / 24.0);
}

// In a context of 4: the 5- and 6-token examples are cut (the 6-token one keeps no
// counted target and is left out) or dropped.
TEST(ChatDataTest, LongExamplesAreCutOrDropped) {
  const ChatExamples examples = read_chat_file(write_file("l.safetensors"), 64);
  const ChatRows cut = pack_chat_rows(examples, 4, ChatPacking::kPerRow, LongExamples::kCut);
  EXPECT_EQ(cut.rows(), 3);
  EXPECT_EQ(cut.cut, 1);
  EXPECT_EQ(cut.dropped, 1);
  EXPECT_EQ(row(cut.targets, 0), (std::vector<int64_t>{-100, -100, 13, -100}));
  const ChatRows dropped = pack_chat_rows(examples, 4, ChatPacking::kPerRow, LongExamples::kDrop);
  EXPECT_EQ(dropped.rows(), 2);
  EXPECT_EQ(dropped.dropped, 2);
  EXPECT_EQ(dropped.counted, 3);
  ChatExamples silent;  // one example, no token counts
  silent.ids = at::arange(3, at::kLong);
  silent.counted = at::zeros({3}, at::kBool);
  silent.offsets = {0, 3};
  EXPECT_THAT([&] { pack_chat_rows(silent, 4, ChatPacking::kPacked, LongExamples::kCut); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr(
                  "pack_chat_rows: none of the 1 examples is left with a counted token in a "
                  "context of 4 (1 left out: 0 longer than the context with "
                  "--long_examples=drop, 0 counting only tokens past it, 1 counting no token at "
                  "all); the file's loss_mask counts nothing: remake it (prepare_chat.py "
                  "--mask, and a chat template that marks the assistant's turns)")));
  // Too long under kDrop too: still a mask that counts nothing.
  EXPECT_THAT([&] { pack_chat_rows(silent, 2, ChatPacking::kPacked, LongExamples::kDrop); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr(
                  "1 counting no token at all); the file's loss_mask counts nothing")));
  // Its one counted token past a context of 2: a longer context would keep it.
  silent.counted[2] = true;
  EXPECT_THAT([&] { pack_chat_rows(silent, 2, ChatPacking::kPacked, LongExamples::kCut); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr(
                  "(1 left out: 0 longer than the context with --long_examples=drop, 1 counting "
                  "only tokens past it, 0 counting no token at all); raise --context")));
}

// A token file's windows carry no positions or segments: narrow() and to() keep them so.
TEST(ChatDataTest, WindowsWithoutSegmentsNarrowAndMove) {
  const ChatBatch windows{at::arange(12, at::kLong).reshape({3, 4}),
                          at::arange(1, 13, at::kLong).reshape({3, 4}), at::Tensor(), at::Tensor()};
  const ChatBatch moved = windows.narrow(1, 2).to(c10::Device(c10::kCPU));
  EXPECT_EQ(row(moved.inputs, 0), (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_EQ(row(moved.targets, 1), (std::vector<int64_t>{9, 10, 11, 12}));
  EXPECT_FALSE(moved.positions.defined());
  EXPECT_FALSE(moved.segments.defined());
}

}  // namespace
}  // namespace fsdp::models
