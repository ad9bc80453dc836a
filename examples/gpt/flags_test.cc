// The trainer's flag checks (issue 15): each bad value is one line naming the flag, the
// value and what is allowed; before, these crashed (SIGFPE), ran nonsense (nan losses,
// one rank for --world_size=0) or were OOM-killed.
#include "examples/gpt/flags.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace fsdp::examples {
namespace {

const MachineLimits kMachine{/*cores=*/2, /*max_ranks=*/8, /*available_bytes=*/int64_t{20} << 30,
                             /*cuda_devices=*/0, /*why_no_cuda=*/""};

std::string error_of(void (*change)(TrainerFlags&)) {
  TrainerFlags flags;
  change(flags);
  return flag_error(flags, kMachine);
}

TEST(TrainerFlagsTest, TheDefaultsAreValid) { EXPECT_EQ(flag_error(TrainerFlags(), kMachine), ""); }

TEST(TrainerFlagsTest, EveryBadValueIsNamed) {
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.heads = 0; }),
            "--heads=0: expected a positive divisor of --width=128 (each head gets width / "
            "heads channels)");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.heads = 5; }),
            "--heads=5: expected a positive divisor of --width=128 (each head gets width / "
            "heads channels)");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.eval_interval = 0; }),
            "--eval_interval=0: expected at least 1 step");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.log_interval = 0; }),
            "--log_interval=0: expected at least 1 step");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.world_size = 0; }),
            "--world_size=0: expected 1 to 8 ranks on this machine (2 cores x 4; each rank "
            "is a process)");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.world_size = -1; }),
            "--world_size=-1: expected 1 to 8 ranks on this machine (2 cores x 4; each rank "
            "is a process)");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.world_size = 1000; }),
            "--world_size=1000: expected 1 to 8 ranks on this machine (2 cores x 4; each "
            "rank is a process)");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.lr = std::numeric_limits<double>::quiet_NaN(); }),
            "--lr=nan: expected a finite learning rate >= 0");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.lr = std::numeric_limits<double>::infinity(); }),
            "--lr=inf: expected a finite learning rate >= 0");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.lr = -1; }),
            "--lr=-1: expected a finite learning rate >= 0");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.batch_size = 0; }),
            "--batch_size=0: expected a positive multiple of the world size 2 (every rank "
            "trains on an equal share)");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.batch_size = 33; }),
            "--batch_size=33: expected a positive multiple of the world size 2 (every rank "
            "trains on an equal share)");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.context = 0; }),
            "--context=0: expected at least 1 token");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.width = -65; }),
            "--width=-65: expected a positive embedding width");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.layers = 0; }),
            "--layers=0: expected at least 1 transformer block");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.steps = -3; }),
            "--steps=-3: expected 0 or more training steps");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.timeout_s = 0; }),
            "--timeout_s=0: expected at least 1 second to wait for the other ranks");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.checkpoint_interval = -1; }),
            "--checkpoint_interval=-1: expected 0 (none) or more steps");
  EXPECT_EQ(error_of([](TrainerFlags& f) {
              f.sharding_strategy = "hybrid_shard";
              f.hybrid_shard_group_size = 3;
            }),
            "--hybrid_shard_group_size=3: expected 0 (the ranks of one host) or a divisor of "
            "the world size 2");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.sharding_strategy = "zero3"; }),
            "--sharding_strategy=zero3: expected full_shard, shard_grad_op, no_shard, "
            "hybrid_shard or hybrid_shard_zero2");
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.policy = "size"; }),
            "--policy=size: expected transformer (each block a unit) or root (one unit)");
  // One rank runs HYBRID as NO_SHARD (resuming a hybrid run's checkpoint there).
  EXPECT_EQ(error_of([](TrainerFlags& f) {
              f.world_size = 1;
              f.sharding_strategy = "hybrid_shard";
              f.hybrid_shard_group_size = 2;
            }),
            "");
}

TEST(TrainerFlagsTest, StrategiesAlsoGoByTheirPyTorchNames) {
  EXPECT_EQ(error_of([](TrainerFlags& f) { f.sharding_strategy = "SHARD_GRAD_OP"; }), "");
  // A hybrid strategy however spelled: its group size must divide the world size.
  EXPECT_EQ(error_of([](TrainerFlags& f) {
              f.sharding_strategy = "_HYBRID_SHARD_ZERO2";
              f.hybrid_shard_group_size = 3;
            }),
            "--hybrid_shard_group_size=3: expected 0 (the ranks of one host) or a divisor of "
            "the world size 2");
}

