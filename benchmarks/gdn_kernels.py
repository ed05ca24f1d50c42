"""Gated DeltaNet on CPU: token-by-token recurrence vs the chunked form, side by side.

Usage: python benchmarks/gdn_kernels.py
Prefill at a few lengths (B=1, 2 key heads, 4 value heads, Dk = Dv = 64, no initial state),
then one 32-token block and one token from a carried state (the block-diffusion decode step).
Each case is timed under inference_mode: one warm-up call, then repeats until 0.3 s or
at least 3 calls, median reported. Also records the largest output difference between the two.
Writes benchmarks/results/gdn_kernels.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from clover.ops.gated_delta import gated_delta_chunked, gated_delta_recurrent

H_K, H_V, D = 2, 4, 64
PREFILL = [256, 1024, 4096]
CHUNKS = [32, 64]


def make_inputs(t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random layer inputs shaped like one Gated DeltaNet layer of the hybrid model."""
    gen = torch.Generator().manual_seed(seed)
    a_log = torch.empty(H_V).uniform_(0.0, 2.77, generator=gen)
    return dict(
        q=torch.randn(1, t, H_K, D, generator=gen),
        k=torch.randn(1, t, H_K, D, generator=gen),
        v=torch.randn(1, t, H_V, D, generator=gen),
        g=-F.softplus(torch.randn(1, t, H_V, generator=gen) - 2.0) * a_log.exp(),
        beta=torch.sigmoid(torch.randn(1, t, H_V, generator=gen)),
    )


def median_seconds(fn: Callable[[], object]) -> float:
    fn()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < 0.3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(x: dict[str, torch.Tensor], state: torch.Tensor | None) -> dict:
    """Time the recurrence and each chunk size on the same inputs; ratios are recurrent/chunked."""
    row: dict = {}
    ref, _ = gated_delta_recurrent(**x, state=state)
    rec = median_seconds(lambda: gated_delta_recurrent(**x, state=state))
    row["recurrent_ms"] = round(rec * 1e3, 3)
    for c in CHUNKS:
        out, _ = gated_delta_chunked(**x, state=state, chunk_size=c)
        sec = median_seconds(lambda c=c: gated_delta_chunked(**x, state=state, chunk_size=c))
        row[f"chunked{c}_ms"] = round(sec * 1e3, 3)
        row[f"speedup_chunked{c}"] = round(rec / sec, 2)
        row[f"max_abs_diff_chunked{c}"] = float(f"{(out - ref).abs().max().item():.2e}")
    return row


def main() -> None:
    results: dict[str, dict] = {}
    with torch.inference_mode():
        for t in PREFILL:
            results[f"prefill_T{t}"] = compare(make_inputs(t), None)
            print(f"prefill T={t}: {results[f'prefill_T{t}']}", flush=True)
        _, state = gated_delta_chunked(**make_inputs(1024, seed=1))
        for t in (32, 1):
            results[f"step_T{t}_from_state"] = compare(make_inputs(t, seed=2), state)
            print(f"step T={t}: {results[f'step_T{t}_from_state']}", flush=True)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}, torch {torch.__version__}",
        "shapes": f"B=1, H_k={H_K}, H_v={H_V}, Dk=Dv={D}, float32",
        "timing": "inference_mode, median of >= 3 calls (>= 0.3 s) after one warm-up",
        "results": results,
        "command": "python benchmarks/gdn_kernels.py",
    }
    out_path = Path(__file__).parent / "results" / "gdn_kernels.json"
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
