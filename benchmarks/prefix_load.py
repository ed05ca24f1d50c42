"""A random-prefix load on `clover serve` with a small prefix cache: the cache stays within its
bound, no request fails, and how often prompts hit.

Usage: python benchmarks/prefix_load.py [--model clover-smol-135m] [--dtype auto]
           [--requests 200] [--concurrency 8] [--prefix-cache-mb 64] [--prefixes 12]
           [--max-tokens 16] [--seed 0] [--out benchmarks/results/prefix_load.json]

Prompts form a random tree: a request starts from one of --prefixes shared system prompts
(random lengths, 80-600 words) with a fresh question, or continues an earlier conversation
(its messages, the answer it got, a new question), so prefixes nest and part at random points.
--concurrency client threads send them (streamed, greedy, `--max-running` = concurrency on the
server) while a sampler thread reads /metrics every 50 ms; clover_prefix_cache_bytes must never
pass clover_prefix_cache_capacity_bytes. The default bound is far below the load's working set,
so the cache evicts all along. Reported: failed requests (non-200 or an error event), the most
bytes seen against the bound, evictions, the hit rate (cached / prompt tokens, from each
response's usage) over all requests and over the second half ("warm"), p50/p95 time to first
token, and the server's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

from clover.bench.client import (
    metrics,
    percentile,
    start_server,
    stop_server,
    stream_chat,
    write_report,
)
from clover.bench.common import machine

WORDS = (
    "system agent tool file test error value cache block token prompt answer model server "
    "request batch memory layer state prefix reuse commit draft verify decode plan result "
    "python function class module import return raise check index length buffer thread queue "
    "metric bound evict pin chain hash snapshot turn user assistant message schema json call"
).split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="clover-smol-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefix-cache-mb", type=float, default=64)
    ap.add_argument("--prefixes", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/prefix_load.json")
    args = ap.parse_args()
    machine_record = machine()
    rng = random.Random(args.seed)
    systems = [text(rng, rng.randint(80, 600)) for _ in range(args.prefixes)]
    # per request: (index, continue an earlier conversation?, question, which one)
    plan = [
        (i, rng.random() < 0.5, text(rng, rng.randint(5, 40)), rng.randint(0, 10**9))
        for i in range(args.requests)
    ]
    proc, url = start_server(
        args.model, args.dtype, "--prefix-cache-mb", str(args.prefix_cache_mb),
        "--max-running", str(args.concurrency), "--max-queue", str(4 * args.requests),
        "--served-model-name", "load",
    )  # fmt: skip
    done: list[dict] = []  # per finished request: messages, answer, usage, ttft
    failures: list[str] = []
    lock = threading.Lock()
    order = iter(plan)
    seen = {"max_bytes": 0.0, "capacity": None, "over": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            m = metrics(url, "clover_prefix_cache_")
            seen["capacity"] = m["clover_prefix_cache_capacity_bytes"]
            seen["max_bytes"] = max(seen["max_bytes"], m["clover_prefix_cache_bytes"])
            seen["over"] += m["clover_prefix_cache_bytes"] > seen["capacity"]
            time.sleep(0.05)

    def worker() -> None:
        while True:
            with lock:
                item = next(order, None)
                if item is None:
                    return
                i, follow_up, question, salt = item
                if done and follow_up:  # continue a finished conversation
                    base = done[salt % len(done)]
                    messages = base["messages"] + [
                        {"role": "assistant", "content": base["answer"]},
                        {"role": "user", "content": question},
                    ]
                else:
                    system = systems[salt % len(systems)]
                    messages = [{"role": "system", "content": system},
                                {"role": "user", "content": question}]  # fmt: skip
            body = {"model": "load", "messages": messages, "max_tokens": args.max_tokens,
                    "temperature": 0}  # fmt: skip
            try:
                r = stream_chat(url, body)
            except Exception as e:  # noqa: BLE001 (a failure is what this load counts)
                with lock:
                    failures.append(f"request {i}: {type(e).__name__}: {e}")
                continue
            with lock:
                done.append({"messages": messages, "answer": r["content"], "ttft": r["ttft"],
                             "usage": r["usage"], "order": len(done)})  # fmt: skip
                if len(done) % 20 == 0:
                    print(f"{len(done)}/{args.requests} done", flush=True)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        stop.set()
        sampler.join()
        final = metrics(url, "clover_prefix_cache_")
        rss = peak_rss_mb(proc.pid)
    finally:
        stop.set()
        stop_server(proc)

    def hit_rate(items: list[dict]) -> float:
        prompt = sum(d["usage"]["prompt_tokens"] for d in items)
        cached = sum(d["usage"]["prompt_tokens_details"]["cached_tokens"] for d in items)
        return round(cached / prompt, 4) if prompt else 0.0

    ttfts = [d["ttft"] for d in done]
    summary = {
        "requests": args.requests,
        "completed": len(done),
        "failed": len(failures),
        "capacity_bytes": seen["capacity"],
        "max_bytes_seen": seen["max_bytes"],
        "samples_over_bound": seen["over"],
        "within_bound": seen["over"] == 0 and seen["max_bytes"] <= seen["capacity"],
        "evictions": final.get("clover_prefix_cache_evictions_total"),
        "hit_rate": hit_rate(done),
        "warm_hit_rate": hit_rate(done[len(done) // 2 :]),
        "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
        "ttft_p95_s": round(percentile(ttfts, 95), 3) if ttfts else None,
        "wall_s": round(wall, 1),
        "server_peak_rss_mb": rss,
    }
    write_report(
        args.out,
        {
            "model": args.model,
            "dtype": args.dtype,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "summary": summary,
            "failures": failures[:20],
            "final_metrics": final,
            "command": "python benchmarks/prefix_load.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        },
        machine_record,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
