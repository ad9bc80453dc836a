#include "examples/trainer/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include "examples/trainer/lever_flags.h"
#include "examples/trainer/metrics.h"
#include "examples/trainer/run_support.h"
#include "fsdp/base/torch_compat_cuda.h"
#include "fsdp/comm/launcher.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/caching_cpu_allocator.h"
#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/dcp_checkpoint.h"

namespace fsdp::examples {
namespace {

// Applies `defaults` (flags not given on the command line) through absl's reflection:
// "" or why one could not be set.
std::string apply_defaults(const std::vector<FlagValue>& defaults) {
  for (const FlagValue& value : defaults) {
    std::string error;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(value.name);
    if (flag == nullptr || !flag->ParseFrom(value.value, &error)) {
      return absl::StrCat("cannot set the CUDA default --", value.name, "=", value.value, ": ",
                          error);
    }
  }
  return "";
}

// The flags of `text` (program_flags as "name\0value\0" pairs).
std::vector<FlagValue> parse_flag_text(const std::string& text) {
  std::vector<FlagValue> flags;
  size_t at = 0;
  while (at < text.size()) {
    const size_t name_end = text.find('\0', at);
    const size_t value_end =
        name_end == std::string::npos ? name_end : text.find('\0', name_end + 1);
    TORCH_INTERNAL_ASSERT(value_end != std::string::npos, "a rank's flags are cut short");
    flags.push_back(
        {text.substr(at, name_end - at), text.substr(name_end + 1, value_end - name_end - 1)});
    at = value_end + 1;
  }
  return flags;
}

}  // namespace

std::vector<FlagValue> program_flags() {
  std::vector<FlagValue> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    // absl's own (--flagfile, --fromenv, --help, ...) say how flags were given, not the
    // run; --world_size says how many ranks to start, and the CUDA defaults set it to each
    // host's device count: the process group's size is what the ranks share.
    if (flag->IsRetired() || absl::StrContains(flag->Filename(), "absl/") || name == "world_size") {
      continue;
    }
    flags.push_back({std::string(name), flag->CurrentValue()});
  }
  std::sort(flags.begin(), flags.end(),
            [](const FlagValue& a, const FlagValue& b) { return a.name < b.name; });
  return flags;
}

std::string flag_difference(const std::vector<std::vector<FlagValue>>& flags) {
  for (size_t r = 1; r < flags.size(); ++r) {
    if (flags[r].size() != flags[0].size()) {
      return absl::StrCat("rank ", r, " runs a program with ", flags[r].size(),
                          " flags but rank 0 one with ", flags[0].size(),
                          "; start every rank from the same binary");
    }
    for (size_t i = 0; i < flags[0].size(); ++i) {
      if (flags[r][i] == flags[0][i]) continue;
      if (flags[r][i].name != flags[0][i].name) {
        return absl::StrCat("rank ", r, " has flag --", flags[r][i].name, " where rank 0 has --",
                            flags[0][i].name, "; start every rank from the same binary");
      }
      return absl::StrCat("rank ", r, " was started with --", flags[r][i].name, "=",
                          flags[r][i].value, " but rank 0 with --", flags[0][i].name, "=",
                          flags[0][i].value, "; start every rank with the same flags");
    }
  }
  return "";
}

void check_same_flags(Communicator& comm, c10::Device device) {
  std::string text;
  for (const FlagValue& flag : program_flags()) {
    text += flag.name;
    text.push_back('\0');
    text += flag.value;
    text.push_back('\0');
  }
  const int world = comm.world_size();
  at::Tensor length = at::tensor({int64_t(text.size())}, at::kLong).to(device);
  at::Tensor lengths = at::empty({world}, at::dtype(at::kLong).device(device));
  comm.all_gather_into_tensor(lengths, length);
  lengths = lengths.cpu();
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::copy(text.begin(), text.end(), reinterpret_cast<char*>(mine.data_ptr<uint8_t>()));
  at::Tensor all = at::empty({world * longest}, at::dtype(at::kByte).device(device));
  comm.all_gather_into_tensor(all, mine.to(device));
  all = all.cpu();
  std::vector<std::vector<FlagValue>> flags;
  for (int r = 0; r < world; ++r) {
    const char* begin = reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest;
    flags.push_back(parse_flag_text(std::string(begin, lengths[r].item<int64_t>())));
  }
  const std::string difference = flag_difference(flags);
  TORCH_CHECK(difference.empty(), difference);
}

