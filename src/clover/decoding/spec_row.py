"""`SpecRow`: a self_spec row, lossless self-speculation.

Each pass feeds [certain tokens | draft (causal, to verify) | B masks (bidirectional, the next
draft)]. The causal outputs give the AR token at every draft position: the longest matching
draft prefix is accepted plus the AR token after it, the rejected tail is rolled back from the
cache, and when the whole draft was accepted the masked block's outputs become the next draft.
Every pass yields >= 1 token and the output is exactly AR decoding (greedy: identical tokens;
sampling: the same distribution, since a draft token is accepted only when it equals the AR
sample). Drafts come from the masked block (`draft="mask"`, needs a block-diffusion model or a
draft adapter), from the context (`"lookup"`: the tokens that followed the last earlier
occurrence of the current 3- or 2-token suffix in prompt + answer; any AR model, no masks in
the pass) or from both (`"mask+lookup"`: a context match when there is one, else the block's
draft).

Where drafts come from is `sources.DraftSources`; which drafts are kept, `verify.py`.
"""

from __future__ import annotations

import torch

from clover.decoding.rows import Row, first_eos
from clover.decoding.sampling import SamplingParams, draw_drafts, sample
from clover.decoding.sources import DraftSources
from clover.decoding.store import NgramIndex
from clover.decoding.trees import graft
from clover.decoding.verify import depth, exact, sampled
from clover.decoding.verify import tree as verify_tree


