"""The layout of one forward pass: which tokens commit, which form the block, who sees whom.

Cached modes (`cached_layout`): per row, n_commit tokens committed causally onto the prefix,
then n_block tokens of the current block (bidirectional among themselves, reading the prefix),
then padding. Training (`training_layout`): a whole sequence [clean prompt + answer | noisy copy
of the answer] with no cache, where the clean part is causal and each noisy block sees the
clean tokens before it and itself bidirectionally. A noisy block in training sees exactly what
the same block sees at inference when its prefix was committed causally, so the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepLayout:
    """What one forward pass does, per row.

    input_ids: [B, T]; row b holds n_commit[b] committed tokens, then n_block[b] block tokens,
    then padding. lengths[b] is the committed prefix length before this pass.
    """

    n_commit: torch.Tensor  # [B] long
    n_block: torch.Tensor  # [B] long
    lengths: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B, T] long, absolute positions (RoPE)
    mask: torch.Tensor | None  # [B, 1, T, S] bool, True = may attend; None = all visible
    # training layout only: (prompt_lens [B], clean_len, answer_len, block_size), for layers
    # (recurrent ones) that need the block structure rather than a mask
    train: tuple | None = None
    span: tuple[int, int] | None = None  # (min, max) of lengths, once per pass, not per layer
    # a tree of drafts in this pass (`tree_parts`): each token's parent in the pass, [B, T]
    # long; None: committed tokens are a causal chain. `sees` [B, T, W >= T] bool: which keys
    # of a window ending with the pass each token sees (a target's tree: W = T, itself and its
    # ancestors; a drafter's tree pass: its block slots too); the fused kernels take it
    tree: torch.Tensor | None = None
    sees: torch.Tensor | None = None
    # layers whose outputs the caller wants (a drafter's features); backbones `keep` them
    capture: tuple[int, ...] = ()
    captured: list = field(default_factory=list)

    def keep(self, layer: int, x: torch.Tensor) -> None:
        """Backbones call this with each layer's output x [B, T, D] (a float32 copy is kept
        for the layers in `capture`)."""
        if layer in self.capture:
            self.captured.append(x.float().clone())

    def length_range(self) -> tuple[int, int]:
        if self.span is None:
            self.span = (int(self.lengths.min()), int(self.lengths.max()))
        return self.span

    def counts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lengths, n_commit, n_block), each long [B]."""
        return self.lengths, self.n_commit, self.n_block

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]

    def block_tokens(self) -> torch.Tensor:
        """bool [B, T]: tokens of a block being denoised (what a draft adapter acts on)."""
        T = self.num_tokens
        t = torch.arange(T, device=self.positions.device)[None, :]
        if self.train is not None:  # [clean | noisy]: the noisy copy
            return (t >= self.train[1]).expand(self.positions.shape[0], T)
        nc, nb = self.n_commit[:, None], self.n_block[:, None]
        return (t >= nc) & (t < nc + nb)


