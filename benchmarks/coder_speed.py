"""Tokens/s and peak RSS at batch 1: Clover's int4 vs llama.cpp on the same GGUF file.

Usage: python benchmarks/coder_speed.py --model qwen2.5-coder-0.5b [--tokens 128] [--reps 3]
Engines (each in its own process, so each peak RSS is its own; the engines take turns, rep by
rep): `clover-int4` (the file's levels: 4-bit types on the int4 kernel, Q5/Q6/Q8 tensors as
8-bit levels in their groups), `clover-int4-wide4` (the wider types rounded to 4 bits: all
int4, packed projections, the fused layer path), `llama.cpp` (llama-cpp-python on the GGUF
as it is; skipped with a note when it is not installed). Greedy AR decoding of --tokens
output tokens (EOS ignored) over the chat-templated prompts; tok/s counts output tokens
over the whole call (prefill included), like `clover bench speed`. Threads: --threads
(default: every core this process may use). Writes
benchmarks/results/coder-speed-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function `is_palindrome(s)` that ignores case and spaces.",
    "Explain what a Python generator is, with a short example.",
    "Write a SQL query that returns the ten customers with the most orders.",
]
ENGINES = ("clover-int4", "clover-int4-wide4", "llama.cpp")


def child(engine: str, model: str, tokens: int, prompts: int, threads: int) -> dict:
    """Load one engine, run every prompt once -> {tok_s: [...], peak_rss_mb, load_s}."""
    import torch

    torch.set_num_threads(threads)
    from clover.checkpoints import load, resolve

    t0 = time.perf_counter()
    rates = []
    if engine.startswith("clover"):
        from clover.decoding.loop import generate
        from clover.decoding.policies import make_policy

        loaded = load(model, dtype="int4", progress=False,
                      wide="int4" if engine.endswith("wide4") else "int8")  # fmt: skip
        tok = loaded.tokenizer
        load_s = time.perf_counter() - t0
        for text in PROMPTS[:prompts]:
            messages = [{"role": "user", "content": text}]
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
            start = time.perf_counter()
            # no EOS ids: exactly `tokens` tokens, as llama.cpp with EOS banned
            for _ in generate(loaded.model, [ids], make_policy("ar"), max_new_tokens=tokens):
                pass
            rates.append(tokens / (time.perf_counter() - start))
    else:
        import llama_cpp

        path = resolve(model, progress=False).path
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=threads,
                              n_batch=512, verbose=False)  # fmt: skip
        load_s = time.perf_counter() - t0
        for text in PROMPTS[:prompts]:
            start = time.perf_counter()
            out = llm.create_chat_completion(
                [{"role": "user", "content": text}], max_tokens=tokens, temperature=0.0,
                logit_bias={t: -1e9 for t in (llm.token_eos(),)},
            )  # fmt: skip
            n = out["usage"]["completion_tokens"]
            rates.append(n / (time.perf_counter() - start))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tok_s": rates, "peak_rss_mb": round(rss, 1), "load_s": round(load_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.tokens, args.prompts, args.threads)))
        return

    import importlib.util

    engines = [e for e in args.engines.split(",") if e]
    notes = []
    if "llama.cpp" in engines and importlib.util.find_spec("llama_cpp") is None:
        engines.remove("llama.cpp")
        notes.append("llama.cpp skipped: llama-cpp-python is not installed")
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for rep in range(args.reps):
        for engine in engines if rep % 2 == 0 else reversed(engines):
            cmd = [sys.executable, __file__, "--child", engine, "--model", args.model,
                   "--tokens", str(args.tokens), "--prompts", str(args.prompts),
                   "--threads", str(args.threads)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{engine} failed:\n{done.stderr[-2000:]}")
            runs[engine].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(engine, runs[engine][-1], flush=True)
    rows = {}
    for engine, results in runs.items():
        rates = [r for res in results for r in res["tok_s"]]
        rows[engine] = {
            "median_tok_s": round(statistics.median(rates), 2),
            "min_tok_s": round(min(rates), 2),
            "max_tok_s": round(max(rates), 2),
            # a first load may convert the GGUF (once per machine): its peak is reported apart
            "peak_rss_mb": max(res["peak_rss_mb"] for res in results[1:] or results),
            "first_run_peak_rss_mb": results[0]["peak_rss_mb"],
            "rss_mb_per_run": [res["peak_rss_mb"] for res in results],
            "load_s": statistics.median(res["load_s"] for res in results),
        }
    if "llama.cpp" in rows:
        for row in rows.values():
            row["vs_llama_cpp"] = round(row["median_tok_s"] / rows["llama.cpp"]["median_tok_s"], 3)
    out = {
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": platform.machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rows": rows,
        "notes": notes,
    }
    path = Path(__file__).parent / "results" / f"coder-speed-{args.model}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    print(path)


if __name__ == "__main__":
    main()
