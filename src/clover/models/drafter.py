"""A block-diffusion drafter on the target's features (the DFlash design, written from its
description): a few transformer layers that draft a block of tokens in one pass, for the
target to verify causally (`self_spec` with `draft="drafter"`).

- Context: the target's hidden states after layers `feature_layers` at every committed token,
  concatenated [k * D], projected (linear + RMSNorm) to the context vector c_t. Each drafter
  layer reads the context through its own key/value projections of c_t.
- Block: B positions [the last verified token, MASK x (B - 1)] at positions p .. p + B - 1,
  embedded with the target's table (frozen, not stored), [MASK] as the target's embedding of
  `mask_token_id`. Queries and keys get a per-head RMSNorm before RoPE. Queries come from the
  block; the block sees every context position before p and itself both ways. (Both as in the
  `speculators` DFlash layout, so an export loads there as it runs here.)
- Output: the target's LM head (frozen) on the final hidden state; block position i >= 1
  predicts the token at position p + i. A drafter may draft from a part of the vocabulary
  (`draft_vocab`: the head's rows for those ids only; trained on all of them by default).
- `chain: true` drafts one token at a time instead (the EAGLE way of conditioning, on the
  same context): block position i >= 1 reads the token at p + i - 1 (the verified token at
  i = 1, then the previous draft) where the block drafter reads [MASK], and the block is causal
  inside. Training feeds the answer's own tokens there (teacher forcing), so its leading
  acceptance is what chained drafting keeps; decoding runs one pass per drafted token
  (`chain_hidden`). Position 0 is kept (the verified token at p) so both kinds share a layout.

Decoding keeps the context K/V per drafter layer in a `ModelCache` of `KVCache`s: features of
newly committed tokens are projected once and appended (`commit`), each draft is one block pass
over it (`block_hidden`). Training runs many blocks of a sequence at once over the whole
context with an explicit mask (`train_hidden`); both paths share every weight and agree
(tests/test_drafter.py). Saved as one safetensors file with its config (target and its
fingerprint, feature layers, block size) in the metadata; loading onto another target is
refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from clover import kernels
from clover.errors import CloverError
from clover.files import atomic_write, read_header
from clover.kernels.qgemm import fused_part as packed
from clover.models.base import on_meta
from clover.models.cache import KVCache, ModelCache
from clover.models.layers import RMSNorm, SwiGLU, apply_rope, attend, rope_cos_sin, rope_inv_freq
from clover.models.layout import StepLayout, cached_layout

POSITIVE = (
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "block_size",
)


@dataclass
class DrafterConfig:
    target: str  # what the drafter was trained on (registry name or path), for messages
    target_fingerprint: str  # `fingerprint(target)`: loading onto another model is refused
    hidden_size: int
    vocab_size: int
    feature_layers: list[int]
    num_hidden_layers: int = 1  # drafter layers
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 1024
    block_size: int = 16
    mask_token_id: int = 0  # masked positions read the target's embedding of this token
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    # drafts come from these many token ids (the `draft_vocab` tensor of the file: what the
    # training answers used most, then the lowest ids); 0: the whole vocabulary. A smaller
    # head makes a drafter pass cheaper; the verify pass still reads the whole head
    draft_vocab: int = 0
    chain: bool = False  # draft token by token, each reading the one before (see above)
    info: dict = field(default_factory=dict)  # provenance: data, steps, measurements

    def __post_init__(self) -> None:
        for name in POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise CloverError(f"drafter config: {name} must be a positive integer")
        if self.block_size < 2:
            raise CloverError("drafter config: block_size must be >= 2 (a token + a draft)")
        if not self.feature_layers:
            raise CloverError("drafter config: feature_layers must name target layers")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise CloverError("drafter config: heads must divide evenly, head_dim be even")
        if not isinstance(self.draft_vocab, int) or not 0 <= self.draft_vocab < self.vocab_size:
            raise CloverError("drafter config: draft_vocab must be 0 (all) or under vocab_size")
        if not isinstance(self.chain, bool):
            raise CloverError(f"drafter config: chain must be true or false, not {self.chain!r}")


def fingerprint(model: nn.Module) -> str:
    """What identifies a target: its shape and the first rows of its embedding table (as
    bfloat16, so float32, bfloat16 and int4 loads of the same checkpoint agree)."""
    c = model.config
    h = hashlib.sha256()
    h.update(json.dumps([c.vocab_size, c.hidden_size, c.num_hidden_layers]).encode())
    with torch.no_grad():
        ids = torch.arange(min(256, c.vocab_size))
        rows = model.embed_rows(ids).detach().to(torch.bfloat16).cpu()
    h.update(rows.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def default_feature_layers(num_layers: int) -> list[int]:
    """Early, middle and late layers (DFlash reads several depths of the target)."""
    return sorted({max(1, num_layers // 10), num_layers // 2, max(0, num_layers - 2)})


class DrafterAttention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.nq, self.nkv, self.dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        D = c.hidden_size
        self.q_proj = nn.Linear(D, self.nq * self.dh, bias=False)
        self.k_proj = nn.Linear(D, self.nkv * self.dh, bias=False)
        self.v_proj = nn.Linear(D, self.nkv * self.dh, bias=False)
        self.o_proj = nn.Linear(self.nq * self.dh, D, bias=False)
        # per-head RMSNorm of q and k before RoPE (Qwen3's), as the published DFlash layer has
        self.q_norm = RMSNorm(self.dh, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.dh, c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int,
               norm: nn.Module | None = None) -> torch.Tensor:  # fmt: skip
        B, T, _ = x.shape
        h = proj(x).view(B, T, n, self.dh)
        return (h if norm is None else norm(h)).transpose(1, 2)  # [B, n, T, Dh]

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self._heads(h, self.q_proj, self.nq, self.q_norm),
                self._heads(h, self.k_proj, self.nkv, self.k_norm),
                self._heads(h, self.v_proj, self.nkv))  # fmt: skip

    def context_kv(self, c: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """c [B, T, D] -> k, v [B, Hkv, T, Dh] (k rotated)."""
        k = apply_rope(self._heads(c, self.k_proj, self.nkv, self.k_norm), *rope)
        return k, self._heads(c, self.v_proj, self.nkv)

    def forward(
        self, h: torch.Tensor, rope: tuple, layout: StepLayout, cache: KVCache
    ) -> torch.Tensor:
        """h [B, T, D] block tokens over the context in `cache` -> [B, T, D]."""
        B, T, _ = h.shape
        q, k, v = self._qkv(h)
        out = attend(q, k, v, layout, cache, rope)  # block slots are scratch past the context
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def train_forward(self, h: torch.Tensor, kv_ctx: tuple, rope: tuple, mask: torch.Tensor,
                      queries: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """h [N, S, D] blocks; kv_ctx: context k, v [N, Hkv, L, Dh]; mask [N, 1, S, L + S];
        queries: the positions of h whose outputs are wanted (None: all of them), [N, Q, D]."""
        N, S, _ = h.shape
        x = h if queries is None else h[:, queries]
        q = self._heads(x, self.q_proj, self.nq, self.q_norm)
        k = self._heads(h, self.k_proj, self.nkv, self.k_norm)
        v = self._heads(h, self.v_proj, self.nkv)
        q_rope = rope if queries is None else tuple(r[:, :, queries] for r in rope)
        q, k = apply_rope(q, *q_rope), apply_rope(k, *rope)
        k, v = torch.cat([kv_ctx[0], k], 2), torch.cat([kv_ctx[1], v], 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask if queries is None else mask[:, :, queries],
            enable_gqa=self.nq != self.nkv,
        )  # fmt: skip
        return self.o_proj(out.transpose(1, 2).reshape(N, x.shape[1], -1))


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DrafterAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = c = config
        self.fc = nn.Linear(len(c.feature_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.fc_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, None)
        self.vocab: torch.Tensor | None = None  # the draft vocabulary's ids (`set_vocab`)

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft only from token ids `ids` (sorted, distinct, a multiple of 16 of them, for
        the kernel's tiles); None: from the whole vocabulary."""
        if ids is not None:
            ids = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
            V = self.config.vocab_size
            if (len(ids) % 16 or len(ids) >= V or int(ids.min()) < 0 or int(ids.max()) >= V
                    or not bool((ids[1:] > ids[:-1]).all())):  # fmt: skip
                raise CloverError(
                    f"a draft vocabulary is sorted distinct ids under {V}, a multiple of 16 of "
                    f"them and fewer than the vocabulary (got {len(ids)})"
                )
        self.vocab = ids
        self.config.draft_vocab = 0 if ids is None else len(ids)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, k * D] (the target's, float32) -> context vectors [B, T, D]."""
        return self.fc_norm(self.fc(features.to(self.norm.weight.dtype)))

    def block_inputs(self, first: torch.Tensor, embed: Callable, width: int,
                     before: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """first [B] (the last verified tokens) -> [B, width, D]: its embedding, then the
        target's embedding of the [MASK] token (frozen, as in the speculators format); a chain
        drafter's position i >= 1 reads before[:, i - 1] instead ([B, width - 1]: the token
        before the one it predicts)."""
        ids = torch.full((first.shape[0], width), self.config.mask_token_id, dtype=torch.long,
                         device=first.device)  # fmt: skip
        ids[:, 0] = first
        if self.config.chain:
            if before is None or before.shape[-1] < width - 1:
                raise CloverError("a chain drafter's block needs the token before each position")
            ids[:, 1:] = before[:, : width - 1]
        return embed(ids).to(self.norm.weight.dtype)

    # --- decoding: the context in a cache -------------------------------------------------------

    def make_cache(self, batch: int) -> ModelCache:
        c = self.config  # float32 K/V: PyTorch's CPU attention is slow in bfloat16 (cache.py)
        layers = [KVCache(batch, c.num_key_value_heads, c.head_dim, torch.float32)
                  for _ in self.layers]  # fmt: skip
        return ModelCache(layers, batch, c.max_position_embeddings)

    def commit(self, features: torch.Tensor, counts: torch.Tensor, cache: ModelCache) -> None:
        """Append the first counts[b] of features [B, T, k * D] to row b's context."""
        T = features.shape[1]
        cache.prepare(T, counts)
        layout = cached_layout(counts, torch.zeros_like(counts), cache.lengths, T)
        rope = rope_cos_sin(layout.positions, self.inv_freq.to(layout.positions.device))
        c = self.context(features)
        for layer, lc in zip(self.layers, cache.layers):
            lc.write(*layer.self_attn.context_kv(c, rope), layout)
        cache.advance(counts)

    def block_hidden(self, first: torch.Tensor, embed: Callable, cache: ModelCache,
                     width: int | None = None) -> torch.Tensor:  # fmt: skip
        """One draft pass: first [B] -> final hidden [B, width, D] (position i >= 1 predicts
        the token i places after `first`); nothing is committed."""
        width = width or self.config.block_size
        if self.config.chain:
            raise CloverError("a chain drafter drafts token by token (chain_hidden)")
        cache.prepare(width)
        zeros = torch.zeros(first.shape[0], dtype=torch.long)
        layout = cached_layout(zeros, torch.full_like(zeros, width), cache.lengths, width)
        return self._cached_pass(self.block_inputs(first, embed, width), layout, cache)

    def chain_hidden(self, ids: torch.Tensor, offset: int, embed: Callable,
                     cache: ModelCache) -> torch.Tensor:  # fmt: skip
        """A chain drafter's pass over block positions offset .. offset + T - 1 holding ids
        [B, T] (position 0: the verified token; i >= 1: the token before the one it predicts)
        -> final hidden [B, T, D]. Causal: each position sees the context and the block
        positions before it, which earlier passes of the same draft wrote past the context
        (scratch slots: nothing is committed). A draft of k tokens is one pass over positions
        0 and 1, then one per further token."""
        T = ids.shape[1]
        cache.prepare(offset + T)
        lengths = cache.lengths + offset
        n = torch.full_like(lengths, T)  # "committed" tokens: causal queries (nothing advances)
        layout = cached_layout(n, torch.zeros_like(n), lengths, T)
        return self._cached_pass(embed(ids).to(self.norm.weight.dtype), layout, cache)

    def _cached_pass(self, h: torch.Tensor, layout: StepLayout, cache: ModelCache) -> torch.Tensor:
        """h [B, T, D] block inputs -> final hidden [B, T, D]: every layer over the context in
        `cache` under `layout` (its slots past the context are scratch), then the norm. With
        int4 weights in Clover's kernels the layers run fused (`fused_layers`; a tree pass's
        visibility as `layout.sees`)."""
        rope = rope_cos_sin(layout.positions, self.inv_freq.to(layout.positions.device))
        fused = self.fused_layers(cache)
        if fused is not None:
            x = h.float().contiguous()  # the residual in float32, as the target's fused layers
            cos, sin = rope[0][:, 0].contiguous(), rope[1][:, 0].contiguous()
            lengths, n_commit, n_block = (t.contiguous() for t in layout.counts())
            sees = None if layout.sees is None else layout.sees.contiguous()
            for layer, lc in zip(fused, cache.layers):
                layer.forward(x, lc.k, lc.v, lengths, n_commit, n_block, cos, sin, sees)
            return self.norm(x.to(self.norm.weight.dtype))
        for layer, lc in zip(self.layers, cache.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), rope, layout, lc)
            h = layer.mlp_residual(h)
        return self.norm(h)

    def fused_layers(self, cache: ModelCache) -> list | None:
        """One kernels.FusedLayer per layer (its q/k norms included) when every projection is
        int4 in Clover's kernels and the cache is float32 K/V, at inference; made once per
        kernel path. Through the modules, a drafter pass of one or two tokens is mostly
        PyTorch's per-op overhead (~20 ops a layer)."""

        if torch.is_grad_enabled() or kernels.load() is None:
            return None
        if self.norm.weight.device.type != "cpu":
            return None
        if any(not isinstance(c, KVCache) or c.dtype != torch.float32 for c in cache.layers):
            return None
        isa = kernels.isa(getattr(self, "dots_x", None))
        made = self.__dict__.setdefault("_fused", {})
        if isa in made:
            return made[isa]
        module = kernels.load()
        c, layers = self.config, []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = [packed(a.q_proj), packed(a.k_proj), packed(a.v_proj)]
            gate_up = [packed(m.gate_proj), packed(m.up_proj)]
            o, down = packed(a.o_proj), packed(m.down_proj)
            if any(p is None for p in [*qkv, *gate_up, o, down]):
                made[isa] = None
                return None
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            fused = module.FusedLayer(ln1.weight.detach(), ln2.weight.detach(), qkv, o, gate_up,
                                      down, c.num_attention_heads, c.num_key_value_heads,
                                      c.head_dim, ln1.eps, isa)  # fmt: skip
            fused.set_qk_norm(a.q_norm.weight.detach(), a.k_norm.weight.detach(), a.q_norm.eps)
            layers.append(fused)
        made[isa] = layers
        return layers

    # --- training: many blocks of a sequence at once ------------------------------------------

    def train_hidden(self, features: torch.Tensor, n_context: torch.Tensor, first: torch.Tensor,
                     starts: torch.Tensor, embed: Callable, width: int | None = None,
                     before: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """features [N, L, k * D] of N sequences (n_context[n] of them real); blocks: starts
        [N, S] (block s begins at position starts[n, s] with token first[n, s]) -> hidden
        [N, S, width, D] of each block's first `width` positions (None: all B). Block s sees
        context positions < starts[n, s] and its own B positions (a chain drafter: those
        before each, and before [N, S, B - 1] holds the tokens its positions read); a narrower
        width computes the last layer's queries, output projection and MLP for those positions
        only (the same values: the block's other positions are still its keys and values)."""
        N, L, _ = features.shape
        S, B = starts.shape[1], self.config.block_size
        c = self.context(features)
        ctx_pos = torch.arange(L)[None].expand(N, L)
        rope_ctx = rope_cos_sin(ctx_pos, self.inv_freq.to(ctx_pos.device))
        offs = torch.arange(B)
        pos = (starts[..., None] + offs).reshape(N, S * B)  # [N, S*B]
        rope = rope_cos_sin(pos, self.inv_freq.to(pos.device))
        key_ctx = (
            torch.arange(L)[None, None, :]
            < torch.minimum(starts.repeat_interleave(B, 1), n_context[:, None])[..., None]
        )  # [N, S*B, L]
        blk = torch.arange(S * B) // B
        key_blk = blk[:, None] == blk[None, :]  # [S*B, S*B]
        if self.config.chain:  # causal inside the block
            key_blk = key_blk & (torch.arange(S * B)[:, None] >= torch.arange(S * B)[None, :])
        key_blk = key_blk[None].expand(N, -1, -1)  # [N, S*B, S*B]
        mask = torch.cat([key_ctx, key_blk], -1)[:, None]  # [N, 1, S*B, L + S*B]
        prev = None if before is None else before.reshape(N * S, -1)
        h = self.block_inputs(first.reshape(-1), embed, B, prev).reshape(N, S * B, -1)
        width = B if width is None else min(width, B)
        wanted = None if width == B else (torch.arange(S * B) % B < width).nonzero()[:, 0]
        for i, layer in enumerate(self.layers):
            queries = wanted if i == len(self.layers) - 1 else None
            kv = layer.self_attn.context_kv(c, rope_ctx)
            x = h if queries is None else h[:, queries]
            h = x + layer.self_attn.train_forward(layer.input_layernorm(h), kv, rope, mask, queries)
            h = layer.mlp_residual(h)
        return self.norm(h).reshape(N, S, width, -1)


def new_drafter(target: nn.Module, target_name: str, **overrides: object) -> Drafter:
    """A drafter shaped after `target` (its width, heads, vocabulary), randomly initialised,
    reading the target's embedding of its mask token at masked positions."""
    t = target.config
    d = {
        "target": target_name,
        "target_fingerprint": fingerprint(target),
        "hidden_size": t.hidden_size,
        "vocab_size": t.vocab_size,
        "feature_layers": default_feature_layers(t.num_hidden_layers),
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "intermediate_size": t.intermediate_size,
        "mask_token_id": t.mask_token_id if t.mask_token_id is not None else 0,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings,
    }
    d.update(overrides)
    return Drafter(DrafterConfig(**d))


def linear_weight(module: nn.Module, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [N, K], b [N]) of any linear module, quantized or packed: its outputs for the rows
    of the identity, less its output for zeros (the bias)."""
    with torch.no_grad():
        eye = torch.eye(in_features)
        zero = module(torch.zeros(1, in_features)).float()
        return (module(eye).float() - zero).t().contiguous(), zero[0]


def init_from_target(drafter: Drafter, target: nn.Module, features: torch.Tensor) -> list[int]:
    """Start the drafter's layers as copies of the target's last layers, so its outputs begin
    in the space the target's final norm and LM head read (a random drafter must first learn
    that, which costs most of a CPU-sized training run).

    - Drafter layer j copies target layer N - n + j (norms, attention, MLP); q/k/v biases (qwen2)
      are dropped: the format has none.
    - fc passes the deepest feature layer through unchanged, and fc_norm takes the first copied
      layer's input norm: the context keys/values then start as that layer's own, when the
      deepest feature is the output of the layer before it (the default: N - 2).
    - The per-head q/k norms (which the target lacks) get the mean RMS of its q and k heads on
      `features` [.., k * D] (the target's, a batch of real text), so attention starts at the
      target's temperature.
    Returns the target layer ids copied."""
    c, t = drafter.config, target.config
    layers = target.model.layers
    n = len(drafter.layers)
    ids = list(range(len(layers) - n, len(layers)))
    for i in ids:
        attn = getattr(layers[i], "self_attn", None)
        if attn is None or not hasattr(attn, "q_proj") or not hasattr(layers[i], "mlp"):
            raise CloverError(
                f"init from target: layer {i} of {c.target!r} is not an attention layer with "
                "an MLP (start the drafter from random weights)"
            )
    same = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size) == (t.hidden_size, t.num_attention_heads,
            t.num_key_value_heads, t.head_dim, t.intermediate_size)  # fmt: skip
    if not same:
        raise CloverError("init from target: the drafter's width, heads and MLP must be the "
                          "target's (leave them at their defaults)")  # fmt: skip
    D = c.hidden_size
    deepest = max(range(len(c.feature_layers)), key=lambda k: c.feature_layers[k])
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, deepest * D : (deepest + 1) * D] = torch.eye(D)
        drafter.fc_norm.weight.copy_(layers[ids[0]].input_layernorm.weight.float())
        drafter.norm.weight.copy_(target.model.norm.weight.float())
        qdim = c.num_attention_heads * c.head_dim
        linears = (
            ("self_attn", "q_proj", D),
            ("self_attn", "k_proj", D),
            ("self_attn", "v_proj", D),
            ("self_attn", "o_proj", qdim),
            ("mlp", "gate_proj", D),
            ("mlp", "up_proj", D),
            ("mlp", "down_proj", c.intermediate_size),
        )  # (module, linear, in_features)
        for dst, i in zip(drafter.layers, ids):
            src = layers[i]
            dst.input_layernorm.weight.copy_(src.input_layernorm.weight.float())
            dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())
            for part, name, width in linears:
                weight = linear_weight(getattr(getattr(src, part), name), width)[0]
                getattr(getattr(dst, part), name).weight.copy_(weight)
        rows = features.reshape(-1, features.shape[-1]).float()
        ctx = drafter.context(rows[rows.abs().sum(-1) > 0][:4096])  # padding rows left out
        for dst in drafter.layers:
            a = dst.self_attn
            for proj, norm, heads in ((a.q_proj, a.q_norm, a.nq), (a.k_proj, a.k_norm, a.nkv)):
                x = proj(ctx).view(-1, heads, a.dh)
                norm.weight.fill_(float(x.pow(2).mean(-1).sqrt().mean()))
    return ids


# --- files ----------------------------------------------------------------------------------


def save_drafter(drafter: Drafter, path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """One safetensors file, the config in its metadata; written atomically."""

    path = Path(path)
    state = {n: t.detach().to(dtype).contiguous().cpu() for n, t in drafter.state_dict().items()}
    if drafter.vocab is not None:
        state["draft_vocab"] = drafter.vocab.to(torch.int64).contiguous()
    meta = {"format": "pt", "clover_drafter": json.dumps(asdict(drafter.config))}
    return atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata=meta))


def read_drafter_config(path: Path) -> DrafterConfig:

    path = Path(path)
    try:
        d = json.loads(read_header(path)["__metadata__"]["clover_drafter"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CloverError(f"{path} is not a Clover drafter file: {e}") from None
    return DrafterConfig(**d)


def drafter_vocabulary(path: Path) -> torch.Tensor | None:
    """The token ids the drafter file `path` drafts from (None: every id), read alone."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("draft_vocab") if "draft_vocab" in f.keys() else None


def load_drafter(
    path: Path,
    target: nn.Module | None = None,
    dtype: torch.dtype = torch.float32,
    linear_dtype: torch.dtype | None = None,
) -> Drafter:
    """The drafter in `path`; with `target`, refused unless it was trained on that model.
    linear_dtype: its linears' weights in this dtype instead (the file's, for a caller that
    quantizes them next: no float32 copy is made)."""

    config = read_drafter_config(path)
    if target is not None and fingerprint(target) != config.target_fingerprint:
        raise CloverError(
            f"{path}: this drafter was trained on {config.target!r} (fingerprint "
            f"{config.target_fingerprint}), not on the model loaded here ({fingerprint(target)})"
        )
    with on_meta():  # every tensor comes from the file: no initializer to run
        drafter = Drafter(config)
    state = load_file(str(path))
    vocab = state.pop("draft_vocab", None)
    if (0 if vocab is None else len(vocab)) != config.draft_vocab:
        raise CloverError(f"{path}: its config says a draft vocabulary of {config.draft_vocab} "
                          f"ids, the file holds {0 if vocab is None else len(vocab)}")  # fmt: skip
    missing, extra = set(drafter.state_dict()) - set(state), set(state) - set(drafter.state_dict())
    if "mask_embedding" in extra:
        raise CloverError(f"{path}: a drafter of an earlier Clover (a learned [MASK] vector, no "
                          "q/k norms), which this one cannot run: train it again")  # fmt: skip
    if missing or extra:
        raise CloverError(f"{path}: drafter file lacks {sorted(missing)[:3]}, has extra "
                          f"{sorted(extra)[:3]}")  # fmt: skip
    linears = {f"{n}.weight" for n, m in drafter.named_modules() if isinstance(m, nn.Linear)}
    drafter.load_state_dict({k: v.to(linear_dtype if k in linears and linear_dtype else dtype)
                             for k, v in state.items()}, assign=True)  # fmt: skip
    drafter.set_vocab(vocab)
    return drafter.eval()


# --- the speculators format (vLLM's drafter checkpoints) and llama.cpp's DFlash drafts -------

SPECULATORS_VERSION = "0.9.0"  # the format version written (the package's release we follow)
# `aux_hidden_state_layer_ids` name the layer whose *input* is read, as llama.cpp's converter
# reads that schema (it takes id - 1 as the layer whose output is read): our feature layer i
# (its output) is written as i + 1, the input of the layer after it
INPUT_OF_NEXT = 1


def layer_config(c: DrafterConfig) -> dict:
    """The drafter's layers as the keys of an HF decoder config (both formats share them)."""
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def speculators_config(drafter: Drafter, verifier_architectures: list[str]) -> dict:
    """config.json of a `speculators` DFlash checkpoint for this drafter: the drafter's
    layers as a llama decoder-layer config, the target's feature layers as
    `aux_hidden_state_layer_ids` (the layers whose input is read: `INPUT_OF_NEXT`), greedy
    proposals of block_size - 1 tokens."""
    c = drafter.config
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "block_size": c.block_size,
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": c.hidden_size,
        "aux_hidden_state_layer_ids": [i + INPUT_OF_NEXT for i in c.feature_layers],
        "mask_token_id": c.mask_token_id,
        "tie_word_embeddings": False,
        "transformer_layer_config": {"model_type": "llama", **layer_config(c)},
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": c.target, "architectures": verifier_architectures},
        },
    }


