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

// "--name=value: expected what (why)".
template <typename T>
std::string bad(const char* name, T value, const std::string& expected) {
  return absl::StrCat("--", name, "=", value, ": expected ", expected);
}

std::string error_text(int error) { return std::strerror(error); }

// Why the folder `dir` cannot take the run's output, or "" if it can: it, or else its
// nearest existing ancestor, must be a folder in which a folder can be made. That is
// tried with a uniquely named folder, removed at once: it works for root too (for whom
// access() allows writing in /proc), leaves nothing, and ranks checking at once do not
// race.
std::string output_dir_problem(const std::string& dir) {
  if (dir.empty()) return "the path is empty";
  std::filesystem::path existing = std::filesystem::path(dir).lexically_normal();
  struct stat st;
  while (::stat(existing.c_str(), &st) != 0) {
    const int error = errno;
    const std::filesystem::path parent =
        existing.has_parent_path() ? existing.parent_path() : std::filesystem::path(".");
    if ((error != ENOENT && error != ENOTDIR) || parent == existing) {
      return absl::StrCat("cannot look at '", existing.string(), "': ", error_text(error));
    }
    existing = parent;
  }
  if (!S_ISDIR(st.st_mode)) return absl::StrCat("'", existing.string(), "' is not a folder");
  std::string probe = (existing / ".fsdp-write-check-XXXXXX").string();
  if (::mkdtemp(probe.data()) == nullptr) {
    return absl::StrCat("cannot make a folder in '", existing.string(), "': ", error_text(errno));
  }
  ::rmdir(probe.c_str());
  return "";
}

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

std::string path_flag_error(const PathFlags& f) {
  if (std::string problem = data_dir_problem(f.data_dir); !problem.empty()) {
    return bad("data_dir", f.data_dir,
               absl::StrCat("a folder of readable fortune files (files without an extension, "
                            "as Debian's fortunes package installs them: tools/setup.sh); ",
                            problem));
  }
  struct OutputFlag {
    const char* name;
    const std::string& value;
    const char* holds;
  };
  for (const OutputFlag& flag :
       {OutputFlag{"out_dir", f.out_dir, "metrics.csv, model.pt and the checkpoints go there"},
        OutputFlag{"checkpoint_dir", f.checkpoint_dir, "the checkpoints go there"}}) {
    if (&flag.value == &f.checkpoint_dir && flag.value.empty()) continue;  // OUT_DIR/...
    if (std::string problem = output_dir_problem(flag.value); !problem.empty()) {
      return bad(
          flag.name, flag.value,
          absl::StrCat("a folder that can be written, or made (", flag.holds, "); ", problem));
    }
  }
  return "";
}

MachineLimits this_machine() {
  MachineLimits machine;
  machine.cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  machine.max_ranks = max_ranks_per_node();
  machine.cuda_devices = cuda_device_count(&machine.why_no_cuda);
  machine.available_bytes = std::max<int64_t>(available_memory_bytes(), 0);
  return machine;
}

int64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    int64_t kib = 0;
    std::string unit;
    if (!(meminfo >> kib >> unit)) break;
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
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

std::string sharding_strategy_error(const char* flag, const std::string& value, bool allow_hybrid) {
  const c10::optional<ShardingStrategy> strategy = parse_sharding_strategy(value);
  if (strategy && (allow_hybrid || !is_hybrid(*strategy))) return "";
  return bad(flag, value,
             allow_hybrid
                 ? "full_shard, shard_grad_op, no_shard, hybrid_shard or hybrid_shard_zero2"
                 : "full_shard, shard_grad_op or no_shard");
}

ShardingStrategy sharding_strategy_flag(const char* flag, const std::string& value,
                                        bool allow_hybrid) {
  const std::string error = sharding_strategy_error(flag, value, allow_hybrid);
  TORCH_CHECK(error.empty(), error);
  return *parse_sharding_strategy(value);
}

c10::Device compute_device(const std::string& device) {
  if (device != "cuda") return c10::Device(c10::kCPU);
  return c10::Device(c10::kCUDA,
                     static_cast<c10::DeviceIndex>(read_launch_environment().local_rank));
}

c10::optional<MixedPrecision> mixed_precision_flag(const std::string& value) {
  if (value != "bf16") return c10::nullopt;
  return MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
}

at::ScalarType model_dtype(const std::string& mixed_precision) {
  return mixed_precision == "pure_bf16" ? at::kBFloat16 : at::kFloat;
}

std::string resolve_device(const std::string& requested, int cuda_devices) {
  return requested == "cuda" || (requested == "auto" && cuda_devices > 0) ? "cuda" : "cpu";
}

std::string resolve_mixed_precision(const std::string& requested, const std::string& device,
                                    at::ScalarType weights) {
  if (requested != "auto") return requested;
  const bool half = weights == at::kBFloat16 || weights == at::kHalf;
  return device == "cuda" || half ? "bf16" : "none";
}

int hybrid_group_size(ShardingStrategy strategy, int flag) {
  if (!is_hybrid(strategy)) return 0;
  return flag > 0 ? flag : read_launch_environment().local_world_size;
}

FullyShardedDataParallelOptions lever_options(std::shared_ptr<Communicator> comm,
                                              const LeverFlags& f) {
  const ShardingStrategy strategy =
      sharding_strategy_flag("sharding_strategy", f.sharding_strategy, /*allow_hybrid=*/true);
  return FullyShardedDataParallelOptions(std::move(comm))
      .sharding_strategy(strategy)
      .hybrid_shard_group_size(hybrid_group_size(strategy, f.hybrid_shard_group_size))
      .device_id(compute_device(f.device))
      .cpu_offload(CPUOffload(f.cpu_offload))
      .mixed_precision(mixed_precision_flag(f.mixed_precision));
}

