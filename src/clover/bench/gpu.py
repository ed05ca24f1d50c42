"""`clover bench gpu`: what one decoding pass of the big model costs, with random weights.

Builds a Clover preset (default `clover-35b-a3b`, ~69 GB of bfloat16) on one device and times
the two passes block decoding is made of, over a cache holding a prompt of L tokens:
- a block pass: `block` masked positions attending to the prefix and to each other (one
  denoising step, nothing committed);
- a commit pass: `block` tokens committed causally (a finished block joining the prefix);
- and, for scale, a one-token AR step.
For a measured TPF, one block of B tokens costs B / TPF block passes + one commit pass (an
upper bound: the engine fuses the commit into the next block's first pass), so
tokens/s <= B / ((B / TPF) * t_block + t_commit) per row; the report gives that bound.

The weights are never trained, so only time is measured. The cache is filled synthetically
(random K/V for the attention layers, random recurrent state for the GDN layers, committed
length L) instead of prefilling L real tokens: a pass costs the same whatever the cache holds,
and skipping the prefill keeps a 32K x 8 run to seconds. The model is built on the `meta`
device, cast to bfloat16 and materialized on the target device, so it never exists in float32.
The engine's tensors carry no explicit device, so everything runs under `torch.device(device)`
(the default device for tensor factories).

On a machine without CUDA it runs on CPU; the test suite runs it at `clover-tiny` shape.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from clover.bench.common import spread
from clover.checkpoints import resolve_device
from clover.errors import CloverError
from clover.models.cache import KVCache
from clover.models.clover import CloverModel, preset_config

LENGTHS = {"clover-35b-a3b": [1024, 8192, 32768], "clover-tiny": [64, 256]}


def build_random(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The preset's model with random weights (std 0.02; GDN decay parameters in their usual
    range), materialized directly on `device` in `dtype`."""

    config = preset_config(preset)
    with torch.device("meta"):
        model = CloverModel(config)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.0, 2.7, generator=gen)  # log of 1..16, as the module's own init
            elif name.endswith(("dt_bias", "right_conv", "block_mix", "history_bias")):
                p.zero_()
            elif name.endswith("norm_weight"):
                p.fill_(1.0)  # the GDN output norm scales by its weight
            elif "norm" in name:
                p.zero_()  # zero-centred norms: weight 0 = scale 1
            else:
                p.normal_(0.0, 0.02, generator=gen)
    with torch.device(device):
        model.reset_buffers()
    return model.eval()


def fill_cache(model: torch.nn.Module, batch: int, length: int, extra: int) -> object:
    """A cache whose rows hold `length` committed tokens of random content, with room for
    `extra` more positions."""

    cache = model.make_cache(batch)
    for layer in cache.layers:
        if isinstance(layer, KVCache):
            B, H, _, D = layer.k.shape
            layer.k = torch.randn(B, H, length + extra, D, dtype=layer.k.dtype)
            layer.v = torch.randn_like(layer.k)
        else:  # GDN: fixed-size conv + recurrent state
            layer.conv = torch.randn_like(layer.conv) * 0.1
            layer.state = torch.randn_like(layer.state) * 0.1
    cache.lengths = torch.full((batch,), length, dtype=torch.long)
    return cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device, reps: int) -> list[float]:
    fn()  # warm-up
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _time_shape(
    model: torch.nn.Module, dev: torch.device, batch: int, length: int, block: int, reps: int
) -> tuple[list[float], list[float], list[float]]:
    """Seconds per block pass, commit pass and AR step over a cache of `length` tokens."""
    with torch.device(dev), torch.inference_mode():
        cache = fill_cache(model, batch, length, 2 * block)
        ids = torch.randint(0, model.config.vocab_size, (batch, block))  # [B, block]
        reset = torch.full((batch,), length, dtype=torch.long)

        def block_pass() -> object:
            return model.logits(model(ids, cache, "block"))  # nothing committed

        def commit_pass() -> object:
            model(ids, cache, "causal")
            cache.lengths = reset.clone()  # back to L for the next repetition

        def ar_step() -> object:
            h = model(ids[:, :1], cache, "causal")
            cache.lengths = reset.clone()
            return model.logits(h)

        return (
            _time(block_pass, dev, reps),
            _time(commit_pass, dev, reps),
            _time(ar_step, dev, reps),
        )


def time_passes(
    preset: str = "clover-35b-a3b",
    device: str = "auto",
    lengths: list[int] | None = None,
    batches: tuple[int, ...] | list[int] = (1, 8),
    block: int = 32,
    reps: int = 5,
    tpf: list[float] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """-> {"results": [{length, batch, block_pass_ms, commit_pass_ms, ar_step_ms, ...}], ...}"""

    dev = resolve_device(device)
    if preset == "clover-35b-a3b" and dev.type == "cpu":
        raise CloverError("clover-35b-a3b needs ~70 GB on one GPU; on CPU use --preset clover-tiny")
    lengths = lengths or LENGTHS.get(preset, [1024])
    tpf = tpf or [1.0, 2.0, 2.55, 4.0]  # 2.55: LLaDA2.0's reported TPF at 0.95 / block 32
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    with torch.device(dev):
        model = build_random(preset, dev, dtype)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    if log:
        log(f"{preset}: {params / 1e6:,.1f}M parameters on {dev} in {build_s:.1f}s")
    context = model.context_length
    results = []
    for length in lengths:
        if length + block > context:
            raise CloverError(f"length {length} + block {block} exceeds the context {context}")
        for batch in batches:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            tb, tc, ta = _time_shape(model, dev, batch, length, block, reps)
            mb, mc, ma = (statistics.median(t) for t in (tb, tc, ta))
            bound = {f"tpf_{x:g}": round(batch * block / ((block / x) * mb + mc), 1) for x in tpf}
            row = {
                "length": length,
                "batch": batch,
                "block_pass_ms": spread([t * 1e3 for t in tb]),
                "commit_pass_ms": spread([t * 1e3 for t in tc]),
                "ar_step_ms": spread([t * 1e3 for t in ta]),
                "ar_tokens_per_s_bound": round(batch / ma, 1),
                "block_tokens_per_s_bound": bound,
            }
            if dev.type == "cuda":
                row["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 1)
            results.append(row)
            if log:
                log(f"L={length} B={batch}: block {mb * 1e3:.1f} ms, commit {mc * 1e3:.1f} ms")
    return {
        "preset": preset,
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "dtype": "bfloat16",
        "parameters": params,
        "build_seconds": round(build_s, 1),
        "block": block,
        "reps": reps,
        "method": "random weights; synthetic cache of L committed tokens; median of reps "
        "after one warm-up; block pass includes the LM head over the block, commit pass does not",
        "results": results,
    }


def format_gpu(report: dict) -> str:
    params = f"{report['parameters'] / 1e6:,.1f}M params"
    lines = [f"{report['preset']} on {report['device']} ({params})"]
    lines.append(f"{'L':>7} {'B':>3} {'block ms':>10} {'commit ms':>10} {'AR ms':>8}  bound tok/s")
    for r in report["results"]:
        bound = ", ".join(f"{k[4:]}: {v}" for k, v in r["block_tokens_per_s_bound"].items())
        lines.append(
            f"{r['length']:>7} {r['batch']:>3} {r['block_pass_ms']['median']:>10} "
            f"{r['commit_pass_ms']['median']:>10} {r['ar_step_ms']['median']:>8}  TPF {bound}"
        )
    return "\n".join(lines)
