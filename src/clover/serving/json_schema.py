"""JSON schema -> the nodes of `json_grammar`'s automaton. Every keyword is enforced or
refused: a schema keyword that a constrained answer would silently break is a 400 naming it.

Enforced: `type`, `enum` / `const` (values the rest of the schema rejects are dropped),
`properties` / `required` / `additionalProperties` (only listed keys are generated; `false`
without properties means `{}`), `items`, `minItems` / `maxItems`, `minLength` / `maxLength`,
`minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` (`json_numbers`), local
`$ref` (`#`, `#/$defs/...`, `#/definitions/...`, recursion included), `anyOf` / `oneOf` whose
branches are all enums (merged) or start with different characters (an object vs null, a
string vs a number: the first character picks the branch), `allOf` with one schema, and
trivially true `uniqueItems: false`, `minProperties` / `maxProperties` that the generated
keys always meet. Annotations (`title`, `description`, `default`, `examples`, `format`, ...)
assert nothing under JSON Schema's own rules and are ignored. Everything else (`pattern`,
`multipleOf`, `not`, `if`, `patternProperties`, `prefixItems`, ...) is refused.

A schema's numbers never become text here: `minLength: 10**9` is an int in a node, checked
by a counter as the answer is typed (`json_grammar`). What compiling may cost is bounded
instead by a `Budget`: subschemas, property names and enum values together, nesting depth,
and seconds; past any of them the schema is refused with a message that says which.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from clover.errors import CloverError
from clover.serving.json_numbers import Bounds, bounds_from

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
ANY = 0  # node id of the unconstrained value
ANNOTATIONS = frozenset(
    "title description default examples $schema $id $comment format readOnly writeOnly "
    "deprecated contentEncoding contentMediaType $defs definitions".split()
)
KEYWORDS = frozenset(
    "type enum const properties required additionalProperties items minItems maxItems "
    "minLength maxLength minimum maximum exclusiveMinimum exclusiveMaximum anyOf oneOf allOf "
    "$ref uniqueItems minProperties maxProperties".split()
)
FIRST = {  # the characters a value of each type may start with
    "object": "{", "array": "[", "string": '"', "number": "-0123456789",
    "integer": "-0123456789", "boolean": "tf", "null": "n",
}  # fmt: skip


@dataclass(frozen=True)
class Budget:
    """What compiling one schema may cost. `size` counts subschemas, property names, required
    names and enum values; `depth` the nesting of subschemas (`$ref` included)."""

    size: int = 20_000
    depth: int = 64
    seconds: float = 1.0  # a core held outside decoding, at most

    def deadline(self) -> float:
        return time.monotonic() + self.seconds


class OverBudget(CloverError):
    """The schema is too large (`code` "schema_too_large") or took too long to compile
    ("schema_timeout")."""

    def __init__(self, message: str, code: str = "schema_too_large") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Node:
    """One compiled schema: what a value at this place may be."""

    types: frozenset[str]
    enum: tuple[str, ...] | None = None  # compact JSON texts of the allowed values
    properties: dict[str, int] = field(default_factory=dict)  # key -> node id
    required: tuple[str, ...] = ()
    extra: int = ANY  # node of values under keys not in properties (free objects)
    no_extra: bool = False  # additionalProperties false without properties: only {}
    items: int = ANY
    branches: tuple[int, ...] = ()  # anyOf / oneOf: the first character picks one
    min_length: int = 0
    max_length: int | None = None
    min_items: int = 0
    max_items: int | None = None
    bounds: Bounds | None = None

    @property
    def sized_string(self) -> bool:
        return self.min_length > 0 or self.max_length is not None

    @property
    def sized_array(self) -> bool:
        return self.min_items > 0 or self.max_items is not None


def compact(value: object) -> str:
    """A value's JSON text; a number JSON cannot write (1e400 reads as infinity) is refused."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise CloverError("enum / const values must be finite numbers") from None


