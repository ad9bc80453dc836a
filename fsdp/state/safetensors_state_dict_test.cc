// safetensors in and out of FSDP models on ranks as threads (the fake communicator):
// per-rank loading at W = 1, 2, 3 gives exactly the full tensors, saving gathers one unit
// at a time, tied weights, renames, every mismatch with its exact message, and the memory
// a rank's load adds (tracking allocator and RSS, printed).
#include "fsdp/state/safetensors_state_dict.h"

#include <stdlib.h>

#include <fstream>
#include <map>
#include <string>

#include "absl/strings/str_replace.h"
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/core/testing/meta_model.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/core/tracking_allocator.h"
#include "fsdp/formats/safetensors.h"
#include "fsdp/state/state_dict.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::ElementsAre;

std::string temp_dir() {
  std::string pattern = testing::TempDir() + "st_state_XXXXXX";
  TORCH_INTERNAL_ASSERT(::mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "";
}

template <typename Net>
FullyShardedDataParallel<Net> wrap(std::shared_ptr<Communicator> comm,
                                   ShardingStrategy strategy = ShardingStrategy::kFullShard) {
  return FullyShardedDataParallel<Net>(
      make<Net>(), FullyShardedDataParallelOptions(comm).sharding_strategy(strategy));
}

// The model's state dict with values unlike its initial ones (every element distinct).
StateDict distinct_values(const torch::nn::Module& module) {
  StateDict out;
  double base = 1;
  for (const auto& item : module_state_dict(module)) {
    const at::Tensor& t = item.value();
    out.insert(
        item.key(),
        (at::arange(t.numel(), at::kDouble) * 0.125 + base).reshape(t.sizes()).to(t.scalar_type()));
    base += 100;
  }
  return out;
}

// Writes `state` as a Hugging Face folder with small files (several shards and the index).
void write_folder(const std::string& dir, const StateDict& state, int64_t max_shard_size) {
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& item : state) {
    specs.push_back({item.key(), item.value().scalar_type(), item.value().sizes().vec()});
  }
  SafetensorsFolderWriter writer(dir, specs,
                                 SafetensorsWriteOptions().max_shard_size(max_shard_size));
  for (const auto& item : state) writer.write(item.key(), item.value());
  writer.commit();
}

void expect_equal(const StateDict& got, const StateDict& want) {
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& item : want) {
    EXPECT_TRUE(at::equal(got[item.key()], item.value())) << item.key();
  }
}

TEST(LoadSafetensors, EachRankGetsExactlyTheFullTensorsAtW123) {
  const StateDict want = distinct_values(*make<NormedImpl>());
  const std::string dir = temp_dir() + "/model";
  write_folder(dir, want, /*max_shard_size=*/100);
  ASSERT_GT(SafetensorsCheckpoint::open(dir).files().size(), 2u);
  for (int world_size : {1, 2, 3}) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(testing::Message()
                   << "W = " << world_size << ", " << sharding_strategy_name(strategy));
      on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
        auto model = wrap<NormedImpl>(comm, strategy);
        load_safetensors(*model, dir);
        expect_equal(full_state_dict(*model), want);
      });
    }
  }
}

// A model built on the meta device (fully_sharded.h) holds only NaN shards until a
// reader fills them: load_safetensors reads each rank's bytes into them, at W = 1, 2, 3
// and every strategy, with the policy picking units on the meta tree.
TEST(LoadSafetensors, FillsTheShardsOfAModelBuiltOnTheMetaDevice) {
  StateDict want = distinct_values(*build_on_cpu());
  want["head.weight"] = want["embed.weight"];  // tied: one parameter, one value
  const std::string dir = temp_dir() + "/meta";
  write_folder(dir, want, /*max_shard_size=*/400);
  for (int world_size : {1, 2, 3}) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
      SCOPED_TRACE(testing::Message()
                   << "W = " << world_size << ", " << sharding_strategy_name(strategy));
      on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
        FullyShardedDataParallel<MetaLmImpl> model(build_on_meta(),
                                                   meta_layer_policy(comm, strategy));
        load_safetensors(*model, dir);
        expect_equal(full_state_dict(*model), want);
      });
    }
  }
}

