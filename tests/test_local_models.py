"""Models already on the machine (issue 60, items 1 and 2, the offline half): references into the
Hugging Face cache, `clover list` and `clover rm`. The cache here is a fake one laid out as
huggingface_hub lays it out (refs, snapshots linking to blobs); nothing reaches the network."""

from __future__ import annotations

import json
import shutil

import pytest

from clover.checkpoints import registry
from clover.checkpoints.local import hub_models, resolve_hub
from clover.checkpoints.registry import resolve
from clover.cli import main
from clover.errors import CloverError
from tests.gguf_files import write_gguf


def _put(hub, repo, files, revision="c0ffee", branch="main"):
    """Lay files out as huggingface_hub does: blobs, a snapshot of links, a ref."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / branch).write_text(revision)
    snap = folder / "snapshots" / revision
    for name, source in files.items():
        blob = folder / "blobs" / f"{abs(hash((repo, name, revision))):x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, blob)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).symlink_to(blob)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone: what it lacks is an error
    gguf = tmp_path / "src" / "tiny.gguf"
    gguf.parent.mkdir()
    write_gguf(gguf, {})
    _put(tmp_path / "hub", "org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf, "tiny-F16.gguf": gguf})
    _put(tmp_path / "hub", "org/tiny-GGUF", {"tiny-Q4_K_M.gguf": gguf}, revision="beef",
         branch="v2")  # fmt: skip
    _put(tmp_path / "hub", "org/split-GGUF", {"big-Q4_0-00002-of-00002.gguf": gguf})
    hf = tmp_path / "src" / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    _put(tmp_path / "hub", "org/tiny-hf", {"config.json": hf / "config.json",
         "model.safetensors": hf / "model.safetensors"})  # fmt: skip
    return tmp_path / "hub"


def test_a_quant_tag_picks_the_file_where_it_lies(hub):
    snap = hub / "models--org--tiny-GGUF" / "snapshots" / "c0ffee"
    r = resolve("org/tiny-GGUF:q8_0")  # case-insensitive
    assert r.kind == "gguf" and r.path == snap / "tiny-Q8_0.gguf" and r.entry is None
    assert r.path.is_symlink()  # the cache's own file: no copy
    assert resolve("org/tiny-GGUF/tiny-F16.gguf").path == snap / "tiny-F16.gguf"
    assert resolve("org/tiny-GGUF:Q4_K_M@v2").path.parent.name == "beef"  # another revision
    assert resolve("org/tiny-hf").kind == "hf"


def test_a_model_from_the_cache_answers(hub, monkeypatch, tmp_path):
    from clover.engine import LLM
    from clover.files import cache_dir

    kernels = cache_dir() / "kernels"  # built once per machine: shared, not rebuilt here
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "clover"))
    (tmp_path / "clover").mkdir()
    if kernels.is_dir():
        (tmp_path / "clover" / "kernels").symlink_to(kernels)
    blob = (hub / "models--org--tiny-GGUF" / "snapshots" / "c0ffee" / "tiny-Q8_0.gguf").resolve()
    # the test file has no vocabulary inside: its tokenizer rides beside the blob it reads
    shutil.copytree(
        tmp_path / "src" / "tiny.gguf.tokenizer", blob.with_name(blob.name + ".tokenizer")
    )
    llm = LLM("org/tiny-GGUF:Q8_0", dtype="float32", progress=False)
    out = llm.generate([[5, 6, 7]], max_tokens=4, decoder="ar")[0]  # ids the tiny vocab has
    assert out.output_tokens == 4 and llm.name == "org/tiny-GGUF:Q8_0"


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("org/absent", "HF_HUB_OFFLINE is set, so nothing is downloaded"),
        ("org/absent:Q4_K_M", "`huggingface-cli download org/absent`"),
        ("org/tiny-GGUF:Q2_K", "has no Q2_K GGUF in the cache; it holds: F16, Q8_0"),
        ("org/tiny-GGUF", "holds several GGUFs; pick one"),
        ("org/tiny-GGUF/nope.gguf", "has no nope.gguf"),
        ("org/tiny-GGUF:Q8_0@v9", "org/tiny-GGUF at v9 is not in the Hugging Face cache"),
        ("org/split-GGUF:Q4_0", "one of 2 parts of a split GGUF"),
    ],
)
def test_every_miss_is_one_line_that_says_what_to_do(hub, ref, words):
    with pytest.raises(CloverError, match=None) as e:
        resolve(ref)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_path_is_still_a_path(hub, tmp_path):
    with pytest.raises(CloverError, match="no such file or directory"):
        resolve("models/missing.gguf")
    gguf = tmp_path / "src" / "tiny.gguf"
    assert resolve(str(gguf)).path == gguf


def test_list_shows_the_cache_and_the_registry(hub, monkeypatch, capsys):
    entry = registry.KNOWN_MODELS["smollm2-135m"]
    fake = hub.parent / "src" / "tiny.gguf"
    monkeypatch.setattr(registry, "_locate", lambda e: fake if e is entry else None)
    assert main(["list", "--json"]) == 0
    rows = {m["model"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert rows["smollm2-135m"]["kind"] == "registry" and rows["smollm2-135m"]["clover_owned"]
    assert {"org/tiny-GGUF:Q8_0", "org/tiny-GGUF:F16", "org/tiny-hf"} <= set(rows)
    assert "org/tiny-GGUF:Q4_K_M" not in rows  # another branch's snapshot: not main
    assert not any(m.startswith("org/split") for m in rows)  # a split file's later part
    assert rows["org/tiny-GGUF:Q8_0"]["architecture"] == "qwen2"
    assert rows["org/tiny-hf"]["quant"] == "bfloat16" and rows["org/tiny-hf"]["bytes"] == 64
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "org/tiny-GGUF:Q8_0" in text and "Hugging Face cache" in text
    assert len(hub_models()) == 3


def test_rm_removes_only_what_clover_downloaded(hub, monkeypatch, tmp_path, capsys):
    entry = registry.KNOWN_MODELS["qwen2.5-coder-0.5b"]
    assembled = tmp_path / "models" / entry.filename
    assembled.parent.mkdir()
    assembled.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setattr(registry, "_locate", lambda e: assembled if e is entry else None)
    derived = tmp_path / "derived"
    derived.mkdir()
    (derived / "weights.pack").write_bytes(b"\0" * 50)
    made = [registry.cache.CacheEntry(derived, 50, [str(assembled.resolve())], True)]
    monkeypatch.setattr(registry.cache, "entries", lambda: made)
    uninstalled = []
    monkeypatch.setattr(registry, "_run_pip_uninstall", lambda p, progress: uninstalled.extend(p))
    assert main(["rm", "qwen2.5-coder-0.5b", "-q"]) == 0
    assert "0.00 GB freed" in capsys.readouterr().out
    assert not assembled.exists() and not derived.exists()
    assert uninstalled == sorted({p.package for p in entry.parts})
    smol, base = registry.KNOWN_MODELS["clover-smol-135m"], registry.KNOWN_MODELS["smollm2-135m"]
    shipped = tmp_path / "smol.gguf"  # two names, one package: both go, and it says so
    shipped.write_bytes(b"GGUF")
    monkeypatch.setattr(registry, "_locate", lambda e: shipped if e in (smol, base) else None)
    assert main(["rm", "clover-smol-135m", "-q"]) == 0
    assert "(and smollm2-135m: the same file)" in capsys.readouterr().out
    assert uninstalled[-1] == smol.package
    monkeypatch.setattr(registry, "_locate", lambda e: None)
    assert main(["rm", "qwen2.5-coder-0.5b"]) == 1
    assert "not installed: nothing to remove" in capsys.readouterr().err
    assert main(["rm", "org/tiny-GGUF:Q8_0"]) == 1
    assert "Clover only reads that cache" in capsys.readouterr().err
    assert (hub / "models--org--tiny-GGUF").is_dir()  # untouched


def test_revision_flag_names_the_revision(hub):
    from clover import cli

    parser = cli.build_parser()
    args = parser.parse_args(["generate", "-m", "org/tiny-GGUF:Q4_K_M", "--revision", "v2"])
    assert cli._with_revision(args.model, args.revision) == "org/tiny-GGUF:Q4_K_M@v2"
    assert resolve(cli._with_revision(args.model, args.revision)).path.parent.name == "beef"
    with pytest.raises(CloverError, match="is not one"):
        cli._with_revision("smollm2-135m", "v2")
    with pytest.raises(CloverError, match="names its revision already"):
        cli._with_revision("org/x@v1", "v2")
    assert main(["generate", "-m", "smollm2-135m", "--revision", "v2", "-p", "hi"]) == 1


def test_resolve_hub_reads_the_revision_a_branch_names(hub):
    path, kind = resolve_hub("org/tiny-GGUF:Q4_K_M@v2")
    assert kind == "gguf" and path.name == "tiny-Q4_K_M.gguf"
