"""Building blocks shared by architectures: RMSNorm, rotary embeddings, attention, SwiGLU.

Attention reads a `StepLayout`: in the cached modes it writes K/V to its `KVCache` and
attends over the cache slots with the layout's mask; in the training layout (no cache) it
attends over the input with the layout's explicit mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from clover.errors import CloverError
from clover.models.cache import KVCache, StepLayout
from clover.quant import project


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        if x.is_cpu and not torch.is_grad_enabled():
            # LayerNorm of [x, -x] is RMSNorm of x (its mean is 0, its variance mean(x^2)),
            # and PyTorch's CPU LayerNorm is one fused kernel where rms_norm is ~8 small ops
            # (a decode step has 2 norms a layer; `test_rms_norm_fast_path`)
            y = F.layer_norm(torch.cat([x, -x], -1), (2 * D,), None, None, self.eps)
            return y[..., :D] * self.weight
        return F.rms_norm(x, (D,), self.weight, self.eps)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2], with the rope_scaling types we support."""
    # on the CPU even where a model is built on the meta device: a meta arange goes through
    # PyTorch's reference decompositions, whose first import costs a large part of a start
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (theta ** (steps / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp
        # between (Meta's published rope scaling).
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(mid, blended, scaled).float()
    raise CloverError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, signed sin [B, 1, T, rotary_dim] (rotate-half form: the
    halves repeated, the first half of sin negated, so `apply_rope` needs no negation)."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, R/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1)[:, None], torch.cat([-sin, sin], dim=-1)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; rotates the first cos.shape[-1] dims (partial rotary leaves the rest).
    rotate_half(x) * sin == roll(x, half) * signed sin: one op for four."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos.to(x.dtype) + x.roll(r // 2, -1) * sin.to(x.dtype)
    rot, rest = x[..., :r], x[..., r:]
    out = rot * cos.to(x.dtype) + rot.roll(r // 2, -1) * sin.to(x.dtype)
    return torch.cat([out, rest], dim=-1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: StepLayout,
    cache: KVCache | None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D] (q's dtype) under the layout's mask.

    RoPE (cos, sin from `rope_cos_sin`), if given, and attention run in the cache's dtype
    (float32 on CPU for 16-bit weights: `cache.kv_dtype`), so q/k/v are cast once, before
    RoPE, and nothing is cast again on the way into the cache (a decode step is mostly small
    ops on a CPU: every cast avoided there counts)."""
    dtype = q.dtype
    if cache is not None:
        work = cache.dtype
        q, k, v = q.to(work), k.to(work), v.to(work)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if cache is not None:
        k, v = cache.write(k, v, layout)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=layout.mask, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.to(dtype)


def attend_packed(
    qkv: torch.Tensor,
    n_q: int,
    n_kv: int,
    layout: StepLayout,
    cache: KVCache | None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`attend` on the packed output of the q/k/v projections: qkv [B, T, (n_q + 2 n_kv) * Dh]
    -> [B, T, n_q * Dh] (qkv's dtype). Same result as splitting, but one cast instead of three
    and RoPE over q and k together (a decode step on a CPU is mostly small ops;
    `test_attend_packed_matches_attend`)."""
    B, T, _ = qkv.shape
    dtype = qkv.dtype
    work = cache.dtype if cache is not None else dtype
    y = qkv.to(work).view(B, T, n_q + 2 * n_kv, -1)  # [B, T, heads, Dh]
    qk = y[:, :, : n_q + n_kv]
    if rope is not None:  # [B, 1, T, R] -> [B, T, 1, R]: views
        qk = apply_rope(qk, rope[0].transpose(1, 2), rope[1].transpose(1, 2))
    q, k = qk[:, :, :n_q].transpose(1, 2), qk[:, :, n_q:].transpose(1, 2)
    v = y[:, :, n_q + n_kv :].transpose(1, 2)
    if cache is not None:
        k, v = cache.write(k, v, layout)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=layout.mask, enable_gqa=n_q != n_kv
    )  # [B, Hq, T, Dh]
    return out.transpose(1, 2).reshape(B, T, -1).to(dtype)


class SwiGLU(nn.Module):
    packed_projections = (("gate_proj", "up_proj"),)  # run through `project` (clover.quant)

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class ZeroRMSNorm(nn.Module):
    """Zero-centred RMSNorm: x_normed * (1 + w), w initialised to 0 (identity scale)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * (1 + self.weight)
