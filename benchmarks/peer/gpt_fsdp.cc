// fsdp's side of the comparison with PyTorch FSDP2 (benchmarks/peer/fsdp2_gpt.py is the
// other): trains the GPT of examples/gpt from prepared weights on prepared token batches
// and writes the per-step losses, the step times and the memory of rank 0 as JSON.
//
//   gpt_fsdp --prepare=DIR --width=128 --steps=50    # one process: DIR/init.pt, batches.pt
//   torchrun --nproc_per_node=2 --no-python gpt_fsdp --data=DIR --heads=4
//       --strategy=full_shard --out=ours.json        # any launcher fsdp supports
//
// Prepare writes the weights of a freshly seeded GptImpl (save_state_dict: a torch.save
// file that torch.load reads with weights_only=True) and {"tokens": int64 [steps,
// batch_size, context + 1]}: windows of Debian's fortunes at seeded offsets. Training
// reads both, so the two sides start from the same weights and see the same batches:
// rank r of W takes rows [r B/W, (r + 1) B/W) of each step's batch, inputs the first
// `context` tokens and targets the last. AdamW (lr --lr, PyTorch's other defaults:
// betas 0.9, 0.999, eps 1e-8, weight decay 0.01), fp32, constant learning rate, one
// intra-op thread per rank. The step runs fsdp::FusedAdamW (--nofused_adamw:
// torch::optim::AdamW, the element-wise implementation PyTorch's AdamW runs on the CPU
// unless given fused=True, as fsdp2_gpt.py leaves it).
//
// JSON (rank 0): "losses" (the mean over ranks of each step's loss, before the update),
// "step_ms" (each step's wall time on rank 0: zero_grad to optimizer step), "host_ms"
// (the part of it until the host had queued the step, before the device
// synchronisation: on a GPU, the host-side time per step), "tokens_per_s"
// (global tokens / time of the steps after --warmup_steps), "peak_rss_mb" (the most
// resident set of the process during training: /proc/self/status VmHWM, reset to the
// current RSS by /proc/self/clear_refs just before the first step), "start_rss_mb" (the
// RSS at that reset), "peak_allocated_mb" (fsdp's tracking allocator: the most bytes of
// CPU tensors held during training; PyTorch has no such counter on the CPU).
//
// On a GPU (issue 18 item 6; tools/gpu_bundle_run.sh runs it at W = 1 on cuda:0):
//   gpt_fsdp --data=DIR --heads=12 --device=cuda --mixed_precision=bf16 --out=ours.json
//   gpt_fsdp --data=DIR --heads=12 --device=cuda --mixed_precision=bf16 --mode=plain ...
// --device=cuda puts rank r on cuda:LOCAL_RANK with NCCL (FullyShardedDataParallelOptions::
// device_id); --mixed_precision=bf16 is FSDP's param_dtype bf16, reduce_dtype fp32 (fp32
// master shards and AdamW state), as FSDP2's MixedPrecisionPolicy in fsdp2_gpt.py.
// --mode=plain trains the same GptImpl without FSDP (one rank, no communicator): the
// model moved to the device, bf16 by LibTorch's autocast (which keeps LayerNorm and the
// softmax-like ops in fp32). Each step then ends with a device synchronisation, so that
// step_ms is the device's time. On CUDA, "peak_allocated_mb" is the caching allocator's
// peak (DeviceHandle::max_memory_allocated, PyTorch's torch.cuda.max_memory_allocated),
// reset just before the first step; the JSON adds "device", "device_name", "mode",
// "mixed_precision", "parameters", "peak_flops" (the device's dense bf16 peak, from
// examples/gpt/mfu.cc or --peak_tflops; null if unknown), "mfu" (per device: 6 x
// parameters x (tokens_per_s / world_size) / peak_flops; null if unknown) and
// "mfu_formula" (that formula in words).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "examples/gpt/corpus.h"
#include "examples/gpt/mfu.h"
#include "examples/gpt/model.h"
#include "examples/gpt/model_flags.h"
#include "examples/trainer/levers.h"
#include "fsdp/base/torch_compat_cuda.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/caching_cpu_allocator.h"
#include "fsdp/core/device_handle.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/fused_adamw.h"
#include "fsdp/core/tracking_allocator.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/state_dict.h"

