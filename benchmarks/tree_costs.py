"""What trees of drafts and a drafter's passes cost here, fused kernels against the modules.

Usage: python benchmarks/tree_costs.py --model smollm2-135m --drafter DRAFTER.safetensors \
           [--widths 16,64] [--prefix 300] [--reps 7] [--out benchmarks/results/....json]

Two tables, each the median of `reps` timed calls after a warm one, int4:
- verify: one target pass of W tokens over a `prefix`-token cache (random ids), as a chain
  (the fused layers), as a tree shaped like that chain (`tree=` parents t - 1: the fused
  layers with their tree visibility) and as the same tree on the modules (`model.fused =
  False`); each pass is rolled back before the next.
- draft: a drafter (`clover train drafter`) after 256 context tokens of random features:
  a chain of 15 drafts and of 3 (`DrafterRunner.draft`), grown trees of 15 and 63 drafts, 15
  deep (`draft_tree`), with its layers fused (`Drafter.fused_layers`) and on its modules.
Run it alone: two jobs on these 2 cores slow each other many times over.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from clover.bench.common import machine, now, write_results
from clover.decoding.drafting import DrafterRunner
from clover.engine import LLM


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[reps // 2] * 1000, 2)


def verify_costs(model: torch.nn.Module, widths: list[int], prefix: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    cache = model.make_cache(1)
    with torch.inference_mode():
        model(torch.randint(100, 5000, (1, prefix), generator=g), cache, "block",
              n_commit=torch.tensor([prefix]), n_valid=torch.tensor([prefix]))  # fmt: skip
    out = {}
    for W in widths:
        ids = torch.randint(100, 5000, (1, W), generator=g)
        chain = torch.arange(-1, W - 1)[None]

        def one(tree: torch.Tensor | None, W: int = W, ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                model(ids, cache, "block", n_commit=torch.tensor([W]), n_valid=torch.tensor([W]),
                      tree=tree)  # fmt: skip
            cache.rollback(torch.tensor([W]))

        row = {"chain": median_ms(partial(one, None), reps),
               "tree_fused": median_ms(partial(one, chain), reps)}  # fmt: skip
        fused, model.fused = model.fused, False
        try:
            row["tree_modules"] = median_ms(partial(one, chain), reps)
        finally:
            model.fused = fused
        out[str(W)] = row
        print(f"verify width {W}: {row}", file=sys.stderr)
    return out


def draft_costs(model: torch.nn.Module, reps: int) -> dict:
    drafter = model.drafter
    width = len(drafter.config.feature_layers) * model.config.hidden_size
    features = torch.randn(1, 256, width, generator=torch.Generator().manual_seed(0))
    out = {}
    for name in ("fused", "modules"):
        if name == "modules":  # the reference path: the drafter's own modules
            object.__setattr__(drafter, "fused_layers", lambda cache: None)
        try:
            runner = DrafterRunner(model, drafter)
            runner.add_row()
            runner.commit(features, torch.tensor([256]))
            first = torch.tensor([11])
            out[name] = {
                "chain15": median_ms(partial(runner.draft, first, 16), reps),
                "chain3": median_ms(partial(runner.draft, first, 4), reps),
                "tree15": median_ms(partial(runner.draft_tree, first, 15, [15]), reps),
                "tree63": median_ms(partial(runner.draft_tree, first, 15, [63]), reps),
            }
        finally:
            drafter.__dict__.pop("fused_layers", None)
        print(f"draft ({name}): {out[name]}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", required=True, help="a drafter file for this model")
    ap.add_argument("--widths", default="16,64", help="verify widths, comma list")
    ap.add_argument("--prefix", type=int, default=300, help="cached tokens before a verify pass")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    if args.reps < 1 or any(w < 1 for w in widths) or args.prefix < 1:
        raise SystemExit("--reps, --prefix and every width must be positive")
    llm = LLM(args.model, dtype="int4", drafter=args.drafter)
    model = llm.model
    report = {
        "benchmark": "benchmarks/tree_costs.py",
        "date": now(),
        "command": shlex.join(["python", "benchmarks/tree_costs.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "model": args.model,
        "drafter": args.drafter,
        "prefix": args.prefix,
        "reps": args.reps,
        "verify_ms": verify_costs(model, widths, args.prefix, args.reps),
        "draft_ms": draft_costs(model, args.reps),
    }
    name = Path(args.model).name
    out = args.out or Path("benchmarks/results") / f"tree-costs-{name}.json"
    print(f"wrote {write_results(report, out)}")


if __name__ == "__main__":
    main()
