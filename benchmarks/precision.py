"""Precision side by side on one model: speed and quality of float32 / bfloat16 / int8 / int4.

Usage: python benchmarks/precision.py [--model smollm2-135m] [--tokens 64] [--dtypes ...]
Quality against float32 on the same weights: next-token KL and top-1 agreement, teacher-forced
over the float32 model's own answers (so every precision scores the same text), both in one
pass over the answer and one token a pass (what AR decoding runs: on CPUs with integer dots,
passes of up to 16 rows, 4 with VNNI, round x per group to integers), and how many greedy
answers are token-identical to float32's. Where the CPU has integer dots, int4 also runs with
them off (`int4-bf16x`, `$CLOVER_INT8_DOTS=0`) and with x on 8 and on 15 bits there for 4- and
5-bit weights (`int4-x8`, `int4-x15`: `$CLOVER_DOTS_X`; plain `int4` takes the model's own
choice). Speed: AR greedy output tokens/s at batch 1, precisions interleaved prompt by prompt.
Writes benchmarks/results/precision-<model>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch

from clover import kernels
from clover.bench.common import machine, now, write_results
from clover.data.bench_prompts import PRECISION_PROMPTS
from clover.engine import LLM, GenerationSettings

DTYPES = ("float32", "bfloat16", "int8", "int4")


VARIANTS = {
    "-bf16x": {"CLOVER_INT8_DOTS": "0"},
    "-x8": {"CLOVER_DOTS_X": "8"},
    "-x15": {"CLOVER_DOTS_X": "15"},
}


@contextlib.contextmanager
def dots(variant: str) -> Iterator[None]:
    """$CLOVER_INT8_DOTS and $CLOVER_DOTS_X for a variant: dots off for `*-bf16x`, x on 8 or
    15 bits for `*-x8` / `*-x15`, else dots with the model's choice of x (read at load for the
    fused layers and at each call for the head)."""
    keys = ("CLOVER_INT8_DOTS", "CLOVER_DOTS_X")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.pop("CLOVER_DOTS_X", None)
    os.environ["CLOVER_INT8_DOTS"] = "1"
    os.environ.update(next((v for s, v in VARIANTS.items() if variant.endswith(s)), {}))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def base_dtype(variant: str) -> str:
    return next((variant.removesuffix(s) for s in VARIANTS if variant.endswith(s)), variant)


def stepwise_logp(llm: LLM, seq: torch.Tensor, start: int) -> torch.Tensor:
    """log-probs [T - 1 - start, V] of positions start..T-2, the prompt in one pass and then
    one token a pass over the cache, as AR decoding runs them."""
    model = llm.model
    cache = model.make_cache(1)
    out = [model.logits(model(seq[:, : start + 1], cache, "causal"))[0, -1:]]
    for t in range(start + 1, seq.shape[1] - 1):
        out.append(model.logits(model(seq[:, t : t + 1], cache, "causal"))[0, -1:])
    return torch.cat(out).float().log_softmax(-1)


def answer(llm: LLM, ids: list[int], n: int) -> tuple[list[int], float]:
    out: list = []
    settings = GenerationSettings(decoder="ar", max_tokens=n)
    for _ in llm.stream([ids], settings, out, cached=False):  # every run prefills in full
        pass
    return out[0].token_ids, out[0].tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="float32 is always run")
    args = ap.parse_args()
    machine_record = machine()
    dtypes = ["float32"] + [d for d in args.dtypes.split(",") if d and d != "float32"]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    module = kernels.load()
    if "int4" in dtypes and module is not None and module.int8_dots_supported():
        dtypes += ["int4-bf16x", "int4-x8", "int4-x15"]
    llms = {}
    for d in dtypes:
        with dots(d):
            llms[d] = LLM(args.model, dtype=base_dtype(d), progress=False)
    prompts = [
        llms["float32"].chat_prompt([{"role": "user", "content": p}]) for p in PRECISION_PROMPTS
    ]
    speed: dict[str, list[float]] = {d: [] for d in dtypes}
    exact = dict.fromkeys(dtypes, 0)
    kl: dict[str, list[float]] = {d: [] for d in dtypes}
    top1: dict[str, list[float]] = {d: [] for d in dtypes}
    step_kl: dict[str, list[float]] = {d: [] for d in dtypes}
    step_top1: dict[str, list[float]] = {d: [] for d in dtypes}
    for ids in prompts:
        reference, _ = answer(llms["float32"], ids, args.tokens)
        seq = torch.tensor([ids + reference])
        with torch.inference_mode():
            ref_logp = llms["float32"].model.logits(llms["float32"].model(seq)).log_softmax(-1)
        span = slice(len(ids) - 1, seq.shape[1] - 1)  # positions predicting the answer
        p_ref = ref_logp[0, span].float()
        for d, llm in llms.items():
            with dots(d):
                got, tps = answer(llm, ids, args.tokens)
                with torch.inference_mode():
                    logp = llm.model.logits(llm.model(seq)).float().log_softmax(-1)[0, span]
                    steps = stepwise_logp(llm, seq, len(ids) - 1)
            speed[d].append(tps)
            exact[d] += got == reference
            for lp, kls, tops in ((logp, kl[d], top1[d]), (steps, step_kl[d], step_top1[d])):
                kls.append(float((p_ref.exp() * (p_ref - lp)).sum(-1).mean()))
                tops.append(float((p_ref.argmax(-1) == lp.argmax(-1)).float().mean()))
    base = statistics.median(speed["float32"])
    results = {
        d: {
            "median_tokens_per_s": round(statistics.median(speed[d]), 2),
            "speed_vs_float32": round(statistics.median(speed[d]) / base, 2),
            "mean_kl_vs_float32": round(statistics.mean(kl[d]), 5),
            "top1_agreement": round(statistics.mean(top1[d]), 4),
            "one_token_a_pass_kl_vs_float32": round(statistics.mean(step_kl[d]), 5),
            "one_token_a_pass_top1_agreement": round(statistics.mean(step_top1[d]), 4),
            "greedy_answers_identical": f"{exact[d]}/{len(prompts)}",
        }
        for d in dtypes
    }
    report = {
        "date": now(),
        "machine": machine_record,
        "model": args.model,
        "max_tokens": args.tokens,
        "results": results,
        "kernel_path": kernels.isa() if module is not None else None,
        "command": f"python benchmarks/precision.py --model {args.model} --tokens {args.tokens}"
        f" --dtypes {args.dtypes}",
    }
    suffix = "" if args.dtypes == ",".join(DTYPES) else "-" + args.dtypes.replace(",", "-")
    out = Path(__file__).parent / "results" / f"precision-{args.model}{suffix}.json"
    write_results(report, out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
