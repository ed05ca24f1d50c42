"""The OpenAI request bodies, checked field by field before anything reaches the model.

We validate by hand instead of with pydantic models: each check knows the OpenAI `param` to
blame, the messages say what was expected, and the limits that depend on the loaded model
(context length, vocabulary, served name) are plain arguments. Unknown fields are ignored, as
OpenAI-compatible servers do, but a known feature this server does not implement (logprobs,
penalties, the legacy `functions`) is refused with 400 rather than silently dropped: an answer
that ignored the request would look valid and be wrong.

Agent features checked here: `tools` / `tool_choice` / `parallel_tool_calls` (`tools.py`),
`response_format` (json_object, or json_schema with the schema subset of `json_grammar.py`;
the schema is compiled here so a bad one is a 400), and the thinking budget:
`max_thinking_tokens`, or `reasoning_effort` mapped through `EFFORT_BUDGETS`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from clover.decoding.policies import DECODERS, DRAFTS
from clover.engine import GenerationSettings
from clover.errors import CloverError
from clover.serving.errors import APIError, bad_request
from clover.serving.json_grammar import JsonGrammar

MAX_N = 16  # choices per request (and prompts per completion request)
MAX_STOPS = 16
MAX_SEED = 2**63
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


@dataclass(frozen=True)
class Limits:
    """What validation needs to know about the server and its model."""

    model_names: tuple[str, ...]
    context_length: int
    vocab_size: int
    defaults: GenerationSettings  # server defaults: decoder, block_size, threshold, max_tokens


@dataclass
class Request:
    model: str
    settings: GenerationSettings  # max_tokens still the request's (or None) until `fit`
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    commits: bool  # stream the diffusion's commits too (the web page asks for them)


@dataclass
class ChatRequest(Request):
    messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"type": "function", ...}
    tool_choice: str = "auto"  # auto | none | required | the name of a function
    parallel_tool_calls: bool = True
    json_grammar: JsonGrammar | None = None  # response_format json_object / json_schema
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


def parse_chat(body: dict[str, Any], limits: Limits) -> ChatRequest:
    messages = _messages(body.get("messages"))
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
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = _bool(body, "parallel_tool_calls", True)
    grammar = _response_format(body.get("response_format"))
    if grammar is not None and choice in ("required",) + tuple(
        t["function"]["name"] for t in tools
    ):
        raise bad_request(
            "response_format cannot be combined with a forced tool call", "tool_choice"
        )
    if body.get("top_logprobs"):
        raise _unsupported("top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    return ChatRequest(
        **_common(body, limits, max_tokens), messages=messages, template_kwargs=kwargs,
        tools=tools if choice != "none" else [], tool_choice=choice,
        parallel_tool_calls=parallel, json_grammar=grammar,
        thinking_budget=_thinking_budget(body, limits.context_length),
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
    common = _common(body, limits, _int(body, "max_tokens", 1))
    if len(prompts) * common["n"] > MAX_N:
        raise bad_request(f"prompts x n must be at most {MAX_N}", "n")
    return CompletionRequest(**common, prompts=prompts, echo=echo)


def fit(request: Request, prompt_len: int, limits: Limits) -> GenerationSettings:
    """The request's settings with max_tokens resolved against what the context leaves."""
    room = limits.context_length - prompt_len
    where = "messages" if isinstance(request, ChatRequest) else "prompt"
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
            f"{prompt_len} and max_tokens asks for {request.max_tokens} more",
            "max_tokens",
            "context_length_exceeded",
        )
    else:
        max_tokens = request.max_tokens
    return replace(request.settings, max_tokens=max_tokens)


# --- shared fields --------------------------------------------------------------------------


