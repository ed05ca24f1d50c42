"""Tool calling, Hermes/Qwen style: tools into the prompt, `<tool_call>` blocks out of the answer.

In: a chat template that knows tools (it reads `tools`, or the checkpoint has a "tool_use"
template) gets them as the `tools` argument and the conversation in the shape Hugging Face
templates expect (assistant `tool_calls` with arguments as objects, `tool` messages). A
template without tools (SmolLM2's plain ChatML) gets a system block listing the tools as JSON
and explaining the call format, assistant calls written back as `<tool_call>` blocks and tool
results as user turns inside `<tool_response>`.

Out: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become OpenAI
`tool_calls` (the arguments as the model wrote them, a JSON string). A block that does not
parse, names an unknown tool or never closes turns the whole answer back into plain content.
`ToolCallStream` does the same on a stream: text outside blocks streams as content; inside a
block the call's id and name go out once the name is complete, and the arguments as their
text commits, while the block is still a valid JSON prefix. If it stops being one, the rest
of the block goes out as content and the answer finishes with "stop" (a stream cannot take
back what it sent).

`tool_choice` "required" or a named function is enforced while decoding (`call_rule`): the
answer is exactly one block whose JSON follows the tools' parameter schemas.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from clover.serving.constraints import JsonRule, Literal, Sequence
from clover.serving.json_grammar import JsonGrammar

OPEN_CALL, CLOSE_CALL = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def template_knows_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template or ""
    return "tool_use" in tokenizer.chat_templates or "tools" in template


def tool_block(tools: list[dict[str, Any]]) -> str:
    """The system text that describes the tools to a template that has no place for them."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou can call functions to help with the request. Their signatures, one "
        f"JSON object per line:\n<tools>\n{lines}\n</tools>\n\nTo call a function, answer "
        "with a JSON object holding its name and its arguments inside <tool_call></tool_call> "
        'tags, one block per call:\n<tool_call>\n{"name": "<function name>", "arguments": '
        "{<the arguments as JSON>}}\n</tool_call>"
    )


