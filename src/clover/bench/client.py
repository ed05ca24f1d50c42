"""A client of `clover serve` for the serving benchmarks (benchmarks/agent_prefix.py,
prefix_load.py, serve_load.py): start the server on a free port, stream one chat request and
time it as a client sees it, read /metrics, percentiles, the results file.

It needs httpx (the `dev` extra), which the package itself does not.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import httpx

from clover.bench.common import machine, now, write_results


def spawn_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`clover serve FLAGS --port 0` started; -> (process, base URL) from its banner line,
    before it is ready."""
    cmd = [sys.executable, "-m", "clover.cli", "serve", "--port", "0", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    banner = proc.stdout.readline()
    if " at http://" not in banner:
        proc.kill()
        raise SystemExit(f"server did not start: {banner!r}")
    return proc, banner.split(" at ", 1)[1].split(" ", 1)[0]


def start_server(model: str, dtype: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """`clover serve --model MODEL --dtype DTYPE FLAGS` on a free local port; -> (process,
    base URL) once /health says ready (loading included, up to 10 minutes)."""
    proc, url = spawn_server(["--model", model, "--dtype", dtype, *flags])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)


def stream_chat(url: str, body: dict, timeout: float = 900) -> dict:
    """POST a streamed chat request; -> ttft (seconds to the first content, reasoning or
    tool-call delta; the whole time if none came), e2e, content, tool_calls (as sent), usage
    and the last choice's timings."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    content, calls, usage, timings = [], {}, {}, {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta", {})
                text = delta.get("content") or delta.get("reasoning_content")
                if first is None and (text or delta.get("tool_calls")):
                    first = time.perf_counter() - start
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    fn = call.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
                timings = chunk.get("timings") or timings
    end = time.perf_counter() - start
    return {
        "ttft": first if first is not None else end,
        "e2e": end,
        "content": "".join(content),
        "tool_calls": [calls[i] for i in sorted(calls)],
        "usage": usage,
        "timings": timings,
    }


def metrics(url: str, prefix: str = "clover_") -> dict[str, float]:
    """/metrics samples without labels whose names start with `prefix`."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(prefix) and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def write_report(path: str, fields: dict, machine_record: dict | None = None) -> None:
    """`fields` as JSON at `path`, after the date and the machine (`machine_record`, taken
    before the run so that its load average says what else ran; else taken now)."""
    record = machine_record or machine()
    write_results({"date": now(), "machine": record, **fields}, path)