class SpecRow(Row):
    """self_spec: draft a block, verify it causally next pass, keep what AR would write."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.draft: list[int] = []
        self.draft_q: torch.Tensor | None = None  # [len(draft), V] what drafts were drawn from
        # a tree of drafts (`policy.tree`): each draft's parent among the drafts (-1: it
        # follows the last certain token); None: the drafts are a chain
        self.parents: list[int] | None = None
        # after a tree pass: the pass indices of the drafts kept (the loop moves their cache
        # entries and features into place)
        self.kept_branch: list[int] | None = None
        self._from_context = False  # the planned pass's draft came from a context lookup
        self.sources = DraftSources(self.policy, self.pending)

    @property
    def uses_drafter(self) -> bool:
        return self.sources.uses_drafter

    @property
    def context(self) -> NgramIndex | None:
        return self.sources.context

    def plan(self, mask_id: int, look: bool = True) -> tuple[list[int], int]:
        self._from_context = False
        found = self._lookup() if look else []
        if found and self.parents is not None and self.draft:
            # a tree of drafts takes the context match as one more branch (the drafter drew
            # the tree knowing a match would come: `drafter_length`)
            self.draft, self.parents = graft(self.draft, self.parents, found)
        elif found:  # a context match beats the block's or the drafter's guess
            self.draft, self.draft_q, self._from_context = found, None, True
            self.parents = None
        return self._verify_plan(mask_id)

    @property
    def grows_tree(self) -> bool:
        """Whether the drafter drafts this row trees (greedy, unconstrained rows of a tree
        policy; the others draft chains)."""
        return bool(self.policy.tree) and self.sampling.greedy and self.constraint is None

    def tree(self) -> list[int] | None:
        """The planned pass's parents (`layout.tree_parts`) when its drafts are a tree: the
        certain tokens a chain, each draft on its parent (-1: on the last certain token)."""
        if self.parents is None:
            return None
        P = len(self.pending)
        return list(range(-1, P - 1)) + [P - 1 if p < 0 else P + p for p in self.parents]

    def _lookup(self) -> list[int]:
        """The context-lookup draft for the next pass ([] without lookup or a paying match).
        [] on a row's first pass: that pass then has `ar`'s width (the prompt), so its rows
        round as `ar`'s do. Drafts appended to the prompt would make a pass of another width,
        whose rows a matmul may sum in another order, and an int4 answer could then part from
        `ar`'s; with integer dots every later pass of up to 4 tokens (16 on AVX2) rounds as
        `ar`'s does (docs/kernels.md)."""
        if not self.sources.looks_up or not self.answer:
            return []
        return self.sources.lookup(self.max_new - len(self.answer) - 1, self.grows_tree)

    def drafter_length(self, stops: bool = False) -> int:
        """How many tokens the drafter should draft for the next pass (0: none, also when the
        next plan will take a context match instead: that drafter pass would be thrown away);
        `stops`: `DraftSources.drafter_length`'s."""
        room = self.max_new - len(self.answer) - 1
        if (
            not self.sources.uses_drafter
            or self.draft
            or room <= 0
            or first_eos(self.answer, self.eos) is not None
            # the next plan takes a context match over any drafter chain (a tree keeps both)
            or (self._lookup() and not self.grows_tree)
        ):
            return 0
        return self.sources.drafter_length(room, stops)

    def take_drafts(
        self,
        logits: torch.Tensor,
        sampling: SamplingParams,
        drawn: tuple[list[int], torch.Tensor | None] | None = None,
        parents: list[int] | None = None,
    ) -> None:
        """The drafter's logits [k, V] for the next k positions -> this row's next draft
        (`drawn`: the draft and its q already drawn from them, by a chain drafter; with
        `parents`, a tree of drafts, `drawn`'s tokens its nodes)."""
        self.draft, self.draft_q = (
            drawn if drawn is not None else draw_drafts(logits, sampling, self.gen)
        )
        self.parents = parents

    def _verify_plan(self, mask_id: int) -> tuple[list[int], int]:
        """[certain | draft to verify | masked block (draft="mask*" only)]."""
        masks = [mask_id] * self.policy.block_size if self.sources.masks else []
        return self.pending + self.draft + masks, len(self.pending) + len(self.draft)

    def optional_tokens(self) -> int:
        """A context-lookup draft (remade every pass, so dropping part of it loses nothing but
        speed; a masked block, if any, moves up behind what is kept)."""
        return len(self.draft) if self._from_context else 0

    def shorten(self, n: int, mask_id: int) -> tuple[list[int], int]:
        """Keep only the first n tokens of the planned lookup draft; -> the new plan."""
        self.draft = self.draft[:n]
        self.draft_q = None if self.draft_q is None else self.draft_q[:n]
        self._from_context = bool(self.draft)
        return self._verify_plan(mask_id)

    def wanted(self, hidden: torch.Tensor | None, n_commit: int) -> list[torch.Tensor]:
        # pending is never empty (the prompt, then the last certain token), so the output at
        # its last token predicts draft[0]; the outputs at draft tokens predict the rest
        verify = hidden[len(self.pending) - 1 : n_commit]
        self._n_verify = len(verify)
        if not self.sources.masks:
            return list(verify)
        draft = hidden[n_commit : n_commit + self.policy.block_size - 1]  # next draft
        return list(verify) + list(draft)

    def update(
        self,
        logits: torch.Tensor,
        sampling: SamplingParams,
        eos: set[int],
        sampled: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple:
        """`sampled`: as `BlockRow.update`'s (greedy, unconstrained rows): the verify
        positions' AR tokens come from it."""
        self.steps += 1
        nv = self._n_verify
        verify, drafted = logits[:nv], logits[nv:]
        self.kept_branch = None
        ar = None  # the greedy tokens of the verify positions, drawn by the loop
        if sampled is not None and self.constraint is None:
            ar = sampled[0][:nv].tolist()
        chain, token = self._verify(verify, sampling, ar)
        accepted = len(chain)
        if self.draft:
            self._tally(accepted)
        for a in self.sources.acceptance.values():
            a.relax()
        self._from_context = False
        rollback = len(self.draft) - accepted
        new = chain + [token]
        start = self._append(new)
        room = self.max_new - len(self.answer) - 1  # the next pass always adds one AR token
        self.draft_q, self.parents = None, None
        if self.sources.masks and rollback == 0 and room > 0 and first_eos(new, eos) is None:
            self.draft, self.draft_q = draw_drafts(drafted[:room], sampling, self.gen)
        else:
            self.draft = []
        return [(start + i, t) for i, t in enumerate(new)], rollback

    def _verify(
        self, verify: torch.Tensor, sampling: SamplingParams, ar: list[int] | None
    ) -> tuple[list[int], int]:
        """-> (the drafts kept, in answer order; the token after them); a tree's kept branch
        (pass indices) is left in `kept_branch` for the loop."""

        def ar_token(row: int, depth: int) -> int:  # AR's token at verify row `row`
            if ar is not None:  # the loop's greedy draw
                return ar[row]
            if self.constraint is not None:
                return self.constrained(verify[row], len(self.answer) + depth, sampling)
            return int(sample(verify[row : row + 1], sampling, self.gen)[0][0])

        if self.parents is not None:
            path, token = verify_tree(self.draft, self.parents, ar_token)
            self.kept_branch = [len(self.pending) + a for a in path]
            return [self.draft[a] for a in path], token
        if sampling.greedy or self.constraint is not None:
            accepted, token = exact(self.draft, ar_token)
        else:
            accepted, token = sampled(verify, self.draft, self.draft_q, sampling, self.gen)
        return self.draft[:accepted], token

    def _tally(self, accepted: int) -> None:
        """Count the pass's drafts by source, and teach that source's acceptance estimate
        (a tree counts as a chain as deep as its deepest branch)."""
        source = "drafter" if self.sources.uses_drafter else "mask"
        source = self.sources.last if self._from_context else source
        tally = self.result.drafts.setdefault(source, [0, 0])
        tally[0] += len(self.draft)
        tally[1] += accepted
        self.result.accepted.append(accepted)
        if source in self.sources.acceptance:
            deepest = len(self.draft) if self.parents is None else depth(self.parents)
            self.sources.acceptance[source].update(deepest, accepted)

    def _append(self, new: list[int]) -> int:
        start = len(self.answer)
        self.answer += new
        self.answer_steps += [self.steps] * len(new)
        self.pending = [new[-1]]
        if self.context is not None:
            self.context.extend(new)
        return start
