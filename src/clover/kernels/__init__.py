"""Clover's CPU kernels: C++ built on first use with `torch.utils.cpp_extension`, then cached.

Why our own: PyTorch's CPU weight-only int4/int8 matmuls re-read and re-dequantize the weights
for every 4 rows of activations, so a pass over 33 positions cost 14.6x a pass over one (the
arithmetic of this class of CPU allows ~2x). `qgemm` reads each weight tile once per pass.

- Sources live beside this file; the build lands in `<clover cache>/kernels/<hash>/` (the hash
  covers the sources, the torch version and the compiler), so an upgrade rebuilds and a second
  venv with the same sources reuses the build.
- One instruction-set choice, here: AVX-512 BF16, else AVX2 + FMA, else portable C++
  (`$CLOVER_KERNEL_ISA` = avx512 / avx2 / portable forces one, for tests and comparisons).
- Short passes (an AR step, a verify pass: 1 to 4 rows with VNNI, 1 to 16 on AVX2 or with
  x on 8 bits, below) round x to 15 bits per group, as two int8 planes, and take exact
  integer dots (AVX-512 VNNI, else AVX2 `vpmaddubsw`, the same results to the bit): ~1.6x
  faster on one row (2-3x on AVX2), and a row's result no longer depends on the pass width.
  `$CLOVER_INT8_DOTS=0` keeps bfloat16 x there.
- x on 8 bits (one int8 plane, as llama.cpp's Q8 activations) for 4- and 5-bit weights: half
  the multiplies a row, so a verify pass of several rows costs less where multiplies bind
  (2-core Zen 3, qwen2.5-coder-0.5b: verify 4 at ~1.6x an AR step, not ~2.2x). It costs
  precision where activations have outliers (SmolLM2's next-token KL to float32 went from
  0.0009 to 0.0115; the coder's from 0.00021 to 0.00054, with the same suite accuracy), so a
  model chooses it (`ModelEntry.dots_x`, carried by its weights and fused layers); 8-bit
  weights keep 15 bits. `$CLOVER_DOTS_X=8` or `15` overrides every model. With VNNI such a
  model's passes of up to 16 rows take the dots (one plane: half the `vpdpbusd` of two;
  2-core Zen 4, the coder: verify 4 / 8 / 16 at ~1.1 / 1.8 / 3.2 AR steps, were 1.4 / 2.7 /
  3.8 with 5 to 16 rows on the bfloat16 path); AVX2 sums the same integers in the same
  epilogue, so either CPU class gives the same tokens.
- Passes of more than 384 rows (a long prefill, a drafter's features) sweep the weights once
  per 192 rows, so x stays in cache while the weight tiles pass (`$CLOVER_QGEMM_ROWS` sets the
  rows, 0 takes all at once; the results are the same to the bit).
- Without a C++ compiler, or with `$CLOVER_KERNELS=0`, `load()` returns None and callers keep
  PyTorch's own kernels; a one-line notice says so once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

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
# kernel ran on one thread (the first builds did: 2 threads gave the speed of 1). The
# extension then needs libgomp.so.1, the runtime PyTorch has already loaded.
CFLAGS = ["-O3", "-std=c++17", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_state: dict = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _notice(msg: str) -> None:
    print(f"clover: {msg}", file=sys.stderr)


def build_dir(key: str) -> Path:
    from clover.checkpoints.registry import cache_dir

    return cache_dir() / "kernels" / key


def _key(here: Path, compiler: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((here / name).read_bytes())
    h.update(torch.__version__.encode())
    # the install too: each venv writes its own include paths into build.ninja, so two venvs
    # sharing a build dir rebuilt each other's objects at every load; and the sources' own
    # path, for the same reason (two checkouts of one commit, e.g. a worktree or a clean clone
    # for CI, took turns rebuilding all objects, ~1 minute of both cores each load)
    h.update(str(Path(torch.__file__).parent).encode())
    h.update(str(here.resolve()).encode())
    h.update(compiler.encode())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """One builder per build dir. PyTorch's own lock is a file that a killed build leaves
    behind, after which every later load waits forever (seen here); an OS lock dies with its
    process, so whoever holds it may remove that stale file."""
    try:
        import fcntl
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


def load() -> ModuleType | None:
    """The compiled kernels, built once per source/torch/compiler; None when unavailable."""
    if "module" in _state:
        return _state["module"]
    _state["module"] = None
    if os.environ.get("CLOVER_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        _notice("no C++ compiler found (g++ or clang++; $CXX): using PyTorch's slower kernels")
        return None
    here = Path(__file__).parent
    key = _key(here, compiler)
    target = build_dir(key)
    fresh = not any(target.glob("*.so"))
    if fresh:
        _notice("building the CPU kernels (once; about a minute)...")
    try:
        target.mkdir(parents=True, exist_ok=True)
        with _build_lock(target):
            from torch.utils import cpp_extension

            module = cpp_extension.load(
                name=f"clover_kernels_{key}",
                sources=[str(here / s) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(target),
                verbose=False,
            )
    except Exception as e:  # a failed build must not stop the model: PyTorch's kernels remain
        first = str(e).strip().splitlines()[:1] or [type(e).__name__]
        _notice(f"could not build the CPU kernels ({first[0][:160]}): using PyTorch's")
        return None
    _state["module"] = module
    return module


INT8_DOTS = 8  # added to a path: short passes take integer dots (int8_dots_rows says how short)
X8 = 16  # added with INT8_DOTS: 4- and 5-bit weights take x on 8 bits there (isa's x_bits)


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
