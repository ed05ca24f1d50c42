"""OpenAI's Responses API, `POST /v1/responses`, on the chat/completions machinery.

As with `anthropic.py`, no second generation path: the body is translated into a chat
request (`to_chat_body`) and validated by `protocol.parse_chat`; the chat completion becomes a
Response object (`response`) and the shared answer pieces become the Responses stream
(`stream`): response.created, response.in_progress, then per output item
output_item.added, its deltas (reasoning_text, output_text with its content part,
function_call_arguments) and their .done events, output_item.done, and finally
response.completed (response.incomplete when max_output_tokens cut the answer). Every event
carries a sequence_number. Errors keep OpenAI's error shape.

Mapping: `instructions` -> a system message; `input` as a string -> one user message; as
items: messages (input_text / output_text parts), `function_call` items -> an assistant
message's tool_calls (consecutive calls share one message), `function_call_output` -> tool
messages, `reasoning` items dropped; flat function tools -> chat tools; `text.format` ->
response_format; `reasoning.effort` -> reasoning_effort; `max_output_tokens` -> max_tokens.
The server stores nothing, so `previous_response_id` and `background` are refused with a 400
that says to send the whole conversation.

Errors name the Responses API's fields, as its reference spells them: `max_output_tokens`,
`text.format`, `input[2].content`, `tools[0].name`, the `{type: function, name}` tool_choice
(`NAMES` for the fields that `protocol.parse_chat` checks after the translation).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from clover.decoding.settings import specs
from clover.engine import Completion
from clover.serving.errors import APIError, bad_request
from clover.serving.protocol import Names
from clover.serving.responses import KEEPALIVE, Blocks, Call, pieces

# the settings a Responses request spells as chat does (`decoding/settings.py`; `stop` too,
# which OpenAI's Responses lacks), and the one it spells its own way
RENAMED = {"max_tokens": "max_output_tokens"}
PASS_THROUGH = (
    *(f.name for f, _ in specs("http") if f.name not in RENAMED),
    "model", "stream", "parallel_tool_calls", "parse_special_tokens", "chat_template_kwargs",
    "user", "cache_salt",
)  # fmt: skip
NAMES = Names(
    max_tokens="max_output_tokens", messages="input", tool="tools[{}]", schema="parameters",
    named_choice="{type: function, name}", response_format="text.format",
    response_schema="text.format.schema", thinking="reasoning.effort", effort="reasoning.effort",
)  # fmt: skip
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ECHOED = (
    "instructions", "max_output_tokens", "metadata", "previous_response_id", "temperature",
    "top_p", "tool_choice", "tools", "parallel_tool_calls", "user",
)  # fmt: skip
TEXT_PARTS = ("input_text", "output_text", "text")


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request -> the equivalent chat/completions request."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad_request(
                f"{name} is not supported: this server stores no responses; send the whole "
                "conversation in input",
                name,
                "unsupported",
            )
    for name in ("background", "prompt", "top_logprobs"):
        if body.get(name):
            raise bad_request(f"{name} is not supported by this server", name, "unsupported")
    out: dict[str, Any] = {k: body[k] for k in PASS_THROUGH if k in body}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a non-empty string or list of items", "input")
    for i, item in enumerate(items):
        _item(item, f"input[{i}]", messages)
    out["messages"] = messages
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_request("reasoning must be an object", "reasoning")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    return out


def _item(item: object, where: str, messages: list[dict[str, Any]]) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{where}.role must be user, assistant, system or developer",
                              f"{where}.role")  # fmt: skip
        content = item.get("content")
        if isinstance(content, list):
            content = "\n".join(_part(p, f"{where}.content[{k}]") for k, p in enumerate(content))
        elif not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of parts",
                              f"{where}.content")  # fmt: skip
        messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
        if not all(isinstance(v, str) for v in (call_id, name, args)):
            raise bad_request(f"{where}: function_call needs call_id, name and arguments "
                              "(a JSON string)", where)  # fmt: skip
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = "\n".join(_part(p, f"{where}.output") for p in output)
        if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
            raise bad_request(f"{where}: function_call_output needs call_id and output", where)
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    elif kind != "reasoning":  # past reasoning is not replayed
        raise bad_request(f"{where}: input items of type {kind!r:.40} are not supported",
                          f"{where}.type")  # fmt: skip


def _part(part: object, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
        raise bad_request(f"{where}: only text parts are supported, got {kind!r:.40}", where)
    return part["text"]


def _tools(tools: object) -> list[dict[str, Any]]:
    """Flat function tools -> chat tools (names and schemas checked by `parse_chat`)."""
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported, got {kind!r:.40}",
                              f"tools[{i}].type")  # fmt: skip
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name must be a string: tool_choice is "
                              "{type: function, name}", "tool_choice.name")  # fmt: skip
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be auto, none, required or {type: function, name}",
                      "tool_choice")  # fmt: skip


def _text_format(text: object) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not _FORMAT_NAME.fullmatch(name):
            raise bad_request("text.format.name must match [A-Za-z0-9_-]{1,64}",
                              "text.format.name")  # fmt: skip
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object",
                              "text.format.schema")  # fmt: skip
        return {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"]}}
    raise bad_request("text.format.type must be text, json_object or json_schema",
                      "text.format.type")  # fmt: skip


def echo_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The request fields a Response object repeats back."""
    out = {k: body.get(k) for k in ECHOED}
    out["text"] = body.get("text") or {"format": {"type": "text"}}
    out["reasoning"] = body.get("reasoning") or {"effort": None, "summary": None}
    out["tool_choice"] = out["tool_choice"] or "auto"
    out["tools"] = out["tools"] or []
    out["parallel_tool_calls"] = out["parallel_tool_calls"] is not False
    out["metadata"] = out["metadata"] or {}
    return out


