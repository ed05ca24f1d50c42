"""The published block-diffusion checkpoints, as tiny random directories with their own config
conventions: SDAR / TraDo (`sdar`), SDAR-MoE (`sdar_moe`), Fast-dLLM v2 (`Fast_dLLM_Qwen`),
LLaDA2.0 (`llada2_moe`, checked against reference functions written from its description);
Dream and LLaDA refused with the reason."""

import json
import math

import pytest
import torch
import transformers

from clover.checkpoints.hf_dir import model_from_state, read_hf_dir, save_checkpoint
from clover.checkpoints.loader import load
from clover.cli import main
from clover.errors import CloverError
from clover.models import make_config
from clover.models.llada2 import LLaDA2Model
from tests.test_hf_parity import ATOL, ids
from tests.test_tokenizer import CHATML, _byte_level_backend, _write_dir

SMALL = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
)


def with_tokenizer(directory, mask: str | None) -> int | None:
    """The byte-level test tokenizer (+ the family's [MASK] as an added token) -> its id."""
    backend = _byte_level_backend()
    if mask:
        backend.add_special_tokens([mask])
    _write_dir(directory, backend, {"eos_token": "<|im_end|>", "chat_template": CHATML})
    return backend.token_to_id(mask) if mask else None


def published(tmp_path, hf_cls: str, cfg_cls: str, model_type: str, arch: str, mask, **kw):
    """A transformers model saved, its config.json rewritten as the published one says."""
    torch.manual_seed(0)
    hf = getattr(transformers, hf_cls)(getattr(transformers, cfg_cls)(**SMALL, **kw)).eval()
    directory = tmp_path / model_type
    hf.save_pretrained(str(directory))
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type=model_type, architectures=[arch])
    if model_type == "Fast_dLLM_Qwen":
        config["bd_size"] = 32
    (directory / "config.json").write_text(json.dumps(config))
    return hf, directory, with_tokenizer(directory, mask)


@pytest.mark.parametrize(
    "hf_cls, cfg_cls, model_type, arch, kw",
    [
        ("Qwen3ForCausalLM", "Qwen3Config", "sdar", "SDARForCausalLM", dict(head_dim=16)),
        ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "sdar_moe", "SDARMoeForCausalLM",
         dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    ],
)  # fmt: skip
def test_sdar_conventions(tmp_path, capsys, hf_cls, cfg_cls, model_type, arch, kw):
    """Qwen3 names; not shifted; blocks of 4; [MASK] (`<|MASK|>`) from the tokenizer, as the
    released config has none; its own logits are Qwen3's."""
    hf, directory, mask_id = published(
        tmp_path, hf_cls, cfg_cls, model_type, arch, "<|MASK|>", **kw
    )
    loaded = load(str(directory), dtype="float32", progress=False)
    c = loaded.model.config
    assert (c.model_type, c.shifted, c.block_size, c.default_decoder) == (
        model_type, False, 4, "low_confidence"
    )  # fmt: skip
    assert c.mask_token_id == mask_id
    x = ids(11)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model.logits(loaded.model(x)), hf(x).logits, atol=ATOL, rtol=0
        )
    assert main(["generate", "--model", str(directory), "-p", "hi", "--max-tokens", "8",
                 "--dtype", "float32", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["decoder"], out["block_size"]) == ("low_confidence", 4)
    assert main(["generate", "--model", str(directory), "-p", "hi", "--decoder", "self_spec",
                 "--dtype", "float32"]) == 1  # fmt: skip
    assert "self_spec needs a token-shifted model" in capsys.readouterr().err


def test_fast_dllm_v2_conventions(tmp_path, capsys):
    """Qwen2 names (q/k/v bias); token-shifted; blocks of `bd_size`; `|<MASK>|`."""
    hf, directory, mask_id = published(
        tmp_path, "Qwen2ForCausalLM", "Qwen2Config", "Fast_dLLM_Qwen", "Fast_dLLM_QwenForCausalLM",
        "|<MASK>|",
    )  # fmt: skip
    loaded = load(str(directory), dtype="float32", progress=False)
    c = loaded.model.config
    assert (c.shifted, c.block_size, c.mask_token_id, c.qkv_bias) == (True, 32, mask_id, True)
    x = ids(11)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model.logits(loaded.model(x)), hf(x).logits, atol=ATOL, rtol=0
        )
    assert main(["generate", "--model", str(directory), "-p", "hi", "--max-tokens", "8",
                 "--dtype", "float32", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["block_size"] == 32


def test_a_missing_mask_token_is_named(tmp_path):
    _, directory, _ = published(
        tmp_path, "Qwen3ForCausalLM", "Qwen3Config", "sdar", "SDARForCausalLM", None, head_dim=16
    )
    with pytest.raises(CloverError, match="no <\\|MASK\\|> token"):
        load(str(directory), dtype="float32", progress=False)


@pytest.mark.parametrize("model_type", ["Dream", "llada"])
def test_full_bidirectional_models_are_refused_with_the_reason(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "model_type": model_type}))
    with pytest.raises(CloverError, match="whole sequence.*cannot run it"):
        load(str(tmp_path), progress=False)


# --- LLaDA2.0 -----------------------------------------------------------------------------------

