// The run flags both trainers take (examples/gpt:train and examples/llama:finetune),
// defined once (run_flags.cc) under the same names with the same meaning:
//
//   --world_size=N           ranks this process starts when no launcher started it
//   --batch_size=N           global batch (sequences), split evenly across ranks
//   --steps=N  --lr=X  --warmup_steps=N  --context=N  --seed=N  --log_interval=N
//   --out_dir=DIR            metrics.csv, memory_rank<R>.csv, the model, .lock
//   --checkpoint_dir=DIR     sharded checkpoints ("": OUT_DIR/checkpoints)
//   --checkpoint_interval=N  --checkpoint_format=dcp|fsdp  --async_save  --overwrite
//   --resume[=DIR]  --timeout_s=N  --schedule_check_every=N
//
// Each trainer has its own defaults for some of them (a GPT from scratch and a
// fine-tune want different step counts and learning rates): it calls
// use_run_flag_defaults() first thing in main(), before anything reads a flag, and
// --help shows its defaults.
//
//   int main(int argc, char** argv) {
//     fsdp::examples::use_run_flag_defaults(my_defaults());
//     absl::ParseCommandLine(argc, argv);
//     const fsdp::examples::RunFlags flags = fsdp::examples::run_flags_from_command_line();
//
// Not thread-safe before ParseCommandLine (like absl flags). PyTorch: none (a trainer's
// command line).
#ifndef FSDP_EXAMPLES_TRAINER_RUN_FLAGS_H_
#define FSDP_EXAMPLES_TRAINER_RUN_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"

#include "examples/trainer/levers.h"

ABSL_DECLARE_FLAG(int, world_size);
ABSL_DECLARE_FLAG(int64_t, batch_size);
ABSL_DECLARE_FLAG(int64_t, steps);
ABSL_DECLARE_FLAG(double, lr);
ABSL_DECLARE_FLAG(int64_t, warmup_steps);
ABSL_DECLARE_FLAG(int64_t, context);
ABSL_DECLARE_FLAG(int64_t, seed);
ABSL_DECLARE_FLAG(int64_t, log_interval);
ABSL_DECLARE_FLAG(std::string, out_dir);
ABSL_DECLARE_FLAG(std::string, checkpoint_dir);
ABSL_DECLARE_FLAG(int64_t, checkpoint_interval);
ABSL_DECLARE_FLAG(std::string, checkpoint_format);
ABSL_DECLARE_FLAG(bool, async_save);
ABSL_DECLARE_FLAG(bool, overwrite);
ABSL_DECLARE_FLAG(std::string, resume);
ABSL_DECLARE_FLAG(int64_t, timeout_s);
ABSL_DECLARE_FLAG(int64_t, schedule_check_every);

namespace fsdp::examples {

// A --resume value (after run_support.h's allow_bare_resume_flag): "" (or false, 0) no resume;
// "latest" (or true, 1) the newest checkpoint in the checkpoint folder (run_support.h's
// resume_step); anything else a checkpoint folder (resume_from).
struct ResumeFlag {
  bool resume = false;
  std::string dir;  // the folder of --resume=DIR; empty for the newest
};
ResumeFlag parse_resume_flag(const std::string& value);

// The run flags' values (with the levers'). The member defaults are those of the flags
// when a binary calls no use_run_flag_defaults.
struct RunFlags : LeverFlags {
  int world_size = 2;           // ranks this process starts (self-launch)
  int launched_world_size = 0;  // WORLD_SIZE of fsdp_run/torchrun/mpirun/srun; 0: self-launch
  std::string launch_error;     // why the launcher's variables are unusable; "" if they are
  int64_t batch_size = 8, steps = 100, warmup_steps = 10, context = 128, seed = 1234;
  double lr = 1e-4;
  int64_t log_interval = 10, checkpoint_interval = 50, timeout_s = 300;
  std::string out_dir, checkpoint_dir, checkpoint_format = "dcp", resume;
  bool async_save = true, overwrite = false;
  int64_t schedule_check_every = kDefaultScheduleCheckEvery;

  // The ranks of the run: the launcher's, else world_size.
  int world() const { return launched_world_size > 0 ? launched_world_size : world_size; }
  // The checkpoint folder: checkpoint_dir, else OUT_DIR/checkpoints.
  std::string checkpoints() const {
    return checkpoint_dir.empty() ? out_dir + "/checkpoints" : checkpoint_dir;
  }
};

// A flag and the value it takes.
struct FlagValue {
  std::string name;
  std::string value;
  bool operator==(const FlagValue& other) const {
    return name == other.name && value == other.value;
  }
};

// Makes `defaults` the run flags' defaults (the levers keep theirs). Call before anything
// reads a flag (before absl::ParseCommandLine): a flag's default is taken when the flag
// is first read (Note [Defaults per trainer] in run_flags.cc). Throws c10::Error if a run
// flag's default was taken already.
void use_run_flag_defaults(const RunFlags& defaults);

// The flags' values (after absl::ParseCommandLine); launched_world_size (and launch_error)
// from the launcher's variables (read_launch_environment, fsdp/comm/rendezvous.h).
RunFlags run_flags_from_command_line();

// "" if the run flags are usable on `machine`, else one line: launch_error, or one naming
// the flag, the value and what is allowed: the levers (lever_flag_error), --world_size
// within the machine when self-launched, --steps, --warmup_steps, --checkpoint_interval
// >= 0, --lr finite and >= 0, --log_interval and --timeout_s >= 1, --context >= 1,
// --checkpoint_format dcp or fsdp, --schedule_check_every >= 0, and --out_dir (and
// --checkpoint_dir when given) folders that can be written or made (output_dir_error).
std::string run_flag_error(const RunFlags& flags, const MachineLimits& machine);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_TRAINER_RUN_FLAGS_H_
