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
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)

    @property
    def choices(self) -> int:
        return sum(t.n for t, _ in self.tickets)

    @property
    def deadline(self) -> float | None:
        timeout = self.runtime.options.request_timeout
        return None if timeout is None else self.started + timeout

    def usage(self, completions: list[Completion]) -> dict[str, Any]:
        """`completions` in choice order: all of the call's, each prompt's first choice
        counting its cached tokens (the others share that prompt)."""
        generated = sum(c.output_tokens for c in completions)
        cached = sum(completions[k].cached_tokens for _, k in self.tickets)
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
        return {
            "completion_tokens": tokens,
            "nfe": nfe,
            "tpf": round(tokens / nfe, 3) if nfe else 0.0,
            "decode_seconds": round(decode, 4),
            "tokens_per_s": round(tokens / decode, 2) if decode > 0 else 0.0,
            "total_seconds": round(time.monotonic() - self.started, 4),
            "cached_tokens": cached,
            "prefill_tokens": prefilled,
            "prefill_seconds": round(prefill, 4),
            "prefill_tokens_per_s": round(prefilled / prefill, 2) if prefill > 0 else 0.0,
        }

    def record(self, completions: list[Completion]) -> None:
        tokens = sum(c.output_tokens for c in completions)
        nfe = sum(c.nfe for c in completions)
        seconds = time.monotonic() - self.started
        self.runtime.metrics.finished(self.prompt_tokens, tokens, nfe, seconds)


def _finish_reason(c: Completion) -> str:
    return "length" if c.finish_reason == "length" else "stop"


# --- non-streamed ----------------------------------------------------------------------------


async def complete(call: Call, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
    """Wait for every choice; the response body (raises APIError, ClientGone)."""
    done: dict[int, Completion] = {}
    first = True
    async with aclosing(ticket_events(call.tickets, call.deadline, disconnected)) as events:
        async for event in events:
            if first and event["type"] == "delta" and event["text"]:
                first = False
                call.runtime.metrics.first_token(time.monotonic() - call.started)
            if event["type"] == "done":
                done[event["choice"]] = event["completion"]
    completions = [done[i] for i in range(call.choices)]
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


async def stream(call: Call) -> AsyncIterator[str]:
    """The SSE body. Cancelled when the client goes away, which cancels the tickets."""
    s = _Stream(call)
    splitters = [
        ReasoningSplitter(call.reasoning_start) if call.chat else None for _ in range(call.choices)
    ]
    tools = [
        ToolCallStream(call.tool_names, call.request.parallel_tool_calls)
        if call.tool_names is not None
        else None
        for _ in range(call.choices)
    ]
    completions: dict[int, Completion] = {}
    first = True
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
        async with aclosing(ticket_events(call.tickets, call.deadline)) as events:
            async for event in events:
                i = event["choice"]
                if event["type"] == "delta":
                    if first and event["text"]:
                        first = False
                        call.runtime.metrics.first_token(time.monotonic() - call.started)
                    parts = _tool_parts(tools[i], _split(splitters[i], event["text"], push=True))
                    part = parts.pop() if parts else {}
                    for earlier in parts:
                        yield s.chunk(i, earlier)
                    extra = {}
                    if call.request.commits and event["commits"]:
                        extra["clover"] = {
                            "step": event["step"],
                            "commits": [
                                [index, call.runtime.token_text(token), step]
                                for index, token, step in event["commits"]
                            ],
                        }
                    if part or extra:
                        yield s.chunk(i, part, **extra)
                else:  # done
                    c = completions[i] = event["completion"]
                    parts = _tool_parts(tools[i], _split(splitters[i], "", push=False), True)
                    for part in parts:
                        yield s.chunk(i, part)
                    reason = _finish_reason(c)
                    if tools[i] is not None and tools[i].called:
                        reason = "tool_calls"
                    yield s.chunk(i, {}, reason, timings=call.timings([c]))
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
