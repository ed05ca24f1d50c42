"""Valid JSON prefixes, character by character, optionally under a JSON schema (a subset).

A constrained answer is checked as it grows: `JsonGrammar.feed(state, text)` returns the state
after `text`, or None when no valid document starts that way. A state is an immutable stack
of frames (`json_frames.Stack`, innermost on top), hashable in O(1): transitions and
completions are cached per grammar (up to `CACHE_LIMIT` each), and a state costs nothing to
keep while other candidates are tried.

`need(state)` is the length of the shortest text that finishes the document. Decoding uses it
to stay inside the token budget: a token is allowed only if what it leaves can still be closed
in the tokens that remain (one character per token at worst), so a constrained answer ends as
complete JSON instead of being cut by max_tokens. The shortest completion is kept as a `Tail`
(parts and repeats, never joined unless `completion` asks for the text), so a schema's numbers
cost what their digits cost: the completion of a string with `minLength: 10**9` is three
small objects whose length is an int, and counters in the frames check lengths and item
counts as characters arrive.

Schemas: `json_schema.SchemaCompiler` turns one into nodes, enforcing every keyword it
accepts (types, enums, properties, lengths, numeric bounds, local `$ref`, decidable `anyOf`)
and refusing the rest with a CloverError that names the keyword, so every generated document
validates against the schema it was generated under. Frames carry what a bounded value
needs: a string's character count, an array's item count, a bounded number's text. Literals
(enum values, an object's keys, true/false/null) live in sorted `Table`s: a frame holds the
range of entries its typed prefix allows, found by bisection, so a character costs O(log n)
whatever the enum's size. The document starts at its first character (no leading
whitespace), and after the root value nothing but the end may follow (the state is then
`BOTTOM`).
"""

from __future__ import annotations

import json
from typing import Any

from clover.errors import CloverError
from clover.serving.json_frames import BOTTOM, EMPTY, Stack, Table, Tail
from clover.serving.json_schema import ANY, TYPES, Budget, Node, SchemaCompiler, compact

__all__ = ["ANY", "BOTTOM", "TYPES", "JsonGrammar", "Node", "State", "Tail", "validate"]

WS = " \t\n\r"
CACHE_LIMIT = 50_000  # transitions, and tails, kept per grammar before that cache is cleared
TEXT_LIMIT = 1_000_000  # the most characters `completion` joins into text

State = Stack  # see `JsonGrammar.feed`