TEST(SaveSafetensors, WritesTheFullModelFromRankZeroOnly) {
  const StateDict want = module_state_dict(*make<NetImpl>());
  for (int world_size : {1, 3}) {
    const std::string dir = temp_dir() + "/out";
    on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      auto model = wrap<NetImpl>(comm);
      const std::vector<std::string> files =
          save_safetensors(*model, dir, SaveSafetensorsOptions().max_shard_size(120));
      if (comm->rank() == 0) {
        // The root unit's head first (84 + 12 bytes together), then l1 (128 alone, 32),
        // l2 (224 alone, 28): five files of at most 120 bytes but the larger tensors'.
        EXPECT_THAT(
            files,
            ElementsAre("model-00001-of-00005.safetensors", "model-00002-of-00005.safetensors",
                        "model-00003-of-00005.safetensors", "model-00004-of-00005.safetensors",
                        "model-00005-of-00005.safetensors"));
        EXPECT_EQ(SafetensorsFile::open(dir + "/" + files[0]).header().tensors.size(), 2u);
      } else {
        EXPECT_TRUE(files.empty());
      }
    });
    const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
    ASSERT_EQ(ckpt.names().size(), want.size());
    for (const auto& item : want) EXPECT_TRUE(at::equal(ckpt.read(item.key()), item.value()));
    EXPECT_EQ(ckpt.files()[0].header().metadata.at("format"), "pt");
  }
}

// A split entry is held in the files as several tensors (here each matrix as its rows,
// "<fqn>.row<i>"): each rank reads its shards' elements from the pieces, at W = 1, 2, 3
// (W = 3 cuts rows across ranks), and saving writes the pieces back, equal to the rows.
TEST(SafetensorsSplit, AnEntryHeldAsSeveralTensorsLoadsAndSavesByPiece) {
  const StateDict want = distinct_values(*make<NormedImpl>());
  const SafetensorsSplit rows = [](const std::string& fqn, c10::IntArrayRef shape) {
    std::vector<SafetensorsPiece> pieces;
    if (shape.size() != 2) return pieces;
    for (int64_t i = 0; i < shape[0]; ++i) {
      pieces.push_back({fqn + ".row" + std::to_string(i), {shape[1]}});
    }
    return pieces;
  };
  StateDict held;  // as the files hold it
  int64_t split = 0;
  for (const auto& item : want) {
    const std::vector<SafetensorsPiece> pieces = rows(item.key(), item.value().sizes());
    if (pieces.empty()) held.insert(item.key(), item.value());
    for (size_t i = 0; i < pieces.size(); ++i) held.insert(pieces[i].name, item.value()[i]);
    split += !pieces.empty();
  }
  ASSERT_GT(split, 0);
  const std::string dir = temp_dir() + "/rows";
  write_folder(dir, held, /*max_shard_size=*/100);
  for (int world_size : {1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << "W = " << world_size);
    const std::string out = temp_dir() + "/out";
    on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      auto model = wrap<NormedImpl>(comm);
      load_safetensors(*model, dir, LoadSafetensorsOptions().split(rows));
      expect_equal(full_state_dict(*model), want);
      save_safetensors(*model, out, SaveSafetensorsOptions().split(rows).max_shard_size(100));
    });
    const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(out);
    ASSERT_EQ(ckpt.names().size(), held.size());
    for (const auto& item : held) EXPECT_TRUE(at::equal(ckpt.read(item.key()), item.value()));
  }
  // Without the split, the rows are unexpected and the matrices missing.
  EXPECT_THAT(error_of([&] {
                on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
                  load_safetensors(*wrap<NormedImpl>(comm), dir);
                });
              }),
              ::testing::HasSubstr(".row0"));
}

