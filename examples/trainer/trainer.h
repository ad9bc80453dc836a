// A training run as both trainers (examples/gpt:train, examples/llama:finetune) run it:
// main()'s checks and launch (trainer_main), and the run's plumbing (TrainingRun): the
// ranks' process group, their agreement on every flag, the run folder's lock, fresh or
// resumed checkpoints, periodic checkpoints (either format, in the background with
// --async_save), metrics.csv and memory_rank<R>.csv, progress lines, and the per-rank
// figures at the end. Each trainer keeps only its model, data and evaluation.
//
//   int main(int argc, char** argv) {
//     return fsdp::examples::trainer_main(argc, argv, "train", my_hooks);
//   }
//   int run() {  // my_hooks.run, on every rank
//     fsdp::examples::TrainingRun run(fsdp::examples::run_flags_from_command_line());
//     Model model(net, fsdp::examples::lever_options(run.comm_ptr(), levers));
//     torch::optim::AdamW adamw(model->parameters(), ...);
//     for (int64_t step = run.start(*model, adamw); step < steps; ++step) {
//       ... forward, backward, adamw.step() ...
//       run.check_loss(step + 1, train_loss);  // the mean over ranks
//       run.checkpoint_if_due(step + 1, *model, adamw);
//       run.record(step + 1, {loss, std::nullopt, lr}, *model);
//     }
//     run.finish(*model);
//   }
//
// Collective members (every rank calls them in the same order) say so. Errors:
// c10::Error, one line naming the flag, folder or file and what to do. PyTorch: none (a
// trainer script's loop; torchtitan's Trainer is the closest).
#ifndef FSDP_EXAMPLES_TRAINER_TRAINER_H_
#define FSDP_EXAMPLES_TRAINER_TRAINER_H_

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ScalarType.h>
#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>

#include "examples/trainer/run_flags.h"
#include "fsdp/comm/communicator.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/tracking_allocator.h"
#include "fsdp/state/checkpoint.h"

namespace fsdp::examples {

// What a trainer adds to trainer_main.
struct TrainerHooks {
  // The run flags' defaults for this trainer (use_run_flag_defaults).
  RunFlags defaults;
  // The defaults to apply on CUDA for flags not given on the command line (e.g.
  // {"world_size", "8"}), given how many devices this process sees; may be empty.
  std::function<std::vector<FlagValue>(int cuda_devices)> cuda_defaults;
  // "" or one line: the trainer's own flags; run_flag_error has accepted the run flags.
  std::function<std::string(const MachineLimits&)> flag_error;
  // The dtype of the weights the run starts from (--mixed_precision=auto reads it); fp32
  // for a model the trainer initialises. Called once the flags were accepted.
  std::function<at::ScalarType()> weights_dtype;
  // The run itself, on every rank; its return value is the exit status.
  std::function<int()> run;
};

// A trainer's main(): enters the directory `bazel run` was started from
// (enter_build_working_directory, fsdp/comm/launcher.h), installs the caching CPU allocator, parses
// the command line (a bare --resume allowed; a positional argument is refused), applies the CUDA
// defaults, checks every flag before any rank starts or any file is touched (a bad one: one line
// "<name>: ..." on stderr, exit status 2), resolves --device and --mixed_precision,
// starts --world_size ranks of this program when no launcher did (Ctrl-C stops them
// all), and runs hooks.run on each rank, an exception becoming one line on stderr and
// exit status 1. `name` prefixes every message.
int trainer_main(int argc, char** argv, const char* name, const TrainerHooks& hooks);

// The first flag on which a rank differs from rank 0, as the line every rank raises
// ("rank 1 was started with --steps=40 but rank 0 with --steps=20; ..."), or "" when
// they agree. `flags[r]` holds rank r's flags, in one order on every rank.
std::string flag_difference(const std::vector<std::vector<FlagValue>>& flags);

// Every flag this program defines, by name: absl's own and --world_size (how many ranks
// to start, not the run's) left out.
std::vector<FlagValue> program_flags();

// Raises on every rank (flag_difference's line) unless every rank runs with rank 0's
// program_flags(): a rank with another --steps would leave the others waiting in a
// collective. Collective (two all-gathers on `device`).
void check_same_flags(Communicator& comm, c10::Device device);

// One rank's run: see the file comment. Not thread-safe; one per process.
class TrainingRun {
 public:
  // Collective: starts this rank's process group from the launch environment (Gloo on
  // the CPU, NCCL on cuda:LOCAL_RANK; --timeout_s), tracks its tensors' memory
  // (MemoryTracker), checks the ranks' flags agree and takes the run folder's lock
  // (lock_out_dir). `flags` must be the command line's (run_flags_from_command_line,
  // after trainer_main resolved --device).
  explicit TrainingRun(RunFlags flags);
  ~TrainingRun();
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  Communicator& comm() { return *comm_; }
  std::shared_ptr<Communicator> comm_ptr() { return comm_; }
  c10::Device device() const { return device_; }
  bool lead() const { return comm_->rank() == 0; }
  const RunFlags& flags() const { return flags_; }

