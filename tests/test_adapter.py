"""Draft adapters: the causal path is the base model's, the split training pass equals the
whole-sequence training layout, and the file round-trips."""

import pytest
import torch

from clover.errors import CloverError
from clover.models.adapter import (
    AdapterConfig,
    adapter_params,
    attach_adapter,
    load_adapter,
    save_adapter,
)
from clover.models.layout import noisy_layout, training_layout
from tests.conftest import tiny_model


def adapted(seed=0, **kw):
    model = tiny_model(seed)
    attach_adapter(model, AdapterConfig(rank=4, **kw))
    with torch.no_grad():  # a trained-looking adapter: non-zero deltas and mask vector
        for n, p in model.named_parameters():
            if ".lora_b" in n or "mask_vector" in n:
                p.normal_(0, 0.5)
    return model


def test_causal_path_is_the_base_model():
    base, model = tiny_model(0), adapted(0)
    ids = torch.randint(4, 64, (2, 9))
    torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=0)
    block = torch.tensor([[5, 6, 3, 3, 3]] * 2)
    hb = base(block, mode="block", n_commit=2)
    ha = model(block, mode="block", n_commit=2)
    torch.testing.assert_close(ha[:, :2], hb[:, :2], rtol=0, atol=0)  # committed tokens
    assert not torch.allclose(ha[:, 2:], hb[:, 2:])  # block tokens see the adapter


def test_fresh_adapter_is_the_identity():
    base, model = tiny_model(0), tiny_model(0)
    attach_adapter(model, AdapterConfig(rank=4))
    block = torch.tensor([[5, 6, 3, 3, 3]])
    torch.testing.assert_close(model(block, mode="block", n_commit=2),
                               base(block, mode="block", n_commit=2))  # fmt: skip


@pytest.mark.parametrize("copies", [1, 2])
def test_split_pass_equals_the_training_layout(copies):
    """clean pass into a cache + noisy copies over it == the whole [clean | noisy] sequence."""
    model = adapted(1)
    torch.manual_seed(0)
    prompt_lens = torch.tensor([3, 5])
    answer_lens = torch.tensor([7, 4])
    C, A, bs = 12, 7, 3
    clean = torch.randint(4, 64, (2, C))
    noisy = [torch.where(torch.rand(2, A) < 0.5, 3, torch.randint(4, 64, (2, A)))
             for _ in range(copies)]  # fmt: skip
    with torch.no_grad():
        cache = model.make_cache(2)
        model(clean, cache)
        split = model.forward_over_prefix(
            torch.cat(noisy, 1), cache, noisy_layout(prompt_lens, C, A, bs, answer_lens, copies)
        )
        for c in range(copies):
            layout = training_layout(prompt_lens, C, A, bs, answer_lens)
            whole = model(torch.cat([clean, noisy[c]], 1), mode="train", layout=layout)[:, C:]
            for b in range(2):
                n = int(answer_lens[b])
                torch.testing.assert_close(split[b, c * A : c * A + n], whole[b, :n],
                                           atol=1e-5, rtol=1e-4)  # fmt: skip


def test_split_pass_trains_only_the_adapter():
    model = adapted(2)
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n or "mask_vector" in n)
    cache = model.make_cache(1)
    with torch.no_grad():
        model(torch.randint(4, 64, (1, 6)), cache)
    layout = noisy_layout(torch.tensor([2]), 6, 4, 4)
    hidden = model.forward_over_prefix(torch.tensor([[3, 3, 9, 3]]), cache, layout)
    model.logits(hidden).logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_file_round_trip_and_errors(tmp_path):
    model = adapted(3, layers=[1], targets=["q_proj", "down_proj"])
    assert adapter_params(model) == 1 * (4 * (32 + 32) + 4 * (64 + 32)) + 32
    path = save_adapter(model, tmp_path / "a.safetensors", dtype=torch.float32)
    fresh = tiny_model(3)
    load_adapter(fresh, path)
    block = torch.tensor([[5, 3, 3, 3]])
    torch.testing.assert_close(fresh(block, mode="block", n_commit=1),
                               model(block, mode="block", n_commit=1))  # fmt: skip
    with pytest.raises(CloverError, match="already has"):
        load_adapter(fresh, path)
    with pytest.raises(CloverError, match="outside the model"):
        load_adapter(tiny_model(0, num_hidden_layers=1), path)
    with pytest.raises(CloverError, match="shape"):
        load_adapter(tiny_model(0, intermediate_size=48), path)
    (tmp_path / "bad").write_bytes(b"garbage")
    with pytest.raises(CloverError, match="not a Clover adapter"):
        load_adapter(tiny_model(0), tmp_path / "bad")
    with pytest.raises(CloverError, match="rank"):
        AdapterConfig(rank=0)


def test_partial_adapter_trains_without_the_mask_vector():
    model = tiny_model(4)
    attach_adapter(model, AdapterConfig(rank=2, layers=[1], mask_embedding=False))
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    layout = training_layout(torch.tensor([2]), 6, 4, 2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 3, 3, 9, 3]])
    model(ids, mode="train", layout=layout).sum().backward()  # lower layer: no grad input
    assert all(p.grad is not None for n, p in model.named_parameters() if ".lora_a" in n)


@pytest.mark.slow  # compiles a few graphs: ~1 min on 2 cores
def test_compile_causal_matches_eager():
    """`compile_causal`: passes without block tokens (prefill, AR steps, verify and commit
    passes, rows at different lengths) run compiled and give the eager backbone's hidden
    states; block passes (adapter active) stay eager, so every decoder returns the same
    tokens as the eager model."""
    import copy

    from torch._dynamo.utils import counters

    from clover.decoding.loop import generate
    from clover.decoding.policies import make_policy

    eager = adapted(seed=1)
    fast = copy.deepcopy(eager)
    fast.compile_causal()
    with torch.no_grad():
        ids = torch.randint(4, 64, (2, 7))
        caches = [m.make_cache(2) for m in (eager, fast)]
        outs = [m(ids, c, n_valid=torch.tensor([7, 5])) for m, c in zip((eager, fast), caches)]
        torch.testing.assert_close(outs[0][0], outs[1][0])
        torch.testing.assert_close(outs[0][1, :5], outs[1][1, :5])
        for _ in range(3):  # AR steps at different lengths, then a 3-token verify pass
            step = torch.randint(4, 64, (2, 1))
            a, b = (m(step, c) for m, c in zip((eager, fast), caches))
            torch.testing.assert_close(a, b)
        step = torch.randint(4, 64, (2, 3))
        a, b = (m(step, c, "block", n_commit=3) for m, c in zip((eager, fast), caches))
        torch.testing.assert_close(a, b)
    prompts = [[5, 9, 12, 5, 9], [7, 8, 9, 10, 11, 12, 13]]
    for name, kw in (
        ("ar", {}),
        ("self_spec", dict(block_size=3, draft="mask+lookup")),
        ("low_confidence", dict(block_size=4, threshold=0.5, slide=True)),
    ):
        results = []
        for model in (eager, fast):
            rows: list = []
            for _ in generate(model, prompts, make_policy(name, **kw), max_new_tokens=12,
                              results=rows):  # fmt: skip
                pass
            results.append([r.tokens for r in rows])
        assert results[0] == results[1], name
    assert counters["stats"]["unique_graphs"] >= 2  # it did compile (prefill and AR step)


def test_compile_needs_a_cpp_compiler(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(CloverError, match="C\\+\\+ compiler"):
        tiny_model().compile_causal()
