"""Architectures by `model_type`: each module gives a config class, a model class, `sanitize`,
and (when llama.cpp files exist for it) `config_from_gguf` / `tensors_from_gguf`."""

from __future__ import annotations

from types import ModuleType

from clover.errors import CloverError
from clover.models import clover, llama
from clover.models.base import DiffusionLM

ARCHITECTURES: dict[str, ModuleType] = {t: llama for t in llama.MODEL_TYPES}
ARCHITECTURES.update({t: clover for t in clover.MODEL_TYPES})


def architecture(model_type: str | None) -> ModuleType:
    if model_type not in ARCHITECTURES:
        raise CloverError(
            f"unknown architecture {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


def make_config(d: dict) -> object:
    """A config.json dict -> the architecture's validated config dataclass."""
    return architecture(d.get("model_type")).Config.from_dict(d)


def build_model(config: object) -> DiffusionLM:
    return architecture(config.model_type).Model(config)


__all__ = ["ARCHITECTURES", "DiffusionLM", "architecture", "build_model", "make_config"]
