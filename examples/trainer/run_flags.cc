#include "examples/trainer/run_flags.h"

#include <cmath>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>

#include "examples/trainer/lever_flags.h"
#include "fsdp/comm/rendezvous.h"

namespace fsdp::examples {
namespace {

struct Defaults {
  RunFlags flags;
  bool taken = false;  // a flag's default was read
};

Defaults& defaults() {
  static Defaults* d = new Defaults();  // never destroyed: flags outlive static destructors
  return *d;
}

// The default of a flag, when absl first reads the flag.
const RunFlags& taken() {
  defaults().taken = true;
  return defaults().flags;
}

}  // namespace
}  // namespace fsdp::examples

using fsdp::examples::taken;

// Note [Defaults per trainer]
// absl takes a flag's default expression when the flag is first read, not at static
// initialisation, so the expressions below read the defaults use_run_flag_defaults set
// at the top of main().
ABSL_FLAG(int, world_size, taken().world_size,
          "ranks to start when not launched by fsdp_run/torchrun/mpirun/srun");
ABSL_FLAG(int64_t, batch_size, taken().batch_size,
          "global batch (sequences), split evenly across ranks");
ABSL_FLAG(int64_t, steps, taken().steps, "training steps");
ABSL_FLAG(double, lr, taken().lr, "peak learning rate (AdamW)");
ABSL_FLAG(int64_t, warmup_steps, taken().warmup_steps,
          "linear warm-up steps, then cosine decay to lr / 10");
ABSL_FLAG(int64_t, context, taken().context, "tokens per training sequence");
ABSL_FLAG(int64_t, seed, taken().seed, "seed of the initial weights and of the data order");
ABSL_FLAG(int64_t, log_interval, taken().log_interval, "steps between progress lines");
ABSL_FLAG(std::string, out_dir, taken().out_dir,
          "where metrics.csv, memory_rank<R>.csv, the model and the checkpoints go");
ABSL_FLAG(std::string, checkpoint_dir, taken().checkpoint_dir,
          "sharded checkpoints (default: OUT_DIR/checkpoints)");
ABSL_FLAG(int64_t, checkpoint_interval, taken().checkpoint_interval,
          "steps between sharded checkpoints (0: none)");
ABSL_FLAG(std::string, checkpoint_format, taken().checkpoint_format,
          "dcp: PyTorch Distributed Checkpoint folders (.metadata, __RANK_0.distcp; "
          "torch.distributed.checkpoint.load reads them) holding {\"model\", \"optim\", "
          "\"step\", \"lr_scheduler\"}; fsdp: fsdp's own (metadata.pt, rank_NNNNN.pt)");
ABSL_FLAG(bool, async_save, taken().async_save,
          "write checkpoints in the background (training stops only for the copy to host "
          "memory); false: training waits for each write");
ABSL_FLAG(bool, overwrite, taken().overwrite,
          "start over in an --out_dir that holds another run's checkpoints (deletes them) or "
          "results (metrics.csv; rewritten)");
ABSL_FLAG(std::string, resume, taken().resume,
          "--resume: continue from the newest complete checkpoint in the checkpoint folder "
          "(either format); --resume=DIR: from checkpoint folder DIR, e.g. one PyTorch's "
          "dcp.save wrote with {\"model\", \"optim\", \"step\"} as get_state_dict lays them out");
ABSL_FLAG(int64_t, timeout_s, taken().timeout_s,
          "seconds to wait for every rank at start-up and in each collective; a rank that "
          "died is usually noticed at once (its connections close)");
ABSL_FLAG(int64_t, schedule_check_every, taken().schedule_check_every,
          "compare the ranks' collective schedules every N FSDP iterations (forward and "
          "backward, or an evaluation forward) and after the last step, so that ranks that "
          "took different branches stop with one error naming the step and the collective "
          "(FullyShardedDataParallelOptions::schedule_check_every); 0: off. Gloo only (off "
          "with NCCL)");

