#!/usr/bin/env bash
# fsdp_plan's command line: a good run prints the plan; each kind of bad input prints
# exactly one line on stderr ("fsdp_plan: ...") and exits with status 2.
#   fsdp_plan_cli_test.sh PATH/TO/fsdp_plan PATH/TO/python3 (with torch 2.11)
set -uo pipefail

plan=${1:?usage: fsdp_plan_cli_test.sh PATH/TO/fsdp_plan PATH/TO/python3}
python=${2:?usage: fsdp_plan_cli_test.sh PATH/TO/fsdp_plan PATH/TO/python3}
tmp=${TEST_TMPDIR:-$(mktemp -d)}
passed=0
failed=0

# From a file: TorchScript reads a function's source.
cat > "$tmp/make_models.py" <<'PY'

import sys, torch
model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 2))
torch.jit.script(model).save(sys.argv[1])
def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x
torch.jit.save(torch.jit.script(double), sys.argv[1].replace("model.pt", "function.pt"))
# What fsdp_plan is often given instead (issue 30): torch.save files and a .pt2 archive.
torch.save(model.state_dict(), sys.argv[1].replace("model.pt", "state_dict.pt"))
torch.save(model.state_dict(), sys.argv[1].replace("model.pt", "legacy.pt"),
           _use_new_zipfile_serialization=False)
pt2 = sys.argv[1].replace("model.pt", "model.pt2")
torch.export.save(torch.export.export(model, (torch.randn(2, 10),)), pt2)
# Damaged .pt2 archives: a weight left out, a schema version from the future.
import json, zipfile
with zipfile.ZipFile(pt2) as z:
    records = {i.filename: z.read(i.filename) for i in z.infolist()}
def rewrite(name, change):
    out = dict(records)
    change(out)
    with zipfile.ZipFile(pt2.replace("model.pt2", name), "w") as z:
        for key, value in out.items():
            z.writestr(key, value)
rewrite("no_weight.pt2", lambda r: r.pop("model/data/weights/weight_2"))
def future(r):
    model = json.loads(r["model/models/model.json"])
    model["schema_version"]["major"] = 99
    r["model/models/model.json"] = json.dumps(model)
rewrite("future.pt2", future)
# A TorchScript module whose __setstate__ (code the file carries, run by torch.jit.load)
# writes a file next to it (issue 38): TorchScript compiles a class from its source file.
import os
evil = os.path.join(os.path.dirname(sys.argv[1]), "evil_module.py")
with open(evil, "w") as f:
    f.write(f"""
import torch
from typing import Tuple
class Evil(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
    def forward(self, x):
        return self.lin(x)
    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, bool]:
        return (self.lin.weight, self.training)
    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, bool]) -> None:
        torch.save(state[0], {os.path.join(os.path.dirname(sys.argv[1]), "pwned")!r})
        self.training = state[1]
""")
sys.path.insert(0, os.path.dirname(evil))
import evil_module
torch.jit.script(evil_module.Evil()).save(sys.argv[1].replace("model.pt", "evil.pt"))
PY
"$python" "$tmp/make_models.py" "$tmp/model.pt" || { echo "cannot create the test models"; exit 1; }
echo "not a zip" > "$tmp/corrupt.pt"
head -c 300 "$tmp/model.pt" > "$tmp/truncated.pt"
head -c 2000 "$tmp/model.pt2" > "$tmp/truncated.pt2"

# expect_error NAME EXPECTED_SUBSTRING ARGS...
expect_error() {
  local name=$1 expected=$2
  shift 2
  local err rc
  err=$("$plan" "$@" 2>&1 >/dev/null)
  rc=$?
  if [[ $rc -eq 2 && $(wc -l <<<"$err") -eq 1 && "$err" == "fsdp_plan: "*"$expected"* ]]; then
    echo "ok $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name: status $rc, stderr:"
    echo "$err" | head -5
    failed=$((failed + 1))
  fi
}

expect_error missing_model "--model=FILE is required (a .pt2 archive from torch.export.save or a TorchScript file)"
# --config: a decoder fine-tune's memory plan; what the decoder refuses is one line.
echo '{"model_type": "deepseek_v2", "hidden_size": 8}' > "$tmp/moe.json"
expect_error config_moe "deepseek_v2" --config="$tmp/moe.json"
# deepseek-ai/DeepSeek-V3's config.json: its FP8 weights are refused, saying how to get bf16;
# without its quantization_config (a bf16 folder's) it plans 671 B parameters.
cat > "$tmp/dsv3.json" <<'JSON'
{"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
 "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
 "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
 "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
 "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
 "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
 "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
 "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
 "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
 "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
 "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
 "type": "yarn"}, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
 "seq_aux": true, "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
 "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true,
 "v_head_dim": 128, "vocab_size": 129280,
 "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
 "weight_block_size": [128, 128]}}
