// Checkpoint files on ranks as threads: full files, sharded directories resharded to
// other world sizes, crash safety, and every reading error.
#include "fsdp/state/checkpoint.h"

#include <signal.h>
#include <sys/resource.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <caffe2/serialize/inline_container.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/adam.h>

#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/state/internal/model_layout.h"
#include "fsdp/state/testing/state_dict_testing.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using ::fsdp::state_testing::scratch;

size_t entries(const fs::path& dir) {
  return std::distance(fs::directory_iterator(dir), fs::directory_iterator());
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// TinyLm trained two Adam steps on `comm`'s ranks.
struct Trained {
  FullyShardedDataParallel<TinyLmImpl> model{nullptr};
  std::unique_ptr<torch::optim::Adam> adam;
};
Trained train_tiny_lm(std::shared_ptr<Communicator> comm, int steps) {
  Trained t{FullyShardedDataParallel<TinyLmImpl>(make<TinyLmImpl>(),
                                                 FullyShardedDataParallelOptions(comm)),
            nullptr};
  t.adam =
      std::make_unique<torch::optim::Adam>(t.model->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < steps; ++step) {
    const Batch batch = TinyLmImpl::batch(step, 2 * comm->world_size());
    t.adam->zero_grad();
    TinyLmImpl::loss(t.model->forward(batch.input.narrow(0, 2 * comm->rank(), 2)),
                     batch.target.narrow(0, 2 * comm->rank(), 2))
        .backward();
    t.adam->step();
  }
  return t;
}

void expect_equal(const StateDict& got, const StateDict& want) {
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& item : want) EXPECT_TRUE(at::equal(got[item.key()], item.value())) << item.key();
}

TEST(StateDictFile, RoundTripsEveryDtypeAndOneItemDicts) {
  const fs::path dir = scratch("full_file");
  StateDict saved;
  saved.insert("a.weight", at::randn({3, 4}));
  saved.insert("a.count", at::arange(5, at::kLong));
  saved.insert("b.half", at::randn({2}).to(at::kHalf));
  saved.insert("b.strided", at::randn({4, 4}).t());
  save_state_dict(saved, (dir / "model.pt").string());
  expect_equal(load_state_dict((dir / "model.pt").string()), saved);
  StateDict one;
  one.insert("only", at::ones({1}));
  save_state_dict(one, (dir / "one.pt").string());
  expect_equal(load_state_dict((dir / "one.pt").string()), one);
  EXPECT_EQ(entries(dir), 2u) << "no temporary files left";
}

TEST(OptimStateDictFile, RoundTrips) {
  const fs::path dir = scratch("optim_file");
  OptimStateDict saved;
  ParamOptimState state;
  state.insert("exp_avg", at::randn({3}));
  state.insert("step", at::scalar_tensor(7, at::kLong));
  saved.insert("l1.weight", state);
  save_optim_state_dict(saved, (dir / "optim.pt").string());
  const OptimStateDict got = load_optim_state_dict((dir / "optim.pt").string());
  ASSERT_THAT(got.keys(), ElementsAre("l1.weight"));
  expect_equal(got["l1.weight"], state);
}

