"""A whole smaller model of the target's tokenizer as its drafter (`--drafter MODEL`: the 0.5B
coder drafting for the 1.5B), beside the trained drafters of `drafting.py`.

The draft model keeps its own cache of every row's committed tokens. It reads them lazily:
a row's next draft pass starts with what the row committed since its last draft (the whole
prompt at its first draft) followed by its pending token, in one causal pass, then drafts one
token a pass. What a chain read past the committed tokens (the pending token, then its drafts)
stays in the cache until the next draft pass, which keeps as much of it as the row committed
since (the kept drafts: read once, not again) and rolls back the rest, so its first pass
usually reads one or two tokens instead of every token the verify pass kept. A row that does
not draft for a while feeds nothing: its next draft pass is wider instead. Verification is
the same as for any drafter: exact, whatever the draft model says.

Its drafts come from the head's rows of the vocabulary's first `draft.draft_vocab` ids, its
end tokens and the ids its own shipped drafter drafts (`draft.draft_ids`; `draft_vocabulary`):
byte-level BPE numbers its tokens in merge order, the common ones first, and the whole head over
a 151,936-token vocabulary adds about 40% to a 0.5B model's one-token pass. Merge order is not
use, though: a code fence, "```", is id 73,594, past the first 32,768 ids, and a draft chain
stops at every fence it cannot draft; the shipped drafter's ids are the commonest of its
model's answers. A token past them all is never drafted; wherever the whole head's likeliest
token is among them, the draft is that token.
"""

from __future__ import annotations

import torch

from clover.decoding.drafting import DrafterRunner, Pick
from clover.decoding.prefix_cache import PrefixCache
from clover.decoding.rows import Row
from clover.decoding.sampling import greedy_ids
from clover.models.base import DiffusionLM
from clover.models.cache import ModelCache
from clover.quant import head_rows, release_freed_memory


