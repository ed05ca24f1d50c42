"""Speculation tuned to the machine: pass costs, acceptance, and the draft length chosen."""

import json

import pytest

from clover.decoding.costs import (
    Acceptance,
    PassCosts,
    batch_length,
    best_length,
    best_rate,
    chain_cost,
)
from clover.decoding.timing import cached_costs
from tests.conftest import tiny_model


def test_cost_table_interpolates_and_extrapolates():
    c = PassCosts({1: 10.0, 4: 13.0, 8: 20.0}, {2: 3.0, 4: 5.0})
    assert c.verify(1) == 10.0 and c.verify(2) == 11.0 and c.verify(6) == 16.5
    assert c.verify(16) == 40.0  # past the last width: proportional
    assert c.draft(0) == 0.0 and c.draft(1) == 3.0 and c.draft(3) == 5.0


def test_draft_length_follows_costs_and_acceptance():
    flat = PassCosts({1: 10.0, 33: 11.0})  # wide passes nearly free (a GPU)
    steep = PassCosts({1: 10.0, 2: 20.0, 33: 330.0})  # each position costs a whole step
    assert best_length([0.9] * 16, flat, 16) == 16  # sure drafts, free width: all
    assert best_length([0.9] * 16, steep, 16) == 0  # no width is worth its cost: AR
    assert best_length([0.02] * 16, flat, 16) == 1  # even bad drafts pay when width is free
    cpu = PassCosts({1: 10.0, 2: 11.0, 33: 40.0})
    assert best_length([0.02] * 16, cpu, 16) == 0  # drafts that lose: AR
    mid = PassCosts({1: 10.0, 2: 11.0, 4: 13.0, 8: 19.0, 16: 40.0})
    k = best_length([0.8] * 16, mid, 16)
    assert 2 <= k <= 8
    # a drafter pass that costs as much as the target's makes short drafts lose
    slow_drafter = PassCosts(mid.verify_ms, {2: 10.0, 16: 12.0})
    assert best_length([0.5] * 15, slow_drafter, 15, drafter=True) == 0


def test_batched_costs_interpolate_in_rows():
    c = PassCosts({1: 10.0, 2: 11.0}, {2: 1.0}, {2: {1: 12.0, 2: 14.0}, 8: {1: 30.0, 2: 60.0}},
                  {2: {2: 1.5}, 8: {2: 3.0}})  # fmt: skip
    assert c.verify_batch(1, 2) == 11.0 and c.verify_batch(2, 2) == 14.0
    assert c.verify_batch(5, 1) == 21.0  # halfway between 2 and 8 rows
    assert c.verify_batch(16, 2) == 120.0  # past the last batch: proportional
    assert c.draft_batch(2, 0) == 0.0 and c.draft_batch(8, 1) == 3.0


def test_a_batch_drafts_only_where_its_wider_pass_pays():
    """The common draft length of a batch: drafts that keep well pay at 2 rows, where a pass of
    2 tokens a row costs little more than 1; at 8 rows a pass twice as wide costs twice as much
    (the 1.5B coder's shape on 2 cores), so the batch runs `ar`'s steps."""
    c = PassCosts({1: 40.0, 2: 42.0, 3: 45.0}, {2: 2.0, 3: 4.0},
                  {2: {1: 42.0, 2: 48.0, 3: 56.0}, 8: {1: 141.0, 2: 280.0, 3: 420.0}},
                  {2: {2: 2.5, 3: 5.0}, 8: {2: 4.0, 3: 8.0}})  # fmt: skip
    good = [0.8, 0.7]
    assert batch_length([good, good], 0, c, 2) == 2
    assert batch_length([good] * 8, 0, c, 2) == 0
    assert batch_length([[0.1, 0.1]] * 2, 0, c, 2) == 0  # drafts that lose: none
    # one drafting row among riders that make a token a pass whatever the width: its gain is
    # spread over a pass every rider widens too
    assert batch_length([good], 1, c, 2) == 1 and batch_length([good], 7, c, 2) == 0
    unmeasured = PassCosts(c.verify_ms, c.draft_ms)  # no batched table: batches do not draft
    assert batch_length([good, good], 0, unmeasured, 2) == 0
    assert batch_length([good], 0, unmeasured, 2) == best_length(good, unmeasured, 2, True)


def test_acceptance_learns_and_drifts_back():
    a = Acceptance(4, prior=0.6, rate=0.5, drift=0.1)
    for _ in range(10):
        a.update(drafted=4, accepted=0)  # the first draft refused every time
    assert a.p[0] < 0.2 and abs(a.p[3] - 0.6) < 1e-6  # position 4 never tried: drifts only
    for _ in range(40):
        a.relax()
    assert a.p[0] > 0.5  # a row that stopped drafting tries again later
    a.update(drafted=3, accepted=3)
    assert a.p[0] > 0.7 and a.p[2] > 0.7


