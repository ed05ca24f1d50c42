"""AR decoding speed with a float32 vs a bfloat16 K/V cache (attention dtype), side by side.

On CPU Clover keeps the K/V cache, and runs attention, in float32 even when the weights are
int4 / bfloat16 (`clover.models.cache.kv_dtype`): PyTorch's CPU attention kernel is much slower
in bfloat16. This measures what that buys per prompt length, in one process, interleaved.

    python benchmarks/attention_dtype.py --model clover-smol-135m --lengths 128,512,1024,2048,4096

Per prompt length and cache dtype: the prompt is prefilled once, then `--steps` AR decode steps
are timed one by one (greedy; median ms per step); repeated `--reps` times in alternating
order. Also reports whether both caches decoded the same greedy tokens. Writes
benchmarks/results/attention_dtype-<model>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from clover.bench.common import command_line, machine, now, write_results
from clover.engine import LLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> tuple[list, list]:
    """Prefill `prompt` [1, L], then `steps` greedy AR steps -> (ms per step, tokens)."""
    cache = model.make_cache(1)
    times, tokens = [], []
    with torch.inference_mode():
        hidden = model(prompt, cache, "causal")
        token = int(model.logits(hidden[0, -1]).argmax())
        for _ in range(steps):
            t0 = time.perf_counter()
            hidden = model(torch.tensor([[token]]), cache, "causal")
            token = int(model.logits(hidden[0, -1]).argmax())
            times.append((time.perf_counter() - t0) * 1000)
            tokens.append(token)
    return times, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="clover-smol-135m")
    p.add_argument("--dtype", default="auto", help="weights (auto: int4 for the default GGUF)")
    p.add_argument("--lengths", default="128,512,1024,2048,4096")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, progress=False)
    model = llm.model
    lengths = [int(x) for x in a.lengths.split(",")]
    if max(lengths) + a.steps >= model.context_length:
        print(f"lengths must stay below the context ({model.context_length})", file=sys.stderr)
        return 2
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(800))
    ids = llm.tokenizer.encode(text)
    while len(ids) < max(lengths):
        ids = ids + ids
    times: dict = {(n, d): [] for n in lengths for d in DTYPES}
    same = {}
    for rep in range(a.reps):
        for n in lengths:
            prompt = torch.tensor([ids[:n]])
            order = list(DTYPES) if rep % 2 == 0 else list(reversed(DTYPES))
            tokens = {}
            for d in order:
                model.kv_cache_dtype = DTYPES[d]
                step_ms, tokens[d] = decode(model, prompt, a.steps)
                times[(n, d)] += step_ms
            same[n] = tokens["float32"] == tokens["bfloat16"]
            print(f"rep {rep + 1}/{a.reps}, prompt {n}: done", file=sys.stderr, flush=True)
    model.kv_cache_dtype = None
    rows = []
    for n in lengths:
        fp32 = statistics.median(times[(n, "float32")])
        bf16 = statistics.median(times[(n, "bfloat16")])
        rows.append({
            "prompt_tokens": n,
            "ms_per_step_float32_kv": round(fp32, 2),
            "ms_per_step_bfloat16_kv": round(bf16, 2),
            "speedup": round(bf16 / fp32, 3),
            "same_greedy_tokens": same[n],
        })  # fmt: skip
    report = {
        "benchmark": "attention_dtype",
        "model": llm.name,
        "dtype": llm.dtype,
        "steps": a.steps,
        "reps": a.reps,
        "rows": rows,
        "date": now(),
        "machine": machine(),
        "command": command_line(),
    }
    path = write_results(report, Path(a.out) / f"attention_dtype-{llm.name}.json")
    print(f"{'prompt':>7} {'fp32 KV ms':>11} {'bf16 KV ms':>11} {'speedup':>8} same")
    for r in rows:
        print(f"{r['prompt_tokens']:7d} {r['ms_per_step_float32_kv']:11.2f} "
              f"{r['ms_per_step_bfloat16_kv']:11.2f} {r['speedup']:8.2f} "
              f"{r['same_greedy_tokens']}")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
