// Hugging Face folders in and out of the decoder: shard sizes; a model built on the meta
// device and read as shards equals the one built whole (weights, adapters, losses); each
// rank reads exactly its shards' bytes (counted by Linux's per-thread I/O accounting);
// the merged LoRA folder and the adapter are written one unit at a time (tracked memory).
#include "models/hf_checkpoint.h"

#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include <ATen/Functions.h>
#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/adamw.h>

#include "fsdp/base/names.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/tracking_allocator.h"
#include "fsdp/formats/nf4.h"
#include "fsdp/formats/safetensors.h"
#include "fsdp/lora/adapter_file.h"
#include "fsdp/lora/lora.h"
#include "fsdp/state/safetensors_state_dict.h"
#include "fsdp/state/state_dict.h"
#include "models/config.h"
#include "models/decoder.h"

namespace fsdp::models {
namespace {

TEST(ParseShardSizeTest, TransformersUnits) {
  EXPECT_EQ(parse_shard_size("20000"), 20000);
  EXPECT_EQ(parse_shard_size("20KB"), 20000);
  EXPECT_EQ(parse_shard_size("5MB"), 5000000);
  EXPECT_EQ(parse_shard_size("5GB"), 5000000000);
  EXPECT_EQ(parse_shard_size("1KiB"), 1024);
  EXPECT_EQ(parse_shard_size("3MiB"), 3 * 1048576);
  EXPECT_EQ(parse_shard_size("2GiB"), 2147483648);
  EXPECT_EQ(parse_shard_size("2gib"), 2147483648);  // save_pretrained ignores the case
  EXPECT_EQ(parse_shard_size("5gB"), 5000000000);   // ... but for a final lowercase b: bits
  EXPECT_THAT([] { parse_shard_size("5gb", "--max_memory_per_rank"); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr(
                  "--max_memory_per_rank=5gb: a final lowercase b means bits to save_pretrained; "
                  "write 5GB for bytes")));
}

TEST(ParseShardSizeTest, BadValuesNameTheFlag) {
  for (const std::string bad : {"", "0", "-5", "5TB", "GB", "1.5GB", "99999999999GiB"}) {
    try {
      parse_shard_size(bad);
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const c10::Error& e) {
      EXPECT_EQ(std::string(e.what_without_backtrace()),
                "--max_shard_size=" + bad +
                    ": expected a positive size in bytes, or with KB, MB, GB, KiB, MiB or GiB "
                    "(e.g. 5GB)");
    }
  }
}

TEST(ParseShardSizeTest, BadValuesNameTheGivenFlag) {
  try {
    parse_shard_size("5TB", "--max_memory_per_rank");
    ADD_FAILURE() << "no error for '5TB'";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "--max_memory_per_rank=5TB: expected a positive size in bytes, or with KB, MB, GB, "
              "KiB, MiB or GiB (e.g. 5GB)");
  }
}

constexpr int kWorld = 2;
constexpr int64_t kAdapterSeed = 7;

// A small Llama (transformers 5's config.json): 4 layers, hidden 32, 4 heads, 2 key/value
// heads, intermediate 64, vocab 64, its own head. Per layer 9280 parameters (q, o
// 32 x 32; k, v 16 x 32; gate, up, down 64 x 32; two norms of 32); outside the layers
// 4128 (embeddings and head 64 x 32, the final norm): 41248 in all, 164992 bytes in fp32.
constexpr int64_t kModelBytes = (4 * 9280 + 4128) * 4;
constexpr char kTinyLlama[] =
    R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "max_position_embeddings": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "vocab_size": 64,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": false})";
DecoderConfig tiny_llama() { return parse_decoder_config(kTinyLlama, "tiny.json"); }

lora::LoraConfig lora_config() {
  lora::LoraConfig config;
  config.r(4).lora_alpha(8).target_modules({"q_proj", "v_proj"});
  return config;
}

std::string temp_dir() {
  std::string pattern = testing::TempDir() + "hf_ckpt_XXXXXX";
  TORCH_INTERNAL_ASSERT(::mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

// Ranks are threads: one seeds and draws from the default generator at a time.
std::mutex& draw_mutex() {
  static std::mutex mutex;
  return mutex;
}

void on_ranks(const std::function<void(std::shared_ptr<Communicator>)>& fn) {
  FakeWorld::run(FakeWorld::create(kWorld), [&](Communicator& comm) {
    MemoryTagGuard tag(comm.rank());
    fn(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
  });
}

// A folder of random weights (a CPU build from seed 1) in files of at most 40 KB.
std::string write_folder() {
  const std::string dir = temp_dir() + "/model";
  at::manual_seed(1);
  save_module_safetensors(CausalLMImpl(tiny_llama()), dir,
                          SaveSafetensorsOptions().max_shard_size(40'000));
  return dir;
}

using Model = FullyShardedDataParallel<CausalLMImpl>;

// What examples/llama:finetune did before: every rank built the whole model on the CPU,
// read the whole folder into it (LoRA) and added the adapters from the seed, then wrapped.
Model whole_then_wrap(const std::string& dir, bool lora, std::shared_ptr<Communicator> comm) {
  std::shared_ptr<CausalLMImpl> net;
  {
    // The random initialisation draws too: not while the other rank seeds for its adapters.
    std::lock_guard<std::mutex> lock(draw_mutex());
    net = std::make_shared<CausalLMImpl>(tiny_llama());
  }
  if (lora) {
    load_module_safetensors(*net, dir);
    std::lock_guard<std::mutex> lock(draw_mutex());
    at::manual_seed(kAdapterSeed);
    lora::apply_lora(*net, lora_config());
  }
  Model model(net, FullyShardedDataParallelOptions(comm));
  if (!lora) load_hf_weights(*model, dir);
  return model;
}

// What it does now: built on the meta device, adapters from the seed, wrapped, then each
// rank reads its shards.
Model meta_then_load(const std::string& dir, bool lora, std::shared_ptr<Communicator> comm) {
  auto net = std::make_shared<CausalLMImpl>(tiny_llama(), at::TensorOptions().device(c10::kMeta));
  if (lora) {
    std::lock_guard<std::mutex> lock(draw_mutex());
    at::manual_seed(kAdapterSeed);
    lora::apply_lora(*net, lora_config());
  }
  Model model(net, FullyShardedDataParallelOptions(comm));
  load_hf_weights(*model, dir);
  return model;
}

// Next-token loss on a fixed batch of this rank, then an AdamW step.
double train_step(Model& model, torch::optim::AdamW& adamw, int rank) {
  const at::Tensor ids = (at::arange(18, at::kLong).view({2, 9}) * (7 + rank)) % 64;
  adamw.zero_grad();
  const at::Tensor logits = model->forward(ids.narrow(1, 0, 8));
  const at::Tensor loss =
      at::cross_entropy_loss(logits.reshape({-1, 64}), ids.narrow(1, 1, 8).reshape({-1}));
  loss.backward();
  adamw.step();
  return loss.item<double>();
}

void expect_equal(const StateDict& got, const StateDict& want) {
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& item : want) EXPECT_TRUE(at::equal(got[item.key()], item.value())) << item.key();
}

// The model the trainer builds now equals the one it built whole: the same weights, the
// same adapters from the same seed, the same losses and updates (full and LoRA).
TEST(MetaLoadTest, SameWeightsAndLossesAsBuildingTheWholeModel) {
  const std::string dir = write_folder();
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA" : "full");
    on_ranks([&](std::shared_ptr<Communicator> comm) {
      Model before = whole_then_wrap(dir, lora, comm);
      Model now = meta_then_load(dir, lora, comm);
      expect_equal(full_state_dict(*now), full_state_dict(*before));
      torch::optim::AdamW adam_before(before->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW adam_now(now->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 2; ++step) {
        EXPECT_EQ(train_step(now, adam_now, comm->rank()),
                  train_step(before, adam_before, comm->rank()));
      }
      expect_equal(full_state_dict(*now), full_state_dict(*before));
    });
  }
}

// This thread's rchar (bytes its read and pread calls returned; Linux's
// /proc/thread-self/io), and in `text_bytes` the bytes this read of it returned.
int64_t thread_rchar(int64_t* text_bytes) {
  std::ifstream in("/proc/thread-self/io");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  *text_bytes = static_cast<int64_t>(text.size());
  const size_t at = text.find("rchar: ");
  return at == std::string::npos ? -1 : std::stoll(text.substr(at + 7));
}

// Each rank reads its shards' bytes and the headers, nothing else: at W = 2 every flat
// parameter's numel is even (the root's 4128, each layer's 9280), so each rank reads
// exactly half the parameter bytes, 82496, plus the index and every file's header; the
// LoRA adapters are not read (they keep their values from the seed).
TEST(MetaLoadTest, EachRankReadsOnlyItsShardsBytes) {
  int64_t probe = 0;
  if (thread_rchar(&probe) < 0) GTEST_SKIP() << "no /proc/thread-self/io (Linux I/O accounting)";
  const std::string dir = write_folder();
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  ASSERT_GT(ckpt.files().size(), 2u);
  int64_t headers = std::filesystem::file_size(dir + "/model.safetensors.index.json");
  int64_t data = 0;
  for (const SafetensorsFile& file : ckpt.files()) {
    headers += file.header().data_offset;
    for (const SafetensorsTensorInfo& t : file.header().tensors) data += t.nbytes;
  }
  ASSERT_EQ(data, kModelBytes);
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA" : "full");
    std::vector<int64_t> read(kWorld), whole(kWorld), peak(kWorld);
    MemoryTracker tracker;
    on_ranks([&](std::shared_ptr<Communicator> comm) {
      const int rank = comm->rank();
      auto net =
          std::make_shared<CausalLMImpl>(tiny_llama(), at::TensorOptions().device(c10::kMeta));
      if (lora) {
        std::lock_guard<std::mutex> lock(draw_mutex());
        lora::apply_lora(*net, lora_config());
      }
      reset_peak_memory_stats(rank);
      Model model(net, FullyShardedDataParallelOptions(comm));
      int64_t text = 0;
      const int64_t before = thread_rchar(&text);
      load_hf_weights(*model, dir);
      int64_t ignored = 0;
      read[rank] = thread_rchar(&ignored) - before - text;
      peak[rank] = max_memory_allocated(rank);
      // The old way, for comparison: the whole folder into a whole model.
      CausalLMImpl cpu(tiny_llama());
      const int64_t before_whole = thread_rchar(&text);
      load_module_safetensors(cpu, dir);
      whole[rank] = thread_rchar(&ignored) - before_whole - text;
    });
    for (int rank = 0; rank < kWorld; ++rank) {
      std::printf(
          "%s, rank %d: read %lld bytes (model %lld, headers %lld; whole: %lld), peak "
          "%lld bytes tracked while wrapping and loading\n",
          lora ? "LoRA" : "full", rank, static_cast<long long>(read[rank]),
          static_cast<long long>(kModelBytes), static_cast<long long>(headers),
          static_cast<long long>(whole[rank]), static_cast<long long>(peak[rank]));
      EXPECT_EQ(read[rank], kModelBytes / 2 + headers) << "rank " << rank;
      EXPECT_EQ(whole[rank], kModelBytes + headers) << "rank " << rank;
      // The shards and one layer unit's flat parameter (9280 elements) unsharded while
      // FSDP builds it from the meta device, less lm_head's shard (1024 elements: its unit
      // is built after the layers); LoRA: plus the adapters (at most all of them).
      if (lora) {
        EXPECT_LE(peak[rank], kModelBytes / 2 + (9280 - 1024) * 4 + 4 * (128 + 128 + 128 + 64) * 4);
      } else {
        EXPECT_EQ(peak[rank], kModelBytes / 2 + (9280 - 1024) * 4) << "rank " << rank;
      }
    }
  }
}

StateDict read_folder(const std::string& path) {
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(path);
  StateDict out;
  for (const std::string& name : ckpt.names()) out.insert(name, ckpt.read(name));
  return out;
}

// save_lora_hf_folders writes what the trainer wrote from a full state dict gathered to
// rank 0 (the merged weights, the adapter), while rank 0 holds at most one unit gathered
// beside its shards: its tracked peak above the shards is that of writing the same model
// without merging (save_hf_folder, one unit at a time: the unit's unsharded flat
// parameters and the fake communicator's all-gather staging) plus a merge's fp32
// temporaries and the adapters' copies, below the whole model's bytes, which gathering
// the full state dict takes.
TEST(MergedLoraSaveTest, WritesWhatAFullStateDictGaveOneUnitAtATime) {
  const std::string from = write_folder();
  const std::string out = temp_dir();
  const lora::LoraConfig config = lora_config();
  // A merge of the largest adapted weight (q_proj, 32 x 32) holds at most three fp32
  // tensors of its size; the adapters of all 4 layers are copied (q: 4 x 32 and 32 x 4,
  // v: 4 x 32 and 16 x 4).
  const int64_t merge_bytes = 3 * 32 * 32 * 4;
  const int64_t adapter_bytes = 4 * (128 + 128 + 128 + 64) * 4;
  std::vector<int64_t> peak(kWorld), plain_peak(kWorld), full_peak(kWorld);
  MemoryTracker tracker;
  on_ranks([&](std::shared_ptr<Communicator> comm) {
    const int rank = comm->rank();
    Model model = meta_then_load(from, /*lora=*/true, comm);
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    train_step(model, adamw, rank);  // lora_B no longer zero: merging changes the weights
    const int64_t shards = memory_allocated(rank);
    reset_peak_memory_stats(rank);
    save_hf_folder(*model, from, out + "/plain", 40'000);  // unmerged, for comparison
    plain_peak[rank] = max_memory_allocated(rank) - shards;
    reset_peak_memory_stats(rank);
    save_lora_hf_folders(*model, config, from, out + "/hf", out + "/adapter", 40'000);
    peak[rank] = max_memory_allocated(rank) - shards;
    reset_peak_memory_stats(rank);
    {
      // The trainer's save before: the full state dict on rank 0.
      const StateDict full = full_state_dict(*model, FullStateDictOptions().rank0_only(true));
      full_peak[rank] = max_memory_allocated(rank) - shards;
      if (rank == 0) {
        lora::save_merged(full, config, out + "/hf_before", 40'000);
        lora::save_adapter(full, config, out + "/adapter_before");
      }
    }
  });
  std::printf(
      "rank 0: peak %lld bytes above the shards saving merged one unit at a time "
      "(%lld unmerged), %lld gathering the full state dict (model %lld)\n",
      static_cast<long long>(peak[0]), static_cast<long long>(plain_peak[0]),
      static_cast<long long>(full_peak[0]), static_cast<long long>(kModelBytes));
  EXPECT_LE(peak[0], plain_peak[0] + merge_bytes + adapter_bytes);
  EXPECT_LT(peak[0], kModelBytes);
  EXPECT_GE(full_peak[0], kModelBytes);
  expect_equal(read_folder(out + "/hf"), read_folder(out + "/hf_before"));
  expect_equal(read_folder(out + "/adapter/adapter_model.safetensors"),
               read_folder(out + "/adapter_before/adapter_model.safetensors"));
  EXPECT_FALSE(at::equal(read_folder(out + "/hf")["model.layers.0.self_attn.q_proj.weight"],
                         read_folder(from)["model.layers.0.self_attn.q_proj.weight"]));
}

// A bitsandbytes 4-bit folder (Note [A bitsandbytes 4-bit folder] in hf_checkpoint.cc).
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

// The tensors transformers saves for `weights` (a float folder's) loaded in bitsandbytes'
// 4-bit NF4 with double quantization, the weights of `quantized` (module FQNs) quantized
// (fsdp's NF4: bitsandbytes' bytes, nf4_interop_test), `edit_state` changing each quant_state's
// JSON before it is written.
Tensors bnb_4bit_tensors(const StateDict& weights, const std::set<std::string>& quantized,
                         const std::function<void(nlohmann::json&)>& edit_state = nullptr) {
  Tensors tensors;
  for (const auto& item : weights) {
    const std::string module = item.key().substr(0, item.key().size() - 7);  // less ".weight"
    if (!quantized.count(module)) {
      tensors.emplace_back(item.key(), item.value());
      continue;
    }
    const auto entries = lora::nf4_weight_entries(item.value());
    nlohmann::json state = {{"quant_type", "nf4"},
                            {"blocksize", 64},
                            {"dtype", "float32"},
                            {"shape", item.value().sizes().vec()},
                            {"nested_blocksize", 256},
                            {"nested_dtype", "float32"},
                            {"nested_offset", entries[4].second.view(at::kFloat).item<float>()}};
    if (edit_state) edit_state(state);
    const std::string text = state.dump();
    tensors.emplace_back(item.key(), entries[0].second.view({-1, 1}));
    tensors.emplace_back(item.key() + ".absmax", entries[1].second);
    tensors.emplace_back(item.key() + ".nested_absmax", entries[2].second.view(at::kFloat));
    tensors.emplace_back(item.key() + ".nested_quant_map", entries[3].second.view(at::kFloat));
    tensors.emplace_back(item.key() + ".quant_map", nf4_code());
    tensors.emplace_back(
        item.key() + ".quant_state.bitsandbytes__nf4",
        at::from_blob(const_cast<char*>(text.data()), {int64_t(text.size())}, at::kByte).clone());
  }
  return tensors;
}

// A folder of `tensors` in one file, with a config.json when `config` is not empty.
std::string write_tensors(const Tensors& tensors, const std::string& config = "") {
  const std::string dir = temp_dir() + "/bnb4";
  std::filesystem::create_directories(dir);
  save_safetensors_file(dir + "/model.safetensors", tensors);
  if (!config.empty()) std::ofstream(dir + "/config.json") << config;
  return dir;
}

// The LoraLinears of `net` by cleaned FQN.
std::map<std::string, lora::LoraLinearImpl*> lora_linears(CausalLMImpl& net) {
  std::map<std::string, lora::LoraLinearImpl*> layers;
  for (const auto& item : net.named_modules("", /*include_self=*/false)) {
    if (auto* layer = item.value()->as<lora::LoraLinearImpl>()) {
      layers.emplace(clean_tensor_name(item.key()), layer);
    }
  }
  return layers;
}

std::shared_ptr<CausalLMImpl> meta_llama() {
  return std::make_shared<CausalLMImpl>(tiny_llama(), at::TensorOptions().device(c10::kMeta));
}

// The folder decides which modules are in 4 bits (here every projection but one, as
// unsloth's "dynamic" folders leave some out): store_hf_nf4_weights stores those in NF4, and
// load_hf_weights reads them into the same bytes, at W = 2, that quantizing the float folder
// as it is read gives (bitsandbytes' quantize_4bit of the same weights), the other weights
// bit for bit.
TEST(Bnb4BitFolderTest, ReadAsStoredEqualsQuantizedAsRead) {
  const std::string from = write_folder();
  const StateDict weights = read_folder(from);
  std::set<std::string> quantized;
  for (const auto& item : weights) {
    const std::string module = item.key().substr(0, item.key().size() - 7);
    if (absl::EndsWith(module, "_proj") && module != "model.layers.3.mlp.down_proj") {
      quantized.insert(module);
    }
  }
  ASSERT_EQ(quantized.size(), 27u);  // 4 layers x 7 projections, less one
  const std::string dir = write_tensors(bnb_4bit_tensors(weights, quantized));
  EXPECT_EQ(hf_weights_dtype(dir), at::kFloat);  // the float32 quantization state left out
  on_ranks([&](std::shared_ptr<Communicator> comm) {
    auto stored = meta_llama();
    const std::vector<std::string> fqns = store_hf_nf4_weights(*stored, dir);
    EXPECT_EQ(std::set<std::string>(fqns.begin(), fqns.end()), quantized);
    auto quantizing = meta_llama();
    const auto layers = lora_linears(*quantizing);
    for (const std::string& fqn : fqns) layers.at(fqn)->store_weight_nf4();
    Model read(stored, FullyShardedDataParallelOptions(comm));
    Model quantized_as_read(quantizing, FullyShardedDataParallelOptions(comm));
    load_hf_weights(*read, dir);
    load_hf_weights(*quantized_as_read, from);
    expect_equal(full_state_dict(*read), full_state_dict(*quantized_as_read));
  });
}

// What store_hf_nf4_weights says of a 4-bit folder whose layer 0 q_proj ([32, 32]: 1024
// codes, 16 blocks) is in 4 bits, `edit` changing its tensors first; DIR for the folder.
std::string store_error(const std::function<void(Tensors&)>& edit,
                        const std::function<void(nlohmann::json&)>& edit_state = nullptr) {
  static const StateDict weights = read_folder(write_folder());
  Tensors tensors = bnb_4bit_tensors(weights, {"model.layers.0.self_attn.q_proj"}, edit_state);
  if (edit) edit(tensors);
  const std::string dir = write_tensors(tensors);
  try {
    store_hf_nf4_weights(*meta_llama(), dir);
  } catch (const c10::Error& e) {
    return absl::StrReplaceAll(e.what_without_backtrace(), {{dir, "DIR"}});
  }
  return "no error";
}

// `name`'s entry in `tensors`.
at::Tensor& tensor_of(Tensors& tensors, const std::string& name) {
  for (auto& [key, value] : tensors) {
    if (key == name) return value;
  }
  TORCH_INTERNAL_ASSERT(false, "no ", name);
}

at::Tensor bytes_of(const std::string& text) {
  return at::from_blob(const_cast<char*>(text.data()), {int64_t(text.size())}, at::kByte).clone();
}

// Every other quantization, and every tensor that disagrees with the quant_state or the
// model, is refused naming the tensor, what it holds and what is expected.
TEST(Bnb4BitFolderTest, RefusesOtherQuantizationsAndBadTensorsByName) {
  const std::string w = "model.layers.0.self_attn.q_proj.weight";
  const std::string state = "'" + w + ".quant_state.bitsandbytes__nf4' in 'DIR/model.safetensors'";
  const std::string nf4 =
      "fsdp reads bitsandbytes' 4-bit NF4 with double quantization (blocksize 64, "
      "nested_blocksize 256), as transformers saves a model loaded with "
      "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", "
      "bnb_4bit_use_double_quant=True)";
  EXPECT_EQ(store_error(nullptr), "no error");
  EXPECT_EQ(store_error([&](Tensors& t) {
              tensor_of(t, w + ".quant_state.bitsandbytes__nf4") = bytes_of(R"({"quant_type": )");
            }),
            state +
                " is not valid JSON: [json.exception.parse_error.101] parse error at line 1, "
                "column 16: syntax error while parsing value - unexpected end of input; "
                "expected '[', '{', or a literal; expected the JSON of bitsandbytes' quant_state");
  EXPECT_EQ(store_error([&](Tensors& t) {
              tensor_of(t, w + ".quant_state.bitsandbytes__nf4") = bytes_of("[64]");
            }),
            state + ": expected a JSON object, found array");
  EXPECT_EQ(store_error([&](Tensors& t) {
              tensor_of(t, w + ".quant_state.bitsandbytes__nf4") = at::zeros({5000}, at::kByte);
            }),
            state + " is U8 [5000]; expected U8 [at most 4096]: the bytes of a JSON object");
  EXPECT_EQ(store_error(nullptr, [](nlohmann::json& j) { j["blocksize"] = 128; }),
            state + ": \"blocksize\" = 128 is not supported: " + nf4);
  EXPECT_EQ(store_error(nullptr, [](nlohmann::json& j) { j.erase("nested_offset"); }),
            state + ": \"nested_offset\" is missing; " + nf4);
  // FP4: its quant_state is named so (and says so).
  EXPECT_EQ(store_error(
                [&](Tensors& t) {
                  for (auto& item : t) {
                    if (absl::EndsWith(item.first, "bitsandbytes__nf4")) {
                      item.first = w + ".quant_state.bitsandbytes__fp4";
                    }
                  }
                },
                [](nlohmann::json& j) { j["quant_type"] = "fp4"; }),
            "'" + w +
                ".quant_state.bitsandbytes__fp4' in 'DIR/model.safetensors': the weight is "
                "stored in bitsandbytes' 4-bit \"fp4\" (bnb_4bit_quant_type), not NF4; " +
                nf4);
  // No double quantization: no nested_* in the JSON (nor beside the weight).
  EXPECT_EQ(store_error(
                [&](Tensors& t) {
                  tensor_of(t, w + ".absmax") = at::ones({16}, at::kFloat);
                  t.erase(std::remove_if(t.begin(), t.end(),
                                         [](const auto& item) {
                                           return absl::StrContains(item.first, ".nested_");
                                         }),
                          t.end());
                },
                [](nlohmann::json& j) {
                  for (const char* key : {"nested_blocksize", "nested_dtype", "nested_offset"}) {
                    j.erase(key);
                  }
                }),
            state +
                ": no \"nested_blocksize\": the weight is not double quantized "
                "(bnb_4bit_use_double_quant=False); " +
                nf4);
  EXPECT_EQ(store_error(nullptr,
                        [](nlohmann::json& j) {
                          j["shape"] = {32, 16};
                        }),
            state +
                ": \"shape\" = [32,16] but the model's weight is [32, 32] (out_features, "
                "in_features); is config.json the folder's own?");
  EXPECT_EQ(store_error(nullptr, [](nlohmann::json& j) { j["dtype"] = "bfloat16"; }),
            state +
                ": \"dtype\" = \"bfloat16\" but the folder's other floating tensors are Float; "
                "fsdp's decoder trains one dtype");
  EXPECT_EQ(store_error([&](Tensors& t) { tensor_of(t, w) = tensor_of(t, w).view({-1}); }),
            "'" + w +
                "' in 'DIR/model.safetensors' is U8 [512]; expected U8 [512, 1] (the 4-bit "
                "codes, two a byte, of bitsandbytes' NF4 of a [32, 32] weight)");
  EXPECT_EQ(store_error([&](Tensors& t) {
              tensor_of(t, w + ".absmax") = tensor_of(t, w + ".absmax").narrow(0, 0, 8);
            }),
            "'" + w +
                ".absmax' in 'DIR/model.safetensors' is U8 [8]; expected U8 [16] (each block's "
                "absmax, 8 bits, of bitsandbytes' NF4 of a [32, 32] weight)");
  EXPECT_EQ(store_error([&](Tensors& t) {
              t.erase(std::find_if(t.begin(), t.end(), [&](const auto& item) {
                return item.first == w + ".nested_absmax";
              }));
            }),
            "'" + w +
                ".nested_absmax' (the absmax of each 256 absmax, of bitsandbytes' NF4 of a "
                "[32, 32] weight) is missing beside " +
                state + "; " + nf4);
  EXPECT_EQ(store_error([&](Tensors& t) { tensor_of(t, w + ".quant_map") = nf4_code() * 2; }),
            "'" + w +
                ".quant_map' in 'DIR/model.safetensors' is not the NF4 code table (bitsandbytes' "
                "get_4bit_type(\"nf4\")), so the weight would dequantize to other values; " +
                nf4);
  // A 4-bit weight where the model has no LoraLinear.
  EXPECT_EQ(store_error([&](Tensors& t) {
              for (auto& item : t) {
                item.first = absl::StrReplaceAll(
                    item.first, {{"model.layers.0.self_attn.q_proj.", "model.layers.0.q_proj."}});
              }
            }),
            "DIR: 'model.layers.0.q_proj.weight' is stored in 4 bits (beside it: "
            "'model.layers.0.q_proj.weight.quant_state.bitsandbytes__nf4') but the model holds "
            "no LoraLinear of that name; is config.json the folder's own?");
}

// load_hf_weights over a 4-bit folder (its config.json's quantization_config) into a model
// that does not hold the weight in NF4 says what to call first.
TEST(Bnb4BitFolderTest, LoadingWithoutStoringSaysWhatToCall) {
  const std::string config = std::string(kTinyLlama).substr(0, std::strlen(kTinyLlama) - 1) +
                             R"(, "quantization_config": {"quant_method": "bitsandbytes",
        "load_in_4bit": true, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true}})";
  const std::string dir = write_tensors(
      bnb_4bit_tensors(read_folder(write_folder()), {"model.layers.0.self_attn.q_proj"}), config);
  FakeWorld::run(FakeWorld::create(1), [&](Communicator& comm) {
    Model model(meta_llama(), FullyShardedDataParallelOptions(
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {})));
    try {
      load_hf_weights(*model, dir);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_EQ(absl::StrReplaceAll(e.what_without_backtrace(), {{dir, "DIR"}}),
                "DIR: 'model.layers.0.self_attn.q_proj.weight' is stored in 4 bits (beside it: "
                "'model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4') but the "
                "model holds no NF4 LoraLinear of that name to read it into; call "
                "fsdp::models::store_hf_nf4_weights(model, dir) on the model before wrapping it");
    }
  });
}

// The folder written from a 4-bit folder holds its config.json without quantization_config
// (the weights are written dequantized), as transformers writes a config.
TEST(Bnb4BitFolderTest, WrittenConfigHasNoQuantizationConfig) {
  const std::string from = temp_dir(), out = temp_dir() + "/out";
  std::ofstream(from + "/config.json")
      << R"({"model_type": "llama", "quantization_config": {"load_in_4bit": true}, "dtype": "bfloat16"})";
  prepare_hf_folder(from, out);
  std::ifstream in(out + "/config.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()),
            "{\n  \"dtype\": \"bfloat16\",\n  \"model_type\": \"llama\"\n}\n");
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The names of the files in `dir`, sorted.
std::set<std::string> files_in(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

// Every file a tokenizer is saved as is copied byte for byte: transformers 5's
// chat_template.jinja, 4.4x's chat_template.json, a BPE's vocab.json and merges.txt
// (no tokenizer.json), added_tokens.json; the files the folder lacks are not created.
TEST(HfFolderFilesTest, CopiesTheTokenizerFilesItHolds) {
  const std::map<std::string, std::string> files = {
      {"config.json", R"({"model_type": "llama"})"},
      {"generation_config.json", R"({"eos_token_id": 2})"},
      {"tokenizer.json", R"({"model": {"type": "BPE"}})"},
      {"tokenizer_config.json", R"({"model_max_length": 64})"},
      {"special_tokens_map.json", R"({"eos_token": "</s>"})"},
      {"tokenizer.model", std::string("\x0a\x00\xff sentencepiece", 17)},
      {"vocab.json", R"({"a": 0, "b": 1})"},
      {"merges.txt", "#version: 0.2\na b\n"},
      {"added_tokens.json", R"({"<|im_end|>": 2})"},
      {"chat_template.jinja", "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"},
      {"chat_template.json", R"({"chat_template": "{{ messages[0]['content'] }}"})"},
  };
  const std::string from = temp_dir(), out = temp_dir() + "/out";
  for (const auto& [name, bytes] : files)
    std::ofstream(from + "/" + name, std::ios::binary) << bytes;
  std::ofstream(from + "/README.md") << "not copied";
  prepare_hf_folder(from, out);
  std::set<std::string> names;
  for (const auto& [name, bytes] : files) {
    names.insert(name);
    EXPECT_EQ(slurp(out + "/" + name), bytes) << name;
  }
  EXPECT_EQ(files_in(out), names);

  const std::string some = temp_dir(), some_out = temp_dir() + "/out";
  for (const char* name : {"config.json", "vocab.json", "merges.txt", "chat_template.jinja"}) {
    std::ofstream(some + "/" + name, std::ios::binary) << files.at(name);
  }
  prepare_hf_folder(some, some_out);
  EXPECT_EQ(files_in(some_out), (std::set<std::string>{"chat_template.jinja", "config.json",
                                                       "merges.txt", "vocab.json"}));
}

// Note [A tied head stored anyway]: a folder whose config ties the head may still hold
// lm_head.weight. Equal to the embeddings, it loads as the folder without it does, the
// same weights and logits; a head of other values (transformers then unties them) or of
// another shape is refused; a save writes no head, as before.
TEST(TiedHeadTest, StoredHeadIsLeftUnreadAndNotWritten) {
  const std::string tied_json = absl::StrReplaceAll(
      kTinyLlama, {{R"("tie_word_embeddings": false)", R"("tie_word_embeddings": true)"}});
  const DecoderConfig tied = parse_decoder_config(tied_json, "tied.json");
  const std::string plain = temp_dir(), stored = temp_dir(), differs = temp_dir(), bad = temp_dir();
  at::manual_seed(1);
  save_module_safetensors(CausalLMImpl(tied), plain);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const SafetensorsCheckpoint plain_ckpt = SafetensorsCheckpoint::open(plain);
  for (const std::string& name : plain_ckpt.names()) {
    tensors.emplace_back(name, plain_ckpt.read(name));
  }
  const at::Tensor embeddings = plain_ckpt.read("model.embed_tokens.weight");
  ASSERT_FALSE(plain_ckpt.contains("lm_head.weight"));
  tensors.emplace_back("lm_head.weight", embeddings);
  save_safetensors_file(stored + "/model.safetensors", tensors);
  tensors.back().second = embeddings.clone();
  tensors.back().second[63][31] = 5.0;  // the last element only
  save_safetensors_file(differs + "/model.safetensors", tensors);
  tensors.back().second = at::full({63, 32}, 5.0);
  save_safetensors_file(bad + "/model.safetensors", tensors);
  for (const std::string& dir : {plain, stored, differs, bad})
    std::ofstream(dir + "/config.json") << tied_json;

  const auto load = [&](const std::string& dir, std::shared_ptr<Communicator> comm) {
    Model model(std::make_shared<CausalLMImpl>(tied, at::TensorOptions().device(c10::kMeta)),
                FullyShardedDataParallelOptions(comm));
    load_hf_weights(*model, dir);
    return model;
  };
  const at::Tensor ids = at::arange(16, at::kLong).view({2, 8}) * 5 % 64;
  on_ranks([&](std::shared_ptr<Communicator> comm) {
    Model from_plain = load(plain, comm);
    Model from_stored = load(stored, comm);
    const StateDict got = full_state_dict(*from_stored);
    EXPECT_TRUE(at::equal(got["model.embed_tokens.weight"], embeddings));
    expect_equal(got, full_state_dict(*from_plain));
    {
      torch::NoGradGuard no_grad;  // forward only: the model is idle again after it
      EXPECT_TRUE(at::equal(from_stored->forward(ids), from_plain->forward(ids)));
    }
    try {
      load(differs, comm);
      ADD_FAILURE() << "no error for a head that differs from the embeddings";
    } catch (const c10::Error& e) {
      EXPECT_EQ(absl::StrReplaceAll(e.what_without_backtrace(), {{differs, "DIR"}}),
                "DIR: config.json ties the head to the embeddings (tie_word_embeddings) but the "
                "folder's 'lm_head.weight' differs from 'model.embed_tokens.weight', so "
                "transformers loads the two untied; set \"tie_word_embeddings\": false in "
                "config.json to train them untied, or remove 'lm_head.weight' to tie them");
    }
    try {
      load(bad, comm);
      ADD_FAILURE() << "no error for a head of shape [63, 32]";
    } catch (const c10::Error& e) {
      EXPECT_EQ(absl::StrReplaceAll(e.what_without_backtrace(), {{bad, "DIR"}}),
                "DIR: tensor 'lm_head.weight' has shape [63, 32] but config.json ties the head "
                "to the embeddings (tie_word_embeddings), of shape [64, 32]; expected the head "
                "in that shape or no head (is config.json the folder's own?)");
    }
    const std::string out = stored + "/out";
    save_hf_folder(*from_stored, stored, out, 5'000'000'000);
    if (comm->rank() == 0) {
      EXPECT_EQ(SafetensorsCheckpoint::open(out).names(), plain_ckpt.names());
    }
  });
}

}  // namespace
}  // namespace fsdp::models