def test_costs_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path))
    model = tiny_model()
    first = cached_costs(model, "float32")
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and set(first.verify_ms) >= {1, 2, 4, 8}
    assert all(v > 0 for v in first.verify_ms.values())
    assert set(first.rows_ms) == {2, 4, 8} and set(first.rows_ms[8]) == {1, 2, 3, 4, 5}
    data = json.loads(files[0].read_text())
    data["verify_ms"] = {"1": 1.0, "2": 2.0}
    files[0].write_text(json.dumps(data))
    again = cached_costs(model, "float32")  # read back, not measured again
    assert again.verify_ms == {1: 1.0, 2: 2.0} and again.rows_ms == first.rows_ms
    assert cached_costs(model, "int4").verify_ms != again.verify_ms  # another key
    # other kernels (a new build of their sources): measured again
    from clover import kernels

    if kernels.load() is not None:
        monkeypatch.setattr(kernels.load(), "__name__", "clover_kernels_other")
        assert cached_costs(model, "float32").verify_ms != again.verify_ms


def test_every_drafter_of_a_model_reads_its_verify_costs(tmp_path, monkeypatch):
    """The model's passes are timed once, whatever drafts for it: a draft model's table adds
    its own file with its draft passes only, and two draft vocabularies compared side by side
    (benchmarks/drafter_ab.py) read the same verify costs."""
    from clover.decoding import timing

    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path))
    model, draft = tiny_model(seed=3), tiny_model(seed=5)
    calls = []
    real = timing.measure
    monkeypatch.setattr(timing, "measure", lambda *a, **k: calls.append(k) or real(*a, **k))
    alone = cached_costs(model, "float32")
    with_draft = cached_costs(model, "float32", draft)
    draft.draft_vocab = 16
    other = cached_costs(model, "float32", draft)
    assert with_draft.verify_ms == alone.verify_ms == other.verify_ms
    assert with_draft.rows_ms == alone.rows_ms and with_draft.draft_ms and other.draft_ms
    assert [c.get("verify", True) for c in calls] == [True, False, False]
    assert len(list((tmp_path / "costs").glob("*.json"))) == 3
    assert cached_costs(model, "float32", draft).draft_ms == other.draft_ms  # read back
    assert len(calls) == 3


def test_lookup_drafts_grow_with_a_long_match():
    from clover.decoding.store import NgramIndex

    text = list(range(20, 60))
    tokens = text + text[:12]  # the start repeats for 12 tokens
    index = NgramIndex(tokens)
    assert index.draft(3) == text[12:15]
    assert index.draft(3, most=100) == tokens[12:44]  # a match of 12 >= 8: up to 32
    assert index.draft(3, most=10) == tokens[12:22]  # ... or as far as `most` allows
    short = NgramIndex([1, 2, 3, 9, 9, 1, 2])
    assert short.draft(3, most=100) == [3, 9, 9]  # a 2-token match stays at k


def test_rows_start_from_what_earlier_rows_saw():
    """A shared estimate (one per model and source): a fresh row of a drafter that kept
    losing starts pessimistic; the shared estimate drifts back to the prior slowly."""
    from clover.decoding.runtime import Runtime

    runtime = Runtime(tiny_model())
    book = runtime.shared_acceptance("drafter", 4)
    assert runtime.shared_acceptance("drafter", 4) is book
    assert Runtime(tiny_model(seed=1)).shared_acceptance("drafter", 4) is not book
    first = Acceptance(4, shared=book)
    for _ in range(60):
        first.update(drafted=4, accepted=0)
    assert book.p[0] < 0.15 and book.p[1] == 0.6  # position 2 never tried
    fresh = Acceptance(4, shared=book)
    assert fresh.p == book.p  # not the 0.6 prior
    mid = PassCosts({1: 10.0, 2: 11.0, 4: 13.0, 8: 19.0})
    assert best_length(fresh.p, mid, 3) == 0 and best_length(Acceptance(4).p, mid, 3) > 0
    before = list(book.p)
    for _ in range(50):  # rows relaxing leave the shared estimate alone: the loop drifts it
        fresh.relax()
    assert book.p == before
    for _ in range(3000):  # nobody drafts: the shared estimate comes back to the prior
        runtime.relax()
        fresh.relax()
    assert book.p[0] > 0.5 and fresh.p[0] > 0.5
    longer = Acceptance(6, shared=book)  # more positions than the book: the rest at the prior
    assert len(longer.p) == 6 and longer.p[5] == 0.6
    first.update(drafted=4, accepted=0)
    runtime.forget_acceptance()  # every estimate anew, at its prior
    assert runtime.shared_acceptance("drafter", 4) is not book
    assert runtime.shared_acceptance("drafter", 4).p == [0.6] * 4