// derive: entries computed from a tensor of the files (here l2.weight doubled, and l2.bias
// the row sums of the files' l2.weight: two entries from one source), each rank keeping its
// slices; written_as: an entry written in another shape than the model's.
TEST(SafetensorsDerive, EntriesComputedFromASourceTensorAndWrittenAsAnotherShape) {
  const StateDict want = module_state_dict(*make<NetImpl>());
  StateDict held;  // the files: l2.bias absent, l2.weight halved
  for (const auto& item : want) {
    if (item.key() == "l2.bias") continue;
    held.insert(item.key(), item.key() == "l2.weight" ? item.value() / 2 : item.value());
  }
  const std::string dir = temp_dir() + "/derived";
  write_folder(dir, held, /*max_shard_size=*/1000);
  StateDict expected;
  for (const auto& item : want) expected.insert(item.key(), item.value());
  expected["l2.bias"] = (want["l2.weight"] / 2).sum(1);
  const SafetensorsDerive derive = [](const std::string& fqn) -> c10::optional<SafetensorsDerived> {
    if (fqn == "l2.weight")
      return SafetensorsDerived{"l2.weight", [](const at::Tensor& w) { return w * 2; }};
    if (fqn == "l2.bias")
      return SafetensorsDerived{"l2.weight", [](const at::Tensor& w) { return w.sum(1); }};
    return c10::nullopt;
  };
  const std::string out = temp_dir() + "/derived_out";
  for (int world_size : {1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << "W = " << world_size);
    on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      auto model = wrap<NetImpl>(comm);
      load_safetensors(*model, dir, LoadSafetensorsOptions().derive(derive));
      expect_equal(full_state_dict(*model), expected);
      save_safetensors(
          *model, out,
          SaveSafetensorsOptions()
              .transform([](const std::string& fqn, const at::Tensor& value,
                            const torch::OrderedDict<std::string, at::Tensor>&) {
                return fqn == "l1.weight" ? value.reshape({-1}) : value;
              })
              .written_as([](const std::string& fqn) -> c10::optional<SafetensorsWrittenAs> {
                if (fqn != "l1.weight") return c10::nullopt;
                return SafetensorsWrittenAs{{32}, at::kFloat};
              }));
    });
    const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(out);
    EXPECT_TRUE(at::equal(ckpt.read("l1.weight"), want["l1.weight"].reshape({-1})));
    EXPECT_TRUE(at::equal(ckpt.read("l2.bias"), expected["l2.bias"]));
  }
  // A derived value of another shape than the model's is an error naming both.
  EXPECT_THAT(
      error_of([&] {
        on_ranks(1, [&](std::shared_ptr<Communicator> comm) {
          load_safetensors(
              *wrap<NetImpl>(comm), dir,
              LoadSafetensorsOptions().derive(
                  [](const std::string& fqn) -> c10::optional<SafetensorsDerived> {
                    if (fqn != "l2.bias") return c10::nullopt;
                    return SafetensorsDerived{"l2.weight", [](const at::Tensor& w) { return w; }};
                  }));
        });
      }),
      ::testing::HasSubstr("'l2.bias' derived from 'l2.weight' came out as Float [7, 8] "
                           "but the model holds Float [7]"));
}

// skip leaves entries out both ways; transform sees each unit's entries gathered
// together, also a unit that splits into a frozen and a trainable flat parameter (l1).
TEST(SaveSafetensors, SkipAndTransformSeeOneUnitAtATime) {
  const StateDict want = module_state_dict(*make<NetImpl>());
  const std::string dir = temp_dir() + "/out";
  const auto skip = [](const std::string& fqn) { return fqn == "l2.bias"; };
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto net = make<NetImpl>();
    net->named_parameters()["l1._fsdp_wrapped_module.bias"].set_requires_grad(
        false);  // l1: a frozen and a trainable flat parameter
    FullyShardedDataParallel<NetImpl> model(net, FullyShardedDataParallelOptions(comm));
    ASSERT_EQ(model->units()[1]->frozen_handles().size(), 1u);
    std::map<std::string, std::vector<std::string>> seen;  // fqn -> its unit's entries
    save_safetensors(*model, dir,
                     SaveSafetensorsOptions().skip(skip).transform(
                         [&](const std::string& fqn, const at::Tensor& value,
                             const torch::OrderedDict<std::string, at::Tensor>& unit) {
                           seen[fqn] = unit.keys();
                           for (const auto& item : unit)
                             EXPECT_TRUE(at::equal(item.value(), want[item.key()]));
                           return value * 2;
                         }));
    if (comm->rank() != 0) {
      EXPECT_TRUE(seen.empty());
      return;
    }
    using V = std::vector<std::string>;
    EXPECT_EQ(seen, (std::map<std::string, V>{{"head.weight", V{"head.weight", "head.bias"}},
                                              {"head.bias", V{"head.weight", "head.bias"}},
                                              {"l1.weight", V{"l1.weight", "l1.bias"}},
                                              {"l1.bias", V{"l1.weight", "l1.bias"}},
                                              {"l2.weight", V{"l2.weight", "l2.bias"}}}));
  });
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  EXPECT_THAT(ckpt.names(),
              ElementsAre("head.bias", "head.weight", "l1.bias", "l1.weight", "l2.weight"));
  for (const std::string& name : ckpt.names()) {
    EXPECT_TRUE(at::equal(ckpt.read(name), want[name] * 2)) << name;
  }
  // Loading what is there, l2.bias skipped: it keeps the value it had.
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NetImpl>(comm);
    load_safetensors(*model, dir, LoadSafetensorsOptions().skip(skip));
    const StateDict got = full_state_dict(*model);
    EXPECT_TRUE(at::equal(got["l2.bias"], want["l2.bias"]));
    EXPECT_TRUE(at::equal(got["l2.weight"], want["l2.weight"] * 2));
  });
}

