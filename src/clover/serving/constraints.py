"""Text rules for constrained answers, and their bridge to token ids for the decoder.

A `TextRule` is immutable: `advance(text)` returns the rule after one token's text, or None if
that text breaks it. `need()` is how many characters must still come before the answer may
end (0: it may end now), `forced(room)` the text that must come next, if any. Rules:

- `JsonRule`: a valid JSON document, optionally under a schema (`json_grammar`).
- `Literal`: exactly this text (the `<tool_call>` tags around a forced call).
- `Sequence`: rules one after another (literal, JSON, literal).
- `ThinkBudget`: leaves the answer free, but counts the tokens inside `<think>` and forces
  `</think>` once the budget is spent (or when only the room to close and finish is left).
- `Chain`: a think budget, then another rule for what follows the thought.

`TokenConstraint` turns a rule into the decoder's `LogitsConstraint` with the vocabulary as
text (`Vocab`, decoded once per tokenizer): a token is allowed when its text keeps the rule
and what the rule still needs fits in the tokens left (at worst one character per token);
EOS is allowed exactly when the rule may end. Tokens whose text is empty, a special token or
an incomplete UTF-8 sequence are never allowed while a rule holds: their text is unknown.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from clover.serving.json_grammar import JsonGrammar, State

MASK_CACHE = 64  # candidate sets kept per vocabulary (keyed by rule state), ~1 MB at most each
NEED_CAP = 2**30  # needs past any context length are alike (and +2 stays within int32)
OPEN, CLOSE = "<think>", "</think>"


class TextRule:
    def advance(self, text: str) -> TextRule | None:
        raise NotImplementedError

    def need(self) -> int:
        return 0

    def forced(self, room: int) -> str | None:
        return None

    @property
    def closed(self) -> bool:
        """Nothing more may follow (only the end of the answer)."""
        return False

    @property
    def free(self) -> bool:
        """Nothing is constrained any more."""
        return False

    def key(self) -> Any:
        """A hashable state for caching full masks, or None."""
        return None


@dataclass(frozen=True)
class JsonRule(TextRule):
    grammar: JsonGrammar
    state: State | None = None

    def __post_init__(self) -> None:
        if self.state is None:
            object.__setattr__(self, "state", self.grammar.start())

    def advance(self, text: str) -> JsonRule | None:
        state = self.grammar.feed(self.state, text)
        return None if state is None else JsonRule(self.grammar, state)

    def need(self) -> int:
        return self.grammar.need(self.state)

    @property
    def closed(self) -> bool:
        return self.grammar.done(self.state)

    def key(self) -> Any:
        return (self.grammar, self.state)


@dataclass(frozen=True)
class Literal(TextRule):
    text: str

    def advance(self, text: str) -> Literal | None:
        return Literal(self.text[len(text) :]) if self.text.startswith(text) else None

    def need(self) -> int:
        return len(self.text)

    def forced(self, room: int) -> str | None:
        return self.text or None

    @property
    def closed(self) -> bool:
        return not self.text

    def key(self) -> Any:
        return ("literal", self.text)


@dataclass(frozen=True)
class Sequence(TextRule):
    parts: tuple[TextRule, ...]

    def advance(self, text: str) -> Sequence | None:
        whole = self.parts[0].advance(text)
        if whole is not None:
            return Sequence((whole,) + self.parts[1:])
        parts = self.parts
        for ch in text:  # the text crosses from one part into the next
            while True:
                nxt = parts[0].advance(ch)
                if nxt is not None:
                    parts = (nxt,) + parts[1:]
                    break
                if parts[0].need() or len(parts) == 1:
                    return None
                parts = parts[1:]
        return Sequence(parts)

    def need(self) -> int:
        return sum(p.need() for p in self.parts)

    def forced(self, room: int) -> str | None:
        parts = self.parts
        while len(parts) > 1 and parts[0].closed:
            parts = parts[1:]
        return parts[0].forced(room)

    @property
    def closed(self) -> bool:
        return all(p.closed for p in self.parts)

    def key(self) -> Any:
        keys = tuple(p.key() for p in self.parts)
        return None if None in keys else ("seq", keys)


@dataclass(frozen=True)
class ThinkBudget(TextRule):
    """`budget`: tokens the thought may take (None: unlimited); `reserve`: tokens to keep for
    what follows it; `inside`: the prompt already opened `<think>`."""

    budget: int | None
    inside: bool = False
    reserve: int = 0
    done: bool = False
    count: int = 0
    tail: str = ""  # recent text, to find tags split over tokens
    leftover: str = ""  # text after `</think>` in the token that closed it

    def advance(self, text: str) -> ThinkBudget:
        if self.done:
            return replace(self, leftover="")
        buf = self.tail + text
        if not self.inside:
            start = buf.lstrip()
            if start.startswith(OPEN):
                return replace(self, inside=True, tail=start[len(OPEN) :], count=1)
            if OPEN.startswith(start):
                return replace(self, tail=buf)  # may still open a thought
            return replace(self, done=True, tail="", leftover=buf)
        end = buf.find(CLOSE)
        if end >= 0:
            return replace(self, done=True, tail="", leftover=buf[end + len(CLOSE) :])
        return replace(self, count=self.count + 1, tail=buf[-len(CLOSE) :])

    def forced(self, room: int) -> str | None:
        if self.done or not self.inside:
            return None
        spent = self.budget is not None and self.count >= self.budget
        if not spent and room > self.reserve + len(CLOSE) + 1:
            return None
        typed = max((n for n in range(len(CLOSE)) if self.tail.endswith(CLOSE[:n])), default=0)
        lead = "" if typed or self.tail.endswith("\n") else "\n"
        return lead + CLOSE[typed:]

    def closing_cost(self) -> int:
        return len(CLOSE) + 1 if self.inside and not self.done else 0

    @property
    def free(self) -> bool:
        return self.done

    def key(self) -> Any:
        return None


@dataclass(frozen=True)
class Chain(TextRule):
    """A thought (with its budget), then `then` for the rest of the answer."""

    think: ThinkBudget
    then: TextRule

    @classmethod
    def make(cls, think: ThinkBudget, then: TextRule) -> Chain:
        return cls(replace(think, reserve=then.need() + 1), then)

    def advance(self, text: str) -> Chain | None:
        if self.think.done:
            then = self.then.advance(text)
            return None if then is None else Chain(self.think, then)
        think = self.think.advance(text)
        if not think.done:
            return Chain(think, self.then)
        rest = think.leftover.lstrip()
        then = self.then.advance(rest) if rest else self.then
        return None if then is None else Chain(replace(think, leftover=""), then)

    def need(self) -> int:
        return self.think.closing_cost() + self.then.need()

    def forced(self, room: int) -> str | None:
        if not self.think.done:
            return self.think.forced(room)
        return self.then.forced(room)

    @property
    def closed(self) -> bool:
        return self.think.done and self.then.closed

    @property
    def free(self) -> bool:
        return self.think.done and self.then.free


class Vocab:
    """The tokenizer's vocabulary as text, built once: id -> text (None: never allowed)."""

    def __init__(
        self, strings: list[str | None], eos_ids: list[int] | tuple[int, ...], end: int | None
    ) -> None:
        self.strings = strings
        self.eos = frozenset(eos_ids)
        self.end = end if end is not None else min(self.eos, default=None)  # the EOS to force
        self.by_text: dict[str, int] = {}
        for i, s in enumerate(strings):
            if s and s not in self.by_text:
                self.by_text[s] = i
        self.longest = max((len(s) for s in self.by_text), default=1)
        # rule state -> (tokens the rule accepts [n] int32, what it needs after each [n] int32)
        self.masks: OrderedDict[Any, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, eos_ids: list[int]) -> Vocab:
        """Decodes every id once (a fraction of a second for a 50k vocabulary)."""
        n = tokenizer.vocab_size
        special = tokenizer.special_token_ids
        strings: list[str | None] = []
        for i in range(n):
            text = None if i in special else tokenizer.decode([i])
            strings.append(text if text and "\ufffd" not in text else None)
        return cls(strings, eos_ids, tokenizer.eos_token_id)

    def prefix_token(self, text: str) -> int | None:
        """The token with the longest text that starts `text`."""
        for n in range(min(len(text), self.longest), 0, -1):
            token = self.by_text.get(text[:n])
            if token is not None:
                return token
        return None


