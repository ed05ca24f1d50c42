"""Bytes of a model's weights at each precision (`model_bytes`, from shapes alone) and memory
per GPU for a deployment: weights (experts sharded, the rest replicated) plus the
cache for one full-context sequence, for 1/2/4/8 GPUs at bfloat16 and int8.

Expert parallelism splits the routed experts across GPUs (`MoE.shard`); attention, GDN, the
shared experts, embeddings and the LM head are replicated. The cache per sequence is the K/V
of every full-attention layer over the whole context (bf16) plus the fixed-size GDN state.
Activations, the CUDA context and allocator slack are not included: keep ~10% headroom.
"""

from __future__ import annotations

from torch import nn

from clover.models import build_model
from clover.models.base import ConfigMixin
from clover.quant import GROUP

GPUS = (1, 2, 4, 8)


def _expert_params(config: ConfigMixin) -> int:
    experts = getattr(config, "num_experts", 0)
    width = getattr(config, "moe_intermediate_size", 0)
    return config.num_hidden_layers * experts * 3 * config.hidden_size * width


def cache_bytes(config: ConfigMixin, tokens: int | None = None) -> int:
    """K/V (bf16) of attention layers + GDN state (fp32) for one sequence of `tokens`."""
    tokens = tokens or config.max_position_embeddings
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    n_attn = types.count("full_attention")
    kv = n_attn * 2 * config.num_key_value_heads * config.head_dim * tokens * 2
    n_gdn = types.count("linear_attention")
    if not n_gdn:
        return kv
    hv, dk = config.linear_num_value_heads, config.linear_key_head_dim
    dv, kern = config.linear_value_head_dim, config.linear_conv_kernel_dim
    channels = 2 * config.linear_num_key_heads * dk + hv * dv
    return kv + n_gdn * (hv * dk * dv * 4 + channels * (kern - 1) * 4)


def deployment_plan(config: ConfigMixin) -> list[dict]:
    rows = []
    cache = cache_bytes(config)
    for dtype, per_weight in (("bfloat16", 2.0), ("int8", None)):
        total = model_bytes(config, dtype)
        experts = _expert_params(config)
        # int8 experts: 1 byte per weight + a bf16 scale per row (rows = params / hidden-ish)
        expert_bytes = experts * per_weight if per_weight else experts * 1.0
        shared = total - expert_bytes
        for n in GPUS:
            weights = shared + expert_bytes / n
            rows.append(
                {
                    "dtype": dtype,
                    "gpus": n,
                    "weights_gb": round(weights / 1e9, 2),
                    "cache_gb_full_context": round(cache / 1e9, 2),
                    "total_gb": round((weights + cache) / 1e9, 2),
                }
            )
    return rows


def format_plan(rows: list[dict]) -> str:
    lines = ["", "memory per GPU (weights + one full-context sequence's cache; + ~10% headroom)"]
    lines.append(f"{'dtype':<9} {'GPUs':>4} {'weights GB':>11} {'cache GB':>9} {'total GB':>9}")
    for r in rows:
        lines.append(
            f"{r['dtype']:<9} {r['gpus']:>4} {r['weights_gb']:>11} "
            f"{r['cache_gb_full_context']:>9} {r['total_gb']:>9}"
        )
    return "\n".join(lines)


def model_bytes(config: ConfigMixin, dtype: str) -> int:
    """Bytes of the weights at a precision, from shapes alone (the model is built on meta)."""
    model = build_model(config, meta=True)
    per = {"float32": 4, "bfloat16": 2}
    total = 0
    quantizable = set()
    for module in model.modules():
        for child in module.children():
            if isinstance(child, nn.Linear):
                quantizable.add(id(child.weight))
        for name in ("gate_up", "down"):
            if isinstance(getattr(module, name, None), nn.Parameter) and hasattr(module, "router"):
                quantizable.add(id(getattr(module, name)))
    head = model.head_weight()
    for p in model.parameters():
        n = p.numel()
        if dtype in per:
            total += per[dtype] * n
        elif id(p) == id(head) or (dtype == "int8" and id(p) in quantizable):
            total += n + 2 * (n // p.shape[-1])  # int8 + a bf16 scale per row
            if id(p) == id(head) and not hasattr(model, "lm_head"):
                total += 2 * n  # a tied table is also kept in bf16 for the lookup
        elif dtype == "int4" and id(p) in quantizable and p.dim() == 2:
            n_out, n_in = p.shape
            if n_in % GROUP == 0 and n_out % 16 == 0:
                total += n // 2 + 4 * (n // GROUP)  # packed nibbles + bf16 scale and zero
            else:
                total += 2 * n
        else:
            total += 2 * n
    return total
