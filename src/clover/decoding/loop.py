"""The decoding loop, written once for every decoder, batch size and model.

Each step: every active row plans its input (tokens to commit causally onto its prefix, then
its block), the rows are padded into one forward pass over the shared cache, the logits every
row needs are computed in one call, and each row updates itself (`rows.py`: `BlockRow` for
ar / low_confidence, `SpecRow` for self_spec). Rows finish on their own (EOS, token budget,
the caller's stop check) and leave the batch; the cache drops their rows.

The loop sees token ids only and yields a `StepEvent` per step; CLI, server, benchmarks and
visualisers all consume that stream. NFE counts forward passes a row took part in.

With a `PrefixCache` (`prefix_cache.py`), a joining row first reuses the longest cached prefix
of its prompt, and rows save what they committed: the prompt once it is in the cache, and
everything when they finish or are cancelled. Each row's committed ids (`Row.committed`) are
kept exact here (commits of each pass, minus rolled-back speculation), so only causal tokens
are ever saved. A model with recurrent layers prefills a new prompt alone, in passes that end
at its snapshot points (caller's `marks`, every `snapshot_every` tokens, one before the end).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from clover.decoding.constraints import LogitsConstraint
from clover.decoding.costs import PassCosts, model_costs, relax_shared
from clover.decoding.drafting import DrafterRunner
from clover.decoding.policies import Policy, Source
from clover.decoding.prefix_cache import PrefixCache
from clover.decoding.rows import BlockRow, Row, RowResult, first_eos
from clover.decoding.sampling import SamplingParams, greedy_picks
from clover.decoding.spec_row import SpecRow
from clover.decoding.store import existing_store, model_store
from clover.errors import CloverError
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
    [B, T, F] (None without a drafter), each row's committed count [B], the width T."""

    hidden: torch.Tensor | None = None
    features: torch.Tensor | None = None
    n_commit: torch.Tensor | None = None
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


def _check(model: DiffusionLM, prompts: list[list[int]], policy: Policy, max_new: int) -> None:
    config = model.config
    if any(len(p) == 0 for p in prompts):
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
    drafter = policy.speculative and Source.DRAFTER in policy.sources
    if drafter and getattr(model, "drafter", None) is None:
        raise CloverError(
            f"draft {policy.draft!r} needs a drafter for this model: load one with --drafter "
            "FILE (`clover train drafter` makes one)"
        )
    longest = max(len(p) for p in prompts)
    if longest >= model.context_length:
        raise CloverError(
            f"prompt of {longest} tokens does not fit the model's context of "
            f"{model.context_length} (prompt + generation)"
        )


def on_model_device(method: Callable) -> Callable:
    """Run a BatchDecoder method with PyTorch's tensor factories defaulting to the model's
    device, so every tensor the loop, the rows, the cache and the model make lands there (a
    GPU); on the CPU nothing changes. Entered per call, never across a yield."""

    @functools.wraps(method)
    def wrapper(self: BatchDecoder, *args: object, **kwargs: object) -> object:
        if self.device.type == "cpu":
            return method(self, *args, **kwargs)
        with torch.device(self.device):
            return method(self, *args, **kwargs)

    return wrapper


