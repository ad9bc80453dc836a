// Fine-tunes a tiny Qwen3 (built from a config.json text with //models, random weights) on
// 2 local ranks with FSDP, each decoder layer a unit, and checks that the next-token loss
// falls: what another monorepo's trainer writes against @fsdp//models.
#include <cstdio>
#include <cstdlib>
#include <memory>

#include <ATen/Functions.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp/fsdp.h"
#include "models/config.h"
#include "models/decoder.h"

int main(int argc, char** argv) {
  if (std::getenv("RANK") == nullptr) {  // start 2 ranks of this program
    return fsdp::launch_self(2, argc, argv);
  }
  at::set_num_threads(1);
  auto comm = fsdp::init_from_environment(fsdp::RendezvousOptions().backend(fsdp::Backend::kGloo));
  const fsdp::models::DecoderConfig config = fsdp::models::parse_decoder_config(
      R"({"model_type": "qwen3", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 64, "tie_word_embeddings": true,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}})",
      "qwen3 config");
  at::manual_seed(0);  // the same initial weights on every rank
  fsdp::FullyShardedDataParallel<fsdp::models::CausalLMImpl> model(
      std::make_shared<fsdp::models::CausalLMImpl>(config),
      fsdp::FullyShardedDataParallelOptions(comm));
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(3e-3));
  // Each rank its own windows of a learnable sequence: token t + 5 (mod 32) follows t.
  const at::Tensor starts = at::arange(4, at::kLong).unsqueeze(1) * 3 + comm->rank();
  const at::Tensor ids = (starts + at::arange(17, at::kLong) * 5) % 32;
  const at::Tensor x = ids.narrow(1, 0, 16), y = ids.narrow(1, 1, 16);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    adamw.zero_grad();
    const at::Tensor logits = model->forward(x);
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, 32}), y.reshape({-1}));
    loss.backward();
    adamw.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("rank %d: qwen3 loss %.4f -> %.4f\n", comm->rank(), first, last);
  return last < first / 2 ? 0 : 1;
}
