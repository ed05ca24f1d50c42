"""Anthropic's Messages API end to end with the official `anthropic` client (issue 21, item 4).

The scripted model (`ScriptedLM`) spells exact answers, so a whole agent loop can be checked
turn by turn: a tool call (streamed and not), its result sent back, the final answer, thinking
blocks with a budget, stop sequences, keep-alive pings while a slow prompt prefills, and every
malformed request answered in Anthropic's error shape.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from clover.serving.options import ServeOptions
from tests.test_server_support import (
    THINKING_CHATML,
    scripted_loader,
    serve_in_thread,
    write_checkpoint,
)

KEY = "sk-ant-test"
ARGS = '{"city": "Paris", "unit": "c"}'
CALL = f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
REASONING = "The user wants the weather, so I look it up."
ANSWER = "It is sunny in Paris."
TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("anthropic"), 2048, THINKING_CHATML)
    load = scripted_loader(
        checkpoint, {False: CALL, True: f"{REASONING}</think>\n{ANSWER}"}, context=2048
    )

    options = ServeOptions(model=str(checkpoint), api_key=KEY, sse_keepalive=0.05)
    with serve_in_thread(options, load) as url:
        client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        yield client, load.model, url


def _script(model, text: str) -> None:
    model.answers[False] = text


def test_agent_loop_with_a_tool_round_trip(served):
    client, model, _ = served
    _script(model, CALL)
    first = client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=[TOOL])
    assert first.stop_reason == "tool_use" and first.role == "assistant"
    text, use = first.content
    assert text.type == "text" and text.text == "Let me check."
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert use.input == {"city": "Paris", "unit": "c"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    assert first.usage.cache_read_input_tokens == 0

    _script(model, ANSWER)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [result]}]  # fmt: skip
    second = client.messages.create(model="tiny", max_tokens=200, messages=history, tools=[TOOL])
    assert second.stop_reason == "end_turn" and second.stop_sequence is None
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == ANSWER
    assert second.usage.input_tokens > first.usage.input_tokens  # the history grew


@pytest.mark.parametrize("decoder", ["ar", "low_confidence"])
def test_streamed_tool_call_matches_the_message(served, decoder):
    client, model, _ = served
    _script(model, CALL)
    extra = {"decoder": decoder, "block_size": 8}
    whole = client.messages.create(
        model="tiny", max_tokens=200, messages=ASK, tools=[TOOL], extra_body=extra
    )
    with client.messages.stream(
        model="tiny", max_tokens=200, messages=ASK, tools=[TOOL], extra_body=extra
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    json_deltas = [e.delta for e in events if e.type == "content_block_delta"]
    deltas = [d.partial_json for d in json_deltas if d.type == "input_json_delta"]
    assert json.loads("".join(deltas)) == {"city": "Paris", "unit": "c"}
    assert final.stop_reason == "tool_use"
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]


def test_thinking_blocks_stream_and_not(served):
    client, _, _ = served
    thinking = {"type": "enabled", "budget_tokens": 200}
    out = client.messages.create(model="tiny", max_tokens=200, messages=ASK, thinking=thinking)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == REASONING and out.content[1].text == ANSWER
    with client.messages.stream(
        model="tiny", max_tokens=200, messages=ASK, thinking=thinking
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING and final.content[1].text == ANSWER


def test_stop_sequences_and_max_tokens(served):
    client, model, _ = served
    _script(model, ANSWER)
    out = client.messages.create(model="tiny", max_tokens=200, messages=ASK,
                                 stop_sequences=["sunny"])  # fmt: skip
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "sunny"
    assert out.content[0].text == "It is "
    cut = client.messages.create(model="tiny", max_tokens=3, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_pings_while_a_slow_prompt_prefills(served):
    _, model, url = served
    _script(model, ANSWER)
    real, calls = model.backbone, []

    def slow(input_ids, layout, caches):
        calls.append(input_ids.shape[1])
        if len(calls) == 1:  # the prompt's pass
            __import__("time").sleep(0.5)
        return real(input_ids, layout, caches)

    model.backbone = slow
    try:
        body = {"model": "tiny", "max_tokens": 50, "messages": ASK, "stream": True}
        headers = {"x-api-key": KEY}
        with httpx.stream("POST", f"{url}/v1/messages", json=body, headers=headers) as r:
            lines = list(r.iter_lines())
        chat = {"messages": ASK, "max_tokens": 5, "stream": True}
        calls.clear()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
            chat_lines = list(r.iter_lines())
    finally:
        del model.backbone
    events = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    assert events.count("ping") >= 3  # one at the start, then while the prompt prefilled
    assert events[-1] == "message_stop"
    assert chat_lines.count(": keep-alive") >= 3


BAD = [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 10, "messages": []}, "messages"),
    ({"max_tokens": 10, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
    ({"max_tokens": 10, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 10, "messages": ASK, "tools": [{"type": "web_search_20250305"}]}, "custom"),
    ({"max_tokens": 10, "messages": ASK, "tools": [TOOL], "tool_choice": {"type": "x"}},
     "tool_choice"),
    ({"max_tokens": 10, "messages": ASK, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"max_tokens": 10, "messages": ASK, "model": "claude-x"}, "claude-x"),
    ({"max_tokens": 10, "messages": ASK, "stop_sequences": "stop"}, "stop_sequences"),
    ({"max_tokens": 10**6, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 10, "messages": ASK, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
]  # fmt: skip


def test_malformed_requests_get_anthropic_errors(served):
    client, _, url = served
    for body, words in BAD:
        r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY})
        assert 400 <= r.status_code < 500, (body, r.text)
        error = r.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        assert words in error["error"]["message"], (words, error)
    r = httpx.post(f"{url}/v1/messages", content=b"{", headers={"x-api-key": KEY,
                   "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    wrong = anthropic.Anthropic(base_url=url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="tiny", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=5, messages=ASK)
    r = httpx.get(f"{url}/v1/messages/nothing", headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