// Saved at W = 2, loaded at W = 3 and W = 1: identical full parameters and optimizer state.
TEST(ShardedCheckpoint, ReshardsToOtherWorldSizes) {
  const fs::path root = scratch("resharding");
  const std::string dir = (root / "step_00000002").string();
  StateDict want_model;
  OptimStateDict want_optim;
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    Trained t = train_tiny_lm(comm, 2);
    save_sharded_checkpoint(*t.model, t.adam.get(), dir);
    StateDict model = full_state_dict(*t.model);
    OptimStateDict optim = full_optim_state_dict(*t.model, *t.adam);
    if (comm->rank() == 0) {
      want_model = model;
      want_optim = optim;
    }
  });
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(root / "step_00000002")) {
    files.push_back(entry.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  EXPECT_THAT(files, ElementsAre("metadata.pt", "rank_00000.pt", "rank_00001.pt"));
  EXPECT_EQ(entries(root), 1u) << "no partial directory left";
  for (int w : {3, 1, 2}) {
    on_ranks(w, [&](std::shared_ptr<Communicator> comm) {
      Trained t = train_tiny_lm(comm, 0);
      load_sharded_checkpoint(*t.model, t.adam.get(), dir);
      const StateDict model = full_state_dict(*t.model);
      const OptimStateDict optim = full_optim_state_dict(*t.model, *t.adam);
      expect_equal(model, want_model);
      ASSERT_EQ(optim.keys(), want_optim.keys()) << "W=" << w;
      for (const auto& item : want_optim) expect_equal(optim[item.key()], item.value());
    });
  }
}

// HYBRID_SHARD at W = 4 (F = 2) with bf16 mixed precision: the full state dict holds the
// fp32 master values, and the checkpoint (each piece written once, by the first shard
// group) loads at W = 2 FULL_SHARD into the same parameters and optimizer state.
TEST(ShardedCheckpoint, HybridMixedPrecisionToFullShard) {
  const std::string dir = (scratch("hybrid") / "step_1").string();
  StateDict want_model;
  OptimStateDict want_optim;
  on_ranks(4, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<TinyLmImpl> model(
        make<TinyLmImpl>(), FullyShardedDataParallelOptions(comm)
                                .sharding_strategy(ShardingStrategy::kHybridShard)
                                .hybrid_shard_group_size(2)
                                .mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    const Batch batch = TinyLmImpl::batch(0, 8);
    TinyLmImpl::loss(model->forward(batch.input.narrow(0, 2 * comm->rank(), 2)),
                     batch.target.narrow(0, 2 * comm->rank(), 2))
        .backward();
    adam.step();
    save_sharded_checkpoint(*model, &adam, dir);
    const StateDict full = full_state_dict(*model);
    for (const auto& item : full) EXPECT_EQ(item.value().scalar_type(), at::kFloat) << item.key();
    const OptimStateDict optim = full_optim_state_dict(*model, adam);
    if (comm->rank() == 0) {
      want_model = full;
      want_optim = optim;
    }
  });
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    Trained t = train_tiny_lm(comm, 0);
    load_sharded_checkpoint(*t.model, t.adam.get(), dir);
    expect_equal(full_state_dict(*t.model), want_model);
    const OptimStateDict optim = full_optim_state_dict(*t.model, *t.adam);
    ASSERT_EQ(optim.keys(), want_optim.keys());
    for (const auto& item : want_optim) expect_equal(optim[item.key()], item.value());
  });
}

// Issue 15: two jobs saving the same checkpoint at once published one that failed its CRC
// (they shared one partial directory). Each save now has its own; the last one wins whole.
TEST(ShardedCheckpoint, ConcurrentSavesOfOneNamePublishACompleteCheckpoint) {
  const fs::path root = scratch("concurrent");
  const std::string target = (root / "step_00000001").string();
  auto job = [&](int steps) {
    on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
      Trained t = train_tiny_lm(comm, steps);
      for (int i = 0; i < 5; ++i) save_sharded_checkpoint(*t.model, t.adam.get(), target);
    });
  };
  std::thread first(job, 1), second(job, 2);
  first.join();
  second.join();
  EXPECT_EQ(entries(root), 1u) << "no partial directory left";
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    Trained t = train_tiny_lm(comm, 0);
    EXPECT_NO_THROW(load_sharded_checkpoint(*t.model, t.adam.get(), target));
  });
}

