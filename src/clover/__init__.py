"""Clover: block-diffusion language models on your own hardware."""

__version__ = "0.1.0"
