import json
import re

from clover.data.bench_prompts import OPEN_CODE_PROMPTS, SPEED_PROMPTS
from clover.data.distill import distill, done_ids, load_examples
from clover.data.prompts import KINDS, PROMPT_SET_VERSION, prompt_set
from clover.data.suite import load_suite


def test_prompt_set_is_deterministic_and_split_by_id():
    a, b = prompt_set(300, seed=0), prompt_set(300, seed=0)
    assert a == b and len({p["id"] for p in a}) == 300
    assert {p["kind"] for p in a} == set(KINDS)
    bigger = {p["id"]: p["split"] for p in prompt_set(600, seed=0)}
    assert all(bigger[p["id"]] == p["split"] for p in a)  # growing n never moves a prompt
    assert 0 < sum(v == "heldout" for v in bigger.values()) < 100


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", text.lower()))


def test_prompt_set_keeps_clear_of_the_benchmarks_items():
    """Drafters and adapters trained on the prompt set are measured on the quality suite and on
    the speed prompts: no question of theirs, no code task of theirs, and nothing close to one,
    is in the set (the set once held 'What is the capital of France?' and the suite's code
    tasks in other words)."""
    suite = [item["prompt"] for item in load_suite()]
    benchmark = suite + SPEED_PROMPTS + OPEN_CODE_PROMPTS
    # the question part of each item, without its format suffix ("Answer in one word.")
    questions = {re.split(r"(?<=[?.])\s", p)[0].lower() for p in benchmark}
    names = {m for p in suite for m in re.findall(r"`(\w+)\(", p)}
    assert len(questions) > 150 and len(names) == 42
    filler = _words("a an the of in to is are what how do does write give explain describe "
                    "answer with just number word one only reply code python function that "
                    "returns return short few sentences")  # fmt: skip
    targets = [(p, _words(p) - filler) for p in benchmark]
    for p in prompt_set(5000, seed=0) + prompt_set(500, seed=1):
        text = " ".join(m["content"] or "" for m in p["messages"]).lower()
        assert not any(q in text for q in questions), text
        assert not any(f"{n}(" in text for n in names), text
        words = _words(text) - filler
        for item, item_words in targets:
            near = len(words & item_words) / len(words | item_words)
            assert near < 0.7, (text, item)


def test_tool_prompts_offer_the_tools_they_call():
    """The tool kinds: each prompt offers distinct tools in the OpenAI format; a call (and the
    result that came back) names a tool the prompt offers, with arguments its parameters
    declare; a few requests need no tool; ids tell tool lists apart and keep a plain
    message list's id as it was before tools."""
    import hashlib

    from clover.data.prompts import prompt_id
    from clover.data.tool_prompts import NO_TOOL_REQUESTS

    tools_seen, no_tool, results = set(), 0, 0
    for p in prompt_set(4000, seed=0):
        if not p["kind"].startswith("tool"):
            assert "tools" not in p
            continue
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in p["tools"]}
        assert len(offered) == len(p["tools"]) >= 1 and p["id"] == prompt_id(
            p["messages"], p["tools"]
        )
        tools_seen |= set(offered)
        if p["kind"] == "tool_call":
            (ask,) = p["messages"]
            no_tool += ask["content"] in NO_TOOL_REQUESTS
            continue
        user, assistant, tool = p["messages"]
        (call,) = assistant["tool_calls"]
        name, args = call["function"]["name"], call["function"]["arguments"]
        assert name in offered and tool["role"] == "tool" and tool["name"] == name
        assert set(args) <= set(offered[name]["properties"])
        assert set(offered[name]["required"]) <= set(args)
        assert isinstance(json.loads(tool["content"]), dict)
        results += 1
    assert len(tools_seen) == 10 and results > 50 and no_tool > 0
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    legacy = "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in plain)
    assert prompt_id(plain) == hashlib.sha256(legacy.encode()).hexdigest()[:16]
    a = [{"type": "function", "function": {"name": "a", "parameters": {}}}]
    b = [{"type": "function", "function": {"name": "b", "parameters": {}}}]
    assert len({prompt_id(plain), prompt_id(plain, a), prompt_id(plain, b)}) == 3
    call = {"type": "function", "function": {"name": "a", "arguments": {}}}
    called = plain[:1] + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert prompt_id(called) != prompt_id(plain[:1] + [{"role": "assistant", "content": None}])


