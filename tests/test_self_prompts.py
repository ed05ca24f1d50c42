import json

import pytest

from clover.data import self_prompts as sp
from clover.data.prompts import PROMPT_SET_VERSION
from clover.errors import CloverError


def test_an_attempt_is_dropped_for_a_reason():
    banned = sp.benchmark_questions()
    assert "what is the capital of france?" in banned  # the quality suite's
    seen = {"describe a river."}
    assert sp.dropped("Describe a river in the mountains.", True, seen, banned) is None
    assert sp.dropped("Describe a river in the mountains.", False, seen, banned) == "unfinished"
    assert sp.dropped("Why?", True, seen, banned) == "length"
    assert sp.dropped("Erkläre das Wetter " + "ü" * 12, True, seen, banned) == "not ascii"
    assert sp.dropped("Describe  a River.", True, seen, banned) == "repeat"
    assert sp.dropped("What is the capital of France? Be brief.", True, seen, banned) == "benchmark"
    # `clover bench speed --prompt-set code`'s requests, however they go on
    ipv4 = "Write a Python function that checks whether a string is a valid IPv4 address. In Go."
    assert sp.dropped(ipv4, True, seen, banned) == "benchmark"


def test_an_unfinished_attempt_keeps_a_whole_first_request():
    assert sp.salvage("How do tides work?\n\nTides are caused by") == "How do tides work?"
    assert sp.salvage("Fix this code:\n\ndef f(") is None  # the request goes on below
    assert sp.salvage("Write a story about a fox who") is None  # no blank line: cut short


def _accept_all_but_every_third(monkeypatch):
    def dropped(text, finished, seen, banned):
        dropped.calls += 1
        return "test" if dropped.calls % 3 == 0 else None

    dropped.calls = 0
    monkeypatch.setattr(sp, "dropped", dropped)


def test_self_prompts_are_written_in_order_and_resume(tiny_checkpoint, tmp_path, monkeypatch):
    """Attempts land in the file in attempt order (rows finish out of order), the kept ones
    become prompt records, and a rerun asking for more keeps the first ones (a torn line is
    redone)."""
    from clover.decoding.loop import BatchDecoder
    from clover.engine import LLM

    _accept_all_but_every_third(monkeypatch)
    widths, step = [], BatchDecoder.step
    monkeypatch.setattr(BatchDecoder, "step", lambda b: widths.append(len(b.active)) or step(b))
    llm = LLM(str(tiny_checkpoint), dtype="float32", progress=False)
    first = sp.self_prompt_set(llm, 4, tmp_path, batch_size=3, max_tokens=5, progress=False)
    assert max(widths) == 3  # never more rows than the batch size
    assert len(first) == 4 and all(r["kind"] == "self" for r in first)
    assert all(r["split"] in ("train", "heldout") for r in first)
    path = tmp_path / "self_prompts.jsonl"
    attempts = [json.loads(line) for line in path.read_text().splitlines()]
    assert [a["attempt"] for a in attempts] == list(range(len(attempts)))
    assert sum(a["text"] is None for a in attempts) == len(attempts) - len(sp.to_records(attempts))
    assert all(a["text"].startswith(sp.STARTERS[a["attempt"]]) for a in attempts if a["text"])
    path.write_text(path.read_text() + '{"attempt": ')
    more = sp.self_prompt_set(llm, 7, tmp_path, batch_size=3, max_tokens=5, progress=False)
    assert len(more) == 7 and more[:4] == first
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert again[: len(attempts)] == attempts
    assert sp.self_prompt_set(llm, 7, tmp_path, progress=False) == more  # nothing left to do


def test_a_model_that_writes_no_usable_prompt_is_not_tried_forever(
    tiny_checkpoint, tmp_path, monkeypatch
):
    from clover.engine import LLM

    monkeypatch.setattr(sp, "dropped", lambda *a: "unfinished")
    llm = LLM(str(tiny_checkpoint), dtype="float32", progress=False)
    with pytest.raises(CloverError, match=r"0 usable prompts in 120 attempts.*unfinished"):
        sp.self_prompt_set(llm, 1, tmp_path, batch_size=8, max_tokens=2, progress=False)


def test_distill_answers_self_written_prompts(tiny_checkpoint, tmp_path, monkeypatch):
    from clover.data.distill import distill, load_examples, read_meta

    _accept_all_but_every_third(monkeypatch)
    out = tmp_path / "data"
    stats = distill(str(tiny_checkpoint), out, 3, max_tokens=4, batch_size=2, top_k=2,
                    dtype="float32", self_prompts=True, progress=False)  # fmt: skip
    assert stats["written"] == 3
    prompts = sp.to_records(sp.read_attempts(out / "self_prompts.jsonl"))
    assert sorted(r["id"] for r in load_examples(out)) == sorted(r["id"] for r in prompts)
    assert read_meta(out)["prompt_set"] == f"self-{sp.VERSION}"
    with pytest.raises(
        CloverError, match=f"prompt_set 'self-{sp.VERSION}' -> {PROMPT_SET_VERSION}"
    ):
        distill(str(tiny_checkpoint), out, 4, max_tokens=4, batch_size=2, top_k=2,
                dtype="float32", progress=False)  # fmt: skip
