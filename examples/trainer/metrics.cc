#include "examples/trainer/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include <c10/util/Exception.h>

#include "fsdp/formats/atomic_file.h"

namespace fsdp::examples {
namespace {

namespace fs = std::filesystem;

bool is_number(absl::string_view text) {
  double value = 0;
  return absl::SimpleAtod(text, &value) && std::isfinite(value);
}

// Whether `line` is a well-formed row of step `step`: step, train loss, validation loss
// (may be empty), lr, tokens/s.
bool is_row_of(absl::string_view line, int64_t step) {
  const std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
  int64_t row = 0;
  return fields.size() == 5 && absl::SimpleAtoi(fields[0], &row) && row == step &&
         is_number(fields[1]) && (fields[2].empty() || is_number(fields[2])) &&
         is_number(fields[3]) && is_number(fields[4]);
}

// A line as a message shows it: escaped, at most 40 characters.
std::string shown(absl::string_view line) {
  std::string text = absl::CHexEscape(line.substr(0, 40));
  return absl::StrCat("'", text, line.size() > 40 ? "...'" : "'");
}

// metrics.set_aside_N.csv beside `path`, N the first number not taken.
fs::path set_aside_name(const fs::path& path) {
  for (int n = 1;; ++n) {
    fs::path candidate = path.parent_path() / absl::StrCat("metrics.set_aside_", n, ".csv");
    std::error_code error;
    if (!fs::exists(fs::symlink_status(candidate, error))) return candidate;
  }
}

}  // namespace

KeptMetrics metrics_to_keep(absl::string_view text, int64_t step) {
  // A line counts only when its newline was written (a killed run may leave half a row).
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  lines.pop_back();  // the text after the last newline
  KeptMetrics kept;
  if (lines.empty() || lines[0] != kMetricsHeader) {
    kept.problem = lines.empty() ? "it holds no complete line"
                                 : absl::StrCat("its first line ", shown(lines[0]),
                                                " is not the header '", kMetricsHeader, "'");
    return kept;
  }
  for (int64_t s = 1; s <= step; ++s) {
    if (static_cast<size_t>(s) >= lines.size()) {
      kept.problem = absl::StrCat("it ends after step ", s - 1);
      return kept;
    }
    if (!is_row_of(lines[s], s)) {
      kept.problem =
          absl::StrCat("line ", s + 1, " ", shown(lines[s]), " is not the row of step ", s);
      return kept;
    }
  }
  for (int64_t i = 0; i <= step; ++i) kept.lines.emplace_back(lines[i]);
  return kept;
}

std::ofstream open_metrics(const std::string& path, int64_t step, std::string* warning) {
  warning->clear();
  std::vector<std::string> lines = {kMetricsHeader};
  std::error_code error;
  const bool exists = fs::exists(fs::symlink_status(path, error));
  std::string problem;
  if (step > 0) {
    std::ifstream in(path, std::ios::binary);
    if (!exists) {
      problem = "is missing";
    } else if (fs::is_directory(path, error)) {
      problem = "is a folder, not a file";
    } else if (!in.good()) {
      problem = absl::StrCat("cannot be read (", std::strerror(errno), ")");
    } else {
      const std::string text((std::istreambuf_iterator<char>(in)), {});
      KeptMetrics kept = metrics_to_keep(text, step);
      if (kept.problem.empty()) {
        lines = std::move(kept.lines);
      } else {
        problem = absl::StrCat("does not hold the rows of steps 1-", step, ": ", kept.problem);
      }
    }
  }
  // The new file first, so that a failure (a full disk) leaves the old one as it was.
  std::string text;
  for (const std::string& line : lines) absl::StrAppend(&text, line, "\n");
  AtomicFile file(path);
  try {
    file.append(text);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.msg(), "; pass a writable --out_dir with free space");
  }
  if (!problem.empty()) {
    std::string aside;
    if (exists) {
      const fs::path name = set_aside_name(path);
      TORCH_CHECK(std::rename(path.c_str(), name.c_str()) == 0, "cannot keep '", path,
                  "' aside as '", name.string(), "': ", std::strerror(errno),
                  "; move it away by hand and resume again");
      aside = absl::StrCat("; kept it as ", name.string());
    }
    *warning =
        absl::StrCat("warning: ", path, " ", problem, aside, "; a new metrics.csv starts at step ",
                     step + 1, " (the rows of steps 1-", step, " are not in it)");
  }
  try {
    file.commit();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.msg(), "; pass a writable --out_dir with free space");
  }
  std::ofstream csv(path, std::ios::binary | std::ios::app);
  TORCH_CHECK(csv.good(), "cannot write ", path, "; pass a writable --out_dir");
  return csv;
}

}  // namespace fsdp::examples
