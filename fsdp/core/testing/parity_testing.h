// Models and a single-process reference for FSDP parity tests (REFERENCE §7), shared by
// the fake-communicator tests and the real-process tests (testonly).
#ifndef FSDP_CORE_TESTING_PARITY_TESTING_H_
#define FSDP_CORE_TESTING_PARITY_TESTING_H_

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "fsdp/base/names.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/checkpoint_wrapper.h"
#include "fsdp/core/fully_sharded.h"

namespace fsdp::core_testing {

// Runs fn on every rank of a fake world of `world_size` ranks (threads), each with its
// rank's communicator.
inline void on_ranks(int world_size, const std::function<void(std::shared_ptr<Communicator>)>& fn) {
  FakeWorld::run(FakeWorld::create(world_size), [&](Communicator& comm) {
    fn(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
  });
}

// Nested linears: two units (l1, l2) and the root's own head; 3 units with parameters.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", make_unit(torch::nn::Linear(4, 8)));
    l2 = register_module("l2", make_unit(torch::nn::Linear(8, 7)));
    head = register_module("head", torch::nn::Linear(7, 3));
  }
  at::Tensor forward(at::Tensor x) {
    namespace F = torch::nn::functional;
    return head(F::relu(l2(F::relu(l1(x)))));
  }
  Unit<torch::nn::LinearImpl> l1{nullptr}, l2{nullptr};
  torch::nn::Linear head{nullptr};
};

// Held while seeding the process-wide generator and drawing initial weights, so ranks
// that are threads do not interleave their draws (one mutex for every model type).
inline std::mutex& seed_mutex() {
  static std::mutex mutex;
  return mutex;
}

// The FQNs of a flat parameter's original parameters, in flattening order.
inline std::vector<std::string> fqns_of(const FlatParamHandle& handle) {
  std::vector<std::string> fqns;
  for (const FlatParamInfo& info : handle.param_infos()) fqns.push_back(info.fqn);
  return fqns;
}

// Identical initial weights on every rank and in the reference.
template <typename Net>
std::shared_ptr<Net> make() {
  std::lock_guard<std::mutex> lock(seed_mutex());
  torch::manual_seed(0);
  return std::make_shared<Net>();
}
inline std::shared_ptr<NetImpl> make_net() { return make<NetImpl>(); }

constexpr int kBatchPerRank = 2;
constexpr int kSteps = 4;

inline at::Tensor inputs(int step, int64_t rows) {
  return at::sin(at::arange(rows * 4, at::kFloat).view({rows, 4}) * 0.37 + step);
}
inline at::Tensor targets(int step, int64_t rows) {
  return at::cos(at::arange(rows * 3, at::kFloat).view({rows, 3}) * 0.21 - step);
}

// Each model: Net::batch(step, rows) -> {input, target}; Net::loss(output, target), a mean
// over the rows; Net::step for models whose forward depends on the iteration.
struct Batch {
  at::Tensor input, target;
};

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<at::Tensor> params,
                                                               bool adam) {
  if (adam) return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-2).momentum(0.9));
}

// The reference: one process, the same initial weights; each step's loss is the mean of
// the W ranks' losses on their shares of the global batch (what FSDP's averaged
// gradients train: for models without batch statistics, the loss on the global batch).
struct Reference {
  std::vector<float> losses;                 // per step
  std::map<std::string, at::Tensor> params;  // cleaned FQN -> final value
};

// A module's parameters, each once: LibTorch's parameters() lists a parameter registered
// by two modules twice (PyTorch's dedups), and an optimizer would then step it twice.
inline std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : module.parameters()) {
    const bool seen = std::any_of(params.begin(), params.end(), [&](const at::Tensor& q) {
      return q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
    });
    if (!seen) params.push_back(p);
  }
  return params;
}

