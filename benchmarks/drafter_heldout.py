"""Drafter files side by side on the held-out prompts of distilled directories, by group.

Usage: python benchmarks/drafter_heldout.py --drafter A.safetensors --drafter B.safetensors \
           --data runs/distill-coder-v2 --data runs/distill-coder-self \
           [--unseen compare,email] [--limit 48] [--copy-bonus 4] \
           [--out benchmarks/results/....json]

The measure is the trainer's (`clover.train.drafter.evaluate`): greedy drafts of a whole block
against the teacher's answer at fixed block starts, the mean leading drafts kept per block and
the first draft's hit rate. Groups: held-out prompts of the kinds trained on, prompts of the
`--unseen` kinds (held out of training whole, so either split), and held-out self-written prompts
(kind "self"); the first `--limit` of each. Every
drafter reads the same records and the same target features (made once, at the drafters'
target precision). `--copy-bonus B`: chain drafters' drafts lean to context copies as the
decoder's do (`DrafterRunner.COPY_BONUS`; 0, the default, measures the drafter alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from clover.engine import LLM
from clover.models.drafter import load_drafter, read_drafter_config
from clover.train.drafter import DrafterTrainConfig, FeatureCache, evaluate, load_sets, loss_head


def groups(cfg: DrafterTrainConfig, limit: int) -> dict[str, list[dict]]:
    """The trainer's held-out sets (its filters; `heldout_kinds` of either split, as training
    leaves those kinds out whole), the self-written prompts apart; the first `limit` of each."""
    _, heldout, unseen = load_sets(replace(cfg, eval_examples=10**9))
    out = {"trained kinds": [r for r in heldout if r["kind"] != "self"],
           "kinds never trained on": unseen,
           "self": [r for r in heldout if r["kind"] == "self"]}  # fmt: skip
    return {g: rs[:limit] for g, rs in out.items() if rs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--data", action="append", required=True)
    ap.add_argument("--unseen", default="compare,email", help="kinds held out of training")
    ap.add_argument("--limit", type=int, default=48, help="records per group")
    ap.add_argument("--dtype", default="int4", help="the target's precision (int4)")
    ap.add_argument("--copy-bonus", type=float, default=0.0,
                    help="lean of chain drafts to context copies (the decoder's: 4)")  # fmt: skip
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    configs = [read_drafter_config(Path(f)) for f in a.drafter]
    if len({c.target for c in configs}) != 1:
        raise SystemExit("the drafters are of different targets")
    c0 = configs[0]
    base = DrafterTrainConfig(target=c0.target, data=a.data, out="", blocks_per_sequence=8,
                              batch_size=8, max_len=448, loss_vocab="draft",
                              copy_bonus=a.copy_bonus,
                              heldout_kinds=[k for k in a.unseen.split(",") if k])  # fmt: skip
    sets = groups(base, a.limit)
    llm = LLM(c0.target, dtype=a.dtype, progress=False)
    target = llm.model
    caches: dict[tuple, FeatureCache] = {}  # features by the layers they are taken from
    result: dict = {"benchmark": "drafter_heldout", "command": " ".join(sys.argv),
                    "target": c0.target, "dtype": a.dtype, "data": a.data,
                    "copy_bonus": a.copy_bonus,
                    "records": {g: len(rs) for g, rs in sets.items()}, "drafters": {}}  # fmt: skip
    for path, c in zip(a.drafter, configs):
        drafter = load_drafter(Path(path), target).float()
        cfg = replace(base, block_size=c.block_size, chain=c.chain)
        cache = caches.setdefault(tuple(c.feature_layers), FeatureCache(8.0))
        head, rows = loss_head(target, drafter, cfg)
        row = {g: evaluate(drafter, target, head, rs, cfg, rows, cache) for g, rs in sets.items()}
        result["drafters"][path] = row
        print(path, json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    with torch.inference_mode(False):
        raise SystemExit(main())