class BatchDecoder:
    """Sequences decoded together, one forward per step; rows may join (`add`) and leave
    (`cancel`) between steps, each with its own policy, sampling, budget, EOS ids and stop
    check. `generate` below is this with all rows added up front; the server keeps one."""

    def __init__(self, model: DiffusionLM, prefix_cache: PrefixCache | None = None) -> None:
        self.model = model
        self.prefix = prefix_cache
        # True while a step runs, and after one failed: the cache may then hold half a pass,
        # so nothing is saved from it (rows are only released) until the batch is empty
        self._busy = False
        self.config = model.config
        self.mask_id = self.config.mask_token_id if self.config.mask_token_id is not None else 0
        self.device = next(model.parameters()).device
        self.cache = None
        self.active: list[Row] = []  # cache row k belongs to active[k]
        self.step_count = 0
        self._next = 0
        # the drafter's context rows, aligned with the cache's, once a row drafts with it
        self.drafting: DrafterRunner | None = None
        self._costs: dict[bool, PassCosts] = {}  # with / without the drafter's pass
        # on_logits(row index, the row's logits [n, V], its commits [(answer index, token)])
        # after every update: for callers that keep the distributions (`clover data distill`)
        self.on_logits: Callable[[int, torch.Tensor, list], None] | None = None
        # inside `joining()`: rows whose prompts wait to be prefilled together (row, 1-row cache)
        self._joiners: list[tuple[Row, object]] | None = None

    @on_model_device
    def add(
        self,
        prompt: list[int],
        policy: Policy,
        *,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        stop: Callable[[int, list[int]], bool] | None = None,
        index: int | None = None,
        seed_index: int = 0,
        constraint: LogitsConstraint | None = None,
        marks: tuple[int, ...] | list[int] = (),
        partition: object = None,
    ) -> Row:
        """Queue a prompt into the batch; returns its row (its `.result` fills as it runs).
        `constraint` limits which tokens the row may commit (`constraints.py`). `marks`:
        prompt positions worth a prefix-cache snapshot (e.g. where the chat template's last
        user turn starts), for models with recurrent layers. `partition`: the prefix-cache
        partition the row reads and feeds (a server's tenant and cache salt)."""
        t_added = time.perf_counter()
        _check(self.model, [prompt], policy, max_new_tokens)
        sampling = sampling or SamplingParams()
        gen = torch.Generator(device=self.device)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed * 1_000_003 + seed_index)
        else:
            gen.seed()  # unseeded sampling: fresh OS entropy, so two such requests differ
        if index is None:
            index, self._next = self._next, self._next + 1
        # the answer may use what the context leaves; it then ends with reason "length"
        budget = min(max_new_tokens, self.model.context_length - len(prompt))
        args = (index, prompt, budget, policy, gen)
        row = SpecRow(*args) if policy.speculative else BlockRow(*args, shifted=self.config.shifted)
        row.sampling, row.eos, row.stop = sampling, set(eos_token_ids), stop
        row.constraint = constraint
        row.t_added, row.marks = t_added, tuple(marks)
        row.partition = partition
        if isinstance(row, SpecRow):
            sources = row.sources
            if sources.uses_drafter and self.drafting is None:
                self.drafting = DrafterRunner(self.model, self.model.drafter)
                for _ in self.active:  # rows already running draft otherwise: empty contexts
                    self.drafting.add_row()
            if policy.adaptive and (sources.looks_up or sources.uses_drafter):
                sources.costs = self._pass_costs(sources.uses_drafter)
                sources.share_acceptance(self.model)
            if Source.STORE in policy.sources:
                sources.store = model_store(self.model)
        cache = self.model.make_cache(1)
        if policy.speculative:
            cache.enable_rollback()
        dcache = self.drafting.drafter.make_cache(1) if self.drafting is not None else None
        drafts = getattr(row, "uses_drafter", False)
        # a prompt joining a running batch waits for the others added in the `joining()` block
        # (into an idle batch it goes straight in: the next step prefills it with the rest)
        joins = self._joiners is not None and not drafts and bool(self.step_count and self.active)
        try:
            with torch.inference_mode():
                self._start(row, cache, dcache if drafts else None, defer=joins)
        except BaseException:
            if self.prefix is not None:
                self.prefix.release(row.pin)
            raise
        if joins:
            self._joiners.append((row, cache))
            return row
        self.cache = cache if self.cache is None else self.cache.extend(cache)
        if self.drafting is not None:
            self.drafting.add_row(dcache)
        self.active.append(row)
        return row

    def _pass_costs(self, drafter: bool) -> PassCosts:
        """This machine's pass costs for the model (and its drafter), measured on first use."""
        if drafter not in self._costs:
            self._costs[drafter] = model_costs(self.model, drafter)
        return self._costs[drafter]

    def _start(self, row: Row, cache: object, dcache: object = None, defer: bool = False) -> None:
        """Reuse the longest cached prefix of the row's prompt (into its fresh 1-row cache),
        then prefill alone what must be: the rest of the prompt of a model with recurrent
        layers (snapshots on the way), or a prompt joining a running batch, so the batch's
        next step is not padded to its length for every row. The last prompt token always
        stays pending: its pass gives the first logits. With `defer`, a joining prompt's
        prefill is left to `joining()`; passes that end at snapshots never are."""
        prompt, prefix = row.prompt, self.prefix
        recurrent = any(layer.recurrent for layer in cache.layers)
        end = len(prompt) - 1
        if prefix is not None:
            hit = prefix.lookup(prompt, end, exact=recurrent, partition=row.partition)
            prefix.restore(hit, cache)
            row.pin = prefix.hold(hit)
            row.committed, row.pending = prompt[: hit.length], prompt[hit.length :]
            row.result.cached_tokens = hit.length
        stops: set[int] = set()
        if prefix is not None and recurrent:
            every = prefix.snapshot_every
            stops = {*row.marks, *range(every, end, every), end}
        elif self.step_count and self.active:
            stops = set() if defer else {end}
        states = {}
        for stop in sorted(p for p in stops if len(row.committed) < p <= end):
            ids = row.pending[: stop - len(row.committed)]
            x = torch.tensor([ids], device=self.device)
            if dcache is None:
                self.model(x, cache, "causal")
            else:  # a drafting row: its drafter reads the features of what is committed
                _, feats = self.model(x, cache, "causal", capture=self.drafting.layers)
                self.drafting.drafter.commit(feats, torch.tensor([len(ids)]), dcache)
            row.committed += ids
            del row.pending[: len(ids)]
            row.result.nfe += 1
            if prefix is not None and recurrent:
                states[stop] = prefix.capture(cache, 0)
        if prefix is not None and len(row.committed) >= end:
            self._save(row, cache, 0, states)

    @contextlib.contextmanager
    def joining(self) -> Iterator[None]:
        """Rows added inside this block join together: the prompts that would each be
        prefilled alone (a running batch's joiners) share one padded pass when it ends, and
        the batch's cache grows once. On a GPU a pass of a small model costs about the same for
        one prompt or dozens, and every join copied the whole cache (`clover data distill`
        refills finished rows this way). Rows of a block that raises are dropped; if the shared
        pass fails, none of its rows joins and the error propagates."""
        if self._joiners is not None:
            raise CloverError("joining() blocks do not nest")
        self._joiners = []
        try:
            yield
            joiners, self._joiners = self._joiners, None
            if joiners:
                self._prefill_joiners(joiners)
        except BaseException:
            for row, _ in self._joiners or ():
                if self.prefix is not None:
                    self.prefix.release(row.pin)
            raise
        finally:
            self._joiners = None

    @on_model_device
    def _prefill_joiners(self, joiners: list[tuple[Row, object]]) -> None:
        """One pass prefills what the joiners' prompts still need (all but the last token),
        over the rows that need it; then every joiner's cache joins the batch's, once."""
        todo = [(r, c, len(r.prompt) - 1 - len(r.committed)) for r, c in joiners]
        todo.sort(key=lambda j: j[2] == 0)  # the rows that need the pass first
        rows, n = [r for r, _, _ in todo], [k for _, _, k in todo]
        cache = todo[0][1]
        try:
            need = sum(1 for k in n if k)
            for _, other, _ in todo[1:need]:
                cache.extend(other)
            if need:
                T = max(n)
                ids = [r.pending[:k] + [self.mask_id] * (T - k) for r, k in zip(rows, n[:need])]
                ids = torch.tensor(ids, dtype=torch.long, device=self.device)
                count = torch.tensor(n[:need])
                with torch.inference_mode():
                    self.model(ids, cache, "block", n_commit=count, n_valid=count)
                    for i, (r, k) in enumerate(zip(rows[:need], n)):
                        r.committed += r.pending[:k]
                        del r.pending[:k]
                        r.result.nfe += 1
                        if self.prefix is not None:
                            self._save(r, cache, i, {})
            for _, other, _ in todo[max(need, 1) :]:
                cache.extend(other)
        except BaseException:
            if self.prefix is not None:
                for r in rows:
                    self.prefix.release(r.pin)
            raise
        self.cache = cache if self.cache is None else self.cache.extend(cache)
        if self.drafting is not None:
            for _ in rows:
                self.drafting.add_row(self.drafting.drafter.make_cache(1))
        self.active += rows

    def _save(self, row: Row, cache: object, k: int, states: dict | None = None) -> None:
        """Save row's committed state (cache row k) into the prefix cache: the first time,
        with snapshots at its marks and one token before its prompt's end. `states`: the
        recurrent states captured during a prefill in passes, by position; None (a save
        between steps) also snapshots where the row is now: where it ends when it leaves,
        its prompt's end (or just past it) after its first pass."""
        snaps = {} if states is None else dict(states)
        if not row.prompt_saved:
            for p in (*row.marks, len(row.prompt) - 1):
                snaps.setdefault(p, None)
        if states is None:
            snaps[len(row.committed)] = None
        row.pin = self.prefix.save(cache, k, row.committed, snaps, row.pin, row.partition)
        row.prompt_saved = True

    def _leave(self, k: int, save: bool) -> None:
        """Row k leaves: save what it committed (unless the cache may be inconsistent), then
        unpin its chain."""
        r = self.active[k]
        if self.prefix is None:
            return
        if save and not self._busy:
            self._save(r, self.cache, k)
        self.prefix.release(r.pin)
        r.pin = None

    @property
    def rows(self) -> int:
        """Rows running plus those waiting to join at the end of a `joining()` block."""
        return len(self.active) + len(self._joiners or ())

    @on_model_device
    def cancel(self, index: int) -> bool:
        """Drop a row at once (a client went away); False if it is not running."""
        for k, (r, _) in enumerate(self._joiners or ()):
            if r.index == index:  # not prefilled yet: nothing to save
                r.result.finish_reason = r.result.finish_reason or "cancelled"
                if self.prefix is not None:
                    self.prefix.release(r.pin)
                del self._joiners[k]
                return True
        for k, r in enumerate(self.active):
            if r.index == index:
                r.result.finish_reason = r.result.finish_reason or "cancelled"
                with torch.inference_mode():
                    self._leave(k, save=True)
                self._keep([j for j in range(len(self.active)) if j != k])
                return True
        return False

    def close(self) -> None:
        """Cancel every row still running (the caller stopped early)."""
        for r in list(self.active):
            self.cancel(r.index)

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.active):
            return
        self.active = [self.active[k] for k in keep]
        if self.drafting is not None:
            self.drafting.select(keep)
        if self.active:
            self.cache.select(keep)
        else:
            self.cache = None
            self._busy = False  # nothing left that a failed pass could have touched

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
        plans = [r.plan(self.mask_id) for r in self.active]
        return self._fit_lookup_drafts(plans) if len(self.active) > 1 else plans

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
        return _Pass(hidden, features, n_commit, T)

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
    ) -> tuple[StepEvent, list[int], torch.Tensor]:
        """Every row takes its logits and commits; -> (the step's event, the rows that stay,
        the tokens each row rolls back)."""
        active = self.active
        plain = [r.constraint is None and r.sampling.greedy for r in active]
        greedy = greedy_picks(logits, plain, [r.policy.uses_confidence for r in active])
        n_rows = sum(1 for t, _ in plans if t)
        event = StepEvent(self.step_count, [], {}, {}, n_rows, width * len(active), 0.0)
        rollback = torch.zeros(len(active), dtype=torch.long)
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
        store = existing_store(self.model)
        if store is not None:  # later answers may draft from this one
            store.learn(r.prompt + final)
        r.result.steps = r.answer_steps[: len(final)]
        if len(r.result.steps) < len(final):  # ended mid-block by the caller's stop
            r.result.steps += r.block_steps[: len(final) - len(r.result.steps)]
        r.result.finish_reason = reason
        event.finished[r.index] = reason
        return False

    def _settle(self, plans: list, out: _Pass, rollback: torch.Tensor, keep: list[int]) -> None:
        """After the rows' updates: a tree's kept branch moves behind its root, rejected
        tokens leave the cache, the drafter drafts the next blocks."""
        for k, r in enumerate(self.active):
            branch = getattr(r, "kept_branch", None)
            if branch:
                first = plans[k][1] - int(rollback[k]) - len(branch)  # where the branch goes
                with torch.inference_mode():
                    self.cache.keep_branch(k, int(out.n_commit[k]), first, branch)
                    if out.features is not None:
                        out.features[k, first : first + len(branch)] = out.features[k, branch]
                end = len(r.committed) - plans[k][1] + first
                r.committed[end : end + len(branch)] = [plans[k][0][i] for i in branch]
        if bool(rollback.any()):
            self.cache.rollback(rollback)
            for r, n in zip(self.active, rollback.tolist()):
                del r.committed[len(r.committed) - n :]
        if self.drafting is not None and out.width:
            self.drafting.draft_for(self.active, out.features, out.n_commit - rollback, keep,
                                    self.config.mask_token_id)  # fmt: skip
        relax_shared(self.model)  # the shared acceptance estimates drift once per step

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
                        self._save(r, self.cache, k)
        self._keep(keep)
        self._busy = False


def generate(
    model: DiffusionLM,
    prompts: list[list[int]],
    policy: Policy,
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    stop: Callable[[int, list[int]], bool] | None = None,
    results: list[RowResult] | None = None,
    constraint: Callable[[int], LogitsConstraint | None] | None = None,
    prefix_cache: PrefixCache | None = None,
    marks: list[tuple[int, ...]] | None = None,
) -> Iterator[StepEvent]:
    """Decode every prompt (lists of token ids, any lengths); yields one event per step.

    stop(row, final_tokens) is called when a row's final tokens grow; True ends that row
    (stop strings live in the caller, which knows text). `results`, if given, is filled with
    one `RowResult` per prompt (complete once the row finishes). `constraint(row)`, if given,
    makes each row's constraint (a fresh one per row: constraints keep state).
    `prefix_cache` reuses and keeps committed prefixes across calls; `marks[row]` are that
    prompt's snapshot positions (`BatchDecoder.add`).
    """
    if not prompts:
        return
    batch = BatchDecoder(model, prefix_cache)
    for p in prompts:  # every prompt is checked before any is prefilled
        _check(model, [p], policy, max_new_tokens)
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
