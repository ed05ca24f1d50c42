"""The drafter's side of a running batch (`self_spec` with `draft="drafter"`): its context
cache rows follow the batch's rows, it takes the target's features of what each pass
committed, and it drafts the next block for every row that asked.

Per step, after the target's verify pass (which computed the features anyway: the drafter
costs no extra target pass): `commit` appends the features of each row's tokens that stayed
committed (certain tokens + accepted drafts) to the rows that draft next (the others keep them
until they do), then `draft` runs one drafter pass over a block
[the new certain token, MASK x (w - 1)] (a chain drafter: one pass per drafted token) for the
rows that want a draft and returns each row's draft logits (from the LM head's rows of the
drafter's draft vocabulary only, if it has one: the rest are -inf). A row whose prompt prefix
came from the prefix cache has no features for that prefix: its drafter context starts after
it. Positions need no offset for that (RoPE attention sees only distances, the same either
way); it costs draft quality, never exactness (every draft is verified).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from clover.decoding.costs import batch_length
from clover.decoding.sampling import draw_drafts, greedy_ids
from clover.decoding.trees import PAD, branch, floor, leaf_tree, likeliest
from clover.models.cache import ModelCache
from clover.models.drafter import Drafter
from clover.models.layout import StepLayout
from clover.quant import head_rows, release_freed_memory

Pick = Callable[[int, torch.Tensor], torch.Tensor]  # (position, logits [B, V]) -> ids [B]


class DrafterRunner:
    BACKLOG = 256  # tokens whose features may wait for a row's next draft
    # a chain drafter's logit at each position gains this much on the token that followed the
    # latest earlier occurrence of the row's last 3 (else 2) tokens, drafts included
    # (`NgramIndex.follower`): small drafters copy names and numbers from the prompt poorly
    # ("The capital of" -> " Morocco" for France), and the context holds them (docs/drafter.md).
    # 0 turns it off. Drafts stay drafts: verification is exact.
    COPY_BONUS = 4.0

    def __init__(
        self, model: torch.nn.Module, drafter: Drafter, vocab_head: tuple | None = None
    ) -> None:
        """vocab_head: `vocab_head(model, drafter)` made before (`Runtime` keeps one), else
        made here."""
        self.model, self.drafter = model, drafter
        self.layers = tuple(drafter.config.feature_layers)
        self.cache = None
        # features not yet committed, kept for the batch as a whole: one entry a pass
        # (features [B, m, F], each row's count, the rows' ids then), so a pass whose rows do
        # not draft costs one copy, not one per row; rows joining or leaving do not touch it
        self.shelf: list[tuple[torch.Tensor, list[int], tuple[int, ...]]] = []
        self.shelf_start = 0  # the pass number of shelf[0]
        self.ids: tuple[int, ...] = ()  # each row's id, kept while it runs
        self.since: list[int] = []  # per row: the first pass its waiting features came from
        self.waiting: list[int] = []  # per row: how many tokens' features wait
        self._next_id = 0
        self.head, self.vocab = None, None  # the LM head's rows of the draft vocabulary
        if drafter.vocab is not None:
            self.head, self.vocab = vocab_head or self.vocab_head(model, drafter)
            # each token's column among the draft vocabulary's (-1: not in it)
            self.column = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long)
            self.column[self.vocab.cpu()] = torch.arange(len(self.vocab))

    @staticmethod
    def vocab_head(model: torch.nn.Module, drafter: Drafter) -> tuple:
        """(the LM head's rows of the drafter's vocabulary, those ids). It reads most of the
        head's tiles: `Runtime` makes it once per model."""
        vocab = drafter.vocab.to(model.device)
        head = head_rows(model, vocab)
        release_freed_memory()  # the rows' levels, unpacked on the way
        return head, vocab

    # the drafter reads the features of a row's prefill (`Prefill.start`)
    reads_prefill = True

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    # whether a chain stops itself where its drafts become unlikely (`ModelDraftRunner`)
    stops_chains = False

    @property
    def grows_trees(self) -> bool:
        """Whether the drafter grows trees itself, one pass per depth (a chain drafter), or
        makes them from one chain's logits (`leaf_tree`)."""
        return self.drafter.config.chain

    def make_cache(self) -> ModelCache:
        """An empty 1-row drafter cache."""
        return self.drafter.make_cache(1)

    def fill_context(self, tokens: int) -> None:
        """Give every row a context of `tokens` arbitrary positions (timing passes)."""
        width = len(self.layers) * self.model.config.hidden_size
        rows = self.cache.batch_size
        self.commit(torch.randn(rows, tokens, width), torch.full((rows,), tokens))

    def add_row(self, cache: ModelCache = None) -> None:
        """A row joins the batch with its 1-row drafter cache (its prefill's context), or an
        empty one."""
        cache = cache if cache is not None else self.make_cache()
        self.cache = cache if self.cache is None else self.cache.extend(cache)
        self._row_added(cache)

    def select(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (their indices, in their new order)."""
        if not keep:
            self.cache = None
        else:
            self.cache.select(keep)
        self._rows_kept(keep)

    def _row_added(self, cache: ModelCache) -> None:
        """The runner's own state of a row that joined with `cache`."""
        self.ids += (self._next_id,)
        self._next_id += 1
        self.since.append(self.shelf_start + len(self.shelf))
        self.waiting.append(0)

    def _rows_kept(self, keep: list[int]) -> None:
        self.ids = tuple(self.ids[k] for k in keep)
        self.since = [self.since[k] for k in keep]
        self.waiting = [self.waiting[k] for k in keep]
        self._trim_shelf()

    def waiting_features(self, b: int) -> list[torch.Tensor]:
        """Row b's features that wait for the drafter's context, in order."""
        if not self.waiting[b]:
            return []
        row, parts = self.ids[b], []
        for features, counts, ids in self.shelf[max(self.since[b] - self.shelf_start, 0) :]:
            if row in ids:
                i = ids.index(row)
                if counts[i]:
                    parts.append(features[i, : counts[i]])
        return parts

    def _trim_shelf(self) -> None:
        """Drop the entries no running row still waits on."""
        end = self.shelf_start + len(self.shelf)
        first = min((s for s, n in zip(self.since, self.waiting) if n), default=end)
        if first > self.shelf_start:
            del self.shelf[: first - self.shelf_start]
            self.shelf_start = first

    def commit(self, features: torch.Tensor, counts: torch.Tensor | list[int],
               now: list[bool] | None = None) -> None:  # fmt: skip
        """features [B, T, k * D] of a pass over every row; counts [B] (a tensor or a list):
        how many of each row's first tokens stay committed (0 for rows that committed
        nothing). `now`: the rows that draft next (None: all). The others' features wait on
        the shelf until they draft, or until BACKLOG tokens of theirs wait: a batch whose rows
        do not draft (adaptive rows of a batch draft only where batched passes pay) skips the
        drafter's context pass."""
        if self.cache is None:
            return
        per_row = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        most = max(per_row, default=0)
        if most:
            # the pass's features as they are when every position stays (the pass made them
            # for this), else one copy of the part that does: a view would keep all alive
            kept = features if most == features.shape[1] else features[:, :most].clone()
            self.shelf.append((kept, per_row, self.ids))
            self.waiting = [w + c for w, c in zip(self.waiting, per_row)]
        sizes = list(self.waiting)
        due = [n > 0 and (now is None or now[b] or n >= self.BACKLOG) for b, n in enumerate(sizes)]
        if not any(due):
            return
        n = torch.tensor([s if d else 0 for s, d in zip(sizes, due)])
        feats = features.new_zeros(len(sizes), int(n.max()), features.shape[-1])
        end = self.shelf_start + len(self.shelf)
        for b, d in enumerate(due):
            if d:
                feats[b, : sizes[b]] = torch.cat(self.waiting_features(b))
                self.since[b], self.waiting[b] = end, 0
        self._trim_shelf()
        with torch.inference_mode():
            self.drafter.commit(feats, n, self.cache)

    def draft(self, first: torch.Tensor, width: int, pick: Pick | None = None) -> torch.Tensor:
        """first [B] (each row's new certain token) -> draft logits [B, width - 1, V]: for
        positions 1 .. width - 1 after it (rows that want no draft ignore theirs). A chain
        drafter takes width - 1 passes, each reading the token drafted at the position before:
        `pick(i, logits [B, V])` -> ids [B] chooses the draft at position i + 1 from its
        logits (default: the arg-max; a sampling row draws it, so the next position's
        distribution is conditioned on the draft it will be verified with). A block drafter
        ignores `pick`: its positions do not read each other."""
        embed = self.model.embed_rows
        with torch.inference_mode():
            if not self.drafter.config.chain:
                h = self.drafter.block_hidden(first, embed, self.cache, width)
                return self._logits(h[:, 1:])
            # each position's logits are written in place: a cat of the steps would copy the
            # whole [B, width - 1, V] block once more
            shape = (len(first), width - 1, self.drafter.config.vocab_size)
            out = torch.empty(shape, device=self.model.device)  # float32, as logits are
            ids, offset = torch.stack([first, first], 1), 0  # positions 0 and 1 read `first`
            for i in range(width - 1):
                h = self.drafter.chain_hidden(ids, offset, embed, self.cache)
                last = self._logits(h[:, -1:], out[:, i : i + 1])[:, 0]
                offset += ids.shape[1]
                # the next pass reads its draft (`pick` sees them all)
                ids = (greedy_ids(last) if pick is None else pick(i, last))[:, None]  # [B, 1]
            return out

    def draft_for(self, rows: list, features: torch.Tensor, kept: list[int],
                  keep: list[int], mask_id: int | None) -> None:  # fmt: skip
        """After a pass: the drafter takes the features of what each drafting row kept
        (features [B, T, F], kept: a count per row), then drafts the next block for the rows
        that stay (`keep`) and want one, in one pass for all; each row takes its drafts
        (`take_drafts`). rows: the batch's rows (a SpecRow drafts with `uses_drafter`)."""
        drafting = [getattr(r, "uses_drafter", False) for r in rows]
        if not all(drafting):
            kept = [n if d else 0 for n, d in zip(kept, drafting)]
        # a row alone whose chains stop themselves pays for the passes they are likely to run
        stops = len(keep) == 1 and self.stops_chains
        # in a batch where no common length pays, the rows that follow the costs are not asked
        idle = len(keep) > 1 and self._batch_idle(rows, drafting, keep)
        lengths = [r.drafter_length(stops)
                   if d and k in keep and not (idle and r.sources.costs is not None) else 0
                   for k, (r, d) in enumerate(zip(rows, drafting))]  # fmt: skip
        if len(keep) > 1:
            lengths = self._batch_lengths(rows, lengths, len(keep))
        # only the rows that draft now take what they committed into the drafter's context
        self.take_context(rows, features, kept, [n > 0 for n in lengths])
        if max(lengths) == 0:
            return
        first = torch.tensor([r.pending[-1] if r.pending else 0 for r in rows])
        # greedy rows of a tree policy draft trees: a chain drafter grows them (one pass per
        # depth), a block drafter's are its chain and the other guesses beside it (leaf_tree)
        trees = [n > 0 and r.grows_tree for r, n in zip(rows, lengths)]
        if self.grows_trees and any(trees):
            self._grow_trees(rows, first, lengths, trees, mask_id)
            lengths = [0 if t else n for n, t in zip(lengths, trees)]
            if max(lengths) == 0:
                return
        self._draft_chains(rows, first, lengths, trees, mask_id)

    def take_context(self, rows: list, features: torch.Tensor, kept: list[int],
                     now: list[bool]) -> None:  # fmt: skip
        """What each row kept of the last pass, for its drafter context: its features."""
        self.commit(features, kept, now)

    @classmethod
    def _batch_idle(cls, rows: list, drafting: list[bool], keep: list[int]) -> bool:
        """Whether `_batch_lengths` would choose no drafts even if every row that follows the
        costs asked for its longest: then asking each (a context lookup and a search over
        lengths per row and step) is skipped. The same decision: fewer drafting rows or
        shorter lengths only lower every length's expected tokens, at the same costs."""
        longest = [r.sources.block - 1 if d and k in keep and r.sources.costs is not None else 0
                   for k, (r, d) in enumerate(zip(rows, drafting))]  # fmt: skip
        return any(longest) and not any(cls._batch_lengths(rows, longest, len(keep)))

    @staticmethod
    def _batch_lengths(rows: list, lengths: list[int], running: int) -> list[int]:
        """In a batch every row's pass is padded to the widest, so the rows whose lengths follow
        the measured costs draft one common length, the one the costs of batched passes say
        pays most for the batch as a whole (`costs.batch_length`; often none: at 8 rows a
        wider pass costs nearly its width in AR steps). Fixed-length rows keep theirs."""
        adaptive = [b for b, (r, n) in enumerate(zip(rows, lengths))
                    if n and r.sources.costs is not None]  # fmt: skip
        if not adaptive:
            return lengths
        sources = [rows[b].sources for b in adaptive]
        k = batch_length([s.acceptance["drafter"].p for s in sources], running - len(adaptive),
                         sources[0].costs, max(lengths[b] for b in adaptive))  # fmt: skip
        out = list(lengths)
        for b in adaptive:
            out[b] = min(k, lengths[b])
        return out

    def _grow_trees(self, rows: list, first: torch.Tensor, lengths: list[int],
                    trees: list[bool], mask_id: int | None) -> None:  # fmt: skip
        """A chain drafter's trees for the rows in `trees`, one pass per depth."""
        grown = self.draft_tree(
            first, max(n for n, t in zip(lengths, trees) if t),
            [r.policy.tree if t else 0 for r, t in zip(rows, trees)],
            [n if t else 0 for n, t in zip(lengths, trees)],
            lambda b, branch: rows[b].context.follower(branch) if trees[b] else None,
            mask_id,
        )  # fmt: skip
        for r, t, (tokens, parents) in zip(rows, trees, grown):
            if t:
                r.take_drafts(None, r.sampling, (tokens, None), parents)

    def _draft_chains(self, rows: list, first: torch.Tensor, lengths: list[int],
                      trees: list[bool], mask_id: int | None) -> None:  # fmt: skip
        """Drafts of `lengths[b]` tokens for each row (a block drafter's trees from them)."""
        qs: list[list[torch.Tensor]] = [[] for _ in lengths]  # a sampling row's q, [1, V] each
        tails: list[list[int]] = [[] for _ in lengths]  # a chain drafter's drafts of each row

        def pick(i: int, logits: torch.Tensor) -> torch.Tensor:
            """A chain drafter's draft at position i + 1 of every row (logits [B, V]): the
            arg-max, or a sampling row's draw from the distribution it will be verified
            against (kept as its q), so its later positions read the token it will really
            propose."""
            for b, (r, n) in enumerate(zip(rows, lengths)):
                copy = r.context.follower(tails[b]) if self.COPY_BONUS and i < n else None
                if copy is not None:  # the drafter's guess leans to what the context repeats
                    logits[b, copy] += self.COPY_BONUS
            if mask_id is not None:
                logits[:, mask_id] = float("-inf")
            ids = greedy_ids(logits)
            for b, (r, n) in enumerate(zip(rows, lengths)):
                if i < n and not r.sampling.greedy:
                    drawn, q = draw_drafts(logits[b : b + 1], r.sampling, r.gen)
                    ids[b] = drawn[0]
                    qs[b].append(q)
            for b, t in enumerate(ids.tolist()):
                tails[b].append(t)
            return ids

        with torch.inference_mode():
            logits = self.draft(first, max(lengths) + 1, pick)  # [B, w - 1, V]
            if mask_id is not None:
                logits[..., mask_id] = float("-inf")
            chosen = tails if tails[0] else None  # a block drafter never picks
            for b, (r, n, row_logits) in enumerate(zip(rows, lengths, logits)):
                if not n:
                    continue
                if trees[b]:  # a block drafter's tree
                    chain = greedy_ids(row_logits[:n]).tolist()
                    tokens, parents = leaf_tree(row_logits[:n], chain, r.policy.tree)
                    r.take_drafts(row_logits[:n], r.sampling, (tokens, None), parents)
                    continue
                drawn = None if chosen is None else (
                    chosen[b][:n], torch.cat(qs[b]) if qs[b] else None)  # fmt: skip
                r.take_drafts(row_logits[:n], r.sampling, drawn)

    FRONTIER = 8  # a tree's nodes per depth that the drafter drafts after (EAGLE-2's top-k)

    def draft_tree(self, first: torch.Tensor, depth: int, nodes: list[int],
                   depths: list[int] | None = None,
                   lean: Callable[[int, list[int]], int | None] | None = None,
                   mask_id: int | None = None) -> list[tuple[list[int], list[int]]]:  # fmt: skip
        """A chain drafter's tree of drafts for every row: first [B] (each row's new certain
        token) -> per row b (tokens, parents) of nodes[b] drafts, parents first (-1: the
        root), at most `depth` (depths[b]) deep. Per depth one drafter pass over the FRONTIER
        likeliest drafts of that depth, each at the block position after its parent's, seeing
        the context, the block's first positions and its own ancestors only; each gives its
        FRONTIER likeliest next tokens. A draft is worth the drafter's probability of its
        whole branch; the nodes[b] likeliest of all those drafted are kept (a branch is never
        worth more than its parent, so they form a tree): EAGLE-2's dynamic tree (Li et al.
        2024). `lean(row, branch tokens)`: the token each draft leans to (`COPY_BONUS`), as
        the chain's."""
        if not self.drafter.config.chain:
            raise ValueError("trees grow from a chain drafter (a block drafter: leaf_tree)")
        B, K = len(first), max(1, min(self.FRONTIER, max(nodes)))
        embed = self.model.embed_rows
        # nodes per row: [token, parent node, depth, value, block slot once drafted after]
        trees: list[list[list]] = [[] for _ in range(B)]
        depths = depths or [depth] * B
        with torch.inference_mode():
            ids = torch.stack([first, first], 1)  # block positions 0 and 1 read `first`
            h = self.drafter.chain_hidden(ids, 0, embed, self.cache)
            self._grow(trees, h[:, -1:], [[-1] for _ in range(B)], K, lean, mask_id)
            offset = 2
            for d in range(1, depth):
                chosen = self._frontier(trees, nodes, depths, d, K)
                if chosen is None:
                    break
                for b, c in enumerate(chosen):
                    for j, i in enumerate(c):
                        if i != PAD:
                            trees[b][i][4] = offset + j
                h = self._tree_pass(trees, chosen, offset, d, embed)
                self._grow(trees, h, chosen, K, lean, mask_id)
                offset += len(chosen[0])
        return [likeliest(t, n, d) for t, n, d in zip(trees, nodes, depths)]

    @staticmethod
    def _frontier(trees: list[list[list]], nodes: list[int], depths: list[int], d: int,
                  K: int) -> list[list[int]] | None:  # fmt: skip
        """Each row's K likeliest drafts at depth d that can still be kept (a draft worth less
        than the row's nodes[b]-th likeliest so far never is, nor are its children: a branch
        is never worth more than its parent), padded with PAD to the same count; a row at its
        depth has none. None when no row has any."""
        chosen = []
        for tree, n, most in zip(trees, nodes, depths):
            if d >= most:
                chosen.append([])
                continue
            least = floor(tree, n, most)
            at = [i for i, node in enumerate(tree) if node[2] == d and node[3] >= least]
            at.sort(key=lambda i: -tree[i][3])
            chosen.append(at[:K])
        k = max(len(c) for c in chosen)
        return None if k == 0 else [c + [PAD] * (k - len(c)) for c in chosen]

    def _grow(self, trees: list[list[list]], h: torch.Tensor, parents: list[list[int]], K: int,
              lean: Callable[[int, list[int]], int | None] | None,
              mask_id: int | None) -> None:  # fmt: skip
        """h [B, k, D] of drafted-after nodes (parents[b][j]; -1: the root) -> their K
        likeliest children, appended to each row's tree. Scored over the draft vocabulary's
        columns only (the other tokens are -inf in the chain's logits: the same
        log-probabilities and picks, without filling and normalizing the whole vocabulary at
        each node: 151,936 ids on the coder)."""
        logits = self._head_logits(h)  # [B, k, n]
        for b, tree in enumerate(trees):
            for j, p in enumerate(parents[b]):
                if p == PAD:
                    continue
                copy = lean(b, branch(tree, p)) if lean is not None and self.COPY_BONUS else None
                col = self._column(copy)
                if col is not None:
                    logits[b, j, col] += self.COPY_BONUS
        col = self._column(mask_id)
        if col is not None:
            logits[..., col] = float("-inf")
        top = torch.log_softmax(logits, -1).topk(min(K, logits.shape[-1]), -1)
        ids = top.indices if self.head is None else self.vocab[top.indices]
        for b, tree in enumerate(trees):
            for j, p in enumerate(parents[b]):
                if p == PAD:
                    continue
                base, d = (tree[p][3], tree[p][2] + 1) if p >= 0 else (0.0, 1)
                for v, t in zip(top.values[b, j].tolist(), ids[b, j].tolist()):
                    if v > float("-inf"):
                        tree.append([t, p, d, base + v, None])

    def _tree_pass(self, trees: list, chosen: list[list[int]], offset: int, d: int,
                   embed: Callable) -> torch.Tensor:  # fmt: skip
        """One drafter pass over each row's chosen depth-d drafts, written at block slots
        offset.., at the position after their parents', each seeing the context, block slots
        0 and 1 and its own ancestors' slots. -> hidden [B, k, D]."""
        cache = self.cache
        B, k = len(chosen), len(chosen[0])
        cache.prepare(offset + k)
        ctx = cache.lengths
        ids = torch.tensor([[trees[b][i][0] if i != PAD else 0 for i in c]
                            for b, c in enumerate(chosen)])  # fmt: skip
        lengths = ctx + offset
        positions = (ctx + d + 1)[:, None].expand(B, k).contiguous()
        # the block's slots each query sees, from the context's end: 0 and 1, then its own
        # ancestors' (earlier passes') and itself
        sees = torch.zeros(B, k, offset + k, dtype=torch.bool)
        sees[:, :, :2] = True
        for b, c in enumerate(chosen):
            for j, i in enumerate(c):
                node = i
                if i == PAD:  # sees the context and itself: its outputs are not read
                    sees[b, j, offset + j] = True
                while node >= 0:  # itself and its ancestors, all drafted after already
                    sees[b, j, trees[b][node][4]] = True
                    node = trees[b][node][1]
        # the same as a mask over every key slot (the modules' path)
        S = int(lengths.max()) + k
        rel = torch.arange(S)[None, None, :] - ctx[:, None, None]  # [B, 1, S]
        window = sees.gather(2, rel.clamp(0, offset + k - 1).expand(B, k, S))
        mask = (rel < 0) | ((rel < offset + k) & window)  # [B, k, S]
        zeros = torch.zeros(B, dtype=torch.long)
        layout = StepLayout(torch.full_like(zeros, k), zeros, lengths, positions, mask[:, None],
                            sees=sees)  # fmt: skip
        h = embed(ids).to(self.drafter.norm.weight.dtype)
        return self.drafter._cached_pass(h, layout, cache)

    def _column(self, token: int | None) -> int | None:
        """A token's column in `_head_logits` (None: none, or not in the draft vocabulary)."""
        if token is None or self.head is None:
            return token
        col = int(self.column[token])
        return col if col >= 0 else None

    def _head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """final hidden [B, n, D] -> float logits [B, n, k] of the draft vocabulary's k ids
        (`self.vocab`; without its head rows, of every id)."""
        h = h.to(self.model.embed_dtype)
        return (self.model.logits(h) if self.head is None else self.head(h)).float()

    def _logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """final hidden [B, n, D] -> logits [B, n, V] (the draft vocabulary's, every other
        token at -inf: never drafted), in `out` when given."""
        return self._spread(self._head_logits(h), out)

    def _spread(self, part: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`_head_logits`' [B, n, k] -> [B, n, V], every id outside the draft vocabulary at
        -inf (in `out` when given)."""
        if self.head is None:
            return part if out is None else out.copy_(part)
        shape = (*part.shape[:2], self.drafter.config.vocab_size)
        out = part.new_empty(shape) if out is None else out
        return out.fill_(float("-inf")).scatter_(-1, self.vocab.expand_as(part), part)
