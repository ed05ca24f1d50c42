"""The int4 route for GGUF files: each weight's own levels packed once into the CPU kernels'
tiles, kept in one file per GGUF and read back at every start (`load_packed`).

Nothing is rounded on the way. A 4-bit type (Q4_0, Q4_1, Q4_K) becomes int4 tiles; a wider one
(Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) 8-bit (or 5-bit) tiles in its own groups, the LM head included
(`wide="int4"` rounds those to 4 bits instead: smaller, not exact); float matrices are
quantized as an HF checkpoint's are (`quant.quantize_int4`). The embedding stays in the GGUF
and a row is decoded when it is looked up (`GGUFEmbedding`).

Why a file: packing reorders every weight into 16-row tiles and factors the k-quants' scales,
seconds for the default model; reading the packed file back costs a fraction of a second.
k-quant scales are kept in their compact form only (int8 multiples of a base,
`qgemm.pack_compact`), so the file is no bigger than the GGUF's own blocks; the float32 scales
that wide passes read are made from them at load.

The file (`PackFile`) is read whole into anonymous memory at load, not mapped: the kernels
stream it faster from there. It holds b"CLVPACK1", the tensors (each 64-byte aligned), a JSON
footer (the pack version, the GGUF it came from, its config, how each module is built), the
footer's length (u64) and b"CLVPEND1". It is written beside its place and renamed into it, so
a reader sees a whole file or none; one that fails its checks is reported in one line and
packed again.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
import sys
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from clover.checkpoints import ggml
from clover.checkpoints.gguf import GGUFFile, tensor_bytes
from clover.checkpoints.hf_dir import check_state
from clover.errors import CloverError
from clover.files import atomic_write
from clover.kernels.qgemm import QWeight
from clover.models import architecture, build_model, make_config
from clover.models.base import DiffusionLM
from clover.quant import Int4Part, int8_rows, quantize_int4, quantized_linear

PACK_VERSION = 2
HEAD, TAIL = b"CLVPACK1", b"CLVPEND1"
ALIGN = 64
BLOCK_VALUES = 1 << 22  # a large matrix is packed about this many values of rows at a time
DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
EMBEDDING = "model.embed_tokens.weight"
HEAD_NAME = "lm_head"


class PackError(CloverError):
    """A packed file that cannot be used as it is (another version, damaged): pack again."""


# --- the file ---------------------------------------------------------------------------------


class PackWriter:
    """Appends tensors to an open file; `finish` writes the footer."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.pos, self.index = fh, len(HEAD), {}
        fh.write(HEAD)

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous().cpu()
        pad = -self.pos % ALIGN
        self.fh.write(b"\0" * pad)
        self.pos += pad
        nbytes = t.numel() * t.element_size()
        if nbytes:
            self.fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        kind = str(t.dtype).removeprefix("torch.")
        self.index[name] = [kind, list(t.shape), self.pos, nbytes]
        self.pos += nbytes

    def finish(self, meta: dict) -> None:
        footer = json.dumps({"version": PACK_VERSION, "meta": meta, "tensors": self.index})
        raw = footer.encode()
        self.fh.write(raw + struct.pack("<Q", len(raw)) + TAIL)


def anonymous_memory(size: int) -> mmap.mmap:
    """`size` bytes of private anonymous memory, in huge pages where the kernel gives them.
    Private: Python's anonymous maps are shared by default, and shared memory takes huge pages
    only where the system enables them for shmem (commonly never)."""
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if private:
        buf = mmap.mmap(-1, max(size, 1), flags=private)
    else:  # Windows: no flags
        buf = mmap.mmap(-1, max(size, 1))
    with contextlib.suppress(AttributeError, OSError):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


