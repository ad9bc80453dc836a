// Sample prompts cut from conversation examples, end-of-sequence ids read from a folder,
// and greedy answers through the KV cache equal to recomputing the whole sequence.
#include "examples/llama/sampling.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "models/config.h"

namespace fsdp::models {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// A small Llama: 2 layers, hidden 32, vocab 64, 24 positions.
DecoderConfig tiny_llama() {
  return parse_decoder_config(
      R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "max_position_embeddings": 24, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "vocab_size": 64,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}})",
      "tiny.json");
}

// The greedy answer recomputing the whole sequence at every step, without a cache.
std::vector<int64_t> uncached_answer(CausalLMImpl& net, std::vector<int64_t> ids, int64_t n) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> answer;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor logits = net.forward(at::tensor(ids, at::kLong).view({1, -1}));
    answer.push_back(logits[0][-1].argmax().item<int64_t>());
    ids.push_back(answer.back());
  }
  return answer;
}

std::string folder(const std::string& name) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  EXPECT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  return dir;
}

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Examples [5 6 | 7 8] and [9 | 10 11 | 12 (not counted)]: prompts before the first
// counted token, references the rest.
TEST(SamplingTest, PromptsEndBeforeTheFirstCountedToken) {
  ChatExamples examples;
  examples.ids = at::tensor(std::vector<int64_t>{5, 6, 7, 8, 9, 10, 11, 12}, at::kLong);
  examples.counted = at::tensor(std::vector<int64_t>{0, 0, 1, 1, 0, 1, 1, 0}, at::kLong) == 1;
  examples.offsets = {0, 4, 8};
  const std::vector<SamplePrompt> prompts = sample_prompts(examples);
  ASSERT_EQ(prompts.size(), 2u);
  EXPECT_THAT(prompts[0].prompt, ElementsAre(5, 6));
  EXPECT_THAT(prompts[0].reference, ElementsAre(7, 8));
  EXPECT_THAT(prompts[1].prompt, ElementsAre(9));
  EXPECT_THAT(prompts[1].reference, ElementsAre(10, 11, 12));
}

TEST(SamplingTest, EosIdsComeFromTheGenerationConfigFirst) {
  const std::string dir = folder("eos");
  EXPECT_TRUE(eos_token_ids(dir).empty());  // neither file
  write(dir + "/config.json", R"({"eos_token_id": 2})");
  EXPECT_THAT(eos_token_ids(dir), ElementsAre(2));
  write(dir + "/generation_config.json", R"({"eos_token_id": [5, 7]})");
  EXPECT_THAT(eos_token_ids(dir), ElementsAre(5, 7));
  write(dir + "/generation_config.json", R"({"eos_token_id": null})");
  EXPECT_THAT(eos_token_ids(dir), ElementsAre(2));  // none there: config.json's
  write(dir + "/generation_config.json", R"({"eos_token_id": "</s>"})");
  EXPECT_THAT([&] { eos_token_ids(dir); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "generation_config.json: expected eos_token_id to be a token id or a list of "
                  "them, found \"</s>\"")));
  write(dir + "/generation_config.json", R"({"eos_token_id": [5,)");
  EXPECT_THAT(
      [&] { eos_token_ids(dir); },
      ThrowsMessage<c10::Error>(HasSubstr("generation_config.json: expected a JSON object")));
}

TEST(SamplingTest, GreedyAnswersThroughTheCacheEqualRecomputing) {
  at::manual_seed(5);
  CausalLMImpl net(tiny_llama());
  const std::vector<int64_t> prompt = {3, 17, 40, 8, 61};
  const auto forward = [&](const at::Tensor& ids) { return net.forward(ids); };
  const std::vector<int64_t> want = uncached_answer(net, prompt, 10);
  EXPECT_EQ(greedy_answer(forward, net, prompt, {10, {}}), want);
  EXPECT_TRUE(net.is_training()) << "the training mode is restored";
  // An end-of-sequence id ends the answer, itself included.
  const std::vector<int64_t> ended = greedy_answer(forward, net, prompt, {10, {want[3], 99}});
  const auto first = std::find(want.begin(), want.end(), want[3]);
  EXPECT_EQ(ended, std::vector<int64_t>(want.begin(), first + 1));
  // The model's 24 positions bound the answer: 19 tokens after a 5-token prompt.
  EXPECT_EQ(greedy_answer(forward, net, prompt, {100, {}}).size(), 19u);
  EXPECT_THAT(
      [&] {
        greedy_answer(forward, net, std::vector<int64_t>(24, 1), {4, {}});
      },
      ThrowsMessage<c10::Error>(
          HasSubstr("greedy_answer: expected a prompt of 1 to 23 tokens (max_position_embeddings "
                    "24), got 24")));
}

TEST(SamplingTest, SamplesAreJsonLines) {
  const std::string path = folder("samples") + "/samples.jsonl";
  const std::vector<SamplePrompt> prompts = {{{1, 2}, {3}}, {{4}, {5, 6}}};
  write_samples(path, prompts, {{7}, {8, 9}}, {});
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text,
            "{\"before\":[7],\"prompt\":[1,2],\"reference\":[3]}\n"
            "{\"before\":[8,9],\"prompt\":[4],\"reference\":[5,6]}\n");
  write_samples(path, prompts, {{7}, {8, 9}}, {{10}, {}});
  std::ifstream again(path);
  std::string line;
  std::getline(again, line);
  EXPECT_EQ(line, "{\"after\":[10],\"before\":[7],\"prompt\":[1,2],\"reference\":[3]}");
}

}  // namespace
}  // namespace fsdp::models