// A bf16 checkpoint trained with fp32 master parameters (examples/llama/finetune's
// default for it): cast_floating reads it into the fp32 shards exactly, at W = 1 and 3, and
// SaveSafetensorsOptions::dtype writes it back bf16, bit for bit; values with more
// precision than bf16 round to nearest on the way out.
TEST(SafetensorsCast, ABf16CheckpointRoundTripsThroughFp32Shards) {
  StateDict bf16;
  for (const auto& item : distinct_values(*make<NetImpl>())) {
    bf16.insert(item.key(), item.value().to(at::kBFloat16));
  }
  const std::string dir = temp_dir() + "/bf16";
  write_folder(dir, bf16, /*max_shard_size=*/100);
  for (int world_size : {1, 3}) {
    SCOPED_TRACE(testing::Message() << "W = " << world_size);
    const std::string out = temp_dir() + "/out";
    on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      auto model = wrap<NetImpl>(comm);
      EXPECT_THAT(error_of([&] { load_safetensors(*model, dir); }),
                  ::testing::HasSubstr("the file has BF16, the model has Float"));
      load_safetensors(*model, dir, LoadSafetensorsOptions().cast_floating(true));
      StateDict fp32;
      for (const auto& item : bf16) fp32.insert(item.key(), item.value().to(at::kFloat));
      expect_equal(full_state_dict(*model), fp32);
      {
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.add_(1.0 / 1024);  // below bf16's resolution
      }
      save_safetensors(*model, out, SaveSafetensorsOptions().dtype(at::kBFloat16));
    });
    const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(out);
    for (const auto& item : bf16) {
      const at::Tensor got = ckpt.read(item.key());
      EXPECT_EQ(got.scalar_type(), at::kBFloat16) << item.key();
      EXPECT_TRUE(at::equal(got, (item.value().to(at::kFloat) + 1.0 / 1024).to(at::kBFloat16)))
          << item.key();
    }
  }
}

// keep_dtype: the entries it names are written in the model's dtype whatever `dtype` says
// (transformers' _keep_in_fp32_modules: DeepSeek-V3's router bias in a bf16 checkpoint).
TEST(SafetensorsCast, KeepDtypeWritesTheNamedEntriesInTheModelsDtype) {
  auto net = make<NetImpl>();
  const StateDict state = module_state_dict(*net);
  const std::string kept = state.keys().front();
  const std::string dir = temp_dir() + "/kept";
  save_module_safetensors(
      *net, dir,
      SaveSafetensorsOptions().dtype(at::kBFloat16).keep_dtype([&](const std::string& fqn) {
        return fqn == kept;
      }));
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  for (const auto& item : state) {
    const at::Tensor got = ckpt.read(item.key());
    EXPECT_EQ(got.scalar_type(), item.key() == kept ? at::kFloat : at::kBFloat16) << item.key();
    EXPECT_TRUE(at::equal(got, item.value().to(got.scalar_type()))) << item.key();
  }
}

