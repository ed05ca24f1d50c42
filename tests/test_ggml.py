"""ggml block decoders (clover.checkpoints.ggml) against the gguf package's reference
dequantizer, and GGUF 4-bit levels carried into the int4 kernel without a second rounding."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from clover import kernels
from clover.checkpoints import ggml
from clover.checkpoints.gguf import GGUFQuant
from clover.checkpoints.hf_dir import model_from_state, read_config, read_hf_dir
from clover.checkpoints.loader import int4_later, load, mark_source_levels, prepare_checkpoint
from clover.checkpoints.registry import resolve
from clover.errors import CloverError
from clover.kernels.qgemm import QWeight
from clover.quant import Int4Linear, Int4Part, Int8Linear, quantize_model
from tests.conftest import tiny_model

QT = gguf.GGMLQuantizationType
SCALE_OFFSETS = {  # where each block keeps its fp16 scale(s): random bytes there could be NaN
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw ggml data [rows, bytes per row] of random levels with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    per, size = ggml.BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[kind]:
        d = rng.uniform(0.001, 0.05, raw.shape[0]).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(ggml.BLOCKS))
def test_decoders_match_the_reference_bit_for_bit(kind):
    rows, cols = 5, 2 * ggml.BLOCKS[kind][0]
    data = random_blocks(kind, rows, cols)
    levels = ggml.decode(data, kind, rows, cols)
    ref = dequantize(data, QT[kind]).reshape(rows, cols)
    assert np.array_equal(levels.dequantize(), ref)
    assert (levels.int4() is not None) == (kind in ggml.INT4_TYPES)


def test_float_types_and_bad_input():
    w = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    assert np.array_equal(ggml.decode(w.astype(np.float16), "F16", 3, 8), w.astype(np.float16))
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)
    want = dequantize(bf16.view(np.uint8), QT.BF16).reshape(3, 8)
    assert np.array_equal(ggml.decode(bf16, "BF16", 3, 8), want)
    with pytest.raises(CloverError, match="IQ2_XS is not supported"):
        ggml.decode(w, "IQ2_XS", 3, 8)
    with pytest.raises(CloverError, match="not whole blocks"):
        ggml.decode(random_blocks("Q4_K", 1, 256), "Q4_K", 2, 128)


def test_q4_k_sub_blocks_are_affine_4bit_groups_of_32():
    """Q4_K: eight sub-blocks of 32 values, each scale d * sc and offset -dmin * m."""
    data = random_blocks("Q4_K", 2, 512)
    q, scale, low = ggml.decode(data, "Q4_K", 2, 512).int4()
    assert q.shape == (2, 512) and scale.shape == low.shape == (2, 16)
    assert q.min() >= 0 and q.max() <= 15 and (low <= 0).all()  # low = -dmin * m, dmin > 0
    w = q.reshape(2, 16, 32) * scale[..., None] + low[..., None]
    assert np.array_equal(w.reshape(2, 512), dequantize(data, QT.Q4_K).reshape(2, 512))


# --- into the int4 kernel ---------------------------------------------------------------------

# a tiny llama whose every matrix row is a whole number of K-quant super-blocks (256 values)
TINY_K = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    eos_token_id=1,
    tie_word_embeddings=True,
)
LINEAR_TYPES = {  # per layer tensor: a mix like a Q4_K_M file's
    "attn_q": "Q4_K",
    "attn_k": "Q4_0",
    "attn_v": "Q6_K",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q5_0",
    "ffn_down": "Q8_0",
}


def write_quantized_gguf(path) -> dict[str, ggml.Levels]:
    """A GGUF of TINY_K with raw random blocks per LINEAR_TYPES; -> levels by HF name."""
    c = TINY_K
    hd = c["hidden_size"] // c["num_attention_heads"]
    shapes = {
        "attn_q": (c["hidden_size"], c["hidden_size"]),
        "attn_k": (c["num_key_value_heads"] * hd, c["hidden_size"]),
        "attn_v": (c["num_key_value_heads"] * hd, c["hidden_size"]),
        "attn_output": (c["hidden_size"], c["hidden_size"]),
        "ffn_gate": (c["intermediate_size"], c["hidden_size"]),
        "ffn_up": (c["intermediate_size"], c["hidden_size"]),
        "ffn_down": (c["hidden_size"], c["intermediate_size"]),
    }
    hf = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    w = gguf.GGUFWriter(str(path), "qwen2")  # qwen2: no q/k row permutation to undo here
    w.add_block_count(1)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(c["vocab_size"])
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((c["vocab_size"], c["hidden_size"])).astype(np.float32)
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output_norm.weight", np.ones(c["hidden_size"], np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(c["hidden_size"], np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(c["hidden_size"], np.float32))
    for name in ("attn_q", "attn_k", "attn_v"):
        bias = rng.standard_normal(shapes[name][0]).astype(np.float32) * 0.1
        w.add_tensor(f"blk.0.{name}.bias", bias)
    levels = {}
    for i, (name, kind) in enumerate(LINEAR_TYPES.items()):
        rows, cols = shapes[name]
        data = random_blocks(kind, rows, cols, seed=i)
        w.add_tensor(f"blk.0.{name}.weight", data, raw_dtype=QT[kind])
        levels[f"model.layers.0.{hf[name]}.weight"] = ggml.decode(data, kind, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return levels


def with_tokenizer(path):
    """A converted tokenizer carried beside the GGUF (the file has no vocabulary inside)."""
    from tests.test_tokenizer import CHATML, _byte_level_backend, _write_dir

    _write_dir(path.with_name(path.name + ".tokenizer"), _byte_level_backend(),
               {"eos_token": "<|im_end|>", "chat_template": CHATML})  # fmt: skip
    return path


def test_gguf_levels_reach_the_kernels_unrounded(tmp_path, monkeypatch):
    """The GGUF's own levels, not ones re-derived from the floats (by min/max, which differ
    wherever a group does not use both level 0 and 15), become the kernels': 4-bit types
    on the int4 kernel, wider ones as 8-bit levels in their own groups (Q6_K: 16, else 32);
    those weights are never read in bf16; q/k/v stay apart when v is 8-bit."""
    if kernels.load() is None:
        pytest.skip("Clover's kernels did not build here (no C++ compiler)")
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    path = with_tokenizer(tmp_path / "k.gguf")
    levels = write_quantized_gguf(path)
    directory = prepare_checkpoint(resolve(str(path)), progress=False)
    quant = GGUFQuant.read(directory)
    assert set(quant.scale) == set(levels)
    assert set(quant.low) == {k for k, v in levels.items() if v.low is not None}
    assert quant.types["model.layers.0.mlp.up_proj.weight"] == "Q5_0"

    config = read_config(directory)
    assert config["model_type"] == "qwen2"
    _, later = int4_later(directory, config)
    assert later == set(levels)
    config, state = read_hf_dir(directory, torch.bfloat16, later)
    assert all(state[k].is_meta for k in later) and not state["model.norm.weight"].is_meta
    model = model_from_state(config, state, "k.gguf", torch.bfloat16)
    assert mark_source_levels(model, quant, directory, later) == len(levels)
    for name, lv in levels.items():
        linear = model.get_submodule(name.removesuffix(".weight"))
        q, scale, _, bits = linear.levels()
        used = np.repeat(lv.scale != 0, lv.group, axis=1)  # a zero scale: any level is `low`
        assert np.array_equal(q.numpy()[used], lv.q[used]), name  # the file's own levels
        assert torch.equal(scale, torch.from_numpy(lv.scale))
        assert bits == linear.level_bits == (4 if lv.int4() is not None else 8)

    loaded = load(str(path), dtype="int4", progress=False)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Int4Linear)  # not packed: v is 8-bit
    assert isinstance(layer.mlp.gate_proj, Int4Linear)
    for name, kind in (
        ("self_attn.v_proj", "Q6_K"),
        ("mlp.up_proj", "Q5_0"),
        ("mlp.down_proj", "Q8_0"),
    ):
        proj = layer.get_submodule(name)
        lv = levels[f"model.layers.0.{name}.weight"]
        assert isinstance(proj, Int8Linear) and proj.weight.group == lv.group, kind
        assert proj.weight.bits == (5 if kind == "Q5_0" else 8), kind  # Q5_0: 5.5 bits a weight
        used = np.repeat(lv.scale != 0, lv.group, axis=1)
        assert np.array_equal(proj.weight.levels().numpy()[used], lv.q[used]), kind
        assert torch.equal(proj.weight.dequantized(), torch.from_numpy(lv.dequantize())), kind
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj"):
        proj = layer.get_submodule(name)
        lv = levels[f"model.layers.0.{name}.weight"]
        used = np.repeat(lv.scale != 0, 32, axis=1)
        assert np.array_equal(proj.weight.levels().numpy()[used], lv.q[used]), name
        assert torch.equal(proj.weight.dequantized(), torch.from_numpy(lv.dequantize())), name
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.isfinite(loaded.model.logits(loaded.model(ids))).all()

    # k-quant scales (d * sc, not float16 numbers) are kept compact for the integer dots:
    # int8 multiples of a base per 256 values, the same logits as the float32 scales
    compact = {"self_attn.q_proj": "Q4_K", "mlp.gate_proj": "Q4_K", "self_attn.v_proj": "Q6_K"}
    for name, proj in layer.named_modules():
        w = getattr(proj, "weight", None)
        if isinstance(w, QWeight):
            assert (w.mults is not None) == (name in compact), name
    with torch.inference_mode():
        cache = loaded.model.make_cache(1)
        steps = [loaded.model.logits(loaded.model(ids[:, :3], cache))]
        steps.append(loaded.model.logits(loaded.model(ids[:, 3:], cache)))
        for proj in layer.modules():
            if isinstance(getattr(proj, "weight", None), QWeight):
                proj.weight.mults = proj.weight.bases = None
        loaded.model.fused = None  # built again, from the float32 scales
        cache = loaded.model.make_cache(1)
        again = [loaded.model.logits(loaded.model(ids[:, :3], cache))]
        again.append(loaded.model.logits(loaded.model(ids[:, 3:], cache)))
    assert all(torch.equal(a, b) for a, b in zip(steps, again))


def test_wide_types_can_be_rounded_to_4_bits(tmp_path, monkeypatch):
    """load(wide="int4"): every matrix on the int4 kernel (smaller, faster, not exact for
    Q5/Q6/Q8 tensors); the 4-bit ones still keep the file's levels."""
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    path = with_tokenizer(tmp_path / "k.gguf")
    levels = write_quantized_gguf(path)
    loaded = load(str(path), dtype="int4", progress=False, wide="int4")
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Int4Part)  # q/k/v packed again
    assert isinstance(layer.mlp.down_proj, Int4Linear)
    if kernels.load() is not None:
        lv = levels["model.layers.0.mlp.gate_proj.weight"]
        w = layer.mlp.gate_proj.fused.weight.dequantized()[: lv.q.shape[0]]
        assert torch.equal(w, torch.from_numpy(lv.dequantize()))


