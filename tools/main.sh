#!/usr/bin/env bash
# The main job (README): plans FSDP units for real architectures exported from PyTorch
# (torchvision's ResNet-18 and a 3-layer torch.nn.TransformerEncoder) and prints what each
# sharding strategy costs per rank. Installs what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build //tools:fsdp_plan
models=$(mktemp -d)
trap 'rm -rf "$models"' EXIT
/usr/bin/python3 tests/plan_oracle.py make-models "$models"
plan=bazel-bin/tools/fsdp_plan
"$plan" --model="$models/resnet18.pt" --policy=size --min_num_params=1000000 --world_size=8
echo
"$plan" --model="$models/transformer_encoder.pt" --policy=transformer \
  --layer_cls=torch.nn.modules.transformer.TransformerEncoderLayer --world_size=4
