"""The Clover hybrid architecture: Gated DeltaNet + gated full attention, MoE feed-forward,
block-bidirectional linear layers, at any scale (`PRESETS`: the published 35B-A3B shape and a
tiny one for tests).

`layer_types` (data, in the config) says per layer whether its mixer is `linear_attention`
(Gated DeltaNet, `gdn.py`, a conv + recurrent state cache) or `full_attention` (gated GQA with
QK-norm and partial RoPE, a KV cache). Every layer's feed-forward is the MoE of `moe.py`.
All norms are zero-centred RMSNorm. The context (prompt + generation) is enforced by the cache.

Training mode runs the same commit/preview steps the decoder runs (per row, block by block),
so a noisy block sees in training exactly what it sees at inference; it is simple rather than
fast, and the place to optimise once the trainer uses this architecture.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from clover.errors import CloverError
from clover.models.base import ConfigMixin, DiffusionLM
from clover.models.cache import KVCache, LayerCache, kv_dtype
from clover.models.gdn import GatedDeltaNet
from clover.models.layers import ZeroRMSNorm, attend, rope_cos_sin, rope_inv_freq
from clover.models.layout import StepLayout
from clover.models.moe import MoE, sanitize_experts, unstack_experts
from clover.quant import project

# ours, and the published family it loads (Qwen3-Next; Qwen3.5/3.6 MoE, text part)
MODEL_TYPES = ("clover_hybrid", "qwen3_next", "qwen3_5_moe_text")
MULTIMODAL_TYPES = ("qwen3_5_moe",)  # config.json nests the text model in `text_config`
ARCHITECTURE_NAMES = {
    "clover_hybrid": "CloverHybridForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class CloverConfig(ConfigMixin):
    # Published for the 35B-A3B model (see shared/REFERENCE.md): layers, hidden, vocab, heads,
    # head dims, experts, top-k, shared width, context. Inferred from the Qwen3-Next-style
    # 35B-A3B family where unpublished: rope_theta, rms_norm_eps, conv kernel for all of
    # q/k/v, untied embeddings, router softmax before top-k with renormalisation.
    vocab_size: int = 248_320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: list[str] | None = None  # default: every 4th layer full attention
    full_attention_interval: int = 4
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0  # inferred
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6  # inferred
    max_position_embeddings: int = 131_072  # prompt + generation
    tie_word_embeddings: bool = False  # inferred
    model_type: str = "clover_hybrid"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    mask_token_id: int | None = None
    shifted: bool = True
    default_decoder: str = "low_confidence"
    block_size: int = 32
    draft: str = "mask"  # where self_spec drafts come from (checked when loaded:
    # decoding.policies.check_model_defaults; the model layer knows no decoder names)
    block_coreset: int = 0  # experts per block during previews; 0 = per-token routing
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            k = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % k == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise CloverError(
                f"config: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise CloverError(f"config: unknown layer type(s) {bad}; use {LAYER_TYPES}")
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "max_position_embeddings", "block_size",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise CloverError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CloverError("config: num_attention_heads must be a multiple of KV heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise CloverError("config: linear value heads must be a multiple of key heads")
        if self.num_experts_per_tok > self.num_experts:
            raise CloverError("config: num_experts_per_tok exceeds num_experts")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CloverError(f"config: partial_rotary_factor gives rotary dim {self.rotary_dim}")
        for name in ("bos_token_id", "pad_token_id", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise CloverError(f"config: {name}={value} outside the vocabulary")
        if self.model_type not in MODEL_TYPES:
            raise CloverError(f"CloverConfig with model_type {self.model_type!r}")
        # what the published family may set and this architecture does not run
        if self.extra.get("mlp_only_layers"):
            raise CloverError("config: dense layers (mlp_only_layers) are not supported")
        if self.extra.get("decoder_sparse_step", 1) != 1:
            raise CloverError("config: decoder_sparse_step must be 1 (every layer MoE)")
        if self.extra.get("attn_output_gate", True) is not True:
            raise CloverError("config: attention without its output gate is not supported")

    @classmethod
    def family_defaults(cls, d: dict) -> dict:
        # Qwen3.5/3.6 always renormalise the top-k router weights
        return {"norm_topk_prob": True} if d.get("model_type") == "qwen3_5_moe_text" else {}

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {**d.pop("extra"), **d, "architectures": [ARCHITECTURE_NAMES[self.model_type]]}

    # --- parameter counts (no weights needed) ------------------------------------------------

    def _counts(self) -> dict[str, int]:
        D = self.hidden_size
        nq = self.linear_num_key_heads * self.linear_key_head_dim
        nv = self.linear_num_value_heads * self.linear_value_head_dim
        conv_c = 2 * nq + nv
        hv, K = self.linear_num_value_heads, self.linear_conv_kernel_dim
        gdn = D * (2 * nq + 2 * nv) + 2 * D * hv + conv_c * K + 2 * hv
        gdn += self.linear_value_head_dim + nv * D + conv_c * (K - 1) + 2 * hv
        hq, hkv, dh = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = D * hq * dh * 2 + 2 * D * hkv * dh + hq * dh * D + 2 * dh
        expert = 3 * D * self.moe_intermediate_size
        shared = 3 * D * self.shared_expert_intermediate_size + D
        n_gdn = self.layer_types.count("linear_attention")
        n_attn = self.num_hidden_layers - n_gdn
        L = self.num_hidden_layers
        emb = self.vocab_size * D
        return {
            "embedding": emb,
            "lm_head": 0 if self.tie_word_embeddings else emb,
            "mixers": n_gdn * gdn + n_attn * attn,
            "experts": L * self.num_experts * expert,
            "active_experts": L * self.num_experts_per_tok * expert,
            "dense_ffn": L * (shared + D * self.num_experts),
            "norms": L * 2 * D + D,
        }

    @property
    def num_params(self) -> int:
        c = self._counts()
        return sum(v for k, v in c.items() if k != "active_experts")

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: everything but the experts it is not routed to
        and the input embedding table (a row lookup, not a matmul; a tied table still counts
        once, as the LM head)."""
        c = self._counts()
        head = c["lm_head"] or c["embedding"]
        return head + c["mixers"] + c["active_experts"] + c["dense_ffn"] + c["norms"]


