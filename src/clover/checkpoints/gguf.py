"""llama.cpp GGUF files, read where they lie (`GGUFFile`).

The header, the metadata and the tensor table are parsed from a memory map; a tensor's data is
a view of that map, never a copy. Large string arrays (a tokenizer's vocabulary and merges) are
walked but not decoded: loading needs their counts, and the tokenizer converter reads them
itself. Every problem with the file (not GGUF, truncated, a tensor past the end, an unknown
type) is a `CloverError` naming the file.

`read_gguf` is the float route (bfloat16/float32 loads, training, export): each tensor
dequantized once, into a state dict with the family's names. The int4 route packs the file's
own levels instead (`packed.py`).

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64;
each metadata entry is a string key, a u32 value type and the value; each tensor entry is a
string name, u32 dims, u64 extents (fastest-varying first), u32 ggml type, u64 offset from the
data start, which follows the header at the next multiple of `general.alignment` (32).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from clover.checkpoints import ggml
from clover.errors import CloverError
from clover.models import architecture

MAGIC = b"GGUF"
ALIGNMENT = 32
LONG_ARRAY = 1024  # string arrays longer than this are counted, not decoded
# metadata value types -> struct format (8: string, 9: array)
SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
# ggml type ids -> names (ggml.h), the ones a weight can have
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
FLOAT_SIZES = {"F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # ggml type name
    shape: tuple[int, ...]  # numpy order: [..., rows, cols], cols contiguous
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1]


def tensor_bytes(kind: str, count: int) -> int | None:
    """Bytes of `count` values of ggml type `kind`, None for a type Clover cannot read."""
    if kind in FLOAT_SIZES:
        return count * FLOAT_SIZES[kind]
    if kind in ggml.BLOCKS:
        per, size = ggml.BLOCKS[kind]
        return None if count % per else count // per * size
    return None


class _Cursor:
    """Reads the header's little-endian fields; running past the end is a truncated file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> object:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise CloverError(f"{self.path}: truncated GGUF header")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise CloverError(f"{self.path}: truncated GGUF header")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        size, pos = len(self.buf), self.pos
        for _ in range(count):
            if pos + 8 > size:
                raise CloverError(f"{self.path}: truncated GGUF header")
            pos += 8 + struct.unpack_from("<Q", self.buf, pos)[0]
        if pos > size:
            raise CloverError(f"{self.path}: truncated GGUF header")
        self.pos = pos

    def value(self, kind: int, key: str) -> object:
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise CloverError(f"{self.path}: metadata {key} has unknown type {kind}")
        item, count = self.take("I"), self.take("Q")
        if item == 8 and count > LONG_ARRAY:
            self.skip_strings(count)
            return _Counted(count)
        if item in SCALARS:
            size = struct.calcsize(SCALARS[item])
            if self.pos + size * count > len(self.buf):
                raise CloverError(f"{self.path}: truncated GGUF header")
            if count > LONG_ARRAY:  # e.g. token types, scores: a count is enough
                self.pos += size * count
                return _Counted(count)
            out = list(struct.unpack_from(f"<{count}{SCALARS[item]}", self.buf, self.pos))
            self.pos += size * count
            return out
        return [self.value(item, key) for _ in range(count)]


@dataclass(frozen=True)
class _Counted:
    count: int


