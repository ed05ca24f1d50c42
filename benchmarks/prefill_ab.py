"""Prefill time of two revisions, by turns: A, B, A, B (each in its own process).

Usage: python benchmarks/prefill_ab.py A B [--model qwen2.5-coder-0.5b] [--dtype int4]
           [--shapes 9x330,1x3000,1x1000,8x128,8x44,1x44,1x200] [--turns 2] [--reps 3]
           [--out FILE]
A and B are git revisions (`worktree`: the files as they are now). Each one is checked out
into a temporary worktree and run with its own src/ first on the path, so its kernels are
built from its own sources (cached by their hash). A run loads the model once and, per shape
BxT (rows x tokens of random ids), times a first causal pass over a fresh cache (what a new
prompt's prefill and a drafter's feature pass are: no cached prefix), the fastest of `reps`
after one warm-up. Why by turns: on the shared 2-core hosts the same pass moves 10-20% between
runs minutes apart; alternating the revisions shows a change against that drift.
Writes benchmarks/results/prefill-ab-<A>-<B>.json: per revision, per turn, ms per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

CHILD = """
import json, sys, time, torch
from clover.engine import LLM
model, dtype, shapes, reps = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
m = LLM(model, dtype=dtype, progress=False).model
gen = torch.Generator().manual_seed(0)
out = {}
with torch.inference_mode():
    for shape in shapes:
        B, T = (int(v) for v in shape.split("x"))
        ids = torch.randint(100, 10000, (B, T), generator=gen)
        m(ids, m.make_cache(B))
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            m(ids, m.make_cache(B))
            best = min(best, time.perf_counter() - t)
        out[shape] = round(best * 1000, 1)
print(json.dumps(out))
"""


def parse_shapes(text: str) -> list[str]:
    shapes = [s.strip() for s in text.split(",") if s.strip()]
    for s in shapes:
        parts = s.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--shapes: {s!r} is not ROWSxTOKENS (e.g. 1x3000)")
    return shapes


def checkout(rev: str, into: Path) -> Path:
    """The src/ directory of `rev` (the working tree's own for `worktree`)."""
    if rev == "worktree":
        return ROOT / "src"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(into), rev],
                   check=True)  # fmt: skip
    return into / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--shapes", default="9x330,1x3000,1x1000,8x128,8x44,1x44,1x200")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    results: dict[str, list[dict]] = {args.a: [], args.b: []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        try:
            srcs = {}
            for i, rev in enumerate((args.a, args.b)):
                srcs[rev] = checkout(rev, Path(tmp) / f"rev{i}")
                if rev != "worktree":
                    trees.append(Path(tmp) / f"rev{i}")
            for turn in range(args.turns):
                for rev in (args.a, args.b):
                    env = {**os.environ, "PYTHONPATH": str(srcs[rev])}
                    cmd = [sys.executable, "-c", CHILD, args.model, args.dtype, ",".join(shapes),
                           str(args.reps)]  # fmt: skip
                    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                    if run.returncode != 0:
                        raise SystemExit(f"{rev}: the timing run failed:\n{run.stderr[-2000:]}")
                    ms = json.loads(run.stdout.strip().splitlines()[-1])
                    results[rev].append(ms)
                    shown = ", ".join(f"{s} {v} ms" for s, v in ms.items())
                    print(f"turn {turn + 1} {rev}: {shown}", flush=True)
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               check=False)  # fmt: skip
    out = Path(args.out) if args.out else RESULTS / f"prefill-ab-{args.a}-{args.b}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "prefill_ab",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "model": args.model,
        "dtype": args.dtype,
        "ms_fastest_of_reps": results,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
