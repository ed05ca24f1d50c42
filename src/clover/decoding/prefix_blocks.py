"""What the prefix cache keeps (`prefix_cache.py`): blocks of committed tokens with their K/V,
hashed into chains from a partition's root; snapshots (recurrent states plus the K/V of a
tail past a block); a lookup's hit; the counters /metrics reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Snapshot:
    tail: tuple[int, ...]  # tokens past the block it hangs from
    kv: torch.Tensor | None  # [L_attn, 2, H_kv, len(tail), D]; None without attention layers
    states: list[tuple[torch.Tensor, ...]]  # one per recurrent layer (`LayerCache.copy_out`)
    nbytes: int
    used: int = 0


@dataclass(eq=False)
class Block:
    id: int
    parent: Block | None
    tokens: tuple[int, ...]
    kv: torch.Tensor | None  # [L_attn, 2, H_kv, block_tokens, D]
    end: int  # position just past this block
    nbytes: int = 0
    used: int = 0
    refs: int = 0  # rows pinning this block (their deepest one)
    children: int = 0
    snaps: dict[tuple[int, ...], Snapshot] = field(default_factory=dict)


@dataclass
class Hit:
    length: int  # tokens served from the cache
    path: list[Block]  # full blocks from the root
    snap: Snapshot | None


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one token
    prompt_tokens: int = 0  # tokens of the prompts looked up
    cached_tokens: int = 0  # of those, served from the cache
    saved_blocks: int = 0
    saved_snapshots: int = 0
    evictions: int = 0  # blocks and snapshots dropped to make room
    skipped: int = 0  # blocks or snapshots not saved: no room even after eviction


def nbytes(tensors: list[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


EMPTY_ROOT = Block(-1, None, (), None, 0)  # a partition with nothing cached: no chains
