"""What tree-shaped drafts would buy: the quality suite's `:fixed` passes replayed with a
drafter's drafts as a chain and as trees of the same and larger sizes.

Usage: python benchmarks/drafter_tree.py --drafter runs/drafter-smol-2h/drafter.safetensors \
           [--limit 64] [--nodes 15,31,63] [--copy-bonus 4,0,2,8] [--dtype int4] \
           [--out benchmarks/results/....json]

Self-speculation with greedy verification is exact, so its passes can be replayed over the
target's own greedy (`ar`) answers: a pass that starts after the answer's first c tokens keeps
the longest drafted path the answer follows, then the target's next token. The chain drafter
is run teacher-forced over each answer (the trainer's `teacher_forced`): at every start c and
depth j it gives the logits of the token c + j - 1 under the answer's own tokens before it,
and the rank of the answer's token there. A tree of drafts is a set of rank paths (Medusa's
"tree choices"): the path (0, 2) drafts the second-best token after the best one. Its branch
that follows the answer's tokens sees exactly the teacher-forced logits, so the answer's rank
path at c tells how far any tree would be kept: the longest prefix of it in the tree. The
chain is the tree {(0,), (0, 0), ...}. Trees of N nodes are built from the rank paths of the
other half of the items (two folds by item parity: no item picks its own tree), most frequent
prefixes first (each prefix's frequency is what its node adds to the expected length).

A chain drafter's drafts lean to context copies in the decoder (`DrafterRunner.COPY_BONUS`
added to the logit of the token that followed the latest earlier occurrence of the last 3, else
2, tokens); the replay adds the same (`--copy-bonus`, the decoder's value by default); more
values compare chains at each and pick one per fold on the other half of the items.

Counted as `clover bench quality` counts: output tokens (EOS excluded) / target passes
(prefill included). A tree of N nodes verifies N + 1 positions a pass (its attention mask
follows the tree); the tokens/s it buys is the pass-cost question (`clover bench passes`). The
decoder verifies trees too (`self_spec:16:drafter:fixed:treeN`), grown by the drafter per depth
rather than built from these frequencies (README "Trees of drafts").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from clover.bench.quality import load_suite
from clover.decoding.drafting import DrafterRunner
from clover.engine import LLM, GenerationSettings
from clover.models.drafter import load_drafter, read_drafter_config
from clover.train.drafter import (
    DrafterTrainConfig,
    copy_lean_rows,
    head_index,
    lean_to_copies,
    loss_head,
    target_features,
    teacher_forced,
)

NEVER = 10**6  # the rank of a token outside the draft vocabulary


def answers(llm: LLM, items: list[dict], max_tokens: int) -> list[dict]:
    """The target's greedy answers, one prompt at a time (as the quality bench's batch-1 runs),
    each with its EOS when it stopped on one."""
    eos = llm.eos_token_ids
    out = []
    for it in items:
        prompt = llm.chat_prompt([{"role": "user", "content": it["prompt"]}])
        done: list = []
        settings = GenerationSettings(decoder="ar", max_tokens=max_tokens)
        for _ in llm.stream([prompt], settings, done, cached=False):
            pass
        ids = list(done[0].token_ids)
        if done[0].finish_reason == "stop" and eos:
            ids.append(eos[0])
        out.append({"id": it["id"], "kind": it["kind"], "prompt_ids": prompt, "answer_ids": ids,
                    "output_tokens": done[0].output_tokens})  # fmt: skip
    return out


def rank_paths(drafter: object, target: torch.nn.Module, head: torch.Tensor,
               rows: torch.Tensor | None, rec: dict, bonuses: tuple[float, ...] = (0.0,),
               chunk: int = 32) -> dict[float, list[tuple]]:  # fmt: skip
    """Per copy bonus, per start c = 1 .. n - 1 of the answer (n tokens, EOS included): the
    ranks of the answer's tokens c .. c + B - 2 among the drafter's logits, teacher-forced,
    cut at the answer's end."""
    B = drafter.config.block_size
    P, n = len(rec["prompt_ids"]), len(rec["answer_ids"])
    feats, lengths, ids = target_features(target, [rec], drafter.config.feature_layers, 10**9)
    index = head_index(rows, drafter.config.vocab_size)
    mask = target.config.mask_token_id  # as the decoding loop: the target's
    if mask is not None and index is not None:
        mask = int(index[mask]) if int(index[mask]) >= 0 else None
    bonuses = tuple(dict.fromkeys(bonuses))
    paths: dict[float, list[tuple[int, ...]]] = {b: [] for b in bonuses}
    for lo in range(1, n, chunk):
        cs = torch.arange(lo, min(n, lo + chunk))
        starts = (P + cs - 1)[None]  # the block's first token: the answer's token c - 1
        with torch.no_grad():
            logp, _, labels = teacher_forced(drafter, target, head, feats, lengths, ids, starts, B)
        logp, labels = logp[0], labels[0]  # [S, B-1, V'], [S, B-1]
        at = labels if index is None else index[labels]
        # the copy each draft leans to, as the decoding loop and the trainer compute it (over
        # prompt + the answer's first c tokens, the drafts before it being the answer's own:
        # the only branch the replay counts)
        lean = copy_lean_rows(ids, lengths, starts, B - 1, index)[0]  # [S, B-1]
        for bonus in bonuses:
            lp = lean_to_copies(logp, lean, bonus) if bonus else logp.clone()
            if mask is not None:  # never drafted (the decoder's drafts skip it too)
                lp[..., mask] = float("-inf")
            mine = lp.gather(-1, at.clamp(min=0)[..., None])
            rank = (lp > mine).sum(-1)
            rank = torch.where(at >= 0, rank, NEVER)
            for s, c in enumerate(cs.tolist()):
                depth = min(B - 1, n - c)  # tokens c .. n - 1 remain
                paths[bonus].append(tuple(rank[s, :depth].tolist()))
    return paths