def test_distill_renders_a_prompt_with_the_tools_it_offers(tiny_checkpoint, tmp_path,
                                                           monkeypatch):  # fmt: skip
    """A tool prompt reaches the chat template with its tools, and its record keeps them; a
    template that cannot render a tool turn (ChatML adding a call's null text) leaves that
    prompt out, counted, and distils the rest."""
    from clover.data import distill as d
    from clover.engine import LLM

    calls = [p for p in prompt_set(400) if p["kind"] == "tool_call"][:2]
    result = [p for p in prompt_set(400) if p["kind"] == "tool_result"][:1]
    made = calls + result
    monkeypatch.setattr(d, "prompt_set", lambda n, seed: made[:n])
    seen, real = [], LLM.chat_prompt
    monkeypatch.setattr(LLM, "chat_prompt", lambda self, messages, **kw: (
        seen.append(kw.get("tools")), real(self, messages, **kw))[1])  # fmt: skip
    stats = distill(str(tiny_checkpoint), tmp_path / "t", 3, max_tokens=3, batch_size=2,
                    top_k=2, dtype="float32", progress=False)  # fmt: skip
    assert seen == [p["tools"] for p in made]
    assert stats["written"] == 2 and stats["no_tool_template"] == 1 and stats["left"] == 0
    records = {r["id"]: r for r in load_examples(tmp_path / "t")}
    assert [records[p["id"]]["tools"] for p in calls] == [p["tools"] for p in calls]


def test_distill_writes_teacher_topk_and_resumes(tiny_checkpoint, tmp_path):
    out = tmp_path / "data"
    stats = distill(str(tiny_checkpoint), out, 5, max_tokens=6, batch_size=2, top_k=4,
                    dtype="float32", progress=False)  # fmt: skip
    assert stats["written"] == 5
    records = load_examples(out)
    for r in records:
        assert len(r["topk_ids"]) == len(r["answer_ids"]) == len(r["topk_logprobs"])
        assert all(len(row) == 4 for row in r["topk_ids"])
        # greedy teacher: its answer token is the top-1 of its own distribution
        assert [row[0] for row in r["topk_ids"]][: len(r["answer_ids"])] == r["answer_ids"][
            : len(r["topk_ids"])
        ] or r["finish_reason"] == "stop"
    # a killed run leaves a torn line: it is dropped and that prompt redone
    path = out / "distill.jsonl"
    path.write_text(path.read_text() + '{"id": "half')
    stats = distill(str(tiny_checkpoint), out, 8, max_tokens=6, batch_size=2, top_k=4,
                    dtype="float32", progress=False)  # fmt: skip
    assert stats == {**stats, "written": 3, "skipped": 5}
    assert len(done_ids(path)) == 8
    assert all(json.loads(line) for line in path.read_text().splitlines())
    assert len(load_examples(out, "train")) + len(load_examples(out, "heldout")) == 8


def test_teacher_topk_batch_matches_one_by_one(tiny_checkpoint):
    """One right-padded pass over sequences of different lengths gives each row's own
    single-sequence top-k (the reference)."""
    import torch

    from clover.data.distill import teacher_topk_batch
    from clover.engine import LLM

    model = LLM(str(tiny_checkpoint), dtype="float32", progress=False).model
    torch.manual_seed(0)
    prompts = [torch.randint(4, 90, (n,)).tolist() for n in (3, 9, 5)]
    answers = [torch.randint(4, 90, (n,)).tolist() for n in (7, 2, 4)]
    batched = teacher_topk_batch(model, prompts, answers, 4)
    for p, a, (ids, lps) in zip(prompts, answers, batched):
        ref_ids, ref_lps = teacher_topk_batch(model, [p], [a], 4)[0]
        assert len(ids) == len(a) and ids == ref_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=2e-4, rtol=0)


def test_distill_stops_at_its_time_box_and_resumes(tiny_checkpoint, tmp_path):
    out = tmp_path / "data"
    stats = distill(str(tiny_checkpoint), out, 6, max_tokens=4, batch_size=2, top_k=2,
                    dtype="float32", max_minutes=1e-9, progress=False)  # fmt: skip
    assert stats["written"] == 0 and stats["left"] == 6  # the box ends before the first batch
    stats = distill(str(tiny_checkpoint), out, 6, max_tokens=4, batch_size=2, top_k=2,
                    dtype="float32", progress=False)  # fmt: skip
    assert stats["written"] == 6 and stats["left"] == 0


