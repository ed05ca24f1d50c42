"""The OpenAI request bodies, checked field by field before anything reaches the model.

We validate by hand instead of with pydantic models: each check knows the OpenAI `param` to
blame, the messages say what was expected, and the limits that depend on the loaded model
(context length, vocabulary, served name) are plain arguments. Unknown fields are ignored, as
OpenAI-compatible servers do, but a known feature this server does not implement (logprobs,
penalties, the legacy `functions`) is refused with 400 rather than silently dropped: an answer
that ignored the request would look valid and be wrong.

Agent features checked here: `tools` / `tool_choice` / `parallel_tool_calls` (`tools.py`),
`response_format` (json_object, or json_schema with the schema subset of `json_grammar.py`),
and the thinking budget: `max_thinking_tokens`, or `reasoning_effort` mapped through
`EFFORT_BUDGETS`. Schemas are only collected here (`ChatRequest.schemas`, by the field that
holds them): compiling one may take a while, so the handler does it in a worker thread
(`grammars.Grammars`), and a bad one is still a 400 that names its field.

The Anthropic and Responses bodies are translated into chat bodies and checked here too, with
`Names` saying how their API spells the fields an error may name (`max_output_tokens`,
`tools[0].input_schema`, ...): a client reads its own field names in every message.
`cache_salt` (vLLM's name) isolates a request's prefix-cache reuse further than its tenant.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from clover.decoding.settings import GenerationSettings, kind, specs
from clover.serving.errors import APIError, bad_request

MAX_N = 16  # choices per request (and prompts per completion request)
MAX_STOPS = 16
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token", "unk_token"}
)
# OpenAI's "developer" role is the system prompt under a newer name
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_FUNCTION = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SURROGATE = re.compile("[\ud800-\udfff]")
# reasoning_effort -> thinking tokens; "minimal"/"none" close the thought at once
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": 4096}
MAX_TOOLS = 128
MAX_SALT = 256  # characters of a cache_salt


@dataclass(frozen=True)
class Limits:
    """What validation needs to know about the server and its model."""

    model_names: tuple[str, ...]
    context_length: int
    vocab_size: int
    defaults: GenerationSettings  # server defaults: decoder, block_size, threshold, max_tokens
    capacity: int = 2**31  # requests the server holds at once (--max-running + --max-queue)


@dataclass(frozen=True)
class Names:
    """How an API spells the chat fields that validation may blame. `tool` is a format
    string of one tool's object (its index), `schema` the field of its JSON schema there."""

    max_tokens: str = "max_tokens"
    messages: str = "messages"
    tool: str = "tools[{}].function"
    schema: str = "parameters"
    tool_choice: str = "tool_choice"
    named_choice: str = "{type: function, function: {name}}"
    response_format: str = "response_format"
    response_schema: str = "response_format.json_schema.schema"
    thinking: str = "max_thinking_tokens"
    effort: str = "reasoning_effort"


CHAT_NAMES = Names()


@dataclass
class Request:
    model: str
    settings: GenerationSettings  # max_tokens still the request's (or None) until `fit`
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    commits: bool  # stream the diffusion's commits too (the web page asks for them)
    cache_salt: str | None  # prefix-cache reuse only among requests with the same salt


@dataclass
class ChatRequest(Request):
    messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"type": "function", ...}
    tool_choice: str = "auto"  # auto | none | required | the name of a function
    parallel_tool_calls: bool = True
    # every JSON schema of the request, by the field that holds it (as its API spells it):
    # compiled before the request runs, so a bad tool schema is refused even if unused
    schemas: dict[str, Any] = field(default_factory=dict)
    answer_schema: str | None = None  # the key in `schemas` the answer must follow
    tool_schemas: dict[str, str] = field(default_factory=dict)  # tool name -> key in schemas
    names: Names = CHAT_NAMES
    thinking_budget: int | None = None
    # special-token text inside messages (e.g. "<|im_start|>") becomes control tokens only
    # when a request opts in; by default it is encoded as the plain text it is
    parse_special: bool = False

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


@dataclass
class CompletionRequest(Request):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False


