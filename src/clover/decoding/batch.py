"""The rows decoded together and their shared cache: who joins, who leaves.

A `Batch` holds the active rows (cache row k belongs to active[k]) and admits new ones
between steps (`add`; several at once: `joining`), each with its own policy, sampling, budget,
EOS ids and stop check. A joining row's prompt reaches the cache through `prefill.py` (the
prefix cache first); a leaving row (finished or cancelled) saves what it committed there. The
steps themselves are `loop.BatchDecoder`'s.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Hashable, Iterator

import torch

from clover.decoding.constraints import LogitsConstraint
from clover.decoding.drafting import DrafterRunner
from clover.decoding.policies import Policy, Source, check_request
from clover.decoding.prefill import Prefill
from clover.decoding.rows import BlockRow, Row
from clover.decoding.runtime import Runtime, runtime_of
from clover.decoding.sampling import SamplingParams
from clover.decoding.spec_row import SpecRow
from clover.errors import CloverError
from clover.models.base import DiffusionLM
from clover.models.cache import ModelCache


def on_model_device(method: Callable) -> Callable:
    """Run a batch's method with PyTorch's tensor factories defaulting to the model's
    device, so every tensor the loop, the rows, the cache and the model make lands there (a
    GPU); on the CPU nothing changes. Entered per call, never across a yield."""

    @functools.wraps(method)
    def wrapper(self: Batch, *args: object, **kwargs: object) -> object:
        if self.device.type == "cpu":
            return method(self, *args, **kwargs)
        with torch.device(self.device):
            return method(self, *args, **kwargs)

    return wrapper


class Batch:
    def __init__(self, model: DiffusionLM | Runtime, cached: bool = True) -> None:
        """model: a `Runtime` (an `LLM`'s), or a bare model (a fresh runtime for this batch).
        cached=False: no prefix cache, whatever the runtime holds."""
        self.runtime = runtime = runtime_of(model)
        self.model = model = runtime.model
        self.prefix = prefix_cache = runtime.prefix_cache if cached else None
        # True while a step runs, and after one failed: the cache may then hold half a pass,
        # so nothing is saved from it (rows are only released) until the batch is empty
        self._busy = False
        self.config = model.config
        self.mask_id = self.config.mask_token_id if self.config.mask_token_id is not None else 0
        self.prefill = Prefill(model, prefix_cache, self.mask_id)
        self.device = next(model.parameters()).device
        self.cache = None
        self.active: list[Row] = []  # cache row k belongs to active[k]
        self.step_count = 0
        self._next = 0
        # the drafter's context rows, aligned with the cache's, once a row drafts with it
        self.drafting: DrafterRunner | None = None
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
        partition: Hashable = None,
    ) -> Row:
        """Queue a prompt into the batch; returns its row (its `.result` fills as it runs).
        `constraint` limits which tokens the row may commit (`constraints.py`). `marks`:
        prompt positions worth a prefix-cache snapshot (e.g. where the chat template's last
        user turn starts), for models with recurrent layers. `partition`: the prefix-cache
        partition the row reads and feeds (a server's tenant and cache salt)."""
        t_added = time.perf_counter()
        check_request(self.model, prompt, policy, max_new_tokens, self.runtime.drafter is not None)
        row = self._new_row(prompt, policy, max_new_tokens, sampling, index, seed_index)
        row.eos, row.stop, row.constraint = set(eos_token_ids), stop, constraint
        row.t_added, row.marks, row.partition = t_added, tuple(marks), partition
        if isinstance(row, SpecRow):
            self._give_sources(row)
        self._admit(row)
        return row

    def _new_row(
        self,
        prompt: list[int],
        policy: Policy,
        max_new: int,
        sampling: SamplingParams | None,
        index: int | None,
        seed_index: int,
    ) -> Row:
        sampling = sampling or SamplingParams()
        gen = torch.Generator(device=self.device)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed * 1_000_003 + seed_index)
        else:
            gen.seed()  # unseeded sampling: fresh OS entropy, so two such requests differ
        if index is None:
            index, self._next = self._next, self._next + 1
        # the answer may use what the context leaves; it then ends with reason "length"
        budget = min(max_new, self.model.context_length - len(prompt))
        args = (index, prompt, budget, policy, gen)
        row = SpecRow(*args) if policy.speculative else BlockRow(*args, shifted=self.config.shifted)
        row.sampling = sampling
        return row

    def _give_sources(self, row: SpecRow) -> None:
        """What a self_spec row's draft sources take from the runtime: the drafter (its
        runner starts with the first row that drafts), the pass costs and the acceptance
        earlier rows saw (adaptive rows), the n-gram store."""
        sources, policy = row.sources, row.policy
        if sources.uses_drafter and self.drafting is None:
            self.drafting = self.runtime.drafter_runner(cached=self.prefix is not None)
            for _ in self.active:  # rows already running draft otherwise: empty contexts
                self.drafting.add_row()
        if policy.adaptive and (sources.looks_up or sources.uses_drafter):
            sources.costs = self.runtime.pass_costs(sources.uses_drafter)
            sources.share_acceptance(self.runtime.shared_acceptance)
        if Source.STORE in policy.sources:
            sources.store = self.runtime.ngram_store()

    def _admit(self, row: Row) -> None:
        """The row's prompt into a cache of its own (`Prefill.start`), which then joins the
        batch's; a prompt joining a running batch inside a `joining()` block waits for the
        others (into an idle batch it goes straight in: the next step prefills it with the
        rest)."""
        cache = self.model.make_cache(1)
        if row.policy.speculative:
            cache.enable_rollback()
        dcache = self.drafting.make_cache() if self.drafting is not None else None
        drafts = getattr(row, "uses_drafter", False)
        running = bool(self.step_count and self.active)
        joins = self._joiners is not None and not drafts and running
        try:
            with torch.inference_mode():
                # a drafting row's drafter reads its prefill (a draft model: at its first draft)
                own = dcache if drafts and self.drafting.reads_prefill else None
                self.prefill.start(row, cache, self.drafting, own, running, defer=joins)
        except BaseException:
            self.prefill.release(row)
            raise
        if joins:
            self._joiners.append((row, cache))
            return
        self.cache = cache if self.cache is None else self.cache.extend(cache)
        if self.drafting is not None:
            self.drafting.add_row(dcache)
        self.active.append(row)

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
                self.prefill.release(row)
            raise
        finally:
            self._joiners = None

    @on_model_device
    def _prefill_joiners(self, joiners: list[tuple[Row, ModelCache]]) -> None:
        """One pass prefills the joiners' prompts; their caches join the batch's, once."""
        rows, cache = self.prefill.together(joiners)
        self.cache = cache if self.cache is None else self.cache.extend(cache)
        if self.drafting is not None:
            for _ in rows:
                self.drafting.add_row(self.drafting.make_cache())
        self.active += rows

    def _leave(self, k: int, save: bool) -> None:
        """Row k leaves: save what it committed (unless the cache may be inconsistent), then
        unpin its chain."""
        r = self.active[k]
        if self.prefix is not None and save and not self._busy:
            self.prefill.save(r, self.cache, k)
        self.prefill.release(r)

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
                self.prefill.release(r)
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