def test_distill_will_not_mix_answers_made_differently(tiny_checkpoint, tmp_path):
    import pytest

    from clover.errors import CloverError

    out = tmp_path / "data"
    kw = dict(max_tokens=4, batch_size=2, dtype="float32", progress=False)
    distill(str(tiny_checkpoint), out, 2, top_k=2, **kw)
    before = (out / "distill.jsonl").read_bytes()
    with pytest.raises(CloverError, match=r"top_k 2 -> 3.*new --out"):
        distill(str(tiny_checkpoint), out, 4, top_k=3, **kw)
    meta = json.loads((out / "meta.json").read_text())
    del meta["prompt_set"]  # a directory from before the version was recorded
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CloverError, match=f"prompt_set 1 -> {PROMPT_SET_VERSION}"):
        distill(str(tiny_checkpoint), out, 4, top_k=2, **kw)
    assert (out / "distill.jsonl").read_bytes() == before
    with pytest.warns(UserWarning, match="prompt set 1, which holds quality-suite"):
        load_examples(out)  # the trainers read it: they say the data is the old set
    meta["prompt_set"] = PROMPT_SET_VERSION
    (out / "meta.json").write_text(json.dumps(meta))
    assert distill(str(tiny_checkpoint), out, 4, top_k=2, **kw)["written"] == 2


def test_distill_skips_prompts_answered_in_another_directory(tiny_checkpoint, tmp_path):
    """A new prompt-set version repeats many of the old set's prompts: `skip` leaves out those
    another directory of the same teacher answered, so the two train side by side without
    doubles; a directory of another teacher or none at all is refused before anything is
    written."""
    import pytest

    from clover.errors import CloverError

    kw = dict(max_tokens=3, batch_size=2, top_k=2, dtype="float32", progress=False)
    first, second = tmp_path / "a", tmp_path / "b"
    distill(str(tiny_checkpoint), first, 5, **kw)
    stats = distill(str(tiny_checkpoint), second, 9, skip=[first], **kw)
    a, b = done_ids(first / "distill.jsonl"), done_ids(second / "distill.jsonl")
    assert stats["answered_elsewhere"] == 5 and stats["written"] == 4 and len(b) == 4
    assert not a & b and a | b == {p["id"] for p in prompt_set(9)}
    assert json.loads((second / "meta.json").read_text())["answered_elsewhere"] == [str(first)]
    with pytest.raises(CloverError, match="no distill.jsonl"):
        distill(str(tiny_checkpoint), tmp_path / "c", 9, skip=[tmp_path / "none"], **kw)
    assert not (tmp_path / "c").exists()
    with pytest.raises(CloverError, match="output directory itself"):
        distill(str(tiny_checkpoint), second, 9, skip=[second], **kw)
    meta = json.loads((first / "meta.json").read_text())
    (first / "meta.json").write_text(json.dumps({**meta, "teacher": "another-model"}))
    with pytest.raises(CloverError, match="answers of 'another-model'"):
        distill(str(tiny_checkpoint), second, 12, skip=[first], **kw)
    assert done_ids(second / "distill.jsonl") == b


def test_distill_leaves_out_prompts_longer_than_the_teacher_s_context(tiny_checkpoint, tmp_path):
    """The tiny test model has a 256-token context and a byte-sized vocabulary: the long
    prompts (questions on a given text, code to explain) do not fit and are counted, not fatal
    (as are the tool results its ChatML template cannot render)."""
    out = tmp_path / "data"
    stats = distill(str(tiny_checkpoint), out, 42, max_tokens=2, batch_size=8, top_k=2,
                    dtype="float32", progress=False)  # fmt: skip
    assert stats["too_long"] > 0 and stats["no_tool_template"] > 0
    assert stats["written"] + stats["too_long"] + stats["no_tool_template"] == 42
    assert stats["left"] == 0 and len(load_examples(out)) == stats["written"]


def test_distill_keeps_the_ar_steps_distributions(tiny_checkpoint, tmp_path):
    """Top-k kept from the AR steps that wrote the answer (rows joining a running batch) equal
    those of one teacher-forced pass over prompt + answer (float32), EOS target included."""
    import torch

    from clover.data.distill import teacher_topk_batch
    from clover.engine import LLM

    out = tmp_path / "data"
    stats = distill(str(tiny_checkpoint), out, 7, max_tokens=9, batch_size=3, top_k=4,
                    dtype="float32", progress=False)  # fmt: skip
    assert stats["written"] == 7 and stats["left"] == 0
    model = LLM(str(tiny_checkpoint), dtype="float32", progress=False).model
    records = load_examples(out)
    assert len(records) == 7
    # a long prompt leaves a shorter budget in the 256-token context: its row ends first and
    # the next prompt joins the running batch
    assert len({len(r["answer_ids"]) for r in records}) > 1
    for r in records:
        written = r["answer_ids"][: len(r["answer_ids"]) - (r["finish_reason"] == "stop")]
        assert [row[0] for row in r["topk_ids"][: len(written)]] == written  # greedy's own
        ids, lps = teacher_topk_batch(model, [r["prompt_ids"]], [r["answer_ids"]], 4)[0]
        assert r["topk_ids"] == ids
        torch.testing.assert_close(
            torch.tensor(r["topk_logprobs"]), torch.tensor(lps), atol=2e-4, rtol=0
        )
