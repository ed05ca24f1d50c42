"""Anthropic's Messages API, `POST /v1/messages`, on the chat/completions machinery.

No second generation path: a Messages body is translated into a chat/completions body
(`to_chat_body`) and validated by `protocol.parse_chat` like any chat request, so tools,
thinking budgets, constraints and the scheduler are the same code. Out, the chat completion
body becomes a Message (`message`), and the shared answer pieces become Anthropic's stream
events (`stream`): message_start, then per content block content_block_start /
content_block_delta / content_block_stop (thinking, text, tool_use with input_json_delta),
message_delta (stop_reason, usage) and message_stop, with `ping` events at the start and
while the prompt prefills. Errors use Anthropic's shape (`errors.APIError.body`).

Mapping: `system` -> a system message; user `tool_result` blocks -> tool messages (before
the user's text, as Anthropic orders them); assistant `tool_use` blocks -> tool_calls;
assistant `thinking` blocks are dropped (templates drop past reasoning too); `tools[].
input_schema` -> function parameters; tool_choice auto / any / tool / none -> auto /
required / the function / none; `thinking.budget_tokens` -> max_thinking_tokens (with
`enable_thinking` for templates that read it); `stop_sequences` -> stop. Images, documents
and server tools are refused with a 400 that names them. Clover's own sampling fields
(decoder, block_size, ...) pass through.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from clover.decoding.settings import specs
from clover.engine import Completion
from clover.serving.errors import APIError, bad_request
from clover.serving.protocol import MAX_STOPS, Names
from clover.serving.responses import Blocks, Call, arguments_object, matched_stop, pieces

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
UNSUPPORTED = ("mcp_servers", "container")  # refused rather than silently dropped
# the settings a Messages request spells as chat does (`decoding/settings.py`), and the
# two it spells its own way
RENAMED = {"max_tokens": "max_tokens", "stop": "stop_sequences"}
PASS_THROUGH = (
    *(f.name for f, _ in specs("http") if f.name not in RENAMED),
    "model", "stream", "parse_special_tokens", "chat_template_kwargs", "cache_salt",
)  # fmt: skip
NAMES = Names(
    tool="tools[{}]", schema="input_schema", named_choice="{type: tool, name}",
    response_format="output_format", response_schema="output_format.schema",
    thinking="thinking.budget_tokens", effort="thinking",
)  # fmt: skip


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A Messages request -> the equivalent chat/completions request (400s name the fields
    as Anthropic's API spells them)."""
    for name in UNSUPPORTED:
        if body.get(name):
            raise bad_request(f"{name} is not supported by this server", name, "unsupported")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad_request("max_tokens is required", "max_tokens")
    out: dict[str, Any] = {k: body[k] for k in PASS_THROUGH if k in body}
    out["max_tokens"] = max_tokens
    if isinstance(body.get("temperature"), int | float) and not 0 <= body["temperature"] <= 1:
        raise bad_request("temperature must be in [0, 1]", "temperature")
    if "stop_sequences" in body:
        out["stop"] = _stop_sequences(body["stop_sequences"])
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    asked: set[str] = set()  # tool_use ids of the assistant turn before, not yet answered
    for i, m in enumerate(raw):
        converted, asked = _message(m, f"messages[{i}]", asked, last=i == len(raw) - 1)
        messages += converted
    out["messages"] = messages
    tools = body.get("tools")
    names = []
    if tools is not None:
        out["tools"] = _tools(tools)
        names = [t["function"]["name"] for t in out["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        out["tool_choice"], parallel = _tool_choice(choice, names)
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    thinking = body.get("thinking")
    if thinking is not None:
        _thinking(thinking, out)
    return out


def _system(system: object) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        return [{"role": "system", "content": "\n".join(_text(b, "system") for b in system)}]
    raise bad_request("system must be a string or a list of text blocks", "system")


def _text(block: object, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else None
        raise bad_request(f"{where}: only text blocks are supported here, got {kind!r:.40}", where)
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text must be a string", where)
    return block["text"]


def _stop_sequences(stops: object) -> list[str]:
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop_sequences must be a list of strings", "stop_sequences")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop_sequences: at most {MAX_STOPS}", "stop_sequences")
    for i, stop in enumerate(stops):
        if not stop:
            raise bad_request(f"stop_sequences[{i}] must not be empty", f"stop_sequences[{i}]")
    return stops


def _message(
    m: object, where: str, asked: set[str], last: bool
) -> tuple[list[dict[str, Any]], set[str]]:
    """One Messages turn -> chat messages, and the tool_use ids it leaves to answer. `asked`
    are those of the turn before it; `last`: the final turn (the only one whose assistant
    content may be empty, or whose tool_use may stay unanswered)."""
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object", where)
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be user or assistant", f"{where}.role")
    may_be_empty = last and role == "assistant"
    if isinstance(content, str):
        content = [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks",
                          f"{where}.content")  # fmt: skip
    if not content and not may_be_empty:
        raise bad_request(
            f"{where}.content is empty: only a final assistant turn may be", f"{where}.content"
        )
    texts, calls, results = [], [], []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(block, at))
            if not texts[-1] and not may_be_empty:
                raise bad_request(f"{at}.text is empty: text blocks must hold text", f"{at}.text")
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            if texts:
                raise bad_request(f"{at}: tool_result blocks must come before any text", at)
            results.append(_tool_result(block, at, asked))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # past reasoning is not replayed
        else:
            raise bad_request(f"{at}: a {kind!r:.40} block is not supported in a {role} turn", at)
    if asked:
        answered = {r["tool_call_id"] for r in results}
        if role != "user" or not asked <= answered:
            missing = ", ".join(sorted(asked - answered))[:200]
            raise bad_request(
                f"{where}: the turn before it called tools whose tool_result is missing here: "
                f"{missing}",
                where,
            )
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        return ([message] if texts or calls else []), {c["id"] for c in calls}
    out = results
    if texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out, set()


def _tool_use(block: dict, where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise bad_request(f"{where}: tool_use needs an id and a name", where)
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise bad_request(f"{where}.input must be an object", where)
    fn = {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}
    return {"id": block["id"], "type": "function", "function": fn}


def _tool_result(block: dict, where: str, asked: set[str]) -> dict[str, Any]:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise bad_request(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    if use_id not in asked:
        raise bad_request(
            f"{where}.tool_use_id {use_id[:80]!r} answers no tool_use of the assistant turn "
            "just before it",
            f"{where}.tool_use_id",
        )
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text(b, f"{where}.content") for b in content)
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or text blocks", where)
    if block.get("is_error") is True:
        content = f"[error] {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tools(tools: object) -> list[dict[str, Any]]:
    """Custom tools -> chat tools (their names and schemas are checked by `parse_chat`,
    which names them as `NAMES` spells them)."""
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"{where}: only custom tools are supported, got {kind!r:.40}",
                              f"{where}.type")  # fmt: skip
        fn: dict[str, Any] = {"name": tool.get("name")}
        if "description" in tool:
            fn["description"] = tool["description"]
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad_request(f"{where}.input_schema must be a JSON schema of type object",
                              f"{where}.input_schema")  # fmt: skip
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object, tools: list[str]) -> tuple[Any, bool | None]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice.type must be auto, any, tool or none", "tool_choice.type")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean",
                          "tool_choice.disable_parallel_tool_use")  # fmt: skip
    parallel = None if disable is None else not disable
    if kind in ("any", "tool") and not tools:
        raise bad_request(f"tool_choice of type {kind} needs tools", "tool_choice.type")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice of type tool needs a name", "tool_choice.name")
        if name not in tools:
            raise bad_request(f"tool_choice.name {name[:64]!r} is not one of tools",
                              "tool_choice.name")  # fmt: skip
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _thinking(thinking: object, out: dict[str, Any]) -> None:
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise bad_request("thinking.type must be enabled or disabled", "thinking.type")
    kwargs = dict(out.get("chat_template_kwargs") or {})
    kwargs["enable_thinking"] = kind == "enabled"
    out["chat_template_kwargs"] = kwargs
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise bad_request("thinking.budget_tokens must be a positive integer",
                              "thinking.budget_tokens")  # fmt: skip
        out["max_thinking_tokens"] = budget