def _common(body: dict[str, Any], limits: Limits, max_tokens: int | None) -> dict[str, Any]:
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
            f"max_tokens must be at most the context length, {limits.context_length}",
            "max_tokens",
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
    d = limits.defaults
    decoder = body.get("decoder", d.decoder)
    if decoder is not None and decoder not in DECODERS:
        raise bad_request(f"decoder must be one of: {', '.join(DECODERS)}", "decoder")
    draft = body.get("draft", d.draft)
    if draft is not None and draft not in DRAFTS:
        raise bad_request(f"draft must be one of: {', '.join(DRAFTS)}", "draft")
    top_k = _int(body, "top_k", -1)
    seed = _int(body, "seed", -MAX_SEED, MAX_SEED - 1)
    settings = GenerationSettings(
        decoder=decoder,
        block_size=_int(body, "block_size", 1, min(1024, limits.context_length)) or d.block_size,
        threshold=_pick(_number(body, "threshold", 0.0, 1.0), d.threshold),
        max_tokens=max_tokens or d.max_tokens,
        temperature=_pick(_number(body, "temperature", 0.0, 2.0), d.temperature),
        top_p=_pick(_number(body, "top_p", 0.0, 1.0, open_low=True), 1.0),
        top_k=max(top_k or 0, 0),  # -1 means "off" in some clients
        seed=None if seed is None else seed % 2**31,  # the decoder's generator wants it small
        stop=_stops(body.get("stop")),
        refine_steps=_pick(_int(body, "refine_steps", 0, 8), d.refine_steps),
        draft=draft,
        slide=_bool(body, "slide", d.slide),
        tree=_pick(_int(body, "tree", 0, 1024), d.tree),
    )
    return dict(
        model=model,
        settings=settings,
        max_tokens=max_tokens,
        n=_pick(_int(body, "n", 1, MAX_N), 1),
        stream=stream,
        include_usage=include_usage,
        commits=_bool(body, "clover_commits", False),
    )


def _messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise _type("messages", "a list of messages", messages)
    if not messages:
        raise bad_request("messages must not be empty", "messages")
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


def _tools(tools: object) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _type("tools", "a list", tools)
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where} must be {{type: function, function: {{...}}}}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object, got {_json_type(fn)}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION.fullmatch(name):
            raise bad_request(f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}", "tools")
        if name in names:
            raise bad_request(f"{where}: two tools are named {name!r}", "tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(f"{where}.function.parameters must be a JSON schema", "tools")
            _compile_schema(params, f"{where}.function.parameters", "tools")
        clean = {"name": name}
        if isinstance(fn.get("description"), str):
            clean["description"] = fn["description"]
        clean["parameters"] = params if params is not None else {"type": "object"}
        out.append({"type": "function", "function": clean})
    return out


def _tool_choice(choice: object, tools: list[dict[str, Any]]) -> str:
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(
                "tool_choice must be auto, none, required or a function", "tool_choice"
            )
        if choice == "required" and not tools:
            raise bad_request("tool_choice is required but no tools were given", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice must be {type: function, function: {name}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name[:64]!r}, which is not in tools", "tool_choice")
    return name


def _response_format(fmt: object) -> JsonGrammar | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _type("response_format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonGrammar({"type": "object"})
    if kind != "json_schema":
        raise bad_request("response_format.type must be text, json_object or json_schema",
                          "response_format")  # fmt: skip
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad_request("response_format.json_schema must be {name, schema}", "response_format")
    return _compile_schema(spec.get("schema", {}), "json_schema.schema", "response_format")


def _compile_schema(schema: dict, where: str, param: str) -> JsonGrammar:
    try:
        return JsonGrammar(schema)
    except CloverError as e:
        raise bad_request(f"{where}: {e}", param) from None
    except RecursionError:
        raise bad_request(f"{where}: the schema is nested too deeply", param) from None


def _thinking_budget(body: dict, context: int) -> int | None:
    budget = _int(body, "max_thinking_tokens", 0, context)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORT_BUDGETS:
            raise bad_request(
                f"reasoning_effort must be one of: {', '.join(EFFORT_BUDGETS)}", "reasoning_effort"
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


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _type(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"{name} must be {_range(lo, hi)}, got {value}", name)
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
