#include "examples/gpt/model_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(int64_t, layers, 4, "transformer blocks");
ABSL_FLAG(int64_t, width, 128, "embedding width");
ABSL_FLAG(int64_t, heads, 4, "attention heads");
ABSL_FLAG(std::string, data_dir, "/usr/share/games/fortunes", "Debian's fortunes");
ABSL_FLAG(double, peak_tflops, 0,
          "peak dense bf16 TFLOP/s of the device, for the model FLOP utilisation (MFU); 0: "
          "from the device name (examples/gpt/mfu.cc's table: H200, H100 SXM 989.4; A100 "
          "312), else no MFU");
