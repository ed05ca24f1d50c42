"""Render a model's Jinja chat template the way Hugging Face does, but inside a sandbox.

A chat template ships with the checkpoint, so it is untrusted code: it renders in Jinja's
immutable sandbox, and any escape attempt (dunder attributes, mutating the messages) becomes a
`CloverError` rather than running. Everything else mirrors `transformers`' renderer so prompts
match token for token: trim_blocks/lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text and does not HTML-escape, and the
`{% generation %}` block (rendered as its plain body; it only marks spans for training).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from clover.errors import CloverError

__all__ = ["render_chat_template", "validate_messages"]


def _raise_exception(message: str) -> None:
    # The template's own message is meant for the user (e.g. "roles must alternate").
    raise CloverError(f"chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson escapes <, >, & and ' for HTML; prompts need the raw JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` token itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox answers a forbidden attribute with an Undefined that prints as "", so a
    probing template would run on silently; we refuse it at the first touch instead."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed"
        )


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise CloverError(
            f"chat template has a syntax error at line {exc.lineno}: {exc.message}"
        ) from None


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check the OpenAI-style message list; returns it unchanged when it is well formed."""
    if not isinstance(messages, list) or not messages:
        raise CloverError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise CloverError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise CloverError(f"messages[{i}] needs a non-empty string 'role'")
        if "content" not in message:
            raise CloverError(f"messages[{i}] ({role}) has no 'content'")
        content = message["content"]
        # None is how OpenAI-style clients send an assistant turn that only calls tools.
        if content is not None and not isinstance(content, str):
            raise CloverError(
                f"messages[{i}] ({role}) content must be a string or null, "
                f"got {type(content).__name__}"
            )
    return messages


def render_chat_template(template: str, **context: Any) -> str:
    """Render `template` with `context` (messages, add_generation_prompt, special tokens...).

    Raises CloverError for a syntax error, a sandbox violation, a `raise_exception` call or any
    other failure inside the template.
    """
    compiled = _compile(template)
    try:
        return compiled.render(**context)
    except CloverError:
        raise
    except SecurityError as exc:
        raise CloverError(f"chat template is unsafe and was not run: {exc}") from None
    except jinja2.TemplateError as exc:
        raise CloverError(f"chat template failed to render: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise CloverError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
