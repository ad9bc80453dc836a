// fashion_mnist: an MLP image classifier (784 -> 512 -> 256 -> 10, ReLU) trained with
// FullyShardedDataParallel on Fashion-MNIST, as Debian's dataset-fashion-mnist installs it.
//
//   bazel run -c opt //examples/fashion_mnist -- --world_size=2      # starts 2 ranks
//   bazel run -c opt //examples/fashion_mnist -- --world_size=1 --sharding_strategy=no_shard
//   fsdp_run --nproc_per_node=4 -- bazel-bin/examples/fashion_mnist/fashion_mnist
//
// Ranks. Without a launcher's variables (RANK/WORLD_SIZE, Open MPI's, MPICH's, Slurm's)
// the binary starts --world_size copies of itself with fsdp::launch (as fsdp_run does:
// their output comes back prefixed "[rank R] ") and exits with their status; --world_size=1
// trains in this process. Under fsdp_run, torchrun, mpirun or srun it is one rank of the
// job and --world_size is ignored.
//
// Model: each hidden block (Linear + ReLU) is an fsdp::Unit; the head stays in the root.
// Inputs are the pixels in [0, 1], normalized with the training set's mean and deviation.
// Optimizer: SGD with momentum on the sharded flat parameters, the learning rate
// cosine-annealed per step from --lr (or constant).
//
// Data parallelism that does not depend on the world size W: every rank draws the same
// permutation of the training set from --seed (a fresh one each epoch) and cuts it into
// global batches of --batch_size examples (the last, partial one is dropped); rank r takes
// the r-th of W equal contiguous shares of each global batch. Each rank's loss is the
// cross-entropy averaged over its share and FSDP averages gradients over ranks, so every
// step follows the gradient of the global batch's mean loss: W = 1 and W = 2 train the
// same model up to floating-point rounding. Evaluation is in lockstep too: each global
// test batch is split into W contiguous shares and the correct counts are summed with
// all_reduce.
//
// Output (rank 0 only):
//   fashion_mnist: 2 ranks, FULL_SHARD, ...                  (the setup)
//   epoch 1/3 step 100/468: loss 0.5138                      (every --log_every steps,
//                                                             the first and the last)
//   epoch 1/3: train loss 0.4955, test accuracy 85.74% (66.3 s)
//   ...
//   final test accuracy: 88.42% (10000 test images, 3 epochs, 187.5 s)
// Step losses are the global batch's mean; the epoch's train loss is the mean of its
// steps' losses. Bad flags: one line on stderr, status 2. A failing rank prints
// "fashion_mnist: rank R: ..." on stderr and exits with status 1.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "examples/fashion_mnist/idx.h"
#include "examples/fashion_mnist/model.h"
#include "fsdp/base/shard_geometry.h"
#include "fsdp/comm/communicator.h"
#include "fsdp/comm/launcher.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"

ABSL_FLAG(int, world_size, 2,
          "ranks to start when not run by a launcher (fsdp_run, torchrun, ...), >= 1");
ABSL_FLAG(int, epochs, 3, "passes over the training set, >= 1");
ABSL_FLAG(int64_t, batch_size, 128,
          "global batch (examples per step over all ranks), a multiple of the world size");
ABSL_FLAG(double, lr, 0.05, "SGD learning rate (the peak with --lr_schedule=cosine), > 0");
ABSL_FLAG(std::string, lr_schedule, "cosine",
          "constant (--lr throughout) or cosine (from --lr down towards 0 over all steps)");
ABSL_FLAG(double, momentum, 0.9, "SGD momentum, in [0, 1)");
ABSL_FLAG(uint64_t, seed, 0, "seeds the initial weights and the shuffling (same on all ranks)");
ABSL_FLAG(std::string, data_dir, "/usr/share/datasets/fashion-mnist",
          "directory with train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
          "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz");
ABSL_FLAG(std::string, sharding_strategy, "full_shard", "full_shard, shard_grad_op or no_shard");
ABSL_FLAG(int64_t, max_steps_per_epoch, 0, "stop each epoch after this many steps; 0: no limit");
ABSL_FLAG(int64_t, test_limit, 0, "evaluate on the first N test images only; 0: all of them");
ABSL_FLAG(int64_t, log_every, 100, "print the loss every N steps (and the first and last), >= 1");

