"""Speculation tuned to the machine: what a causal pass costs by width here (measured once per
model, precision, threads and device by `timing.py`, then cached), how often each draft
position is accepted (per row, as it decodes), and from both the draft length that maximises
expected tokens per second.

A pass verifying k drafted tokens yields 1 + (accepted run) tokens, in expectation
    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k
(a_i: the chance that draft position i is kept once the ones before it were), and costs
verify(1 + k) + draft(k) milliseconds. The length chosen is the k in 0 .. max that maximises
E(k) / cost(k); k = 0 is a plain AR step, which is what a row falls back to while its drafts
lose. The acceptance estimates drift back toward a prior at every step, so a row that stopped
drafting tries again later (contexts change: code repeats, prose does not).

In a batch the pass is as wide as its widest row: the drafting rows share one length, the one
whose expected tokens for the whole batch per ms of a batched pass is highest (`batch_length`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate


@dataclass
class PassCosts:
    """ms of a causal pass by width (tokens per row, the LM head over all of them), and
    optionally of a drafter pass by draft length; `rows_ms` / `draft_rows_ms`: the same for
    batches of several rows ({rows: {width: ms}}; empty: not measured, batches do not draft)."""

    verify_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    rows_ms: dict[int, dict[int, float]] = field(default_factory=dict)
    draft_rows_ms: dict[int, dict[int, float]] = field(default_factory=dict)
    # pass_ms's lists, by its arguments (the tables above never change once made)
    _memo: dict[tuple, list[float]] = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def _at(table: dict[int, float], w: int) -> float:
        """Linear between measured widths, flat past the last."""
        if not table:
            return 0.0
        keys = sorted(table)
        if w <= keys[0]:
            return table[keys[0]] * w / keys[0] if keys[0] > 1 else table[keys[0]]
        for lo, hi in zip(keys, keys[1:]):
            if w <= hi:
                return table[lo] + (table[hi] - table[lo]) * (w - lo) / (hi - lo)
        return table[keys[-1]] * w / keys[-1]

    def verify(self, width: int) -> float:
        return self._at(self.verify_ms, width)

    def draft(self, k: int) -> float:
        return self._at(self.draft_ms, k + 1) if k else 0.0

    def _rows(self, tables: dict[int, dict[int, float]], one: dict[int, float], rows: int,
              w: int) -> float:  # fmt: skip
        """Linear in rows between the measured batches (batch 1: the single-row table)."""
        measured = {1: one, **tables}
        keys = sorted(measured)
        lo = max((k for k in keys if k <= rows), default=keys[0])
        hi = min((k for k in keys if k >= rows), default=keys[-1])
        a, b = self._at(measured[lo], w), self._at(measured[hi], w)
        if lo == hi:
            return a * rows / lo
        return a + (b - a) * (rows - lo) / (hi - lo)

    def verify_batch(self, rows: int, width: int) -> float:
        return self._rows(self.rows_ms, self.verify_ms, rows, width)

    def draft_batch(self, rows: int, k: int) -> float:
        return self._rows(self.draft_rows_ms, self.draft_ms, rows, k + 1) if k else 0.0

    def pass_ms(self, rows: int, most: int, drafter: bool) -> list[float]:
        """[k] -> ms of a pass of `rows` rows that verifies k drafts (with the drafter's
        passes that drafted them when `drafter`), k = 0 .. most; made once per arguments
        (a batch asks every step)."""
        key = (rows, most, drafter)
        if key not in self._memo:
            if rows == 1:
                verify, draft = self.verify, self.draft
            else:
                verify = lambda w: self.verify_batch(rows, w)  # noqa: E731
                draft = lambda k: self.draft_batch(rows, k)  # noqa: E731
            self._memo[key] = [verify(1 + k) + (draft(k) if drafter else 0.0)
                               for k in range(most + 1)]  # fmt: skip
        return self._memo[key]


def best_length(accept: list[float], costs: PassCosts, most: int, drafter: bool = False,
                stops: bool = False) -> int:  # fmt: skip
    """The draft length in 0 .. most with the highest expected tokens per ms; `stops`: the
    drafter's chains stop themselves (`chain_cost`)."""
    return best_rate(accept, costs, most, drafter, stops)[0]


def best_rate(accept: list[float], costs: PassCosts, most: int, drafter: bool = False,
              stops: bool = False) -> tuple[int, float]:  # fmt: skip
    """(that length, its expected tokens per ms)."""
    if drafter and stops:
        draft = chain_cost(accept, costs.draft)
        return _best([accept], 0, [costs.verify(1 + k) + draft(k) for k in range(most + 1)])
    return _best([accept], 0, costs.pass_ms(1, most, drafter))


