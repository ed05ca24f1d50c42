"""Decoders side by side on one model: tokens/s, NFE, TPF and agreement with AR greedy.

Usage: python benchmarks/decoders.py [--model smollm2-135m] [--dtype auto] [--tokens 64]
Each decoder setting answers the same chat prompts greedily, interleaved prompt by prompt,
at batch 1. Tokens/s counts output tokens only, over the whole call (prefill included).
`exact` counts answers token-identical to `ar`.
Writes benchmarks/results/decoders-<model>-<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
from datetime import UTC, datetime
from pathlib import Path

import torch

from clover.engine import LLM, GenerationSettings

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give three tips for better sleep.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning' into Spanish and French.",
    "What is 12 times 7? Answer briefly.",
]
SETTINGS = [
    ("ar", 1),
    ("self_spec", 2),
    ("self_spec", 3),
    ("self_spec", 4),
    ("self_spec", 8),
    ("low_confidence", 8),
    ("low_confidence", 32),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--label", help="name in the results file (default: from --model)")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, progress=False)
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    stats = {f"{d}/{b}": {"tps": [], "tokens": 0, "nfe": 0, "exact": 0} for d, b in SETTINGS}
    for ids in prompts:
        reference = None
        for decoder, block in SETTINGS:
            s = GenerationSettings(
                decoder=decoder, block_size=block, threshold=args.threshold, max_tokens=args.tokens
            )
            out: list = []
            for _ in llm.stream([ids], s, out, cached=False):  # every run prefills in full
                pass
            c = out[0]
            entry = stats[f"{decoder}/{block}"]
            entry["tps"].append(c.tokens_per_s)
            entry["tokens"] += c.output_tokens
            entry["nfe"] += c.nfe
            reference = c.token_ids if reference is None else reference
            entry["exact"] += c.token_ids == reference
    ar_tps = statistics.median(stats["ar/1"]["tps"])
    table = {
        k: {
            "median_tokens_per_s": round(statistics.median(v["tps"]), 2),
            "speed_vs_ar": round(statistics.median(v["tps"]) / ar_tps, 2),
            "tpf": round(v["tokens"] / v["nfe"], 3),
            "exact_vs_ar": f"{v['exact']}/{len(prompts)}",
        }
        for k, v in stats.items()
    }
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "model": args.model,
        "dtype": llm.dtype,
        "max_tokens": args.tokens,
        "threshold": args.threshold,
        "results": table,
        "command": f"python benchmarks/decoders.py --model {args.model} --dtype {args.dtype} "
        f"--tokens {args.tokens}",
    }
    label = args.label or "-".join(Path(args.model).parts[-2:]) if "/" in args.model else args.model
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", args.label or label)
    out_path = Path(__file__).parent / "results" / f"decoders-{label}-{llm.dtype}.json"
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