JSON
expect_error config_fp8 "FineGrainedFP8Config(dequantize=True)" --config="$tmp/dsv3.json"
"$python" -c 'import json, sys; c = json.load(open(sys.argv[1])); del c["quantization_config"]
json.dump(c, open(sys.argv[2], "w"))' "$tmp/dsv3.json" "$tmp/dsv3_bf16.json"
out=$("$plan" --config="$tmp/dsv3_bf16.json" --world_size=256 --device=cuda --context=4096 \
  --activation_checkpointing 2>&1)
if grep -q "(deepseek_v3): 671026404352 parameters" <<<"$out" &&
   grep -q "gathers all 256 experts" <<<"$out"; then
  echo "ok config_deepseek_v3"
  passed=$((passed + 1))
else
  echo "FAIL config_deepseek_v3: expected 671026404352 parameters and 256 experts in: $out"
  failed=$((failed + 1))
fi
expect_error config_missing "$tmp/none.json" --config="$tmp/none.json"
expect_error config_and_model "give --config or --model, not both" --config="$tmp/moe.json" --model="$tmp/nope.pt"
echo '{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 100}' > "$tmp/llama.json"
expect_error config_bad_memory "--memory_per_rank=lots: expected a positive size in bytes" --config="$tmp/llama.json" --memory_per_rank=lots
expect_error config_bad_precision "unknown --mixed_precision 'fp8'" --config="$tmp/llama.json" --mixed_precision=fp8
expect_error config_bad_quantize "unknown --quantize 'int4': expected none or nf4" --config="$tmp/llama.json" --quantize=int4
expect_error config_nf4_without_lora "--quantize=nf4 freezes the base weights in 4 bits (QLoRA): give --lora_rank too" --config="$tmp/llama.json" --quantize=nf4
expect_error config_bad_base "unknown --lora_base_dtype 'fp8': expected auto or float32" --config="$tmp/llama.json" --lora_base_dtype=fp8
expect_error config_bad_device "unknown --device 'tpu': expected cpu or cuda" --config="$tmp/llama.json" --device=tpu
expect_error missing_file "cannot open '$tmp/nope.pt': no such file" --model="$tmp/nope.pt"
expect_error directory "'$tmp' is a directory" --model="$tmp"
mkfifo "$tmp/fifo"
expect_error fifo "'$tmp/fifo' is not a regular file" --model="$tmp/fifo"
# What the file is, in one line that leads with our words (issue 30).
expected="expected a .pt2 archive written by torch.export.save(ep, path) or a TorchScript file written by torch.jit.script(model).save(path)"
pt2_expected="expected an archive written by torch.export.save(ep, path)"
: >"$tmp/empty.pt"
mkdir -p "$tmp/checkpoint" && : >"$tmp/checkpoint/metadata.pt"
expect_line() {  # expect_line NAME EXACT_LINE ARGS...
  local name=$1 want=$2
  shift 2
  expect_error "$name" "" "$@"
  if [[ "$("$plan" "$@" 2>&1 >/dev/null)" != "$want" ]]; then
    echo "FAIL $name: not exactly '$want'"
    passed=$((passed - 1))
    failed=$((failed + 1))
  fi
}
expect_line corrupt_file \
  "fsdp_plan: '$tmp/corrupt.pt' is not a PyTorch file (not a zip archive; it starts with 'not a zi'); $expected" \
  --model="$tmp/corrupt.pt"
expect_line truncated_file \
  "fsdp_plan: '$tmp/truncated.pt' is a truncated or damaged zip archive (its directory of files cannot be read); $expected" \
  --model="$tmp/truncated.pt"
expect_line empty_file "fsdp_plan: '$tmp/empty.pt' is empty (0 bytes); $expected" \
  --model="$tmp/empty.pt"
expect_line state_dict \
  "fsdp_plan: '$tmp/state_dict.pt' was written by torch.save (a state dict, a checkpoint or a pickled module): it holds tensors, not a TorchScript module's structure; $expected" \
  --model="$tmp/state_dict.pt"
expect_line legacy_state_dict \
  "fsdp_plan: '$tmp/legacy.pt' was written by torch.save in its legacy (non-zip) format: a state dict or a pickled object, not a TorchScript module; $expected" \
  --model="$tmp/legacy.pt"
