"""The models on this machine: the registry's installed ones and what the Hugging Face cache holds.

Other tools (`huggingface-cli download`, llama.cpp's `-hf`, transformers) fill the Hugging Face
cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`): one folder per
repo, `models--ORG--NAME/snapshots/REVISION/...`, whose files link to content-addressed blobs.
Clover reads those files where they lie, headers only, and runs them by reference:
`ORG/NAME:QUANT` (a GGUF in the repo picked by its quant tag, case-insensitive),
`ORG/NAME/FILE.gguf`, or `ORG/NAME` (a GGUF when the repo holds one kind, else its
Hugging Face format weights). `refs/main` names the revision used; another is chosen with
`ORG/NAME@REVISION`.

`clover list` shows all of it; `clover rm` removes only what Clover downloaded itself (a
registry model's assembled file, its packages, what Clover derived from the file).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from clover.checkpoints.gguf import FILE_TYPES, GGUFFile
from clover.errors import CloverError

# ORG/NAME, then :QUANT, /PATH/IN/REPO.gguf or nothing, then @REVISION
HUB_REF = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+)|/(?P<file>[\w./-]+\.gguf))?"
    r"(?:@(?P<revision>[\w.-]+))?$"
)
HF_FILES = (".json", ".safetensors", ".jinja", ".model", ".txt")  # a Hugging Face format model
SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def hub_ref(text: str) -> re.Match | None:
    """The parts of a Hugging Face reference, or None (a path: `dir/file.gguf` is one)."""
    m = HUB_REF.match(text.strip())
    return m if m is not None and not m["repo"].lower().endswith(".gguf") else None


class NotCached(CloverError):
    """The Hugging Face cache does not hold what a reference names (a download may)."""


def cached_or_fetched(
    ref: str, fetch_missing: bool = True, progress: bool = True
) -> tuple[Path, str]:
    """`resolve_hub`, downloading first what the cache lacks (unless offline or told not to)."""
    try:
        return resolve_hub(ref)
    except NotCached:
        if offline() or not fetch_missing:
            raise
    fetch(ref, progress)
    return resolve_hub(ref)


@dataclass(frozen=True)
class LocalModel:
    ref: str  # what --model takes
    kind: str  # "registry", "gguf" (a file in the Hugging Face cache) or "hf" (a directory)
    path: Path
    size: int  # bytes on disk
    quant: str  # Q4_K_M, F16, ... (a GGUF's file type) or the safetensors' dtype
    architecture: str
    clover_owned: bool = False  # Clover downloaded it (`clover rm` may remove it)


def hub_cache() -> Path:
    """The Hugging Face cache's hub folder, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def repo_folder(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


def snapshot(repo: str, revision: str | None = None) -> Path | None:
    """The cached snapshot of `repo` at `revision` (a branch or tag in refs/, or a commit
    hash), default main; None when the cache holds none."""
    folder = repo_folder(repo)
    name = revision or "main"
    ref = folder / "refs" / name
    commit = ref.read_text().strip() if ref.is_file() else name
    path = folder / "snapshots" / commit
    return path if path.is_dir() else None


def gguf_quant(path: Path) -> tuple[str, str]:
    """(quant tag, architecture) of a GGUF from its header."""
    gf = GGUFFile(path)
    try:
        ftype = gf.meta.get("general.file_type")
        quant = FILE_TYPES.get(int(ftype), str(ftype)) if ftype is not None else "?"
        return quant.removeprefix("MOSTLY_").removeprefix("ALL_"), str(gf.architecture)
    finally:
        gf.close()


def quant_of_name(name: str) -> str | None:
    """The quant tag a GGUF's file name carries (`...-Q4_K_M.gguf` -> Q4_K_M)."""
    m = re.search(r"(?i)[-_.]((?:I?Q\d[\w]*?)|F16|BF16|F32)(?:-\d{5}-of-\d{5})?\.gguf$", name)
    return m.group(1).upper() if m else None


def resolve_hub(ref: str) -> tuple[Path, str]:
    """A Hugging Face reference found in the cache -> (the file or directory, "gguf" or
    "hf"). Raises CloverError with what to do when the cache does not hold it."""
    m = hub_ref(ref)
    if m is None:
        raise CloverError(f"{ref!r} is not a Hugging Face reference (ORG/NAME[:QUANT])")
    repo, quant, file, revision = m["repo"], m["quant"], m["file"], m["revision"]
    root = snapshot(repo, revision)
    if root is None:
        at = f" at {revision}" if revision else ""
        how = "HF_HUB_OFFLINE is set, so nothing is downloaded" if offline() else "not found"
        raise NotCached(
            f"{ref}: no such file or directory, and {repo}{at} is not in the Hugging Face "
            f"cache ({hub_cache()}; {how}): unset HF_HUB_OFFLINE, or fill the cache with "
            f"`huggingface-cli download {repo}`"
        )
    ggufs = sorted(p for p in root.rglob("*.gguf") if p.is_file())
    if file is not None:
        path = root / file
        if not path.is_file():
            raise NotCached(f"{repo} has no {file} in the cache; it holds: {_names(ggufs, root)}")
        return _one_file(path, root), "gguf"
    if quant is not None:
        hits = [p for p in ggufs if (quant_of_name(p.name) or "").lower() == quant.lower()]
        if not hits:
            tags = sorted({quant_of_name(p.name) or p.name for p in ggufs})
            raise NotCached(
                f"{repo} has no {quant} GGUF in the cache; it holds: {', '.join(tags) or 'none'}"
            )
        return _one_file(hits[0], root), "gguf"
    if (root / "config.json").is_file() and any(root.glob("*.safetensors")):
        return root, "hf"
    if len({quant_of_name(p.name) for p in ggufs}) == 1:
        return _one_file(ggufs[0], root), "gguf"
    if ggufs:
        tags = sorted({quant_of_name(p.name) or p.name for p in ggufs})
        choices = ", ".join(tags)
        raise CloverError(f"{repo} holds several GGUFs; pick one: {repo}:{tags[0]} ({choices})")
    raise NotCached(f"{repo} in the cache holds no GGUF and no safetensors with config.json")