int trainer_main(int argc, char** argv, const char* name, const TrainerHooks& hooks) {
  if (const absl::Status entered = enter_build_working_directory(); !entered.ok()) {
    std::cerr << name << ": " << entered.message() << "\n";
    return 2;
  }
  use_run_flag_defaults(hooks.defaults);
  install_caching_cpu_allocator();  // before any tensor: see caching_cpu_allocator.h
  allow_bare_resume_flag(argc, argv);
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {  // positional[0] is the program
    std::vector<std::string> extra(positional.begin() + 1, positional.end());
    for (std::string& argument : extra) argument = "'" + argument + "'";
    std::cerr << name << ": unexpected argument" << (extra.size() > 1 ? "s " : " ")
              << absl::StrJoin(extra, ", ")
              << ": the trainer takes only --flags (see --help); pass values as --name=value\n";
    return 2;
  }
  // Every flag is checked before a rank starts or a file is touched. On CUDA the flags
  // not given take the trainer's CUDA defaults first; a self-launched rank runs this too,
  // on the same command line and machine, so every rank ends with the same values.
  const MachineLimits machine = this_machine();
  std::string error;
  if (machine.cuda_devices > 0 &&
      resolve_device(absl::GetFlag(FLAGS_device), machine.cuda_devices) == "cuda" &&
      hooks.cuda_defaults) {
    error = apply_defaults(hooks.cuda_defaults(machine.cuda_devices));
  }
  const RunFlags run_flags = run_flags_from_command_line();
  if (error.empty()) error = run_flag_error(run_flags, machine);
  if (error.empty() && hooks.flag_error) error = hooks.flag_error(machine);
  if (!error.empty()) {
    std::cerr << name << ": " << error << "\n";
    return 2;
  }
  // From here on --device is cpu or cuda and --mixed_precision bf16, pure_bf16 or none.
  resolve_lever_flags(machine.cuda_devices,
                      hooks.weights_dtype ? hooks.weights_dtype() : at::kFloat);
  if (run_flags.launched_world_size == 0 && run_flags.world_size > 1) {
    return launch_self(run_flags.world_size, argc, argv);
  }
  try {
    // Before anything asks LibTorch about CUDA (fsdp/base/torch_compat_cuda.h): a CPU run
    // never maps libtorch_cuda.
    if (absl::GetFlag(FLAGS_device) == "cuda") compat::load_torch_cuda();
    return hooks.run();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::cerr << name << ": " << what.substr(0, what.find('\n')) << "\n";
    return 1;
  }
}

namespace {

// Sets the current CUDA device before the process group starts (NCCL binds to it).
c10::Device rank_device(const std::string& device_flag) {
  std::cout << std::unitbuf;  // stdout is a pipe under the launcher: show progress live
  at::set_num_threads(1);
  const c10::Device device = compute_device(device_flag);
  if (device.is_cuda()) c10::cuda::set_device(device.index());
  return device;
}

}  // namespace

TrainingRun::TrainingRun(RunFlags flags)
    : flags_(std::move(flags)),
      device_(rank_device(flags_.device)),
      comm_(init_from_environment(
          RendezvousOptions()
              .timeout(std::chrono::seconds(flags_.timeout_s))
              .backend(device_.is_cuda() ? Backend::kNccl : Backend::kGloo))) {
  check_same_flags(*comm_, device_);
  lock_ = lock_out_dir(*comm_, flags_.out_dir, device_);
}

