// The decoder built on the meta device (decoder.h): no memory until FSDP allocates each
// rank's shards, and init_parameters with reset_decoder_parameters gives the values a CPU
// build from the same seed has (tied and untied heads), with no buffer left uncomputed. And
// packed rows, the KV cache, sublayer units, and on a CUDA device masked attention over
// grouped key/value heads against the CPU.
#include "models/decoder.h"

#include <cmath>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/SDPBackend.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/equal.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp/comm/fake.h"
#include "fsdp/comm/testing/gpu_testing.h"
#include "fsdp/core/memory_plan.h"
#include "fsdp/core/tracking_allocator.h"
#include "fsdp/state/state_dict.h"
#include "models/attention.h"
#include "models/memory_plan.h"

namespace fsdp::models {
namespace {

constexpr int kWorld = 2;

// A small Llama (transformers 5's config.json): 4 layers, hidden 32, 4 heads, 2 key/value
// heads, intermediate 64, vocab 64.
DecoderConfig tiny_llama(bool tied) {
  return parse_decoder_config(
      std::string(R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "max_position_embeddings": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "vocab_size": 64,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": )") +
          (tied ? "true" : "false") + "}",
      "tiny.json");
}

// A small Qwen2-MoE: 4 experts of width 16, top-2, a shared expert, layer 1 dense.
DecoderConfig tiny_qwen2_moe() {
  return parse_decoder_config(
      R"({"model_type": "qwen2_moe", "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
        "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1],
        "max_position_embeddings": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "vocab_size": 64})",
      "tiny.json");
}

// A small gpt-oss: sinks, q/k/v/o biases, sliding (window 3) and full layers, YaRN, 4
// experts of width 16 with biases, top-2.
DecoderConfig tiny_gpt_oss() {
  return parse_decoder_config(
      R"({"model_type": "gpt_oss", "hidden_size": 32, "intermediate_size": 16, "head_dim": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 3,
        "max_position_embeddings": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
        "num_key_value_heads": 2, "vocab_size": 64,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 16, "truncate": false}})",
      "tiny.json");
}

// A small DeepSeek-V3: latent attention (q_lora_rank 8, kv_lora_rank 8, 4 heads of 8 + 8
// rotated, interleaved, values of 6), YaRN; a dense layer, then 8 experts in 4 groups, top-2,
// a shared expert.
DecoderConfig tiny_deepseek_v3() {
  return parse_decoder_config(
      R"({"model_type": "deepseek_v3", "hidden_size": 32, "intermediate_size": 48,
        "max_position_embeddings": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 3, "vocab_size": 64, "q_lora_rank": 8, "kv_lora_rank": 8,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 6,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "moe_intermediate_size": 16, "first_k_dense_replace": 1,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}})",
      "tiny.json");
}

// Sinks and DeepSeek-V3's router biases drawn (they are built zero) and large enough to
// count.
void draw_sinks(CausalLMImpl& net) {
  torch::NoGradGuard no_grad;
  for (const auto& item : net.named_parameters()) {
    if (item.key().find("sinks") != std::string::npos) item.value().normal_(0, 2);
  }
  for (const auto& item : net.named_buffers()) {
    if (item.key().find("e_score_correction_bias") != std::string::npos) {
      item.value().uniform_(-0.3, 0.3);
    }
  }
}

// Ranks are threads: one seeds and draws from the default generator at a time.
std::mutex& draw_mutex() {
  static std::mutex mutex;
  return mutex;
}

at::Tensor tokens() { return (at::arange(18, at::kLong).view({2, 9}) * 7) % 64; }