TEST(ShardedCheckpoint, ReplacesAnExistingCheckpointAndFindsTheLatest) {
  const fs::path root = scratch("latest");
  EXPECT_EQ(latest_checkpoint(root.string()), std::nullopt);
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    Trained t = train_tiny_lm(comm, 1);
    save_sharded_checkpoint(*t.model, t.adam.get(), (root / "step_00000100").string());
    save_sharded_checkpoint(*t.model, t.adam.get(), (root / "step_00000200").string());
    save_sharded_checkpoint(*t.model, nullptr, (root / "step_00000200").string());  // replace
  });
  fs::create_directories(root / ".step_00000300.partial");  // a save that crashed
  fs::create_directories(root / "step_00000400");           // not a checkpoint
  EXPECT_EQ(latest_checkpoint(root.string()), (root / "step_00000200").string());
  on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
    Trained t = train_tiny_lm(comm, 0);
    load_sharded_checkpoint(*t.model, t.adam.get(), (root / "step_00000200").string());
    EXPECT_TRUE(t.adam->state().empty()) << "the replacement holds no optimizer state";
  });
}

// Issue 25: a save built the model layout three times (sharded_state_dict,
// sharded_optim_state_dict and the file's item list), a load three times too. One rank,
// so that no other rank's thread counts at the same time.
TEST(ShardedCheckpoint, BuildsTheModelLayoutOncePerSaveAndOncePerLoad) {
  const std::string dir = (scratch("layout_builds") / "step_00000001").string();
  on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
    Trained t = train_tiny_lm(comm, 1);
    const int64_t before = state_internal::model_layout_builds();
    save_sharded_checkpoint(*t.model, t.adam.get(), dir);
    EXPECT_EQ(state_internal::model_layout_builds() - before, 1);
    load_sharded_checkpoint(*t.model, t.adam.get(), dir);
    EXPECT_EQ(state_internal::model_layout_builds() - before, 2);
    (void)sharded_state_dict(*t.model);
    EXPECT_EQ(state_internal::model_layout_builds() - before, 3) << "the public API builds its own";
  });
}

TEST(ShardedCheckpoint, AFailedSaveRaisesOnEveryRankAndChangesNothing) {
  const fs::path root = scratch("failed_save");
  on_ranks(3, [&](std::shared_ptr<Communicator> comm) {
    Trained t = train_tiny_lm(comm, 0);
    // Rank 0 (which creates the directory) says why; the others that it failed.
    EXPECT_THAT(
        [&] { save_sharded_checkpoint(*t.model, nullptr, (root / "no/such/dir").string()); },
        ThrowsMessage<c10::Error>(
            HasSubstr(comm->rank() == 0 ? "failed on rank 0: the parent directory '" +
                                              (root / "no/such").string() + "' does not exist"
                                        : "failed on 1 other rank(s); see their errors")));
  });
  EXPECT_EQ(entries(root), 0u);
}

// Issue 30: a write that fails (here: every write past 64 bytes fails with EFBIG, as
// RLIMIT_FSIZE makes it) removes the partial directory before the error, on every rank,
// and the error says how much space the checkpoint needs and how much is free.
TEST(ShardedCheckpoint, AFailedWriteRemovesItsPartialDirectoryAndSaysTheSpace) {
  const fs::path root = scratch("failed_write");
  const std::string good = (root / "step_00000001").string();
  std::vector<std::string> errors(2);
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    Trained t = train_tiny_lm(comm, 1);
    save_sharded_checkpoint(*t.model, t.adam.get(), good);
    comm->barrier();
    static std::mutex mutex;
    if (comm->rank() == 0) {
      ::signal(SIGXFSZ, SIG_IGN);  // write() fails with EFBIG instead of a signal
      const rlimit limit = {64, RLIM_INFINITY};
      ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
    }
    comm->barrier();
    try {
      save_sharded_checkpoint(*t.model, t.adam.get(), (root / "step_00000002").string());
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[comm->rank()] = e.what_without_backtrace();
    }
    comm->barrier();
    if (comm->rank() == 0) {
      const rlimit unlimited = {RLIM_INFINITY, RLIM_INFINITY};
      ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &unlimited), 0);
    }
  });
  int64_t needed = 0;
  for (const char* file : {"rank_00000.pt", "rank_00001.pt"}) {
    needed += static_cast<int64_t>(fs::file_size(root / "step_00000001" / file));
  }
  const std::string partial_prefix = (root / ".step_00000002.partial-").string();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_THAT(errors[rank], ::testing::StartsWith(absl::StrCat(
                                  "save_sharded_checkpoint: rank ", rank,
                                  " cannot write its shard: cannot write '", partial_prefix)))
        << rank;
    EXPECT_THAT(errors[rank],
                HasSubstr(absl::StrFormat(
                    "': File too large; the checkpoint needs at least %d bytes (%.1f MB), ", needed,
                    needed / 1e6)));
    EXPECT_THAT(errors[rank], HasSubstr(" is free on the file system of '" + root.string() +
                                        "'; its partial directory was removed: free space (or "
                                        "save elsewhere) and save again"));
  }
  EXPECT_EQ(entries(root), 1u) << "only step_00000001: no partial directory left";
}

