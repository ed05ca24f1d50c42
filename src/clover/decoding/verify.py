"""Verifying a self_spec row's drafts: which of them AR decoding would have written.

A verify pass gives the causal output at the last certain token and at every draft; the
token AR decoding writes at each position is drawn from it (`ar_token(row, depth)`: verify
row `row`, `depth` tokens into the answer's new part). Three verifiers, one per kind of row:

- `exact` (greedy or constrained rows): drafts are kept while they equal AR's token;
- `tree` (greedy rows verifying a tree of drafts): the same, walking from the root to the
  child that drafted AR's token;
- `sampled` (sampling rows): speculative sampling, kept with probability min(1, p/q).

Each returns what was kept and the token after it: a pass always yields one token more.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from clover.decoding.sampling import SamplingParams, filtered_probs

ArToken = Callable[[int, int], int]  # (verify row, depth) -> AR's token there


def exact(draft: list[int], ar_token: ArToken) -> tuple[int, int]:
    """-> (drafts accepted, the token after them). Sequential: a token is drawn only where
    AR draws one (a constrained or sampled draw moves state)."""
    for i in range(len(draft) + 1):
        token = ar_token(i, i)
        if i < len(draft) and token == draft[i]:
            continue
        return i, token
    raise AssertionError("unreachable: the last position always returns")


def tree(draft: list[int], parents: list[int], ar_token: ArToken) -> tuple[list[int], int]:
    """`exact` over a tree (draft i's parent is parents[i], -1: the last certain token; its
    output is verify row i + 1): from the root, AR's token at the current node, then on to
    the child that drafted it while there is one. -> (the drafts kept, in order; the token
    after them)."""
    children: dict[int, dict[int, int]] = {}
    for i, (p, t) in enumerate(zip(parents, draft)):
        children.setdefault(p, {}).setdefault(t, i)  # the first of equal siblings
    path, node = [], -1
    while True:
        token = ar_token(node + 1, len(path))
        nxt = children.get(node, {}).get(token)
        if nxt is None:
            return path, token
        path.append(nxt)
        node = nxt


def depth(parents: list[int]) -> int:
    """How deep a tree of drafts goes (a chain as deep as its deepest branch)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return max(depths, default=0)


def sampled(
    verify: torch.Tensor,
    draft: list[int],
    draft_q: torch.Tensor | None,
    sampling: SamplingParams,
    gen: torch.Generator,
) -> tuple[int, int]:
    """Speculative sampling: draft token d, drawn from q, is kept with probability
    min(1, p(d) / q(d)) under the target's p; the first one refused is replaced by a draw
    from the residual max(p - q, 0) (renormalised); after every draft, a draw from p. The
    tokens are distributed exactly as AR sampling's (tests/test_self_spec.py), and a draft
    drawn from a q close to p survives far more often than one that must equal p's sample.
    A draft without q (a context lookup, an arg-max) is a point mass: q(d) = 1."""
    probs = filtered_probs(verify.float(), sampling)  # [nv, V]
    for i, p in enumerate(probs):
        if i == len(draft):
            return i, int(torch.multinomial(p, 1, generator=gen))
        d = draft[i]
        q = None if draft_q is None else draft_q[i]
        qd = 1.0 if q is None else float(q[d])
        if float(torch.rand((), generator=gen)) * qd < float(p[d]):
            continue
        residual = p.clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (p - q).clamp(min=0.0)
        if float(residual.sum()) <= 0:  # p <= q everywhere: only p itself is left
            residual = p
        return i, int(torch.multinomial(residual, 1, generator=gen))
    raise AssertionError("a verify pass has one position more than its draft")
