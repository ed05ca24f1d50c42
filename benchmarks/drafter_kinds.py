"""Drafters' held-out acceptance by prompt kind, the kinds never trained on apart.

Usage: python benchmarks/drafter_kinds.py CONFIG DRAFTER [DRAFTER ...] [--per-kind 48]
       [--out FILE]

CONFIG is a `clover train drafter` config: its target, data directories, `heldout_kinds`,
`max_len`, block size and blocks per answer. Every answer a run on it never trains on (the
held-out answers of trained kinds, every answer of `heldout_kinds`), at most --per-kind of
each kind, goes through the target once; then each drafter file drafts at the same fixed
blocks as the training's held-out measure (`train/drafter.py` `evaluate`): leading drafts kept
per block (`accepted`, of block size - 1) and first-draft accuracy (`first_token`), per kind
and over all trained / never-trained kinds. Writes
benchmarks/results/drafter-kinds-<model>.json unless --out names another file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clover.bench.common import command_line, machine, model_label, now, write_results
from clover.engine import LLM
from clover.errors import CloverError
from clover.models.drafter import load_drafter
from clover.train.drafter import DrafterTrainConfig, kind_report, kind_sets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", help="the drafter training config (YAML)")
    p.add_argument("drafters", nargs="+", help="drafter files of the config's target")
    p.add_argument("--per-kind", type=int, default=48, help="answers per kind, at most")
    p.add_argument("--out")
    a = p.parse_args()
    if a.per_kind < 1:
        p.error("--per-kind must be >= 1")
    try:
        cfg = DrafterTrainConfig.from_yaml(Path(a.config))
        sets = kind_sets(cfg, a.per_kind)
        if not sets:
            raise CloverError(f"{a.config}: its data holds no held-out answers")
        llm = LLM(cfg.target, dtype=cfg.target_dtype, progress=False)
        drafters = {f: load_drafter(Path(f), llm.model) for f in a.drafters}
        report = kind_report(drafters, llm.model, cfg, sets, progress=True)
    except CloverError as e:
        p.exit(1, f"error: {e}\n")
    out = a.out or f"benchmarks/results/drafter-kinds-{model_label(cfg.target)}.json"
    write_results({"benchmark": "benchmarks/drafter_kinds.py", "date": now(),
                   "command": command_line(), "machine": machine(), "target": cfg.target,
                   "target_dtype": cfg.target_dtype, "per_kind": a.per_kind,
                   **report}, out)  # fmt: skip
    names = list(drafters)
    print(f"{'kind':<22}{'answers':>8}  " + "  ".join(f"{i}: kept/block first" for i in
                                                      range(len(names))))  # fmt: skip
    for kind, info in report["kinds"].items():
        cells = [report["drafters"][n]["by_kind"][kind] for n in names]
        label = kind + ("" if info["trained_kind"] else " (never trained)")
        print(f"{label:<22}{info['answers']:>8}  " + "  ".join(
            f"{c['accepted']:>14.2f} {c['first_token']:.2f}" for c in cells))  # fmt: skip
    for group in ("trained_kinds", "never_trained_kinds"):
        cells = [report["drafters"][n].get(group) for n in names]
        if all(cells):
            print(f"{group:<30}  " + "  ".join(
                f"{c['accepted']:>14.2f} {c['first_token']:.2f}" for c in cells))  # fmt: skip
    for i, n in enumerate(names):
        print(f"{i}: {n}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
