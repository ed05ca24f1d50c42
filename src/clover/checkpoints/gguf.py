"""llama.cpp GGUF files -> (HF-style config dict, float32 state dict with HF names).

The architecture module maps names and metadata (`config_from_gguf`, `tensors_from_gguf`,
beside its model code); this module reads the file and dequantizes its tensors. A GGUF is
converted once into an HF-format directory under the user cache (`load.prepare_checkpoint`),
so later starts read safetensors directly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from clover.errors import CloverError
from clover.models import architecture


def gguf_metadata(reader: object) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue  # large and handled by the tokenizer converter
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 (exotic field types are not needed for weights)
            continue
    return meta


def read_gguf(path: Path, progress: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """A GGUF file -> (HF-style config dict, float32 state dict with HF names)."""
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
    arch_name = meta.get("general.architecture")
    arch = architecture({"llama": "llama", "qwen2": "qwen2"}.get(arch_name, arch_name))
    config = arch.config_from_gguf(meta)
    file_type = meta.get("general.file_type")
    if file_type is not None:
        try:  # kept in config.json: `auto` precision picks int4 for 4-bit sources
            config["gguf_file_type"] = gguf.LlamaFileType(int(file_type)).name
        except ValueError:
            config["gguf_file_type"] = str(file_type)
    arrays: dict[str, np.ndarray] = {}
    tensors = reader.tensors
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=f"dequantizing {path.name}", unit="tensor")
    for t in tensors:
        try:
            arrays[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise CloverError(
                f"{path.name}: tensor {t.name} has type {t.tensor_type.name}, "
                "which cannot be dequantized"
            ) from None
    arrays = arch.tensors_from_gguf(arrays, config)
    state = {k: torch.from_numpy(np.require(v, requirements=["C", "W"])) for k, v in arrays.items()}
    return config, state
