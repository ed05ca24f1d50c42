"""Recipe comparison for `clover train adapt`: the same budget for every variant.

Each variant runs the first `--until` steps of the same schedule (`configs/adapt-cpu.yaml` with
the variant's changes), so they are compared at the same point, and the winner can be resumed
to the end (that is how the shipped adapter was made). The comparable number is the held-out
*draft acceptance* at block 4 (fully masked blocks, as a self-speculative draft sees them): the
mean number of leading drafted positions equal to the teacher's token ("accept", what a
self_spec pass keeps beyond its one exact token) and the per-position accuracy ("pos_acc").
Held-out losses are printed too, but CE and KL are different numbers, and full fine-tuning
also scores the (easy) first block position, so losses compare only within a loss type.

    python benchmarks/adapt_recipes.py --runs runs/cmp --until 48          # run + summarize
    python benchmarks/adapt_recipes.py --runs runs/cmp --summarize-only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

VARIANTS = {
    "A adapter r32, KL, block 4, two copies, bf16": {"block_sizes": [4]},
    "B as A, hard-token CE": {"block_sizes": [4], "loss": "ce"},
    "D as A, mixed blocks {2,4,8}": {"block_sizes": [2, 4, 8]},
    "F partial: adapter on last 10 layers, r64, no mask vector": {
        "block_sizes": [4], "adapter_layers": "last:10", "mask_embedding": False,
        "rank": 64, "alpha": 64.0,
    },
    "G full fine-tune (+0.5 AR loss, lr 5e-5)": {
        "block_sizes": [4], "trainable": "full", "lr": 5e-5, "ar_weight": 0.5,
    },
    "H as A, float32 (no bf16 autocast)": {"block_sizes": [4], "autocast_bf16": False},
    "E as A, one copy, complementary across epochs, batch 16": {
        "block_sizes": [4], "noise": "complement_epochs", "batch_size": 16,
    },
    "I as A, + 0.3 x confidence (entropy of correct predictions)": {
        "block_sizes": [4], "confidence_weight": 0.3,
    },
}  # fmt: skip


def base_config(args: argparse.Namespace) -> object:
    from clover.train.adapt import TrainConfig

    cfg = TrainConfig.from_yaml(Path(args.config), data=args.data)
    return replace(cfg, steps=args.steps, max_len=args.max_len, save_every=args.until,
                   eval_every=args.until)  # fmt: skip


def run(args: argparse.Namespace) -> None:
    from clover.train.adapt import train

    base = base_config(args)
    for name, changes in VARIANTS.items():
        key = name.split()[0]
        out = Path(args.runs) / key
        if (out / "done").exists():
            continue
        cfg = replace(base, out=str(out), **changes)
        t0 = time.perf_counter()
        print(f"{name} ...", file=sys.stderr, flush=True)
        train(cfg, progress=False, until=args.until)
        (out / "seconds").write_text(f"{time.perf_counter() - t0:.0f}\n")
        (out / "done").touch()


def summarize(args: argparse.Namespace) -> dict:
    rows = {}
    for name in VARIANTS:
        out = Path(args.runs) / name.split()[0]
        path = out / "metrics.jsonl"
        if not path.exists():
            continue
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        evals = [x for x in lines if "heldout" in x]
        if not evals:
            continue
        last = evals[-1]
        seconds = (out / "seconds").read_text().strip() if (out / "seconds").exists() else None
        cfg = json.loads((out / "config.json").read_text())
        rows[name] = {
            "step": last["step"],
            "heldout": last["heldout"],
            "heldout_at_steps": {x["step"]: x["heldout"] for x in evals},
            "train_tokens_per_s": last["tokens_per_s"],
            "answer_tokens_seen": sum(x["tokens"] for x in lines),
            "wall_seconds": None if seconds is None else int(seconds),
            "config": {
                k: cfg[k]
                for k in (
                    "trainable",
                    "loss",
                    "block_sizes",
                    "noise",
                    "autocast_bf16",
                    "batch_size",
                    "lr",
                )
            },  # fmt: skip
        }
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", default="runs/cmp")
    p.add_argument("--config", default="configs/adapt-cpu.yaml")
    p.add_argument("--data", default="runs/distill")
    p.add_argument("--steps", type=int, default=240, help="the schedule every variant shares")
    p.add_argument("--until", type=int, default=48, help="steps each variant runs")
    p.add_argument("--max-len", type=int, default=112)
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--out", default="benchmarks/results/adapt-recipes.json")
    a = p.parse_args()
    if not a.summarize_only:
        run(a)
    rows = summarize(a)
    from clover.bench.common import machine, now

    report = {"date": now(), "machine": machine(), "command": " ".join(sys.argv),
              "budget": {"steps_of_schedule": a.steps, "until": a.until, "max_len": a.max_len},
              "variants": rows}  # fmt: skip
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'variant':62} {'accept':>6} {'pos_acc':>7} {'loss':>6} {'tok/s':>6} {'wall s':>6}")
    for name, r in rows.items():
        h, nan = r["heldout"], float("nan")
        acc, pos = h.get("accept", nan), h.get("pos_acc", nan)
        print(
            f"{name:62} {acc:6.3f} {pos:7.3f} {h['masked']:6.3f} "
            f"{r['train_tokens_per_s']:6.1f} {r['wall_seconds'] or 0:6}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