def test_fused_parts_keep_each_parts_levels():
    """q/k/v packed as one matrix hold exactly the levels each had alone (levels are per row)."""
    model = tiny_model()
    attn = model.model.layers[0].self_attn
    n, k = attn.k_proj.weight.shape  # [16, 32]: one group of 32 per row
    scale = (torch.rand(n, 1) * 0.01 + 1e-3).half().float()
    low = (-torch.rand(n, 1) * 0.02).half().float()
    q_true = torch.randint(2, 14, (n, k), dtype=torch.int32)  # never 0 or 15: min/max differs
    attn.k_proj.weight.data = q_true * scale + low
    attn.k_proj.levels = lambda: (q_true, scale, low, 4)
    quantize_model(model, "int4")
    assert isinstance(attn.k_proj, Int4Part)
    fused, rows = attn.fused_q_proj, slice(attn.k_proj.start, attn.k_proj.stop)
    if fused.weight is not None:  # Clover's kernels: levels and scales kept as given
        assert torch.equal(fused.weight.levels()[rows], q_true)
        assert torch.equal(fused.weight.dequantized()[rows], q_true * scale + low)
    else:  # PyTorch's kernel rounds scale and zero to bf16
        got = attn.k_proj(torch.eye(k)).float().t()
        s16, z16 = scale.bfloat16().float(), (low + 8 * scale).bfloat16().float()
        assert (got - (q_true - 8) * s16 - z16).abs().max() < 1e-2 * got.abs().max()
