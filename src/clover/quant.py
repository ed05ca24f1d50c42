"""Weight-only quantized linears for CPU inference (the `int4` precision).

Why: one decoding step at batch 1 reads every weight once, so on a CPU its time is memory
traffic. 4-bit weights read a quarter of bfloat16's bytes. A GGUF's own levels come packed by
`checkpoints.packed` (`quantized_linear`); a float checkpoint (an HF directory) is quantized
here: decoder linears to 4-bit groups of 32 along the input dimension (the layout of GGUF
Q4_1), the LM head to 8 bits per output row (`quantize_model`).

Projections that read the same input (q/k/v, gate/up) are packed as one matrix (`Int4Part`):
the kernel has a fixed cost per call that dominates at batch 1 for matrices this small.
Levels are per output row, so the packed matrix holds exactly the levels the separate ones
would.

The tests compare each kernel with a plain matmul on the dequantized weights (the reference).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from clover import kernels
from clover.errors import CloverError
from clover.kernels.qgemm import QWeight

GROUP = 32


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, ...]:
    """w [N, K] -> (q int32 [N, K] in 0..15, scale [N, K/g], low [N, K/g]); w ~ q*scale + low.

    scale and low are rounded to float16 before the levels are chosen, so the kernel keeps
    them in 16 bits with nothing rounded, and a Q4_1 checkpoint (float16 d and m per 32, both
    extreme levels used) gets its own levels and scales back exactly."""
    N, K = w.shape
    wg = w.float().reshape(N, K // group, group)
    low, scale = wg.amin(-1), (wg.amax(-1) - wg.amin(-1)) / 15
    if bool((low.abs().amax() < 6e4) & (scale.amax() < 6e4)):  # within float16's range
        low, scale = low.half().float(), scale.half().float()
    scale = scale.clamp(min=2.0**-24)  # the smallest float16 (subnormal); groups of one value
    q = ((wg - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), scale, low


def int4_fits(linear: nn.Module, group: int = GROUP) -> bool:
    """The CPU kernels take whole groups along K and 16-row tiles along N."""
    return linear.in_features % group == 0 and linear.out_features % 16 == 0


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4-bit groups of 32; x is rounded to bfloat16, output bfloat16
    (float32 with `float_output`, as an LM head: logits rounded to bfloat16 would tie).

    With Clover's kernels (`clover.kernels`) the weights are a `QWeight` (levels, scale and low
    kept exactly); without them, PyTorch's int4 kernel, which rounds scale and zero to bfloat16
    and re-reads the weights for every 4 rows (the fallback)."""

    def __init__(self, linear: nn.Linear, group: int = GROUP) -> None:
        super().__init__()
        q, scale, low = quantize_int4(linear.weight.detach(), group)
        self._set(q, scale, low, linear.bias)

    @classmethod
    def from_levels(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        low: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """From integer levels q [N, K] in 0..15 and float32 scale/low [N, K/32] (W = q * scale
        + low), e.g. a GGUF Q4_K/Q4_1 tensor's own, with nothing re-derived."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._set(q, scale, low, bias)
        return module

    def _set(
        self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        N, K = q.shape
        self.in_features, self.out_features, self.group = K, N, K // scale.shape[1]
        self.bias = None if bias is None else bias.detach().float()
        self.weight: QWeight | None = None
        if kernels.load() is not None:
            self.weight = QWeight.from_levels(q, scale, low, bits=4)
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # the aten kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale
        zero = low + 8 * scale
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16)
        self.scales_and_zeros = self.scales_and_zeros.contiguous()  # [K/g, N, 2]

    float_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] (bfloat16)."""
        if self.weight is not None:
            return self.weight.matmul(x, self.bias, out_bf16=not self.float_output)
        shape = x.shape
        if x.dtype != torch.bfloat16:  # checked here: a no-op `.to` still costs a dispatch
            x = x.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features),
            self.packed,
            self.group,
            self.scales_and_zeros,
        )
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(torch.bfloat16)