  // Collective: the first step to run. With --resume, loads the newest checkpoint every
  // rank can read (or --resume=DIR) into `model` and `optimizer` (and `scheduler`, when
  // not null and the checkpoint holds one; one that holds none is set to the resumed
  // step with `lr_at`); else checks that the checkpoint folder holds no other run's
  // checkpoints (--overwrite deletes them) and --out_dir no other run's metrics.csv
  // (check_fresh_run). Then removes what an interrupted save left,
  // opens metrics.csv (rows up to the resumed step kept) and memory_rank<R>.csv. Call
  // once, before any record().
  int64_t start(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                SchedulerState* scheduler = nullptr,
                const std::function<double(int64_t)>& lr_at = nullptr);

  // After step `step` (1-based), before its checkpoint: raises if `train_loss` (the mean
  // over ranks, the same on every rank) is not finite, naming the step and, for the run's
  // first step, its inputs as the likelier cause: a diverged run stops with its earlier
  // checkpoints kept (--resume continues from the newest) and writes no model of NaNs.
  void check_loss(int64_t step, double train_loss) const;

  // Collective: after optimizer step `step` (1-based) has been taken, writes the sharded
  // checkpoint step_NNNNNNNN (model, optimizer, step, and `scheduler` when not null) if
  // --checkpoint_interval divides `step`: in --checkpoint_format, in the background with
  // --async_save (training waits only for the copy to host memory; an earlier write's
  // error is raised here or by finish()).
  void checkpoint_if_due(int64_t step, FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                         const SchedulerState* scheduler = nullptr);

  // What one step measured.
  struct StepRecord {
    double train_loss = 0;                  // the mean over ranks
    std::optional<double> validation_loss;  // when the step evaluated
    double lr = 0;
  };

  // After step `step` (1-based): rank 0 appends its row to metrics.csv (a row that cannot
  // be written, e.g. on a full disk, stops the run naming the file) and, every
  // --log_interval steps and at the last, prints the progress line (loss, lr, tokens/s,
  // `extra` when not empty, ETA); every rank appends its memory row (resident set and
  // tracked tensor bytes) at those steps. Not collective. Returns whether this step
  // printed a progress line.
  bool record(int64_t step, const StepRecord& record, FullyShardedRoot& model,
              const std::string& extra = "");

  // Tokens per second since start() (the global batch x --context per step).
  double tokens_per_second(int64_t step) const;

  // Collective: waits for the last background checkpoint, compares the steps since the
  // last periodic collective-schedule check, and rank 0 prints each rank's peak tracked
  // memory and bytes sent per step (every communicator the model uses, HYBRID's
  // subgroups included). Closes metrics.csv.
  void finish(FullyShardedRoot& model);

 private:
  RunFlags flags_;
  MemoryTracker memory_;
  c10::Device device_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Communicator> checkpoint_comm_;  // --async_save's
  int lock_ = -1;
  int64_t first_ = 0;
  std::ofstream csv_, memory_csv_;
  std::chrono::steady_clock::time_point start_time_;
};

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_TRAINER_TRAINER_H_
