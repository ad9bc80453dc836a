#include "examples/trainer/run_support.h"

#include <fcntl.h>
#ifdef __GLIBC__
#endif
#include <sys/file.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>

#include "examples/trainer/levers.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/formats/values.h"
#include "fsdp/state/checkpoint.h"

namespace fsdp::examples {

namespace {

// Rank 0's `value` on every rank (a broadcast on `device`, where the collective runs).
int64_t rank0_value(Communicator& comm, int64_t value, c10::Device device) {
  at::Tensor status = at::full({1}, value, at::dtype(at::kLong).device(device));
  comm.broadcast(status, /*root=*/0);
  return status.item<int64_t>();
}

}  // namespace

int lock_out_dir(Communicator& comm, const std::string& dir, c10::Device device) {
  int fd = -1;
  int64_t holder = 0;
  if (comm.rank() == 0) {
    std::filesystem::create_directories(dir);
    const std::string path = dir + "/.lock";
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    TORCH_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno),
                "; pass a writable --out_dir");
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      char pid[32] = {};
      ssize_t n = ::pread(fd, pid, sizeof(pid) - 1, 0);
      holder = n > 0 ? std::max<int64_t>(1, std::atoll(pid)) : 1;
      ::close(fd);
      fd = -1;
    } else {
      // The pid is for people and for the message above; the flock is the lock. A full
      // disk may refuse to write it: that must not read as another run's lock.
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
        std::cerr << "note: cannot write the pid to " << path << ": " << std::strerror(errno)
                  << "\n";
      }
    }
  }
  holder = rank0_value(comm, holder, device);
  TORCH_CHECK(holder == 0, "--out_dir=", dir, " is in use by another run (",
              holder > 1 ? "pid " + std::to_string(holder) : std::string("see its .lock"),
              "); wait for it to finish or pass another --out_dir");
  return fd;
}

void check_fresh_run(Communicator& comm, const std::string& out_dir,
                     const std::string& checkpoint_dir, bool resume, bool overwrite,
                     c10::Device device) {
  if (resume) return;
  // Rank 0 looks (the folders may be its node's alone) and every rank learns what it saw.
  enum : int64_t { kFresh, kCheckpoints, kResults };  // kResults: metrics.csv rows only
  std::optional<std::string> old;
  int64_t seen = kFresh;
  if (comm.rank() == 0) {
    old = latest_checkpoint(checkpoint_dir);
    std::ifstream metrics(out_dir + "/metrics.csv");
    std::string header, row;
    if (old) {
      seen = kCheckpoints;
    } else if (std::getline(metrics, header) && std::getline(metrics, row)) {
      // (A header alone: a run that stopped before its first step, nothing to lose.)
      seen = kResults;
    }
  }
  seen = rank0_value(comm, seen, device);
  TORCH_CHECK(seen != kCheckpoints || overwrite, "'", checkpoint_dir,
              "' holds another run's checkpoints (newest ", old.value_or("named on rank 0"),
              "); continue that run with --resume, or start over with --overwrite (deletes "
              "them)");
  TORCH_CHECK(seen != kResults || overwrite, "--out_dir=", out_dir,
              " holds another run's results (metrics.csv, no checkpoint to continue from); "
              "pass another --out_dir, or --overwrite to replace them");
  if (old && comm.rank() == 0) {
    for (const auto& entry : std::filesystem::directory_iterator(checkpoint_dir)) {
      const std::string name = entry.path().filename().string();
      if (absl::StartsWith(name, "step_") || absl::StartsWith(name, ".step_")) {
        std::filesystem::remove_all(entry.path());
      }
    }
  }
  // Host ordering (files): no rank writes a checkpoint before the old ones are gone; on
  // NCCL too, see Note [A barrier that blocks the host] in fsdp/comm/nccl.cc.
  comm.barrier();
}

