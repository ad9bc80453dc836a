#include "examples/gpt/flags.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <c10/util/Exception.h>

#include "fsdp/comm/nccl.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/flat_param.h"

namespace fsdp::examples {
namespace {

std::string error_text(int error) { return std::strerror(error); }

// Why `dir` holds no usable fortune files, or "" if it does. Same selection as
// load_fortunes (corpus.cc).
std::string data_dir_problem(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return absl::StrCat("cannot open it: ", error_text(errno));
  if (!S_ISDIR(st.st_mode)) return "it is not a folder";
  DIR* listing = ::opendir(dir.c_str());
  if (listing == nullptr) return absl::StrCat("cannot list it: ", error_text(errno));
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(listing)) names.emplace_back(entry->d_name);
  ::closedir(listing);
  std::sort(names.begin(), names.end());
  int fortune_files = 0;
  for (const std::string& name : names) {
    if (name == "." || name == ".." || std::filesystem::path(name).has_extension()) continue;
    const std::string path = dir + "/" + name;
    if (::stat(path.c_str(), &st) != 0) {
      return absl::StrCat("cannot read '", path, "': ", error_text(errno));
    }
    if (!S_ISREG(st.st_mode)) continue;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::StrCat("cannot read '", path, "': ", error_text(errno));
    ::close(fd);
    ++fortune_files;
  }
  return fortune_files > 0 ? "" : "it holds none";
}

}  // namespace

TrainerFlags::TrainerFlags() {
  batch_size = 32;
  steps = 1200;
  lr = 3e-3;
  warmup_steps = 50;
  checkpoint_interval = 200;
  out_dir = "/tmp/fsdp_gpt";
}

std::string data_dir_error(const std::string& data_dir) {
  const std::string problem = data_dir_problem(data_dir);
  if (problem.empty()) return "";
  return bad_flag("data_dir", data_dir,
                  absl::StrCat("a folder of readable fortune files (files without an extension, "
                               "as Debian's fortunes package installs them: tools/setup.sh); ",
                               problem));
}

double lower_bound_bytes_per_rank(const TrainerFlags& f) {
  const int world = f.launched_world_size > 0 ? f.launched_world_size : f.world_size;
  const double d = static_cast<double>(f.width);
  const double params = 12 * f.layers * d * d + (f.vocab_size + f.context) * d;
  const double micro_batch = std::ceil(double(f.batch_size) / std::max(1, world) /
                                       double(std::max<int64_t>(1, f.grad_accumulation_steps)));
  // With activation checkpointing only the layer being recomputed keeps its scores.
  const double layers = f.activation_checkpointing ? 1 : double(f.layers);
  const double attention =
      8.0 * layers * micro_batch * f.heads * double(f.context) * double(f.context);
  return 16 * params + attention;
}

std::vector<FlagValue> cuda_defaults(const TrainerFlags& f, int cuda_devices,
                                     const std::function<bool(const std::string&)>& specified) {
  std::vector<FlagValue> defaults;
  const auto add = [&](const char* name, const std::string& value) {
    if (!specified(name)) defaults.push_back({name, value});
  };
  const int world_size = specified("world_size") ? f.world_size : cuda_devices;
  add("world_size", std::to_string(cuda_devices));
  add("width", "768");
  add("layers", "12");
  add("heads", "12");
  add("context", "256");
  add("lr", "6e-4");
  const int world = std::max(1, f.launched_world_size > 0 ? f.launched_world_size : world_size);
  add("batch_size", std::to_string((64 + world - 1) / world * world));
  add("checkpoint_interval", "600");
  return defaults;
}

std::string flag_error(const TrainerFlags& f, const MachineLimits& machine) {
  if (std::string error = run_flag_error(f, machine); !error.empty()) return error;
  if (!std::isfinite(f.peak_tflops) || f.peak_tflops < 0) {
    return bad_flag("peak_tflops", f.peak_tflops,
                    "0 (the device's peak from the table in examples/gpt/mfu.cc) or the peak "
                    "dense bf16 TFLOP/s of the device");
  }
  const int world = f.world();
  const bool cuda = resolve_device(f.device, machine.cuda_devices) == "cuda";
  if (f.layers < 1) return bad_flag("layers", f.layers, "at least 1 transformer block");
  if (f.width < 1) return bad_flag("width", f.width, "a positive embedding width");
  if (f.heads < 1 || f.width % f.heads != 0) {
    return bad_flag("heads", f.heads,
                    absl::StrCat("a positive divisor of --width=", f.width,
                                 " (each head gets width / heads channels)"));
  }
  if (f.eval_interval < 1) return bad_flag("eval_interval", f.eval_interval, "at least 1 step");
  if (f.eval_batches < 1) return bad_flag("eval_batches", f.eval_batches, "at least 1 batch");
  if (f.sample_length < 0) return bad_flag("sample_length", f.sample_length, "0 (none) or more");
  if (f.policy != "transformer" && f.policy != "root") {
    return bad_flag("policy", f.policy, "transformer (each block a unit) or root (one unit)");
  }
  if (cuda) return "";  // device memory is the bound there
  const double need = lower_bound_bytes_per_rank(f);
  const int ranks_here = f.launched_world_size > 0 ? 1 : world;
  if (machine.available_bytes > 0 && need > double(machine.available_bytes) / ranks_here) {
    return absl::StrFormat(
        "--context=%d, --batch_size=%d, --width=%d, --layers=%d: one step needs at least "
        "%.1f GB per rank (AdamW state and every layer's attention scores), more than the "
        "%.1f GB available to each of %d ranks here; lower --context, --batch_size or the "
        "model size",
        f.context, f.batch_size, f.width, f.layers, need / 1e9,
        machine.available_bytes / 1e9 / ranks_here, ranks_here);
  }
  return "";
}

}  // namespace fsdp::examples