class ModelDraftRunner(DrafterRunner):
    COPY_BONUS = 0.0  # a language model copies from its context well without it
    reads_prefill = False  # it reads the prompt's tokens at the first draft instead
    MOST = 16  # the longest draft the pass costs are timed for
    # the acceptance its drafts start from and drift back to (`Runtime.shared_acceptance`):
    # a smaller model of the target's family agrees with it on most greedy tokens (the 0.5B
    # coder keeps 88% of its drafts for the 1.5B). From a trained drafter's 0.6 a draft model
    # whose pass costs half a target step is never tried, so never learnt, where it pays.
    PRIOR = 0.8
    # how much of a long prompt a row's first draft reads (past what the draft model's prefix
    # cache holds): the last max(WINDOW, READ_PER_TOKEN x the tokens the row may still write).
    # Reading costs the 0.5B about 2.5 ms a token on 2 cores, a third of the 1.5B's prefill,
    # and comes before the first text when the model's prefix cache held the prompt. On a
    # 1,700-token prompt the whole context kept more drafts (TPF 2.9 against 2.1 from its last
    # 256 tokens) but not more speed after the read: lookup drafts what lies far back, at no
    # cost (benchmarks/draft_window.py). One token read per token to write bounds the read at
    # a few percent of the answer's time.
    WINDOW = 256
    READ_PER_TOKEN = 1
    # a chain stops once every row's draft so far is unlikely to be kept whole: the product of
    # the draft model's own probabilities of its drafts below this. Its next pass costs about
    # a third of a target step (the 0.5B for the 1.5B), and a draft is only worth it where the
    # drafts before it are kept, so such a pass rarely pays; the draft it has made is kept
    # (its logits are there, a wider verify pass costs little). 0: every pass of the width.
    # On prose the 1.5B's default gains ~5% at 0.3 to 0.6 (fewer drafts, the same tokens a
    # pass); on code the 0.5B is rarely unsure and nothing changes (benchmarks/draft_stop.py).
    STOP_BELOW = 0.5

    def __init__(self, model: torch.nn.Module, draft: DiffusionLM,
                 vocab_head: tuple | None = None,
                 prefix: PrefixCache | None = None) -> None:  # fmt: skip
        """vocab_head: `vocab_head(draft)` made before (`Runtime` keeps one), else made here.
        prefix: the draft model's prefix cache (`PrefixCache.for_draft`): a row's first draft
        resumes from the longest cached prefix of what it committed, and a row that leaves
        saves what the draft model read of it."""
        self.model, self.drafter = model, draft
        self.layers: tuple[int, ...] = ()  # no target features: the draft reads tokens
        self.cache: ModelCache | None = None
        self.head, self.vocab = vocab_head or self.vocab_head(draft)
        self.prefix = prefix
        self.fed: list[int] = []  # per row: its committed tokens in the draft model's cache
        self.owners: list = []  # per row: the row it drafts for, once it drafted
        self.pins: list = []  # per row: the prefix-cache block it holds
        self.skipped: list[int] = []  # per row: committed tokens before its window (`WINDOW`)
        self.ahead: list[list[int]] = []  # per row: tokens in the cache past its committed ones
        self.rows: list | None = None  # the batch's rows, until the draft pass reads them
        self.clean = True  # False while a draft pass runs: the cache may hold half of it

    @staticmethod
    def vocab_head(draft: DiffusionLM) -> tuple:
        """(the draft model's head over `draft_vocabulary`, those ids), or (None, None): the
        whole head (a vocabulary no larger, or a head the kernel cannot cut)."""
        vocab = draft_vocabulary(draft.config, draft.draft_vocab, draft.draft_ids)
        if vocab is None:
            return None, None
        with torch.inference_mode():
            head = head_rows(draft, vocab.to(draft.device), draft.draft_wide == "int4")
        release_freed_memory()
        return (None, None) if head is None else (head, vocab.to(draft.device))

    # with STOP_BELOW, the costs price a row alone's chain of k drafts by the passes it is
    # likely to run, not k (`costs.chain_cost`): it stops itself where it becomes unsure, so
    # its later passes run where the drafts before them are likely kept; longer chains then
    # pay (benchmarks/draft_stop.py, `:priced`). False: k passes.
    PRICE_STOPS = True

    @property
    def stops_chains(self) -> bool:
        return self.PRICE_STOPS and self.STOP_BELOW > 0

    @property
    def block_size(self) -> int:
        return self.MOST

    @property
    def grows_trees(self) -> bool:
        return False  # a tree row's tree comes from its chain's logits (`leaf_tree`)

    def make_cache(self) -> ModelCache:
        cache = self.drafter.make_cache(1)
        cache.enable_rollback()
        return cache

    def fill_context(self, tokens: int) -> None:
        rows = self.cache.batch_size
        ids = torch.randint(0, self.drafter.config.vocab_size, (rows, tokens))
        with torch.inference_mode():
            self.drafter(ids.to(self.drafter.device), self.cache, "causal")
        self.fed = [f + tokens for f in self.fed]

    def _row_added(self, cache: ModelCache) -> None:
        self.fed.append(int(cache.lengths[0]))
        self.owners.append(None)
        self.pins.append(None)
        self.skipped.append(0)
        self.ahead.append([])

    def select(self, keep: list[int]) -> None:
        """Rows that leave save what the draft model read of them, then the rest stay."""
        if self.prefix is not None:
            for k in sorted(set(range(len(self.fed))) - set(keep)):
                self._leave(k)
        super().select(keep)

    def _rows_kept(self, keep: list[int]) -> None:
        self.fed = [self.fed[k] for k in keep]
        self.owners = [self.owners[k] for k in keep]
        self.pins = [self.pins[k] for k in keep]
        self.skipped = [self.skipped[k] for k in keep]
        self.ahead = [self.ahead[k] for k in keep]

    def _leave(self, k: int) -> None:
        """Row k's committed tokens in the draft model's cache into its prefix cache (unless a
        draft pass was cut short), then its hold on the cache's chain goes."""
        row, pin = self.owners[k], self.pins[k]
        if self.ahead[k]:  # the cache keeps only the committed tokens it saves
            n = torch.zeros(len(self.fed), dtype=torch.long)
            n[k] = len(self.ahead[k])
            self.cache.rollback(n)
            self.ahead[k] = []
        if row is not None and self.clean and self.fed[k] and not self.skipped[k]:
            tokens = row.committed[: self.fed[k]]
            pin = self.prefix.save(self.cache, k, tokens, {}, pin, row.partition)
        self.prefix.release(pin)

    def _resume(self, k: int, row: Row) -> None:
        """Row k's first draft: the longest cached prefix of what it committed, read back; of
        more tokens past it than the row's window, only the last ones are read (the row's
        draft cache then starts there, and is not saved)."""
        self.owners[k] = row
        if self.fed[k]:  # (timing passes, or rows that joined with a context)
            return
        n = len(row.committed)
        hit = None
        if self.prefix is not None and n >= self.prefix.block_tokens:
            hit = self.prefix.lookup(row.committed, n, self.prefix.recurrent, row.partition)
        start = hit.length if hit is not None else 0
        window = max(self.WINDOW, self.READ_PER_TOKEN * (row.max_new - len(row.answer)))
        if n - start > window:
            self.skipped[k] = self.fed[k] = n - window
        elif start:
            self.prefix.restore(hit, self.cache, k)
            self.pins[k] = self.prefix.hold(hit)
            self.fed[k] = start

    def take_context(self, rows: list, features: torch.Tensor, kept: list[int],
                     now: list[bool]) -> None:  # fmt: skip
        """Nothing is read now: a draft pass reads the rows' tokens (`_feeds`)."""
        self.rows = rows

    def _feeds(self, first: torch.Tensor) -> tuple[list[list[int]], list[int]]:
        """Each row's input to the first draft pass: what it committed since its last draft,
        then its pending tokens (the last of them is `first`); and how many of those are
        uncommitted. The tokens its last chain left in the cache (`ahead`) count as read where
        the row committed the same ones since; the rest are rolled back. Without rows (timing
        passes): just `first`."""
        if self.rows is None:
            return [[t] for t in first.tolist()], [1] * len(first)
        back = []
        for k, r in enumerate(self.rows):
            if self.owners[k] is None:
                self._resume(k, r)
            ahead, self.ahead[k] = self.ahead[k], []
            f, n = self.fed[k], len(r.committed)
            same = 0
            for a, c in zip(ahead, r.committed[f:] if f <= n else []):
                if a != c:
                    break
                same += 1
            # the rest of what it read ahead, and committed tokens it no longer has (never by
            # the loop: committed stays exact)
            back.append(len(ahead) - same + max(0, f - n))
            self.fed[k] = min(f, n) + same
        if any(back):
            self.cache.rollback(torch.tensor(back))
        pending = [list(r.pending) or [0] for r in self.rows]
        feeds = [r.committed[f:] + p for r, f, p in zip(self.rows, self.fed, pending)]
        return feeds, [len(p) for p in pending]

    def draft(self, first: torch.Tensor, width: int, pick: Pick | None = None) -> torch.Tensor:
        """Like a chain drafter's: first [B] -> draft logits [B, w - 1, V], `pick(i,
        logits)` choosing the draft at position i + 1. The first pass reads each row's feed
        (`_feeds`), each later one the draft before. w is `width`, or less where the rows'
        drafts became unlikely (`STOP_BELOW`; not in timing passes, which have no rows)."""
        B, dm = len(first), self.drafter
        stop = self.STOP_BELOW if self.rows is not None else 0.0
        feeds, tails = self._feeds(first)
        self.clean = False
        n = torch.tensor([len(f) for f in feeds])
        T = int(n.max())
        ids = torch.tensor([f + [0] * (T - len(f)) for f in feeds], device=dm.device)
        out = torch.empty((B, width - 1, dm.config.vocab_size), device=self.model.device)
        read: list[torch.Tensor] = []  # the drafts the cache read after the feeds
        with torch.inference_mode():
            h = dm(ids, self.cache, "causal", n_valid=n)
            last = h[torch.arange(B), n.to(h.device) - 1]  # [B, D]: each row's last real token
            sure = torch.ones(B, device=out.device)  # each row's chain, as the draft model sees it
            for i in range(width - 1):
                part = self._head_logits(last[:, None])  # [B, 1, k]: the draft vocabulary's
                self._spread(part, out[:, i : i + 1])
                picked = greedy_ids(out[:, i]) if pick is None else pick(i, out[:, i])
                if stop:  # the draft's probability, normalized over the draft vocabulary
                    logit = out[:, i].gather(1, picked[:, None].to(out.device))[:, 0]
                    sure *= (logit - part[:, 0].logsumexp(-1)).exp()
                    if bool((sure < stop).all()) and i < width - 2:
                        out = out[:, : i + 1]
                        break
                if i < width - 2:  # the next pass reads this draft
                    last = dm(picked[:, None].to(dm.device), self.cache, "causal")[:, -1]
                    read.append(picked.cpu())
            if self.rows is None:  # timing passes: the cache keeps its committed tokens only
                self.cache.rollback(torch.tensor(tails) + len(read))
        self.clean = True
        self.fed = [f + len(feed) - t for f, feed, t in zip(self.fed, feeds, tails)]
        if self.rows is not None:  # the pending tokens and the drafts read stay (`_feeds`)
            drafts = torch.stack(read, 1).tolist() if read else [[] for _ in feeds]
            self.ahead = [feed[len(feed) - t :] + d for feed, t, d in zip(feeds, tails, drafts)]
        self.rows = None
        return out

    def _head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The draft model's own head (`DrafterRunner._logits` spreads it over every id)."""
        h = h.to(self.drafter.embed_dtype)
        return (self.drafter.logits(h) if self.head is None else self.head(h)).float()


