"""The names of an exported checkpoint (`clover export`): its config.json says
`"model_type": "clover"` and keeps the architecture our loader builds in
`"clover_architecture"` (clover.hf says why). Plain dicts, no imports: the loader reads such a
config (`native_config`) and `import clover` registers the type, both without loading the
other.
"""

from __future__ import annotations

MODEL_TYPE = "clover"
ARCHITECTURE_KEY = "clover_architecture"


def native_config(d: dict) -> dict:
    """An exported config dict -> the dict our architectures expect (others pass through)."""
    if not isinstance(d, dict) or d.get("model_type") != MODEL_TYPE:
        return d
    d = dict(d)
    d["model_type"] = d.pop(ARCHITECTURE_KEY, "llama")
    return d


def hf_config(d: dict) -> dict:
    """Our config dict -> the exported config.json (model_type transformers maps to us)."""
    d = dict(d)
    d[ARCHITECTURE_KEY] = d.get("model_type", "llama")
    d["model_type"] = MODEL_TYPE
    d["architectures"] = ["CloverForCausalLM"]
    return d