TEST(TrainerFlagsTest, UnderALauncherTheWorldSizeIsItsAndNotCapped) {
  TrainerFlags flags;
  flags.launched_world_size = 16;  // e.g. torchrun over several hosts
  flags.world_size = 0;            // ignored then
  EXPECT_EQ(flag_error(flags, kMachine), "");
  flags.batch_size = 24;
  EXPECT_EQ(flag_error(flags, kMachine),
            "--batch_size=24: expected a positive multiple of the world size 16 (every rank "
            "trains on an equal share)");
}

TEST(TrainerFlagsTest, AModelThatCannotFitIsRefusedFromItsSize) {
  TrainerFlags flags;
  flags.width = 96;
  flags.context = 100000000;
  // AdamW state of 12 x 4 x 96^2 + (256 + 1e8) x 96 parameters (the position embedding
  // grows with the context), and 4 layers x 16 sequences per rank x 4 heads x 1e16 x 8
  // bytes of attention: far beyond 20 GiB.
  EXPECT_DOUBLE_EQ(lower_bound_bytes_per_rank(flags),
                   16.0 * (12 * 4 * 96 * 96 + (256 + 1e8) * 96) + 8 * 4 * 16 * 4 * 1e16);
  EXPECT_THAT(flag_error(flags, kMachine),
              ::testing::StartsWith("--context=100000000, --batch_size=32, --width=96, "
                                    "--layers=4: one step needs at least 20480000153.6 GB "
                                    "per rank (AdamW state and every layer's attention "
                                    "scores), more than the 10.7 GB available to each of 2 "
                                    "ranks here"));
  flags.context = 64;
  // 12 x 4 x 96^2 + (256 + 64) x 96 = 473,088 parameters: 7.6 MB of AdamW state, plus
  // 4 x 16 x 4 x 64^2 x 8 = 8.4 MB of attention.
  EXPECT_DOUBLE_EQ(lower_bound_bytes_per_rank(flags), 16.0 * 473088 + 8388608);
}

// The compute device (issue 18 item 4): --device is checked up front like the others.
TEST(TrainerFlagsTest, CudaWithoutADeviceIsRefusedWithTheRuntimesReason) {
  MachineLimits machine = kMachine;
  machine.why_no_cuda = "cudaGetDeviceCount: cudaErrorNoDevice: no CUDA-capable device is detected";
  TrainerFlags flags;
  flags.device = "cuda";
  EXPECT_EQ(flag_error(flags, machine),
            "--device=cuda: expected a CUDA device, but this process sees none "
            "(cudaGetDeviceCount: cudaErrorNoDevice: no CUDA-capable device is detected); "
            "pass --device=cpu, or run where a GPU is visible");
  flags.device = "auto";  // the CPU then
  EXPECT_EQ(flag_error(flags, machine), "");
  flags.device = "gpu";
  EXPECT_EQ(flag_error(flags, machine),
            "--device=gpu: expected auto (CUDA when this process sees a CUDA device, else the "
            "CPU), cpu or cuda");
  flags.device = "cpu";
  flags.mixed_precision = "fp16";
  EXPECT_EQ(flag_error(flags, machine),
            "--mixed_precision=fp16: expected auto (bf16 on CUDA or for a 16-bit checkpoint, "
            "else none), bf16 (bf16 compute, fp32 master weights), pure_bf16 or none (fp32)");
  flags.mixed_precision = "pure_bf16";
  EXPECT_EQ(flag_error(flags, machine), "");
  flags.mixed_precision = "none";
  flags.peak_tflops = -1;
  EXPECT_EQ(flag_error(flags, machine),
            "--peak_tflops=-1: expected 0 (the device's peak from the table in "
            "examples/gpt/mfu.cc) or the peak dense bf16 TFLOP/s of the device");
}