class Int4Part(nn.Module):
    """Output columns [start, stop) of an Int4Linear shared by projections of one input.
    Alone it runs the whole packed matmul; `project` runs it once for all its parts."""

    def __init__(self, fused: Int4Linear, start: int, stop: int) -> None:
        super().__init__()
        self.in_features, self.out_features = fused.in_features, stop - start
        self.start, self.stop = start, stop
        object.__setattr__(self, "fused", fused)  # not a child: the owner holds it once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.stop]


def _fuse_int4(module: nn.Module, names: tuple[str, ...], group: int) -> None:
    """Replace the linears `names` of module (maybe LoRA-wrapped: their `.base`) by parts of
    one Int4Linear, kept as module.fused_<first name>."""
    outer = [getattr(module, n, None) for n in names]
    bases = [getattr(o, "base", o) for o in outer]
    if not all(isinstance(b, nn.Linear) for b in bases):
        return
    if len({b.in_features for b in bases}) != 1 or len({b.bias is None for b in bases}) != 1:
        return
    if not all(int4_fits(b, group) for b in bases):
        return
    bias = None if bases[0].bias is None else torch.cat([b.bias.detach() for b in bases])
    # levels are per output row, so the packed matrix holds each part's own levels
    levels = [quantize_int4(b.weight.detach(), group) for b in bases]
    fused = Int4Linear.from_levels(*(torch.cat(x) for x in zip(*levels)), bias)
    setattr(module, f"fused_{names[0]}", fused)
    start = 0
    for name, o, b in zip(names, outer, bases):
        part = Int4Part(fused, start, start + b.out_features)
        start = part.stop
        if o is b:
            setattr(module, name, part)
        else:
            o.base = part


def _packed(linears: tuple[nn.Module, ...]) -> tuple[Int4Linear | None, list[nn.Module]]:
    """(the packed matrix all of `linears` are parts of, or None; their bases: the linears
    themselves, or what a draft adapter's LoRALinear wraps)."""
    bases = [getattr(m, "base", m) for m in linears]
    fused = getattr(bases[0], "fused", None)
    if fused is None or any(getattr(b, "fused", None) is not fused for b in bases):
        return None, bases
    return fused, bases


