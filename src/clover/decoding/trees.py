"""Trees of drafts: one verify pass checks many guesses.

A tree is a list of drafts, each with its parent's index among them (-1: it follows the last
certain token), parents first. A block drafter's tree is its chain and the other guesses
beside it (`leaf_tree`); a chain drafter grows one depth per pass (`DrafterRunner.draft_tree`),
its nodes kept as [token, parent, depth, value, block slot] while it grows. Either way the
drafts worth the most (the drafter's probability of the whole branch) are kept (`likeliest`):
EAGLE-2's dynamic tree (Li et al. 2024). A context match joins a tree as one more branch
(`graft`).
"""

from __future__ import annotations

import torch

PAD = -2  # a place in a tree pass that a row with fewer drafts at that depth leaves empty


def leaf_tree(
    logits: torch.Tensor, chain: list[int], nodes: int, widest: int = 8
) -> tuple[list[int], list[int]]:
    """A tree of `nodes` drafts from a chain drafter's logits [n, V] at its n depths and the
    chain it drafted (each depth's pick, read by the next depth's pass): the chain's nodes and,
    beside them, other guesses at each depth (up to widest - 1, hanging on the chain's node
    before: the drafter gives their logits in the same pass, so they cost no drafter pass, but
    nothing is drafted after them). Every candidate is worth the drafter's probability of the
    branch that ends in it; the `nodes` likeliest are kept (EAGLE-2's rule, Li et al. 2024,
    on a tree whose only deep branch is the chain); a parent is always worth at least its
    children, so the kept set is a tree. -> (tokens, parents: index of each token's parent
    among them, -1 for the root; parents come first)."""
    n = min(len(chain), logits.shape[0])
    if n == 0 or nodes < 1:
        return [], []
    logp = torch.log_softmax(logits[:n].float(), -1)
    top = logp.topk(min(widest, logp.shape[-1]), -1)
    on = logp[torch.arange(n), torch.tensor(chain[:n])]
    upto = torch.cumsum(on, 0).tolist()  # the chain's branch to each depth
    tree: list[list] = []  # as a grown tree's nodes: [token, parent, depth, value, None]
    parent = -1  # the chain's node before this depth
    for d in range(n):
        before = upto[d - 1] if d else 0.0
        tree.append([chain[d], parent, d + 1, upto[d], None])
        others = [(v, t) for v, t in zip(top.values[d].tolist(), top.indices[d].tolist())
                  if t != chain[d] and v > float("-inf")]  # fmt: skip
        for v, t in others[: widest - 1]:
            tree.append([t, parent, d + 1, before + v, None])
        parent = len(tree) - 1 - len(others[: widest - 1])
    return likeliest(tree, nodes, n)


def likeliest(tree: list[list], nodes: int, depth: int) -> tuple[list[int], list[int]]:
    """The `nodes` likeliest drafts of a tree (nodes [token, parent index or -1, depth,
    value, ...], each parent before its children), at most `depth` deep, parents first ->
    (tokens, parents). A node is taken only after its parent (ties: the shallower first)."""
    order = sorted(range(len(tree)), key=lambda i: (-tree[i][3], tree[i][2], i))
    kept: set = set()
    for i in order:
        if len(kept) == nodes:
            break
        if tree[i][2] <= depth and (tree[i][1] < 0 or tree[i][1] in kept):
            kept.add(i)
    ranked = sorted(kept, key=lambda i: (tree[i][2], i))
    where = {i: j for j, i in enumerate(ranked)}
    return [tree[i][0] for i in ranked], [where.get(tree[i][1], -1) for i in ranked]


def graft(tokens: list[int], parents: list[int], chain: list[int]) -> tuple[list[int], list[int]]:
    """A tree of drafts (tokens, parents: parents first, -1 the root) with `chain` (a context
    lookup's draft after the same root) joined as one more branch: it follows the tree's nodes
    while they draft its tokens, then goes on as new nodes, appended (so parents still come
    first). The tree's own nodes keep their places."""
    tokens, parents = list(tokens), list(parents)
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(parents, tokens)):
        children.setdefault((p, t), i)
    node = -1
    for t in chain:
        nxt = children.get((node, t))
        if nxt is None:
            tokens.append(t)
            parents.append(node)
            nxt = children[(node, t)] = len(tokens) - 1
        node = nxt
    return tokens, parents


def floor(tree: list[list], nodes: int, depth: int) -> float:
    """The value a draft needs to be among the `nodes` likeliest of a tree so far (at most
    `depth` deep; -inf while it has fewer): later drafts only add rivals."""
    values = sorted((n[3] for n in tree if n[2] <= depth), reverse=True)
    return values[nodes - 1] if 0 < nodes <= len(values) else float("-inf")


def branch(tree: list[list], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(tree[node][0])
        node = tree[node][1]
    return out[::-1]
