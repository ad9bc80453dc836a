#!/usr/bin/env bash
# Compares the C++ wrap planner (fsdp_plan) against PyTorch's own
# _recursive_wrap (tests/plan_oracle.py) on real architectures, each read from every file
# plan_oracle.py made of it: NAME.pt (TorchScript), NAME.pt2 (torch.export) and, for some,
# NAME.meta.pt2 (exported on the meta device). The models are exported once per run.
#
# Usage: plan_oracle_test.sh PATH/TO/fsdp_plan PATH/TO/python3 (with torch 2.11)
# Runs as a Bazel sh_test (uses $TEST_TMPDIR) or by hand.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ORACLE="$HERE/plan_oracle.py"
LAYER=torch.nn.modules.transformer.TransformerEncoderLayer
DECODER_LAYER=torch.nn.modules.transformer.TransformerDecoderLayer
GPT_BLOCK=__main__.Block  # tests/plan_oracle.py's Block (it runs as __main__)
LINEAR=torch.nn.modules.linear.Linear
SEQUENTIAL=torch.nn.modules.container.Sequential
BASIC_BLOCK=torchvision.models.resnet.BasicBlock

die() { echo "ERROR: $*" >&2; exit 1; }

[[ $# -eq 2 ]] || die "usage: $0 PATH/TO/fsdp_plan PATH/TO/python3"
PLAN="$1"
PY="$2"
[[ -x "$PY" ]] || die "$PY not found"
[[ -f "$ORACLE" ]] || die "$ORACLE not found"
[[ -f "$PLAN" && -x "$PLAN" ]] || die "fsdp_plan binary '$PLAN' is not executable"

if [[ -n "${TEST_TMPDIR:-}" ]]; then
  TMP="$TEST_TMPDIR/plan_oracle"
  mkdir -p "$TMP"
else
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
fi

# The oracle must be right on a hand-computed example before we trust it.
"$PY" "$ORACLE" selfcheck || die "plan_oracle.py selfcheck failed"
"$PY" "$ORACLE" make-models "$TMP" || die "model creation failed"

# One case a line: NAME MODEL WORLD_SIZE POLICY-FLAGS...
# A module that a .pt2 export never called has no class (fsdp/wrap/exported_program_tree.h):
# frozen_unused's spare.0, spare.1 and extra are Linears that no class-based policy can
# pick from the archive, so its class-based cases name Sequential (heads.a) instead.
# The policy flags are passed unchanged to both fsdp_plan and the oracle.
CASES=(
  "resnet18_size_1e5_w8            resnet18            8 --policy=size --min_num_params=100000"
  "resnet18_size_1e6_w3            resnet18            3 --policy=size --min_num_params=1000000"
  "resnet18_size_0_w1              resnet18            1 --policy=size --min_num_params=0"
  "resnet18_size_1e8_w3            resnet18            3 --policy=size --min_num_params=100000000"
  "resnet18_always_w2              resnet18            2 --policy=always"
  "mobilenet_size_1e5_w4           mobilenet_v3_small  4 --policy=size --min_num_params=100000"
  "mobilenet_always_w3             mobilenet_v3_small  3 --policy=always"
  "encoder_size_1e4_w2             transformer_encoder 2 --policy=size --min_num_params=10000"
  "encoder_size_1e5_w3             transformer_encoder 3 --policy=size --min_num_params=100000"
  "encoder_transformer_w8          transformer_encoder 8 --policy=transformer --layer_cls=$LAYER"
  "encoder_always_w3               transformer_encoder 3 --policy=always"
  "encoder_module_w8               transformer_encoder 8 --policy=module --layer_cls=$LAYER"
  "transformer_size_1e4_w2         transformer         2 --policy=size --min_num_params=10000"
  "transformer_decoder_layer_w4    transformer         4 --policy=transformer --layer_cls=$DECODER_LAYER"
  "transformer_always_w3           transformer         3 --policy=always"
  "tied_lm_transformer_w2          tied_lm             2 --policy=transformer --layer_cls=$LAYER"
  "tied_lm_size_1e3_w3             tied_lm             3 --policy=size --min_num_params=1000"
  "tied_lm_always_w8               tied_lm             8 --policy=always"
  "tied_lm_module_w2               tied_lm             2 --policy=module --layer_cls=$LAYER"
  "transformer_module_w4           transformer         4 --policy=module --layer_cls=$LAYER,$DECODER_LAYER"
  "resnet18_transformer_w4         resnet18            4 --policy=transformer --layer_cls=$BASIC_BLOCK"
  "gpt_size_1e3_w2                 gpt                 2 --policy=size --min_num_params=1000"
  "gpt_size_1e4_w3                 gpt                 3 --policy=size --min_num_params=10000"
  "gpt_size_0_w1                   gpt                 1 --policy=size --min_num_params=0"
  "gpt_transformer_w4              gpt                 4 --policy=transformer --layer_cls=$GPT_BLOCK"
  "gpt_module_w2                   gpt                 2 --policy=module --layer_cls=$GPT_BLOCK"
  "gpt_always_w3                   gpt                 3 --policy=always"
  "frozen_unused_size_0_w2         frozen_unused       2 --policy=size --min_num_params=0"
  "frozen_unused_size_1e3_w3       frozen_unused       3 --policy=size --min_num_params=1000"
  "frozen_unused_always_w3         frozen_unused       3 --policy=always"
  "frozen_unused_transformer_w2    frozen_unused       2 --policy=transformer --layer_cls=$SEQUENTIAL"
  "frozen_unused_module_w4         frozen_unused       4 --policy=module --layer_cls=$SEQUENTIAL"
)

# Compares total_numel and units (fqn, numel, shard_numel, padding, in
# order); other keys (e.g. per_rank) are ignored. argv: CASE ORACLE PLAN.
COMPARE='
import difflib, json, sys
case, oracle_path, plan_path = sys.argv[1:]
def lines(path):
    with open(path) as f:
        d = json.load(f)
    out = ["total_numel %s" % d.get("total_numel")]
    for u in d.get("units", []):
        out.append("unit %-32r numel=%s shard_numel=%s padding=%s" % (
            u.get("fqn"), u.get("numel"), u.get("shard_numel"), u.get("padding")))
    return out
want = lines(oracle_path)
try:
    got = lines(plan_path)
except (ValueError, AttributeError) as e:
    sys.exit("  fsdp_plan output is not the expected JSON: %s" % e)
if want != got:
    for l in difflib.unified_diff(want, got, "oracle", "fsdp_plan", lineterm="", n=2):
        print("  " + l)
    sys.exit(1)
'

# PyTorch's plans for every case, in one Python process.
printf '%s\n' "${CASES[@]}" >"$TMP/cases.txt"
"$PY" "$ORACLE" oracle-batch "$TMP/cases.txt" "$TMP" || die "plan_oracle.py oracle-batch failed"

passed=0
failed=0
for line in "${CASES[@]}"; do
  read -r name model ws flags <<<"$line"
  read -r -a flags <<<"$flags"
  out="$TMP/$name"
  if [[ ! -f "$out.oracle.json" ]]; then
    echo "FAIL $name (oracle failed)"; sed 's/^/  /' "$out.oracle.err"
    failed=$((failed + 1)); continue
  fi
  for ext in pt pt2 meta.pt2; do
    [[ -f "$TMP/$model.$ext" ]] || continue
    plan_cmd=("$PLAN" --model="$TMP/$model.$ext" --world_size="$ws" --format=json "${flags[@]}")
    if ! "${plan_cmd[@]}" >"$out.$ext.json" 2>"$out.$ext.err"; then
      echo "FAIL $name.$ext (fsdp_plan failed): ${plan_cmd[*]}"; sed 's/^/  /' "$out.$ext.err"
      failed=$((failed + 1)); continue
    fi
    if diff_text="$("$PY" -c "$COMPARE" "$name" "$out.oracle.json" "$out.$ext.json" 2>&1)"; then
      echo "ok $name.$ext"
      passed=$((passed + 1))
    else
      echo "FAIL $name.$ext: ${plan_cmd[*]}"; echo "$diff_text"
      failed=$((failed + 1))
    fi
  done
  if [[ ! -f "$TMP/$model.pt2" ]]; then
    echo "FAIL $name: plan_oracle.py make-models wrote no $model.pt2"
    failed=$((failed + 1))
  fi
done

# What fsdp_plan read from the real archives beyond the plan: frozen parameters, ties
# (also on the meta device, where only the graph shows them), classes never recorded.
# FrozenUnused: stem (Linear(16, 32): 512 + 32 elements) frozen; heads (a ModuleDict),
# spare, spare.0, spare.1 and extra never called. GPT: lm_head.weight is
# transformer.wte.weight; transformer, h and each of the 3 blocks' attn ModuleDict never
# called.
SUMMARIES=(
  "frozen_unused.pt2|12 parameters + 0 tied names, 2 frozen (544 elements); elements by dtype: Float 4048; 0 buffers; 5 modules never called"
  "gpt.pt2|40 parameters + 1 tied names, 0 frozen (0 elements); elements by dtype: Float 42784; 0 buffers; 5 modules never called"
  "gpt.meta.pt2|40 parameters + 1 tied names, 0 frozen (0 elements); elements by dtype: Float 42784; 0 buffers; 5 modules never called"
)
for entry in "${SUMMARIES[@]}"; do
  file=${entry%%|*}
  want=${entry#*|}
  got=$("$PLAN" --model="$TMP/$file" --policy=always 2>&1) || true
  got=${got%%$'\n'*}  # the first line
  if [[ "$got" == *"$want"* ]]; then
    echo "ok summary $file"
    passed=$((passed + 1))
  else
    echo "FAIL summary $file: got '$got', want '$want'"
    failed=$((failed + 1))
  fi
done

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
