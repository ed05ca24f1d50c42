"""A prefix cache across requests: the committed state of earlier sequences, kept by token prefix.

Decisions:
- Fixed-size blocks of `block_tokens` committed tokens form a hashed chain: a block's key is
  (its parent block's id, its tokens), so a lookup walks a prompt block by block with dict
  reads, and two prefixes share a block only when every token before it is equal (keys are
  compared exactly: no hash collision can alias two prefixes).
- Only committed tokens enter: the decoder tracks the ids each row has committed causally
  (`Row.committed`); block previews are never committed, and rejected speculation is rolled
  back before anything is saved.
- K/V is stored per position, so any block boundary is a place to resume. A recurrent layer's
  state (Gated DeltaNet: conv + recurrent state) summarises its whole prefix and cannot be cut,
  so a model with such layers resumes only at a *snapshot*: the recurrent states at a position
  plus the K/V of the tokens past the last full block (the tail). The decoder takes snapshots
  at the caller's prompt boundaries (the chat template before the last user turn), every
  `snapshot_every` prompt tokens, one token before the end of each prompt (a repeat of the same
  prompt must still feed its last token) and where a sequence ends. A model without recurrent
  layers gets tail snapshots at the same points, so an exact repeat or a conversation's next
  turn resumes exactly instead of at the last block boundary.
- Copies, not pages: the decoder's cache is one contiguous tensor per layer (models/cache.py),
  so a hit copies its blocks in (one concatenation and one copy per layer) and saving copies
  them out. Paged attention would make reuse copy-free but change every attention call; the
  copy costs far less than the prefill it replaces.
- Partitions: a lookup or save names a partition (any hashable; None is the default) and sees
  only that partition's chains, each hanging from its own root, so requests of different
  tenants (or cache salts) never reuse, or learn of, each other's prefixes. A partition's
  root goes away with its last block or snapshot.
- Memory: blocks + snapshots stay within `capacity_bytes`. When full, the least recently used
  leaf block (one no cached block continues) or snapshot goes first; a running row pins the
  deepest block of its chain, which keeps every block it uses (ancestors are never leaves).
  What does not fit is not saved.

Thread-safety: one lock around every public method (the server's scheduler thread writes,
/metrics reads).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Hashable

import torch

from clover.decoding.prefix_blocks import EMPTY_ROOT, Block, Hit, PrefixStats, Snapshot, nbytes
from clover.errors import CloverError
from clover.models.cache import ModelCache

MIN_DEFAULT_BYTES = 256 * 2**20
COPY_BLOCKS = 64  # blocks copied out of a row's cache per copy when saving


class PrefixCache:
    """Committed K/V and recurrent snapshots of earlier sequences, reused by token prefix."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        block_tokens: int = 16,
        snapshot_every: int = 1024,
        recurrent: bool = False,
    ) -> None:
        """recurrent: the model has recurrent layers (resume only at snapshots); informs
        callers (`LLM.chat_marks`), the decoder reads its own cache's layers."""
        if capacity_bytes < 0 or block_tokens < 1 or snapshot_every < 1:
            raise CloverError("prefix cache: capacity >= 0, block and snapshot sizes >= 1")
        self.capacity = int(capacity_bytes)
        self.recurrent = recurrent
        self.block_tokens = block_tokens
        self.snapshot_every = snapshot_every
        self.root = Block(0, None, (), None, 0)  # the default partition's
        self.roots: dict[object, Block] = {None: self.root}
        self._partition_of: dict[int, object] = {}  # a root's id -> its partition
        self.table: dict[tuple[int, tuple[int, ...]], Block] = {}
        self.bytes = 0
        self.snapshots = 0
        self.stats = PrefixStats()
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._lock = threading.RLock()
        self.draft: PrefixCache | None = None  # a draft model's (`for_draft`)

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity_mb: float | None = None) -> PrefixCache:
        """A cache sized for `model`: `capacity_mb`, or by default the model's own bytes
        (weights and buffers), at least 256 MiB and at most a quarter of the machine's memory.
        Periodic snapshots of a recurrent model are spaced so that one costs about what the
        K/V of the tokens between two of them does (a few thousand tokens for the published
        35B shape, whose GDN states take ~60 MB a snapshot)."""
        if capacity_mb is None:
            weights = nbytes([*model.parameters(), *model.buffers()])
            capacity = min(max(weights, MIN_DEFAULT_BYTES), max(_memory_bytes() // 4, 1))
        else:
            if capacity_mb < 0:
                raise CloverError(f"--prefix-cache-mb must be >= 0, got {capacity_mb}")
            capacity = int(capacity_mb * 2**20)
        block = 16
        state, kv, recurrent = _state_bytes(model)
        every = max(256, -(-state // max(kv, 1)))
        every = -(-every // block) * block  # a whole number of blocks
        return cls(capacity, block_tokens=block, snapshot_every=every, recurrent=recurrent)

    def for_draft(self, draft: torch.nn.Module, model: torch.nn.Module) -> PrefixCache:
        """The draft model's own prefix cache beside this one, `model`'s (a smaller model
        drafting as a whole reads each prompt at its first draft: a conversation's next turn
        or a repeated system prompt resumes there too). Made on first use, cleared with this
        one. The two share this one's bound, split by their K/V bytes a token so that each
        has room for as many tokens (`report` counts both)."""
        with self._lock:
            if self.draft is None:
                share = _state_bytes(draft)[1] / max(_state_bytes(model)[1], 1)
                own = int(self.capacity / (1 + share))
                self.draft = PrefixCache.for_model(draft, (self.capacity - own) / 2**20)
                self.capacity = own
                self._make_room(0, [])
            return self.draft

    # --- lookup and restore -------------------------------------------------------------------

    def lookup(self, tokens: list[int], limit: int, exact: bool, partition: Hashable = None) -> Hit:
        """The longest cached prefix of tokens[:limit] in `partition`. exact: only snapshots
        count (a model with recurrent layers); otherwise any block boundary does too."""
        with self._lock:
            bs = self.block_tokens
            node, depth = self.roots.get(partition, EMPTY_ROOT), 0
            path: list[Block] = []
            best_len, best_depth, best_snap = 0, 0, None
            while True:
                for tail, snap in node.snaps.items():
                    n = node.end + len(tail)
                    if best_len < n <= limit and tuple(tokens[node.end : n]) == tail:
                        best_len, best_depth, best_snap = n, depth, snap
                if not exact and node.end > best_len:
                    best_len, best_depth, best_snap = node.end, depth, None
                if node.end + bs > limit:
                    break
                child = self.table.get((node.id, tuple(tokens[node.end : node.end + bs])))
                if child is None:
                    break
                path.append(child)
                node, depth = child, depth + 1
            hit = Hit(best_len, path[:best_depth], best_snap)
            now = next(self._clock)
            for b in hit.path:
                b.used = now
            if best_snap is not None:
                best_snap.used = now
            self.stats.lookups += 1
            self.stats.hits += best_len > 0
            self.stats.prompt_tokens += len(tokens)
            self.stats.cached_tokens += best_len
            return hit

    def hold(self, hit: Hit) -> Block | None:
        """Pin a hit's chain for a row that uses it; -> the pinned block (`release` it)."""
        if not hit.path:
            return None
        with self._lock:
            hit.path[-1].refs += 1
            return hit.path[-1]

    def restore(self, hit: Hit, cache: ModelCache, row: int = 0) -> None:
        """Load a hit into a row of `cache` (a fresh one: nothing committed yet)."""
        if not hit.length:
            return
        with self._lock:
            parts = [b.kv for b in hit.path]
            if hit.snap is not None:
                parts.append(hit.snap.kv)
            parts = [p for p in parts if p is not None]
            kv = torch.cat(parts, dim=3) if parts else None  # [L_attn, 2, H, length, D]
            a = r = 0
            for layer in cache.layers:
                if layer.recurrent:
                    layer.copy_in(row, 0, hit.snap.states[r])
                    r += 1
                else:
                    layer.copy_in(row, 0, (kv[a, 0], kv[a, 1]))
                    a += 1
            cache.lengths[row] = hit.length

    # --- saving -------------------------------------------------------------------------------

    def save(
        self,
        cache: ModelCache,
        row: int,
        tokens: list[int],
        snapshots: dict[int, list | None],
        pin: Block | None,
        partition: Hashable = None,
    ) -> Block | None:
        """Save what row `row` of `cache` has committed: `tokens` are its committed ids (the
        cache holds len(tokens) of them). Full blocks go into the chain; a snapshot goes at
        each position of `snapshots`, with the recurrent states captured there (`capture`;
        None: the row's current ones, valid only at len(tokens)). `pin` is the block the row
        pins now; returns the one it pins after (the deepest of its chain saved so far)."""
        with self._lock:
            kinds = [layer.recurrent for layer in cache.layers]
            root = self.roots.get(partition)
            if root is None:
                root = self.roots[partition] = Block(next(self._ids), None, (), None, 0)
                self._partition_of[root.id] = partition
            now = next(self._clock)
            chain = self._save_blocks(cache, row, kinds, tokens, root, now)
            for pos, states in sorted(snapshots.items()):
                if 0 < pos <= len(tokens):
                    self._snapshot(cache, row, kinds, tokens, pos, states, chain, now)
            self._forget_if_empty(root)
            deepest = chain[-1] if len(chain) > 1 else None
            if deepest is not pin:
                if deepest is not None:
                    deepest.refs += 1
                if pin is not None:
                    pin.refs -= 1
            return deepest

    def _save_blocks(self, cache: ModelCache, row: int, kinds: list[bool], tokens: list[int],
                     root: Block, now: int) -> list[Block]:  # fmt: skip
        """The full blocks of `tokens` into the chain from `root`, those not cached yet with
        their K/V copied out of the row; -> the chain (root first) as far as it got (a block
        that does not fit ends it)."""
        bs = self.block_tokens
        node, chain = root, [root]
        full = len(tokens) // bs * bs
        # K/V of blocks not cached yet, copied out COPY_BLOCKS at a time (fewer, larger
        # copies; a bounded transient for a long prompt)
        fresh, first, last = None, 0, 0  # fresh: K/V of positions [first, last)
        for start in range(0, full, bs):
            key = (node.id, tuple(tokens[start : start + bs]))
            child = self.table.get(key)
            if child is None:  # and none after it: a block's parent is always cached
                if start >= last:
                    last = min(full, start + COPY_BLOCKS * bs)
                    fresh, first = self._kv(cache, row, kinds, start, last), start
                kv = None  # [L_attn, 2, H, bs, D] in its own storage (evicted alone)
                if fresh is not None:
                    kv = fresh[:, :, :, start - first : start - first + bs].clone()
                if not self._make_room(nbytes([kv]), keep=chain):
                    break
                child = Block(next(self._ids), node, key[1], kv, start + bs, nbytes([kv]))
                self.table[key] = child
                node.children += 1
                self.bytes += child.nbytes
                self.stats.saved_blocks += 1
            child.used = now
            node = child
            chain.append(node)
        return chain

    def release(self, pin: Block | None) -> None:
        """A row is done with its chain (finished, cancelled or failed)."""
        if pin is None:
            return
        with self._lock:
            pin.refs -= 1

    @staticmethod
    def capture(cache: ModelCache, row: int) -> list[tuple[torch.Tensor, ...]]:
        """Copies of row's recurrent states now (for a snapshot at its committed length)."""
        return [layer.copy_out(row, 0, 0) for layer in cache.layers if layer.recurrent]

    def _kv(
        self, cache: ModelCache, row: int, kinds: list[bool], start: int, end: int
    ) -> torch.Tensor | None:
        """-> K/V of positions [start, end) of every attention layer, [L_attn, 2, H, n, D]."""
        parts = [
            torch.stack(layer.copy_out(row, start, end))
            for layer, rec in zip(cache.layers, kinds)
            if not rec
        ]
        return torch.stack(parts) if parts else None

    def _snapshot(self, cache, row, kinds, tokens, pos, states, chain, now) -> None:  # noqa: ANN001
        base = pos // self.block_tokens
        if base >= len(chain):  # the blocks before it were not saved (no room)
            return
        node = chain[base]
        tail = tuple(tokens[node.end : pos])
        if tail in node.snaps:
            node.snaps[tail].used = now
            return
        if not any(kinds) and not tail:
            return  # a block boundary of a model without recurrent layers: nothing to add
        if states is None:
            if any(kinds) and pos != len(tokens):
                return  # the recurrent state there was not captured
            states = self.capture(cache, row)
        kv = self._kv(cache, row, kinds, node.end, pos) if tail else None
        size = nbytes([kv, *(t for s in states for t in s)])
        if not self._make_room(size, keep=chain):
            return
        node.snaps[tail] = Snapshot(tail, kv, states, size, now)
        self.bytes += size
        self.snapshots += 1
        self.stats.saved_snapshots += 1

    # --- eviction -----------------------------------------------------------------------------

    def _make_room(self, need: int, keep: list[Block]) -> bool:
        """Evict least recently used leaves and snapshots until `need` more bytes fit; blocks
        in `keep` (the chain being saved) and pinned ones stay. False if it cannot fit."""
        if self.bytes + need <= self.capacity:
            return True
        if need > self.capacity:
            self.stats.skipped += 1
            return False
        kept = {id(b) for b in keep}
        while self.bytes + need > self.capacity:
            victims: list[tuple[int, int, object]] = []
            for b in self.table.values():
                for s in b.snaps.values():
                    victims.append((s.used, 0, (b, s)))
                if not b.children and not b.refs and id(b) not in kept:
                    victims.append((b.used, 1, b))
            for root in self.roots.values():
                for s in root.snaps.values():
                    victims.append((s.used, 0, (root, s)))
            if not victims:
                self.stats.skipped += 1
                return False
            victims.sort(key=lambda v: (v[0], v[1]))
            for _, _, victim in victims:
                if self.bytes + need <= self.capacity:
                    break
                if isinstance(victim, Block):
                    self._drop_block(victim)
                else:
                    b, s = victim
                    if b.snaps.get(s.tail) is s:  # not already dropped with its block
                        self._drop_snapshot(b, s)
        return True

    def _drop_snapshot(self, block: Block, snap: Snapshot) -> None:
        del block.snaps[snap.tail]
        self.bytes -= snap.nbytes
        self.snapshots -= 1
        self.stats.evictions += 1
        if block.parent is None:
            self._forget_if_empty(block)

    def _drop_block(self, block: Block) -> None:
        for snap in list(block.snaps.values()):
            self._drop_snapshot(block, snap)
        del self.table[(block.parent.id, block.tokens)]
        block.parent.children -= 1
        self.bytes -= block.nbytes
        self.stats.evictions += 1
        if block.parent.parent is None:
            self._forget_if_empty(block.parent)

    def _forget_if_empty(self, root: Block) -> None:
        """A partition whose root holds nothing more is forgotten (salts are unbounded)."""
        if root is not self.root and not root.children and not root.snaps:
            partition = self._partition_of.pop(root.id, None)
            if self.roots.get(partition) is root:
                del self.roots[partition]

    # --- reporting ----------------------------------------------------------------------------

    def report(self) -> dict[str, float]:
        """Counters and sizes, for /metrics and benchmarks (the memory figures include a
        draft model's cache, `for_draft`)."""
        with self._lock:
            s, d = self.stats, self.draft
            return {
                "capacity_bytes": self.capacity + (d.capacity if d is not None else 0),
                "bytes": self.bytes + (d.bytes if d is not None else 0),
                "blocks": len(self.table),
                "snapshots": self.snapshots,
                "pinned_blocks": sum(1 for b in self.table.values() if b.refs),
                "lookups": s.lookups,
                "hits": s.hits,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "hit_rate": round(s.cached_tokens / s.prompt_tokens, 4) if s.prompt_tokens else 0.0,
                "saved_blocks": s.saved_blocks,
                "saved_snapshots": s.saved_snapshots,
                "evictions": s.evictions,
                "skipped": s.skipped,
            }

    def clear(self) -> None:
        """Forget everything that no running row pins (in the draft model's cache too)."""
        with self._lock:
            if self.draft is not None:
                self.draft.clear()
            for b in [*self.roots.values(), *self.table.values()]:
                for snap in list(b.snaps.values()):
                    self._drop_snapshot(b, snap)
            for b in sorted(self.table.values(), key=lambda b: -b.end):  # children first
                if not b.children and not b.refs:
                    self._drop_block(b)


def _state_bytes(model: torch.nn.Module) -> tuple[int, int, bool]:
    """(bytes of a row's recurrent states, bytes of one token's K/V, whether it has recurrent
    layers) of `model`'s cache, from shapes only (no memory for the probe)."""
    with torch.device("meta"):
        layers = model.make_layer_caches(1)
        for c in layers:
            c.reserve(1)
        state = sum(nbytes(list(c.copy_out(0, 0, 0))) for c in layers if c.recurrent)
        kv = sum(nbytes(list(c.copy_out(0, 0, 1))) for c in layers if not c.recurrent)
    return state, kv, any(c.recurrent for c in layers)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * 2**30
