"""Caches and the per-forward layout shared by every layer.

Decisions:
- One cache object per layer, made by the model (`model.make_cache`), held in a `ModelCache`
  that also owns the committed length of every row. Attention layers hold K/V; a recurrent
  layer (Gated DeltaNet) will hold its conv + recurrent state behind the same `LayerCache`
  interface, so the decoding loop never sees layer types.
- A forward in the cached modes reads, per row, `n_commit` tokens that are committed causally
  (appended to the prefix) followed by `n_block` tokens that form the current block (they see
  the prefix, the committed tokens and each other, and are never written to the prefix), then
  padding. Prefill, an AR step, a block preview and the fused "commit the finished block +
  preview the next one" pass are all this one layout with different counts.
- Attention layers write the K/V of *all* input tokens into the slots just past the committed
  length, as scratch, and only `advance()` moves the committed length. So a preview can never
  corrupt the prefix: the slots it writes are overwritten by the next forward.
- `copy_out` / `copy_in` move one row's committed state to and from the prefix cache across
  requests (`decoding/prefix_cache.py`): positions of K/V, or the whole state of a recurrent
  layer (`recurrent = True`), which summarises its prefix and cannot be cut by position.
"""

from __future__ import annotations

import torch

from clover.errors import CloverError
from clover.models.layout import StepLayout


