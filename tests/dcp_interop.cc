// The C++ half of dcp_interop_test.sh: Distributed Checkpoint folders of the GPT
// example's model and AdamW move between fsdp (ranks as threads) and PyTorch's
// fully_shard (dcp_interop.py), with the loss curve continuing on both sides.
//
//   dcp_interop save DIR   W = 2: trains 2 steps, writes DIR/cpp_ckpt (DCP, extra
//                          "step" = 2) and DIR/cpp_full.pt (full state dict), then
//                          trains 20 more steps: their losses in DIR/cpp_losses.txt
//   dcp_interop load DIR   at W = 3 and 1: loads DIR/py_ckpt (dcp.save of fully_shard
//                          at W = 2 after 2 steps), checks it against DIR/py_full.pt,
//                          trains 20 steps and compares the losses with
//                          DIR/py_losses.txt (within 1e-4)
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "examples/gpt/model.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/dcp_checkpoint.h"

namespace fsdp {
namespace {

using examples::GptImpl;
using examples::GptOptions;
using Model = FullyShardedDataParallel<GptImpl>;

// Keep in step with dcp_interop.py.
constexpr int64_t kVocab = 23, kContext = 8, kRows = 6, kSteps = 20;
GptOptions small() {
  return GptOptions().vocab_size(kVocab).context(kContext).width(16).heads(2).layers(2);
}
at::Tensor tokens(int64_t step) {
  return (at::arange(kRows * (kContext + 1), at::kLong).view({kRows, kContext + 1}) * 7 +
          step * 3) %
         kVocab;
}

// One AdamW step on this rank's rows of step `step`'s batch; returns the rank's loss.
double train_step(Model& model, torch::optim::AdamW& adamw, int64_t step, int rank, int world) {
  const int64_t rows = kRows / world;
  const at::Tensor batch = tokens(step).narrow(0, rank * rows, rows);
  adamw.zero_grad();
  at::Tensor loss = torch::nn::functional::cross_entropy(
      model->forward(batch.narrow(1, 0, kContext)).reshape({-1, kVocab}),
      batch.narrow(1, 1, kContext).reshape({-1}));
  loss.backward();
  adamw.step();
  return loss.item<double>();
}

// Runs fn on `world` ranks as threads; each gets a model (seed 0) and AdamW (lr 1e-2).
// Returns the mean over ranks of the losses fn returns, per step.
std::vector<double> on_ranks(
    int world, const std::function<std::vector<double>(Model&, torch::optim::AdamW&, int)>& fn) {
  std::vector<double> mean;
  std::mutex mu;
  FakeWorld::run(FakeWorld::create(world), [&](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    at::manual_seed(0);
    Model model(std::make_shared<GptImpl>(small()), FullyShardedDataParallelOptions(self));
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    const std::vector<double> losses = fn(model, adamw, comm.rank());
    std::lock_guard<std::mutex> lock(mu);
    mean.resize(losses.size(), 0.0);
    for (size_t i = 0; i < losses.size(); ++i) mean[i] += losses[i] / world;
  });
  return mean;
}

int save(const std::string& dir) {
  const std::vector<double> losses =
      on_ranks(2, [&](Model& model, torch::optim::AdamW& adamw, int rank) {
        for (int64_t step = 0; step < 2; ++step) train_step(model, adamw, step, rank, 2);
        save_dcp_checkpoint(*model, &adamw, dir + "/cpp_ckpt",
                            DcpCheckpointOptions().extras({{"step", int64_t{2}}}));
        const StateDict full = full_state_dict(*model, FullStateDictOptions().rank0_only(true));
        if (rank == 0) save_state_dict(full, dir + "/cpp_full.pt");
        std::vector<double> out;
        for (int64_t step = 2; step < 2 + kSteps; ++step) {
          out.push_back(train_step(model, adamw, step, rank, 2));
        }
        return out;
      });
  std::ofstream out(dir + "/cpp_losses.txt");
  for (double loss : losses) out << std::setprecision(17) << loss << "\n";
  std::cout << "fsdp W = 2: saved " << dir << "/cpp_ckpt; losses " << losses.front() << " ... "
            << losses.back() << "\n";
  return 0;
}

int load(const std::string& dir) {
  const StateDict want = load_state_dict(dir + "/py_full.pt");
  std::vector<double> py_losses;
  std::ifstream in(dir + "/py_losses.txt");
  for (double loss; in >> loss;) py_losses.push_back(loss);
  if (py_losses.size() != kSteps) {
    std::cerr << "py_losses.txt holds " << py_losses.size() << " losses, not " << kSteps << "\n";
    return 1;
  }
  int status = 0;
  for (int world : {3, 1}) {
    double worst_tensor = 0;
    std::mutex mu;
    const std::vector<double> losses = on_ranks(world, [&](Model& model, torch::optim::AdamW& adamw,
                                                           int rank) {
      const DcpExtras extras = load_dcp_checkpoint(*model, &adamw, dir + "/py_ckpt");
      TORCH_CHECK(extras.size() == 1 && extras[0].first == "step" && extras[0].second.toInt() == 2,
                  "the extra entry 'step' = 2 did not come back");
      const StateDict full = full_state_dict(*model);
      TORCH_CHECK(full.keys() == want.keys(), "the keys differ from py_full.pt's");
      double worst = 0;
      for (const auto& item : want) {
        worst = std::max(worst, (full[item.key()] - item.value()).abs().max().item<double>());
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        worst_tensor = std::max(worst_tensor, worst);
      }
      std::vector<double> out;
      for (int64_t step = 2; step < 2 + kSteps; ++step) {
        out.push_back(train_step(model, adamw, step, rank, world));
      }
      return out;
    });
    double worst_loss = 0;
    for (int64_t i = 0; i < kSteps; ++i) {
      worst_loss = std::max(worst_loss, std::abs(losses[i] - py_losses[i]));
    }
    std::cout << "PyTorch DCP in fsdp W = " << world
              << ": max |tensor difference| = " << worst_tensor << ", max |loss difference| over "
              << kSteps << " steps = " << worst_loss << "\n";
    if (worst_tensor != 0 || worst_loss > 1e-4) status = 1;
  }
  return status;
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "save") != 0 && std::strcmp(argv[1], "load") != 0)) {
    std::cerr << "usage: dcp_interop save|load DIR\n";
    return 2;
  }
  return std::strcmp(argv[1], "save") == 0 ? fsdp::save(argv[2]) : fsdp::load(argv[2]);
}
