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
