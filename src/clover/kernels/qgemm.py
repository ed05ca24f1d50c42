"""Packed quantized weights for the `qgemm` kernel (layouts in qgemm.h) and its reference.

A `QWeight` holds one [N, K] matrix as integer levels in tiles of 16 output rows x one group
of k, with a scale (and, for affine formats, a low) per row and group:
    W[n, k] = level[n, k] * scale[n, k // group] + low[n, k // group]
int4 levels are 0..15 in groups of 32 (GGUF Q4_0/Q4_1/Q4_K sub-blocks, our own quantization);
int8 levels are -128..127 in groups of 16 or 32 (Q8_0, Q6_K, per-row int8 with the row's
scale repeated); 8-bit levels in groups of 32 that all fit in -16..15 (Q5_0) are stored in 5
bits (`bits` 5), which the kernel reads as such. Scales are stored in float16 when every scale
and low is exactly a float16 (then nothing is rounded and the weights read 12% fewer bytes at
int4), else float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clover import kernels
from clover.errors import CloverError


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """levels [N, K] in 0..15 -> uint8 [N/16, K/32, 256] (qgemm.h's int4 layout)."""
    N, K = q.shape
    v = q.to(torch.int32).reshape(N // 16, 16, K // 32, 4, 4, 2)  # t, i, g, c, j, e
    v = v.permute(0, 2, 3, 1, 5, 4)  # t, g, c, i, e, j: word (i, e) holds nibbles j
    words = v[..., 0] | v[..., 1] << 4 | v[..., 2] << 8 | v[..., 3] << 12
    return words.to(torch.int16).contiguous().view(torch.uint8).reshape(N // 16, K // 32, 256)


def pack_int5(q: torch.Tensor) -> torch.Tensor:
    """levels [N, K] in -16..15 -> uint8 [N/16, K/32, 320] (qgemm.h's int5 layout): the int4
    layout of the low 4 bits of level + 16, then one 32-bit mask of high bits per pair."""
    N, K = q.shape
    u = q.to(torch.int32) + 16
    low = pack_int4(u & 15)
    v = (u >> 4).reshape(N // 16, 16, K // 32, 4, 4, 2)  # t, i, g, c, j, e
    v = v.permute(0, 2, 3, 4, 1, 5).reshape(N // 16, K // 32, 16, 32)  # pair p = 4c + j, word w
    masks = (v.to(torch.int64) << torch.arange(32)).sum(-1)  # bit w of pair p's mask
    masks = torch.stack([(masks >> (8 * b)) & 255 for b in range(4)], -1)  # little-endian
    masks = masks.to(torch.uint8).reshape(N // 16, K // 32, 64)
    return torch.cat([low, masks], -1).contiguous()


def pack_int8(q: torch.Tensor, group: int) -> torch.Tensor:
    """levels [N, K] in -128..127 -> uint8 [N/16, K/group, group * 16]."""
    N, K = q.shape
    v = q.to(torch.int8).reshape(N // 16, 16, K // group, group // 2, 2)  # t, i, g, p, e
    return v.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).reshape(N // 16, K // group, -1)


def pack_scales(scale: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
    """scale, low [N, G] -> [N/16, G, 1 or 2, 16], float16 when that is exact, else float32."""
    N, G = scale.shape
    parts = [scale] if low is None else [scale, low]
    out = torch.stack([p.float().reshape(N // 16, 16, G).transpose(1, 2) for p in parts], 2)
    half = out.half()
    return half.contiguous() if torch.equal(half.float(), out) else out.contiguous()


@dataclass
class QWeight:
    """One packed matrix; `matmul` runs the kernel."""

    bits: int
    group: int
    out_features: int  # N
    in_features: int  # K
    q: torch.Tensor  # uint8, packed levels
    scales: torch.Tensor  # float16 or float32 [N/16, G, 1 or 2, 16]
    x_bits: int | None = None  # the integer dots' x for 4-/5-bit levels: 8, 15 (None: 15)

    @property
    def has_low(self) -> bool:
        return self.scales.shape[2] == 2

    @classmethod
    def from_levels(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        low: torch.Tensor | None = None,
        bits: int = 4,
    ) -> QWeight:
        """q [N, K] integer levels, scale/low [N, K / group] (group = K / scale columns)."""
        q, scale = q.detach(), scale.detach()
        low = None if low is None else low.detach()
        N, K = q.shape
        group = K // scale.shape[1] if scale.shape[1] else 0
        if bits == 8 and group == 32 and q.numel() and -16 <= int(q.min()) <= int(q.max()) <= 15:
            bits = 5  # 8-bit levels that fit in 5 (GGUF Q5_0's): 5.5 bits a weight, not 8.5
        supported = {4: (32,), 5: (32,), 8: (16, 32)}[bits]
        if group not in supported or K % group or N % 16:
            raise CloverError(
                f"int{bits} weights of shape [{N}, {K}] in groups of {group}: the kernel takes "
                f"N a multiple of 16 and groups of {' or '.join(map(str, supported))} along K"
            )
        lo_level, hi_level = {4: (0, 15), 5: (-16, 15), 8: (-128, 127)}[bits]
        if int(q.min()) < lo_level or int(q.max()) > hi_level:
            raise CloverError(f"int{bits} levels outside {lo_level}..{hi_level}")
        pack = {4: pack_int4, 5: pack_int5, 8: lambda q: pack_int8(q, group)}[bits]
        packed = pack(q)
        return cls(bits, group, N, K, packed, pack_scales(scale, low))

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_bf16: bool = True
    ) -> torch.Tensor:
        """x [..., K] (float32 or bfloat16, rounded to bfloat16) -> [..., N]."""
        module = kernels.load()
        return module.qgemm(
            x,
            self.q,
            self.scales,
            self.bits,
            self.group,
            self.has_low,
            self.out_features,
            bias,
            out_bf16,
            kernels.isa(self.x_bits),
        )

    def levels(self) -> torch.Tensor:
        """int32 [N, K], read back from the packed layout (tests)."""
        return kernels.load().unpack_levels(
            self.q, self.bits, self.group, self.out_features, self.in_features
        )

    def group_scales(self) -> torch.Tensor:
        """float32 [N, K / group, 1 or 2]: each row's scale (and low) per group."""
        N, G = self.out_features, self.in_features // self.group
        return self.scales.float().permute(0, 3, 1, 2).reshape(N, G, -1)

    def row_levels(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(levels, scale, low) of output rows `rows`, exactly as stored: `from_levels` of them
        (bits 4, or 8 for 5- and 8-bit levels) packs those rows of this matrix unchanged."""
        s = self.group_scales()[rows]
        low = s[..., 1].contiguous() if self.has_low else None
        return self.levels()[rows], s[..., 0].contiguous(), low

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K]: levels * scale + low (the reference for the kernel)."""
        N, G = self.out_features, self.in_features // self.group
        s = self.group_scales()
        w = self.levels().float().reshape(N, G, self.group) * s[..., :1]
        if self.has_low:
            w = w + s[..., 1:]
        return w.reshape(N, self.in_features)

    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


def reference_matmul(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `QWeight.matmul` computes, in float64: x rounded to bfloat16 times the dequantized
    weights (x [..., K] -> float64 [..., N]), on paths without integer dots."""
    y = x.to(torch.bfloat16).double() @ w.dequantized().double().t()
    return y if bias is None else y + bias.double()


def reference_dots_matmul(
    x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, x_bits: int = 15
) -> torch.Tensor:
    """What the integer-dot path (`kernels.INT8_DOTS`, passes of up to 4 or 16 rows) computes,
    in float64: x rounded to bfloat16, then per group of the weights' k to steps of
    max |x| / 16256 (x_q = round(x * 16256 / max |x|), float32 as the kernel rounds), each
    group's exact dot with the levels times scale * step, plus low times the bfloat16 x's group
    sum. (The kernel splits x_q into two int8 planes; that split is exact.) With x_bits 8
    (`QWeight.x_bits`, `$CLOVER_DOTS_X`) 4- and 5-bit weights take steps of max |x| / 127
    instead, x_q on one plane."""
    xb = x.to(torch.bfloat16).float()
    N, K, g = w.out_features, w.in_features, w.group
    top = 127 if x_bits == 8 and w.bits != 8 else 16256
    xg = xb.reshape(-1, K // g, g)
    amax = xg.abs().amax(-1, keepdim=True)
    # top / amax as a true division (`top / t` is a reciprocal then a product: two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, float(top)) / amax, torch.zeros(()))
    xq = (xg * inv).round().clamp(-top, top).double()
    s = w.group_scales().double()
    dots = torch.einsum("mgk,ngk->mng", xq, w.levels().double().reshape(N, K // g, g))
    y = (dots * s[None, :, :, 0] * (amax / float(top)).double()[:, None, :, 0]).sum(-1)
    if w.has_low:
        y = y + (xg.double().sum(-1)[:, None, :] * s[None, :, :, 1]).sum(-1)
    y = y.reshape(*x.shape[:-1], N)
    return y if bias is None else y + bias.double()
