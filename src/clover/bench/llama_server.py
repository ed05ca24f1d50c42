"""llama.cpp's own server as rows of `clover bench speed`: plain, and with its speculation.

A peer is named `llama-server[:KIND[=ARG]]`:

- `llama-server`: no speculation;
- `llama-server:ngram-mod`: llama.cpp's n-gram speculation with its documented defaults;
- `llama-server:ngram-simple`: the n-gram lookup of `--spec-type ngram-simple` (n=3, m=8);
- `llama-server:draft=MODEL`: a draft model (`--spec-type draft-simple`), MODEL any name or
  GGUF `--model` takes (the 0.5B coder drafting for the 1.5B: same tokenizer);
- `llama-server:dflash=FILE.gguf`: a converted DFlash drafter (`--spec-type draft-dflash`,
  `clover export --format llama.cpp`).

Each row starts one server (the binaries `scripts/build_llamacpp.sh` builds) on a free local
port and sends the prompt token ids our rows get to its `/completion` endpoint: greedy, EOS
ignored, exactly `n` tokens, no prompt cache, so prompt processing is timed as for our rows.
The server's own counters give the drafts it made and kept.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from clover.bench.load import llamacpp_bin
from clover.bench.speed import RunStats
from clover.errors import CloverError

PREFIX = "llama-server"
# `--spec-draft-n-max` and `-p-min` for a draft model: llama.cpp's speculative example values
# (a draft of up to 16 tokens, cut where the draft model's own probability falls under 0.75)
DRAFT_FLAGS = ["--spec-draft-n-max", "16", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0.75"]
KINDS = {
    "": [],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-simple": [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "3",
        "--spec-ngram-simple-size-m",
        "8",
    ],  # fmt: skip
    "draft": ["--spec-type", "draft-simple", *DRAFT_FLAGS],
    "dflash": ["--spec-type", "draft-dflash", "--spec-draft-n-max", "15"],
}
WITH_FILE = ("draft", "dflash")  # the kinds that name a GGUF file


def is_server_peer(name: str) -> bool:
    return name == PREFIX or name.startswith(PREFIX + ":")


def server_flags(name: str, resolve_gguf: object) -> tuple[str, list[str]]:
    """A peer's row label and the llama-server flags it adds: ("ngram-mod", [...]).

    `resolve_gguf(text)` turns a draft model's name into its GGUF path."""
    kind, _, arg = name.removeprefix(PREFIX).removeprefix(":").partition("=")
    if kind not in KINDS:
        raise CloverError(f"peer {name!r}: the kinds are {', '.join(k for k in KINDS if k)}")
    if kind in WITH_FILE and not arg:
        raise CloverError(f"peer {name!r}: {kind} needs a file, e.g. {PREFIX}:{kind}=FILE.gguf")
    if kind not in WITH_FILE and arg:
        raise CloverError(f"peer {name!r}: {kind or PREFIX} takes no argument")
    flags = list(KINDS[kind])
    if arg:
        path = Path(resolve_gguf(arg))
        if not path.is_file():
            raise CloverError(f"peer {name!r}: no GGUF file at {path}")
        flags = ["-md", str(path), *flags]
    return (kind or "plain") + (f" {Path(arg).name}" if arg else ""), flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class LlamaServerEngine:
    """One llama-server process; `run` asks it for one answer at a time (batch 1)."""

    engine = "llama.cpp"

    def __init__(self, gguf: Path, precision: str, threads: int, label: str, flags: list[str],
                 n_ctx: int = 4096, timeout: float = 600) -> None:  # fmt: skip
        bin_dir = llamacpp_bin()
        binary = None if bin_dir is None else bin_dir / "llama-server"
        if binary is None or not binary.is_file():
            raise CloverError("llama-server not found: run scripts/build_llamacpp.sh (or set "
                              "$CLOVER_LLAMACPP_BIN)")  # fmt: skip
        self.precision, self.timeout = precision, timeout
        self.name = f"llama-server {label} {precision}"
        self.port = _free_port()
        self.command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1",
                        "--port", str(self.port), "-t", str(threads), "-c", str(n_ctx),
                        "-np", "1", "--no-webui", *flags]  # fmt: skip
        version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        self.build = " ".join((version.stdout + version.stderr).split()[:6])
        fd, log_path = tempfile.mkstemp(prefix="clover-llama-server-", suffix=".log")
        self.log = Path(log_path)  # its tail explains a server that exits; removed at close
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready()

    def _wait_ready(self, limit: float = 300) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < limit:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-600:]
                self.close()
                raise CloverError(f"{self.name}: llama-server exited ({self.proc.returncode}): "
                                  f"{tail}")  # fmt: skip
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.close()
        raise CloverError(f"{self.name}: llama-server not ready after {limit:.0f} s")

    def run(self, prompts: list[list[int]], n: int) -> RunStats:
        if len(prompts) != 1:
            raise CloverError("the llama-server rows run batch 1")
        body = {"prompt": prompts[0], "n_predict": n, "ignore_eos": True, "temperature": 0.0,
                "top_k": 1, "cache_prompt": False, "stream": False, "return_tokens": True,
                "samplers": ["top_k"]}  # fmt: skip
        t0 = time.perf_counter()
        out = _post(self.url + "/completion", body, self.timeout)
        seconds = time.perf_counter() - t0
        timings = out.get("timings", {})
        drafted, kept = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
        made = int(timings.get("predicted_n", n))
        if made != n:
            raise CloverError(f"{self.name}: asked for {n} tokens, made {made}")
        ttft = timings.get("prompt_ms", 0.0) / 1000
        drafts = {"llama.cpp": [drafted, kept]} if drafted else {}
        # target passes: each commits its kept drafts and one token of its own
        return RunStats(1, n, seconds, float(n - kept), ttft, [out.get("tokens", [])], drafts)

    def peak_rss_mb(self) -> float | None:
        """The server process's peak resident memory (VmHWM), models and caches included."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        kb = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM")), 0)
        return round(kb / 1024, 1) if kb else None

    def describe(self) -> dict:
        return {"build": self.build, "command": " ".join(self.command)}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)
