"""Prompts the teacher writes itself, for self-distillation with more variety than templates.

A chat model that is given its chat template up to the start of a user turn (system turn, then
`<|im_start|>user\\n`) writes a plausible user request when sampled (the "Magpie" recipe: Xu
et al. 2024, arXiv:2406.08464). Left alone, a coder model mostly writes code snippets; each
attempt therefore starts the user turn with one of a few dozen opening words ("Describe",
"How do I", "Write a Python function", ...), and the model completes the request. Attempts
that do not close the turn within `max_tokens` (unless their first paragraph is a whole
request followed by a blank line: that paragraph is kept), are too short or too long, are mostly not
ASCII, repeat an earlier prompt, or ask one of the benchmarks' questions are dropped.

Every attempt is written to `<out>/self_prompts.jsonl` as it finishes ({"attempt", "text"};
text null and "dropped" saying why for a dropped one), and attempt i always samples with seed
(seed, i) and opening STARTERS[i % len(STARTERS)]: a rerun continues after the last attempt
written and keeps the prompts it already has.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from clover.data.bench_prompts import OPEN_CODE_PROMPTS, SPEED_PROMPTS
from clover.data.prompts import prompt_id, split_of
from clover.data.suite import default_suite_path, load_suite
from clover.decoding.loop import BatchDecoder
from clover.decoding.sampling import SamplingParams
from clover.engine import LLM, GenerationSettings
from clover.errors import CloverError
from clover.files import truncate_torn_tail

VERSION = 2  # bumped when the openings or the filters change what a seed gives

STARTERS = [
    "Write", "Explain", "Describe", "What is", "How do I", "Give me", "Why", "Tell me about",
    "List", "Can you", "Write a short", "Summarize", "What are", "Compare", "Suggest",
    "Help me", "Write a Python function", "How does", "What happens when", "Give three",
    "Write two sentences", "Explain in simple words", "Create", "I need", "Please",
    "How can I", "Write a story", "Describe a", "What should I", "Is it", "Fix", "Rewrite",
    "Write a poem", "Give an example of", "How many", "What would", "Convert", "Plan",
    "Recommend", "Name",
    # coding requests in many forms: a coder model's users ask for these most
    "Write a JavaScript function", "Write a TypeScript", "Write a SQL query", "Write a bash script",
    "Write unit tests for", "Refactor", "Write a Python class", "Implement", "Debug",
    "Write a regular expression", "Write a Go function", "Write a Rust function",
    "Add type hints to", "Write a docstring for", "Write a Dockerfile", "Write a React component",
    "What does this error mean:", "Optimize", "Write a Python script", "Write a C function",
    "Write an HTML page", "Write a YAML", "Review this code:", "Convert this Python code to",
]  # fmt: skip

_SPACE = re.compile(r"\s+")


def _norm(text: str) -> str:
    return _SPACE.sub(" ", text.strip().lower())


def _first_sentence(text: str) -> str:
    m = re.match(r"[^.?!]*[.?!]?", _norm(text))
    return m.group(0) if m else ""


def benchmark_questions() -> set[str]:
    """First sentences (normalised) of the quality suite's and the speed bench's prompts (both
    its sets): a
    self prompt that asks one of them is dropped, so acceptance measured there stays measured
    on prompts no drafter trained on."""

    out = {_first_sentence(p) for p in [*SPEED_PROMPTS, *OPEN_CODE_PROMPTS]}
    if default_suite_path().is_file():
        out |= {_first_sentence(it["prompt"]) for it in load_suite()}
    out.discard("")
    return out


def dropped(text: str, finished: bool, seen: set[str], banned: set[str]) -> str | None:
    """Why the attempt's prompt is dropped, or None when it is kept (see the module doc)."""
    if not finished:  # (a cut one is passed as finished: `salvage`)
        return "unfinished"
    if not 12 <= len(text) <= 600:
        return "length"
    if sum(c.isascii() for c in text) < 0.95 * len(text):
        return "not ascii"
    if _norm(text) in seen:
        return "repeat"
    if _first_sentence(text) in banned:
        return "benchmark"
    return None


def salvage(text: str) -> str | None:
    """An unfinished attempt whose first paragraph is a whole request (it ends with "?" or
    ".") and is followed by a blank line: the model closed the request and went on to
    something else (often its own answer) instead of closing the turn. That paragraph, else
    None."""
    head, sep, _ = text.partition("\n\n")
    head = head.strip()
    return head if sep and head.endswith(("?", ".")) else None


