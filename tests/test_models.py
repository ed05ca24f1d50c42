import pytest
import torch

from clover.errors import CloverError
from clover.models import build_model, make_config
from clover.models.layers import rope_inv_freq
from clover.models.layout import training_layout
from tests.conftest import TINY, tiny_model

ATOL = 1e-4


def logits(model, ids, cache=None, mode="causal", **kw):
    with torch.no_grad():
        return model.logits(model(ids, cache, mode, **kw))


def test_config_validation():
    with pytest.raises(CloverError, match="multiple of num_key_value_heads"):
        make_config({**TINY, "num_key_value_heads": 3})
    with pytest.raises(CloverError, match="unknown architecture"):
        make_config({**TINY, "model_type": "mamba"})
    with pytest.raises(CloverError, match="mask_token_id"):
        make_config({**TINY, "mask_token_id": 64})
    with pytest.raises(CloverError, match="hidden_size"):
        make_config({**TINY, "hidden_size": 0})
    with pytest.raises(CloverError, match="rope_scaling"):
        make_config({**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 2}})
    cfg = make_config({**TINY, "some_unknown_key": 1})
    assert cfg.to_dict()["some_unknown_key"] == 1


def test_cached_equals_uncached_causal(model):
    ids = torch.randint(0, 64, (2, 30))
    full = logits(model, ids)
    cache = model.make_cache(2)
    parts = [logits(model, ids[:, a:b], cache) for a, b in [(0, 11), (11, 12), (12, 30)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == [30, 30]


def test_block_preview_never_touches_prefix(model):
    ids = torch.randint(0, 64, (1, 24))
    cache = model.make_cache(1)
    model(ids[:, :16], cache)
    before = [layer.k[:, :, :16].clone() for layer in cache.layers]
    noisy = ids[:, 16:].clone()
    noisy[:, ::2] = 3  # masks
    cached = logits(model, noisy, cache, "block")
    assert cache.lengths.item() == 16
    for layer, k in zip(cache.layers, before):
        assert torch.equal(layer.k[:, :, :16], k)
    # uncached reference: the prefix committed and the block previewed in one fresh pass
    fresh = logits(model, torch.cat([ids[:, :16], noisy], 1), None, "block", n_commit=16)
    torch.testing.assert_close(cached, fresh[:, 16:], atol=ATOL, rtol=0)
    # the block is bidirectional: changing its last token changes the first position's output
    other = noisy.clone()
    other[:, -1] = 7
    assert not torch.allclose(logits(model, other, cache, "block")[:, 0], cached[:, 0])
    # and after many previews, a causal continuation still matches the uncached model
    cont = logits(model, ids[:, 16:], cache)
    torch.testing.assert_close(cont, logits(model, ids)[:, 16:], atol=ATOL, rtol=0)


def test_fused_commit_and_preview(model):
    ids = torch.randint(0, 64, (1, 28))
    block = torch.full((1, 8), 3)
    a = model.make_cache(1)
    model(ids[:, :20], a)
    fused = logits(model, torch.cat([ids[:, 20:], block], 1), a, "block", n_commit=8)
    b = model.make_cache(1)
    model(ids, b)
    separate = logits(model, block, b, "block")
    torch.testing.assert_close(fused[:, 8:], separate, atol=ATOL, rtol=0)
    assert a.lengths.item() == b.lengths.item() == 28


def test_rows_at_different_lengths_match_single_rows(model):
    seqs = [torch.randint(0, 64, (n,)) for n in (5, 13, 9)]
    blocks = [torch.randint(0, 64, (4,)) for _ in seqs]
    cache = model.make_cache(3)
    T = max(len(s) for s in seqs)
    ids = torch.zeros(3, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    model(ids, cache, n_valid=torch.tensor([len(s) for s in seqs]))
    batched = logits(model, torch.stack(blocks), cache, "block")
    for i, s in enumerate(seqs):
        single = model.make_cache(1)
        model(s[None], single)
        torch.testing.assert_close(
            batched[i], logits(model, blocks[i][None], single, "block")[0], atol=ATOL, rtol=0
        )


def test_training_layout_matches_cached_blocks(model):
    prompt, answer, B = 6, 12, 4
    ids = torch.randint(0, 64, (1, prompt + answer))
    noisy = ids[:, prompt:].clone()
    noisy[:, 1::3] = 3
    layout = training_layout(torch.tensor([prompt]), prompt + answer, answer, B)
    train = logits(model, torch.cat([ids, noisy], 1), mode="train", layout=layout)
    torch.testing.assert_close(train[:, : prompt + answer], logits(model, ids), atol=ATOL, rtol=0)
    cache = model.make_cache(1)
    model(ids[:, :prompt], cache)
    for j in range(answer // B):
        blk = logits(model, noisy[:, j * B : (j + 1) * B], cache, "block")
        got = train[:, prompt + answer + j * B : prompt + answer + (j + 1) * B]
        torch.testing.assert_close(got, blk, atol=ATOL, rtol=0)
        model(ids[:, prompt + j * B : prompt + (j + 1) * B], cache)


def test_context_limit_is_enforced(model):
    cache = model.make_cache(1)
    with pytest.raises(CloverError, match="context of 256"):
        model(torch.zeros(1, 257, dtype=torch.long), cache)


def test_qwen2_and_tied_variants_build():
    q = build_model(make_config({**TINY, "model_type": "qwen2", "tie_word_embeddings": True}))
    assert q.model.layers[0].self_attn.q_proj.bias is not None
    assert q.model.layers[0].self_attn.o_proj.bias is None
    assert not hasattr(q, "lm_head")
    n = sum(p.numel() for p in tiny_model().parameters())
    assert n == tiny_model().config.num_params


def test_llama3_rope_scaling_keeps_high_frequencies():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    base = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(scaled[:8], base[:8])  # short wavelengths untouched
    assert torch.allclose(scaled[-4:], base[-4:] / 8)  # long ones slowed by the factor


def test_bfloat16_on_cpu_attends_in_float32_over_a_float32_cache():
    """The fast path (16-bit weights, float32 K/V and attention on CPU) against the reference
    (the same bfloat16 weights, all in float32): the fast path is closer to it than bf16
    attention over the whole sequence is."""
    from clover.models.cache import kv_dtype

    ref = tiny_model(4)
    half = tiny_model(4).to(torch.bfloat16)
    ref.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    assert kv_dtype(half) == kv_dtype(ref) == torch.float32
    ids = torch.randint(0, 64, (2, 20))
    cache = half.make_cache(2)
    assert cache.layers[0].k.dtype == torch.float32
    parts = [logits(half, ids[:, a:b], cache) for a, b in [(0, 12), (12, 13), (13, 20)]]
    fast = torch.cat(parts, 1).float()
    want = logits(ref, ids)
    plain = logits(half, ids).float()  # no cache: bf16 attention
    err_fast, err_plain = (fast - want).abs().max(), (plain - want).abs().max()
    assert err_fast <= err_plain + 1e-3
    assert err_fast < 0.1 * want.abs().max()
    half.kv_cache_dtype = torch.bfloat16  # the override: the bf16 cache of before
    assert half.make_cache(1).layers[0].k.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fast_path(dtype):
    """The CPU inference RMSNorm (a LayerNorm of [x, -x]) against F.rms_norm (the reference,
    also what runs under autograd)."""
    from clover.models.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(3, 5, 48) * 4).to(dtype)
    ref = torch.nn.functional.rms_norm(x.float(), (48,), norm.weight.float(), 1e-5)
    with torch.no_grad():
        fast = norm(x)
    trained = norm(x)  # grad enabled: the plain rms_norm path
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(fast.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(trained.float(), ref, rtol=tol, atol=tol)


def test_rope_matches_rotate_half():
    """apply_rope (roll + a sin with its first half negated) against the textbook rotate-half
    form, full and partial rotary."""
    from clover.models.layers import apply_rope, rope_cos_sin

    torch.manual_seed(0)
    positions = torch.tensor([[0, 3, 7, 100]])
    for rotary in (16, 8):
        inv = rope_inv_freq(rotary, 10000.0, None)
        cos, sin = rope_cos_sin(positions, inv)
        x = torch.randn(1, 2, 4, 16)
        freqs = positions[..., None].float() * inv
        c, s = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
        rot, rest = x[..., :rotary], x[..., rotary:]
        half = rotary // 2
        ref = rot * c + torch.cat([-rot[..., half:], rot[..., :half]], -1) * s
        torch.testing.assert_close(apply_rope(x, cos, sin), torch.cat([ref, rest], -1))


def test_attend_packed_matches_attend():
    """attend_packed (one cast, RoPE over q and k together, on the packed projection output)
    against attend on the split q/k/v (the reference), with and without a cache."""
    from clover.models.cache import KVCache
    from clover.models.layers import attend, attend_packed, rope_cos_sin
    from clover.models.layout import cached_layout

    torch.manual_seed(0)
    B, T, hq, hkv, dh = 2, 5, 6, 2, 16
    qkv = torch.randn(B, T, (hq + 2 * hkv) * dh, dtype=torch.bfloat16)
    for rotary in (dh, dh // 2):
        rope = rope_cos_sin(torch.arange(3, 3 + T).expand(B, T), rope_inv_freq(rotary, 1e4, None))
        q, k, v = qkv.split([hq * dh, hkv * dh, hkv * dh], -1)
        q, k, v = (t.reshape(B, T, -1, dh).transpose(1, 2) for t in (q, k, v))
        for cached in (False, True):
            lengths = torch.tensor([3, 3] if cached else [0, 0])  # uncached: keys = the input
            layout = cached_layout(torch.tensor([2, 2]), torch.tensor([3, 3]), lengths, T)
            caches = (
                [KVCache(B, hkv, dh, torch.float32) for _ in range(2)] if cached else [None] * 2
            )
            for c in caches:
                if c is not None:
                    c.reserve(16)
            ref = attend(q, k, v, layout, caches[0], rope).transpose(1, 2).reshape(B, T, -1)
            got = attend_packed(qkv, hq, hkv, layout, caches[1], rope)
            assert got.dtype == qkv.dtype and got.shape == (B, T, hq * dh)
            torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=1e-2)
            if cached:
                torch.testing.assert_close(caches[0].k, caches[1].k)


def test_models_know_no_decoding_and_loading_checks_decoder_names():
    """The model layer imports nothing from clover.decoding (one-way layers); a checkpoint whose
    config names an unknown default decoder is refused when loaded, with the name."""
    import ast
    from pathlib import Path

    import clover.models
    from clover.decoding.policies import check_model_defaults

    for path in Path(clover.models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("clover.decoding"), path.name
    c = tiny_model().config
    check_model_defaults(c)
    c.default_decoder = "magic"
    with pytest.raises(CloverError, match="magic"):
        check_model_defaults(c)
