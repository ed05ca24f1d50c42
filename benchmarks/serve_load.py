"""Load on `clover serve`: throughput and latency at several concurrencies, batched vs not.

Usage: python benchmarks/serve_load.py [--model smollm2-135m] [--max-tokens 48]
           [--concurrency 1,4,16] [--requests N] [--batched-running 16]

Starts the server twice on a free local port: once batching up to --batched-running sequences
per forward pass, once with --max-running 1 (one request at a time, the rest queued). At each
concurrency C, C client threads send streaming chat requests back to back until N requests
(default max(12, 2 C)) are done. Reported per level: requests/s and output tokens/s over the
level's wall time, and p50/p95 of the time to first token and of end-to-end latency, as a
client sees them (queueing included). Greedy decoding; prompts cycle through a fixed list.
Writes benchmarks/results/serve_load.json.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx

from clover.bench.client import percentile, start_server, stop_server
from clover.bench.common import machine, now, write_results
from clover.data.bench_prompts import SERVE_PROMPTS


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if first is None and choice["delta"].get("content"):
                    first = time.perf_counter() - start
    end = time.perf_counter() - start
    return {"ttft": first if first is not None else end, "e2e": end, "tokens": tokens}


def run_level(url: str, concurrency: int, total: int, max_tokens: int) -> dict:
    results: list[dict] = []
    counter = iter(range(total))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = one_request(url, SERVE_PROMPTS[i % len(SERVE_PROMPTS)], max_tokens)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 3),
        "output_tokens_per_s": round(tokens / wall, 2),
        "mean_output_tokens": round(tokens / len(results), 1),
        "ttft_p50_s": round(percentile([r["ttft"] for r in results], 50), 3),
        "ttft_p95_s": round(percentile([r["ttft"] for r in results], 95), 3),
        "e2e_p50_s": round(percentile([r["e2e"] for r in results], 50), 3),
        "e2e_p95_s": round(percentile([r["e2e"] for r in results], 95), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, help="per level (default: max(12, 2 x concurrency))")
    ap.add_argument("--batched-running", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/serve_load.json")
    args = ap.parse_args()
    machine_record = machine()
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = {"batched": args.batched_running, "one_at_a_time": 1}
    results: dict[str, dict] = {}
    for mode, running in modes.items():
        proc, url = start_server(
            args.model, args.dtype, "--max-running", str(running), "--max-queue", "1024",
            "--max-tokens", str(args.max_tokens),
        )  # fmt: skip
        try:
            one_request(url, SERVE_PROMPTS[0], 8)  # warm-up
            results[mode] = {}
            for c in levels:
                n = args.requests or max(12, 2 * c)
                results[mode][str(c)] = level = run_level(url, c, n, args.max_tokens)
                print(f"{mode:>14} c={c:<3} {json.dumps(level)}", flush=True)
        finally:
            stop_server(proc)
    ratio = {
        str(c): {
            key: round(results["batched"][str(c)][key] / results["one_at_a_time"][str(c)][key], 2)
            for key in ("requests_per_s", "output_tokens_per_s")
        }
        for c in levels
    }
    report = {
        "date": now(),
        "machine": machine_record,
        "model": args.model,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "decoder": "the model's default",
        "batched_max_running": args.batched_running,
        "results": results,
        "batched_over_one_at_a_time": ratio,
        "command": f"python benchmarks/serve_load.py --model {args.model} --dtype {args.dtype} "
        f"--max-tokens {args.max_tokens} --concurrency {args.concurrency} "
        + (f"--requests {args.requests} " if args.requests else "")
        + f"--batched-running {args.batched_running}",
    }
    write_results(report, args.out)
    print(json.dumps(ratio))


if __name__ == "__main__":
    main()