def tree_parts(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, T] long (token t's parent in the pass, < t; -1: it hangs on the prefix)
    -> (depth [B, T] long, sees [B, T, T] bool: token u is t itself or one of its ancestors).
    A causal chain is parents t - 1: depth t, sees u <= t."""
    B, T = parents.shape
    rows = torch.arange(B, device=parents.device)
    depth = torch.zeros(B, T, dtype=torch.long, device=parents.device)
    sees = torch.zeros(B, T, T, dtype=torch.bool, device=parents.device)
    for t in range(T):  # parents come first: each token's row copies its parent's
        p = parents[:, t]
        up = p >= 0
        if bool((p >= t).any()):
            raise ValueError("a token's parent must come before it in the pass")
        sees[:, t] = torch.where(up[:, None], sees[rows, p.clamp(min=0)], False)
        sees[:, t, t] = True
        depth[:, t] = torch.where(up, depth[rows, p.clamp(min=0)] + 1, 0)
    return depth, sees


def cached_layout(
    n_commit: torch.Tensor,
    n_block: torch.Tensor,
    lengths: torch.Tensor,
    num_tokens: int,
    tree: torch.Tensor | None = None,
) -> StepLayout:
    """Layout for a forward over a KV prefix; keys are cache slots [0, max(lengths) + T).
    `tree` [B, T] (parents, `tree_parts`): the committed tokens of a row form a tree (drafts
    verified in one pass, each branch seeing the prefix and its own ancestors, at the position
    of its depth) instead of a chain; block tokens keep their rule. Every token still writes
    its K/V at slot lengths + t: the loop moves the branch it keeps together after the pass
    (`ModelCache.compact`)."""
    device = lengths.device
    T = num_tokens
    t = torch.arange(T, device=device)
    positions = lengths[:, None] + t[None, :]  # [B, T]
    sees = None
    if tree is not None:
        depth, sees = tree_parts(tree)
        positions = lengths[:, None] + depth
    span = (int(lengths.min()), int(lengths.max()))
    if T == 1 and span[0] == span[1]:
        # one token per row at a shared length (AR steps): every key slot is visible
        return StepLayout(n_commit, n_block, lengths, positions, None, span=span)
    S = span[1] + T
    rel = torch.arange(S, device=device)[None, None, :] - lengths[:, None, None]  # [B, 1, S]
    qi = t[None, :, None]  # [1, T, 1]
    nc = n_commit[:, None, None]
    nb = n_block[:, None, None]
    is_block_query = (qi >= nc) & (qi < nc + nb)  # [B, T, 1]
    # Committed queries (and padding) are causal; block queries see the whole block.
    committed = rel <= qi
    if sees is not None:  # the prefix, then the query's own branch of the tree
        inside = torch.zeros(sees.shape[0], T, S, dtype=torch.bool, device=device)
        slots = (lengths[:, None] + t[None, :])[:, None, :].expand(-1, T, -1)  # [B, T, T]
        inside.scatter_(2, slots, sees)
        committed = (rel < 0) | inside
    mask = torch.where(is_block_query, rel < nc + nb, committed)  # [B, T, S]
    return StepLayout(n_commit, n_block, lengths, positions, mask[:, None], span=span, tree=tree,
                      sees=sees)  # fmt: skip


def training_layout(
    prompt_lens: torch.Tensor,
    clean_len: int,
    answer_len: int,
    block_size: int,
    answer_lens: torch.Tensor | None = None,
) -> StepLayout:
    """Layout for [clean (prompt + answer, padded to clean_len) | noisy answer (answer_len)].

    prompt_lens: [B]. Row b's answer starts at position prompt_lens[b]; answer index i belongs to
    block i // block_size (blocks start where the answer starts, as in decoding). Clean token t
    sees clean tokens <= t. Noisy token i sees clean tokens before its block and the noisy tokens
    of its own block. Positions of noisy tokens equal those of their clean twins.
    answer_lens [B] (optional): noisy tokens past a row's answer are padding, seen by nobody
    (a short last block then looks exactly like the short last block of decoding).
    Returns a layout over T = clean_len + answer_len tokens with a [B, 1, T, T] mask.
    """
    B = prompt_lens.shape[0]
    device = prompt_lens.device
    T = clean_len + answer_len
    idx = torch.arange(T, device=device)
    is_noisy = idx >= clean_len  # [T]
    answer_idx = (idx - clean_len).clamp(min=0)  # [T], meaningful for noisy tokens
    p = prompt_lens[:, None]  # [B, 1]
    positions = torch.where(is_noisy, p + answer_idx, idx.expand(B, T))  # [B, T]
    block_start = p + (answer_idx // block_size) * block_size  # [B, T] in clean positions
    q_noisy = is_noisy[None, :, None]
    k_noisy = is_noisy[None, None, :]
    # clean query: causal over clean keys
    clean_q = ~k_noisy & (idx[None, None, :] <= idx[None, :, None])
    # noisy query: clean keys before its block start, noisy keys of the same block
    same_block = (answer_idx[:, None] // block_size) == (answer_idx[None, :] // block_size)
    noisy_keys = same_block[None].expand(B, T, T)
    if answer_lens is not None:
        noisy_keys = noisy_keys & (answer_idx[None, None, :] < answer_lens[:, None, None])
    noisy_q = torch.where(k_noisy, noisy_keys, idx[None, None, :] < block_start[:, :, None])
    mask = torch.where(q_noisy, noisy_q, clean_q.expand(B, T, T))
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    structure = (prompt_lens, clean_len, answer_len, block_size)
    return StepLayout(zeros, zeros, zeros, positions, mask[:, None], structure)


def noisy_layout(
    prompt_lens: torch.Tensor,
    clean_len: int,
    answer_len: int,
    block_size: int,
    answer_lens: torch.Tensor | None = None,
    copies: int = 1,
) -> StepLayout:
    """Layout for the noisy answer copies alone, over a cache that holds the clean sequence.

    The split form of `training_layout`: the clean [prompt + answer] (padded to clean_len) was
    run causally into a cache first; this pass feeds `copies` noisy copies of the answer
    ([B, copies * answer_len] tokens), each noisy token seeing the clean keys before its block
    and the tokens of its own block in its own copy. Keys are cache slots [0, clean_len + T).
    Every token is a block token (n_block = T), so nothing is committed to the cache.
    """
    B = prompt_lens.shape[0]
    device = prompt_lens.device
    T = copies * answer_len
    i = torch.arange(T, device=device)
    a, c = i % answer_len, i // answer_len  # answer index and copy of each noisy token
    p = prompt_lens[:, None]
    positions = p + a[None, :]  # [B, T]
    block_start = p + (a // block_size * block_size)[None, :]  # [B, T]
    S = clean_len + T
    key = torch.arange(S, device=device)
    clean_keys = key[None, None, :] < block_start[:, :, None]  # [B, T, S]
    kn = (key - clean_len).clamp(min=0)
    ka, kc = kn % answer_len, kn // answer_len
    same = (ka[None, :] // block_size == a[:, None] // block_size) & (kc[None, :] == c[:, None])
    noisy_keys = same[None] & (key >= clean_len)[None, None, :]  # [1, T, S]
    if answer_lens is not None:
        noisy_keys = noisy_keys & (ka[None, None, :] < answer_lens[:, None, None])
    mask = torch.where(key[None, None, :] >= clean_len, noisy_keys, clean_keys)
    lengths = torch.full((B,), clean_len, dtype=torch.long, device=device)
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    return StepLayout(zeros, torch.full_like(zeros, T), lengths, positions, mask[:, None])
