"""`clover bench load`: how fast a model starts and how much memory and disk it takes, against
llama.cpp on the same GGUF, in one run.

Per model, each in a fresh child process (so every peak is that process's own, VmHWM):
- first-ever start: a cache that holds nothing for this GGUF (the kernels' build and the
  machine's pass costs are shared with the user's cache, so only the model's own first-use
  work is timed: packing, tokenizer conversion);
- warm starts: the same cache afterwards, `reps` times (the fastest is the figure);
- load: seconds from `LLM(...)` to ready, and the peak RSS when it returns; answer: the peak
  RSS after a greedy answer of `tokens` tokens to one coding prompt; a first start's figure is
  the larger of its own and its children's (the tokenizer converts in a child process);
- disk: bytes the cache keeps for the GGUF beyond the file itself.
llama.cpp: `llama-completion` (scripts/build_llamacpp.sh) loading the same file, its own
"load time", and its peak RSS for a 1-token and a `tokens`-token answer to the same prompt.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from clover.checkpoints import resolve
from clover.data.bench_prompts import LOAD_PROMPT
from clover.errors import CloverError
from clover.files import cache_dir

SHARED = ("kernels", "costs", "models")  # kept from the user's cache in a first-ever start

CHILD = """
import json, sys, time
from clover.bench.common import peak_rss_mb
from clover.engine import LLM, GenerationSettings
t = time.perf_counter()
llm = LLM(sys.argv[1], progress=False)
load_s = time.perf_counter() - t
rss_load = peak_rss_mb()
prompt = llm.chat_prompt([{"role": "user", "content": sys.argv[2]}])
settings = llm.default_settings(GenerationSettings(max_tokens=int(sys.argv[3])))
[c] = llm.generate([prompt], settings)
import resource  # a first start converts the tokenizer in a child: its peak counts too
child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"load_s": round(load_s, 3), "rss_load_mb": round(rss_load, 1),
                  "rss_answer_mb": round(peak_rss_mb(), 1), "rss_children_mb": round(child, 1),
                  "tokens": c.output_tokens, "tok_s": round(c.tokens_per_s, 2),
                  "dtype": llm.dtype}))
"""


def _clover_child(model: str, tokens: int, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, model, LOAD_PROMPT, str(tokens)],
                          env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise CloverError(f"clover load of {model} failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fresh_cache(root: Path) -> dict:
    """An environment whose cache shares only SHARED with the user's."""
    user = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    for name in SHARED:
        (user / name).mkdir(exist_ok=True)
        (root / name).symlink_to(user / name)
    return {**os.environ, "CLOVER_CACHE": str(root)}


def _disk_beyond(cache_root: Path) -> int:
    """Bytes the cache holds for GGUF files (their entries), not counting shared folders."""
    entries = cache_root / "gguf"
    return (
        sum(f.stat().st_size for f in entries.rglob("*") if f.is_file()) if entries.is_dir() else 0
    )


def clover_rows(model: str, tokens: int, reps: int, log: object = print) -> dict:
    with tempfile.TemporaryDirectory(prefix="clover-bench-load-") as tmp:
        env = _fresh_cache(Path(tmp) / "cache")
        log(f"{model}: first-ever start (nothing cached for it)")
        first = _clover_child(model, tokens, env)
        warm = []
        for i in range(reps):
            log(f"{model}: warm start {i + 1}/{reps}")
            warm.append(_clover_child(model, tokens, env))
        disk = _disk_beyond(Path(tmp) / "cache")
    best = min(warm, key=lambda r: r["load_s"])
    return {
        "first": first,
        "warm": warm,
        "load_s_warm": best["load_s"],
        "load_s_first": first["load_s"],
        "rss_load_mb": max(r["rss_load_mb"] for r in warm),
        "rss_answer_mb": max(r["rss_answer_mb"] for r in warm),
        "rss_first_mb": max(first["rss_answer_mb"], first["rss_children_mb"]),
        "disk_beyond_gguf_bytes": disk,
    }


def llamacpp_bin() -> Path | None:
    """The folder of llama.cpp's tools: $CLOVER_LLAMACPP_BIN, else what
    scripts/build_llamacpp.sh built into the cache."""
    given = os.environ.get("CLOVER_LLAMACPP_BIN")
    if given:
        return Path(given)
    found = sorted((cache_dir() / "llama.cpp").glob("*/build/bin/llama-completion"))
    return found[-1].parent if found else None


