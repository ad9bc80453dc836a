// The Llama-family decoder (models/decoder.h) on a CUDA device: with packed rows and with
// sliding windows, attention runs with a mask, and grouped key/value heads are repeated
// per query head before scaled_dot_product_attention (Note [Grouped heads with a mask] in
// models/attention.cc); the logits and gradients equal the CPU's, which runs the grouped
// heads as they are. And the premise of that note on this device: PyTorch 2.11 runs
// grouped heads with a mask in its math kernel only, and the repeated heads in a fused
// one. Every case skips without a CUDA device, naming why.
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <gtest/gtest.h>

#include "fsdp/comm/testing/gpu_testing.h"
#include "models/config.h"
#include "models/decoder.h"

namespace fsdp::models {
namespace {

const c10::Device kCpu(c10::kCPU), kCuda("cuda:0");

// Four query heads over two key/value heads; "gemma3_text" adds sliding layers (window 3).
DecoderConfig tiny(const std::string& model_type) {
  return parse_decoder_config(
      R"({"model_type": ")" + model_type + R"(", "hidden_size": 32, "intermediate_size": 64,
        "max_position_embeddings": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-06, "vocab_size": 64,
        "sliding_window": 3, "query_pre_attn_scalar": 8, "sliding_window_pattern": 2,
        "rope_theta": 10000.0, "rope_local_base_freq": 1000.0})",
      "tiny.json");
}

struct Pass {
  at::Tensor logits;              // on the CPU
  std::vector<at::Tensor> grads;  // every parameter's, on the CPU, in parameters() order
};

// Forward (rows [5 | 3 | pad] and [8 | pad] packed when `packed`), the mean of the squared
// logits, and backward, with `net` and its inputs on `device`.
Pass run(CausalLMImpl& net, c10::Device device, bool packed) {
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
  Pass pass{logits.detach().to(kCpu), {}};
  for (const at::Tensor& p : net.parameters()) {
    EXPECT_TRUE(p.grad().defined());
    pass.grads.push_back(p.grad().defined() ? p.grad().to(kCpu) : at::Tensor());
  }
  return pass;
}

// fp32 on both devices: the CPU's flash kernel and CUDA's memory-efficient one differ in
// summation order only (1e-4 of the largest value is far above their rounding; a query
// head served by the wrong key head is off by whole units).
TEST(DecoderCudaTest, MaskedAttentionWithGroupedHeadsEqualsTheCpu) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const auto& [model_type, packed] : std::vector<std::pair<std::string, bool>>{
           {"llama", true}, {"llama", false}, {"gemma3_text", false}}) {
    SCOPED_TRACE(model_type + (packed ? " packed" : ""));
    at::manual_seed(0);
    CausalLMImpl net(tiny(model_type));
    const Pass cpu = run(net, kCpu, packed), cuda = run(net, kCuda, packed);
    EXPECT_TRUE(at::allclose(cuda.logits, cpu.logits, 1e-4, 1e-5))
        << (cuda.logits - cpu.logits).abs().max().item<float>();
    ASSERT_EQ(cuda.grads.size(), cpu.grads.size());
    for (size_t i = 0; i < cpu.grads.size(); ++i) {
      const double scale = cpu.grads[i].abs().max().item<double>();
      EXPECT_TRUE(at::allclose(cuda.grads[i], cpu.grads[i], 1e-3, 1e-4 * scale))
          << "parameter " << i << ": " << (cuda.grads[i] - cpu.grads[i]).abs().max().item<float>();
    }
  }
}

// scaled_dot_product_attention's choice (SDPBackend: 0 math, 1 flash, 2 memory-efficient,
// 3 cuDNN) for Qwen3-8B's attention at 4096 tokens in bf16: grouped heads with a mask go
// to the math kernel (fp32 scores of 2 GiB), repeated heads with the mask and grouped
// heads without one to a fused kernel.
TEST(DecoderCudaTest, GroupedHeadsWithAMaskWouldTakeTheMathKernel) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(kCuda);
  const at::Tensor q = at::randn({1, 32, 4096, 128}, options).requires_grad_(),
                   k = at::randn({1, 8, 4096, 128}, options).requires_grad_(),
                   v = at::randn({1, 8, 4096, 128}, options).requires_grad_();
  const at::Tensor mask = at::ones({1, 1, 4096, 4096}, options.dtype(at::kBool)).tril();
  constexpr int64_t kMath = 0;
  EXPECT_EQ(at::_fused_sdp_choice(q, k, v, mask, 0.0, false, std::nullopt, true), kMath)
      << "PyTorch now runs grouped heads with a mask in a fused kernel: models/attention.cc "
         "need not repeat them (Note [Grouped heads with a mask])";
  const at::Tensor k4 = k.repeat_interleave(4, 1), v4 = v.repeat_interleave(4, 1);
  EXPECT_NE(at::_fused_sdp_choice(q, k4, v4, mask, 0.0, false, std::nullopt, false), kMath);
  EXPECT_NE(at::_fused_sdp_choice(q, k, v, std::nullopt, 0.0, true, std::nullopt, true), kMath);
}

}  // namespace
}  // namespace fsdp::models
