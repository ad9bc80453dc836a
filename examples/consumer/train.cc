// Trains a two-unit MLP with FSDP on 2 local ranks (it launches itself) and checks that
// the loss falls: what a program in another monorepo writes against @fsdp//fsdp.
#include <cstdio>
#include <cstdlib>

#include <ATen/Functions.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "fsdp/fsdp.h"

struct NetImpl : torch::nn::Module {
  NetImpl() {
    hidden = register_module("hidden", fsdp::make_unit(torch::nn::Linear(8, 32)));
    out = register_module("out", fsdp::make_unit(torch::nn::Linear(32, 1)));
  }
  at::Tensor forward(at::Tensor x) { return out(torch::nn::functional::relu(hidden(x))); }
  fsdp::Unit<torch::nn::LinearImpl> hidden{nullptr}, out{nullptr};
};

int main(int argc, char** argv) {
  if (std::getenv("RANK") == nullptr) {  // start 2 ranks of this program
    return fsdp::launch_self(2, argc, argv);
  }
  at::set_num_threads(1);
  auto comm =  // CPU tensors: Gloo on any host
      fsdp::init_from_environment(fsdp::RendezvousOptions().backend(fsdp::Backend::kGloo));
  at::manual_seed(0);
  fsdp::FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(),
                                                fsdp::FullyShardedDataParallelOptions(comm));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const at::Tensor x = at::randn({16, 8}).narrow(0, comm->rank() * 8, 8);
  const at::Tensor y = x.sum(1, /*keepdim=*/true);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    sgd.zero_grad();
    at::Tensor loss = torch::nn::functional::mse_loss(model->forward(x), y);
    loss.backward();
    sgd.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("rank %d: loss %.4f -> %.4f\n", comm->rank(), first, last);
  return last < first / 4 ? 0 : 1;
}
