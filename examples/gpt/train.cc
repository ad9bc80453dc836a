// Trains a character-level GPT on Debian's fortunes with FSDP.
//
//   bazel run -c opt //examples/gpt:train                  # 2 ranks, FULL_SHARD
//   bazel run -c opt //examples/gpt:train -- --world_size=1 --steps=100
//   fsdp_run --nproc_per_node=4 -- bazel-bin/examples/gpt/train --sharding_strategy=shard_grad_op
//
// The run (launch, checkpoints, --resume, metrics.csv, memory_rank<R>.csv, progress
// lines, Ctrl-C) is examples/trainer's, shared with examples/llama/finetune; its flags are
// examples/trainer/run_flags.h's and lever_flags.h's. What is the GPT's: the model
// (--layers, --width, --heads, --policy), the fortunes (--data_dir), the validation loss
// every --eval_interval steps over --eval_batches batches, --plan_check, model.pt (the
// full state dict, which torch.load reads), loss.png (gnuplot) and a text sample of
// --sample_length characters at the end. Checkpoints carry the LR schedule's position.
//
// --device=auto (the default) trains on CUDA when this process sees a CUDA device, else
// on the CPU (Note [The compute device] in examples/trainer/levers.h): on CUDA rank r uses
// cuda:LOCAL_RANK over NCCL with bf16 mixed precision, a GPT-2-small-sized model for the
// model flags not given, and the progress lines add the model FLOP utilisation (mfu.h).
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>

#include "examples/gpt/corpus.h"
#include "examples/gpt/flags.h"
#include "examples/gpt/mfu.h"
#include "examples/gpt/model.h"
#include "examples/gpt/model_flags.h"
#include "examples/trainer/lever_flags.h"
#include "examples/trainer/run_flags.h"
#include "examples/trainer/run_support.h"
#include "examples/trainer/trainer.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/fused_adamw.h"
#include "fsdp/core/memory_plan.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/wrap/policy.h"

ABSL_FLAG(std::string, policy, "transformer",
          "units: transformer (each block) or root (one unit for the whole model)");
ABSL_FLAG(int64_t, eval_interval, 200, "steps between validation losses");
ABSL_FLAG(int64_t, eval_batches, 8, "global batches per validation loss");
ABSL_FLAG(int64_t, sample_length, 300, "characters to sample at the end (0: none)");
ABSL_FLAG(bool, plan_check, false,
          "check every step against the model's per-rank plan (fsdp/core/memory_plan.h): "
          "the progress line shows measured/planned, a rank above its plan stops naming the "
          "term, and rank 0 prints each term measured and planned at the end");

