"""Ollama's API end to end with the official `ollama` client (issue 60, item 3).

The scripted model (`ScriptedLM`) spells exact answers: chat and generate, streamed and not,
structured output through `format`, a tool call and its result sent back, thinking, the
model listings, and errors in Ollama's shape (`{"error": ...}`) for bad options, a context
too small, model management this server does not do.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from clover.serving.options import ServeOptions
from tests.test_server_support import (
    THINKING_CHATML,
    scripted_loader,
    serve_in_thread,
    write_checkpoint,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REASONING = "The user wants the weather, so I look it up."
ANSWER = "It is sunny in Paris."
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },  # fmt: skip
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
KEY = "ollama-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("ollama"), 2048, THINKING_CHATML)
    load = scripted_loader(
        checkpoint, {False: ANSWER, True: f"{REASONING}</think>\n{ANSWER}"}, context=2048
    )

    options = ServeOptions(model=str(checkpoint), served_model_name="tiny:latest", api_key=KEY)
    with serve_in_thread(options, load) as url:
        yield ollama.Client(host=url, headers=AUTH), load.model, url


def _script(model, text: str) -> None:
    model.answers[False] = text


def test_chat_and_streamed_chat(served):
    client, model, _ = served
    _script(model, ANSWER)
    out = client.chat(model="tiny:latest", messages=ASK, stream=False)
    assert out.message.role == "assistant" and out.message.content == ANSWER
    assert out.done and out.done_reason == "stop" and out.eval_count > 0
    assert out.prompt_eval_count > 0 and out.total_duration > 0
    parts = list(client.chat(model="tiny:latest", messages=ASK, stream=True))
    assert "".join(p.message.content for p in parts) == ANSWER
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count == out.eval_count


def test_generate_streamed_and_not_and_its_options(served):
    client, model, _ = served
    _script(model, ANSWER)
    out = client.generate(model="tiny:latest", prompt="Weather?", stream=False)
    assert out.response == ANSWER and out.done_reason == "stop"
    parts = list(client.generate(model="tiny:latest", prompt="Weather?", stream=True))
    assert "".join(p.response for p in parts) == ANSWER
    short = client.generate(model="tiny:latest", prompt="Weather?", options={"num_predict": 3})
    assert short.done_reason == "length" and short.eval_count == 3
    stopped = client.generate(model="tiny:latest", prompt="Weather?", options={"stop": [" in"]})
    assert stopped.response == "It is sunny"
    seeded = {"temperature": 0.9, "seed": 7, "top_k": 5, "top_p": 0.9, "num_ctx": 2048,
              "num_thread": 2, "decoder": "ar"}  # fmt: skip
    assert client.generate(model="tiny:latest", prompt="Weather?", options=seeded).done
    load = client.generate(model="tiny:latest")  # what clients send to warm a model up
    assert load.done and load.done_reason == "load" and load.response == ""


def test_structured_output_follows_the_schema(served):
    client, model, _ = served
    _script(model, '{"city": "Paris", "sunny": true}')
    schema = {"type": "object", "properties": {"city": {"type": "string"},
              "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}  # fmt: skip
    out = client.chat(model="tiny:latest", messages=ASK, format=schema)
    assert json.loads(out.message.content) == {"city": "Paris", "sunny": True}
    out = client.chat(model="tiny:latest", messages=ASK, format="json")
    assert json.loads(out.message.content)["city"] == "Paris"


def test_a_tool_call_and_its_result(served):
    client, model, _ = served
    _script(model, CALL)
    first = client.chat(model="tiny:latest", messages=ASK, tools=[TOOL])
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = [p for p in client.chat(model="tiny:latest", messages=ASK, tools=[TOOL],
                                       stream=True) if p.message.tool_calls]  # fmt: skip
    assert [c.function.arguments for p in streamed for c in p.message.tool_calls] == [
        {"city": "Paris"}
    ]
    _script(model, ANSWER)
    history = [
        *ASK,
        first.message,
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    second = client.chat(model="tiny:latest", messages=history, tools=[TOOL])
    assert second.message.content == ANSWER and not second.message.tool_calls


def test_thinking_comes_apart_from_the_answer(served):
    client, model, _ = served
    out = client.chat(model="tiny:latest", messages=ASK, think=True)
    assert out.message.thinking == REASONING and out.message.content == ANSWER
    parts = list(client.chat(model="tiny:latest", messages=ASK, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == REASONING


def test_the_model_listings(served):
    client, _, url = served
    (entry,) = client.list().models
    assert entry.model == "tiny:latest" and entry.details.quantization_level == "float32"
    assert [m.model for m in client.ps().models] == ["tiny:latest"]
    shown = client.show("tiny:latest")
    assert shown.modelinfo["context_length"] == 2048 and "completion" in shown.capabilities
    assert httpx.get(f"{url}/api/version", headers=AUTH).json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        client.show("other")
    assert e.value.status_code == 404 and "not found" in e.value.error


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"options": {"num_ctx": 100_000}}, "context is 2048"),
        ({"options": {"repeat_penalty": 1.3}}, "options.repeat_penalty is not supported"),
        ({"options": {"mirostat": 2}}, "options.mirostat is not supported"),
        ({"options": {"num_predict": "many"}}, "options.num_predict must be"),
        ({"options": {"temperature": 9}}, "temperature must be in"),
        ({"format": "yaml"}, "format must be"),
        ({"think": "maybe"}, "think must be"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
        ({"model": "other"}, "not served here"),
    ],
)
def test_bad_requests_are_one_clear_error(served, body, words):
    _, _, url = served
    r = httpx.post(f"{url}/api/chat", json={"model": "tiny:latest", "messages": ASK, **body},
                   headers=AUTH)  # fmt: skip
    assert 400 <= r.status_code < 500 and set(r.json()) == {"error"}, r.text
    assert words in r.json()["error"], r.json()


def test_model_management_is_refused_in_ollamas_shape(served):
    client, _, url = served
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")
    assert e.value.status_code == 501 and "clover pull" in e.value.error
    r = httpx.post(f"{url}/api/embed", json={"model": "tiny:latest", "input": "hi"}, headers=AUTH)
    assert r.status_code == 501 and "embeddings" in r.json()["error"]
    r = httpx.get(f"{url}/api/nothing", headers=AUTH)
    assert r.json() == {"error": "no such route: /api/nothing"}


def test_the_key_guards_ollamas_routes_too(served):
    _, _, url = served
    r = httpx.post(f"{url}/api/chat", json={"model": "tiny:latest", "messages": ASK})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).list()
    assert e.value.status_code == 401


def test_streams_are_ndjson_and_streaming_is_the_default(served):
    _, model, url = served
    _script(model, ANSWER)
    body = {"model": "tiny:latest", "messages": ASK}  # no "stream": Ollama streams
    with httpx.stream("POST", f"{url}/api/chat", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert len(lines) > 1 and lines[-1]["done"] and not any(x["done"] for x in lines[:-1])
    assert "".join(x["message"]["content"] for x in lines) == ANSWER
