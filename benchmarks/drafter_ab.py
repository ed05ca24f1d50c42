"""Two drafters of one model side by side on requests none of them trained on, per prompt.

Usage: python benchmarks/drafter_ab.py NEW [--old DRAFTER] [--model M] [--prompt-set code]
       [--tokens 384] [--reps 2] [--old-vocab N[+drafter]] [--new-vocab N[+drafter]]
       [--old-wide int8|int4] [--new-wide int8|int4] [--out FILE]

A drafter is a drafter file or a smaller model of the same tokenizer (`--drafter`); a draft
model's side may draft from its first N ids (`--old-vocab`, `--new-vocab`: its
`draft_vocab`, 0 every id) and, given as N+drafter, its shipped drafter's ids too (its
`draft_ids`, the default), so one draft model with two draft vocabularies can be compared;
`--old-wide`/`--new-wide` load a draft model's tensors stored wider than 4 bits as they are
(int8) or rounded to 4 bits (int4, the default: `LLM(draft_wide=...)`).
The model is loaded twice, once with each drafter (OLD: the model's shipped one unless given);
every prompt runs `ar` and the model's default decoding with each drafter, greedy, answers
ending at EOS or `--tokens`, prefix cache off, in an order that rotates between repetitions so
the host's drift falls on every setting alike. Per prompt and setting: tokens/s (median over
the repetitions), tokens per forward pass (TPF), tokens per verify pass, and each draft
source's drafted and kept tokens; then the totals and the ratios to `ar`. Both drafters must
give `ar`'s tokens (lossless at int4 too): a differing answer is reported. Writes
benchmarks/results/drafter-ab-<model>-<prompt set>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from clover.bench.common import command_line, machine, model_label, now, write_results
from clover.data.bench_prompts import OPEN_CODE_PROMPTS, SPEED_PROMPTS
from clover.engine import LLM, GenerationSettings
from clover.models.base import DiffusionLM

SETS = {"code": OPEN_CODE_PROMPTS, "speed": SPEED_PROMPTS}


def _tally(completions: list) -> dict:
    drafts: dict[str, list[int]] = {}
    for c in completions:
        for source, (d, k) in c.drafts.items():
            t = drafts.setdefault(source, [0, 0])
            t[0], t[1] = t[0] + d, t[1] + k
    tokens = sum(c.output_tokens for c in completions)
    passes = sum(len(c.accepted) for c in completions)
    kept = sum(sum(c.accepted) for c in completions)
    return {
        "tokens": tokens,
        "tpf": round(tokens / max(1, sum(c.nfe for c in completions)), 3),
        "tokens_per_verify_pass": round(1 + kept / passes, 3) if passes else None,
        "drafted_kept": drafts,
        "kept_fraction": {s: round(k / d, 3) for s, (d, k) in drafts.items() if d},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("new", help="the drafter file to compare")
    p.add_argument("--old", help="the other drafter (default: the model's own)")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompt-set", choices=sorted(SETS), default="code")
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--old-vocab", help="a draft model's draft_vocab on the OLD side: N, or "
                   "N+drafter (with its shipped drafter's ids)")  # fmt: skip
    p.add_argument("--new-vocab", help="the same on the NEW side")
    for side in ("old", "new"):
        p.add_argument(f"--{side}-wide", choices=("int8", "int4"), default="int4",
                       help=f"the {side} draft model's wider tensors: kept or rounded to 4 "
                       "bits")  # fmt: skip
    p.add_argument("--out")
    a = p.parse_args()
    record = machine()
    llms = {"old": LLM(a.model, drafter=a.old, progress=False, draft_wide=a.old_wide),
            "new": LLM(a.model, drafter=a.new, progress=False, draft_wide=a.new_wide)}  # fmt: skip
    for name, vocab in (("old", a.old_vocab), ("new", a.new_vocab)):
        draft = llms[name].runtime.drafter
        if vocab is not None:
            size, _, ids = vocab.partition("+")
            if not isinstance(draft, DiffusionLM):
                p.error(f"--{name}-vocab: the {name} drafter is not a draft model")
            if not size.isdigit() or ids not in ("", "drafter"):
                p.error(f"--{name}-vocab: N or N+drafter, not {vocab!r}")
            if ids and draft.draft_ids is None:
                p.error(f"--{name}-vocab: the {name} draft model ships no drafter")
            # before its first draft: its head (`Runtime.drafter_runner`) and costs follow
            draft.draft_vocab = int(size)
            draft.draft_ids = draft.draft_ids if ids else None
    for llm in llms.values():
        llm.set_prefix_cache(0)
    first = llms["old"]
    default = first.default_settings(GenerationSettings(max_tokens=a.tokens))
    ar = GenerationSettings(decoder="ar", max_tokens=a.tokens)
    runs = {"ar": (first, ar), "old": (llms["old"], default), "new": (llms["new"], default)}
    texts = SETS[a.prompt_set]
    prompts = [first.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    for llm, s in runs.values():  # warm-up: pass costs, kernels, the drafter's first pass
        llm.generate([prompts[0]], dataclasses.replace(s, max_tokens=16))
    done: dict[str, list[list]] = {name: [[] for _ in prompts] for name in runs}
    names = list(runs)
    for rep in range(a.reps):
        for i, prompt in enumerate(prompts):
            turn = (rep + i) % len(names)
            for name in names[turn:] + names[:turn]:
                llm, s = runs[name]
                [c] = llm.generate([prompt], s)
                done[name][i].append(c)
        print(f"rep {rep + 1}/{a.reps} done", file=sys.stderr, flush=True)
    per_prompt, differ = [], []
    for i, text in enumerate(texts):
        row = {"prompt": text}
        for name in names:
            cs = done[name][i]
            row[name] = {"tokens_per_s": round(statistics.median(c.tokens_per_s for c in cs), 2),
                         **_tally(cs[:1])}  # fmt: skip
            if name != "ar" and cs[0].token_ids != done["ar"][i][0].token_ids:
                differ.append(f"{name}: prompt {i}")
        per_prompt.append(row)
    totals = {}
    for name in names:
        cs = [c for runs_ in done[name] for c in runs_]
        rates = [statistics.median(c.tokens_per_s for c in r) for r in done[name]]
        totals[name] = {"median_tokens_per_s_over_prompts": round(statistics.median(rates), 2),
                        "tokens_per_s_all": round(sum(c.output_tokens for c in cs)
                                                  / sum(c.seconds for c in cs), 2),
                        **_tally([r[0] for r in done[name]])}  # fmt: skip
    for name in ("old", "new"):
        totals[name]["vs_ar"] = round(
            totals[name]["tokens_per_s_all"] / totals["ar"]["tokens_per_s_all"], 3
        )
    report = {
        "benchmark": "benchmarks/drafter_ab.py",
        "date": now(),
        "command": command_line(),
        "machine": record,
        "model": a.model,
        "drafters": {"old": a.old or "the model's own", "new": a.new},
        "draft_vocab": {"old": a.old_vocab, "new": a.new_vocab},
        "draft_wide": {"old": a.old_wide, "new": a.new_wide},
        "settings": {"prompt_set": a.prompt_set, "max_tokens": a.tokens, "reps": a.reps,
                     "default": {k: v for k, v in dataclasses.asdict(default).items()
                                 if v is not None}, "greedy": True, "eos": "respected",
                     "prefix_cache": "off"},
        "answers_differ_from_ar": differ,
        "totals": totals,
        "per_prompt": per_prompt,
    }  # fmt: skip
    label = model_label(a.model)
    out = Path(a.out or f"benchmarks/results/drafter-ab-{label}-{a.prompt_set}.json")
    write_results(report, out)
    for name in names:
        t = totals[name]
        print(f"{name:>4}: {t['tokens_per_s_all']:7.2f} tok/s  TPF {t['tpf']:.2f}  "
              f"per verify pass {t['tokens_per_verify_pass']}  kept {t['kept_fraction']}"
              + (f"  x{t['vs_ar']} ar" if "vs_ar" in t else ""))  # fmt: skip
    print(f"answers differing from ar: {differ or 'none'}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
