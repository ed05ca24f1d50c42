"""Thinking mode: split `<think>...</think>` out of an answer into `reasoning_content`.

Models mark their reasoning in two ways. Some generate `<think>` themselves; others' chat
templates already end the prompt with an open `<think>` (e.g. when `enable_thinking` is true),
so the answer starts inside the reasoning. So the splitter starts inside reasoning exactly
when the rendered prompt ends with an open tag, and otherwise switches into reasoning only if
the answer opens with the tag (after whitespace). Everything after `</think>` is content, with
its leading whitespace dropped; an answer that never closes its reasoning (max_tokens) has only
reasoning.

One class serves both paths: a non-streamed answer is one `push` and `finish`, so streamed
and non-streamed answers split identically. While streaming, text that might still become a
tag (`<thi`, a trailing `</th`) or the whitespace before `</think>` is held back, so a
partial tag never reaches either field.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the answer inside an open `<think>` block."""
    return prompt.rstrip().endswith(OPEN)


class ReasoningSplitter:
    """Streamed answer text -> (reasoning, content) deltas, never a partial tag in either."""

    def __init__(self, in_reasoning: bool = False) -> None:
        # start: nothing decided yet (the answer may open with <think>)
        # reasoning: inside the block; after: just closed, dropping whitespace; content: rest
        self.state = "reasoning_start" if in_reasoning else "start"
        self.buffer = ""

    def push(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = [], []
        while True:
            progressed = self._advance(reasoning, content)
            if not progressed:
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the answer: release what was held back."""
        reasoning, content = self.push("")
        rest, self.buffer = self.buffer, ""
        if self.state == "start":
            content += rest
        elif self.state in ("reasoning", "reasoning_start"):
            reasoning += rest.rstrip()
        return reasoning, content

    def _advance(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the buffer allows in the current state; False when it must wait."""
        buf = self.buffer
        if self.state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(OPEN):
                self.state, self.buffer = "reasoning_start", stripped[len(OPEN) :]
                return True
            if not stripped or OPEN.startswith(stripped):
                return False  # could still be the opening tag
            self.state = "content"
            return True
        if self.state in ("reasoning_start", "after"):
            stripped = buf.lstrip()
            if not stripped:
                self.buffer = ""
                return False
            self.buffer = stripped
            self.state = "reasoning" if self.state == "reasoning_start" else "content"
            return True
        if self.state == "reasoning":
            end = buf.find(CLOSE)
            if end >= 0:
                reasoning.append(buf[:end].rstrip())
                self.state, self.buffer = "after", buf[end + len(CLOSE) :]
                return True
            keep = _partial_suffix(buf, CLOSE)
            body = buf[: len(buf) - keep]
            safe = body.rstrip()  # whitespace before </think> is not reasoning
            reasoning.append(safe)
            self.buffer = buf[len(safe) :]
            return False
        content.append(buf)  # state "content"
        self.buffer = ""
        return False


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """A whole answer -> (reasoning, content), exactly as streaming would split it."""
    splitter = ReasoningSplitter(in_reasoning)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2
