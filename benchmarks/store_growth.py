"""Tokens per pass that lookup + n-gram store drafts would give, by the store's size.

Replays greedy self-speculation over held-out answers of a `clover data distill` set, without
running the model: the answer is what the target wrote, so a draft token is kept exactly when
it equals the next answer token (what verification keeps under greedy decoding). Each pass
drafts from the row's own context (`rows.NgramIndex`) and, where that has no match, from a
store (`store.NgramStore`) of the other answers (prompt + answer), at several store sizes; text
files may be added to the store instead (`--text`, encoded with the model's tokenizer). Draft
lengths are fixed (`--drafts`), not cost-adaptive: this is what a machine with free wide passes
would see, an upper view of the decoder's TPF on such answers.

    python benchmarks/store_growth.py --data runs/distill-coder-v2 \\
        --out benchmarks/results/store-growth-qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import shlex
import sys
import time
import tracemalloc
from pathlib import Path

from clover.bench.common import machine, now, write_results
from clover.decoding.store import NgramIndex, NgramStore


def replay(records: list[dict], store: NgramStore | None, most: int) -> dict:
    """-> tokens per pass (answer tokens / passes) and kept drafts by source."""
    passes = tokens = 0
    kept = {"lookup": 0, "store": 0}
    for r in records:
        seq, p = r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])
        context, i = NgramIndex(seq[:p]), p
        while i < len(seq):
            draft, source = (context.draft(most), "lookup") if i > p else ([], "lookup")
            if not draft and store is not None:
                draft, source = store.draft(context.tokens, most), "store"
            a = 0
            while a < len(draft) and i + a < len(seq) and draft[a] == seq[i + a]:
                a += 1
            kept[source] += a
            context.extend(seq[i : i + a + 1])
            i, passes = i + a + 1, passes + 1
        tokens += len(seq) - p
    return {"tpf": round(tokens / passes, 3), "passes": passes, "kept": kept}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a `clover data distill` directory")
    ap.add_argument("--heldout", type=int, default=80, help="answers replayed (80)")
    ap.add_argument("--sizes", default="0,100,300,1000,all", help="store sizes in answers")
    ap.add_argument("--drafts", default="1,3,8,15", help="fixed draft lengths")
    ap.add_argument("--text", help="also a store of text files (a glob), e.g. Python sources")
    ap.add_argument("--text-tokens", type=int, default=1_000_000)
    ap.add_argument("--model", help="tokenizer for --text (default: the set's teacher)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    data = Path(a.data)
    meta = json.loads((data / "meta.json").read_text())
    records = [json.loads(line) for line in open(data / "distill.jsonl") if line.strip()]
    random.Random(a.seed).shuffle(records)
    held, pool = records[: a.heldout], records[a.heldout :]
    drafts = [int(x) for x in a.drafts.split(",")]
    sizes = [len(pool) if s == "all" else min(int(s), len(pool)) for s in a.sizes.split(",")]
    rows = []
    for n in dict.fromkeys(sizes):
        tracemalloc.start()
        t0 = time.perf_counter()
        store = NgramStore()
        for r in pool[:n]:
            store.add(r["prompt_ids"] + r["answer_ids"])
        seconds, held_bytes = time.perf_counter() - t0, tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        runs = {str(k): replay(held, store if n else None, k) for k in drafts}
        rows.append({"store": f"{n} answers", "store_tokens": store.tokens, "ngrams": len(store),
                     "build_seconds_traced": round(seconds, 2),
                     "python_mb": round(held_bytes / 1e6, 1), "by_draft": runs})  # fmt: skip
        print(n, store.tokens, {k: v["tpf"] for k, v in runs.items()}, file=sys.stderr)
    if a.text:
        from clover.engine import LLM

        tokenizer = LLM(a.model or meta["teacher"], progress=False).tokenizer
        files = sorted(glob.glob(a.text, recursive=True))
        random.Random(a.seed).shuffle(files)
        for label, with_answers in (("text", False), ("text + all answers", True)):
            store = NgramStore(max_tokens=a.text_tokens + (10**7 if with_answers else 0))
            if with_answers:
                for r in pool:
                    store.add(r["prompt_ids"] + r["answer_ids"])
            used = 0
            for f in files:
                if used >= a.text_tokens:
                    break
                try:
                    ids = tokenizer.encode(Path(f).read_text(), split_special_tokens=False)
                except (OSError, UnicodeDecodeError):
                    continue
                store.add(ids[: a.text_tokens - used])
                used += min(len(ids), a.text_tokens - used)
            runs = {str(k): replay(held, store, k) for k in drafts}
            rows.append({"store": f"{label} ({a.text})", "store_tokens": store.tokens,
                         "by_draft": runs})  # fmt: skip
            print(label, store.tokens, {k: v["tpf"] for k, v in runs.items()}, file=sys.stderr)
    write_results(
        {
            "benchmark": "n-gram store growth (replayed greedy self-speculation, no model run)",
            "date": now(),
            "machine": machine(),
            "command": "python benchmarks/store_growth.py " + shlex.join(argv or sys.argv[1:]),
            "data": {"dir": str(data), **meta, "answers": len(records)},
            "heldout_answers": len(held),
            "heldout_kinds": sorted({r["kind"] for r in held}),
            "rows": rows,
            "notes": [
                "python_mb: what the store holds (tracemalloc), build_seconds_traced: its "
                "build time under tracemalloc (slower than without)",
                "tpf: held-out answer tokens / passes; each pass yields its kept drafts plus "
                "one token; drafts from the row's own context first, the store where that "
                "has no match; fixed draft lengths (no cost model)",
            ],
        },
        a.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
