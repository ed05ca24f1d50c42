"""Agent features end to end with the openai client: tools, thinking budget, JSON output.

The scripted model (`ScriptedLM`) spells a chosen answer, so tool-call parsing (and its
fallback for invalid JSON) and the thought's budget can be checked against exact text; a tiny
random model checks that constrained decoding always returns valid JSON, whatever it "wants".
"""

from __future__ import annotations

import json

import pytest
from openai import BadRequestError, OpenAI

from clover.engine import LLM
from clover.serving.json_grammar import validate
from clover.serving.options import ServeOptions
from tests.test_server_support import (
    THINKING_CHATML,
    scripted_loader,
    serve_in_thread,
    write_checkpoint,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ARGS = '{"city": "Paris", "unit": "c"}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]
REASONING = "First I think about the weather in Paris for a while, slowly and at length."
ANSWER = "It is sunny."


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("agent"), 2048, THINKING_CHATML)
    load = scripted_loader(
        checkpoint, {False: CALL, True: f"{REASONING}</think>\n{ANSWER}"}, context=2048
    )

    with serve_in_thread(ServeOptions(model=str(checkpoint)), load) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), load.model


def _script(model, text: str) -> None:
    model.answers[False] = text


# --- tools -----------------------------------------------------------------------------------


@pytest.mark.parametrize("decoder", ["ar", "low_confidence"])
def test_tool_call_is_parsed(scripted, decoder):
    client, model = scripted
    _script(model, "Let me check.\n" + CALL)
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=120,
        extra_body={"decoder": decoder, "block_size": 8},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and call.function.arguments == ARGS
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}


def test_tool_call_streams_arguments_as_they_commit(scripted):
    client, model = scripted
    _script(model, CALL)
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=120, stream=True,
        extra_body={"decoder": "ar"},
    )  # fmt: skip
    chunks = list(stream)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    pieces = [d.function.arguments for d in deltas if d.function.arguments]
    assert len(pieces) > 5  # streamed piece by piece, not at the end
    assert "".join(pieces) == ARGS and all(d.index == 0 for d in deltas)
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_calls_and_parallel_off(scripted):
    client, model = scripted
    second = CALL.replace("Paris", "Rome")
    _script(model, f"{CALL}\n{second}")
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, extra_body={"decoder": "ar"}
    )
    calls = out.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.id for c in calls}) == 2
    one = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200,
        parallel_tool_calls=False, extra_body={"decoder": "ar"},
    )  # fmt: skip
    assert len(one.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_json_is_plain_content(scripted, stream):
    client, model = scripted
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    _script(model, bad)
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=120)
    if not stream:
        out = client.chat.completions.create(**kw, extra_body={"decoder": "ar"})
        assert out.choices[0].message.content == bad
        assert not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop"
        return
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "Paris}}" in content  # what the call did not send comes out as text


def test_unknown_tool_name_and_tool_choice_none(scripted):
    client, model = scripted
    _script(model, CALL.replace("get_weather", "launch_rockets"))
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    assert out.choices[0].message.tool_calls is None and "launch_rockets" in (
        out.choices[0].message.content
    )
    _script(model, CALL)
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none"
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == CALL


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_is_enforced_while_decoding(scripted, choice):
    client, model = scripted
    _script(model, "I would rather chat about the weather than call anything at all.")
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_tokens=120,
        extra_body={"decoder": "low_confidence", "block_size": 8},
    )  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert validate(args, WEATHER["function"]["parameters"])
    assert out.choices[0].finish_reason == "tool_calls"


def test_tool_results_go_back_into_the_conversation(scripted):
    client, model = scripted
    _script(model, ANSWER)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "temp": 21}'},
    ]  # fmt: skip
    out = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
    assert out.choices[0].message.content == ANSWER
    assert out.choices[0].finish_reason == "stop"


def test_tools_rendering_without_template_support(tiny_checkpoint):
    from clover.serving.tools import render_inputs, template_knows_tools
    from clover.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_checkpoint)
    assert not template_knows_tools(tok)  # plain ChatML: tools go into a system block
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "name": "get_weather", "arguments": ARGS}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]  # fmt: skip
    messages, extra = render_inputs(history, [WEATHER], knows_tools=False)
    text = tok.apply_chat_template(messages, **extra)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text
    messages, extra = render_inputs(history, [WEATHER], knows_tools=True)
    assert extra == {"tools": [WEATHER]}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == json.loads(ARGS)