class _Reader(threading.Thread):
    """Reads a file's first `size` bytes into anonymous memory (huge pages where the kernel
    gives them), in the background: the read releases the GIL, so a loader goes on (the
    tokenizer) meanwhile. The kernels' passes over such memory are faster than over a
    mapping of the file's own pages (docs/checkpoints.md)."""

    def __init__(self, path: Path, size: int) -> None:
        super().__init__(daemon=True)
        self.path, self.size, self.error = path, size, None
        self.buf = anonymous_memory(size)
        self.start()

    def run(self) -> None:
        view = memoryview(self.buf)[: self.size]
        try:
            with open(self.path, "rb") as fh:
                done = 0
                while done < self.size:
                    n = fh.readinto(view[done:])
                    if not n:
                        raise PackError(f"{self.path}: shorter than its footer says (damaged)")
                    done += n
        except (OSError, PackError) as e:
            self.error = e if isinstance(e, PackError) else PackError(f"{self.path}: {e}")
        finally:
            view.release()

    def data(self) -> np.ndarray:
        self.join()
        if self.error is not None:
            raise self.error
        return np.frombuffer(self.buf, dtype=np.uint8, count=self.size)


class PackFile:
    """A packed file, checked and read into memory; `tensor(name)` is a view of it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as fh:
                head = fh.read(len(HEAD))
                fh.seek(max(size - 16, 0))
                tail = fh.read(16)
                n = struct.unpack("<Q", tail[:8])[0] if len(tail) == 16 else 0
                if head != HEAD or tail[8:] != TAIL or not 0 < n <= size - 24 - len(HEAD):
                    raise PackError(f"{self.path}: not a whole packed file (cut short?)")
                fh.seek(size - 16 - n)
                footer = json.loads(fh.read(n))
        except OSError as e:
            raise PackError(f"{self.path}: cannot read it ({e.strerror or e})") from None
        except (ValueError, UnicodeDecodeError):
            raise PackError(f"{self.path}: its footer is damaged") from None
        version = footer.get("version") if isinstance(footer, dict) else None
        if version != PACK_VERSION:
            raise PackError(f"{self.path}: packed by format version {version}, this Clover "
                            f"reads version {PACK_VERSION}")  # fmt: skip
        self.meta: dict = footer.get("meta", {})
        self.index: dict = footer.get("tensors", {})
        end = size - 16 - n
        for name, (kind, shape, offset, nbytes) in self.index.items():
            count = int(np.prod(shape, dtype=np.int64))
            if (
                kind not in DTYPES
                or count * DTYPES[kind].itemsize != nbytes
                or offset + nbytes > end
            ):
                raise PackError(f"{self.path}: tensor {name} does not fit the file (damaged)")
        self._reader = _Reader(self.path, end)
        self._map: np.ndarray | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def tensor(self, name: str) -> torch.Tensor:
        if self._map is None:
            self._map = self._reader.data()
        kind, shape, offset, nbytes = self.index[name]
        raw = torch.from_numpy(self._map[offset : offset + nbytes])
        return raw.view(DTYPES[kind]).reshape(shape)


# --- packing a GGUF ---------------------------------------------------------------------------


class _Source:
    """A GGUF's tensors by the family's names, in the family's row order."""

    def __init__(self, gf: GGUFFile, config: dict) -> None:
        self.gf, self.config = gf, config
        self.arch = architecture(gf.architecture)
        self.names = {self.arch.gguf_name(n): n for n in gf.tensors}

    def _map(self, name: str, a: np.ndarray) -> np.ndarray:
        (out,) = self.arch.tensors_from_gguf({name: a}, dict(self.config)).values()
        return np.ascontiguousarray(out)

    def type(self, hf: str) -> str:
        return self.gf.tensors[self.names[hf]].type

    def shape(self, hf: str) -> tuple[int, ...]:
        return self.gf.tensors[self.names[hf]].shape

    def floats(self, hf: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor (or some rows of a matrix) dequantized to float32, in the family's
        row order."""
        name = self.names[hf]
        t = self.gf.tensors[name]
        out = self.gf.decode(name, rows)
        w = out.dequantize() if isinstance(out, ggml.Levels) else out
        if rows is None:
            w = self._map(name, w.reshape(t.shape))
        self.gf.release(name)
        return torch.from_numpy(w)

    def rows_in_place(self, hf: str) -> bool:
        """Whether the family keeps the file's row order for this tensor (llama's q/k: no)."""
        name = self.names[hf]
        N = self.shape(hf)[0]
        return np.array_equal(self._map(name, np.arange(N).reshape(N, 1))[:, 0], np.arange(N))

    def levels(self, hf: str, rows: slice | None = None) -> tuple:
        """A quantized matrix's levels: (q [N, K], scale, low or None [N, K / group])."""
        name = self.names[hf]
        lv = self.gf.decode(name, rows)
        parts = (lv.q, lv.scale, lv.low)
        if rows is None:  # a row map (llama's q/k order) applies to whole matrices only
            parts = tuple(None if p is None else self._map(name, p) for p in parts)
        self.gf.release(name)
        return tuple(None if p is None else torch.from_numpy(np.ascontiguousarray(p))
                     for p in parts)  # fmt: skip