expect_line truncated_pt2 \
  "fsdp_plan: '$tmp/truncated.pt2' is a truncated or damaged zip archive (its directory of files cannot be read); $expected" \
  --model="$tmp/truncated.pt2"
expect_line pt2_without_weight \
  "fsdp_plan: '$tmp/no_weight.pt2': the weight of 2.weight (data/weights/weight_2) is missing from the archive; $pt2_expected" \
  --model="$tmp/no_weight.pt2"
expect_line pt2_future_schema \
  "fsdp_plan: '$tmp/future.pt2': unsupported export schema version 99.17: this reader understands version 8.x (torch 2.11's torch.export.save); re-export the model with torch 2.11" \
  --model="$tmp/future.pt2"
expect_line checkpoint_folder \
  "fsdp_plan: '$tmp/checkpoint' is a directory (a sharded checkpoint, as save_sharded_checkpoint writes); $expected" \
  --model="$tmp/checkpoint"
expect_error unknown_policy "unknown --policy 'biggest'" --model="$tmp/model.pt" --policy=biggest
expect_error negative_threshold "--min_num_params must be an integer in [0, 9007199254740992], got '-5'" \
  --model="$tmp/model.pt" --min_num_params=-5
expect_error fractional_threshold "got '1.5'" --model="$tmp/model.pt" --min_num_params=1.5
expect_error huge_world_size "--world_size must be an integer in [1, 1048576], got '9223372036854775807'" \
  --model="$tmp/model.pt" --world_size=9223372036854775807
expect_error text_world_size "got 'abc'" --model="$tmp/model.pt" --world_size=abc
expect_error trailing_comma "--ignored_modules has an empty entry" --model="$tmp/model.pt" \
  --ignored_modules=0,
expect_error layer_cls_with_size "--layer_cls is used by --policy=transformer and --policy=module only" \
  --model="$tmp/model.pt" --layer_cls=torch.nn.modules.linear.Linear
expect_error scripted_function "holds a scripted function, not a module" --model="$tmp/function.pt"
# Read as data: the file's __setstate__ never runs, and the module it would restore is
# refused by name.
expect_error setstate_refused \
  "'$tmp/evil.pt': module class evil_module.Evil restores its attributes with its own __setstate__, code the archive carries; fsdp reads TorchScript archives as data and never runs their code" \
  --model="$tmp/evil.pt"
if [[ -e "$tmp/pwned" ]]; then
  echo "FAIL setstate_not_run: fsdp_plan ran the archive's __setstate__ ($tmp/pwned exists)"
  failed=$((failed + 1))
else
  echo "ok setstate_not_run"
  passed=$((passed + 1))
fi
expect_error unknown_class "unknown class path 'torch.nn.modules.linear.Linearr'" \
  --model="$tmp/model.pt" --policy=transformer --layer_cls=torch.nn.modules.linear.Linearr
expect_error transformer_without_layers "needs --layer_cls" --model="$tmp/model.pt" \
  --policy=transformer
expect_error bad_world_size "--world_size must be an integer in [1, 1048576], got '0'" \
  --model="$tmp/model.pt" --world_size=0
expect_error bad_format "unknown --format 'xml'" --model="$tmp/model.pt" --format=xml
expect_error unknown_ignored "no module '7'" --model="$tmp/model.pt" --ignored_modules=7
expect_error unknown_optimizer "unknown --optimizer 'lamb'" --model="$tmp/model.pt" --optimizer=lamb
expect_error hybrid_not_dividing "--hybrid_shard_group_size=3 must divide --world_size=4" \
  --model="$tmp/model.pt" --world_size=4 --hybrid_shard_group_size=3
expect_error unknown_prefetch "unknown --backward_prefetch 'early'" --model="$tmp/model.pt" \
  --backward_prefetch=early

# A good run: Linear(10,10) = 110 elements becomes a unit at min 100; the root keeps 22.
out=$("$plan" --model="$tmp/model.pt" --policy=size --min_num_params=1e2 --world_size=4 \
  --format=json 2>&1)
want='"units": [{"fqn": "", "numel": 22, "shard_numel": 6, "padding": 2}, {"fqn": "0", "numel": 110, "shard_numel": 28, "padding": 2}]'
if [[ $? -eq 0 && "$out" == *"$want"* ]]; then
  echo "ok good_run"
  passed=$((passed + 1))
