// The run flags: each trainer's defaults are the flags' defaults (--help shows them), and
// each bad value is one line naming the flag.
#include "examples/trainer/run_flags.h"

#include <cstdlib>
#include <limits>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp::examples {
namespace {

const MachineLimits kMachine{/*cores=*/2, /*max_ranks=*/8, /*available_bytes=*/int64_t{20} << 30,
                             /*cuda_devices=*/0, /*why_no_cuda=*/""};

// A trainer's defaults, set before any flag is read (the first test of this binary: the
// flags are process-wide).
TEST(RunFlagsTest, ATrainersDefaultsAreTheFlagsDefaults) {
  RunFlags defaults;
  defaults.steps = 1200;
  defaults.lr = 3e-3;
  defaults.out_dir = "/tmp/fsdp_gpt";
  use_run_flag_defaults(defaults);
  EXPECT_EQ(absl::GetFlag(FLAGS_steps), 1200);
  EXPECT_EQ(absl::GetFlag(FLAGS_lr), 3e-3);
  EXPECT_EQ(absl::GetFlag(FLAGS_out_dir), "/tmp/fsdp_gpt");
  EXPECT_EQ(absl::GetFlag(FLAGS_batch_size), 8);  // RunFlags' own
  // What --help prints as the default.
  EXPECT_EQ(absl::FindCommandLineFlag("steps")->DefaultValue(), "1200");
  EXPECT_EQ(absl::FindCommandLineFlag("checkpoint_format")->DefaultValue(), "dcp");
  // Too late once a default was taken.
  try {
    use_run_flag_defaults(RunFlags());
    ADD_FAILURE() << "no error for defaults set after a flag was read";
  } catch (const c10::Error& e) {
    EXPECT_EQ(e.msg(),
              "use_run_flag_defaults: a run flag was read before its defaults were set; call "
              "it first thing in main()");
  }
  const RunFlags flags = run_flags_from_command_line();
  EXPECT_EQ(flags.steps, 1200);
  EXPECT_EQ(flags.checkpoints(), "/tmp/fsdp_gpt/checkpoints");
}

std::string error_of(void (*change)(RunFlags&)) {
  RunFlags flags;
  const char* tmp = std::getenv("TEST_TMPDIR");
  flags.out_dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/run";
  change(flags);
  return run_flag_error(flags, kMachine);
}

TEST(RunFlagsTest, EveryBadValueIsNamed) {
  EXPECT_EQ(error_of([](RunFlags&) {}), "");
  EXPECT_EQ(error_of([](RunFlags& f) { f.world_size = 9; }),
            "--world_size=9: expected 1 to 8 ranks on this machine (2 cores x 4; each rank is "
            "a process)");
  EXPECT_EQ(error_of([](RunFlags& f) {
              f.launched_world_size = 16;  // a launcher's: not capped by this machine
              f.world_size = 0;
              f.batch_size = 32;
            }),
            "");
  EXPECT_EQ(error_of([](RunFlags& f) { f.batch_size = 7; }),
            "--batch_size=7: expected a positive multiple of the world size 2 (every rank "
            "trains on an equal share)");
  EXPECT_EQ(error_of([](RunFlags& f) { f.context = 0; }), "--context=0: expected at least 1 token");
  EXPECT_EQ(error_of([](RunFlags& f) { f.steps = -1; }),
            "--steps=-1: expected 0 or more training steps");
  EXPECT_EQ(error_of([](RunFlags& f) { f.steps = 0; }), "");
  EXPECT_EQ(error_of([](RunFlags& f) { f.lr = std::numeric_limits<double>::quiet_NaN(); }),
            "--lr=nan: expected a finite learning rate >= 0");
  EXPECT_EQ(error_of([](RunFlags& f) { f.lr = -1; }),
            "--lr=-1: expected a finite learning rate >= 0");
  EXPECT_EQ(error_of([](RunFlags& f) { f.warmup_steps = -1; }),
            "--warmup_steps=-1: expected 0 or more steps");
  EXPECT_EQ(error_of([](RunFlags& f) { f.log_interval = 0; }),
            "--log_interval=0: expected at least 1 step");
  EXPECT_EQ(error_of([](RunFlags& f) { f.checkpoint_interval = -1; }),
            "--checkpoint_interval=-1: expected 0 (none) or more steps");
  EXPECT_EQ(error_of([](RunFlags& f) { f.checkpoint_format = "zip"; }),
            "--checkpoint_format=zip: expected dcp (PyTorch Distributed Checkpoint) or fsdp");
  EXPECT_EQ(error_of([](RunFlags& f) { f.timeout_s = 0; }),
            "--timeout_s=0: expected at least 1 second to wait for the other ranks");
  EXPECT_EQ(error_of([](RunFlags& f) { f.schedule_check_every = -1; }),
            "--schedule_check_every=-1: expected 0 (off) or more iterations");
  EXPECT_EQ(error_of([](RunFlags& f) { f.out_dir = ""; }),
            "--out_dir=: expected a folder that can be written, or made (metrics.csv, the model "
            "and the checkpoints go there); the path is empty");
  EXPECT_EQ(error_of([](RunFlags& f) { f.checkpoint_dir = "/proc/x"; }),
            "--checkpoint_dir=/proc/x: expected a folder that can be written, or made (the "
            "checkpoints go there); cannot make a folder in '/proc': No such file or directory");
  EXPECT_EQ(error_of([](RunFlags& f) {
              f.resume = "latest";
              f.overwrite = true;
            }),
            "--resume=latest and --overwrite: expected one of them (--resume continues the run "
            "in --out_dir, --overwrite starts it over)");
  EXPECT_EQ(error_of([](RunFlags& f) {
              f.resume = "false";
              f.overwrite = true;
            }),
            "");
  // The levers are checked with them.
  EXPECT_EQ(error_of([](RunFlags& f) { f.grad_accumulation_steps = 0; }),
            "--grad_accumulation_steps=0: expected at least 1 micro-batch per optimizer step");
}

// Every launcher rendezvous.h reads makes the run launched (no --world_size ranks of its
// own): Open MPI's and Slurm's variables as torchrun's; a bad value is the one error.
TEST(RunFlagsTest, EveryLaunchersWorldSizeIsTheRuns) {
  EXPECT_EQ(run_flags_from_command_line().launched_world_size, 0);
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  EXPECT_EQ(run_flags_from_command_line().launched_world_size, 3);
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_NTASKS", "4", 1);
  EXPECT_EQ(run_flags_from_command_line().launched_world_size, 4);
  setenv("SLURM_PROCID", "4", 1);
  EXPECT_EQ(run_flag_error(run_flags_from_command_line(), kMachine),
            "SLURM_PROCID='4' is not an integer in [0, 3]; check how the job was launched");
  unsetenv("SLURM_PROCID");
  unsetenv("SLURM_NTASKS");
}

}  // namespace
}  // namespace fsdp::examples