def render_inputs(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], knows_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Checked OpenAI messages + tools -> (template messages, extra template arguments)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if knows_tools:
            if calls:
                m["tool_calls"] = [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["name"], "arguments": _as_object(c["arguments"])}}
                    for c in calls
                ]  # fmt: skip
                m["content"] = m["content"] or ""
            out.append(m)
            continue
        if calls:
            blocks = [
                f"{OPEN_CALL}\n"
                + json.dumps({"name": c["name"], "arguments": _as_object(c["arguments"])})
                + f"\n{CLOSE_CALL}"
                for c in calls
            ]
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + blocks)
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if not tools:
        return out, {}
    if knows_tools:
        return out, {"tools": tools}
    block = tool_block(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content'] or ''}\n\n{block}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, {}


def _as_object(arguments: str) -> Any:
    """Templates expect arguments as an object; OpenAI sends a JSON string."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON schema of one call: {"name": <a tool>, "arguments": <its parameters>}."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if len(chosen) == 1:
        params = chosen[0].get("parameters") or {"type": "object"}
    else:
        params = {"type": "object"}  # several tools: any object (the schema subset has no anyOf)
    return {
        "type": "object",
        "properties": {"name": {"enum": [f["name"] for f in chosen]}, "arguments": params},
        "required": ["name", "arguments"],
    }


def call_rule(grammar: JsonGrammar) -> Sequence:
    """What a forced call must look like, as a decoding rule; `grammar` is `call_schema`'s."""
    return Sequence((Literal(OPEN_CALL + "\n"), JsonRule(grammar), Literal("\n" + CLOSE_CALL)))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_block(body: str, names: set[str]) -> tuple[str, str] | None:
    """A block's text -> (name, arguments JSON string), or None if it is not a valid call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    if names and call["name"] not in names:
        return None
    args = call.get("arguments", {})
    if isinstance(args, str):
        return call["name"], args
    if not isinstance(args, dict):
        return None
    return call["name"], _raw_arguments(body, args)


def _raw_arguments(body: str, args: dict) -> str:
    """The arguments exactly as written (what a stream sends), if they can be found."""
    match = _NAME.match(body)
    if match:
        try:
            value, end = json.JSONDecoder().raw_decode(body, match.end())
        except ValueError:
            value = None
        if value == args:
            return body[match.end() : end]
    return json.dumps(args, ensure_ascii=False)


def parse_tool_calls(
    text: str, names: set[str], parallel: bool = True
) -> tuple[str | None, list[dict[str, Any]]] | None:
    """An answer -> (content around the calls or None, tool_calls); None: no valid calls."""
    if OPEN_CALL not in text:
        return None
    calls = []
    for match in _BLOCK.finditer(text):
        parsed = _parse_block(match.group(1).strip(), names)
        if parsed is None:
            return None
        calls.append(_call(len(calls), parsed[0], parsed[1], with_index=False))
    rest = _BLOCK.sub("", text)
    if not calls or OPEN_CALL in rest:  # an unclosed block: the answer was cut short
        return None
    content = rest.strip() or None
    return content, calls if parallel else calls[:1]


def _call(index: int, name: str, arguments: str, with_index: bool = True) -> dict[str, Any]:
    call = {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip
    return {"index": index, **call} if with_index else call


class ToolCallStream:
    """Content deltas -> stream parts: {"content": ...} or {"tool_calls": [delta]}."""

    def __init__(self, names: set[str], parallel: bool = True) -> None:
        self.names, self.parallel = names, parallel
        self.buffer = ""
        self.in_call = False
        self.calls = 0  # calls started (their headers sent)
        self.failed = False  # a block went bad: everything else is content
        self.pending_ws = ""  # whitespace between text and a call, sent only before text
        self._reset_call()

    def _reset_call(self) -> None:
        self.header = False
        self.args_start: int | None = None
        self.sent = 0  # characters of the arguments already sent

    @property
    def called(self) -> bool:
        return self.calls > 0 and not self.failed

    def push(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        parts: list[dict[str, Any]] = []
        while self._advance(parts):
            pass
        return parts

    def finish(self) -> list[dict[str, Any]]:
        parts = self.push("")
        if self.in_call:  # never closed: the raw block is content
            self._fail(parts, self.buffer, "")
        rest, self.buffer = self.buffer, ""
        if rest and (self.failed or not self.calls or rest.strip()):
            parts.append({"content": self.pending_ws + rest})
        return parts

    def _content(self, parts: list, text: str) -> None:
        if not text:
            return
        if self.calls and not self.failed and not text.strip():
            self.pending_ws += text  # maybe only the gap before the next call
            return
        parts.append({"content": self.pending_ws + text})
        self.pending_ws = ""

    def _advance(self, parts: list) -> bool:
        buf = self.buffer
        if self.failed or (self.calls and not self.parallel and not self.in_call):
            if self.failed:
                self._content(parts, buf)
            self.buffer = ""  # a second call without parallel_tool_calls is dropped
            return False
        if not self.in_call:
            at = buf.find(OPEN_CALL)
            if at < 0:  # hold back a partial tag, and whitespace that may precede a call
                keep = _partial_suffix(buf, OPEN_CALL)
                keep += len(buf[: len(buf) - keep]) - len(buf[: len(buf) - keep].rstrip())
                self._content(parts, buf[: len(buf) - keep])
                self.buffer = buf[len(buf) - keep :]
                return False
            self._content(parts, buf[:at].rstrip() if self.calls == 0 else buf[:at])
            self.buffer, self.in_call = buf[at + len(OPEN_CALL) :], True
            self.pending_ws = ""
            self._reset_call()
            return True
        end = buf.find(CLOSE_CALL)
        body = buf if end < 0 else buf[:end]
        if end >= 0:
            parsed = _parse_block(body.strip(), self.names)
            if parsed is None:
                return self._fail(parts, body + CLOSE_CALL, buf[end + len(CLOSE_CALL) :])
            name, args = parsed
            if not self.header:
                parts.append({"tool_calls": [_call(self.calls, name, args)]})
                self.calls += 1
            elif args[self.sent :]:
                parts.append(self._args(args[self.sent :]))
            self.buffer, self.in_call = buf[end + len(CLOSE_CALL) :], False
            return True
        core = body[: len(body) - _partial_suffix(body, CLOSE_CALL)]  # without a partial tag
        if not _json_prefix(core.strip()):
            return self._fail(parts, body, "")
        if not self.header:
            match = _NAME.match(body)
            if match is None or match.end() == len(body):  # the arguments have not begun
                return False
            name = json.loads(f'"{match.group(1)}"')
            if self.names and name not in self.names:
                return self._fail(parts, body, "")
            parts.append({"tool_calls": [_call(self.calls, name, "")]})
            self.calls += 1
            self.header, self.args_start = True, match.end()
        # hold back what may be the call object's closing "}" and the start of </tool_call>
        safe = core.rstrip()
        safe = safe[:-1].rstrip() if safe.endswith("}") else safe
        new = safe[self.args_start + self.sent :]
        if new:
            parts.append(self._args(new))
            self.sent += len(new)
        return False

    def _args(self, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]}

    def _fail(self, parts: list, raw: str, rest: str) -> bool:
        if self.header:  # the call is out already; what it did not send becomes content
            raw = raw[self.args_start + self.sent :]
        else:
            raw = OPEN_CALL + raw
        self.failed, self.in_call = True, False
        if raw:
            parts.append({"content": raw})
        self.buffer = rest
        return True


_ANY = JsonGrammar()


def _json_prefix(text: str) -> bool:
    """Whether some JSON document starts with `text`."""
    return _ANY.feed(_ANY.start(), text) is not None


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