class JsonGrammar:
    """JSON documents (under a schema, if given) as a character-level automaton."""

    def __init__(self, schema: dict[str, Any] | None = None, budget: Budget | None = None) -> None:
        compiler = SchemaCompiler(schema, budget)
        self.nodes: list[Node] = compiler.nodes
        self.root = ANY if schema is None else compiler.compile(schema, "schema")
        compiler.check_unions()
        self.first = {nid: compiler.first_chars(nid) for nid in range(len(self.nodes))}
        self._spend = compiler.spend
        self._reset()
        self._shortest_values()
        for nid, where in compiler.enums:  # drop values the rest of the schema rejects
            node = self.nodes[nid]
            values, node.enum = node.enum, None
            kept = []
            for i, v in enumerate(values):
                if i % 256 == 0:
                    self._spend()
                if self._accepts(nid, v):
                    kept.append(v)
            node.enum = tuple(kept)
            if not node.enum:
                raise CloverError(f"{where}: no value of its enum / const fits the schema")
            self._reset()  # states and tables seen while this enum was open
        if compiler.enums:
            self._shortest_values()
        del self._spend  # the compiler (and the schema it holds) is not kept

    def _reset(self) -> None:
        self._steps: dict[tuple[State, str], State | None] = {}
        self._tails: dict[State, Tail] = {}
        self.tables: list[Table] = []
        self._table_ids: dict[tuple, int] = {}

    def _accepts(self, nid: int, text: str) -> bool:
        state = self.feed(BOTTOM.push(("value", nid)), text)
        return state is not None and self.need(state) == 0

    def _table(self, kind: str, key: Any, texts: Any) -> int:
        """The id of a literal table, built on first use: ("enum", node), ("keys", node) or
        ("words", words)."""
        tid = self._table_ids.get((kind, key))
        if tid is None:
            tid = self._table_ids[(kind, key)] = len(self.tables)
            self.tables.append(Table(tuple(texts()), keys=kind == "keys"))
        return tid

    # --- the automaton -----------------------------------------------------------------------

    def start(self) -> State:
        return BOTTOM.push(("value", self.root))

    def feed(self, state: State | None, text: str) -> State | None:
        """The state after `text`, or None if `text` cannot continue a valid document."""
        for ch in text:
            if state is None:
                return None
            key = (state, ch)
            nxt = self._steps.get(key, key)
            if nxt is key:
                if len(self._steps) > CACHE_LIMIT:
                    self._steps.clear()
                nxt = self._steps[key] = self._step(state, ch)
            state = nxt
        return state

    def complete(self, state: State) -> bool:
        """Whether the document may end here."""
        return self.need(state) == 0

    @staticmethod
    def done(state: State) -> bool:
        """Whether the document is finished (nothing but the end may follow)."""
        return state is BOTTOM

    def _step(self, stack: State, ch: str) -> State | None:
        if stack is BOTTOM:
            return None  # the root value is finished: only the end may follow
        top = stack.top
        kind = top[0]
        if kind == "value":
            return self._begin(stack.below, top[1], ch)
        if kind == "str":
            return self._string(stack, top, ch)
        if kind == "num":
            return self._number(stack, top, ch)
        if kind == "lit":
            return self._literal(stack, ch)
        if kind == "obj":
            return self._object(stack, top, ch)
        return self._array(stack, top, ch)

    def _begin(self, below: State, nid: int, ch: str) -> State | None:
        """A value starts with `ch` (frames: ("value", node))."""
        if ch in WS:  # (not before the root value: a leading blank line helps no one)
            return below.push(("value", nid)) if below is not BOTTOM else None
        node = self.nodes[nid]
        if node.branches:  # a union: the branches start with different characters
            for branch in node.branches:
                if ch in self.first[branch]:
                    return self._begin(below, branch, ch)
            return None
        if node.enum is not None:
            tid = self._table("enum", nid, lambda: node.enum)
            return self._literal(below.push(self._lit(tid, None)), ch, fresh=True)
        t = node.types
        if ch == "{" and "object" in t:
            return below.push(("obj", nid, "first", (), None))
        if ch == "[" and "array" in t:
            return below.push(("arr", nid, "first") + ((0,) if node.sized_array else ()))
        if ch == '"' and "string" in t:
            return below.push(("str", "value", 0) + ((0, nid) if node.sized_string else ()))
        if (ch == "-" or ch.isdigit()) and ch.isascii() and t & {"number", "integer"}:
            whole = "number" not in t
            at = "-" if ch == "-" else "0" if ch == "0" else "int"
            if node.bounds is None:
                return below.push(("num", at, whole))
            if node.bounds.completion(ch) is None:
                return None
            return below.push(("num", at, whole, ch, nid))
        words = ("true", "false") if "boolean" in t else ()
        words += ("null",) if "null" in t else ()
        if words:
            tid = self._table("words", words, lambda: words)
            return self._literal(below.push(self._lit(tid, None)), ch, fresh=True)
        return None

    def _lit(self, tid: int, role: str | None) -> tuple:
        # frames: ("lit", table, lo, hi, typed so far, role: None value | "key")
        return ("lit", tid, 0, len(self.tables[tid]), "", role)

    def _string(self, stack: State, top: tuple, ch: str) -> State | None:
        # frames: ("str", role "value" | "key", escape: 0 none, 1 after "\", 2-5 in \uXXXX,
        # 6 after \uD) + (characters so far, node) for a string with a length bound. An
        # escape counts as one character, so surrogate escapes (two for one character, or
        # half of one) are refused: a length is then the decoded string's length
        _, role, esc, *sized = top
        below = stack.below
        if esc == 0:
            if ch == '"':
                if sized and sized[0] < self.nodes[sized[1]].min_length:
                    return None
                if role == "value":
                    return below
                obj = below.top  # a free key closed: its value may be anything
                return below.below.push(obj[:2] + ("colon", obj[3], None))
            if ord(ch) < 0x20:
                return None
            if sized:  # a character starts (an escape counts as one)
                node = self.nodes[sized[1]]
                count = sized[0] + 1
                if node.max_length is not None and count > node.max_length:
                    return None
                # counts past both bounds are all alike: capped, so states stay finite
                sized = [min(count, max(node.min_length, node.max_length or 0)), sized[1]]
            return below.push(("str", role, 1 if ch == "\\" else 0, *sized))
        if esc == 1:
            if ch in '"\\/bfnrt':
                return below.push(("str", role, 0, *sized))
            return below.push(("str", role, 2, *sized)) if ch == "u" else None
        if esc == 2 and ch in "dD":  # \uD...: 6 until the next digit says no surrogate
            return below.push(("str", role, 6, *sized))
        if esc == 6:  # \uD800-\uDFFF are halves of a character, not one: refused
            return below.push(("str", role, 4, *sized)) if ch in "01234567" else None
        if ch in "0123456789abcdefABCDEF":
            return below.push(("str", role, 0 if esc == 5 else esc + 1, *sized))
        return None

    def _number(self, stack: State, top: tuple, ch: str) -> State | None:
        # frames: ("num", where in the grammar, integer only) + (text, node) when bounded
        _, at, whole, *bounded = top
        digit = ch.isascii() and ch.isdigit()
        if bounded:
            text, nid = bounded
            bounds = self.nodes[nid].bounds
            if ch in "eE" or not (digit or ch == "."):  # no exponent under bounds
                if at in ("0", "int", "frac") and bounds.accepts(text):
                    return self._step(stack.below, ch)
                return None
        nxt = None
        if at == "-":
            nxt = "0" if ch == "0" else "int" if digit else None
        elif at in ("0", "int") and not whole and ch == ".":
            nxt = "."
        elif at in ("0", "int", "frac") and not whole and ch in "eE":
            nxt = "e"
        elif at in ("int", "frac", "exp") and digit:
            nxt = at
        elif at in (".", "e+") and digit:
            nxt = "frac" if at == "." else "exp"
        elif at == "e":
            nxt = "e+" if ch in "+-" else "exp" if digit else None
        if nxt is not None and bounded:
            if bounds.completion(text + ch) is None:
                return None
            return stack.below.push(("num", nxt, whole, text + ch, nid))
        if nxt is not None:
            return stack.below.push(("num", nxt, whole))
        if at in ("0", "int", "frac", "exp"):  # the number ended: `ch` belongs to the parent
            return self._step(stack.below, ch)
        return None

    def _literal(self, stack: State, ch: str, fresh: bool = False) -> State | None:
        _, tid, lo, hi, typed, role = stack.top
        below, table = stack.below, self.tables[tid]
        used = below.top[3] if role == "key" else ()
        text = typed + ch
        nlo, nhi = table.narrow(lo, hi, text)
        if nlo < nhi and self._unused(table, nlo, nhi, used):
            if nhi - nlo == 1 and table.texts[nlo] == text:  # nothing longer possible: done
                return self._literal_done(below, text, role)
            return below.push(("lit", tid, nlo, nhi, text, role))
        if not fresh and table.texts[lo] == typed:  # ended; `ch` belongs to the parent
            done = self._literal_done(below, typed, role)
            return self._step(done, ch) if done else None
        return None

    @staticmethod
    def _unused(table: Table, lo: int, hi: int, used: tuple) -> bool:
        """Whether a key of table[lo:hi] is not in `used` (always, for value literals)."""
        if hi - lo > len(used):
            return True
        return any(table.names[i] not in used for i in range(lo, hi))

    def _literal_done(self, below: State, text: str, role: str | None) -> State:
        if role != "key":
            return below
        obj = below.top
        return below.below.push(obj[:2] + ("colon", obj[3], json.loads(text)))

    def _object(self, stack: State, top: tuple, ch: str) -> State | None:
        # frames: ("obj", node, phase, keys used, key awaiting its value)
        # phases: first (after "{"), key (after ","), colon, next (after a value)
        _, nid, phase, used, key = top
        below, node = stack.below, self.nodes[nid]
        if ch in WS:
            return stack
        if phase == "colon":
            if ch != ":":
                return None
            value = node.properties.get(key, node.extra) if key is not None else node.extra
            used = used + (key,) if key is not None else used
            return below.push(("obj", nid, "next", used, None), ("value", value))
        if ch == "}" and phase in ("first", "next"):
            return below if all(k in used for k in node.required) else None
        if ch == "," and phase == "next":
            if node.properties and all(k in used for k in node.properties):
                return None
            return below.push(("obj", nid, "key", used, None))
        if ch == '"' and phase in ("first", "key"):
            if node.no_extra:
                return None
            if not node.properties:
                return stack.push(("str", "key", 0))
            tid = self._table("keys", nid, lambda: (compact(k) for k in node.properties))
            return self._literal(stack.push(self._lit(tid, "key")), ch, fresh=True)
        return None

    def _array(self, stack: State, top: tuple, ch: str) -> State | None:
        # frames: ("arr", node, phase): first (after "["), item (after ","), next (after a value)
        # + (items started,) for an array with a length bound
        _, nid, phase, *sized = top
        below, node = stack.below, self.nodes[nid]
        if ch in WS:
            return stack
        count = sized[0] if sized else 0
        if phase == "next":
            if ch == ",":
                if node.max_items is not None and count >= node.max_items:
                    return None
                return below.push(("arr", nid, "item", *sized))
            return below if ch == "]" and count >= node.min_items else None
        if ch == "]" and phase == "first":
            return below if node.min_items == 0 else None
        if node.max_items == 0:
            return None
        if sized:  # counts past both bounds are all alike: cap them (finite states)
            sized = [min(count + 1, max(node.min_items, node.max_items or 0))]
        inner = below.push(("arr", nid, "next", *sized))
        return self._begin(inner, node.items, ch)

    # --- shortest completions ------------------------------------------------------------------

    def need(self, state: State) -> int:
        """How many characters must still come before the document may end."""
        return self.tail(state).length

    def completion(self, state: State, limit: int = TEXT_LIMIT) -> str:
        """The shortest text after which the document is complete (for tests and tools: the
        decoder needs only its length). Refused past `limit` characters."""
        tail = self.tail(state)
        if tail.length > limit:
            raise CloverError(f"the shortest completion is {tail.length} characters")
        return tail.text()

    def tail(self, state: State) -> Tail:
        """The shortest completion of `state`, as a Tail. Built from the bottom frame up with
        each stack prefix's tail cached, in a loop: a deep document costs no recursion."""
        got = self._tails.get(state)
        if got is not None:
            return got
        if state is BOTTOM:
            return EMPTY
        todo, stack = [], state
        while stack is not BOTTOM and stack not in self._tails:
            todo.append(stack)
            stack = self._rest(stack)
        if len(self._tails) + len(todo) > CACHE_LIMIT:
            self._tails.clear()
        for stack in reversed(todo):
            below = self._rest(stack)
            rest = EMPTY if below is BOTTOM else self._tails.get(below)
            if rest is None:  # cleared meanwhile: rare, recompute
                rest = self.tail(below)
            self._tails[stack] = Tail(self._local(stack), rest)
        return self._tails[state]

    @staticmethod
    def _rest(stack: State) -> State:
        """The frames below what the top's completion closes (a key closes its object too)."""
        top = stack.top
        key = (top[0] == "str" and top[1] == "key") or (top[0] == "lit" and top[5] == "key")
        return stack.below.below if key else stack.below

    def _local(self, stack: State) -> Tail | str:
        """What closes the top frame (and a key's object): the tail minus the frames below."""
        top = stack.top
        kind = top[0]
        if kind == "value":
            return self.minimal(top[1])
        if kind == "str":
            close = ('"', 'n"', '0000"', '000"', '00"', '0"', '000"')[top[2]]  # by escape state
            if len(top) > 3:  # sized: pad to the minimum length
                pad = max(0, self.nodes[top[4]].min_length - top[3])
                close = Tail(close[:-1], Tail("a", times=pad), '"')
            if top[1] == "value":
                return close
            obj = stack.below.top
            extra = self.minimal(self.nodes[obj[1]].extra)
            return Tail(close, ":", extra, self._object_tail(obj[1], obj[3]))
        if kind == "num":
            if len(top) > 3:  # bounded
                return self.nodes[top[4]].bounds.completion(top[3])
            return "0" if top[1] in ("-", ".", "e", "e+") else ""
        if kind == "lit":
            return self._literal_tail(stack)
        if kind == "obj":
            _, nid, phase, used, key = top
            node = self.nodes[nid]
            if phase == "colon":
                value = node.properties.get(key, node.extra) if key is not None else node.extra
                used = used + (key,) if key is not None else used
                return Tail(":", self.minimal(value), self._object_tail(nid, used))
            if phase == "next":
                return self._object_tail(nid, used)
            missing = self._missing(nid, used)
            if not missing and phase == "key":  # a key must follow the comma
                missing = [self._cheapest_key(nid, used)]
            return Tail(*_joined(missing), "}")
        node, phase = self.nodes[top[1]], top[2]  # arr
        count = top[3] if len(top) > 3 else 0
        item = self.minimal(node.items)
        if phase == "next":
            return Tail(Tail(",", item, times=max(0, node.min_items - count)), "]")
        need = max(node.min_items - count, 1 if phase == "item" else 0)  # after "," one at least
        return Tail(_repeat(item, need), "]")

    def _literal_tail(self, stack: State) -> Tail | str:
        _, tid, lo, hi, typed, role = stack.top
        table = self.tables[tid]
        if role != "key":
            return table.shortest_text(lo, hi)[len(typed) :]
        obj = stack.below.top
        nid, used = obj[1], obj[3]
        node = self.nodes[nid]
        base = self._object_tail(nid, used)
        best, best_len = None, None
        for i in range(lo, hi):  # the key whose ":value" and remaining keys are shortest
            name = table.names[i]
            if name in used:
                continue
            n = len(table.texts[i]) + 1 + self.minimal(node.properties[name]).length + base.length
            if name in node.required:  # no longer missing after it
                n -= 1 + self._pair(nid, name).length
            if best_len is None or n < best_len:
                best, best_len = i, n
        name = table.names[best]
        value = self.minimal(node.properties[name])
        rest = self._object_tail(nid, used + (name,))
        return Tail(table.texts[best][len(typed) :], ":", value, rest)

    def _pair(self, nid: int, key: str) -> Tail:
        node = self.nodes[nid]
        return Tail(compact(key), ":", self.minimal(node.properties.get(key, node.extra)))

    def _missing(self, nid: int, used: tuple) -> list[Tail]:
        node = self.nodes[nid]
        return [self._pair(nid, k) for k in node.required if k not in used]

    def _cheapest_key(self, nid: int, used: tuple) -> Tail:
        node = self.nodes[nid]
        if not node.properties:
            return Tail('"":', self.minimal(node.extra))
        pairs = [self._pair(nid, k) for k in node.properties if k not in used]
        return min(pairs, key=lambda p: p.length)

    def _object_tail(self, nid: int, used: tuple) -> Tail:
        """After a value inside the object: the required keys still missing, then "}"."""
        return Tail(*(Tail(",", m) for m in self._missing(nid, used)), "}")

    def minimal(self, nid: int) -> Tail:
        """The shortest value a node allows."""
        return self._minimal[nid]

    def _shortest_values(self) -> None:
        """Every node's shortest value, to a fixpoint: recursive schemas (a tree whose
        children are trees) resolve through their non-recursive options. A node left
        without one allows no finite document and is refused."""
        best: dict[int, Tail] = {}
        changed = True
        while changed:
            changed = False
            self._spend()
            for nid in range(len(self.nodes)):
                value = self._shortest(self.nodes[nid], best)
                if value is not None and (nid not in best or value.length < best[nid].length):
                    best[nid] = value
                    changed = True
        if len(best) < len(self.nodes):
            raise CloverError("the schema allows no finite JSON document")
        self._minimal = best

    def _shortest(self, node: Node, best: dict[int, Tail]) -> Tail | None:
        if node.branches:
            options = [best[b] for b in node.branches if b in best]
        elif node.enum is not None:
            options = [Tail(min(node.enum, key=len))]
        else:
            options = []
            t = node.types
            if t & {"number", "integer"}:
                options.append(Tail("0" if node.bounds is None else node.bounds.completion("")))
            if "string" in t:
                options.append(Tail('"', Tail("a", times=node.min_length), '"'))
            if "array" in t and (node.min_items == 0 or node.items in best):
                options.append(Tail("[", _repeat(best.get(node.items, EMPTY), node.min_items), "]"))
            if "boolean" in t:
                options.append(Tail("true"))
            if "null" in t:
                options.append(Tail("null"))
            values = {k: best.get(node.properties.get(k, node.extra)) for k in node.required}
            if "object" in t and None not in values.values():
                pairs = [Tail(compact(k), ":", v) for k, v in values.items()]
                options.append(Tail("{", *_joined(pairs), "}"))
        return min(options, key=lambda o: o.length) if options else None


def _repeat(item: Tail, n: int) -> Tail:
    """`n` copies of `item` separated by commas."""
    return Tail(item, Tail(",", item, times=n - 1)) if n > 0 else EMPTY


def _joined(items: list[Tail]) -> list[Tail | str]:
    out: list[Tail | str] = []
    for i, item in enumerate(items):
        out += [",", item] if i else [item]
    return out


def validate(value: object, schema: dict[str, Any] | None) -> bool:
    """Whether a parsed document satisfies the supported subset of `schema` (for tests)."""
    if schema is None or schema is True or schema == {}:
        return True
    if "const" in schema and value != schema["const"]:
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind is not None:
        kinds = [kind] if isinstance(kind, str) else kind
        if not any(_is(value, k) for k in kinds):
            return False
    if isinstance(value, dict):
        props = schema.get("properties")
        if any(k not in value for k in schema.get("required", [])):
            return False
        for k, v in value.items():
            sub = (props or {}).get(k, schema.get("additionalProperties"))
            if props is not None and k not in props:
                return False
            if isinstance(sub, dict) and not validate(v, sub):
                return False
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return all(validate(v, schema["items"]) for v in value)
    return True


def _is(value: object, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "null":
        return value is None
    return isinstance(value, types[kind])
