// Trains a character-level GPT on Debian's fortunes with FSDP.
//
//   bazel run -c opt //examples/gpt:train                  # 2 ranks, FULL_SHARD
//   bazel run -c opt //examples/gpt:train -- --world_size=1 --steps=100
//   fsdp_run --nproc_per_node=4 -- bazel-bin/examples/gpt/train --sharding_strategy=shard_grad_op
//
// Without RANK in its environment the program starts --world_size ranks of itself (like
// fsdp_run); under fsdp_run, torchrun, mpirun or srun it is one rank. Rank 0 prints a
// progress line per --log_interval steps, the validation loss every --eval_interval
// steps, per-rank peak memory and traffic at the end, and a text sample; it writes
// metrics.csv, loss.png (gnuplot) and model.pt (the full state dict, which torch.load
// reads) into --out_dir. Every --checkpoint_interval steps the ranks write a sharded
// checkpoint (model, optimizer, step and the LR schedule's position) to
// --checkpoint_dir/step_NNNNNNNN, by default as a PyTorch Distributed Checkpoint folder
// (--checkpoint_format=dcp|fsdp) and asynchronously (--async_save: training stops only
// while the shards are copied to host memory; the files are written in the background,
// and the run waits for the last write before it ends); --resume continues from the
// newest complete one (either format), on the same loss curve, and --resume=DIR from
// folder DIR (e.g. one PyTorch's dcp.save wrote). Each rank logs its resident
// memory and tracked tensor bytes every --log_interval steps to memory_rank<R>.csv.
// Ctrl-C stops every rank.
//
// --device=auto (the default) trains on CUDA when this process sees a CUDA device, else
// on the CPU (Note [The compute device] in flags.h): on CUDA rank r uses cuda:LOCAL_RANK
// over NCCL with bf16 mixed precision, a GPT-2-small-sized model for the model flags not
// given, and the progress lines add the model FLOP utilisation (mfu.h). The memory levers
// (--mixed_precision, --cpu_offload, --sharding_strategy, --hybrid_shard_group_size,
// --activation_checkpointing, --grad_accumulation_steps) are those of examples/llama/finetune
// too (lever_flags.h).
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "examples/gpt/corpus.h"
#include "examples/gpt/flags.h"
#include "examples/gpt/lever_flags.h"
#include "examples/gpt/metrics.h"
#include "examples/gpt/mfu.h"
#include "examples/gpt/model.h"
#include "examples/gpt/model_flags.h"
#include "examples/gpt/run_support.h"
#include "fsdp/base/torch_compat_cuda.h"
#include "fsdp/comm/launcher.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/caching_cpu_allocator.h"
#include "fsdp/core/device_handle.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/tracking_allocator.h"
#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/dcp_checkpoint.h"
#include "fsdp/wrap/policy.h"

ABSL_FLAG(int, world_size, 2, "ranks to start when not launched by fsdp_run/torchrun");
ABSL_FLAG(std::string, policy, "transformer",
          "units: transformer (each block) or root (one unit for the whole model)");
ABSL_FLAG(int64_t, batch_size, 32, "global batch (sequences), split evenly across ranks");
ABSL_FLAG(int64_t, steps, 1200, "training steps");
ABSL_FLAG(double, lr, 3e-3, "peak learning rate (AdamW)");
ABSL_FLAG(int64_t, warmup_steps, 50, "linear warm-up steps, then cosine decay to lr / 10");
ABSL_FLAG(int64_t, log_interval, 10, "steps between progress lines");
ABSL_FLAG(int64_t, eval_interval, 200, "steps between validation losses");
ABSL_FLAG(int64_t, eval_batches, 8, "global batches per validation loss");
ABSL_FLAG(int64_t, sample_length, 300, "characters to sample at the end (0: none)");
ABSL_FLAG(std::string, out_dir, "/tmp/fsdp_gpt", "where metrics.csv, loss.png, model.pt go");
ABSL_FLAG(std::string, checkpoint_dir, "", "sharded checkpoints (default: OUT_DIR/checkpoints)");
ABSL_FLAG(int64_t, checkpoint_interval, 200, "steps between checkpoints (0: none)");
ABSL_FLAG(bool, async_save, true,
          "write checkpoints in the background (training stops only for the copy to host "
          "memory); false: training waits for each write");
