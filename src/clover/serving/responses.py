"""Scheduler events -> OpenAI response bodies and server-sent-event streams.

Streams follow OpenAI's framing exactly: for chat, one chunk per choice with the assistant
role first, then content deltas, then a chunk with an empty delta and `finish_reason`; with
`stream_options.include_usage`, every chunk carries `"usage": null` and a last chunk with no
choices carries the usage; then `data: [DONE]`. Text is sent as the scheduler reports it,
which is text that has become final, so nothing sent ever changes.

`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens reused from the prefix
cache across requests (OpenAI's field; per prompt, from its first choice).

Two additions ride along without disturbing standard clients: `timings` (tokens/s, NFE, TPF,
prompt tokens cached and prefilled, prefill tokens/s) on each choice's last chunk and on
non-streamed bodies, and, only when the request asks with
`"clover_commits": true` (the web page does), a `clover` field with the diffusion's commits
`[answer index, token text, denoising step]`, sent as they happen, even when no text became
final yet. An error after the stream started is sent as an `error` event before `[DONE]`.

With tools, the content goes through the Hermes parser (`tools.py`): calls become `tool_calls`
(streamed: the call's header, then its arguments as they commit) and the choice finishes with
"tool_calls"; an answer whose calls do not parse stays plain content.

The split of an answer into reasoning, content and tool calls is done once, in `pieces`:
scheduler events -> `Piece`s whose `parts` are OpenAI delta dicts (`{"reasoning_content"}`,
`{"content"}`, `{"tool_calls": [...]}`). The chat/completions stream below, and the Anthropic
Messages and Responses streams (`anthropic.py`, `openai_responses.py`), only format them.
A quiet stream (a long prompt prefilling, a queue wait) gets a keep-alive every
`--sse-keepalive` seconds: an SSE comment here.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from clover.engine import Completion, GenerationSettings
from clover.serving.errors import APIError
from clover.serving.protocol import Request
from clover.serving.reasoning import ReasoningSplitter, split_reasoning
from clover.serving.runtime import Runtime, ticket_events
from clover.serving.scheduler import Ticket
from clover.serving.tenants import Tenant
from clover.serving.tools import ToolCallStream, parse_tool_calls


@dataclass
class Call:
    """One accepted request: what it asked for and the tickets that answer it."""

    runtime: Runtime
    chat: bool
    id: str
    model: str
    request: Request
    settings: GenerationSettings  # with the server's and the model's defaults filled in
    tickets: list[tuple[Ticket, int]]  # each with the index of its first choice
    prompt_tokens: int
    reasoning_start: bool = False  # chat: the prompt leaves the answer inside <think>
    tool_names: set[str] | None = None  # chat with tools: parse tool calls out of answers
    echo: list[str] = field(default_factory=list)  # completions: prompt text per choice
    api: dict[str, Any] = field(default_factory=dict)  # what another API's body repeats
    completions: list[Completion] = field(default_factory=list)  # once complete() is done
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)  # when the request arrived
    tenant: Tenant | None = None  # whose answer: /metrics and the token budget count it

    @property
    def choices(self) -> int:
        return sum(t.n for t, _ in self.tickets)

    @property
    def timeout(self) -> float | None:
        return self.runtime.options.request_timeout

    def usage(self, completions: list[Completion]) -> dict[str, Any]:
        """`completions` in choice order: all of the call's, each prompt's first choice
        counting its cached tokens (the others share that prompt); none yet (a stream's
        start) counts none."""
        generated = sum(c.output_tokens for c in completions)
        cached = sum(completions[k].cached_tokens for _, k in self.tickets if k < len(completions))
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": self.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def timings(self, completions: list[Completion]) -> dict[str, float]:
        tokens = sum(c.output_tokens for c in completions)
        nfe = sum(c.nfe for c in completions)
        decode = max((c.seconds for c in completions), default=0.0)
        cached = sum(c.cached_tokens for c in completions)
        prefilled = sum(c.prompt_tokens - c.cached_tokens for c in completions)
        prefill = max((c.prefill_seconds for c in completions), default=0.0)
        total = max(time.monotonic() - self.started, decode)  # decoding is inside the request
        return {
            "completion_tokens": tokens,
            "nfe": nfe,
            "tpf": round(tokens / nfe, 3) if nfe else 0.0,
            "decode_seconds": round(decode, 4),
            "tokens_per_s": round(tokens / decode, 2) if decode > 0 else 0.0,
            "total_seconds": round(total, 4),
            "cached_tokens": cached,
            "prefill_tokens": prefilled,
            "prefill_seconds": round(prefill, 4),
            "prefill_tokens_per_s": round(prefilled / prefill, 2) if prefill > 0 else 0.0,
        }

    def record(self, completions: list[Completion]) -> None:
        tokens = sum(c.output_tokens for c in completions)
        nfe = sum(c.nfe for c in completions)
        seconds = time.monotonic() - self.started
        drafts = [c.drafts for c in completions]
        cached = self.usage(completions)["prompt_tokens_details"]["cached_tokens"]
        name = self.tenant.name if self.tenant is not None else None
        self.runtime.metrics.finished(
            self.prompt_tokens, tokens, nfe, seconds, drafts, tenant=name, cached_tokens=cached
        )
        if self.tenant is not None:
            self.runtime.limiter.charge(self.tenant, tokens)


def _finish_reason(c: Completion) -> str:
    return "length" if c.finish_reason == "length" else "stop"


# --- non-streamed ----------------------------------------------------------------------------


async def complete(call: Call, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
    """Wait for every choice; the response body (raises APIError, ClientGone)."""
    done: dict[int, Completion] = {}
    first = True
    async with aclosing(ticket_events(call.tickets, call.timeout, disconnected)) as events:
        async for event in events:
            if first and event["type"] == "delta" and event["text"]:
                first = False
                call.runtime.metrics.first_token(time.monotonic() - call.started)
            if event["type"] == "done":
                done[event["choice"]] = event["completion"]
    completions = call.completions = [done[i] for i in range(call.choices)]
    call.record(completions)
    return {
        "id": call.id,
        "object": "chat.completion" if call.chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": [_choice(call, i, c) for i, c in enumerate(completions)],
        "usage": call.usage(completions),
        "timings": call.timings(completions),
    }


def _choice(call: Call, index: int, c: Completion) -> dict[str, Any]:
    reason = _finish_reason(c)
    if not call.chat:
        text = (call.echo[index] if call.echo else "") + c.text
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    reasoning, content = split_reasoning(c.text, call.reasoning_start)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = None
    if call.tool_names is not None:
        calls = parse_tool_calls(content, call.tool_names, call.request.parallel_tool_calls)
    if calls is not None:
        message["content"], message["tool_calls"] = calls
        reason = "tool_calls"
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}


# --- streamed --------------------------------------------------------------------------------


KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, idle timers restart


def sse(payload: dict[str, Any] | str) -> str:
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class _Stream:
    """Chunk builders for one streamed call."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.head = {
            "id": call.id,
            "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created,
            "model": call.model,
        }
        self.usage = call.request.include_usage

    def chunk(
        self, index: int, part: dict[str, Any], reason: str | None = None, **extra: Any
    ) -> str:
        choice: dict[str, Any] = {"index": index}
        if self.call.chat:
            choice["delta"] = part
        else:
            choice["text"] = part.get("content", "")
        choice["logprobs"] = None
        choice["finish_reason"] = reason
        body = {**self.head, "choices": [choice], **extra}
        if self.usage:
            body["usage"] = None
        return sse(body)


