"""`CloverConfig`: the transformers config class of exported Clover checkpoints.

transformers 5 configs are strict dataclasses that accept unknown keys as plain attributes, so
every field of our own config (sizes, `mask_token_id`, `default_decoder`, ...) rides along
untouched. A few keys are declared here because transformers would otherwise rewrite them:
`rope_theta` / `rope_scaling` would be folded into its `rope_parameters`, and
`tie_word_embeddings` is read by its weight-tying logic. Their defaults equal ours.

Building one calls `on_first_build` once, which `clover.hf` sets to register the model class:
a config is built exactly when a checkpoint of ours is about to be loaded.
"""

from __future__ import annotations

from transformers.configuration_utils import PreTrainedConfig

from clover.exported import ARCHITECTURE_KEY, MODEL_TYPE

__all__ = ["CloverConfig"]


class CloverConfig(PreTrainedConfig):
    model_type = MODEL_TYPE

    clover_architecture: str = "llama"  # what our loader builds (llama, qwen2, mistral, ...)
    rope_theta: float | int = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False

    on_first_build = None  # a callable, run once when the first config is built

    def __post_init__(self, **kwargs: object) -> None:
        super().__post_init__(**kwargs)
        hook, type(self).on_first_build = type(self).on_first_build, None
        if hook is not None:
            hook()

    def clover_dict(self, names: set[str]) -> dict:
        """The values of our config's fields `names` that this config holds, with our
        model_type (the architecture) instead of `clover`."""
        d = {name: getattr(self, name) for name in names if hasattr(self, name)}
        d["model_type"] = getattr(self, ARCHITECTURE_KEY)
        return d