template <typename Net>
Reference reference(int world_size, bool adam) {
  auto net = make<Net>();
  auto optimizer = make_optimizer(unique_parameters(*net), adam);
  std::vector<float> losses;
  for (int step = 0; step < kSteps; ++step) {
    net->step = step;
    optimizer->zero_grad();
    const Batch batch = Net::batch(step, kBatchPerRank * world_size);
    at::Tensor loss = at::zeros({});
    for (int r = 0; r < world_size; ++r) {
      loss = loss + Net::loss(net->forward(batch.input.narrow(0, r * kBatchPerRank, kBatchPerRank)),
                              batch.target.narrow(0, r * kBatchPerRank, kBatchPerRank));
    }
    loss = loss / world_size;
    loss.backward();
    optimizer->step();
    losses.push_back(loss.item<float>());
  }
  std::map<std::string, at::Tensor> params;
  for (const auto& item : net->named_parameters()) {
    params[clean_tensor_name(item.key())] = item.value().detach().clone();
  }
  return {losses, params};
}

// Called after each optimizer step (e.g. to save, zero and reload the state).
template <typename Net>
using AfterStep =
    std::function<void(FullyShardedDataParallelImpl<Net>& model, torch::optim::Optimizer& opt)>;

// Trains Net (made by `build_net`, default make<Net>) with FSDP on this rank of `comm`
// (every rank calls it) and EXPECTs the reference's losses every step and its parameters
// at the end. `device`: the compute device, CPU by default; any other (CUDA) is set as
// the options' device_id, each rank's share of the batch is moved there, and losses and
// parameters are compared after copying them to the CPU (the reference always runs on
// the CPU). Tolerance, absolute: 2e-6 on the CPU, the fp32 rounding of averaging W
// partial gradients in a different order; 1e-5 on a GPU, whose kernels (cuBLAS GEMMs,
// reductions) also sum in another order than the CPU reference's; a nonzero `tolerance`
// replaces them (e.g. for mixed precision).
template <typename Net>
void expect_parity_on(const std::shared_ptr<Communicator>& comm, const Reference& want,
                      const FullyShardedDataParallelOptions& options, bool adam,
                      const AfterStep<Net>& after_step = nullptr,
                      const std::function<std::shared_ptr<Net>()>& build_net = make<Net>,
                      const c10::Device& device = c10::Device(c10::kCPU), double tolerance = 0) {
  const int world_size = comm->world_size();
  if (tolerance == 0) tolerance = device.is_cpu() ? 2e-6 : 1e-5;
  FullyShardedDataParallelOptions on_device = options;
  if (!device.is_cpu()) on_device.device_id(device);
  FullyShardedDataParallel<Net> model(build_net(), on_device);
  auto optimizer = make_optimizer(model->parameters(), adam);
  for (int step = 0; step < kSteps; ++step) {
    model->module()->step = step;
    const Batch batch = Net::batch(step, kBatchPerRank * world_size);
    optimizer->zero_grad();
    const int64_t first = comm->rank() * kBatchPerRank;
    at::Tensor loss =
        Net::loss(model->forward(batch.input.narrow(0, first, kBatchPerRank).to(device)),
                  batch.target.narrow(0, first, kBatchPerRank).to(device));
    loss.backward();
    optimizer->step();
    if (after_step) after_step(*model, *optimizer);
    at::Tensor global = loss.detach().clone();
    comm->all_reduce(global, ReduceOp::kAvg);
    EXPECT_NEAR(global.item<float>(), want.losses[step], tolerance) << "step " << step;
    EXPECT_EQ(model->training_state(), TrainingState::kIdle);
  }
  auto summon = model->summon_full_params(SummonFullParamsOptions().writeback(false));
  for (const auto& item : model->named_parameters()) {
    const std::string fqn = clean_tensor_name(item.key());
    EXPECT_EQ(item.value().device(), model->device_handle().device()) << fqn;
    EXPECT_TRUE(
        at::allclose(item.value().cpu(), want.params.at(fqn), /*rtol=*/0, /*atol=*/tolerance))
        << fqn << " on rank " << comm->rank();
  }
}

// expect_parity_on for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, each with SGD and with
// Adam, on `device` (every rank calls it).
template <typename Net>
void expect_parity_for_all_strategies(const std::shared_ptr<Communicator>& comm,
                                      const c10::Device& device = c10::Device(c10::kCPU)) {
  for (bool adam : {false, true}) {
    const Reference want = reference<Net>(comm->world_size(), adam);
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(::testing::Message()
                   << sharding_strategy_name(strategy) << (adam ? ", Adam" : ", SGD"));
      expect_parity_on<Net>(comm, want,
                            FullyShardedDataParallelOptions(comm).sharding_strategy(strategy), adam,
                            nullptr, make<Net>, device);
    }
  }
}

