"""Two commits of Clover side by side: greedy answers' tokens/s of one model, the two trees run
in turn (A B, B A, ...) so that the host's drift falls on both alike.

Usage: python benchmarks/commit_ab.py OLD [NEW] [--model M] [--pairs 6] [--configs ar,default]
OLD and NEW are git revisions (NEW defaults to the working tree). Each revision other than the
working tree runs from a worktree of its own with a cache of its own (its kernels build there;
the model files are shared). Per run: 4 chat prompts x 128 tokens per config, prefix cache off,
3 repetitions (median and best), after one warm-up pass. Writes
benchmarks/results/commit-ab-<model>.json with every run and the medians over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from clover.bench.common import command_line, machine, now, write_results
from clover.data.bench_prompts import COMMIT_AB_PROMPTS
from clover.files import cache_dir

ROOT = Path(__file__).resolve().parents[1]
RUN = """
import json, statistics, sys, time
from clover.engine import LLM, GenerationSettings
llm = LLM(sys.argv[1], progress=False)
llm.set_prefix_cache(0)
prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in json.loads(sys.argv[3])]
out = {}
for name in sys.argv[2].split(","):
    base = GenerationSettings(max_tokens=128)
    ar = GenerationSettings(decoder="ar", max_tokens=128)
    s = ar if name == "ar" else llm.default_settings(base)
    for p in prompts:
        llm.generate([p], s)
    rates = []
    for _ in range(3):
        n, t = 0, time.perf_counter()
        for p in prompts:
            [c] = llm.generate([p], s)
            n += c.output_tokens
        rates.append(n / (time.perf_counter() - t))
    out[name] = {"median": round(statistics.median(rates), 2), "best": round(max(rates), 2)}
print(json.dumps(out))
"""
# the child's third argument: an old tree may not have the list
PROMPTS = json.dumps(COMMIT_AB_PROMPTS)


def _tree(rev: str, work: Path) -> tuple[Path, dict]:
    """(source folder, environment) for a revision: the working tree, or a worktree."""
    if rev == "worktree":
        return ROOT / "src", dict(os.environ)
    path = work / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                   check=True, capture_output=True)  # fmt: skip
    cache = work / f"cache-{rev.replace('/', '_')}"
    cache.mkdir()
    (cache / "models").symlink_to(cache_dir() / "models")
    return path / "src", {**os.environ, "CLOVER_CACHE": str(cache)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default="worktree")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--configs", default="ar,default")
    a = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="clover-ab-") as tmp:
        trees = {rev: _tree(rev, Path(tmp)) for rev in (a.old, a.new)}
        try:
            for i in range(a.pairs):
                order = (a.old, a.new) if i % 2 == 0 else (a.new, a.old)
                for rev in order:
                    src, env = trees[rev]
                    env = {**env, "PYTHONPATH": str(src)}
                    proc = subprocess.run([sys.executable, "-c", RUN, a.model, a.configs, PROMPTS],
                                          env=env, capture_output=True, text=True)  # fmt: skip
                    if proc.returncode:
                        raise SystemExit(f"{rev}: {proc.stderr.strip()[-500:]}")
                    row = {
                        "pair": i,
                        "rev": rev,
                        **json.loads(proc.stdout.strip().splitlines()[-1]),
                    }
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    runs.append(row)
        finally:
            for rev in trees:
                if rev != "worktree":
                    path = str(Path(tmp) / rev.replace("/", "_"))
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", path],
                                   capture_output=True)  # fmt: skip
    summary = {}
    for rev in (a.old, a.new):
        mine = [r for r in runs if r["rev"] == rev]
        summary[rev] = {c: {"median": round(statistics.median(r[c]["median"] for r in mine), 1),
                            "min": round(min(r[c]["median"] for r in mine), 1),
                            "max": round(max(r[c]["median"] for r in mine), 1)}
                        for c in a.configs.split(",")}  # fmt: skip
    report = {"benchmark": "benchmarks/commit_ab.py", "date": now(), "command": command_line(),
              "machine": machine(), "model": a.model, "pairs": a.pairs, "summary": summary,
              "runs": runs}  # fmt: skip
    out = ROOT / "benchmarks" / "results" / f"commit-ab-{a.model}.json"
    write_results(report, out)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