def _bits(kind: str, wide: str) -> int:
    """8 for a type stored wider than 4 bits (its own levels), unless `wide` is int4; else 4."""
    wider = kind in ggml.BLOCKS and kind not in ggml.INT4_TYPES
    return 8 if wider and wide == "int8" else 4


def _levels(src: _Source, hf: str, wide: str, rows: slice | None = None) -> tuple:
    """(q, scale, low) as the matrix is packed (`_bits`): a 4-bit or kept-wide type's own
    levels; a wider type rounded to 4 bits (wide="int4"); a float one quantized to 4 bits
    from bfloat16, as an HF checkpoint's is."""
    kind = src.type(hf)
    if kind in ggml.INT4_TYPES or _bits(kind, wide) == 8:
        return src.levels(hf, rows)
    if kind in ggml.BLOCKS:
        q, scale, low = src.levels(hf, rows)
        w = q.float().reshape(q.shape[0], scale.shape[1], -1) * scale[..., None]
        w = (w if low is None else w + low[..., None]).reshape(q.shape)
        return quantize_int4(w)
    return quantize_int4(src.floats(hf, rows).to(torch.bfloat16))


def _fits(src: _Source, hf: str) -> bool:
    N, K = src.shape(hf)
    return N % 16 == 0 and K % 32 == 0


def _qweight(src: _Source, hf: str, wide: str, rows: slice | None = None) -> QWeight:
    bits = _bits(src.type(hf), wide)
    return QWeight.from_levels(*_levels(src, hf, wide, rows), bits=bits)


