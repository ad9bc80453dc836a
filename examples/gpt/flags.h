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
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "examples/trainer/run_flags.h"

namespace fsdp::examples {

// The GPT trainer's flags: the run flags (with the levers) and its own.
struct TrainerFlags : RunFlags {
  TrainerFlags();  // the trainer's defaults (use_run_flag_defaults takes them)
  std::string policy = "transformer";
  int64_t layers = 4, width = 128, heads = 4;
  int64_t eval_interval = 200, eval_batches = 8, sample_length = 300;
  int64_t vocab_size = 256;  // an upper bound before the corpus is read (bytes)
  double peak_tflops = 0;    // 0: the table of mfu.cc
  bool plan_check = false;
  std::string data_dir = "/usr/share/games/fortunes";
};

// "" if the flags are usable on `machine`, else one line saying why not: the run flags
// (run_flag_error), the model's shape and the GPT's own flags, and on the CPU a lower
// bound of the memory a rank needs (on CUDA device memory is what runs out; the caching
// allocator says so). The data folder is data_dir_error's.
std::string flag_error(const TrainerFlags& flags, const MachineLimits& machine);

// "" if --data_dir is a folder holding at least one fortune file and every fortune file
// in it can be opened; else one line naming the flag, the value, what is expected and
// what was found. A fortune file is an entry without an extension that is (or links to)
// a regular file; one whose type cannot be read (a dangling or looping link) counts as
// unreadable.
std::string data_dir_error(const std::string& data_dir);

// The CUDA defaults of the flags for which `specified(name)` is false (not given on the
// command line), in the order to apply them: --world_size: one rank per device; --width
// 768, --layers 12, --heads 12, --context 256 (GPT-2 small's shape, with this corpus's
// context); --lr 6e-4 (GPT-3's 125M model, Brown et al. 2020, table 2.1); --batch_size 64
// sequences rounded up to a multiple of the world size (the launcher's, else --world_size
// as given or defaulted here); --checkpoint_interval 600 (a checkpoint is 1.5 GB at this
// size). `flags` holds the values as parsed. Pure.
std::vector<FlagValue> cuda_defaults(const TrainerFlags& flags, int cuda_devices,
                                     const std::function<bool(const std::string&)>& specified);

// Bytes one rank needs at least: AdamW model state (16 bytes a parameter, unsharded as a
// bound) and the attention scores and probabilities every layer keeps for backward
// (layers x micro-batch per rank x heads x context^2 x 8 bytes; one layer with
// activation checkpointing).
double lower_bound_bytes_per_rank(const TrainerFlags& flags);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_GPT_FLAGS_H_