ABSL_FLAG(int64_t, timeout_s, 300,
          "seconds to wait for every rank at start-up and in each collective; a rank that "
          "died is usually noticed at once (its connections close)");
ABSL_FLAG(std::string, resume, "",
          "--resume: continue from the newest complete checkpoint in --checkpoint_dir (either "
          "format); --resume=DIR: from checkpoint folder DIR, e.g. one PyTorch's dcp.save wrote "
          "with {\"model\", \"optim\", \"step\"} as get_state_dict lays them out");
ABSL_FLAG(std::string, checkpoint_format, "dcp",
          "dcp: PyTorch Distributed Checkpoint folders (.metadata, __RANK_0.distcp; "
          "torch.distributed.checkpoint.load reads them) holding {\"model\", \"optim\", "
          "\"step\", \"lr_scheduler\"}; fsdp: fsdp's own (metadata.pt, rank_NNNNN.pt); "
          "either one written in the background with --async_save");
ABSL_FLAG(bool, overwrite, false,
          "start over in an --out_dir that holds another run's checkpoints (deletes them)");
ABSL_FLAG(bool, plan_check, false,
          "check every step against the model's per-rank plan (fsdp/core/memory_plan.h): "
          "the progress line shows measured/planned, a rank above its plan stops naming the "
          "term, and rank 0 prints each term measured and planned at the end");
ABSL_FLAG(int64_t, schedule_check_every, fsdp::kDefaultScheduleCheckEvery,
          "compare the ranks' collective schedules every N FSDP iterations (forward and "
          "backward, or an evaluation forward) and after the last step, so that ranks that "
          "took different branches stop with one error naming the step and the collective "
          "(FullyShardedDataParallelOptions::schedule_check_every); 0: off. Gloo only (off "
          "with NCCL)");

