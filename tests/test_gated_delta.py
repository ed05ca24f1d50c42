"""Gated DeltaNet operators: the chunked form equals the token-by-token reference, state
carries across calls, the delta rule really stores and overwrites, the short convolution
streams, and gradients flow (and agree) through the chunked form.

Tolerance: float32, unit-norm keys, outputs of order 1: chunked vs recurrent agree to ~1e-6
in practice; we assert atol = rtol = 1e-4. Gradient comparisons run in float64 (the ops
compute in float64 for float64 inputs) at 1e-9.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clover.errors import CloverError
from clover.ops.gated_delta import (
    causal_conv1d,
    gated_delta_chunked,
    gated_delta_recurrent,
)

ATOL = RTOL = 1e-4


def inputs(b=2, t=37, h_k=2, h_v=4, d_k=8, d_v=6, seed=0, dtype=torch.float32):
    """Random inputs with H_v = 2 H_k, decays as the model makes them: g = -exp(A) softplus(.)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    a_log = torch.empty(h_v, dtype=dtype).uniform_(0.0, 2.77, generator=gen)  # A in [1, 16]
    return dict(
        q=rnd(b, t, h_k, d_k),
        k=rnd(b, t, h_k, d_k),
        v=rnd(b, t, h_v, d_v),
        g=-F.softplus(rnd(b, t, h_v) - 2.0) * a_log.exp(),
        beta=torch.sigmoid(rnd(b, t, h_v)),
    )


def initial_state(x, seed=1):
    b, _, h_v, d_v = x["v"].shape
    d_k = x["k"].shape[-1]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, h_v, d_k, d_v, generator=gen, dtype=x["v"].dtype)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("t", [1, 5, 37, 130])
@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_chunked_matches_recurrent(chunk_size, t, with_state):
    x = inputs(t=t, seed=t)
    s0 = initial_state(x) if with_state else None
    out_r, s_r = gated_delta_recurrent(**x, state=s0)
    out_c, s_c = gated_delta_chunked(**x, state=s0, chunk_size=chunk_size)
    assert out_c.shape == (2, t, 4, 6) and s_c.shape == (2, 4, 8, 6)
    torch.testing.assert_close(out_c, out_r, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s_c, s_r, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("op", ["recurrent", "chunked"])
def test_split_with_carried_state_equals_one_call(op):
    fn = {
        "recurrent": gated_delta_recurrent,
        "chunked": lambda **kw: gated_delta_chunked(**kw, chunk_size=16),
    }[op]
    x = inputs(t=37)
    s0 = initial_state(x)
    s0_copy = s0.clone()
    out, s = fn(**x, state=s0)
    first = {n: y[:, :20] for n, y in x.items()}
    second = {n: y[:, 20:] for n, y in x.items()}
    out1, s1 = fn(**first, state=s0)
    out2, s2 = fn(**second, state=s1)
    torch.testing.assert_close(torch.cat([out1, out2], dim=1), out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s2, s, atol=ATOL, rtol=RTOL)
    assert torch.equal(s0, s0_copy)  # callers re-run blocks from the same state


def test_dtypes_follow_convention():
    x = {n: y.bfloat16() for n, y in inputs(t=5).items()}
    out, s = gated_delta_chunked(**x)
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32
    out, s = gated_delta_recurrent(**x)
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_decay_is_applied_before_the_correction():
    # one head, Dk = Dv = 1, k = 1: S1 = a S0 + b (v - a S0) = 0.5*2 + 0.5*(1 - 1) = 1.
    # Decay after the correction would give 0.75, no decay in the prediction 0.5.
    one = torch.ones(1, 1, 1, 1)
    g = torch.full((1, 1, 1), 0.5).log()
    beta = torch.full((1, 1, 1), 0.5)
    s0 = torch.full((1, 1, 1, 1), 2.0)
    for fn in (gated_delta_recurrent, gated_delta_chunked):
        out, s = fn(one, one, one, g, beta, state=s0, normalize_qk=False)
        assert s.item() == pytest.approx(1.0) and out.item() == pytest.approx(1.0)


@pytest.mark.parametrize("fn", [gated_delta_recurrent, gated_delta_chunked])
def test_delta_rule_stores_and_overwrites(fn):
    d, n = 8, 5
    keys = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(0)))[0][:n]
    values = torch.randn(n, 3)
    new_value = torch.randn(3)
    # write k_0..k_4 -> v_0..v_4, then k_0 again -> new_value (g = 0, beta = 1)
    k = torch.cat([keys, keys[:1]])[None, :, None]  # [1, 6, 1, d]
    v = torch.cat([values, new_value[None]])[None, :, None]  # [1, 6, 1, 3]
    zeros, ones = torch.zeros(1, n + 1, 1), torch.ones(1, n + 1, 1)
    _, s = fn(k, k, v, zeros, ones, normalize_qk=False)
    # read back without writing (beta = 0): querying with k_i returns what k_i holds
    read, _ = fn(
        keys[None, :, None],
        keys[None, :, None],
        torch.zeros(1, n, 1, 3),
        torch.zeros(1, n, 1),
        torch.zeros(1, n, 1),
        state=s,
        normalize_qk=False,
    )
    expected = torch.cat([new_value[None], values[1:]])  # linear attention would give v_0 + new
    torch.testing.assert_close(read[0, :, 0], expected, atol=1e-5, rtol=1e-5)


