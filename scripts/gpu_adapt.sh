#!/usr/bin/env bash
# One GPU, one command: distil a large set with the base model, adapt for ~10 minutes, export.
# Runs from the repository root with the package on PYTHONPATH (a lent GPU machine has no
# registry access: its image must already hold torch, and the wheels of gguf, tokenizers,
# safetensors, jinja2, tqdm and pyyaml must be carried in ./wheels and installed offline).
# Not yet run on a GPU: no device was lent to the session that wrote it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d wheels ]; then python3 -m pip install --no-index --find-links wheels -q gguf tokenizers safetensors jinja2 tqdm pyyaml || true; fi
export PYTHONPATH=src
PROMPTS=${PROMPTS:-20000}
python3 -m clover.cli data distill --out runs/distill-gpu --prompts "$PROMPTS" --batch-size 64 --max-tokens 192 --dtype float32
python3 -m clover.cli train adapt --config configs/adapt-gpu.yaml
python3 benchmarks/frontier.py --model smollm2-135m --adapter runs/adapt-gpu/adapter.safetensors --label adapt-gpu