class GGUFFile:
    """A GGUF file mapped into memory: `meta` (metadata; long arrays as `<key>.count`),
    `tensors` (name -> TensorInfo, in file order) and `raw(name)`, a tensor's bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CloverError(f"GGUF file not found: {self.path}")
        try:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file
            raise CloverError(f"cannot read GGUF file {self.path}: {e}") from None
        cur = _Cursor(self._map, self.path)
        if self._map[:4] != MAGIC:
            raise CloverError(f"{self.path} is not a GGUF file (no GGUF magic)")
        cur.pos = 4
        self.version, n_tensors, n_meta = cur.take("I"), cur.take("Q"), cur.take("Q")
        if self.version not in (2, 3):
            raise CloverError(f"{self.path}: GGUF version {self.version} (Clover reads 2 and 3)")
        if n_tensors > 1 << 20 or n_meta > 1 << 20:
            raise CloverError(f"{self.path}: implausible GGUF header (corrupt?)")
        self.meta: dict[str, object] = {}
        for _ in range(n_meta):
            key = cur.string()
            value = cur.value(cur.take("I"), key)
            if isinstance(value, _Counted):
                self.meta[f"{key}.count"] = value.count
            else:
                self.meta[key] = value
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = cur.take("I")
            if dims > 8:
                raise CloverError(f"{self.path}: tensor {name} has {dims} dimensions (corrupt?)")
            extents = [cur.take("Q") for _ in range(dims)]
            kind_id, offset = cur.take("I"), cur.take("Q")
            infos.append((name, extents, kind_id, offset))
        align = int(self.meta.get("general.alignment", ALIGNMENT) or ALIGNMENT)
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, extents, kind_id, offset in infos:
            kind = GGML_TYPES.get(kind_id, f"type {kind_id}")
            shape = tuple(int(n) for n in reversed(extents))
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            size = tensor_bytes(kind, count)
            if size is None:
                raise CloverError(
                    f"{self.path.name}: tensor {name} has ggml type {kind}, which Clover cannot "
                    f"read (supported: {', '.join([*FLOAT_SIZES, *ggml.BLOCKS])})"
                )
            start = data_start + offset
            if start + size > len(self._map):
                raise CloverError(
                    f"{self.path}: tensor {name} runs past the end of the file (truncated "
                    f"download? the file has {len(self._map)} bytes, it needs {start + size})"
                )
            self.tensors[name] = TensorInfo(name, kind, shape, start, size)

    @property
    def architecture(self) -> str | None:
        arch = self.meta.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as they lie in the file: uint8 [rows, bytes a row], read-only."""
        t = self.tensors[name]
        flat = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return flat.reshape(t.rows, -1)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's memory (the file keeps them; a later read
        maps them again): a pass over every tensor then holds about one at a time."""
        t = self.tensors[name]
        start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(AttributeError, OSError, ValueError):
            self._map.madvise(mmap.MADV_DONTNEED, start, t.offset + t.nbytes - start)

    def decode(self, name: str, rows: slice | None = None) -> ggml.Levels | np.ndarray:
        """Rows of a 2-D (or flattened) tensor: Levels for a quantized type, float32 for a
        float one (`ggml.decode`)."""
        t = self.tensors[name]
        data = self.raw(name) if rows is None else self.raw(name)[rows]
        return ggml.decode(data, t.type, data.shape[0], t.cols)

    def config(self) -> dict:
        """An HF-style config dict from the metadata (the family's `config_from_gguf`), with
        the file type kept (`auto` precision picks int4 for 4-bit files) and whether the LM
        head is tied to the embedding (no `output.weight`)."""
        arch = architecture(self.architecture)
        try:
            config = arch.config_from_gguf(self.meta)
        except (KeyError, TypeError, ValueError) as e:
            raise CloverError(f"{self.path.name}: GGUF metadata incomplete ({e})") from None
        file_type = self.meta.get("general.file_type")
        if file_type is not None:
            config["gguf_file_type"] = FILE_TYPES.get(int(file_type), str(file_type))
        if "output.weight" not in self.tensors:
            config["tie_word_embeddings"] = True
        return config

    def close(self) -> None:
        """Unmap the file (views of it must be gone: `raw` arrays keep the map alive)."""
        with contextlib.suppress(BufferError):
            self._map.close()


# llama.cpp's `llama_ftype` names (general.file_type), the ones `auto` precision reads
FILE_TYPES = {
    0: "ALL_F32", 1: "MOSTLY_F16", 2: "MOSTLY_Q4_0", 3: "MOSTLY_Q4_1", 7: "MOSTLY_Q8_0",
    8: "MOSTLY_Q5_0", 9: "MOSTLY_Q5_1", 10: "MOSTLY_Q2_K", 11: "MOSTLY_Q3_K_S",
    12: "MOSTLY_Q3_K_M", 13: "MOSTLY_Q3_K_L", 14: "MOSTLY_Q4_K_S", 15: "MOSTLY_Q4_K_M",
    16: "MOSTLY_Q5_K_S", 17: "MOSTLY_Q5_K_M", 18: "MOSTLY_Q6_K", 32: "MOSTLY_BF16",
}  # fmt: skip


def read_gguf(path: Path, progress: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """A GGUF file -> (HF-style config dict, float32 state dict with HF names): every tensor
    dequantized once (the float route; the int4 route packs levels instead, `packed.py`)."""
    gf = GGUFFile(path)
    config = gf.config()
    arch = architecture(gf.architecture)
    names = list(gf.tensors)
    if progress:
        names = tqdm(names, desc=f"dequantizing {gf.path.name}", unit="tensor")
    arrays: dict[str, np.ndarray] = {}
    for name in names:
        t = gf.tensors[name]
        out = gf.decode(name)
        if isinstance(out, ggml.Levels):
            out = out.dequantize()
        arrays[name] = out.reshape(t.shape)
    arrays = arch.tensors_from_gguf(arrays, dict(config))
    state = {k: torch.from_numpy(np.require(v, requirements=["C", "W"])) for k, v in arrays.items()}
    return config, state
