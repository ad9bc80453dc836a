// The GPT of examples/gpt on a CUDA device (issue 29 items 1 and 7): forward and backward
// with the model moved to cuda:0, and training under FSDP over NCCL at W = 1 (device_id
// cuda:0), with the host running ahead (stream waits) and with the host waiting for every
// collective (NcclOptions::blocking_wait), against the same steps on the CPU. Every case
// skips without a CUDA device, naming why.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "examples/gpt/model.h"
#include "fsdp/comm/nccl.h"
#include "fsdp/comm/testing/gpu_testing.h"
#include "fsdp/core/fully_sharded.h"

namespace fsdp {
namespace {

using examples::GptImpl;
using examples::GptOptions;

const c10::Device kCuda("cuda:0");
constexpr int kSteps = 3;

std::shared_ptr<GptImpl> make_gpt() {
  torch::manual_seed(0);
  return std::make_shared<GptImpl>(
      GptOptions().vocab_size(11).context(16).width(32).heads(4).layers(2));
}

// Step `step`'s batch: 2 sequences of 16 tokens and their next tokens.
std::pair<at::Tensor, at::Tensor> batch(int step) {
  const at::Tensor ids = (at::arange(2 * 17, at::kLong).view({2, 17}) * 7 + step) % 11;
  return {ids.narrow(1, 0, 16), ids.narrow(1, 1, 16)};
}

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& next) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 11}), next.reshape({-1}));
}

// kSteps of SGD on `parameters` (on `device`: the plain model's, or the flat parameters
// of FSDP's root, model->parameters(); the wrapped model's own are not leaves); the losses.
std::vector<float> train(const std::vector<at::Tensor>& parameters,
                         const std::function<at::Tensor(const at::Tensor&)>& forward,
                         c10::Device device) {
  torch::optim::SGD sgd(parameters, torch::optim::SGDOptions(0.1));
  std::vector<float> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    at::Tensor loss = loss_of(forward(x.to(device)), y.to(device));
    EXPECT_EQ(loss.device(), device);
    loss.backward();
    sgd.step();
    losses.push_back(loss.item<float>());
  }
  return losses;
}

std::vector<float> cpu_losses() {
  auto gpt = make_gpt();
  return train(
      gpt->parameters(), [&](const at::Tensor& x) { return gpt->forward(x); }, c10::kCPU);
}

TEST(GptCudaTest, ForwardAndBackwardOnTheDeviceMatchTheCpu) {
  FSDP_SKIP_WITHOUT_GPU();
  auto reference = make_gpt();
  auto gpt = make_gpt();
  gpt->to(kCuda);
  auto [x, y] = batch(0);
  loss_of(reference->forward(x), y).backward();
  at::Tensor logits = gpt->forward(x.to(kCuda));
  EXPECT_EQ(logits.device(), kCuda);
  EXPECT_EQ(logits.sizes(), at::IntArrayRef({2, 16, 11}));
  loss_of(logits, y.to(kCuda)).backward();
  const auto want = reference->named_parameters();
  for (const auto& item : gpt->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_EQ(item.value().grad().device(), kCuda) << item.key();
    EXPECT_TRUE(at::allclose(item.value().grad().cpu(), want[item.key()].grad(), /*rtol=*/1e-4,
                             /*atol=*/1e-5))
        << item.key();
  }
}

TEST(GptCudaTest, FsdpOverNcclTrainsLikeTheCpuWithAndWithoutHostWaits) {
  FSDP_SKIP_WITHOUT_GPU();
  const std::vector<float> want = cpu_losses();
  std::map<bool, std::vector<float>> got;
  for (const bool blocking : {false, true}) {
    std::shared_ptr<Communicator> comm = make_nccl_communicator(
        c10::make_intrusive<c10d::HashStore>(), 0, 1, NcclOptions().blocking_wait(blocking));
    comm->set_size_checks(true);  // FSDP's first iteration does so too; these are all on
    FullyShardedDataParallel<GptImpl> model(make_gpt(),
                                            FullyShardedDataParallelOptions(comm).device_id(kCuda));
    for (const at::Tensor& p : model->parameters()) EXPECT_EQ(p.device(), kCuda);
    got[blocking] = train(
        model->parameters(), [&](const at::Tensor& x) { return model->forward(x); }, kCuda);
    ASSERT_EQ(got[blocking].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[blocking][i], want[i], 1e-4) << "step " << i << " blocking " << blocking;
    }
  }
}

}  // namespace
}  // namespace fsdp