LLADA2 = dict(
    model_type="llada2_moe",
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=3,
    num_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    partial_rotary_factor=0.5,
    rope_theta=600000.0,
    max_position_embeddings=128,
    eos_token_id=1,
    mask_token_id=5,
)


def llada2(seed: int = 0) -> LLaDA2Model:
    torch.manual_seed(seed)
    model = LLaDA2Model(make_config(LLADA2)).eval()
    with torch.no_grad():  # something to route on: a nonzero expert bias, sharper weights
        for layer in model.model.layers[1:]:
            layer.mlp.expert_bias.normal_(0, 0.5)
        model.model.embed_tokens.weight.mul_(8)
    return model


def reference_route(scores_logits, bias, n_group, topk_group, k, scale):
    """From the published description, one token at a time: sigmoid scores; a group's score
    is the sum of its two best biased scores; keep the best `topk_group` groups; pick the k
    best biased scores inside them; weight = unbiased score / their sum * scale."""
    E = scores_logits.shape[-1]
    per = E // n_group
    out = []
    for row in scores_logits.detach():
        s = [1 / (1 + math.exp(-float(v))) for v in row]
        b = [s[e] + float(bias[e]) for e in range(E)]
        groups = sorted(range(n_group), key=lambda g: -sum(sorted(b[g * per : (g + 1) * per])[-2:]))
        allowed = [e for g in groups[:topk_group] for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: -b[e])[:k]
        total = sum(s[e] for e in chosen)
        out.append({e: s[e] / total * scale for e in chosen})
    return out


def test_llada2_router_matches_the_reference():
    moe = llada2().model.layers[1].mlp
    x = torch.randn(9, 32)
    weights, experts = moe.route(x)
    want = reference_route(moe.router(x), moe.expert_bias, 4, 2, 3, 2.5)
    for w, e, ref in zip(weights, experts, want):
        assert set(e.tolist()) == set(ref)
        for wi, ei in zip(w.tolist(), e.tolist()):
            assert abs(wi - ref[ei]) < 1e-6


def reference_attention(attn, x: torch.Tensor, theta: float, rotary: int) -> torch.Tensor:
    """Causal attention as LLaDA2's description says: fused qkv (rows q, k, v), RMSNorm per
    q and k head, NeoX RoPE on the first `rotary` dims of each head, GQA, output `dense`."""
    T = x.shape[0]
    hq, hkv, dh = attn.hq, attn.hkv, attn.dh
    q, k, v = attn.query_key_value(x).split([hq * dh, hkv * dh, hkv * dh], -1)
    q, k, v = q.view(T, hq, dh), k.view(T, hkv, dh), v.view(T, hkv, dh)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q, k = rms(q, attn.query_layernorm.weight), rms(k, attn.key_layernorm.weight)
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # [T, rotary/2]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]

    def rope(t):
        a, b, rest = t[..., : rotary // 2], t[..., rotary // 2 : rotary], t[..., rotary:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(dh)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, hq * dh)
    return attn.dense(out)


def test_llada2_attention_matches_the_reference():
    from clover.models.layers import rope_cos_sin
    from clover.models.layout import cached_layout

    model = llada2()
    attn = model.model.layers[0].attention
    T = 10
    x = torch.randn(1, T, 32)
    layout = cached_layout(torch.tensor([T]), torch.tensor([0]), torch.tensor([0]), T)
    cache = model.make_cache(1).layers[0]
    cache.reserve(T)
    with torch.no_grad():
        got = attn(x, rope_cos_sin(layout.positions, model.inv_freq), layout, cache)[0]
        want = reference_attention(attn, x[0], 600000.0, 8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_llada2_round_trip_in_its_own_names(tmp_path, capsys):
    model = llada2()
    save_checkpoint(model, tmp_path / "l2")
    config, state = read_hf_dir(tmp_path / "l2")
    assert "model.word_embeddings.weight" in state
    assert "model.layers.1.mlp.gate.expert_bias" in state
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in state
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in state
    assert "model.layers.0.attention.query_key_value.weight" in state
    again = model_from_state(config, state, "l2", torch.float32)
    for name, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name
    x = ids(9)
    with torch.no_grad():
        torch.testing.assert_close(again.logits(again(x)), model.logits(model(x)))
        block = again.logits(again(x, mode="block", n_commit=5))  # prefix causal, block both ways
        torch.testing.assert_close(block[:, :5], again.logits(again(x[:, :5])))
        assert not torch.allclose(block[:, 5:], again.logits(again(x))[:, 5:])
    with_tokenizer(tmp_path / "l2", None)
    assert main(["generate", "--model", str(tmp_path / "l2"), "-p", "hi", "--max-tokens", "8",
                 "--dtype", "float32", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["decoder"], out["block_size"]) == ("low_confidence", 32)


def test_llada2_published_defaults():
    published = {k: v for k, v in LLADA2.items() if k != "mask_token_id"}
    c = make_config({**published, "vocab_size": 157184})
    assert (c.mask_token_id, c.shifted, c.block_size) == (156895, False, 32)
    with pytest.raises(CloverError, match="n_group"):
        make_config({**LLADA2, "n_group": 3})
