"""Each API speaks its own language (issue 61, item 4).

The same bad inputs go to chat/completions, Anthropic's /v1/messages and the Responses API,
each spelled as that API spells it; every error must name the field as the client sent it
(the audit found `tools[0].function.name`, `max_thinking_tokens`, `response_format` and
`max_tokens` in Anthropic and Responses errors). Anthropic's own rules (no empty content but a
final assistant turn's, a tool_result only for a tool_use just before it) and usage that is
the same streamed or not are checked against the official client.
"""

from __future__ import annotations

import re

import anthropic
import httpx
import pytest

from clover.engine import LLM
from clover.serving.options import ServeOptions
from tests.test_server_support import serve_in_thread, write_checkpoint

ASK = [{"role": "user", "content": "hello world"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^a"}}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("apis"), context=2048)
    options = ServeOptions(model=str(checkpoint), prefix_cache_mb=64)
    load = lambda: LLM(str(checkpoint), dtype="float32", progress=False)  # noqa: E731
    with serve_in_thread(options, load) as u:
        yield u


def chat_tool(name: str = "get_weather", params: dict = PARAMS) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def claude_tool(name: str = "get_weather", params: dict = PARAMS) -> dict:
    return {"name": name, "input_schema": params}


def responses_tool(name: str = "get_weather", params: dict = PARAMS) -> dict:
    return {"type": "function", "name": name, "parameters": params}


# (what is wrong, chat body + its field, Messages body + its field, Responses body + its field)
CHAT = {"messages": ASK, "max_tokens": 8}
CLAUDE = {"messages": ASK, "max_tokens": 8}
RESP = {"input": "hello world", "max_output_tokens": 8}
CASES = [
    ("a tool name that is not one",
     ({**CHAT, "tools": [chat_tool("bad name!")]}, "tools[0].function.name"),
     ({**CLAUDE, "tools": [claude_tool("bad name!")]}, "tools[0].name"),
     ({**RESP, "tools": [responses_tool("bad name!")]}, "tools[0].name")),
    ("a tool schema with an unsupported keyword",
     ({**CHAT, "tools": [chat_tool(params=BAD_SCHEMA)]}, "tools[0].function.parameters"),
     ({**CLAUDE, "tools": [claude_tool(params=BAD_SCHEMA)]}, "tools[0].input_schema"),
     ({**RESP, "tools": [responses_tool(params=BAD_SCHEMA)]}, "tools[0].parameters")),
    ("a token budget below 1",
     ({**CHAT, "max_tokens": 0}, "max_tokens"),
     ({**CLAUDE, "max_tokens": 0}, "max_tokens"),
     ({**RESP, "max_output_tokens": 0}, "max_output_tokens")),
    ("a token budget past the context",
     ({**CHAT, "max_tokens": 10**6}, "max_tokens"),
     ({**CLAUDE, "max_tokens": 10**6}, "max_tokens"),
     ({**RESP, "max_output_tokens": 10**6}, "max_output_tokens")),
    ("a forced tool that is not in tools",
     ({**CHAT, "tools": [chat_tool()],
       "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
     ({**CLAUDE, "tools": [claude_tool()], "tool_choice": {"type": "tool", "name": "nope"}},
      "tool_choice.name"),
     ({**RESP, "tools": [responses_tool()], "tool_choice": {"type": "function", "name": "nope"}},
      "tool_choice")),
    ("another API's tool_choice shape",
     ({**CHAT, "tools": [chat_tool()], "tool_choice": {"type": "function", "name": "get_weather"}},
      "{type: function, function: {name}}"),
     ({**CLAUDE, "tools": [claude_tool()],
       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
     ({**RESP, "tools": [responses_tool()],
       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
      "tool_choice.name")),
    ("a thinking budget below 0",
     ({**CHAT, "max_thinking_tokens": -1}, "max_thinking_tokens"),
     ({**CLAUDE, "thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
     ({**RESP, "reasoning": {"effort": "extreme"}}, "reasoning.effort")),
    ("an answer schema with an unsupported keyword",
     ({**CHAT, "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
      "response_format.json_schema.schema"),
     None,  # Messages has no answer format here
     ({**RESP, "text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
      "text.format.schema")),
    ("an answer schema whose shortest answer cannot fit",
     ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "string", "minLength": 10**4}}}}, "max_tokens"),
     None,
     ({**RESP, "text": {"format": {"type": "json_schema", "name": "x",
                                   "schema": {"type": "string", "minLength": 10**4}}}},
      "max_output_tokens")),
]  # fmt: skip
ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
# a field that belongs to another API and must not be named (as a whole word)
FOREIGN = {
    "/v1/chat/completions": ("input_schema", "max_output_tokens", "text.format"),
    "/v1/messages": ("function.name", "function.parameters", "max_thinking_tokens",
                     "response_format", "max_output_tokens"),
    "/v1/responses": ("function.name", "function.parameters", "response_format",
                      "reasoning_effort", r"(?<!output_)max_tokens", "input_schema"),
}  # fmt: skip


def _message(route: str, r: httpx.Response) -> str:
    error = r.json()["error"]
    if route == "/v1/messages":
        assert r.json()["type"] == "error" and set(error) == {"type", "message"}
    return error["message"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_same_bad_input_names_each_apis_own_field(url, case):
    for route, given in zip(ROUTES, case[1:]):
        if given is None:
            continue
        body, field = given
        r = httpx.post(f"{url}{route}", json=body, timeout=60)
        assert r.status_code == 400, (route, r.text)
        message = _message(route, r)
        assert field in message, (route, field, message)
        if route != "/v1/messages":  # OpenAI's shapes carry the field as `param` too
            param = r.json()["error"]["param"]
            assert param == field or field.startswith("{"), (route, param)
        for foreign in FOREIGN[route]:
            assert not re.search(rf"\b{foreign}\b", message), (route, foreign, message)


CLAUDE_RULES = [
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": ""}], "messages[0].content"),
    ([*ASK, {"role": "assistant", "content": []}, {"role": "user", "content": "and?"}],
     "messages[1].content"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                    "content": "sunny"}]}], "messages[0].content[0].tool_use_id"),
    ([*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather", "input": {}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                    "content": "sunny"}]}], "toolu_2"),
    ([*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather", "input": {}}]},
      {"role": "user", "content": "thanks"}], "toolu_1"),
    ([*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather", "input": {}}]},
      {"role": "user", "content": [{"type": "text", "text": "first"},
                                   {"type": "tool_result", "tool_use_id": "toolu_1"}]}],
     "before any text"),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "words"), CLAUDE_RULES)
def test_anthropic_conversation_rules(url, messages, words):
    """Audit: `content: []` and a tool_result with no matching tool_use were accepted."""
    body = {"max_tokens": 4, "messages": messages, "tools": [claude_tool()]}
    r = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert words in _message("/v1/messages", r)


def test_anthropic_accepts_what_its_rules_allow(url):
    history = [
        *ASK,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny"}, {"type": "text", "text": "so?"}]},
        {"role": "assistant", "content": ""},  # a final assistant turn may be empty
    ]  # fmt: skip
    body = {"max_tokens": 4, "messages": history, "tools": [claude_tool()]}
    r = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_anthropic_usage_is_the_same_streamed_or_not(url):
    """Audit: streamed /v1/messages never reported cache_read_input_tokens."""
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    ask = dict(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "the quick "
               "brown fox jumps over the lazy dog, twice: the quick brown fox jumps"}],
               extra_body={"decoder": "ar", "temperature": 0.0})  # fmt: skip
    client.messages.create(**ask)  # the prompt is in the prefix cache from here on
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert whole.usage.cache_read_input_tokens > 0
    for field in ("input_tokens", "output_tokens", "cache_read_input_tokens",
                  "cache_creation_input_tokens"):  # fmt: skip
        assert getattr(streamed.usage, field) == getattr(whole.usage, field), field