// A save killed mid-way leaves ".<name>.partial-<id>"; the next start removes it, and
// only it.
TEST(ShardedCheckpoint, RemovesThePartialDirectoriesOfAKilledSave) {
  const fs::path root = scratch("killed_save");
  fs::create_directories(root / ".step_00000004.partial-123456");
  write_bytes(root / ".step_00000004.partial-123456" / "rank_00000.pt.tmp-77", "half");
  fs::create_directories(root / ".step_00000002.partial-9");
  fs::create_directories(root / "step_00000002");
  fs::create_directories(root / ".hidden");
  write_bytes(root / ".notes.partial-1", "a file, not a partial directory");
  EXPECT_THAT(remove_partial_checkpoints(root.string()),
              ElementsAre((root / ".step_00000002.partial-9").string(),
                          (root / ".step_00000004.partial-123456").string()));
  EXPECT_EQ(entries(root), 3u);
  EXPECT_TRUE(fs::exists(root / "step_00000002") && fs::exists(root / ".hidden") &&
              fs::exists(root / ".notes.partial-1"));
  EXPECT_THAT(remove_partial_checkpoints(root.string()), ElementsAre());
}

// Issue 25 item 4: two checkpoints at W = 2; damage in the newest one is found by the
// rank that reads the damaged file, the ranks agree, and every rank loads the older one
// (or, when none loads, every rank raises the same error naming each damaged file).
class LoadLatestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = scratch("latest_" +
                    std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
      Trained t = train_tiny_lm(comm, 1);
      save_sharded_checkpoint(*t.model, t.adam.get(), (root_ / "step_1").string());
      const StateDict full = full_state_dict(*t.model);
      if (comm->rank() == 0) step1_ = full;
      Trained u = train_tiny_lm(comm, 2);
      save_sharded_checkpoint(*u.model, u.adam.get(), (root_ / "step_2").string());
    });
  }
  // Every rank's outcome of load_latest_sharded_checkpoint at W = 2.
  std::vector<std::string> load_latest() {
    std::vector<std::string> outcomes(2);
    on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
      Trained t = train_tiny_lm(comm, 0);
      std::string outcome;
      try {
        const std::optional<LoadedCheckpoint> loaded =
            load_latest_sharded_checkpoint(*t.model, t.adam.get(), root_.string());
        outcome = loaded ? absl::StrCat("loaded ", loaded->dir, " skipping ",
                                        absl::StrJoin(loaded->skipped, " | "))
                         : "none";
        if (loaded && loaded->dir == (root_ / "step_1").string()) {
          expect_equal(full_state_dict(*t.model), step1_);
        }
      } catch (const c10::Error& e) {
        outcome = absl::StrCat("error ", e.what_without_backtrace());
      }
      outcomes[comm->rank()] = outcome;
    });
    return outcomes;
  }
  std::string damage(const std::string& file) {  // flips a byte in the middle
    std::string bytes = read_bytes(root_ / file);
    bytes[bytes.size() / 2] ^= 0x5a;
    write_bytes(root_ / file, bytes);
    return (root_ / file).string();
  }
  std::string dir(const std::string& name) { return (root_ / name).string(); }
  fs::path root_;
  StateDict step1_;
};

