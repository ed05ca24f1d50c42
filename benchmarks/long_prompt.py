"""Long prompts: prefill time, block-step time, memory and TPF against prompt length.

Usage: python benchmarks/long_prompt.py [--model smollm2-135m] [--dtype float32]
           [--decoders ar,low_confidence,self_spec] [--max-tokens 24] [--start 256]
           [--max-prompt 2048]

Prompt lengths double from --start up to the model's context or --max-prompt (2048 by default,
to keep a CPU run to a few minutes; the last one is capped so the prompt plus --max-tokens
fits). Per length the prompt (all but its last token) is prefilled
once, causally, and timed; each decoder then starts from a copy of that cache (as a request
joining a running batch does) and decodes greedily with `BatchDecoder`. Every step after the
prefill is a block step over the cached prefix; its mean time is what the prefix cache should
keep nearly flat as the prompt grows. Memory: the process's peak RSS growth over the prefill
and the KV cache's size (from the config).
Writes benchmarks/results/long_prompt-<model>.json and a PNG plot; prints a table and the
fitted slope of block-step time against prompt length (log-log exponent and ms per 1k tokens).
A CPU run with the defaults takes a few minutes.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from clover.decoding.loop import BatchDecoder
from clover.decoding.policies import make_policy
from clover.engine import LLM

RESULTS = Path(__file__).parent / "results"
TEXT = (
    "The history of computing is a story of layers: each generation of machines hides the "
    "details of the one before it, so that people can think about problems instead of wires. "
)


def prompt_ids(llm: LLM, length: int) -> list[int]:
    unit = llm.tokenizer.encode(TEXT)
    ids = (unit * (length // len(unit) + 1))[:length]
    return ids


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def kv_mb(llm: LLM, tokens: int) -> float:
    c = llm.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim
    return per_token * tokens * torch.finfo(next(llm.model.parameters()).dtype).bits / 8 / 2**20


def prefill(llm: LLM, ids: list[int]) -> tuple[object, float, float]:
    """The prompt but its last token, committed causally -> (cache, seconds, RSS growth MB)."""
    cache = llm.model.make_cache(1)
    cache.enable_rollback()  # self_spec needs it; the other decoders ignore it
    rss0, t0 = peak_rss_mb(), time.perf_counter()
    with torch.inference_mode():
        llm.model(torch.tensor([ids[:-1]]), cache, "causal")
    return cache, time.perf_counter() - t0, peak_rss_mb() - rss0


def run(llm: LLM, decoder: str, ids: list[int], cache: object, max_tokens: int, block: int) -> dict:
    policy = make_policy(decoder, block, 0.95)
    batch = BatchDecoder(llm.model)
    row = batch.add(ids, policy, max_new_tokens=max_tokens, eos_token_ids=())
    batch.cache, row.pending = copy.deepcopy(cache), [ids[-1]]  # start after the prefill
    row.result.nfe += 1
    times = []
    while batch.active:
        t0 = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - t0)
    r = row.result
    return {
        "decoder": decoder,
        "prompt_tokens": len(ids),
        "block_step_ms": round(1000 * float(np.mean(times)), 2),
        "steps": len(times),
        "tokens": len(r.tokens),
        "nfe": r.nfe,
        "tpf": round(r.tpf, 3),
        "kv_cache_mb": round(kv_mb(llm, len(ids) + len(r.tokens)), 1),
    }


def slope(rows: list[dict]) -> dict:
    x = np.array([r["prompt_tokens"] for r in rows], dtype=float)
    y = np.array([r["block_step_ms"] for r in rows], dtype=float)
    exponent = float(np.polyfit(np.log(x), np.log(y), 1)[0])
    per_1k = float(np.polyfit(x / 1000, y, 1)[0])
    return {"loglog_exponent": round(exponent, 3), "ms_per_1k_prompt_tokens": round(per_1k, 2)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for decoder, rows in results["runs"].items():
        x = [r["prompt_tokens"] for r in rows]
        axes[0].plot(x, [r["prefill_s"] for r in rows], "o-", label=decoder)
        axes[1].plot(x, [r["block_step_ms"] for r in rows], "o-", label=decoder)
        axes[2].plot(x, [r["tpf"] for r in rows], "o-", label=decoder)
    titles = ["prefill (s)", "block step (ms)", "tokens per forward"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{results['model']} ({results['dtype']}, {results['device']}): long prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--decoders", default="ar,low_confidence,self_spec")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--start", type=int, default=256)
    ap.add_argument("--max-prompt", type=int, default=2048, help="cap (0: the model's context)")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, progress=False)
    context = llm.model.context_length
    if args.max_prompt:
        context = min(context, args.max_prompt)
    lengths, n = [], args.start
    while n < context:
        lengths.append(n)
        n *= 2
    lengths.append(context - args.max_tokens - 1)  # the context's own length, as far as fits
    warm = prompt_ids(llm, 64)
    run(llm, "ar", warm, prefill(llm, warm)[0], 4, args.block_size)  # warm-up
    results = {
        "model": args.model, "dtype": llm.dtype, "device": "cpu",
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "max_tokens": args.max_tokens, "block_size": args.block_size, "runs": {}, "slopes": {},
    }  # fmt: skip
    print(f"{'decoder':<15}{'prompt':>7}{'prefill s':>11}{'step ms':>9}{'TPF':>6}{'KV MB':>7}")
    decoders = args.decoders.split(",")
    for decoder in decoders:
        results["runs"][decoder] = []
    for length in lengths:
        ids = prompt_ids(llm, length)
        cache, seconds, rss = prefill(llm, ids)
        for decoder in decoders:
            r = run(llm, decoder, ids, cache, args.max_tokens, args.block_size)
            r["prefill_s"], r["prefill_rss_growth_mb"] = round(seconds, 3), round(rss, 1)
            results["runs"][decoder].append(r)
            print(
                f"{decoder:<15}{length:>7}{r['prefill_s']:>11.3f}{r['block_step_ms']:>9.1f}"
                f"{r['tpf']:>6.2f}{r['kv_cache_mb']:>7.1f}",
                flush=True,
            )
    for decoder in decoders:
        results["slopes"][decoder] = slope(results["runs"][decoder])
        print(f"{decoder}: block-step time vs prompt length {results['slopes'][decoder]}")
    RESULTS.mkdir(exist_ok=True)
    stem = f"long_prompt-{args.model}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / stem}.json and .png")


if __name__ == "__main__":
    main()
