"""What every architecture shares: the forward modes, the cache contract, the LM head call.

An architecture subclasses `DiffusionLM` and implements `make_layer_caches` and `backbone`.
The model maps token ids (+ cache) to hidden states; `logits()` is a separate call so callers
project only the positions they need (the LM head is a large share of a small model's step).
It does no sampling, no noising and no cache policy.

Modes of `forward`:
- "causal": every input token is committed causally onto the prefix (prefill, AR steps,
  committing a finished block).
- "block": the first `n_commit` tokens (default 0) are committed causally, the rest form the
  current block, which attends to itself bidirectionally and to the prefix, and is not kept.
- "train": a whole-sequence `StepLayout` from `training_layout`, no cache.
Without a cache, "causal"/"block" run on a fresh one (the uncached reference).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import fields
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from clover.errors import CloverError
from clover.models.cache import LayerCache, ModelCache
from clover.models.layout import StepLayout, cached_layout

Mode = Literal["causal", "block", "train"]


class ConfigMixin:
    """What every architecture's config dataclass shares: built from a checkpoint's
    config.json (unknown keys kept in `extra` for saving) and its EOS ids as a list."""

    @classmethod
    def family_defaults(cls, d: dict) -> dict:
        """Settings a published model type implies that its config.json does not say (e.g.
        a block-diffusion checkpoint's block size and token shift); the file's keys win."""
        return {}

    @classmethod
    def from_dict(cls, d: dict) -> object:
        d = {**cls.family_defaults(d), **d}
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known and k != "architectures"}
        return cls(**kwargs, extra=extra)

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)


class DiffusionLM(nn.Module):
    """Architectures keep their embedding table at `model.embed_tokens` and, when untied,
    their output projection at `lm_head`."""

    config: object  # the architecture's config dataclass
    kv_cache_dtype: torch.dtype | None = None  # None: `cache.kv_dtype`'s rule
    compiled_backbone = None  # set by `compile_causal`
    # drafting for another model (`--drafter MODEL`), its drafts come from its head's rows of
    # this many first ids and its end tokens (`decoding.draft_model`); 0: every id
    draft_vocab: int = 32768
    # and of these ids (None: none): its own shipped drafter's vocabulary, the tokens its
    # answers use most, some of them far past the first ids (the loader sets it)
    draft_ids: torch.Tensor | None = None
    # and its tensors stored wider than 4 bits, its head's rows there included: kept ("int8")
    # or rounded to 4 bits ("int4"; the loader sets it: a draft model's precision changes no
    # answer)
    draft_wide: str = "int8"

    def make_layer_caches(self, batch_size: int) -> list[LayerCache]:
        raise NotImplementedError

    def backbone(
        self, input_ids: torch.Tensor, layout: StepLayout, caches: list[LayerCache] | None
    ) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, D]."""
        raise NotImplementedError

    def reset_buffers(self) -> None:
        """Recompute state that checkpoints do not hold (called after loading)."""

    def fused_layers(self, layout: StepLayout, caches: list[LayerCache] | None) -> list | None:
        """Fused C++ layers (clover.kernels) this pass runs through, or None: the modules."""
        return None

    @property
    def embed_dtype(self) -> torch.dtype:
        """The dtype of the embedding's rows (a table read from a GGUF says its own)."""
        embed = self.model.embed_tokens
        return getattr(embed, "dtype", None) or embed.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the model's tensors are (its first parameter's device)."""
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding table: ids [...] -> [..., D], in `embed_dtype`."""
        return self.model.embed_tokens(ids.to(self.device))

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [V, D]: `lm_head`, or the embedding table when tied."""
        return self.lm_head.weight if hasattr(self, "lm_head") else self.model.embed_tokens.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., V]."""
        head = getattr(self, "quantized_head", None)  # set by clover.quant.quantize_model
        if head is not None:
            return head(hidden).float()
        return F.linear(hidden, self.head_weight()).float()

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    def make_cache(self, batch_size: int) -> ModelCache:
        return ModelCache(self.make_layer_caches(batch_size), batch_size, self.context_length)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: ModelCache | None = None,
        mode: Mode = "causal",
        *,
        n_commit: torch.Tensor | int | None = None,
        n_valid: torch.Tensor | int | None = None,
        layout: StepLayout | None = None,
        capture: tuple[int, ...] = (),
        tree: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> hidden [B, T, D].

        n_valid [B] (default T): tokens per row that are not padding. n_commit [B] (mode
        "block" only, default 0): leading tokens committed causally before the block.
        capture: layer ids whose outputs to return too (a drafter's features, cached modes):
        then -> (hidden, features float32 [B, T, len(capture) * D], in capture's order).
        tree [B, T] (mode "block"): each token's parent in the pass, when a row's committed
        tokens are a tree of drafts (`layout.cached_layout`); models with recurrent layers
        cannot verify trees (their state follows one sequence).
        """
        B, T = input_ids.shape
        if mode == "train":
            if layout is None or cache is not None:
                raise CloverError("mode 'train' takes a training layout and no cache")
            return self._run(input_ids, layout, None)
        if mode not in ("causal", "block"):
            raise CloverError(f"unknown forward mode {mode!r}: causal, block or train")
        if cache is None:
            cache = self.make_cache(B)
        if cache.batch_size != B:
            raise CloverError(f"cache holds {cache.batch_size} rows, input has {B}")
        valid = _per_row(n_valid, T, B)
        if mode == "causal":
            commit, block = valid, torch.zeros_like(valid)
        else:
            commit = _per_row(n_commit, 0, B)
            block = valid - commit
            if bool((block < 0).any()):
                raise CloverError("n_commit exceeds the number of valid tokens")
        if tree is not None and any(layer.recurrent for layer in cache.layers):
            raise CloverError("a tree of drafts needs a model without recurrent layers")
        cache.prepare(T, valid)
        step = cached_layout(commit, block, cache.lengths, T, tree)
        step.capture = tuple(capture)
        hidden = self._run(input_ids, step, cache.layers)
        cache.advance(commit)
        if not capture:
            return hidden
        if len(step.captured) != len(set(capture)):
            raise CloverError(f"capture {list(capture)}: layer ids outside the model")
        by_layer = dict(zip(sorted(set(capture)), step.captured))
        return hidden, torch.cat([by_layer[i] for i in capture], -1)

    def forward_over_prefix(
        self, input_ids: torch.Tensor, cache: ModelCache, layout: StepLayout
    ) -> torch.Tensor:
        """input_ids [B, T] as block tokens over the cached prefix, under a layout from
        `noisy_layout` (training's split form); nothing is committed. -> hidden [B, T, D]."""
        cache.prepare(input_ids.shape[1])
        return self._run(input_ids, layout, cache.layers)

    def compile_causal(self) -> None:
        """Run passes without block tokens (prefill, AR steps, commit and verify passes)
        through `torch.compile`d backbone code; block passes stay eager.

        Why: a decode step of a small model on a CPU is mostly the fixed cost of a few
        hundred small ops (norms, RoPE, casts, cache writes), which the compiler fuses. Why
        not block passes: with a draft adapter they take other branches (block-token
        gathers) and every variant compiles for minutes on a small CPU, while their time
        is the weight matmuls. Shapes are dynamic (batch, positions, cache length), so a
        process compiles a handful of graphs (each can take a minute or more on a small CPU;
        cached on disk by PyTorch, which shortens the next process's start). Inference only:
        the eager backbone is the reference (`test_compile_causal_matches_eager`)."""

        import torch._dynamo  # slow to import: only to compile

        on_cpu = next(self.parameters()).device.type == "cpu"
        compilers = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
        if on_cpu and not any(c and shutil.which(c) for c in compilers):
            raise CloverError("compiling for CPU needs a C++ compiler (g++ or clang++; CXX)")
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 32))  # B=1/T=1 specialize: a few graphs
        # not inductor's cpp_wrapper: it makes a decode step's backbone a little faster, but
        # each graph then compiles about three times as long
        self.compiled_backbone = torch.compile(self.backbone, dynamic=True)

    def _run(
        self, input_ids: torch.Tensor, layout: StepLayout, caches: list | None
    ) -> torch.Tensor:
        adapter = getattr(self, "draft_adapter", None)
        if adapter is not None:
            adapter.tokens.set(layout.block_tokens(), input_ids)
        compiled = (
            self.compiled_backbone is not None
            and caches is not None
            and (adapter is None or adapter.tokens.index is None)  # no block tokens
            and not torch.is_grad_enabled()
            and self.fused_layers(layout, caches) is None  # the fused path needs no compiling
            and not layout.capture
        )
        backbone = self.compiled_backbone if compiled else self.backbone
        try:
            return backbone(input_ids, layout, caches)
        finally:
            if adapter is not None:
                adapter.tokens.clear()


def _per_row(value: torch.Tensor | int | None, default: int, batch: int) -> torch.Tensor:
    if value is None:
        value = default
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.long)
    return value.to(torch.long)


_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
          "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")  # fmt: skip


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside land on the meta device and skip `torch.nn.init`: a meta tensor
    has no values to initialize, and some PyTorch versions run meta initializers through
    reference code whose first import costs seconds."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, _unchanged)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
