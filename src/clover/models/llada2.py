"""LLaDA2.0 (`llada2_moe`, inclusionAI's LLaDA2.0 mini / flash): a block-diffusion MoE with
names and a router of its own; transformers has no class for it.

From its published config and code (facts in shared/CHECKPOINTS.md): plain RMSNorm; one fused
`attention.query_key_value` projection (rows q, then k, then v), RMSNorm per q and k head
(`query_layernorm` / `key_layernorm`), partial NeoX RoPE (`partial_rotary_factor` of the head),
output `attention.dense`; the first `first_k_dense_replace` layers have a dense SwiGLU, the rest
a MoE whose router is sigmoid scores, group-limited top-k chosen on scores + `expert_bias`
(the bias only chooses), the chosen scores renormalised and scaled by `routed_scaling_factor`,
plus ungated shared experts. Not token-shifted; blocks of 32 at threshold 0.95 (sglang's dllm
config), [MASK] id 156895.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from clover.errors import CloverError
from clover.models.base import ConfigMixin, DiffusionLM
from clover.models.cache import KVCache, LayerCache, kv_dtype
from clover.models.layers import RMSNorm, SwiGLU, attend_packed, rope_cos_sin, rope_inv_freq
from clover.models.layout import StepLayout
from clover.models.moe import MoE, sanitize_experts, unstack_experts

MODEL_TYPES = ("llada2_moe",)
MASK_ID = 156895  # LLaDA2.0's <|mask|> in its 157,184-token vocabulary


@dataclass
class LLaDA2Config(ConfigMixin):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int  # the dense layers' width
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_function: str = "sigmoid"
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    use_qk_norm: bool = True
    use_qkv_bias: bool = False
    use_bias: bool = False  # on the output projection
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    model_type: str = "llada2_moe"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    mask_token_id: int | None = None
    shifted: bool = False
    default_decoder: str = "low_confidence"
    block_size: int = 32
    draft: str = "mask"
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def family_defaults(cls, d: dict) -> dict:
        big = d.get("vocab_size", 0) > MASK_ID  # the published vocabulary (tests use tiny ones)
        return {"mask_token_id": MASK_ID} if big else {}

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise CloverError(f"LLaDA2Config with model_type {self.model_type!r}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "intermediate_size", "n_group", "topk_group",
                     "block_size"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise CloverError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CloverError("config: num_attention_heads must be a multiple of KV heads")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise CloverError("config: num_experts must split into n_group groups (topk_group <=)")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise CloverError(
                "config: num_experts_per_tok exceeds the experts of topk_group groups"
            )
        if self.score_function != "sigmoid":
            raise CloverError(f"config: score_function {self.score_function!r} (sigmoid only)")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CloverError(f"config: partial_rotary_factor gives rotary dim {self.rotary_dim}")
        for name in ("bos_token_id", "pad_token_id", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise CloverError(f"config: {name}={value} outside the vocabulary")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {**d.pop("extra"), **d, "architectures": ["LLaDA2MoeModelLM"]}

    def _counts(self) -> tuple[int, int]:
        """(total, active) parameters."""
        D, L = self.hidden_size, self.num_hidden_layers
        hq, hkv, dh = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = D * (hq + 2 * hkv) * dh + hq * dh * D + (2 * dh if self.use_qk_norm else 0)
        expert = 3 * D * self.moe_intermediate_size
        shared = self.num_shared_experts * expert
        n_dense = min(self.first_k_dense_replace, L)
        moe_layers = L - n_dense
        dense = n_dense * 3 * D * self.intermediate_size
        base = L * (attn + 2 * D) + D + dense + moe_layers * (shared + D * self.num_experts)
        head = self.vocab_size * D
        emb = 0 if self.tie_word_embeddings else head
        total = base + head + emb + moe_layers * self.num_experts * expert
        active = base + head + moe_layers * self.num_experts_per_tok * expert
        return total, active

    @property
    def num_params(self) -> int:
        return self._counts()[0]

    @property
    def active_params(self) -> int:
        return self._counts()[1]


class LLaDA2Attention(nn.Module):
    def __init__(self, c: LLaDA2Config) -> None:
        super().__init__()
        self.hq, self.hkv, self.dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        width = (self.hq + 2 * self.hkv) * self.dh
        self.query_key_value = nn.Linear(c.hidden_size, width, bias=c.use_qkv_bias)
        self.dense = nn.Linear(self.hq * self.dh, c.hidden_size, bias=c.use_bias)
        self.use_qk_norm = c.use_qk_norm
        if c.use_qk_norm:
            self.query_layernorm = RMSNorm(self.dh, c.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.dh, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple, layout: StepLayout, cache: KVCache | None
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        B, T, _ = x.shape
        qkv = self.query_key_value(x)
        if self.use_qk_norm:
            heads = qkv.view(B, T, self.hq + 2 * self.hkv, self.dh)
            q = self.query_layernorm(heads[:, :, : self.hq])
            k = self.key_layernorm(heads[:, :, self.hq : self.hq + self.hkv])
            qkv = torch.cat([q, k, heads[:, :, self.hq + self.hkv :]], 2).reshape(B, T, -1)
        return self.dense(attend_packed(qkv, self.hq, self.hkv, layout, cache, rope))


class GroupLimitedMoE(MoE):
    """`MoE`'s experts with LLaDA2's router and ungated shared experts."""

    def __init__(self, c: LLaDA2Config) -> None:
        D, width = c.hidden_size, c.moe_intermediate_size
        super().__init__(D, c.num_experts, c.num_experts_per_tok, width, 0, c.norm_topk_prob)
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.scaling = c.routed_scaling_factor
        self.expert_bias = nn.Parameter(torch.zeros(c.num_experts), requires_grad=False)
        self.shared_experts = (
            SwiGLU(D, width * c.num_shared_experts) if c.num_shared_experts else None
        )

    def route(
        self, x: torch.Tensor, block: torch.Tensor | None = None, coreset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k], expert ids [N, k]): sigmoid scores; groups ranked by
        the sum of their two best biased scores, the best `topk_group` kept; the top-k biased
        scores among those choose; their unbiased scores are the weights (renormalised,
        times `routed_scaling_factor`)."""
        scores = torch.sigmoid(self.router(x).float())  # [N, E]
        biased = scores + self.expert_bias.float()
        N, E = scores.shape
        grouped = biased.view(N, self.n_group, E // self.n_group)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
        allowed = keep[:, :, None].expand_as(grouped).reshape(N, E)
        ids = biased.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-20)
        return weights * self.scaling, ids

    def _shared(self, x: torch.Tensor) -> torch.Tensor | float:
        return 0.0 if self.shared_experts is None else self.shared_experts(x)

    def forward(
        self, x: torch.Tensor, block: torch.Tensor | None = None, coreset: int = 0
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        routed = super().forward(x, block, coreset)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(x).to(routed.dtype)


class LLaDA2Layer(nn.Module):
    def __init__(self, c: LLaDA2Config, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attention = LLaDA2Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if index < c.first_k_dense_replace:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        else:
            self.mlp = GroupLimitedMoE(c)

    def forward(
        self, x: torch.Tensor, rope: tuple, layout: StepLayout, cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), rope, layout, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: LLaDA2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LLaDA2Layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LLaDA2Model(DiffusionLM):
    def __init__(self, config: LLaDA2Config) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        c = self.config
        self.inv_freq = rope_inv_freq(c.rotary_dim, c.rope_theta, None)

    def make_layer_caches(self, batch_size: int) -> list[LayerCache]:
        c, dtype = self.config, kv_dtype(self)
        return [
            KVCache(batch_size, c.num_key_value_heads, c.head_dim, dtype)
            for _ in range(c.num_hidden_layers)
        ]

    def backbone(
        self, input_ids: torch.Tensor, layout: StepLayout, caches: list[LayerCache] | None
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [B, T, D]
        rope = rope_cos_sin(layout.positions, self.inv_freq.to(input_ids.device))
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, layout, None if caches is None else caches[i])
            layout.keep(i, x)
        return self.model.norm(x)


# --- checkpoint names: theirs <-> ours ------------------------------------------------------------

_RENAMES = {  # theirs -> ours (whole names or `.mlp.` suffixes)
    "model.word_embeddings.weight": "model.embed_tokens.weight",
    "gate.expert_bias": "expert_bias",
}


def sanitize(weights: dict[str, torch.Tensor], config: LLaDA2Config) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in weights.items():
        name = _RENAMES.get(name, name)
        prefix, sep, rest = name.partition(".mlp.")
        if sep and rest in _RENAMES:
            name = f"{prefix}.mlp.{_RENAMES[rest]}"
        out[name] = t
    out = sanitize_experts(out, config.num_experts)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def to_checkpoint(state: dict[str, torch.Tensor], config: LLaDA2Config) -> dict[str, torch.Tensor]:
    back = {ours: theirs for theirs, ours in _RENAMES.items()}
    out = {}
    for name, t in unstack_experts(state).items():
        name = back.get(name, name)
        prefix, sep, rest = name.partition(".mlp.")
        if sep and rest in back:
            name = f"{prefix}.mlp.{back[rest]}"
        out[name] = t
    return out


Config = LLaDA2Config
Model = LLaDA2Model
