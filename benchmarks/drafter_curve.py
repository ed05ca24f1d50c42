"""The learning curve of one drafter run, or of a run and the runs it continued (`init: FILE`).

Usage: python benchmarks/drafter_curve.py runs/drafter-coder runs/drafter-coder-v4 \
           [--out benchmarks/results/drafter-curve-....json]

Runs are given oldest first; each is a `clover train drafter` output directory (its
config.json and metrics.jsonl). Steps and minutes add up across the runs, so a continued run
reads as one curve. Per run: steps, wall minutes (the box: the feature pass included), the
seconds before the first step (the feature pass, estimated from the first steps' pace), the
median seconds a step; per held-out evaluation: the step and minute of the whole chain and the
mean leading drafts kept per block on held-out prompts of trained kinds and of kinds never
trained on; per 100 steps: the training loss and the training batches' acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def read_run(path: Path) -> tuple[dict, list[dict]]:
    try:
        config = json.loads((path / "config.json").read_text())
        lines = (path / "metrics.jsonl").read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"{path}: not a drafter run directory ({e})") from None
    metrics = [json.loads(x) for x in lines if x.strip()]
    if not metrics:
        raise SystemExit(f"{path}: no steps in metrics.jsonl")
    return config, metrics


def means_by(metrics: list[dict], key: str, every: int = 100) -> list[float]:
    out = []
    for i in range(0, len(metrics), every):
        chunk = [m[key] for m in metrics[i : i + every]]
        out.append(round(sum(chunk) / len(chunk), 3))
    return out


def curve(paths: list[Path]) -> dict:
    runs, evals, loss, accepted = [], [], [], []
    step0, minutes0 = 0, 0.0
    for path in paths:
        config, metrics = read_run(path)
        # a run resumed after a stop appends to the same file: keep its last pass over each step
        by_step = {m["step"]: m for m in metrics}
        metrics = [by_step[s] for s in sorted(by_step)]
        gaps = [b["seconds"] - a["seconds"] for a, b in zip(metrics, metrics[1:])]
        per_step = statistics.median(gaps) if gaps else 0.0
        first = metrics[0]
        before = max(0.0, first["seconds"] - first["step"] * per_step)
        last = metrics[-1]
        runs.append({
            "run": str(path),
            "init": config.get("init"),
            "target_dtype": config.get("target_dtype"),
            "loss_positions": config.get("loss_positions", 0),
            "steps": last["step"],
            "minutes": round(last["seconds"] / 60, 1),
            "seconds_before_first_step": round(before),
            "median_step_seconds": round(per_step, 2),
        })  # fmt: skip
        for m in metrics:
            if "heldout" in m:
                evals.append({
                    "step": step0 + m["step"],
                    "minutes": round(minutes0 + m["seconds"] / 60, 1),
                    "run": len(runs) - 1,
                    "heldout": m["heldout"].get("accepted"),
                    "heldout_kinds": (m.get("heldout_kinds") or {}).get("accepted"),
                })  # fmt: skip
        loss += means_by(metrics, "loss")
        accepted += means_by(metrics, "accepted")
        step0 += last["step"]
        minutes0 += last["seconds"] / 60
    return {
        "runs": runs,
        "steps": step0,
        "minutes": round(minutes0, 1),
        "evals": evals,
        "loss_by_100_steps": loss,
        "train_batch_accepted_by_100_steps": accepted,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories, oldest first")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    result = curve(args.runs)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    for e in result["evals"]:
        print(f"step {e['step']:>6}  minute {e['minutes']:>6}  held-out {e['heldout']}  "
              f"unseen kinds {e['heldout_kinds']}", file=sys.stderr)  # fmt: skip
    print(text)


if __name__ == "__main__":
    main()
