"""The decoding loop, written once for every decoder, batch size and model.

Each step: every active row plans its input (tokens to commit causally onto its prefix, then
its block), the rows are padded into one forward pass over the shared cache, the logits every
row needs are computed in one call, and each row updates itself (`rows.py`: `BlockRow` for
ar / low_confidence, `SpecRow` for self_spec). Rows finish on their own (EOS, token budget,
the caller's stop check) and leave the batch; the cache drops their rows.

The loop sees token ids only and yields a `StepEvent` per step; CLI, server, benchmarks and
visualisers all consume that stream. NFE counts forward passes a row took part in.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from clover.decoding.constraints import LogitsConstraint
from clover.decoding.policies import Policy
from clover.decoding.rows import BlockRow, Row, RowResult, SpecRow, first_eos
from clover.decoding.sampling import SamplingParams
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

    def __init__(self, model: DiffusionLM) -> None:
        self.model = model
        self.config = model.config
        self.mask_id = self.config.mask_token_id if self.config.mask_token_id is not None else 0
        self.device = next(model.parameters()).device
        self.cache = None
        self.active: list[Row] = []  # cache row k belongs to active[k]
        self.step_count = 0
        self._next = 0

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
    ) -> Row:
        """Queue a prompt into the batch; returns its row (its `.result` fills as it runs).
        `constraint` limits which tokens the row may commit (`constraints.py`)."""
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
        cache = self.model.make_cache(1)
        if policy.speculative:
            cache.enable_rollback()
        if self.step_count and self.active and len(prompt) > 1:
            # joining a running batch: prefill alone, so the batch's next step is not padded
            # to this prompt's length for every row (one extra pass for this row only)
            with torch.inference_mode():
                self.model(torch.tensor([prompt[:-1]], device=self.device), cache, "causal")
            row.pending = [prompt[-1]]
            row.result.nfe += 1
        self.cache = cache if self.cache is None else self.cache.extend(cache)
        self.active.append(row)
        return row

    @on_model_device
    def cancel(self, index: int) -> bool:
        """Drop a row at once (a client went away); False if it is not running."""
        for k, r in enumerate(self.active):
            if r.index == index:
                r.result.finish_reason = r.result.finish_reason or "cancelled"
                self._keep([j for j in range(len(self.active)) if j != k])
                return True
        return False

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.active):
            return
        self.active = [self.active[k] for k in keep]
        if self.active:
            self.cache.select(keep)
        else:
            self.cache = None

    def _fit_lookup_drafts(self, plans: list[tuple[list[int], int]]) -> list:
        """In a batch every row's pass is padded to the longest, so a context-lookup draft may
        only fill what the other rows' passes take anyway: one row's 3-token guess must not
        make all rows pay 4 positions (measured: lookup at batch 8 was 0.85x `ar` before)."""
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
        self.step_count += 1
        model, active, mask_id = self.model, self.active, self.mask_id
        plans = [r.plan(mask_id) for r in active]
        if len(active) > 1:
            plans = self._fit_lookup_drafts(plans)
        T = max((len(tokens) for tokens, _ in plans), default=0)
        hidden = None
        if T:
            # one host-to-device copy for the whole batch (a GPU step pays per copy)
            rows = [tokens + [mask_id] * (T - len(tokens)) for tokens, _ in plans]
            ids = torch.tensor(rows, dtype=torch.long, device=self.device)
            n_valid = torch.tensor([len(t) for t, _ in plans])
            n_commit = torch.tensor([c for _, c in plans])
            with torch.inference_mode():
                hidden = model(ids, self.cache, "block", n_commit=n_commit, n_valid=n_valid)
        wanted, counts = [], []
        for k, r in enumerate(active):
            if plans[k][0]:
                r.result.nfe += 1
            vectors = r.wanted(None if hidden is None else hidden[k], plans[k][1])
            wanted += vectors
            counts.append(len(vectors))
        logits = None
        if wanted:
            with torch.inference_mode():
                logits = model.logits(torch.stack(wanted))  # [N, V]
                if self.config.mask_token_id is not None:
                    logits[:, self.config.mask_token_id] = float("-inf")  # never an answer
        n_rows = sum(1 for t, _ in plans if t)
        event = StepEvent(self.step_count, [], {}, {}, n_rows, T * len(active), 0.0)
        rollback = torch.zeros(len(active), dtype=torch.long)
        keep, start = [], 0
        for k, r in enumerate(active):
            row_logits = logits[start : start + counts[k]] if counts[k] else torch.empty(0)
            start += counts[k]
            commits, rollback[k] = r.update(row_logits, r.sampling, r.eos)
            event.commits += [Commit(r.index, i, t, r.steps) for i, t in commits]
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
                keep.append(k)
                continue
            r.result.tokens = final
            r.result.steps = r.answer_steps[: len(final)]
            if len(r.result.steps) < len(final):  # ended mid-block by the caller's stop
                r.result.steps += r.block_steps[: len(final) - len(r.result.steps)]
            r.result.finish_reason = reason
            event.finished[r.index] = reason
        if bool(rollback.any()):
            self.cache.rollback(rollback)
        self._keep(keep)
        event.seconds = time.perf_counter() - t0
        return event


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
) -> Iterator[StepEvent]:
    """Decode every prompt (lists of token ids, any lengths); yields one event per step.

    stop(row, final_tokens) is called when a row's final tokens grow; True ends that row
    (stop strings live in the caller, which knows text). `results`, if given, is filled with
    one `RowResult` per prompt (complete once the row finishes). `constraint(row)`, if given,
    makes each row's constraint (a fresh one per row: constraints keep state).
    """
    if not prompts:
        return
    batch = BatchDecoder(model)  # `add` checks every prompt before the first step
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
        )
        for i, p in enumerate(prompts)
    ]
    if results is not None:
        results[:] = [r.result for r in rows]
    while batch.active:
        yield batch.step()
