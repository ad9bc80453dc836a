// Greedy answers to prompts, to see what a fine-tune changed (examples/llama/finetune's
// --sample_prompts): the prompts come from a conversation file (prepare_chat.py's), each
// example's tokens before its first counted token, with the rest as the reference answer;
// the model answers each greedily through a KV cache (models::KVCacheScope: the prompt
// once, then one token a forward), until an end-of-sequence token or a length limit.
// PyTorch/transformers: model.generate(input_ids, do_sample=False, max_new_tokens=N).
//
//   const std::vector<fsdp::models::SamplePrompt> prompts =
//       fsdp::models::sample_prompts(fsdp::models::read_chat_file(path, vocab));
//   std::vector<int64_t> answer = fsdp::models::greedy_answer(
//       [&](const at::Tensor& ids) { return model->forward(ids); }, *model->module(),
//       prompts[0].prompt, {128, fsdp::models::eos_token_ids(folder), device}, &comm);
//
// Threading: one call at a time per model.
#ifndef FSDP_EXAMPLES_LLAMA_SAMPLING_H_
#define FSDP_EXAMPLES_LLAMA_SAMPLING_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "examples/llama/chat_data.h"
#include "fsdp/comm/communicator.h"
#include "models/decoder.h"

namespace fsdp::models {

struct SamplePrompt {
  std::vector<int64_t> prompt;     // the example's tokens before its first counted one
  std::vector<int64_t> reference;  // the rest of the example: the answer it was written with
};

// Every example of `examples` as a prompt and its reference answer, in file order.
std::vector<SamplePrompt> sample_prompts(const ChatExamples& examples);

// The token ids that end an answer: eos_token_id (an id or a list of ids) of the folder's
// generation_config.json, else of its config.json, as transformers' generate() takes them;
// empty when neither names one (answers then end at their length limit). Throws c10::Error
// naming the file when it is not JSON or eos_token_id is neither an id nor a list of them.
std::vector<int64_t> eos_token_ids(const std::string& model_dir);

struct GreedyOptions {
  int64_t max_new_tokens = 128;    // an answer's tokens at most (and the model's positions)
  std::vector<int64_t> eos;        // eos_token_ids(): an answer ends with one of them
  c10::Device device = c10::kCPU;  // the model's: where the ids go
};

// The greedy answer to `prompt` (token ids, not empty): each next token the argmax of the
// last logits (the first of equal ones), the end-of-sequence token included when reached.
// `forward` runs `net` (directly, or through the FSDP root that holds it: ids [1, time] on
// the model's device -> logits [1, time, vocab]); `net` is the decoder that forward runs,
// whose KV cache scope this opens. Runs without grad, in eval mode, restoring the
// training mode after. With `comm`, rank 0's token is broadcast each step, so every rank
// runs the same forwards (FSDP's all-gathers) whatever its arithmetic; every rank calls it
// with the same prompt. Throws c10::Error if the prompt is empty or leaves no position
// below max_position_embeddings.
std::vector<int64_t> greedy_answer(const std::function<at::Tensor(const at::Tensor&)>& forward,
                                   CausalLMImpl& net, const std::vector<int64_t>& prompt,
                                   const GreedyOptions& options, Communicator* comm = nullptr);

// Writes `path` (JSON Lines, atomically): one line per prompt,
//   {"prompt": [ids], "reference": [ids], "before": [ids], "after": [ids]}
// "before" / "after": the answers before and after training, one per prompt, or none yet
// (an empty vector: the key is left out). Throws c10::Error if it cannot be written.
void write_samples(const std::string& path, const std::vector<SamplePrompt>& prompts,
                   const std::vector<std::vector<int64_t>>& before,
                   const std::vector<std::vector<int64_t>>& after);

}  // namespace fsdp::models

#endif  // FSDP_EXAMPLES_LLAMA_SAMPLING_H_