ABSL_FLAG(std::string, prepare, "", "write init.pt and batches.pt into this folder and exit");
ABSL_FLAG(std::string, data, "", "train from the init.pt and batches.pt in this folder");
ABSL_FLAG(std::string, out, "", "where rank 0 writes the JSON of the run");
ABSL_FLAG(std::string, strategy, "full_shard", "full_shard, shard_grad_op or no_shard");
// --layers, --width, --heads, --data_dir (prepare; --heads also train) and --peak_tflops
// (train) are examples/gpt/model_flags.h's; --context and --seed have the trainer's
// defaults.
ABSL_FLAG(int64_t, context, 128, "context length, characters (prepare)");
ABSL_FLAG(int64_t, seed, 1234, "seed of the weights and of the batches' offsets (prepare)");
ABSL_FLAG(int64_t, batch_size, 16, "global batch, sequences (prepare)");
ABSL_FLAG(int64_t, steps, 50, "training steps (prepare)");
ABSL_FLAG(double, lr, 1e-3, "AdamW learning rate (train)");
ABSL_FLAG(int64_t, warmup_steps, 3, "steps left out of tokens_per_s (train)");
ABSL_FLAG(std::string, device, "cpu", "cpu, or cuda: rank r on cuda:LOCAL_RANK over NCCL (train)");
ABSL_FLAG(std::string, mode, "fsdp", "fsdp, or plain: LibTorch without FSDP, one rank (train)");
ABSL_FLAG(std::string, mixed_precision, "none",
          "none (fp32), or bf16: param_dtype bf16 and reduce_dtype fp32 under FSDP, "
          "autocast to bf16 in plain mode (train)");
ABSL_FLAG(
    bool, caching_cpu_allocator, true,
    "serve CPU tensors from fsdp's caching CPU allocator (fsdp/core/caching_cpu_allocator.h), "
    "as the trainers do; false: glibc's malloc with its defaults, as PyTorch runs");
ABSL_FLAG(bool, fused_adamw, true,
          "step with fsdp::FusedAdamW (ATen's fused kernel, as the trainers do); false: "
          "torch::optim::AdamW, the element-wise implementation PyTorch's AdamW runs on the "
          "CPU by default (train)");
ABSL_FLAG(bool, forward_prefetch, false,
          "FullyShardedDataParallelOptions::forward_prefetch (train)");

