"""Does `--compile` change answers? Greedy `ar` answers of the eager and the compiled model at
one precision, each compared with the float32 model's (the most exact reference we have).

    python benchmarks/compile_agreement.py --model clover-smol-135m --items 20

Compiled code fuses bfloat16 elementwise ops, so it rounds differently from eager code; at
int4 both differ from float32 at near-ties. This counts identical answers and the tokens
before the first difference, over every 8th item of the quality suite (natural answers:
stops at EOS). Writes benchmarks/results/compile_agreement-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from clover.bench.common import command_line, machine, model_label, now, write_results
from clover.engine import LLM, GenerationSettings


def answer(llm: LLM, prompt: list[int], settings: GenerationSettings) -> list[int]:
    out: list = []
    for _ in llm.stream([prompt], settings, out, cached=False):  # no prefix-cache effects
        pass
    return out[0].token_ids


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="clover-smol-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--items", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--suite", default="benchmarks/suites/quality.jsonl")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    record = machine()
    lines = open(a.suite).read().splitlines()
    items = [json.loads(line) for line in lines if line.strip()][::8][: a.items]
    eager = LLM(a.model, dtype=a.dtype, progress=False)
    t0 = time.perf_counter()
    compiled = LLM(a.model, dtype=eager.dtype, progress=False, compile=True)
    compile_s = time.perf_counter() - t0
    exact = LLM(a.model, dtype="float32", progress=False)
    settings = GenerationSettings(decoder="ar", max_tokens=a.max_tokens)
    rows = []
    with torch.inference_mode():
        for it in items:
            prompt = eager.chat_prompt([{"role": "user", "content": it["prompt"]}])
            e, c, f = (answer(m, prompt, settings) for m in (eager, compiled, exact))
            rows.append(
                {
                    "id": it.get("id"),
                    "tokens": [len(e), len(c), len(f)],
                    "eager_eq_compiled": e == c,
                    "eager_eq_float32": e == f,
                    "compiled_eq_float32": c == f,
                    "prefix_eager_float32": common_prefix(e, f),
                    "prefix_compiled_float32": common_prefix(c, f),
                }
            )
    n = len(rows)
    summary = {
        "items": n,
        "eager_identical_to_compiled": sum(r["eager_eq_compiled"] for r in rows),
        "eager_identical_to_float32": sum(r["eager_eq_float32"] for r in rows),
        "compiled_identical_to_float32": sum(r["compiled_eq_float32"] for r in rows),
        "tokens_before_first_difference_from_float32": {
            "eager": sum(r["prefix_eager_float32"] for r in rows),
            "compiled": sum(r["prefix_compiled_float32"] for r in rows),
        },
        "compiled_load_seconds": round(compile_s, 1),
    }
    print(json.dumps(summary, indent=1))
    report = {
        "benchmark": "compile_agreement",
        "date": now(),
        "command": command_line(),
        "machine": record,
        "model": a.model,
        "dtype": eager.dtype,
        "decoder": "ar, greedy, stops at EOS",
        "max_tokens": a.max_tokens,
        "summary": summary,
        "rows": rows,
    }
    out = write_results(report, f"{a.out}/compile_agreement-{model_label(a.model)}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