def parse_json(raw: bytes) -> dict[str, Any]:
    """Body bytes -> a JSON object; NaN and Infinity are not JSON and are refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=refuse)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {_short(e)}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"the body must be a JSON object, got {_json_type(body)}", code="invalid_json"
        )
    _check_text(body)
    return body


def _check_text(body: object) -> None:
    """JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), which is no character: no
    tokenizer can take it, so it is refused here, wherever it appears (keys included)."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and _SURROGATE.search(value):
            raise bad_request(
                "the body holds a lone UTF-16 surrogate escape (e.g. \\ud800), which is not text",
                code="invalid_unicode",
            )


def parse_chat(body: dict[str, Any], limits: Limits, names: Names = CHAT_NAMES) -> ChatRequest:
    """A chat body (or one translated from another API, whose fields `names` spells)."""
    messages = _messages(body.get("messages"), names.messages)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise _type("chat_template_kwargs", "an object", kwargs)
    for key in kwargs:
        if not _NAME.fullmatch(key) or key in RESERVED_TEMPLATE_NAMES:
            raise bad_request(
                f"chat_template_kwargs: {key[:40]!r} is not a name a request may set",
                "chat_template_kwargs",
            )
    for name in ("functions", "function_call"):
        if body.get(name):
            raise bad_request(f"{name} is the legacy form: use tools / tool_choice", name)
    schemas: dict[str, Any] = {}
    tools, tool_schemas = _tools(body.get("tools"), names, schemas)
    choice = _tool_choice(body.get("tool_choice"), tools, names)
    parallel = _bool(body, "parallel_tool_calls", True)
    answer = _response_format(body.get("response_format"), names, schemas)
    if answer is not None and choice in ("required",) + tuple(t["function"]["name"] for t in tools):
        raise bad_request(
            f"{names.response_format} cannot be combined with a forced tool call",
            names.tool_choice,
        )
    if body.get("top_logprobs"):
        raise _unsupported("top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, param=names.max_tokens)
    return ChatRequest(
        **_common(body, limits, max_tokens, names), messages=messages, template_kwargs=kwargs,
        tools=tools if choice != "none" else [], tool_choice=choice,
        parallel_tool_calls=parallel, schemas=schemas, answer_schema=answer,
        tool_schemas=tool_schemas, names=names,
        thinking_budget=_thinking_budget(body, limits.context_length, names),
        parse_special=_bool(body, "parse_special_tokens", False),
    )  # fmt: skip


def parse_completion(body: dict[str, Any], limits: Limits) -> CompletionRequest:
    prompts = _prompts(body.get("prompt"), limits.vocab_size)
    if body.get("suffix"):
        raise _unsupported("suffix")
    best_of = _int(body, "best_of", 1)
    if best_of not in (None, 1):
        raise _unsupported("best_of")
    echo = _bool(body, "echo", False)
    common = _common(body, limits, _int(body, "max_tokens", 1), CHAT_NAMES)
    if len(prompts) * common["n"] > MAX_N:
        raise bad_request(f"prompts x n must be at most {MAX_N}", "n")
    if len(prompts) > limits.capacity:  # each prompt takes a place: this could never fit
        raise bad_request(
            f"the request holds {len(prompts)} prompts; this server holds at most "
            f"{limits.capacity} requests at once (running + queued): send fewer prompts "
            "per request",
            "prompt",
            "exceeds_capacity",
        )
    return CompletionRequest(**common, prompts=prompts, echo=echo)


def fit(request: Request, prompt_len: int, limits: Limits) -> GenerationSettings:
    """The request's settings with max_tokens resolved against what the context leaves."""
    room = limits.context_length - prompt_len
    chat = isinstance(request, ChatRequest)
    where = request.names.messages if chat else "prompt"
    max_name = request.names.max_tokens if chat else "max_tokens"
    if room < 1:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this model's context is "
            f"{limits.context_length} tokens (prompt + completion)",
            where,
            "context_length_exceeded",
        )
    if request.max_tokens is None:
        max_tokens = min(limits.defaults.max_tokens, room)
    elif request.max_tokens > room:
        raise bad_request(
            f"this model's context is {limits.context_length} tokens; the prompt has "
            f"{prompt_len} and {max_name} asks for {request.max_tokens} more",
            max_name,
            "context_length_exceeded",
        )
    else:
        max_tokens = request.max_tokens
    return replace(request.settings, max_tokens=max_tokens)


# --- shared fields --------------------------------------------------------------------------


