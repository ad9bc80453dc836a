// The GPT trainer's command line, checked before any rank starts or any file is touched.
//
//   fsdp::examples::TrainerFlags flags = ...;  // from absl flags (train.cc)
//   std::string error = fsdp::examples::flag_error(flags, fsdp::examples::this_machine());
//   if (!error.empty()) { std::cerr << "train: " << error << "\n"; return 2; }
//
// Each error is one line naming the flag, the value, what is allowed and why.
#ifndef FSDP_EXAMPLES_GPT_FLAGS_H_
#define FSDP_EXAMPLES_GPT_FLAGS_H_

#include <cstdint>
#include <string>

#include "fsdp/comm/launcher.h"

namespace fsdp::examples {

struct TrainerFlags {
  int world_size = 2;           // ranks this process starts (self-launch); 0: launched
  int launched_world_size = 0;  // WORLD_SIZE of fsdp_run/torchrun/...; 0: self-launch
  std::string sharding_strategy = "full_shard";
  std::string policy = "transformer";
  int hybrid_shard_group_size = 0;
  // The trainer's defaults (train.cc).
  int64_t layers = 4, width = 128, heads = 4, context = 128, batch_size = 32, steps = 1200;
  double lr = 3e-3;
  int64_t warmup_steps = 50, log_interval = 10, eval_interval = 200, eval_batches = 8;
  int64_t sample_length = 300, checkpoint_interval = 200, timeout_s = 300;
  int64_t vocab_size = 256;  // an upper bound before the corpus is read (bytes)
};

// What the machine allows.
struct MachineLimits {
  int cores = 1;
  int max_ranks = kMaxRanksPerCore;  // fsdp::max_ranks_per_node()
  int64_t available_bytes = 0;       // MemAvailable
};

MachineLimits this_machine();

// "" if the flags are usable on `machine`, else one line saying why not.
std::string flag_error(const TrainerFlags& flags, const MachineLimits& machine);

// The trainer's path flags.
struct PathFlags {
  std::string out_dir;         // metrics.csv, model.pt, memory_rank<R>.csv, .lock
  std::string checkpoint_dir;  // "": OUT_DIR/checkpoints
  std::string data_dir;        // the fortune files
};

// "" if --data_dir is a folder holding at least one fortune file and every fortune file
// in it can be opened, and --out_dir (and --checkpoint_dir, if given) is a folder that can
// be written, or that can be made; else one line naming the flag, the value, what is
// expected and what was found. A fortune file is an entry without an extension that is
// (or links to) a regular file; one whose type cannot be read (a dangling or looping link)
// counts as unreadable. An output folder is checked by making a uniquely named folder in
// it (or in its nearest existing ancestor) and removing it at once: nothing is left
// behind, root is not waved through as by access(), and ranks checking at once do not
// race.
std::string path_flag_error(const PathFlags& flags);

// Bytes one rank needs at least: AdamW model state (16 bytes a parameter, unsharded as a
// bound) and the attention scores and probabilities every layer keeps for backward
// (layers x batch per rank x heads x context^2 x 8 bytes).
double lower_bound_bytes_per_rank(const TrainerFlags& flags);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_GPT_FLAGS_H_