namespace {

// A checkpoint's step: its "step" entry (a DCP folder's), else its step_NNNNNNNN name;
// either must be an integer in [0, 2^53). Throws for a "step" entry of another type when
// the name gives none either.
std::optional<int64_t> step_of(const std::string& dir, const DcpExtras& extras) {
  std::string other_type;
  for (const auto& [name, value] : extras) {
    if (name != "step") continue;
    if (value.isInt()) {
      return checked_count(value.toInt(), absl::StrCat("'", dir, "': its \"step\" entry"));
    }
    other_type = value.tagKind();
  }
  int64_t step = 0;
  const std::string name = std::filesystem::path(dir).filename().string();
  if (absl::StartsWith(name, "step_") && absl::SimpleAtoi(name.substr(5), &step)) {
    return checked_count(step, absl::StrCat("'", dir, "': the step in its name"));
  }
  TORCH_CHECK(other_type.empty(), "'", dir, "': its \"step\" entry is a ", other_type,
              ", not an int; save {\"step\": step} with step a Python int, or name the folder "
              "step_NNNNNNNN");
  return std::nullopt;
}

}  // namespace

int64_t resume_step(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                    const std::string& checkpoint_dir, bool resume, bool lead,
                    SchedulerState* scheduler) {
  if (!resume) return 0;
  std::optional<LoadedCheckpoint> loaded;
  try {
    loaded = load_latest_sharded_checkpoint(model, &optimizer, checkpoint_dir);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "--resume: ", e.what_without_backtrace(),
                "; every file is as it was: restore a checkpoint or start a new run with "
                "--overwrite");
  }
  const std::optional<int64_t> step = loaded ? step_of(loaded->dir, loaded->extras) : std::nullopt;
  TORCH_CHECK(step.has_value(),
              "--resume: no complete checkpoint (step_NNNNNNNN with metadata.pt or .metadata) in '",
              checkpoint_dir,
              "'; pass the --checkpoint_dir of the run to continue, or start "
              "a new run without --resume");
  if (scheduler != nullptr && loaded->scheduler) *scheduler = *loaded->scheduler;
  if (!lead) return *step;
  for (const std::string& skipped : loaded->skipped) {
    std::cout << "--resume: skipped " << skipped << "\n";
  }
  std::cout << "resumed from " << loaded->dir << " at step " << *step
            << (loaded->skipped.empty() ? "" : " (the newest checkpoint that loads)") << "\n";
  return *step;
}

int64_t resume_from(FullyShardedRoot& model, torch::optim::Optimizer& optimizer, Communicator& comm,
                    const std::string& dir, bool lead, SchedulerState* scheduler) {
  std::string error;
  DcpExtras extras;
  std::optional<SchedulerState> loaded_scheduler;
  try {
    if (is_dcp_checkpoint(dir)) {
      extras = load_dcp_checkpoint(model, &optimizer, dir);
      loaded_scheduler = scheduler_from_dcp_extras(extras);
    } else {
      loaded_scheduler = load_sharded_checkpoint(model, &optimizer, dir);
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  at::Tensor failed = at::full({1}, error.empty() ? 0 : 1,
                               at::dtype(at::kLong).device(model.device_handle().device()));
  comm.all_reduce(failed, ReduceOp::kSum);
  const int64_t failures = failed.item<int64_t>();
  TORCH_CHECK(error.empty(), "--resume=", dir, ": ", error,
              "; every file is as it was: pass another checkpoint folder");
  TORCH_CHECK(failures == 0, "--resume=", dir, ": the checkpoint does not load on ", failures,
              " other rank(s); see their errors");
  const std::optional<int64_t> step = step_of(dir, extras);
  TORCH_CHECK(step.has_value(), "--resume=", dir,
              ": the checkpoint has no \"step\" entry and its folder is not named step_NNNNNNNN; "
              "save {\"model\", \"optim\", \"step\"} (an int) with dcp.save");
  if (scheduler != nullptr && loaded_scheduler) *scheduler = *loaded_scheduler;
  if (lead) std::cout << "resumed from " << dir << " at step " << *step << "\n";
  return *step;
}

void check_resumed_step(int64_t step, int64_t steps) {
  TORCH_CHECK(step <= steps, "--resume: the checkpoint is at step ", step,
              ", beyond --steps=", steps, " (the resumed step must be in [0, ", steps,
              "]); pass a --steps of at least ", step, " to continue it, or another checkpoint");
}

void allow_bare_resume_flag(int argc, char** argv) {
  static char kLatest[] = "--resume=latest";
  static char kNone[] = "--resume=";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg == "--resume" || arg == "-resume") argv[i] = kLatest;
    if (arg == "--noresume" || arg == "-noresume") argv[i] = kNone;
  }
}