def test_bad_tool_requests_are_400(scripted):
    client, _ = scripted
    cases = [
        dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}),
        dict(extra_body={"reasoning_effort": "extreme"}),
    ]
    for kw in cases:
        with pytest.raises(BadRequestError):
            client.chat.completions.create(model="tiny", messages=ASK, **kw)


# --- thinking budget ---------------------------------------------------------------------------


def _think(decoder: str, **extra) -> dict:
    return {"decoder": decoder, "block_size": 32, "chat_template_kwargs": {"enable_thinking": True},
            **extra}  # fmt: skip


@pytest.mark.parametrize("decoder", ["ar", "low_confidence", "self_spec"])
def test_thinking_budget_closes_the_thought(scripted, decoder):
    client, model = scripted
    budget = 6
    out = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=100,
        extra_body=_think(decoder, max_thinking_tokens=budget),
    )  # fmt: skip
    message = out.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    expected = model.tok.decode(model.tok.encode(REASONING)[:budget]).rstrip()
    assert reasoning == expected  # exactly the budget's tokens, then the thought was closed
    assert "<" not in reasoning and not message.content.startswith("<")
    # the answer goes on after the forced close (the scripted model just keeps spelling)
    assert message.content.endswith(ANSWER) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_block_holding_the_close_splits_cleanly(scripted, stream):
    client, _ = scripted
    # one 32-token block spans the end of the thought, </think> and the answer's start
    kw = dict(model="tiny", messages=ASK, max_tokens=100, extra_body=_think("low_confidence"))
    if not stream:
        message = client.chat.completions.create(**kw).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (REASONING, ANSWER)
        return
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_reasoning_effort_maps_to_a_budget(scripted):
    client, _ = scripted
    out = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=100,
        extra_body=_think("ar", reasoning_effort="minimal"),
    )  # fmt: skip
    message = out.choices[0].message
    assert not message.model_extra.get("reasoning_content")  # budget 0: closed at once
    assert message.content
    full = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=100, extra_body=_think("ar", reasoning_effort="high")
    )
    assert full.choices[0].message.model_extra["reasoning_content"] == REASONING


# --- constrained JSON output -------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("json"), 512)
    loader = lambda: LLM(str(checkpoint), dtype="float32", progress=False)  # noqa: E731
    with serve_in_thread(ServeOptions(model=str(checkpoint)), loader) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_json_output_always_parses_and_validates(random_model):
    decoders = ["ar", "low_confidence", "self_spec"]
    formats = [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    ]
    for i in range(20):
        fmt = formats[i % 2]
        out = random_model.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"person {i}"}],
            response_format=fmt, max_tokens=40 + i, temperature=0.0 if i < 10 else 1.0, seed=i,
            stream=i % 5 == 4,
            extra_body={"decoder": decoders[i % 3], "block_size": 8, "threshold": 0.3},
        )  # fmt: skip
        if i % 5 == 4:
            text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
        else:
            text = out.choices[0].message.content
        # must parse: 40 tokens leave room for the schema's smallest document (30 characters),
        # so the budget check closes the JSON in time whatever the random weights prefer
        value = json.loads(text)
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            assert validate(value, SCHEMA), text


# --- the grammar and the rules, without a server -------------------------------------------------


def test_json_grammar_prefixes_and_completions():
    import random

    from clover.serving.json_grammar import JsonGrammar

    g = JsonGrammar()
    for doc in ['{"a": [1, -2.5e+3, true, null, "x\\u00e9"], "b": {}}', "12", "[]", '"hi"']:
        assert g.complete(g.feed(g.start(), doc)), doc
    for bad in ["{,", '{"a" 1', "[1,]", "01", "tru e", "{}x", "[1 2]", " {}"]:
        assert g.feed(g.start(), bad) is None, bad
    g = JsonGrammar(SCHEMA)
    assert g.feed(g.start(), '{"age":1.5') is None and g.feed(g.start(), '{"zz"') is None
    assert g.feed(g.start(), '{"age":1}') is None  # required keys missing
    rng = random.Random(0)
    alphabet = list('{}[]",:0123456789-.eE tfrualsn\\xyz')
    for _ in range(200):  # any valid prefix + its shortest completion is a valid document
        state, text = g.start(), ""
        for _ in range(rng.randint(0, 60)):
            options = [c for c in alphabet if g.feed(state, c) is not None]
            if not options:
                break
            c = rng.choice(options)
            state, text = g.feed(state, c), text + c
        assert validate(json.loads(text + g.completion(state)), SCHEMA)