def read_attempts(path: Path) -> list[dict]:
    """Attempts written so far, in order; a torn last line is dropped (and redone)."""
    out: list[dict] = []
    if not path.exists():
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                a = json.loads(line)
            except json.JSONDecodeError:
                break
            if a.get("attempt") != len(out):
                raise CloverError(f"{path}: attempt {len(out)} expected, the file is damaged")
            out.append(a)
    return out


def to_records(attempts: list[dict], heldout: float = 0.05) -> list[dict]:
    """Kept attempts as prompt-set records (kind "self")."""
    out = []
    for a in attempts:
        if a.get("text"):
            messages = [{"role": "user", "content": a["text"]}]
            pid = prompt_id(messages)
            out.append({"id": pid, "kind": "self", "split": split_of(pid, heldout),
                        "messages": messages})  # fmt: skip
    return out


def self_prompt_set(llm: LLM, n: int, out_dir: Path, *, seed: int = 0,
                    batch_size: int = 16, max_tokens: int = 48, temperature: float = 1.0,
                    top_k: int = 40, max_minutes: float | None = None,
                    progress: bool = True) -> list[dict]:  # fmt: skip
    """`n` prompts written by `llm` (resumable; fewer if `max_minutes` runs out first)."""

    path = Path(out_dir) / "self_prompts.jsonl"
    truncate_torn_tail(path)
    attempts = read_attempts(path)
    records = to_records(attempts)
    if len(records) >= n:
        return records[:n]
    banned = benchmark_questions()
    seen = {_norm(r["messages"][0]["content"]) for r in records}
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "\x00"}], add_generation_prompt=True
    )
    head = text[: text.index("\x00")]
    s = llm.default_settings(GenerationSettings(decoder="ar", max_tokens=max_tokens))
    policy, eos = s.policy(), llm.eos_token_ids
    bar = None
    if progress:
        bar = tqdm(total=n, initial=len(records), desc="self prompts", unit="prompt")
    t0 = time.perf_counter()
    batch = BatchDecoder(llm.runtime, cached=False)
    running: dict[int, tuple] = {}  # attempt -> (opening, row)
    done: dict[int, dict] = {}  # finished attempts not yet written (they go in order)
    attempt = len(attempts)
    limit = 20 * n + 100  # a model that never writes a usable request is not tried forever
    try:
        with open(path, "a", encoding="utf-8") as f:
            while True:
                room = batch_size - len(batch.active)  # rows joining count only after
                with batch.joining():
                    while (
                        room > 0
                        and len(records) + len(running) + len(done) < n
                        and attempt < limit
                        and (max_minutes is None or time.perf_counter() - t0 <= 60 * max_minutes)
                    ):
                        start = STARTERS[attempt % len(STARTERS)]
                        row = batch.add(
                            llm.encode(head + start), policy, max_new_tokens=max_tokens,
                            sampling=SamplingParams(temperature, top_k, 1.0, seed),
                            eos_token_ids=eos, index=attempt, seed_index=attempt,
                        )  # fmt: skip
                        running[attempt], attempt, room = (start, row), attempt + 1, room - 1
                if not batch.active:
                    break
                event = batch.step()
                for index in sorted(event.finished):
                    start, row = running.pop(index)
                    body = llm.tokenizer.decode(list(row.result.tokens))
                    text = (start + body).strip()
                    finished = row.result.finish_reason == "stop"
                    if not finished and (cut := salvage(text)):
                        text, finished = cut, True
                    why = dropped(text, finished, seen, banned)
                    if why is None:
                        seen.add(_norm(text))
                    # attempts are written in order: one finishing early waits for the
                    # earlier ones (a few rows at most)
                    done[index] = {"text": None, "dropped": why} if why else {"text": text}
                    while len(attempts) in done:
                        a = {"attempt": len(attempts), **done.pop(len(attempts))}
                        f.write(json.dumps(a) + "\n")
                        attempts.append(a)
                        records.extend(to_records([a]))
                        if a["text"] and bar is not None:
                            bar.update(1)
                if event.finished:  # once a step: the attempts it finished
                    f.flush()
                    os.fsync(f.fileno())
    finally:
        batch.close()
        if bar is not None:
            bar.close()
    if len(records) < n and attempt >= limit:
        why = Counter(a.get("dropped") for a in attempts if not a.get("text"))
        raise CloverError(
            f"{llm.name} wrote {len(records)} usable prompts in {attempt} attempts (dropped: "
            f"{dict(why)}); it may not be a chat model. The {len(records)} are kept in {path}"
        )
    return records[:n]