class GatedAttention(nn.Module):
    """GQA with per-head QK-norm, partial RoPE and a sigmoid output gate from the q projection."""

    packed_projections = (("q_proj", "k_proj", "v_proj"),)  # run through `project` (clover.quant)

    def __init__(self, c: CloverConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, 2 * self.hq * self.dh, bias=False)  # query + gate
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.dh, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.dh, bias=False)
        self.o_proj = nn.Linear(self.hq * self.dh, c.hidden_size, bias=False)
        self.q_norm = ZeroRMSNorm(self.dh, c.rms_norm_eps)
        self.k_norm = ZeroRMSNorm(self.dh, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple, layout: StepLayout, cache: KVCache | None
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        B, T, _ = x.shape
        qg, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = qg.reshape(B, T, self.hq, 2 * self.dh).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [B, Hq, T, Dh]
        k = self.k_norm(k.reshape(B, T, self.hkv, self.dh)).transpose(1, 2)
        v = v.reshape(B, T, self.hkv, self.dh).transpose(1, 2)
        out = attend(q, k, v, layout, cache, rope).transpose(1, 2)  # [B, T, Hq, Dh]
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(B, T, -1))


class HybridLayer(nn.Module):
    def __init__(self, c: CloverConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = ZeroRMSNorm(c.hidden_size, c.rms_norm_eps)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                c.hidden_size,
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                c.linear_conv_kernel_dim,
                c.rms_norm_eps,
            )
        else:
            self.self_attn = GatedAttention(c)
        self.post_attention_layernorm = ZeroRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MoE(
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
            c.norm_topk_prob,
        )

    def forward(self, x, rope, layout, cache, groups, coreset):  # noqa: ANN001, ANN201
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.linear_attn(h, layout, cache)
        else:
            h = self.self_attn(h, rope, layout, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), groups, coreset)


class Backbone(nn.Module):
    def __init__(self, c: CloverConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(c, t) for t in c.layer_types)
        self.norm = ZeroRMSNorm(c.hidden_size, c.rms_norm_eps)


