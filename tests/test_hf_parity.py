"""Parity with transformers (the version pinned in the dev extra): tiny random checkpoints of
each family saved with `save_pretrained`, loaded by Clover. Causal logits equal transformers'
at 1e-4 (float32); block-mode logits equal transformers run with the block-causal 4D mask;
the first block a low_confidence decoder commits reads the right positions, shifted or not."""

import json

import pytest
import torch
import transformers

from clover.checkpoints.hf_dir import model_from_state, read_hf_dir
from clover.decoding.loop import generate
from clover.decoding.policies import make_policy

ATOL = 1e-4
VOCAB = 320  # >= the byte-level test tokenizer's, so `clover generate` can run the directory

ATTENTION = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # sharper logits than the default 0.02: differences show
    tie_word_embeddings=False,
)
HYBRID = dict(
    ATTENTION,
    intermediate_size=37,
    head_dim=8,
    linear_conv_kernel_dim=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=36,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(ATTENTION)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(ATTENTION)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(ATTENTION, head_dim=16)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            ATTENTION,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),  # fmt: skip
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(HYBRID, layer_types=["linear_attention", "full_attention"]),
    ),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(HYBRID, layer_types=["full_attention", "linear_attention"], tie_word_embeddings=True),
    ),
}
ATTENTION_ONLY = ("llama", "qwen2", "qwen3", "qwen3_moe")


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kw)
    return getattr(transformers, model_cls)(config).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, transformers model, the directory it saved, our model loaded from it)."""
    family = request.param
    hf = hf_model(family)
    directory = tmp_path_factory.mktemp(family)
    hf.save_pretrained(str(directory))
    config, state = read_hf_dir(directory)
    ours = model_from_state(config, state, family, torch.float32)
    return family, hf, directory, ours


def ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_saved_names_are_transformers_own(pair):
    """The file holds transformers' names (5.x fuses experts in memory and splits them again
    on save for some families: the set we read is pinned here)."""
    family, hf, directory, _ = pair
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    expert = {
        "qwen3_moe": "model.layers.1.mlp.experts.gate_up_proj",
        "qwen3_next": "model.layers.0.mlp.experts.gate_up_proj",
        "qwen3_5_moe_text": "model.layers.0.mlp.experts.gate_up_proj",
    }
    if family in expert:
        assert expert[family] in names or any(".mlp.experts.0." in n for n in names)
    assert transformers.__version__ == "5.24.0"  # the version these layouts were read from


def test_causal_logits_match(pair):
    _, hf, _, ours = pair
    x = ids(13)
    with torch.no_grad():
        want = hf(x).logits
        got = ours.logits(ours(x))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def block_mask(prefix: int, block: int) -> torch.Tensor:
    """[1, 1, T, T] bool: causal over the prefix, the block sees the prefix and itself."""
    T = prefix + block
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return ((j <= i) | ((i >= prefix) & (j >= prefix)))[None, None]


def test_block_mode_matches_a_block_causal_mask(pair):
    family, hf, _, ours = pair
    if family not in ATTENTION_ONLY:
        pytest.skip("transformers' GDN layers are causal whatever the mask: test_hybrid_block")
    P, B = 9, 6
    x = ids(P + B, seed=2)
    with torch.no_grad():
        want = hf(x, attention_mask=block_mask(P, B)).logits
        got = ours.logits(ours(x, mode="block", n_commit=P))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_hybrid_block_mode_is_causal_gdn_and_block_attention(pair):
    """A Qwen3-Next / 3.5 checkpoint is the Clover hybrid's AR parent (our block-diffusion GDN
    tensors at zero): in block mode its GDN layers stay causal and its attention layers see
    the whole block. transformers' full-attention layers honour a 4D mask."""
    family, hf, _, ours = pair
    if family in ATTENTION_ONLY:
        pytest.skip("attention-only family: test_block_mode_matches_a_block_causal_mask")
    P, B = 9, 6
    x = ids(P + B, seed=2)
    with torch.no_grad():
        want = hf(x, attention_mask=block_mask(P, B)).logits
        got = ours.logits(ours(x, mode="block", n_commit=P))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("shifted", [True, False])