TEST(DecoderTest, MetaBuildInitialisedEqualsACpuBuildFromTheSameSeed) {
  // The experts too (ExpertsImpl's reset_parameters, in the constructors' order).
  for (const auto& [label, config] :
       {std::pair("own head", tiny_llama(false)), std::pair("tied head", tiny_llama(true)),
        std::pair("qwen2_moe", tiny_qwen2_moe()), std::pair("gpt_oss", tiny_gpt_oss()),
        std::pair("deepseek_v3", tiny_deepseek_v3())}) {
    SCOPED_TRACE(label);
    const bool tied = config.tie_word_embeddings;
    std::shared_ptr<CausalLMImpl> cpu;
    {
      std::lock_guard<std::mutex> lock(draw_mutex());
      at::manual_seed(3);
      cpu = std::make_shared<CausalLMImpl>(config);
    }
    // RoPE and embedding scales come from the config; DeepSeek-V3's router biases, zeros as
    // built, from the checkpoint.
    EXPECT_EQ(cpu->buffers().size(), config.router_sigmoid_groups ? 2u : 0u);
    const StateDict want = module_state_dict(*cpu);
    EXPECT_EQ(want.contains("lm_head.weight"), !tied);
    // Untied, the embeddings and the head are units of their own, as the layers are.
    EXPECT_EQ(static_cast<bool>(cpu->head_unit), !tied);
    EXPECT_EQ(static_cast<bool>(cpu->model->embed_unit), !tied);
    const at::Tensor want_logits = cpu->forward(tokens());
    MemoryTracker tracker;
    FakeWorld::run(FakeWorld::create(kWorld), [&](Communicator& comm) {
      MemoryTagGuard tag(comm.rank());
      auto net = std::make_shared<CausalLMImpl>(config, at::TensorOptions().device(c10::kMeta));
      for (const at::Tensor& p : net->parameters()) ASSERT_TRUE(p.is_meta());
      EXPECT_EQ(memory_allocated(comm.rank()), 0);  // shapes only
      FullyShardedDataParallel<CausalLMImpl> model(
          net, FullyShardedDataParallelOptions(
                   std::shared_ptr<Communicator>(&comm, [](Communicator*) {})));
      {
        std::lock_guard<std::mutex> lock(draw_mutex());
        at::manual_seed(3);
        model->init_parameters(reset_decoder_parameters);  // throws if one stays NaN
      }
      const StateDict got = full_state_dict(*model);
      ASSERT_EQ(got.keys(), want.keys());
      for (const auto& item : want) EXPECT_TRUE(at::equal(got[item.key()], item.value()));
      EXPECT_TRUE(at::equal(model->forward(tokens()), want_logits));
    });
  }
}

// Sizes that make a tensor past what a process can address are named as the config's.
TEST(DecoderTest, SizesPastAnAddressAreTheConfigs) {
  DecoderConfig config = tiny_llama(false);
  config.vocab_size = int64_t{1} << 62;
  try {
    CausalLMImpl net(config, at::TensorOptions().device(c10::kMeta));
    FAIL() << "a [2^62, 32] embedding was built";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_EQ(message.rfind("CausalLM: cannot build the llama model its config describes "
                            "(vocab_size 4611686018427387904, hidden_size 32, intermediate_size "
                            "64, num_hidden_layers 4, num_attention_heads 4, head_dim 8): ",
                            0),
              0u)
        << message;
    EXPECT_NE(message.find("overflow"), std::string::npos) << message;
    EXPECT_EQ(message.substr(message.size() - 36), "; check the sizes in its config.json");
  }
}

}  // namespace
}  // namespace fsdp::models

namespace fsdp::models {
namespace {

// Gemma 2 (soft-capped attention, sliding layers of window 3) and Gemma 3 text (sliding
// layers with their own RoPE), small.
DecoderConfig tiny_gemma(const std::string& model_type) {
  return parse_decoder_config(
      R"({"model_type": ")" + model_type + R"(", "hidden_size": 32, "intermediate_size": 64,
        "max_position_embeddings": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-06, "vocab_size": 64,
        "sliding_window": 3, "query_pre_attn_scalar": 8, "sliding_window_pattern": 2,
        "rope_theta": 10000.0, "rope_local_base_freq": 1000.0})",
      "tiny.json");
}

