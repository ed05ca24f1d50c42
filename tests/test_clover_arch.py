import pytest
import torch

from clover.checkpoints.hf_dir import model_from_state, read_hf_dir, save_checkpoint
from clover.decoding.loop import generate
from clover.decoding.policies import LowConfidence, SelfSpec, make_policy
from clover.errors import CloverError
from clover.models.clover import CloverModel, preset_config, sanitize
from clover.models.layout import training_layout
from clover.models.moe import MoE, unstack_experts

ATOL = 1e-4  # fp32, cached vs uncached and train vs inference


def tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    config = preset_config("clover-tiny", vocab_size=96, **overrides)
    model = CloverModel(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4)  # sharper logits: fewer greedy near-ties
    return model


def bidirectional(model):
    """Give the block-diffusion GDN parameters non-zero values (as training would)."""
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.kind == "linear_attention":
                layer.linear_attn.right_conv.normal_(0, 0.3)
                layer.linear_attn.block_mix.fill_(0.7)
                layer.linear_attn.history_bias.fill_(0.5)
    return model


def logits(model, ids, cache=None, mode="causal", **kw):
    with torch.no_grad():
        return model.logits(model(ids, cache, mode, **kw))


def test_published_shape_counts():
    c = preset_config("clover-35b-a3b")
    assert c.layer_types.count("full_attention") == 10 and len(c.layer_types) == 40
    assert abs(c.num_params / 35e9 - 1) < 0.05
    assert abs(c.active_params / 3e9 - 1) < 0.05
    assert abs(2 * c.num_params / 69e9 - 1) < 0.05
    with torch.device("meta"):
        assert sum(p.numel() for p in CloverModel(c).parameters()) == c.num_params


def test_active_params_formula_matches_the_module_tree():
    model = tiny()
    c = model.config
    expert = sum(p.numel() for p in (model.model.layers[0].mlp.gate_up,)) // c.num_experts
    expert += model.model.layers[0].mlp.down.numel() // c.num_experts
    total = sum(p.numel() for p in model.parameters())
    unused = c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok) * expert
    # tied embeddings: the table is the LM head, counted once as active
    assert c.active_params == total - unused


@pytest.mark.parametrize("overrides", [{}, {"block_coreset": 3}])
def test_cached_equals_uncached(overrides):
    model = bidirectional(tiny(**overrides))
    ids = torch.randint(3, 96, (2, 21))
    full = logits(model, ids)
    cache = model.make_cache(2)
    parts = [logits(model, ids[:, a:b], cache) for a, b in [(0, 9), (9, 10), (10, 21)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)
    cache = model.make_cache(2)
    model(ids[:, :13], cache)
    block = logits(model, ids[:, 13:], cache, "block")
    fresh = logits(model, ids, None, "block", n_commit=13)[:, 13:]
    torch.testing.assert_close(block, fresh, atol=ATOL, rtol=0)


def test_rows_at_different_lengths_match_single_rows():
    model = bidirectional(tiny())
    seqs = [torch.randint(3, 96, (n,)) for n in (4, 11, 7)]
    blocks = torch.randint(3, 96, (3, 5))
    cache = model.make_cache(3)
    ids = torch.zeros(3, 11, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    model(ids, cache, n_valid=torch.tensor([len(s) for s in seqs]))
    batched = logits(model, blocks, cache, "block")
    for i, s in enumerate(seqs):
        single = model.make_cache(1)
        model(s[None], single)
        want = logits(model, blocks[i][None], single, "block")[0]
        torch.testing.assert_close(batched[i], want, atol=ATOL, rtol=0)


def gdn_only(**kw):
    return tiny(layer_types=["linear_attention"] * 4, **kw)


def test_gdn_block_sees_right_but_prefix_state_stays_causal():
    model = bidirectional(gdn_only())
    ids = torch.randint(3, 96, (1, 16))
    cache = model.make_cache(1)
    model(ids[:, :10], cache)
    states = [(c.state.clone(), c.conv.clone()) for c in cache.layers]
    block = ids[:, 10:].clone()
    first = logits(model, block, cache, "block")
    block[:, -1] = (block[:, -1] + 1) % 96
    second = logits(model, block, cache, "block")
    assert not torch.allclose(first[:, 0], second[:, 0])  # position 0 saw a change at its right
    for c, (s, v) in zip(cache.layers, states):
        assert torch.equal(c.state, s) and torch.equal(c.conv, v)  # previews never write


def test_at_init_the_model_is_its_autoregressive_parent():
    model = gdn_only()  # block-diffusion parameters at their zero init
    ids = torch.randint(3, 96, (1, 16))
    causal = logits(model, ids)
    cache = model.make_cache(1)
    model(ids[:, :10], cache)
    torch.testing.assert_close(
        logits(model, ids[:, 10:], cache, "block"), causal[:, 10:], atol=ATOL, rtol=0
    )
    # and the new parameters never touch the causal (commit) path
    trained = bidirectional(gdn_only())
    trained.load_state_dict(model.state_dict() | {
        k: v for k, v in trained.state_dict().items()
        if k.endswith(("right_conv", "block_mix", "history_bias"))
    })  # fmt: skip
    torch.testing.assert_close(logits(trained, ids), causal, atol=0, rtol=0)


def test_training_layout_matches_cached_previews():
    model = bidirectional(tiny())
    prompt, answer, B = 5, 10, 4
    ids = torch.randint(3, 96, (1, prompt + answer))
    noisy = ids[:, prompt:].clone()
    noisy[:, ::3] = 0
    layout = training_layout(torch.tensor([prompt]), prompt + answer, answer, B)
    train = logits(model, torch.cat([ids, noisy], 1), mode="train", layout=layout)
    torch.testing.assert_close(train[:, : prompt + answer], logits(model, ids), atol=ATOL, rtol=0)
    cache = model.make_cache(1)
    model(ids[:, :prompt], cache)
    for j in range(0, answer, B):
        blk = logits(model, noisy[:, j : j + B], cache, "block")
        got = train[:, prompt + answer + j : prompt + answer + j + B]
        torch.testing.assert_close(got, blk, atol=ATOL, rtol=0)
        model(ids[:, prompt + j : prompt + j + B], cache)


def test_moe_routing_and_fast_path():
    torch.manual_seed(0)
    moe = MoE(hidden=16, experts=6, top_k=2, width=8, shared_width=8, norm_topk=True)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), moe.forward_dense(x), atol=1e-5, rtol=1e-5)
        w, ids = moe.route(x.reshape(-1, 16))
    assert ids.shape == (14, 2) and all(len(set(r.tolist())) == 2 for r in ids)
    torch.testing.assert_close(w.sum(-1), torch.ones(14))
    groups = torch.tensor([0] * 7 + [1] * 7)
    _, cids = moe.route(x.reshape(-1, 16), groups, coreset=3)
    assert len(set(cids[:7].flatten().tolist())) <= 3
    assert len(set(cids[7:].flatten().tolist())) <= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_grouped_path_equals_the_expert_loop(dtype):
    """The grouped-matmul path (where this PyTorch runs it) against the loop over experts and
    the dense reference, with experts that get no token and a token batch of one."""
    from clover.models.moe import _grouped_mm_works

    if not _grouped_mm_works("cpu", dtype):
        pytest.skip("torch._grouped_mm does not run on this PyTorch's CPU")
    torch.manual_seed(0)
    moe = MoE(hidden=32, experts=16, top_k=4, width=16, shared_width=16, norm_topk=True)
    moe = moe.to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for shape in [(2, 9, 32), (1, 1, 32)]:
        x = torch.randn(shape).to(dtype)
        with torch.no_grad():
            assert moe._grouped_fits(x.reshape(-1, 32))
            fast = moe(x)
            moe.grouped = False
            loop = moe(x)
            moe.grouped = True
            if shape[1] == 1:
                assert len(moe.route(x.reshape(-1, 32))[1].unique()) < 16  # idle experts
        torch.testing.assert_close(fast.float(), loop.float(), **tol)
        if dtype == torch.float32:
            torch.testing.assert_close(fast, moe.forward_dense(x), **tol)
    odd = MoE(hidden=30, experts=4, top_k=2, width=8, shared_width=0, norm_topk=True)
    assert not odd._grouped_fits(torch.randn(3, 30))  # rows of 120 bytes: the loop