namespace fsdp::examples {
namespace {

using Model = FullyShardedDataParallel<GptImpl>;

TrainerFlags flags_from_command_line() {
  TrainerFlags f;
  static_cast<LeverFlags&>(f) = lever_flags_from_command_line();
  const char* launched = std::getenv("RANK") != nullptr ? std::getenv("WORLD_SIZE") : nullptr;
  if (launched == nullptr || !absl::SimpleAtoi(launched, &f.launched_world_size)) {
    f.launched_world_size = 0;
  }
  f.world_size = absl::GetFlag(FLAGS_world_size);
  f.policy = absl::GetFlag(FLAGS_policy);
  f.layers = absl::GetFlag(FLAGS_layers);
  f.width = absl::GetFlag(FLAGS_width);
  f.heads = absl::GetFlag(FLAGS_heads);
  f.context = absl::GetFlag(FLAGS_context);
  f.batch_size = absl::GetFlag(FLAGS_batch_size);
  f.steps = absl::GetFlag(FLAGS_steps);
  f.lr = absl::GetFlag(FLAGS_lr);
  f.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  f.log_interval = absl::GetFlag(FLAGS_log_interval);
  f.eval_interval = absl::GetFlag(FLAGS_eval_interval);
  f.eval_batches = absl::GetFlag(FLAGS_eval_batches);
  f.sample_length = absl::GetFlag(FLAGS_sample_length);
  f.checkpoint_interval = absl::GetFlag(FLAGS_checkpoint_interval);
  f.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  f.peak_tflops = absl::GetFlag(FLAGS_peak_tflops);
  return f;
}

// Note [The compute device] (flags.h): on CUDA, the flags not given on the command line
// (nor in a --flagfile) take their CUDA defaults. A self-launched rank runs this too, on
// the same command line and machine, so every rank ends with the same values. Returns ""
// or why a default could not be set (a bug).
std::string apply_device_defaults(const MachineLimits& machine) {
  if (machine.cuda_devices == 0 ||
      resolve_device(absl::GetFlag(FLAGS_device), machine.cuda_devices) != "cuda") {
    return "";
  }
  for (const FlagValue& value :
       cuda_defaults(flags_from_command_line(), machine.cuda_devices, specified_on_command_line)) {
    std::string error;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(value.name);
    if (flag == nullptr || !flag->ParseFrom(value.value, &error)) {
      return absl::StrCat("cannot set the CUDA default --", value.name, "=", value.value, ": ",
                          error);
    }
  }
  return "";
}

AutoWrapPolicy parse_policy(const std::string& name) {
  if (name == "transformer") return transformer_auto_wrap_policy({ModuleType::of<BlockImpl>()});
  if (name == "root") return lambda_auto_wrap_policy([](const ModuleNode&) { return false; });
  TORCH_CHECK(false, "--policy must be transformer or root, got '", name, "'");
}

double learning_rate(int64_t step) {
  return cosine_learning_rate(step, absl::GetFlag(FLAGS_lr), absl::GetFlag(FLAGS_warmup_steps),
                              absl::GetFlag(FLAGS_steps));
}

// This rank's share of global batch `index` (the same windows whatever the world size).
std::pair<at::Tensor, at::Tensor> batch(const at::Tensor& tokens, int64_t index, Communicator& comm,
                                        c10::Device device) {
  const int64_t global = absl::GetFlag(FLAGS_batch_size);
  const int64_t context = absl::GetFlag(FLAGS_context);
  TORCH_CHECK(global % comm.world_size() == 0, "--batch_size ", global,
              " must be a multiple of the world size ", comm.world_size());
  at::manual_seed(absl::GetFlag(FLAGS_seed) * 1000003 + index);
  const at::Tensor starts = at::randint(tokens.numel() - context - 1, {global}, at::kLong);
  const int64_t local = global / comm.world_size();
  auto [x, y] = windows(tokens, starts.narrow(0, comm.rank() * local, local), context);
  return {x.to(device), y.to(device)};
}

double validation_loss(Model& model, const Corpus& corpus, Communicator& comm) {
  torch::NoGradGuard no_grad;
  double sum = 0;
  const int64_t batches = absl::GetFlag(FLAGS_eval_batches);
  for (int64_t i = 0; i < batches; ++i) {
    auto [x, y] = batch(corpus.validation, -1 - i, comm,
                        model->device_handle().device());  // fixed batches
    sum += global_mean(next_token_loss(model->forward(x), y), comm);
  }
  return sum / batches;
}

std::string sample(Model& model, const Corpus& corpus) {
  torch::NoGradGuard no_grad;
  at::manual_seed(absl::GetFlag(FLAGS_seed));  // identical on every rank
  const int64_t context = absl::GetFlag(FLAGS_context);
  at::Tensor ids = corpus.train.narrow(0, 0, 1).view({1, 1});
  for (int64_t i = 0; i < absl::GetFlag(FLAGS_sample_length); ++i) {
    const int64_t t = std::min<int64_t>(ids.size(1), context);
    at::Tensor logits =
        model->forward(ids.narrow(1, ids.size(1) - t, t).to(model->device_handle().device()));
    // Drawn on the CPU in fp32: the same text on every rank and device.
    at::Tensor probs = at::softmax(logits.select(1, t - 1).to(at::kCPU, at::kFloat) / 0.8, -1);
    ids = at::cat({ids, at::multinomial(probs, 1)}, 1);
  }
  return corpus.decode(ids);
}

// Runs `gnuplot loss.gnuplot` in `dir` without a shell, its stderr discarded: any folder
// name works (spaces, quotes, non-ASCII letters). Returns its exit status, or -1 with
// errno when it cannot start (ENOENT: not on PATH).
int run_gnuplot(const std::string& dir) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addchdir_np(&actions, dir.c_str());
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  char program[] = "gnuplot";
  char script[] = "loss.gnuplot";
  char* argv[] = {program, script, nullptr};
  pid_t pid = 0;
  const int error = ::posix_spawnp(&pid, program, &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) {
    errno = error;
    return -1;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void plot(const std::string& dir) {
  // File names relative to `dir`, where gnuplot runs: nothing to quote.
  std::ofstream(dir + "/loss.gnuplot")
      << "set terminal png size 900,500\nset output 'loss.png'\nset datafile separator ','\n"
      << "set key top right\nset xlabel 'step'\nset ylabel 'cross-entropy (nats/char)'\n"
      << "plot 'metrics.csv' using 1:2 skip 1 with lines title 'train', '' using 1:3 skip 1 "
      << "with linespoints title 'validation'\n";
  const int status = run_gnuplot(dir);
  if (status == -1 && errno == ENOENT) {
    std::cout << "gnuplot not found: no loss.png (tools/setup.sh installs it)\n";
  } else if (status != 0) {
    std::cout << "gnuplot could not plot " << dir << "/metrics.csv: no loss.png\n";
  }
}

std::string checkpoint_dir() {
  const std::string dir = absl::GetFlag(FLAGS_checkpoint_dir);
  return dir.empty() ? absl::GetFlag(FLAGS_out_dir) + "/checkpoints" : dir;
}

// Every rank must run with the flags rank 0 has: a rank with another --steps would leave
// the others waiting in a collective. Raises on every rank naming the first difference.
void check_same_flags(Communicator& comm, c10::Device device) {
  const TrainerFlags f = flags_from_command_line();
  const std::vector<std::pair<const char*, double>> values = {
      {"steps", double(f.steps)},
      {"batch_size", double(f.batch_size)},
      {"context", double(f.context)},
      {"width", double(f.width)},
      {"layers", double(f.layers)},
      {"heads", double(f.heads)},
      {"lr", f.lr},
      {"warmup_steps", double(f.warmup_steps)},
      {"log_interval", double(f.log_interval)},
      {"eval_interval", double(f.eval_interval)},
      {"eval_batches", double(f.eval_batches)},
      {"sample_length", double(f.sample_length)},
      {"checkpoint_interval", double(f.checkpoint_interval)},
      {"seed", double(absl::GetFlag(FLAGS_seed))},
      // Strings as 48-bit hashes (exact in a double).
      {"resume", double(std::hash<std::string>()(absl::GetFlag(FLAGS_resume)) & 0xffffffffffff)},
      {"checkpoint_format",
       double(std::hash<std::string>()(absl::GetFlag(FLAGS_checkpoint_format)) & 0xffffffffffff)},
      {"async_save", double(absl::GetFlag(FLAGS_async_save))},
      {"cuda", double(f.device == "cuda")},
      {"bf16", double(f.mixed_precision == "bf16")},
      {"pure_bf16", double(f.mixed_precision == "pure_bf16")},
      {"cpu_offload", double(f.cpu_offload)},
      {"activation_checkpointing", double(f.activation_checkpointing)},
      {"grad_accumulation_steps", double(f.grad_accumulation_steps)},
  };
  const int64_t n = static_cast<int64_t>(values.size());
  at::Tensor mine = at::empty({n}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) mine.data_ptr<double>()[i] = values[i].second;
  at::Tensor all = at::empty({n * comm.world_size()}, at::dtype(at::kDouble).device(device));
  comm.all_gather_into_tensor(all, mine.to(device));
  all = all.cpu();
  const double* got = all.data_ptr<double>();
  for (int r = 1; r < comm.world_size(); ++r) {
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(got[r * n + i] == got[i], "rank ", r, " was started with --", values[i].first,
                  "=", got[r * n + i], " but rank 0 with --", values[i].first, "=", got[i],
                  "; start every rank with the same flags");
    }
  }
}

// A row that cannot be written (a full disk) stops the run: the curve is never silently
// cut.
void check_written(std::ostream& out, const std::string& path) {
  TORCH_CHECK(out.good(), "cannot write ", path, ": ", std::strerror(errno),
              "; free space and continue with --resume");
}

int train() {
  std::cout << std::unitbuf;  // stdout is a pipe under the launcher: show progress live
  at::set_num_threads(1);
  MemoryTracker memory;
  // On the CPU the model and its tensors stay there (Gloo on any host); on CUDA, rank r
  // works on cuda:LOCAL_RANK over NCCL.
  // --device is resolved by main().
  const c10::Device device = compute_device(absl::GetFlag(FLAGS_device));
  if (device.is_cuda()) c10::cuda::set_device(device.index());
  std::shared_ptr<Communicator> comm =
      init_from_environment(RendezvousOptions()
                                .timeout(std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)))
                                .backend(device.is_cuda() ? Backend::kNccl : Backend::kGloo));
  const bool lead = comm->rank() == 0;
  check_same_flags(*comm, device);
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  const int lock = lock_out_dir(*comm, dir, device);
  const Corpus corpus = load_fortunes(absl::GetFlag(FLAGS_data_dir));
  const int64_t context = absl::GetFlag(FLAGS_context);
  TORCH_CHECK(corpus.validation.numel() > context + 1, "--context=", context, ": the corpus in '",
              absl::GetFlag(FLAGS_data_dir), "' has ", corpus.train.numel(), " training and ",
              corpus.validation.numel(),
              " validation characters (every 10th fortune); a "
              "window needs context + 2 = ",
              context + 2,
              " characters in each; lower "
              "--context or add text");