std::string lever_flag_error(const LeverFlags& f, int world, bool self_launched, int64_t batch_size,
                             const MachineLimits& machine) {
  if (f.device != "auto" && f.device != "cpu" && f.device != "cuda") {
    return bad("device", f.device,
               "auto (CUDA when this process sees a CUDA device, else the CPU), cpu or cuda");
  }
  const bool cuda = resolve_device(f.device, machine.cuda_devices) == "cuda";
  if (cuda && machine.cuda_devices == 0) {
    return bad("device", f.device,
               absl::StrCat("a CUDA device, but this process sees none (",
                            machine.why_no_cuda.empty() ? "no reason given" : machine.why_no_cuda,
                            "); pass --device=cpu, or run where a GPU is visible"));
  }
  if (f.mixed_precision != "auto" && f.mixed_precision != "bf16" &&
      f.mixed_precision != "pure_bf16" && f.mixed_precision != "none") {
    return bad("mixed_precision", f.mixed_precision,
               "auto (bf16 on CUDA or for a 16-bit checkpoint, else none), bf16 (bf16 "
               "compute, fp32 master weights), pure_bf16 or none (fp32)");
  }
  if (cuda && self_launched && world > machine.cuda_devices) {
    return bad("world_size", world,
               absl::StrCat("1 to ", machine.cuda_devices,
                            " ranks with --device=cuda (one CUDA device per rank; this "
                            "process sees ",
                            machine.cuda_devices, ")"));
  }
  if (f.grad_accumulation_steps < 1) {
    return bad("grad_accumulation_steps", f.grad_accumulation_steps,
               "at least 1 micro-batch per optimizer step");
  }
  const int64_t share = int64_t{world} * f.grad_accumulation_steps;
  if (batch_size < 1 || batch_size % share != 0) {
    return bad("batch_size", batch_size,
               f.grad_accumulation_steps == 1
                   ? absl::StrCat("a positive multiple of the world size ", world,
                                  " (every rank trains on an equal share)")
                   : absl::StrCat("a positive multiple of the world size ", world,
                                  " x --grad_accumulation_steps=", f.grad_accumulation_steps,
                                  " (every rank trains on an equal share, in equal "
                                  "micro-batches)"));
  }
  if (std::string error = sharding_strategy_error("sharding_strategy", f.sharding_strategy,
                                                  /*allow_hybrid=*/true);
      !error.empty()) {
    return error;
  }
  // One rank runs every strategy as NO_SHARD, so the group size matters only above it.
  const bool hybrid = is_hybrid(*parse_sharding_strategy(f.sharding_strategy)) && world > 1;
  if (f.hybrid_shard_group_size < 0 ||
      (hybrid && f.hybrid_shard_group_size > 0 && world % f.hybrid_shard_group_size != 0)) {
    return bad("hybrid_shard_group_size", f.hybrid_shard_group_size,
               absl::StrCat("0 (the ranks of one host) or a divisor of the world size ", world));
  }
  return "";
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
  if (!std::isfinite(f.peak_tflops) || f.peak_tflops < 0) {
    return bad("peak_tflops", f.peak_tflops,
               "0 (the device's peak from the table in examples/gpt/mfu.cc) or the peak "
               "dense bf16 TFLOP/s of the device");
  }
  if (f.launched_world_size == 0 && (f.world_size < 1 || f.world_size > machine.max_ranks)) {
    return bad("world_size", f.world_size,
               absl::StrCat("1 to ", machine.max_ranks, " ranks on this machine (", machine.cores,
                            " cores x ", kMaxRanksPerCore, "; each rank is a process)"));
  }
  const int world = f.launched_world_size > 0 ? f.launched_world_size : f.world_size;
  if (std::string error =
          lever_flag_error(f, world, f.launched_world_size == 0, f.batch_size, machine);
      !error.empty()) {
    return error;
  }
  const bool cuda = resolve_device(f.device, machine.cuda_devices) == "cuda";
  if (f.layers < 1) return bad("layers", f.layers, "at least 1 transformer block");
  if (f.width < 1) return bad("width", f.width, "a positive embedding width");
  if (f.heads < 1 || f.width % f.heads != 0) {
    return bad("heads", f.heads,
               absl::StrCat("a positive divisor of --width=", f.width,
                            " (each head gets width / heads channels)"));
  }
  if (f.context < 1) return bad("context", f.context, "at least 1 character");
  if (f.steps < 1) return bad("steps", f.steps, "at least 1 training step");
  if (!std::isfinite(f.lr) || f.lr <= 0) {
    return bad("lr", f.lr, "a finite learning rate > 0");
  }
  if (f.warmup_steps < 0) return bad("warmup_steps", f.warmup_steps, "0 or more steps");
  if (f.log_interval < 1) return bad("log_interval", f.log_interval, "at least 1 step");
  if (f.eval_interval < 1) return bad("eval_interval", f.eval_interval, "at least 1 step");
  if (f.eval_batches < 1) return bad("eval_batches", f.eval_batches, "at least 1 batch");
  if (f.sample_length < 0) return bad("sample_length", f.sample_length, "0 (none) or more");
  if (f.checkpoint_interval < 0) {
    return bad("checkpoint_interval", f.checkpoint_interval, "0 (none) or more steps");
  }
  if (f.timeout_s < 1) {
    return bad("timeout_s", f.timeout_s, "at least 1 second to wait for the other ranks");
  }
  if (f.policy != "transformer" && f.policy != "root") {
    return bad("policy", f.policy, "transformer (each block a unit) or root (one unit)");
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
