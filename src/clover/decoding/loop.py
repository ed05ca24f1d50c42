"""The decoding loop, written once for every decoder, batch size and model.

Each step: every active row plans its input (tokens to commit causally onto its prefix, then
its block), the rows are padded into one forward pass over the shared cache, the logits every
row needs are computed in one call, and each row updates itself (`rows.py`: `BlockRow` for
ar / low_confidence, `SpecRow` for self_spec). Rows finish on their own (EOS, token budget,
the caller's stop check) and leave the batch; the cache drops their rows.

The loop sees token ids only and yields a `StepEvent` per step; CLI, server, benchmarks and
visualisers all consume that stream. NFE counts forward passes a row took part in.

Rows join and leave between steps (`batch.py`; their prompts reach the cache through
`prefill.py`). Each row's committed ids (`Row.committed`) are kept exact here (commits of each
pass, minus rolled-back speculation), so a prefix cache only ever saves causal tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from clover.decoding.batch import Batch, on_model_device
from clover.decoding.constraints import LogitsConstraint
from clover.decoding.policies import Policy, check_request
from clover.decoding.rows import Row, RowResult, first_eos
from clover.decoding.runtime import Runtime
from clover.decoding.sampling import SamplingParams, greedy_picks
from clover.decoding.spec_row import SpecRow
from clover.models.base import DiffusionLM

__all__ = ["BatchDecoder", "Commit", "RowResult", "StepEvent", "generate"]


@dataclass
class Commit:
    row: int
    index: int  # position in the answer (0 = first generated token)
    token: int
    step: int  # the row's denoising step that committed it (1-based)


@dataclass
class _Pass:
    """One step's forward: hidden [B, T, D] (None: no row had tokens), the drafter's features
    [B, T, F] (None without a drafter), the width T."""

    hidden: torch.Tensor | None = None
    features: torch.Tensor | None = None
    width: int = 0


@dataclass
class StepEvent:
    step: int  # global step of this generate call (1-based)
    commits: list[Commit]
    final: dict[int, list[int]]  # row -> tokens that just became final, in answer order
    finished: dict[int, str]  # row -> "stop" (EOS / stop condition) or "length"
    forward_rows: int  # rows with tokens in this step's forward pass (0: no pass was needed)
    forward_tokens: int  # input positions of that pass, padding included
    seconds: float


class BatchDecoder(Batch):
    """Sequences decoded together, one forward per step; rows may join (`add`) and leave
    (`cancel`) between steps (`batch.Batch`). `generate` below is this with all rows added up
    front; the server keeps one."""

    def _fit_lookup_drafts(self, plans: list[tuple[list[int], int]]) -> list:
        """In a batch every row's pass is padded to the longest, so a context-lookup draft may
        only fill what the other rows' passes take anyway: one row's 3-token guess must not
        make all rows pay 4 positions."""
        core = [len(t) - r.optional_tokens() for r, (t, _) in zip(self.active, plans)]
        width = max(core)
        for k, r in enumerate(self.active):
            if len(plans[k][0]) > width:
                plans[k] = r.shorten(width - core[k], self.mask_id)
        return plans

    @on_model_device
    def step(self) -> StepEvent:
        """One forward over every active row, then each row commits; finished rows leave."""
        t0 = time.perf_counter()
        self._busy = True
        self.step_count += 1
        plans = self._plan()
        out = self._forward(plans)
        logits, counts = self._logits(plans, out.hidden)
        event, keep, rollback = self._update(plans, logits, counts, out.width)
        self._settle(plans, out, rollback, keep)
        self._finish(keep)
        event.seconds = time.perf_counter() - t0
        return event

    def _plan(self) -> list[tuple[list[int], int]]:
        """Each row's (tokens of this pass, how many lead to commit causally); in a batch a
        context-lookup draft fills only what the other rows' passes take anyway."""
        rows = self.active
        if len(rows) == 1:
            return [rows[0].plan(self.mask_id)]
        if any(getattr(r, "draft", None) for r in rows):  # a match may replace a row's draft
            return self._fit_lookup_drafts([r.plan(self.mask_id) for r in rows])
        # no draft a match could replace: the pass is as wide as the widest plan without
        # matches, and a row already that wide has no room for one (not looked up)
        plans = [r.plan(self.mask_id, look=False) for r in rows]
        width = max(len(t) for t, _ in plans)
        plans = [r.plan(self.mask_id) if len(t) < width else (t, n)
                 for r, (t, n) in zip(rows, plans)]  # fmt: skip
        return self._fit_lookup_drafts(plans)

    def _forward(self, plans: list[tuple[list[int], int]]) -> _Pass:
        """The rows' plans padded into one pass over the shared cache (none when no row has
        tokens); what each row commits is added to its `committed`."""
        T = max((len(tokens) for tokens, _ in plans), default=0)
        if not T:
            return _Pass()
        # one host-to-device copy for the whole batch (a GPU step pays per copy)
        rows = [tokens + [self.mask_id] * (T - len(tokens)) for tokens, _ in plans]
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        n_valid = torch.tensor([len(t) for t, _ in plans])
        n_commit = torch.tensor([c for _, c in plans])
        capture = self.drafting.layers if self.drafting is not None else ()
        with torch.inference_mode():
            hidden = self.model(ids, self.cache, "block", n_commit=n_commit, n_valid=n_valid,
                                capture=capture, tree=self._tree_parents(T))  # fmt: skip
        features = None
        if capture:
            hidden, features = hidden
        for r, (tokens, n) in zip(self.active, plans):
            r.committed += tokens[:n]
        return _Pass(hidden, features, T)

    def _tree_parents(self, T: int) -> torch.Tensor | None:
        """[B, T] each pass position's parent when a row verifies a tree of drafts (a chain
        elsewhere: position i's parent is i - 1), else None."""
        trees = [r.tree() if isinstance(r, SpecRow) else None for r in self.active]
        if all(t is None for t in trees):
            return None
        tree = torch.arange(-1, T - 1).repeat(len(self.active), 1)
        for k, t in enumerate(trees):
            if t is not None:
                tree[k, : len(t)] = torch.tensor(t)
        return tree

    def _logits(
        self, plans: list[tuple[list[int], int]], hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, list[int]]:
        """The logits every row needs, in one call: -> (logits [N, V] or None, rows' counts)."""
        wanted, counts = [], []
        for k, r in enumerate(self.active):
            if plans[k][0]:
                r.result.nfe += 1
            vectors = r.wanted(None if hidden is None else hidden[k], plans[k][1])
            wanted += vectors
            counts.append(len(vectors))
        if not wanted:
            return None, counts
        with torch.inference_mode():
            logits = self.model.logits(torch.stack(wanted))  # [N, V]
            if self.config.mask_token_id is not None:
                logits[:, self.config.mask_token_id] = float("-inf")  # never an answer
        return logits, counts

    def _update(
        self, plans: list, logits: torch.Tensor | None, counts: list[int], width: int
    ) -> tuple[StepEvent, list[int], list[int]]:
        """Every row takes its logits and commits; -> (the step's event, the rows that stay,
        the tokens each row rolls back). Per-row counts stay Python ints: a step's tiny tensor
        ops cost more than the bookkeeping they hold."""
        active = self.active
        plain = [r.constraint is None and r.sampling.greedy for r in active]
        greedy = greedy_picks(logits, plain, [r.policy.uses_confidence for r in active])
        n_rows = sum(1 for t, _ in plans if t)
        event = StepEvent(self.step_count, [], {}, {}, n_rows, width * len(active), 0.0)
        rollback = [0] * len(active)
        keep, start = [], 0
        for k, r in enumerate(active):
            row_logits = logits[start : start + counts[k]] if counts[k] else torch.empty(0)
            picked = None
            if plain[k] and greedy is not None:
                picked = tuple(None if g is None else g[start : start + counts[k]]
                               for g in greedy)  # fmt: skip
            commits, rollback[k] = r.update(row_logits, r.sampling, r.eos, picked)
            start += counts[k]
            if self.on_logits is not None:
                self.on_logits(r.index, row_logits, commits)
            event.commits += [Commit(r.index, i, t, r.steps) for i, t in commits]
            if self._emit(r, event):
                keep.append(k)
        return event, keep, rollback

    def _emit(self, r: Row, event: StepEvent) -> bool:
        """The row's newly final tokens into the event; a row that ends is finalised (its
        result, the n-gram store taught its answer). -> whether the row goes on."""
        reason = r.finish_reason(r.eos)
        final = r.final_tokens()
        cut = first_eos(final, r.eos)
        final = final[: min(r.max_new, len(final) if cut is None else cut)]
        if len(final) > r.emitted:
            event.final[r.index] = final[r.emitted :]
            r.emitted = len(final)
            if r.stop is not None and r.stop(r.index, final):
                reason = "stop"
        if reason is None:
            return True
        r.result.tokens = final
        store = self.runtime.store
        if store is not None:  # later answers may draft from this one
            store.learn(r.prompt + final)
        r.result.steps = r.answer_steps[: len(final)]
        if len(r.result.steps) < len(final):  # ended mid-block by the caller's stop
            r.result.steps += r.block_steps[: len(final) - len(r.result.steps)]
        r.result.finish_reason = reason
        event.finished[r.index] = reason
        return False

    def _settle(self, plans: list, out: _Pass, rollback: list[int], keep: list[int]) -> None:
        """After the rows' updates: a tree's kept branch moves behind its root, rejected
        tokens leave the cache, the drafter drafts the next blocks."""
        for k, r in enumerate(self.active):
            branch = getattr(r, "kept_branch", None)
            if branch:
                first = plans[k][1] - rollback[k] - len(branch)  # where the branch goes
                with torch.inference_mode():
                    self.cache.keep_branch(k, plans[k][1], first, branch)
                    if out.features is not None:
                        out.features[k, first : first + len(branch)] = out.features[k, branch]
                end = len(r.committed) - plans[k][1] + first
                r.committed[end : end + len(branch)] = [plans[k][0][i] for i in branch]
        if any(rollback):
            self.cache.rollback(torch.tensor(rollback))
            for r, n in zip(self.active, rollback):
                del r.committed[len(r.committed) - n :]
        if self.drafting is not None and out.width:
            kept = [n - b for (_, n), b in zip(plans, rollback)]
            self.drafting.draft_for(self.active, out.features, kept, keep,
                                    self.config.mask_token_id)  # fmt: skip
        self.runtime.relax()  # the shared acceptance estimates drift once per step

    def _finish(self, keep: list[int]) -> None:
        """Rows' prefill times; the prefix cache takes each prompt once it is in and each
        leaving row's state; the rows that ended leave the batch."""
        now = time.perf_counter()
        for r in self.active:
            if not r.result.prefill_seconds and r.steps:
                r.result.prefill_seconds = now - r.t_added
        if self.prefix is not None:
            self._busy = False  # the pass is complete: the cache is consistent again
            with torch.inference_mode():
                for k, r in enumerate(self.active):
                    if k not in keep:
                        self._leave(k, save=True)
                    elif not r.prompt_saved and len(r.committed) >= len(r.prompt) - 1:
                        self.prefill.save(r, self.cache, k)
        self._keep(keep)
        self._busy = False


