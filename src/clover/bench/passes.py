"""`clover bench passes`: what one forward pass costs, by width, next to what this machine
allows: the harness every speed change is judged by.

Passes (each over a KV cache already holding `cache` tokens per row, `batch` rows):
- `ar`: one token per row, the LM head over it (a decode step);
- `verify W`: W tokens per row committed causally, the head over all W (self-speculation);
- `block W`: W tokens per row as a denoising block (nothing committed), the head over all W.

Per pass: the median time, its ratio to the AR step at the same batch and cache (the
break-even tokens per forward a decoder needs), and a breakdown by component where the fused
layers run (clover.kernels: their stage clocks; the LM head timed alone; "rest" is what is left:
embedding, layout, Python). Each component stands beside its bound on this machine:
    weights (and head): max(bytes read / memory bandwidth, 2 * weights * rows / matmul peak)
    attention: max(K/V bytes / bandwidth, 4 * queries * keys * head_dim / float32 peak)
with the bandwidth and peaks timed at the start: a read as large as the model's weights (at
least 128 MB, since a model that fits in its share of L3 reads at the cache's rate and a larger
one streams from DRAM, which is slower), from memory in huge pages as the packed weights are
(`checkpoints.packed.anonymous_memory`: 4 KB pages read a 1 GB buffer at 25 GB/s where huge
pages give 30 on one machine), and PyTorch's bf16 and float32 matmuls. The matmul
peak is the better of the two: a CPU without bfloat16 arithmetic multiplies bf16 so slowly
that every weight bound would become a compute bound. The integer dots of short passes may
beat the float peak. The timing of one pass is `decoding.timing.pass_costs`, which the decode
loop's draft lengths use too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from clover.checkpoints.packed import anonymous_memory
from clover.decoding.timing import pass_costs
from clover.kernels.qgemm import QWeight
from clover.quant import Int4Linear, Int8Linear

WEIGHT_STAGES = ("qkv", "o", "gate_up", "down")
ELEMENTWISE_STAGES = ("norms", "rope+cache", "silu*up", "residual")


def measure_machine(seconds: float = 0.5, read_bytes: int = 128 * 1024 * 1024) -> dict:
    """Read bandwidth (GB/s, summing `read_bytes` of float32) and bf16 / float32 matmul peaks
    (GFLOP/s), with the threads PyTorch uses."""

    def rate(fn: Callable[[], None], work: float) -> float:
        fn()
        best, t_end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return work / best / 1e9

    def read_rate() -> float:
        memory = anonymous_memory(read_bytes)
        big = torch.frombuffer(memory, dtype=torch.float32, count=read_bytes // 4).fill_(1.0)
        return rate(lambda: big.sum(), big.numel() * 4)  # the memory goes with its one view

    out = {"bandwidth_gb_s": round(read_rate(), 1)}
    n = 1024
    for dtype, key in ((torch.bfloat16, "bf16_gflop_s"), (torch.float32, "fp32_gflop_s")):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        out[key] = round(rate(lambda a=a, b=b: a @ b, 2 * n**3), 1)
    return out


def head_ms(model: torch.nn.Module, rows: int, reps: int) -> float:
    hidden = torch.randn(rows, model.config.hidden_size).to(model.embed_dtype)
    with torch.inference_mode():
        model.logits(hidden)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model.logits(hidden)
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(bytes, count) of the decoder's matmul weights and of the LM head, as stored."""

    head = getattr(model, "quantized_head", None)
    body_b = body_n = 0
    for m in model.modules():
        if m is head or not isinstance(m, (Int4Linear, Int8Linear, torch.nn.Linear)):
            continue
        if isinstance(m, torch.nn.Linear):
            if m is getattr(model, "lm_head", None):
                continue
            body_b, body_n = (
                body_b + m.weight.numel() * m.weight.element_size(),
                body_n + m.weight.numel(),
            )
        elif isinstance(m.weight, QWeight):
            body_b, body_n = body_b + m.weight.nbytes(), body_n + m.in_features * m.out_features
    if head is not None and isinstance(head.weight, QWeight):
        head_b, head_n = head.weight.nbytes(), head.weight.in_features * head.weight.out_features
    else:
        w = model.head_weight() if head is None else head.weight
        head_b, head_n = w.numel() * w.element_size(), w.numel()
    return body_b, body_n, head_b, head_n