TEST_F(LoadLatestTest, LoadsTheNewestWhenItIsWhole) {
  const std::vector<std::string> outcomes = load_latest();
  EXPECT_EQ(outcomes[0], "loaded " + dir("step_2") + " skipping ");
  EXPECT_EQ(outcomes[1], outcomes[0]);
}

TEST_F(LoadLatestTest, NoCheckpointIsNullopt) {
  fs::remove_all(root_ / "step_1");
  fs::remove_all(root_ / "step_2");
  fs::create_directories(root_ / ".step_3.partial-1");
  EXPECT_THAT(load_latest(), ElementsAre("none", "none"));
}

TEST_F(LoadLatestTest, DamageOnRankOneOnlyFallsBackOnEveryRank) {
  const std::string bytes = read_bytes(root_ / "step_2/rank_00001.pt");
  write_bytes(root_ / "step_2/rank_00001.pt", bytes.substr(0, 100));
  const std::vector<std::string> outcomes = load_latest();
  EXPECT_EQ(outcomes[0], absl::StrCat("loaded ", dir("step_1"), " skipping '", dir("step_2"),
                                      "': rank 1: checkpoint file '", dir("step_2/rank_00001.pt"),
                                      "' has 100 bytes, the metadata says ", bytes.size(),
                                      ": it is truncated or damaged; use another checkpoint"));
  EXPECT_EQ(outcomes[1], outcomes[0]);
}

TEST_F(LoadLatestTest, DamageInTheMetadataFallsBack) {
  write_bytes(root_ / "step_2/metadata.pt", "garbage");
  const std::vector<std::string> outcomes = load_latest();
  EXPECT_EQ(outcomes[0],
            absl::StrCat("loaded ", dir("step_1"), " skipping '", dir("step_2"),
                         "': ranks 0, 1: cannot read '", dir("step_2/metadata.pt"),
                         "': it is truncated or damaged, or not a file torch.save (zip format) or "
                         "fsdp wrote (reading it failed: PytorchStreamReader failed reading zip "
                         "archive: not a ZIP archive)"));
  EXPECT_EQ(outcomes[1], outcomes[0]);
}

TEST_F(LoadLatestTest, DamageOnRankZeroInEveryCheckpointRaisesOnEveryRank) {
  const std::string newest = damage("step_2/rank_00000.pt");
  const std::string older = damage("step_1/rank_00000.pt");
  const std::vector<std::string> outcomes = load_latest();
  // Rank 1 reads rank 0's file too: Adam's step counts are replicated, written by rank 0.
  auto crc = [](const std::string& file) {
    return "ranks 0, 1: checkpoint file '" + file +
           "' fails its CRC-32 check: it is damaged; use another checkpoint";
  };
  EXPECT_EQ(outcomes[0], absl::StrCat("error no checkpoint under '", root_.string(),
                                      "' loads on every rank: '", dir("step_2"), "': ", crc(newest),
                                      "; '", dir("step_1"), "': ", crc(older)));
  EXPECT_EQ(outcomes[1], outcomes[0]);
}

class BadCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = scratch("bad_" +
                    std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    dir_ = root_ / "step_1";
    on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
      Trained t = train_tiny_lm(comm, 1);
      save_sharded_checkpoint(*t.model, t.adam.get(), dir_.string());
    });
  }
  // The error loading dir_ into TinyLm at W = 1.
  void expect_load_error(const std::string& message) {
    on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
      Trained t = train_tiny_lm(comm, 0);
      EXPECT_THAT([&] { load_sharded_checkpoint(*t.model, t.adam.get(), dir_.string()); },
                  ThrowsMessage<c10::Error>(HasSubstr(message)));
    });
  }
  fs::path root_, dir_;
};

