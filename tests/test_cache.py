"""What Clover derives from GGUF files (clover.checkpoints.cache): one entry per file's bytes,
its sources recorded, pruning, the old float32 conversions removed once, `clover cache`."""

import errno
import json
import os
import shutil
import time

import pytest

from clover.checkpoints import cache, loader
from clover.checkpoints.registry import resolve
from clover.cli import main
from clover.errors import CloverError
from tests.gguf_files import write_gguf


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def make_gguf(directory, seed=0):
    """A tiny qwen2 GGUF with a tokenizer carried beside it (no vocab inside)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.gguf"
    write_gguf(path, {"attn_q": "Q4_K"}, config={"vocab_size": 64 + seed * 16})
    return path


def copy_gguf(src, directory):
    directory.mkdir(parents=True)
    shutil.copy(src, directory / src.name)  # new path, new mtime, same bytes
    shutil.copytree(src.parent / f"{src.name}.tokenizer", directory / f"{src.name}.tokenizer")
    return directory / src.name


def entry_of(path):
    return loader.gguf_entry(resolve(str(path)), progress=False)


def test_same_bytes_elsewhere_reuse_the_entry(tmp_path, cache_root, monkeypatch):
    a = make_gguf(tmp_path / "venv1")
    first = entry_of(a)
    assert first.parent == cache_root and (first / "tokenizer" / "tokenizer.json").is_file()
    b = copy_gguf(a, tmp_path / "venv2")
    monkeypatch.setattr(loader, "convert_gguf_tokenizer", lambda *a: pytest.fail("again"))
    assert entry_of(b) == first
    recorded = cache.read_sources(first)["files"]
    assert sorted(recorded) == sorted([str(a.resolve()), str(b.resolve())])
    assert [p.name for p in cache_root.iterdir()] == [first.name]  # no temp dirs left behind


def test_different_bytes_get_their_own_entry(tmp_path, cache_root):
    a = make_gguf(tmp_path / "a", seed=0)
    b = make_gguf(tmp_path / "b", seed=1)
    sha_a, sha_b = cache.file_sha256(a), cache.file_sha256(b)
    assert sha_a != sha_b
    assert cache.entry_dir(a, sha_a) != cache.entry_dir(b, sha_b)
    assert cache.entry_dir(a, sha_a) == cache.entry_dir(b, sha_a)


def test_hash_is_read_from_the_record_until_the_file_changes(tmp_path, cache_root):
    a = make_gguf(tmp_path / "a")
    entry = entry_of(a)
    real = cache.file_sha256(a)
    data = cache.read_sources(entry)
    assert data["sha256"] == real
    (entry / cache.SOURCES).write_text(json.dumps(dict(data, sha256="recorded")))
    assert cache.file_sha256(a) == "recorded"  # not re-read: the record matched size + mtime
    os.utime(a, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cache.file_sha256(a) == real  # touched: hashed again


def test_prune_removes_only_unreachable_entries(tmp_path, cache_root):
    a = make_gguf(tmp_path / "a")
    entry = entry_of(a)
    b = copy_gguf(a, tmp_path / "b")
    entry_of(b)
    young = cache_root / "tiny-0123456789abcdef"  # no sources.json: being written right now
    young.mkdir()
    dead = cache_root / "tiny-fedcba9876543210"  # no sources.json, two hours old: died midway
    dead.mkdir()
    (dead / "weights-int8-v1.pack").write_bytes(bytes(1000))
    two_hours_ago = time.time() - 7200
    os.utime(dead, (two_hours_ago, two_hours_ago))

    removed = cache.prune()
    assert [e.path.name for e in removed] == [dead.name]
    assert sum(e.bytes for e in removed) == 1000
    shutil.rmtree(a.parent)
    assert cache.prune() == []  # still reachable from b
    c = copy_gguf(b, tmp_path / "c")
    entry_of(c)  # a hit: a gone file is dropped from the record
    assert sorted(cache.read_sources(entry)["files"]) == sorted(
        [str(b.resolve()), str(c.resolve())]
    )
    shutil.rmtree(c.parent)
    shutil.rmtree(b.parent)
    assert [e.path for e in cache.prune()] == [entry]
    assert sorted(p.name for p in cache_root.iterdir()) == [young.name]


def test_a_new_entry_prunes_stale_ones(tmp_path, cache_root, capsys):
    a = make_gguf(tmp_path / "a", seed=0)
    old = entry_of(a)
    shutil.rmtree(a.parent)
    b = make_gguf(tmp_path / "b", seed=1)
    new = loader.gguf_entry(resolve(str(b)), progress=True)
    assert not old.exists() and new.is_dir()
    assert "removed 1 stale cache entries" in capsys.readouterr().err


def test_old_float32_conversions_are_removed_once_saying_so(tmp_path, cache_root, capsys):
    old = cache_root.parent / "converted" / "tiny-0123456789abcdef"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(bytes(5000))
    entry_of(make_gguf(tmp_path / "a"))
    assert not old.parent.exists()
    loader.gguf_entry(resolve(str(tmp_path / "a" / "tiny.gguf")), progress=True)
    assert "float32 conversions" not in capsys.readouterr().err  # once
    old.mkdir(parents=True)
    loader.gguf_entry(resolve(str(tmp_path / "a" / "tiny.gguf")), progress=True)
    assert f"removed {old.parent}" in capsys.readouterr().err


def test_cache_command_lists_and_prunes(tmp_path, cache_root, capsys):
    a = make_gguf(tmp_path / "a")
    entry = entry_of(a)
    assert main(["cache", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["root"] == str(cache_root)
    [row] = listed["entries"]
    assert (row["path"], row["live"], row["files"]) == (str(entry), True, [str(a.resolve())])
    assert row["bytes"] > 1000
    assert main(["cache", "prune"]) == 0
    assert "removed 0 stale" in capsys.readouterr().out and entry.is_dir()
    shutil.rmtree(a.parent)
    assert main(["cache"]) == 0
    assert "stale (clover cache prune removes it)" in capsys.readouterr().out
    assert main(["cache", "prune"]) == 0
    assert "removed 1 stale" in capsys.readouterr().out and not entry.exists()
    assert main(["cache"]) == 0
    assert ": 0 GGUF file(s)" in capsys.readouterr().out


def test_a_closed_pipe_ends_quietly(tmp_path, cache_root, monkeypatch):
    for i in range(3):
        (cache_root / f"tiny-{i:016x}").mkdir(parents=True)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `clover cache | head -0`
    with os.fdopen(write_end, "w", buffering=1) as out:
        monkeypatch.setattr("sys.stdout", out)
        assert main(["cache"]) == 141
        out.write("after\n")  # the descriptor now leads to /dev/null: no second error


def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path, cache_root, monkeypatch):
    a = make_gguf(tmp_path / "a")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(loader, "convert_gguf_tokenizer", full)
    with pytest.raises(CloverError, match=r"No space left on device; .*\$CLOVER_CACHE"):
        entry_of(a)
    assert not list(cache_root.glob("*/tokenizer"))
    monkeypatch.undo()
    monkeypatch.setenv("CLOVER_CACHE", str(cache_root.parent))
    entry = entry_of(a)
    monkeypatch.setattr("clover.checkpoints.packed.atomic_write", full)
    with pytest.raises(CloverError, match=r"No space left on device; .*\$CLOVER_CACHE"):
        loader.load(str(a), dtype="int4", progress=False)
    assert not list(entry.glob("*.pack"))