def bounds(model: torch.nn.Module, rows: int, queries: int, keys: int, m: dict) -> dict:
    """Lower bounds in ms for the pass's components on this machine (see the module doc)."""
    c = model.config
    body_b, body_n, head_b, head_n = weight_bytes(model)

    def matmul(nbytes: int, n: int, r: int) -> float:
        peak = max(m["bf16_gflop_s"], m["fp32_gflop_s"])
        return max(nbytes / m["bandwidth_gb_s"] / 1e6, 2 * n * r / peak / 1e6)

    layers = c.num_hidden_layers
    kv = layers * 2 * c.num_key_value_heads * c.head_dim * 4 * keys * (rows // queries)
    flops = layers * 4 * c.num_attention_heads * rows * keys * c.head_dim
    return {
        "weights": matmul(body_b, body_n, rows),
        "head": matmul(head_b, head_n, rows),
        "attention": max(kv / m["bandwidth_gb_s"] / 1e6, flops / m["fp32_gflop_s"] / 1e6),
    }


def run_passes(
    model: torch.nn.Module,
    widths: list[int],
    block: int,
    batches: list[int],
    caches: list[int],
    reps: int,
    log: Callable[[str], None] = print,
) -> dict:
    """The whole table: every (batch, cache) x (ar, verify widths, block) pass."""
    body_b, _, head_b, _ = weight_bytes(model)
    machine_rates = measure_machine(read_bytes=max(128 * 1024 * 1024, body_b + head_b))
    log(f"machine: {machine_rates}")
    rows_out = []
    for batch in batches:
        for cache in caches:
            kinds = [("ar", 1, "causal")] + [(f"verify {w}", w, "causal") for w in widths]
            kinds.append((f"block {block}", block, "block"))
            ar_ms = None
            for name, w, mode in kinds:
                cost = pass_costs(model, [w], batch, cache, reps, mode, profile=True)[w]
                head = head_ms(model, batch * w, reps)
                stages = cost["stages"]
                keys = cache + w
                b = bounds(model, batch * w, w, keys, machine_rates)
                comp = {}
                if stages:
                    comp = {
                        "weights": sum(stages.get(s, 0.0) for s in WEIGHT_STAGES),
                        "attention": stages.get("attention", 0.0),
                        "elementwise": sum(stages.get(s, 0.0) for s in ELEMENTWISE_STAGES),
                    }
                comp["head"] = head
                comp["rest"] = max(0.0, cost["ms"] - sum(comp.values()))
                if name == "ar":
                    ar_ms = cost["ms"]
                row = {
                    "batch": batch,
                    "cache": cache,
                    "pass": name,
                    "tokens_per_row": w,
                    "ms": round(cost["ms"], 3),
                    "x_ar_step": round(cost["ms"] / ar_ms, 3),
                    "components_ms": {k: round(v, 3) for k, v in comp.items()},
                    # each stage of the fused layers (the components sum them): a stage
                    # that costs more than its share shows here first
                    "stages_ms": {k: round(v, 3) for k, v in sorted(stages.items())},
                    "bounds_ms": {k: round(v, 3) for k, v in b.items()},
                    "x_bound": {k: round(comp[k] / b[k], 2) for k in b if k in comp and b[k] > 0},
                }
                rows_out.append(row)
                log(format_row(row))
    return {"machine_rates": machine_rates, "passes": rows_out}


def format_row(r: dict) -> str:
    comp = r["components_ms"]
    parts = ", ".join(
        f"{k} {v:.2f}" + (f" ({r['x_bound'][k]}x bound)" if k in r["x_bound"] else "")
        for k, v in comp.items()
    )
    return (
        f"b{r['batch']} cache {r['cache']:>5} {r['pass']:<9} {r['ms']:8.2f} ms "
        f"({r['x_ar_step']:.2f}x ar): {parts}"
    )


def format_passes(report: dict) -> str:
    m = report["machine_rates"]
    lines = [
        f"machine: {m['bandwidth_gb_s']} GB/s read, bf16 {m['bf16_gflop_s']} GFLOP/s, "
        f"float32 {m['fp32_gflop_s']} GFLOP/s ({report['machine']['torch_threads']} threads)",
        f"{'batch':>5} {'cache':>5} {'pass':<9} {'ms':>8} {'x ar':>6}  "
        f"{'weights':>15} {'attention':>15} {'head':>15} {'elementwise':>11} {'rest':>6}",
    ]
    for r in report["passes"]:
        c, b = r["components_ms"], r["bounds_ms"]

        def cell(k: str, c: dict = c, b: dict = b) -> str:
            return f"{c[k]:6.2f}/{b[k]:.2f}" if k in c else "-"

        lines.append(
            f"{r['batch']:>5} {r['cache']:>5} {r['pass']:<9} {r['ms']:8.2f} {r['x_ar_step']:6.2f}  "
            f"{cell('weights'):>15} {cell('attention'):>15} {cell('head'):>15} "
            f"{c.get('elementwise', 0):11.2f} {c['rest']:6.2f}"
        )
    lines.append("components: measured ms / bound ms on this machine")
    return "\n".join(lines)
