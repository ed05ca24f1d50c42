"""The n-gram store (decoding/store.py) and self_spec draft="lookup+store"."""

import json

import pytest
import torch

from clover.decoding.loop import generate
from clover.decoding.policies import SelfSpec, make_policy
from clover.decoding.runtime import Runtime
from clover.decoding.store import NgramStore, is_saved_store, read_saved, save_learned, seed_store
from clover.errors import CloverError
from tests.conftest import ScriptedModel, tiny_model


def run(model, prompts, policy, max_new=30, **kw):
    results = []
    list(generate(model, prompts, policy, max_new_tokens=max_new, results=results, **kw))
    return results


def test_store_drafts_the_majority_continuation_longest_match_first():
    s = NgramStore()
    s.add([1, 2, 3, 4, 5])
    s.add([9, 2, 3, 4, 6])
    s.add([8, 2, 3, 4, 6])
    # (2, 3, 4) was followed by 5 once and 6 twice; then (3, 4, 6) by nothing: the draft ends
    assert s.draft([7, 2, 3, 4], 5) == [6]
    # the 4-gram (1, 2, 3, 4) is known and was followed by 5: longer matches win
    assert s.draft([1, 2, 3, 4], 5) == [5]
    assert s.draft([2, 3], 3) == [4, 6]  # (2, 3) -> 4 (3 of 3); (3, 4) -> 6 (2 of 3)
    assert s.draft([5, 5], 3) == []  # never seen
    assert s.draft([1, 2, 3, 4], 0) == []
    s.add([4, 7, 4, 8])  # (4,) is not an order: (3, 4) still 6 of 3 -> 6
    t = NgramStore()
    t.add([1, 2, 3])
    t.add([1, 2, 4])  # a tie: 3 and 4 each half of the time, still a majority of >= half
    assert t.draft([1, 2], 1) in ([3], [4])
    t.add([1, 2, 5])  # now no token has half: no draft
    assert t.draft([1, 2], 1) == []


def test_forget_learned_restores_the_seed_exactly_and_relearn_gives_it_back():
    s = NgramStore()
    s.add([1, 2, 3, 4, 5, 6])
    before = {k: dict(v) for k, v in s.after.items()}
    s.learn([7, 2, 3, 4, 9, 9])
    s.learn([1, 2, 3, 4, 9])
    assert s.draft([1, 2, 3, 4], 1) == [5]  # the 4-gram (1, 2, 3, 4): 5 once, 9 once
    assert s.draft([0, 2, 3, 4], 1) == [9]  # the 3-gram (2, 3, 4): 9 twice, 5 once
    dropped = s.forget_learned()
    assert s.after == before and s.tokens == 6 and s.sequences == 1 and s.learned == []
    s.relearn(dropped)
    assert s.draft([0, 2, 3, 4], 1) == [9]
    s.learning = False
    s.learn([5, 5, 5, 5])
    assert (5, 5) not in s.after


def test_store_keeps_nothing_past_its_budget():
    s = NgramStore(max_tokens=5)
    s.add([1, 2, 3, 4, 5, 6, 7])
    assert s.tokens == 5 and (4, 5) not in s.after and (3, 4) in s.after
    s.add([1, 2, 9])
    assert s.tokens == 5 and s.draft([1, 2], 1) == [3]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("adaptive", [True, False])
def test_lookup_store_drafts_are_exact_batched(seed, adaptive):
    """Float32, batched: whatever the store drafts, the answers are `ar`'s."""
    model = Runtime(tiny_model(seed))  # its store is the runtime's
    g = torch.Generator().manual_seed(seed)
    # distinct prompt tokens: the row's own context has few matches, the store drafts more
    prompts = [(torch.randperm(60, generator=g)[:n] + 4).tolist() for n in (3, 5, 7)]
    ar = run(model, prompts, make_policy("ar"), eos_token_ids=[1])
    store = model.ngram_store()
    for a in ar:  # a store that knows the answers (and wrong guesses: a shifted copy)
        store.add(a.tokens)
        store.add([t + 1 for t in a.tokens])
    policy = SelfSpec(block_size=5, draft="lookup+store", adaptive=adaptive)
    # batched (where context drafts only fill what the widest row's pass takes anyway) and
    # one row at a time (where they draft)
    spec = run(model, prompts, policy, eos_token_ids=[1])
    alone = [run(model, [p], policy, eos_token_ids=[1])[0] for p in prompts]
    for a, s, s1 in zip(ar, spec, alone):
        assert s.tokens == a.tokens == s1.tokens
        assert s.finish_reason == a.finish_reason == s1.finish_reason
    if not adaptive:  # adaptive lengths follow this machine's pass costs: maybe no drafts
        assert sum(s.drafts.get("store", [0, 0])[0] for s in alone) > 0