@dataclass
class Piece:
    """What one scheduler event means for one choice, in OpenAI delta dicts."""

    choice: int
    parts: list[dict[str, Any]] = field(default_factory=list)
    commits: dict[str, Any] | None = None  # the diffusion's commits, when the request asks
    done: Completion | None = None  # the choice is finished (its last parts are in `parts`)
    reason: str | None = None  # with `done`: stop, length or tool_calls
    ping: bool = False  # nothing happened for a while (choice -1)


async def pieces(call: Call) -> AsyncIterator[Piece]:
    """The answer's pieces as they become final. Raises APIError (timeout, engine errors)."""
    splitters = [
        ReasoningSplitter(call.reasoning_start) if call.chat else None for _ in range(call.choices)
    ]
    tools = [
        ToolCallStream(call.tool_names, call.request.parallel_tool_calls)
        if call.tool_names is not None
        else None
        for _ in range(call.choices)
    ]
    first = True
    keepalive = call.runtime.options.sse_keepalive
    async with aclosing(ticket_events(call.tickets, call.timeout, keepalive=keepalive)) as events:
        async for event in events:
            if event["type"] == "ping":
                yield Piece(-1, ping=True)
                continue
            i = event["choice"]
            if event["type"] == "delta":
                if first and event["text"]:
                    first = False
                    call.runtime.metrics.first_token(time.monotonic() - call.started)
                parts = _tool_parts(tools[i], _split(splitters[i], event["text"], push=True))
                commits = None
                if call.request.commits and event["commits"]:
                    commits = {
                        "step": event["step"],
                        "commits": [
                            [index, call.runtime.token_text(token), step]
                            for index, token, step in event["commits"]
                        ],
                    }
                if parts or commits:
                    yield Piece(i, parts, commits)
            else:  # done
                c = event["completion"]
                parts = _tool_parts(tools[i], _split(splitters[i], "", push=False), True)
                reason = _finish_reason(c)
                if tools[i] is not None and tools[i].called:
                    reason = "tool_calls"
                yield Piece(i, parts, done=c, reason=reason)


