"""How a row's prompt gets into the cache, and how what it commits gets into the prefix cache.

A joining row first reuses the longest prefix of its prompt that the prefix cache holds
(`prefix_cache.py`), then prefills alone what must be: the rest of the prompt of a model with
recurrent layers, in passes that end at its snapshot points (the caller's marks, every
`snapshot_every` tokens, one before the end), or a prompt joining a running batch, so the
batch's next step is not padded to its length for every row. Rows joining together share one
padded pass (`together`). Only causal tokens are ever saved: each row's `committed` ids are
kept exact by the loop.
"""

from __future__ import annotations

import torch

from clover.decoding.drafting import DrafterRunner
from clover.decoding.prefix_cache import PrefixCache
from clover.decoding.rows import Row
from clover.models.base import DiffusionLM
from clover.models.cache import ModelCache


class Prefill:
    def __init__(self, model: DiffusionLM, prefix: PrefixCache | None, mask_id: int) -> None:
        self.model, self.prefix, self.mask_id = model, prefix, mask_id
        self.device = next(model.parameters()).device

    def start(
        self,
        row: Row,
        cache: ModelCache,
        drafting: DrafterRunner | None = None,
        dcache: ModelCache | None = None,
        running: bool = False,
        defer: bool = False,
    ) -> None:
        """Reuse the longest cached prefix of the row's prompt (into its fresh 1-row cache),
        then prefill alone what must be. The last prompt token always stays pending: its pass
        gives the first logits. `running`: the row joins a running batch; with `defer`, its
        prefill is left to `together`; passes that end at snapshots never are. `dcache`: a
        drafting row's drafter cache, which reads the features of what is committed."""
        prompt, prefix = row.prompt, self.prefix
        recurrent = any(layer.recurrent for layer in cache.layers)
        end = len(prompt) - 1
        if prefix is not None:
            hit = prefix.lookup(prompt, end, exact=recurrent, partition=row.partition)
            prefix.restore(hit, cache)
            row.pin = prefix.hold(hit)
            row.committed, row.pending = prompt[: hit.length], prompt[hit.length :]
            row.result.cached_tokens = hit.length
        stops: set[int] = set()
        if prefix is not None and recurrent:
            every = prefix.snapshot_every
            stops = {*row.marks, *range(every, end, every), end}
        elif running:
            stops = set() if defer else {end}
        states = {}
        for stop in sorted(p for p in stops if len(row.committed) < p <= end):
            ids = row.pending[: stop - len(row.committed)]
            x = torch.tensor([ids], device=self.device)
            if dcache is None:
                self.model(x, cache, "causal")
            else:
                _, feats = self.model(x, cache, "causal", capture=drafting.layers)
                drafting.drafter.commit(feats, torch.tensor([len(ids)]), dcache)
            row.committed += ids
            del row.pending[: len(ids)]
            row.result.nfe += 1
            if prefix is not None and recurrent:
                states[stop] = prefix.capture(cache, 0)
        if prefix is not None and len(row.committed) >= end:
            self.save(row, cache, 0, states)

    def together(self, joiners: list[tuple[Row, ModelCache]]) -> tuple[list[Row], ModelCache]:
        """One pass prefills what the joiners' prompts still need (all but the last token),
        over the rows that need it. -> (the rows, their caches joined into one, in that
        order). If the pass fails, every joiner's pin is released and the error propagates."""
        todo = [(r, c, len(r.prompt) - 1 - len(r.committed)) for r, c in joiners]
        todo.sort(key=lambda j: j[2] == 0)  # the rows that need the pass first
        rows, n = [r for r, _, _ in todo], [k for _, _, k in todo]
        cache = todo[0][1]
        try:
            need = sum(1 for k in n if k)
            for _, other, _ in todo[1:need]:
                cache.extend(other)
            if need:
                T = max(n)
                ids = [r.pending[:k] + [self.mask_id] * (T - k) for r, k in zip(rows, n[:need])]
                ids = torch.tensor(ids, dtype=torch.long, device=self.device)
                count = torch.tensor(n[:need])
                with torch.inference_mode():
                    self.model(ids, cache, "block", n_commit=count, n_valid=count)
                    for i, (r, k) in enumerate(zip(rows[:need], n)):
                        r.committed += r.pending[:k]
                        del r.pending[:k]
                        r.result.nfe += 1
                        if self.prefix is not None:
                            self.save(r, cache, i, {})
            for _, other, _ in todo[max(need, 1) :]:
                cache.extend(other)
        except BaseException:
            for r in rows:
                self.release(r)
            raise
        return rows, cache

    def save(self, row: Row, cache: ModelCache, k: int, states: dict | None = None) -> None:
        """Save row's committed state (cache row k) into the prefix cache: the first time,
        with snapshots at its marks and one token before its prompt's end. `states`: the
        recurrent states captured during a prefill in passes, by position; None (a save
        between steps) also snapshots where the row is now: where it ends when it leaves,
        its prompt's end (or just past it) after its first pass."""
        snaps = {} if states is None else dict(states)
        if not row.prompt_saved:
            for p in (*row.marks, len(row.prompt) - 1):
                snaps.setdefault(p, None)
        if states is None:
            snaps[len(row.committed)] = None
        row.pin = self.prefix.save(cache, k, row.committed, snaps, row.pin, row.partition)
        row.prompt_saved = True

    def release(self, row: Row) -> None:
        """Unpin the row's chain of cached blocks (it left, or never joined)."""
        if self.prefix is not None:
            self.prefix.release(row.pin)
        row.pin = None
