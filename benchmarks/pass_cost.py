"""What a forward pass costs as it carries more positions, per precision: the break-even TPF.

Every multi-token decoder (block diffusion, the sliding window, self-speculation with masked
drafts) buys tokens per forward (TPF) with wider passes. It beats `ar` only when its TPF is
above (cost of its pass) / (cost of an AR step). This measures that ratio on the real model,
over a cache holding a prompt, in one process, interleaved:

    python benchmarks/pass_cost.py --model clover-smol-135m --dtypes int4,bfloat16

For T positions the pass is a block pass (mode "block", nothing committed, the draft adapter
active on every position, as in a denoising step) plus the LM head over the T positions; the
head is also timed alone. The AR step is one causal token + its head (the cache is rolled back
after each). Median of `--reps` after one warm-up; writes benchmarks/results/pass_cost-<model>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from clover.bench.common import command_line, machine, model_label, now, write_results
from clover.engine import LLM

WIDTHS = (1, 2, 3, 5, 9, 17, 33)


def time_model(llm: LLM, prompt_len: int, widths: tuple, reps: int) -> dict:
    model = llm.model
    gen = torch.Generator().manual_seed(0)
    vocab = llm.tokenizer.vocab_size
    ids = torch.randint(100, vocab, (1, prompt_len), generator=gen)
    runs: dict[str, list[float]] = {}
    with torch.inference_mode():
        cache = model.make_cache(1)
        model(ids, cache, "causal")
        length = cache.lengths.clone()
        hidden_d = model.config.hidden_size

        def ar_step() -> None:
            h = model(ids[:, -1:], cache, "causal")
            model.logits(h[0, -1])
            cache.lengths = length.clone()

        cases = {"ar step": ar_step}
        for T in widths:
            x = torch.randint(100, vocab, (1, T), generator=gen)
            h = torch.randn(T, hidden_d).to(model.model.embed_tokens.weight.dtype)
            cases[f"block {T}"] = lambda x=x: model.logits(model(x, cache, "block")[0])
            cases[f"head {T}"] = lambda h=h: model.logits(h)
        for fn in cases.values():  # warm-up
            fn()
        for rep in range(reps):
            names = list(cases)
            names = names[rep % len(names) :] + names[: rep % len(names)]
            for name in names:
                t0 = time.perf_counter()
                cases[name]()
                runs.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
    ar = statistics.median(runs["ar step"])
    rows = []
    for T in widths:
        block = statistics.median(runs[f"block {T}"])
        head = statistics.median(runs[f"head {T}"])
        rows.append(
            {
                "positions": T,
                "pass_ms": round(block, 2),
                "head_ms": round(head, 2),
                "break_even_tpf": round(block / ar, 2),
            }
        )
    return {"ar_step_ms": round(ar, 2), "passes": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="clover-smol-135m")
    p.add_argument("--dtypes", default="int4,bfloat16")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    widths = tuple(int(x) for x in a.widths.split(","))
    record = machine()
    results = {}
    for dt in a.dtypes.split(","):
        llm = LLM(a.model, dtype=dt.strip(), progress=False)
        results[llm.dtype] = time_model(llm, a.prompt_len, widths, a.reps)
        del llm
        r = results[list(results)[-1]]
        print(f"{dt}: AR step {r['ar_step_ms']} ms")
        for row in r["passes"]:
            print(
                f"  {row['positions']:>3} positions: {row['pass_ms']:>7} ms "
                f"(head {row['head_ms']:>6} ms)  break-even TPF {row['break_even_tpf']}"
            )
    report = {
        "benchmark": "pass_cost",
        "date": now(),
        "command": command_line(),
        "machine": record,
        "model": a.model,
        "prompt_tokens": a.prompt_len,
        "reps": a.reps,
        "method": "median ms of a block pass of T positions (adapter active, LM head over "
        "the T positions) and of one AR step (causal token + head), interleaved, one warm-up",
        "reading": "break_even_tpf = pass_ms / ar_step_ms: a decoder whose passes carry T "
        "positions needs more tokens per forward than this to be faster than ar",
        "results": results,
    }
    out = write_results(report, f"{a.out}/pass_cost-{model_label(a.model)}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