// Nested linears with two units (NetImpl above).
struct NestedImpl : NetImpl {
  static Batch batch(int step, int64_t rows) { return {inputs(step, rows), targets(step, rows)}; }
  static at::Tensor loss(const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::mse_loss(out, y);
  }
  int step = 0;
};

// A tiny language model: tied embedding / output head in the root, vocabulary 11 (not a
// multiple of 2 or 3), two MLP blocks as units.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    up = register_module("up", torch::nn::Linear(8, 16));
    down = register_module("down", torch::nn::Linear(16, 8));
  }
  at::Tensor forward(at::Tensor x) { return x + down(torch::nn::functional::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};

struct TinyLmImpl : torch::nn::Module {
  static constexpr int64_t kVocab = 11;
  TinyLmImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(kVocab, 8));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(Unit<BlockImpl>(std::make_shared<BlockImpl>()));
  }
  at::Tensor forward(at::Tensor tokens) {
    at::Tensor x = embedding(tokens);
    for (const auto& block : *blocks) x = block->as<UnitImpl<BlockImpl>>()->forward(x);
    return at::matmul(x, embedding->weight.t());  // tied output head
  }
  static Batch batch(int step, int64_t rows) {
    at::Tensor tokens = (at::arange(rows * 6, at::kLong).view({rows, 6}) * 7 + step) % kVocab;
    return {tokens.narrow(1, 0, 5), tokens.narrow(1, 1, 5)};
  }
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& next) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), next.reshape({-1}));
  }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  int step = 0;
};

// A unit that runs on odd steps only.
struct SkipImpl : NestedImpl {
  at::Tensor forward(at::Tensor x) {
    namespace F = torch::nn::functional;
    at::Tensor h = F::relu(l1(x));
    if (step % 2 == 1)
      h = F::relu(l2(h));
    else
      h = h.narrow(1, 0, 7);
    return head(h);
  }
};

// BatchNorm (buffers, batch statistics) inside a unit.
struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    first = register_module("first", make_unit(torch::nn::Linear(4, 6)));
    norm = register_module("norm", make_unit(torch::nn::BatchNorm1d(6)));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(at::Tensor x) { return head(norm(first(x))); }
  static Batch batch(int step, int64_t rows) { return NestedImpl::batch(step, rows); }
  static at::Tensor loss(const at::Tensor& out, const at::Tensor& y) {
    return NestedImpl::loss(out, y);
  }
  Unit<torch::nn::LinearImpl> first{nullptr};
  Unit<torch::nn::BatchNorm1dImpl> norm{nullptr};
  torch::nn::Linear head{nullptr};
  int step = 0;
};

// TinyLmImpl with each block a Unit<CheckpointWrapper<Block>>: the same parameters, in
// the same order, under the same cleaned names. No random numbers in forward, and ranks
// are threads: no RNG state to preserve (see checkpoint_wrapper.h).
using CheckpointedBlock = CheckpointWrapperImpl<BlockImpl>;
struct CheckpointedLmImpl : torch::nn::Module {
  CheckpointedLmImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(TinyLmImpl::kVocab, 8));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) {
      blocks->push_back(Unit<CheckpointedBlock>(std::make_shared<CheckpointedBlock>(
          std::make_shared<BlockImpl>(), /*preserve_rng_state=*/false)));
    }
  }
  at::Tensor forward(at::Tensor tokens) {
    at::Tensor x = embedding(tokens);
    for (const auto& block : *blocks) x = block->as<UnitImpl<CheckpointedBlock>>()->forward(x);
    return at::matmul(x, embedding->weight.t());
  }
  static Batch batch(int step, int64_t rows) { return TinyLmImpl::batch(step, rows); }
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& next) {
    return TinyLmImpl::loss(logits, next);
  }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  int step = 0;
};

// Execution-order validation: two units of identical flat size (12 elements); `swap`
// runs b before a.
struct OrderImpl : torch::nn::Module {
  OrderImpl() {
    a = register_module("a", make_unit(torch::nn::Linear(3, 3)));
    b = register_module("b", make_unit(torch::nn::Linear(3, 3)));
  }
  at::Tensor forward(at::Tensor x) { return swap ? a(b(x)) : b(a(x)); }
  Unit<torch::nn::LinearImpl> a{nullptr}, b{nullptr};
  bool swap = false;
};

