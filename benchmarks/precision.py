"""Precision side by side on one model: speed and quality of float32 / bfloat16 / int8 / int4.

Usage: python benchmarks/precision.py [--model smollm2-135m] [--tokens 64]
Quality against float32 on the same weights: next-token KL and top-1 agreement, teacher-forced
over the float32 model's own answers (so every precision scores the same text), and how many
greedy answers are token-identical to float32's. Speed: AR greedy output tokens/s at batch 1,
precisions interleaved prompt by prompt. Writes benchmarks/results/precision-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from datetime import UTC, datetime
from pathlib import Path

import torch

from clover.engine import LLM, GenerationSettings

PROMPTS = [
    "Explain why the sky is blue in three sentences.",
    "Write a Python function that checks whether a number is prime.",
    "List four countries in South America and their capitals.",
    "What are the benefits of regular exercise?",
]
DTYPES = ("float32", "bfloat16", "int8", "int4")


def answer(llm: LLM, ids: list[int], n: int) -> tuple[list[int], float]:
    out: list = []
    settings = GenerationSettings(decoder="ar", max_tokens=n)
    for _ in llm.stream([ids], settings, out, cached=False):  # every run prefills in full
        pass
    return out[0].token_ids, out[0].tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llms = {d: LLM(args.model, dtype=d, progress=False) for d in DTYPES}
    prompts = [llms["float32"].chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    speed: dict[str, list[float]] = {d: [] for d in DTYPES}
    exact = dict.fromkeys(DTYPES, 0)
    kl: dict[str, list[float]] = {d: [] for d in DTYPES}
    top1: dict[str, list[float]] = {d: [] for d in DTYPES}
    for ids in prompts:
        reference, _ = answer(llms["float32"], ids, args.tokens)
        seq = torch.tensor([ids + reference])
        with torch.inference_mode():
            ref_logp = llms["float32"].model.logits(llms["float32"].model(seq)).log_softmax(-1)
        for d, llm in llms.items():
            got, tps = answer(llm, ids, args.tokens)
            speed[d].append(tps)
            exact[d] += got == reference
            with torch.inference_mode():
                logp = llm.model.logits(llm.model(seq)).log_softmax(-1)
            span = slice(len(ids) - 1, seq.shape[1] - 1)  # positions predicting the answer
            p_ref = ref_logp[0, span]
            kl[d].append(float((p_ref.exp() * (p_ref - logp[0, span])).sum(-1).mean()))
            top1[d].append(float((p_ref.argmax(-1) == logp[0, span].argmax(-1)).float().mean()))
    base = statistics.median(speed["float32"])
    results = {
        d: {
            "median_tokens_per_s": round(statistics.median(speed[d]), 2),
            "speed_vs_float32": round(statistics.median(speed[d]) / base, 2),
            "mean_kl_vs_float32": round(statistics.mean(kl[d]), 5),
            "top1_agreement": round(statistics.mean(top1[d]), 4),
            "greedy_answers_identical": f"{exact[d]}/{len(prompts)}",
        }
        for d in DTYPES
    }
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "model": args.model,
        "max_tokens": args.tokens,
        "results": results,
        "command": f"python benchmarks/precision.py --model {args.model} --tokens {args.tokens}",
    }
    out = Path(__file__).parent / "results" / f"precision-{args.model}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
