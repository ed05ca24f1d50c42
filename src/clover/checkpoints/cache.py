"""The conversion cache: GGUF files -> converted HF-format checkpoints under `cache_dir()`.

An entry is keyed by what the GGUF file holds (sha256 of its bytes) plus the registry's config
overrides, not by where the file lies: the same package installed into a fresh venv or clone
must reuse the entry instead of writing another copy (SmolLM2-135M's entry is 0.5 GB of
float32; keyed by path, every clean-clone test run added one). Each entry records the files it
was made from, with their size and mtime, in `sources.json`, which serves two purposes:
- the file is hashed once per (path, size, mtime), not at every start;
- an entry none of whose recorded files still exists unchanged, or one written in an older
  layout (`CONVERSION_VERSION`), can never be reached again, so `prune` removes it: before
  every new conversion, and on `clover cache prune`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from clover.checkpoints.registry import cache_dir
from clover.files import atomic_write_text

SOURCES = "sources.json"
# bump when the converted layout changes, to invalidate old caches (2: the GGUF's 4-bit
# levels, gguf_quant.safetensors, beside the weights)
CONVERSION_VERSION = 2
TEMP_GRACE_S = 3600.0  # a half-written conversion younger than this may still be in progress


def converted_root() -> Path:
    return cache_dir() / "converted"


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
    root = converted_root()
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


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


def converted_dir(path: Path, sha256: str, overrides: dict) -> Path:
    """Where the conversion of a GGUF file with these bytes and config overrides lives."""
    key = json.dumps([sha256, overrides, CONVERSION_VERSION], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return converted_root() / f"{path.stem}-{digest}"


def write_sources(directory: Path, path: Path, sha256: str, previous: dict | None = None) -> None:
    """Record `path` (as it is now) among the sources of the entry in `directory`, atomically;
    recorded files that are gone or changed are dropped (deleted venvs and clones)."""
    old = previous["files"] if previous else {}
    files = {name: stamp for name, stamp in old.items() if _unchanged(name, stamp)}
    files[str(path.resolve())] = _stamp(path)
    record = {"sha256": sha256, "files": files, "version": CONVERSION_VERSION}
    atomic_write_text(directory / SOURCES, json.dumps(record, indent=1))


def note_use(entry: Path, path: Path, sha256: str) -> None:
    """A cache hit from `path`: add it to the entry's sources if it is not there unchanged.
    Best effort: a read-only cache still serves the entry."""
    data = read_sources(entry)
    if data.get("files", {}).get(str(path.resolve())) != _stamp(path):
        try:
            write_sources(entry, path, sha256, data or None)
        except OSError:
            pass


@dataclass
class CacheEntry:
    path: Path
    bytes: int
    files: list[str]  # the GGUF files it was made from (recorded)
    live: bool  # one of them still exists unchanged (or a conversion is writing it now)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _is_live(entry: Path, data: dict) -> bool:
    if entry.name.startswith("."):  # a conversion being written, or one that died midway
        return time.time() - entry.stat().st_mtime < TEMP_GRACE_S
    if data.get("version", 1) != CONVERSION_VERSION:
        return False  # an older layout: no load will look for it again
    return any(_unchanged(name, stamp) for name, stamp in data.get("files", {}).items())


def entries() -> list[CacheEntry]:
    """Every converted checkpoint in the cache, with its size and whether it is still reachable."""
    out = []
    for entry in _entries():
        data = read_sources(entry)
        live = _is_live(entry, data)
        out.append(CacheEntry(entry, _size(entry), sorted(data.get("files", {})), live))
    return out


def prune() -> list[CacheEntry]:
    """Remove the entries no recorded file can reach any more (and conversions that died
    midway); returns what was removed."""
    removed = [e for e in entries() if not e.live]
    for e in removed:
        shutil.rmtree(e.path, ignore_errors=True)
    return removed


def removed_summary(removed: list[CacheEntry]) -> str:
    freed = sum(e.bytes for e in removed) / 1e9
    return f"removed {len(removed)} stale converted checkpoint(s), {freed:.2f} GB"