TrainingRun::~TrainingRun() {
  if (lock_ >= 0) ::close(lock_);
}

int64_t TrainingRun::start(FullyShardedRoot& model, torch::optim::Optimizer& optimizer,
                           SchedulerState* scheduler, const std::function<double(int64_t)>& lr_at) {
  const ResumeFlag resume = parse_resume_flag(flags_.resume);
  const std::string checkpoints = flags_.checkpoints();
  const int64_t first =  // before anything is written
      !resume.dir.empty()
          ? resume_from(model, optimizer, *comm_, resume.dir, lead(), scheduler)
          : resume_step(model, optimizer, checkpoints, resume.resume, lead(), scheduler);
  check_resumed_step(first, flags_.steps);
  if (scheduler != nullptr) {
    // A checkpoint without a scheduler state (or a fresh run) starts at its step.
    if (scheduler->last_epoch == 0 && lr_at) *scheduler = {first, {lr_at(first)}};
    TORCH_CHECK(scheduler->last_epoch == first, "--resume: the checkpoint of step ", first,
                " holds the LR schedule of step ", scheduler->last_epoch,
                "; it was written by another run: start a new run with --overwrite");
  }
  check_fresh_run(*comm_, flags_.out_dir, checkpoints, resume.resume, flags_.overwrite, device_);
  if (lead()) std::filesystem::create_directories(checkpoints);
  remove_leftover_checkpoints(checkpoints, lead());
  if (lead()) {
    std::string warning;
    csv_ = open_metrics(flags_.out_dir + "/metrics.csv", first, &warning);
    if (!warning.empty()) std::cout << warning << "\n";
  }
  memory_csv_.open(absl::StrFormat("%s/memory_rank%d.csv", flags_.out_dir, comm_->rank()),
                   first > 0 ? std::ios::app : std::ios::trunc);
  if (first == 0) memory_csv_ << "step,rss_mb,tracked_mb,peak_tracked_mb\n";
  // Background checkpoint writes run their collectives over a communicator of their own
  // (Note [A communicator for checkpoint I/O] in fsdp/state/async_checkpoint.cc).
  if (flags_.async_save && flags_.checkpoint_interval > 0) {
    checkpoint_comm_ = make_checkpoint_communicator(*comm_);
  }
  for (Communicator* c : communicators_of(model, *comm_)) c->counters().reset();
  first_ = first;
  start_time_ = std::chrono::steady_clock::now();
  return first;
}

void TrainingRun::check_loss(int64_t step, double train_loss) const {
  TORCH_CHECK(std::isfinite(train_loss), "step ", step, ": the training loss is ", train_loss,
              step == first_ + 1
                  ? " in the run's first step: the weights it started from (the model folder "
                    "or checkpoint) or its data may hold NaN or inf, or --lr is far too high"
                  : ": the run diverged; try a lower --lr or more --warmup_steps",
              ". Stopped before writing this step's checkpoint or the model; the earlier "
              "checkpoints are kept");
}

