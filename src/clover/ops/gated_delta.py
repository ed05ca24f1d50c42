"""Gated DeltaNet: the gated delta rule (token-by-token reference and chunked form) and the
short causal convolution that feeds it.

Convention (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", 2024, written with the state
as [Dk, Dv] so that reading is `S^T q`). Per value head, for each token t:

    S_t = alpha_t * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
        = alpha_t S_{t-1} + beta_t k_t (v_t - alpha_t S_{t-1}^T k_t)^T
    o_t = S_t^T q_t

with alpha_t = exp(g_t). The decay is applied *before* the delta-rule correction: the value
the rule replaces is what the decayed state predicts for k_t. This is the paper's equation
(its S is our S^T) and what the reference kernels of the paper's authors compute.

Decisions:
- `normalize_qk=True` (default) L2-normalises q and k over Dk and scales q by Dk**-0.5 inside
  the op, so a caller cannot forget either; with False, q and k are used exactly as given.
  The delta rule only behaves (the state stays bounded) for unit-norm keys and beta in (0, 1).
- Heads: q and k carry H_k heads; v, g, beta and the state carry H_v heads, H_v a multiple of
  H_k. Value head h reads key head h // (H_v // H_k) (`repeat_interleave`, the Qwen3-Next
  layout). The state is per value head: [B, H_v, Dk, Dv].
- g is the log decay, finite and <= 0 (not checked: it is data, and the model computes it as
  -exp(A) * softplus(.)). beta is the write strength in (0, 1).
- Dtypes: the math runs in float32 (float64 if v is float64, which the tests use for tight
  gradient checks); `out` comes back in v's dtype and the final state in the compute dtype.
  The incoming state is never modified in place, so a block-diffusion caller can re-run a
  block from the same state until it commits.
- The chunked form is the WY / UT-transform one: within a chunk the delta-rule corrections
  solve a unit lower-triangular system, then one state update per chunk. Decays stay in log
  space; only differences g_i - g_j with j <= i (or the chunk total) are exponentiated, and
  the masked entries are set to -inf *before* exp, so nothing can overflow. Against the
  recurrent reference it agrees to about 1e-5 in float32 for unit-norm keys (tests use
  atol 1e-4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clover.errors import CloverError

_L2_EPS = 1e-6  # inside the rsqrt: keeps an all-zero key (padding, dead head) finite


def repeat_kv_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each key head `n_rep` times so that value head h reads key head h // n_rep."""
    # x: [B, T, H_k, D] -> [B, T, H_k * n_rep, D]
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    normalize_qk: bool,
) -> tuple[torch.Tensor, ...]:
    """Validate shapes, cast to the compute dtype, normalise q/k and expand key heads."""
    # q, k: [B, T, H_k, Dk]; v: [B, T, H_v, Dv]; g, beta: [B, T, H_v]; state: [B, H_v, Dk, Dv]
    if q.dim() != 4 or k.shape != q.shape:
        raise CloverError(
            f"q and k must both be [B, T, H_k, Dk]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    b, t, h_k, d_k = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t):
        raise CloverError(f"v must be [B={b}, T={t}, H_v, Dv]; got {tuple(v.shape)}")
    h_v, d_v = v.shape[2], v.shape[3]
    if h_v % h_k != 0:
        raise CloverError(f"value heads ({h_v}) must be a multiple of key heads ({h_k})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, h_v):
            raise CloverError(f"{name} must be [B, T, H_v] = {(b, t, h_v)}; got {tuple(x.shape)}")
    if state is not None and state.shape != (b, h_v, d_k, d_v):
        raise CloverError(
            f"state must be [B, H_v, Dk, Dv] = {(b, h_v, d_k, d_v)}; got {tuple(state.shape)}"
        )
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if normalize_qk:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + _L2_EPS) * d_k**-0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + _L2_EPS)
    q, k = repeat_kv_heads(q, h_v // h_k), repeat_kv_heads(k, h_v // h_k)
    if state is None:
        state = q.new_zeros(b, h_v, d_k, d_v)
    return q, k, v, g, beta, state.to(dtype)


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    normalize_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time: the reference the chunked form must match.

    q, k: [B, T, H_k, Dk]; v: [B, T, H_v, Dv]; g, beta: [B, T, H_v];
    state: [B, H_v, Dk, Dv] or None (zeros) -> out [B, T, H_v, Dv], final_state [B, H_v, Dk, Dv].
    """
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, normalize_qk)
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]  # decay first: [B, H, Dk, Dv]
        predicted = torch.einsum("bhkv,bhk->bhv", s, k[:, t])  # what S says k_t holds
        write = beta[:, t, :, None] * (v[:, t] - predicted)  # [B, H, Dv]
        s = s + k[:, t, :, :, None] * write[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return out.to(out_dtype), s


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
    normalize_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, parallel within chunks of `chunk_size` tokens (same math).

    q, k: [B, T, H_k, Dk]; v: [B, T, H_v, Dv]; g, beta: [B, T, H_v];
    state: [B, H_v, Dk, Dv] or None (zeros) -> out [B, T, H_v, Dv], final_state [B, H_v, Dk, Dv].

    Within a chunk with cumulative log decay G_i = g_1 + ... + g_i and incoming state S0, the
    written values u_i = beta_i (v_i - alpha_i S_{i-1}^T k_i) satisfy
        u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j
            = beta_i v_i - beta_i exp(G_i) S0^T k_i
    i.e. (I + A) U = beta V - (beta exp(G) K) S0 with A strictly lower triangular. Solving it
    once per chunk for both right-hand sides gives U = U0 - W S0, then
        O   = (exp(G) Q) S0 + [causal (Q K^T * exp(G_i - G_j))] U
        S_C = exp(G_C) S0 + (exp(G_C - G) K)^T U.
    Only the last two lines depend on the carried state, so they are the only sequential part.
    """
    if chunk_size < 1:
        raise CloverError(f"chunk_size must be >= 1; got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, normalize_qk)
    b, t, h, d_k = q.shape
    d_v = v.shape[-1]
    if t == 0:
        return v.to(out_dtype), s
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, ...] -> [B, H, N, C, ...]; zero padding is a no-op token: k = v = beta = 0
        # writes nothing and g = 0 decays nothing, so the final state is unchanged.
        x = x.movedim(1, 2)
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(b, h, n, c, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    gc = g.cumsum(-1)  # G: [B, H, N, C]
    g_last = gc[..., -1:]  # [B, H, N, 1]

    # exp(G_i - G_j) for j < i (strict) and j <= i (inclusive); -inf before exp, not after
    diff = gc[..., :, None] - gc[..., None, :]  # [B, H, N, C, C]
    ones = torch.ones(c, c, dtype=torch.bool, device=q.device)
    decay_strict = diff.masked_fill(~torch.tril(ones, -1), float("-inf")).exp()
    decay_incl = diff.masked_fill(~torch.tril(ones), float("-inf")).exp()

    a = beta[..., None] * (k @ k.transpose(-1, -2)) * decay_strict  # [B, H, N, C, C]
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * gc.exp()[..., None] * k, beta[..., None] * v], dim=-1)
    solved = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    w, u0 = solved[..., :d_k], solved[..., d_k:]  # [B, H, N, C, Dk], [B, H, N, C, Dv]

    attn = (q @ k.transpose(-1, -2)) * decay_incl  # [B, H, N, C, C]
    q_decayed = q * gc.exp()[..., None]  # reads S0 through the decay since chunk start
    k_decayed = k * (g_last - gc).exp()[..., None]  # writes decay until chunk end

    outs = []
    for i in range(n):  # s: [B, H, Dk, Dv]
        u = u0[:, :, i] - w[:, :, i] @ s  # [B, H, C, Dv]
        outs.append(q_decayed[:, :, i] @ s + attn[:, :, i] @ u)
        s = g_last[:, :, i, :, None].exp() * s + k_decayed[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(b, h, n * c, d_v)[:, :, :t]
    return out.movedim(1, 2).to(out_dtype), s


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time; the caller applies the activation.

    x: [B, T, C]; weight: [C, K], weight[:, -1] multiplies the current token;
    state: [B, C, K-1], the K-1 inputs before x (zeros if None)
    -> y [B, T, C], new_state [B, C, K-1] (the last K-1 inputs, state included, for the next call).
    """
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise CloverError(
            f"causal_conv1d wants x [B, T, C] and weight [C, K]; got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}"
        )
    b, _, ch = x.shape
    kw = weight.shape[1]
    if state is None:
        state = x.new_zeros(b, ch, kw - 1)
    elif state.shape != (b, ch, kw - 1):
        raise CloverError(
            f"conv state must be [B, C, K-1] = {(b, ch, kw - 1)}; got {tuple(state.shape)}"
        )
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
    y = F.conv1d(xs, weight.to(x.dtype)[:, None, :], groups=ch)  # [B, C, T]
    # slice by start index: `[..., -(K-1):]` would keep everything when K == 1
    new_state = xs[..., xs.shape[-1] - (kw - 1) :]
    return y.transpose(1, 2), new_state