def generate(
    model: DiffusionLM | Runtime,
    prompts: list[list[int]],
    policy: Policy,
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    stop: Callable[[int, list[int]], bool] | None = None,
    results: list[RowResult] | None = None,
    constraint: Callable[[int], LogitsConstraint | None] | None = None,
    cached: bool = True,
    marks: list[tuple[int, ...]] | None = None,
) -> Iterator[StepEvent]:
    """Decode every prompt (lists of token ids, any lengths); yields one event per step.

    stop(row, final_tokens) is called when a row's final tokens grow; True ends that row
    (stop strings live in the caller, which knows text). `results`, if given, is filled with
    one `RowResult` per prompt (complete once the row finishes). `constraint(row)`, if given,
    makes each row's constraint (a fresh one per row: constraints keep state).
    `model` may be a `Runtime` (an `LLM`'s: its drafter, store, prefix cache); its prefix
    cache reuses and keeps committed prefixes across calls (cached=False: not in this call);
    `marks[row]` are that prompt's snapshot positions (`BatchDecoder.add`).
    """
    if not prompts:
        return
    batch = BatchDecoder(model, cached)
    for p in prompts:  # every prompt is checked before any is prefilled
        check_request(batch.model, p, policy, max_new_tokens, batch.runtime.drafter is not None)
    try:
        rows = [
            batch.add(
                p,
                policy,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                eos_token_ids=eos_token_ids,
                stop=stop,
                index=i,
                seed_index=i,
                constraint=constraint(i) if constraint is not None else None,
                marks=marks[i] if marks is not None else (),
            )
            for i, p in enumerate(prompts)
        ]
        if results is not None:
            results[:] = [r.result for r in rows]
        while batch.active:
            yield batch.step()
    finally:
        batch.close()  # stopped early: rows leave (saving what they committed)
