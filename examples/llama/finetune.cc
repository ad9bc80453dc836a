// Fine-tunes a Hugging Face decoder model folder (Llama, Mistral, Qwen2, Qwen3, Gemma 2,
// Gemma 3 text, Granite, OLMo 2, Phi-3, Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, gpt-oss in
// its bf16 layout, DeepSeek-V3 / Kimi K2 in bf16: the families of //models) with FSDP and writes
// the result back as a Hugging Face folder.
//
//   bazel run -c opt //examples/llama:finetune -- --from=HF_DIR --data=TOKENS
//       --out_dir=OUT --world_size=2 --steps=100 [--eval_data=TOKENS]   (one line)
//
// The model is fsdp::models::CausalLMImpl (models/decoder.h) built from HF_DIR/config.json,
// each decoder layer an FSDP unit, and the embeddings and the head when untied (FULL_SHARD
// by default), its weights read from HF_DIR (hf_checkpoint.h) with no process ever holding
// the whole model (see Note [No rank holds the whole model]), trained with AdamW on random
// windows of --context + 1 tokens of --data (the same windows at any world size). A token
// file is a flat little-endian array of token ids (nanoGPT / llm.c): uint16 when the
// vocabulary fits, else uint32 (--data_dtype; examples/llama/tokenize.py makes one with the
// folder's tokenizer). Before reading a weight it prints what each rank will hold and stops
// if that does not fit (Note [Checking the plan before loading]).
//
// Rank 0 prints a progress line per --log_interval steps (loss, lr, tokens/s, ETA) and
// writes OUT/metrics.csv (a row per step, flushed); every --checkpoint_interval steps the
// ranks write a sharded checkpoint (model, AdamW and step) under OUT/checkpoints, by
// default as a PyTorch Distributed Checkpoint folder (--checkpoint_format=dcp|fsdp), and
// --resume continues from the newest (either format), --resume=DIR from folder DIR. With
// --eval_data it prints `eval loss before: X` and `eval loss after: Y`: the mean next-token
// cross-entropy over the file cut into consecutive windows of --context + 1 tokens (no overlap, the
// remainder dropped). With --sample_prompts=FILE (a conversation file) it writes
// OUT/samples.jsonl: the model's greedy answers (KV-cached; examples/llama/sampling.h) to
// each example's prompt before and after training, beside the example's own answer
// (examples/llama/show_samples.py prints them as text). At the end it writes OUT/hf/ (config.json
// and the weights, in files of at most --max_shard_size) that transformers'
// AutoModelForCausalLM.from_pretrained loads; --steps=0 writes the weights it read, bit for bit.
// With --lora_rank it trains LoRA adapters only (fsdp/lora), writes them to OUT/adapter/ as PEFT
// does (PeftModel.from_pretrained loads them) and OUT/hf/ holds them merged into the base weights
// (both written one unit at a time). The mixture-of-experts families (Qwen3-MoE, Mixtral,
// OLMoE, Qwen2-MoE, gpt-oss) train on the cross-entropy plus the router's load-balancing loss, as
// transformers does with output_router_logits (--router_aux_loss_coef; Note [The router's
// load-balancing loss]). Without RANK in its environment it starts --world_size ranks
// of itself; Ctrl-C stops every rank. Flags are checked before any rank starts: a bad one is one
// line on stderr and exit status 2.
//
// The memory levers are the GPT trainer's, under the same flags (examples/trainer/lever_flags.h):
// --device (auto, cpu, cuda: rank r on cuda:LOCAL_RANK over NCCL, one rank per visible device
// unless --world_size says otherwise), --mixed_precision (auto: bf16 compute with fp32 master
// weights for a bf16 or fp16 folder and on CUDA; see Note [Master weights of a 16-bit
// folder]), --cpu_offload, --sharding_strategy (hybrid_shard with --hybrid_shard_group_size
// too), --activation_checkpointing (each decoder layer recomputes its forward in backward)
// and --grad_accumulation_steps (micro-batches, no_sync between).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "examples/llama/chat_data.h"
#include "examples/llama/sampling.h"
#include "examples/llama/token_file.h"
#include "examples/trainer/lever_flags.h"
#include "examples/trainer/run_flags.h"
#include "examples/trainer/run_support.h"
#include "examples/trainer/trainer.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/fused_adamw.h"
#include "fsdp/lora/lora.h"
#include "fsdp/state/checkpoint.h"
#include "models/config.h"
#include "models/decoder.h"
#include "models/hf_checkpoint.h"
#include "models/lora_targets.h"
#include "models/memory_plan.h"

ABSL_FLAG(std::string, from, "", "Hugging Face model folder (config.json + safetensors)");
ABSL_FLAG(std::string, data, "",
          "training data: a token file (a flat little-endian array of token ids; "
          "tokenize.py), or a conversation file (*.safetensors; prepare_chat.py) whose loss "
          "mask says which tokens count");
ABSL_FLAG(std::string, eval_data, "",
          "evaluation data (a token or a conversation file); none if empty");
ABSL_FLAG(bool, packing, true,
          "conversations: several examples to a row of --context tokens (best-fit "
          "decreasing), each attending only to itself; false: one example a row, padded");
ABSL_FLAG(std::string, long_examples, "cut",
          "conversations longer than --context: cut (their first --context tokens kept) or "
          "drop");
ABSL_FLAG(std::string, sample_prompts, "",
          "a conversation file (.safetensors; prepare_chat.py) whose prompts (each example's "
          "tokens before its first counted one) the model answers greedily before and after "
          "training, into OUT/samples.jsonl (show_samples.py prints them as text); none if "
          "empty");
ABSL_FLAG(int64_t, sample_tokens, 128, "--sample_prompts: an answer's tokens at most");
ABSL_FLAG(std::string, data_dtype, "auto",
          "uint16, uint32, or auto: uint16 when the vocabulary fits (<= 65536), else uint32");
ABSL_FLAG(double, weight_decay, 0.0, "AdamW's decoupled weight decay");
ABSL_FLAG(std::string, max_shard_size, "5GB",
          "largest safetensors file of OUT/hf (bytes, or KB/MB/GB/KiB/MiB/GiB), as "
          "save_pretrained's max_shard_size");
ABSL_FLAG(int64_t, lora_rank, 0,
          "0: full fine-tuning; R > 0: LoRA adapters of rank R on --lora_target_modules, "
          "every other weight frozen");
ABSL_FLAG(double, lora_alpha, 16, "LoRA's alpha: the update is scaled by alpha / rank");
ABSL_FLAG(double, lora_dropout, 0.0, "dropout on the LoRA adapters' input, in [0, 1)");
ABSL_FLAG(
    std::string, lora_target_modules, "",
    "comma-separated module names that get adapters (q_proj, k_proj, v_proj, o_proj, "
    "gate_proj, up_proj, down_proj; phi3: qkv_proj, o_proj, gate_up_proj, down_proj); "
    "empty: PEFT's default for the family (q_proj,v_proj, mixtral too; phi3: qkv_proj; "
    "none for qwen3_moe, qwen2_moe, olmoe, gpt_oss, deepseek_v3: name them). The MoE families' "
    "routed experts take no LoRA yet (PEFT's target_parameters)");
