// Pieces of an FSDP training run that the example trainers share (the GPT trainer,
// train.cc, and the Llama fine-tuner, examples/llama/finetune.cc): the run folder's lock,
// fresh or resumed sharded checkpoints, metrics.csv, the next-token loss, means over
// ranks, the learning-rate schedule and per-rank figures.
//
//   const int lock = fsdp::examples::lock_out_dir(*comm, out_dir, device);
//   fsdp::examples::check_fresh_run(*comm, out_dir, ckpt_dir, resume, overwrite, device);
//   const int64_t first = fsdp::examples::resume_step(*model, &adamw, ckpt_dir, resume, lead);
//   fsdp::examples::remove_leftover_checkpoints(ckpt_dir, lead);
//
// Collective functions (every rank calls them in the same order) say so. Errors:
// c10::Error, one line naming the folder or file and what to do.
#ifndef FSDP_EXAMPLES_TRAINER_RUN_SUPPORT_H_
#define FSDP_EXAMPLES_TRAINER_RUN_SUPPORT_H_

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>

#include "fsdp/comm/communicator.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/checkpoint.h"

namespace fsdp::examples {

// One run per out_dir: rank 0 makes `dir` and holds an flock on dir/.lock (with its pid in
// it) for the run's life; every rank learns whether it got it (raises on every rank naming
// the holder if not). Returns the lock's descriptor on rank 0 (-1 elsewhere). Collective
// (one broadcast on `device`).
int lock_out_dir(Communicator& comm, const std::string& dir, c10::Device device);

// A new run (resume false) does not mix its checkpoints with another run's in
// `checkpoint_dir`, nor replace the results of another run that wrote none (an
// `out_dir`/metrics.csv with a row): it raises on every rank naming them, or with
// `overwrite` deletes the old checkpoints (rank 0, before any is written; metrics.csv is
// rewritten later). Rank 0 looks, before the barrier that ends it (no rank has written a
// file of this run yet), and broadcasts what it saw on `device`, so ranks whose folders
// differ (node-local out_dirs) agree. Collective (a broadcast and a barrier).
void check_fresh_run(Communicator& comm, const std::string& out_dir,
                     const std::string& checkpoint_dir, bool resume, bool overwrite,
                     c10::Device device);

// With `resume`, loads the newest checkpoint (step_NNNNNNNN) of `checkpoint_dir` that every
// rank can read into `model` and `optimizer` and returns its step; else 0. The ranks agree
// before any prints or writes anything (load_latest_sharded_checkpoint): a damaged newest
// checkpoint is named and skipped (printed when `lead`); when none loads, every rank raises
// and every file is as it was. If `scheduler` is not null, it receives the scheduler
// state the checkpoint holds (left as it is when the checkpoint has none). Collective.
// Either format counts (fsdp's metadata.pt folders and Distributed Checkpoint folders);
// the step is a DCP folder's "step" entry, else the folder name's number.
int64_t resume_step(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                    const std::string& checkpoint_dir, bool resume, bool lead,
                    SchedulerState* scheduler = nullptr);

// --resume=DIR: loads the checkpoint folder `dir` (either format, e.g. one PyTorch's
// dcp.save wrote with {"model", "optim", "step"} as get_state_dict lays them out) and
// returns its step ("step" entry, else the step_NNNNNNNN name). The ranks agree (one
// all-reduce on the model's device) before any returns: if the folder fails on any rank,
// every rank raises. `scheduler` as for resume_step. Collective.
int64_t resume_from(FullyShardedRoot& model, torch::optim::Optimizer& optimizer, Communicator& comm,
                    const std::string& dir, bool lead, SchedulerState* scheduler = nullptr);

// A resumed step (from resume_step or resume_from, so in [0, 2^53)) must not be beyond
// the run's --steps: throws naming both.
void check_resumed_step(int64_t step, int64_t steps);

// The trainers' --resume takes no value (newest checkpoint) or a folder: rewrites a bare
// "--resume" in argv to "--resume=latest" (and "--noresume" to "--resume=") before
// absl::ParseCommandLine, since a string flag needs a value.
void allow_bare_resume_flag(int argc, char** argv);

// Rank 0 (`lead`) removes the partial checkpoints a killed save left in `checkpoint_dir`
// (remove_partial_checkpoints) and says so. Call it while holding the out_dir's lock.
void remove_leftover_checkpoints(const std::string& checkpoint_dir, bool lead);

// Mean next-token cross-entropy (nats) of `logits` [..., vocab] (any float dtype, taken in
// fp32) against `targets` [...] (int64).
at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets);

// One optimizer step's gradients over `micro_batches` (--grad_accumulation_steps) equal
// micro-batches of this rank's share: micro_loss(k) runs micro-batch k's forward and
// returns its mean loss (a scalar); each backward is scaled by 1 / micro_batches and all
// but the last run inside model.no_sync(), so the gradients are those of the whole share,
// reduced once, and the unsharded gradients of every unit are held between (PyTorch:
// FullyShardedDataParallel.no_sync). Returns the mean of the micro-batches' losses (the
// whole share's mean loss), detached. One micro-batch is a plain backward. Collective as
// a backward is.
at::Tensor accumulate_gradients(FullyShardedRoot& model, int64_t micro_batches,
                                const std::function<at::Tensor(int64_t)>& micro_loss);

// The mean over ranks of `value` (each rank's mean over an equal share). Collective.
double global_mean(const at::Tensor& value, Communicator& comm);

// Linear warm-up over `warmup` steps to `peak`, then cosine decay to peak / 10 at `steps`.
double cosine_learning_rate(int64_t step, double peak, int64_t warmup, int64_t steps);

// This process's resident set size in bytes (Linux), or -1.
int64_t resident_bytes();

// The largest resident set this process has had, in bytes (getrusage's ru_maxrss).
int64_t peak_resident_bytes();

// Note [The memory a rank may use]
// What one rank may hold: its share of its memory cgroup's limit (cgroup v2 memory.max,
// or v1 memory.limit_in_bytes, of the cgroup /proc/self/cgroup names), split between the
// ranks in that same cgroup, and its share of the machine's available memory
// (MemAvailable, beyond what the ranks hold already), split between the ranks on the
// host, whichever is smaller. A launcher that is this process's parent in the same cgroup
// (this binary starting its ranks, fsdp_run, torchrun) holds part of the limit: its
// resident set is taken off first. Ranks compare cgroups and hosts by an all-gather, so ranks
// each in a cgroup of their own (as Slurm and Kubernetes make them) get their own
// limit. Collective (one small all-gather on `device`).
struct MemoryBudget {
  int64_t bytes = 0;  // the most this rank may hold in all
  std::string why;    // "its cgroup's limit of 3.00 GiB shared by 2 ranks"
};
MemoryBudget rank_memory_budget(Communicator& comm, c10::Device device);

// Every rank's peak resident set (bytes, by rank). Collective.
std::vector<int64_t> peak_resident_set_of_ranks(Communicator& comm, c10::Device device);

// Every communicator the model's collectives use: `root`'s and, under the HYBRID
// strategies, the shard and replicate groups (whose traffic the root's counters miss).
std::vector<Communicator*> communicators_of(FullyShardedRoot& model, Communicator& root);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_TRAINER_RUN_SUPPORT_H_