def draft_vocabulary(config: object, size: int,
                     extra: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
    """The ids a draft model drafts: the first `size`, its end tokens and the `extra` ids,
    padded with the next ids to a multiple of 16 rows (the kernel's tile); None: every id
    (`size` 0, or no fewer)."""
    V = config.vocab_size
    if not size or size >= V - 16:
        return None
    more = {e for e in config.eos_token_ids if size <= e < V}
    if extra is not None:
        more |= {i for i in extra.tolist() if size <= i < V}
    n = size + len(more)
    if n >= V - 16:
        return None
    pad = [i for i in range(size, V) if i not in more][: -n % 16]
    return torch.tensor(sorted([*range(size), *pad, *more]))


def runner_for(model: torch.nn.Module, drafter: torch.nn.Module,
               vocab_head: tuple | None = None,
               prefix: PrefixCache | None = None) -> DrafterRunner:  # fmt: skip
    """The runner of `drafter` over a batch's rows: a trained drafter's (`DrafterRunner`) or a
    draft model's (with its own prefix cache beside `prefix`, the model's)."""
    if isinstance(drafter, DiffusionLM):
        own = prefix.for_draft(drafter, model) if prefix is not None else None
        return ModelDraftRunner(model, drafter, vocab_head, own)
    return DrafterRunner(model, drafter, vocab_head)
