// Asynchronous saves of FSDP models on cuda:0 (ranks as threads each on its own stream,
// on_cuda_ranks): the staged pieces are host copies in pinned memory, and what the
// background write puts on disk is the model as it was at the save call, while training
// goes on on the device. Every case skips without a CUDA device, naming why.
#include <filesystem>
#include <memory>
#include <string>

#include <gtest/gtest.h>
#include <torch/optim/adam.h>

#include "fsdp/core/testing/cuda_testing.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/checkpoint.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using namespace ::fsdp::core_testing;  // NOLINT: the shared test models

void train(FullyShardedDataParallel<TinyLmImpl>& model, torch::optim::Optimizer& optimizer,
           int first_step, int steps, const Communicator& comm) {
  for (int step = first_step; step < first_step + steps; ++step) {
    const Batch batch = TinyLmImpl::batch(step, kBatchPerRank * comm.world_size());
    optimizer.zero_grad();
    TinyLmImpl::loss(
        model->forward(
            batch.input.narrow(0, kBatchPerRank * comm.rank(), kBatchPerRank).to(kCudaDevice)),
        batch.target.narrow(0, kBatchPerRank * comm.rank(), kBatchPerRank).to(kCudaDevice))
        .backward();
    optimizer.step();
  }
}

TEST(CudaAsyncSave, StagesToPinnedHostMemory) {
  FSDP_SKIP_WITHOUT_GPU();
  on_cuda_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(
        make<TinyLmImpl>(), FullyShardedDataParallelOptions(comm).device_id(kCudaDevice));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    train(model, adam, 0, 1, *comm);
    const StagedShardedCheckpoint staged = stage_sharded_checkpoint(*model, &adam);
    EXPECT_EQ(staged.device, kCudaDevice);
    int written = 0;
    // Adam's step counts are CPU scalars in the optimizer's state: a piece already on the
    // CPU is taken as it is (no copy, so not pinned); every piece copied from the device
    // lands in pinned memory.
    const auto on_host = [](const std::string& key) {
      return key.size() > 5 && key.compare(key.size() - 5, 5, "/step") == 0;
    };
    for (const StagedShardedCheckpoint::Entry& entry : staged.entries) {
      EXPECT_TRUE(entry.piece.local.is_cpu()) << entry.key;
      if (!entry.written) continue;
      ++written;
      EXPECT_EQ(entry.piece.local.is_pinned(), !on_host(entry.key)) << entry.key;
    }
    EXPECT_GT(written, 0);
  });
}

TEST(CudaAsyncSave, WritesTheModelAsItWasAtTheSaveCall) {
  FSDP_SKIP_WITHOUT_GPU();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const fs::path root = fs::path(tmp != nullptr ? tmp : "/tmp") / "cuda_async_save";
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string dir = (root / "step_1").string();
  StateDict want;
  on_cuda_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(
        make<TinyLmImpl>(), FullyShardedDataParallelOptions(comm).device_id(kCudaDevice));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    train(model, adam, 0, 1, *comm);
    const StateDict full = full_state_dict(*model, FullStateDictOptions().offload_to_cpu(true));
    if (comm->rank() == 0) want = full;
    AsyncSave save = async_save_sharded_checkpoint(
        *model, &adam, dir, nullptr,
        AsyncSaveOptions().communicator(make_checkpoint_communicator(*comm)));
    train(model, adam, 1, 2, *comm);
    save.wait();
  });
  on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(make<TinyLmImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    (void)load_sharded_checkpoint(*model, nullptr, dir);
    const StateDict got = full_state_dict(*model);
    ASSERT_EQ(got.keys(), want.keys());
    for (const auto& item : want)
      EXPECT_TRUE(at::equal(got[item.key()], item.value())) << item.key();
  });
}

}  // namespace
}  // namespace fsdp