void TrainingRun::checkpoint_if_due(int64_t step, FullyShardedRoot& model,
                                    torch::optim::Optimizer& optimizer,
                                    const SchedulerState* scheduler) {
  if (flags_.checkpoint_interval == 0 || step % flags_.checkpoint_interval != 0) return;
  const auto begin = std::chrono::steady_clock::now();
  const std::string path = absl::StrFormat("%s/step_%08d", flags_.checkpoints(), step);
  const bool dcp = flags_.checkpoint_format == "dcp";
  // {"model", "optim", "step", "lr_scheduler"} as PyTorch trainers save them.
  DcpCheckpointOptions dcp_options = DcpCheckpointOptions().extras({{"step", int64_t{step}}});
  if (flags_.async_save) {
    // Waits for the previous write first; the write's error, if any, is raised by the
    // next save or by wait_for_async_saves in finish().
    const AsyncSaveOptions options = AsyncSaveOptions().communicator(checkpoint_comm_);
    (void)(dcp ? async_save_dcp_checkpoint(model, &optimizer, path, dcp_options, scheduler, options)
               : async_save_sharded_checkpoint(model, &optimizer, path, scheduler, options));
  } else if (dcp) {
    if (scheduler != nullptr) dcp_options.extras().push_back(scheduler_dcp_extra(*scheduler));
    save_dcp_checkpoint(model, &optimizer, path, dcp_options);
  } else {
    save_sharded_checkpoint(model, &optimizer, path, scheduler);
  }
  if (lead()) {
    std::cout << absl::StrFormat(
        "checkpoint: %s (%.2f s%s)\n", path,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count(),
        flags_.async_save ? " to stage; written in the background" : "");
  }
}

double TrainingRun::tokens_per_second(int64_t step) const {
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
  return double(flags_.batch_size * flags_.context) * double(step - first_) / seconds;
}

bool TrainingRun::record(int64_t step, const StepRecord& record, FullyShardedRoot& model,
                         const std::string& extra) {
  const bool log = step % flags_.log_interval == 0 || step == flags_.steps;
  if (log) {
    DeviceHandle& handle = model.device_handle();
    memory_csv_ << absl::StrFormat("%d,%.2f,%.2f,%.2f\n", step, resident_bytes() / 1e6,
                                   handle.memory_allocated() / 1e6,
                                   handle.max_memory_allocated() / 1e6)
                << std::flush;
  }
  if (!lead()) return log;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
  const double tokens_per_s = tokens_per_second(step);
  csv_ << absl::StrFormat("%d,%.7f,%s,%.6f,%.0f\n", step, record.train_loss,
                          record.validation_loss ? absl::StrFormat("%.7f", *record.validation_loss)
                                                 : std::string(),
                          record.lr, tokens_per_s)
       << std::flush;  // a killed run keeps every row
  // A row that cannot be written (a full disk) stops the run: the curve is never
  // silently cut.
  TORCH_CHECK(csv_.good(), "cannot write ", flags_.out_dir, "/metrics.csv: ", std::strerror(errno),
              "; free space and continue with --resume");
  if (log) {
    std::cout << absl::StrFormat("step %d/%d | loss %.4f | lr %.2e | %.0f tok/s%s | ETA %.0f s\n",
                                 step, flags_.steps, record.train_loss, record.lr, tokens_per_s,
                                 extra,
                                 seconds / double(step - first_) * double(flags_.steps - step));
  }
  return log;
}

void TrainingRun::finish(FullyShardedRoot& model) {
  wait_for_async_saves();  // the last checkpoint is complete before the run ends
  // The steps since the last periodic schedule check are compared too.
  if (comm_->schedule_checks_enabled()) model.check_collective_schedule();
  int64_t sent = 0;
  for (Communicator* c : communicators_of(model, *comm_)) sent += c->counters().total().bytes_sent;
  const double per_step = double(sent) / double(std::max<int64_t>(1, flags_.steps - first_));
  at::Tensor mine =
      at::tensor({double(model.device_handle().max_memory_allocated()), per_step}, at::kDouble)
          .to(device_);
  at::Tensor all = at::empty({2 * comm_->world_size()}, at::dtype(at::kDouble).device(device_));
  comm_->all_gather_into_tensor(all, mine);
  all = all.cpu();
  if (lead()) {
    for (int r = 0; r < comm_->world_size(); ++r) {
      std::cout << absl::StrFormat("rank %d: peak memory %.1f MB, sent %.2f MB per step\n", r,
                                   all[2 * r].item<double>() / 1e6,
                                   all[2 * r + 1].item<double>() / 1e6);
    }
  }
  csv_.close();
  memory_csv_.close();
}

}  // namespace fsdp::examples
