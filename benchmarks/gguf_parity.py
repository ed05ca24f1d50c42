"""Clover's GGUF loading vs transformers' own GGUF loader: logits in float32, same file.

Usage: python benchmarks/gguf_parity.py --model qwen2.5-coder-0.5b [--items 3] [--int4]
Each side dequantizes the GGUF itself (ours: `clover.checkpoints.ggml`; transformers: the
gguf package) and runs one causal forward over the chat-templated prompt of the first
--items code items of the quality suite (plus a 64-token greedy answer of ours, so answer
positions are compared too). Reported per item: argmax agreement over all positions, the
max |logit difference|, and the same for the last position. --int4 adds our int4 model
(the file's 4-bit levels, wider types on int8) against the same float32 reference: how far
the default precision is from the file's floats. One model is in memory at a time (a 1.5B
model is ~7 GB in float32). Writes benchmarks/results/gguf-parity-<model>.json.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch

from clover.bench.common import machine, now, write_results
from clover.data.suite import load_suite
from clover.decoding.loop import generate
from clover.decoding.policies import make_policy
from clover.engine import LLM


def logits_of(model: object, ids: list[int]) -> torch.Tensor:
    """-> float32 logits [T, V] of one causal pass."""
    with torch.no_grad():
        if hasattr(model, "backbone"):  # ours
            return model.logits(model(torch.tensor([ids])))[0].float()
        return model(torch.tensor([ids])).logits[0].float()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    top_a, top_b = a.argmax(-1), b.argmax(-1)
    return {
        "positions": a.shape[0],
        "argmax_equal": int((top_a == top_b).sum()),
        "max_abs_diff": float((a - b).abs().max()),
        "last_argmax_equal": bool(top_a[-1] == top_b[-1]),
        "last_max_abs_diff": float((a[-1] - b[-1]).abs().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--items", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--int4", action="store_true", help="also compare our int4 model")
    args = ap.parse_args()
    machine_record = machine()
    torch.manual_seed(0)

    llm = LLM(args.model, dtype="float32", progress=True)
    items = [i for i in load_suite() if i["kind"] == "code"][: args.items]
    sequences, ours = [], []
    for item in items:
        prompt = llm.chat_prompt([{"role": "user", "content": item["prompt"]}])
        results: list = []
        policy = make_policy("ar")
        for _ in generate(llm.model, [prompt], policy, max_new_tokens=args.answer_tokens,
                          eos_token_ids=llm.eos_token_ids, results=results):  # fmt: skip
            pass
        ids = prompt + results[0].tokens
        sequences.append(ids)
        ours.append(logits_of(llm.model, ids))
    gguf_path = llm.resolved.path
    del llm
    gc.collect()

    rows = [{"id": item["id"], "tokens": len(ids)} for item, ids in zip(items, sequences)]
    if args.int4:
        q = LLM(args.model, dtype="int4", progress=False)
        for row, ids, ref in zip(rows, sequences, ours):
            row["int4_vs_float32"] = compare(logits_of(q.model, ids), ref)
        del q
        gc.collect()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    for row, ids, ref in zip(rows, sequences, ours):
        row["float32_vs_transformers"] = compare(ref, logits_of(hf, ids))
        print(row)
    import transformers

    out = {
        "model": args.model,
        "gguf": str(gguf_path),
        "settings": vars(args),
        "machine": machine_record,
        "transformers": transformers.__version__,
        "date": now(),
        "items": rows,
        "all_argmax_equal": all(
            r["float32_vs_transformers"]["argmax_equal"] == r["tokens"] for r in rows
        ),
        "max_abs_diff": max(r["float32_vs_transformers"]["max_abs_diff"] for r in rows),
    }
    path = Path(__file__).parent / "results" / f"gguf-parity-{args.model}.json"
    write_results(out, path)
    print(
        f"argmax equal everywhere: {out['all_argmax_equal']}; max |diff| {out['max_abs_diff']:.2e}"
    )
    print(path)


if __name__ == "__main__":
    main()