# --- out ------------------------------------------------------------------------------------


def usage(call: Call, completions: list[Completion]) -> dict[str, int]:
    """Anthropic's usage from the chat usage object (cached prompt tokens, once the engine
    reports them there, count as cache reads and not as input)."""
    u = call.usage(completions)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "output_tokens": u["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _stop(call: Call, c: Completion, reason: str) -> tuple[str, str | None]:
    if reason in STOP_REASONS:
        return STOP_REASONS[reason], None
    stop = matched_stop(call, c)
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def message(call: Call, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion body (one choice) -> an Anthropic Message."""
    choice = chat["choices"][0]
    m = choice["message"]
    content: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    for tc in m.get("tool_calls") or []:
        fn = tc["function"]
        content.append(
            {"type": "tool_use", "id": tool_id(tc["id"]), "name": fn["name"],
             "input": arguments_object(fn["arguments"])}
        )  # fmt: skip
    completion = call.completions[0]
    reason, stop = _stop(call, completion, choice["finish_reason"])
    return {
        "id": call.id, "type": "message", "role": "assistant", "model": call.model,
        "content": content, "stop_reason": reason, "stop_sequence": stop,
        "usage": usage(call, [completion]),
    }  # fmt: skip


def event(kind: str, payload: dict[str, Any]) -> str:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


BLOCK_STARTS = {
    "reasoning": lambda info: {"type": "thinking", "thinking": "", "signature": ""},
    "text": lambda info: {"type": "text", "text": ""},
    "tool": lambda info: {
        "type": "tool_use",
        "id": tool_id(info["id"]),
        "name": info["name"],
        "input": {},
    },
}
DELTAS = {
    "reasoning": lambda text: {"type": "thinking_delta", "thinking": text},
    "text": lambda text: {"type": "text_delta", "text": text},
    "tool": lambda text: {"type": "input_json_delta", "partial_json": text},
}


async def stream(call: Call) -> AsyncIterator[str]:
    """The Messages SSE stream."""
    start = {
        "id": call.id, "type": "message", "role": "assistant", "model": call.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": usage(call, []),
    }  # fmt: skip
    yield event("message_start", {"message": start})
    yield event("ping", {})
    blocks, index = Blocks(), -1
    try:
        async with aclosing(pieces(call)) as answer:
            async for piece in answer:
                if piece.ping:
                    yield event("ping", {})
                    continue
                steps = blocks.feed(piece.parts)
                if piece.done is not None:
                    steps += blocks.close()
                for what, kind, data in steps:
                    if what == "open":
                        index += 1
                        start = {"index": index, "content_block": BLOCK_STARTS[kind](data)}
                        yield event("content_block_start", start)
                    elif what == "delta":
                        delta = {"index": index, "delta": DELTAS[kind](data)}
                        yield event("content_block_delta", delta)
                    else:
                        yield event("content_block_stop", {"index": index})
                if piece.done is not None:
                    c = piece.done
                    call.record([c])
                    reason, stop = _stop(call, c, piece.reason)
                    # the whole usage, cumulative as the API reports it: the cache reads are
                    # known only now, and clients take these over message_start's
                    yield event(
                        "message_delta",
                        {"delta": {"stop_reason": reason, "stop_sequence": stop},
                         "usage": usage(call, [c])},
                    )  # fmt: skip
                    yield event("message_stop", {})
    except APIError as e:
        yield event("error", {"error": e.body("anthropic")["error"]})