// lm_head.weight is model.embed_tokens.weight: transformers writes only the embedding.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    embed = register_module("embed_tokens", torch::nn::Embedding(5, 4));
    norm = register_module("norm", make_unit(torch::nn::Linear(4, 4)));
    lm_head = register_module("lm_head", std::make_shared<torch::nn::Module>());
    lm_head->register_parameter("weight", embed->weight);
  }
  at::Tensor forward(at::Tensor x) { return at::matmul(norm(embed(x)), embed->weight.t()); }
  torch::nn::Embedding embed{nullptr};
  Unit<torch::nn::LinearImpl> norm{nullptr};
  std::shared_ptr<torch::nn::Module> lm_head;
};

TEST(LoadSafetensors, TiedWeightsAndRenames) {
  auto hf_name = [](const std::string& fqn) { return "model." + fqn; };
  const std::string dir = temp_dir() + "/tied";
  auto source = make<TiedImpl>();
  {
    torch::NoGradGuard no_grad;
    source->embed->weight.copy_(at::arange(20, at::kFloat).reshape({5, 4}));
  }
  save_module_safetensors(*source, dir, SaveSafetensorsOptions().rename(hf_name));
  EXPECT_THAT(SafetensorsCheckpoint::open(dir).names(),
              ElementsAre("model.embed_tokens.weight", "model.norm.bias", "model.norm.weight"));
  for (int world_size : {1, 2, 3}) {
    on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      auto model = wrap<TiedImpl>(comm);
      load_safetensors(*model, dir, LoadSafetensorsOptions().rename(hf_name));
      const StateDict full = full_state_dict(*model);
      EXPECT_TRUE(at::equal(full["lm_head.weight"], at::arange(20, at::kFloat).reshape({5, 4})));
      EXPECT_TRUE(at::equal(full["embed_tokens.weight"], full["lm_head.weight"]));
      EXPECT_TRUE(at::equal(full["norm.weight"], source->norm->module()->weight));
    });
  }
  // Both names in the file (as some exporters write them) load as well.
  const std::string both = temp_dir() + "/both.safetensors";
  save_safetensors_file(both, {{"embed_tokens.weight", at::ones({5, 4})},
                               {"lm_head.weight", at::ones({5, 4})},
                               {"norm.weight", at::ones({4, 4})},
                               {"norm.bias", at::ones({4})}});
  auto plain = make<TiedImpl>();
  load_module_safetensors(*plain, both);
  EXPECT_TRUE(at::equal(plain->lm_head->named_parameters()["weight"], at::ones({5, 4})));
}

TEST(LoadSafetensors, MismatchesNameTheTensorAndTheFile) {
  const std::string dir = temp_dir();
  const StateDict good = module_state_dict(*make<NetImpl>());
  auto write = [&](const std::string& name, std::vector<std::pair<std::string, at::Tensor>> extra,
                   const std::vector<std::string>& drop) {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& item : good) {
      if (std::find(drop.begin(), drop.end(), item.key()) == drop.end()) {
        tensors.emplace_back(item.key(), item.value());
      }
    }
    for (auto& e : extra) tensors.push_back(std::move(e));
    const std::string path = dir + "/" + name;
    save_safetensors_file(path, tensors);
    return path;
  };
  const std::string missing = write("missing.safetensors", {}, {"l2.bias"});
  const std::string unexpected = write("unexpected.safetensors", {{"extra", at::ones({2})}}, {});
  const std::string shape =
      write("shape.safetensors", {{"l1.weight", at::ones({4, 8})}}, {"l1.weight"});
  const std::string dtype =
      write("dtype.safetensors", {{"head.bias", at::ones({3}, at::kDouble)}}, {"head.bias"});
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = wrap<NetImpl>(comm);
    auto message = [&](const std::string& path, const LoadSafetensorsOptions& options = {}) {
      return absl::StrReplaceAll(error_of([&] { load_safetensors(*model, path, options); }),
                                 {{dir, "DIR"}});
    };
    EXPECT_EQ(message(missing),
              "load_safetensors: 'DIR/missing.safetensors': the keys do not match the model's; "
              "missing keys (1): 'l2.bias'. Load a state dict saved from the same model "
              "architecture");
    EXPECT_EQ(message(unexpected),
              "load_safetensors: 'DIR/unexpected.safetensors': the keys do not match the "
              "model's; unexpected keys (1): 'extra'. Load a state dict saved from the same "
              "model architecture");
    EXPECT_EQ(message(unexpected, LoadSafetensorsOptions().allow_unexpected(true)), "");
    EXPECT_EQ(message(unexpected, LoadSafetensorsOptions().unread(
                                      [](const std::string& name) { return name == "extra"; })),
              "");
    EXPECT_EQ(message(unexpected, LoadSafetensorsOptions().unread(
                                      [](const std::string& name) { return name == "l1.weight"; })),
              "load_safetensors: 'DIR/unexpected.safetensors': the keys do not match the "
              "model's; unexpected keys (1): 'extra'. Load a state dict saved from the same "
              "model architecture");
    EXPECT_EQ(message(shape),
              "load_safetensors: size mismatch for 'l1.weight' (tensor 'l1.weight' in "
              "'DIR/shape.safetensors'): the file has shape [4, 8], the model has [8, 4]");
    EXPECT_EQ(message(dtype),
              "load_safetensors: dtype mismatch for 'head.bias' (tensor 'head.bias' in "
              "'DIR/dtype.safetensors'): the file has F64, the model has Float; convert one of "
              "them first, or load with LoadSafetensorsOptions().cast_floating(true) (fsdp does "
              "not cast silently)");
  });
}

