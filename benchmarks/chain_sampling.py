"""A chain drafter at temperature > 0: what conditioning each draft on the one drawn before it
buys over conditioning it on the greedy drafts.

A chain drafter drafts token by token, each position reading the token drafted before it.
A sampling row draws its drafts, so its later positions can read either what it drew (what
the decoder does since the drafts take a `pick`) or the greedy chain's tokens (what it did
before: the distributions were fixed before the draws). Both are lossless (every draft is
verified by speculative sampling); only the drafts kept per verify pass differ. This runs the
quality suite's prompts (chat template, `--limit` items) with `self_spec:B:drafter:fixed`
(B - 1 drafts every pass) at each temperature, both ways side by side in one process, the
same seed per item, and reports tokens per target pass and drafts kept.

    python benchmarks/chain_sampling.py --model smollm2-135m --dtype int4 \\
        --drafter runs/drafter-smol-chain2/drafter.safetensors

Writes benchmarks/results/chain_sampling-<model>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from clover.bench.common import command_line, machine, model_label, now, write_results
from clover.decoding.drafting import DrafterRunner, Pick
from clover.decoding.loop import generate
from clover.decoding.policies import SelfSpec
from clover.decoding.sampling import SamplingParams
from clover.engine import LLM
from clover.errors import CloverError

SUITE = Path("benchmarks/suites/quality.jsonl")


@contextlib.contextmanager
def greedy_fed() -> Iterator[None]:
    """The earlier chain: each row's draw still goes through the decoder's pick (so the
    drafts keep their distributions), but the next position reads the arg-max."""
    draft = DrafterRunner.draft

    def fed(
        self: DrafterRunner, first: torch.Tensor, width: int, pick: Pick | None = None
    ) -> torch.Tensor:
        def greedy(i: int, logits: torch.Tensor) -> torch.Tensor:
            if pick is not None:
                pick(i, logits)
            return logits.argmax(-1)

        return draft(self, first, width, greedy)

    DrafterRunner.draft = fed
    try:
        yield
    finally:
        DrafterRunner.draft = draft


def run(llm: LLM, prompts: list[list[int]], block: int, temperature: float, max_tokens: int,
        batch: int) -> dict:  # fmt: skip
    policy = SelfSpec(block_size=block, draft="drafter", adaptive=False)
    tokens = passes = drafted = kept = 0
    for i in range(0, len(prompts), batch):
        rows: list = []
        sampling = SamplingParams(temperature=temperature, seed=1000 + i)
        eos = llm.eos_token_ids
        loop = generate(llm.model, prompts[i : i + batch], policy, max_new_tokens=max_tokens,
                        sampling=sampling, eos_token_ids=eos, results=rows)  # fmt: skip
        for _ in loop:
            pass
        for r in rows:
            tokens += len(r.tokens)
            passes += r.nfe
            d = r.drafts.get("drafter", [0, 0])
            drafted, kept = drafted + d[0], kept + d[1]
    return {
        "tokens": tokens,
        "target_passes": passes,
        "tokens_per_pass": round(tokens / max(passes, 1), 3),
        "drafted": drafted,
        "kept": kept,
        "kept_fraction": round(kept / max(drafted, 1), 4),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="int4")
    p.add_argument("--drafter", required=True, help="a chain drafter file (clover train drafter)")
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, drafter=a.drafter, progress=False)
    if not llm.model.drafter.config.chain:
        raise CloverError(f"{a.drafter} is a block drafter: its positions read no drafts")
    suite = [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()]
    prompts = [llm.chat_prompt([{"role": "user", "content": it["prompt"]}])
               for it in suite[: a.limit]]  # fmt: skip
    rows = []
    for t in (float(x) for x in a.temperatures.split(",")):
        with greedy_fed():
            before = run(llm, prompts, a.block_size, t, a.max_tokens, a.batch_size)
        after = run(llm, prompts, a.block_size, t, a.max_tokens, a.batch_size)
        rows.append({"temperature": t, "greedy_fed": before, "sample_fed": after})
        print(f"T={t}: tokens per target pass {before['tokens_per_pass']} (greedy-fed) -> "
              f"{after['tokens_per_pass']} (sample-fed); drafts kept {before['kept_fraction']} "
              f"-> {after['kept_fraction']}", flush=True)  # fmt: skip
    report = {
        "benchmark": "chain_sampling",
        "date": now(),
        "command": command_line(),
        "machine": machine(),
        "model": a.model,
        "dtype": llm.dtype,
        "drafter": a.drafter,
        "suite": str(SUITE),
        "items": len(prompts),
        "block_size": a.block_size,
        "max_tokens": a.max_tokens,
        "method": "self_spec:B:drafter:fixed at each temperature, the same seeds; greedy_fed: "
        "each chain position reads the arg-max of the one before (the drafts still drawn from "
        "their distributions); sample_fed: it reads the drawn draft",
        "results": rows,
    }
    out = write_results(report, f"{a.out}/chain_sampling-{model_label(a.model)}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
