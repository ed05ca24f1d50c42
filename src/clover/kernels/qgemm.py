"""Packed quantized weights for the `qgemm` kernel (layouts in qgemm.h) and its reference.

A `QWeight` holds one [N, K] matrix as integer levels in tiles of 16 output rows x one group
of k, with a scale (and, for affine formats, a low) per row and group:
    W[n, k] = level[n, k] * scale[n, k // group] + low[n, k // group]
int4 levels are 0..15 in groups of 32 (GGUF Q4_0/Q4_1/Q4_K sub-blocks, our own quantization);
int8 levels are -128..127 in groups of 16 or 32 (Q8_0, Q6_K, per-row int8 with the row's
scale repeated); 8-bit levels in groups of 32 that all fit in -16..15 (Q5_0) are stored in 5
bits (`bits` 5), and in groups of 16 that fit in -32..31 (Q6_K) in 6 (`bits` 6), which the
kernel reads as such (with 15-bit or bfloat16 x, to the bit as their int8 form; a model's 8-bit
x takes one plane for them, two for int8). Scales are stored in float16 when every scale
and low is exactly a float16 (then nothing is rounded and the weights read 12% fewer bytes at
int4), else float32; float32 ones that are small integers times a base per 256 values (GGUF's
Q4_K and Q6_K) are also kept as int8 multiples and bases (`pack_compact`), which the integer
dots read instead: 4.75 bits a Q4_K weight instead of 6, 6.6 a Q6_K one instead of 8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from clover import kernels
from clover.errors import CloverError


def pack_int4(q: torch.Tensor, group: int = 32) -> torch.Tensor:
    """levels [N, K] in 0..15 -> uint8 [N/16, K/group, 8 group] (qgemm.h's int4 layout; its
    groups of 16, the int6 layout's first part, are two chunks instead of four)."""
    N, K = q.shape
    G, C = K // group, group // 8
    v = q.to(torch.uint8).reshape(N // 16, 16, G, C, 4, 2)  # t, i, g, c, j, e
    v = v.permute(0, 2, 3, 1, 5, 4)  # t, g, c, i, e, j: word (i, e) holds nibbles j
    bytes_ = torch.stack([v[..., 0] | v[..., 1] << 4, v[..., 2] | v[..., 3] << 4], -1)
    return bytes_.reshape(N // 16, G, 8 * group)  # little-endian words


def _bit_masks(bits: torch.Tensor, group: int) -> torch.Tensor:
    """0/1 [N, K] -> uint8 [N/16, K/group, group / 2 pairs x 4 bytes]: one little-endian
    32-bit mask per pair p = 4c + j of a tile's group, whose bit w is word w's (qgemm.h)."""
    N, K = bits.shape
    G, C = K // group, group // 8
    v = bits.to(torch.uint8).reshape(N // 16, 16, G, C, 4, 2)  # t, i, g, c, j, e
    v = v.permute(0, 2, 3, 4, 1, 5).reshape(N // 16, G, 4 * C, 4, 8)  # pair p, byte, bit
    masks = (v << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # a byte each
    return masks.reshape(N // 16, G, 16 * C)


def pack_int5(q: torch.Tensor) -> torch.Tensor:
    """levels [N, K] in -16..15 -> uint8 [N/16, K/32, 320] (qgemm.h's int5 layout): the int4
    layout of the low 4 bits of level + 16, then one 32-bit mask of high bits per pair."""
    u = (q.to(torch.int16) + 16).to(torch.uint8)
    return torch.cat([pack_int4(u & 15), _bit_masks(u >> 4, 32)], -1).contiguous()


def pack_int6(q: torch.Tensor) -> torch.Tensor:
    """levels [N, K] in -32..31 -> uint8 [N/16, K/16, 192] (qgemm.h's int6 layout, GGUF Q6_K's
    levels in their groups of 16): the int4 layout of the low 4 bits of level + 32, then the
    pair masks of bit 4, then those of bit 5."""
    u = (q.to(torch.int16) + 32).to(torch.uint8)
    parts = [pack_int4(u & 15, 16), _bit_masks(u >> 4 & 1, 16), _bit_masks(u >> 5, 16)]
    return torch.cat(parts, -1).contiguous()


def pack_int8(q: torch.Tensor, group: int) -> torch.Tensor:
    """levels [N, K] in -128..127 -> uint8 [N/16, K/group, group * 16]."""
    N, K = q.shape
    v = q.to(torch.int8).reshape(N // 16, 16, K // group, group // 2, 2)  # t, i, g, p, e
    return v.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).reshape(N // 16, K // group, -1)


def compact_parts(scale: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """scale [N, G] float32 -> (mult int8 [N, G], base float32 [N, G / groups]) with every
    scale exactly float32(mult) * base (one product, as the kernels take it), or None.

    GGUF's k-quants store a group's scale as a small integer times a float16 per 256 values
    (Q4_K: sc in 0..63 times d, and the offset m times dmin; Q6_K: an int8 times d). Those
    products are not float16 numbers; in float32 they would take 2 bits a weight at int4, a
    third of what a pass reads of such a matrix. Written back as the integers and one base
    per 256 values, they take 0.75 bits (Q4_K) with the same values. Found without knowing
    the format: each scale is an integer mantissa times a power of two; at the block's least
    exponent the mantissas' greatest common divisor is the base, and the quotients must fit
    in int8."""
    N, G = scale.shape
    if G % groups or not scale.numel() or not torch.isfinite(scale).all():
        return None
    s = scale.double().reshape(N, G // groups, groups)
    frac, exp = torch.frexp(s)  # s = frac * 2**exp, |frac| in [0.5, 1) (0 for 0)
    mant = (frac * 2.0**24).round().to(torch.int64)  # exact: float32 has 24 bits
    exp = exp.to(torch.int64) - 24
    nonzero = mant != 0
    big = torch.iinfo(torch.int64).max
    low_exp = torch.where(nonzero, exp, big).amin(-1, keepdim=True)
    shift = torch.where(nonzero, exp - low_exp, 0)
    if int(shift.max()) > 30:  # scales 2**30 apart: no int8 quotient
        return None
    aligned = mant << shift
    g = aligned[..., 0].abs()
    for i in range(1, groups):
        g = torch.gcd(g, aligned[..., i])
    g = torch.where(g == 0, 1, g)
    mult = aligned // g[..., None]
    # a negative base where that fits int8 (Q6_K's d may be negative: quotients up to 128)
    flip = mult.amax(-1) > 127
    g, mult = torch.where(flip, -g, g), torch.where(flip[..., None], -mult, mult)
    if int(mult.min()) < -128 or int(mult.max()) > 127:
        return None
    low_exp = torch.where(low_exp == big, 0, low_exp)
    base = (g.double() * torch.pow(2.0, low_exp[..., 0].double())).float()
    mult = mult.to(torch.int8)
    if not torch.equal(mult.float() * base[..., None], scale.reshape(N, G // groups, groups)):
        return None  # a base outside float32's range
    return mult.reshape(N, G), base


def pack_compact(
    scale: torch.Tensor, low: torch.Tensor | None, group: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """scale, low [N, G] -> (mults int8 [N/16, G, 1 or 2, 16], bases float32 [N/16, G/S,
    1 or 2, 16]) with S groups (256 values along k) a base, or None (`compact_parts`)."""
    N, G = scale.shape
    given = [scale] if low is None else [scale, low]
    parts = [compact_parts(p.float(), 256 // group) for p in given]
    if any(p is None for p in parts):
        return None

    def tiled(t: torch.Tensor) -> torch.Tensor:  # [N, n] -> [N/16, n, 16]
        return t.reshape(N // 16, 16, -1).transpose(1, 2)

    mults = torch.stack([tiled(m) for m, _ in parts], 2).contiguous()
    bases = torch.stack([tiled(b) for _, b in parts], 2).contiguous()
    return mults, bases


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
    x_bits: int | None = None  # the integer dots' x for 4- to 6-bit levels: 8, 15 (None: 15)
    # the scales as int8 multiples of a base per 256 values (`pack_compact`), which the
    # integer dots read instead of `scales` (float32 ones only; wider passes read those)
    mults: torch.Tensor | None = None
    bases: torch.Tensor | None = None

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
        if bits == 8 and q.numel():  # 8-bit levels that fit in fewer bits, read as such
            lo, hi = int(q.min()), int(q.max())
            if group == 32 and -16 <= lo and hi <= 15:
                bits = 5  # GGUF Q5_0's: 5.5 bits a weight, not 8.5
            elif group == 16 and -32 <= lo and hi <= 31:
                bits = 6  # GGUF Q6_K's: 6.5 bits a weight (compact scales), not 8.5
        supported = {4: (32,), 5: (32,), 6: (16,), 8: (16, 32)}[bits]
        if group not in supported or K % group or N % 16:
            raise CloverError(
                f"int{bits} weights of shape [{N}, {K}] in groups of {group}: the kernel takes "
                f"N a multiple of 16 and groups of {' or '.join(map(str, supported))} along K"
            )
        lo_level, hi_level = {4: (0, 15), 5: (-16, 15), 6: (-32, 31), 8: (-128, 127)}[bits]
        if int(q.min()) < lo_level or int(q.max()) > hi_level:
            raise CloverError(f"int{bits} levels outside {lo_level}..{hi_level}")
        pack = {4: pack_int4, 5: pack_int5, 6: pack_int6, 8: lambda q: pack_int8(q, group)}[bits]
        packed = pack(q)
        scales = pack_scales(scale, low)
        compact = pack_compact(scale, low, group) if scales.dtype == torch.float32 else None
        mults, bases = compact if compact is not None else (None, None)
        return cls(bits, group, N, K, packed, scales, mults=mults, bases=bases)

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
            self.mults,
            self.bases,
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
        (bits 4, or 8 for 5-, 6- and 8-bit levels) packs those rows of this matrix unchanged.
        Only the 16-row tiles holding them are unpacked: unpacking a whole large-vocabulary
        head for a drafter's few thousand rows would cost far more time and memory."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        tiles, tile_of = torch.unique(rows // 16, return_inverse=True)
        at = tiles.to(self.q.device)
        # those tiles alone (their levels and scales; integer-dot extras are not read here)
        sub = replace(self, out_features=len(tiles) * 16, q=self.q[at].contiguous(),
                      scales=self.scales[at], mults=None, bases=None)  # fmt: skip
        local = tile_of * 16 + rows % 16
        s = sub.group_scales()[local]
        low = s[..., 1].contiguous() if self.has_low else None
        return sub.levels()[local], s[..., 0].contiguous(), low

    def take_rows(self, rows: torch.Tensor) -> QWeight:
        """The matrix of output rows `rows` (a multiple of 16 of them, any order), gathered
        from the packed tiles as they are: the same levels, scales and compact scales, nothing
        unpacked (a drafter's 16,384 rows of a 151,936-row head in milliseconds)."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        R = len(rows)
        if R % 16:
            raise CloverError(f"take_rows: {R} rows, not a multiple of 16")
        if self.bits in (5, 6):  # high bits shared by a tile's rows: unpack those tiles
            q, scale, low = self.row_levels(rows)
            out = QWeight.from_levels(q, scale, low, bits=8)
            out.x_bits = self.x_bits
            return out
        t, i = rows // 16, rows % 16
        G = self.in_features // self.group
        # a tile's bytes per row: int4 [G, 4 chunks, 16 rows, 4 bytes], int8 [G, P, 16, 2]
        inner = (4, 16, 4) if self.bits == 4 else (self.group // 2, 16, 2)
        q = self.q.view(-1, G, *inner)[t, :, :, i]  # [R, G, a, b]
        q = q.reshape(R // 16, 16, G, *inner[::2]).permute(0, 2, 3, 1, 4)  # [R/16, G, a, 16, b]
        packed = q.contiguous().view(R // 16, G, -1)

        def per_row(x: torch.Tensor | None) -> torch.Tensor | None:  # [NT, n, s, 16]
            if x is None:
                return None
            x = x[t, :, :, i]  # [R, n, s]
            return x.reshape(R // 16, 16, *x.shape[1:]).permute(0, 2, 3, 1).contiguous()

        return replace(self, out_features=R, q=packed, scales=per_row(self.scales),
                       mults=per_row(self.mults), bases=per_row(self.bases))  # fmt: skip

    def stored(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(attributes, tensors) to keep this matrix in a file (`from_stored` reads it back):
        k-quant scales only in their compact form, their float32 form being made at load."""
        attrs = {"bits": self.bits, "group": self.group, "out": self.out_features,
                 "in": self.in_features, "low": self.has_low}  # fmt: skip
        tensors = {"q": self.q}
        if self.mults is not None:
            tensors.update(mults=self.mults, bases=self.bases)
        else:
            tensors["scales"] = self.scales
        return attrs, tensors

    @classmethod
    def from_stored(cls, attrs: dict, tensors: dict[str, torch.Tensor]) -> QWeight:
        scales = tensors.get("scales")
        mults, bases = tensors.get("mults"), tensors.get("bases")
        if scales is None:  # float32(mult) * base is each scale exactly (`compact_parts`)
            NT, G, parts, _ = mults.shape
            per = G // bases.shape[1]
            scales = torch.empty(mults.shape, dtype=torch.float32)  # one allocation, no temps
            scales.copy_(mults)
            scales.view(NT, G // per, per, parts, 16).mul_(bases[:, :, None])
        return cls(attrs["bits"], attrs["group"], attrs["out"], attrs["in"], tensors["q"],
                   scales, mults=mults, bases=bases)  # fmt: skip

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K]: levels * scale + low (the reference for the kernel)."""
        N, G = self.out_features, self.in_features // self.group
        s = self.group_scales()
        w = self.levels().float().reshape(N, G, self.group) * s[..., :1]
        if self.has_low:
            w = w + s[..., 1:]
        return w.reshape(N, self.in_features)

    def nbytes(self) -> int:
        """Bytes a short pass (the integer dots) reads: levels and scales, compact or not."""
        if self.mults is not None:
            return self.q.numel() + self.mults.numel() + self.bases.numel() * 4
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


def fused_part(linear: torch.nn.Module) -> object | None:
    """A linear's weight as the fused layers take it (`kernels.Packed`): an Int4Linear, or an
    Int8Linear with a GGUF's 8-bit levels, in Clover's kernels (under a draft adapter's
    LoRALinear: its base); None for anything else."""
    linear = getattr(linear, "base", linear)
    w = getattr(linear, "weight", None)
    if not isinstance(w, QWeight):
        return None
    return kernels.load().Packed(w.q, w.scales, w.bits, w.group, w.has_low, w.out_features,
                                 w.in_features, linear.bias, w.mults, w.bases)  # fmt: skip


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
    (`QWeight.x_bits`, `$CLOVER_DOTS_X`) 4-, 5- and 6-bit weights take steps of max |x| / 127
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
