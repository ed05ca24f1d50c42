"""Timing this machine's passes: a causal pass of each width (alone and batched) and a drafter
pass of each length, measured once per model, precision, threads, device and kernel build,
then kept in the user cache: the model's passes in one file, each drafter's in its own
(`costs.PassCosts` is what the decoder reads from them).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from clover import kernels
from clover.decoding.costs import PassCosts
from clover.decoding.draft_model import runner_for
from clover.files import atomic_write_text, cache_dir
from clover.kernels.qgemm import QWeight
from clover.models.cache import ModelCache
from clover.models.drafter import Drafter, fingerprint

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33)
# batches: the rows and widths timed for drafting at batch (a batch's pass is as wide as its
# widest row; past 5 tokens a row, batched passes cost too much to pay on a CPU)
BATCH_ROWS = (2, 4, 8)
BATCH_WIDTHS = (1, 2, 3, 4, 5)


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


def measure(model: torch.nn.Module, drafter: torch.nn.Module | None = None, reps: int = 5,
            widths: tuple[int, ...] = WIDTHS, batches: bool = True,
            verify: bool = True) -> PassCosts:  # fmt: skip
    """Time causal passes of each width over a cache of 256 tokens (the bench harness), and
    with `batches` the few widths batched rows draft at; with `drafter`, its passes by draft
    length too (`verify` False: only those)."""
    cached = min(256, model.context_length // 2)  # what a typical prompt leaves in the cache
    widths = tuple(w for w in widths if cached + w <= model.context_length)
    small = [w for w in BATCH_WIDTHS if cached + w <= model.context_length]
    verify_ms: dict[int, float] = {}
    rows_ms: dict[int, dict[int, float]] = {}
    if verify:
        # the fastest of the repetitions: what the machine can do (other work only slows a
        # run, and a table measured under load would be kept, and mislead, for good)
        timed = pass_costs(model, list(widths), 1, cached, reps, best=True)
        verify_ms = {w: r["ms"] for w, r in timed.items()}
        for rows in BATCH_ROWS if batches else ():
            timed = pass_costs(model, small, rows, cached, reps, best=True)
            rows_ms[rows] = {w: r["ms"] for w, r in timed.items()}
    draft: dict[int, float] = {}
    draft_rows: dict[int, dict[int, float]] = {}
    if drafter is not None:
        draft = _draft_costs(model, drafter, 1, cached, reps, widths)
        for rows in BATCH_ROWS if batches else ():
            draft_rows[rows] = _draft_costs(model, drafter, rows, cached, reps, BATCH_WIDTHS)
    return PassCosts(verify_ms, draft, rows_ms, draft_rows)


def _draft_costs(model: torch.nn.Module, drafter: torch.nn.Module, rows: int, cached: int,
                 reps: int, widths: tuple[int, ...]) -> dict[int, float]:  # fmt: skip
    """ms of a drafter pass drafting w - 1 tokens for `rows` rows, by w (the fastest rep)."""
    runner = runner_for(model, drafter)
    for _ in range(rows):
        runner.add_row()
    runner.fill_context(cached)
    first = torch.ones(rows, dtype=torch.long)
    out = {}
    for w in sorted({w for w in widths if 2 <= w <= runner.block_size}):
        runner.draft(first, w)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.draft(first, w)
            times.append((time.perf_counter() - t0) * 1000)
        out[w] = min(times)
    return out


def cached_costs(model: torch.nn.Module, label: str,
                 drafter: torch.nn.Module | None = None) -> PassCosts:  # fmt: skip
    """The cost table for this model here, measured on first use and kept in the user cache:
    the model's own passes in one file, a drafter's in another, so every drafter of a model
    (and a comparison of two) reads the same verify costs."""
    ours = _kept(costs_key(model, label), ("verify_ms", "rows_ms"), model, None)
    if drafter is None:
        return ours
    if isinstance(drafter, Drafter):  # its shape and head decide its pass's cost
        c = drafter.config
        label += f"|drafter:{c.target_fingerprint}:{c.num_hidden_layers}:{c.draft_vocab}"
    else:  # a draft model: its own weights and head
        weights = next(drafter.parameters()).dtype
        head = _head_label(drafter) + (":rows-int4" if drafter.draft_wide == "int4" else "")
        label += f"|draft-model:{fingerprint(drafter)}:{head}:{weights}:{_packed_bytes(drafter)}"
        extra = drafter.draft_ids
        label += f":vocab{drafter.draft_vocab}" + ("" if extra is None else f"+{len(extra)}")
    theirs = _kept(costs_key(model, label), ("draft_ms", "draft_rows_ms"), model, drafter)
    return PassCosts(ours.verify_ms, theirs.draft_ms, ours.rows_ms, theirs.draft_rows_ms)


def _kept(key: str, fields: tuple[str, str], model: torch.nn.Module,
          drafter: torch.nn.Module | None) -> PassCosts:  # fmt: skip
    """The two tables `fields` of the file `key`, measured (the model's passes, or with
    `drafter` its drafter's only) and written there when it has none."""
    path = costs_path(key)

    def ints(table: dict) -> dict:
        return {int(k): ints(v) if isinstance(v, dict) else v for k, v in table.items()}

    try:
        d = json.loads(path.read_text())
        return PassCosts(**{"verify_ms": {}, **{f: ints(d[f]) for f in fields}})
    except (OSError, ValueError, KeyError):  # (a table from before batches: timed again)
        pass
    print("clover: timing this machine's passes by width, once (draft lengths follow them)",
          file=sys.stderr)  # fmt: skip
    costs = measure(model, drafter, verify=drafter is None)
    table = {f: getattr(costs, f) for f in fields}
    atomic_write_text(path, json.dumps(table), durable=False)  # remade if lost
    return costs


def model_costs(model: torch.nn.Module, drafter: torch.nn.Module | None = None) -> PassCosts:
    """The table the decode loop reads for `model` (with `drafter`'s passes, if given);
    `clover bench` asks for it before timing anything, so that a first measurement does not
    land in a setting's seconds."""
    return cached_costs(model, target_label(model), drafter)


def target_label(model: torch.nn.Module) -> str:
    """What names a target's passes in its cost key besides its fingerprint: its head's
    format and, for packed weights, their bytes (a GGUF loaded with its wider tensors kept
    or rounded to 4 bits, `--gguf-wide`, reads more or fewer a pass)."""
    packed = _packed_bytes(model)
    return _head_label(model) + (f":packed{packed}" if packed else "")


def _head_label(model: torch.nn.Module) -> str:
    """The LM head's format: it decides much of a pass's cost."""
    head = getattr(model, "quantized_head", None)
    w = getattr(head, "weight", None)
    if head is None:
        return "float"
    return f"{type(head).__name__}:{getattr(w, 'bits', '')}:{getattr(w, 'group', '')}"


def _packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's packed weights: the same checkpoint loaded with its wider tensors
    kept or rounded to 4 bits (`load(draft_wide=...)`) reads more or fewer a pass."""
    return sum(m.weight.nbytes() for m in model.modules()
               if isinstance(getattr(m, "weight", None), QWeight))  # fmt: skip


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
