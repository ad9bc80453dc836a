// The C++ half of pytorch_interop_test.sh: checkpoints of the GPT example's model move
// between fsdp (W = 2, ranks as threads) and PyTorch (pytorch_interop.py).
//
//   pytorch_interop write DIR   trains 2 steps, writes DIR/cpp_model.pt (full state
//                               dict) and DIR/cpp_io.pt (tokens, logits); then, from
//                               the initial weights (DIR/cpp_init.pt), 2 steps with
//                               Adagrad and with RMSprop (momentum, centered): their
//                               full optimizer state files DIR/cpp_optim_<name>.pt and
//                               weights DIR/cpp_model_<name>.pt
//   pytorch_interop check DIR   loads DIR/py_model.pt (torch.save(model.state_dict()))
//                               and compares its logits with DIR/py_io.pt's
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>

#include <ATen/Functions.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "examples/gpt/model.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/optim_state_dict.h"

namespace fsdp {
namespace {

using examples::GptImpl;
using examples::GptOptions;

// Keep in step with pytorch_interop.py.
GptOptions small() { return GptOptions().vocab_size(23).context(8).width(16).heads(2).layers(2); }
at::Tensor tokens() { return (at::arange(2 * 8, at::kLong).view({2, 8}) * 5 + 3) % 23; }

void on_two_ranks(
    const std::function<void(FullyShardedDataParallel<GptImpl>&, Communicator&)>& fn) {
  FakeWorld::run(FakeWorld::create(2), [&](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    std::shared_ptr<GptImpl> gpt;
    {
      // The same weights on both ranks and in every run: the ranks (threads) draw from
      // the process-wide generator one at a time.
      static std::mutex seed_mutex;
      std::lock_guard<std::mutex> lock(seed_mutex);
      at::manual_seed(0);
      gpt = std::make_shared<GptImpl>(small());
    }
    FullyShardedDataParallel<GptImpl> model(gpt, FullyShardedDataParallelOptions(self));
    fn(model, comm);
  });
}

// Two steps on this rank's row of tokens() (the global batch: both rows).
void train_two_steps(FullyShardedDataParallel<GptImpl>& model, torch::optim::Optimizer& optimizer,
                     const Communicator& comm) {
  for (int step = 0; step < 2; ++step) {
    optimizer.zero_grad();
    const at::Tensor x = tokens().narrow(0, comm.rank(), 1);
    torch::nn::functional::cross_entropy(model->forward(x).reshape({-1, 23}),
                                         x.roll(1, 1).reshape({-1}))
        .backward();
    optimizer.step();
  }
}

// Keep the hyper-parameters in step with pytorch_interop.py.
void write_optimizer_states(const std::string& dir) {
  on_two_ranks([&](FullyShardedDataParallel<GptImpl>& model, Communicator& comm) {
    const StateDict init = full_state_dict(*model);
    if (comm.rank() == 0) save_state_dict(init, dir + "/cpp_init.pt");
  });
  const std::vector<std::pair<std::string, std::function<std::unique_ptr<torch::optim::Optimizer>(
                                               std::vector<at::Tensor>)>>>
      optimizers = {
          {"adagrad",
           [](std::vector<at::Tensor> params) {
             return std::make_unique<torch::optim::Adagrad>(
                 params, torch::optim::AdagradOptions(0.05).initial_accumulator_value(0.1));
           }},
          {"rmsprop",
           [](std::vector<at::Tensor> params) {
             return std::make_unique<torch::optim::RMSprop>(
                 params, torch::optim::RMSpropOptions(0.01).momentum(0.9).centered(true).eps(0.01));
           }},
      };
  for (const auto& [name, make] : optimizers) {
    on_two_ranks([&](FullyShardedDataParallel<GptImpl>& model, Communicator& comm) {
      std::unique_ptr<torch::optim::Optimizer> optimizer = make(model->parameters());
      train_two_steps(model, *optimizer, comm);
      const OptimStateDict state =
          full_optim_state_dict(*model, *optimizer, FullStateDictOptions().rank0_only(true));
      const StateDict weights = full_state_dict(*model, FullStateDictOptions().rank0_only(true));
      if (comm.rank() != 0) return;
      save_optim_state_dict(state, dir + "/cpp_optim_" + name + ".pt");
      save_state_dict(weights, dir + "/cpp_model_" + name + ".pt");
    });
  }
}

int write(const std::string& dir) {
  write_optimizer_states(dir);
  on_two_ranks([&](FullyShardedDataParallel<GptImpl>& model, Communicator& comm) {
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5));
    train_two_steps(model, sgd, comm);
    const StateDict full = full_state_dict(*model, FullStateDictOptions().rank0_only(true));
    torch::NoGradGuard no_grad;
    const at::Tensor logits = model->forward(tokens());
    if (comm.rank() != 0) return;
    save_state_dict(full, dir + "/cpp_model.pt");
    StateDict io;
    io.insert("tokens", tokens());
    io.insert("logits", logits);
    save_state_dict(io, dir + "/cpp_io.pt");
  });
  return 0;
}

int check(const std::string& dir) {
  const StateDict weights = load_state_dict(dir + "/py_model.pt");
  const StateDict io = load_state_dict(dir + "/py_io.pt");
  double worst = 0;
  on_two_ranks([&](FullyShardedDataParallel<GptImpl>& model, Communicator& comm) {
    load_full_state_dict(*model, weights);
    torch::NoGradGuard no_grad;
    const double diff = (model->forward(io["tokens"]) - io["logits"]).abs().max().item<double>();
    if (comm.rank() == 0) worst = diff;
  });
  std::cout << "PyTorch checkpoint in fsdp (W = 2): max |logit difference| = " << worst << "\n";
  return worst <= 1e-5 ? 0 : 1;
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "write") != 0 && std::strcmp(argv[1], "check") != 0)) {
    std::cerr << "usage: pytorch_interop write|check DIR\n";
    return 2;
  }
  return std::strcmp(argv[1], "write") == 0 ? fsdp::write(argv[2]) : fsdp::check(argv[2]);
}