def project(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """[linear(x) for linear in linears], in one kernel call when they are the parts of one
    packed matrix (`Int4Part`, maybe under a draft adapter's LoRALinear)."""
    fused, bases = _packed(linears)
    if fused is None:
        return [m(x) for m in linears]
    y = fused(x)
    outs = [y[..., b.start : b.stop] for b in bases]
    return [o if m is b else m.add_delta(x, o) for m, b, o in zip(linears, bases, outs)]


def project_cat(x: torch.Tensor, *linears: nn.Module) -> torch.Tensor:
    """torch.cat([linear(x) for linear in linears], -1), with no cat when they are the parts
    of one packed matrix in order: the packed output itself, a draft adapter's deltas added
    into its columns (in place at inference)."""
    fused, bases = _packed(linears)
    edges = [0] + [b.stop for b in bases] if fused is not None else []
    whole = fused is not None and edges[-1] == fused.out_features
    if not whole or any(b.start != edges[i] for i, b in enumerate(bases)):  # all, in order
        return torch.cat([m(x) for m in linears], -1)
    y = fused(x)
    outs, inplace = [], True
    for m, b in zip(linears, bases):
        part = y[..., b.start : b.stop]
        out = part if m is b else m.add_delta(x, part)
        inplace = inplace and out is part
        outs.append(out)
    return y if inplace else torch.cat(outs, -1)


def quantized_linear(weight: QWeight, bias: torch.Tensor | None = None) -> nn.Module:
    """An Int4Linear (4-bit levels) or Int8Linear (5- and 8-bit) over a packed matrix as it
    is, e.g. one mapped from a packed GGUF (`checkpoints.packed`). bias: float32 [N]."""
    cls = Int4Linear if weight.bits == 4 else Int8Linear
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.weight = weight
    module.bias = None if bias is None else bias.detach().float()
    module.in_features, module.out_features = weight.in_features, weight.out_features
    if cls is Int4Linear:
        module.group = weight.group
    else:
        module.scale = None
    return module


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W in int8 per output row (a scale per row); x in bfloat16.
    Run by Clover's kernel when it is there (the row's scale repeated per group of 32), else
    by PyTorch's int8 kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)
        q, self.scale = int8_rows(weight)  # scale: bfloat16 (exact in the kernel's float16)
        N, K = q.shape
        self.out_features, self.in_features = N, K
        self.weight: torch.Tensor | QWeight = q
        if kernels.load() is not None and N % 16 == 0 and K % 32 == 0:
            scales = self.scale.float()[:, None].expand(N, K // 32)
            self.weight = QWeight.from_levels(q, scales, bits=8)

    @classmethod
    def from_levels(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        low: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> Int8Linear:
        """From int8 levels q [N, K] and scale (low) [N, K / group], group 16 or 32, as a
        GGUF Q8_0 / Q6_K / Q5_0 / Q5_K tensor stores them: nothing re-rounded. Needs Clover's
        kernels (PyTorch's int8 kernel has one scale per row)."""
        if kernels.load() is None:
            raise CloverError("int8 weights in groups need Clover's CPU kernels (a C++ compiler)")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        # float32, added inside the kernel as Int4Linear's (the fused layer reads the same)
        module.bias = None if bias is None else bias.detach().float()
        module.weight = QWeight.from_levels(q, scale, low, bits=8)
        module.scale = None
        module.out_features, module.in_features = q.shape
        return module

    float_output = False  # as an LM head (see Int4Linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if isinstance(self.weight, QWeight):
            return self.weight.matmul(x, self.bias, out_bf16=not self.float_output)
        y = int8_matmul(x.reshape(-1, shape[-1]), self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1)

    def dequantized_weight(self) -> torch.Tensor:
        if isinstance(self.weight, QWeight):
            return self.weight.dequantized()
        return self.weight.float() * self.scale.float()[:, None]


def quantize_model(
    model: nn.Module,
    mode: str = "int4",
    group: int = GROUP,
    fuse: bool = True,
    head: str = "int8",
) -> nn.Module:
    """In place, weight-only. int4: decoder linears -> Int4Linear (where the kernel's tiling
    fits). int8: every linear and every expert -> 8-bit per output channel. The LM head is
    `head` (int8 per row, or int4 groups of 32 where Clover's kernels run) and returns float32.
    Everything else (embeddings, norms) becomes bfloat16. fuse (int4): pack q/k/v and gate/up
    into one matrix each (`Int4Part`; False keeps them apart: the reference)."""
    if mode not in ("int4", "int8"):
        raise CloverError(f"unknown quantization {mode!r}: int4 or int8")
    if head not in ("int4", "int8"):
        raise CloverError(f"unknown LM head precision {head!r}: int4 or int8")
    if next(model.parameters()).device.type != "cpu":
        raise CloverError("weight-only quantization uses CPU kernels; use bfloat16 elsewhere")
    model.to(torch.bfloat16)
    # the modules whose children get replaced, not the linears themselves: a list holding those
    # would keep every bfloat16 weight alive until the end, and the load's peak with them
    owners = [m for m in model.modules() if not isinstance(m, nn.Linear)]
    for module in owners:
        changed = False
        if mode == "int8" and hasattr(module, "quantize_experts_int8"):
            module.quantize_experts_int8()
            changed = True
        if mode == "int4" and fuse:
            # modules that run these linears through `project` say so (a module calling them
            # one by one would run the packed matmul once per call)
            for names in getattr(module, "packed_projections", ()):
                _fuse_int4(module, names, group)
                changed = True
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or name == "lm_head":
                continue
            if mode == "int8":
                setattr(module, name, Int8Linear(child.weight, child.bias))
                changed = True
            elif int4_fits(child, group):
                setattr(module, name, Int4Linear(child, group))
                changed = True
        child = None  # (the loop variable would keep the last replaced linear alive)
        if changed:  # the replaced weights are free now: give their pages back as we go
            release_freed_memory()
    w = model.head_weight()
    if head == "int4" and kernels.load() is not None and w.shape[0] % 16 == 0:
        model.quantized_head = Int4Linear.from_levels(*quantize_int4(w.detach(), group))
    else:
        model.quantized_head = Int8Linear(w)
    model.quantized_head.float_output = True
    if hasattr(model, "lm_head"):
        del model.lm_head
    release_freed_memory()
    return model


def head_rows(model: nn.Module, rows: torch.Tensor, four_bits: bool = False) -> nn.Module | None:
    """The model's LM head restricted to output rows `rows` (a drafter's vocabulary): float32
    logits over those tokens, each exactly the full head's logit for it. Quantized heads keep
    their levels (no rounding again) unless `four_bits` rounds rows stored wider to 4 bits
    (a draft model's: fewer bytes a draft, not exact); None where that cannot be done
    (PyTorch's int4 fallback, or a row count the kernel cannot tile), and the caller uses the
    whole head."""
    head = getattr(model, "quantized_head", None)
    if head is None:
        weight = model.head_weight().detach()[rows]
        sub = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        sub.weight = nn.Parameter(weight, requires_grad=False)
        return sub
    qweight = getattr(head, "weight", None)
    if not isinstance(qweight, QWeight) or len(rows) % 16 or head.bias is not None:
        return None
    taken = qweight.take_rows(rows)
    if four_bits and taken.bits > 4:
        taken = QWeight.from_levels(*quantize_int4(taken.dequantized()), bits=4)
    sub = quantized_linear(taken)
    sub.weight.x_bits = qweight.x_bits  # the same x, so the same logits (when kept)
    sub.float_output = True
    return sub


def set_dots_x(model: nn.Module, bits: int, drafter: nn.Module | None = None) -> None:
    """In place: the integer dots of `model`'s 4- to 6-bit weights take x on `bits` (8 or 15)
    bits per group (`clover.kernels`), in its modules, its fused layers (built again) and its
    drafter, if given; `$CLOVER_DOTS_X` still overrides it."""
    if bits not in (8, 15):
        raise ValueError(f"dots x bits {bits}: 8 or 15")
    for owner in (model, drafter):
        if owner is None:
            continue
        object.__setattr__(owner, "dots_x", bits)
        for module in owner.modules():
            for value in vars(module).values():
                if isinstance(value, QWeight):
                    value.x_bits = bits
    if getattr(model, "fused", None):
        model.fused = None  # built again, with the new kernel path, at the next pass


def quantize_linears(module: nn.Module, group: int = GROUP) -> nn.Module:
    """In place: every nn.Linear of `module` whose shape the int4 kernel takes becomes an
    Int4Linear (a small model beside the main one, e.g. a drafter; no LM head, no packing)."""
    for owner in list(module.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % group == 0:
                if child.out_features % 16 == 0:
                    setattr(owner, name, Int4Linear(child, group))
    return module


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (int8 [..., N, K], bf16 scale [..., N]), symmetric per row. In
    chunks of rows: a float32 copy of a whole LM head (vocabulary x hidden) is large."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[:-1], dtype=torch.float32)
    # detached: a weight that requires grad (the LM head's parameter) would make `scale` an
    # autograd node keeping every float32 chunk and the weight alive
    rows, qf, sf = w.detach().reshape(-1, w.shape[-1]), q.view(-1, w.shape[-1]), scale.view(-1)
    for i in range(0, rows.shape[0], 4096):
        chunk = rows[i : i + 4096].float()
        s = (chunk.abs().amax(-1) / 127).clamp(min=1e-10)
        sf[i : i + 4096] = s
        qf[i : i + 4096] = (chunk / s[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] * scale [N])^T with the CPU int8 kernel (bf16 activations)."""
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them after many large frees)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
