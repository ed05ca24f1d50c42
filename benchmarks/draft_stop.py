"""Where a draft model's chain stops (`ModelDraftRunner.STOP_BELOW`), side by side in one process.

Usage: python benchmarks/draft_stop.py [--model qwen2.5-coder-1.5b]
           [--stops 0,0.5,0.5:priced] [--prompts code] [--tokens 128] [--reps 2] [--out FILE]

Each prompt of the set (`code`: `clover bench speed --prompt-set code`'s ten coding requests;
`speed`: its four open-ended ones) is answered once by `ar`, then, per repetition, with the
model's default decoding at every stop value in turn (0: every chain as wide as the costs
chose). A stop value with `:priced` lets the costs price a row alone's chain by the passes it
is likely to run before it stops (`ModelDraftRunner.PRICE_STOPS`, `costs.chain_cost`); without
it, a chain of k drafts is priced as k passes. Before each answer both prefix caches are
cleared and the drafts' shared acceptance goes back to its prior, so every answer starts alike
whatever ran before it. Reported per stop: the median tokens/s (and `ar`'s) and TPF over all
answers, the draft model's drafts and kept drafts, and whether every answer is `ar`'s (greedy,
at most `--tokens` tokens, ending at EOS).
Writes benchmarks/results/draft-stop-<model>-<prompts>.json.
"""

from __future__ import annotations

import argparse
import statistics

from clover.bench.cli import PROMPT_SETS
from clover.bench.common import command_line, machine, now, write_results
from clover.decoding import draft_model
from clover.engine import LLM, GenerationSettings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--stops", default="0,0.5,0.5:priced")
    ap.add_argument("--prompts", default="code", choices=sorted(PROMPT_SETS))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    machine_record = machine()
    stops = [s.strip() for s in args.stops.split(",")]
    for s in stops:
        value, _, mode = s.partition(":")
        if mode not in ("", "priced") or not 0 <= float(value) < 1:
            raise SystemExit(f"--stops: {s!r} is not a value in [0, 1), optionally :priced")
    llm = LLM(args.model, progress=False)
    prompts = PROMPT_SETS[args.prompts]

    def run(prompt: str, stop: str | None) -> dict:
        llm.prefix_cache.clear()
        llm.runtime.forget_acceptance()  # the drafts' shared acceptance: back to the prior
        value, _, mode = (stop or "0").partition(":")
        draft_model.ModelDraftRunner.STOP_BELOW = float(value)
        draft_model.ModelDraftRunner.PRICE_STOPS = mode == "priced"
        decoder = "ar" if stop is None else None  # None: the model's default
        settings = GenerationSettings(max_tokens=args.tokens, decoder=decoder)
        c = llm.chat([{"role": "user", "content": prompt}], llm.default_settings(settings))
        drafted, kept = c.drafts.get("drafter", (0, 0))
        return {
            "prompt": prompts.index(prompt),
            "stop": stop,
            "seconds": round(c.seconds, 3),
            "tokens_per_s": round(c.tokens_per_s, 2),
            "tpf": round(c.tpf, 3),
            "drafts": c.drafts,
            "drafter_drafted": drafted,
            "drafter_kept": kept,
            "token_ids": c.token_ids,
        }

    run(prompts[0], stops[0])  # warm-up: the first answer pays for first-use costs
    ar_rows = [run(p, None) for p in prompts]
    ar = {i: r["token_ids"] for i, r in enumerate(ar_rows)}
    rows = []
    for rep in range(args.reps):
        for i, p in enumerate(prompts):
            for stop in stops if rep % 2 == 0 else stops[::-1]:
                row = run(p, stop)
                row["same_as_ar"] = row.pop("token_ids") == ar[i]
                rows.append(row)
                print({k: v for k, v in row.items() if k != "drafts"}, flush=True)
    summary = {"ar": {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in ar_rows)}}
    for stop in stops:
        runs = [r for r in rows if r["stop"] == stop]
        drafted = sum(r["drafter_drafted"] for r in runs)
        kept = sum(r["drafter_kept"] for r in runs)
        summary[stop] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "tpf": statistics.median(r["tpf"] for r in runs),
            "drafter_drafted": drafted,
            "drafter_kept": kept,
            "kept_share": round(kept / drafted, 3) if drafted else None,
            "all_same_as_ar": all(r["same_as_ar"] for r in runs),
        }
    report = {
        "benchmark": "draft_stop",
        "date": now(),
        "command": command_line(),
        "machine": machine_record,
        "model": args.model,
        "dtype": llm.dtype,
        "settings": {k: getattr(args, k) for k in ("stops", "prompts", "tokens", "reps")},
        "summary": summary,
        "rows": rows,
    }
    out = args.out or f"benchmarks/results/draft-stop-{args.model}-{args.prompts}.json"
    print(write_results(report, out))
    for stop, s in summary.items():
        print(f"stop {stop}:", s)


if __name__ == "__main__":
    main()
