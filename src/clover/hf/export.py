"""`clover export MODEL OUT_DIR`: any model Clover loads -> a Hugging Face style checkpoint.

The model is loaded through the engine (so a registry name or a GGUF file is converted first)
in float32 or bfloat16, never int4: the packed int4 modules have no HF layout. The directory
gets exactly what our loader and transformers read: config.json (model_type `clover`,
see `clover.hf`), model.safetensors (our state dict, names as in HF llama checkpoints), the
tokenizer files with the chat template inside tokenizer_config.json, and
generation_config.json holding our decoding defaults (decoder, block_size, threshold,
mask_token_id, eos ids, max_new_tokens), which `diffusion_generate` reads.

Everything is written into a temporary sibling directory that replaces OUT_DIR only when
complete; a non-empty OUT_DIR is replaced only with `force`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from clover.checkpoints.hf_dir import checkpoint_state
from clover.engine import LLM, GenerationSettings
from clover.errors import CloverError
from clover.hf import hf_config

EXPORT_DTYPES = ("float32", "bfloat16")
# transformers' generic class for a tokenizer.json; loads in transformers 4 and 5
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

__all__ = ["EXPORT_DTYPES", "export"]


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CloverError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CloverError(f"{out} is not empty; pass --force to replace it")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _copy_tokenizer(source: Path, target: Path) -> None:
    """tokenizer.json (+ special_tokens_map.json) as they are; tokenizer_config.json with a
    tokenizer class for AutoTokenizer and the chat template folded in."""
    if not (source / "tokenizer.json").is_file():
        raise CloverError(f"{source} has no tokenizer.json to export")
    for name in ("tokenizer.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    config_file = source / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    config.setdefault("tokenizer_class", TOKENIZER_CLASS)
    jinja = source / "chat_template.jinja"
    if jinja.is_file():
        if isinstance(config.get("chat_template"), list):  # named templates: keep the file
            shutil.copy2(jinja, target / jinja.name)
        else:  # the file overrides the config's template (as in HF and our tokenizer)
            config["chat_template"] = jinja.read_text(encoding="utf-8")
    if (source / "additional_chat_templates").is_dir():
        shutil.copytree(source / "additional_chat_templates", target / "additional_chat_templates")
    _write_json(target / "tokenizer_config.json", config)


def _write_checkpoint(llm: LLM, target: Path, dtype: str) -> None:

    state = checkpoint_state(llm.model)  # the family's published names (plus ours)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(llm.model.config.to_dict())
    config.pop("torch_dtype", None)  # transformers 5 reads `dtype`; a stale one would mislead
    config["dtype"] = dtype
    _write_json(target / "config.json", config)
    defaults = llm.default_settings(GenerationSettings())
    c = llm.model.config
    generation = {
        "decoder": defaults.decoder,
        "block_size": defaults.block_size,
        "threshold": defaults.threshold,
        "draft": defaults.draft,
        "max_new_tokens": defaults.max_tokens,
        "mask_token_id": c.mask_token_id,
        "eos_token_id": llm.eos_token_ids,  # config's and tokenizer's end-of-turn ids
        "bos_token_id": c.bos_token_id,
        "pad_token_id": c.pad_token_id,
    }
    _write_json(
        target / "generation_config.json", {k: v for k, v in generation.items() if v is not None}
    )
    _copy_tokenizer(Path(llm.directory), target)


def _replace_dir(staging: Path, out: Path) -> None:
    if not out.exists():
        os.replace(staging, out)
        return
    # a directory cannot be renamed over another: move the old one aside, then drop it
    retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    os.replace(out, retired / out.name)
    os.replace(staging, out)
    shutil.rmtree(retired, ignore_errors=True)


def export(
    model: str,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Write `model` (name, GGUF file or HF directory) as an HF-style checkpoint in `out_dir`."""
    if dtype not in EXPORT_DTYPES:
        raise CloverError(f"export dtype {dtype!r}: choose {' or '.join(EXPORT_DTYPES)}")
    out = Path(out_dir).expanduser()
    _check_target(out, force)  # before loading: a refusal should be instant

    llm = LLM(model, dtype=dtype, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_checkpoint(llm, staging, dtype)
        _check_target(out, force)  # it may have been filled while we loaded
        _replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