int64_t rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// Eight 256 x 256 units (2.1 MB): load_safetensors reads into the shards themselves, so a
// rank allocates nothing beyond the model; loading the full state dict first holds all N.
struct WideImpl : torch::nn::Module {
  WideImpl() {
    for (int i = 0; i < 8; ++i) {
      layers.push_back(
          register_module("layers" + std::to_string(i), make_unit(torch::nn::Linear(256, 256))));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : layers) x = layer(x);
    return x;
  }
  std::vector<Unit<torch::nn::LinearImpl>> layers;
};

TEST(LoadSafetensors, ARankAllocatesOnlyItsShardsNotTheModel) {
  const std::string dir = temp_dir() + "/wide";
  const StateDict want = distinct_values(*make<WideImpl>());
  int64_t model_bytes = 0;
  for (const auto& item : want) model_bytes += item.value().nbytes();
  ASSERT_EQ(model_bytes, 8 * (256 * 256 + 256) * 4);
  write_folder(dir, want, /*max_shard_size=*/600'000);
  MemoryTracker tracker;
  for (int world_size : {1, 2, 3}) {
    std::vector<int64_t> load_peak(world_size), full_peak(world_size), shard_bytes(world_size);
    const int64_t rss_before = rss_kib();
    on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      const int rank = comm->rank();
      MemoryTagGuard tag(rank);
      auto model = wrap<WideImpl>(comm);
      shard_bytes[rank] = memory_allocated(rank);
      reset_peak_memory_stats(rank);
      load_safetensors(*model, dir);
      load_peak[rank] = max_memory_allocated(rank) - shard_bytes[rank];
      const StateDict full = full_state_dict(*model);  // (checked, then dropped)
      for (const auto& item : want) ASSERT_TRUE(at::equal(full[item.key()], item.value()));
      const int64_t before_full = memory_allocated(rank);
      reset_peak_memory_stats(rank);
      {
        const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
        StateDict read;
        for (const auto& item : want) read.insert(item.key(), ckpt.read(item.key()));
        load_full_state_dict(*model, read);
      }
      full_peak[rank] = max_memory_allocated(rank) - before_full;
    });
    for (int rank = 0; rank < world_size; ++rank) {
      std::printf(
          "W = %d rank %d: shards %lld bytes; load_safetensors adds %lld bytes at peak, "
          "reading the full state dict first adds %lld (model %lld); process RSS %+lld KiB\n",
          world_size, rank, static_cast<long long>(shard_bytes[rank]),
          static_cast<long long>(load_peak[rank]), static_cast<long long>(full_peak[rank]),
          static_cast<long long>(model_bytes), static_cast<long long>(rss_kib() - rss_before));
      EXPECT_EQ(load_peak[rank], 0) << "rank " << rank;
      EXPECT_EQ(full_peak[rank], model_bytes) << "rank " << rank;
    }
  }
}

}  // namespace
}  // namespace fsdp