def test_finished_answers_teach_the_store_so_a_repeat_drafts_from_it():
    script = [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    model = Runtime(ScriptedModel(prompt_len=2, script=script, conf=[0.9] * 10))
    fixed = SelfSpec(block_size=4, draft="lookup+store", adaptive=False)
    assert model.store is None
    (first,) = run(model, [[5, 6]], fixed, max_new=10)
    assert first.tokens == script and "store" not in first.drafts  # nothing to draft from yet
    store = model.store
    assert store is not None and store.sequences == 1 and len(store.learned) == 1
    (second,) = run(model, [[5, 6]], fixed, max_new=10)
    assert second.tokens == script
    drafted, kept = second.drafts["store"]
    assert kept == drafted > 0 and second.nfe < first.nfe
    # plain lookup rows never draft from it (but their answers feed it like any row's)
    (plain,) = run(model, [[5, 6]], SelfSpec(block_size=4, draft="lookup", adaptive=False))
    assert "store" not in plain.drafts and store.sequences == 3


def test_seed_store_from_a_distilled_set_and_text(tmp_path):
    model = Runtime(tiny_model(0))

    class Tok:
        def encode(self, text, split_special_tokens=True):
            assert split_special_tokens is False  # seed text never becomes control tokens
            return [ord(c) % 50 for c in text]

    d = tmp_path / "set"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"teacher": "tiny"}))
    rec = {"prompt_ids": [1, 2, 3], "answer_ids": [4, 5, 6]}
    (d / "distill.jsonl").write_text(json.dumps(rec) + "\n")
    text = tmp_path / "notes.txt"
    text.write_text("abcabd")
    with pytest.raises(CloverError, match="distilled from 'tiny', not 'other'"):
        seed_store(model.ngram_store(), [d], "other", Tok())
    with pytest.raises(CloverError, match="no such file"):
        seed_store(model.ngram_store(), [text, tmp_path / "missing.txt"], "tiny", Tok())
    with pytest.raises(CloverError, match="must be a `clover data distill` set"):
        seed_store(model.ngram_store(), [tmp_path], "tiny", Tok())
    assert model.store.tokens == 0  # bad input added nothing
    store = seed_store(model.ngram_store(), [d, text], "tiny", Tok())
    assert store.draft([2, 3], 3) == [4, 5, 6]
    assert store.draft([ord("a") % 50, ord("b") % 50], 1) in ([ord("c") % 50], [ord("d") % 50])
    assert store.describe() == {"seed_tokens": 12, "seed_sequences": 2, "learning": True}


def test_saved_store_round_trip_and_bad_files(tmp_path):
    s = NgramStore()
    s.add([9, 9, 9])  # a seed: not saved, only what answers taught
    s.learn([1, 2, 3, 4])
    s.learn([5, 6])
    path = tmp_path / "store.jsonl"
    assert save_learned(s, path, "tiny") == 2
    assert is_saved_store(path) and (path.stat().st_mode & 0o777) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["store.jsonl"]  # no temporary left
    assert read_saved(path, "tiny") == [[1, 2, 3, 4], [5, 6]]
    with pytest.raises(CloverError, match="saved by 'tiny', not 'other'"):
        read_saved(path, "other")
    text = tmp_path / "notes.txt"
    text.write_text("[1, 2]\n")
    assert not is_saved_store(text) and not is_saved_store(tmp_path / "missing")
    with pytest.raises(CloverError, match="not a saved n-gram store"):
        read_saved(text, "tiny")
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text(path.read_text() + '[1, "x"]\n')
    with pytest.raises(CloverError, match="line 4: not a list of token ids"):
        read_saved(damaged, "tiny")
    # seed_store takes a saved store as a seed (by its header, not as text to encode)
    store = seed_store(NgramStore(), [path], "tiny", tokenizer=None)
    assert store.draft([1, 2], 2) == [3, 4] and store.learned == []
    with pytest.raises(CloverError, match="line 4"):
        seed_store(NgramStore(), [damaged], "tiny", tokenizer=None)
