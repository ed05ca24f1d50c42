"""How much of a long prompt a draft model reads at a row's first draft (`ModelDraftRunner`'s
window), side by side in one process.

Usage: python benchmarks/draft_window.py [--model qwen2.5-coder-1.5b]
           [--windows whole,default,512,256] [--tokens 128] [--reps 2] [--chars 7000] [--out FILE]

The prompt asks about a module's source (the first `--chars` characters of Python's own
`textwrap.py`, about 1,700 tokens). Per window (`whole`: the whole prompt; `default`: the
runner's rule, max(WINDOW, READ_PER_TOKEN x the tokens left to write); N: the last N tokens)
two cases, each greedy with the model's default decoding: cold (both prefix caches empty: the
model prefills the prompt, then the draft model reads it at the first draft) and warm (the
model's prefix cache holds the prompt, the draft model's is empty: a conversation after a
request that did not draft, where the first draft comes before the first text). `ar` runs
once, cold, for reference. Reported per run: seconds, time to first text, tokens/s, TPF, the
first draft's milliseconds, drafts kept by source and whether the answer is `ar`'s.
Writes benchmarks/results/draft-window-<model>.json.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import textwrap
import time

from clover.bench.common import command_line, machine, now, write_results
from clover.decoding import draft_model
from clover.engine import LLM, GenerationSettings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--windows", default="whole,default,512,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--chars", type=int, default=7000)
    ap.add_argument("--out")
    args = ap.parse_args()
    machine_record = machine()
    windows = args.windows.split(",")
    runner = draft_model.ModelDraftRunner
    rule = (runner.WINDOW, runner.READ_PER_TOKEN)
    first_draft: list[float] = []
    draft = runner.draft

    def timed(self, first, width, pick=None):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = draft(self, first, width, pick)
        first_draft.append((time.perf_counter() - t0) * 1000)
        return out

    runner.draft = timed
    llm = LLM(args.model, progress=False)
    source = inspect.getsource(textwrap)[: args.chars]
    prompt = (f"Here is a Python module:\n```python\n{source}\n```\n"
              "Explain what it does, function by function.")  # fmt: skip
    messages = [{"role": "user", "content": prompt}]
    rows = []

    def run(window: str | None, warm: bool) -> dict:
        cache = llm.prefix_cache
        if not warm:
            cache.clear()
        elif cache.draft is not None:
            cache.draft.clear()
        fixed = {"whole": (10**9, 0), "default": rule, None: rule}
        runner.WINDOW, runner.READ_PER_TOKEN = fixed.get(window) or (int(window), 0)
        first_draft.clear()
        settings = GenerationSettings(max_tokens=args.tokens)
        if window is None:
            settings = GenerationSettings(max_tokens=args.tokens, decoder="ar")
        c = llm.chat(messages, llm.default_settings(settings))
        row = {
            "decoder": "ar" if window is None else "default",
            "window": window,
            "warm_model_cache": warm,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "output_tokens": c.output_tokens,
            "seconds": round(c.seconds, 3),
            "ttft_s": round(c.ttft, 3),
            "tokens_per_s": round(c.tokens_per_s, 2),
            "tpf": round(c.tpf, 3),
            "first_draft_ms": round(first_draft[0], 1) if first_draft else None,
            "drafts": c.drafts,
            "token_ids": c.token_ids,
        }
        print({k: v for k, v in row.items() if k != "token_ids"}, flush=True)
        return row

    rows.append(run(None, False))
    for _ in range(args.reps):
        for w in windows:
            rows += [run(w, False), run(w, True)]
    ar_ids = rows[0]["token_ids"]
    for r in rows:
        r["same_as_ar"] = r.pop("token_ids") == ar_ids
    summary = {}
    for w in windows:
        for warm in (False, True):
            runs = [r for r in rows if r["window"] == w and r["warm_model_cache"] == warm]
            summary[f"window {w}, {'warm' if warm else 'cold'}"] = {
                k: statistics.median(r[k] for r in runs)
                for k in ("seconds", "ttft_s", "tokens_per_s", "tpf", "first_draft_ms")
            }
    report = {
        "benchmark": "draft_window",
        "date": now(),
        "command": command_line(),
        "machine": machine_record,
        "model": args.model,
        "dtype": llm.dtype,
        "settings": {k: getattr(args, k) for k in ("windows", "tokens", "reps", "chars")},
        "ar": {k: rows[0][k] for k in ("seconds", "ttft_s", "tokens_per_s")},
        "summary": summary,
        "rows": rows,
    }
    out = args.out or f"benchmarks/results/draft-window-{args.model}.json"
    print(write_results(report, out))
    for name, s in summary.items():
        print(name, s)


if __name__ == "__main__":
    main()
