"""Ollama's API on the same server, for the editors and agents that speak it.

`/api/chat` and `/api/generate` bodies are translated into the equivalent chat/completions
body and take the one path every API takes (`app.start_chat`); answers come back as Ollama
frames them: newline-delimited JSON objects while they stream (Ollama's default), one object
with `"stream": false`. `options` map onto the settings spec (`decoding/settings.py`):
temperature, top_p, top_k, seed, stop, num_predict (the answer's token budget; -1 and -2:
as much as the context leaves), and Clover's own settings by their names; num_ctx above the
model's window is refused, and options that only tune Ollama's runtime (threads, GPU layers,
batch size, mmap) are accepted and have nothing to tune here. `format` ("json" or a JSON
schema) is `response_format`'s constrained decoding; `think` turns the model's thinking on
or off (or sets its effort: "low", "medium", "high"); tool calls come back whole, their
arguments an object. Errors are `{"error": message}` with the status (`errors.py`).

`/api/tags`, `/api/ps` and `/api/show` describe the one model served; `/api/version` the
server. Ollama's model management (`/api/pull`, `/api/create`, `/api/copy`, `/api/delete`,
`/api/push`, `/api/blobs`) and embeddings do not exist here: they answer 501 saying so.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import UTC, datetime
from typing import Any

from clover.decoding.settings import specs
from clover.serving.errors import APIError, bad_request
from clover.serving.protocol import Limits, Names
from clover.serving.responses import Blocks, Call, arguments_object, pieces

NAMES = Names(
    max_tokens="options.num_predict", tool="tools[{}].function", response_format="format",
    response_schema="format", thinking="think", effort="think",
)  # fmt: skip
MAPPED = {"temperature", "top_p", "top_k", "seed", "stop", "num_predict", "num_ctx"}
CLOVER = {f.name for f, _ in specs("http")} - {"max_tokens"}  # decoder, block_size, draft, ...
# Ollama's runtime knobs: how its own server loads and batches, nothing to do with the answer
RUNTIME = {
    "num_thread", "num_gpu", "main_gpu", "num_batch", "use_mmap", "use_mlock", "low_vram",
    "numa", "num_keep", "vocab_only", "f16_kv",
}  # fmt: skip
NEUTRAL = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
EFFORTS = ("low", "medium", "high")
MEDIA = "application/x-ndjson"
MANAGEMENT = ("pull", "push", "create", "copy", "delete", "blobs", "embed", "embeddings")


def to_chat_body(body: dict[str, Any], limits: Limits, generate: bool) -> dict[str, Any]:
    """An /api/chat (or, `generate`, /api/generate) body -> the chat/completions body."""
    out: dict[str, Any] = {"stream": body.get("stream", True)}
    if "model" in body:
        out["model"] = body["model"]
    out.update(_options(body.get("options"), limits))
    if generate:
        for name in ("raw", "suffix", "template", "context", "images"):
            if body.get(name):
                raise bad_request(f"{name} is not supported by this server", name, "unsupported")
        messages = []
        if body.get("system"):
            messages.append({"role": "system", "content": _string(body, "system")})
        messages.append({"role": "user", "content": _string(body, "prompt")})
        out["messages"] = messages
    else:
        out["messages"] = _messages(body.get("messages"))
        if body.get("tools") is not None:
            out["tools"] = body["tools"]
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        schema = {"name": "format", "schema": fmt}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt not in (None, ""):
        raise bad_request('format must be "json" or a JSON schema (an object)', "format")
    _think(body.get("think"), out)
    return out


def is_load(body: dict[str, Any], generate: bool) -> bool:
    """A body that only asks for the model to be loaded (Ollama's warm-up request): no
    prompt, or no messages."""
    return not body.get("prompt") if generate else body.get("messages") in (None, [])


def _string(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string", name)
    return value


def _options(options: object, limits: Limits) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise bad_request("options must be an object", "options")
    out: dict[str, Any] = {}
    for name, value in options.items():
        where = f"options.{name}"
        if name in NEUTRAL:
            if value is not None and value != NEUTRAL[name]:
                raise bad_request(f"{where} is not supported by this server", where, "unsupported")
        elif name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool) or value < -2 or value == 0:
                raise bad_request(f"{where} must be a positive integer (-1: no limit)", where)
            if value > 0:
                out["max_tokens"] = value
        elif name == "num_ctx":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad_request(f"{where} must be a positive integer", where)
            if value > limits.context_length:
                raise bad_request(
                    f"{where} is {value}; this model's context is {limits.context_length} "
                    "tokens", where, "context_length_exceeded",
                )  # fmt: skip
        elif name in MAPPED or name in CLOVER:
            out[name] = value
        elif name not in RUNTIME:
            raise bad_request(f"{where} is not supported by this server", where, "unsupported")
    return out


def _messages(messages: object) -> list[dict[str, Any]]:
    """Ollama's messages -> chat messages: tool calls get ids (Ollama's have none) and each
    tool result answers the earliest unanswered call of its tool_name (else of any)."""
    if not isinstance(messages, list):
        raise bad_request("messages must be a list", "messages")
    out, open_calls = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        if m.get("images"):
            raise bad_request("images are not supported: the model reads text", "images")
        msg = {k: m[k] for k in ("role", "content") if k in m}
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for k, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    raise bad_request(f"messages[{i}].tool_calls[{k}] needs a function", "messages")
                call_id = f"call_{i}_{k}"
                calls.append({"id": call_id, "type": "function", "function": fn})
                open_calls.append((call_id, fn.get("name")))
            msg["tool_calls"] = calls
        if m.get("role") == "tool":
            name = m.get("tool_name") or m.get("name")
            match = next((c for c in open_calls if c[1] == name), None) or (
                open_calls[0] if open_calls else None
            )
            if match is None:
                raise bad_request(f"messages[{i}] answers no tool call before it", "messages")
            open_calls.remove(match)
            msg["tool_call_id"], msg["name"] = match[0], match[1]
        out.append(msg)
    return out


def _think(think: object, out: dict[str, Any]) -> None:
    if think is None:
        return
    if isinstance(think, bool):
        out["chat_template_kwargs"] = {"enable_thinking": think}
        if not think:
            out["reasoning_effort"] = "none"
    elif think in EFFORTS:
        out["chat_template_kwargs"] = {"enable_thinking": True}
        out["reasoning_effort"] = think
    else:
        raise bad_request(f"think must be true, false or one of {', '.join(EFFORTS)}", "think")


# --- answers ---------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _stats(call: Call, done_reason: str) -> dict[str, Any]:
    """The closing object's fields: counts and durations in nanoseconds, as Ollama gives."""
    c = call.completions
    u = call.usage(c)
    decode = max((x.seconds for x in c), default=0.0)
    prefill = max((x.prefill_seconds for x in c), default=0.0)
    return {
        "done": True, "done_reason": done_reason,
        "total_duration": int((time.monotonic() - call.started) * 1e9), "load_duration": 0,
        "prompt_eval_count": u["prompt_tokens"], "prompt_eval_duration": int(prefill * 1e9),
        "eval_count": u["completion_tokens"], "eval_duration": int(max(decode - prefill, 0) * 1e9),
    }  # fmt: skip


