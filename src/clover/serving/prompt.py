"""A chat request -> the prompt text and token ids, with message text kept as text.

A chat template renders messages into one string and the tokenizer maps special-token text
in it (`<|im_start|>`, `<|im_end|>`) to control tokens. Run naively, that also turns such text
typed *inside* a message (or a tool result, or a tool's description) into control tokens, so
a user could close their turn and write a fake system turn. So, unless the request opts in
(`parse_special_tokens: true`), every special-token string inside request text is swapped
for a placeholder before rendering, `<U+E000><nonce><k><U+E001>` with a random nonce per
request (so request text cannot forge one), and the rendered prompt is encoded piece by
piece: template text as usual, each placeholder as the plain text of the token it stands
for. A request without such text renders and encodes exactly as before.

Shapes: `render_chat(llm, request)` -> (prompt text as the model sees it, ids [T], snapshot
positions for the prefix cache).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from clover.engine import LLM
from clover.errors import CloverError
from clover.serving.errors import bad_request
from clover.serving.protocol import ChatRequest
from clover.serving.tools import render_inputs, template_knows_tools

OPEN_MARK, CLOSE_MARK = "\ue000", "\ue001"  # private-use characters


class Placeholders:
    """Special-token text in request values <-> placeholders in the rendered prompt."""

    def __init__(self, specials: tuple[str, ...]) -> None:
        self.specials = specials
        self.find = re.compile("|".join(re.escape(t) for t in specials)) if specials else None
        nonce = secrets.token_hex(8)
        self.mark = re.compile(f"{OPEN_MARK}{nonce}(\\d+){CLOSE_MARK}")
        self.nonce = nonce
        self.used = False

    def protect(self, value: Any) -> Any:
        """`value` (strings, lists, dicts, nested) with special-token text replaced."""
        if isinstance(value, str):
            if self.find is None or self.find.search(value) is None:
                return value
            self.used = True
            index = {t: k for k, t in enumerate(self.specials)}
            return self.find.sub(
                lambda m: f"{OPEN_MARK}{self.nonce}{index[m.group(0)]}{CLOSE_MARK}", value
            )
        if isinstance(value, list):
            return [self.protect(v) for v in value]
        if isinstance(value, dict):
            return {self.protect(k): self.protect(v) for k, v in value.items()}
        return value

    def restore(self, text: str) -> str:
        return self.mark.sub(lambda m: self.specials[int(m.group(1))], text)

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        """Template text with its control tokens; each placeholder as plain text."""
        ids: list[int] = []
        pieces = self.mark.split(text)  # plain, index, plain, index, ..., plain
        for k, piece in enumerate(pieces):
            if k % 2:
                special = self.specials[int(piece)]
                ids += tokenizer.encode(special, split_special_tokens=False)
            elif piece:
                ids += tokenizer.encode(piece)
        return ids


def render_chat(llm: LLM, req: ChatRequest) -> tuple[str, list[int], tuple[int, ...]]:
    """The request's prompt text (what the model reads), its token ids, and the positions
    worth a prefix-cache snapshot (`LLM.chat_marks`: recurrent models only)."""
    tokenizer = llm.tokenizer
    knows = template_knows_tools(tokenizer)
    messages, extra = render_inputs(req.messages, req.tools, knows)
    kwargs = {**req.template_kwargs, **extra}
    marks = None
    if not req.parse_special:
        marks = Placeholders(tokenizer.special_tokens)
        messages, kwargs = marks.protect(messages), marks.protect(kwargs)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    except CloverError as e:
        raise bad_request(str(e), "messages") from None
    if marks is None or not marks.used:
        text, ids = text, tokenizer.encode(text)
    else:
        text, ids = marks.restore(text), marks.encode(tokenizer, text)
    return text, ids, llm.chat_marks(messages, ids, **kwargs)
