"""The llama family (SmolLM2, Llama 2/3, Qwen2, Fast-dLLM v2): RMSNorm, RoPE, GQA, SwiGLU.

Module names mirror the Hugging Face checkpoint names, so an HF state dict needs no renaming;
`sanitize` drops what we compute ourselves and `GGUF_NAMES` / `config_from_gguf` translate a
llama.cpp file. Block diffusion needs no extra weights here: the layout (see `layout.py`)
decides who attends to whom, and `mask_token_id` / `shifted` say how the block is decoded.
Fast-dLLM v2 (`Fast_dLLM_Qwen`) is Qwen2 with block-diffusion conventions (`FAMILY_DEFAULTS`):
token-shifted, blocks of `bd_size` (32), its added `|<MASK>|` token.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from clover import kernels
from clover.errors import CloverError
from clover.kernels.qgemm import fused_part as packed
from clover.models.base import ConfigMixin, DiffusionLM
from clover.models.cache import KVCache, LayerCache, kv_dtype
from clover.models.layers import (
    RMSNorm,
    SwiGLU,
    attend_packed,
    rope_cos_sin,
    rope_inv_freq,
)
from clover.models.layout import StepLayout
from clover.quant import project_cat

MODEL_TYPES = ("llama", "qwen2", "mistral", "Fast_dLLM_Qwen")
QKV_BIAS_TYPES = ("qwen2", "Fast_dLLM_Qwen")  # bias on q/k/v only


@dataclass
class LlamaConfig(ConfigMixin):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v/o (llama convention)
    qkv_bias: bool = False  # bias on q/k/v only (qwen2)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Block diffusion: the [MASK] id, the token-shift convention (position i predicted from the
    # output at i - 1, as in AR-adapted diffusion models) and the decoder a model is made for.
    mask_token_id: int | None = None
    shifted: bool = True
    default_decoder: str = "low_confidence"
    block_size: int = 32
    draft: str = "mask"  # where self_spec drafts come from (checked when loaded:
    # decoding.policies.check_model_defaults; the model layer knows no decoder names)
    mask_token: str | None = None  # the [MASK] token's text, when only the tokenizer has its id
    extra: dict = field(default_factory=dict, repr=False)  # unknown keys, kept for saving

    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    architectures: ClassVar[dict[str, str]] = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
        "Fast_dLLM_Qwen": "Fast_dLLM_QwenForCausalLM",
    }

    @classmethod
    def family_defaults(cls, d: dict) -> dict:
        if d.get("model_type") == "Fast_dLLM_Qwen":  # NVlabs/Fast-dLLM v2: block 32 (bd_size)
            return {"shifted": True, "block_size": d.get("bd_size", 32), "mask_token": "|<MASK>|"}
        return {}

    def __post_init__(self) -> None:
        if self.model_type not in self.model_types:
            raise CloverError(f"{type(self).__name__} with model_type {self.model_type!r}")
        if self.model_type in QKV_BIAS_TYPES:
            self.qkv_bias = True
        if self.extra.get("use_sliding_window"):
            raise CloverError(
                "config: sliding-window attention (use_sliding_window) is not supported"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "block_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise CloverError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CloverError(
                f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise CloverError(f"config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise CloverError(f"config: hidden_act {self.hidden_act!r} (only silu is supported)")
        for name in ("bos_token_id", "pad_token_id", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise CloverError(f"config: {name}={value} outside the vocabulary")
        if any(not 0 <= e < self.vocab_size for e in self.eos_token_ids):
            raise CloverError(f"config: eos_token_id {self.eos_token_id} outside the vocabulary")
        rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)  # validates scaling

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        arch = self.architectures.get(self.model_type, "LlamaForCausalLM")
        return {**extra, **d, "architectures": [arch]}

    @property
    def num_params(self) -> int:
        D, F_, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        hq = self.num_attention_heads * self.head_dim
        hkv = self.num_key_value_heads * self.head_dim
        per_layer = D * (hq + 2 * hkv) + hq * D + 3 * D * F_ + 2 * D
        if self.qkv_bias or self.attention_bias:
            per_layer += hq + 2 * hkv
        per_layer += D * self.attention_bias + (2 * F_ + D) * self.mlp_bias
        emb = self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + D


class Attention(nn.Module):
    packed_projections = (("q_proj", "k_proj", "v_proj"),)  # run through `project` (clover.quant)

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        qkv_bias = c.attention_bias or c.qkv_bias
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=c.attention_bias)

    def forward(
        self, x: torch.Tensor, rope: tuple, layout: StepLayout, cache: KVCache | None
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        qkv = project_cat(x, self.q_proj, self.k_proj, self.v_proj)
        return self.o_proj(attend_packed(qkv, self.n_heads, self.n_kv, layout, cache, rope))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, c.mlp_bias)

    def forward(
        self, x: torch.Tensor, rope: tuple, layout: StepLayout, cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layout, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: LlamaConfig, layer: type = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaModel(DiffusionLM):
    config_class = LlamaConfig
    layer_class: type = DecoderLayer  # a family with other layers (qwen3) gives its own

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, self.layer_class)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        # a plain float32 attribute, not a buffer: `.to(bfloat16)` must not round RoPE
        c = self.config
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    def make_layer_caches(self, batch_size: int) -> list[LayerCache]:
        c = self.config
        dtype = kv_dtype(self)
        return [
            KVCache(batch_size, c.num_key_value_heads, c.head_dim, dtype)
            for _ in range(c.num_hidden_layers)
        ]

    def backbone(
        self, input_ids: torch.Tensor, layout: StepLayout, caches: list[LayerCache] | None
    ) -> torch.Tensor:
        fused = self.fused_layers(layout, caches)
        if fused is not None:
            return self._fused_backbone(fused, input_ids, layout, caches)
        x = self.model.embed_tokens(input_ids)  # [B, T, D]
        rope = rope_cos_sin(layout.positions, self.inv_freq.to(input_ids.device))
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, layout, None if caches is None else caches[i])
            layout.keep(i, x)
        return self.model.norm(x)

    # --- the fused path: one C++ call a layer (clover/kernels/layer.cpp) -----------------------

    fused: list | bool | None = None  # FusedLayer per layer, False where they cannot run

    def fused_layers(self, layout: StepLayout, caches: list[LayerCache] | None) -> list | None:
        """The fused layers, when this pass can take them: int4 weights in Clover's kernels,
        inference over float32 KV caches, no draft adapter acting on block tokens (its deltas
        live in the modules). Built once, on first use."""
        if caches is None or layout.train is not None or torch.is_grad_enabled():
            return None
        adapter = getattr(self, "draft_adapter", None)
        if adapter is not None and adapter.tokens.index is not None:
            return None
        if self.fused is None:
            self.fused = build_fused_layers(self) or False
        if not self.fused or any(not isinstance(c, KVCache) or c.dtype != torch.float32
                                 for c in caches):  # fmt: skip
            return None
        return self.fused

    def _fused_backbone(
        self, fused: list, input_ids: torch.Tensor, layout: StepLayout, caches: list[LayerCache]
    ) -> torch.Tensor:
        """`backbone` through the fused layers: input_ids [B, T] -> hidden [B, T, D] bf16."""

        x = self.model.embed_tokens(input_ids).float()  # [B, T, D], the residual in float32
        cos, sin = rope_cos_sin(layout.positions, self.inv_freq)  # [B, 1, T, R]
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        lengths, n_commit, n_block = (t.contiguous() for t in layout.counts())
        sees = None if layout.sees is None else layout.sees.contiguous()  # a tree of drafts
        for i, (layer, cache) in enumerate(zip(fused, caches)):
            layer.forward(x, cache.k, cache.v, lengths, n_commit, n_block, cos, sin, sees)
            layout.keep(i, x)
        norm = self.model.norm
        return kernels.load().rms_norm_bf16(x, norm.weight, norm.eps)


def build_fused_layers(model: LlamaModel) -> list | None:
    """One kernels.FusedLayer per decoder layer, from the quantized modules (q/k/v and gate/up
    packed, or apart where their formats differ; Int4Linear or Int8Linear with a GGUF's 8-bit
    levels, in Clover's kernels); None where any piece is missing."""

    module = kernels.load()
    if module is None or model.device.type != "cpu":
        return None
    c = model.config

    def group(module: nn.Module, fused: str, names: tuple[str, ...]) -> list | None:
        """The packed matrix, or (when its parts differ in format, e.g. a Q6_K v beside Q4_K
        q and k) the parts apart, in order."""
        if hasattr(module, fused):
            one = packed(getattr(module, fused))
            return None if one is None else [one]
        parts = [packed(getattr(module, n)) for n in names]
        return None if any(p is None for p in parts) else parts

    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [
            group(attn, "fused_q_proj", ("q_proj", "k_proj", "v_proj")),
            packed(attn.o_proj),
            group(mlp, "fused_gate_proj", ("gate_proj", "up_proj")),
            packed(mlp.down_proj),
        ]
        if any(p is None for p in parts):
            return None
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(
            module.FusedLayer(
                ln1.weight.detach(),
                ln2.weight.detach(),
                *parts,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                ln1.eps,
                kernels.isa(getattr(model, "dots_x", None)),
            )  # fmt: skip
        )
    return layers


# --- checkpoint names -------------------------------------------------------------------------


def sanitize(weights: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF state dict -> our module names (identical but for what we compute or tie)."""
    out = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_name(name: str) -> str:
    """llama.cpp tensor name -> HF name (`blk.3.attn_q.weight` -> `model.layers.3...`)."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m:
        if m.group(2) not in GGUF_NAMES:
            raise CloverError(f"GGUF tensor {name!r} has no llama mapping")
        return f"model.layers.{m.group(1)}.{GGUF_NAMES[m.group(2)]}"
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    raise CloverError(f"GGUF tensor {name!r} has no llama mapping")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (interleaved rotary pairs -> rotate-half halves).

    w: [n_heads * head_dim, ...] as stored in GGUF -> the HF row order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(meta: dict) -> dict:
    """GGUF metadata (llama.* keys) -> an HF-style config dict."""
    arch = meta["general.architecture"]

    def get(key: str, default: object = None) -> object:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    d = {
        "model_type": "qwen2" if arch == "qwen2" else "llama",
        "vocab_size": int(get("vocab_size", 0) or meta.get("tokenizer.ggml.tokens.count", 0)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return d


def tensors_from_gguf(tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """Dequantized GGUF tensors (numpy, HF orientation [out, in]) -> HF names and row order."""
    out = {}
    for name, w in tensors.items():
        hf = gguf_name(name)
        if config["model_type"] == "llama":
            # llama.cpp permutes q/k rows for llama only (qwen2 files keep HF order)
            if ".q_proj." in hf:
                w = unpermute_qk(w, config["num_attention_heads"])
            elif ".k_proj." in hf:
                w = unpermute_qk(w, config["num_key_value_heads"])
        out[hf] = w
    if "lm_head.weight" not in out:
        config["tie_word_embeddings"] = True
    return out


# what `clover.models` looks up for every architecture module
Config = LlamaConfig
Model = LlamaModel