ABSL_FLAG(std::string, router_aux_loss_coef, "auto",
          "mixture-of-experts families: the weight of the router's load-balancing loss added "
          "to each micro-batch's training loss (transformers' output_router_logits=True); "
          "auto: the config's router_aux_loss_coef; 0: none");
ABSL_FLAG(std::string, moe_units, "layer",
          "mixture-of-experts families: the FSDP units of each decoder layer. layer: the layer "
          "is one unit (backward gathers the previous layer's experts while a layer's are "
          "still gathered: two layers' experts at once); sublayer: its attention and its "
          "feed-forward block (the experts) are two units, so backward holds about one "
          "layer's experts, for one more all-gather and reduce-scatter per layer and step. "
          "The names, checkpoints and losses are the same either way; the memory plan says "
          "what each would peak at (see Note [Sublayer units])");
ABSL_FLAG(std::string, lora_base_dtype, "auto",
          "dtype of the frozen base weights of a LoRA run: auto (the folder's own bf16 or "
          "fp16 under --mixed_precision=bf16, else the training dtype) or float32 (an fp32 "
          "copy, twice the bytes, the same results); see Note [The frozen base of a LoRA run]");
ABSL_FLAG(std::string, quantize, "none",
          "none, or nf4: QLoRA, the decoder layers' linear projections (q/k/v/o, gate/up/down "
          "and fused variants) held in NF4 as bitsandbytes stores them, quantized as the "
          "folder is read; needs --lora_rank. A bitsandbytes 4-bit folder is read as it is "
          "stored, with or without it (see Note [QLoRA: an NF4 base])");
ABSL_FLAG(bool, memory_check, true,
          "stop before reading any weight when the memory plan exceeds what a rank may use "
          "(its cgroup's limit or the machine's available memory; see --max_memory_per_rank)");
ABSL_FLAG(std::string, max_memory_per_rank, "",
          "the most one rank may hold (bytes, or KB/MB/GB/KiB/MiB/GiB); empty: its share of "
          "its cgroup's limit and of the machine's available memory");