// Rows [5 | 3 | pad] and [8 | pad] of the examples a (5 tokens), b (3), c (8): every example's
// logits equal those it has run alone (within fp32 rounding: logits reach 30, so 1e-4
// absolute), padding aside.
TEST(PackedRowsTest, EachExampleAttendsOnlyToItself) {
  for (const DecoderConfig& config :
       {tiny_llama(false), tiny_gemma("gemma2"), tiny_gemma("gemma3_text"), tiny_gpt_oss(),
        tiny_deepseek_v3()}) {
    SCOPED_TRACE(config.model_type);
    at::manual_seed(3);
    CausalLMImpl net(config);
    draw_sinks(net);
    const at::Tensor a = at::arange(5, at::kLong) * 3 + 1, b = at::arange(3, at::kLong) * 5 + 2;
    const at::Tensor c = at::arange(8, at::kLong) * 7 % 64;
    const at::Tensor pad = at::zeros({1}, at::kLong);
    const auto range = [](int64_t n) { return at::arange(n, at::kLong); };
    const at::Tensor ids = at::stack({at::cat({a, b, pad}), at::cat({c, pad})});
    const at::Tensor positions =
        at::stack({at::cat({range(5), range(3), pad}), at::cat({range(8), pad})});
    const at::Tensor segments =
        at::tensor({0, 0, 0, 0, 0, 1, 1, 1, -1, 0, 0, 0, 0, 0, 0, 0, 0, -1}, at::kLong)
            .view({2, 9});
    at::Tensor packed;
    {
      PackedRowsScope scope(net, positions, segments);
      packed = net.forward(ids);
    }
    EXPECT_FALSE(net.packed.positions.defined()) << "the scope cleared the packing";
    const auto alone = [&](const at::Tensor& x) { return net.forward(x.view({1, -1}))[0]; };
    EXPECT_TRUE(at::allclose(packed[0].narrow(0, 0, 5), alone(a), 1e-5, 1e-4));
    EXPECT_TRUE(at::allclose(packed[0].narrow(0, 5, 3), alone(b), 1e-5, 1e-4));
    EXPECT_TRUE(at::allclose(packed[1].narrow(0, 0, 8), alone(c), 1e-5, 1e-4));
    // Unpacked, b would see a: not its logits.
    EXPECT_FALSE(at::allclose(net.forward(at::cat({a, b}).view({1, 8}))[0].narrow(0, 5, 3),
                              alone(b), 1e-5, 1e-4));
  }
}

// Generation with a KV cache: a prompt of 5 tokens, then 2, then one at a time, each
// forward's logits those of the whole 12-token sequence at its positions (Gemma: past the
// sliding window of 3; Gemma 2: soft-capped; Gemma 3: RoPE per layer type; gpt-oss:
// sinks; DeepSeek-V3: latent attention, its keys and values expanded per head).
TEST(KVCacheTest, EachForwardEqualsTheWholeSequence) {
  torch::NoGradGuard no_grad;
  for (const DecoderConfig& config :
       {tiny_llama(false), tiny_gemma("gemma2"), tiny_gemma("gemma3_text"), tiny_gpt_oss(),
        tiny_deepseek_v3()}) {
    SCOPED_TRACE(config.model_type);
    at::manual_seed(3);
    CausalLMImpl net(config);
    draw_sinks(net);
    const at::Tensor ids = (at::arange(12, at::kLong) * 7 % 64).view({1, 12});
    const at::Tensor whole = net.forward(ids);
    KVCache cache;
    {
      KVCacheScope scope(net, cache);
      int64_t first = 0;
      for (int64_t n : {5, 2, 1, 1, 1, 1, 1}) {
        const at::Tensor logits = net.forward(ids.narrow(1, first, n));
        EXPECT_TRUE(at::allclose(logits, whole.narrow(1, first, n), 1e-5, 1e-5))
            << "tokens " << first << " ... " << first + n - 1;
        first += n;
      }
    }
    EXPECT_EQ(cache.length, 12);
    ASSERT_EQ(cache.layers.size(), size_t(config.num_hidden_layers));
    // Latent attention caches its keys expanded: qk_head_dim() per head.
    const int64_t key_width = config.latent_attention() ? config.qk_head_dim() : config.head_dim;
    EXPECT_EQ(cache.layers[1].keys.sizes(),
              (std::vector<int64_t>{1, config.num_key_value_heads, 12, key_width}));
    EXPECT_EQ(net.model->cache, nullptr) << "the scope cleared the cache";
    // The next token without the cache: it would start again at position 0.
    EXPECT_FALSE(
        at::allclose(net.forward(ids.narrow(1, 11, 1)), whole.narrow(1, 11, 1), 1e-5, 1e-5));
  }
}

