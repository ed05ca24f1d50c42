"""HF-format directories <-> state dicts: config.json + (sharded) safetensors, saving, and
`model_from_state`, the one place a (config, state dict) pair becomes a model.

Every reader (this one, `gguf.read_gguf`) returns (config dict, state dict with checkpoint
names) so one path builds the model; the architecture module owns the name map (`sanitize`,
beside its model code). Problems with files (missing, truncated, wrong shapes, unknown
architecture) raise `CloverError` naming the file or tensor. Saving writes into a temporary
directory next to the target and renames it, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from clover.errors import CloverError
from clover.exported import native_config
from clover.files import SAFETENSORS_DTYPES, read_safetensors, safetensors_header
from clover.models import DiffusionLM, architecture, build_model, make_config

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"


def read_config(directory: Path) -> dict:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise CloverError(f"no {CONFIG} in {directory}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CloverError(f"{path} is not valid JSON: {e}") from None
    return native_config(config)  # `clover export` output names its own model_type


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: the index's shards, model.safetensors, or every
    *.safetensors (a converted GGUF keeps its levels in another file beside the weights)."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CloverError(f"{index} is not a valid safetensors index: {e}") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CloverError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CloverError(f"no *.safetensors weights in {directory}")
    return files


def read_hf_dir(
    directory: Path, dtype: torch.dtype | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    config = read_config(directory)
    return config, read_safetensors(safetensors_files(directory), dtype)


def check_state(model: DiffusionLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Names and shapes of a (sanitized) state dict against the model, before any copy."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing:
        raise CloverError(f"{source}: missing tensor(s) {', '.join(missing[:5])}")
    if unexpected:
        raise CloverError(f"{source}: unexpected tensor(s) {', '.join(unexpected[:5])}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise CloverError(
                f"{source}: tensor {name} has shape {tuple(t.shape)}, "
                f"the config needs {tuple(own[name].shape)}"
            )


def check_dir(directory: Path) -> object:
    """config.json and the safetensors headers (no weights read) -> the validated config, the
    tensors' names and shapes checked against the architecture built on the meta device (the
    family's `sanitize` runs on shapes alone). `clover info DIR`."""
    config = make_config(read_config(directory))
    model = build_model(config, meta=True)
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(directory):
        with safetensors_header(f) as (_, _, header):
            for name, info in header.items():
                kind = SAFETENSORS_DTYPES.get(info["dtype"], torch.float32)
                state[name] = torch.empty(info["shape"], dtype=kind, device="meta")
    with torch.device("meta"):
        state = architecture(config.model_type).sanitize(state, config)
    check_state(model, state, str(directory))
    return config


def model_from_state(
    config_dict: dict, state: dict[str, torch.Tensor], source: str, dtype: torch.dtype
) -> DiffusionLM:
    """Build the model on the meta device and adopt the tensors (converted one at a time, so
    peak memory is one model in `dtype` plus one source tensor). Consumes `state`."""
    config = make_config(config_dict)
    model = build_model(config, meta=True)
    given, state = state, architecture(config.model_type).sanitize(state, config)
    check_state(model, state, source)
    for name in list(state):
        state[name] = state.pop(name).to(dtype).contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    # neither dict may keep the weights alive: quantization drops the float ones as it goes,
    # and a dict still holding them would keep every float weight in memory until the end
    given.clear()
    state.clear()
    model.reset_buffers()  # non-persistent buffers (RoPE frequencies) are not in checkpoints
    return model.eval()


def checkpoint_state(model: DiffusionLM) -> dict[str, torch.Tensor]:
    """The model's tensors under the names its family publishes (`to_checkpoint`, where the
    family has one: e.g. the Clover hybrid in the Qwen3.5 layout plus its own tensors), on the
    CPU and contiguous; `model_from_state` reads them back."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    arch = architecture(model.config.model_type)
    if hasattr(arch, "to_checkpoint"):
        state = {k: v.contiguous() for k, v in arch.to_checkpoint(state, model.config).items()}
    return state


def save_checkpoint(model: DiffusionLM, directory: Path, extra_files: Iterable[Path] = ()) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files) atomically into `directory`."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        state = checkpoint_state(model)
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        for f in extra_files:
            shutil.copy2(f, tmp / Path(f).name)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