TEST(TrainerFlagsTest, OnCudaEachSelfLaunchedRankNeedsADevice) {
  MachineLimits machine = kMachine;
  machine.cuda_devices = 1;
  TrainerFlags flags;
  flags.device = "cuda";
  EXPECT_EQ(flag_error(flags, machine),
            "--world_size=2: expected 1 to 1 ranks with --device=cuda (one CUDA device per "
            "rank; this process sees 1)");
  flags.world_size = 1;
  EXPECT_EQ(flag_error(flags, machine), "");
  // Host memory does not bound a CUDA run (this one needs far more than 20 GiB).
  flags.context = 100000;
  EXPECT_EQ(flag_error(flags, machine), "");
}

// The parsing the GPT binaries share (train, benchmarks/peer/gpt_fsdp, llama finetune).
TEST(SharedFlagsTest, StrategiesTheBinaryTakesAndOneLineForOthers) {
  EXPECT_EQ(sharding_strategy_error("sharding_strategy", "hybrid_shard", /*allow_hybrid=*/true),
            "");
  EXPECT_EQ(sharding_strategy_error("strategy", "hybrid_shard", /*allow_hybrid=*/false),
            "--strategy=hybrid_shard: expected full_shard, shard_grad_op or no_shard");
  EXPECT_EQ(sharding_strategy_flag("strategy", "SHARD_GRAD_OP", /*allow_hybrid=*/false),
            ShardingStrategy::kShardGradOp);
  EXPECT_EQ(sharding_strategy_flag("sharding_strategy", "hybrid_shard_zero2",
                                   /*allow_hybrid=*/true),
            ShardingStrategy::kHybridShardZero2);
  try {
    sharding_strategy_flag("strategy", "zero3", /*allow_hybrid=*/false);
    ADD_FAILURE() << "no error for --strategy=zero3";
  } catch (const c10::Error& e) {
    EXPECT_EQ(e.msg(), "--strategy=zero3: expected full_shard, shard_grad_op or no_shard");
  }
}

TEST(SharedFlagsTest, ResolvedDeviceAndMixedPrecision) {
  EXPECT_EQ(compute_device("cpu"), c10::Device(c10::kCPU));
  EXPECT_FALSE(mixed_precision_flag("none").has_value());
  const c10::optional<MixedPrecision> bf16 = mixed_precision_flag("bf16");
  ASSERT_TRUE(bf16.has_value());
  EXPECT_EQ(bf16->param_dtype(), c10::optional<at::ScalarType>(at::kBFloat16));
  EXPECT_EQ(bf16->reduce_dtype(), c10::optional<at::ScalarType>(at::kFloat));
}

TEST(TrainerFlagsTest, AutoMeansCudaWhenADeviceIsSeen) {
  EXPECT_EQ(resolve_device("auto", 0), "cpu");
  EXPECT_EQ(resolve_device("auto", 2), "cuda");
  EXPECT_EQ(resolve_device("cpu", 2), "cpu");
  EXPECT_EQ(resolve_device("cuda", 2), "cuda");
  EXPECT_EQ(resolve_mixed_precision("auto", "cuda"), "bf16");
  EXPECT_EQ(resolve_mixed_precision("auto", "cpu"), "none");
  EXPECT_EQ(resolve_mixed_precision("none", "cuda"), "none");
  EXPECT_EQ(resolve_mixed_precision("bf16", "cpu"), "bf16");
  // A 16-bit checkpoint (the fine-tune trainer's folder): bf16 compute with fp32 master
  // weights on the CPU too; pure bf16 only when asked.
  EXPECT_EQ(resolve_mixed_precision("auto", "cpu", at::kBFloat16), "bf16");
  EXPECT_EQ(resolve_mixed_precision("auto", "cpu", at::kHalf), "bf16");
  EXPECT_EQ(resolve_mixed_precision("auto", "cpu", at::kFloat), "none");
  EXPECT_EQ(resolve_mixed_precision("pure_bf16", "cpu", at::kBFloat16), "pure_bf16");
  EXPECT_EQ(resolve_mixed_precision("none", "cpu", at::kBFloat16), "none");
  EXPECT_EQ(model_dtype("pure_bf16"), at::kBFloat16);
  EXPECT_EQ(model_dtype("bf16"), at::kFloat);
  EXPECT_EQ(model_dtype("none"), at::kFloat);
}

