"""Gated DeltaNet mixer with block-bidirectional preview, and its state cache.

A GDN layer carries a short-conv state and a recurrent state instead of K/V. One forward over
a `StepLayout` does, per row: a *commit* pass over the n_commit tokens (causal: conv, gated
delta rule from the cached state, the state advances) and a *preview* of the n_block block
tokens that reads the new state and never writes it. Inside the block the preview can look
right, through two additions made for block diffusion (after the published model's "right
conv taps and a block softmax with a history slot read from the clean state"):

- right conv taps: the block's conv also sums the next K-1 inputs *inside the block*;
- a block softmax: each block position attends (softmax) over every block position plus one
  history slot whose value is the clean state's read-out S^T q and whose logit is learned;
  the result is added to the causal output times a learned per-head `block_mix`.

`right_conv`, `block_mix` and `history_bias` start at zero, so a freshly adapted model
computes exactly its autoregressive parent in every mode until training moves them; the
commit pass never uses them, so the cached prefix state is always a causal function of the
committed tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover.errors import CloverError
from clover.models.cache import LayerCache
from clover.models.layout import StepLayout
from clover.ops.gated_delta import (
    causal_conv1d,
    gated_delta_chunked,
    gated_delta_recurrent,
    repeat_kv_heads,
)


class GDNCache(LayerCache):
    """conv [B, C, K-1] (last K-1 committed conv inputs) + state [B, Hv, Dk, Dv] float32.

    With `track` on (speculative decoding), the last commit segment is kept so that
    `rollback` can recompute the state after fewer of its tokens.
    """

    recurrent = True

    def __init__(self, batch: int, channels: int, kernel: int, hv: int, dk: int, dv: int) -> None:
        self.conv = torch.zeros(batch, channels, kernel - 1)
        self.state = torch.zeros(batch, hv, dk, dv)
        self.track = False
        self.saved: tuple | None = None

    def reserve(self, capacity: int) -> None:
        pass  # fixed size, whatever the length

    def select(self, rows: torch.Tensor) -> None:
        self.conv, self.state = self.conv[rows], self.state[rows]
        self.saved = None

    def copy_out(self, row: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """-> conv [C, K-1], state [Hv, Dk, Dv]: copies, at the committed length."""
        return self.conv[row].clone(), self.state[row].clone()

    def copy_in(self, row: int, start: int, parts: tuple[torch.Tensor, ...]) -> None:
        self.conv[row], self.state[row] = parts
        self.saved = None

    def extend(self, other: GDNCache) -> None:
        self.conv = torch.cat([self.conv, other.conv])
        self.state = torch.cat([self.state, other.state])
        self.track = self.track or other.track
        self.saved = None

    def rollback(self, n: torch.Tensor) -> None:
        if not bool(n.any()):
            return
        if self.saved is None:
            raise CloverError("GDN cache cannot roll back: tracking was off for the last pass")
        conv0, state0, x_in, q, k, v, g, beta, n_commit = self.saved
        keep = n_commit - n  # [B] tokens of the last commit that stay
        t = torch.arange(q.shape[1])[None, :]
        live = (t < keep[:, None]).to(g.dtype)[..., None]  # [B, Tc, 1]
        _, self.state = gated_delta_chunked(q, k, v, g * live, beta * live, state0)
        self.conv = conv_state_after(conv0, x_in, keep)
        self.saved = None


def conv_state_after(conv0: torch.Tensor, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The last K-1 conv inputs after n[b] tokens of x [B, T, C] follow state conv0 [B, C, K-1]."""
    km1 = conv0.shape[2]
    if km1 == 0:
        return conv0
    hist = torch.cat([conv0.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, C, K-1+T]
    idx = n[:, None, None] + torch.arange(km1)[None, None, :]  # [B, 1, K-1]
    return hist.gather(2, idx.expand(-1, hist.shape[1], -1)).float()


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden: int,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int,
        eps: float,
    ) -> None:
        super().__init__()
        self.hk, self.hv, self.dk, self.dv = key_heads, value_heads, key_dim, value_dim
        self.kernel = conv_kernel
        self.channels = 2 * key_heads * key_dim + value_heads * value_dim
        self.q_proj = nn.Linear(hidden, key_heads * key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, key_heads * key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, value_heads * value_dim, bias=False)
        self.z_proj = nn.Linear(hidden, value_heads * value_dim, bias=False)
        self.b_proj = nn.Linear(hidden, value_heads, bias=False)
        self.a_proj = nn.Linear(hidden, value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(self.channels, conv_kernel) * 0.3)
        self.A_log = nn.Parameter(torch.log(torch.empty(value_heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.zeros(value_heads))
        self.norm_weight = nn.Parameter(torch.ones(value_dim))
        self.eps = eps
        self.o_proj = nn.Linear(value_heads * value_dim, hidden, bias=False)
        # block diffusion (zero at init: the layer is then exactly its causal parent)
        self.right_conv = nn.Parameter(torch.zeros(self.channels, conv_kernel - 1))
        self.block_mix = nn.Parameter(torch.zeros(value_heads))
        self.history_bias = nn.Parameter(torch.zeros(value_heads))

    def make_cache(self, batch: int) -> GDNCache:
        return GDNCache(batch, self.channels, self.kernel, self.hv, self.dk, self.dv)

    # --- pieces ------------------------------------------------------------------------------

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """conv output [B, T, C] -> q, k [B, T, Hk, Dk], v [B, T, Hv, Dv]."""
        B, T, _ = y.shape
        nq = self.hk * self.dk
        q, k, v = y.split([nq, nq, self.hv * self.dv], dim=-1)
        return (
            q.reshape(B, T, self.hk, self.dk),
            k.reshape(B, T, self.hk, self.dk),
            v.reshape(B, T, self.hv, self.dv),
        )

    def _right_taps(self, x: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Sum of w_j * x[t + j] (j = 1..K-1) for block tokens t, staying inside [start, end)."""
        B, T, C = x.shape
        t = torch.arange(T)[None, :]
        in_block = (t >= start[:, None]) & (t < end[:, None])  # [B, T]
        out = torch.zeros_like(x)
        for j in range(1, min(self.kernel, T)):
            shifted = F.pad(x[:, j:], (0, 0, 0, j))  # x[t + j], zero past the end
            ok = in_block & (t + j < end[:, None])
            out = out + shifted * ok[..., None] * self.right_conv[:, j - 1].to(x.dtype)
        return out

    def _delta(self, q, k, v, g, beta, state):  # noqa: ANN001, ANN202 (internal)
        if q.shape[1] == 1:  # one token: the recurrent form is cheaper
            return gated_delta_recurrent(q, k, v, g, beta, state)
        return gated_delta_chunked(q, k, v, g, beta, state)

    def _block_softmax(self, q, k, v, valid, state) -> torch.Tensor:  # noqa: ANN001
        """q, k [B, N, Hk, Dk], v [B, N, Hv, Dv], valid [B, N] -> [B, N, Hv, Dv]."""
        rep = self.hv // self.hk
        q = F.normalize(repeat_kv_heads(q, rep).float(), dim=-1) * self.dk**-0.5
        k = F.normalize(repeat_kv_heads(k, rep).float(), dim=-1)
        scores = torch.einsum("bihd,bjhd->bhij", q, k)  # [B, Hv, N, N]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        hist = self.history_bias.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        p = torch.softmax(torch.cat([hist, scores], -1), dim=-1)
        read = torch.einsum("bihd,bhde->bihe", q, state)  # clean state's read-out, per position
        mixed = torch.einsum("bhij,bjhe->bihe", p[..., 1:], v.float())
        return mixed + p[..., 0].transpose(1, 2)[..., None] * read

    # --- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, layout: StepLayout, cache: GDNCache | None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; without a cache, a fresh (zero) state."""
        B, T, _ = x.shape
        if cache is None:
            cache = self.make_cache(B)
        xin = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, C]
        beta = torch.sigmoid(self.b_proj(x).float())  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        nc, nb = layout.n_commit, layout.n_block
        y, _ = causal_conv1d(xin, self.conv_weight.to(xin.dtype), cache.conv.to(xin.dtype))
        if bool(nb.any()):
            y = y + self._right_taps(xin, nc, nc + nb)
        q, k, v = self._split(F.silu(y))
        out = torch.zeros(B, T, self.hv, self.dv, dtype=torch.float32)
        # 1. commit: tokens t < n_commit[b] advance the state; later tokens are inert
        Tc = int(nc.max())
        state0, conv0 = cache.state, cache.conv
        state = state0
        if Tc:
            live = (torch.arange(Tc)[None, :] < nc[:, None]).float()[..., None]  # [B, Tc, 1]
            qc, kc, vc = q[:, :Tc], k[:, :Tc], v[:, :Tc]
            gc, bc = g[:, :Tc] * live, beta[:, :Tc] * live
            o, state = self._delta(qc, kc, vc, gc, bc, state0)
            out[:, :Tc] = o.float()
            if cache.track:
                cache.saved = (conv0, state0, xin[:, :Tc], qc, kc, vc, gc, bc, nc)
            cache.state, cache.conv = state, conv_state_after(conv0, xin, nc)
        # 2. preview: block tokens read the committed state, causally + the block softmax
        Nb = int(nb.max())
        if Nb:
            idx = (nc[:, None] + torch.arange(Nb)[None, :]).clamp(max=T - 1)  # [B, Nb]
            valid = torch.arange(Nb)[None, :] < nb[:, None]
            live = valid.float()[..., None]

            def take(t: torch.Tensor) -> torch.Tensor:
                shape = (B, Nb) + t.shape[2:]
                flat = idx.reshape(B, Nb, *([1] * (t.dim() - 2))).expand(shape)
                return t.gather(1, flat)

            qb, kb, vb = take(q), take(k), take(v)
            ob, _ = self._delta(qb, kb, vb, take(g) * live, take(beta) * live, state)
            ob = ob.float()
            if bool(self.block_mix.any()):
                soft = self._block_softmax(qb, kb, vb, valid, state)
                ob = ob + self.block_mix.float()[None, None, :, None] * soft
            rows = torch.arange(B)[:, None].expand(B, Nb)
            out[rows[valid], idx[valid]] = ob[valid]
        # gated RMSNorm: norm(o) * w * silu(z), per value head
        z = self.z_proj(x).float().reshape(B, T, self.hv, self.dv)
        o = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        o = o * self.norm_weight.float() * F.silu(z)
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype))