def speculators_state(drafter: Drafter) -> dict[str, torch.Tensor]:
    """Our tensors under the format's names: `fc`, `hidden_norm` (after fc), `layers.N.*`
    (with q/k norms), `norm`; the target's embeddings and head are not stored: the format's
    loader takes the verifier's, [MASK] included, as our drafter does."""
    out = {}
    for name, t in drafter.state_dict().items():
        out[name.replace("fc_norm.", "hidden_norm.")] = t
    return out


def dflash_config(drafter: Drafter) -> dict:
    """config.json that llama.cpp's converter (convert_hf_to_gguf.py) reads as a DFlash draft.
    Its `target_layer_ids` name the layers whose output is read, as our feature layers do (the
    converter writes id + 1 to the GGUF, the input of the next layer, which its runtime reads).
    With a draft vocabulary it is a DSpark name: only that class takes `lm_head` + `d2t` (the
    head's rows and their ids); its block is DFlash's ([token, MASK...], drafts read from
    positions >= 1: `sample_from_anchor` false) and, with no Markov head, it runs as one."""
    c = drafter.config
    keys = {
        "target_layer_ids": list(c.feature_layers),
        "mask_token_id": c.mask_token_id,
        "block_size": c.block_size,
    }
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **layer_config(c),
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "dflash_config": keys,
    }
    if c.draft_vocab:  # the DSpark class reads these keys at the top level
        config.update(keys, architectures=["DSparkDraftModel"], draft_vocab_size=c.draft_vocab,
                      sample_from_anchor=False)  # fmt: skip
    return config