// The levers both trainers check the same way (examples/llama/finetune calls
// lever_flag_error too): micro-batches must split every rank's share evenly.
TEST(SharedFlagsTest, GradientAccumulationSplitsEachRanksShareEvenly) {
  LeverFlags levers;
  levers.grad_accumulation_steps = 4;
  EXPECT_EQ(
      lever_flag_error(levers, /*world=*/2, /*self_launched=*/true, /*batch_size=*/16, kMachine),
      "");
  EXPECT_EQ(lever_flag_error(levers, 2, true, 12, kMachine),
            "--batch_size=12: expected a positive multiple of the world size 2 x "
            "--grad_accumulation_steps=4 (every rank trains on an equal share, in equal "
            "micro-batches)");
  levers.grad_accumulation_steps = 0;
  EXPECT_EQ(lever_flag_error(levers, 2, true, 16, kMachine),
            "--grad_accumulation_steps=0: expected at least 1 micro-batch per optimizer step");
  levers.grad_accumulation_steps = 1;
  levers.activation_checkpointing = true;
  levers.cpu_offload = true;
  EXPECT_EQ(lever_flag_error(levers, 2, true, 2, kMachine), "");
  // The GPT trainer's message is the same one.
  TrainerFlags flags;
  flags.grad_accumulation_steps = 3;
  EXPECT_EQ(flag_error(flags, kMachine),
            "--batch_size=32: expected a positive multiple of the world size 2 x "
            "--grad_accumulation_steps=3 (every rank trains on an equal share, in equal "
            "micro-batches)");
}

TEST(SharedFlagsTest, LeverOptionsAreTheFsdpOptionsOfTheFlags) {
  LeverFlags levers;
  levers.device = "cpu";
  levers.mixed_precision = "bf16";
  levers.cpu_offload = true;
  levers.sharding_strategy = "hybrid_shard";
  levers.hybrid_shard_group_size = 2;
  const FullyShardedDataParallelOptions options = lever_options(nullptr, levers);
  EXPECT_EQ(options.sharding_strategy(), ShardingStrategy::kHybridShard);
  EXPECT_EQ(options.hybrid_shard_group_size(), 2);
  EXPECT_TRUE(options.cpu_offload().offload_params());
  ASSERT_TRUE(options.mixed_precision().has_value());
  EXPECT_EQ(options.mixed_precision()->param_dtype(), c10::optional<at::ScalarType>(at::kBFloat16));
  EXPECT_EQ(options.mixed_precision()->reduce_dtype(), c10::optional<at::ScalarType>(at::kFloat));
  levers.mixed_precision = "pure_bf16";  // the model's own dtype, no MixedPrecision
  levers.sharding_strategy = "shard_grad_op";
  const FullyShardedDataParallelOptions plain = lever_options(nullptr, levers);
  EXPECT_EQ(plain.sharding_strategy(), ShardingStrategy::kShardGradOp);
  EXPECT_EQ(plain.hybrid_shard_group_size(), 0);
  EXPECT_FALSE(plain.mixed_precision().has_value());
}

TEST(TrainerFlagsTest, CudaDefaultsApplyOnlyToFlagsNotGiven) {
  const auto none = [](const std::string&) { return false; };
  EXPECT_EQ(cuda_defaults(TrainerFlags(), 1, none),
            (std::vector<FlagValue>{{"world_size", "1"},
                                    {"width", "768"},
                                    {"layers", "12"},
                                    {"heads", "12"},
                                    {"context", "256"},
                                    {"lr", "6e-4"},
                                    {"batch_size", "64"},
                                    {"checkpoint_interval", "600"}}));
  // Given flags win; the batch is rounded up to a multiple of the world size.
  TrainerFlags flags;
  flags.world_size = 3;
  flags.width = 256;
  const auto given = [](const std::string& name) {
    return name == "world_size" || name == "width" || name == "lr";
  };
  EXPECT_EQ(cuda_defaults(flags, 8, given),
            (std::vector<FlagValue>{{"layers", "12"},
                                    {"heads", "12"},
                                    {"context", "256"},
                                    {"batch_size", "66"},
                                    {"checkpoint_interval", "600"}}));
  // Under a launcher its world size counts; every device a rank: 8 ranks.
  flags.launched_world_size = 5;
  EXPECT_EQ(cuda_defaults(flags, 8, given)[3], (FlagValue{"batch_size", "65"}));
  EXPECT_EQ(cuda_defaults(TrainerFlags(), 8, none)[6], (FlagValue{"batch_size", "64"}));
}