class LayerCache:
    """Interface of a per-layer cache; subclasses hold the state of one layer type."""

    recurrent = False  # True: a state of the whole prefix, not one entry per position

    def copy_out(self, row: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """A copy of row's committed state: positions [start, end) of a positional cache, the
        whole state of a recurrent one (start, end ignored: it holds the committed length)."""
        raise NotImplementedError

    def copy_in(self, row: int, start: int, parts: tuple[torch.Tensor, ...]) -> None:
        """Write `copy_out`'s parts into row: at positions start.. of a positional cache, as
        the state of a recurrent one."""
        raise NotImplementedError

    def reserve(self, capacity: int) -> None:
        raise NotImplementedError

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (sequences leaving a batch)."""
        raise NotImplementedError

    def rollback(self, n: torch.Tensor) -> None:
        """Forget the last n[b] committed tokens of each row (rejected speculation). Caches
        indexed by length (KV) need nothing: the slots past the length are scratch."""

    def extend(self, other: LayerCache) -> None:
        """Append other's rows (a sequence joining a running batch)."""
        raise NotImplementedError

    def compact(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Move the entries at `slots` (ascending, each >= its destination) of row to
        positions start, start + 1, ...: the branch of a tree of drafts that was kept. Only
        positional caches can."""
        raise CloverError(f"{type(self).__name__} cannot keep one branch of a tree of drafts")


def kv_dtype(model: torch.nn.Module) -> torch.dtype:
    """The K/V cache dtype of a model: `model.kv_cache_dtype` if set, else the embedding
    weights' dtype, except float32 on CPU for 16-bit weights. Why: PyTorch's CPU attention
    kernel is several times slower in bfloat16 than in float32 for a decode step (one query
    row over the cache), and attention would then dominate a step of a small model
    (docs/history.md has the figures). The cache costs twice the memory of a bfloat16 one."""
    forced = getattr(model, "kv_cache_dtype", None)
    if forced is not None:
        return forced
    dtype = model.embed_dtype
    if model.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


class KVCache(LayerCache):
    """K/V of one attention layer: k, v [B, H_kv, capacity, D]."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.k = torch.zeros(batch, kv_heads, 0, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def reserve(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        B, H, _, D = self.k.shape
        k = self.k.new_zeros(B, H, capacity, D)
        v = self.v.new_zeros(B, H, capacity, D)
        k[:, :, : self.capacity] = self.k
        v[:, :, : self.capacity] = self.v
        self.k, self.v = k, v

    def write(self, k: torch.Tensor, v: torch.Tensor, layout: StepLayout) -> tuple:
        """Write k, v [B, H_kv, T, D] at slots lengths[b] + t; return keys/values to attend.

        Returns k, v [B, H_kv, S, D] with S = max(lengths) + T (what `layout.mask` covers).
        """
        if k.dtype != self.k.dtype:  # checked: a no-op `.to` still costs a dispatch
            k = k.to(self.k.dtype)
        if v.dtype != self.v.dtype:  # apart: a drafter's normed k can be float32, its v not
            v = v.to(self.v.dtype)
        T = k.shape[2]
        lengths = layout.lengths
        lo, hi = layout.length_range()
        if lo == hi:  # every row at the same length: a plain slice write
            self.k[:, :, lo : lo + T] = k
            self.v[:, :, lo : lo + T] = v
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            slots = lengths[:, None] + torch.arange(T, device=k.device)[None, :]  # [B, T]
            self.k[rows, :, slots] = k.transpose(1, 2)
            self.v[rows, :, slots] = v.transpose(1, 2)
        return self.k[:, :, : hi + T], self.v[:, :, : hi + T]

    def select(self, rows: torch.Tensor) -> None:
        self.k = self.k[rows]
        self.v = self.v[rows]

    def copy_out(self, row: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """-> k, v [H_kv, end - start, D], copies."""
        return self.k[row, :, start:end].clone(), self.v[row, :, start:end].clone()

    def copy_in(self, row: int, start: int, parts: tuple[torch.Tensor, ...]) -> None:
        k, v = parts  # [H_kv, n, D]
        self.reserve(start + k.shape[1])
        self.k[row, :, start : start + k.shape[1]] = k
        self.v[row, :, start : start + v.shape[1]] = v

    def compact(self, row: int, start: int, slots: torch.Tensor) -> None:
        slots = slots.to(self.k.device)
        end = start + len(slots)  # the index reads all sources before the slice is written
        self.k[row, :, start:end] = self.k[row, :, slots]
        self.v[row, :, start:end] = self.v[row, :, slots]

    def extend(self, other: KVCache) -> None:
        cap = max(self.capacity, other.capacity)
        self.reserve(cap)
        other.reserve(cap)
        self.k = torch.cat([self.k, other.k])
        self.v = torch.cat([self.v, other.v])


class ModelCache:
    """The whole model's cache: one `LayerCache` per layer and the committed length per row."""

    def __init__(self, layers: list[LayerCache], batch: int, max_length: int) -> None:
        self.layers = layers
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self.max_length = max_length  # the model's context (prompt + generation)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def prepare(self, num_tokens: int, n_valid: torch.Tensor | None = None) -> None:
        """Make room for a forward of `num_tokens` input positions (padding included) and
        refuse a row whose real tokens (n_valid[b]) would pass the context."""
        real = self.lengths + (num_tokens if n_valid is None else n_valid)
        if bool((real > self.max_length).any()):
            raise CloverError(
                f"sequence would reach {int(real.max())} tokens, over the model's context of "
                f"{self.max_length} (prompt + generation)"
            )
        # scratch slots: padding of short rows may land past the context; that is fine
        need = int(self.lengths.max()) + num_tokens
        for layer in self.layers:
            current = getattr(layer, "capacity", 0)
            if need > current:  # grow geometrically so long generations copy rarely
                layer.reserve(max(need, min(2 * current, self.max_length), 256))

    def advance(self, n_commit: torch.Tensor) -> None:
        self.lengths = self.lengths + n_commit

    def enable_rollback(self) -> None:
        """Ask layers whose state is not indexed by length (recurrent ones) to keep what
        `rollback` needs; speculative decoding turns this on."""
        for layer in self.layers:
            if hasattr(layer, "track"):
                layer.track = True

    def rollback(self, n: torch.Tensor) -> None:
        """n [B]: drop the last n[b] committed tokens of row b."""
        for layer in self.layers:
            layer.rollback(n)
        self.lengths = self.lengths - n

    def compact(self, row: int, start: int, slots: list[int]) -> None:
        """Row's entries at cache slots `slots` move to start, start + 1, ... in every layer
        (a tree pass's kept branch, before the rest is rolled back)."""
        if slots == list(range(start, start + len(slots))):
            return  # the branch is already in place (a chain, or the tree's first branch)
        index = torch.tensor(slots, dtype=torch.long, device=self.lengths.device)
        for layer in self.layers:
            layer.compact(row, start, index)

    def keep_branch(self, row: int, passed: int, first: int, branch: list[int]) -> None:
        """Row's last pass committed `passed` tokens, a tree of drafts; of them the kept
        branch (pass positions `branch`, ascending) moves to pass position `first` onward, so
        the path the answer took lies in order behind its root."""
        start = int(self.lengths[row]) - passed  # the pass's first slot
        self.compact(row, start + first, [start + i for i in branch])

    def extend(self, other: ModelCache) -> ModelCache:
        """Append other's rows; returns self."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.extend(theirs)
        self.lengths = torch.cat([self.lengths, other.lengths])
        return self

    def select(self, rows: torch.Tensor | list[int]) -> None:
        rows = torch.as_tensor(rows, dtype=torch.long)
        for layer in self.layers:
            layer.select(rows)
        self.lengths = self.lengths[rows]
