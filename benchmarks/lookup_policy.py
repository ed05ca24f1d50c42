"""Which context-lookup drafts pay on this machine: the draft length and n-gram rule of the
default decoder (`self_spec`, drafts from `NgramIndex`), chosen by measurement.

`self_spec` with lookup drafts is lossless, so its answer is the AR answer and only its
passes depend on the policy. That makes the policy exactly simulable: given an AR answer,
each pass verifies the draft the index proposes, keeps its matching prefix plus one AR token.
This measures, in one process,

1. what a causal verify pass of w tokens costs (`clover.bench.passes.pass_costs`, the harness
   of `clover bench passes`: the last certain token + w - 1 drafted ones, LM head over all w,
   median of `--reps`, the cache rolled back), and
2. the greedy AR answers of the quality suite (natural ends, `--max-tokens`),

then replays every policy (longest draft k, n-gram sizes, fixed or adaptive length) over the
answers with the shipped `NgramIndex` and prices each pass with (1): speedup over `ar` per
kind of item, passes, and tokens per pass.

    python benchmarks/lookup_policy.py --model clover-smol-135m

Writes benchmarks/results/lookup_policy-<model>.json. The model of time is the measured pass
cost alone (sampling and bookkeeping are the same per pass for every policy).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from clover.bench.common import command_line, machine, model_label, now, write_results
from clover.bench.passes import pass_costs
from clover.decoding.loop import generate
from clover.decoding.policies import make_policy
from clover.decoding.rows import NgramIndex
from clover.engine import LLM

SUITE = Path("benchmarks/suites/quality.jsonl")
NGRAM_SIZES = ((3, 2), (4, 3, 2), (3,), (2,), (3, 2, 1))
LONGEST = (1, 2, 3, 4, 5, 7)


def ar_answers(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int) -> list:
    """Greedy AR answers, each with the EOS that ended it (a pass makes it, and a lookup
    draft can propose it: the chat template's end of turn is in every prompt)."""
    answers: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        rows: list = []
        chunk = prompts[i : i + batch]
        for _ in generate(llm.model, chunk, make_policy("ar"), max_new_tokens=max_tokens,
                          eos_token_ids=llm.eos_token_ids, results=rows):  # fmt: skip
            pass
        for prompt, r in zip(chunk, rows):
            ends = [e for e in llm.eos_token_ids if e in prompt] or llm.eos_token_ids
            answers.append(r.tokens + ([ends[0]] if r.finish_reason == "stop" else []))
        print(f"  AR answers {len(answers)}/{len(prompts)}", flush=True)
    return answers


Adapt = Callable[[int, int, int, int], int]


def adaptive(k: int, kept: int, drafted: int, longest: int) -> int:
    """Next draft length: double after a draft kept whole, else what was kept + 1."""
    return min(longest, 2 * k) if kept == drafted else max(1, kept + 1)


def replay(
    prompt: list[int], answer: list[int], budget: int, longest: int, sizes: tuple,
    adapt: Adapt | None, cost: Callable[[int], float],
) -> tuple[float, int]:  # fmt: skip
    """answer: the AR answer with the EOS that ended it, if one did; budget: max new tokens.
    -> (ms, passes) of self_spec with lookup drafts on it, the prefill pass counted."""
    index = NgramIndex(list(prompt))
    index.SIZES = sizes  # instance attribute: the class's stays as shipped
    pos, ms, passes, k = 0, 0.0, 0, longest
    while pos < len(answer):
        room = budget - pos - 1  # a pass also yields one AR token
        draft = index.draft(min(k, room))
        kept = 0
        while kept < len(draft) and pos + kept < len(answer) and draft[kept] == answer[pos + kept]:
            kept += 1
        ms += cost(1 + len(draft))
        passes += 1
        index.extend(answer[pos : pos + kept + 1])
        pos += kept + 1
        if adapt is not None and draft:
            k = adapt(k, kept, len(draft), longest)
    return ms, passes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="clover-smol-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, progress=False)
    suite = [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()]
    prompts = [llm.chat_prompt([{"role": "user", "content": it["prompt"]}]) for it in suite]
    kinds = [it["kind"] for it in suite]
    longest_prompt = max(prompts, key=len)
    widths = range(1, max(LONGEST) + 2)
    timed = pass_costs(llm.model, list(widths), 1, len(longest_prompt), a.reps)
    costs = {w: t["ms"] for w, t in timed.items()}
    cost = costs.__getitem__
    print("verify pass ms by width: " + ", ".join(f"{w}: {c:.2f}" for w, c in costs.items()))
    answers = ar_answers(llm, prompts, a.max_tokens, a.batch_size)
    tokens = sum(map(len, answers))
    kind_tokens: dict[str, int] = {}
    for answer, kind in zip(answers, kinds):
        kind_tokens[kind] = kind_tokens.get(kind, 0) + len(answer)
    ar_ms = {k: costs[1] * n for k, n in kind_tokens.items()}  # AR: one width-1 pass a token
    # the replay is the decoder: on answers it reproduces, its pass count must be the real NFE
    check = {"items": 0, "same_answer": 0, "same_passes": 0}
    spec = make_policy("self_spec", block_size=4, draft="lookup")
    for prompt, answer in list(zip(prompts, answers))[:: max(1, len(prompts) // 24)]:
        rows: list = []
        for _ in generate(llm.model, [prompt], spec, max_new_tokens=a.max_tokens,
                          eos_token_ids=llm.eos_token_ids, results=rows):  # fmt: skip
            pass
        check["items"] += 1
        ended = [answer[-1]] if rows[0].finish_reason == "stop" else []
        if rows[0].tokens + ended == answer:
            check["same_answer"] += 1
            passes = replay(prompt, answer, a.max_tokens, 3, NgramIndex.SIZES, None, cost)[1]
            check["same_passes"] += passes == rows[0].nfe
    print(f"replay check: {check}")
    policies = []
    for sizes in NGRAM_SIZES:
        for longest in LONGEST:
            for adapt in (None, adaptive):
                if adapt is not None and longest < 3:
                    continue
                ms: dict[str, float] = {}
                passes = 0
                for prompt, answer, kind in zip(prompts, answers, kinds):
                    t, n = replay(prompt, answer, a.max_tokens, longest, sizes, adapt, cost)
                    ms[kind] = ms.get(kind, 0.0) + t
                    passes += n
                policies.append({
                    "ngram_sizes": list(sizes),
                    "longest_draft": longest,
                    "length": "adaptive" if adapt else "fixed",
                    "speedup_vs_ar": round(sum(ar_ms.values()) / sum(ms.values()), 3),
                    "per_kind": {k: round(ar_ms[k] / ms[k], 3) for k in ms},
                    "passes": passes,
                    "tokens_per_pass": round(tokens / passes, 3),
                })  # fmt: skip
    policies.sort(key=lambda r: -r["speedup_vs_ar"])
    shipped = next(r for r in policies if r["ngram_sizes"] == list(NgramIndex.SIZES)
                   and r["longest_draft"] == 3 and r["length"] == "fixed")  # fmt: skip
    print(f"{'n-grams':<10} {'k':>2} {'length':<9} {'x ar':>6} {'TPF':>6}  per kind")
    for r in policies[:12] + ([shipped] if shipped not in policies[:12] else []):
        mark = "  <- shipped (self_spec:4:lookup)" if r is shipped else ""
        print(f"{','.join(map(str, r['ngram_sizes'])):<10} {r['longest_draft']:>2} "
              f"{r['length']:<9} {r['speedup_vs_ar']:>6.3f} {r['tokens_per_pass']:>6.3f}  "
              f"{r['per_kind']}{mark}")  # fmt: skip
    report = {
        "benchmark": "lookup_policy",
        "date": now(),
        "command": command_line(),
        "machine": machine(),
        "model": a.model,
        "dtype": llm.dtype,
        "suite": str(SUITE),
        "items": len(suite),
        "answer_tokens": tokens,
        "max_tokens": a.max_tokens,
        "verify_pass_ms": {str(w): round(c, 2) for w, c in costs.items()},
        "method": "AR greedy answers of the suite replayed under each lookup policy (lossless: "
        "same answer); each pass priced by the measured median cost of a causal pass of its "
        "width (1 + drafted tokens); speedup = AR's cost (width-1 passes) / the policy's",
        "replay_check": check,
        "shipped": shipped,
        "policies": policies,
    }
    out = write_results(report, f"{a.out}/lookup_policy-{model_label(a.model)}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
