// The trainer's metrics.csv across --resume: a resumed run keeps the rows up to its
// checkpoint's step as they were, and never rewrites a file it cannot account for.
//
//   std::string warning;
//   std::ofstream csv = open_metrics(dir + "/metrics.csv", /*step=*/4, &warning);
//   if (!warning.empty()) std::cout << warning << "\n";
//   csv << "5,1.2345678,,0.003000,12345\n";
//
// Not thread-safe (one process, rank 0, owns the file). PyTorch: none (a trainer's log).
#ifndef FSDP_EXAMPLES_TRAINER_METRICS_H_
#define FSDP_EXAMPLES_TRAINER_METRICS_H_

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace fsdp::examples {

// The first line of metrics.csv.
inline constexpr char kMetricsHeader[] = "step,train_loss,validation_loss,lr,tokens_per_s";

// What a run resuming at `step` (>= 1) keeps of metrics.csv's `text`: `lines` holds the
// header and the rows of steps 1 ... step exactly as they were (rows after `step` are
// dropped: the resumed run writes them again); when the text does not hold those rows
// (another first line, a row missing, out of order or unreadable, the file ends early),
// `lines` is empty and `problem` says why in a few words.
struct KeptMetrics {
  std::vector<std::string> lines;
  std::string problem;
};
KeptMetrics metrics_to_keep(absl::string_view text, int64_t step);

// Opens `path` (metrics.csv) for appending the rows after `step`: a new run (step 0)
// starts a file with the header; a resumed run keeps the rows metrics_to_keep keeps
// (written to a temporary file and renamed over `path`, so a crash leaves the old file or
// the new one). A file that is missing, unreadable or does not cover steps 1 ... step is
// kept aside as metrics.set_aside_N.csv (N the first free number) and a new file starts
// at step + 1; `warning` then receives one line saying so ("" otherwise). Raises
// c10::Error if `path` cannot be written.
std::ofstream open_metrics(const std::string& path, int64_t step, std::string* warning);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_TRAINER_METRICS_H_