namespace fsdp::models {
namespace {

using examples::global_mean;
using examples::LeverFlags;
using examples::next_token_loss;
using Model = FullyShardedDataParallel<CausalLMImpl>;

// Bytes per token id of a token file under --data_dtype for `vocab_size`.
int64_t token_bytes(const std::string& data_dtype, int64_t vocab_size) {
  if (data_dtype == "uint16") return 2;
  if (data_dtype == "uint32") return 4;
  return vocab_size <= 65536 ? 2 : 4;
}

// Training or evaluation data: a token file (windows of --context + 1 tokens) or a
// conversation file (rows of --context tokens; see Note [Conversations]).
struct Data {
  std::optional<TokenFile> tokens;  // a token file
  ChatRows rows;                    // a conversation file's rows
  bool chat() const { return !tokens.has_value(); }
};

bool is_chat_file(const std::string& path) { return absl::EndsWith(path, ".safetensors"); }

ChatPacking packing_flag() {
  return absl::GetFlag(FLAGS_packing) ? ChatPacking::kPacked : ChatPacking::kPerRow;
}

LongExamples long_examples_flag() {
  return absl::GetFlag(FLAGS_long_examples) == "drop" ? LongExamples::kDrop : LongExamples::kCut;
}

// A token file's ids are all checked once a process, by flag_error (`check` kEvery) before
// any rank runs; the run then checks the windows it reads (kAsRead).
Data read_data(const std::string& path, const DecoderConfig& config,
               TokenFile::IdCheck check = TokenFile::IdCheck::kAsRead) {
  Data data;
  if (is_chat_file(path)) {
    data.rows = pack_chat_rows(read_chat_file(path, config.vocab_size),
                               absl::GetFlag(FLAGS_context), packing_flag(), long_examples_flag());
  } else {
    const std::string dtype = absl::GetFlag(FLAGS_data_dtype);
    data.tokens.emplace(path, token_bytes(dtype, config.vocab_size), config.vocab_size, check);
    TORCH_CHECK(dtype != "auto" || !data.tokens->looks_like_4_byte_ids(),
                "every second 16-bit id is 0, as when a file of uint32 ids (tokenize.py "
                "--dtype=uint32) is read as uint16; pass --data_dtype=uint32, or "
                "--data_dtype=uint16 if it does hold 16-bit ids");
  }
  return data;
}

// "" if --`flag`=`path` is a usable token file (at least `min_tokens` tokens, `why`) or
// conversation file (rows left in the context), else why not. Reads the whole file once.
std::string data_file_error(const char* flag, const std::string& path, const DecoderConfig& config,
                            int64_t min_tokens, const char* why) {
  try {
    const Data data = read_data(path, config, TokenFile::IdCheck::kEvery);
    if (!data.chat() && data.tokens->size() < min_tokens) {
      return absl::StrCat("--", flag, "=", path, ": ", data.tokens->size(), " tokens, fewer than ",
                          min_tokens, " (", why, ")");
    }
  } catch (const c10::Error& e) {
    return absl::StrCat("--", flag, "=", path, ": ", e.msg());
  }
  return "";
}

// The prompts of --sample_prompts (none without it).
std::vector<SamplePrompt> read_sample_prompts(const DecoderConfig& config) {
  const std::string path = absl::GetFlag(FLAGS_sample_prompts);
  if (path.empty()) return {};
  return sample_prompts(read_chat_file(path, config.vocab_size));
}

// "" if --sample_prompts and --sample_tokens are usable, else why not.
std::string sample_prompts_error(const DecoderConfig& config) {
  const std::string path = absl::GetFlag(FLAGS_sample_prompts);
  if (path.empty()) return "";
  if (absl::GetFlag(FLAGS_sample_tokens) < 1) {
    return absl::StrCat("--sample_tokens=", absl::GetFlag(FLAGS_sample_tokens),
                        ": expected 1 token or more");
  }
  if (!is_chat_file(path)) {
    return absl::StrCat("--sample_prompts=", path,
                        ": expected a conversation file (.safetensors; prepare_chat.py)");
  }
  std::vector<SamplePrompt> prompts;
  try {
    prompts = read_sample_prompts(config);
    eos_token_ids(absl::GetFlag(FLAGS_from));
  } catch (const c10::Error& e) {
    return absl::StrCat("--sample_prompts=", path, ": ", e.msg());
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (static_cast<int64_t>(prompts[i].prompt.size()) >= config.max_position_embeddings) {
      return absl::StrFormat(
          "--sample_prompts=%s: prompt %d has %d tokens; the model answers prompts of at most "
          "%d (max_position_embeddings - 1)",
          path, i, prompts[i].prompt.size(), config.max_position_embeddings - 1);
    }
  }
  return "";
}

// The greedy answers to `prompts` (--sample_tokens at most each), every rank running
// each prompt; see examples/llama/sampling.h.
std::vector<std::vector<int64_t>> sample_answers(Model& model,
                                                 const std::vector<SamplePrompt>& prompts,
                                                 Communicator& comm, c10::Device device) {
  const GreedyOptions options{absl::GetFlag(FLAGS_sample_tokens),
                              eos_token_ids(absl::GetFlag(FLAGS_from)), device};
  const auto forward = [&](const at::Tensor& ids) { return model->forward(ids); };
  std::vector<std::vector<int64_t>> answers;
  for (const SamplePrompt& prompt : prompts) {
    answers.push_back(greedy_answer(forward, *model->module(), prompt.prompt, options, &comm));
  }
  return answers;
}

// The module names of --lora_target_modules, or the family's default.
std::vector<std::string> lora_targets(const DecoderConfig& config) {
  const std::string flag = absl::GetFlag(FLAGS_lora_target_modules);
  if (flag.empty()) return default_lora_targets(config);
  return absl::StrSplit(flag, ',', absl::SkipWhitespace());
}

// Note [The router's load-balancing loss]
// A mixture-of-experts family trains, as transformers' *MoeForCausalLM with
// output_router_logits=True does, on cross-entropy + router_aux_loss_coef x aux, aux being
// load_balancing_loss_func over every sparse layer's router logits of the forward
// (CausalLMImpl::aux_loss); the coefficient is the config's (--router_aux_loss_coef=auto,
// even where config.json leaves output_router_logits false: transformers' Trainer
// recipes for these models turn it on) or the flag's, 0 turning it off. The tokens it
// counts are those transformers counts for the same batch: a token file's windows have no
// padding and no attention mask, so every token; conversation rows count their examples'
// tokens and not the padding, as transformers does with the attention mask of padded
// rows (--packing=false: DataCollatorWithPadding) and as it must with packed rows
// (DataCollatorWithFlattening leaves no padding at all; its rows carry no mask). aux is
// computed per forward, as transformers computes it per forward: each micro-batch of
// each rank adds coef x its own aux, and the step's gradient is the mean of those terms
// over the micro-batches and ranks (accumulate_gradients' 1 / M, FSDP's average over W),
// beside the global batch's cross-entropy. At W = 1 and one micro-batch the step's loss
// is therefore transformers' model(..., output_router_logits=True).loss on the same batch
// (families_test checks it per family). transformers' Trainer differs at M > 1: it
// normalises the cross-entropy by the whole step's token count but leaves each forward's
// aux term unscaled, so its aux weighs M times coef; here coef means the same at any
// --grad_accumulation_steps and world size. The progress lines show the mean aux; the
// training loss they and metrics.csv report includes coef x aux, the eval loss does not
// (cross-entropy only, the figure transformers' evaluation compares).

// The coefficient of --router_aux_loss_coef for `config` (0 for a dense family).
double router_aux_coef(const DecoderConfig& config) {
  if (!config.is_moe()) return 0;
  const std::string flag = absl::GetFlag(FLAGS_router_aux_loss_coef);
  double coef = 0;
  if (flag == "auto") return config.router_aux_loss_coef;
  TORCH_CHECK(absl::SimpleAtod(flag, &coef), "--router_aux_loss_coef=", flag);
  return coef;
}

// "" if --router_aux_loss_coef is usable for `config`, else why not.
std::string router_aux_flag_error(const DecoderConfig& config) {
  const std::string flag = absl::GetFlag(FLAGS_router_aux_loss_coef);
  if (flag == "auto") return "";
  double coef = 0;
  if (!absl::SimpleAtod(flag, &coef) || !std::isfinite(coef) || coef < 0) {
    return absl::StrCat("--router_aux_loss_coef=", flag,
                        ": expected auto (the config's router_aux_loss_coef) or a number >= 0 "
                        "(0: no load-balancing loss)");
  }
  if (!config.is_moe() && coef != 0) {
    return absl::StrCat("--router_aux_loss_coef=", flag, ": a ", config.model_type,
                        " decoder has no router; the load-balancing loss is for the "
                        "mixture-of-experts families (qwen3_moe, mixtral, olmoe, qwen2_moe, "
                        "gpt_oss)");
  }
  if (config.router_sigmoid_groups && coef != 0) {
    return absl::StrCat("--router_aux_loss_coef=", flag, ": a ", config.model_type,
                        " decoder has no load-balancing loss (transformers computes none; "
                        "e_score_correction_bias balances its routing); give 0 or auto");
  }
  return "";
}

// Note [Sublayer units]
// --moe_units=sublayer builds the model with models::DecoderUnits::kSublayer: each decoder
// layer's self_attn and mlp are FSDP units of their own, siblings in forward order, and the
// layer's norms join the root (decoder.h). Backward prefetch (BACKWARD_PRE) gathers "the
// latest unit in forward order whose backward has not started" (Note [Prefetching] in
// fsdp/core/internal/runtime.cc): while layer i's mlp runs backward that is its
// self_attn (small), and while the self_attn runs, layer i - 1's mlp, after layer i's was
// resharded. So about one layer's experts (and their unsharded gradients) are held at the
// peak instead of two layers' and a gradient in flight. A unit nested inside its layer
// would not do: its pre-backward would prefetch the previous layer's experts while its own
// are gathered. The memory plan is made both ways and printed in one line; the losses are
// the same bit for bit (models:decoder_test). Dense families are refused: their layers
// have no experts to keep apart.

// The fine-tune's own flags, checked before a rank starts or a file is touched (the run
// flags were): "" or one line.
std::string flag_error() {
  const std::string from = absl::GetFlag(FLAGS_from);
  if (from.empty()) return "--from: expected a Hugging Face model folder (config.json)";
  DecoderConfig config;
  try {
    config = load_decoder_config(from + "/config.json");
    hf_weights_dtype(from);  // one floating dtype (--mixed_precision=auto reads it)
    parse_decoder_units(absl::GetFlag(FLAGS_moe_units), config);
    parse_shard_size(absl::GetFlag(FLAGS_max_shard_size));
    if (!absl::GetFlag(FLAGS_max_memory_per_rank).empty()) {
      parse_shard_size(absl::GetFlag(FLAGS_max_memory_per_rank), "--max_memory_per_rank");
    }
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  const std::string dtype = absl::GetFlag(FLAGS_data_dtype);
  if (dtype != "auto" && dtype != "uint16" && dtype != "uint32") {
    return absl::StrCat("--data_dtype=", dtype, ": expected auto, uint16 or uint32");
  }
  if (dtype == "uint16" && config.vocab_size > 65536) {
    return absl::StrCat("--data_dtype=uint16: the vocabulary of ", config.vocab_size,
                        " tokens does not fit; use uint32");
  }
  const int64_t context = absl::GetFlag(FLAGS_context);
  if (context > config.max_position_embeddings) {
    return absl::StrCat("--context=", context, ": expected 1 to max_position_embeddings = ",
                        config.max_position_embeddings);
  }
  const std::string long_examples = absl::GetFlag(FLAGS_long_examples);
  if (long_examples != "cut" && long_examples != "drop") {
    return absl::StrCat("--long_examples=", long_examples, ": expected cut or drop");
  }
  if (absl::GetFlag(FLAGS_data).empty()) {
    return "--data: expected a token file or a conversation file (.safetensors)";
  }
  std::string error =
      data_file_error("data", absl::GetFlag(FLAGS_data), config, context + 2,
                      "--context + 2: a window of --context + 1 tokens at a random start");
  if (error.empty() && !absl::GetFlag(FLAGS_eval_data).empty()) {
    error = data_file_error("eval_data", absl::GetFlag(FLAGS_eval_data), config, context + 1,
                            "one window of --context + 1");
  }
  if (!error.empty()) return error;
  if (error = sample_prompts_error(config); !error.empty()) return error;
  if (error = router_aux_flag_error(config); !error.empty()) return error;
  if (absl::GetFlag(FLAGS_lora_rank) < 0) {
    return "--lora_rank: expected 0 (full fine-tuning) or a rank >= 1";
  }
  const double dropout = absl::GetFlag(FLAGS_lora_dropout);
  if (!(dropout >= 0 && dropout < 1)) {
    return absl::StrCat("--lora_dropout=", dropout, ": expected a value in [0, 1)");
  }
  if (!(absl::GetFlag(FLAGS_lora_alpha) > 0)) return "--lora_alpha: expected a positive number";
  if (absl::GetFlag(FLAGS_lora_rank) == 0 && !absl::GetFlag(FLAGS_lora_target_modules).empty()) {
    return absl::StrCat("--lora_target_modules=", absl::GetFlag(FLAGS_lora_target_modules),
                        ": adapters need --lora_rank=R (R >= 1); without it every weight is "
                        "fine-tuned");
  }
  const double weight_decay = absl::GetFlag(FLAGS_weight_decay);
  if (!(std::isfinite(weight_decay) && weight_decay >= 0)) {
    return absl::StrCat("--weight_decay=", weight_decay, ": expected a finite value >= 0");
  }
  const std::string base_dtype = absl::GetFlag(FLAGS_lora_base_dtype);
  if (base_dtype != "auto" && base_dtype != "float32") {
    return absl::StrCat("--lora_base_dtype=", base_dtype, ": expected auto or float32");
  }
  const std::string quantize = absl::GetFlag(FLAGS_quantize);
  if (quantize != "none" && quantize != "nf4") {
    return absl::StrCat("--quantize=", quantize, ": expected none or nf4");
  }
  if (config.load_in_4bit && absl::GetFlag(FLAGS_lora_rank) == 0) {
    return absl::StrCat("--from=", from,
                        " holds 4-bit weights (its quantization_config: bitsandbytes' NF4), "
                        "which cannot be trained: fine-tune it with LoRA (--lora_rank=R)");
  }
  if (quantize == "nf4" && absl::GetFlag(FLAGS_lora_rank) == 0) {
    return "--quantize=nf4 freezes the base weights in 4 bits (QLoRA): give --lora_rank too";
  }
  if (absl::GetFlag(FLAGS_lora_rank) > 0) {
    if (std::string error = lora_targets_error(config, lora_targets(config)); !error.empty()) {
      return error;
    }
  }
  return "";
}

// The LoRA adapters of --lora_rank (PEFT's LoraConfig).
lora::LoraConfig lora_config(const DecoderConfig& model) {
  const std::vector<std::string> targets = lora_targets(model);
  lora::LoraConfig config;
  config.r(absl::GetFlag(FLAGS_lora_rank))
      .lora_alpha(absl::GetFlag(FLAGS_lora_alpha))
      .lora_dropout(absl::GetFlag(FLAGS_lora_dropout))
      .target_modules(targets)
      .base_model_name_or_path(absl::GetFlag(FLAGS_from))
      // pure_bf16 keeps everything in bf16, the adapters too.
      .autocast_adapter_dtype(absl::GetFlag(FLAGS_mixed_precision) != "pure_bf16");
  return config;
}

// Note [The frozen base of a LoRA run]
// A LoRA run over a bf16 (or fp16) folder under --mixed_precision=bf16 builds the frozen
// base in the folder's dtype and the adapters in fp32 (lora::LoraConfig::
// autocast_adapter_dtype, PEFT's default): each unit then holds an fp32 flat parameter for
// its adapters and a bf16 one for its frozen weights (Note [Flat parameters of several
// dtypes] in fsdp/core/flat_param.cc), so every rank's share of the base costs 2 bytes a
// weight, as the folder does, instead of the 4 of an fp32 copy. The results are those of the
// fp32 copy bit for bit: the fp32 copy held the bf16 values exactly and was cast back to
// bf16 on every all-gather, which the bf16 base now skips; the adapters, their gradients and
// AdamW's state stay fp32, the gradients reduced in fp32. --lora_base_dtype=float32 keeps the
// fp32 copy. The merged OUT/hf rounds base + update to the folder's dtype once, either way.
// The dtype the model's weights are built in: `dtype`, except the frozen base of a LoRA
// run (see the Note above).
at::ScalarType base_dtype_of(at::ScalarType dtype, at::ScalarType folder_dtype,
                             const std::string& mixed_precision) {
  if (absl::GetFlag(FLAGS_lora_rank) == 0 || absl::GetFlag(FLAGS_lora_base_dtype) != "auto") {
    return dtype;
  }
  return lora_base_dtype(dtype, folder_dtype, mixed_precision == "bf16");
}

// Note [No rank holds the whole model]
// The decoder is built on the meta device in the training dtype (shapes, no memory), the
// LoRA adapters are added to it from --seed (apply_lora: PEFT's initialisation, on the
// CPU: they are small) before any base weight is read, FSDP then allocates each rank's
// shards only, and each rank reads only its shards' bytes of the folder
// (load_hf_weights). Saving gathers one unit at a time (save_hf_folder, or
// save_lora_hf_folders merging each unit's adapters on the way). So a rank's peak is its
// shards, gradients and AdamW state plus one gathered unit, never the whole model: a
// model larger than one process fits at a large enough world size. The values are those
// the trainer had when it built the model whole on every rank: the same adapters from the
// same seed (the same draws), the same bytes from the folder.

// Note [Checking the plan before loading]
// Before any weight is read, the trainer plans what each rank will hold
// (models/memory_plan.h: shards, gradients and AdamW state, gathered units, the
// activations of a micro-batch, saving, and the process as it stands) from the meta-built
// model, and rank 0 prints it. When the plan exceeds what a rank may use (Note [The memory
// a rank may use] in examples/trainer/run_support.h, or --max_memory_per_rank), every rank
// stops there with one message naming the sum, the budget and the flags that would each
// make it fit (planned again with that flag), instead of meeting the kernel's OOM killer
// hours into a load; --memory_check=false runs anyway. At the end rank 0 prints each
// rank's peak resident set next to the plan.

// The plan of one rank for the model `net` (meta-built, adapters applied) under the flags.
FinetunePlan plan_for(const DecoderConfig& config, CausalLMImpl& net,
                      const FullyShardedDataParallelOptions& options, const LeverFlags& levers,
                      at::ScalarType dtype, at::ScalarType folder_dtype) {
  const int world = options.communicator()->world_size();
  FinetunePlanOptions plan;
  plan.world_size(world)
      .sharding_strategy(options.sharding_strategy())
      .hybrid_shard_group_size(options.hybrid_shard_group_size())
      .dtype(dtype)
      .param_dtype(options.mixed_precision() ? options.mixed_precision()->param_dtype()
                                             : c10::nullopt)
      .micro_batch(
          micro_batch_of(absl::GetFlag(FLAGS_batch_size), world, levers.grad_accumulation_steps))
      .context(absl::GetFlag(FLAGS_context))
      .activation_checkpointing(levers.activation_checkpointing)
      .packed_rows(is_chat_file(absl::GetFlag(FLAGS_data)))
      .router_aux_loss(router_aux_coef(config) > 0)
      .decoder_units(net.model->units)
      .cpu_offload(levers.cpu_offload)
      .backend(plan_backend_of(options.communicator()->backend_name()))
      .runtime_bytes(std::max<int64_t>(examples::resident_bytes(), 0))
      .save_dtype(folder_dtype);
  if (absl::GetFlag(FLAGS_lora_rank) > 0) {
    plan.trained(TrainedWeights{absl::GetFlag(FLAGS_lora_rank), lora_targets(config)});
  }
  return plan_finetune(config, plan_units(net), plan);
}

// The flags that would each make `plan` fit in `budget` bytes, planned again with each
// ("--activation_checkpointing (peak 3.1 GiB)"); empty if none does alone.
std::vector<std::string> flags_that_fit(const DecoderConfig& config, CausalLMImpl& net,
                                        const FinetunePlan& plan, int64_t grad_accumulation_steps,
                                        int64_t budget) {
  const std::vector<PlanUnit> units = plan_units(net);
  std::vector<std::string> fits;
  const auto consider = [&](const std::string& flag, FinetunePlanOptions options) {
    const FinetunePlan other = plan_finetune(config, units, options);
    if (other.peak_bytes <= budget) {
      fits.push_back(absl::StrCat(flag, " (peak ", format_bytes(other.peak_bytes), ")"));
    }
  };
  FinetunePlanOptions options = plan.options;
  if (!options.activation_checkpointing()) {
    consider("--activation_checkpointing",
             FinetunePlanOptions(options).activation_checkpointing(true));
  }
  if (options.micro_batch() > 1) {
    consider(absl::StrCat("--grad_accumulation_steps=",
                          absl::GetFlag(FLAGS_batch_size) / options.world_size()),
             FinetunePlanOptions(options).micro_batch(1));
  }
  if (options.dtype() != at::kBFloat16) {
    consider("--mixed_precision=pure_bf16",
             FinetunePlanOptions(options).dtype(at::kBFloat16).param_dtype(c10::nullopt));
  }
  if (config.is_moe() && options.decoder_units() == DecoderUnits::kLayer) {
    const FinetunePlan split =
        plan_finetune(config, plan_units(net, DecoderUnits::kSublayer),
                      FinetunePlanOptions(options).decoder_units(DecoderUnits::kSublayer));
    if (split.peak_bytes <= budget) {
      fits.push_back(
          absl::StrCat("--moe_units=sublayer (peak ", format_bytes(split.peak_bytes), ")"));
    }
  }
  // More ranks (on more hosts): the smallest world size that fits, if any does.
  FinetunePlan wider;
  if (const int64_t world = smallest_world_size(
          config, units, options, absl::GetFlag(FLAGS_batch_size), grad_accumulation_steps, budget,
          options.world_size() + 1, 4096, &wider)) {
    fits.push_back(absl::StrCat("--world_size=", world, " (more hosts) (peak ",
                                format_bytes(wider.peak_bytes), ")"));
  }
  return fits;
}

// Prints the plan (rank 0) and stops every rank when it does not fit: see Note [The memory
// plan]. Collective.
void check_memory_plan(const FinetunePlan& plan, const DecoderConfig& config, CausalLMImpl& net,
                       int64_t grad_accumulation_steps, Communicator& comm, c10::Device device) {
  if (device.is_cuda()) {
    // The plan's tensors sit on the GPU and its activations are the CPU kernels'; the host's
    // budget says nothing about them, so no check is made (docs/GPU.md).
    if (comm.rank() == 0) {
      std::cout << "memory plan: " << plan.summary()
                << " (on CUDA: tensors per GPU, activations as the CPU's kernels hold them; "
                   "not checked)\n";
    }
    return;
  }
  examples::MemoryBudget budget = examples::rank_memory_budget(comm, device);
  const std::string flag = absl::GetFlag(FLAGS_max_memory_per_rank);
  if (!flag.empty()) {
    budget.bytes = parse_shard_size(flag, "--max_memory_per_rank");
    budget.why = "--max_memory_per_rank";
  }
  if (comm.rank() == 0) {
    std::cout << "memory plan: " << plan.summary() << "\n";
    if (config.is_moe()) {  // planned the other way too (Note [Sublayer units])
      const DecoderUnits other = plan.options.decoder_units() == DecoderUnits::kLayer
                                     ? DecoderUnits::kSublayer
                                     : DecoderUnits::kLayer;
      const FinetunePlan other_plan = plan_finetune(
          config, plan_units(net, other), FinetunePlanOptions(plan.options).decoder_units(other));
      std::cout << experts_gathered_line(config, plan, other_plan) << "\n";
    }
  }
  if (!absl::GetFlag(FLAGS_memory_check) || plan.peak_bytes <= budget.bytes) return;
  const std::vector<std::string> fits =
      flags_that_fit(config, net, plan, grad_accumulation_steps, budget.bytes);
  TORCH_CHECK(false, "the memory plan needs ", format_bytes(plan.peak_bytes),
              " per rank, more than the ", format_bytes(budget.bytes), " rank ", comm.rank(),
              " may use (", budget.why, "); ",
              fits.empty() ? std::string("no single flag makes it fit: combine levers or add ranks")
                           : absl::StrCat("each of these would fit: ", absl::StrJoin(fits, ", ")),
              "; --memory_check=false runs anyway. Nothing was read.");
}

// Note [QLoRA: an NF4 base]
// --quantize=nf4 holds the linear projections of every decoder layer
// (models::store_projections_nf4: not the routers, routed experts, embeddings, norms or
// head, as QLoRA leaves them) in NF4 with double quantization, the layout bitsandbytes'
// Linear4bit stores (lora::LoraLinearImpl::store_weight_nf4). They
// are quantized as the folder is read (Note [NF4 base weights in an HF folder] in
// models/hf_checkpoint.cc): bit for bit bitsandbytes' quantize_4bit of the same weight.
// Each layer's unit then holds its adapters (fp32), its other frozen weights (the folder's
// dtype under bf16 mixed precision) and the 4-bit bytes, each its own flat parameter; the
// bytes are gathered as they are and dequantized in the compute dtype right before each
// product, and again in backward (fsdp/core/stored_weight.h). OUT/adapter is PEFT's adapter
// over the same base folder; OUT/hf holds base (dequantized) + update in the folder's dtype.
// A bitsandbytes 4-bit folder (config.json's quantization_config) is read as it is stored:
// exactly the projections it holds in NF4 are held in NF4 (models::store_hf_nf4_weights), with
// the folder's bytes; the others stay in the folder's dtype. --quantize=nf4 changes nothing
// there (the folder is quantized already), and without --lora_rank the run is refused (4-bit
// weights cannot be trained). OUT/hf is then written in the dtype the weights dequantize to,
// without the quantization_config.

// The model of --from, sharded (see Note [No rank holds the whole model]), its parameters
// in `dtype` (Note [Master weights of a 16-bit folder]), each decoder layer recomputing its
// forward in backward when `checkpoint_activations`, wrapped with `options`, after its
// memory plan (returned in `plan`) was checked (Note [Checking the plan before loading]); `numel`
// and `trainable` count its parameters (adapters included).
Model load_model(const DecoderConfig& config, const FullyShardedDataParallelOptions& options,
                 const LeverFlags& levers, at::ScalarType dtype, at::ScalarType folder_dtype,
                 c10::Device device, int64_t* numel, int64_t* trainable, FinetunePlan* plan) {
  const std::string from = absl::GetFlag(FLAGS_from);
  // See Note [The frozen base of a LoRA run].
  const at::ScalarType base = base_dtype_of(dtype, folder_dtype, levers.mixed_precision);
  auto net =
      std::make_shared<CausalLMImpl>(config, at::TensorOptions().device(c10::kMeta).dtype(base),
                                     parse_decoder_units(absl::GetFlag(FLAGS_moe_units), config));
  for (DecoderLayer& layer : net->model->decoder_layers) {
    layer->checkpoint_activations = levers.activation_checkpointing;
  }
  if (absl::GetFlag(FLAGS_lora_rank) > 0) {
    at::manual_seed(absl::GetFlag(FLAGS_seed));  // every rank draws the same adapters
    const std::vector<std::string> adapted = lora::apply_lora(*net, lora_config(config));
    if (options.communicator()->rank() == 0) {
      std::cout << "LoRA: adapters on " << adapted.size() << " modules\n";
    }
  }
  *numel = *trainable = 0;  // before NF4 packs two weights in a byte
  for (const auto& p : net->parameters()) {
    *numel += p.numel();
    if (p.requires_grad()) *trainable += p.numel();
  }
  if (config.load_in_4bit) {
    const std::vector<std::string> stored = store_hf_nf4_weights(*net, from);
    if (options.communicator()->rank() == 0) {
      std::cout << "QLoRA: " << stored.size()
                << " projections in NF4 as the folder stores them (bitsandbytes 4-bit)\n";
    }
  } else if (absl::GetFlag(FLAGS_quantize) == "nf4") {
    const int64_t stored = store_projections_nf4(*net);
    if (options.communicator()->rank() == 0) {
      std::cout << "QLoRA: " << stored << " projections in NF4\n";
    }
  }
  *plan = plan_for(config, *net, options, levers, dtype, folder_dtype);
  check_memory_plan(*plan, config, *net, levers.grad_accumulation_steps, *options.communicator(),
                    device);
  Model model(net, options);  // allocates this rank's shards only
  load_hf_weights(*model, from);
  return model;
}

// OUT/hf (and OUT/adapter with --lora_rank), one unit gathered at a time. Collective.
void save_model(Model& model, const DecoderConfig& config) {
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  const int64_t shard_size = parse_shard_size(absl::GetFlag(FLAGS_max_shard_size));
  if (absl::GetFlag(FLAGS_lora_rank) > 0) {
    save_lora_hf_folders(*model, lora_config(config), absl::GetFlag(FLAGS_from), dir + "/hf",
                         dir + "/adapter", shard_size);
  } else {
    save_hf_folder(*model, absl::GetFlag(FLAGS_from), dir + "/hf", shard_size);
  }
}

// This rank's share of global batch `index`: random windows of --context + 1 tokens, the
// same whatever the world size.
std::pair<at::Tensor, at::Tensor> batch(const TokenFile& tokens, int64_t index, Communicator& comm,
                                        c10::Device device) {
  const int64_t global = absl::GetFlag(FLAGS_batch_size);
  const int64_t context = absl::GetFlag(FLAGS_context);
  at::manual_seed(absl::GetFlag(FLAGS_seed) * 1000003 + index);
  const at::Tensor starts = at::randint(tokens.size() - context - 1, {global}, at::kLong);
  const int64_t local = global / comm.world_size();
  auto [x, y] = tokens.windows(starts.narrow(0, comm.rank() * local, local), context);
  return {x.to(device), y.to(device)};
}

// What a data file holds, for the progress lines.
std::string data_words(const Data& data) {
  if (!data.chat()) return absl::StrFormat("%d tokens", data.tokens->size());
  return absl::StrFormat(
      "%d examples in %d rows of %d tokens (%s, %.1f%% padding), %d counted targets%s",
      data.rows.examples, data.rows.rows(), absl::GetFlag(FLAGS_context),
      absl::GetFlag(FLAGS_packing) ? "packed best-fit decreasing" : "one example a row",
      100 * data.rows.padding(), data.rows.counted,
      data.rows.cut + data.rows.dropped > 0
          ? absl::StrFormat("; %d cut to the context, %d left out", data.rows.cut,
                            data.rows.dropped)
          : std::string());
}

// The summed next-token cross-entropy (fp32 scalar) of `rows` over the targets that count
// (-100: none), packed rows each attending to their own examples.
at::Tensor summed_loss(Model& model, const ChatBatch& rows) {
  std::optional<PackedRowsScope> packed;
  if (rows.segments.defined()) packed.emplace(*model->module(), rows.positions, rows.segments);
  const at::Tensor logits = model->forward(rows.inputs);
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(at::kFloat), rows.targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
}

// The evaluation units of `data`: a token file's consecutive windows of context + 1 (the
// remainder dropped), or a conversation file's rows in order. Units [first, first + count).
int64_t eval_units(const Data& data) {
  return data.chat() ? data.rows.rows() : data.tokens->size() / (absl::GetFlag(FLAGS_context) + 1);
}
ChatBatch eval_rows(const Data& data, int64_t first, int64_t count) {
  if (data.chat()) return chat_rows(data.rows, first, count);
  const int64_t context = absl::GetFlag(FLAGS_context);
  auto [x, y] =
      data.tokens->windows(at::arange(first, first + count, at::kLong) * (context + 1), context);
  return {x, y, at::Tensor(), at::Tensor()};
}

// The mean next-token cross-entropy over every target of `data` that counts (each
// once), the quantity training reports. Units go to the ranks in rounds of --batch_size;
// a rank with none left in the last round runs unit 0 and counts nothing, so every rank
// runs the same units.
double eval_loss(Model& model, const Data& data, Communicator& comm) {
  torch::NoGradGuard no_grad;
  CausalLMImpl& net = *model->module();
  const bool training = net.is_training();
  net.eval();  // no dropout (LoRA's), as PEFT's model.eval() and transformers' evaluation
  const c10::Device device = model->device_handle().device();
  const int64_t units = eval_units(data);
  const int64_t local = absl::GetFlag(FLAGS_batch_size) / comm.world_size();
  const int64_t per_round = local * comm.world_size();
  // Loss sum, targets; on the model's device, where the collective runs.
  at::Tensor sums = at::zeros({2}, at::dtype(at::kDouble).device(device));
  for (int64_t round = 0; round * per_round < units; ++round) {
    const int64_t first = std::min(units, round * per_round + comm.rank() * local);
    const int64_t count = std::min(units, first + local) - first;
    const ChatBatch rows = eval_rows(data, count > 0 ? first : 0, count > 0 ? count : 1).to(device);
    const at::Tensor sum = summed_loss(model, rows);
    if (count == 0) continue;
    sums[0] += sum.to(at::kDouble);
    sums[1] += (rows.targets != -100).sum().to(at::kDouble);
  }
  comm.all_reduce(sums, ReduceOp::kSum);
  net.train(training);
  return sums[0].item<double>() / sums[1].item<double>();
}

// Note [Conversations]
// A conversation file (prepare_chat.py's; examples/llama/chat_data.h) trains on the
// tokens its loss mask counts (the assistant's, or the completion's) and on nothing else.
// Its examples are packed into rows of --context tokens (--packing: best-fit decreasing;
// else one example a row, padded), position ids restarting and attention staying inside
// each example (models::PackedRowsScope); an example longer than the context is cut or
// left out (--long_examples). Step s takes rows s x B ... s x B + B - 1 of an endless
// order of the rows, epoch after epoch reshuffled from --seed: the same rows at any world
// size. The loss is the mean over the counted targets of the whole global batch, at any
// world size and --grad_accumulation_steps, not a mean of per-micro-batch means (the
// transformers gradient-accumulation bug of 2024): every rank first learns the global
// count N (one all-reduce), then each micro-batch's loss is its summed cross-entropy
// x W x M / N, which FSDP's gradient average over the W ranks and accumulate_gradients'
// 1 / M make exactly the gradient of (sum over the global batch) / N.

// A micro-batch's loss plus the router's term over its tokens (`token_mask`: undefined, or
// 1 where a token counts).
using AuxTerm = std::function<at::Tensor(const at::Tensor& loss, const at::Tensor& token_mask)>;

// This rank's micro-batch losses for conversation step `step`: see Note [Conversations].
// `with_aux` adds the router's term to a micro-batch's loss (Note [The router's
// load-balancing loss]), given the micro-batch's token mask.
at::Tensor chat_step(Model& model, const ChatRows& rows, int64_t step, int64_t micro_batches,
                     Communicator& comm, c10::Device device, const AuxTerm& with_aux) {
  const int64_t global = absl::GetFlag(FLAGS_batch_size);
  const int64_t local = global / comm.world_size();
  const ChatBatch mine = chat_training_rows(rows, step * global + comm.rank() * local, local,
                                            absl::GetFlag(FLAGS_seed))
                             .to(device);
  at::Tensor counted = (mine.targets != -100).sum().to(at::kDouble).reshape({1});
  comm.all_reduce(counted, ReduceOp::kSum);
  const double scale =
      double(comm.world_size() * micro_batches) / std::max(1.0, counted.item<double>());
  const int64_t micro = local / micro_batches;
  return examples::accumulate_gradients(*model, micro_batches, [&](int64_t k) {
    const ChatBatch micro_rows = mine.narrow(k * micro, micro);
    return with_aux(summed_loss(model, micro_rows) * scale, micro_rows.segments >= 0);
  });
}

// Note [Master weights of a 16-bit folder]
// A bf16 (or fp16) folder trains by default as PyTorch users train it with FSDP's
// MixedPrecision: the model is built in fp32, the folder's values read into it exactly
// (cast_floating: every bf16 value is an fp32 value), and the sharded flat parameters, their
// gradients and AdamW's state stay fp32 (the master weights), while each unit is
// all-gathered and runs forward and backward in bf16 (param_dtype) and its gradients are
// reduced in fp32 (reduce_dtype) -- --mixed_precision=auto resolves to bf16 for such a
// folder (examples/trainer/levers.h). Updates smaller than bf16's resolution then accumulate
// in the masters instead of being lost, at 16 bytes a parameter with AdamW (weight,
// gradient, two moments) instead of 8. --mixed_precision=pure_bf16 is the old way
// (everything bf16); none trains in fp32. The folder written at the end holds the
// folder's dtype again (save_hf_folder writes that; a LoRA run casts the frozen base
// weights, which were read exactly, before merging, so the merged weight is rounded once).

// What --mixed_precision (resolved) means, for the progress line.
const char* precision_words(const std::string& mixed_precision) {
  if (mixed_precision == "bf16") {
    return "bf16 mixed precision (bf16 compute, fp32 master weights, AdamW state and "
           "gradient reduction)";
  }
  if (mixed_precision == "pure_bf16") return "pure bf16 (parameters and AdamW state bf16)";
  return "fp32";
}

// The other levers in effect, for the progress line ("" when none).
std::string lever_words(const LeverFlags& levers) {
  std::string words;
  if (levers.activation_checkpointing) words += "; activation checkpointing per unit";
  if (levers.grad_accumulation_steps > 1) {
    words += absl::StrFormat("; %d micro-batches per step", levers.grad_accumulation_steps);
  }
  return words;
}

double learning_rate(int64_t step) {
  return examples::cosine_learning_rate(
      step, absl::GetFlag(FLAGS_lr), absl::GetFlag(FLAGS_warmup_steps), absl::GetFlag(FLAGS_steps));
}

int finetune() {
  const examples::RunFlags flags = examples::run_flags_from_command_line();
  // The process group (on CUDA rank r works on cuda:LOCAL_RANK over NCCL: Note [The
  // compute device] in examples/trainer/levers.h), the flags' agreement, the lock.
  examples::TrainingRun run(flags);
  Communicator& comm = run.comm();
  const c10::Device device = run.device();
  const bool lead = run.lead();
  const std::string from = absl::GetFlag(FLAGS_from);
  const DecoderConfig config = load_decoder_config(from + "/config.json");
  const Data train = read_data(absl::GetFlag(FLAGS_data), config);
  const std::string eval_path = absl::GetFlag(FLAGS_eval_data);
  const std::optional<Data> eval =
      eval_path.empty() ? std::nullopt : std::optional<Data>(read_data(eval_path, config));

  // See Note [Master weights of a 16-bit folder].
  const at::ScalarType folder_dtype = hf_weights_dtype(from);
  int64_t numel = 0, trainable = 0;
  FinetunePlan plan;
  Model model = load_model(config, examples::lever_options(run.comm_ptr(), flags), flags,
                           examples::model_dtype(flags.mixed_precision), folder_dtype, device,
                           &numel, &trainable, &plan);
  FusedAdamW adamw(model->parameters(), torch::optim::AdamWOptions(flags.lr).weight_decay(
                                            absl::GetFlag(FLAGS_weight_decay)));
  if (lead) {
    std::cout << absl::StrFormat(
        "model: %s (%s), %d parameters (%d trainable; %d layers, %d heads, %d key/value heads) in "
        "%d units over %d ranks (%s)\nprecision: %s weights; %s%s%s%s\ndata: %s%s\n",
        from, config.model_type, numel, trainable, config.num_hidden_layers,
        config.num_attention_heads, config.num_key_value_heads, model->units().size(),
        comm.world_size(), sharding_strategy_name(model->sharding_strategy()),
        c10::toString(folder_dtype),
        absl::StrCat(precision_words(flags.mixed_precision),
                     base_dtype_of(examples::model_dtype(flags.mixed_precision), folder_dtype,
                                   flags.mixed_precision) == folder_dtype &&
                             folder_dtype != examples::model_dtype(flags.mixed_precision)
                         ? absl::StrCat("; frozen base kept in ", c10::toString(folder_dtype))
                         : "",
                     absl::GetFlag(FLAGS_quantize) == "nf4" || config.load_in_4bit
                         ? "; layer projections in NF4 (QLoRA), dequantized to compute"
                         : ""),
        device.is_cuda() ? "; on cuda:LOCAL_RANK over NCCL" : "",
        flags.cpu_offload ? "; CPU offload" : "", lever_words(flags), data_words(train),
        eval ? absl::StrCat("; evaluation: ", data_words(*eval)) : std::string());
  }
  // The LR schedule's position travels with the checkpoints, as the GPT trainer's.
  SchedulerState scheduler{0, {learning_rate(0)}};
  const int64_t first = run.start(*model, adamw, &scheduler, learning_rate);
  if (eval) {
    const double before = eval_loss(model, *eval, comm);
    if (lead) std::cout << absl::StrFormat("eval loss before: %.6f\n", before);
  }
  // --sample_prompts: answers before this run's steps, written at once, and after them.
  const std::vector<SamplePrompt> samples = read_sample_prompts(config);
  const std::string samples_path = flags.out_dir + "/samples.jsonl";
  std::vector<std::vector<int64_t>> answers_before;
  if (!samples.empty()) {
    answers_before = sample_answers(model, samples, comm, device);
    if (lead) write_samples(samples_path, samples, answers_before, {});
  }
  // See Note [The router's load-balancing loss].
  const double aux_coef = router_aux_coef(config);
  if (lead && aux_coef > 0) {
    std::cout << absl::StrFormat(
        "router load-balancing loss: %g x aux added to each micro-batch's loss (%s); the "
        "training loss includes it\n",
        aux_coef,
        absl::GetFlag(FLAGS_router_aux_loss_coef) == "auto" ? "the config's router_aux_loss_coef"
                                                            : "--router_aux_loss_coef");
  }
  at::Tensor aux_sum;  // this step's micro-batches' aux, detached
  const AuxTerm with_aux = [&](const at::Tensor& loss, const at::Tensor& token_mask) {
    if (aux_coef == 0) return loss;
    const at::Tensor aux = model->module()->aux_loss(token_mask);
    aux_sum = aux_sum.defined() ? aux_sum + aux.detach() : aux.detach().clone();
    return loss + aux_coef * aux;
  };
  for (int64_t step = first; step < flags.steps; ++step) {
    const double lr = scheduler.last_lr.at(0);
    aux_sum = at::Tensor();
    for (auto& group : adamw.param_groups()) group.options().set_lr(lr);
    adamw.zero_grad();
    // --grad_accumulation_steps: this rank's share in equal micro-batches, no_sync between.
    at::Tensor loss;
    if (train.chat()) {
      loss =
          chat_step(model, train.rows, step, flags.grad_accumulation_steps, comm, device, with_aux);
    } else {
      auto [x, y] = batch(*train.tokens, step, comm, device);
      const int64_t micro = x.size(0) / flags.grad_accumulation_steps;
      loss = examples::accumulate_gradients(*model, flags.grad_accumulation_steps, [&](int64_t k) {
        return with_aux(next_token_loss(model->forward(x.narrow(0, k * micro, micro)),
                                        y.narrow(0, k * micro, micro)),
                        at::Tensor());
      });
    }
    adamw.step();
    scheduler = {step + 1, {learning_rate(step + 1)}};  // as scheduler.step()
    const double train_loss = global_mean(loss, comm);
    run.check_loss(step + 1, train_loss);
    run.checkpoint_if_due(step + 1, *model, adamw, &scheduler);
    std::string aux_words;
    if (aux_sum.defined()) {
      aux_words = absl::StrFormat(
          " | router aux %.4f", global_mean(aux_sum / double(flags.grad_accumulation_steps), comm));
    }
    run.record(step + 1, {train_loss, std::nullopt, lr}, *model, aux_words);
  }
  run.finish(*model);
  if (eval) {
    const double after = eval_loss(model, *eval, comm);
    if (lead) std::cout << absl::StrFormat("eval loss after: %.6f\n", after);
  }
  if (!samples.empty()) {
    const std::vector<std::vector<int64_t>> answers_after =
        sample_answers(model, samples, comm, device);
    if (lead) {
      write_samples(samples_path, samples, answers_before, answers_after);
      std::cout << absl::StrFormat("samples: %s (%d prompts answered before and after)\n",
                                   samples_path, samples.size());
    }
  }
  save_model(model, config);
  // See Note [Checking the plan before loading].
  const std::vector<int64_t> peaks = examples::peak_resident_set_of_ranks(comm, device);
  if (!lead) return 0;
  if (device.is_cuda()) {
    std::cout << absl::StrFormat("peak resident set (host): %d MiB\n",
                                 *std::max_element(peaks.begin(), peaks.end()) >> 20);
  } else {
    std::vector<std::string> each;
    for (size_t r = 0; r < peaks.size(); ++r) {
      each.push_back(absl::StrFormat("rank %d %d MiB", r, peaks[r] >> 20));
    }
    const int64_t largest = *std::max_element(peaks.begin(), peaks.end());
    std::cout << absl::StrFormat(
        "peak resident set: %s; planned %d MiB per rank (largest / plan %.3f)\n",
        absl::StrJoin(each, ", "), plan.peak_bytes >> 20, double(largest) / plan.peak_bytes);
  }
  std::cout << "metrics: " << flags.out_dir << "/metrics.csv, model: " << flags.out_dir << "/hf/\n";
  return 0;
}

// What the fine-tune adds to the trainers' main().
examples::TrainerHooks finetune_hooks() {
  using examples::FlagValue;
  examples::TrainerHooks hooks;
  // RunFlags' own defaults are the fine-tune's; its memory plan counts a synchronous save.
  hooks.defaults.async_save = false;
  // On CUDA one rank per visible device unless --world_size says otherwise (a launcher's
  // WORLD_SIZE counts instead).
  hooks.cuda_defaults = [](int cuda_devices) {
    std::vector<FlagValue> defaults;
    if (!examples::specified_on_command_line("world_size")) {
      defaults.push_back({"world_size", std::to_string(cuda_devices)});
    }
    return defaults;
  };
  hooks.flag_error = [](const examples::MachineLimits&) { return flag_error(); };
  // --mixed_precision=auto: bf16 for a 16-bit folder (Note [Master weights of a 16-bit
  // folder]).
  hooks.weights_dtype = [] { return hf_weights_dtype(absl::GetFlag(FLAGS_from)); };
  hooks.run = finetune;
  return hooks;
}

}  // namespace
}  // namespace fsdp::models

int main(int argc, char** argv) {
  return fsdp::examples::trainer_main(argc, argv, "finetune", fsdp::models::finetune_hooks());
}