def test_the_shared_estimates_drift_once_per_step_at_any_batch(monkeypatch):
    """At batch 3 the shared acceptance drifts as at batch 1: once per decode step (it used
    to drift once per row per step, and twice for a row that had just drafted)."""
    from clover.decoding import loop
    from clover.decoding.policies import SelfSpec
    from clover.decoding.runtime import Runtime

    calls, events = [], []
    monkeypatch.setattr(Runtime, "relax", lambda self: calls.append(self))
    model = Runtime(tiny_model(seed=3))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    policy = SelfSpec(block_size=4, draft="lookup", adaptive=True)
    for event in loop.generate(model, prompts, policy, max_new_tokens=12):
        events.append(event)
    assert len(calls) == events[-1].step > 3  # one per step of the loop, not per row
    assert all(m is model for m in calls)


def test_a_row_keeps_estimates_only_for_the_sources_it_drafts_from():
    """Each estimate relaxes every step; a row holds those of its own draft sources only."""
    import torch

    from clover.decoding.policies import make_policy
    from clover.decoding.spec_row import SpecRow

    def sources(draft: str) -> set[str]:
        policy = make_policy("self_spec", 4, draft=draft)
        return set(SpecRow(0, [1, 2, 3], 8, policy, torch.Generator()).sources.acceptance)

    assert sources("lookup") == {"lookup"} and sources("mask") == set()
    assert sources("drafter+lookup") == {"drafter", "lookup"}
    assert sources("lookup+store") == {"lookup", "store"}
    assert sources("drafter+lookup+store") == {"drafter", "lookup", "store"}


def test_a_chain_that_stops_itself_is_priced_by_the_passes_it_runs():
    """A chain that stops where its drafts become unlikely runs its pass for draft i about as
    often as the drafts before it are kept: priced so, longer chains pay where each pass
    costs a third of a step (a 0.5B drafting for the 1.5B); at acceptance 1 nothing changes."""
    costs = PassCosts({1: 40.0, 2: 43.5, 3: 46.0, 4: 50.0, 5: 54.0, 6: 57.0},
                      {2: 14.0, 3: 27.0, 4: 40.0, 5: 53.0, 6: 66.0})  # fmt: skip
    accept = [0.85] * 5
    cost = chain_cost(accept, costs.draft)
    assert cost(0) == 0 and cost(1) == costs.draft(1)
    assert cost(3) == pytest.approx(14 + 13 * 0.85 + 13 * 0.85**2)
    assert chain_cost([1.0] * 5, costs.draft)(4) == costs.draft(4)
    plain = best_length(accept, costs, 5, drafter=True)
    priced = best_length(accept, costs, 5, drafter=True, stops=True)
    assert 0 < plain < priced == 5
    assert best_length([0.1] * 5, costs, 5, drafter=True, stops=True) == 0  # still none


def test_the_length_search_stops_early_and_finds_what_trying_every_length_finds():
    """`best_rate` and `batch_length` (memoized pass costs, a search that stops once no
    longer length can pay more) choose what trying every length chooses (the reference),
    on random tables, noisy ones (a longer pass timed cheaper) included."""
    import random

    from clover.decoding.costs import _best

    def reference(accepts, riders, cost):
        rows = len(accepts) + riders
        rates = []
        for k in range(len(cost)):
            expected = rows
            for a in accepts:
                p = 1.0
                for i in range(k):
                    p *= a[i] if i < len(a) else a[-1]
                    expected += p
            rates.append(expected / cost[k])
        k = max(range(len(cost)), key=lambda j: (rates[j], -j))  # the first of the best
        return k, rates[k]

    rng = random.Random(7)
    for trial in range(400):
        most = rng.randint(1, 31)
        verify = {w: 10 + w * rng.uniform(0.1, 3) + rng.uniform(-2, 2) for w in (1, 2, 4, 8, 33)}
        draft = {w: w * rng.uniform(0.05, 2) for w in (2, 4, 8, 16)}
        costs = PassCosts(verify, draft, {8: {w: 30 + 8 * w * rng.uniform(0.5, 2)
                                              for w in (1, 2, 3, 4, 5)}})  # fmt: skip
        rows = rng.choice([1, 1, 2, 8])
        accepts = [[rng.random() ** rng.choice([0.1, 1, 3]) for _ in range(rng.randint(1, 31))]
                   for _ in range(min(rows, rng.randint(1, 8)))]  # fmt: skip
        riders = rows - len(accepts)
        for drafter in (False, True):
            cost = costs.pass_ms(rows, most, drafter)
            k, rate = _best(accepts, riders, cost)
            want_k, want_rate = reference(accepts, riders, cost)
            assert k == want_k and rate == pytest.approx(want_rate), (trial, drafter)
        if rows == 1:
            k, _ = best_rate(accepts[0], costs, most, drafter=True)
            assert k == reference(accepts, 0, costs.pass_ms(1, most, True))[0]
        else:
            assert batch_length(accepts, riders, costs, most) == reference(
                accepts, riders, costs.pass_ms(rows, most, True))[0]  # fmt: skip