class CloverModel(DiffusionLM):
    def __init__(self, config: CloverConfig) -> None:
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
        c = self.config
        dtype = kv_dtype(self)
        caches: list[LayerCache] = []
        for layer in self.model.layers:
            if layer.kind == "linear_attention":
                caches.append(layer.linear_attn.make_cache(batch_size))
            else:
                caches.append(KVCache(batch_size, c.num_key_value_heads, c.head_dim, dtype))
        return caches

    def backbone(
        self, input_ids: torch.Tensor, layout: StepLayout, caches: list[LayerCache] | None
    ) -> torch.Tensor:
        if layout.train is not None:
            return self._train_forward(input_ids, layout)
        x = self.model.embed_tokens(input_ids)
        rope = rope_cos_sin(layout.positions, self.inv_freq.to(input_ids.device))
        coreset = self.config.block_coreset
        groups = None
        if coreset:  # block tokens of row b form group b; committed tokens route per token
            t = torch.arange(input_ids.shape[1])[None, :]
            nc, nb = layout.n_commit[:, None], layout.n_block[:, None]
            in_block = (t >= nc) & (t < nc + nb)
            groups = torch.where(in_block, torch.arange(len(nc))[:, None], -1)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, layout, None if caches is None else caches[i], groups, coreset)
            layout.keep(i, x)
        return self.model.norm(x)

    def _train_forward(self, input_ids: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """[clean | noisy] training layout, computed as the decoder's own commit/preview steps."""
        prompt_lens, clean_len, answer_len, B = layout.train
        out = []
        for b in range(input_ids.shape[0]):
            p = int(prompt_lens[b])
            clean, noisy = input_ids[b, :clean_len], input_ids[b, clean_len:]
            cache = self.make_cache(1)
            clean_h, noisy_h = [], []
            start, seg = 0, p
            for j in range(0, answer_len, B):
                ids = torch.cat([clean[start:seg], noisy[j : j + B]])[None]
                h = self(ids, cache, "block", n_commit=seg - start)[0]
                clean_h.append(h[: seg - start])
                noisy_h.append(h[seg - start :])
                start, seg = seg, min(seg + B, clean_len)
            if start < clean_len:  # the rest of the clean part (last block, padding)
                clean_h.append(self(clean[start:][None], cache, "causal")[0])
            out.append(torch.cat(clean_h + noisy_h))
        return torch.stack(out)


# --- checkpoint names -------------------------------------------------------------------------
#
# Ours are the module names above; a checkpoint may use transformers' Qwen3-Next or Qwen3.5/3.6
# names, which `sanitize` maps (and `to_checkpoint` writes back, in the Qwen3.5 layout plus our
# block-diffusion tensors): one format. Per GDN layer (`linear_attn.`), theirs -> ours:
#   Next: in_proj_qkvz [per key head g: q_g | k_g | v_g (r heads) | z_g (r heads)] -> q/k/v/z_proj,
#         in_proj_ba [per key head g: b_g (r) | a_g (r)] -> b_proj, a_proj
#   3.5:  in_proj_qkv [q_all | k_all | v_all] -> q/k/v_proj; in_proj_z/_b/_a -> z/b/a_proj
#   both: conv1d.weight [C, 1, K] -> conv_weight [C, K]; norm.weight -> norm_weight;
#         out_proj -> o_proj
# MoE names: `moe.sanitize_experts`. Block-diffusion tensors absent from a checkpoint (an AR
# parent) start at their zero init, which makes the layer exactly that parent.
_GDN_RENAMES = {
    "conv1d.weight": "conv_weight",
    "norm.weight": "norm_weight",
    "out_proj.weight": "o_proj.weight",
    "in_proj_z.weight": "z_proj.weight",
    "in_proj_b.weight": "b_proj.weight",
    "in_proj_a.weight": "a_proj.weight",
}
BLOCK_DIFFUSION = ("right_conv", "block_mix", "history_bias")  # ours, zero in an AR parent
SKIPPED = ("mtp.", "model.visual.")  # multi-token prediction head, vision tower


def _split_gdn(name: str, t: torch.Tensor, c: CloverConfig) -> dict[str, torch.Tensor]:
    """One of transformers' fused GDN projections -> our separate ones (prefix kept)."""
    prefix, proj = name.rsplit(".linear_attn.", 1)
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // hk
    at = f"{prefix}.linear_attn."
    D = t.shape[-1]
    if proj == "in_proj_qkvz.weight":
        g = t.reshape(hk, 2 * dk + 2 * r * dv, D)
        q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
        parts = {"q_proj": q, "k_proj": k, "v_proj": v, "z_proj": z}
    elif proj == "in_proj_ba.weight":
        b, a = t.reshape(hk, 2 * r, D).split([r, r], dim=1)
        parts = {"b_proj": b, "a_proj": a}
    else:  # in_proj_qkv: [q_all | k_all | v_all]
        q, k, v = t.split([hk * dk, hk * dk, c.linear_num_value_heads * dv])
        parts = {"q_proj": q, "k_proj": k, "v_proj": v}
    return {f"{at}{n}.weight": w.reshape(-1, D).contiguous() for n, w in parts.items()}


def sanitize(weights: dict[str, torch.Tensor], config: CloverConfig) -> dict[str, torch.Tensor]:
    """Ours, Qwen3-Next's or Qwen3.5/3.6's names (`model.language_model.` prefix, `mtp.*` and
    `model.visual.*` skipped with a notice) -> ours."""
    out: dict[str, torch.Tensor] = {}
    skipped = 0
    for name, t in weights.items():
        if name.startswith(SKIPPED):
            skipped += 1
            continue
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        if ".linear_attn." in name:
            prefix, proj = name.rsplit(".linear_attn.", 1)
            if proj in ("in_proj_qkvz.weight", "in_proj_ba.weight", "in_proj_qkv.weight"):
                out.update(_split_gdn(name, t, config))
                continue
            if proj == "conv1d.weight" and t.dim() == 3:
                t = t[:, 0]
            name = f"{prefix}.linear_attn.{_GDN_RENAMES.get(proj, proj)}"
        out[name] = t
    if skipped:
        note = f"note: skipped {skipped} tensor(s) of the multi-token-prediction head and "
        print(note + "vision tower (mtp.*, model.visual.*): Clover runs the language model",
              file=sys.stderr)  # fmt: skip
    out = sanitize_experts(out, config.num_experts)
    for i, kind in enumerate(config.layer_types):  # an AR parent: our extras at zero
        if kind != "linear_attention":
            continue
        at = f"model.layers.{i}.linear_attn."
        conv = out.get(f"{at}conv_weight")
        if conv is None:
            continue
        for extra in BLOCK_DIFFUSION:
            if f"{at}{extra}" not in out:
                width = config.linear_num_value_heads
                shape = (conv.shape[0], conv.shape[1] - 1) if extra == "right_conv" else (width,)
                out[f"{at}{extra}"] = torch.zeros(shape, dtype=conv.dtype)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def to_checkpoint(state: dict[str, torch.Tensor], config: CloverConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> the Qwen3.5/3.6 text layout (split GDN projections, fused experts),
    plus our block-diffusion tensors under their own names: what `sanitize` reads back and
    what transformers' `qwen3_5_moe_text` loads (ignoring ours)."""
    back = {ours: theirs for theirs, ours in _GDN_RENAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".linear_attn." not in name:
            out[name] = t
            continue
        prefix, proj = name.rsplit(".linear_attn.", 1)
        at = f"{prefix}.linear_attn."
        if proj in ("k_proj.weight", "v_proj.weight"):
            continue  # written with q_proj
        if proj == "q_proj.weight":
            qkv = [state[f"{at}{p}_proj.weight"] for p in "qkv"]
            out[f"{at}in_proj_qkv.weight"] = torch.cat(qkv)
        elif proj == "conv_weight":
            out[f"{at}conv1d.weight"] = t[:, None, :]
        else:
            out[f"{at}{back.get(proj, proj)}"] = t
    return unstack_experts(out, fused=True)


PRESETS: dict[str, dict] = {
    "clover-35b-a3b": {},  # the dataclass defaults are the published shape
    "clover-tiny": dict(
        vocab_size=49_152,  # the default model's tokenizer, so `clover generate` can run it
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        mask_token_id=0,
        block_size=8,
    ),
}


def preset_config(name: str, **overrides: object) -> CloverConfig:
    if name not in PRESETS:
        raise CloverError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return CloverConfig(**{**PRESETS[name], **overrides})


Config = CloverConfig
Model = CloverModel
