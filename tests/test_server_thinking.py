"""Thinking mode end to end: a template with think tags, a scripted model, the openai client.

The scripted model spells exact answers, so the split into `reasoning_content` (and its
alias `reasoning`) and `content` can be checked character for character, streamed and not.
The test tokenizer has no `<think>` token, so tags arrive split over several byte-level
tokens: with the ar decoder the stream sends them a piece at a time, which is where a
careless splitter would leak `</th` into the content.
"""

from __future__ import annotations

import pytest
from openai import InternalServerError, OpenAI

from clover.serving.options import ServeOptions
from tests.test_server_support import (
    THINKING_CHATML,
    scripted_loader,
    serve_in_thread,
    write_checkpoint,
)

REASONING = "I add 2 and 2, which makes 4."
ANSWER = "The answer is 4."
ANSWERS = {True: f"{REASONING}\n</think>\n\n{ANSWER}", False: ANSWER}
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("think"), 512, THINKING_CHATML)
    loader = scripted_loader(checkpoint, dict(ANSWERS))
    with serve_in_thread(ServeOptions(model=str(checkpoint)), loader) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), loader.model


def _extra(decoder: str, enable: bool | None) -> dict:
    extra = {"decoder": decoder, "block_size": 8}
    if enable is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": enable}
    return extra


@pytest.mark.parametrize("decoder", ["ar", "low_confidence"])
def test_reasoning_is_split_out(thinking, decoder):
    client, _ = thinking
    out = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=100, extra_body=_extra(decoder, True)
    )
    message = out.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == REASONING
    assert message.model_extra["reasoning"] == REASONING
    assert out.choices[0].finish_reason == "stop"

    plain = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=100, extra_body=_extra(decoder, False)
    )
    assert plain.choices[0].message.content == ANSWER
    assert "reasoning_content" not in plain.choices[0].message.model_extra


@pytest.mark.parametrize("decoder", ["ar", "low_confidence"])
def test_reasoning_streams_without_partial_tags(thinking, decoder):
    client, _ = thinking
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=100, stream=True,
        extra_body=_extra(decoder, True),
    )  # fmt: skip
    reasoning, content = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            reasoning.append(extra["reasoning_content"])
        if delta.content:
            content.append(delta.content)
    pieces = reasoning + content
    assert "".join(reasoning) == REASONING and "".join(content) == ANSWER
    assert not any("<" in p or ">" in p for p in pieces)  # no fragment of a tag leaked
    if decoder == "ar":
        assert len(reasoning) > 3  # it really streamed, piece by piece


def test_a_model_that_opens_think_itself(thinking):
    client, model = thinking
    model.answers[False] = "<think>\nLet me see.</think>\n\nFour."
    try:
        out = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=100, extra_body={"decoder": "ar"}
        )
        message = out.choices[0].message
        assert (message.content, message.model_extra["reasoning_content"]) == (
            "Four.",
            "Let me see.",
        )
    finally:
        model.answers[False] = ANSWER


def test_reasoning_cut_by_max_tokens_stays_reasoning(thinking):
    client, _ = thinking
    out = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=4, extra_body=_extra("ar", True)
    )
    message = out.choices[0].message
    assert message.content == "" and REASONING.startswith(message.model_extra["reasoning"])
    assert out.choices[0].finish_reason == "length"


def test_a_failing_step_is_a_500_without_details(thinking):
    client, model = thinking
    http = client.with_options(max_retries=0)
    model.fail = True
    try:
        with pytest.raises(InternalServerError) as e:
            http.chat.completions.create(model="tiny", messages=ASK, max_tokens=8)
    finally:
        model.fail = False
    assert e.value.status_code == 500
    assert e.value.body == {
        "message": "generation failed", "type": "server_error", "param": None,
        "code": "engine_error",
    }  # fmt: skip
    assert "secret" not in e.value.response.text and "Traceback" not in e.value.response.text
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=100)
    assert out.choices[0].message.content == ANSWER  # and the server goes on


def test_stop_strings(thinking):
    client, _ = thinking
    out = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=100, stop=["is 4", "zzz"],
        extra_body={"decoder": "ar"},
    )  # fmt: skip
    assert out.choices[0].message.content == "The answer "
    assert out.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=100, stop="answer", stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The "
    assert chunks[-1].choices[0].finish_reason == "stop"