  at::manual_seed(absl::GetFlag(FLAGS_seed));
  auto gpt = std::make_shared<GptImpl>(GptOptions()
                                           .vocab_size(corpus.vocab_size())
                                           .context(absl::GetFlag(FLAGS_context))
                                           .width(absl::GetFlag(FLAGS_width))
                                           .heads(absl::GetFlag(FLAGS_heads))
                                           .layers(absl::GetFlag(FLAGS_layers)));
  int64_t numel = 0;
  for (const auto& p : gpt->parameters()) numel += p.numel();
  const LeverFlags levers = lever_flags_from_command_line();
  const bool bf16 = levers.mixed_precision == "bf16";
  gpt->to(model_dtype(levers.mixed_precision));  // bf16 for pure_bf16, else fp32 masters
  for (auto& unit : gpt->units)
    unit->module()->checkpoint_activations = levers.activation_checkpointing;
  const FullyShardedDataParallelOptions options =
      lever_options(comm, levers)
          .auto_wrap_policy(parse_policy(absl::GetFlag(FLAGS_policy)))
          .plan_check(absl::GetFlag(FLAGS_plan_check))
          .schedule_check_every(absl::GetFlag(FLAGS_schedule_check_every));
  Model model(gpt, options);
  DeviceHandle& handle = model->device_handle();
  // Model FLOP utilisation needs the device's peak (mfu.h); the CPU has one only by flag.
  const std::string device_name =
      device.is_cuda() ? cuda_device_name(device.index()) : std::string("CPU");
  const std::optional<double> peak_flops =
      peak_bf16_flops(device.is_cuda() ? device_name : "", absl::GetFlag(FLAGS_peak_tflops));
  torch::optim::AdamW adamw(model->parameters(),
                            torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  if (lead) {
    std::cout << absl::StrFormat(
        "corpus: %d fortunes, %d train / %d validation characters, vocabulary %d\n"
        "model: %d parameters in %d units over %d ranks (%s)\n",
        corpus.entries, corpus.train.numel(), corpus.validation.numel(), corpus.vocab_size(), numel,
        model->units().size(), comm->world_size(),
        sharding_strategy_name(model->sharding_strategy()));
    if (device.is_cuda()) {
      std::cout << absl::StrFormat(
          "device: cuda:LOCAL_RANK (%s), NCCL, %s; peak bf16 %s\n", device_name,
          bf16 ? "bf16 mixed precision (param_dtype bf16, reduce_dtype fp32)"
          : levers.mixed_precision == "pure_bf16" ? "pure bf16"
                                                  : "fp32",
          peak_flops ? absl::StrFormat("%.1f TFLOP/s; %s", *peak_flops / 1e12, kMfuFormula)
                     : std::string("unknown (pass --peak_tflops for the MFU)"));
    }
  }
  const int64_t interval = absl::GetFlag(FLAGS_checkpoint_interval);
  const ResumeFlag resume = parse_resume_flag(absl::GetFlag(FLAGS_resume));
  const std::string format = absl::GetFlag(FLAGS_checkpoint_format);
  TORCH_CHECK(format == "dcp" || format == "fsdp", "--checkpoint_format must be dcp or fsdp, not '",
              format, "'");
  // The LR schedule's position, as torch.optim.lr_scheduler keeps it: last_epoch
  // scheduler steps taken, last_lr the LR of the next step. A checkpoint carries it.
  SchedulerState scheduler{0, {learning_rate(0)}};
  const int64_t first =  // before anything is written
      !resume.dir.empty()
          ? resume_from(*model, adamw, *comm, resume.dir, lead, &scheduler)
          : resume_step(*model, adamw, checkpoint_dir(), resume.resume, lead, &scheduler);
  check_resumed_step(first, absl::GetFlag(FLAGS_steps));
  // A checkpoint without a scheduler state (an older fsdp) resumes at its step.
  if (scheduler.last_epoch == 0) scheduler = {first, {learning_rate(first)}};
  TORCH_CHECK(scheduler.last_epoch == first, "--resume: the checkpoint of step ", first,
              " holds the LR schedule of step ", scheduler.last_epoch,
              "; it was written by another run: start a new run with --overwrite");
  check_fresh_checkpoints(*comm, checkpoint_dir(), resume.resume, absl::GetFlag(FLAGS_overwrite));
  if (lead) std::filesystem::create_directories(checkpoint_dir());
  remove_leftover_checkpoints(checkpoint_dir(), lead);
  std::ofstream csv;
  if (lead) {
    std::string warning;
    csv = open_metrics(dir + "/metrics.csv", first, &warning);
    if (!warning.empty()) std::cout << warning << "\n";
  }
  std::ofstream memory_csv(absl::StrFormat("%s/memory_rank%d.csv", dir, comm->rank()),
                           first > 0 ? std::ios::app : std::ios::trunc);
  if (first == 0) memory_csv << "step,rss_mb,tracked_mb,peak_tracked_mb\n";
  const double initial = validation_loss(model, corpus, *comm);
  if (lead) std::cout << "step " << first << ": validation loss " << initial << "\n";

  // Background checkpoint writes run their collectives over a communicator of their own
  // (Note [A communicator for checkpoint I/O] in fsdp/state/async_checkpoint.cc).
  const std::shared_ptr<Communicator> checkpoint_comm =
      absl::GetFlag(FLAGS_async_save) && absl::GetFlag(FLAGS_checkpoint_interval) > 0
          ? make_checkpoint_communicator(*comm)
          : nullptr;
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t tokens_per_step = absl::GetFlag(FLAGS_batch_size) * absl::GetFlag(FLAGS_context);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Communicator*> communicators = communicators_of(*model, *comm);
  for (Communicator* c : communicators) c->counters().reset();
  PlanCheckResult plan_check;  // the last step's, with --plan_check
  for (int64_t step = first; step < steps; ++step) {
    const double lr = scheduler.last_lr.at(0);
    for (auto& group : adamw.param_groups()) group.options().set_lr(lr);
    auto [x, y] = batch(corpus.train, step, *comm, device);
    adamw.zero_grad();
    // --grad_accumulation_steps: this rank's share in equal micro-batches, no_sync between.
    const int64_t micro = x.size(0) / levers.grad_accumulation_steps;
    const at::Tensor loss =
        accumulate_gradients(*model, levers.grad_accumulation_steps, [&](int64_t k) {
          return next_token_loss(model->forward(x.narrow(0, k * micro, micro)),
                                 y.narrow(0, k * micro, micro));
        });
    adamw.step();
    scheduler = {step + 1, {learning_rate(step + 1)}};  // as scheduler.step()
    // Before any other collective (global_mean): see FullyShardedRoot::check_plan.
    if (absl::GetFlag(FLAGS_plan_check)) plan_check = model->check_plan(adamw);
    const double train_loss = global_mean(loss, *comm);
    const bool log = (step + 1) % absl::GetFlag(FLAGS_log_interval) == 0 || step + 1 == steps;
    const bool eval = (step + 1) % absl::GetFlag(FLAGS_eval_interval) == 0 || step + 1 == steps;
    const double val = eval ? validation_loss(model, corpus, *comm) : NAN;
    if (interval > 0 && (step + 1) % interval == 0) {
      const auto begin = std::chrono::steady_clock::now();
      const std::string path = absl::StrFormat("%s/step_%08d", checkpoint_dir(), step + 1);
      const bool async = absl::GetFlag(FLAGS_async_save);
      // {"model", "optim", "step", "lr_scheduler"} as PyTorch trainers save them.
      const DcpCheckpointOptions dcp_options =
          DcpCheckpointOptions().extras({{"step", int64_t{step + 1}}});
      if (async) {
        // Waits for the previous write first; the write's error, if any, is raised by the
        // next save or by wait_for_async_saves below.
        const AsyncSaveOptions options = AsyncSaveOptions().communicator(checkpoint_comm);
        (void)(format == "dcp"
                   ? async_save_dcp_checkpoint(*model, &adamw, path, dcp_options, &scheduler,
                                               options)
                   : async_save_sharded_checkpoint(*model, &adamw, path, &scheduler, options));
      } else if (format == "dcp") {
        DcpCheckpointOptions with_scheduler = dcp_options;
        with_scheduler.extras().push_back(scheduler_dcp_extra(scheduler));
        save_dcp_checkpoint(*model, &adamw, path, with_scheduler);
      } else {
        save_sharded_checkpoint(*model, &adamw, path, &scheduler);
      }
      if (lead) {
        std::cout << absl::StrFormat(
            "checkpoint: %s (%.2f s%s)\n", path,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count(),
            async ? " to stage; written in the background" : "");
      }
    }
    if (log) {
      memory_csv << absl::StrFormat("%d,%.2f,%.2f,%.2f\n", step + 1, resident_bytes() / 1e6,
                                    handle.memory_allocated() / 1e6,
                                    handle.max_memory_allocated() / 1e6)
                 << std::flush;
    }
    if (!lead) continue;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double tokens_per_s = tokens_per_step * (step + 1 - first) / seconds;
    csv << absl::StrFormat("%d,%.7f,%s,%.6f,%.0f\n", step + 1, train_loss,
                           eval ? absl::StrFormat("%.7f", val) : "", lr, tokens_per_s)
        << std::flush;  // a killed run keeps every row up to its last progress line
    check_written(csv, dir + "/metrics.csv");
    if (log) {
      std::cout << absl::StrFormat(
          "step %d/%d | loss %.4f | lr %.2e | %.0f tok/s%s%s | ETA %.0f s\n", step + 1, steps,
          train_loss, lr, tokens_per_s,
          plan_check.rows.empty() ? std::string() : " | " + plan_check.summary(),
          peak_flops ? absl::StrFormat(" | MFU %.1f%%", 100 * model_flops_utilization(
                                                                  numel, tokens_per_s,
                                                                  comm->world_size(), *peak_flops))
                     : std::string(),
          seconds / (step + 1 - first) * (steps - step - 1));
    }
    if (eval) std::cout << absl::StrFormat("step %d: validation loss %.4f\n", step + 1, val);
  }
  wait_for_async_saves();  // the last checkpoint is complete before the run ends
  // The steps since the last periodic schedule check are compared too.
  if (comm->schedule_checks_enabled()) model->check_collective_schedule();
  // Per-rank figures, gathered to rank 0.
  int64_t sent = 0;
  for (Communicator* c : communicators) sent += c->counters().total().bytes_sent;
  const double per_step = double(sent) / std::max<int64_t>(1, steps - first);
  at::Tensor mine =
      at::tensor({double(handle.max_memory_allocated()), per_step}, at::kDouble).to(device);
  at::Tensor all = at::empty({2 * comm->world_size()}, at::dtype(at::kDouble).device(device));
  comm->all_gather_into_tensor(all, mine);
  all = all.cpu();
  const StateDict full = full_state_dict(
      *model, FullStateDictOptions().rank0_only(true).offload_to_cpu(device.is_cuda()));
  if (lead) save_state_dict(full, dir + "/model.pt");
  const std::string text = absl::GetFlag(FLAGS_sample_length) > 0 ? sample(model, corpus) : "";
  if (!lead) return 0;
  for (int r = 0; r < comm->world_size(); ++r) {
    std::cout << absl::StrFormat("rank %d: peak memory %.1f MB, sent %.2f MB per step\n", r,
                                 all[2 * r].item<double>() / 1e6,
                                 all[2 * r + 1].item<double>() / 1e6);
  }
  if (!plan_check.rows.empty()) {
    std::cout << memory_plan_table(model->memory_plan(optimizer_spec_of(adamw)))
              << "plan check, last step, rank 0 (bytes):\n";
    for (const PlanComparison& row : plan_check.rows) {
      std::cout << absl::StrFormat("  %-36s measured %12d planned %12d ratio %.3f\n", row.what,
                                   row.measured, row.planned, row.ratio());
    }
  }
  csv.close();
  plot(dir);
  std::cout << "metrics: " << dir << "/metrics.csv, plot: " << dir << "/loss.png, model: " << dir
            << "/model.pt\n";
  if (!text.empty()) std::cout << "sample:\n" << text << "\n";
  if (lock >= 0) ::close(lock);
  return 0;
}

}  // namespace
}  // namespace fsdp::examples

