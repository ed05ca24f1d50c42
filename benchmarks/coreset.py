"""Block expert coreset vs per-token routing: experts touched per block step, and the cost.

Usage: python benchmarks/coreset.py [--preset clover-tiny] [--experts 64 --top-k 8]
A Clover-architecture model with random weights (no trained checkpoint of this architecture
exists yet) previews blocks of B = 32 tokens over a committed prefix. For each coreset size it
reports the distinct experts one block step touches (per MoE layer, mean) and the KL /
top-1 agreement of the block's logits against per-token routing. Random weights route
near-uniformly, so this measures the mechanism and an upper bound on disagreement; rerun on
trained weights for the quality cost that matters. Writes benchmarks/results/coreset.json.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

import torch

from clover.models.clover import CloverModel, preset_config
from clover.models.moe import MoE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="clover-tiny")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--block", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    config = preset_config(
        args.preset, num_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=512
    )
    model = CloverModel(config).eval()
    touched: list[int] = []

    def count(module: MoE, inputs: tuple, _output: torch.Tensor) -> None:
        x, groups, coreset = inputs
        for b in range(x.shape[0]):  # distinct experts one row's block step touches
            g = None if groups is None else groups[b]
            _, ids = module.route(x[b], g, coreset)
            touched.append(len(ids.unique()))

    for m in model.modules():
        if isinstance(m, MoE):
            m.register_forward_hook(count)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 512, (4, 64), generator=gen)
    block = torch.randint(3, 512, (4, args.block), generator=gen)
    block[:, ::2] = 0  # half the block still masked
    rows = []
    reference = None
    for coreset in dict.fromkeys((0, args.top_k, 2 * args.top_k, 4 * args.top_k)):
        model.config.block_coreset = coreset
        cache = model.make_cache(4)
        with torch.no_grad():
            model(prefix, cache)
            touched.clear()
            logp = model.logits(model(block, cache, "block")).log_softmax(-1)
        if reference is None:
            reference = logp
        kl = float((reference.exp() * (reference - logp)).sum(-1).mean())
        agree = float((reference.argmax(-1) == logp.argmax(-1)).float().mean())
        rows.append(
            {
                "coreset": coreset or "per-token",
                "experts_touched_per_layer_step": round(sum(touched) / len(touched), 1),
                "kl_vs_per_token": round(kl, 5),
                "top1_agreement": round(agree, 4),
            }
        )
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "setup": f"{args.preset} random weights, {args.experts} experts top-{args.top_k}, "
        f"4 rows x block {args.block} over a 64-token prefix",
        "note": "experts touched: distinct experts per MoE layer for one row's block step",
        "results": rows,
        "command": f"python benchmarks/coreset.py --preset {args.preset} --experts "
        f"{args.experts} --top-k {args.top_k} --block {args.block}",
    }
    out = Path(__file__).parent / "results" / "coreset.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
