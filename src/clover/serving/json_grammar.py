"""Valid JSON prefixes, character by character, optionally under a JSON schema (a subset).

A constrained answer is checked as it grows: `JsonGrammar.feed(state, text)` returns the state
after `text`, or None when no valid document starts that way. A state is an immutable tuple
of frames (innermost last), so states are hashable: transitions and completions are cached
per grammar, and a state costs nothing to keep while other candidates are tried.

`completion(state)` is the shortest text that finishes the document. Decoding uses its length
to stay inside the token budget: a token is allowed only if what it leaves can still be closed
in the tokens that remain (one character per token at worst), so a constrained answer ends as
complete JSON instead of being cut by max_tokens.

Schemas: `json_schema.SchemaCompiler` turns one into nodes, enforcing every keyword it
accepts (types, enums, properties, lengths, numeric bounds, local `$ref`, decidable `anyOf`)
and refusing the rest with a CloverError that names the keyword, so every generated document
validates against the schema it was generated under. Frames carry what a bounded value
needs: a string's character count, an array's item count, a bounded number's text. The
document starts at its first character (no leading whitespace), and after the root value
nothing but the end may follow.
"""

from __future__ import annotations

import json
from typing import Any

from clover.errors import CloverError
from clover.serving.json_schema import ANY, TYPES, Node, SchemaCompiler, compact

__all__ = ["ANY", "TYPES", "JsonGrammar", "Node", "State", "validate"]

WS = " \t\n\r"
CACHE_LIMIT = 200_000  # transitions kept per grammar before the cache is cleared

State = tuple  # of frames, see `JsonGrammar.feed`