// Issue 14's shared-parameter cases (pytorch#83052's pattern): a parent unit and a unit
// inside it register one bias, and the parent uses it after calling the child.
struct BiasChildImpl : torch::nn::Module {
  explicit BiasChildImpl(const at::Tensor& shared) {
    lin = register_module("lin", torch::nn::Linear(4, 4));
    bias = register_parameter("bias", shared);
  }
  at::Tensor forward(const at::Tensor& x) { return lin(x) + bias; }
  torch::nn::Linear lin{nullptr};
  at::Tensor bias;
};
struct BiasParentImpl : torch::nn::Module {
  BiasParentImpl() {
    bias = register_parameter("bias", at::randn({4}) * 0.1);
    child = register_module("child", Unit<BiasChildImpl>(std::make_shared<BiasChildImpl>(bias)));
  }
  at::Tensor forward(const at::Tensor& x) { return torch::relu(child(x)) * bias; }
  at::Tensor bias;
  Unit<BiasChildImpl> child{nullptr};
};
struct SharedBiasImpl : torch::nn::Module {
  SharedBiasImpl() {
    parent = register_module("parent", Unit<BiasParentImpl>(std::make_shared<BiasParentImpl>()));
    head = register_module("head", torch::nn::Linear(4, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return head(parent(x)); }
  static Batch batch(int step, int64_t rows) { return NestedImpl::batch(step, rows); }
  static at::Tensor loss(const at::Tensor& out, const at::Tensor& y) {
    return NestedImpl::loss(out, y);
  }
  Unit<BiasParentImpl> parent{nullptr};
  torch::nn::Linear head{nullptr};
  int step = 0;
};

// Two sibling units tied: b uses a's weight (transposed).
struct TiedLinearImpl : torch::nn::Module {
  explicit TiedLinearImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, weight.t()); }
  at::Tensor weight;
};
struct TiedUnitsImpl : torch::nn::Module {
  TiedUnitsImpl() {
    a = register_module("a", make_unit(torch::nn::Linear(4, 4)));
    b = register_module(
        "b", Unit<TiedLinearImpl>(std::make_shared<TiedLinearImpl>(a->module()->weight)));
  }
  at::Tensor forward(at::Tensor x) { return b(torch::tanh(a(x))).narrow(1, 0, 3); }
  static Batch batch(int step, int64_t rows) { return NestedImpl::batch(step, rows); }
  static at::Tensor loss(const at::Tensor& out, const at::Tensor& y) {
    return NestedImpl::loss(out, y);
  }
  Unit<torch::nn::LinearImpl> a{nullptr};
  Unit<TiedLinearImpl> b{nullptr};
  int step = 0;
};

// The token embedding a unit of its own, the output head in the root tied to it.
struct EmbeddingUnitLmImpl : torch::nn::Module {
  EmbeddingUnitLmImpl() {
    embedding =
        register_module("embedding", make_unit(torch::nn::Embedding(TinyLmImpl::kVocab, 8)));
    block = register_module("block", Unit<BlockImpl>(std::make_shared<BlockImpl>()));
    head = register_module("head", std::make_shared<TiedLinearImpl>(embedding->module()->weight));
  }
  at::Tensor forward(at::Tensor tokens) { return head->forward(block(embedding(tokens))); }
  static Batch batch(int step, int64_t rows) { return TinyLmImpl::batch(step, rows); }
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& next) {
    return TinyLmImpl::loss(logits, next);
  }
  Unit<torch::nn::EmbeddingImpl> embedding{nullptr};
  Unit<BlockImpl> block{nullptr};
  std::shared_ptr<TiedLinearImpl> head;
  int step = 0;
};