def test_first_block_reads_the_right_positions(pair, shifted):
    """low_confidence at threshold 0 commits the whole first block in one step: each position
    is the argmax transformers gives under the block mask at p - 1 (shifted) or p."""
    family, hf, _, ours = pair
    ours.config.mask_token_id, ours.config.shifted = 3, shifted
    P, B = 7, 4
    prompt = ids(P, seed=3)
    results: list = []
    policy = make_policy("low_confidence", block_size=B, threshold=0.0)
    for _ in generate(ours, [prompt[0].tolist()], policy, max_new_tokens=B, results=results):
        pass
    x = torch.cat([prompt, torch.full((1, B), 3)], 1)
    with torch.no_grad():
        logits = hf(x, attention_mask=block_mask(P, B)).logits[0]
    rows = range(P - 1, P - 1 + B) if shifted else range(P, P + B)
    assert results[0].tokens == [int(logits[r].argmax()) for r in rows]


def test_generate_runs_on_each_directory(pair, capsys):
    """`clover generate --model DIR` with a tokenizer beside the weights: its default decoder
    (ar: these configs name no [MASK])."""
    from clover.cli import main
    from tests.test_tokenizer import CHATML, _byte_level_backend, _write_dir

    family, _, directory, _ = pair
    _write_dir(
        directory, _byte_level_backend(), {"eos_token": "<|im_end|>", "chat_template": CHATML}
    )
    rc = main(["generate", "--model", str(directory), "-p", "hello", "--max-tokens", "4",
               "--dtype", "float32", "--json"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["decoder"] == "ar" and out["output_tokens"] <= 4


# --- the Clover backbone family: layouts --------------------------------------------------------


def saved(directory) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return json.loads((directory / "config.json").read_text()), load_file(
        str(directory / "model.safetensors")
    )


def logits_of(config: dict, state: dict, x: torch.Tensor) -> torch.Tensor:
    model = model_from_state(config, dict(state), "test", torch.float32)
    with torch.no_grad():
        return model.logits(model(x))


@pytest.fixture(scope="module")
def next_and_35(tmp_path_factory):
    out = {}
    for family in ("qwen3_next", "qwen3_5_moe_text"):
        hf = hf_model(family, seed=5)
        directory = tmp_path_factory.mktemp(f"{family}-layouts")
        hf.save_pretrained(str(directory))
        with torch.no_grad():
            out[family] = (hf, directory, hf(ids(11)).logits)
    return out


def test_gdn_layouts_fused_and_split(next_and_35):
    """Qwen3-Next files fuse q/k/v/z and b/a per key-head group; Qwen3.5 files split them."""
    _, next_dir, _ = next_and_35["qwen3_next"]
    _, split_dir, _ = next_and_35["qwen3_5_moe_text"]
    _, next_state = saved(next_dir)
    _, split_state = saved(split_dir)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in next_state
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in next_state
    assert "model.layers.1.linear_attn.in_proj_qkv.weight" in split_state
    assert "model.layers.1.linear_attn.in_proj_z.weight" in split_state


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_experts_per_expert_or_fused(next_and_35, family):
    """The same experts as per-expert tensors or fused `gate_up_proj` / `down_proj`."""
    from clover.models.moe import sanitize_experts, unstack_experts

    hf, directory, want = next_and_35[family]
    config, state = saved(directory)
    E = config["num_experts"]
    ours = sanitize_experts(state, E)  # whatever the file holds -> stacked
    for form in (unstack_experts(ours, fused=False), unstack_experts(ours, fused=True)):
        torch.testing.assert_close(logits_of(config, form, ids(11)), want, atol=ATOL, rtol=0)
    per = unstack_experts(ours, fused=False)
    assert any(".mlp.experts.7.down_proj.weight" in k for k in per)


def test_qwen36_format_checkpoint_loads_as_the_hybrids_ar_parent(next_and_35, tmp_path, capsys):
    """A Qwen3.6-format checkpoint (vision-language config with `text_config`, tensors under
    `model.language_model.`, an MTP head and a vision tower) loads into the Clover hybrid: the
    extra towers skipped with one notice, our block-diffusion tensors at zero, logits equal to
    transformers' `qwen3_5_moe_text`."""
    from clover.models.clover import CloverModel

    _, directory, want = next_and_35["qwen3_5_moe_text"]
    text_config, state = saved(directory)
    wrapped = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": text_config, "vision_config": {"depth": 1}}  # fmt: skip
    tensors = {f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.")
               else k: v for k, v in state.items()}  # fmt: skip
    tensors["mtp.layers.0.mlp.gate.weight"] = torch.zeros(8, 32)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(12, 4)
    model = model_from_state(wrapped, dict(tensors), "qwen3.6", torch.float32)
    assert isinstance(model, CloverModel) and model.config.model_type == "qwen3_5_moe_text"
    assert "skipped 2 tensor(s)" in capsys.readouterr().err
    gdn = model.model.layers[1].linear_attn
    assert not gdn.right_conv.any() and not gdn.block_mix.any() and not gdn.history_bias.any()
    with torch.no_grad():
        got = model.logits(model(ids(11)))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_our_checkpoint_is_the_published_layout_plus_ours(next_and_35, tmp_path):
    """Saved by Clover (after block-diffusion training moved our tensors), a hybrid is
    transformers' qwen3_5_moe_text layout plus our tensors: transformers loads it and its
    causal logits equal ours (our tensors act on block tokens only), and we read it back
    exactly."""
    from clover.checkpoints.hf_dir import save_checkpoint

    _, directory, _ = next_and_35["qwen3_5_moe_text"]
    config, state = read_hf_dir(directory)
    model = model_from_state(config, state, "3.5", torch.float32)
    with torch.no_grad():
        for p in (
            model.model.layers[1].linear_attn.block_mix,
            model.model.layers[1].linear_attn.right_conv,
        ):
            p.add_(0.1)
    out = save_checkpoint(model, tmp_path / "ours")
    _, written = saved(out)
    assert "model.layers.1.linear_attn.in_proj_qkv.weight" in written
    assert "model.layers.1.linear_attn.block_mix" in written
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(str(out)).eval()
    x = ids(11)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(model(x)), hf(x).logits, atol=ATOL, rtol=0)
    again = model_from_state(*read_hf_dir(out), "again", torch.float32)
    for name, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name


def test_info_reads_config_and_headers_only(pair, capsys, monkeypatch):
    """`clover info DIR`: parameters from config.json (the model on the meta device), no
    weights read; a tensor of the wrong shape is named."""
    import clover.files
    from clover.cli import main

    family, hf, directory, ours = pair

    def no_reads(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(clover.files, "_read", no_reads)
    assert main(["info", str(directory), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["total_params"] == sum(p.numel() for p in ours.parameters())
    if family in ATTENTION_ONLY:
        assert info["total_params"] == sum(p.numel() for p in hf.parameters())
    assert info["active_params"] <= info["total_params"]
    if family == "qwen3_moe":
        assert info["active_params"] < info["total_params"]


def test_info_names_a_wrong_shape_and_an_unknown_type(tmp_path, capsys):
    from safetensors.torch import save_file

    from clover.cli import main

    hf = hf_model("qwen3")
    hf.save_pretrained(str(tmp_path / "q"))
    config, state = saved(tmp_path / "q")
    state["model.layers.1.self_attn.k_norm.weight"] = torch.ones(7)
    save_file(state, str(tmp_path / "q" / "model.safetensors"))
    assert main(["info", str(tmp_path / "q")]) == 1
    assert "model.layers.1.self_attn.k_norm.weight has shape (7,)" in capsys.readouterr().err
    (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "model_type": "mamba9"}))
    assert main(["info", str(tmp_path / "q")]) == 1
    assert "unknown architecture 'mamba9'" in capsys.readouterr().err
    (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "model_type": "Dream"}))
    assert main(["info", str(tmp_path / "q")]) == 1
    err = capsys.readouterr().err
    assert "Dream" in err and "bidirectionally over the whole sequence" in err


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
def test_export_in_the_published_layout_loads_in_the_transformers_wrapper(family, tmp_path):
    """`clover export` writes a family's published names (per-expert tensors; the hybrid's
    Qwen3.5 layout plus ours); `AutoModelForCausalLM` (Clover's wrapper) reads them back."""
    import clover  # noqa: F401  (registers the wrapper)
    from clover.hf.export import export
    from tests.test_tokenizer import CHATML, _byte_level_backend, _write_dir

    hf = hf_model(family)
    hf.save_pretrained(str(tmp_path / "src"))
    _write_dir(
        tmp_path / "src",
        _byte_level_backend(),
        {"eos_token": "<|im_end|>", "chat_template": CHATML},
    )
    out = export(str(tmp_path / "src"), tmp_path / "out", progress=False)
    _, written = saved(out)
    assert any(".mlp.experts." in k for k in written)
    wrapper = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    x = ids(9)
    with torch.no_grad():
        torch.testing.assert_close(wrapper(x).logits, hf(x).logits, atol=ATOL, rtol=0)
