"""Clover's CPU kernels against their references: the quantized matmul on every instruction
set this CPU has, for every row count class, and the fused llama layers against the modules."""

import copy
import shutil

import pytest
import torch

from clover import kernels
from clover.errors import CloverError
from clover.kernels.qgemm import QWeight, pack_scales, reference_dots_matmul, reference_matmul
from clover.models.llama import LlamaConfig, LlamaModel
from clover.quant import Int4Linear, Int4Part, Int8Linear, project, quantize_model

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C++ compiler here")

ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 18, 19, 33)  # one row, tile edges (4, 12, 16), remainders


def available_isas() -> list[str]:  # read at collection: also where the kernels cannot build
    module = kernels.load()
    best = module.best_isa() if module is not None else -1
    return [name for name, level in kernels.ISAS.items() if level <= best]


def random_weight(kind: str, N: int, K: int, f16: bool, seed: int = 0) -> QWeight:
    g = torch.Generator().manual_seed(seed)
    bits, group, low = {"int4": (4, 32, True), "int8": (8, 32, False),
                        "int8g16": (8, 16, False), "int8low": (8, 32, True),
                        "int5": (8, 32, False), "int5low": (8, 32, True),
                        "int6": (8, 16, False), "int6low": (8, 16, True)}[kind]  # fmt: skip
    lo, hi = {"int4": (0, 16), "int5": (-16, 16), "int6": (-32, 32)}.get(kind[:4], (-128, 128))
    q = torch.randint(lo, hi, (N, K), generator=g)
    scale = torch.rand(N, K // group, generator=g) * 0.05 + 1e-3
    lows = torch.randn(N, K // group, generator=g) * 0.1 if low else None
    if f16:  # values a float16 holds exactly: stored in 16 bits
        scale = scale.half().float()
        lows = None if lows is None else lows.half().float()
    return QWeight.from_levels(q, scale, lows, bits=bits)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize(
    "kind", ["int4", "int8", "int8g16", "int8low", "int5", "int5low", "int6", "int6low"]
)
def test_qgemm_matches_reference(isa, kind, monkeypatch):
    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    monkeypatch.setenv("CLOVER_INT8_DOTS", "0")  # bfloat16 x at every width (next test: int8)
    N, K = 48, 96
    for f16 in (True, False):
        w = random_weight(kind, N, K, f16)
        assert (w.scales.dtype == torch.float16) == f16
        assert w.bits == {"int4": 4, "int5": 5, "int6": 6}.get(kind[:4], 8)
        bias = torch.randn(N)
        for M in ROWS:
            x = torch.randn(M, K)
            ref = reference_matmul(x, w, bias)
            tol = 1e-5 * float((x.abs() @ w.dequantized().abs().t()).max() + 1)
            out = w.matmul(x, bias, out_bf16=False)
            assert out.dtype == torch.float32 and out.shape == (M, N)
            assert (out.double() - ref).abs().max() < tol, (isa, kind, f16, M)
            half = w.matmul(x.to(torch.bfloat16), bias)  # bfloat16 in and out
            assert half.dtype == torch.bfloat16
            torch.testing.assert_close(half.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max())


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("kind", ["int4", "int8", "int5low"])
def test_long_passes_sweep_the_weights_in_chunks_of_rows(isa, kind, monkeypatch):
    """A pass of more than 2 x 192 rows runs in sweeps of 192 (the last takes what is left of
    two): the same numbers to the bit as one sweep over all rows, and the reference's."""
    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    N, K = 32, 64
    w = random_weight(kind, N, K, f16=True)
    bias = torch.randn(N)
    for M in (383, 384, 421, 600):  # one sweep; two of 192; 192 + 229; 192 + 192 + 216
        x = torch.randn(M, K)
        monkeypatch.setenv("CLOVER_QGEMM_ROWS", "0")
        whole = w.matmul(x, bias, out_bf16=False)
        monkeypatch.delenv("CLOVER_QGEMM_ROWS")
        chunked = w.matmul(x, bias, out_bf16=False)
        assert torch.equal(chunked, whole), (isa, kind, M)
        assert torch.equal(w.matmul(x, bias), whole.to(torch.bfloat16)), (isa, kind, M)
        ref = reference_matmul(x, w, bias)
        tol = 1e-5 * float((x.abs() @ w.dequantized().abs().t()).max() + 1)
        assert (chunked.double() - ref).abs().max() < tol, (isa, kind, M)


def int8_dots_here() -> bool:  # read at collection: also where the kernels cannot build
    module = kernels.load()
    return module is not None and bool(module.int8_dots_supported())


def dot_isas() -> list[str]:
    """Kernel paths with integer dots here: avx2 (qgemm_dots_avx2.cpp), and avx512 (VNNI)
    where the CPU has AVX-512 BF16."""
    return (
        [isa for isa in available_isas() if isa in ("avx2", "avx512")] if int8_dots_here() else []
    )


@pytest.mark.skipif(not int8_dots_here(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("x_bits", [8, 15])
@pytest.mark.parametrize("isa", dot_isas())
@pytest.mark.parametrize(
    "kind", ["int4", "int8", "int8g16", "int8low", "int5", "int5low", "int6", "int6low"]
)
def test_int8_dots_match_their_reference(isa, kind, x_bits, monkeypatch):
    """Passes of up to int8_dots_rows (VNNI: 4, 16 with x on 8 bits; AVX2: 16) on the dots equal
    x rounded per group (8 bits for 4- and 5-bit weights unless $CLOVER_DOTS_X=15, else 15)
    times the levels, exactly summed (reference_dots_matmul), every format and scale type;
    wider passes keep bfloat16 x. At 15 bits that second rounding (of the bfloat16 x) errs
    less than the first one did, also in a group with one large value."""
    monkeypatch.setenv("CLOVER_INT8_DOTS", "1")
    monkeypatch.setenv("CLOVER_DOTS_X", str(x_bits))
    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    assert kernels.isa() & kernels.INT8_DOTS
    assert bool(kernels.isa() & kernels.X8) == (x_bits == 8)
    N, K = 48, 96
    for f16 in (True, False):
        w = random_weight(kind, N, K, f16)
        bias = torch.randn(N)
        rows = kernels.load().int8_dots_rows(kernels.isa())
        assert rows == (4 if isa == "avx512" and x_bits == 15 else 16)
        for M in (1, 2, 3, 4, 5, 7, 16, 17):
            x = torch.randn(M, K)
            x[0, :32] = 0  # a group of zeros: step 0, no division by it
            x[-1, 40] = 30.0  # one large value sets its group's step
            exact = reference_matmul(x, w, bias)
            want = reference_dots_matmul(x, w, bias, x_bits) if M <= rows else exact
            out = w.matmul(x, bias, out_bf16=False).double()
            tol = 1e-5 * float((x.abs() @ w.dequantized().abs().t()).max() + 1)
            assert (out - want).abs().max() < tol, (kind, f16, M)
            if M <= rows:
                assert not torch.equal(want, exact)
                unrounded = x.double() @ w.dequantized().double().t() + bias.double()
                wide = reference_dots_matmul(x, w, bias, 15)
                if x_bits == 15 or w.bits == 8:  # 8-bit weights keep 15-bit x
                    assert torch.equal(want, wide)
                    assert (want - exact).norm() < (exact - unrounded).norm()
                else:  # a coarser x: further from exact than 15 bits, still close
                    assert (want - exact).norm() > (wide - exact).norm()
                    assert (want - exact).norm() < 0.05 * exact.norm()
            half = w.matmul(x.to(torch.bfloat16), bias)  # bfloat16 out
            torch.testing.assert_close(half.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
            x[0, 5] = float("nan")  # a NaN in x gives NaN, as on the bfloat16 path
            out = w.matmul(x, bias, out_bf16=False)
            assert out[0].isnan().all() and out[1:].isfinite().all()


@pytest.mark.skipif(not int8_dots_here(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("x_bits", [8, 15])
@pytest.mark.parametrize("isa", dot_isas())
def test_int8_dots_give_each_row_the_same_result_in_any_pass(isa, x_bits, monkeypatch):
    """Integer dots are exact, so a row's output does not depend on the rows beside it: an AR
    step and each row of a verify pass as wide as the dots take agree to the bit (bfloat16 x
    on AMX sums in another order for 3 rows or more), with x on 8 bits or 15."""
    monkeypatch.setenv("CLOVER_INT8_DOTS", "1")
    monkeypatch.setenv("CLOVER_DOTS_X", str(x_bits))
    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    rows = kernels.load().int8_dots_rows(kernels.isa())
    for kind in ("int4", "int5", "int6", "int8g16", "int8low"):
        w = random_weight(kind, 64, 128, True)
        x = torch.randn(rows, 128)
        alone = torch.cat([w.matmul(x[i : i + 1], out_bf16=False) for i in range(rows)])
        for M in range(2, rows + 1):
            assert torch.equal(w.matmul(x[:M], out_bf16=False), alone[:M]), (kind, M)


@pytest.mark.skipif("avx2" not in dot_isas(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("kind", ["int4", "int8g16", "int8low", "int5", "int5low", "int6"])
def test_wide_avx2_passes_match_the_reference_and_give_each_row_one_result(kind, monkeypatch):
    """Passes wider than the integer dots take on AVX2 (qgemm_tiles_wide_avx2: float32 weights
    per tile, blocks of 6 rows, 96-row chunks, k in blocks of 256) equal the exact reference,
    and a row's result is the same in any wide pass, wherever it sits in it."""
    monkeypatch.setenv("CLOVER_INT8_DOTS", "1")
    monkeypatch.setenv("CLOVER_KERNEL_ISA", "avx2")
    K = 320  # one k block and a part
    for f16 in (True, False):
        w = random_weight(kind, 48, K, f16, seed=1)
        bias = torch.randn(48)
        x = torch.randn(203, K)
        out = w.matmul(x, bias, out_bf16=False)
        ref = reference_matmul(x, w, bias)
        tol = 1e-5 * float((x.abs() @ w.dequantized().abs().t()).max() + 1)
        assert (out.double() - ref).abs().max() < tol, (kind, f16)
        for lo, hi in ((0, 17), (5, 28), (100, 203), (186, 203)):
            part = w.matmul(x[lo:hi], bias, out_bf16=False)
            assert torch.equal(part, out[lo:hi]), (kind, f16, lo, hi)
        half = w.matmul(x.to(torch.bfloat16), bias)
        assert torch.equal(half, out.to(torch.bfloat16))


@pytest.mark.skipif("avx512" not in dot_isas(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("x_bits", [8, 15])
def test_int8_dots_on_avx2_equal_vnni_to_the_bit(x_bits, monkeypatch):
    """The AVX2 dots sum the same integers and run the same float epilogue in the same order
    as the VNNI ones, in every pass both take (x on 8 bits: up to 16 rows, 8-bit weights on
    two planes in blocks of 4, 4- to 6-bit ones on one in blocks of 8): a model gives the
    same tokens on either CPU class."""
    monkeypatch.setenv("CLOVER_INT8_DOTS", "1")
    monkeypatch.setenv("CLOVER_DOTS_X", str(x_bits))
    for kind in ("int4", "int8", "int8g16", "int8low", "int5", "int5low", "int6", "int6low"):
        for f16 in (True, False):
            w = random_weight(kind, 48, 160, f16, seed=3)
            x = torch.randn(16, 160) * torch.rand(16, 160) * 4
            bias = torch.randn(48)
            for M in range(1, 5 if x_bits == 15 else 17):
                monkeypatch.setenv("CLOVER_KERNEL_ISA", "avx512")
                vnni = w.matmul(x[:M], bias, out_bf16=False)
                monkeypatch.setenv("CLOVER_KERNEL_ISA", "avx2")
                avx2 = w.matmul(x[:M], bias, out_bf16=False)
                assert torch.equal(vnni, avx2), (kind, f16, M)
                monkeypatch.setenv("CLOVER_KERNEL_ISA", "avx512")
                assert kernels.load().int8_dots_rows(kernels.isa()) >= M


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dots", ["0", "1"])
def test_6bit_levels_give_their_8bit_form_s_results_to_the_bit(isa, dots, monkeypatch):
    """Levels in -32..31 in groups of 16 (GGUF Q6_K's) are stored in 6 bits, and every kernel
    path reads them into the same products as their int8 form: the same outputs to the bit
    at every width, on the integer dots with 15-bit x and on bfloat16 x. (With x on 8 bits
    the dots take 6-bit levels on one plane of x, int8 ones on two: the dots' reference test.)"""
    from clover.kernels.qgemm import pack_int8

    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    monkeypatch.setenv("CLOVER_INT8_DOTS", dots)
    for low, f16 in ((False, False), (False, True), (True, True)):
        w6 = random_weight("int6low" if low else "int6", 64, 256, f16, seed=5)
        assert w6.bits == 6 and w6.q.numel() == 64 * 256 * 6 // 8
        w8 = QWeight(8, 16, 64, 256, pack_int8(w6.levels(), 16), w6.scales, mults=w6.mults,
                     bases=w6.bases)  # fmt: skip
        bias = torch.randn(64)
        for M in (1, 2, 3, 4, 5, 9, 16, 17, 40):
            x = torch.randn(M, 256)
            for x_bits in (8, 15) if dots == "0" else (15,):
                w6.x_bits = w8.x_bits = x_bits
                want = w8.matmul(x, bias, out_bf16=False)
                assert torch.equal(w6.matmul(x, bias, out_bf16=False), want), (low, f16, M)
                assert torch.equal(w6.matmul(x, bias), w8.matmul(x, bias)), (low, f16, M)


def k_quant_weight(affine: bool, N: int = 48, K: int = 512, seed: int = 0) -> QWeight:
    """Levels with scales as GGUF's k-quants store them: a float16 per 256 values times a
    small integer per group (Q4_K: 0..63 for scale and offset; Q6_K: int8, d of either sign)."""
    g = torch.Generator().manual_seed(seed)
    group = 32 if affine else 16

    def per_group(lo: int, hi: int, sign: bool) -> torch.Tensor:
        d = (torch.rand(N, K // 256, generator=g) * 0.01).half().float()
        if sign:
            d = d * (torch.randint(0, 2, d.shape, generator=g) * 2 - 1)
        mult = torch.randint(lo, hi, (N, K // group), generator=g).float()
        return d.repeat_interleave(256 // group, 1) * mult

    if affine:
        q = torch.randint(0, 16, (N, K), generator=g)
        return QWeight.from_levels(q, per_group(0, 64, False), -per_group(0, 64, False), bits=4)
    q = torch.randint(-32, 32, (N, K), generator=g)
    return QWeight.from_levels(q, per_group(-128, 128, True), bits=8)


@pytest.mark.parametrize("affine", [True, False])
def test_k_quant_scales_are_stored_compact_and_give_the_same_results(affine, monkeypatch):
    """Scales that are small integers times a base per 256 values (not float16 numbers) are
    kept as int8 multiples plus the bases: fewer bytes a pass, and on every kernel path and
    width (integer dots, which read them, and wider passes, which keep the float32 copy) the
    same results to the bit as the float32 scales. Other float32 scales stay as they are."""
    from clover.kernels.qgemm import compact_parts

    w = k_quant_weight(affine)
    assert w.scales.dtype == torch.float32 and w.mults is not None
    plain = QWeight(w.bits, w.group, w.out_features, w.in_features, w.q, w.scales)
    assert w.nbytes() < plain.nbytes() * (0.8 if affine else 0.9)
    mult, base = compact_parts(w.group_scales()[..., 0].contiguous(), 256 // w.group)
    assert torch.equal(mult.float() * base.repeat_interleave(256 // w.group, 1),
                       w.group_scales()[..., 0])  # fmt: skip
    assert compact_parts(torch.rand(16, 16) + 0.1, 8) is None  # arbitrary floats: no base
    assert random_weight("int4", 48, 512, False).mults is None
    bias = torch.randn(w.out_features)
    x = torch.randn(40, w.in_features) * torch.rand(40, w.in_features) * 4
    for isa in dot_isas() or available_isas():
        monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
        for x_bits in (8, 15):
            w.x_bits = plain.x_bits = x_bits
            for M in (1, 2, 3, 4, 5, 8, 9, 16, 17, 40):
                got = w.matmul(x[:M], bias, out_bf16=False)
                assert torch.equal(got, plain.matmul(x[:M], bias, out_bf16=False)), (isa, M)


def verify_and_steps(model, prompt: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Logits of one verify pass over `step` after `prompt`, and of AR steps over the same
    tokens one at a time, each on a fresh cache."""
    with torch.inference_mode():
        wide, narrow = model.make_cache(1), model.make_cache(1)
        model(prompt, wide), model(prompt, narrow)
        verify = model.logits(model(step, wide))
        steps = [model.logits(model(step[:, i : i + 1], narrow)) for i in range(step.shape[1])]
    return verify, torch.cat(steps, 1)


@pytest.mark.skipif(not int8_dots_here(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("x_bits", [8, 15])
def test_int8_dots_make_int4_verify_passes_equal_ar_steps(x_bits, monkeypatch):
    """A quantized model's verify pass of as many tokens as the dots take (VNNI: 4, or 16 with
    x on 8 bits; AVX2: 16) gives, to the bit, the logits of AR steps over the same tokens
    (fused layers, head and all), so int4 self-speculation keeps exactly `ar`'s tokens, not
    only in float32."""
    from clover.decoding.loop import generate
    from clover.decoding.policies import SelfSpec, make_policy

    monkeypatch.setenv("CLOVER_INT8_DOTS", "1")
    monkeypatch.setenv("CLOVER_DOTS_X", str(x_bits))
    q = quantize_model(tiny_llama())
    rows = kernels.load().int8_dots_rows(kernels.isa())
    g = torch.Generator().manual_seed(2)
    prompt, step = (
        torch.randint(4, 256, (1, 9), generator=g),
        torch.randint(4, 256, (1, rows), generator=g),
    )
    verify, steps = verify_and_steps(q, prompt, step)
    assert q.fused
    assert torch.equal(verify, steps)
    prompts = ([5, 6, 7, 8, 9] * 3, torch.randint(4, 256, (30,), generator=g).tolist())
    ar, lookup = make_policy("ar"), SelfSpec(4, draft="lookup", adaptive=False)
    for prompt in prompts:
        want, got = [], []
        for policy, results in ((ar, want), (lookup, got)):
            for _ in generate(q, [prompt], policy, max_new_tokens=40, results=results):
                pass
        assert got[0].tokens == want[0].tokens
        assert got[0].nfe < want[0].nfe  # drafts were kept


def test_int8_dots_switch(monkeypatch):
    monkeypatch.delenv("CLOVER_DOTS_X", raising=False)
    monkeypatch.delenv("CLOVER_INT8_DOTS", raising=False)
    assert not kernels.isa() & kernels.X8  # x on 15 bits unless a model asks for 8
    if int8_dots_here():
        assert kernels.isa(8) & kernels.X8 and kernels.isa(8) & kernels.INT8_DOTS
        assert not kernels.isa(15) & kernels.X8
    monkeypatch.setenv("CLOVER_DOTS_X", "15")  # the variable overrides the model's choice
    assert not kernels.isa(8) & kernels.X8
    monkeypatch.setenv("CLOVER_DOTS_X", "4")
    with pytest.raises(ValueError, match="CLOVER_DOTS_X"):
        kernels.isa()
    monkeypatch.setenv("CLOVER_DOTS_X", "8")
    monkeypatch.setenv("CLOVER_INT8_DOTS", "0")  # no dots, so no 8-bit x either
    assert not kernels.isa() & (kernels.INT8_DOTS | kernels.X8)


@pytest.mark.skipif(not int8_dots_here(), reason="no AVX2 on this CPU")
def test_a_model_chooses_its_dots_x(monkeypatch):
    """set_dots_x (a registry entry's dots_x) reaches the model's weights and its fused layers,
    built again: its logits become those of $CLOVER_DOTS_X=8, and a verify pass still equals
    AR steps to the bit; the variable overrides the model's choice."""
    from clover.checkpoints.registry import KNOWN_MODELS
    from clover.quant import set_dots_x

    monkeypatch.delenv("CLOVER_DOTS_X", raising=False)
    monkeypatch.setenv("CLOVER_INT8_DOTS", "1")
    assert KNOWN_MODELS["qwen2.5-coder-0.5b"].dots_x == 8  # measured for it
    assert KNOWN_MODELS["qwen2.5-coder-1.5b"].dots_x == 8
    assert KNOWN_MODELS["smollm2-135m"].dots_x == 15  # its activations' outliers cost too much
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, 256, (1, 12), generator=g)

    def logits(model):
        wide, steps = verify_and_steps(model, ids[:, :8], ids[:, 8:])
        assert model.fused and torch.equal(wide, steps)
        return wide

    model = quantize_model(tiny_llama())
    plain = logits(model)
    set_dots_x(model, 8)
    assert model.dots_x == 8 and model.quantized_head.weight.x_bits == 8
    x8 = logits(model)
    assert not torch.equal(x8, plain)
    monkeypatch.setenv("CLOVER_DOTS_X", "8")
    assert torch.equal(logits(quantize_model(tiny_llama())), x8)
    monkeypatch.setenv("CLOVER_DOTS_X", "15")
    set_dots_x(model, 8)  # rebuilt under the variable: 15 bits again
    assert torch.equal(logits(model), plain)
    with pytest.raises(ValueError, match="8 or 15"):
        set_dots_x(model, 4)
    monkeypatch.setenv("CLOVER_INT8_DOTS", "yes")
    with pytest.raises(ValueError, match="CLOVER_INT8_DOTS"):
        kernels.isa()
    monkeypatch.setenv("CLOVER_INT8_DOTS", "1")
    monkeypatch.setenv("CLOVER_KERNEL_ISA", "portable")  # no dots without AVX2
    assert kernels.isa() == 0


def test_packed_layout_round_trip():
    for kind in ("int4", "int8", "int8g16", "int5", "int6"):
        g = torch.Generator().manual_seed(1)
        lo, hi = {"int4": (0, 16), "int5": (-16, 16), "int6": (-32, 32)}.get(kind, (-128, 128))
        q = torch.randint(lo, hi, (32, 64), generator=g)
        q[0, :2] = torch.tensor([lo, hi - 1])  # both ends of the range
        group = 16 if kind in ("int8g16", "int6") else 32
        w = QWeight.from_levels(
            q, torch.ones(32, 64 // group), None, bits=4 if kind == "int4" else 8
        )
        assert w.bits == {"int4": 4, "int5": 5, "int6": 6}.get(kind, 8)
        assert torch.equal(w.levels(), q.to(torch.int32))


def test_row_levels_read_only_their_tiles_and_equal_the_whole_matrix_s_rows():
    """A subset of rows (unsorted, repeated, across tiles) read back from only the 16-row
    tiles holding them: the levels, scales and lows the whole matrix's read gives."""
    g = torch.Generator().manual_seed(2)
    rows = torch.tensor([70, 3, 3, 95, 16, 0, 64, 47])
    for bits, lo, hi, group, low in ((4, 0, 16, 32, True), (8, -128, 128, 16, False),
                                     (8, -16, 16, 32, False), (8, -32, 32, 16, False)):  # fmt: skip
        q = torch.randint(lo, hi, (96, 64), generator=g)
        scale = torch.rand(96, 64 // group, generator=g) + 0.1
        lows = torch.randn(96, 64 // group, generator=g) if low else None
        w = QWeight.from_levels(q, scale, lows, bits=bits)
        levels, s, l_ = w.row_levels(rows)
        assert torch.equal(levels, w.levels()[rows])
        whole = w.group_scales()[rows]
        assert torch.equal(s, whole[..., 0])
        assert (l_ is None) == (not low) and (l_ is None or torch.equal(l_, whole[..., 1]))


def test_5bit_levels_read_5_5_bits_a_weight():
    """GGUF Q5_0's levels (-16..15 in groups of 32, float16 scales) take 5.5 bits a weight, as
    in the file (8.5 as 8-bit levels); one level outside -16..15 keeps 8 bits."""
    q = torch.randint(-16, 16, (64, 128))
    w = QWeight.from_levels(q, torch.full((64, 4), 0.5), None, bits=8)
    assert w.bits == 5 and w.nbytes() * 8 / q.numel() == 5.5
    q[3, 7] = 16
    assert QWeight.from_levels(q, torch.full((64, 4), 0.5), None, bits=8).bits == 8


def test_scales_stored_in_float16_only_when_exact():
    exact = torch.tensor([[0.5, 0.25]] * 16)
    assert pack_scales(exact, None).dtype == torch.float16
    assert pack_scales(exact + 1e-7, None).dtype == torch.float32


def test_odd_sizes_are_refused_with_a_clear_error():
    q = torch.zeros(40, 64, dtype=torch.int32)  # 40 rows: not whole tiles of 16
    with pytest.raises(CloverError, match="multiple of 16"):
        QWeight.from_levels(q, torch.ones(40, 2), torch.zeros(40, 2))
    with pytest.raises(CloverError, match="groups of 32"):
        QWeight.from_levels(torch.zeros(32, 48, dtype=torch.int32), torch.ones(32, 3), None)
    with pytest.raises(CloverError, match="outside 0..15"):
        QWeight.from_levels(torch.full((16, 32), 16), torch.ones(16, 1), torch.zeros(16, 1))


def test_int4_linear_from_given_levels_keeps_them():
    """Levels handed over (e.g. a GGUF Q4_K sub-block: scale = d * sc, low = -dmin * m) stay
    exactly as given, with float32 scales where float16 cannot hold them."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 64), generator=g)
    scale = torch.rand(32, 2, generator=g) * 0.01  # not float16 values: kept in float32
    low = -torch.rand(32, 2, generator=g) * 0.1
    lin = Int4Linear.from_levels(q, scale, low)
    assert torch.equal(lin.weight.levels(), q.to(torch.int32))
    assert lin.weight.scales.dtype == torch.float32
    w = (q.float().reshape(32, 2, 32) * scale[..., None] + low[..., None]).reshape(32, 64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x).float(), x.bfloat16().float() @ w.t(), rtol=1e-2, atol=1e-2)


def tiny_llama(model_type: str = "llama", **kw) -> LlamaModel:
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                    mask_token_id=3, model_type=model_type, **kw)  # fmt: skip
    model = LlamaModel(c).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def fused_and_modules(model: LlamaModel) -> tuple[LlamaModel, LlamaModel]:
    fast = quantize_model(copy.deepcopy(model))
    ref = quantize_model(copy.deepcopy(model))
    ref.fused = False  # the module path: the reference
    return fast, ref


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_layers_match_the_modules(model_type):
    """Prefill with padding (rows of different lengths), AR steps, block passes with commits
    in front, verify-like causal passes, and a wide pass (PyTorch's attention inside)."""
    model = tiny_llama(model_type)
    fast, ref = fused_and_modules(model)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 256, (2, 9), generator=g)
    valid = torch.tensor([9, 6])
    block = {"mode": "block", "n_commit": torch.tensor([1, 2])}
    passes = [
        (ids, {"n_valid": valid}),
        (ids[:, :1], {}),
        (torch.randint(4, 256, (2, 5), generator=g), block),
        (torch.randint(4, 256, (2, 4), generator=g), {}),
        (torch.randint(4, 256, (2, 18), generator=g), {}),  # 4 queries a task in attention
        (torch.randint(4, 256, (2, 17), generator=g), block),
        (torch.randint(4, 256, (2, 70), generator=g), {}),
    ]
    agree = []
    with torch.inference_mode():
        cf, cr = fast.make_cache(2), ref.make_cache(2)
        for x, kw in passes:
            a, b = fast(x, cf, **kw), ref(x, cr, **kw)
            assert fast.fused and not ref.fused
            scale = float(b.float().abs().max())
            assert float((a.float() - b.float()).abs().max()) < 0.02 * scale
            la, lb = fast.logits(a), ref.logits(b)
            agree.append((la.argmax(-1) == lb.argmax(-1)).flatten())
            assert torch.equal(cf.lengths, cr.lengths)
        # the random tiny model's logits lie close together: counted over all ~250 positions
        assert float(torch.cat(agree).float().mean()) > 0.9
        for lf, lr in zip(cf.layers, cr.layers):  # the committed K/V agree too
            n = int(cf.lengths.min())
            torch.testing.assert_close(lf.k[:, :, :n], lr.k[:, :, :n], rtol=0.05, atol=0.02)


@pytest.mark.parametrize("isa", available_isas())
def test_fused_layers_verify_trees_of_drafts_as_the_modules(isa, monkeypatch):
    """Passes whose tokens are trees of drafts (each sees the prefix and its own ancestors)
    through the fused layers, two rows of different prefixes and trees: one query a task (3, 6
    tokens), 4 a task (18) and PyTorch's attention (70); the modules' masked attention is the
    reference. A chain over the same tokens gives far other states."""
    from clover.models.llama import LlamaModel

    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    fast, ref = fused_and_modules(tiny_llama())
    fused = []
    backbone = LlamaModel._fused_backbone
    monkeypatch.setattr(LlamaModel, "_fused_backbone",
                        lambda self, *a: fused.append(1) or backbone(self, *a))  # fmt: skip
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 256, (2, 9), generator=g)
    with torch.inference_mode():
        cf, cr = fast.make_cache(2), ref.make_cache(2)
        fast(ids, cf, n_valid=torch.tensor([9, 5]))
        ref(ids, cr, n_valid=torch.tensor([9, 5]))
        for T in (3, 6, 18, 70):
            x = torch.randint(4, 256, (2, T), generator=g)
            # each token's parent: any token before it, or the prefix (-1)
            parents = torch.full((2, T), -1)
            for t in range(1, T):
                parents[:, t] = torch.randint(-1, t, (2,), generator=g)
            kw = {"mode": "block", "n_commit": torch.tensor([T, T]), "tree": parents}
            before = len(fused)
            a, b = fast(x, cf, **kw), ref(x, cr, **kw)
            assert len(fused) == before + 1  # the tree took the fused layers
            scale = float(b.float().abs().max())
            gap = float((a.float() - b.float()).abs().max())
            assert gap < 0.02 * scale, T
            cr.rollback(torch.tensor([T, T]))  # the same tokens as a chain: another pass
            chain = ref(x, cr, mode="block", n_commit=torch.tensor([T, T]))
            assert float((chain.float() - b.float()).abs().max()) > 5 * gap, T
            for c in (cf, cr):  # the next tree over the same prefix
                c.rollback(torch.tensor([T, T]))


@pytest.mark.parametrize("apart", [(), ("attn_v", "ffn_up")])
def test_fused_layers_of_a_long_prefill(apart, tmp_path, monkeypatch):
    """A first prefill of 2 x 230 rows (a long prompt, a drafter's features): the matmuls sweep
    the weights in chunks of rows, parts kept apart write their columns of one output in
    place, and attention is SDPA's causal one; the same to the bit as one sweep, and close to
    the modules on every valid position."""
    if apart:
        fast, ref = packed_pair(tmp_path, monkeypatch, group16=apart)
    else:
        fast, ref = fused_and_modules(tiny_llama("qwen2"))
    ids = torch.randint(4, 256, (2, 230), generator=torch.Generator().manual_seed(9))
    valid = torch.tensor([230, 200])
    with torch.inference_mode():
        monkeypatch.setenv("CLOVER_QGEMM_ROWS", "0")
        whole = fast(ids, fast.make_cache(2), n_valid=valid)
        monkeypatch.delenv("CLOVER_QGEMM_ROWS")
        a, b = (
            fast(ids, fast.make_cache(2), n_valid=valid),
            ref(ids, ref.make_cache(2), n_valid=valid),
        )
        assert fast.fused and not ref.fused
        assert torch.equal(a, whole)
        for row, n in enumerate(valid.tolist()):  # PyTorch's causal attention, no mask
            x, y = a[row, :n].float(), b[row, :n].float()
            assert float((x - y).abs().max()) < 0.02 * float(y.abs().max())


def packed_pair(
    tmp_path, monkeypatch, group16: tuple[str, ...] = (), arch: str = "qwen2"
) -> tuple[LlamaModel, LlamaModel]:
    """A GGUF whose linears are all stored wider than 4 bits (Q8_0: 8-bit levels in groups of
    32; those in `group16` Q6_K: groups of 16), packed as the loader packs it: fused layers
    and, separately loaded, the module path."""
    from clover.checkpoints.loader import load
    from tests.gguf_files import LINEARS, write_gguf

    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "wide.gguf"
    types = {n: "Q6_K" if n in group16 else "Q8_0" for n in LINEARS}
    write_gguf(
        path,
        types,
        arch=arch,
        config={"num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512},
    )
    fast = load(str(path), dtype="int4", progress=False).model
    ref = load(str(path), dtype="int4", progress=False).model
    ref.fused = False
    return fast, ref


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_layers_take_8bit_levels(arch, tmp_path, monkeypatch):
    """A GGUF whose q/k/v and gate/up are all stored wider than 4 bits (Qwen2.5-Coder-0.5B's
    Q5_0/Q8_0) gets them packed as one 8-bit matrix each, with every part's own levels, and
    the fused layer path; it agrees with the modules."""
    fast, ref = packed_pair(tmp_path, monkeypatch, arch=arch)
    attn = fast.model.layers[0].self_attn
    assert isinstance(attn.fused_q_proj, Int8Linear) and isinstance(attn.q_proj, Int4Part)
    x = torch.randn(3, 256)
    with torch.inference_mode():
        whole = attn.fused_q_proj(x)
        for got, p in zip(project(x, attn.q_proj, attn.k_proj, attn.v_proj),
                          (attn.q_proj, attn.k_proj, attn.v_proj)):  # fmt: skip
            assert torch.equal(got, whole[..., p.start : p.stop])  # one call, each its columns
        ids = torch.randint(4, 256, (2, 7))
        cf, cr = fast.make_cache(2), ref.make_cache(2)
        for step in (ids, ids[:, :1], ids[:, :4]):
            a, b = fast(step, cf), ref(step, cr)
            assert fast.fused and not ref.fused
            assert float((a.float() - b.float()).abs().max()) < 0.02 * float(b.float().abs().max())


@pytest.mark.parametrize("apart", [("attn_v",), ("attn_v", "ffn_up")])
def test_8bit_parts_of_other_groups_stay_apart(apart, tmp_path, monkeypatch):
    """v (and up) in groups of 16 (Q6_K) beside the rest in groups of 32: no packed matrix for
    q/k/v (gate/up), so the fused layer takes the parts one by one, and agrees with the
    modules (a Qwen2.5-1.5B Q4_K_M file has this in half its layers)."""
    fast, ref = packed_pair(tmp_path, monkeypatch, group16=apart)
    attn, mlp = fast.model.layers[0].self_attn, fast.model.layers[0].mlp
    assert not hasattr(attn, "fused_q_proj") and isinstance(attn.v_proj, Int8Linear)
    assert attn.v_proj.weight.group == 16
    assert hasattr(mlp, "fused_gate_proj") == ("ffn_up" not in apart)
    ids = torch.randint(4, 256, (2, 7))
    with torch.inference_mode():
        cf, cr = fast.make_cache(2), ref.make_cache(2)
        for step in (ids, ids[:, :1], ids[:, :5]):
            a, b = fast(step, cf), ref(step, cr)
            assert fast.fused and not ref.fused
            assert float((a.float() - b.float()).abs().max()) < 0.02 * float(b.float().abs().max())


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dh", [64, 32, 24, 20])  # AVX-512 takes multiples of 16, AVX2 of 8
def test_attention_matches_softmax_reference(isa, dh, monkeypatch):
    """Queries 4 at a time over one cache (keys and values read once for all), each with its
    own visible length, against softmax(q K^T / sqrt(dh)) V in float64."""
    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    g = torch.Generator().manual_seed(3)
    S = 37
    K, V = torch.randn(S, dh, generator=g), torch.randn(S, dh, generator=g)
    for n in (1, 2, 3, 4, 5, 7, 9):
        q = torch.randn(n, dh, generator=g) * 2
        ends = torch.randint(1, S + 1, (n,), generator=g)
        ends[0] = S  # the last key, and a short one where there is room
        if n > 1:
            ends[1] = 1
        out = kernels.load().attention(q, K, V, ends, kernels.isa())
        for i in range(n):
            e = int(ends[i])
            w = torch.softmax(q[i].double() @ K[:e].double().t() / dh**0.5, -1)
            torch.testing.assert_close(out[i].double(), w @ V[:e].double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", available_isas())
def test_silu_mul_matches_portable_and_torch(isa, monkeypatch):
    """The fused layers' silu(gate) * up on each path, against the portable loop (to the
    bfloat16 bit but for rare last-bit roundings of the AVX2 exp's fused multiply-adds) and
    against PyTorch in float64; widths with a tail past the 8-lane loop, gates past exp's
    clamps, infinities and a NaN."""
    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    module, g = kernels.load(), torch.Generator().manual_seed(5)
    for F in (1, 8, 13, 4864):
        gu = torch.randn(3, 2 * F, generator=g) * 6
        gu[0, : min(F, 4)] = torch.tensor([-120.0, 95.0, 0.0, -0.0])[: min(F, 4)]
        out = module.silu_mul_bf16(gu, kernels.isa())
        portable = module.silu_mul_bf16(gu, 0)
        assert out.dtype == torch.bfloat16 and out.shape == (3, F)
        differ = (out.view(torch.int16) != portable.view(torch.int16)).float().mean()
        assert float(differ) <= 0.01
        torch.testing.assert_close(out.float(), portable.float(), rtol=2**-7, atol=1e-30)
        gate, up = gu[:, :F].double(), gu[:, F:].double()
        want = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-6)
    special = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0] * 4 + [2.0] * 16])
    out = kernels.load().silu_mul_bf16(special, kernels.isa()).float()[0]
    assert out[0].isnan() and out[4].isnan()  # a NaN gate stays NaN
    assert out[1] == float("inf") and out[2] == -float("inf")  # exp's clamps, not inf * 0
    assert abs(float(out[3]) - 2 * 0.7310585786) < 2**-7
    assert torch.equal(out.isnan(), kernels.load().silu_mul_bf16(special, 0).float()[0].isnan())


@pytest.mark.parametrize("isa", available_isas())
def test_fused_layers_on_every_instruction_set(isa, monkeypatch):
    """The same fused pass on each path (qgemm and attention per instruction set) agrees with
    the modules; float32 in, so only the kernels differ."""
    monkeypatch.setenv("CLOVER_KERNEL_ISA", isa)
    fast, ref = fused_and_modules(tiny_llama())
    ids = torch.randint(4, 256, (1, 12))
    with torch.inference_mode():
        a, b = fast(ids), ref(ids)
    assert fast.fused
    assert float((a.float() - b.float()).abs().max()) < 0.02 * float(b.float().abs().max())


def test_fused_layers_stay_off_for_block_tokens_of_a_draft_adapter():
    from clover.models.adapter import AdapterConfig, attach_adapter

    model = tiny_llama()
    attach_adapter(model, AdapterConfig(rank=4))
    fast = quantize_model(model)
    with torch.inference_mode():
        cache = fast.make_cache(1)
        fast(torch.randint(4, 256, (1, 6)), cache)
        assert fast.fused  # causal: fused
        seen = []
        original = fast.fused_layers

        def spy(layout, caches):
            out = original(layout, caches)
            seen.append(out is not None)
            return out

        fast.fused_layers = spy
        fast(torch.tensor([[5, 3, 3]]), cache, "block", n_commit=1)
        fast(torch.tensor([[5]]), cache)
    assert seen == [False, True]


def test_without_a_compiler_the_pytorch_kernels_run(monkeypatch, capsys):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    assert kernels.load() is None
    assert "no C++ compiler" in capsys.readouterr().err
    model = tiny_llama()
    q = quantize_model(copy.deepcopy(model))
    lin = q.model.layers[0].mlp.down_proj
    assert isinstance(lin, Int4Linear) and lin.weight is None  # PyTorch's int4 layout
    with torch.inference_mode():
        ids = torch.randint(4, 256, (1, 7))
        ref = model.logits(model(ids))
        got = q.logits(q(ids))
    assert not q.fused
    assert float((got - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_a_failed_build_is_remembered_and_said_in_one_line(tmp_path, monkeypatch, capsys):
    """A build that fails (e.g. headers that need another C++ standard) leaves a record under
    its key: later starts do not build again and say why the kernels are off and what that
    costs; `rebuild` forgets the record. PyTorch picks the C++ standard (no -std of ours)."""
    from torch.utils import cpp_extension

    assert not any(flag.startswith("-std") for flag in kernels.CFLAGS)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "build_dir", lambda key: tmp_path / key)
    calls = []

    def fails(**kw):
        calls.append(kw["name"])
        raise RuntimeError("Error building extension\nx.h:3: error: 'concept' needs C++20\n")

    monkeypatch.setattr(cpp_extension, "load", fails)
    assert kernels.load() is None
    err = capsys.readouterr().err
    assert "CPU kernels off: the build failed (x.h:3: error: 'concept' needs C++20)" in err
    assert kernels.SLOWER in err and len(calls) == 1
    [record] = tmp_path.glob("*/failed.json")
    monkeypatch.setattr(kernels, "_state", {})  # a later start
    assert kernels.load() is None and len(calls) == 1  # not built again
    assert "the build failed before" in capsys.readouterr().err
    status = kernels.status()
    assert status["on"] is False and "C++20" in status["why"] and status["cost"] == kernels.SLOWER
    assert kernels.rebuild(verbose=False) is None and len(calls) == 2  # tried again


def test_forced_instruction_set(monkeypatch):
    monkeypatch.setenv("CLOVER_KERNEL_ISA", "portable")
    assert kernels.isa() == 0
    monkeypatch.setenv("CLOVER_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="CLOVER_KERNEL_ISA"):
        kernels.isa()


def test_a_build_killed_midway_does_not_block_later_loads(tmp_path):
    """PyTorch's build lock is a plain file; a build killed midway leaves it behind. Under our
    OS lock (freed when its holder dies) the next load removes it instead of waiting forever."""
    (tmp_path / "lock").write_text("")
    with kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_each_checkout_builds_in_its_own_directory(tmp_path):
    """Two copies of the same sources (a worktree, a clean clone) get different build
    directories: sharing one, each load rebuilt the other's objects (ninja reads the paths)."""
    from pathlib import Path

    from clover import kernels

    here = Path(kernels.__file__).parent
    copy = tmp_path / "kernels"
    shutil.copytree(here, copy)
    assert kernels._key(here, "g++") == kernels._key(here, "g++")
    before = kernels._key(copy, "g++")
    assert before != kernels._key(here, "g++")
    (copy / kernels.SOURCES[0]).write_text("// changed\n")
    assert kernels._key(copy, "g++") != before  # and the sources themselves, as before