def _names(paths: list[Path], root: Path) -> str:
    return ", ".join(str(p.relative_to(root)) for p in paths) or "no GGUF"


def _one_file(path: Path, root: Path) -> Path:
    shard = SHARD.search(path.name)
    if shard is not None and shard.group(2) != "00001":
        raise CloverError(
            f"{path.relative_to(root)} is one of {int(shard.group(2))} parts of a split GGUF; "
            "Clover reads single-file GGUFs (llama.cpp's `llama-gguf-split --merge` joins them)"
        )
    return path


def hub_models() -> list[LocalModel]:
    """Every runnable model in the Hugging Face cache (main revisions), headers read only."""
    out: list[LocalModel] = []
    root = hub_cache()
    for folder in sorted(root.glob("models--*")) if root.is_dir() else []:
        repo = folder.name.removeprefix("models--").replace("--", "/", 1)
        snap = snapshot(repo)
        if snap is None:
            continue
        for path in sorted(p for p in snap.rglob("*.gguf") if p.is_file()):
            shard = SHARD.search(path.name)
            if shard is not None and shard.group(2) != "00001":
                continue  # a split GGUF's part: Clover reads single files
            try:
                quant, arch = gguf_quant(path)
            except CloverError:
                continue  # not readable as a GGUF: nothing Clover could run
            tag = quant_of_name(path.name)
            quant = tag if quant == "?" and tag else quant
            ref = f"{repo}:{tag}" if tag else f"{repo}/{path.relative_to(snap)}"
            out.append(LocalModel(ref, "gguf", path, path.stat().st_size, quant, arch))
        config = snap / "config.json"
        weights = list(snap.glob("*.safetensors"))
        if config.is_file() and weights:
            try:
                cfg = json.loads(config.read_text())
            except (OSError, ValueError):
                continue
            size = sum(p.stat().st_size for p in weights)
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "?")
            arch = str(cfg.get("model_type") or "?")
            out.append(LocalModel(repo, "hf", snap, size, dtype, arch))
    return out


# --- downloads -------------------------------------------------------------------------------


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch(ref: str, progress: bool = True) -> None:
    """Download what `ref` names into the Hugging Face cache with huggingface_hub (resumable,
    the shared cache, HF_TOKEN, HF_ENDPOINT, its progress bars): one GGUF (by quant tag or
    path), or a Hugging Face format repo's config, tokenizer and safetensors. Each failure is
    one line saying what to do."""
    # the Hub client: only to download (it reads HF_* settings on import: passed explicitly)
    import huggingface_hub
    from huggingface_hub import errors

    m = hub_ref(ref)
    repo, quant, file, revision = m["repo"], m["quant"], m["file"], m["revision"]
    endpoint = os.environ.get("HF_ENDPOINT") or None
    cache = str(hub_cache())
    try:
        info = huggingface_hub.HfApi(endpoint=endpoint).model_info(repo, revision=revision)
        files = [s.rfilename for s in info.siblings or []]
        names = _wanted(repo, files, quant, file)
        if progress:
            print(f"clover: downloading {repo} into {cache}", file=sys.stderr)
        for name in names:
            huggingface_hub.hf_hub_download(
                repo, name, revision=revision, cache_dir=cache, endpoint=endpoint
            )
    except errors.GatedRepoError:
        raise CloverError(
            f"{repo} is gated: accept its terms on its Hub page, then set HF_TOKEN (or run "
            "`huggingface-cli login`)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise CloverError(
            f"{repo}: no such repo on the Hub (a private one needs HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise CloverError(f"{repo} has no revision {revision!r}") from None
    except errors.HfHubHTTPError as e:
        raise CloverError(f"the Hub refused {repo}: {str(e).splitlines()[0]}") from None
    except CloverError:
        raise
    except Exception as e:  # noqa: BLE001 (no network, a full disk, the client's transport)
        raise CloverError(
            f"could not download {repo} ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            f"connect, or fill {cache} another way"
        ) from None


def _wanted(repo: str, files: list[str], quant: str | None, file: str | None) -> list[str]:
    """The files a reference needs, from the repo's list."""
    ggufs = [f for f in files if f.endswith(".gguf")]
    tags = sorted({quant_of_name(f) or f for f in ggufs})
    if file is not None:
        if file not in files:
            raise CloverError(f"{repo} has no {file}; its GGUFs: {', '.join(ggufs) or 'none'}")
        return [file]
    if quant is not None:
        hits = [f for f in ggufs if (quant_of_name(f) or "").lower() == quant.lower()]
        if not hits:
            raise CloverError(f"{repo} has no {quant} GGUF; it has: {', '.join(tags) or 'none'}")
        shard = SHARD.search(hits[0])
        if shard is not None and shard.group(2) != "00001":
            raise CloverError(
                f"{repo}'s {quant} is a GGUF split in {int(shard.group(2))} parts; Clover reads "
                "single-file GGUFs (llama.cpp's `llama-gguf-split --merge` joins them)"
            )
        return hits[:1]
    if "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return [f for f in files if "/" not in f and f.endswith(HF_FILES)]
    if len(tags) == 1:
        return ggufs[:1]
    if ggufs:
        raise CloverError(
            f"{repo} has several GGUFs; pick one: {repo}:{tags[0]} ({', '.join(tags)})"
        )
    raise CloverError(f"{repo} holds no GGUF and no safetensors with config.json")
