"""Drafter files side by side on the held-out prompts of distilled directories, by group.

Usage: python benchmarks/drafter_heldout.py --drafter A.safetensors --drafter B.safetensors \
           --data runs/distill-coder-v2 --data runs/distill-coder-self \
           [--unseen compare,email] [--limit 48] [--out benchmarks/results/....json]

The measure is the trainer's (`clover.train.drafter.evaluate`): greedy drafts of a whole block
against the teacher's answer at fixed block starts, the mean leading drafts kept per block and
the first draft's hit rate. Groups: held-out prompts of the kinds trained on, prompts of the
`--unseen` kinds (held out of training whole, so either split), and held-out self-written prompts
(kind "self"); the first `--limit` of each. Every
drafter reads the same records and the same target features (made once, at the drafters'
target precision).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from clover.data.distill import load_examples
from clover.engine import LLM
from clover.models.drafter import load_drafter, read_drafter_config
from clover.train.drafter import DrafterTrainConfig, FeatureCache, evaluate, head_weight

MAX_LEN = 448  # the configs' max_len: longer prompts are left out of training and of this


def groups(data: list[str], unseen: set[str], limit: int) -> dict[str, list[dict]]:
    """Held-out records by group; the `unseen` kinds' records of either split (training leaves
    those kinds out whole)."""
    out: dict[str, list[dict]] = {"trained kinds": [], "kinds never trained on": [], "self": []}
    for d in data:
        for r in load_examples(Path(d)):
            if not r["answer_ids"] or len(r["prompt_ids"]) + 2 > MAX_LEN:  # as the trainer
                continue
            if r["kind"] in unseen:
                out["kinds never trained on"].append(r)
            elif r.get("split") == "heldout":
                out["self" if r["kind"] == "self" else "trained kinds"].append(r)
    return {g: rs[:limit] for g, rs in out.items() if rs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--data", action="append", required=True)
    ap.add_argument("--unseen", default="compare,email", help="kinds held out of training")
    ap.add_argument("--limit", type=int, default=48, help="records per group")
    ap.add_argument("--dtype", default="int4", help="the target's precision (int4)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    configs = [read_drafter_config(Path(f)) for f in a.drafter]
    if len({c.target for c in configs}) != 1:
        raise SystemExit("the drafters are of different targets")
    c0 = configs[0]
    sets = groups(a.data, set(filter(None, a.unseen.split(","))), a.limit)
    llm = LLM(c0.target, dtype=a.dtype, progress=False)
    target = llm.model
    caches: dict[tuple, FeatureCache] = {}  # features by the layers they are taken from
    result: dict = {"benchmark": "drafter_heldout", "command": " ".join(sys.argv),
                    "target": c0.target, "dtype": a.dtype, "data": a.data,
                    "records": {g: len(rs) for g, rs in sets.items()}, "drafters": {}}  # fmt: skip
    for path, c in zip(a.drafter, configs):
        drafter = load_drafter(Path(path), target).float()
        cfg = DrafterTrainConfig(target=c.target, data=a.data, out="", block_size=c.block_size,
                                 chain=c.chain, blocks_per_sequence=8, batch_size=8,
                                 max_len=MAX_LEN, loss_vocab="draft")  # fmt: skip
        cache = caches.setdefault(tuple(c.feature_layers), FeatureCache(8.0))
        head, rows = head_weight(target), None
        if drafter.vocab is not None:
            rows = drafter.vocab
            head = head.index_select(0, rows).contiguous()
        row = {g: evaluate(drafter, target, head, rs, cfg, rows, cache) for g, rs in sets.items()}
        result["drafters"][path] = row
        print(path, json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    with torch.inference_mode(False):
        raise SystemExit(main())