TEST_F(BadCheckpointTest, TruncatedShard) {
  const std::string bytes = read_bytes(dir_ / "rank_00001.pt");
  write_bytes(dir_ / "rank_00001.pt", bytes.substr(0, bytes.size() / 2));
  expect_load_error("rank_00001.pt' has " + std::to_string(bytes.size() / 2) +
                    " bytes, the metadata says " + std::to_string(bytes.size()) +
                    ": it is truncated or damaged");
}

TEST_F(BadCheckpointTest, CorruptShard) {
  std::string bytes = read_bytes(dir_ / "rank_00000.pt");
  bytes[bytes.size() / 2] ^= 0x5a;
  write_bytes(dir_ / "rank_00000.pt", bytes);
  expect_load_error("rank_00000.pt' fails its CRC-32 check");
}

TEST_F(BadCheckpointTest, MissingMetadata) {
  fs::remove(dir_ / "metadata.pt");
  expect_load_error("is not a complete checkpoint: it has no metadata.pt");
}

TEST_F(BadCheckpointTest, NotAZipFile) {
  write_bytes(dir_ / "metadata.pt", "not a checkpoint");
  expect_load_error("metadata.pt': ");
}

TEST_F(BadCheckpointTest, NewerVersion) {
  c10::impl::GenericDict metadata(c10::StringType::get(), c10::AnyType::get());
  metadata.insert("format", std::string("fsdp.sharded_checkpoint"));
  metadata.insert("version", int64_t{2});
  const std::vector<char> bytes = torch::jit::pickle_save(metadata);
  write_bytes(dir_ / "metadata.pt", std::string(bytes.begin(), bytes.end()));
  expect_load_error(
      "was written in checkpoint format version 2; this build of fsdp reads "
      "version 1");
}

// Issue 38: pieces whose element counts add up but overlap (and so leave a hole) were
// read with the hole left uninitialised.
TEST_F(BadCheckpointTest, OverlappingPiecesThatAddUp) {
  c10::IValue metadata = torch::jit::pickle_load([&] {
    const std::string bytes = read_bytes(dir_ / "metadata.pt");
    return std::vector<char>(bytes.begin(), bytes.end());
  }());
  auto field = [](const c10::IValue& dict, const std::string& name) {
    for (const auto& item : dict.toGenericDict()) {
      if (item.key().toStringRef() == name) return item.value();
    }
    ADD_FAILURE() << "no field " << name;
    return c10::IValue();
  };
  // The first model tensor split over both ranks: (rank, offset, numel) twice.
  std::string key;
  c10::IValue entry;
  for (const auto& item : field(metadata, "tensors").toGenericDict()) {
    if (key.empty() && item.key().toStringRef().rfind("model/", 0) == 0 &&
        field(item.value(), "pieces").toListRef().size() == 6) {
      key = item.key().toStringRef();
      entry = item.value();
    }
  }
  ASSERT_FALSE(key.empty());
  // A copy: the loaded metadata may share one list among tensors split alike.
  c10::List<int64_t> pieces = field(entry, "pieces").toIntList().copy();
  const int64_t second = pieces[4];
  pieces.set(4, second - 2);  // rank 1's piece starts 2 elements early
  entry.toGenericDict().insert_or_assign("pieces", pieces);
  const std::vector<char> bytes = torch::jit::pickle_save(metadata);
  write_bytes(dir_ / "metadata.pt", std::string(bytes.begin(), bytes.end()));
  expect_load_error(absl::StrCat("metadata.pt': the pieces of '", key, "' overlap: elements [",
                                 second - 2, ", ", second,
                                 ") are stored twice; the checkpoint is damaged or was edited"));
}