namespace fsdp::examples {
namespace {

using Model = FullyShardedDataParallel<GptImpl>;

TrainerFlags flags_from_command_line() {
  TrainerFlags f;
  static_cast<RunFlags&>(f) = run_flags_from_command_line();
  f.policy = absl::GetFlag(FLAGS_policy);
  f.layers = absl::GetFlag(FLAGS_layers);
  f.width = absl::GetFlag(FLAGS_width);
  f.heads = absl::GetFlag(FLAGS_heads);
  f.eval_interval = absl::GetFlag(FLAGS_eval_interval);
  f.eval_batches = absl::GetFlag(FLAGS_eval_batches);
  f.sample_length = absl::GetFlag(FLAGS_sample_length);
  f.peak_tflops = absl::GetFlag(FLAGS_peak_tflops);
  f.plan_check = absl::GetFlag(FLAGS_plan_check);
  f.data_dir = absl::GetFlag(FLAGS_data_dir);
  return f;
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

int train() {
  const TrainerFlags flags = flags_from_command_line();
  TrainingRun run(flags);  // the process group, the flags' agreement, the run folder's lock
  Communicator& comm = run.comm();
  const c10::Device device = run.device();
  const bool lead = run.lead();
  const Corpus corpus = load_fortunes(flags.data_dir);
  TORCH_CHECK(corpus.validation.numel() > flags.context + 1, "--context=", flags.context,
              ": the corpus in '", flags.data_dir, "' has ", corpus.train.numel(), " training and ",
              corpus.validation.numel(),
              " validation characters (every 10th fortune); a window needs context + 2 = ",
              flags.context + 2, " characters in each; lower --context or add text");

  at::manual_seed(flags.seed);
  auto gpt = std::make_shared<GptImpl>(GptOptions()
                                           .vocab_size(corpus.vocab_size())
                                           .context(flags.context)
                                           .width(flags.width)
                                           .heads(flags.heads)
                                           .layers(flags.layers));
  int64_t numel = 0;
  for (const auto& p : gpt->parameters()) numel += p.numel();
  const bool bf16 = flags.mixed_precision == "bf16";
  gpt->to(model_dtype(flags.mixed_precision));  // bf16 for pure_bf16, else fp32 masters
  for (auto& unit : gpt->units) {
    unit->module()->checkpoint_activations = flags.activation_checkpointing;
  }
  const FullyShardedDataParallelOptions options =
      lever_options(run.comm_ptr(), flags)
          .auto_wrap_policy(parse_policy(flags.policy))
          .plan_check(flags.plan_check)
          .schedule_check_every(flags.schedule_check_every);
  Model model(gpt, options);
  // Model FLOP utilisation needs the device's peak (mfu.h); the CPU has one only by flag.
  const std::string device_name =
      device.is_cuda() ? cuda_device_name(device.index()) : std::string("CPU");
  const std::optional<double> peak_flops =
      peak_bf16_flops(device.is_cuda() ? device_name : "", flags.peak_tflops);
  FusedAdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  const OptimizerSpec adamw_spec = optimizer_spec_of(adamw);  // for the memory plan
  if (lead) {
    std::cout << absl::StrFormat(
        "corpus: %d fortunes, %d train / %d validation characters, vocabulary %d\n"
        "model: %d parameters in %d units over %d ranks (%s)\n",
        corpus.entries, corpus.train.numel(), corpus.validation.numel(), corpus.vocab_size(), numel,
        model->units().size(), comm.world_size(),
        sharding_strategy_name(model->sharding_strategy()));
    if (device.is_cuda()) {
      std::cout << absl::StrFormat(
          "device: cuda:LOCAL_RANK (%s), NCCL, %s; peak bf16 %s\n", device_name,
          bf16 ? "bf16 mixed precision (param_dtype bf16, reduce_dtype fp32)"
          : flags.mixed_precision == "pure_bf16" ? "pure bf16"
                                                 : "fp32",
          peak_flops ? absl::StrFormat("%.1f TFLOP/s; %s", *peak_flops / 1e12, kMfuFormula)
                     : std::string("unknown (pass --peak_tflops for the MFU)"));
    }
  }
  if (lead) {
    // What each rank's tensors will hold at the step's peak (fsdp/core/memory_plan.h;
    // activations not planned: --plan_check compares it with each step).
    const MemoryPlan plan = model->memory_plan(adamw_spec);
    std::cout << absl::StrFormat(
        "memory plan: sharded parameters %.1f MiB + gradients %.1f MiB + optimizer state "
        "%.1f MiB, peak %.1f MiB per rank without activations (%s)\n",
        plan.term_bytes(PlanTerm::kShardedParameters) / 1048576.0,
        plan.term_bytes(PlanTerm::kShardedGradients) / 1048576.0,
        plan.term_bytes(PlanTerm::kOptimizerState) / 1048576.0, plan.peak_bytes / 1048576.0,
        plan.peak_event);
  }
  // The LR schedule's position, as torch.optim.lr_scheduler keeps it: last_epoch
  // scheduler steps taken, last_lr the LR of the next step. A checkpoint carries it.
  SchedulerState scheduler{0, {learning_rate(0)}};
  const int64_t first = run.start(*model, adamw, &scheduler, learning_rate);
  const double initial = validation_loss(model, corpus, comm);
  if (lead) std::cout << "step " << first << ": validation loss " << initial << "\n";

  PlanCheckResult plan_check;  // the last step's, with --plan_check
  for (int64_t step = first; step < flags.steps; ++step) {
    const double lr = scheduler.last_lr.at(0);
    for (auto& group : adamw.param_groups()) group.options().set_lr(lr);
    // Named tensors, not a structured binding: C++17 lambdas cannot capture those.
    const auto xy = batch(corpus.train, step, comm, device);
    const at::Tensor& x = xy.first;
    const at::Tensor& y = xy.second;
    adamw.zero_grad();
    // --grad_accumulation_steps: this rank's share in equal micro-batches, no_sync between.
    const int64_t micro = x.size(0) / flags.grad_accumulation_steps;
    const at::Tensor loss =
        accumulate_gradients(*model, flags.grad_accumulation_steps, [&](int64_t k) {
          return next_token_loss(model->forward(x.narrow(0, k * micro, micro)),
                                 y.narrow(0, k * micro, micro));
        });
    adamw.step();
    scheduler = {step + 1, {learning_rate(step + 1)}};  // as scheduler.step()
    // Before any other collective (global_mean): see FullyShardedRoot::check_plan.
    if (flags.plan_check) plan_check = model->check_plan(adamw);
    const double train_loss = global_mean(loss, comm);
    run.check_loss(step + 1, train_loss);
    const bool eval = (step + 1) % flags.eval_interval == 0 || step + 1 == flags.steps;
    const std::optional<double> val =
        eval ? std::optional<double>(validation_loss(model, corpus, comm)) : std::nullopt;
    run.checkpoint_if_due(step + 1, *model, adamw, &scheduler);
    const std::string extra = absl::StrCat(
        plan_check.rows.empty() ? std::string() : " | " + plan_check.summary(),
        peak_flops
            ? absl::StrFormat(" | MFU %.1f%%",
                              100 * model_flops_utilization(numel, run.tokens_per_second(step + 1),
                                                            comm.world_size(), *peak_flops))
            : std::string());
    run.record(step + 1, {train_loss, val, lr}, *model, extra);
    if (lead && val)
      std::cout << absl::StrFormat("step %d: validation loss %.4f\n", step + 1, *val);
  }
  run.finish(*model);
  const StateDict full = full_state_dict(
      *model, FullStateDictOptions().rank0_only(true).offload_to_cpu(device.is_cuda()));
  if (lead) save_state_dict(full, flags.out_dir + "/model.pt");
  const std::string text = flags.sample_length > 0 ? sample(model, corpus) : "";
  if (!lead) return 0;
  if (!plan_check.rows.empty()) {
    std::cout << memory_plan_table(model->memory_plan(adamw_spec))
              << "plan check, last step, rank 0 (bytes):\n";
    for (const PlanComparison& row : plan_check.rows) {
      std::cout << absl::StrFormat("  %-36s measured %12d planned %12d ratio %.3f\n", row.what,
                                   row.measured, row.planned, row.ratio());
    }
  }
  plot(flags.out_dir);
  std::cout << "metrics: " << flags.out_dir << "/metrics.csv, plot: " << flags.out_dir
            << "/loss.png, model: " << flags.out_dir << "/model.pt\n";
  if (!text.empty()) std::cout << "sample:\n" << text << "\n";
  return 0;
}

}  // namespace
}  // namespace fsdp::examples

int main(int argc, char** argv) {
  using namespace fsdp::examples;
  TrainerHooks hooks;
  hooks.defaults = TrainerFlags();
  // Note [The compute device] (levers.h): on CUDA the flags not given take their CUDA
  // defaults.
  hooks.cuda_defaults = [](int cuda_devices) {
    return cuda_defaults(flags_from_command_line(), cuda_devices, specified_on_command_line);
  };
  hooks.flag_error = [](const MachineLimits& machine) {
    const TrainerFlags flags = flags_from_command_line();
    std::string error = flag_error(flags, machine);
    return error.empty() ? data_dir_error(flags.data_dir) : error;
  };
  hooks.run = train;
  return trainer_main(argc, argv, "train", hooks);
}