def dflash_state(drafter: Drafter, head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The tensors of `dflash_config`'s checkpoint: the speculators names, and with a draft
    vocabulary `lm_head.weight` = head [n_sub, D] (the target head's rows at its ids) and
    `d2t` [n_sub] int64 (each id less its row: the converter adds the row back)."""
    state = speculators_state(drafter)
    if drafter.vocab is not None:
        if head is None or head.shape != (len(drafter.vocab), drafter.config.hidden_size):
            raise CloverError("a draft vocabulary exports with the target head's rows at its ids")
        state["lm_head.weight"] = head
        state["d2t"] = drafter.vocab.to(torch.int64) - torch.arange(len(drafter.vocab))
    return state


def export_speculators(drafter_file: Path, out_dir: Path, verifier_architectures: list[str],
                       force: bool = False) -> Path:  # fmt: skip
    """Write `out_dir/config.json` + `model.safetensors` in the speculators format."""

    drafter = load_drafter(Path(drafter_file))
    if drafter.config.chain:  # refused before anything is written
        raise CloverError(
            f"{drafter_file}: a chain drafter (token by token) is not the DFlash layout the "
            "speculators format describes; only block drafters export"
        )
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise CloverError(f"{out_dir} is not empty (use --force to replace it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in speculators_state(drafter).items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = speculators_config(drafter, verifier_architectures)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
