// The C++ half of peft_interop_test.sh: a small model with LoRA on q_proj and v_proj,
// trained with FSDP (W = 2, ranks as threads, every unit mixing frozen base weights and
// trainable adapters), saved as PEFT saves it.
//
//   peft_interop DIR   writes DIR/adapter/ (save_adapter), DIR/base.pt (the base
//                      weights, torch.save format), DIR/merged.pt (merged_state_dict),
//                      DIR/merged/ (save_merged, sharded safetensors) and DIR/io.pt
//                      (tokens, logits of the adapted model in eval mode)
//
// peft_interop.py builds the same model in PyTorch, loads base.pt, then the adapter with
// peft.PeftModel.from_pretrained, and compares logits and merged weights.
#include <iostream>
#include <memory>
#include <mutex>
#include <string>

#include <ATen/Functions.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/adamw.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/lora/adapter_file.h"
#include "fsdp/lora/lora.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/state_dict.h"

namespace fsdp {
namespace {

constexpr int64_t kVocab = 13;
constexpr int64_t kWidth = 12;

// Keep in step with peft_interop.py.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    q_proj = register_module("q_proj", lora::LoraLinear(kWidth, kWidth));
    v_proj = register_module("v_proj", lora::LoraLinear(lora::LoraLinearImpl(
                                           torch::nn::LinearOptions(kWidth, kWidth).bias(false))));
    o_proj = register_module("o_proj", lora::LoraLinear(kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& x) { return x + o_proj(at::tanh(q_proj(x)) * v_proj(x)); }
  lora::LoraLinear q_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};

struct NetImpl : torch::nn::Module {
  NetImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kWidth));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) layers->push_back(Unit<BlockImpl>(std::make_shared<BlockImpl>()));
    head = register_module("head", lora::LoraLinear(kWidth, kVocab));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = embed(tokens);
    for (const auto& layer : *layers) x = layer->as<UnitImpl<BlockImpl>>()->forward(x);
    return head(x);
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList layers{nullptr};
  lora::LoraLinear head{nullptr};
};

lora::LoraConfig config() {
  lora::LoraConfig config;
  // A plain torch.nn.Module in Python, not a transformers model: no task type.
  config.r(4).lora_alpha(8).lora_dropout(0.05).target_modules({"q_proj", "v_proj"}).task_type("");
  return config;
}

at::Tensor tokens() { return (at::arange(2 * 6, at::kLong).view({2, 6}) * 5 + 3) % kVocab; }

int write(const std::string& dir) {
  std::mutex seed;
  FakeWorld::run(FakeWorld::create(2), [&](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    std::shared_ptr<NetImpl> net;
    {
      std::lock_guard<std::mutex> lock(seed);
      at::manual_seed(0);  // the same weights on both ranks
      net = std::make_shared<NetImpl>();
      lora::apply_lora(*net, config());
    }
    FullyShardedDataParallel<NetImpl> model(net, FullyShardedDataParallelOptions(self));
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(2e-2));
    for (int step = 0; step < 5; ++step) {
      adamw.zero_grad();
      const at::Tensor x = tokens().narrow(0, comm.rank(), 1);
      torch::nn::functional::cross_entropy(model->forward(x).reshape({-1, kVocab}),
                                           x.roll(1, 1).reshape({-1}))
          .backward();
      adamw.step();
    }
    const StateDict full = full_state_dict(*model, FullStateDictOptions().rank0_only(true));
    model->eval();
    torch::NoGradGuard no_grad;
    const at::Tensor logits = model->forward(tokens());
    if (comm.rank() != 0) return;
    lora::save_adapter(full, config(), dir + "/adapter");
    StateDict base;
    for (const auto& item : full) {
      if (!lora::is_adapter_key(item.key())) base.insert(item.key(), item.value());
    }
    save_state_dict(base, dir + "/base.pt");
    save_state_dict(lora::merged_state_dict(full, config()), dir + "/merged.pt");
    // Small shards: a folder of several files with the index.
    lora::save_merged(full, config(), dir + "/merged", /*max_shard_size=*/1500);
    StateDict io;
    io.insert("tokens", tokens());
    io.insert("logits", logits);
    save_state_dict(io, dir + "/io.pt");
  });
  return 0;
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: peft_interop DIR\n";
    return 2;
  }
  return fsdp::write(argv[1]);
}
