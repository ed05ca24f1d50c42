"""Soak test of `clover serve`: mixed traffic for a long while, then a health check.

Usage: python benchmarks/soak.py [--model qwen2.5-coder-0.5b] [--minutes 15] [--concurrency 8]
           [--warmup MINUTES] [--rss-bound 5] [--seed 0] [--server-args "--max-queue 64"]

Starts `clover serve` on a free local port (or drives --url, with --pid for its RSS), then
--concurrency client threads send requests back to back for --minutes: plain and streamed
chat, streams the client drops half way (cancels), tool calls (auto and forced), JSON-schema
answers, Anthropic Messages and Responses requests (streamed and not), completions, and bad
requests (malformed JSON, wrong types, an unknown model, a text/plain body, a lone
surrogate, a refused schema keyword) that must get a 4xx. Answers are short (16-48 tokens).

Reported (printed, and written to benchmarks/results/soak-<model>.json): requests served,
outcomes by class (ok, expected 4xx, unexpected 4xx, 5xx, connection errors, timeouts) and
by kind, p50/p95 latency per kind and overall, the server's RSS after the warm-up and at the
end (sampled every 5 s from /proc), and whether a final request still answers. Warm-up: by
default until the server's prefix cache holds 90% of its bound (/metrics), at most half the
run: filling a bounded cache is not growth (the default bound is the model's size, so RSS
climbs for the first minutes); --warmup MINUTES fixes it instead.
Targets (issue 22): zero 5xx, RSS growth after warm-up under --rss-bound percent, the final
request answers; the exit status is 1 when one is missed. A progress line every 30 s.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from clover.bench import common
from clover.bench.client import spawn_server
from clover.checkpoints.registry import DEFAULT_MODEL
from clover.data.bench_prompts import SOAK_PROMPTS

RESULTS = Path(__file__).parent / "results"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
JSON_HEADERS = {"Content-Type": "application/json"}


def _user(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": rng.choice(SOAK_PROMPTS)}]


# A request: (path, body as bytes or JSON, extra headers, streamed, dropped half way)
Request = tuple[str, bytes | dict, dict, bool, bool]


def _chat(rng: random.Random) -> Request:
    return "/v1/chat/completions", {"messages": _user(rng), "max_tokens": 32}, {}, False, False


def _chat_stream(rng: random.Random) -> Request:
    body = {"messages": _user(rng), "max_tokens": 48, "stream": True}
    return "/v1/chat/completions", body, {}, True, False


def _cancelled(rng: random.Random) -> Request:
    body = {"messages": _user(rng), "max_tokens": 200, "stream": True}
    return "/v1/chat/completions", body, {}, True, True


def _tools(rng: random.Random) -> Request:
    choice = rng.choice(["auto", "required"])
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [{"type": "function", "function": WEATHER}], "tool_choice": choice,
            "max_tokens": 48}  # fmt: skip
    return "/v1/chat/completions", body, {}, False, False


def _json(rng: random.Random) -> Request:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"messages": _user(rng), "response_format": fmt, "max_tokens": 40}
    return "/v1/chat/completions", body, {}, False, False


def _anthropic(rng: random.Random) -> Request:
    stream = rng.random() < 0.5
    tool = {"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}
    body = {"max_tokens": 32, "messages": _user(rng), "tools": [tool], "stream": stream}
    return "/v1/messages", body, {}, stream, False


def _responses(rng: random.Random) -> Request:
    stream = rng.random() < 0.5
    body = {"input": rng.choice(SOAK_PROMPTS), "max_output_tokens": 32, "stream": stream}
    return "/v1/responses", body, {}, stream, False


def _completion(rng: random.Random) -> Request:
    body = {"prompt": rng.choice(SOAK_PROMPTS), "max_tokens": 16}
    return "/v1/completions", body, {}, False, False


BAD_BODIES = [
    ("/v1/chat/completions", b'{"messages": [', {}),
    ("/v1/chat/completions", {"messages": "hi"}, {}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, {}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', {}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
     {"Content-Type": "text/plain"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "a"}}}}, {}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, {}),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, {}),
]  # fmt: skip


def _bad(rng: random.Random) -> Request:
    path, body, headers = rng.choice(BAD_BODIES)
    return path, body, headers, False, False


KINDS = {  # name: (weight, builder, expected)
    "chat": (3, _chat, "ok"),
    "chat_stream": (3, _chat_stream, "ok"),
    "cancelled_stream": (2, _cancelled, "ok"),
    "tools": (2, _tools, "ok"),
    "json_schema": (2, _json, "ok"),
    "anthropic": (2, _anthropic, "ok"),
    "responses": (2, _responses, "ok"),
    "completion": (1, _completion, "ok"),
    "bad_request": (3, _bad, "4xx"),
}


def run_one(client: httpx.Client, url: str, kind: str, rng: random.Random) -> tuple[str, float]:
    """-> (outcome class, seconds)."""
    _, build, expected = KINDS[kind]
    path, body, headers, stream, cancel = build(rng)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**JSON_HEADERS, **headers}
    start = time.monotonic()
    try:
        if stream:
            with client.stream("POST", url + path, content=content, headers=headers) as r:
                status = r.status_code
                lines = 0
                for line in r.iter_lines():
                    lines += 1
                    if cancel and lines >= 6:
                        break  # leaving the block drops the connection: the server cancels
                    if status < 400 and _error_event(line):
                        status = 599  # an error event inside a 200 stream
        else:
            r = client.post(url + path, content=content, headers=headers)
            status = r.status_code
    except httpx.TimeoutException:
        return "timeout", time.monotonic() - start
    except httpx.HTTPError:
        return "connection_error", time.monotonic() - start
    seconds = time.monotonic() - start
    if status >= 500:
        return "5xx", seconds
    if 400 <= status < 500:
        return ("expected_4xx" if expected == "4xx" else "unexpected_4xx"), seconds
    return ("ok" if expected == "ok" else "unexpected_2xx"), seconds


def _error_event(line: str) -> bool:
    """An SSE line that reports an error: Anthropic's and the Responses API's `event: error`,
    or a chat chunk whose payload is an error object."""
    if line == "event: error":
        return True
    if not line.startswith("data: {"):
        return False
    payload = json.loads(line[len("data: ") :])
    return isinstance(payload.get("error"), dict) and "choices" not in payload


def prefix_cache_full(url: str, share: float = 0.9) -> bool:
    """The server's prefix cache holds `share` of its bound (/metrics); False when unknown."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return False
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("clover_prefix_cache_bytes", "clover_prefix_cache_capacity_bytes"):
            values[name] = float(value)
    capacity = values.get("clover_prefix_cache_capacity_bytes", 0.0)
    return capacity > 0 and values.get("clover_prefix_cache_bytes", 0.0) >= share * capacity


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc, url = spawn_server(["--model", model, "--max-queue", "64", *extra])
    wait_ready(url, proc)
    return proc, url