class SchemaCompiler:
    """Fills `nodes` (node 0 is ANY) from a root schema; `compile` returns the root's id."""

    def __init__(self, root: object, budget: Budget | None = None) -> None:
        self.root = root
        self.budget = budget or Budget()
        self.deadline = self.budget.deadline()
        self.nodes: list[Node] = [Node(frozenset(TYPES))]
        self.refs: dict[str, int] = {}
        self.enums: list[tuple[int, str]] = []  # nodes whose enum the grammar filters
        self.size = 0
        self.depth = 0

    def spend(self, items: int = 0) -> None:
        """Count `items` against the size budget and check the clock."""
        self.size += items
        if self.size > self.budget.size:
            raise OverBudget(
                f"the schema is too large: more than {self.budget.size} subschemas, property "
                "names and enum values together"
            )
        if time.monotonic() > self.deadline:
            seconds = f"{self.budget.seconds:g}"
            raise OverBudget(f"the schema took over {seconds} s to compile", "schema_timeout")

    def compile(self, schema: object, where: str) -> int:
        if self.depth >= self.budget.depth:
            raise OverBudget(f"{where}: subschemas nested more than {self.budget.depth} deep")
        self.depth += 1
        try:
            return self._compile(schema, where)
        finally:
            self.depth -= 1

    def _compile(self, schema: object, where: str) -> int:
        self.spend(1)
        if schema is True or schema == {}:
            return ANY
        if schema is False:
            raise CloverError(f"{where} is false: no value can match it")
        if not isinstance(schema, dict):
            raise CloverError(f"{where} must be an object")
        for key in schema:
            if key not in KEYWORDS and key not in ANNOTATIONS:
                raise CloverError(f"{where}: the JSON schema keyword {key!r:.60} is not supported")
        active = {k for k in schema if k in KEYWORDS}
        if "$ref" in schema:
            if active != {"$ref"}:
                raise CloverError(f"{where}: $ref beside other keywords is not supported")
            return self._ref(schema["$ref"], where)
        for combo in ("anyOf", "oneOf", "allOf"):
            if combo in schema:
                if active != {combo}:
                    raise CloverError(f"{where}: {combo} beside other keywords is not supported")
                return self._combine(combo, schema[combo], where)
        nid = len(self.nodes)
        self.nodes.append(Node(frozenset(TYPES)))
        self._fill(self.nodes[nid], schema, where, nid)
        return nid

    def _ref(self, ref: object, where: str) -> int:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise CloverError(f"{where}.$ref: only local references (#/...) are supported")
        if ref in self.refs:
            return self.refs[ref]
        target = self.root
        for raw in [p for p in ref[1:].split("/") if p]:
            key = raw.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or key not in target:
                raise CloverError(f"{where}.$ref {ref[:80]!r} points to nothing")
            target = target[key]
        if target is True or target == {}:
            self.refs[ref] = ANY
            return ANY
        nid = len(self.nodes)  # reserved first: the target may refer back to itself
        self.nodes.append(Node(frozenset(TYPES)))
        self.refs[ref] = nid
        inner = self.compile(target, f"{where}.$ref")
        self.nodes[nid] = self.nodes[inner]
        return nid

    def _combine(self, combo: str, branches: object, where: str) -> int:
        if not isinstance(branches, list) or not branches:
            raise CloverError(f"{where}.{combo} must be a non-empty list of schemas")
        if combo == "allOf":
            if len(branches) != 1:
                raise CloverError(f"{where}.allOf with several schemas is not supported")
            return self.compile(branches[0], f"{where}.allOf[0]")
        ids = [self.compile(b, f"{where}.{combo}[{i}]") for i, b in enumerate(branches)]
        nodes = [self.nodes[i] for i in ids]
        if all(n.enum is not None for n in nodes) and all(i != ANY for i in ids):
            values = [v for n in nodes for v in n.enum]
            if combo == "oneOf" and len(set(values)) < len(values):
                raise CloverError(f"{where}.oneOf: a value matches several branches")
            merged = Node(frozenset(TYPES), enum=tuple(dict.fromkeys(values)))
            self.nodes.append(merged)
            return len(self.nodes) - 1
        self.nodes.append(Node(frozenset(TYPES), branches=tuple(ids)))
        return len(self.nodes) - 1

    def _fill(self, node: Node, schema: dict, where: str, nid: int) -> None:
        active = {k for k in schema if k in KEYWORDS}
        kind = schema.get("type")
        if kind is not None:
            kinds = [kind] if isinstance(kind, str) else kind
            if not isinstance(kinds, list) or not kinds or any(k not in TYPES for k in kinds):
                raise CloverError(f"{where}.type must be one or a list of: {', '.join(TYPES)}")
            node.types = frozenset(kinds) | ({"integer"} if "number" in kinds else set())
        values = schema.get("enum")
        if values is not None and (not isinstance(values, list) or not values):
            raise CloverError(f"{where}.enum must be a non-empty list")
        if "const" in schema:
            const = compact(schema["const"])
            if values is not None and const not in {compact(v) for v in values}:
                raise CloverError(f"{where}: const is not one of its enum's values")
            values = [schema["const"]]
        if values is not None:
            self.spend(len(values))
            node.enum = tuple(dict.fromkeys(compact(v) for v in values))
            if active - {"enum", "const"}:  # other keywords may reject some values
                self.enums.append((nid, where))
        self._object(node, schema, where)
        self._array(node, schema, where)
        node.min_length = _count(schema, "minLength", where) or 0
        node.max_length = _count(schema, "maxLength", where)
        if node.max_length is not None and node.max_length < node.min_length:
            raise CloverError(f"{where}: maxLength is below minLength")
        node.bounds = bounds_from(schema, integer="number" not in node.types)
        if node.bounds is not None and node.bounds.completion("") is None:
            raise CloverError(f"{where}: no number lies within minimum / maximum")

    def _object(self, node: Node, schema: dict, where: str) -> None:
        props = schema.get("properties")
        if props is not None and not isinstance(props, dict):
            raise CloverError(f"{where}.properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise CloverError(f"{where}.required must be a list of strings")
        self.spend(len(required) + len(props or ()))
        extra = schema.get("additionalProperties", True)
        if extra is not True and not isinstance(extra, dict) and extra is not False:
            raise CloverError(f"{where}.additionalProperties must be a schema or a boolean")
        if isinstance(extra, dict):
            node.extra = self.compile(extra, f"{where}.additionalProperties")
        props = dict(props or {})
        for key in required:  # generated objects hold exactly the listed keys
            if key not in props:
                if extra is False:
                    raise CloverError(f"{where}.required names {key!r:.40}, which may not appear")
                props[key] = True
        for key, sub in props.items():
            node.properties[key] = self.compile(sub, f"{where}.properties.{key}")
        node.required = tuple(dict.fromkeys(required))
        node.no_extra = extra is False and not props
        low = _count(schema, "minProperties", where) or 0
        high = _count(schema, "maxProperties", where)
        if low > len(node.required) or (high is not None and high < len(node.properties)):
            raise CloverError(f"{where}: minProperties / maxProperties beyond the required and "
                              "listed keys are not supported")  # fmt: skip

    def _array(self, node: Node, schema: dict, where: str) -> None:
        items = schema.get("items", True)
        if isinstance(items, list):
            raise CloverError(f"{where}.items as a list (tuple form) is not supported")
        node.min_items = _count(schema, "minItems", where) or 0
        node.max_items = _count(schema, "maxItems", where)
        if items is False:
            node.max_items = 0
        elif "items" in schema:
            node.items = self.compile(items, f"{where}.items")
        if node.max_items is not None and node.max_items < node.min_items:
            raise CloverError(f"{where}: maxItems is below minItems")
        unique = schema.get("uniqueItems", False)
        at_most_one = node.max_items is not None and node.max_items <= 1
        if unique is not False and not (unique is True and at_most_one):
            raise CloverError(f"{where}: uniqueItems is not supported")

    def first_chars(self, nid: int, seen: frozenset[int] = frozenset()) -> set[str]:
        """The characters a value of node `nid` may start with."""
        if nid in seen:
            raise CloverError("a $ref cycle with no type in between cannot be decoded")
        node = self.nodes[nid]
        if node.branches:
            return set().union(*(self.first_chars(b, seen | {nid}) for b in node.branches))
        if node.enum is not None:
            return {text[0] for text in node.enum}
        return set().union(*(FIRST[t] for t in node.types))

    def check_unions(self) -> None:
        """Every union must be decidable at its first character."""
        for nid, node in enumerate(self.nodes):
            starts: set[str] = set()
            for b in node.branches:
                chars = self.first_chars(b, frozenset({nid}))
                if chars & starts:
                    raise CloverError(
                        "anyOf / oneOf branches must be enums or start differently (e.g. an "
                        "object or null); these overlap"
                    )
                starts |= chars


def _count(schema: dict, name: str, where: str) -> int | None:
    value = schema.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CloverError(f"{where}.{name} must be a non-negative integer")
    return value
