"""`clover export DRAFTER OUT --format llama.cpp`: the folders llama.cpp's DFlash converter
reads, the draft vocabulary's head rows, refusals, and (slow, where llama.cpp's sources are
here) the converter's GGUF read back."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clover import LLM
from clover.cli import main
from clover.errors import CloverError
from clover.hf.llamacpp import export_llamacpp
from clover.models.drafter import new_drafter, save_drafter

# what the converter's DFlash class reads at the top level of config.json (conversion/qwen.py,
# conversion/base.py): the layers' shapes, rope, norm eps, context
LAYER_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
              "max_position_embeddings", "vocab_size"}  # fmt: skip
DRAFT_LAYER = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
               "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
               "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}  # fmt: skip


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), dtype="float32", progress=False, drafter="none")


def drafter_file(target, tiny_checkpoint, path: Path, vocab: bool = True, **kw) -> Path:
    """A random block drafter of the tiny target (2 layers: feature layer 0, the only one
    whose output llama.cpp publishes); with `vocab`, drafting from 160 of its 320 ids."""
    torch.manual_seed(0)
    kw = {"feature_layers": [0], "num_hidden_layers": 1, "block_size": 4, **kw}
    d = new_drafter(target.model, str(tiny_checkpoint), **kw)
    if vocab:
        d.set_vocab(torch.arange(1, 320, 2))
    return save_drafter(d, path, dtype=torch.float32)


def no_llamacpp(monkeypatch, tmp_path):
    """The CLI finds no llama.cpp tree (its binaries' folder has no sources beside it)."""
    monkeypatch.setenv("CLOVER_LLAMACPP_BIN", str(tmp_path / "none" / "build" / "bin"))


def test_export_writes_the_dspark_route_with_the_head_rows(target, tiny_checkpoint, tmp_path,
                                                           monkeypatch, capsys):  # fmt: skip
    path = drafter_file(target, tiny_checkpoint, tmp_path / "d.safetensors")
    no_llamacpp(monkeypatch, tmp_path)
    out = tmp_path / "out"
    assert main(["export", str(path), str(out), "--format", "llama.cpp"]) == 0
    err = capsys.readouterr().err
    assert "converter not found" in err and "convert_hf_to_gguf.py" in err
    assert "--spec-type draft-dflash --spec-draft-n-max 3" in err
    assert sorted(p.name for p in out.iterdir()) == ["draft", "target"]

    config = json.loads((out / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"]
    assert LAYER_KEYS <= config.keys() and config["vocab_size"] == 320
    # feature layer 0's output: the converter writes 0 + 1, the input of layer 1
    assert config["target_layer_ids"] == [0] and config["dflash_config"]["target_layer_ids"] == [0]
    assert config["mask_token_id"] == target.model.config.mask_token_id
    assert config["block_size"] == 4 and config["draft_vocab_size"] == 160
    assert config["sample_from_anchor"] is False

    state = load_file(str(out / "draft" / "model.safetensors"))
    layer = {f"layers.0.{n}.weight" for n in DRAFT_LAYER}
    assert set(state) == {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight",
                          "d2t"} | layer  # fmt: skip
    ids = torch.arange(1, 320, 2)
    assert state["d2t"].dtype == torch.int64
    assert torch.equal(state["d2t"] + torch.arange(160), ids)
    assert torch.equal(state["lm_head.weight"], target.model.head_weight().detach()[ids])

    tconfig = json.loads((out / "target" / "config.json").read_text())
    assert tconfig["architectures"] == ["LlamaForCausalLM"] and tconfig["model_type"] == "llama"
    assert tconfig["vocab_size"] == 320 and "mask_token_id" not in tconfig
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in
                                                          (out / "target").iterdir()}  # fmt: skip
    assert not (out / "target" / "model.safetensors").exists()  # no target weights

    capsys.readouterr()
    assert main(["export", str(path), str(out), "--format", "llama.cpp"]) == 1
    assert "is not empty; pass --force" in capsys.readouterr().err
    assert main(["export", str(path), str(out), "--format", "llama.cpp", "--force"]) == 0


def test_export_of_the_full_vocabulary_is_plain_dflash(target, tiny_checkpoint, tmp_path):
    path = drafter_file(target, tiny_checkpoint, tmp_path / "d.safetensors", vocab=False)
    result = export_llamacpp(path, tmp_path / "out", None, dtype="bfloat16", progress=False)
    assert result.gguf is None and "--outtype bf16" in result.convert_line()
    config = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    mask = target.model.config.mask_token_id
    assert config["dflash_config"] == {"target_layer_ids": [0], "block_size": 4,
                                       "mask_token_id": mask}  # fmt: skip
    assert "draft_vocab_size" not in config and "target_layer_ids" not in config
    state = load_file(str(tmp_path / "out" / "draft" / "model.safetensors"))
    assert "lm_head.weight" not in state and "d2t" not in state
    assert state["fc.weight"].dtype == torch.bfloat16


def test_refusals(target, tiny_checkpoint, tmp_path, capsys):
    chain = drafter_file(target, tiny_checkpoint, tmp_path / "c.safetensors", chain=True)
    with pytest.raises(CloverError, match="chain drafter"):
        export_llamacpp(chain, tmp_path / "chain", None, progress=False)
    assert not (tmp_path / "chain").exists()  # refused before anything is written
    last = drafter_file(target, tiny_checkpoint, tmp_path / "l.safetensors", feature_layers=[1])
    with pytest.raises(CloverError, match="last layer's output"):
        export_llamacpp(last, tmp_path / "last", None, progress=False)
    assert not (tmp_path / "last").exists()
    assert main(["export", str(tiny_checkpoint), str(tmp_path / "m"), "--format",
                 "llama.cpp"]) == 1  # fmt: skip
    assert "writes drafter files" in capsys.readouterr().err


def test_a_converter_failure_is_an_error_with_its_output(target, tiny_checkpoint, tmp_path):
    src = tmp_path / "llama.cpp"
    (src / "gguf-py").mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text("import sys\nsys.exit('no DFlash here')\n")
    path = drafter_file(target, tiny_checkpoint, tmp_path / "d.safetensors")
    with pytest.raises(CloverError, match="converter failed(.|\n)*no DFlash here"):
        export_llamacpp(path, tmp_path / "out", src, progress=False)
    assert (tmp_path / "out" / "draft" / "config.json").is_file()  # kept for a later try


def test_a_converter_missing_a_package_is_not_run(target, tiny_checkpoint, tmp_path,
                                                  monkeypatch):  # fmt: skip
    from clover.hf import llamacpp

    src = tmp_path / "llama.cpp"
    src.mkdir()
    (src / "convert_hf_to_gguf.py").write_text("raise SystemExit('ran')\n")
    monkeypatch.setattr(llamacpp, "CONVERTER_NEEDS", ("no_such_package_here",))
    path = drafter_file(target, tiny_checkpoint, tmp_path / "d.safetensors")
    result = export_llamacpp(path, tmp_path / "out", src, progress=False)
    assert result.gguf is None and result.missing == ("no_such_package_here",)
    assert result.convert_line().startswith(f"PYTHONPATH={src / 'gguf-py'} ")


LLAMACPP = Path(os.path.expanduser("~/.cache/clover/llama.cpp"))
CODER = Path(os.path.expanduser("~/.cache/clover/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))


@pytest.mark.slow
def test_the_converter_writes_a_dflash_gguf(tmp_path):
    """The real target (Qwen2.5-Coder 0.5B, the converter knows its tokenizer) with a random
    drafter drafting from 4096 ids: llama.cpp's converter writes a dflash GGUF whose keys and
    tensors say what the drafter computes, read back with llama.cpp's own gguf-py."""
    sources = sorted(LLAMACPP.glob("*/src/convert_hf_to_gguf.py"))
    if not sources or not CODER.is_file() or importlib.util.find_spec("sentencepiece") is None:
        pytest.skip(
            "needs llama.cpp's sources (scripts/build_llamacpp.sh), the coder GGUF and "
            "sentencepiece (the converter's)"
        )
    src = sources[-1].parent
    target = LLM("qwen2.5-coder-0.5b", dtype="float32", progress=False, drafter="none")
    torch.manual_seed(0)
    d = new_drafter(target.model, "qwen2.5-coder-0.5b", num_hidden_layers=1)
    ids = torch.randperm(target.config.vocab_size)[:4096].sort().values
    d.set_vocab(ids)
    path = save_drafter(d, tmp_path / "d.safetensors")
    result = export_llamacpp(path, tmp_path / "out", src, progress=False)
    assert result.gguf is not None and result.gguf.is_file()
    reader = """
import json, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
def value(k):
    f = r.fields[k]
    return f.contents()
print(json.dumps({"arch": value("general.architecture"),
    "layers": value("dflash.target_layers"), "block": value("dflash.block_size"),
    "mask": value("tokenizer.ggml.mask_token_id"),
    "tensors": {t.name: [int(x) for x in t.shape] for t in r.tensors},
    "d2t": [int(x) for x in next(t for t in r.tensors if t.name == "d2t").data[:5]]}))
"""
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    proc = subprocess.run([sys.executable, "-c", reader, str(result.gguf)], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    got = json.loads(proc.stdout)
    c = d.config
    assert got["arch"] == "dflash" and got["block"] == c.block_size
    assert got["layers"] == [i + 1 for i in c.feature_layers]  # the inputs of the next layers
    assert got["mask"] == c.mask_token_id
    D = c.hidden_size
    assert got["tensors"]["fc.weight"] == [len(c.feature_layers) * D, D]
    assert got["tensors"]["output.weight"] == [D, 4096]
    assert got["d2t"] == ids[:5].tolist()
    shutil.rmtree(tmp_path / "out")