class JsonGrammar:
    """JSON documents (under a schema, if given) as a character-level automaton."""

    def __init__(self, schema: dict[str, Any] | None = None) -> None:
        compiler = SchemaCompiler(schema)
        self.nodes: list[Node] = compiler.nodes
        self.root = ANY if schema is None else compiler.compile(schema, "schema")
        compiler.check_unions()
        self.first = {nid: compiler.first_chars(nid) for nid in range(len(self.nodes))}
        self._steps: dict[tuple[State, str], State | None] = {}
        self._completions: dict[State, str] = {}
        self._shortest_values()
        for nid, where in compiler.enums:  # drop values the rest of the schema rejects
            node = self.nodes[nid]
            values, node.enum = node.enum, None
            node.enum = tuple(v for v in values if self._accepts(nid, v))
            if not node.enum:
                raise CloverError(f"{where}: no value of its enum / const fits the schema")
        self._steps.clear()  # computed while enums were open
        self._completions.clear()
        self._shortest_values()

    def _accepts(self, nid: int, text: str) -> bool:
        state = self.feed((("value", nid),), text)
        return state is not None and self.completion(state) == ""

    # --- the automaton -----------------------------------------------------------------------

    def start(self) -> State:
        return (("value", self.root),)

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
        return self.completion(state) == ""

    def _step(self, stack: State, ch: str) -> State | None:
        if not stack:
            return None  # the root value is finished: only the end may follow
        top, below = stack[-1], stack[:-1]
        kind = top[0]
        if kind == "value":
            return self._begin(below, top[1], ch)
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
            return below + (("value", nid),) if below else None
        node = self.nodes[nid]
        if node.branches:  # a union: the branches start with different characters
            for branch in node.branches:
                if ch in self.first[branch]:
                    return self._begin(below, branch, ch)
            return None
        if node.enum is not None:
            return self._literal(below + (("lit", node.enum, "", None),), ch, fresh=True)
        t = node.types
        if ch == "{" and "object" in t:
            return below + (("obj", nid, "first", (), None),)
        if ch == "[" and "array" in t:
            return below + (("arr", nid, "first") + ((0,) if node.sized_array else ()),)
        if ch == '"' and "string" in t:
            return below + (("str", "value", 0) + ((0, nid) if node.sized_string else ()),)
        if (ch == "-" or ch.isdigit()) and ch.isascii() and t & {"number", "integer"}:
            whole = "number" not in t
            at = "-" if ch == "-" else "0" if ch == "0" else "int"
            if node.bounds is None:
                return below + (("num", at, whole),)
            if node.bounds.completion(ch) is None:
                return None
            return below + (("num", at, whole, ch, nid),)
        words = ("true", "false") if "boolean" in t else ()
        words += ("null",) if "null" in t else ()
        if words:
            return self._literal(below + (("lit", words, "", None),), ch, fresh=True)
        return None

    def _string(self, stack: State, top: tuple, ch: str) -> State | None:
        # frames: ("str", role "value" | "key", escape: 0 none, 1 after "\", 2-5 in \uXXXX)
        # + (characters so far, node) for a string with a length bound
        _, role, esc, *sized = top
        below = stack[:-1]
        if esc == 0:
            if ch == '"':
                if sized and sized[0] < self.nodes[sized[1]].min_length:
                    return None
                if role == "value":
                    return below
                obj = below[-1]  # a free key closed: its value may be anything
                return below[:-1] + (obj[:2] + ("colon", obj[3], None),)
            if ord(ch) < 0x20:
                return None
            if sized:  # a character starts (an escape counts as one)
                node = self.nodes[sized[1]]
                count = sized[0] + 1
                if node.max_length is not None and count > node.max_length:
                    return None
                sized = [min(count, max(node.min_length, node.max_length or 0)), sized[1]]
            return below + (("str", role, 1 if ch == "\\" else 0, *sized),)
        if esc == 1:
            if ch in '"\\/bfnrt':
                return below + (("str", role, 0, *sized),)
            return below + (("str", role, 2, *sized),) if ch == "u" else None
        if ch in "0123456789abcdefABCDEF":
            return below + (("str", role, 0 if esc == 5 else esc + 1, *sized),)
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
                    return self._step(stack[:-1], ch) if stack[:-1] else None
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
            return stack[:-1] + (("num", nxt, whole, text + ch, nid),)
        if nxt is not None:
            return stack[:-1] + (("num", nxt, whole),)
        if at in ("0", "int", "frac", "exp"):  # the number ended: `ch` belongs to the parent
            return self._step(stack[:-1], ch) if stack[:-1] else None
        return None

    def _literal(self, stack: State, ch: str, fresh: bool = False) -> State | None:
        # frames: ("lit", candidate texts, typed so far, role: None value | "key")
        _, options, typed, role = stack[-1]
        below = stack[:-1]
        text = typed + ch
        left = tuple(o for o in options if o.startswith(text))
        if left:
            if text in left and len(left) == 1:  # nothing longer possible: done now
                return self._literal_done(below, text, role)
            return below + (("lit", left, text, role),)
        if not fresh and typed in options:  # ended; `ch` belongs to the parent
            done = self._literal_done(below, typed, role)
            return self._step(done, ch) if done else None
        return None

    def _literal_done(self, below: State, text: str, role: str | None) -> State:
        if role != "key":
            return below
        obj = below[-1]
        return below[:-1] + (obj[:2] + ("colon", obj[3], json.loads(text)),)

    def _object(self, stack: State, top: tuple, ch: str) -> State | None:
        # frames: ("obj", node, phase, keys used, key awaiting its value)
        # phases: first (after "{"), key (after ","), colon, next (after a value)
        _, nid, phase, used, key = top
        below, node = stack[:-1], self.nodes[nid]
        if ch in WS:
            return stack
        if phase == "colon":
            if ch != ":":
                return None
            value = node.properties.get(key, node.extra) if key is not None else node.extra
            used = used + (key,) if key is not None else used
            return below + (("obj", nid, "next", used, None), ("value", value))
        if ch == "}" and phase in ("first", "next"):
            return below if all(k in used for k in node.required) else None
        if ch == "," and phase == "next":
            if node.properties and all(k in used for k in node.properties):
                return None
            return below + (("obj", nid, "key", used, None),)
        if ch == '"' and phase in ("first", "key"):
            if node.no_extra:
                return None
            if not node.properties:
                return stack + (("str", "key", 0),)
            keys = tuple(_compact(k) for k in node.properties if k not in used)
            if not keys:
                return None
            return self._literal(stack + (("lit", keys, "", "key"),), ch, fresh=True)
        return None

    def _array(self, stack: State, top: tuple, ch: str) -> State | None:
        # frames: ("arr", node, phase): first (after "["), item (after ","), next (after a value)
        # + (items started,) for an array with a length bound
        _, nid, phase, *sized = top
        below, node = stack[:-1], self.nodes[nid]
        if ch in WS:
            return stack
        count = sized[0] if sized else 0
        if phase == "next":
            if ch == ",":
                if node.max_items is not None and count >= node.max_items:
                    return None
                return below + (("arr", nid, "item", *sized),)
            return below if ch == "]" and count >= node.min_items else None
        if ch == "]" and phase == "first":
            return below if node.min_items == 0 else None
        if node.max_items == 0:
            return None
        if sized:  # counts past both bounds are all alike: cap them (finite states)
            sized = [min(count + 1, max(node.min_items, node.max_items or 0))]
        inner = below + (("arr", nid, "next", *sized),)
        return self._begin(inner, node.items, ch)

    # --- shortest completions ------------------------------------------------------------------

    def completion(self, state: State) -> str:
        """The shortest text after which the document is complete."""
        done = self._completions.get(state)
        if done is None:
            if len(self._completions) > CACHE_LIMIT:
                self._completions.clear()
            done = self._completions[state] = self._complete(state)
        return done

    def _complete(self, stack: State) -> str:
        if not stack:
            return ""
        top, below = stack[-1], stack[:-1]
        kind = top[0]
        if kind == "value":
            return self.minimal(top[1]) + self.completion(below)
        if kind == "str":
            close = ('"', 'n"', '0000"', '000"', '00"', '0"')[top[2]]  # by escape state
            if len(top) > 3:  # sized: pad to the minimum length
                close = close[:-1] + "a" * max(0, self.nodes[top[4]].min_length - top[3]) + '"'
            if top[1] == "value":
                return close + self.completion(below)
            obj = below[-1]
            rest = ":" + self.minimal(self.nodes[obj[1]].extra)
            return close + rest + self._object_tail(obj[1], obj[3]) + self.completion(below[:-1])
        if kind == "num":
            if len(top) > 3:  # bounded
                return self.nodes[top[4]].bounds.completion(top[3]) + self.completion(below)
            return ("0" if top[1] in ("-", ".", "e", "e+") else "") + self.completion(below)
        if kind == "lit":
            _, options, typed, role = top
            if role != "key":
                return min((o[len(typed) :] for o in options), key=len) + self.completion(below)
            obj = below[-1]
            node = self.nodes[obj[1]]
            ends = []
            for option in options:
                name = json.loads(option)
                tail = self._object_tail(obj[1], obj[3] + (name,))
                ends.append(option[len(typed) :] + ":" + self.minimal(node.properties[name]) + tail)
            return min(ends, key=len) + self.completion(below[:-1])
        if kind == "obj":
            _, nid, phase, used, key = top
            node = self.nodes[nid]
            if phase == "colon":
                value = node.properties.get(key, node.extra) if key is not None else node.extra
                used = used + (key,) if key is not None else used
                text = ":" + self.minimal(value) + self._object_tail(nid, used)
            elif phase == "next":
                text = self._object_tail(nid, used)
            else:
                missing = self._missing(nid, used)
                if not missing and phase == "key":  # a key must follow the comma
                    missing = [self._cheapest_key(nid, used)]
                text = ",".join(missing) + "}"
            return text + self.completion(below)
        node, phase = self.nodes[top[1]], top[2]  # arr
        count = top[3] if len(top) > 3 else 0
        item = self.minimal(node.items)
        if phase == "next":
            text = "," * bool(node.min_items > count) + ",".join(
                [item] * max(0, node.min_items - count)
            )
        else:  # first: nothing yet; item: after a comma, one item at least
            need = max(node.min_items - count, 1 if phase == "item" else 0)
            text = ",".join([item] * need)
        return text + "]" + self.completion(below)

    def _missing(self, nid: int, used: tuple) -> list[str]:
        node = self.nodes[nid]
        return [
            f"{_compact(k)}:{self.minimal(node.properties.get(k, node.extra))}"
            for k in node.required
            if k not in used
        ]

    def _cheapest_key(self, nid: int, used: tuple) -> str:
        node = self.nodes[nid]
        if not node.properties:
            return '"":' + self.minimal(node.extra)
        pairs = [
            f"{_compact(k)}:{self.minimal(n)}" for k, n in node.properties.items() if k not in used
        ]
        return min(pairs, key=len)

    def _object_tail(self, nid: int, used: tuple) -> str:
        """After a value inside the object: the required keys still missing, then "}"."""
        return "".join("," + m for m in self._missing(nid, used)) + "}"

    def minimal(self, nid: int) -> str:
        """The shortest value a node allows."""
        return self._minimal[nid]

    def _shortest_values(self) -> None:
        """Every node's shortest value, to a fixpoint: recursive schemas (a tree whose
        children are trees) resolve through their non-recursive options. A node left
        without one allows no finite document and is refused."""
        best: dict[int, str] = {}
        changed = True
        while changed:
            changed = False
            for nid in range(len(self.nodes)):
                value = self._shortest(self.nodes[nid], best)
                if value is not None and (nid not in best or len(value) < len(best[nid])):
                    best[nid] = value
                    changed = True
        if len(best) < len(self.nodes):
            raise CloverError("the schema allows no finite JSON document")
        self._minimal = best

    def _shortest(self, node: Node, best: dict[int, str]) -> str | None:
        if node.branches:
            options = [best[b] for b in node.branches if b in best]
        elif node.enum is not None:
            options = list(node.enum)
        else:
            options = []
            t = node.types
            if t & {"number", "integer"}:
                options.append("0" if node.bounds is None else node.bounds.completion(""))
            if "string" in t:
                options.append('"' + "a" * node.min_length + '"')
            if "array" in t and (node.min_items == 0 or node.items in best):
                options.append("[" + ",".join([best.get(node.items, "")] * node.min_items) + "]")
            if "boolean" in t:
                options.append("true")
            if "null" in t:
                options.append("null")
            values = {k: best.get(node.properties.get(k, node.extra)) for k in node.required}
            if "object" in t and None not in values.values():
                options.append(
                    "{" + ",".join(f"{_compact(k)}:{v}" for k, v in values.items()) + "}"
                )
        return min(options, key=len) if options else None


_compact = compact


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