// Frozen and trainable parameters in the same units (Note [Frozen parameters in a unit]
// in internal/runtime.cc): TinyLmImpl's blocks with each block's norm and up.weight
// frozen, and a frozen final norm (random, so its values matter) in the root beside the
// trained tied embedding. Flat numels: root 88 trainable + 16 frozen; each block 152
// trainable (up.bias, down.weight, down.bias) + 144 frozen (norm.weight, norm.bias,
// up.weight).
struct FrozenLmImpl : torch::nn::Module {
  FrozenLmImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(TinyLmImpl::kVocab, 8));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(Unit<BlockImpl>(std::make_shared<BlockImpl>()));
    final_norm =
        register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    torch::NoGradGuard no_grad;
    final_norm->weight.copy_(1 + 0.5 * at::randn({8}));
    final_norm->bias.copy_(0.1 * at::randn({8}));
    std::vector<at::Tensor> frozen = final_norm->parameters();
    for (const auto& block : *blocks) {
      auto& inner = *block->as<UnitImpl<BlockImpl>>()->module();
      for (const at::Tensor& p : inner.norm->parameters()) frozen.push_back(p);
      frozen.push_back(inner.up->weight);
    }
    for (at::Tensor& p : frozen) p.set_requires_grad(false);
  }
  at::Tensor forward(at::Tensor tokens) {
    at::Tensor x = embedding(tokens);
    for (const auto& block : *blocks) x = block->as<UnitImpl<BlockImpl>>()->forward(x);
    return at::matmul(final_norm(x), embedding->weight.t());
  }
  static Batch batch(int step, int64_t rows) { return TinyLmImpl::batch(step, rows); }
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& next) {
    return TinyLmImpl::loss(logits, next);
  }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm final_norm{nullptr};
  int step = 0;
};

// Flat parameters of several dtypes in one unit (Note [Flat parameters of several dtypes]
// in flat_param.cc): each block holds a frozen bf16 weight `up_weight` [16, 8], frozen
// uint8 codes `up_codes` [16] (stored values that scale the weight's rows by code / 128,
// as a quantized weight's metadata would) and trainable fp32 `up_bias` and `down`; the
// root holds the trained tied embedding and a frozen bf16 output scale [8]. Flat numels:
// root 88 fp32 + 8 bf16; each block 152 fp32 (up_bias, down.weight, down.bias) + 128
// bf16 + 16 uint8.
struct MixedDtypeBlockImpl : torch::nn::Module {
  MixedDtypeBlockImpl() {
    at::Tensor weight = 0.3 * at::randn({16, 8});
    up_weight = register_parameter("up_weight", weight.to(at::kBFloat16), /*requires_grad=*/false);
    up_codes =
        register_parameter("up_codes", (at::arange(16, at::kLong) * 37 % 200 + 40).to(at::kByte),
                           /*requires_grad=*/false);
    up_bias = register_parameter("up_bias", 0.1 * at::randn({16}));
    down = register_module("down", torch::nn::Linear(16, 8));
  }
  at::Tensor forward(at::Tensor x) {
    const at::Tensor scale = up_codes.to(at::kFloat).div(128).unsqueeze(1);
    const at::Tensor weight = up_weight.to(x.scalar_type()) * scale.to(x.scalar_type());
    return x + down(torch::nn::functional::gelu(torch::nn::functional::linear(x, weight, up_bias)));
  }
  at::Tensor up_weight, up_codes, up_bias;
  torch::nn::Linear down{nullptr};
};

struct MixedDtypeLmImpl : torch::nn::Module {
  MixedDtypeLmImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(TinyLmImpl::kVocab, 8));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) {
      blocks->push_back(Unit<MixedDtypeBlockImpl>(std::make_shared<MixedDtypeBlockImpl>()));
    }
    out_scale = register_parameter("out_scale", (1 + 0.5 * at::randn({8})).to(at::kBFloat16),
                                   /*requires_grad=*/false);
  }
  at::Tensor forward(at::Tensor tokens) {
    at::Tensor x = embedding(tokens);
    for (const auto& block : *blocks) x = block->as<UnitImpl<MixedDtypeBlockImpl>>()->forward(x);
    return at::matmul(x * out_scale.to(x.scalar_type()), embedding->weight.t());
  }
  static Batch batch(int step, int64_t rows) { return TinyLmImpl::batch(step, rows); }
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& next) {
    return TinyLmImpl::loss(logits, next);
  }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  at::Tensor out_scale;
  int step = 0;
};

}  // namespace fsdp::core_testing

#endif  // FSDP_CORE_TESTING_PARITY_TESTING_H_
