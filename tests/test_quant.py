import torch
import torch.nn.functional as F
from torch import nn

from clover.quant import Int4Linear, Int8Linear, quantize_int4, quantize_model
from tests.conftest import tiny_model


def reference_int4(w: torch.Tensor) -> torch.Tensor:
    """Plain dequantization of what Int4Linear stores: (q - 8) * scale + zero, bf16 scales."""
    q, scale, low = quantize_int4(w)
    zero = (low + 8 * scale).bfloat16().float()
    scale = scale.bfloat16().float()
    N, K = w.shape
    qg = q.reshape(N, K // 32, 32).float()
    return ((qg - 8) * scale[..., None] + zero[..., None]).reshape(N, K)


def test_int4_linear_matches_reference():
    torch.manual_seed(0)
    lin = nn.Linear(96, 48, bias=True)
    q = Int4Linear(lin)
    x = torch.randn(5, 3, 96)
    ref = F.linear(x.bfloat16().float(), reference_int4(lin.weight.detach()), lin.bias.detach())
    out = q(x).float()
    assert out.shape == (5, 3, 48)
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.02)


def test_int4_keeps_q4_1_levels():
    # weights already on a Q4_1 grid (per 32-group: q * d + m, both q = 0 and 15 present)
    torch.manual_seed(1)
    N, K = 8, 64
    q = torch.randint(0, 16, (N, K // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(N, K // 32, 1) * 0.1 + 0.01
    m = torch.randn(N, K // 32, 1) * 0.1
    w = (q * d + m).reshape(N, K)
    got, _, _ = quantize_int4(w)
    assert torch.equal(got.reshape(N, K // 32, 32), q.to(torch.int32))


def test_int8_head_matches_reference():
    torch.manual_seed(2)
    w = torch.randn(5000, 64)
    head = Int8Linear(w)
    x = torch.randn(3, 64)
    ref = x.bfloat16().float() @ head.dequantized_weight().t()
    torch.testing.assert_close(head(x).float(), ref, atol=0.05, rtol=0.02)
    assert (head.dequantized_weight() - w).abs().max() <= w.abs().max() / 127


def test_quantized_model_tracks_the_float_model():
    model = tiny_model(hidden_size=64, intermediate_size=128)
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        ref = model.logits(model(ids)).softmax(-1)
        quantize_model(model)
        assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
        got = model.logits(model(ids)).softmax(-1)
    assert (got - ref).abs().max() < 0.1


def test_int8_everywhere_bounds_the_logit_error_on_clover_tiny():
    import copy

    from clover.models.clover import CloverModel, preset_config

    torch.manual_seed(0)
    model = CloverModel(preset_config("clover-tiny", vocab_size=96)).eval()
    ids = torch.randint(3, 96, (2, 12))
    with torch.no_grad():
        ref = model.logits(model(ids))
        half = copy.deepcopy(model).to(torch.bfloat16)
        bf16 = half.logits(half(ids))
        q = quantize_model(copy.deepcopy(model), "int8")
        got = q.logits(q(ids))
    moe = q.model.layers[0].mlp
    assert moe.int8 is not None and not hasattr(moe, "gate_up")
    assert isinstance(q.model.layers[0].linear_attn.q_proj, Int8Linear)
    scale = ref.abs().max()
    # int8 runs bf16 activations: bound what the 8-bit weights add on top of bf16 (measured
    # ~0.3% of the logit range here) and the total against fp32 (bf16 alone: ~13% on this
    # random model, whose activations are far larger than a trained model's)
    assert (got - bf16).abs().max() / scale < 0.02
    assert (got - ref).abs().max() / scale < (bf16 - ref).abs().max() / scale + 0.02


def test_model_bytes_by_precision():
    from clover.models.clover import preset_config
    from clover.plan import model_bytes

    c = preset_config("clover-35b-a3b")
    assert model_bytes(c, "bfloat16") == 2 * c.num_params
    assert 0.49 < model_bytes(c, "int8") / model_bytes(c, "bfloat16") < 0.53


def test_packed_projections_match_separate_ones():
    """q/k/v and gate/up packed in one int4 matrix (`Int4Part`) give what separate int4
    linears give, with a draft adapter's deltas on block tokens too."""
    import copy

    from clover.models.adapter import AdapterConfig, attach_adapter
    from clover.quant import Int4Part

    model = tiny_model(hidden_size=64, intermediate_size=128)
    attach_adapter(model, AdapterConfig(rank=4, layers=[1]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_b" in n:
                p.normal_(0, 0.5)
    fused = quantize_model(copy.deepcopy(model))
    fused.fused = False  # both through the modules: this is about packing (the C++ layers'
    # float32 residual is tested against the modules in test_kernels.py)
    apart = quantize_model(copy.deepcopy(model), fuse=False)
    apart.fused = False  # the fused layers take separate parts too (the same reason)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[1].mlp
    assert isinstance(attn.k_proj, Int4Part) and attn.k_proj.fused is attn.fused_q_proj
    assert isinstance(mlp.up_proj.base, Int4Part)  # under the adapter's LoRALinear
    assert isinstance(apart.model.layers[0].self_attn.k_proj, Int4Linear)
    ids = torch.randint(4, 64, (2, 9))
    block = torch.tensor([[5, 6, 3, 3, 3]] * 2)
    with torch.inference_mode():
        for args, kw in (((ids,), {}), ((block,), {"mode": "block", "n_commit": 2})):
            torch.testing.assert_close(fused(*args, **kw), apart(*args, **kw), rtol=0, atol=1e-2)
        x = torch.randn(3, 64)
        torch.testing.assert_close(attn.k_proj(x), apart.model.layers[0].self_attn.k_proj(x))


def test_packed_projections_on_clover_tiny():
    """The hybrid architecture packs only what it runs through `project` (gated attention;
    not the GDN layer, which calls its projections one by one) and matches separate ones."""
    import copy

    from clover.models.clover import CloverModel, preset_config
    from clover.quant import Int4Part

    torch.manual_seed(0)
    model = CloverModel(preset_config("clover-tiny", vocab_size=96)).eval()
    fused = quantize_model(copy.deepcopy(model))
    apart = quantize_model(copy.deepcopy(model), fuse=False)
    owners = [m for m in fused.modules() if any(isinstance(c, Int4Part) for c in m.children())]
    assert owners and all(hasattr(m, "packed_projections") for m in owners)
    assert not any(isinstance(m, Int4Part) for m in apart.modules())
    ids = torch.randint(3, 96, (2, 12))
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids), apart(ids), rtol=0, atol=1e-2)


def test_int8_rows_in_chunks_matches_the_whole_table():
    """int8_rows quantizes row chunks (no float32 copy of a whole LM head); the reference is
    the one-shot formula on the whole matrix."""
    from clover.quant import int8_rows

    torch.manual_seed(0)
    w = (torch.randn(9000, 40) * torch.rand(9000, 1)).to(torch.bfloat16)
    q, scale = int8_rows(w)
    ref_scale = (w.float().abs().amax(-1) / 127).clamp(min=1e-10)
    ref_q = (w.float() / ref_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale.to(torch.bfloat16))


def test_int8_rows_of_a_parameter_keeps_no_autograd_graph():
    """The LM head is a Parameter that requires grad: its per-row scales must not become an
    autograd node holding the float32 chunks and the weight (seen: +1.1 GB after loading
    Qwen2.5-Coder-0.5B at int4)."""
    from clover.quant import int8_rows

    w = torch.nn.Parameter(torch.randn(9000, 64))
    q, scale = int8_rows(w)
    assert scale.grad_fn is None and not scale.requires_grad
    torch.testing.assert_close(q.float() * scale.float()[:, None], w.detach(), atol=0.05, rtol=0.02)
