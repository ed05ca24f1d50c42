"""Speculation tuned to the machine: what a causal pass costs by width here (measured once per
model, precision, threads and device, in a few seconds, then cached), how often each draft
position is accepted (per row, as it decodes), and from both the draft length that maximises
expected tokens per second.

A pass verifying k drafted tokens yields 1 + (accepted run) tokens, in expectation
    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k
(a_i: the chance that draft position i is kept once the ones before it were), and costs
verify(1 + k) + draft(k) milliseconds. The length chosen is the k in 0 .. max that maximises
E(k) / cost(k); k = 0 is a plain AR step, which is what a row falls back to while its drafts
lose. The acceptance estimates drift back toward a prior at every step, so a row that stopped
drafting tries again later (contexts change: code repeats, prose does not).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from clover import kernels
from clover.decoding.drafting import DrafterRunner
from clover.files import atomic_write_text, cache_dir
from clover.models.cache import ModelCache
from clover.models.drafter import Drafter, fingerprint

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33)


@dataclass
class PassCosts:
    """ms of a causal pass by width (tokens per row, the LM head over all of them), and
    optionally of a drafter pass by draft length."""

    verify_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def _at(table: dict[int, float], w: int) -> float:
        """Linear between measured widths, flat past the last."""
        if not table:
            return 0.0
        keys = sorted(table)
        if w <= keys[0]:
            return table[keys[0]] * w / keys[0] if keys[0] > 1 else table[keys[0]]
        for lo, hi in zip(keys, keys[1:]):
            if w <= hi:
                return table[lo] + (table[hi] - table[lo]) * (w - lo) / (hi - lo)
        return table[keys[-1]] * w / keys[-1]

    def verify(self, width: int) -> float:
        return self._at(self.verify_ms, width)

    def draft(self, k: int) -> float:
        return self._at(self.draft_ms, k + 1) if k else 0.0


def best_length(accept: list[float], costs: PassCosts, most: int, drafter: bool = False) -> int:
    """The draft length in 0 .. most with the highest expected tokens per ms."""
    return best_rate(accept, costs, most, drafter)[0]


def best_rate(accept: list[float], costs: PassCosts, most: int,
              drafter: bool = False) -> tuple[int, float]:  # fmt: skip
    """(that length, its expected tokens per ms)."""
    best_k, best = 0, 1.0 / costs.verify(1)
    survive, expected = 1.0, 1.0
    for k in range(1, most + 1):
        survive *= accept[k - 1] if k - 1 < len(accept) else accept[-1]
        expected += survive
        rate = expected / (costs.verify(1 + k) + (costs.draft(k) if drafter else 0.0))
        if rate > best:
            best_k, best = k, rate
    return best_k, best


class Acceptance:
    """Per draft position, the running chance that it is kept (given the ones before were).

    With `shared` (`Runtime.shared_acceptance`: one per model and draft source, fed by every
    row) a row starts from what the rows before it saw and drifts back toward that, not
    toward a fixed prior: a fresh row of a weak drafter starts pessimistic instead of paying for
    drafts until it learns. The shared estimate itself drifts slowly toward the prior, so a
    source that stopped drafting everywhere is tried again later.

    `update` takes evidence, `relax` drifts: a row calls `relax` once per step (whether it
    drafted or not), and the decode loop relaxes the shared estimates once per step
    (`Runtime.relax`), however many rows run."""

    def __init__(self, positions: int, prior: float = 0.6, rate: float = 0.2,
                 drift: float = 0.02, shared: Acceptance | None = None) -> None:  # fmt: skip
        self.shared = shared
        self.p = [prior] * positions if shared is None else list(shared.p[:positions])
        self.p += [prior] * (positions - len(self.p))
        self.prior, self.rate, self.drift = prior, rate, drift

    def update(self, drafted: int, accepted: int) -> None:
        """A verify pass kept `accepted` of `drafted` drafts: positions 1..accepted were kept,
        position accepted + 1 was refused, the rest were not tried."""
        for i in range(min(drafted, len(self.p))):
            if i <= accepted:
                hit = 1.0 if i < accepted else 0.0
                self.p[i] += self.rate * (hit - self.p[i])
        if self.shared is not None:
            self.shared.update(drafted, accepted)

    def relax(self) -> None:
        """Drift toward the prior, or the shared estimate (a row that stopped drafting tries
        again later). A row's relax leaves the shared estimate alone: `Runtime.relax`."""
        if self.shared is None:
            self.p = [x + self.drift * (self.prior - x) for x in self.p]
            return
        toward = self.shared.p
        self.p = [x + self.drift * (toward[i] - x) if i < len(toward) else x
                  for i, x in enumerate(self.p)]  # fmt: skip


# --- measured once, cached ------------------------------------------------------------------


def costs_key(model: torch.nn.Module, label: str) -> str:

    weight = next(model.parameters())
    module = kernels.load() if weight.device.type == "cpu" else None  # CPU kernels: no build
    try:
        isa = kernels.isa(getattr(model, "dots_x", None)) if module is not None else -1
    except (RuntimeError, ValueError):
        isa = -1
    # the kernels' build (named by a hash of their sources): new kernels, new costs
    build = getattr(module, "__name__", "none")
    parts = [fingerprint(model), label, str(weight.device), str(torch.get_num_threads()),
             torch.__version__, str(isa), build]  # fmt: skip
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def costs_path(key: str) -> Path:
    return cache_dir() / "costs" / f"{key}.json"


