"""Qwen3 and Qwen3-MoE: the llama family plus per-head RMSNorm on q and k before RoPE, and
(Qwen3-MoE) sparse expert feed-forwards without a shared expert.

The block-diffusion checkpoints published on these names run here with their own
conventions (`FAMILY_DEFAULTS`): SDAR / TraDo (`sdar`) and SDAR-MoE (`sdar_moe`) predict each
position from its own output (not token-shifted), decode blocks of 4, and take [MASK] from
the tokenizer (`<|MASK|>`: their config.json has no mask id).

Checkpoint names are transformers' (`q_norm`, `k_norm`, `mlp.gate`, `mlp.experts.{e}.*` or
the fused `mlp.experts.gate_up_proj` / `down_proj`); `sanitize` maps experts onto `moe.MoE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from clover.errors import CloverError
from clover.models import llama
from clover.models.cache import KVCache
from clover.models.layers import RMSNorm, SwiGLU, attend_packed
from clover.models.layout import StepLayout
from clover.models.moe import MoE, sanitize_experts, unstack_experts
from clover.quant import project_cat

MODEL_TYPES = ("qwen3", "qwen3_moe", "sdar", "sdar_moe")
MOE_TYPES = ("qwen3_moe", "sdar_moe")
# JetAstra/SDAR: not shifted, block 4, [MASK] from the tokenizer (sglang's dllm config agrees)
SDAR = {"shifted": False, "block_size": 4, "mask_token": "<|MASK|>"}


@dataclass
class Qwen3Config(llama.LlamaConfig):
    model_type: str = "qwen3"
    num_experts: int = 0  # > 0: a MoE model (qwen3_moe)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    architectures: ClassVar[dict[str, str]] = {
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "sdar": "SDARForCausalLM",
        "sdar_moe": "SDARMoeForCausalLM",
    }

    @classmethod
    def family_defaults(cls, d: dict) -> dict:
        return dict(SDAR) if d.get("model_type") in ("sdar", "sdar_moe") else {}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type in MOE_TYPES:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, name) <= 0:
                    raise CloverError(f"config: {self.model_type} needs {name} > 0")
            if self.num_experts_per_tok > self.num_experts:
                raise CloverError("config: num_experts_per_tok exceeds num_experts")
            if self.decoder_sparse_step < 1:
                raise CloverError("config: decoder_sparse_step must be >= 1")
        else:
            self.num_experts = 0

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule: sparse unless listed in mlp_only_layers, every
        decoder_sparse_step-th layer."""
        if not self.num_experts or i in self.mlp_only_layers:
            return False
        return (i + 1) % self.decoder_sparse_step == 0

    def _moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def num_params(self) -> int:
        D, L = self.hidden_size, self.num_hidden_layers
        n_moe = self._moe_layers()
        dense = super().num_params + L * 2 * self.head_dim  # + q_norm, k_norm
        dense -= n_moe * 3 * D * self.intermediate_size  # MoE layers have no dense MLP
        expert = 3 * D * self.moe_intermediate_size
        return dense + n_moe * (self.num_experts * expert + D * self.num_experts)

    @property
    def active_params(self) -> int:
        """What one token computes with: the top-k experts, not the input embedding lookup."""
        expert = 3 * self.hidden_size * self.moe_intermediate_size
        idle = self._moe_layers() * (self.num_experts - self.num_experts_per_tok) * expert
        emb = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_params - idle - emb


class Qwen3Attention(llama.Attention):
    """llama's attention with RMSNorm over each q and k head (before RoPE)."""

    def __init__(self, c: Qwen3Config) -> None:
        super().__init__(c)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple, layout: StepLayout, cache: KVCache | None
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        B, T, _ = x.shape
        nq, nkv = self.n_heads, self.n_kv
        heads = project_cat(x, self.q_proj, self.k_proj, self.v_proj).view(B, T, nq + 2 * nkv, -1)
        q = self.q_norm(heads[:, :, :nq])
        k = self.k_norm(heads[:, :, nq : nq + nkv])
        qkv = torch.cat([q, k, heads[:, :, nq + nkv :].to(q.dtype)], 2).reshape(B, T, -1)
        return self.o_proj(attend_packed(qkv, nq, nkv, layout, cache, rope))


class Qwen3Layer(llama.DecoderLayer):
    def __init__(self, c: Qwen3Config, index: int = 0) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Qwen3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.is_moe_layer(index):
            self.mlp = MoE(
                c.hidden_size,
                c.num_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size,
                0,  # no shared expert
                c.norm_topk_prob,
            )
        else:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, c.mlp_bias)


class Qwen3Model(llama.LlamaModel):
    config_class = Qwen3Config
    layer_class = Qwen3Layer

    def fused_layers(self, layout: StepLayout, caches: list | None) -> None:
        return None  # the fused C++ layer has no q/k norm (nor experts)


def sanitize(weights: dict[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """transformers' names -> ours: experts onto `moe.MoE`; what we compute or tie dropped."""
    out = llama.sanitize(weights, config)
    return sanitize_experts(out, config.num_experts) if config.num_experts else out


def to_checkpoint(state: dict[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """Our state dict -> transformers' file names (per-expert tensors, `mlp.gate`)."""
    return unstack_experts(state) if config.num_experts else state


Config = Qwen3Config
Model = Qwen3Model
