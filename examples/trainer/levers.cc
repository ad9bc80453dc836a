#include "examples/trainer/levers.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>

#include "fsdp/comm/nccl.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/flat_param.h"

namespace fsdp::examples {
namespace {

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

}  // namespace

std::string output_dir_error(const char* flag, const std::string& dir, const char* holds) {
  const std::string problem = output_dir_problem(dir);
  if (problem.empty()) return "";
  return bad_flag(flag, dir,
                  absl::StrCat("a folder that can be written, or made (", holds, "); ", problem));
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

std::string sharding_strategy_error(const char* flag, const std::string& value, bool allow_hybrid) {
  const c10::optional<ShardingStrategy> strategy = parse_sharding_strategy(value);
  if (strategy && (allow_hybrid || !is_hybrid(*strategy))) return "";
  return bad_flag(flag, value,
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
    return bad_flag("device", f.device,
                    "auto (CUDA when this process sees a CUDA device, else the CPU), cpu or cuda");
  }
  const bool cuda = resolve_device(f.device, machine.cuda_devices) == "cuda";
  if (cuda && machine.cuda_devices == 0) {
    return bad_flag(
        "device", f.device,
        absl::StrCat("a CUDA device, but this process sees none (",
                     machine.why_no_cuda.empty() ? "no reason given" : machine.why_no_cuda,
                     "); pass --device=cpu, or run where a GPU is visible"));
  }
  if (f.mixed_precision != "auto" && f.mixed_precision != "bf16" &&
      f.mixed_precision != "pure_bf16" && f.mixed_precision != "none") {
    return bad_flag("mixed_precision", f.mixed_precision,
                    "auto (bf16 on CUDA or for a 16-bit checkpoint, else none), bf16 (bf16 "
                    "compute, fp32 master weights), pure_bf16 or none (fp32)");
  }
  if (cuda && self_launched && world > machine.cuda_devices) {
    return bad_flag("world_size", world,
                    absl::StrCat("1 to ", machine.cuda_devices,
                                 " ranks with --device=cuda (one CUDA device per rank; this "
                                 "process sees ",
                                 machine.cuda_devices, ")"));
  }
  if (f.grad_accumulation_steps < 1) {
    return bad_flag("grad_accumulation_steps", f.grad_accumulation_steps,
                    "at least 1 micro-batch per optimizer step");
  }
  const int64_t share = int64_t{world} * f.grad_accumulation_steps;
  if (batch_size < 1 || batch_size % share != 0) {
    return bad_flag("batch_size", batch_size,
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
    return bad_flag(
        "hybrid_shard_group_size", f.hybrid_shard_group_size,
        absl::StrCat("0 (the ranks of one host) or a divisor of the world size ", world));
  }
  return "";
}

}  // namespace fsdp::examples
