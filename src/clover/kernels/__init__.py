"""Clover's CPU kernels: C++ built on first use with `torch.utils.cpp_extension`, then cached.

Why our own: PyTorch's CPU weight-only int4/int8 matmuls re-read and re-dequantize the weights
for every 4 rows of activations; `qgemm` reads each weight tile once per pass, and `layer.cpp`
runs a whole decoder layer per call. docs/kernels.md has the layouts and their measured costs.

- Sources live beside this file; the build lands in `<clover cache>/kernels/<key>/` (the key
  covers the sources, the torch install and the compiler), so an upgrade rebuilds and a second
  venv with the same sources reuses the build. PyTorch chooses the C++ standard its headers
  need. A build that fails is remembered under the same key (`failed.json`), so later starts
  do not try it again; `status()` says why the kernels are off and what that costs.
- One instruction-set choice, here: AVX-512 BF16, else AVX2 + FMA, else portable C++
  (`$CLOVER_KERNEL_ISA` = avx512 / avx2 / portable forces one, for tests and comparisons).
- Short passes (an AR step, a verify pass) round x per group and take exact integer dots
  (AVX-512 VNNI, else AVX2 `vpmaddubsw`, the same results to the bit), so a row's result does
  not depend on the pass width. `$CLOVER_INT8_DOTS=0` keeps bfloat16 x there. x takes 15 bits
  (two int8 planes) or, where a model chose it (`ModelEntry.dots_x`), 8 bits for 4- to 6-bit
  weights: fewer multiplies, a little less precision; `$CLOVER_DOTS_X=8` or `15` overrides it.
- Passes of more than 384 rows sweep the weights once per 192 rows, so x stays in cache
  (`$CLOVER_QGEMM_ROWS` sets the rows, 0 takes all at once; the results are the same).
- Without a C++ compiler, after a failed build, or with `$CLOVER_KERNELS=0`, `load()` returns
  None and callers keep PyTorch's own kernels; a one-line notice says so once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from clover.files import cache_dir

SOURCES = (
    "ops.cpp",
    "layer.cpp",
    "attention.cpp",
    "qgemm_scalar.cpp",
    "qgemm_avx2.cpp",
    "qgemm_avx512.cpp",
    "qgemm_vnni.cpp",
    "qgemm_dots_avx2.cpp",
)
HEADERS = ("qgemm.h", "ops.h", "attention.h", "simd512.h")
ISAS = {"portable": 0, "avx2": 1, "avx512": 2, "amx": 3}
# -fopenmp: `at::parallel_for` is inline OpenMP in PyTorch's headers, so without it every
# kernel runs on one thread. The extension then needs libgomp.so.1, which PyTorch has loaded.
# No -std: PyTorch's build adds the standard its own headers need.
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
SLOWER = "about 2.5x slower"  # PyTorch's kernels against these, an AR step of the default model
COMPILER_HINT = "install one (Debian/Ubuntu: apt install g++; macOS: xcode-select --install)"
FAILED, BUILT = "failed.json", "built.json"

_state: dict = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _notice(msg: str) -> None:
    print(f"clover: {msg}", file=sys.stderr)


def build_dir(key: str) -> Path:
    return cache_dir() / "kernels" / key


def _key(here: Path, compiler: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((here / name).read_bytes())
    h.update(torch.__version__.encode())
    # the install too: each venv writes its own include paths into build.ninja, so two venvs
    # sharing a build dir would rebuild each other's objects at every load; and the sources'
    # own path, for the same reason (two checkouts of one commit, e.g. a worktree or a clean
    # clone for CI, would take turns rebuilding all objects)
    h.update(str(Path(torch.__file__).parent).encode())
    h.update(str(here.resolve()).encode())
    h.update(compiler.encode())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """One builder per build dir. PyTorch's own lock is a file that a killed build leaves
    behind, after which every later load waits forever; an OS lock dies with its
    process, so whoever holds it may remove that stale file."""
    try:
        import fcntl  # POSIX only
    except ImportError:  # not a POSIX system: PyTorch's lock alone
        yield
        return
    with open(target / ".clover-build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        (target / "lock").unlink(missing_ok=True)  # PyTorch's, from a build that died
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _off(why: str) -> None:
    _state["why"] = why
    _notice(f"CPU kernels off: {why}; using PyTorch's, {SLOWER}")


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, built once per source/torch/compiler; None when unavailable.
    verbose: show the compiler's output (`clover kernels --rebuild`)."""
    if "module" in _state:
        return _state["module"]
    _state["module"] = None
    if os.environ.get("CLOVER_KERNELS", "1") == "0":
        _state["why"] = "$CLOVER_KERNELS=0"
        return None
    compiler = _compiler()
    if compiler is None:
        _off(f"no C++ compiler found (g++, clang++ or $CXX): {COMPILER_HINT}")
        return None
    here = Path(__file__).parent
    key = _key(here, compiler)
    target = build_dir(key)
    failed = target / FAILED
    if failed.is_file():
        try:
            why = json.loads(failed.read_text())["error"]
        except (OSError, ValueError, KeyError, TypeError):
            why = "an earlier build failed"
        _off(f"the build failed before ({why}); `clover kernels --rebuild` tries again")
        return None
    name = f"clover_kernels_{key}"
    built = target / BUILT  # written after a whole build: its .so is these sources' own
    if built.is_file():
        try:
            _state["module"] = _import(name, target / f"{name}.so")
            return _state["module"]
        except ImportError:  # damaged: build again
            built.unlink(missing_ok=True)
    fresh = not any(target.glob("*.so"))
    if fresh:
        _notice("building the CPU kernels (once; about a minute)...")
    try:
        target.mkdir(parents=True, exist_ok=True)
        with _build_lock(target):
            from torch.utils import cpp_extension  # slow to import: only to build

            module = cpp_extension.load(
                name=name,
                sources=[str(here / s) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(target),
                verbose=verbose,
            )
    except Exception as e:  # a failed build must not stop the model: PyTorch's kernels remain
        why = _first_error(str(e)) or type(e).__name__
        with contextlib.suppress(OSError):
            failed.write_text(json.dumps({"error": why, "torch": torch.__version__,
                                          "compiler": compiler}))  # fmt: skip
        _off(f"the build failed ({why}); see `clover kernels --rebuild` for the whole log")
        return None
    with contextlib.suppress(OSError):
        built.write_text(json.dumps({"torch": torch.__version__, "compiler": compiler}))
    _state["module"] = module
    return module


def _import(name: str, path: Path) -> ModuleType:
    """The built extension, imported as `cpp_extension.load` imports it, without asking ninja
    again whether it is up to date (its key already says so)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_error(log: str) -> str:
    """The compiler's first error line of a build log, shortened, else its first line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    found = [ln for ln in lines if "error:" in ln] or lines
    return found[0][:200] if found else ""


def status() -> dict:
    """Whether the kernels run here and, where not, why and what it costs (for `-v`, `info`)."""
    module = load()
    if module is not None:
        names = {v: k for k, v in ISAS.items()}
        return {"on": True, "isa": names.get(module.best_isa(), str(module.best_isa()))}
    return {"on": False, "why": _state.get("why", "unavailable"), "cost": SLOWER}


def rebuild(verbose: bool = True) -> ModuleType | None:
    """Forget a remembered failure and build again, the compiler's output shown."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C++ compiler found: {COMPILER_HINT}")
    target = build_dir(_key(Path(__file__).parent, compiler))
    (target / FAILED).unlink(missing_ok=True)
    (target / BUILT).unlink(missing_ok=True)
    _state.clear()
    return load(verbose)


INT8_DOTS = 8  # added to a path: short passes take integer dots (int8_dots_rows says how short)
X8 = 16  # added with INT8_DOTS: 4- to 6-bit weights take x on 8 bits there (isa's x_bits)


def isa(x_bits: int | None = None) -> int:
    """The kernel path: the instruction set (3 AMX tiles for passes of several rows + AVX-512
    BF16, 2 AVX-512 BF16, 1 AVX2 + FMA, 0 portable), plus INT8_DOTS where the level is 1 or
    more and `$CLOVER_INT8_DOTS` is not 0 (AVX-512 VNNI from level 2 where the CPU has it,
    else AVX2: the same results to the bit), plus X8 with it where x_bits (a model's choice,
    None: 15) or `$CLOVER_DOTS_X`, which overrides it, is 8."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available")
    level = module.best_isa()
    forced = os.environ.get("CLOVER_KERNEL_ISA")
    if forced:
        if forced not in ISAS:
            raise ValueError(f"$CLOVER_KERNEL_ISA={forced!r}: one of {', '.join(ISAS)}")
        level = min(ISAS[forced], level)
    dots = os.environ.get("CLOVER_INT8_DOTS", "1")
    if dots not in ("0", "1"):
        raise ValueError(f"$CLOVER_INT8_DOTS={dots!r}: 0 or 1")
    bits = os.environ.get("CLOVER_DOTS_X", str(x_bits or 15))
    if bits not in ("8", "15"):
        raise ValueError(f"$CLOVER_DOTS_X={bits!r}: 8 or 15")
    if dots == "1" and level >= 1 and module.int8_dots_supported():
        level += INT8_DOTS + (X8 if bits == "8" else 0)
    return level
