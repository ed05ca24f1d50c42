"""Where Clover keeps derived files (`cache_dir`), and writing a file so that readers see the
old one or the whole new one, never a part of it.

Every file Clover keeps across runs (drafters, adapters, assembled checkpoints, the cache's
records, measured pass costs, a server's learned store, benchmark results) goes through
`atomic_write`: a temporary file beside the target (the same directory, so the rename stays on
one filesystem) with the target's permissions from the start, written, flushed to disk, then
renamed over the target. A failure at any point removes the temporary and leaves the old file
as it was; a crash leaves at worst a stray `.<name>.*.tmp` beside it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

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