# --- out ------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(call: Call, completions: list[Completion]) -> dict[str, Any]:
    u = call.usage(completions)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _shell(call: Call, status: str, output: list, completions: list | None) -> dict[str, Any]:
    incomplete = status == "incomplete"
    return {
        "id": call.id, "object": "response", "created_at": call.created, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": call.model, "output": output, "store": False, "truncation": "disabled",
        **call.api,
        "usage": usage(call, completions) if completions is not None else None,
    }  # fmt: skip


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id or _id("msg"), "status": status,
            "role": "assistant", "content": content}  # fmt: skip


def _call_item(call_id: str, name: str, args: str, item_id: str | None = None,
               status: str = "completed") -> dict:  # fmt: skip
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id,
            "name": name, "arguments": args, "status": status}  # fmt: skip


def response(call: Call, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion body (one choice) -> a Response object."""
    choice = chat["choices"][0]
    m = choice["message"]
    output: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        output.append(_reasoning_item(m["reasoning_content"]))
    if m.get("content"):
        output.append(_message_item(m["content"]))
    for tc in m.get("tool_calls") or []:
        fn = tc["function"]
        output.append(_call_item(tc["id"], fn["name"], fn["arguments"]))
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return _shell(call, status, output, call.completions)


class _Items:
    """Block events (`responses.Blocks`) -> Responses stream events, numbered."""

    def __init__(self) -> None:
        self.n = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.item: dict[str, Any] = {}
        self.text = ""

    def emit(self, kind: str, payload: dict[str, Any]) -> str:
        body = {"type": kind, "sequence_number": self.n, **payload}
        self.n += 1
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    def step(self, what: str, kind: str, data: Any) -> list[str]:
        at = {"output_index": len(self.output)}
        if what == "open":
            return self._open(kind, data, at)
        ref = {**at, "item_id": self.item["id"]}
        if what == "delta":
            self.text += data
            if kind == "tool":
                return [self.emit("response.function_call_arguments.delta", {**ref, "delta": data})]
            if kind == "text":
                delta = {**ref, "content_index": 0, "delta": data, "logprobs": []}
                return [self.emit("response.output_text.delta", delta)]
            delta = {**ref, "content_index": 0, "delta": data}
            return [self.emit("response.reasoning_text.delta", delta)]
        return self._close(kind, at, ref)

    def _open(self, kind: str, data: Any, at: dict[str, int]) -> list[str]:
        self.text = ""
        if kind == "reasoning":
            self.item = {**_reasoning_item(""), "content": []}
        elif kind == "text":
            self.item = _message_item("", status="in_progress")
        else:
            self.item = _call_item(data["id"], data["name"], "", status="in_progress")
        out = [self.emit("response.output_item.added", {**at, "item": self.item})]
        if kind == "text":
            part = {**at, "item_id": self.item["id"], "content_index": 0, "part": _text_part("")}
            out.append(self.emit("response.content_part.added", part))
        return out

    def _close(self, kind: str, at: dict[str, int], ref: dict[str, Any]) -> list[str]:
        text, item = self.text, self.item
        if kind == "tool":
            done = _call_item(item["call_id"], item["name"], text, item["id"])
            args = {**ref, "name": item["name"], "arguments": text}
            out = [self.emit("response.function_call_arguments.done", args)]
        elif kind == "reasoning":
            done = _reasoning_item(text, item["id"])
            text_done = {**ref, "content_index": 0, "text": text}
            out = [self.emit("response.reasoning_text.done", text_done)]
        else:
            done = _message_item(text, item["id"])
            ref = {**ref, "content_index": 0}
            out = [
                self.emit("response.output_text.done", {**ref, "text": text, "logprobs": []}),
                self.emit("response.content_part.done", {**ref, "part": _text_part(text)}),
            ]
        self.output.append(done)
        return out + [self.emit("response.output_item.done", {**at, "item": done})]


async def stream(call: Call) -> AsyncIterator[str]:
    """The Responses SSE stream."""
    items, blocks = _Items(), Blocks()
    for kind in ("response.created", "response.in_progress"):
        yield items.emit(kind, {"response": _shell(call, "in_progress", [], None)})
    try:
        async with aclosing(pieces(call)) as answer:
            async for piece in answer:
                if piece.ping:
                    yield KEEPALIVE
                    continue
                steps = blocks.feed(piece.parts)
                if piece.done is not None:
                    steps += blocks.close()
                for what, kind, data in steps:
                    for text in items.step(what, kind, data):
                        yield text
                if piece.done is not None:
                    call.record([piece.done])
                    status = "incomplete" if piece.reason == "length" else "completed"
                    final = _shell(call, status, items.output, [piece.done])
                    yield items.emit(f"response.{status}", {"response": final})
    except APIError as e:
        yield items.emit("error", {"code": e.code, "message": e.message, "param": e.param})