namespace fsdp::examples {
namespace {

int prepare(const std::string& dir) {
  const Corpus corpus = load_fortunes(absl::GetFlag(FLAGS_data_dir));
  const int64_t context = absl::GetFlag(FLAGS_context);
  const int64_t batch = absl::GetFlag(FLAGS_batch_size);
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  TORCH_CHECK(context > 0 && batch > 0 && steps > 0,
              "--context, --batch_size and --steps must be positive, got ", context, ", ", batch,
              " and ", steps);
  TORCH_CHECK(corpus.train.numel() > context + 1, "--context=", context, " needs at least ",
              context + 2, " training characters; the corpus has ", corpus.train.numel());
  at::manual_seed(absl::GetFlag(FLAGS_seed));
  GptImpl gpt(GptOptions()
                  .vocab_size(corpus.vocab_size())
                  .context(context)
                  .width(absl::GetFlag(FLAGS_width))
                  .heads(absl::GetFlag(FLAGS_heads))
                  .layers(absl::GetFlag(FLAGS_layers)));
  const at::Tensor starts =
      at::randint(corpus.train.numel() - context - 1, {steps * batch}, at::kLong);
  auto [x, y] = windows(corpus.train, starts, context);
  StateDict batches;
  batches.insert("tokens", at::cat({x, y.narrow(1, context - 1, 1)}, 1)
                               .reshape({steps, batch, context + 1})
                               .contiguous());
  save_state_dict(module_state_dict(gpt), dir + "/init.pt");
  save_state_dict(batches, dir + "/batches.pt");
  std::cout << "prepared " << dir << ": vocabulary " << corpus.vocab_size() << ", " << steps
            << " batches of " << batch << " x " << context + 1 << " tokens\n";
  return 0;
}

// A field of /proc/self/status in MB ("VmRSS", "VmHWM").
double status_mb(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::istringstream value(line.substr(field.size() + 1));  // "   1234 kB"
    int64_t kb = -1;
    value >> kb;
    return kb / 1024.0;
  }
  return -1;
}

int train(const std::string& dir) {
  at::set_num_threads(1);
  MemoryTracker memory;
  const std::string device_flag = absl::GetFlag(FLAGS_device);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const std::string precision = absl::GetFlag(FLAGS_mixed_precision);
  TORCH_CHECK(device_flag == "cpu" || device_flag == "cuda", "--device must be cpu or cuda, got '",
              device_flag, "'");
  TORCH_CHECK(mode == "fsdp" || mode == "plain", "--mode must be fsdp or plain, got '", mode, "'");
  TORCH_CHECK(precision == "none" || precision == "bf16",
              "--mixed_precision must be none or bf16, got '", precision, "'");
  // Before anything asks LibTorch about CUDA: a CPU run never maps libtorch_cuda.
  if (device_flag == "cuda") compat::load_torch_cuda();
  const LaunchEnvironment env = read_launch_environment();
  TORCH_CHECK(mode == "fsdp" || env.world_size == 1,
              "--mode=plain trains one rank without FSDP; run it with WORLD_SIZE 1, not ",
              env.world_size);
  const c10::Device device = compute_device(device_flag);
  if (device.is_cuda()) c10::cuda::set_device(device.index());
  std::shared_ptr<Communicator> comm =
      mode == "fsdp" ? init_from_environment(RendezvousOptions().backend(
                           device.is_cuda() ? Backend::kNccl : Backend::kGloo))
                     : nullptr;
  const StateDict init = load_state_dict(dir + "/init.pt");
  const at::Tensor tokens = load_state_dict(dir + "/batches.pt")["tokens"].to(device);
  const int64_t steps = tokens.size(0), batch = tokens.size(1), context = tokens.size(2) - 1;
  const int world = env.world_size, rank = env.rank;
  TORCH_CHECK(batch % world == 0, "the prepared batch of ", batch,
              " sequences does not split evenly over ", world, " ranks");
  int64_t layers = 0;
  while (init.contains(absl::StrCat("blocks.", layers, ".qkv.weight"))) ++layers;
  auto gpt = std::make_shared<GptImpl>(GptOptions()
                                           .vocab_size(init["token.weight"].size(0))
                                           .context(init["position.weight"].size(0))
                                           .width(init["token.weight"].size(1))
                                           .heads(absl::GetFlag(FLAGS_heads))
                                           .layers(layers));
  load_module_state_dict(*gpt, init);
  int64_t parameters = 0;
  for (const at::Tensor& p : gpt->parameters()) parameters += p.numel();
  const bool bf16 = precision == "bf16";
  // The model a step runs: FSDP's root, or the GptImpl itself (plain).
  std::optional<FullyShardedDataParallel<GptImpl>> fsdp_model;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<at::Tensor> trained;
  if (mode == "fsdp") {
    // The non-hybrid strategies only (the peer side has FSDP2 and DDP counterparts for
    // those).
    const FullyShardedDataParallelOptions options =
        FullyShardedDataParallelOptions(comm)
            .sharding_strategy(sharding_strategy_flag("strategy", absl::GetFlag(FLAGS_strategy),
                                                      /*allow_hybrid=*/false))
            .device_id(device)
            .forward_prefetch(absl::GetFlag(FLAGS_forward_prefetch))
            .mixed_precision(mixed_precision_flag(precision));
    fsdp_model.emplace(gpt, options);
    forward = [&](const at::Tensor& x) { return (*fsdp_model)->forward(x); };
    trained = (*fsdp_model)->parameters();
  } else {
    gpt->to(device);
    forward = [&](const at::Tensor& x) { return gpt->forward(x); };
    trained = gpt->parameters();
    if (bf16) {
      at::autocast::set_autocast_dtype(device.type(), at::kBFloat16);
      at::autocast::set_autocast_enabled(device.type(), true);
    }
  }
  const auto adamw_options = torch::optim::AdamWOptions(absl::GetFlag(FLAGS_lr)).weight_decay(0.01);
  std::unique_ptr<torch::optim::AdamW> optimizer =
      absl::GetFlag(FLAGS_fused_adamw)
          ? std::make_unique<FusedAdamW>(trained, adamw_options)
          : std::make_unique<torch::optim::AdamW>(trained, adamw_options);
  torch::optim::AdamW& adamw = *optimizer;
  const std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(device);

  std::vector<double> losses, step_ms, host_ms;
  const int64_t local = batch / world;
  // Host ordering: the timed steps start when every rank is ready (NCCL included: Note
  // [A barrier that blocks the host] in fsdp/comm/nccl.cc).
  if (comm != nullptr) comm->barrier();
  std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
  const double start_rss = status_mb("VmRSS");
  handle->synchronize();
  handle->reset_peak_memory_stats();
  for (int64_t step = 0; step < steps; ++step) {
    const at::Tensor rows = tokens[step].narrow(0, rank * local, local);
    const auto begin = std::chrono::steady_clock::now();
    adamw.zero_grad();
    const at::Tensor logits = forward(rows.narrow(1, 0, context));
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                             rows.narrow(1, 1, context).reshape({-1}));
    loss.backward();
    adamw.step();
    at::autocast::clear_cache();  // plain bf16: the weights' bf16 copies are stale now
    // The host's share: the step is queued (on the CPU: done).
    host_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin)
            .count());
    handle->synchronize();  // the step's kernels are done (CPU: nothing to wait for)
    step_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin)
            .count());
    at::Tensor mean = loss.detach().reshape({1}).clone();
    if (comm != nullptr) comm->all_reduce(mean, ReduceOp::kAvg);
    losses.push_back(mean.item<double>());
  }
  if (rank != 0) return 0;
  const int64_t warmup = std::min(absl::GetFlag(FLAGS_warmup_steps), steps - 1);
  double timed_ms = 0;
  for (int64_t i = warmup; i < steps; ++i) timed_ms += step_ms[i];
  const auto number = [](std::string* s, double v) {
    absl::StrAppend(s, absl::StrFormat("%.9g", v));
  };
  const double tokens_per_s = (steps - warmup) * batch * context / (timed_ms / 1e3);
  const std::string device_name = device.is_cuda() ? cuda_device_name(device.index()) : "CPU";
  const std::optional<double> peak =
      peak_bf16_flops(device.is_cuda() ? device_name : "", absl::GetFlag(FLAGS_peak_tflops));
  const auto or_null = [](const std::optional<double>& v) {
    return v ? absl::StrFormat("%.9g", *v) : std::string("null");
  };
  std::ofstream out(absl::GetFlag(FLAGS_out));
  out << "{\"side\": \"" << (mode == "fsdp" ? "fsdp" : "plain") << "\", \"strategy\": \""
      << absl::GetFlag(FLAGS_strategy) << "\", \"world_size\": " << world
      << ", \"width\": " << gpt->options.width() << ",\n \"losses\": ["
      << absl::StrJoin(losses, ", ", number) << "],\n \"step_ms\": ["
      << absl::StrJoin(step_ms, ", ", number) << "],\n \"host_ms\": ["
      << absl::StrJoin(host_ms, ", ", number) << "],\n \"tokens_per_s\": " << tokens_per_s
      << ", \"peak_rss_mb\": " << status_mb("VmHWM") << ", \"start_rss_mb\": " << start_rss
      << ", \"peak_allocated_mb\": " << handle->max_memory_allocated() / 1e6 << ",\n \"device\": \""
      << device.str() << "\", \"device_name\": \"" << device_name << "\", \"mode\": \"" << mode
      << "\", \"mixed_precision\": \"" << precision << "\", \"parameters\": " << parameters
      << ", \"peak_flops\": " << or_null(peak) << ", \"mfu\": "
      << or_null(peak ? std::optional<double>(
                            model_flops_utilization(parameters, tokens_per_s, world, *peak))
                      : std::nullopt)
      << ", \"mfu_formula\": \"" << kMfuFormula << "\"}\n";
  TORCH_CHECK(out.good(), "could not write --out='", absl::GetFlag(FLAGS_out), "'");
  return 0;
}

}  // namespace
}  // namespace fsdp::examples

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_caching_cpu_allocator)) fsdp::install_caching_cpu_allocator();
  try {
    if (!absl::GetFlag(FLAGS_prepare).empty()) {
      return fsdp::examples::prepare(absl::GetFlag(FLAGS_prepare));
    }
    TORCH_CHECK(!absl::GetFlag(FLAGS_data).empty() && !absl::GetFlag(FLAGS_out).empty(),
                "pass --prepare=DIR, or --data=DIR and --out=FILE (see the top of "
                "benchmarks/peer/gpt_fsdp.cc)");
    return fsdp::examples::train(absl::GetFlag(FLAGS_data));
  } catch (const c10::Error& e) {
    std::cerr << "gpt_fsdp: " << e.what_without_backtrace() << "\n";
    return 1;
  }
}
