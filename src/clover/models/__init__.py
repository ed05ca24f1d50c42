"""Architectures by `model_type`: each module gives a config class, a model class, `sanitize`
(checkpoint names -> its modules), and where they apply `to_checkpoint` (the inverse, for
saving in the published layout) and `config_from_gguf` / `tensors_from_gguf` (llama.cpp).

`make_config` first brings a config.json into one shape (`hf_config_dict`): transformers 5
writes RoPE settings under `rope_parameters`, a multimodal checkpoint nests its language model
under `text_config`, and some published model types have names of their own for a family we
run (`ALIASES`). Model types we know and cannot run say why (`REFUSED`).
"""

from __future__ import annotations

from types import ModuleType

from clover.errors import CloverError
from clover.models import clover, llada2, llama, qwen3
from clover.models.base import ConfigMixin, DiffusionLM, on_meta

ARCHITECTURES: dict[str, ModuleType] = {t: llama for t in llama.MODEL_TYPES}
ARCHITECTURES.update({t: qwen3 for t in qwen3.MODEL_TYPES})
ARCHITECTURES.update({t: clover for t in clover.MODEL_TYPES})
ARCHITECTURES.update({t: llada2 for t in llada2.MODEL_TYPES})

_FULL_BIDIRECTIONAL = (
    "attends bidirectionally over the whole sequence (prompt and answer together) and is "
    "decoded as one block that the prompt also reads; Clover commits the prompt and each "
    "finished block causally into a cache, and a prompt that attends to the answer would have "
    "to be recomputed at every step, with no cache: this engine's layout cannot run it"
)
REFUSED = {
    "Dream": f"Dream {_FULL_BIDIRECTIONAL}",
    "dream": f"Dream {_FULL_BIDIRECTIONAL}",
    "llada": f"LLaDA {_FULL_BIDIRECTIONAL}",
}


def architecture(model_type: str | None) -> ModuleType:
    if model_type in REFUSED:
        raise CloverError(f"model_type {model_type!r} is not supported: {REFUSED[model_type]}")
    if model_type not in ARCHITECTURES:
        raise CloverError(
            f"unknown architecture {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


def hf_config_dict(d: dict) -> dict:
    """A config.json as transformers 4/5 or a published checkpoint writes it -> the flat form
    our config classes read (unknown keys stay, for saving)."""
    d = dict(d)
    text = d.get("text_config")
    if isinstance(text, dict) and d.get("model_type") in clover.MULTIMODAL_TYPES:
        # a vision-language checkpoint: we run its language model (its own keys win)
        outer = {k: v for k, v in d.items() if k != "text_config"}
        d = {**outer, **text}
    if "num_local_experts" in d:  # transformers 5's name for some families' expert count
        d.setdefault("num_experts", d["num_local_experts"])
    rope = d.get("rope_parameters")
    if isinstance(rope, dict):
        d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if "partial_rotary_factor" in rope:
            d.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
        if rope.get("rope_type", "default") != "default":
            d.setdefault("rope_scaling", rope)
    return d


def make_config(d: dict) -> object:
    """A config.json dict -> the architecture's validated config dataclass."""
    d = hf_config_dict(d)
    return architecture(d.get("model_type")).Config.from_dict(d)


def build_model(config: ConfigMixin, meta: bool = False) -> DiffusionLM:
    """The architecture's model for `config`; meta: shapes only, on the meta device, with no
    initializer run (the caller assigns every tensor)."""
    if not meta:
        return architecture(config.model_type).Model(config)
    with on_meta():
        return architecture(config.model_type).Model(config)


__all__ = ["ARCHITECTURES", "DiffusionLM", "architecture", "build_model", "make_config", "on_meta"]
