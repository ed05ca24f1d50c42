"""Files, below every other layer: where Clover keeps derived files (`cache_dir`), reading
safetensors files (`read_safetensors`, `read_header`), and writing a file so that readers see
the old one or the whole new one, never a part of it (`atomic_write`).

Every file Clover keeps across runs (drafters, adapters, assembled checkpoints, the cache's
records, measured pass costs, a server's learned store, benchmark results) goes through
`atomic_write`: a temporary file beside the target (the same directory, so the rename stays on
one filesystem) with the target's permissions from the start, written, flushed to disk, then
renamed over the target. A failure at any point removes the temporary and leaves the old file
as it was; a crash leaves at worst a stray `.<name>.*.tmp` beside it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

from clover.errors import CloverError


def atomic_write(
    path: str | Path, write: Callable[[Path], object], mode: int = 0o644, durable: bool = True
) -> Path:
    """write(tmp) fills a temporary file beside `path`, then one rename puts it in place.
    mode: the new file's permissions, set before anything is written (0o600 for files holding
    users' prompts or answers). durable: fsync the data before the rename, so a power loss
    leaves the old file or the new one whole (off for files that are cheap to remake).
    -> path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, mode)
        write(tmp)
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str, mode: int = 0o644, durable: bool = True) -> Path:
    """`atomic_write` of a whole text (UTF-8)."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), mode, durable)


def cache_dir() -> Path:
    """Where Clover keeps derived files: $CLOVER_CACHE, else $XDG_CACHE_HOME/clover, else
    ~/.cache/clover. Created on first use."""
    if os.environ.get("CLOVER_CACHE"):
        path = Path(os.environ["CLOVER_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        path = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "clover"
    else:
        path = Path.home() / ".cache" / "clover"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CloverError(f"cannot create the cache directory {path}: {exc}") from None
    return path


def truncate_torn_tail(path: Path) -> None:
    """Drop a half-written last line of a JSONL file (a run killed mid-write), so that appends
    start on a clean line; a missing or empty file is left as it is."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with open(path, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)


# --- safetensors ------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(
    files: Iterable[Path], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of the files, read one at a time and converted to `dtype` on the way.

    Plain reads, not a memory map: a mapped file's pages count as resident memory, so mapping
    a float32 checkpoint to build a bfloat16 model would double the peak footprint.
    """
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safetensors_header(Path(f)) as (fh, base, header):
            for name, info in header.items():
                t = _read(f, fh, base, name, info)
                state[name] = t if dtype is None or not t.is_floating_point() else t.to(dtype)
    return state


def read_header(path: Path) -> dict:
    """A safetensors file's JSON header, `__metadata__` included, without reading tensors.
    Raises OSError, or ValueError when the file has no sound header."""
    path = Path(path)
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n <= min(path.stat().st_size - 8, 1 << 24):
            raise ValueError("no safetensors header")
        return json.loads(fh.read(n))


@contextmanager
def safetensors_header(f: Path) -> Iterator[tuple]:
    """-> (file handle, offset of the data, header without metadata), every tensor checked
    to lie inside the file."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length past the end of the file")
            header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            for name, info in header.items():
                if 8 + n + info["data_offsets"][1] > size:
                    raise ValueError(f"tensor {name} runs past the end of the file")
            yield fh, 8 + n, header
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CloverError(f"cannot read {f} (truncated or not safetensors?): {e}") from None


def _read(f: Path, fh: BinaryIO, base: int, name: str, info: dict) -> torch.Tensor:
    start, end = info["data_offsets"]
    try:
        fh.seek(base + start)
        buf = bytearray(end - start)
        fh.readinto(buf)
        t = torch.frombuffer(buf, dtype=SAFETENSORS_DTYPES[info["dtype"]])
        return t.reshape(info["shape"]) if buf else t.new_empty(info["shape"])
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as e:
        raise CloverError(f"cannot read {name} from {f} (truncated?): {e}") from None