namespace fsdp::examples {

void use_run_flag_defaults(const RunFlags& flags) {
  TORCH_CHECK(!defaults().taken,
              "use_run_flag_defaults: a run flag was read before its defaults were set; call "
              "it first thing in main()");
  defaults().flags = flags;
}

RunFlags run_flags_from_command_line() {
  RunFlags f;
  static_cast<LeverFlags&>(f) = lever_flags_from_command_line();
  // Any launcher rendezvous.h reads (torchrun's RANK, Open MPI's, MPICH's, Slurm's): a
  // rank that only looked for RANK started --world_size ranks of its own under mpirun.
  try {
    const LaunchEnvironment launch = read_launch_environment();
    if (launch.launcher != "none") f.launched_world_size = launch.world_size;
  } catch (const c10::Error& e) {
    f.launch_error = e.msg();
  }
  f.world_size = absl::GetFlag(FLAGS_world_size);
  f.batch_size = absl::GetFlag(FLAGS_batch_size);
  f.steps = absl::GetFlag(FLAGS_steps);
  f.lr = absl::GetFlag(FLAGS_lr);
  f.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  f.context = absl::GetFlag(FLAGS_context);
  f.seed = absl::GetFlag(FLAGS_seed);
  f.log_interval = absl::GetFlag(FLAGS_log_interval);
  f.out_dir = absl::GetFlag(FLAGS_out_dir);
  f.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  f.checkpoint_interval = absl::GetFlag(FLAGS_checkpoint_interval);
  f.checkpoint_format = absl::GetFlag(FLAGS_checkpoint_format);
  f.async_save = absl::GetFlag(FLAGS_async_save);
  f.overwrite = absl::GetFlag(FLAGS_overwrite);
  f.resume = absl::GetFlag(FLAGS_resume);
  f.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  f.schedule_check_every = absl::GetFlag(FLAGS_schedule_check_every);
  return f;
}

ResumeFlag parse_resume_flag(const std::string& value) {
  if (value.empty() || value == "false" || value == "0") return {};
  if (value == "latest" || value == "true" || value == "1") return {true, ""};
  return {true, value};
}

std::string run_flag_error(const RunFlags& f, const MachineLimits& machine) {
  if (!f.launch_error.empty()) return f.launch_error;
  if (f.launched_world_size == 0 && (f.world_size < 1 || f.world_size > machine.max_ranks)) {
    return bad_flag(
        "world_size", f.world_size,
        absl::StrCat("1 to ", machine.max_ranks, " ranks on this machine (", machine.cores,
                     " cores x ", kMaxRanksPerCore, "; each rank is a process)"));
  }
  if (std::string error =
          lever_flag_error(f, f.world(), f.launched_world_size == 0, f.batch_size, machine);
      !error.empty()) {
    return error;
  }
  if (f.context < 1) return bad_flag("context", f.context, "at least 1 token");
  if (f.steps < 0) return bad_flag("steps", f.steps, "0 or more training steps");
  if (!std::isfinite(f.lr) || f.lr < 0) return bad_flag("lr", f.lr, "a finite learning rate >= 0");
  if (f.warmup_steps < 0) return bad_flag("warmup_steps", f.warmup_steps, "0 or more steps");
  if (f.log_interval < 1) return bad_flag("log_interval", f.log_interval, "at least 1 step");
  if (f.checkpoint_interval < 0) {
    return bad_flag("checkpoint_interval", f.checkpoint_interval, "0 (none) or more steps");
  }
  if (f.checkpoint_format != "dcp" && f.checkpoint_format != "fsdp") {
    return bad_flag("checkpoint_format", f.checkpoint_format,
                    "dcp (PyTorch Distributed Checkpoint) or fsdp");
  }
  if (f.timeout_s < 1) {
    return bad_flag("timeout_s", f.timeout_s, "at least 1 second to wait for the other ranks");
  }
  if (f.schedule_check_every < 0) {
    return bad_flag("schedule_check_every", f.schedule_check_every, "0 (off) or more iterations");
  }
  if (f.overwrite && parse_resume_flag(f.resume).resume) {
    return absl::StrCat("--resume=", f.resume,
                        " and --overwrite: expected one of them (--resume continues the run in "
                        "--out_dir, --overwrite starts it over)");
  }
  if (std::string error = output_dir_error("out_dir", f.out_dir,
                                           "metrics.csv, the model and the checkpoints go there");
      !error.empty()) {
    return error;
  }
  if (!f.checkpoint_dir.empty()) {
    return output_dir_error("checkpoint_dir", f.checkpoint_dir, "the checkpoints go there");
  }
  return "";
}

}  // namespace fsdp::examples
