"""llama.cpp GGUF files -> (HF-style config dict, float32 state dict with HF names).

The architecture module maps names and metadata (`config_from_gguf`, `tensors_from_gguf`,
beside its model code); this module reads the file and dequantizes its tensors. A GGUF is
converted once into an HF-format directory under the user cache (`load.prepare_checkpoint`),
so later starts read safetensors directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from clover.checkpoints import ggml
from clover.errors import CloverError
from clover.models import architecture

QUANT_FILE = "gguf_quant.safetensors"  # beside a converted checkpoint: `GGUFQuant`
SCALE, LOW = ":scale", ":low"


def gguf_metadata(reader: object) -> dict:
    meta = {}
    for key, entry in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            meta[f"{key}.count"] = len(entry.data)  # large: the tokenizer converter reads them
            continue
        try:
            meta[key] = entry.contents()
        except Exception:  # noqa: BLE001 (exotic field types are not needed for weights)
            continue
    return meta


@dataclass
class GGUFQuant:
    """How a GGUF stored each weight, by HF name: its ggml type, and for quantized matrices
    the per-group scale (and offset, for affine types) [N, K / group] float32, so a kernel
    can take the file's own integer levels (`levels`) instead of rounding the floats again."""

    types: dict[str, str] = field(default_factory=dict)
    scale: dict[str, torch.Tensor] = field(default_factory=dict)
    low: dict[str, torch.Tensor] = field(default_factory=dict)  # absent: symmetric type

    def save(self, path: Path) -> None:
        tensors = {f"{k}{SCALE}": v.contiguous() for k, v in self.scale.items()}
        tensors.update({f"{k}{LOW}": v.contiguous() for k, v in self.low.items()})
        save_file(tensors, str(path), metadata={"gguf_types": json.dumps(self.types)})

    def bits(self, name: str) -> int:
        """4 for the types whose levels are our int4 layout (0..15, groups of 32), else 8."""
        return 4 if self.types[name] in ggml.INT4_TYPES else 8

    def levels(self, name: str, weight: torch.Tensor) -> tuple:
        """weight [N, K] float32 as dequantized -> (q int32 [N, K], scale, low or None,
        bits): its levels, recovered exactly (the weight was computed as q * scale (+ low)
        in float32, which is checked)."""
        scale, low = self.scale[name], self.low.get(name)
        N, K = weight.shape
        w = weight.float().reshape(N, scale.shape[1], -1)
        base = w if low is None else w - low[..., None]
        safe = torch.where(scale != 0, scale, 1.0)[..., None]  # a zero scale: any level, take 0
        q = (base / safe).round()
        back = q * scale[..., None]
        if low is not None:
            back = back + low[..., None]
        if not torch.equal(back, w):
            raise CloverError(
                f"{name}: the converted weights do not hold the GGUF's levels (a damaged "
                "conversion?); delete it (clover cache lists it) to convert again"
            )
        return q.to(torch.int32).reshape(N, K), scale, low, self.bits(name)

    @classmethod
    def read(cls, directory: Path) -> GGUFQuant | None:
        """The record `save` wrote into a converted checkpoint, or None (not from a GGUF)."""
        path = Path(directory) / QUANT_FILE
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), "pt") as f:
                types = json.loads(f.metadata()["gguf_types"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        except (OSError, KeyError, ValueError, SafetensorError) as e:
            raise CloverError(f"cannot read {path}: {e}") from None
        quant = cls(types)
        for k, v in tensors.items():
            if k.endswith(SCALE):
                quant.scale[k[: -len(SCALE)]] = v
            elif k.endswith(LOW):
                quant.low[k[: -len(LOW)]] = v
        return quant


def read_gguf(
    path: Path, progress: bool = False
) -> tuple[dict, dict[str, torch.Tensor], GGUFQuant]:
    """A GGUF file -> (HF-style config dict, float32 state dict with HF names, how each
    weight was stored). Our own decoders (`ggml`) for the common types, the gguf package's
    reference dequantizer for the rest."""
    import gguf
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise CloverError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 (the reader raises many types on bad files)
        raise CloverError(f"cannot read GGUF file {path} (truncated or not GGUF?): {e}") from None
    meta = gguf_metadata(reader)
    arch = architecture(meta.get("general.architecture"))
    config = arch.config_from_gguf(meta)
    file_type = meta.get("general.file_type")
    if file_type is not None:
        try:  # kept in config.json: `auto` precision picks int4 for 4-bit sources
            config["gguf_file_type"] = gguf.LlamaFileType(int(file_type)).name
        except ValueError:
            config["gguf_file_type"] = str(file_type)
    arrays: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    scales: dict[str, np.ndarray] = {}
    lows: dict[str, np.ndarray] = {}
    tensors = reader.tensors
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=f"dequantizing {path.name}", unit="tensor")
    for t in tensors:
        kind = t.tensor_type.name
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order: [rows..., cols]
        types[t.name] = kind
        if kind in ggml.DECODERS or kind in ("F32", "F16", "BF16"):
            rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            out = ggml.decode(t.data, kind, rows, shape[-1])
            if isinstance(out, ggml.Levels):
                if len(shape) == 2:
                    scales[t.name] = out.scale
                    if out.low is not None:
                        lows[t.name] = out.low
                out = out.dequantize()
            arrays[t.name] = out.reshape(shape)
            continue
        try:
            arrays[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise CloverError(
                f"{path.name}: tensor {t.name} has type {kind}, which cannot be dequantized"
            ) from None
    # the family's map renames (and for llama re-orders q/k rows); scales and offsets are
    # per row, so the same map applies to them (on a copy of the config: it is data, not
    # the model, that may tell a map whether embeddings are tied)
    arrays = arch.tensors_from_gguf(arrays, config)
    quant = GGUFQuant({arch.gguf_name(k): v for k, v in types.items()})
    for target, source in ((quant.scale, scales), (quant.low, lows)):
        for k, v in arch.tensors_from_gguf(source, dict(config)).items():
            target[k] = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    state = {k: torch.from_numpy(np.require(v, requirements=["C", "W"])) for k, v in arrays.items()}
    return config, state, quant