def _common(
    body: dict[str, Any], limits: Limits, max_tokens: int | None, names: Names
) -> dict[str, Any]:
    model = body.get("model", limits.model_names[0])
    if not isinstance(model, str):
        raise _type("model", "a string", model)
    if model not in limits.model_names:
        raise APIError(
            404,
            f"model {model[:80]!r} is not served here; available: {', '.join(limits.model_names)}",
            param="model",
            code="model_not_found",
        )
    if max_tokens is not None and max_tokens > limits.context_length:
        raise bad_request(
            f"{names.max_tokens} must be at most the context length, {limits.context_length}",
            names.max_tokens,
            "context_length_exceeded",
        )
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, -2.0, 2.0) not in (None, 0):
            raise _unsupported(name)
    if body.get("logprobs") not in (None, False, 0):
        raise _unsupported("logprobs")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _type("user", "a string", body["user"])
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type("stream_options", "an object", options)
    if options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    options = options or {}
    include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    settings = _settings(body, limits, max_tokens)
    return dict(
        model=model,
        settings=settings,
        max_tokens=max_tokens,
        n=_pick(_int(body, "n", 1, MAX_N), 1),
        stream=stream,
        include_usage=include_usage,
        commits=_bool(body, "clover_commits", False),
        cache_salt=_salt(body.get("cache_salt")),
    )


def _settings(body: dict[str, Any], limits: Limits, max_tokens: int | None) -> GenerationSettings:
    """The decoding and sampling fields (`decoding/settings.py`, those offered over HTTP),
    each checked against its spec; a field left out takes the server's default. max_tokens
    (each API spells it its own way) is the caller's; seeds of any size are folded to 31
    bits (the decoder's generator wants them small); top_k -1 means off, as some clients
    send it."""
    given: dict[str, Any] = {}
    for f, spec in specs("http"):
        value = body.get(f.name)
        if value is None or f.name == "max_tokens":
            continue
        if f.name == "stop":
            given["stop"] = _stops(value)
        elif f.name == "top_k" and value == -1:
            given["top_k"] = 0
        elif kind(f) is bool:
            given[f.name] = _bool(body, f.name, False)
        elif spec.choices:
            if value not in spec.choices:
                raise bad_request(f"{f.name} must be one of: {', '.join(spec.choices)}", f.name)
            given[f.name] = value
        elif kind(f) is int:
            given[f.name] = _int(body, f.name, spec.low, spec.high)
        else:
            given[f.name] = _number(body, f.name, spec.low, spec.high, spec.open_low)
    if given.get("block_size", 0) > limits.context_length:
        raise bad_request(f"block_size must be at most {limits.context_length}", "block_size")
    if "seed" in given:
        given["seed"] %= 2**31
    return replace(limits.defaults, **given, max_tokens=max_tokens or limits.defaults.max_tokens)


def _salt(salt: object) -> str | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_SALT:
        raise bad_request(
            f"cache_salt must be a non-empty string of at most {MAX_SALT} characters",
            "cache_salt",
        )
    return salt


