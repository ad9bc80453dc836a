// The GPT's model-shape and data flags, defined once for the binaries that build a GptImpl
// from the command line: examples/gpt/train and benchmarks/peer/gpt_fsdp (whose prepared
// weights then have the trainer's shape for the same flags).
//
//   absl::GetFlag(FLAGS_width);  // after absl::ParseCommandLine
//
// --layers, --width, --heads: GptOptions (model.h); --data_dir: the fortune files
// (corpus.h); --peak_tflops: the device's peak for the MFU (mfu.h). --context and --seed
// are the trainer's run flags (examples/trainer/run_flags.h); gpt_fsdp defines its own
// with the same defaults.
#ifndef FSDP_EXAMPLES_GPT_MODEL_FLAGS_H_
#define FSDP_EXAMPLES_GPT_MODEL_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(int64_t, layers);
ABSL_DECLARE_FLAG(int64_t, width);
ABSL_DECLARE_FLAG(int64_t, heads);
ABSL_DECLARE_FLAG(std::string, data_dir);
ABSL_DECLARE_FLAG(double, peak_tflops);

#endif  // FSDP_EXAMPLES_GPT_MODEL_FLAGS_H_
