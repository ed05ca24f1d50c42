"""Numeric bounds in the JSON grammar: which number prefixes can still end inside a range.

A JSON schema's `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` are checked
while a number is typed, character by character: `completion(text)` is the shortest text
that turns the prefix `text` into a number inside the bounds, or None when no such number
starts with `text` (so the grammar refuses that character). Under bounds, numbers are written
without an exponent: `-?(0|[1-9][0-9]*)(\\.[0-9]+)?`.

How: a prefix followed by k more integer digits, then (for `number`) a dot and m fraction
digits, spans an arithmetic grid of values (step 10^-m); the smallest grid point inside the
bounds, if any, gives a completion of that length. Trying (k, m) by growing total length
finds the shortest. Values are exact fractions (a bound 0.1 is 1/10, not the float), and
a number's sign flips the bounds onto its magnitude.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from clover.errors import CloverError

MAX_FRACTION_DIGITS = 30
MAX_MAGNITUDE = 10**309  # past every finite double: longer bounds are refused, not typed


@dataclass(frozen=True)
class Bounds:
    lo: Fraction | None = None
    lo_open: bool = False
    hi: Fraction | None = None
    hi_open: bool = False
    integer: bool = False
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def accepts(self, text: str) -> bool:
        """Whether `text` is a whole number inside the bounds."""
        if text in ("", "-") or text.endswith("."):
            return False
        return self._inside(Fraction(text))

    def _inside(self, x: Fraction) -> bool:
        if self.lo is not None and (x < self.lo or (self.lo_open and x == self.lo)):
            return False
        return self.hi is None or not (x > self.hi or (self.hi_open and x == self.hi))

    def completion(self, text: str) -> str | None:
        """The shortest suffix making `text` a number inside the bounds (None: none does)."""
        if text not in self._memo:
            self._memo[text] = self._complete(text)
        return self._memo[text]

    def _complete(self, text: str) -> str | None:
        if self.accepts(text):
            return ""
        options = []
        if text in ("", "-"):
            found = self._magnitude("", True)
            if found is not None:
                options.append("-" + found if text == "" else found)
            if text == "":
                found = self._magnitude("", False)
                if found is not None:
                    options.append(found)
        else:
            negative = text.startswith("-")
            found = self._magnitude(text[1:] if negative else text, negative)
            if found is not None:
                options.append(found)
        return min(options, key=len) if options else None

    def _magnitude(self, body: str, negative: bool) -> str | None:
        """Shortest suffix for a magnitude typed as `body`, under the bounds seen from its
        sign (for a negative number, lo <= -m <= hi means -hi <= m <= -lo)."""
        if negative:
            lo, lo_open = (None if self.hi is None else -self.hi), self.hi_open
            hi, hi_open = (None if self.lo is None else -self.lo), self.lo_open
        else:
            lo, lo_open, hi, hi_open = self.lo, self.lo_open, self.hi, self.hi_open
        if lo is None or lo < 0:
            lo, lo_open = Fraction(0), False
        if hi is not None and (hi < 0 or (hi == 0 and hi_open)):
            return None
        dot = "." in body
        int_part, _, frac = body.partition(".")
        if dot:
            ks = [0]
        elif int_part == "0":
            ks = [0]
        else:
            biggest = max((abs(b) for b in (lo, hi) if b is not None), default=Fraction(0))
            ks = range(0 if int_part else 1, len(str(math.floor(biggest))) + 3)
        ms = [0] if self.integer else range(0, MAX_FRACTION_DIGITS + 1)
        best = None
        for k in ks:
            if not _overlaps(_span(int_part, dot, frac, k, self.integer), lo, lo_open, hi, hi_open):
                continue  # no number with k more digits lies inside: skip every m
            for m in ms:
                if dot and not frac and m == 0:
                    continue  # a dot needs a digit after it
                length = k + (m if dot else (m + 1 if m else 0))
                if best is not None and length >= len(best):
                    break
                found = self._grid(int_part, dot, frac, k, m, (lo, lo_open, hi, hi_open))
                if found is not None:
                    best = found
        return best

    @staticmethod
    def _grid(int_part: str, dot: bool, frac: str, k: int, m: int, bounds: tuple) -> str | None:
        """The suffix of the smallest value on the (k, m) grid inside the magnitude bounds."""
        lo, lo_open, hi, hi_open = bounds
        if dot:
            step = Fraction(1, 10 ** (len(frac) + m))
            first = Fraction(f"{int_part}.{frac}" if frac else int_part)
            last = first + Fraction(1, 10 ** len(frac)) - step
        else:
            step = Fraction(1, 10**m)
            if int_part:
                j_lo = int(int_part) * 10**k
                j_hi = j_lo + 10**k - 1
            else:
                j_lo, j_hi = (0, 9) if k == 1 else (10 ** (k - 1), 10**k - 1)
            first, last = Fraction(j_lo), Fraction(j_hi) + 1 - step
        x = max(first, math.ceil(lo / step) * step)
        if lo_open and x == lo:
            x += step
        if x > last or (hi is not None and (x > hi or (hi_open and x == hi))):
            return None
        whole = math.floor(x)
        digits = len(frac) + m
        tail = str(int((x - whole) * 10**digits)).zfill(digits) if digits else ""
        if dot:
            return tail[len(frac) :]
        head = str(whole)[len(int_part) :]
        return head + ("." + tail if m else "")


def _span(int_part: str, dot: bool, frac: str, k: int, integer: bool) -> tuple:
    """(low, high, high is reached) of the magnitudes a prefix + k integer digits can end
    as, whatever fraction digits follow."""
    if dot:
        low = Fraction(f"{int_part}.{frac}" if frac else int_part)
        return low, low + Fraction(1, 10 ** len(frac)), False
    if int_part:
        j_lo = int(int_part) * 10**k
        j_hi = j_lo + 10**k - 1
    else:
        j_lo, j_hi = (0, 9) if k == 1 else (10 ** (k - 1), 10**k - 1)
    return (Fraction(j_lo), Fraction(j_hi), True) if integer else (j_lo, Fraction(j_hi + 1), False)


def _overlaps(span: tuple, lo: Fraction, lo_open: bool, hi: Fraction | None, hi_open: bool) -> bool:
    low, high, reached = span
    if high < lo or (high == lo and (lo_open or not reached)):
        return False
    return hi is None or low < hi or (low == hi and not hi_open)


def bounds_from(schema: dict, integer: bool) -> Bounds | None:
    """The schema's numeric bounds, or None when it has none. Draft-4 boolean
    exclusiveMinimum / exclusiveMaximum are read too."""
    lo, lo_open = _bound(schema, "minimum", "exclusiveMinimum", max)
    hi, hi_open = _bound(schema, "maximum", "exclusiveMaximum", min)
    if lo is None and hi is None:
        return None
    return Bounds(lo, lo_open, hi, hi_open, integer)


def _bound(schema: dict, inclusive: str, exclusive: str, tighter: object) -> tuple:
    plain, strict = schema.get(inclusive), schema.get(exclusive)
    if isinstance(strict, bool):  # draft 4: a flag on the inclusive bound
        return (_exact(plain), strict) if plain is not None else (None, False)
    candidates = []
    if plain is not None:
        candidates.append((_exact(plain), False))
    if strict is not None:
        candidates.append((_exact(strict), True))
    if not candidates:
        return None, False
    if len(candidates) == 1:
        return candidates[0]
    (a, a_open), (b, b_open) = candidates
    if a == b:
        return a, a_open or b_open
    pick = tighter(a, b)
    return (a, a_open) if pick == a else (b, b_open)


def _exact(value: object) -> Fraction:
    # the JSON text of the bound, not its binary float: 0.1 means 1/10
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CloverError("minimum / maximum must be finite numbers")
    exact = Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    if abs(exact) >= MAX_MAGNITUDE:
        raise CloverError("minimum / maximum beyond 1e309 are not supported")
    return exact