def measure(model: torch.nn.Module, drafter: Drafter | None = None, reps: int = 5,
            widths: tuple[int, ...] = WIDTHS) -> PassCosts:  # fmt: skip
    """Time causal passes of each width over a cache of 256 tokens (the bench harness)."""
    cached = min(256, model.context_length // 2)  # what a typical prompt leaves in the cache
    widths = tuple(w for w in widths if cached + w <= model.context_length)
    # the fastest of the repetitions: what the machine can do (other work only slows a run,
    # and a table measured under load would be kept, and mislead, for good)
    timed = pass_costs(model, list(widths), 1, cached, reps, best=True)
    verify = {w: r["ms"] for w, r in timed.items()}
    draft: dict[int, float] = {}
    if drafter is not None:
        runner = DrafterRunner(model, drafter)
        runner.add_row()
        width = len(drafter.config.feature_layers) * model.config.hidden_size
        runner.commit(torch.randn(1, cached, width), torch.tensor([cached]))
        first = torch.tensor([1])
        for w in sorted({w for w in widths if 2 <= w <= drafter.config.block_size}):
            runner.draft(first, w)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                runner.draft(first, w)
                times.append((time.perf_counter() - t0) * 1000)
            draft[w] = min(times)
    return PassCosts(verify, draft)


def cached_costs(model: torch.nn.Module, label: str, drafter: Drafter | None = None) -> PassCosts:
    """The cost table for this model here, measured on first use and kept in the user cache."""
    if drafter is not None:  # its shape and head decide its pass's cost
        c = drafter.config
        label += f"|drafter:{c.target_fingerprint}:{c.num_hidden_layers}:{c.draft_vocab}"
    key = costs_key(model, label)
    path = costs_path(key)
    try:
        d = json.loads(path.read_text())
        return PassCosts({int(k): v for k, v in d["verify_ms"].items()},
                         {int(k): v for k, v in d.get("draft_ms", {}).items()})  # fmt: skip
    except (OSError, ValueError, KeyError):
        pass
    print("clover: timing this machine's passes by width, once (draft lengths follow them)",
          file=sys.stderr)  # fmt: skip
    costs = measure(model, drafter)
    table = {"verify_ms": costs.verify_ms, "draft_ms": costs.draft_ms}
    atomic_write_text(path, json.dumps(table), durable=False)  # remade if lost
    return costs


def model_costs(model: torch.nn.Module, drafter: Drafter | None = None) -> PassCosts:
    """The table the decode loop reads for `model` (with `drafter`'s passes, if given);
    `clover bench` asks for it before timing anything, so that a first measurement does not
    land in a setting's seconds."""
    head = getattr(model, "quantized_head", None)
    w = getattr(head, "weight", None)  # its format decides its cost
    label = (
        "float"
        if head is None
        else f"{type(head).__name__}:{getattr(w, 'bits', '')}:{getattr(w, 'group', '')}"
    )
    return cached_costs(model, label, drafter)


# --- timing one pass -------------------------------------------------------------------------


def _reset_after(cache: ModelCache, committed: int) -> Callable[[], None]:
    """Undo a pass's commits (KV: the length; recurrent layers: their tracked state)."""
    cache.enable_rollback()

    def reset() -> None:
        if committed:
            cache.rollback(torch.full_like(cache.lengths, committed))

    return reset


def pass_costs(
    model: torch.nn.Module,
    widths: list[int],
    batch: int = 1,
    cache_tokens: int = 200,
    reps: int = 10,
    mode: str = "causal",
    vocab: int | None = None,
    profile: bool = False,
    best: bool = False,
) -> dict[int, dict]:
    """{width: {"ms": median ms (with best: the fastest) of a pass of `width` tokens per row
    + the head over them, "stages": {stage: ms} (fused layers, with profile)}} over a cache
    of `cache_tokens`."""
    vocab = vocab or model.config.vocab_size
    device = next(model.parameters()).device  # the tokens come from a generator there
    gen = torch.Generator(device=device).manual_seed(0)
    # the stage clocks are the CPU kernels' (a model on another device has none to read)
    module = kernels.load() if profile and device.type == "cpu" else None
    out: dict[int, dict] = {}
    with torch.inference_mode():
        cache = model.make_cache(batch)
        low = min(100, vocab // 2)  # past the special tokens of real vocabularies
        prompt = torch.randint(low, vocab, (batch, cache_tokens), generator=gen, device=device)
        model(prompt, cache, "causal")
        for w in widths:
            x = torch.randint(low, vocab, (batch, w), generator=gen, device=device)
            reset = _reset_after(cache, w if mode == "causal" else 0)

            def run(x: torch.Tensor = x, reset: Callable[[], None] = reset) -> None:
                h = model(x, cache, mode)
                model.logits(h)
                reset()

            run()
            run()
            if module is not None:
                module.profile(True)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1000)
            stages = module.profile(False) if module is not None else {}
            out[w] = {
                "ms": min(times) if best else statistics.median(times),
                "stages": {k: v * 1000 / reps for k, v in stages.items()},
            }
    return out