def _messages(messages: object, name: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise _type(name, "a list of messages", messages)
    if not messages:
        raise bad_request(f"{name} must not be empty", name)
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type(where, "an object", m)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of: {', '.join(ROLES)}", where)
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(_text_part(part, f"{where}.content") for part in content)
        elif content is None and role != "assistant":
            raise bad_request(f"{where}.content is required", where)
        elif content is not None and not isinstance(content, str):
            raise _type(f"{where}.content", "a string or a list of text parts", content)
        message: dict[str, Any] = {"role": ROLES[role], "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _past_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _type(f"{where}.tool_call_id", "a string", call_id)
            message["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                message["name"] = m["name"]
        out.append(message)
    return out


def _past_calls(calls: object, where: str) -> list[dict[str, str]]:
    """An assistant turn's tool_calls -> [{id, name, arguments (a string)}]."""
    if not isinstance(calls, list):
        raise _type(where, "a list", calls)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{i}] must be {{type: function, function: {{name, "
                              "arguments}}}}", where)  # fmt: skip
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args)
        out.append(
            {"id": str(call.get("id") or f"call_{i}"), "name": fn["name"], "arguments": args}
        )
    return out


def _tools(
    tools: object, names: Names, schemas: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Checked tools, and each one's schema field (their schemas go into `schemas`)."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise _type("tools", "a list", tools)
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools", "tools")
    out, fields = [], {}
    for i, tool in enumerate(tools):
        where = names.tool.format(i)
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"tools[{i}] must be {{type: function, function: {{...}}}}",
                              f"tools[{i}]")  # fmt: skip
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where} must be an object, got {_json_type(fn)}", where)
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION.fullmatch(name):
            raise bad_request(f"{where}.name must match [A-Za-z0-9_-]{{1,64}}", f"{where}.name")
        if name in fields:
            raise bad_request(f"{where}.name: two tools are named {name!r}", f"{where}.name")
        params = fn.get("parameters")
        field_name = f"{where}.{names.schema}"
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{field_name} must be a JSON schema object", field_name)
        clean = {"name": name}
        if isinstance(fn.get("description"), str):
            clean["description"] = fn["description"]
        clean["parameters"] = params if params is not None else {"type": "object"}
        schemas[field_name] = clean["parameters"]
        fields[name] = field_name
        out.append({"type": "function", "function": clean})
    return out, fields


def _tool_choice(choice: object, tools: list[dict[str, Any]], names: Names) -> str:
    param = names.tool_choice
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(f"{param} must be auto, none, required or a function", param)
        if choice == "required" and not tools:
            raise bad_request(f"{param} requires a tool call but no tools were given", param)
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(f"{param} must be {names.named_choice}", param)
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"{param} names {name[:64]!r}, which is not in tools", param)
    return name


def _response_format(fmt: object, names: Names, schemas: dict[str, Any]) -> str | None:
    """The key in `schemas` of the schema the answer must follow, if any."""
    param = names.response_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _type(param, "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schemas[param] = {"type": "object"}
        return param
    if kind != "json_schema":
        raise bad_request(f"{param}.type must be text, json_object or json_schema", param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad_request(f"{param}.json_schema must be {{name, schema}}", param)
    schemas[names.response_schema] = spec.get("schema", {})
    return names.response_schema


def _thinking_budget(body: dict, context: int, names: Names) -> int | None:
    budget = _int(body, "max_thinking_tokens", 0, context, param=names.thinking)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORT_BUDGETS:
            raise bad_request(
                f"{names.effort} must be one of: {', '.join(EFFORT_BUDGETS)}", names.effort
            )
        if budget is None:
            budget = EFFORT_BUDGETS[effort]
    return budget


def _text_part(part: object, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise bad_request(f"{where}: only text parts are supported", where)
    if not isinstance(part.get("text"), str):
        raise _type(f"{where}.text", "a string", part.get("text"))
    return part["text"]


def _prompts(prompt: object, vocab: int) -> list[str | list[int]]:
    wrong = bad_request("prompt must be a string, a list of strings or of token ids", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise wrong
    if len(prompt) > MAX_N:
        raise bad_request(f"at most {MAX_N} prompts per request", "prompt")
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty", "prompt")
        elif not (isinstance(p, list) and p and _is_ids(p)):
            raise wrong
        elif not all(0 <= t < vocab for t in p):
            raise bad_request(f"token ids must be in [0, {vocab})", "prompt")
    return prompt


def _is_ids(items: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def _stops(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop strings", "stop")
    return tuple(stops)


# --- typed getters: each names its field on failure --------------------------------------


def _int(
    body: dict, name: str, lo: int | None = None, hi: int | None = None, param: str | None = None
) -> int | None:
    """An integer field; `param` is how the client's API spells it (default: `name`)."""
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _type(param, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"{param} must be {_range(lo, hi)}, got {value}", param)
    return value


def _number(body: dict, name: str, lo: float, hi: float, open_low: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise _type(name, "a number", value)
    if value < lo or value > hi or (open_low and value == lo):
        bounds = f"in ({lo:g}, {hi:g}]" if open_low else f"in [{lo:g}, {hi:g}]"
        raise bad_request(f"{name} must be {bounds}, got {value:g}", name)
    return float(value)


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type(param or name, "a boolean", value)
    return value


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _range(lo: int | None, hi: int | None) -> str:
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"in [{lo}, {hi}]"


def _type(param: str, expected: str, value: object) -> APIError:
    return bad_request(f"{param} must be {expected}, got {_json_type(value)}", param)


def _unsupported(param: str) -> APIError:
    return bad_request(f"{param} is not supported by this server", param, "unsupported")


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _short(e: Exception) -> str:
    return str(e)[:120]
