"""A trained drafter's draft vocabulary: what it costs in acceptance, what it saves in training.

Usage: python benchmarks/drafter_vocab.py --config configs/drafter-cpu.yaml \
           --drafter runs/drafter-2h/drafter.safetensors [--examples 96]

- Held-out acceptance (leading drafts per block, as training reports it) of the drafter drafting
  from every token and from its draft vocabulary, on held-out records of trained kinds and on
  the kinds the run never trained on.
- One training step (loss + backward over 4 batches, the target's features computed first)
  with the loss over the whole LM head and over the draft vocabulary's rows (`loss_vocab`),
  best of 3, side by side.
- What building the vocabulary's head rows costs (`quant.head_rows`), once per drafter.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from clover.engine import LLM
from clover.models.drafter import load_drafter, new_drafter
from clover.quant import head_rows
from clover.train.drafter import (
    DrafterTrainConfig,
    block_starts,
    draft_vocabulary,
    drafter_loss,
    evaluate,
    head_weight,
    load_sets,
    target_features,
)


def acceptance(cfg: DrafterTrainConfig, target: torch.nn.Module, path: Path) -> dict:
    drafter = load_drafter(path, target).float()
    _, heldout, unseen = load_sets(cfg)
    head, vocab = head_weight(target), drafter.vocab
    out = {"vocab_ids": 0 if vocab is None else len(vocab), "records": [len(heldout), len(unseen)]}
    for name, v in (("all_tokens", None), ("draft_vocab", vocab)):
        drafter.vocab = v
        out[name] = {
            "heldout": evaluate(drafter, target, head, heldout, cfg),
            "heldout_kinds": evaluate(drafter, target, head, unseen, cfg),
        }
    drafter.vocab = vocab
    return out


def step_seconds(cfg: DrafterTrainConfig, target: torch.nn.Module) -> dict:
    train, _, _ = load_sets(cfg)
    torch.manual_seed(0)
    drafter = new_drafter(
        target, cfg.target, num_hidden_layers=cfg.layers, block_size=cfg.block_size
    ).float()
    drafter.set_vocab(draft_vocabulary(train, drafter.config.vocab_size, cfg.draft_vocab or 16384))
    head, rows = head_weight(target), drafter.vocab
    sub = head.index_select(0, rows).contiguous()
    rng, batches = random.Random(0), []
    for i in range(4):
        chunk = train[i * cfg.batch_size : (i + 1) * cfg.batch_size]
        feats, n, ids = target_features(target, chunk, drafter.config.feature_layers, cfg.max_len)
        starts = block_starts(chunk, n, cfg.blocks_per_sequence, rng)
        batches.append({"feats": feats, "n": n, "ids": ids, "records": chunk, "starts": starts})
    times: dict[str, list[float]] = {"all": [], "draft": []}
    for _ in range(3):
        for name, h, r in (("all", head, None), ("draft", sub, rows)):
            t0 = time.perf_counter()
            for b in batches:
                loss, _ = drafter_loss(drafter, target, h, b, cfg, r)
                loss.backward()
                drafter.zero_grad(set_to_none=True)
            times[name].append((time.perf_counter() - t0) / len(batches))
    best = {k: round(min(v), 3) for k, v in times.items()}
    return {"seconds_per_step": best, "all_over_draft": round(best["all"] / best["draft"], 2),
            "vocab_ids": len(rows), "vocab_size": head.shape[0]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the drafter's training config (YAML)")
    ap.add_argument("--drafter", required=True, help="the trained drafter file")
    ap.add_argument("--examples", type=int, default=96, help="held-out records per set")
    a = ap.parse_args()
    cfg = DrafterTrainConfig.from_yaml(Path(a.config), eval_examples=a.examples)
    target = LLM(cfg.target, dtype=cfg.target_dtype, progress=False).model
    for p in target.parameters():
        p.requires_grad_(False)
    out = {"command": f"python benchmarks/drafter_vocab.py --config {a.config} --drafter "
                      f"{a.drafter} --examples {a.examples}"}  # fmt: skip
    out["acceptance"] = acceptance(cfg, target, Path(a.drafter))
    out["training_step"] = step_seconds(cfg, target)
    vocab = load_drafter(Path(a.drafter), target).vocab
    if vocab is not None:
        t0 = time.perf_counter()
        head_rows(target, vocab)
        out["head_rows_seconds"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
