"""Request-body schemas for the app's OpenAPI document (`app.openapi()`).

The handlers validate bodies by hand (`protocol`, with per-field messages), so FastAPI
cannot infer these; they are written out here to describe each route's accepted fields
for clients and for the property-based fuzz test (tests/test_server_fuzz.py), which
generates bodies from them. They describe the shape, not every rule: a body that fits the
schema may still get a 400 (an unknown model, a prompt over the context), never a 5xx.
"""

from __future__ import annotations

from dataclasses import Field
from typing import Any

from clover.decoding.settings import Spec, kind, specs

TEXT = {"type": "string", "maxLength": 200}
NUM = {"type": "number"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
STOP = {"anyOf": [TEXT, {"type": "array", "items": TEXT, "maxItems": 4}]}
PARAMS = {"type": "object", "additionalProperties": True}  # a JSON schema (tool parameters)


def _setting(f: Field, spec: Spec) -> dict[str, Any]:
    if spec.choices:
        return {"enum": list(spec.choices)}
    return {str: TEXT, int: INT, float: NUM, bool: BOOL, tuple: STOP}[kind(f)]


# the decoding and sampling settings (one spec each, `decoding/settings.py`) and the fields
# every API shares
SAMPLING = {
    "model": TEXT, "stream": BOOL,
    **{f.name: _setting(f, spec) for f, spec in specs("http") if f.name != "stop"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 200},
}  # fmt: skip

CHAT_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [TEXT, {"type": "null"}, {"type": "array", "maxItems": 3,
                    "items": {"type": "object", "properties": {"type": TEXT, "text": TEXT}}}]},
        "tool_call_id": TEXT,
        "tool_calls": {"type": "array", "maxItems": 2, "items": {"type": "object"}},
    },
    "required": ["role"],
}  # fmt: skip
CHAT_TOOL = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "properties": {"name": TEXT, "description": TEXT,
                     "parameters": PARAMS}, "required": ["name"]},
    },
    "required": ["type", "function"],
}  # fmt: skip
CHAT = {
    "type": "object",
    "properties": {
        **SAMPLING,
        "messages": {"type": "array", "items": CHAT_MESSAGE, "maxItems": 4},
        "max_completion_tokens": INT, "n": INT, "stop": STOP,
        "stream_options": {"type": "object", "properties": {"include_usage": BOOL}},
        "tools": {"type": "array", "items": CHAT_TOOL, "maxItems": 3},
        "tool_choice": {"anyOf": [TEXT, {"type": "object"}]},
        "parallel_tool_calls": BOOL,
        "response_format": {"type": "object", "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {"name": TEXT, "schema": PARAMS}}}},
        "reasoning_effort": TEXT, "max_thinking_tokens": INT,
        "chat_template_kwargs": {"type": "object"}, "parse_special_tokens": BOOL,
    },
    "required": ["messages"],
}  # fmt: skip
COMPLETIONS = {
    "type": "object",
    "properties": {
        **SAMPLING,
        "prompt": {"anyOf": [TEXT, {"type": "array", "items": TEXT, "maxItems": 3},
                             {"type": "array", "items": INT, "maxItems": 8}]},
        "n": INT, "stop": STOP, "echo": BOOL,
    },
    "required": ["prompt"],
}  # fmt: skip
BLOCK = {
    "type": "object",
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "image"]},
        "text": TEXT, "id": TEXT, "name": TEXT, "input": {"type": "object"},
        "tool_use_id": TEXT, "content": {"anyOf": [TEXT, {"type": "array", "maxItems": 2}]},
        "is_error": BOOL,
    },
    "required": ["type"],
}  # fmt: skip
MESSAGES = {
    "type": "object",
    "properties": {
        **SAMPLING,
        "system": {"anyOf": [TEXT, {"type": "array", "items": BLOCK, "maxItems": 2}]},
        "messages": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"enum": ["user", "assistant"]},
                "content": {"anyOf": [TEXT, {"type": "array", "items": BLOCK, "maxItems": 3}]}}}},
        "tools": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "name": TEXT, "description": TEXT, "input_schema": PARAMS}}},
        "tool_choice": {"type": "object", "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "name": TEXT,
            "disable_parallel_tool_use": BOOL}},
        "stop_sequences": {"type": "array", "items": TEXT, "maxItems": 4},
        "thinking": {"type": "object", "properties": {
            "type": {"enum": ["enabled", "disabled"]}, "budget_tokens": INT}},
        "metadata": {"type": "object"},
    },
    "required": ["max_tokens", "messages"],
}  # fmt: skip
ITEM = {
    "type": "object",
    "properties": {
        "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
        "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"anyOf": [TEXT, {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"type": TEXT, "text": TEXT}}}]},
        "call_id": TEXT, "name": TEXT, "arguments": TEXT, "output": TEXT,
    },
}  # fmt: skip
RESPONSES = {
    "type": "object",
    "properties": {
        **{k: v for k, v in SAMPLING.items() if k != "max_tokens"},
        "input": {"anyOf": [TEXT, {"type": "array", "items": ITEM, "maxItems": 4}]},
        "instructions": TEXT, "max_output_tokens": INT,
        "tools": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "type": {"const": "function"}, "name": TEXT, "parameters": PARAMS}}},
        "tool_choice": {"anyOf": [TEXT, {"type": "object"}]},
        "parallel_tool_calls": BOOL,
        "reasoning": {"type": "object", "properties": {"effort": TEXT}},
        "text": {"type": "object", "properties": {"format": {"type": "object", "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}, "name": TEXT,
            "schema": PARAMS}}}},
        "previous_response_id": TEXT,
    },
    "required": ["input"],
}  # fmt: skip


OLLAMA_OPTIONS = {
    "type": "object",
    "properties": {
        "temperature": NUM, "top_p": NUM, "top_k": INT, "seed": INT, "num_ctx": INT,
        "num_predict": INT, "stop": {"type": "array", "items": TEXT, "maxItems": 4},
        "num_thread": INT,
    },
}  # fmt: skip
OLLAMA_COMMON = {
    "model": TEXT, "stream": BOOL, "options": OLLAMA_OPTIONS, "keep_alive": TEXT,
    "format": {"anyOf": [{"const": "json"}, PARAMS]},
    "think": {"anyOf": [BOOL, {"enum": ["low", "medium", "high"]}]},
}  # fmt: skip
OLLAMA_CHAT = {
    "type": "object",
    "properties": {
        **OLLAMA_COMMON,
        "messages": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"enum": ["system", "user", "assistant", "tool"]}, "content": TEXT,
                "tool_name": TEXT, "thinking": TEXT,
                "tool_calls": {"type": "array", "maxItems": 2, "items": {"type": "object"}}}}},
        "tools": {"type": "array", "items": CHAT_TOOL, "maxItems": 3},
    },
    "required": ["messages"],
}  # fmt: skip
OLLAMA_GENERATE = {
    "type": "object",
    "properties": {**OLLAMA_COMMON, "prompt": TEXT, "system": TEXT, "raw": BOOL},
    "required": ["prompt"],
}  # fmt: skip


def body(schema: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body follows `schema`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