def test_normalize_qk_scales_and_normalises():
    x = inputs(t=9)
    out, s = gated_delta_recurrent(**x)
    q, k = x["q"], x["k"]
    manual = dict(x, q=F.normalize(q, dim=-1) * q.shape[-1] ** -0.5, k=F.normalize(k, dim=-1))
    out_m, s_m = gated_delta_recurrent(**manual, normalize_qk=False)
    torch.testing.assert_close(out, out_m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_m, atol=1e-5, rtol=1e-5)


def test_value_head_reads_its_key_group():
    # H_k = 2, H_v = 4: value heads 0, 1 read key head 0 and value heads 2, 3 read key head 1
    x = inputs(t=7)
    out, _ = gated_delta_chunked(**x, chunk_size=4)
    for h in range(4):
        single = dict(
            q=x["q"][:, :, h // 2 : h // 2 + 1],
            k=x["k"][:, :, h // 2 : h // 2 + 1],
            v=x["v"][:, :, h : h + 1],
            g=x["g"][:, :, h : h + 1],
            beta=x["beta"][:, :, h : h + 1],
        )
        ref, _ = gated_delta_recurrent(**single)
        torch.testing.assert_close(out[:, :, h : h + 1], ref, atol=ATOL, rtol=RTOL)


def test_gradients_flow_and_match_recurrent():
    x = inputs(b=1, t=11, h_k=1, h_v=2, d_k=4, d_v=3, dtype=torch.float64)
    x["state"] = initial_state(x)
    grads = {}
    for name, fn in (("r", gated_delta_recurrent), ("c", gated_delta_chunked)):
        leaves = {n: y.clone().requires_grad_(True) for n, y in x.items()}
        kw = {"chunk_size": 4} if name == "c" else {}
        out, s = fn(**leaves, **kw)
        (out.sin().sum() + s.cos().sum()).backward()
        grads[name] = {n: y.grad for n, y in leaves.items()}
    for n in x:
        assert torch.isfinite(grads["c"][n]).all(), n
        torch.testing.assert_close(grads["c"][n], grads["r"][n], atol=1e-9, rtol=1e-9)
    # float32 backward through padding (T not a multiple of the chunk) stays finite
    x32 = {n: y.float().requires_grad_(True) for n, y in inputs(t=5).items()}
    out, s = gated_delta_chunked(**x32, chunk_size=4)
    (out.sum() + s.sum()).backward()
    assert all(torch.isfinite(y.grad).all() for y in x32.values())


@pytest.mark.parametrize("kernel", [1, 4])
def test_causal_conv1d_streaming_equals_full(kernel):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 5, generator=gen)
    w = torch.randn(5, kernel, generator=gen)
    s0 = torch.randn(2, 5, kernel - 1, generator=gen)
    y, s = causal_conv1d(x, w, s0)
    # explicit definition: y_t = sum_j w[:, j] * x_{t - (K - 1) + j}, history from s0
    hist = torch.cat([s0.transpose(1, 2), x], dim=1)
    ref = sum(w[:, j] * hist[:, j : j + 9] for j in range(kernel))
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
    state, steps = s0, []
    for t in range(9):  # one token at a time, state carried
        y_t, state = causal_conv1d(x[:, t : t + 1], w, state)
        steps.append(y_t)
    torch.testing.assert_close(torch.cat(steps, dim=1), y, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, s, atol=0, rtol=0)
    y_a, s_a = causal_conv1d(x[:, :2], w, s0)  # a split shorter than K - 1 also carries
    y_b, s_b = causal_conv1d(x[:, 2:], w, s_a)
    torch.testing.assert_close(torch.cat([y_a, y_b], dim=1), y, atol=1e-6, rtol=1e-6)


def test_bad_shapes_raise_clover_error():
    x = inputs(t=5, h_v=3)  # 3 value heads are not a multiple of 2 key heads
    with pytest.raises(CloverError, match="multiple"):
        gated_delta_recurrent(**x)
    x = inputs(t=5)
    with pytest.raises(CloverError, match="state"):
        gated_delta_chunked(**x, state=torch.zeros(2, 4, 8, 7))
    with pytest.raises(CloverError, match="chunk_size"):
        gated_delta_chunked(**x, chunk_size=0)
    with pytest.raises(CloverError, match="conv state"):
        causal_conv1d(torch.zeros(1, 3, 4), torch.zeros(4, 4), torch.zeros(1, 4, 2))