// The path flags (issue 15 item 1): checked before any rank starts. Before, a bad
// --out_dir gave "train: filesystem error: cannot create directories: No such file or
// directory [/proc/x]" (status 1, no flag named) and a bad --data_dir was found by the
// ranks.
// The trainer's path flags: --data_dir (data_dir_error), then --out_dir and
// --checkpoint_dir (the run flags' check, through flag_error).
struct PathFlags {
  std::string out_dir, checkpoint_dir, data_dir;
};

std::string path_flag_error(const PathFlags& paths) {
  if (std::string error = data_dir_error(paths.data_dir); !error.empty()) return error;
  TrainerFlags flags;
  flags.out_dir = paths.out_dir;
  flags.checkpoint_dir = paths.checkpoint_dir;
  return flag_error(flags, kMachine);
}

class PathFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/path_flags_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
    data_ = root_ + "/data";
    std::filesystem::create_directories(data_);
    std::ofstream(data_ + "/jokes") << "a joke\n%\nanother\n";
    std::ofstream(data_ + "/jokes.dat") << "index";  // skipped: has an extension
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  // Everything under root_, to show that a check leaves nothing behind.
  std::vector<std::string> listing() const {
    std::vector<std::string> paths;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root_)) {
      paths.push_back(entry.path().string());
    }
    std::sort(paths.begin(), paths.end());
    return paths;
  }

  std::string root_, data_;
};

TEST_F(PathFlagsTest, ExistingAndMakeableFoldersAreAcceptedAndNothingIsMade) {
  const std::vector<std::string> before = listing();
  EXPECT_EQ(path_flag_error({root_, "", data_}), "");
  EXPECT_EQ(path_flag_error({root_ + "/new/deeper/out", root_ + "/elsewhere/ckpt/", data_}), "");
  EXPECT_EQ(path_flag_error({root_ + "/new/", "", data_ + "/"}), "");
  EXPECT_EQ(listing(), before);
}

TEST_F(PathFlagsTest, EveryBadPathIsNamed) {
  const std::string data_expected =
      ": expected a folder of readable fortune files (files without an extension, as "
      "Debian's fortunes package installs them: tools/setup.sh); ";
  EXPECT_EQ(path_flag_error({root_, "", root_ + "/nope"}),
            "--data_dir=" + root_ + "/nope" + data_expected +
                "cannot open it: No such file or directory");
  EXPECT_EQ(path_flag_error({root_, "", data_ + "/jokes"}),
            "--data_dir=" + data_ + "/jokes" + data_expected + "it is not a folder");
  std::filesystem::create_directories(root_ + "/only_indexes/sub");
  std::ofstream(root_ + "/only_indexes/jokes.dat") << "index";
  EXPECT_EQ(path_flag_error({root_, "", root_ + "/only_indexes"}),
            "--data_dir=" + root_ + "/only_indexes" + data_expected + "it holds none");
  // A link that loops cannot be opened, also by root.
  std::filesystem::create_symlink("loop", data_ + "/loop");
  EXPECT_EQ(path_flag_error({root_, "", data_}), "--data_dir=" + data_ + data_expected +
                                                     "cannot read '" + data_ +
                                                     "/loop': Too many levels of symbolic links");
  std::filesystem::remove(data_ + "/loop");

  const std::string out_expected =
      ": expected a folder that can be written, or made (metrics.csv, the model and the "
      "checkpoints go there); ";
  // Nothing can be made in /proc, also by root (for whom access() says it is writable).
  EXPECT_EQ(path_flag_error({"/proc/x", "", data_}),
            "--out_dir=/proc/x" + out_expected +
                "cannot make a folder in '/proc': No such file or directory");
  EXPECT_EQ(
      path_flag_error({data_ + "/jokes/out", "", data_}),
      "--out_dir=" + data_ + "/jokes/out" + out_expected + "'" + data_ + "/jokes' is not a folder");
  EXPECT_EQ(path_flag_error({"", "", data_}), "--out_dir=" + out_expected + "the path is empty");
  EXPECT_EQ(path_flag_error({root_, data_ + "/jokes", data_}),
            "--checkpoint_dir=" + data_ +
                "/jokes: expected a folder that can be written, or made (the checkpoints go "
                "there); '" +
                data_ + "/jokes' is not a folder");
}

}  // namespace
}  // namespace fsdp::examples