def test_checkpoint_round_trip_per_expert_and_stacked(tmp_path):
    """Saved in the Qwen3.5 layout (split GDN projections, fused experts) plus our tensors;
    read back from that, from per-expert tensors, or from our own names."""
    model = bidirectional(tiny())
    save_checkpoint(model, tmp_path / "saved")
    config, state = read_hf_dir(tmp_path / "saved")
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in state
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    assert "model.layers.0.linear_attn.right_conv" in state  # ours, beside theirs
    per_expert = unstack_experts(model.state_dict())
    assert any(".mlp.experts.3.down_proj.weight" in k for k in per_expert)
    for source in (state, per_expert, model.state_dict()):
        loaded = model_from_state(config, dict(source), "ckpt", torch.float32)
        for name, t in model.state_dict().items():
            assert torch.equal(t, loaded.state_dict()[name]), name
    bad = dict(per_expert)
    del bad["model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(CloverError, match="lacks"):
        sanitize(bad, model.config)


def test_context_is_enforced():
    model = tiny(max_position_embeddings=32)
    with pytest.raises(CloverError, match="context of 32"):
        model(torch.zeros(1, 33, dtype=torch.long), model.make_cache(1))
    with pytest.raises(CloverError, match="layer_types"):
        preset_config("clover-tiny", layer_types=["linear_attention"])


@pytest.mark.parametrize("policy", [LowConfidence(block_size=4, threshold=0.3), SelfSpec(4)])
def test_decoders_run_and_self_spec_is_exact(policy):
    model = bidirectional(tiny())
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    ar, res = [], []
    list(generate(model, prompts, make_policy("ar"), max_new_tokens=16, results=ar))
    list(generate(model, prompts, policy, max_new_tokens=16, results=res))
    assert all(len(r.tokens) == 16 for r in res)
    if policy.speculative:
        assert [r.tokens for r in res] == [r.tokens for r in ar]


def test_cli_info_describes_the_published_shape_without_memory(capsys):
    import json

    from clover.cli import main

    assert main(["info", "clover-35b-a3b", "--json", "--dtype", "int8", "--plan"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "clover_hybrid"
    assert abs(info["total_params"] / 35e9 - 1) < 0.05
    assert abs(info["active_params"] / 3e9 - 1) < 0.05
    assert abs(info["bf16_bytes"] / 69e9 - 1) < 0.05
    assert info["bytes"] < info["bf16_bytes"] * 0.55
    plan = {(r["dtype"], r["gpus"]): r["total_gb"] for r in info["plan"]}
    assert plan[("bfloat16", 1)] > plan[("bfloat16", 8)] > 0


@pytest.mark.slow
def test_generate_clover_tiny_end_to_end(capsys):
    import json

    from clover.cli import main
    from tests.test_weights import smollm2_path

    if smollm2_path() is None:
        pytest.skip("the preset borrows the default model's tokenizer")
    args = ["generate", "-m", "clover-tiny", "--decoder", "low_confidence", "-p", "hi"]
    assert main([*args, "--max-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output_tokens"] == 12 and out["nfe"] >= 2