int main(int argc, char** argv) {
  fsdp::install_caching_cpu_allocator();  // before any tensor: see caching_cpu_allocator.h
  fsdp::examples::allow_bare_resume_flag(argc, argv);
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {  // positional[0] is the program
    std::vector<std::string> extra(positional.begin() + 1, positional.end());
    for (std::string& argument : extra) argument = "'" + argument + "'";
    std::cerr << "train: unexpected argument" << (extra.size() > 1 ? "s " : " ")
              << absl::StrJoin(extra, ", ")
              << ": the trainer takes only --flags (see --help); pass values as --name=value\n";
    return 2;
  }
  // Every flag is checked before a rank starts or a file is touched.
  const fsdp::examples::MachineLimits machine = fsdp::examples::this_machine();
  std::string error = fsdp::examples::apply_device_defaults(machine);
  if (error.empty()) {
    error = fsdp::examples::flag_error(fsdp::examples::flags_from_command_line(), machine);
  }
  if (error.empty()) {
    error = fsdp::examples::path_flag_error({absl::GetFlag(FLAGS_out_dir),
                                             absl::GetFlag(FLAGS_checkpoint_dir),
                                             absl::GetFlag(FLAGS_data_dir)});
  }
  if (!error.empty()) {
    std::cerr << "train: " << error << "\n";
    return 2;
  }
  // From here on --device is cpu or cuda and --mixed_precision bf16, pure_bf16 or none.
  fsdp::examples::resolve_lever_flags(machine.cuda_devices);
  if (std::getenv("RANK") == nullptr && absl::GetFlag(FLAGS_world_size) > 1) {
    return fsdp::launch_self(absl::GetFlag(FLAGS_world_size), argc, argv);
  }
  try {
    // Before anything asks LibTorch about CUDA (fsdp/base/torch_compat_cuda.h): a CPU run
    // never maps libtorch_cuda.
    if (absl::GetFlag(FLAGS_device) == "cuda") fsdp::compat::load_torch_cuda();
    return fsdp::examples::train();
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::cerr << "train: " << what.substr(0, what.find('\n')) << "\n";
    return 1;
  }
}