async def stream(call: Call) -> AsyncIterator[str]:
    """The chat/completions SSE body. Cancelled when the client goes away, which cancels the
    tickets."""
    s = _Stream(call)
    completions: dict[int, Completion] = {}
    opening = {}
    if call.request.commits:
        decoder = call.settings.decoder
        opening["clover"] = {"block_size": _block_size(call.settings), "decoder": decoder}
    for i in range(call.choices):
        if call.chat:
            yield s.chunk(i, {"role": "assistant", "content": ""}, **opening)
        elif call.echo or opening:
            yield s.chunk(i, {"content": call.echo[i] if call.echo else ""}, **opening)
    try:
        async with aclosing(pieces(call)) as answer:
            async for piece in answer:
                if piece.ping:
                    yield KEEPALIVE
                    continue
                i, parts = piece.choice, list(piece.parts)
                if piece.done is None:
                    part = parts.pop() if parts else {}
                    for earlier in parts:
                        yield s.chunk(i, earlier)
                    extra = {"clover": piece.commits} if piece.commits else {}
                    if part or extra:
                        yield s.chunk(i, part, **extra)
                    continue
                completions[i] = piece.done
                for part in parts:
                    yield s.chunk(i, part)
                yield s.chunk(i, {}, piece.reason, timings=call.timings([piece.done]))
    except APIError as e:
        yield sse(e.body())
    else:
        done = [completions[i] for i in range(call.choices)]
        call.record(done)
        if s.usage:
            yield sse({**s.head, "choices": [], "usage": call.usage(done)})
    yield sse("[DONE]")


def _split(splitter: ReasoningSplitter | None, text: str, push: bool) -> dict[str, Any]:
    if splitter is None:
        return {"content": text} if text else {}
    reasoning, content = splitter.push(text) if push else splitter.finish()
    part: dict[str, Any] = {}
    if reasoning:
        part["reasoning_content"] = part["reasoning"] = reasoning
    if content:
        part["content"] = content
    return part


def _tool_parts(
    tools: ToolCallStream | None, part: dict[str, Any], finish: bool = False
) -> list[dict[str, Any]]:
    """A delta through the tool-call parser: its content may become several parts."""
    if tools is None:
        return [part] if part else []
    text = part.pop("content", "")
    out = [part] if part else []  # reasoning passes untouched
    out += tools.push(text) if text else []
    if finish:
        out += tools.finish()
    return out


def _block_size(settings: GenerationSettings) -> int:
    return 1 if settings.decoder == "ar" else int(settings.block_size or 1)


class Blocks:
    """An answer's parts -> a run of blocks, for APIs that frame output as blocks or items
    (Anthropic's content blocks, the Responses API's output items): `feed(parts)` returns
    events `("open", kind, info)`, `("delta", kind, text)`, `("close", kind, info)`, with kind
    "reasoning", "text" or "tool" (info: {"id", "name"} for a tool, else {}). A new kind, or
    a new tool call, closes the open block first; `close()` ends the last one."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.info: dict[str, Any] = {}

    def feed(self, parts: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
        out: list[tuple[str, str, Any]] = []
        for part in parts:
            if part.get("reasoning_content"):
                out += self._to("reasoning") + [("delta", "reasoning", part["reasoning_content"])]
            if part.get("content"):
                out += self._to("text") + [("delta", "text", part["content"])]
            for call in part.get("tool_calls", []):
                fn = call.get("function", {})
                if "id" in call:  # a new call's header
                    out += self.close()
                    self.kind, self.info = "tool", {"id": call["id"], "name": fn.get("name", "")}
                    out.append(("open", "tool", self.info))
                if fn.get("arguments"):
                    out.append(("delta", "tool", fn["arguments"]))
        return out

    def _to(self, kind: str) -> list[tuple[str, str, Any]]:
        if self.kind == kind:
            return []
        out = self.close()
        self.kind, self.info = kind, {}
        return out + [("open", kind, {})]

    def close(self) -> list[tuple[str, str, Any]]:
        if self.kind is None:
            return []
        out = [("close", self.kind, self.info)]
        self.kind, self.info = None, {}
        return out


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's arguments (a JSON string) as the object the APIs that send objects want;
    text that is not a JSON object is kept whole under "arguments"."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def matched_stop(call: Call, c: Completion) -> str | None:
    """The stop string that ended an answer, if one did (Anthropic reports which)."""
    stops = call.settings.stop
    if c.finish_reason != "stop" or not stops:
        return None
    full = call.runtime.llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    hits = [s for s in stops if full.startswith(s, len(c.text))]
    return hits[0] if hits else None