TEST_F(BadCheckpointTest, MetadataThatIsADevice) {
  fs::remove(dir_ / "metadata.pt");
  fs::create_symlink("/dev/zero", dir_ / "metadata.pt");
  expect_load_error(
      "metadata.pt' is a character device; checkpoint metadata must be a regular "
      "file (or a symlink to one)");
}

TEST(SchedulerState, LastEpochMustBeACount) {
  const DcpExtras extras = {{"lr_scheduler.last_epoch", int64_t{-1'000'000'000'000}},
                            {"lr_scheduler._last_lr", c10::List<double>({0.1})}};
  EXPECT_THAT([&] { scheduler_from_dcp_extras(extras); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "the checkpoint's 'lr_scheduler.last_epoch' is -1000000000000; expected an "
                  "integer in [0, 2^53) (the file is damaged or was edited: use another "
                  "checkpoint)")));
  const DcpExtras nan_lr = {{"lr_scheduler.last_epoch", int64_t{3}},
                            {"lr_scheduler._last_lr", c10::List<double>({std::nan("")})}};
  EXPECT_THAT([&] { scheduler_from_dcp_extras(nan_lr); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "the checkpoint's 'lr_scheduler._last_lr' is nan; expected a finite number")));
}

TEST_F(BadCheckpointTest, AnotherModel) {
  on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(),
                                               FullyShardedDataParallelOptions(comm));
    EXPECT_THAT([&] { load_sharded_checkpoint(*model, nullptr, dir_.string()); },
                ThrowsMessage<c10::Error>(HasSubstr(
                    "holds another model): the keys do not match the model's; missing keys (6): "
                    "'l1.weight'")));
  });
}

TEST(StateDictFile, ErrorsNameTheFile) {
  const fs::path dir = scratch("bad_full");
  EXPECT_THAT([&] { load_state_dict((dir / "absent.pt").string()); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot open torch.save file '" +
                                                  (dir / "absent.pt").string() +
                                                  "': No such file or directory")));
  write_bytes(dir / "text.pt", "hello");
  EXPECT_THAT([&] { load_state_dict((dir / "text.pt").string()); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot read '" + (dir / "text.pt").string())));
  c10::Dict<std::string, int64_t> not_tensors;
  not_tensors.insert("a", 1);
  not_tensors.insert("b", 2);
  const std::vector<char> bytes = torch::jit::pickle_save(not_tensors);
  write_bytes(dir / "ints.pt", std::string(bytes.begin(), bytes.end()));
  EXPECT_THAT([&] { load_state_dict((dir / "ints.pt").string()); },
              ThrowsMessage<c10::Error>(HasSubstr("the state dict value 'a' must be a Tensor, "
                                                  "found a int")));
}

// Found by tools/fuzz.sh (a leak under ASan): a pickle whose dict is set as an item of
// itself through the memo. The reader must refuse it and free everything.
TEST(StateDictFile, SelfContainingDictFromTheFuzzer) {
  static const char kPickle[] =
      "\x80\x02"
      "ccollections\nOrderedDict\nq\x00)Rq\x01(X\x01\x00\x00\x00wq\x02"
      "ctorch._utils\n_rebuild_tensor_v2\x10tq\x08QK\x00K\x03M\x03\x86q\tK\x03K\x01S"
      "\x86q\n\x89h\x00)Rqhhhhhhhhhhhhhsssb.";
  const std::string pickle(kPickle, sizeof(kPickle) - 1);  // it holds NUL bytes
  const fs::path path = scratch("fuzz_regression") / "leak.pt";
  {
    std::ofstream out(path, std::ios::binary);
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
      out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
      return n;
    });
    writer.writeRecord("data.pkl", pickle.data(), pickle.size());
    const std::string storage(64, '\0');
    writer.writeRecord("data/0", storage.data(), storage.size());
    writer.writeEndOfFile();
  }
  EXPECT_THAT([&] { load_state_dict(path.string()); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot read '" + path.string())));
}

}  // namespace
}  // namespace fsdp
