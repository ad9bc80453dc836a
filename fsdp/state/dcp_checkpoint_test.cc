// Distributed Checkpoint folders of FSDP models on ranks as threads: saved at one world
// size, loaded at others (model, optimizer state, param_groups, extras), crash safety
// and errors. PyTorch's side is tests/dcp_interop_test.sh.
#include "fsdp/state/dcp_checkpoint.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/formats/dcp.h"
#include "fsdp/state/internal/model_layout.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/state/state_dict.h"
#include "fsdp/state/testing/state_dict_testing.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using ::fsdp::state_testing::scratch;

using Model = FullyShardedDataParallel<TinyLmImpl>;

Model tiny_lm(std::shared_ptr<Communicator> comm) {
  return Model(make<TinyLmImpl>(), FullyShardedDataParallelOptions(comm));
}

void train(Model& model, torch::optim::Optimizer& optimizer, int steps, int rank, int world) {
  for (int step = 0; step < steps; ++step) {
    const Batch batch = TinyLmImpl::batch(step, 2 * world);
    optimizer.zero_grad();
    TinyLmImpl::loss(model->forward(batch.input.narrow(0, 2 * rank, 2)),
                     batch.target.narrow(0, 2 * rank, 2))
        .backward();
    optimizer.step();
  }
}

struct Saved {
  StateDict model;
  OptimStateDict optim;
};

// TinyLm trained with AdamW at W = 2, saved to `dir` with extras {"step": 7}.
Saved save_at_two(const fs::path& dir) {
  Saved saved;
  std::mutex mu;
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    Model model = tiny_lm(comm);
    torch::optim::AdamW adamw(model->parameters(),
                              torch::optim::AdamWOptions(0.02).betas({0.8, 0.95}));
    train(model, adamw, 2, comm->rank(), 2);
    save_dcp_checkpoint(*model, &adamw, dir.string(),
                        DcpCheckpointOptions().extras({{"step", int64_t{7}}}));
    StateDict full = full_state_dict(*model);
    OptimStateDict optim = full_optim_state_dict(*model, adamw);
    if (comm->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      saved = {full, optim};
    }
  });
  return saved;
}

TEST(DcpCheckpoint, SavedAtTwoLoadsAtThreeAndOne) {
  const fs::path root = scratch("dcp_reshard");
  const fs::path dir = root / "step_7";
  const Saved saved = save_at_two(dir);
  // Complete, published, nothing partial left beside it.
  EXPECT_TRUE(fs::exists(dir / ".metadata"));
  EXPECT_TRUE(fs::exists(dir / "__0_0.distcp"));
  EXPECT_TRUE(fs::exists(dir / "__1_0.distcp"));
  EXPECT_EQ(std::distance(fs::directory_iterator(root), fs::directory_iterator()), 1);
  // Every tensor's chunks tile it exactly; the keys are get_state_dict's.
  const DcpMetadata md = read_dcp_metadata(dir.string());
  for (const DcpEntryMetadata& e : md.entries) {
    if (!e.is_tensor) continue;
    int64_t numel = 1, covered = 0;
    for (int64_t d : e.size) numel *= d;
    for (const DcpChunk& c : e.chunks) {
      int64_t n = 1;
      for (int64_t d : c.sizes) n *= d;
      covered += n;
    }
    EXPECT_EQ(covered, numel) << e.fqn;
  }
  ASSERT_NE(md.find("model.embedding.weight"), nullptr);
  ASSERT_NE(md.find("optim.state.blocks.0.up.weight.exp_avg_sq"), nullptr);
  EXPECT_EQ(md.find("optim.state.blocks.0.up.weight.step")->dtype, c10::ScalarType::Float);
  EXPECT_FALSE(md.find("optim.param_groups.0.betas")->is_tensor);
  EXPECT_EQ(md.find("optim.param_groups.0.params")->path,
            (std::vector<DcpPathElement>{std::string("optim"), std::string("param_groups"),
                                         int64_t{0}, std::string("params")}));
  EXPECT_FALSE(md.find("step")->is_tensor);

  for (int world : {3, 1}) {
    SCOPED_TRACE(world);
    on_ranks(world, [&](std::shared_ptr<Communicator> comm) {
      Model model = tiny_lm(comm);
      torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1.0));
      const DcpExtras extras = load_dcp_checkpoint(*model, &adamw, dir.string());
      ASSERT_EQ(extras.size(), 1u);
      EXPECT_EQ(extras[0].first, "step");
      EXPECT_EQ(extras[0].second.toInt(), 7);
      const StateDict full = full_state_dict(*model);
      ASSERT_EQ(full.keys(), saved.model.keys());
      for (const auto& item : saved.model) {
        EXPECT_TRUE(at::equal(full[item.key()], item.value())) << item.key();
      }
      const OptimStateDict optim = full_optim_state_dict(*model, adamw);
      ASSERT_EQ(optim.keys(), saved.optim.keys());
      for (const auto& param : saved.optim) {
        for (const auto& state : param.value()) {
          EXPECT_TRUE(at::equal(optim[param.key()][state.key()], state.value()))
              << param.key() << " " << state.key();
        }
      }
      const auto& o =
          static_cast<const torch::optim::AdamWOptions&>(adamw.param_groups()[0].options());
      EXPECT_EQ(o.lr(), 0.02);
      EXPECT_EQ(o.betas(), std::make_tuple(0.8, 0.95));
    });
  }
}

