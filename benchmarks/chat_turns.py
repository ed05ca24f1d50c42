"""`clover chat` over several turns: time to first text per turn, with the prefix cache and
without it.

Usage: python benchmarks/chat_turns.py [--model clover-smol-135m] [--dtype auto] [--turns 5]
           [--max-tokens 96] [--system TEXT] [--out benchmarks/results/chat_turns.json]

Each turn is `clover chat`'s own (`clover.cli.chat_turn`: the conversation so far through the
chat template, one streamed answer, the model's prefix cache keeping the earlier turns), on
scripted user lines; the answers join the history as they do in the terminal. The same
conversation (the same prompts: the first pass's answers) is then replayed with the cache
off. Reported per turn: prompt tokens, cached tokens, time to first text with and without the
cache, each whole turn's seconds and tokens/s, and whether both answers are identical. Target
(issue 21): turn 5's time to first text within 2x of turn 1's, with the cache. Greedy
decoding, the model's default decoder.
"""

from __future__ import annotations

import argparse
import json

from clover.bench.common import machine, now, write_results
from clover.cli import chat_turn
from clover.data.bench_prompts import CHAT_TURNS
from clover.engine import LLM, Completion, GenerationSettings

LINES = list(CHAT_TURNS)  # main() sizes it to --turns


def conversation(
    llm: LLM, settings: GenerationSettings, system: list, answers: list | None
) -> list[Completion]:
    """Run the turns; replay `answers` as the history instead of the model's own if given.
    -> one completion per turn."""
    history: list[dict] = []
    out = []
    for turn in range(len(answers) if answers is not None else len(LINES)):
        history.append({"role": "user", "content": LINES[turn % len(LINES)]})
        c, _ = chat_turn(llm, settings, system + history, echo=False)
        out.append(c)
        text = answers[turn] if answers is not None else c.text
        history.append({"role": "assistant", "content": text})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="clover-smol-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--system", help="a system prompt (`clover chat --system`)")
    ap.add_argument("--out", default="benchmarks/results/chat_turns.json")
    args = ap.parse_args()
    machine_record = machine()
    LINES[:] = [LINES[i % len(LINES)] for i in range(args.turns)]
    llm = LLM(args.model, dtype=args.dtype, progress=False)
    settings = llm.default_settings(GenerationSettings(max_tokens=args.max_tokens))
    system = [{"role": "system", "content": args.system}] if args.system else []
    chat_turn(llm, settings, [{"role": "user", "content": "Hello."}], echo=False)  # warm-up
    llm.prefix_cache.clear()
    warm = conversation(llm, settings, system, None)
    cache = llm.prefix_cache.report()
    llm.set_prefix_cache(0)
    cold = conversation(llm, settings, system, [c.text for c in warm])
    rows = []
    for turn, (w, c) in enumerate(zip(warm, cold)):
        rows.append({
            "turn": turn + 1,
            "prompt_tokens": w.prompt_tokens,
            "cached_tokens": w.cached_tokens,
            "ttft_s": round(w.ttft, 3),
            "ttft_no_cache_s": round(c.ttft, 3),
            "output_tokens": w.output_tokens,
            "seconds": round(w.seconds, 3),
            "seconds_no_cache": round(c.seconds, 3),
            "tokens_per_s": round(w.tokens_per_s, 2),
            "identical": w.token_ids == c.token_ids,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    last = min(5, len(rows))
    summary = {
        f"turn{last}_over_turn1": round(rows[last - 1]["ttft_s"] / rows[0]["ttft_s"], 3),
        f"turn{last}_over_turn1_no_cache": round(
            rows[last - 1]["ttft_no_cache_s"] / rows[0]["ttft_no_cache_s"], 3
        ),
        "target_met": rows[last - 1]["ttft_s"] <= 2 * rows[0]["ttft_s"],
        "identical_answers": sum(r["identical"] for r in rows),
        "turns": len(rows),
        "prefix_cache": cache,
    }
    report = {
        "date": now(),
        "machine": machine_record,
        "model": args.model,
        "dtype": llm.dtype,
        "decoder": settings.decoder,
        "max_tokens": args.max_tokens,
        "system": args.system,
        "rows": rows,
        "summary": summary,
        "command": f"python benchmarks/chat_turns.py --model {args.model} --dtype {args.dtype} "
        f"--turns {args.turns} --max-tokens {args.max_tokens}"
        + (f" --system {json.dumps(args.system)}" if args.system else ""),
    }
    write_results(report, args.out)
    print(json.dumps({k: v for k, v in summary.items() if k != "prefix_cache"}))


if __name__ == "__main__":
    main()
