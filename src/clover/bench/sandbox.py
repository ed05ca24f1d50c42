"""Run a model's Python answer against asserts in a child process with time and memory limits.

Generated code is untrusted: it runs in a fresh interpreter (`-I`: no user site, no
environment variables read), in an empty temporary directory, under an address-space limit,
a CPU-time limit and no core files (`resource.setrlimit`, set by a prologue before the answer's
code runs: a `preexec_fn` is unsafe in a process with threads, as torch's), and with a
wall-clock timeout on top. This keeps a runaway loop or allocation from hurting the
benchmark; it is not a security boundary against hostile code (the child can still read files
and open sockets), which is fine for answers to our own suite.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


@dataclass
class CodeResult:
    passed: bool
    reason: str  # "passed", "failed", "error", "timeout", "memory", "no code"
    detail: str = ""  # the tail of stderr


def extract_code(answer: str) -> str:
    """The Python code in an answer: the fenced blocks if any (joined), else the text from the
    first `def`/`import`/`from` line on."""
    blocks = [b for b in _FENCE.findall(answer) if b.strip()]
    if blocks:
        return "\n\n".join(blocks)
    lines = answer.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*(def |import |from \w)", line):
            return "\n".join(lines[i:])
    return ""


def _prologue(memory_mb: int, cpu_s: float) -> str:
    mem = memory_mb * 1024 * 1024
    cpu = max(1, int(cpu_s + 0.999))
    return (
        "import resource as _r\n"
        f"_r.setrlimit(_r.RLIMIT_AS, ({mem}, {mem}))\n"
        f"_r.setrlimit(_r.RLIMIT_CPU, ({cpu}, {cpu + 1}))\n"
        "_r.setrlimit(_r.RLIMIT_CORE, (0, 0))\n"
        "del _r\n"
    )


def run_python_checks(
    code: str, tests: str, *, timeout: float = 5.0, memory_mb: int = 256
) -> CodeResult:
    """Run `code` then `tests` (asserts) in a limited child; passed iff it exits 0."""
    if not code.strip():
        return CodeResult(False, "no code")
    program = f"{_prologue(memory_mb, timeout)}{code}\n\n# --- checks ---\n{tests}\n"
    with tempfile.TemporaryDirectory(prefix="clover-check-") as tmp:
        path = Path(tmp) / "answer.py"
        path.write_text(program)
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-B", str(path)],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin"},
            )
        except subprocess.TimeoutExpired:
            return CodeResult(False, "timeout")
    err = proc.stderr[-600:]
    if proc.returncode == 0:
        return CodeResult(True, "passed")
    if "MemoryError" in err:
        return CodeResult(False, "memory", err)
    if proc.returncode < 0:  # killed by a signal: SIGXCPU / SIGKILL from the CPU limit
        return CodeResult(False, "timeout", err)
    if "AssertionError" in err:
        return CodeResult(False, "failed", err)
    return CodeResult(False, "error", err)
