"""The conversion cache (clover.checkpoints.cache): keyed by content, sources recorded, pruning."""

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
from tests.conftest import tiny_model
from tests.test_weights import write_tiny_gguf


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "converted"


def make_gguf(directory, seed=0):
    """A tiny llama GGUF with a converted tokenizer carried beside it (no vocab inside)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.gguf"
    write_tiny_gguf(path, tiny_model(seed=seed, hidden_size=64, intermediate_size=128))
    side = directory / "tiny.gguf.tokenizer"
    side.mkdir()
    (side / "tokenizer.json").write_text("{}")
    (side / "tokenizer_config.json").write_text("{}")
    return path


def copy_gguf(src, directory):
    directory.mkdir(parents=True)
    shutil.copy(src, directory / src.name)  # new path, new mtime, same bytes
    shutil.copytree(src.parent / f"{src.name}.tokenizer", directory / f"{src.name}.tokenizer")
    return directory / src.name


def no_conversion(*a, **k):
    raise AssertionError("converted again")


def test_same_bytes_elsewhere_reuse_the_entry(tmp_path, cache_root, monkeypatch, capsys):
    a = make_gguf(tmp_path / "venv1")
    first = loader.prepare_checkpoint(resolve(str(a)), progress=False)
    assert first.parent == cache_root and (first / "model.safetensors").is_file()
    b = copy_gguf(a, tmp_path / "venv2")
    monkeypatch.setattr(loader, "read_gguf", no_conversion)
    assert loader.prepare_checkpoint(resolve(str(b)), progress=False) == first
    recorded = cache.read_sources(first)["files"]
    assert sorted(recorded) == sorted([str(a.resolve()), str(b.resolve())])
    assert [p.name for p in cache_root.iterdir()] == [first.name]  # no temp dirs left behind


def test_different_bytes_or_overrides_get_their_own_entry(tmp_path, cache_root):
    a = make_gguf(tmp_path / "a", seed=0)
    b = make_gguf(tmp_path / "b", seed=1)
    sha_a, sha_b = cache.file_sha256(a), cache.file_sha256(b)
    assert sha_a != sha_b
    assert cache.converted_dir(a, sha_a, {}) != cache.converted_dir(b, sha_b, {})
    assert cache.converted_dir(a, sha_a, {}) != cache.converted_dir(a, sha_a, {"x": 1})
    assert cache.converted_dir(a, sha_a, {}) == cache.converted_dir(b, sha_a, {})


def test_hash_is_read_from_the_record_until_the_file_changes(tmp_path, cache_root):
    a = make_gguf(tmp_path / "a")
    entry = loader.prepare_checkpoint(resolve(str(a)), progress=False)
    real = cache.file_sha256(a)
    data = cache.read_sources(entry)
    assert data["sha256"] == real
    (entry / cache.SOURCES).write_text(json.dumps(dict(data, sha256="recorded")))
    assert cache.file_sha256(a) == "recorded"  # not re-read: the record matched size + mtime
    os.utime(a, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cache.file_sha256(a) == real  # touched: hashed again


def test_prune_removes_only_unreachable_entries(tmp_path, cache_root, capsys):
    a = make_gguf(tmp_path / "a")
    entry = loader.prepare_checkpoint(resolve(str(a)), progress=False)
    b = copy_gguf(a, tmp_path / "b")
    loader.prepare_checkpoint(resolve(str(b)), progress=False)
    old_format = cache_root / "tiny-0123456789abcdef"  # no sources.json: an older key scheme
    old_format.mkdir()
    (old_format / "model.safetensors").write_bytes(bytes(1000))
    young_tmp = cache_root / ".tiny-x.abc"  # a conversion being written right now
    young_tmp.mkdir()
    dead_tmp = cache_root / ".tiny-y.def"  # a conversion that died two hours ago
    dead_tmp.mkdir()
    two_hours_ago = time.time() - 7200
    os.utime(dead_tmp, (two_hours_ago, two_hours_ago))

    removed = cache.prune()
    assert sorted(e.path.name for e in removed) == sorted([old_format.name, dead_tmp.name])
    assert sum(e.bytes for e in removed) == 1000
    shutil.rmtree(a.parent)
    assert cache.prune() == []  # still reachable from b
    c = copy_gguf(b, tmp_path / "c")
    loader.prepare_checkpoint(resolve(str(c)), progress=False)  # a hit: a gone file is dropped
    assert sorted(cache.read_sources(entry)["files"]) == sorted(
        [str(b.resolve()), str(c.resolve())]
    )
    shutil.rmtree(c.parent)
    shutil.rmtree(b.parent)
    assert [e.path for e in cache.prune()] == [entry]
    assert sorted(p.name for p in cache_root.iterdir()) == [young_tmp.name]


def test_a_new_conversion_prunes_stale_entries(tmp_path, cache_root, capsys):
    a = make_gguf(tmp_path / "a", seed=0)
    old = loader.prepare_checkpoint(resolve(str(a)), progress=False)
    shutil.rmtree(a.parent)
    b = make_gguf(tmp_path / "b", seed=1)
    new = loader.prepare_checkpoint(resolve(str(b)), progress=True)
    assert not old.exists() and new.is_dir()
    assert "removed 1 stale converted checkpoint(s)" in capsys.readouterr().err


def test_an_older_layout_is_pruned_though_its_source_is_there(tmp_path, cache_root):
    a = make_gguf(tmp_path / "a")
    entry = loader.prepare_checkpoint(resolve(str(a)), progress=False)
    data = cache.read_sources(entry)
    assert data["version"] == cache.CONVERSION_VERSION and cache.prune() == []
    (entry / cache.SOURCES).write_text(
        json.dumps({k: v for k, v in data.items() if k != "version"})
    )
    assert [e.path for e in cache.prune()] == [entry]  # a version-1 entry: never read again


def test_cache_command_lists_and_prunes(tmp_path, cache_root, capsys):
    a = make_gguf(tmp_path / "a")
    entry = loader.prepare_checkpoint(resolve(str(a)), progress=False)
    assert main(["cache", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["root"] == str(cache_root)
    [row] = listed["entries"]
    assert (row["path"], row["live"], row["files"]) == (str(entry), True, [str(a.resolve())])
    assert row["bytes"] > 10_000
    assert main(["cache", "prune"]) == 0
    assert "removed 0 stale" in capsys.readouterr().out and entry.is_dir()
    shutil.rmtree(a.parent)
    assert main(["cache"]) == 0
    assert "stale (clover cache prune removes it)" in capsys.readouterr().out
    assert main(["cache", "prune"]) == 0
    assert "removed 1 stale" in capsys.readouterr().out and not entry.exists()
    assert main(["cache"]) == 0
    assert ": 0 converted checkpoint(s)" in capsys.readouterr().out


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

    def full(model, directory, extra_files=()):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(loader, "save_checkpoint", full)
    with pytest.raises(CloverError, match=r"No space left on device; .*\$CLOVER_CACHE"):
        loader.prepare_checkpoint(resolve(str(a)), progress=False)
    assert list(cache_root.iterdir()) == []
