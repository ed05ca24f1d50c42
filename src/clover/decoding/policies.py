"""Decoding policies: which masked positions of the block to commit at a step.

The block loop (`loop.py`) exists once; a policy only sees the confidences of the masked
positions it may commit and returns which to commit. `ar` is the one-position block, so on
a token-shifted model it is exactly autoregressive decoding with a KV cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from clover.errors import CloverError, ContextTooLong
from clover.models.base import DiffusionLM


@dataclass(frozen=True)
class Policy:
    """Base: commit every masked position (what a one-position block needs)."""

    block_size: int = 1
    name: str = "ar"
    speculative = False  # class attribute: SpecRow instead of BlockRow in the loop
    slide = False  # a sliding window instead of fixed blocks (a LowConfidence field)
    # whether `select` reads the confidences (else a greedy step takes the arg-max alone:
    # a softmax over the vocabulary costs more than the arg-max itself)
    uses_confidence = False

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise CloverError(f"block_size must be a positive integer, got {self.block_size!r}")

    def select(self, confidence: torch.Tensor) -> torch.Tensor:
        """confidence [n] of the masked positions (n >= 1) -> bool [n], at least one True."""
        return torch.ones_like(confidence, dtype=torch.bool)

    def confident(self, confidence: float) -> bool:
        """Whether one position at this confidence would be committed (constrained rows,
        which commit left to right, ask this of each position after the first)."""
        return True

    def needs_mask(self, shifted: bool) -> bool:
        """Whether decoding feeds [MASK] inputs (a model without a mask token cannot): any
        block wider than one position, and any block of a model without token shift."""
        return self.block_size > 1 or not shifted


@dataclass(frozen=True)
class LowConfidence(Policy):
    """Commit every position whose confidence >= threshold; if none, the most confident one.

    `slide=True` keeps a window of block_size positions ahead of the prefix instead of fixed
    blocks: committed leading positions leave the window at once (they are committed causally
    in the next pass, fused with it) and fresh masks join at its end. The window's first
    position is then always predicted by the prefix's causal output, which is the token AR
    decoding would write, so it is committed every step and the threshold only decides which
    further positions come along (see `rows.BlockRow`)."""

    block_size: int = 32
    threshold: float = 0.95
    slide: bool = False
    name: str = "low_confidence"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.threshold >= 0:
            raise CloverError(f"threshold must be >= 0, got {self.threshold}")

    uses_confidence = True

    def select(self, confidence: torch.Tensor) -> torch.Tensor:
        chosen = confidence >= self.threshold
        if self.slide:  # the leftmost masked position is the window's first: AR's token
            chosen[0] = True
        elif not bool(chosen.any()):
            chosen[int(confidence.argmax())] = True
        return chosen

    def confident(self, confidence: float) -> bool:
        return confidence >= self.threshold


DRAFTS = (
    "mask", "lookup", "mask+lookup", "drafter", "drafter+lookup", "lookup+store",
    "drafter+lookup+store",
)  # fmt: skip


class Source(enum.Enum):
    """One place a self_spec draft can come from (`sources.DraftSources` chooses)."""

    MASK = "mask"  # the model's own masked block
    LOOKUP = "lookup"  # what followed the current suffix earlier in prompt + answer
    DRAFTER = "drafter"  # a small trained drafter on the model's features
    STORE = "store"  # the model's n-gram store of earlier text


def draft_sources(draft: str) -> frozenset[Source]:
    """A `draft` name (one of DRAFTS) -> its sources, parsed once."""
    if draft not in DRAFTS:
        raise CloverError(f"draft {draft!r}: choose one of {', '.join(DRAFTS)}")
    return frozenset(Source(part) for part in draft.split("+"))


@dataclass(frozen=True)
class SelfSpec(Policy):
    """Lossless self-speculation: draft block_size - 1 tokens per pass, verify them causally
    in the next pass (fused with the next draft), keep exactly what AR decoding would.
    `draft` is where drafts come from: the masked block ("mask"), earlier occurrences of the
    current suffix in prompt + answer ("lookup"), or a context match when there is one and
    the block otherwise ("mask+lookup"), or a context match and else the model's n-gram store
    of earlier text ("lookup+store", `store.NgramStore`), or a context match, else the store
    (adaptive: where it pays more than the drafter), else the drafter ("drafter+lookup+store");
    see `spec_row.SpecRow`."""

    block_size: int = 32
    draft: str = "mask"
    # lookup / drafter drafts as long as this machine's pass costs and the row's acceptance
    # make them pay (decoding/costs.py), AR steps while they do not; False: always the most
    adaptive: bool = True
    # > 0: a drafter's drafts form a tree of this many tokens, verified in one pass (greedy
    # rows; `trees.leaf_tree`): its best chain plus the likeliest other guesses at each
    # depth. 0: the chain alone
    tree: int = 0
    name: str = "self_spec"
    speculative = True
    sources: frozenset[Source] = field(init=False, compare=False, repr=False)  # of `draft`

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 2:
            raise CloverError("self_spec needs block_size >= 2 (one AR token + drafts)")
        object.__setattr__(self, "sources", draft_sources(self.draft))
        if not isinstance(self.tree, int) or self.tree < 0:
            raise CloverError(f"tree must be a number of drafted tokens >= 0, got {self.tree!r}")
        if self.tree and Source.DRAFTER not in self.sources:
            raise CloverError(f"tree drafts come from a drafter; draft {self.draft!r} has none")

    def needs_mask(self, shifted: bool) -> bool:
        return Source.MASK in self.sources  # lookup drafts feed only real tokens


DECODERS = ("ar", "low_confidence", "self_spec")


def make_policy(
    name: str,
    block_size: int = 32,
    threshold: float = 0.95,
    draft: str = "mask",
    slide: bool = False,
    adaptive: bool = True,
    tree: int = 0,
) -> Policy:
    if slide and name != "low_confidence":
        raise CloverError(f"slide is a low_confidence option (the decoder here is {name})")
    if not adaptive and name != "self_spec":
        raise CloverError(f"fixed draft lengths are a self_spec option (the decoder is {name})")
    if tree and name != "self_spec":
        raise CloverError(f"trees of drafts are a self_spec option (the decoder is {name})")
    if name == "ar":
        return Policy()
    if name == "low_confidence":
        return LowConfidence(block_size=block_size, threshold=threshold, slide=slide)
    if name == "self_spec":
        return SelfSpec(
            block_size=block_size,
            draft=draft,
            adaptive=adaptive,
            tree=tree,
        )
    raise CloverError(f"unknown decoder {name!r}; choose one of: {', '.join(DECODERS)}")


def check_request(
    model: DiffusionLM, prompt: list[int], policy: Policy, max_new: int, drafter: bool
) -> None:
    """Refuse, before anything runs, a request this model (with a drafter or not) cannot
    decode with this policy."""
    config = model.config
    if not prompt:
        raise CloverError("empty prompt: give at least one token")
    if max_new < 1:
        raise CloverError(f"max_new_tokens must be >= 1, got {max_new}")
    if policy.needs_mask(config.shifted) and config.mask_token_id is None:
        hint = "--draft lookup" if policy.speculative else "--decoder ar"
        raise CloverError(
            f"this model has no mask_token_id, so it cannot decode blocks; use {hint}"
        )
    if policy.speculative and not config.shifted:
        raise CloverError("self_spec needs a token-shifted model (config.shifted = true)")
    if getattr(policy, "tree", 0) and any(c.recurrent for c in model.make_cache(1).layers):
        raise CloverError(
            "trees of drafts need a model without recurrent layers (their state follows one "
            "sequence): drop the tree option"
        )
    if policy.speculative and Source.DRAFTER in policy.sources and not drafter:
        raise CloverError(
            f"draft {policy.draft!r} needs a drafter for this model: load one with --drafter "
            "FILE (`clover train drafter` makes one)"
        )
    if len(prompt) >= model.context_length:
        raise ContextTooLong(
            f"prompt of {len(prompt)} tokens does not fit the model's context of "
            f"{model.context_length} (prompt + generation)"
        )


def check_model_defaults(config: object) -> None:
    """A model's config names the decoder and self_spec draft source it is made for; refuse
    names this engine does not know, when the model is loaded (the model layer does not know
    decoding)."""
    decoder = getattr(config, "default_decoder", "ar")
    draft = getattr(config, "draft", "mask")
    if decoder not in DECODERS:
        raise CloverError(f"config: default_decoder {decoder!r}: one of {', '.join(DECODERS)}")
    if draft not in DRAFTS:
        raise CloverError(f"config: draft {draft!r}: one of {', '.join(DRAFTS)}")
