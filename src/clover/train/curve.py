"""The learning curve of one drafter run, or of a run and the runs it continued (`init: FILE`).

Each run is a `clover train drafter` output directory (its config.json and metrics.jsonl),
given oldest first. Steps and minutes add up across the runs, so a continued run reads as one
curve. Per run: steps, wall minutes (the feature pass included), the seconds before the first
step (the feature pass, estimated from the first steps' pace), the median seconds a step; per
held-out evaluation: the step and minute of the whole chain and the mean leading drafts kept
per block on held-out prompts of trained kinds and of kinds never trained on; per 100 steps:
the training loss and the training batches' acceptance. `benchmarks/drafter_curve.py` prints
and writes it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from clover.errors import CloverError


def read_run(path: Path) -> tuple[dict, list[dict]]:
    """A run directory -> (its config.json, its metrics.jsonl lines)."""
    try:
        config = json.loads((path / "config.json").read_text())
        lines = (path / "metrics.jsonl").read_text().splitlines()
    except OSError as e:
        raise CloverError(f"{path}: not a drafter run directory ({e})") from None
    metrics = [json.loads(x) for x in lines if x.strip()]
    if not metrics:
        raise CloverError(f"{path}: no steps in metrics.jsonl")
    return config, metrics


def means_by(metrics: list[dict], key: str, every: int = 100) -> list[float]:
    """The mean of `key` over each `every` consecutive steps."""
    out = []
    for i in range(0, len(metrics), every):
        chunk = [m[key] for m in metrics[i : i + every]]
        out.append(round(sum(chunk) / len(chunk), 3))
    return out


def curve(paths: list[Path]) -> dict:
    """Run directories, oldest first -> one curve (see the module docstring)."""
    runs, evals, loss, accepted = [], [], [], []
    step0, minutes0 = 0, 0.0
    for path in paths:
        config, metrics = read_run(path)
        # a run resumed after a stop appends to the same file: keep its last pass over each step
        by_step = {m["step"]: m for m in metrics}
        # step 0: a drafter trained before, measured on this run's data before its first step
        start = by_step.pop(0, None)
        if start is not None and "heldout" in start:
            evals.append({"step": step0, "minutes": round(minutes0, 1), "run": len(runs),
                          "heldout": start["heldout"].get("accepted"),
                          "heldout_first_token": start["heldout"].get("first_token"),
                          "heldout_kinds": (start.get("heldout_kinds") or {}).get("accepted"),
                          "start": True})  # fmt: skip
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
                    "heldout_first_token": m["heldout"].get("first_token"),
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