def _reason(finish: str) -> str:
    return "length" if finish == "length" else "stop"


def message(call: Call, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion body -> /api/chat's one object."""
    choice = chat["choices"][0]
    m = choice["message"]
    msg: dict[str, Any] = {"role": "assistant", "content": m.get("content") or ""}
    if m.get("reasoning_content"):
        msg["thinking"] = m["reasoning_content"]
    if m.get("tool_calls"):
        msg["tool_calls"] = [
            {"function": {"name": tc["function"]["name"],
                          "arguments": arguments_object(tc["function"]["arguments"])}}
            for tc in m["tool_calls"]
        ]  # fmt: skip
    head = {"model": call.model, "created_at": _now(), "message": msg}
    return {**head, **_stats(call, _reason(choice["finish_reason"]))}


def generated(call: Call, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion body -> /api/generate's one object."""
    choice = chat["choices"][0]
    m = choice["message"]
    out: dict[str, Any] = {"model": call.model, "created_at": _now(),
                           "response": m.get("content") or ""}  # fmt: skip
    if m.get("reasoning_content"):
        out["thinking"] = m["reasoning_content"]
    return {**out, **_stats(call, _reason(choice["finish_reason"]))}


def line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"


def loaded(model: str, generate: bool) -> dict[str, Any]:
    """The answer to a load-only request."""
    out: dict[str, Any] = {"model": model, "created_at": _now()}
    out.update({"response": ""} if generate else {"message": {"role": "assistant", "content": ""}})
    return {**out, "done": True, "done_reason": "load"}


def streamer(generate: bool):  # noqa: ANN201 (an app.respond streamer)
    """The NDJSON stream of /api/chat (or /api/generate)."""

    def frame(call: Call, text: str = "", thinking: str = "", calls: list | None = None) -> dict:
        out: dict[str, Any] = {"model": call.model, "created_at": _now()}
        if generate:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            out["message"] = msg
        return out

    async def stream(call: Call) -> AsyncIterator[str]:
        blocks, args = Blocks(), ""
        try:
            async with aclosing(pieces(call)) as answer:
                async for piece in answer:
                    if piece.ping:
                        continue  # NDJSON has no comment line: the client waits on the socket
                    steps = blocks.feed(piece.parts)
                    if piece.done is not None:
                        steps += blocks.close()
                    for what, kind, data in steps:
                        if kind == "tool":  # whole calls, arguments an object
                            if what == "open":
                                name, args = data["name"], ""
                            elif what == "delta":
                                args += data
                            else:
                                fn = {"name": name, "arguments": arguments_object(args)}
                                yield line({**frame(call, calls=[{"function": fn}]), "done": False})
                        elif what == "delta":
                            part = {"thinking": data} if kind == "reasoning" else {"text": data}
                            yield line({**frame(call, **part), "done": False})
                    if piece.done is not None:
                        call.completions = [piece.done]
                        call.record([piece.done])
                        yield line({**frame(call), **_stats(call, _reason(piece.reason))})
        except APIError as e:
            yield line(e.body("ollama"))

    return stream


# --- the model served ------------------------------------------------------------------------


def model_entry(llm: Any, name: str) -> dict[str, Any]:
    """One model as /api/tags and /api/ps list it."""
    resolved = getattr(llm, "resolved", None)
    path = getattr(resolved, "path", None)
    size = path.stat().st_size if path is not None and path.is_file() else 0
    family = getattr(llm.model.config, "model_type", "")
    params = sum(p.numel() for p in llm.model.parameters())
    details = {
        "format": "gguf" if path is not None and path.suffix == ".gguf" else "safetensors",
        "family": family, "families": [family],
        "parameter_size": f"{params / 1e9:.1f}B" if params >= 1e8 else f"{params / 1e6:.0f}M",
        "quantization_level": llm.dtype,
    }  # fmt: skip
    return {"name": name, "model": name, "modified_at": _now(), "size": size,
            "digest": "", "details": details}  # fmt: skip


def show(llm: Any, name: str) -> dict[str, Any]:
    """/api/show: what the model is and what it can do."""
    entry = model_entry(llm, name)
    config = llm.model.config
    info = {
        "general.architecture": getattr(config, "model_type", ""),
        "general.parameter_count": sum(p.numel() for p in llm.model.parameters()),
        "context_length": llm.model.context_length,
    }
    template = getattr(llm.tokenizer, "chat_template", None) or ""
    capabilities = ["completion"] + (["tools"] if "tool" in template else [])
    capabilities += ["thinking"] if "think" in template else []
    return {"modified_at": entry["modified_at"], "details": entry["details"], "model_info": info,
            "template": template, "parameters": "", "capabilities": capabilities}  # fmt: skip


def unsupported(name: str) -> APIError:
    what = "embeddings" if name.startswith("embed") else "model management"
    return APIError(
        501,
        f"/api/{name} is not supported: this server serves one model, loaded at start, and "
        f"offers no {what} (`clover pull` and `clover serve -m MODEL` choose the model)",
        kind="invalid_request_error", code="unsupported",
    )  # fmt: skip