def _llamacpp_child(binary: Path, gguf: Path, tokens: int, threads: int) -> dict:
    command = [str(binary), "-m", str(gguf), "-p", LOAD_PROMPT, "-n", str(tokens), "--temp", "0",
               "-t", str(threads), "-no-cnv", "--no-warmup", "-c", "2048"]  # fmt: skip
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    _, err = proc.communicate()
    if proc.returncode:
        raise CloverError(f"{binary.name} failed: {err.strip()[-400:]}")
    load = re.search(r"load time =\s*([\d.]+) ms", err)
    evals = [ln for ln in err.splitlines() if "eval time" in ln and "prompt eval" not in ln]
    gen = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", evals[-1] if evals else "")
    return {"load_s": round(float(load.group(1)) / 1000, 3) if load else None,
            "tok_s": round(int(gen.group(2)) / float(gen.group(1)) * 1000, 2) if gen else None,
            "command": " ".join(command)}  # fmt: skip


def _peak_of(command: list[str]) -> float:
    """Peak RSS (MB) of a child run to its end (its own rusage, from wait4)."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise CloverError(f"{command[0]} exited with status {status}")
    return round(usage.ru_maxrss / 1024, 1)


def llamacpp_rows(gguf: Path, tokens: int, reps: int, threads: int, log: object = print) -> dict:
    bin_dir = llamacpp_bin()
    binary = None if bin_dir is None else bin_dir / "llama-completion"
    if binary is None or not binary.is_file():
        return {"skipped": "llama-completion not found: run scripts/build_llamacpp.sh (or set "
                           "$CLOVER_LLAMACPP_BIN)"}  # fmt: skip
    runs = []
    for i in range(reps):
        log(f"llama.cpp {gguf.name}: run {i + 1}/{reps}")
        runs.append(_llamacpp_child(binary, gguf, tokens, threads))
    base = [str(binary), "-m", str(gguf), "-p", LOAD_PROMPT, "--temp", "0", "-t", str(threads),
            "-no-cnv", "--no-warmup", "-c", "2048"]  # fmt: skip
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return {
        "load_s_warm": min(r["load_s"] for r in runs if r["load_s"] is not None),
        "tok_s": max((r["tok_s"] for r in runs if r["tok_s"]), default=None),
        "rss_load_mb": _peak_of([*base, "-n", "1"]),
        "rss_answer_mb": _peak_of([*base, "-n", str(tokens)]),
        "disk_beyond_gguf_bytes": 0,
        "build": f"{bin_dir} ({' '.join((version.stdout + version.stderr).split()[:6])})",
        "command": runs[0]["command"],
    }


def run_load(models: list[str], tokens: int = 256, reps: int = 3, threads: int = 2,
             log: object = print) -> dict:  # fmt: skip

    rows = {}
    for model in models:
        resolved = resolve(model, progress=False)
        if resolved.kind != "gguf":
            raise CloverError(f"{model}: `clover bench load` compares GGUF files with llama.cpp")
        gguf = resolved.path
        ours = clover_rows(model, tokens, reps, log)
        peer = llamacpp_rows(gguf, tokens, reps, threads, log)
        row = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "clover": ours,
               "llama.cpp": peer}  # fmt: skip
        if "skipped" not in peer:
            row["ratios"] = {
                "load_warm": round(ours["load_s_warm"] / peer["load_s_warm"], 2),
                "rss_answer": round(ours["rss_answer_mb"] / peer["rss_answer_mb"], 2),
            }
        row["disk_beyond_gguf_x"] = round(ours["disk_beyond_gguf_bytes"] / row["gguf_bytes"], 3)
        rows[model] = row
    return {
        "prompt": LOAD_PROMPT,
        "tokens": tokens,
        "reps": reps,
        "threads": threads,
        "models": rows,
    }


def format_load(report: dict) -> str:
    lines = [f"{'model':<22} {'engine':<10} {'load warm':>10} {'first':>8} {'RSS load':>9} "
             f"{'RSS answer':>11} {'disk+':>8}"]  # fmt: skip
    for model, row in report["models"].items():
        ours, peer = row["clover"], row["llama.cpp"]
        disk = row["disk_beyond_gguf_x"]
        lines.append(f"{model:<22} {'clover':<10} {ours['load_s_warm']:>9.2f}s "
                     f"{ours['load_s_first']:>7.1f}s {ours['rss_load_mb']:>7.0f}MB "
                     f"{ours['rss_answer_mb']:>9.0f}MB {disk:>7.2f}x")  # fmt: skip
        if "skipped" in peer:
            lines.append(f"{'':<22} llama.cpp  skipped: {peer['skipped']}")
        else:
            lines.append(f"{'':<22} {'llama.cpp':<10} {peer['load_s_warm']:>9.2f}s {'':>8} "
                         f"{peer['rss_load_mb']:>7.0f}MB {peer['rss_answer_mb']:>9.0f}MB "
                         f"{0:>7.2f}x")  # fmt: skip
    return "\n".join(lines)


def _main() -> None:  # python -m clover.bench.load MODEL...: a quick look without the CLI
    report = run_load(sys.argv[1:] or ["qwen2.5-coder-0.5b"])
    print(format_load(report))


if __name__ == "__main__":
    _main()
