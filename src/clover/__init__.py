"""Clover: block-diffusion language models on your own hardware."""

from clover.version import __version__

__all__ = ["LLM", "GenerationSettings", "CloverError", "__version__"]

# transformers' Auto classes learn about exported Clover checkpoints when transformers loads them
from clover.hf import install as _install_hf  # noqa: E402

_install_hf()


def __getattr__(name: str) -> object:
    # lazy: `clover --version` and the tokenizer tools should not pay for importing torch
    if name in ("LLM", "GenerationSettings"):
        from clover import engine

        return getattr(engine, name)
    if name == "CloverError":
        from clover.errors import CloverError

        return CloverError
    raise AttributeError(name)
