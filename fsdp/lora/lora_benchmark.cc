// LoRA against full fine-tuning of the same model with FSDP (FULL_SHARD, W = 2 ranks
// over Gloo, AdamW): trainable parameters, gradient memory, bytes reduce-scattered and
// tokens per second, in one run.
//
//   bazel run -c opt //fsdp/lora:lora_benchmark   # starts its own 2 ranks
//
// The model: a decoder of 4 blocks (width 512; q, k, v, o projections 512 x 512, MLP
// 512 -> 2048 -> 512, causal attention through SDPA, 8 heads), vocabulary 4096, each block
// an FSDP unit, 14.7 M parameters. LoRA: r = 8, alpha 16 on q_proj and v_proj, every other
// parameter frozen (each unit then holds a trainable and a frozen flat parameter).
// Counters, per rank and step: trainable_params (all ranks together), grad_MB (the
// sharded .grad of every flat parameter after the step, decimal MB), flat_grad_MB (the
// largest flat gradient a reduction holds while in flight), reduce_scatter_MB (bytes
// this rank sent in reduce-scatters), all_gather_MB (sent in all-gathers), tokens_per_s
// (both ranks' tokens / step time). After the run rank 0 prints LoRA / full ratios.
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include <ATen/Functions.h>
#include <benchmark/benchmark.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/adamw.h>

#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/benchmark_ranks.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/lora/lora.h"

namespace fsdp {
namespace {

constexpr int kWorldSize = 2;
constexpr int64_t kVocab = 4096, kWidth = 512, kHeads = 8, kBlocks = 4;
constexpr int64_t kBatch = 4, kContext = 128;  // per rank
constexpr int kSteps = 5;

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    for (const char* name : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      projections.push_back(register_module(name, lora::LoraLinear(kWidth, kWidth)));
    }
    up = register_module("up_proj", lora::LoraLinear(kWidth, 4 * kWidth));
    down = register_module("down_proj", lora::LoraLinear(4 * kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto heads = [&](const at::Tensor& t) {
      return t.view({x.size(0), x.size(1), kHeads, kWidth / kHeads}).transpose(1, 2);
    };
    at::Tensor attention = at::scaled_dot_product_attention(
        heads(projections[0](x)), heads(projections[1](x)), heads(projections[2](x)),
        /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
    at::Tensor h = x + projections[3](attention.transpose(1, 2).reshape(x.sizes()));
    return h + down(at::gelu(up(h)));
  }
  std::vector<lora::LoraLinear> projections;
  lora::LoraLinear up{nullptr}, down{nullptr};
};

struct DecoderImpl : torch::nn::Module {
  DecoderImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kWidth));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) {
      layers->push_back(Unit<BlockImpl>(std::make_shared<BlockImpl>()));
    }
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = embed(tokens);
    for (const auto& layer : *layers) x = layer->as<UnitImpl<BlockImpl>>()->forward(x);
    return at::matmul(x, embed->weight.t());
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList layers{nullptr};
};

std::shared_ptr<Communicator>& comm() {
  static auto* c = new std::shared_ptr<Communicator>(
      init_from_environment(RendezvousOptions().backend(Backend::kGloo)));
  return *c;
}

std::map<std::string, std::map<std::string, double>>& results() {
  static auto* r = new std::map<std::string, std::map<std::string, double>>;
  return *r;
}

void fine_tune(benchmark::State& state, bool lora_only) {
  Communicator& c = *comm();
  at::manual_seed(0);  // the same model on both ranks
  auto net = std::make_shared<DecoderImpl>();
  if (lora_only) {
    lora::LoraConfig config;
    config.r(8).lora_alpha(16).target_modules({"q_proj", "v_proj"});
    lora::apply_lora(*net, config);
  }
  int64_t trainable = 0;
  for (const at::Tensor& p : net->parameters()) trainable += p.requires_grad() ? p.numel() : 0;
  FullyShardedDataParallel<DecoderImpl> model(net, FullyShardedDataParallelOptions(comm()));
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-4));
  at::Tensor tokens =
      (at::arange(kBatch * (kContext + 1), at::kLong).view({kBatch, kContext + 1}) * 7919 +
       c.rank()) %
      kVocab;
  const auto step = [&] {
    adamw.zero_grad();
    torch::nn::functional::cross_entropy(
        model->forward(tokens.narrow(1, 0, kContext)).reshape({-1, kVocab}),
        tokens.narrow(1, 1, kContext).reshape({-1}))
        .backward();
    adamw.step();
  };
  step();  // warm-up (first-iteration checks, optimizer state)
  c.counters().reset();
  double seconds = 0;
  for (auto _ : state) {
    c.barrier();  // host ordering: each timed step starts when every rank is ready
    const auto start = std::chrono::steady_clock::now();
    step();
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(t);
    seconds += t;
  }
  int64_t grad_bytes = 0, flat_grad_bytes = 0;
  for (const auto& unit : model->units()) {
    const at::Tensor& grad = unit->handle()->sharded_flat_param().grad();
    if (grad.defined()) grad_bytes += grad.nbytes();
    if (unit->handle()->sharded_flat_param().requires_grad()) {
      flat_grad_bytes = std::max<int64_t>(flat_grad_bytes, unit->handle()->padded_numel() * 4);
    }
  }
  const double steps = static_cast<double>(state.iterations());
  std::map<std::string, double> figures = {
      {"trainable_params", double(trainable)},
      {"grad_MB", grad_bytes / 1e6},
      {"flat_grad_MB", flat_grad_bytes / 1e6},
      {"reduce_scatter_MB",
       c.counters().get(CollectiveKind::kReduceScatter).bytes_sent / steps / 1e6},
      {"all_gather_MB", c.counters().get(CollectiveKind::kAllGather).bytes_sent / steps / 1e6},
      {"tokens_per_s", kWorldSize * kBatch * kContext * steps / seconds},
  };
  for (const auto& [name, value] : figures) state.counters[name] = value;
  results()[lora_only ? "LoRA" : "Full"] = figures;
}

void BM_FullFineTune(benchmark::State& state) { fine_tune(state, /*lora_only=*/false); }
void BM_LoraFineTune(benchmark::State& state) { fine_tune(state, /*lora_only=*/true); }

// Fixed iteration counts keep the ranks' collectives matched.
BENCHMARK(BM_FullFineTune)->Iterations(kSteps)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoraFineTune)->Iterations(kSteps)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  return fsdp::comm_internal::benchmark_main(
      fsdp::kWorldSize, argc, argv, []() -> fsdp::Communicator& { return *fsdp::comm(); },
      [](int rank) {
        const auto& r = fsdp::results();
        if (rank == 0 && r.count("LoRA") && r.count("Full")) {
          std::cout << "| figure (per rank and step) | full fine-tuning | LoRA r = 8 (q, v) | LoRA "
                       "/ full |\n"
                    << "|---|---|---|---|\n";
          for (const auto& [name, full] : r.at("Full")) {
            const double lora = r.at("LoRA").at(name);
            std::cout << absl::StrFormat("| %s | %.6g | %.6g | %.4f |\n", name, full, lora,
                                         lora / full);
          }
        }
      });
}
