"""Tiny GGUF files for tests: a llama/qwen2 model of random blocks, each tensor of the ggml type
asked for, with a byte-level tokenizer carried beside it (the file has no vocabulary inside)."""

from pathlib import Path

import gguf
import numpy as np

from clover.checkpoints import ggml

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
# a tiny llama whose every matrix row is a whole number of K-quant super-blocks (256 values)
TINY = dict(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
LINEARS = {  # GGUF name -> HF module name, per layer
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# how large a level times its block's sub-scales typically is, per type: a block's fp16 scale
# of ~0.05 / this makes weights of ~0.05, as a trained model's (`random_blocks(small=True)`)
TYPICAL = {"Q4_0": 4, "Q4_1": 8, "Q5_0": 8, "Q5_1": 16, "Q8_0": 64, "Q4_K": 256, "Q5_K": 512,
           "Q6_K": 1024}  # fmt: skip


def random_blocks(
    kind: str, rows: int, cols: int, seed: int = 0, small: bool = False
) -> np.ndarray:
    """Raw ggml data [rows, bytes per row] of random levels with sane fp16 scales (small:
    scaled so that the weights are ~0.05, where a forward pass's numbers stay moderate)."""
    rng = np.random.default_rng(seed)
    per, size = ggml.BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    lo, hi = (0.025, 0.075) if small else (0.001, 0.05)
    top = TYPICAL[kind] if small else 1
    for off in SCALE_OFFSETS[kind]:
        d = (rng.uniform(lo, hi, raw.shape[0]) / top).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _tensor(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    if kind in ggml.BLOCKS:
        return random_blocks(kind, rows, cols, seed, small=True)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return w.astype({"F32": np.float32, "F16": np.float16}[kind])


def write_gguf(
    path: Path,
    types: dict[str, str],
    *,
    arch: str = "qwen2",
    embedding: str = "F32",
    head: str | None = None,
    config: dict | None = None,
    tokenizer: bool = True,
) -> dict[str, ggml.Levels | np.ndarray]:
    """A GGUF of `config` (TINY) whose linears have ggml types `types` (GGUF names, e.g.
    {"attn_q": "Q4_K", ...}; others F32), the embedding `embedding`, an untied LM head of
    type `head` (None: tied). -> what each tensor holds by HF name: its decoded levels for a
    quantized type, its float32 values for a float one."""
    c = dict(TINY, **(config or {}))
    D, F, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = D // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    shapes = {"attn_q": (D, D), "attn_k": (kv, D), "attn_v": (kv, D), "attn_output": (D, D),
              "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}  # fmt: skip
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(c["vocab_size"])
    w.add_eos_token_id(1)
    held: dict[str, ggml.Levels | np.ndarray] = {}
    rng = np.random.default_rng(1)
    seed = 10

    def add(gname: str, hf: str, kind: str, rows: int, cols: int) -> None:
        nonlocal seed
        data = _tensor(kind, rows, cols, seed)
        seed += 1
        w.add_tensor(gname, data, raw_dtype=QT[kind])
        held[hf] = ggml.decode(data, kind, rows, cols)

    add("token_embd.weight", "model.embed_tokens.weight", embedding, c["vocab_size"], D)
    if head is not None:
        add("output.weight", "lm_head.weight", head, c["vocab_size"], D)
    norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    w.add_tensor("output_norm.weight", norm)
    held["model.norm.weight"] = norm
    for i in range(L):
        for name in ("attn_norm", "ffn_norm"):
            v = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
            w.add_tensor(f"blk.{i}.{name}.weight", v)
            hf = "input_layernorm" if name == "attn_norm" else "post_attention_layernorm"
            held[f"model.layers.{i}.{hf}.weight"] = v
        if arch == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                bias = (rng.standard_normal(shapes[name][0]) * 0.1).astype(np.float32)
                w.add_tensor(f"blk.{i}.{name}.bias", bias)
                held[f"model.layers.{i}.{LINEARS[name]}.bias"] = bias
        for name, (rows, cols) in shapes.items():
            hf = f"model.layers.{i}.{LINEARS[name]}.weight"
            add(f"blk.{i}.{name}.weight", hf, types.get(name, "F32"), rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if tokenizer:
        with_tokenizer(path)
    return held


def with_tokenizer(path: Path) -> Path:
    """A converted tokenizer carried beside the GGUF (the file has no vocabulary inside)."""
    from tests.test_tokenizer import CHATML, _byte_level_backend, _write_dir

    _write_dir(path.with_name(path.name + ".tokenizer"), _byte_level_backend(),
               {"eos_token": "<|im_end|>", "chat_template": CHATML})  # fmt: skip
    return path


def dequantized(held: ggml.Levels | np.ndarray) -> np.ndarray:
    return held.dequantize() if isinstance(held, ggml.Levels) else np.asarray(held, np.float32)