def kept(path: tuple[int, ...], tree: set[tuple[int, ...]]) -> int:
    m = 0
    while m < len(path) and path[: m + 1] in tree:
        m += 1
    return m


def replay(paths: list[tuple[int, ...]], tree: set[tuple[int, ...]]) -> tuple[int, list[int]]:
    """-> (target passes, drafts kept per verify pass) of one answer (its paths by start)."""
    n = len(paths) + 1
    passes, c, hist = 1, 1, []  # the prefill gives token 0
    while c < n:
        m = kept(paths[c - 1], tree)
        hist.append(m)
        passes += 1
        c += m + 1
    return passes, hist


def build_tree(paths: list[tuple[int, ...]], nodes: int, widest: int = 8,
               leaves: bool = False) -> set:  # fmt: skip
    """The `nodes` most frequent rank prefixes (ranks below `widest`), prefix-closed.
    `leaves`: only the arg-max chain has children (every other draft is a leaf: a chain
    drafter's pass per depth drafts them all, no pass of its own per branch)."""
    freq: Counter = Counter()
    for p in paths:
        for d in range(1, len(p) + 1):
            if p[d - 1] >= widest or (leaves and d > 1 and p[d - 2] != 0):
                break
            freq[p[:d]] += 1
    tree: set = set()
    for prefix, _ in sorted(freq.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0])):
        if len(tree) == nodes:
            break
        if len(prefix) == 1 or prefix[:-1] in tree:
            tree.add(prefix)
    return tree


