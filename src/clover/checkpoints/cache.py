"""What Clover derives from a GGUF file, kept in the user cache: one entry per file's bytes.

An entry, `<cache>/gguf/<stem>-<sha256[:16]>/`, holds the file's tokenizer (`tokenizer/`,
converted once from its embedded vocabulary) and its packed weights (`*.pack`, `packed.py`).
It is keyed by what the file holds, not by where it lies: the same package installed into a
fresh venv or clone reuses it. Each entry records the files it was made from, with their size
and mtime, in `sources.json`, which serves two purposes:
- a file is hashed once per (path, size, mtime), not at every start;
- an entry none of whose recorded files still exists unchanged can never be reached again, so
  `prune` removes it (before every new entry is written, and on `clover cache prune`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from clover.files import atomic_write_text, cache_dir

SOURCES = "sources.json"
TEMP_GRACE_S = 3600.0  # a half-written entry younger than this may still be in progress
LEGACY = "converted"  # float32 conversions that older Clover versions wrote: removed once


def root() -> Path:
    return cache_dir() / "gguf"


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _unchanged(name: str, stamp: list[int]) -> bool:
    """The recorded file still exists with the recorded size and mtime."""
    try:
        return _stamp(Path(name)) == stamp
    except OSError:
        return False


def read_sources(entry: Path) -> dict:
    """{"sha256": ..., "files": {absolute path: [size, mtime_ns]}}; {} if missing or unreadable."""
    try:
        data = json.loads((entry / SOURCES).read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(data, dict) and isinstance(data.get("files"), dict)
    return data if ok and isinstance(data.get("sha256"), str) else {}


def _entries() -> list[Path]:
    base = root()
    return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []


def file_sha256(path: Path, progress: bool = False) -> str:
    """The file's sha256: read from an entry that recorded this file unchanged, else computed."""
    key, stamp = str(path.resolve()), _stamp(path)
    for entry in _entries():
        data = read_sources(entry)
        if data and data["files"].get(key) == stamp:
            return data["sha256"]
    if progress and stamp[0] > 1 << 30:
        print(f"identifying {path.name} ({stamp[0] / 1e9:.1f} GB, once)", file=sys.stderr)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def entry_dir(path: Path, sha256: str) -> Path:
    """The entry of a GGUF file with these bytes (it may not exist yet)."""
    return root() / f"{path.stem}-{sha256[:16]}"


def note_use(entry: Path, path: Path, sha256: str) -> None:
    """Record `path` (as it is now) among the entry's sources, if it is not there unchanged;
    recorded files that are gone or changed are dropped. Best effort: a read-only cache still
    serves the entry."""
    data = read_sources(entry)
    if data.get("files", {}).get(str(path.resolve())) == _stamp(path):
        return
    files = {n: s for n, s in data.get("files", {}).items() if _unchanged(n, s)}
    files[str(path.resolve())] = _stamp(path)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        record = {"sha256": sha256, "files": files}
        atomic_write_text(entry / SOURCES, json.dumps(record, indent=1), durable=False)
    except OSError:
        pass


@dataclass
class CacheEntry:
    path: Path
    bytes: int
    files: list[str]  # the GGUF files it was made from (recorded)
    live: bool  # one of them still exists unchanged (or an entry is being written now)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _is_live(entry: Path, data: dict) -> bool:
    if not data:  # being written (sources come last), or left by a process that died
        return time.time() - entry.stat().st_mtime < TEMP_GRACE_S
    return any(_unchanged(name, stamp) for name, stamp in data.get("files", {}).items())


def entries() -> list[CacheEntry]:
    """Every entry in the cache, with its size and whether a GGUF file still leads to it."""
    out = []
    for entry in _entries():
        data = read_sources(entry)
        live = _is_live(entry, data)
        out.append(CacheEntry(entry, _size(entry), sorted(data.get("files", {})), live))
    return out


def prune() -> list[CacheEntry]:
    """Remove the entries no recorded file can reach any more; returns what was removed."""
    removed = [e for e in entries() if not e.live]
    for e in removed:
        shutil.rmtree(e.path, ignore_errors=True)
    return removed


def removed_summary(removed: list[CacheEntry]) -> str:
    freed = sum(e.bytes for e in removed) / 1e9
    return f"removed {len(removed)} stale cache entries, {freed:.2f} GB"


def remove_legacy(progress: bool = True) -> None:
    """Delete the float32 conversions older versions wrote (`<cache>/converted`, each many
    times its GGUF's size), once, saying so."""
    old = cache_dir() / LEGACY
    if not old.is_dir():
        return
    size = _size(old)
    shutil.rmtree(old, ignore_errors=True)
    if progress:
        print(f"clover: removed {old} ({size / 1e9:.2f} GB of float32 conversions earlier "
              "versions made; weights are now packed from the GGUF itself)",
              file=sys.stderr)  # fmt: skip
