"""Where a self_spec row's drafts come from, and how far each source pays to draft.

A row's policy names its sources once (`policies.Source`): its own prompt + answer (context
lookup: the tokens that followed the latest earlier occurrence of the current 3- or 2-token
suffix), the model's n-gram store of earlier text, the drafter, the masked block. A
`DraftSources` holds what choosing needs: the row's context index, the acceptance each source
has seen (one estimate per source used) and, when the policy adapts its draft lengths, this
machine's pass costs (`costs.py`). `lookup` gives the next pass's context or store draft;
`drafter_length` how far the drafter should draft. Verification lives with the row
(`spec_row.SpecRow`): the sources only propose.
"""

from __future__ import annotations

from collections.abc import Callable

from clover.decoding.costs import Acceptance, PassCosts, best_length, best_rate
from clover.decoding.policies import SelfSpec, Source
from clover.decoding.store import NgramIndex, NgramStore


class DraftSources:
    """One row's draft sources (`policy.sources`) over its tokens (prompt, then answer)."""

    def __init__(self, policy: SelfSpec, tokens: list[int]) -> None:
        sources = policy.sources
        self.masks = Source.MASK in sources  # a masked block rides in every pass
        self.looks_up = Source.LOOKUP in sources
        self.uses_drafter = Source.DRAFTER in sources  # the loop's drafter sets the drafts
        self.block = policy.block_size
        # the row's prompt + answer, indexed for lookup drafts and the copies a chain
        # drafter's drafts lean to
        self.context = NgramIndex(tokens) if self.looks_up or self.uses_drafter else None
        self.store: NgramStore | None = None  # the model's, set by the loop ("store")
        self.costs: PassCosts | None = None  # set by the loop when the policy adapts
        self.last = ""  # where the latest lookup draft came from: "lookup" or "store"
        # one estimate per source used: each relaxes every step, which costs per source
        used = {"lookup": (self.looks_up, NgramIndex.LONG),
                "store": (Source.STORE in sources, self.block - 1),
                "drafter": (self.uses_drafter, self.block - 1)}  # fmt: skip
        self.acceptance = {name: Acceptance(n) for name, (on, n) in used.items() if on}

    def share_acceptance(self, shared: Callable[[str, int], Acceptance]) -> None:
        """Start from, and report to, the acceptance the model's earlier rows saw
        (`shared(source, positions)`: `Runtime.shared_acceptance`)."""
        self.acceptance = {s: Acceptance(len(a.p), shared=shared(s, len(a.p)))
                           for s, a in self.acceptance.items()}  # fmt: skip

    def lookup(self, room: int, tree: bool) -> list[int]:
        """The context draft for the next pass, else the store's where the context has no
        paying match ([] for none). room: tokens the answer may still take beyond the pass's
        own AR token; tree: the row verifies trees (a fixed row's long match then goes on:
        its pass is as wide as its tree plus the match anyway)."""
        most = min(self.block - 1, room)
        self.last = "lookup"
        if self.costs is None:  # fixed: block - 1 drafted tokens at most
            found = self.context.draft(most, room if tree else None)
        else:  # long matches may draft far; as far as this machine and these matches pay
            found = self.context.draft(most, room)
            found = found[: best_length(self.acceptance["lookup"].p, self.costs, len(found))]
        if found or self.store is None:
            return found
        self.last = "store"  # no paying match in the row's own text: earlier text's guess
        found = self.store.draft(self.context.tokens, most)
        if self.costs is None or not found:
            return found
        k, rate = best_rate(self.acceptance["store"].p, self.costs, len(found))
        if self.uses_drafter:  # the store's guess only where it pays more than the drafter's
            if best_rate(self.acceptance["drafter"].p, self.costs, most, drafter=True)[1] > rate:
                return []
        return found[:k]

    def drafter_length(self, room: int, stops: bool = False) -> int:
        """How far the drafter should draft for a pass that may keep `room` tokens; `stops`:
        its chains stop themselves where their drafts become unlikely (`costs.chain_cost`)."""
        most = min(self.block - 1, room)
        if self.costs is None:
            return most
        return best_length(self.acceptance["drafter"].p, self.costs, most, True, stops)