def wait_ready(url: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit("the server exited while loading")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become ready")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=float, help="minutes before the RSS baseline (default: "
                   "until the prefix cache is 90%% full, at most half the run)")  # fmt: skip
    p.add_argument("--rss-bound", type=float, default=5.0, help="allowed RSS growth, percent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="drive a running server instead of starting one")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, for RSS")
    p.add_argument("--server-args", default="", help="extra `clover serve` flags")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    machine_record = common.machine()  # before the server starts: what else runs here

    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
        wait_ready(url)
    else:
        proc, url = start_server(args.model, shlex.split(args.server_args))
        pid = proc.pid
    started = time.monotonic()
    deadline = started + args.minutes * 60
    latest = started + args.minutes / 2 * 60
    warm_at = None if args.warmup is None else started + min(args.warmup * 60, latest - started)
    outcomes: Counter = Counter()
    by_kind: dict[str, Counter] = defaultdict(Counter)
    latency: dict[str, list[float]] = defaultdict(list)
    rss: list[tuple[float, float]] = []
    lock = threading.Lock()
    names = list(KINDS)
    weights = [KINDS[k][0] for k in names]

    def worker(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        with httpx.Client(timeout=httpx.Timeout(120.0)) as client:
            while time.monotonic() < deadline:
                kind = rng.choices(names, weights)[0]
                outcome, seconds = run_one(client, url, kind, rng)
                with lock:
                    outcomes[outcome] += 1
                    by_kind[kind][outcome] += 1
                    if outcome in ("ok", "expected_4xx"):
                        latency[kind].append(seconds)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    next_report = started + 30
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if pid is not None:
            value = rss_mb(pid)
            if value is not None:
                rss.append((now - started, value))
        if warm_at is None and (now >= latest or prefix_cache_full(url)):
            warm_at = now
            print(f"[{(now - started) / 60:5.1f} min] warm: RSS baseline from here", flush=True)
        if now >= next_report:
            with lock:
                done = sum(outcomes.values())
                summary = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
            mem = f", RSS {rss[-1][1]:.0f} MB" if rss else ""
            print(f"[{(now - started) / 60:5.1f} min] {done} requests: {summary}{mem}",
                  flush=True)  # fmt: skip
            next_report += 30
        time.sleep(5 if now + 5 < deadline else 0.5)
    for t in threads:
        t.join()

    final = httpx.post(
        f"{url}/v1/chat/completions", headers=JSON_HEADERS, timeout=120,
        json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16},
    )  # fmt: skip
    final_ok = final.status_code == 200 and bool(final.json()["choices"][0]["message"]["content"])
    warm = [v for t, v in rss if warm_at is not None and t >= warm_at - started]
    rss_start, rss_end = (warm[0], warm[-1]) if warm else (None, None)
    growth = round(100 * (rss_end - rss_start) / rss_start, 2) if warm else None
    all_latency = [s for values in latency.values() for s in values]
    report = {
        "date": common.now(),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "machine": machine_record,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "latency_s": {
            "all": {"p50": percentile(all_latency, 0.5), "p95": percentile(all_latency, 0.95)},
            **{
                k: {"p50": percentile(v, 0.5), "p95": percentile(v, 0.95), "n": len(v)}
                for k, v in sorted(latency.items())
            },  # fmt: skip
        },
        "rss_mb": {
            "warm_after_min": None if warm_at is None else round((warm_at - started) / 60, 2),
            "after_warmup": rss_start,
            "end": rss_end,
            "growth_percent": growth,
            "peak": max((v for _, v in rss), default=None),
        },  # fmt: skip
        "final_request_ok": final_ok,
    }
    misses = []
    if outcomes["5xx"]:
        misses.append(f"{outcomes['5xx']} 5xx")
    if growth is not None and growth >= args.rss_bound:
        misses.append(f"RSS grew {growth}% (bound {args.rss_bound}%)")
    if not final_ok:
        misses.append("the final request failed")
    report["targets_met"] = not misses
    report["misses"] = misses
    if proc is not None:
        proc.terminate()
        proc.wait(60)
    out = args.out or RESULTS / f"soak-{Path(args.model).name}.json"
    common.write_results(report, out)
    print(json.dumps({k: report[k] for k in ("requests", "outcomes", "latency_s", "rss_mb",
                                             "final_request_ok", "misses")}, indent=1))  # fmt: skip
    print(f"wrote {out}")
    return 0 if not misses else 1


if __name__ == "__main__":
    raise SystemExit(main())
