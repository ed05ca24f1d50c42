"""The decoding and sampling settings, declared once.

Each field of `GenerationSettings` carries its `Spec`: what it means, its range or choices,
the decoder it is for, and where it is offered. Everything else is made from these specs:
the flags of `clover generate`, `chat`, `serve` (`cli.py`), the server's request parsing
(`serving/protocol.py`), the fields Messages and Responses requests pass on, and the JSON
schemas (`serving/schemas.py`). tests/test_settings.py walks the specs over the four HTTP APIs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import Field, dataclass, field, fields

from clover.decoding.policies import DECODERS, DRAFTS, Policy, make_policy
from clover.errors import CloverError


@dataclass(frozen=True)
class Spec:
    """How a setting is offered. low/high bound numbers (open_low: low itself excluded);
    `choices` bound names; `decoder`: the decoder it is for (None: any); `cli`: a flag of
    generate and chat; `serve`: also a flag of serve (the default of requests that leave it
    out); `http`: a request field of every API."""

    help: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    choices: tuple[str, ...] = ()
    decoder: str | None = None
    cli: bool = True
    serve: bool = False
    http: bool = True


def _setting(default: object, help: str, **spec: object) -> Field:
    return field(default=default, metadata={"spec": Spec(help, **spec)})


@dataclass(frozen=True)
class GenerationSettings:
    """Everything a request may set; None means the model's default."""

    decoder: str | None = _setting(
        None, "ar, low_confidence or self_spec (default: the model's)", choices=DECODERS,
        serve=True,
    )  # fmt: skip
    block_size: int | None = _setting(
        None, "positions per block (default: the model's)", low=1, high=1024, serve=True
    )
    threshold: float = _setting(
        0.95, "commit confidence", low=0.0, high=1.0, decoder="low_confidence", serve=True
    )
    draft: str | None = _setting(
        None, "where drafts come from (default: the model's)", choices=DRAFTS,
        decoder="self_spec", serve=True,
    )  # fmt: skip
    slide: bool = _setting(
        False, "a sliding window of block_size positions instead of fixed blocks",
        decoder="low_confidence", serve=True,
    )  # fmt: skip
    tree: int = _setting(
        0, "verify a tree of N drafts a pass (a drafter draft source, greedy; 0: a chain)",
        low=0, high=1024, decoder="self_spec", serve=True,
    )  # fmt: skip
    # False (bench configs' `:fixed`): drafts as long as the block allows, whatever the costs
    adaptive: bool = _setting(
        True, "draft lengths follow this machine's pass costs", decoder="self_spec", cli=False,
        http=False,
    )  # fmt: skip
    max_tokens: int = _setting(256, "max new tokens", low=1, serve=True)
    temperature: float = _setting(0.0, "0 = greedy", low=0.0, high=2.0)
    top_p: float = _setting(1.0, "nucleus sampling mass", low=0.0, high=1.0, open_low=True)
    top_k: int = _setting(0, "sample among the k likeliest (0: all)", low=0)
    seed: int | None = _setting(
        None, "sampling seed (default: fresh entropy)", low=-(2**63), high=2**63 - 1
    )
    stop: tuple[str, ...] = _setting((), "stop string (repeatable)")
    # makes a fresh LogitsConstraint for each answer (clover.decoding.constraints), or None
    constraint: Callable[[], object] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for f, spec in specs():
            check(f, spec, getattr(self, f.name))

    def policy(self) -> Policy:
        """The decoding policy these settings ask for (after `LLM.default_settings`)."""
        return make_policy(
            self.decoder,
            self.block_size,
            self.threshold,
            draft=self.draft,
            slide=self.slide,
            adaptive=self.adaptive,
            tree=self.tree,
        )


def specs(where: str | None = None) -> Iterator[tuple[Field, Spec]]:
    """The settings' fields and specs, in declaration order; `where`: only those offered
    there ("cli", "serve" or "http")."""
    for f in fields(GenerationSettings):
        spec = f.metadata.get("spec")
        if spec is not None and (where is None or getattr(spec, where)):
            yield f, spec


def kind(f: Field) -> type:
    """The Python type a setting's values have (the field's annotation, None aside)."""
    text = str(f.type).replace(" | None", "")
    return {"str": str, "int": int, "float": float, "bool": bool}.get(text, tuple)


def check(f: Field, spec: Spec, value: object) -> None:
    """Refuse a value outside the setting's type, range or choices, naming the setting."""
    if value is None and f.default is None:
        return
    want = kind(f)
    if want is tuple:
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise CloverError(f"{f.name} must be a tuple of strings, got {value!r}")
        return
    numeric = want in (int, float) and isinstance(value, int | float)
    if isinstance(value, bool) != (want is bool) or not (numeric or isinstance(value, want)):
        raise CloverError(f"{f.name} must be {want.__name__}, got {value!r}")
    if want is int and not isinstance(value, int):
        raise CloverError(f"{f.name} must be an integer, got {value!r}")
    if spec.choices and value not in spec.choices:
        raise CloverError(f"{f.name} must be one of: {', '.join(spec.choices)}; got {value!r}")
    low, high = spec.low, spec.high
    if (low is not None and (value < low or (spec.open_low and value == low))) or (
        high is not None and value > high
    ):
        raise CloverError(f"{f.name} must be {bounds(spec)}, got {value!r}")


def bounds(spec: Spec) -> str:
    if spec.high is None:
        return f"> {spec.low:g}" if spec.open_low else f">= {spec.low:g}"
    return f"in {'(' if spec.open_low else '['}{spec.low:g}, {spec.high:g}]"