namespace {

constexpr int64_t kImagePixels = 28 * 28;
using fsdp::examples::kNumClasses;
constexpr int64_t kEvalBatchSize = 1000;  // global, split over the ranks like training's
// Pixel mean and standard deviation of Fashion-MNIST's training images (values in [0, 1]).
constexpr double kPixelMean = 0.2860;
constexpr double kPixelStd = 0.3530;

// The flags, validated by config_from_flags.
struct Config {
  int world_size = 0;
  int epochs = 0;
  int64_t batch_size = 0;
  double lr = 0;
  bool cosine_lr = true;
  double momentum = 0;
  uint64_t seed = 0;
  std::string data_dir;
  fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard;
  int64_t max_steps_per_epoch = 0;
  int64_t test_limit = 0;
  int64_t log_every = 0;
};

[[noreturn]] void fail_usage(const std::string& message) {
  std::cerr << "fashion_mnist: " << message << "\n";
  std::exit(2);
}

// The non-hybrid strategies only.
fsdp::ShardingStrategy parse_strategy(const std::string& name) {
  const c10::optional<fsdp::ShardingStrategy> strategy = fsdp::parse_sharding_strategy(name);
  if (!strategy || fsdp::is_hybrid(*strategy)) {
    fail_usage(absl::StrCat("unknown --sharding_strategy '", name,
                            "'; expected full_shard, shard_grad_op or no_shard"));
  }
  return *strategy;
}

// True for "cosine", false for "constant".
bool parse_lr_schedule(const std::string& name) {
  if (name != "cosine" && name != "constant") {
    fail_usage(absl::StrCat("unknown --lr_schedule '", name, "'; expected cosine or constant"));
  }
  return name == "cosine";
}

void require(bool ok, const std::string& message) {
  if (!ok) fail_usage(message);
}

// Exits with status 2 and one line on stderr for the first invalid value.
void validate(const Config& c) {
  require(c.world_size >= 1, absl::StrCat("--world_size must be >= 1, got ", c.world_size));
  require(c.epochs >= 1, absl::StrCat("--epochs must be >= 1, got ", c.epochs));
  require(c.batch_size >= 1, absl::StrCat("--batch_size must be >= 1, got ", c.batch_size));
  require(c.lr > 0, absl::StrCat("--lr must be > 0, got ", c.lr));
  require(c.momentum >= 0 && c.momentum < 1,
          absl::StrCat("--momentum must be in [0, 1), got ", c.momentum));
  require(c.max_steps_per_epoch >= 0,
          absl::StrCat("--max_steps_per_epoch must be >= 0, got ", c.max_steps_per_epoch));
  require(c.test_limit >= 0, absl::StrCat("--test_limit must be >= 0, got ", c.test_limit));
  require(c.log_every >= 1, absl::StrCat("--log_every must be >= 1, got ", c.log_every));
}

Config config_from_flags() {
  Config c;
  c.world_size = absl::GetFlag(FLAGS_world_size);
  c.epochs = absl::GetFlag(FLAGS_epochs);
  c.batch_size = absl::GetFlag(FLAGS_batch_size);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.cosine_lr = parse_lr_schedule(absl::GetFlag(FLAGS_lr_schedule));
  c.momentum = absl::GetFlag(FLAGS_momentum);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.data_dir = absl::GetFlag(FLAGS_data_dir);
  c.strategy = parse_strategy(absl::GetFlag(FLAGS_sharding_strategy));
  c.max_steps_per_epoch = absl::GetFlag(FLAGS_max_steps_per_epoch);
  c.test_limit = absl::GetFlag(FLAGS_test_limit);
  c.log_every = absl::GetFlag(FLAGS_log_every);
  validate(c);
  return c;
}

// The four files of --data_dir, for the splits "train" and "t10k".
std::string images_path(const std::string& dir, const std::string& split) {
  return absl::StrCat(dir, "/", split, "-images-idx3-ubyte.gz");
}
std::string labels_path(const std::string& dir, const std::string& split) {
  return absl::StrCat(dir, "/", split, "-labels-idx1-ubyte.gz");
}

// Before starting ranks that would all fail: every file of --data_dir is readable.
void require_readable_data(const std::string& dir) {
  for (const char* split : {"train", "t10k"}) {
    for (const std::string& path : {images_path(dir, split), labels_path(dir, split)}) {
      if (access(path.c_str(), R_OK) == 0) continue;
      fail_usage(absl::StrCat("cannot read '", path, "' (", std::strerror(errno),
                              "); install Debian's dataset-fashion-mnist or point --data_dir "
                              "at a directory with the four gzipped IDX files"));
    }
  }
}

// "--batch_size (B) must be a multiple of the world size (W) ...", or "" if it is.
std::string batch_split_error(int64_t batch_size, int world_size) {
  if (batch_size % world_size == 0) return "";
  return absl::StrCat("--batch_size (", batch_size, ") must be a multiple of the world size (",
                      world_size, ") so that every rank gets an equal share of each batch");
}

// --- the model ---

// examples/fashion_mnist/model.h
using fsdp::examples::ClassifierImpl;
using Model = fsdp::FullyShardedDataParallel<ClassifierImpl>;

// --- the data ---

// One split ("train" or "t10k"), images flattened and normalized, at most `limit` examples
// (0: all).
fsdp::examples::IdxDataset load_split(const std::string& dir, const std::string& split,
                                      int64_t limit) {
  fsdp::examples::IdxDataset data = fsdp::examples::read_idx_dataset(
      images_path(dir, split), labels_path(dir, split), /*flatten=*/true);
  TORCH_CHECK(data.images.size(1) == kImagePixels, "the ", split, " images in '", dir, "' have ",
              data.images.size(1), " pixels, expected 28 x 28 = ", kImagePixels);
  TORCH_CHECK(data.size() > 0, "the ", split, " files in '", dir, "' hold no images");
  TORCH_CHECK(data.labels.max().item<int64_t>() < kNumClasses, "the ", split, " labels in '", dir,
              "' go up to ", data.labels.max().item<int64_t>(),
              ", expected Fashion-MNIST's classes 0 ... 9");
  if (limit > 0 && limit < data.size()) {
    data.images = data.images.narrow(0, 0, limit);
    data.labels = data.labels.narrow(0, 0, limit);
  }
  data.images = (data.images - kPixelMean) / kPixelStd;
  return data;
}

// Rank `rank`'s contiguous share of `global` (1-D): the r-th of W chunks of
// ceil(n / W) elements (fsdp::shard_range); the last ranks' shares are shorter or empty
// when W does not divide n.
at::Tensor rank_share(const at::Tensor& global, int rank, int world_size) {
  const int64_t n = global.size(0);
  const fsdp::ShardRange range = fsdp::shard_range(n, world_size, rank);
  const int64_t begin = std::min(n, range.begin);
  return global.narrow(0, begin, std::min(range.end, n) - begin);
}

// --- training ---

struct Rank {
  Config config;
  std::shared_ptr<fsdp::Communicator> comm;
  fsdp::examples::IdxDataset train;
  fsdp::examples::IdxDataset test;
  at::Generator shuffle;  // same seed, same draws on every rank
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The mean of `value` over the ranks (every rank calls it).
double mean_over_ranks(fsdp::Communicator& comm, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  comm.all_reduce(t, fsdp::ReduceOp::kAvg);
  return t.item<double>();
}

int64_t steps_per_epoch(const Rank& r) {
  const int64_t steps = r.train.size() / r.config.batch_size;
  TORCH_CHECK(steps > 0, "--batch_size (", r.config.batch_size,
              ") is larger than the training set (", r.train.size(), " images)");
  const int64_t max = r.config.max_steps_per_epoch;
  return max > 0 ? std::min(steps, max) : steps;
}

// One optimizer step on this rank's share of the global batch `indices`; returns the
// rank's loss (mean over its share).
double train_step(Model& model, torch::optim::Optimizer& optimizer, const Rank& r,
                  const at::Tensor& indices) {
  const at::Tensor mine = rank_share(indices, r.comm->rank(), r.comm->world_size());
  optimizer.zero_grad();
  at::Tensor loss = torch::nn::functional::cross_entropy(
      model->forward(r.train.images.index_select(0, mine)), r.train.labels.index_select(0, mine));
  loss.backward();
  optimizer.step();
  return loss.item<double>();
}

// The learning rate of step t (0-based) of `total`: --lr, or with the cosine schedule
// lr x (1 + cos(pi t / total)) / 2 (PyTorch: CosineAnnealingLR, T_max = total, eta_min = 0,
// stepped every batch).
double scheduled_lr(const Config& c, int64_t t, int64_t total) {
  if (!c.cosine_lr) return c.lr;
  const double progress = static_cast<double>(t) / static_cast<double>(total);
  return c.lr * 0.5 * (1.0 + std::cos(M_PI * progress));
}

void set_lr(torch::optim::Optimizer& optimizer, double lr) {
  for (torch::optim::OptimizerParamGroup& group : optimizer.param_groups()) {
    group.options().set_lr(lr);
  }
}

bool should_log(int64_t step, int64_t steps, int64_t log_every) {
  return step == 1 || step == steps || step % log_every == 0;
}

// One epoch; returns the mean over its steps of the global batches' losses.
double train_epoch(Model& model, torch::optim::Optimizer& optimizer, Rank& r, int epoch) {
  model->train();
  const at::Tensor order =
      at::randperm(r.train.size(), r.shuffle, at::TensorOptions().dtype(at::kLong));
  const int64_t steps = steps_per_epoch(r);
  double loss_sum = 0;
  for (int64_t step = 1; step <= steps; ++step) {
    const int64_t begin = (step - 1) * r.config.batch_size;
    set_lr(optimizer,
           scheduled_lr(r.config, (epoch - 1) * steps + step - 1, r.config.epochs * steps));
    const double loss =
        train_step(model, optimizer, r, order.narrow(0, begin, r.config.batch_size));
    loss_sum += loss;
    if (!should_log(step, steps, r.config.log_every)) continue;
    const double global_loss = mean_over_ranks(*r.comm, loss);
    if (r.comm->rank() == 0) {
      std::cout << absl::StrFormat("epoch %d/%d step %d/%d: loss %.4f", epoch, r.config.epochs,
                                   step, steps, global_loss)
                << std::endl;
    }
  }
  return mean_over_ranks(*r.comm, loss_sum / static_cast<double>(steps));
}

// Test accuracy in percent: every rank classifies its share of each global test batch,
// and the correct counts are summed over the ranks.
double evaluate(Model& model, const Rank& r) {
  model->eval();
  torch::NoGradGuard no_grad;
  const int64_t n = r.test.size();
  at::Tensor correct = at::zeros({1}, at::kLong);
  for (int64_t begin = 0; begin < n; begin += kEvalBatchSize) {
    const at::Tensor global = at::arange(begin, std::min(n, begin + kEvalBatchSize), at::kLong);
    const at::Tensor mine = rank_share(global, r.comm->rank(), r.comm->world_size());
    const at::Tensor logits = model->forward(r.test.images.index_select(0, mine));
    correct += logits.argmax(1).eq(r.test.labels.index_select(0, mine)).sum();
  }
  r.comm->all_reduce(correct, fsdp::ReduceOp::kSum);
  return 100.0 * static_cast<double>(correct.item<int64_t>()) / static_cast<double>(n);
}

int64_t parameter_count(torch::nn::Module& module) {
  int64_t count = 0;
  for (const at::Tensor& p : module.parameters()) count += p.numel();
  return count;
}

// "FULL_SHARD", or "FULL_SHARD (runs as NO_SHARD)" on one rank.
std::string describe_strategy(fsdp::ShardingStrategy requested, fsdp::ShardingStrategy used) {
  if (requested == used) return fsdp::sharding_strategy_name(used);
  return absl::StrCat(fsdp::sharding_strategy_name(requested), " (runs as ",
                      fsdp::sharding_strategy_name(used), ")");
}

void print_setup(const Rank& r, const Model& model, int64_t num_parameters) {
  const int w = r.comm->world_size();
  std::cout << absl::StrFormat(
                   "fashion_mnist: %d rank%s, %s, MLP 784-512-256-10 (%d parameters), global "
                   "batch %d (%d per rank), %d steps per epoch, SGD lr %g (%s) momentum %g, "
                   "seed "
                   "%d, %d training and %d test images",
                   w, w == 1 ? "" : "s",
                   describe_strategy(r.config.strategy, model->sharding_strategy()), num_parameters,
                   r.config.batch_size, r.config.batch_size / w, steps_per_epoch(r), r.config.lr,
                   r.config.cosine_lr ? "cosine" : "constant", r.config.momentum, r.config.seed,
                   r.train.size(), r.test.size())
            << std::endl;
}

void train_and_evaluate(Rank& r) {
  torch::manual_seed(r.config.seed);  // identical initial weights on every rank
  auto net = std::make_shared<ClassifierImpl>();
  const int64_t num_parameters = parameter_count(*net);
  Model model(net,
              fsdp::FullyShardedDataParallelOptions(r.comm).sharding_strategy(r.config.strategy));
  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(r.config.lr).momentum(r.config.momentum));
  const bool reporter = r.comm->rank() == 0;
  if (reporter) print_setup(r, model, num_parameters);
  const auto start = std::chrono::steady_clock::now();
  double accuracy = 0;
  for (int epoch = 1; epoch <= r.config.epochs; ++epoch) {
    const auto epoch_start = std::chrono::steady_clock::now();
    const double loss = train_epoch(model, optimizer, r, epoch);
    accuracy = evaluate(model, r);
    if (!reporter) continue;
    std::cout << absl::StrFormat("epoch %d/%d: train loss %.4f, test accuracy %.2f%% (%.1f s)",
                                 epoch, r.config.epochs, loss, accuracy, seconds_since(epoch_start))
              << std::endl;
  }
  if (reporter) {
    std::cout << absl::StrFormat("final test accuracy: %.2f%% (%d test images, %d epoch%s, %.1f s)",
                                 accuracy, r.test.size(), r.config.epochs,
                                 r.config.epochs == 1 ? "" : "s", seconds_since(start))
              << std::endl;
  }
}

// This process as one rank of the job.
int run_rank(const Config& config, const fsdp::LaunchEnvironment& env) {
  at::set_num_threads(1);
  const int rank = env.rank;
  try {
    Rank r{config,
           fsdp::init_communicator(env, fsdp::RendezvousOptions().backend(fsdp::Backend::kGloo)),
           {},
           {},
           at::make_generator<at::CPUGeneratorImpl>(config.seed)};
    const std::string split_error = batch_split_error(config.batch_size, r.comm->world_size());
    TORCH_CHECK(split_error.empty(), split_error);
    r.train = load_split(config.data_dir, "train", 0);
    r.test = load_split(config.data_dir, "t10k", config.test_limit);
    train_and_evaluate(r);
  } catch (const c10::Error& e) {
    std::cerr << "fashion_mnist: rank " << rank << ": " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fashion_mnist: rank " << rank << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}

// Where this process sits: a launcher's variables, or launcher "none".
fsdp::LaunchEnvironment launch_environment() {
  try {
    return fsdp::read_launch_environment();
  } catch (const c10::Error& e) {
    fail_usage(e.what_without_backtrace());
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Trains an MLP on Fashion-MNIST with FSDP.\n"
      "  fashion_mnist [--world_size=2] [--epochs=3] [--batch_size=128] [--lr=0.05] ...\n"
      "Starts --world_size ranks of itself, or runs as one rank under fsdp_run/torchrun.");
  if (const absl::Status entered = fsdp::enter_build_working_directory(); !entered.ok()) {
    fail_usage(std::string(entered.message()));
  }
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) fail_usage(absl::StrCat("unexpected argument '", positional[1], "'"));
  const Config config = config_from_flags();
  const fsdp::LaunchEnvironment env = launch_environment();
  if (env.launcher == "none") require_readable_data(config.data_dir);
  if (env.launcher == "none" && config.world_size > 1) {
    const std::string split_error = batch_split_error(config.batch_size, config.world_size);
    require(split_error.empty(), split_error);  // before starting ranks that would all fail
    return fsdp::launch_self(config.world_size, argc, argv);
  }
  return run_rank(config, env);
}
