"""Constrained decoding: a per-row rule on which token ids may be committed next.

The loop knows token ids only, so a constraint is an object over ids (`LogitsConstraint`);
what it means in text (JSON, a tool call, a thought's budget) is built at the edge
(`clover.serving.constraints`). A constrained row commits left to right: a constraint judges a
token against everything before it, so a position may only be committed once every position
before it is. For block diffusion this means the row commits a *run* per step: the leftmost
masked position always (its best allowed token), then the following ones while their best
allowed token is confident enough for the policy; positions after the first one that is not
stay masked for the next step, exactly as uncommitted positions do without a constraint.

`pick` finds the token without judging the whole vocabulary when it can: candidates are tried
in descending logit order (greedy) or drawn and rejected (sampling: rejection keeps the
distribution exactly the one renormalised over allowed tokens); only after `TRIES` refusals
does it ask the constraint for the full mask.
"""

from __future__ import annotations

from typing import Protocol

import torch

from clover.decoding.sampling import SamplingParams, filtered_probs

TRIES = 48  # candidates judged one by one before the full vocabulary mask


class LogitsConstraint(Protocol):
    """Which token ids may come next. `room`: tokens the answer may still take, this one
    included (a constraint may need some of them to finish what it started)."""

    def allowed(self, token: int, room: int) -> bool: ...

    def allowed_mask(self, room: int, vocab_size: int) -> torch.Tensor:
        """bool [vocab_size]; never all False (a constraint that cannot go on allows EOS)."""
        ...

    def forced(self, room: int) -> int | None:
        """The only token that may come next, if the constraint dictates one."""
        ...

    def advance(self, token: int) -> None: ...

    @property
    def finished(self) -> bool:
        """True once nothing is constrained any more: the row drops the constraint."""
        ...


def pick(
    logits: torch.Tensor,
    constraint: LogitsConstraint,
    room: int,
    sampling: SamplingParams,
    gen: torch.Generator | None,
) -> tuple[int, float]:
    """logits [V] of one position -> (allowed token, its probability among allowed ones).

    Greedy confidence is computed with only the refused candidates removed, so it is a lower
    bound on the renormalised probability (never an over-confident commit).
    """
    forced = constraint.forced(room)
    if forced is not None:
        return forced, 1.0
    logits = logits.float()
    V = logits.shape[-1]
    if sampling.greedy:
        refused = []
        for token in torch.topk(logits, min(TRIES, V)).indices.tolist():
            if constraint.allowed(token, room):
                masked = logits.clone()
                masked[refused] = float("-inf")
                return token, float(torch.softmax(masked, -1)[token])
            refused.append(token)
        masked = logits.masked_fill(~constraint.allowed_mask(room, V), float("-inf"))
        probs = torch.softmax(masked, -1)
        token = int(probs.argmax())
        return token, float(probs[token])
    probs = filtered_probs(logits[None], sampling)[0]
    for _ in range(TRIES):
        total = float(probs.sum())
        if total <= 0:
            break
        token = int(torch.multinomial(probs, 1, generator=gen))
        if constraint.allowed(token, room):
            return token, float(probs[token]) / total
        probs[token] = 0.0
    masked = logits.masked_fill(~constraint.allowed_mask(room, V), float("-inf"))
    probs = filtered_probs(masked[None], sampling)[0]
    if not bool((probs > 0).any()) or bool(probs.isnan().any()):
        probs = torch.softmax(masked, -1)  # top-k/top-p kept only refused tokens
    token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(probs[token])
