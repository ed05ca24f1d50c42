"""Hugging Face interop: exported checkpoints that `transformers` loads as Clover models.

Decisions, and why:

- An exported config.json says `"model_type": "clover"` and keeps the architecture our loader
  builds (llama, qwen2, mistral, ...) in `"clover_architecture"`. A distinct model_type is
  the only thing that makes `AutoModelForCausalLM.from_pretrained(dir)` pick our wrapper:
  transformers maps a config to a class by model_type alone, and taking over "llama" would
  hijack every llama checkpoint in the process. One type serves every Clover architecture
  (the wrapper builds whichever one the config names). `native_config` turns such a dict back
  into ours at read time, so our own loader reads both and in memory the config keeps its
  real model_type (see `clover.checkpoints.hf_dir.read_config`).
- `import clover` registers with transformers without importing it (that costs seconds, and
  transformers 5 offers no plugin entry point for its Auto classes). `install()` puts a
  post-import hook on `sys.meta_path` (see `clover.hf.hooks`): right after transformers
  executes `transformers.models.auto.configuration_auto` (or at once, if it already has),
  `CloverConfig` is registered with `AutoConfig` (cheap: its base class is loaded by then).
  The model class is registered when the first `CloverConfig` is built, i.e. exactly when
  someone is about to load such a model; defining it imports `transformers.modeling_utils`,
  seconds that processes using transformers only for tokenizers should not pay.
- `register()` does all of it now, for code that wants it explicit. Interop needs
  transformers >= 5 (its dataclass configs); with 4.x the hook does nothing.
"""

from __future__ import annotations

from clover.exported import ARCHITECTURE_KEY, MODEL_TYPE, hf_config, native_config
from clover.hf.hooks import when_imported

CONFIG_MODULE = "transformers.models.auto.configuration_auto"

__all__ = [
    "ARCHITECTURE_KEY",
    "MODEL_TYPE",
    "hf_config",
    "install",
    "native_config",
    "register",
    "register_model",
]


def _supported() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5  # configs became dataclasses in 5


def _register_config(_module: object = None) -> None:
    if not _supported():
        return  # the hook stays silent: transformers 4 keeps working, just without our classes
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, AutoConfig

    from clover.hf.config import CloverConfig  # transformers, imported only once it is loaded

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, CloverConfig)
        CloverConfig.on_first_build = register_model


def register_model() -> None:
    """Register `CloverForCausalLM` with `AutoModelForCausalLM` (imports transformers' model
    machinery; idempotent)."""
    import clover.hf.modeling  # noqa: F401  (registers itself on import)


def register() -> None:
    """Register config and model with transformers' Auto classes now (imports transformers)."""
    if not _supported():
        from clover.errors import CloverError

        raise CloverError("Hugging Face interop needs transformers >= 5")
    _register_config()
    register_model()


def install() -> None:
    """Register lazily: when transformers loads its AutoConfig module (called by `import
    clover`; costs microseconds)."""
    when_imported(CONFIG_MODULE, _register_config)