void remove_leftover_checkpoints(const std::string& checkpoint_dir, bool lead) {
  if (!lead) return;
  const std::vector<std::string> removed = remove_partial_checkpoints(checkpoint_dir);
  if (!removed.empty()) {
    std::cout << "removed " << removed.size()
              << " partial checkpoint(s) an interrupted save left: " << absl::StrJoin(removed, ", ")
              << "\n";
  }
}

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                              targets.reshape({-1}));
}

at::Tensor accumulate_gradients(FullyShardedRoot& model, int64_t micro_batches,
                                const std::function<at::Tensor(int64_t)>& micro_loss) {
  TORCH_INTERNAL_ASSERT(micro_batches >= 1);
  if (micro_batches == 1) {
    at::Tensor loss = micro_loss(0);
    loss.backward();
    return loss.detach();
  }
  at::Tensor sum;
  for (int64_t k = 0; k < micro_batches; ++k) {
    std::optional<NoSyncScope> no_sync;
    if (k + 1 < micro_batches) no_sync.emplace(model);
    at::Tensor loss = micro_loss(k);
    (loss / double(micro_batches)).backward();
    sum = k == 0 ? loss.detach().clone() : sum + loss.detach();
  }
  return sum / double(micro_batches);
}

double global_mean(const at::Tensor& value, Communicator& comm) {
  at::Tensor mean = value.detach().reshape({1}).clone();
  comm.all_reduce(mean, ReduceOp::kAvg);
  return mean.item<double>();
}

double cosine_learning_rate(int64_t step, double peak, int64_t warmup, int64_t steps) {
  if (step < warmup) return peak * (step + 1) / warmup;
  const double progress = double(step - warmup) / std::max<int64_t>(1, steps - warmup);
  return peak * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * progress)));
}

int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = -1;
  if (!(statm >> pages >> resident)) return -1;
  return resident * sysconf(_SC_PAGESIZE);
}

int64_t peak_resident_bytes() {
  struct rusage usage {};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return int64_t{usage.ru_maxrss} * 1024;  // KiB on Linux
}

namespace {

// The first line of `path` as a byte count; nullopt when absent, "max" or unreadable.
std::optional<int64_t> read_limit(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!std::getline(in, text)) return std::nullopt;
  int64_t bytes = 0;
  if (!absl::SimpleAtoi(text, &bytes) || bytes <= 0) return std::nullopt;
  // cgroup v1 spells "no limit" as a page-rounded INT64_MAX.
  if (bytes >= (int64_t{1} << 62)) return std::nullopt;
  return bytes;
}

// This process's memory cgroup (from /proc/self/cgroup) and the smallest limit of it and
// its ancestors (a parent's limit bounds its children), if any.
std::pair<std::string, std::optional<int64_t>> memory_cgroup() {
  std::ifstream in("/proc/self/cgroup");
  std::string v2, v1;
  for (std::string line; std::getline(in, line);) {
    const std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) v2 = parts[2];
    for (absl::string_view controller : absl::StrSplit(parts[1], ',')) {
      if (controller == "memory") v1 = parts[2];
    }
  }
  const bool is_v1 = !v1.empty();
  std::string path = is_v1 ? v1 : v2;
  if (path.empty()) return {"", std::nullopt};
  const std::string root = is_v1 ? "/sys/fs/cgroup/memory" : "/sys/fs/cgroup";
  const char* file = is_v1 ? "/memory.limit_in_bytes" : "/memory.max";
  std::optional<int64_t> smallest;
  for (std::string at = path;; at = at.substr(0, at.rfind('/'))) {
    if (const std::optional<int64_t> limit = read_limit(root + at + file)) {
      smallest = smallest ? std::min(*smallest, *limit) : *limit;
    }
    if (at.empty() || at == "/") break;
  }
  return {absl::StrCat(is_v1 ? "v1:" : "v2:", path), smallest};
}