def chain(length: int) -> set:
    return {(0,) * d for d in range(1, length + 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--dtype", default="int4", help="the target's precision (int4)")
    ap.add_argument("--limit", type=int, default=64, help="suite items (the first of each kind)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--nodes", default="1,2,3,4,7,15,31,63", help="draft sizes to compare")
    ap.add_argument("--copy-bonus", default=f"{DrafterRunner.COPY_BONUS:g}",
                    help="a chain drafter's lean to context copies (the decoder's: "
                    f"{DrafterRunner.COPY_BONUS:g}); the first value's paths make the trees, "
                    "more values add chains of the longest size and a two-fold pick")  # fmt: skip
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    bonuses = tuple(float(x) for x in a.copy_bonus.split(",") if x)
    dc = read_drafter_config(Path(a.drafter))
    llm = LLM(dc.target, dtype=a.dtype, progress=False)
    target = llm.model
    drafter = load_drafter(Path(a.drafter), target).float().eval()
    cfg = DrafterTrainConfig(target=dc.target, data=[], out="", loss_vocab="draft")
    head, rows = loss_head(target, drafter, cfg)
    items = load_suite(limit=a.limit)
    recs = answers(llm, items, a.max_tokens)
    for r in recs:
        r["by_bonus"] = rank_paths(drafter, target, head, rows, r, bonuses)
        r["paths"] = r["by_bonus"][bonuses[0]]
    sizes = [int(x) for x in a.nodes.split(",") if x]
    B1 = drafter.config.block_size - 1
    trees: dict[str, list[set]] = {}
    for N in sizes:  # fold f's tree is built on the items of the other parity
        if N <= B1:
            trees[f"chain {N}"] = [chain(N)] * 2
        for kind, leaves in (("leaves", True), ("tree", False)):
            if N > 1:
                trees[f"{kind} {N}"] = [build_tree([p for i, r in enumerate(recs) if i % 2 != f
                                                    for p in r["paths"]], N, leaves=leaves)
                                        for f in (0, 1)]  # fmt: skip
    result: dict = {"benchmark": "drafter_tree", "command": " ".join(sys.argv),
                    "drafter": a.drafter, "target": dc.target, "dtype": a.dtype,
                    "copy_bonus": bonuses[0], "items": len(recs), "settings": {}}  # fmt: skip
    if len(bonuses) > 1:  # the longest chain at each bonus, and the bonus each fold picks
        longest = chain(min(B1, max(sizes)))
        per = {b: [replay(r["by_bonus"][b], longest)[0] for r in recs] for b in bonuses}
        tokens = [r["output_tokens"] for r in recs]

        def tpf(b: float, f: int | None = None) -> float:
            idx = [i for i in range(len(recs)) if f is None or i % 2 == f]
            return sum(tokens[i] for i in idx) / sum(per[b][i] for i in idx)

        picks = [max(bonuses, key=lambda b: tpf(b, 1 - f)) for f in (0, 1)]
        folded = sum(tokens) / sum(per[picks[i % 2]][i] for i in range(len(recs)))
        result["copy_bonus_chain"] = {
            "tpf": {f"{b:g}": round(tpf(b), 3) for b in bonuses},
            "two_fold": {"picks": picks, "tpf": round(folded, 3)},
        }
        print("copy bonus", json.dumps(result["copy_bonus_chain"]), flush=True)
    # how often the answer's token ranks within the top k at each depth (its prefix right),
    # and how often it is outside the draft vocabulary (never drafted)
    every = [p for r in recs for p in r["paths"]]
    ranks = {}
    for d in range(4):
        at = [p[d] for p in every if len(p) > d]
        ranks[f"depth {d + 1}"] = {f"top {k}": round(sum(x < k for x in at) / len(at), 3)
                                   for k in (1, 2, 4, 8)}  # fmt: skip
        ranks[f"depth {d + 1}"]["outside draft vocabulary"] = round(
            sum(x == NEVER for x in at) / len(at), 3)  # fmt: skip
    result["answer_token_ranks"] = ranks
    print("ranks", json.dumps(ranks), flush=True)
    for name, (t0, t1) in trees.items():
        tot_tokens, tot_passes, hist, by_kind = 0, 0, Counter(), {}
        for i, r in enumerate(recs):
            passes, h = replay(r["paths"], t0 if i % 2 == 0 else t1)
            tot_tokens += r["output_tokens"]
            tot_passes += passes
            hist.update(h)
            k = by_kind.setdefault(r["kind"], [0, 0])
            k[0], k[1] = k[0] + r["output_tokens"], k[1] + passes
        verify, top = sum(hist.values()), max(hist) + 1
        row = {"nodes": len(t0), "positions_per_pass": len(t0) + 1,
               "tpf": round(tot_tokens / tot_passes, 3),
               "tokens_per_verify_pass": round(1 + sum(m * c for m, c in hist.items()) / verify, 3),
               "tpf_by_kind": {k: round(t / p, 2) for k, (t, p) in by_kind.items()},
               "kept_per_pass_histogram": {str(m): hist[m] for m in range(top)}}  # fmt: skip
        if not name.startswith("chain"):
            row["tree_fold0"] = sorted(t0, key=lambda p: (len(p), p))
        result["settings"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "tree_fold0"}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