TEST(DcpCheckpoint, BadFoldersAreOneClearError) {
  const fs::path dir = scratch("dcp_bad") / "ckpt";
  save_at_two(dir);
  auto expect_load_error = [&](const std::string& message, bool with_optimizer = true) {
    on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
      Model model = tiny_lm(comm);
      torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1.0));
      EXPECT_THAT(
          [&] { load_dcp_checkpoint(*model, with_optimizer ? &adamw : nullptr, dir.string()); },
          ThrowsMessage<c10::Error>(HasSubstr(message)));
    });
  };
  on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NestedImpl> other(make<NestedImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    EXPECT_THAT([&] { load_dcp_checkpoint(*other, nullptr, dir.string()); },
                ThrowsMessage<c10::Error>(HasSubstr("holds another model)")));
  });
  const std::string file = (dir / "__1_0.distcp").string();
  const auto size = fs::file_size(file);
  fs::resize_file(file, size / 2);
  expect_load_error("__1_0.distcp' has " + std::to_string(size / 2) + " bytes, but .metadata puts");
  fs::remove(file);
  expect_load_error("is in '__1_0.distcp': cannot open Distributed Checkpoint data '" + file +
                    "': No such file or directory");
  fs::remove(dir / ".metadata");
  expect_load_error(
      "is not a complete Distributed Checkpoint: cannot open Distributed Checkpoint "
      "metadata '" +
          (dir / ".metadata").string() + "': No such file or directory",
      false);
}

// As for sharded checkpoints (issue 25): staging a DCP save builds the model layout once
// (not once each for the model state, the optimizer state, param_groups and the chunk
// list), and so does a load. One rank, so that no other rank's thread counts meanwhile.
TEST(DcpCheckpoint, BuildsTheModelLayoutOncePerSaveAndOncePerLoad) {
  const fs::path dir = scratch("dcp_layout_builds") / "step_00000001";
  on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
    Model model = tiny_lm(comm);
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(0.02));
    train(model, adamw, 1, 0, 1);
    const int64_t before = state_internal::model_layout_builds();
    const StagedDcpCheckpoint staged = stage_dcp_checkpoint(*model, &adamw);
    EXPECT_EQ(state_internal::model_layout_builds() - before, 1);
    write_dcp_checkpoint(staged, dir.string(), *comm);
    EXPECT_EQ(state_internal::model_layout_builds() - before, 1) << "the write needs no model";
    load_dcp_checkpoint(*model, &adamw, dir.string());
    EXPECT_EQ(state_internal::model_layout_builds() - before, 2);
  });
}

}  // namespace
}  // namespace fsdp