else
  echo "FAIL good_run: $out"
  failed=$((failed + 1))
fi

# --trust_torchscript (torch::jit::load) gives the plan the data reader gives.
out=$("$plan" --model="$tmp/model.pt" --policy=size --min_num_params=1e2 --world_size=4 \
  --format=json --trust_torchscript 2>&1)
if [[ $? -eq 0 && "$out" == *"$want"* ]]; then
  echo "ok good_run_trusted"
  passed=$((passed + 1))
else
  echo "FAIL good_run_trusted: $out"
  failed=$((failed + 1))
fi

# The same model as a .pt2 archive: the same plan, and the table names what it holds.
out=$("$plan" --model="$tmp/model.pt2" --policy=size --min_num_params=1e2 --world_size=4 \
  --format=json 2>&1)
rc=$?
if [[ $rc -eq 0 && "$out" == *"$want"* ]]; then
  echo "ok good_run_pt2"
  passed=$((passed + 1))
else
  echo "FAIL good_run_pt2: $out"
  failed=$((failed + 1))
fi
out=$("$plan" --model="$tmp/model.pt2" 2>&1)
rc=$?
want='torch.export archive (schema 8.17, torch 2.11.0'
want2='4 parameters + 0 tied names, 0 frozen (0 elements); elements by dtype: Float 132; 0 buffers; 0 modules never called (class unknown)'
if [[ $rc -eq 0 && "$out" == "$want"* && "$out" == *"$want2"* ]]; then
  echo "ok table_pt2"
  passed=$((passed + 1))
else
  echo "FAIL table_pt2: $out"
  failed=$((failed + 1))
fi

# QLoRA from a bf16 config.json at W = 1: the sharded parameters are the frozen weights at
# their stored size, counted here by hand. The 14 layer projections in NF4, each of n
# weights: n / 2 bytes of codes, n / 64 absmax codes, 4 x ceil(n / 16384) bytes of fp32
# second-level absmax, 256 x 4 of its code table and 4 of its offset; the embeddings, head
# and norms in bf16; q_proj and v_proj's rank-8 adapters in fp32.
cat > "$tmp/bf16.json" <<'JSON'
{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
 "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "dtype": "bfloat16"}
JSON
want=$("$python" - <<'PY'
h, i, kv, v, layers, r = 64, 128, 32, 256, 2, 8
projections = [h * h, kv * h, kv * h, h * h, i * h, i * h, h * i]  # q k v o gate up down
nf4 = sum(n // 2 + n // 64 + 4 * -(-n // 16384) + 256 * 4 + 4 for n in projections)
bf16 = 2 * (2 * v * h + (2 * layers + 1) * h)  # embeddings, head, norms
adapters = 4 * r * ((h + h) + (h + kv))  # q_proj, v_proj: A [r, in] and B [out, r]
print(layers * (nf4 + adapters) + bf16)
PY
)
out=$("$plan" --config="$tmp/bf16.json" --lora_rank=8 --quantize=nf4 --batch_size=1 \
  --format=json 2>&1)
sharded_parameters() {  # of a --format=json plan on stdin
  "$python" -c 'import json, sys; print(json.load(sys.stdin)["bytes"]["sharded_parameters"])' 2>&1
}
got=$(sharded_parameters <<<"$out")
if [[ "$got" == "$want" ]]; then
  echo "ok config_nf4_bytes ($want bytes)"
  passed=$((passed + 1))
else
  echo "FAIL config_nf4_bytes: expected sharded_parameters $want in: $out"
  failed=$((failed + 1))
fi
# A bitsandbytes 4-bit config.json plans as NF4 without --quantize, and only with LoRA.
"$python" - "$tmp" <<'PY'
import json, sys
config = json.load(open(sys.argv[1] + "/bf16.json"))
config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                 "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                                 "bnb_4bit_compute_dtype": "bfloat16"}
json.dump(config, open(sys.argv[1] + "/bnb4.json", "w"))
PY
got=$("$plan" --config="$tmp/bnb4.json" --lora_rank=8 --batch_size=1 --format=json 2>&1 |
  sharded_parameters)
if [[ "$got" == "$want" ]]; then
  echo "ok config_bnb4_bytes"
  passed=$((passed + 1))
else
  echo "FAIL config_bnb4_bytes: expected sharded_parameters $want, got $got"
  failed=$((failed + 1))
fi
expect_error config_bnb4_full "NF4 freezes the base weights in 4 bits (QLoRA): give a LoRA rank too" \
  --config="$tmp/bnb4.json"

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