// The resident set of this process's parent (a launcher: fsdp_run, this binary starting
// its ranks, torchrun) when it shares this process's cgroups, else 0: it counts against the
// same limit.
int64_t parent_resident_in_same_cgroup() {
  const auto text = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::string parent = absl::StrCat("/proc/", getppid());
  if (text("/proc/self/cgroup") != text(parent + "/cgroup")) return 0;
  std::ifstream statm(parent + "/statm");
  int64_t pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * sysconf(_SC_PAGESIZE);
}

// Each rank's `values` (rank order, values.size() per rank), in one collective.
std::vector<int64_t> all_gather_int64(Communicator& comm, const std::vector<int64_t>& values,
                                      c10::Device device) {
  const auto count = static_cast<int64_t>(values.size());
  at::Tensor mine = at::tensor(values, at::kLong).to(device);
  at::Tensor all =
      at::empty({comm.world_size() * count}, at::TensorOptions().dtype(at::kLong).device(device));
  comm.all_gather_into_tensor(all, mine);
  all = all.cpu();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
}

std::string gib(int64_t bytes) { return absl::StrFormat("%.2f GiB", bytes / double(1 << 30)); }

}  // namespace

MemoryBudget rank_memory_budget(Communicator& comm, c10::Device device) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const auto [cgroup, limit] = memory_cgroup();
  const auto hash = [](const std::string& text) {
    return static_cast<int64_t>(std::hash<std::string>()(text));
  };
  // Per rank: its host's hash, then its cgroup's.
  const std::vector<int64_t> all =
      all_gather_int64(comm, {hash(host), hash(absl::StrCat(host, "/", cgroup))}, device);
  int64_t on_host = 0, in_cgroup = 0;
  for (int r = 0; r < comm.world_size(); ++r) {
    on_host += all[2 * r] == all[2 * comm.rank()];
    in_cgroup += all[2 * r + 1] == all[2 * comm.rank() + 1];
  }
  // Each rank on the host holds its resident set already; MemAvailable is what is left.
  const int64_t resident = std::max<int64_t>(resident_bytes(), 0);
  MemoryBudget budget;
  budget.bytes = resident + std::max<int64_t>(available_memory_bytes(), 0) / on_host;
  budget.why = absl::StrFormat("the machine's available memory shared by %d rank%s", on_host,
                               on_host == 1 ? "" : "s");
  if (limit) {
    const int64_t launcher = parent_resident_in_same_cgroup();
    const int64_t share = std::max<int64_t>(*limit - launcher, 0) / in_cgroup;
    if (share < budget.bytes) {
      budget.bytes = share;
      budget.why = absl::StrFormat(
          "its cgroup's memory limit of %s shared by %d rank%s%s", gib(*limit), in_cgroup,
          in_cgroup == 1 ? "" : "s",
          launcher > 0 ? absl::StrCat(" and their launcher's ", launcher >> 20, " MiB") : "");
    }
  }
  return budget;
}

std::vector<int64_t> peak_resident_set_of_ranks(Communicator& comm, c10::Device device) {
  return all_gather_int64(comm, {peak_resident_bytes()}, device);
}

std::vector<Communicator*> communicators_of(FullyShardedRoot& model, Communicator& root) {
  std::vector<Communicator*> all = {&root};
  for (const auto& unit : model.units()) {
    if (unit->handle() == nullptr) continue;
    for (Communicator* c :
         {&unit->handle()->communicator(), unit->handle()->replicate_communicator()}) {
      if (c != nullptr && std::find(all.begin(), all.end(), c) == all.end()) all.push_back(c);
    }
  }
  return all;
}

}  // namespace fsdp::examples