TEST(KVCacheTest, MisuseIsRefused) {
  CausalLMImpl net(tiny_llama(false));
  KVCache cache;
  KVCacheScope scope(net, cache);
  const at::Tensor ids = at::zeros({1, 2}, at::kLong);
  EXPECT_THROW(
      {
        try {
          net.forward(ids);  // grad mode on
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("runs without grad (torch::NoGradGuard)"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
  KVCache other;
  EXPECT_THROW(KVCacheScope(net, other), c10::Error);
  EXPECT_THROW(PackedRowsScope(net, ids, ids), c10::Error);
  torch::NoGradGuard no_grad;
  const int64_t longest = net.config.max_position_embeddings;
  EXPECT_THROW(net.forward(at::zeros({1, longest + 1}, at::kLong)), c10::Error);
}

}  // namespace
}  // namespace fsdp::models

namespace fsdp::models {
namespace {

// What three AdamW steps of a decoder under FSDP gave rank 0: each step's loss, the last
// step's collectives and its peak tracked memory (FullyShardedRoot::check_plan's
// measurement: model state and what the step allocated), and the plan of that step
// (plan_finetune, the fake backend).
struct UnitsRun {
  std::vector<at::Tensor> losses;
  int64_t all_gathers = 0, reduce_scatters = 0;
  int64_t measured_peak = 0;
  FinetunePlan plan;
};

// Full fine-tuning of `config` (a CPU build from seed 5, every rank the same) with `units`
// on `world` ranks as threads: each rank a batch of its own (2 rows of 8 tokens), loss
// cross-entropy + 0.01 x the load-balancing loss, no gradient clipping (a collective).
UnitsRun train_units(const DecoderConfig& config, DecoderUnits units, int world,
                     bool checkpointed) {
  UnitsRun run;
  MemoryTracker tracker;
  FakeWorld::run(FakeWorld::create(world), [&](Communicator& comm) {
    MemoryTagGuard tag(comm.rank());
    std::shared_ptr<CausalLMImpl> net;
    {
      std::lock_guard<std::mutex> lock(draw_mutex());
      at::manual_seed(5);
      net = std::make_shared<CausalLMImpl>(config, at::TensorOptions(), units);
    }
    for (DecoderLayer& layer : net->model->decoder_layers) {
      layer->checkpoint_activations = checkpointed;
    }
    FinetunePlanOptions planned;
    planned.world_size(world)
        .micro_batch(2)
        .context(8)
        .activation_checkpointing(checkpointed)
        .router_aux_loss(true)
        .backend(PlanBackend::kFake)
        .decoder_units(units);
    const FinetunePlan plan = plan_finetune(config, plan_units(*net), planned);
    FullyShardedDataParallel<CausalLMImpl> model(
        net,
        FullyShardedDataParallelOptions(std::shared_ptr<Communicator>(&comm, [](Communicator*) {
        })).plan_check(true));
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      const at::Tensor ids =
          (at::arange(18, at::kLong).view({2, 9}) * (7 + 2 * comm.rank() + step) + step) %
          config.vocab_size;
      adamw.zero_grad();
      comm.counters().reset();
      const at::Tensor logits = model->forward(ids.narrow(1, 0, 8));
      const at::Tensor loss = torch::nn::functional::cross_entropy(
                                  logits.reshape({16, -1}), ids.narrow(1, 1, 8).reshape({16})) +
                              0.01 * net->aux_loss();
      loss.backward();
      adamw.step();
      const PlanCheckResult check = model->check_plan(adamw);
      if (comm.rank() != 0) continue;
      run.losses.push_back(loss.detach());
      run.all_gathers = comm.counters().get(CollectiveKind::kAllGather).calls;
      run.reduce_scatters = comm.counters().get(CollectiveKind::kReduceScatter).calls;
      run.measured_peak = check.row("peak").measured;
      run.plan = plan;
    }
  });
  return run;
}

// Note [Sublayer units] (DecoderUnits::kSublayer): the same losses as layer units, bit for
// bit (the same arithmetic: each gradient element is reduced alone, whatever unit holds
// it), with and without checkpointing, the routers' load-balancing loss on; per step the
// collectives REFERENCE §4 counts for n units (n all-gathers in forward, n - 1 in
// backward, n reduce-scatters), the plan's.
TEST(SublayerUnitsTest, SameLossesAsLayerUnitsWithTwoCollectivesPerSublayer) {
  const DecoderConfig config = tiny_qwen2_moe();  // 3 layers, layer 1 dense
  for (const int world : {2, 3}) {
    for (const bool checkpointed : {false, true}) {
      SCOPED_TRACE(testing::Message() << "W = " << world << ", checkpointed " << checkpointed);
      const UnitsRun layer = train_units(config, DecoderUnits::kLayer, world, checkpointed);
      const UnitsRun split = train_units(config, DecoderUnits::kSublayer, world, checkpointed);
      ASSERT_EQ(split.losses.size(), 3u);
      for (size_t step = 0; step < 3; ++step) {
        EXPECT_TRUE(at::equal(split.losses[step], layer.losses[step]))
            << "step " << step << ": " << split.losses[step].item<double>() << " vs "
            << layer.losses[step].item<double>();
      }
      // Layer units: the root, the embeddings, 3 layers, the head (n = 6); sublayer units:
      // 3 x 2 sublayers instead (n = 9).
      EXPECT_EQ(layer.all_gathers, 6 + 5);
      EXPECT_EQ(layer.reduce_scatters, 6);
      EXPECT_EQ(split.all_gathers, 9 + 8);
      EXPECT_EQ(split.reduce_scatters, 9);
      for (const UnitsRun* run : {&layer, &split}) {
        EXPECT_EQ(run->plan.step.traffic_of(CollectiveKind::kAllGather).calls, run->all_gathers);
        EXPECT_EQ(run->plan.step.traffic_of(CollectiveKind::kReduceScatter).calls,
                  run->reduce_scatters);
      }
    }
  }
}

// A Qwen3-MoE whose experts are nearly all of it: 4 sparse layers of 16 experts of width 64
// over hidden 32 (98304 elements a layer, 384 KiB in fp32), vocab 64.
DecoderConfig experts_heavy_moe() {
  return parse_decoder_config(
      R"({"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 64, "num_experts": 16, "num_experts_per_tok": 2,
        "norm_topk_prob": true, "head_dim": 8, "max_position_embeddings": 64,
        "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "vocab_size": 64})",
      "tiny.json");
}

// Where experts dominate, sublayer units lower the step's measured peak (one layer's
// experts gathered at a time in backward instead of two), and each plan is within 15% of
// what the rank measured.
TEST(SublayerUnitsTest, LowerPeakWhereExpertsDominate) {
  const DecoderConfig config = experts_heavy_moe();
  const UnitsRun layer = train_units(config, DecoderUnits::kLayer, 2, false);
  const UnitsRun split = train_units(config, DecoderUnits::kSublayer, 2, false);
  for (const UnitsRun* run : {&layer, &split}) {
    const double ratio = double(run->measured_peak) / double(run->plan.step.peak_bytes);
    EXPECT_GT(ratio, 0.85) << run->measured_peak << " measured, " << run->plan.step.peak_bytes
                           << " planned";
    EXPECT_LT(ratio, 1.15) << run->measured_peak << " measured, " << run->plan.step.peak_bytes
                           << " planned";
  }
  std::cout << "peak of a rank (W = 2): layer units " << layer.measured_peak << " B measured, "
            << layer.plan.step.peak_bytes << " B planned; sublayer units " << split.measured_peak
            << " B measured, " << split.plan.step.peak_bytes << " B planned\n";
  EXPECT_LT(split.measured_peak, layer.measured_peak);
  EXPECT_LT(split.plan.step.peak_bytes, layer.plan.step.peak_bytes);
}

// On a CUDA device (skipped without one, naming why): where PyTorch would run grouped
// key/value heads in its math kernel, attention repeats them per query head first (Note
// [Grouped heads with a mask] in models/attention.cc). In fp32, with packed rows, causal
// and with sliding windows, the logits and gradients equal the CPU's, which runs the
// grouped heads as they are; and at real shapes attention never runs the math kernel.
const c10::Device kCpu(c10::kCPU), kCuda("cuda:0");

struct CudaPass {
  at::Tensor logits;              // on the CPU
  std::vector<at::Tensor> grads;  // every parameter's, on the CPU, in parameters() order
};

// Forward (rows [5 | 3 | pad] and [8 | pad] packed when `packed`), the mean of the squared
// logits, and backward, with `net` and its inputs on `device`.
CudaPass run_on(CausalLMImpl& net, c10::Device device, bool packed) {
  net.zero_grad(/*set_to_none=*/true);  // no gradient left on the other device
  net.to(device);
  const at::Tensor ids = (at::arange(18, at::kLong) * 7 % 64).view({2, 9}).to(device);
  const at::Tensor positions =
      at::tensor({0, 1, 2, 3, 4, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 6, 7, 0}, at::kLong)
          .view({2, 9})
          .to(device);
  const at::Tensor segments =
      at::tensor({0, 0, 0, 0, 0, 1, 1, 1, -1, 0, 0, 0, 0, 0, 0, 0, 0, -1}, at::kLong)
          .view({2, 9})
          .to(device);
  at::Tensor logits;
  if (packed) {
    PackedRowsScope scope(net, positions, segments);
    logits = net.forward(ids);
  } else {
    logits = net.forward(ids);
  }
  EXPECT_EQ(logits.device(), device);
  logits.square().mean().backward();
  CudaPass pass{logits.detach().to(kCpu), {}};
  for (const at::Tensor& p : net.parameters()) {
    EXPECT_TRUE(p.grad().defined());
    pass.grads.push_back(p.grad().defined() ? p.grad().to(kCpu) : at::Tensor());
  }
  return pass;
}

// fp32 on both devices: the CPU's flash kernel and CUDA's memory-efficient one differ in
// summation order only (1e-4 of the largest value is far above their rounding; a query
// head served by the wrong key head is off by whole units). In fp32 grouped heads would
// take CUDA's math kernel, so every case here runs the repeated heads.
TEST(DecoderCudaTest, MaskedAttentionWithGroupedHeadsEqualsTheCpu) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const auto& [config, packed] :
       std::vector<std::pair<DecoderConfig, bool>>{{tiny_llama(false), true},
                                                   {tiny_llama(false), false},
                                                   {tiny_gemma("gemma3_text"), false}}) {
    SCOPED_TRACE(config.model_type + (packed ? " packed" : ""));
    at::manual_seed(0);
    CausalLMImpl net(config);
    const CudaPass cpu = run_on(net, kCpu, packed), cuda = run_on(net, kCuda, packed);
    const double largest = cpu.logits.abs().max().item<double>();
    EXPECT_TRUE(at::allclose(cuda.logits, cpu.logits, 1e-4, 1e-4 * largest))
        << (cuda.logits - cpu.logits).abs().max().item<float>();
    ASSERT_EQ(cuda.grads.size(), cpu.grads.size());
    for (size_t i = 0; i < cpu.grads.size(); ++i) {
      const double scale = cpu.grads[i].abs().max().item<double>();
      EXPECT_TRUE(at::allclose(cuda.grads[i], cpu.grads[i], 1e-3, 1e-4 * scale))
          << "parameter " << i << ": " << (cuda.grads[i] - cpu.grads[i]).abs().max().item<float>();
    }
  }
}

// What attention runs at Qwen3-8B's shapes (32 query heads of 128 over 8 key/value heads,
// 4096 tokens), with a bool mask and causal, in bf16 and fp32: never the math kernel.
// Where PyTorch would run the grouped heads there (fp32; a mask on GPUs whose cuDNN
// attention is not preferred), the repeated heads run in a fused kernel. Prints each
// choice (SDPBackend: 0 math, 1 flash, 2 memory-efficient, 3 cuDNN).
TEST(DecoderCudaTest, AttentionNeverRunsTheMathKernel) {
  FSDP_SKIP_WITHOUT_GPU();
  const double scale = 1.0 / std::sqrt(128.0);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const auto options = at::TensorOptions().dtype(dtype).device(kCuda);
    const at::Tensor q = at::randn({1, 32, 4096, 128}, options).requires_grad_(),
                     k = at::randn({1, 8, 4096, 128}, options).requires_grad_(),
                     v = at::randn({1, 8, 4096, 128}, options).requires_grad_();
    const at::Tensor mask = at::ones({1, 1, 4096, 4096}, options.dtype(at::kBool)).tril();
    for (const at::Tensor& m : {mask, at::Tensor()}) {
      const bool repeat = grouped_heads_take_the_math_kernel(q, k, v, m, scale);
      const at::Tensor keys = repeat ? k.repeat_interleave(4, 1) : k,
                       values = repeat ? v.repeat_interleave(4, 1) : v;
      const int64_t backend = at::_fused_sdp_choice(
          q, keys, values, m.defined() ? std::optional<at::Tensor>(m) : std::nullopt, 0.0,
          !m.defined(), scale, /*enable_gqa=*/!repeat);
      std::cout << dtype << (m.defined() ? " with a mask" : " causal")
                << (repeat ? ": heads repeated, backend " : ": grouped heads, backend ") << backend
                << "\n";
      EXPECT_NE(backend, static_cast<int64_t>(at::SDPBackend::math))
          << dtype << (m.defined() ? " with a mask" : " causal");
    }
  }
}

}  // namespace
}  // namespace fsdp::models