def chain_cost(accept: list[float], draft: Callable[[int], float]) -> Callable[[int], float]:
    """k -> the expected ms of a chain of at most k drafts that stops itself where its drafts
    become unlikely (`ModelDraftRunner.STOP_BELOW`): its pass for draft i runs as often as
    the drafts before it are kept (their acceptance stands in for the draft model's own
    certainty, which is what stops the chain)."""

    def cost(k: int) -> float:
        total, survive = 0.0, 1.0
        for i in range(1, k + 1):
            total += (draft(i) - draft(i - 1)) * survive
            survive *= accept[i - 1] if i - 1 < len(accept) else accept[-1]
        return total

    return cost


def batch_length(accepts: list[list[float]], riders: int, costs: PassCosts, most: int) -> int:
    """The draft length, common to a batch's drafting rows (a batch's pass is as wide as its
    widest row), with the highest expected tokens per ms: `accepts` holds each drafting row's
    acceptance by position, `riders` counts the rows that make one token a pass whatever the
    length. 0 (no drafts) where batched passes were not measured."""
    rows = len(accepts) + riders
    if not accepts or (rows > 1 and not costs.rows_ms):
        return 0
    return _best(accepts, riders, costs.pass_ms(rows, most, True))[0]


def _best(accepts: list[list[float]], riders: int, cost: list[float]) -> tuple[int, float]:
    """The length k in 0 .. len(cost) - 1 that maximises the expected tokens per ms of one
    pass over the drafting rows (`accepts`: each one's acceptance by position) and `riders`
    rows of one token: E(k) / cost[k] (cost[k]: the pass that verifies k drafts, with their
    drafting); -> (k, that rate)."""
    rows = len(accepts) + riders
    best_k, best = 0, rows / cost[0]
    survive, expected = [1.0] * len(accepts), float(rows)
    # no longer length can pay more once even every later draft kept (acceptances are at
    # most 1) over the cheapest longer pass does not: the search stops there
    floor = list(accumulate(reversed(cost), min))[::-1]  # floor[k]: min(cost[k:])
    bounded = max(map(max, accepts), default=0.0) <= 1.0
    most = len(cost) - 1
    for k in range(1, most + 1):
        for i, a in enumerate(accepts):
            survive[i] *= a[k - 1] if k - 1 < len(a) else a[-1]
            expected += survive[i]
        rate = expected / cost[k]
        if rate > best:
            best_k, best = k, rate
        if bounded and k < most:
            ceiling = (expected + sum(survive) * (most - k)) / floor[k + 1]
            if ceiling * (1 + 1e-12) < best:
                break
    return best_k, best


class Acceptance:
    """Per draft position, the running chance that it is kept (given the ones before were).

    With `shared` (`Runtime.shared_acceptance`: one per model and draft source, fed by every
    row) a row starts from what the rows before it saw and drifts back toward that, not
    toward a fixed prior: a fresh row of a weak drafter starts pessimistic instead of paying for
    drafts until it learns. The shared estimate itself drifts slowly toward the prior, so a
    source that stopped drafting everywhere is tried again later.

    `update` takes evidence, `relax` drifts: a row calls `relax` once per step (whether it
    drafted or not), and the decode loop relaxes the shared estimates once per step
    (`Runtime.relax`), however many rows run."""

    def __init__(self, positions: int, prior: float = 0.6, rate: float = 0.2,
                 drift: float = 0.02, shared: Acceptance | None = None) -> None:  # fmt: skip
        self.shared = shared
        self.p = [prior] * positions if shared is None else list(shared.p[:positions])
        self.p += [prior] * (positions - len(self.p))
        self.prior, self.rate, self.drift = prior, rate, drift

    def update(self, drafted: int, accepted: int) -> None:
        """A verify pass kept `accepted` of `drafted` drafts: positions 1..accepted were kept,
        position accepted + 1 was refused, the rest were not tried."""
        for i in range(min(drafted, len(self.p))):
            if i <= accepted:
                hit = 1.0 if i < accepted else 0.0
                self.p[i] += self.rate * (hit - self.p[i])
        if self.shared is not None:
            self.shared.update(drafted, accepted)

    def relax(self) -> None:
        """Drift toward the prior, or the shared estimate (a row that stopped drafting tries
        again later). A row's relax leaves the shared estimate alone: `Runtime.relax`."""
        if self.shared is None:
            self.p = [x + self.drift * (self.prior - x) for x in self.p]
            return
        toward = self.shared.p
        self.p = [x + self.drift * (toward[i] - x) if i < len(toward) else x
                  for i, x in enumerate(self.p)]  # fmt: skip
