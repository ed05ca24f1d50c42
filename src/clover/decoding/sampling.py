"""Turning logits into a token and a confidence per position.

Greedy (temperature 0) takes the arg-max of the logits and reports its softmax probability
(unless the caller needs no confidence: a softmax over a large vocabulary costs far more than
the arg-max); sampling draws from the temperature-scaled distribution after top-k / top-p
filtering and reports the probability of the drawn token under that distribution. The
confidence is what decoding policies threshold on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clover.errors import CloverError

MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise CloverError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise CloverError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise CloverError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k and top-p."""
    # shifted so the largest is 0, and a temperature too small for float32 (1e-179 is 0
    # there: 0/0) divides as the smallest one that is not: the arg-max, not NaN
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    logits = shifted / max(params.temperature, MIN_TEMPERATURE)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the top one always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The arg-max over the last dimension, as `argmax` picks it (the first of equal largest
    logits; a NaN the largest): `max` finds the same index in about a third of `argmax`'s
    time on a CPU over a vocabulary of 150k logits (a millisecond a step at 8 rows)."""
    return logits.max(dim=-1).indices


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    confidence: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] -> (tokens [N] long, confidence [N] float; None for a greedy draw
    without `confidence`). Greedy takes the first of the largest logits."""
    if params.greedy:
        tokens = greedy_ids(logits)
        if not confidence:
            return tokens, None
        probs = torch.softmax(logits.float(), dim=-1)
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1)
    probs = filtered_probs(logits.float(), params)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1)


def greedy_picks(
    logits: torch.Tensor | None, plain: list[bool], uses_confidence: list[bool]
) -> list[torch.Tensor | None] | None:
    """The greedy tokens (and, where a plain row selects by it, confidences) of a whole batch's
    logits [N, V] in one call, on the host: row by row each would be a few ops, and on a GPU a
    host sync. `plain[k]`: row k is greedy and unconstrained. -> [tokens [N], confidence [N]
    or None], or None where no row is plain."""
    if logits is None or not any(plain):
        return None
    confident = any(p and c for p, c in zip(plain, uses_confidence))
    tokens, conf = sample(logits, SamplingParams(), confidence=confident)
    return [tokens.cpu(), None if conf is None else conf.cpu()]


def draw_drafts(
    logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator
) -> tuple[list[int], torch.Tensor | None]:
    """A draft from its logits [n, V]: the arg-max (greedy decoding; no distribution kept),
    else a draw from the same filtered distribution the target samples from, kept as q for
    speculative sampling."""
    if sampling.greedy or logits.shape[0] == 0:
        return greedy_ids(logits).tolist(), None
    q = filtered_probs(logits.float(), sampling)
    return torch.multinomial(q, 1, generator=gen).squeeze(-1).tolist(), q