def _head(src: _Source, hf: str, wide: str, rows: slice | None = None) -> QWeight:
    """The LM head: a quantized type's own levels (4- or 8-bit, never rounded again, whatever
    `wide` says); a float one in int8 per row, as an HF checkpoint's head."""
    kind = src.type(hf)
    if kind in ggml.BLOCKS:
        return _qweight(src, hf, "int8", rows)
    q, scale = int8_rows(src.floats(hf, rows).to(torch.bfloat16))
    N, K = q.shape
    return QWeight.from_levels(q, scale.float()[:, None].expand(N, K // 32), bits=8)


def _blocks(src: _Source, hf: str) -> list[slice | None]:
    """Row blocks of about BLOCK_VALUES values each, in whole 16-row tiles, so a large matrix's
    unpacked levels are never all in memory at once; one block (None: all rows) for a small
    matrix or one whose rows the family reorders across the matrix (llama's q/k)."""
    N, K = src.shape(hf)
    if N * K <= BLOCK_VALUES or not src.rows_in_place(hf):
        return [None]
    step = max(16, BLOCK_VALUES // K // 16 * 16)
    return [slice(i, min(i + step, N)) for i in range(0, N, step)]


def _signature(w: QWeight) -> tuple:
    return w.bits, w.group, w.scales.dtype, w.mults is None, w.has_low


def _assembled(pieces: list[Callable[[], QWeight]], N: int) -> QWeight | None:
    """QWeights of consecutive rows, made one at a time, as one [N, K] matrix (tiles are whole
    rows, so they are copied in place); None where the pieces came out packed differently (a
    bit width or scale form is decided per piece), and the caller packs the rows at once."""
    first = pieces[0]()
    if len(pieces) == 1:
        return first
    q = torch.empty((N // 16, *first.q.shape[1:]), dtype=first.q.dtype)
    small = {k: [] for k in ("scales", "mults", "bases")}
    at = 0
    for make in pieces:
        part = first if make is pieces[0] else make()
        if _signature(part) != _signature(first) or part.in_features != first.in_features:
            return None
        q[at : at + part.out_features // 16] = part.q
        at += part.out_features // 16
        for k in small:
            small[k].append(getattr(part, k))
    cat = {k: None if v[0] is None else torch.cat(v) for k, v in small.items()}
    return QWeight(first.bits, first.group, N, first.in_features, q, cat["scales"],
                   mults=cat["mults"], bases=cat["bases"])  # fmt: skip


def _matrix(src: _Source, hf: str, wide: str, make: Callable = _qweight) -> QWeight:
    """One matrix packed a block of rows at a time (`_blocks`); make: `_qweight` or `_head`."""
    pieces = [partial(make, src, hf, wide, rows) for rows in _blocks(src, hf)]
    return _assembled(pieces, src.shape(hf)[0]) or make(src, hf, wide, None)


def _put(writer: PackWriter, path: str, w: QWeight, bias: torch.Tensor | None) -> dict:
    attrs, tensors = w.stored()
    for key, t in tensors.items():
        writer.add(f"{path}.{key}", t)
    if bias is not None:
        writer.add(f"{path}.bias", bias.float())
    return {"w": attrs, "bias": bias is not None}


def _group(src: _Source, names: list[str], wide: str) -> QWeight | None:
    """Projections of one input (q/k/v, gate/up) as one matrix, when they share a format:
    all 4-bit, or all 8-bit in the same groups and form (levels are per row, so each part
    keeps its own); None where they differ (each is packed alone)."""
    hfs = [f"{n}.weight" for n in names]
    bits = {_bits(src.type(hf), wide) for hf in hfs}
    if len(bits) != 1 or not all(_fits(src, hf) for hf in hfs):
        return None
    kinds = {src.type(hf) for hf in hfs}
    if bits == {8} and len({_group_size(k) for k in kinds}) != 1:  # Q6_K (16) beside Q8_0 (32)
        return None
    pieces = [partial(_qweight, src, hf, wide, rows) for hf in hfs for rows in _blocks(src, hf)]
    whole = _assembled(pieces, sum(src.shape(hf)[0] for hf in hfs))
    if whole is not None:
        return whole
    levels = [_levels(src, hf, wide) for hf in hfs]  # the rows at once, as one decision
    if len({s.shape[1] for _, s, _ in levels}) != 1 or len({lo is None for *_, lo in levels}) != 1:
        return None
    q, scale, low = (None if x[0] is None else torch.cat(x) for x in zip(*levels))
    return QWeight.from_levels(q, scale, low, bits=bits.pop())


def _group_size(kind: str) -> int:
    """Values a scale covers in the 8-bit levels of a `kind` tensor: Q6_K's 16, else 32."""
    return 16 if kind == "Q6_K" else 32


def _biases(src: _Source, names: list[str]) -> torch.Tensor | None:
    have = [f"{n}.bias" in src.names for n in names]
    if not any(have):
        return None
    if not all(have):
        raise CloverError(f"{src.gf.path.name}: {names[have.index(False)]} has no bias")
    return torch.cat([src.floats(f"{n}.bias") for n in names])


def pack_gguf(gf: GGUFFile, target: Path, wide: str = "int8", progress: bool = True) -> Path:
    """Pack `gf`'s weights into `target` (atomically): every linear of the family's model,
    the LM head (the embedding's levels when tied), the norms, and where the embedding lies
    in the GGUF. Names and shapes are checked against the model first."""
    if wide not in ("int8", "int4"):
        raise CloverError(f"wide {wide!r}: int8 or int4")
    config = gf.config()
    src = _Source(gf, config)
    cfg = make_config(config)
    skeleton = build_model(cfg, meta=True)
    with torch.device("meta"):
        shapes = {hf: torch.empty(src.shape(hf)) for hf in src.names}
        state = src.arch.sanitize(dict(shapes), cfg)
    check_state(skeleton, state, str(gf.path))
    linears = [name for name, m in skeleton.named_modules() if isinstance(m, nn.Linear)]
    grouped = [(owner, [f"{owner}.{n}" for n in names])
               for owner, module in skeleton.named_modules()
               for names in getattr(module, "packed_projections", ())]  # fmt: skip
    bar = None
    if progress:
        bar = tqdm(total=len(linears) + 1, desc=f"packing {gf.path.name} (once)",
                   unit="matrix", file=sys.stderr)  # fmt: skip

    def write(tmp: Path) -> None:
        meta: dict = {"config": config, "linears": {}, "dense": [], "floats": [], "wide": wide}
        done: set[str] = set()
        with open(tmp, "wb") as fh:
            writer = PackWriter(fh)
            for owner, names in grouped:
                w = _group(src, names, wide)
                if w is None:
                    continue
                path = f"{owner}.fused_{names[0].rsplit('.', 1)[1]}"
                entry = _put(writer, path, w, _biases(src, names))
                start, entry["parts"] = 0, []
                for n in names:
                    stop = start + src.shape(f"{n}.weight")[0]
                    entry["parts"].append([n.rsplit(".", 1)[1], start, stop])
                    start = stop
                meta["linears"][path] = entry
                done.update(names)
                if bar is not None:
                    bar.update(len(names))
            for name in linears:
                if name in done:
                    continue
                hf = f"{name}.weight"
                bias = _biases(src, [name])
                if not _fits(src, hf):  # stays a bfloat16 linear
                    writer.add(hf, src.floats(hf).to(torch.bfloat16))
                    if bias is not None:
                        writer.add(f"{name}.bias", bias.to(torch.bfloat16))
                    meta["dense"].append(name)
                elif name == HEAD_NAME:
                    w = _matrix(src, hf, wide, _head)
                    meta["linears"][name] = _put(writer, name, w, bias)
                else:
                    meta["linears"][name] = _put(writer, name, _matrix(src, hf, wide), bias)
                if bar is not None:
                    bar.update(1)
            if HEAD_NAME not in linears:  # tied: the head packed from the embedding's blocks
                if not _fits(src, EMBEDDING):
                    shape = src.shape(EMBEDDING)
                    raise CloverError(f"{gf.path.name}: the tied LM head's shape {shape} does not "
                                      "fit the kernels")  # fmt: skip
                w = _matrix(src, EMBEDDING, wide, _head)
                meta["linears"][HEAD_NAME] = _put(writer, HEAD_NAME, w, None)
            if bar is not None:
                bar.update(1)
            for hf in state:
                if hf != EMBEDDING and hf.rsplit(".", 1)[0] not in linears:
                    writer.add(hf, src.floats(hf))
                    meta["floats"].append(hf)
            t = gf.tensors[src.names[EMBEDDING]]
            meta["embedding"] = {"type": t.type, "offset": t.offset, "rows": t.rows,
                                 "cols": t.cols}  # fmt: skip
            writer.finish(meta)

    try:
        atomic_write(target, write)
    finally:
        if bar is not None:
            bar.close()
    return target


# --- loading ----------------------------------------------------------------------------------


class GGUFEmbedding(nn.Module):
    """An embedding table read from a GGUF file's own blocks, where they lie: the rows a pass
    looks up are decoded then (`ggml.decode`), so the table is never held as floats; the rows
    of recent lookups are kept (up to `KEEP` of them), since a decode step or a drafter's
    chain looks up one or a few ids at a time, often again.
    ids [...] -> [..., D] in `dtype`; the same numbers as the dequantized table in `dtype`."""

    KEEP = 4096

    def __init__(self, path: Path, kind: str, offset: int, rows: int, cols: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
        super().__init__()
        row_bytes = tensor_bytes(kind, cols)
        self.table = np.memmap(path, dtype=np.uint8, mode="r", offset=offset,
                               shape=(rows, row_bytes))  # fmt: skip
        self.kind, self.num_embeddings, self.embedding_dim = kind, rows, cols
        self.dtype = dtype
        self.kept: dict[int, torch.Tensor] = {}

    def _decode(self, ids: np.ndarray) -> torch.Tensor:
        """Rows `ids` (distinct, in range) -> [len(ids), D] in `dtype`."""
        out = ggml.decode(self.table[ids], self.kind, len(ids), self.embedding_dim)
        rows = out.dequantize() if isinstance(out, ggml.Levels) else out
        return torch.from_numpy(rows).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).tolist()
        if flat and (min(flat) < 0 or max(flat) >= self.num_embeddings):
            raise IndexError(f"token id outside the embedding's {self.num_embeddings} rows")
        if len(flat) > 64:  # a prompt: decode its distinct rows at once, keep none
            uniq, inverse = np.unique(np.asarray(flat), return_inverse=True)
            table = self._decode(uniq)[torch.from_numpy(inverse)]
        else:
            missing = sorted(set(flat) - self.kept.keys())
            if missing and len(self.kept) + len(missing) > self.KEEP:
                self.kept.clear()  # all of this lookup's rows are decoded again
                missing = sorted(set(flat))
            if missing:
                for i, row in zip(missing, self._decode(np.asarray(missing))):
                    self.kept[i] = row
            table = torch.stack([self.kept[i] for i in flat]) if flat else torch.empty(
                0, self.embedding_dim, dtype=self.dtype)  # fmt: skip
        return table.reshape(*ids.shape, -1).to(ids.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} (in the GGUF)"


def load_packed(pack: PackFile, gguf_path: Path, config: dict) -> DiffusionLM:
    """The model a packed file describes: quantized linears over the mapped tiles, the norms
    in bfloat16, the embedding read from `gguf_path`. `config`: the pack's config with any
    overrides applied."""
    meta = pack.meta
    cfg = make_config(config)
    model = build_model(cfg, meta=True)
    for path, entry in meta["linears"].items():
        keys = ("q", "scales", "mults", "bases")
        w = QWeight.from_stored(entry["w"], {k: pack.tensor(f"{path}.{k}") for k in keys
                                             if f"{path}.{k}" in pack})  # fmt: skip
        bias = pack.tensor(f"{path}.bias") if entry["bias"] else None
        linear = quantized_linear(w, bias)
        if path == HEAD_NAME:
            linear.float_output = True
            model.quantized_head = linear
            if hasattr(model, "lm_head"):
                del model.lm_head
            continue
        owner, name = _split(model, path)
        setattr(owner, name, linear)
        for part, start, stop in entry.get("parts", ()):
            setattr(owner, part, Int4Part(linear, start, stop))
    state = {name: pack.tensor(name).to(torch.bfloat16) for name in meta["floats"]}
    for path in meta["dense"]:  # bfloat16 linears (shapes the kernels do not tile)
        for part in ("weight", "bias"):
            if f"{path}.{part}" in pack:
                state[f"{path}.{part}"] = pack.tensor(f"{path}.{part}")
    e = meta["embedding"]
    model.model.embed_tokens = GGUFEmbedding(gguf_path, e["type"], e["offset"], e["rows"],
                                             e["cols"])  # fmt: skip
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_buffers()
    return model.eval()


def _split(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    owner, _, name = path.rpartition(".")
    return model.get_submodule(owner), name
