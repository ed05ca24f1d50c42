"""OpenAI's Responses API end to end with the official `openai` client (issue 21, item 4).

As for the Messages API: the scripted model spells exact answers, so the agent loop (a
function call, its output sent back as an input item, the answer), streaming, reasoning
items, JSON output and the 400s can be checked with the client's own parsing.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from clover.serving.options import ServeOptions
from tests.test_server_support import (
    THINKING_CHATML,
    scripted_loader,
    serve_in_thread,
    write_checkpoint,
)

ARGS = '{"city": "Paris", "unit": "c"}'
CALL = f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
REASONING = "The user wants the weather, so I look it up."
ANSWER = "It is sunny in Paris."
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("responses"), 2048, THINKING_CHATML)
    load = scripted_loader(
        checkpoint, {False: CALL, True: f"{REASONING}</think>\n{ANSWER}"}, context=2048
    )

    with serve_in_thread(ServeOptions(model=str(checkpoint), api_key="k"), load) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0), load.model, url


def test_agent_loop_with_a_function_call_round_trip(served):
    client, model, _ = served
    model.answers[False] = CALL
    first = client.responses.create(
        model="tiny", instructions="Be brief.", input="Weather in Paris?", tools=[TOOL]
    )
    assert first.status == "completed" and first.object == "response"
    message, call = first.output
    assert message.type == "message" and first.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "c"}
    assert first.usage.input_tokens > 0 and first.usage.input_tokens_details.cached_tokens == 0
    assert first.instructions == "Be brief." and first.tools[0].name == "get_weather"

    model.answers[False] = ANSWER
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    items = [{"role": "user", "content": "Weather in Paris?"},
             *[item.model_dump(exclude_none=True) for item in first.output], result]  # fmt: skip
    second = client.responses.create(model="tiny", input=items, tools=[TOOL])
    assert second.output_text == ANSWER and [o.type for o in second.output] == ["message"]
    assert second.usage.input_tokens > first.usage.input_tokens


def test_stream_events_and_final_response(served):
    client, model, _ = served
    model.answers[False] = CALL
    whole = client.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL])
    events = list(client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[TOOL], stream=True
    ))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("output_item.added", "output_text.delta", "function_call_arguments.delta",
                 "output_item.done"):  # fmt: skip
        kind = f"response.{kind}"
        assert kind in kinds, kind
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == "Let me check." and args == ARGS
    final = events[-1].response
    strip = {"id", "call_id"}
    assert [o.model_dump(exclude=strip) for o in final.output] == [
        o.model_dump(exclude=strip) for o in whole.output
    ]
    with client.responses.stream(model="tiny", input="Weather in Paris?", tools=[TOOL]) as s:
        assert s.get_final_response().output[1].arguments == ARGS


def test_reasoning_items(served):
    client, _, _ = served
    extra = {"chat_template_kwargs": {"enable_thinking": True}}
    out = client.responses.create(model="tiny", input="Weather?", reasoning={"effort": "high"},
                                  extra_body=extra)  # fmt: skip
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert out.output_text == ANSWER
    events = list(client.responses.create(model="tiny", input="Weather?", stream=True,
                                          extra_body=extra))  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == REASONING


def test_json_output_and_incomplete(served):
    client, model, _ = served
    model.answers[False] = ANSWER  # the constraint overrides what the model would say
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = client.responses.create(
        model="tiny", input="ok?", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(out.output_text), schema)
    cut = client.responses.create(model="tiny", input="Weather?", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


BAD = [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "file_search_call"}]}, "file_search_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input_image"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "nope"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"pattern": "a"}}}}, "pattern"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "background": True}, "background"),
]  # fmt: skip


def test_malformed_requests_get_openai_errors(served):
    client, _, url = served
    for body, words in BAD:
        r = httpx.post(f"{url}/v1/responses", json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert words in error["message"], (words, error)
    with pytest.raises(BadRequestError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_1")
