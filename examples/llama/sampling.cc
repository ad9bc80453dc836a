#include "examples/llama/sampling.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/formats/atomic_file.h"

namespace fsdp::models {
namespace {

// eos_token_id of the JSON file `path`: nullopt when the file or the key is missing (or
// null), else its ids.
std::optional<std::vector<int64_t>> eos_of(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  const nlohmann::json json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(json.is_object(), path, ": expected a JSON object; is the file complete?");
  const auto found = json.find("eos_token_id");
  if (found == json.end() || found->is_null()) return std::nullopt;
  const auto id = [&](const nlohmann::json& value) {
    TORCH_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0, path,
                ": expected eos_token_id to be a token id or a list of them, found ",
                found->dump());
    return value.get<int64_t>();
  };
  std::vector<int64_t> ids;
  if (found->is_array()) {
    for (const nlohmann::json& value : *found) ids.push_back(id(value));
  } else {
    ids.push_back(id(*found));
  }
  return ids;
}

}  // namespace

std::vector<SamplePrompt> sample_prompts(const ChatExamples& examples) {
  const at::Tensor ids = examples.ids.contiguous(), counted = examples.counted.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const bool* counts = counted.data_ptr<bool>();
  std::vector<SamplePrompt> prompts;
  for (int64_t e = 0; e < examples.size(); ++e) {
    const int64_t begin = examples.offsets[e], end = examples.offsets[e + 1];
    int64_t answer = begin;
    while (answer < end && !counts[answer]) ++answer;
    prompts.push_back({std::vector<int64_t>(id + begin, id + answer),
                       std::vector<int64_t>(id + answer, id + end)});
  }
  return prompts;
}

std::vector<int64_t> eos_token_ids(const std::string& model_dir) {
  for (const char* name : {"/generation_config.json", "/config.json"}) {
    if (auto ids = eos_of(model_dir + name)) return *ids;
  }
  return {};
}

std::vector<int64_t> greedy_answer(const std::function<at::Tensor(const at::Tensor&)>& forward,
                                   CausalLMImpl& net, const std::vector<int64_t>& prompt,
                                   const GreedyOptions& options, Communicator* comm) {
  const int64_t room = net.config.max_position_embeddings - static_cast<int64_t>(prompt.size());
  TORCH_CHECK(!prompt.empty() && room > 0, "greedy_answer: expected a prompt of 1 to ",
              net.config.max_position_embeddings - 1, " tokens (max_position_embeddings ",
              net.config.max_position_embeddings, "), got ", prompt.size());
  const int64_t limit = std::min(options.max_new_tokens, room);
  torch::NoGradGuard no_grad;
  const bool training = net.is_training();
  net.eval();
  KVCache cache;
  std::vector<int64_t> answer;
  {
    KVCacheScope scope(net, cache);
    at::Tensor ids = at::tensor(prompt, at::kLong).to(options.device).view({1, -1});
    while (static_cast<int64_t>(answer.size()) < limit) {
      at::Tensor next = forward(ids).select(1, -1).argmax(-1);  // [1] int64
      if (comm != nullptr) comm->broadcast(next, 0);
      answer.push_back(next.item<int64_t>());
      if (std::find(options.eos.begin(), options.eos.end(), answer.back()) != options.eos.end())
        break;
      ids = next.view({1, 1});
    }
  }
  net.train(training);
  return answer;
}

void write_samples(const std::string& path, const std::vector<SamplePrompt>& prompts,
                   const std::vector<std::vector<int64_t>>& before,
                   const std::vector<std::vector<int64_t>>& after) {
  std::ostringstream lines;
  for (size_t i = 0; i < prompts.size(); ++i) {
    nlohmann::json line = {{"prompt", prompts[i].prompt}, {"reference", prompts[i].reference}};
    if (i < before.size()) line["before"] = before[i];
    if (i < after.size()) line["after"] = after[i];
    lines << line.dump() << '\n';
  }
  write_file_atomically(path, lines.str());
}

}  // namespace fsdp::models
