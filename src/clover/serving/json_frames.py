"""The data structures of the JSON automaton (`json_grammar`), each chosen so that what a
state costs does not grow with the document or the schema's numbers.

- `Stack`: a state's frames as an immutable linked stack. Pushing, popping and hashing are
  O(1) (the hash is kept), and states share what lies below their top, so a document nested
  thousands deep costs a frame a level, not a copy of the stack per character.
- `Tail`: text as parts and repeat counts with its length known, joined only on request: the
  shortest completion of a string with `minLength: 10**9` is three small objects.
- `Table`: sorted literal texts (enum values, an object's keys, true/false/null); the entries
  a typed prefix allows are a range found by bisection, and the shortest entry of a range
  comes from a sparse table, so a literal costs O(log n) a character whatever its enum's size.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from typing import Any


class Stack:
    """Frames, innermost on top; `BOTTOM` is the empty stack (the document is complete)."""

    __slots__ = ("top", "below", "depth", "_hash")

    def __init__(self, top: Any, below: Stack | None) -> None:
        self.top, self.below = top, below
        self.depth = below.depth + 1 if below is not None else 0
        self._hash = hash((top, below._hash)) if below is not None else 0

    def push(self, *frames: Any) -> Stack:
        stack = self
        for frame in frames:
            stack = Stack(frame, stack)
        return stack

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        a, b = self, other
        while a is not b:  # states grown from one another share their lower frames
            if not isinstance(b, Stack) or a._hash != b._hash or a.depth != b.depth:
                return False
            if a.top != b.top:
                return False
            a, b = a.below, b.below
        return True

    def __repr__(self) -> str:
        frames, s = [], self
        while s.below is not None:
            frames.append(s.top)
            s = s.below
        return f"Stack{tuple(reversed(frames))!r}"


BOTTOM = Stack(None, None)


class Tail:
    """Text as parts and a repeat count, with its length known and the text built only on
    request. Parts are strings or Tails; `times` repeats the parts' concatenation."""

    __slots__ = ("parts", "times", "length")

    def __init__(self, *parts: Tail | str, times: int = 1) -> None:
        self.parts, self.times = parts, times
        self.length = times * sum(p.length if isinstance(p, Tail) else len(p) for p in parts)

    def text(self) -> str:
        out: list[str] = []
        todo: list[Tail | str] = [self]
        while todo:  # a loop, not recursion: a deep document's tail is a long chain
            part = todo.pop()
            if isinstance(part, str):
                out.append(part)
            elif part.times == 1:
                todo.extend(reversed(part.parts))
            else:  # repeats are minimal values: as shallow as the schema
                out.append(Tail(*part.parts).text() * part.times)
        return "".join(out)


EMPTY = Tail()


class Table:
    """Sorted literal texts: the entries a typed prefix allows are a range (bisection), and
    the shortest entry of a range comes from a sparse table in O(1)."""

    def __init__(self, texts: tuple[str, ...], keys: bool = False) -> None:
        self.texts = tuple(sorted(set(texts)))
        self.names = tuple(json.loads(t) for t in self.texts) if keys else ()
        lengths = [len(t) for t in self.texts]
        self._mins = [lengths]  # _mins[j][i]: the shortest of texts[i : i + 2**j]
        span = 1
        while 2 * span <= len(lengths):
            prev = self._mins[-1]
            self._mins.append([min(prev[i], prev[i + span]) for i in range(len(prev) - span)])
            span *= 2

    def __len__(self) -> int:
        return len(self.texts)

    def narrow(self, lo: int, hi: int, text: str) -> tuple[int, int]:
        """The entries of [lo, hi) that start with `text` (they all start with text[:-1])."""
        lo = bisect_left(self.texts, text, lo, hi)
        hi = bisect_left(self.texts, True, lo, hi, key=lambda t: not t.startswith(text))
        return lo, hi

    def shortest(self, lo: int, hi: int) -> int:
        level = (hi - lo).bit_length() - 1
        row = self._mins[level]
        return min(row[lo], row[hi - (1 << level)])

    def shortest_text(self, lo: int, hi: int) -> str:
        n = self.shortest(lo, hi)
        return next(t for t in self.texts[lo:hi] if len(t) == n)