class TokenConstraint:
    """A `TextRule` as the decoder's `LogitsConstraint` (see `clover.decoding.constraints`)."""

    def __init__(self, rule: TextRule, vocab: Vocab) -> None:
        self.rule, self.vocab = rule, vocab

    def _fits(self, rule: TextRule | None, room: int) -> bool:
        # after this token room - 1 remain, for what the rule needs and then an EOS; a text
        # that may end right here always fits (the answer ends complete, by length)
        if rule is None:
            return False
        need = rule.need()
        return need == 0 or need + 1 <= room - 1

    def allowed(self, token: int, room: int) -> bool:
        if token in self.vocab.eos:
            return self.rule.need() == 0
        text = self.vocab.strings[token] if token < len(self.vocab.strings) else None
        return text is not None and self._fits(self.rule.advance(text), room)

    def allowed_mask(self, room: int, vocab_size: int) -> torch.Tensor:
        tokens, needs = self._candidates()
        fits = (needs == 0) | (needs + 2 <= room)
        if not bool(fits.any()) and len(needs):  # no room: head for the end as fast as it can
            fits = needs == needs.min()
        chosen = tokens[fits]
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[chosen[chosen < vocab_size].long()] = True
        if self.rule.need() == 0 or not bool(mask.any()):
            for token in self.vocab.eos:
                if token < vocab_size:
                    mask[token] = True
        return mask

    def _candidates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens the rule accepts and what the rule needs after each: ([n], [n])."""
        key, cache = self.rule.key(), self.vocab.masks
        if key is not None and key in cache:
            cache.move_to_end(key)
            return cache[key]
        tokens, needs = [], []
        for token, text in enumerate(self.vocab.strings):
            if text is not None:
                nxt = self.rule.advance(text)
                if nxt is not None:
                    tokens.append(token)
                    needs.append(min(nxt.need(), NEED_CAP))
        found = (torch.tensor(tokens, dtype=torch.int32), torch.tensor(needs, dtype=torch.int32))
        if key is not None:
            cache[key] = found
            if len(cache) > MASK_CACHE:
                cache.popitem(last=False)
        return found

    def forced(self, room: int) -> int | None:
        text = self.rule.forced(room)
        if text is None:
            if self.rule.closed and self.rule.need() == 0:
                return self.vocab.end  # nothing may follow: end the answer
            return None
        return self.vocab.prefix_token(text)

    def advance(self, token: int) -> None:
        if token in self.vocab.eos:
            return
        text = self.vocab.strings[token] if token < len(self.vocab.strings) else None
        nxt = self.rule.advance(text) if text is not None else None
        if nxt is not None:
            self.rule = nxt

    @property
    def finished(self) -> bool:
        return self.rule.free


def answer_rule(then: TextRule | None, budget: int | None, in_reasoning: bool) -> TextRule | None:
    """The rule for a whole chat answer: `then` (JSON, a forced tool call, or nothing) after a
    thought that the prompt opened or the model may open, whose budget is `budget` tokens."""
    if budget is None and (then is None or not in_reasoning):
        return then
    think = ThinkBudget(budget, inside=in_reasoning)
    return think if then is None else Chain.make(think, then)
