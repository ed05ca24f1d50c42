#!/usr/bin/env bash
# What a newcomer runs, checked: the README's quick-start line, verbatim (no pins: pip takes the
# newest torch it can), in a fresh copy of this tree with a fresh venv; then the kernels must be
# on and the default model must answer. `scripts/test` runs it beside the pinned test venv.
# The line is read from the README (the block after "## Quick start"), so the two cannot part.
set -euo pipefail
cd "$(dirname "$0")/.."
line="$(awk '/^## Quick start/{on=1} on && /^```bash/{getline; print; exit}' README.md)"
if [ -z "$line" ]; then
  echo "quickstart: no bash block under '## Quick start' in README.md" >&2
  exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# the tree as a clean clone has it, plus what is not yet committed (git's own lists)
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && mkdir -p "$work/$(dirname "$f")" && cp -p "$f" "$work/$f"
done
echo "quickstart: $line" >&2
( cd "$work" && env -u VIRTUAL_ENV bash -c "$line" ) > "$work/answer.txt" 2> "$work/log.txt" || {
  tail -30 "$work/log.txt" >&2
  echo "quickstart: the README's line failed" >&2
  exit 1
}
torch_version="$("$work/.venv/bin/python" -c 'import torch; print(torch.__version__)')"
json="$(cd "$work" && .venv/bin/clover generate --prompt "Say hi." --max-tokens 8 --json)"
echo "quickstart: torch $torch_version; $(tail -1 "$work/log.txt")" >&2
"$work/.venv/bin/python" - "$json" <<'EOF'
import json, sys
out = json.loads(sys.argv[1])
if not out["kernels"].startswith("on"):
    sys.exit(f"quickstart: the kernels are {out['kernels']}")
if out["output_tokens"] < 1:
    sys.exit("quickstart: the default model gave no answer")
print(f"quickstart: kernels {out['kernels']}, {out['output_tokens']} tokens, "
      f"load {out['load_seconds']} s", file=sys.stderr)
EOF
