"""A model name, a GGUF file or an HF directory -> a ready model + tokenizer (`load`).

The steps, in order, each decided here once:
1. resolve: a registry name (pulled if missing), a `.gguf` file, an HF directory, or a
   shape preset (random weights, the base model's tokenizer);
2. precision and device: `auto` is int4 for a 4-bit GGUF source, else bfloat16 where the CPU
   has bf16 instructions, else float32; off the CPU, bfloat16 (int4/int8 are CPU kernels);
3. the weights: a GGUF at int4 with Clover's kernels maps its packed levels (`packed`: packed
   once per file, the embedding read from the GGUF itself); anything else is read as floats
   (a GGUF dequantized, an HF directory's safetensors), adopted by the architecture
   (`hf_dir.model_from_state`) and quantized last where int4/int8 was asked for;
4. the registry's decoding defaults, draft adapter and drafter; then the move to the device.
A GGUF's tokenizer is converted once into its cache entry (`cache`, `gguf_tokenizer`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from clover import kernels
from clover.checkpoints import cache
from clover.checkpoints.gguf import GGUFFile, read_gguf
from clover.checkpoints.gguf_tokenizer import convert_gguf_tokenizer
from clover.checkpoints.hf_dir import CONFIG, model_from_state, read_config, read_hf_dir
from clover.checkpoints.packed import PACK_VERSION, PackError, PackFile, load_packed, pack_gguf
from clover.checkpoints.registry import BASE_MODEL, ResolvedModel, resolve
from clover.errors import CloverError
from clover.files import atomic_write_text
from clover.models import make_config
from clover.models.adapter import keep_float32, load_adapter
from clover.models.base import ConfigMixin, DiffusionLM
from clover.models.clover import CloverModel, preset_config
from clover.models.drafter import Drafter, drafter_vocabulary, load_drafter
from clover.quant import quantize_linears, quantize_model, release_freed_memory, set_dots_x
from clover.tokenizer import Tokenizer

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int8": torch.bfloat16,  # weight-only int8, bf16 activations (clover.quant)
    "int4": torch.bfloat16,  # weight-only int4 groups of 32, bf16 activations
}
PRESETS = ("clover-tiny", "clover-35b-a3b")  # architecture shapes with random weights
FOUR_BIT_FILES = ("MOSTLY_Q4_0", "MOSTLY_Q4_1", "MOSTLY_Q4_K")  # auto precision: int4


@dataclass
class Loaded:
    """What `load` returns: the model (on its device, at its precision) and how it was made."""

    model: DiffusionLM
    tokenizer: Tokenizer
    name: str
    dtype: str  # the precision chosen (never "auto")
    device: torch.device
    directory: Path | None  # the tokenizer's folder: an HF directory, a GGUF's cache entry's
    resolved: ResolvedModel | None  # None for a preset
    adapter: str | None  # the draft adapter file attached, if any
    drafter: str | None = None  # the drafter file loaded, if any
    # that drafter (a trained one, or a smaller model of the same tokenizer), on the model's
    # device and precision
    drafter_model: Drafter | DiffusionLM | None = None


def gguf_entry(resolved: ResolvedModel, progress: bool = True) -> Path:
    """The cache entry of a GGUF file (`cache`): its sha256 checked against the registry's
    pin, its tokenizer converted on first use."""
    cache.remove_legacy(progress)
    sha = cache.file_sha256(resolved.path, progress)
    pinned = resolved.entry.sha256 if resolved.entry else None
    if pinned is not None and sha != pinned:  # a split model's assembled file, changed since
        raise CloverError(
            f"{resolved.path} has sha256 {sha}, not the pinned {pinned}; delete it and run "
            f"`clover pull {resolved.entry.name}` to assemble it again"
        )
    entry = cache.entry_dir(resolved.path, sha)
    tokenizer, config = entry / "tokenizer", entry / CONFIG
    if not (tokenizer / "tokenizer.json").is_file() or not config.is_file():
        removed = cache.prune()  # before writing: a full disk may be full of stale entries
        if progress and removed:
            print(cache.removed_summary(removed), file=sys.stderr)
        try:
            text = json.dumps(GGUFFile(resolved.path).config(), indent=1)
            convert_gguf_tokenizer(resolved.path, tokenizer)
            atomic_write_text(config, text)
        except OSError as e:
            why = e.strerror or e
            raise CloverError(f"cannot write to the cache at {entry.parent}: {why}; free space "
                              "there or set $CLOVER_CACHE") from None  # fmt: skip
    cache.note_use(entry, resolved.path, sha)
    return entry


def gguf_config(entry: Path, resolved: ResolvedModel) -> dict:
    """The GGUF's config dict as its entry keeps it (`gguf_entry`), overrides applied."""
    try:
        config = json.loads((entry / CONFIG).read_text())
    except (OSError, ValueError):  # damaged: read the header again
        config = GGUFFile(resolved.path).config()
    return {**config, **_overrides(resolved)}


def tokenizer_dir(resolved: ResolvedModel, progress: bool = True) -> Path:
    """The folder holding the model's tokenizer.json: an HF directory itself, or the GGUF's
    converted tokenizer in its cache entry."""
    if resolved.kind == "hf":
        return resolved.path
    return gguf_entry(resolved, progress) / "tokenizer"


def model_config(resolved: ResolvedModel) -> dict:
    """The model's config dict from the header alone (no weights read), registry overrides
    applied."""
    if resolved.kind == "hf":
        return read_config(resolved.path)
    return {**GGUFFile(resolved.path).config(), **_overrides(resolved)}


def packed_weights(
    resolved: ResolvedModel, entry: Path, wide: str = "int8", progress: bool = True
) -> PackFile:
    """The GGUF's packed weights in its cache entry, packed now where there are none (or the
    ones there cannot be used: another format version, a damaged file, said in one line)."""
    path = entry / f"weights-{wide}-v{PACK_VERSION}.pack"
    if path.is_file():
        try:
            return PackFile(path)
        except PackError as e:
            print(f"clover: {e}; packing it again", file=sys.stderr)
    for old in entry.glob("weights-*.pack"):  # other versions (not wides): never read again
        if not old.name.endswith(f"-v{PACK_VERSION}.pack"):
            old.unlink(missing_ok=True)
    gf = GGUFFile(resolved.path)
    try:
        pack_gguf(gf, path, wide, progress)
    except OSError as e:
        raise CloverError(f"cannot write {path}: {e.strerror or e}; free space there or set "
                          "$CLOVER_CACHE") from None  # fmt: skip
    finally:
        gf.close()
        release_freed_memory()  # the packing's temporaries: a first start peaks as later ones
    return PackFile(path)


def resolve_device(name: str) -> torch.device:
    """ "auto" (cuda when visible, else cpu), "cpu", "cuda", "cuda:N" -> a device; a CUDA
    device that is not visible is a clear error here rather than a crash later."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise CloverError(f"--device {name!r}: expected cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CloverError(f"--device {name}: no CUDA device is visible")
    return dev


def device_dtype(device: torch.device, dtype: str) -> str:
    """The precision to load at on `device`: off the CPU, auto means bfloat16 and the
    weight-only int4/int8 kernels (CPU ones) are refused."""
    if device.type == "cpu":
        return dtype
    if dtype in ("int4", "int8"):
        raise CloverError(
            f"--dtype {dtype} is a CPU precision; on {device} use bfloat16 or float32"
        )
    return "bfloat16" if dtype == "auto" else dtype


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_fast(device: torch.device) -> bool:
    """Whether PyTorch's bfloat16 matmul is fast on `device`: any accelerator, a CPU with bf16
    instructions. Without them PyTorch multiplies bfloat16 far slower than float32."""
    return device.type != "cpu" or cpu_has_bf16()


def auto_dtype(config: dict) -> str:
    """int4 for 4-bit GGUF sources (their own levels), else bfloat16 where the CPU has bf16
    instructions, else float32."""
    if not cpu_has_bf16():
        return "float32"
    if str(config.get("gguf_file_type", "")).startswith(FOUR_BIT_FILES):
        return "int4"
    return "bfloat16"


def mask_from_tokenizer(config: ConfigMixin, tokenizer: Tokenizer) -> None:
    """A family that names its [MASK] token only in the tokenizer (`config.mask_token`, e.g.
    SDAR's `<|MASK|>`, Fast-dLLM v2's `|<MASK>|`) gets its id from there; a model with no
    [MASK] at all decodes autoregressively by default (its block decoders need one)."""
    text = getattr(config, "mask_token", None)
    if config.mask_token_id is None and text:
        config.mask_token_id = tokenizer.token_to_id(text)
        if config.mask_token_id is None or config.mask_token_id >= config.vocab_size:
            raise CloverError(f"the tokenizer has no {text} token in the model's vocabulary "
                              "(the [MASK] this model needs)")  # fmt: skip
    if config.mask_token_id is None and config.default_decoder != "ar":
        config.default_decoder = "ar"


def _preset_model(name: str, progress: bool) -> tuple[DiffusionLM, Tokenizer]:
    """A Clover-architecture preset with random weights (seed 0) and the default model's
    tokenizer: it exercises the whole mechanism; its output is meaningless."""

    config = preset_config(name)
    if config.num_params > 2e9:
        raise CloverError(
            f"{name} is a shape preset of {config.num_params / 1e9:.1f}B parameters with no "
            "weights; `clover info` describes it, generation needs a checkpoint"
        )
    tokenizer = Tokenizer.from_dir(tokenizer_dir(resolve(BASE_MODEL, progress=progress), progress))
    if tokenizer.vocab_size > config.vocab_size:
        raise CloverError(f"{name}: vocabulary smaller than the tokenizer's")
    torch.manual_seed(0)
    return CloverModel(config).eval(), tokenizer


def load(
    model: str,
    *,
    dtype: str = "auto",
    progress: bool = True,
    adapter: str | Path | None = None,
    device: str = "cpu",
    drafter: str | Path | None = None,
    wide: str = "int8",
    draft_wide: str = "int4",
) -> Loaded:
    """adapter: a draft adapter file to attach; a registry name that ships one attaches its
    own. drafter: a drafter file for self_spec draft="drafter" (a registry name that ships one
    loads its own unless another is given; "none": no drafter, and a default that drafted from
    it drafts from the rest of its sources, lookup at least), or a smaller model of the same
    tokenizer (a name, GGUF file or HF directory) that drafts as a whole, loaded at `dtype`.
    device: cpu, cuda, cuda:N or auto (`resolve_device`): weights load on the CPU, then move.
    wide (int4 from a GGUF): the tensors stored wider than 4 bits keep their 8-bit levels
    ("int8") or are rounded to 4 bits ("int4": smaller, not exact). draft_wide: the same for a
    draft model's tensors; its precision changes no answer (verification keeps the model's
    tokens), only how fast and how often it drafts right, so by default its wider tensors are
    rounded to 4 bits: fewer bytes a draft pass (docs/drafter.md)."""
    if dtype not in DTYPES and dtype != "auto":
        raise CloverError(f"dtype {dtype!r}: choose auto or one of {', '.join(DTYPES)}")
    for name, value in (("wide", wide), ("draft_wide", draft_wide)):
        if value not in ("int8", "int4"):
            raise CloverError(f"{name} {value!r}: int8 or int4")
    dev = resolve_device(device)
    dtype = device_dtype(dev, dtype)
    resolved, directory, packed = None, None, False
    if model in PRESETS:
        net, tokenizer = _preset_model(model, progress)
        dtype = "float32" if dtype == "auto" else dtype
        net.to(DTYPES[dtype])
        name = model
    else:
        resolved = resolve(model, progress=progress)
        if resolved.kind == "gguf":
            entry = gguf_entry(resolved, progress)
            directory, config = entry / "tokenizer", gguf_config(entry, resolved)
        else:
            directory, config = resolved.path, read_config(resolved.path)
        make_config(config)  # an unknown or refused family says so before any weight is read
        if dtype == "auto":
            dtype = auto_dtype(config)
        packed = resolved.kind == "gguf" and dtype == "int4" and kernels.load() is not None
        if packed:
            pack = packed_weights(resolved, entry, wide, progress)  # read in the background
            tokenizer = Tokenizer.from_dir(directory)  # meanwhile
            net = load_packed(pack, resolved.path, {**pack.meta["config"], **_overrides(resolved)})
        else:
            if resolved.kind == "gguf":
                config, state = read_gguf(resolved.path, progress=progress)
                config.update(_overrides(resolved))
            else:
                config, state = read_hf_dir(directory, DTYPES[dtype])
            net = model_from_state(config, state, str(resolved.path), DTYPES[dtype])
            tokenizer = Tokenizer.from_dir(directory)
        name = resolved.name
        entry = resolved.entry
        if entry is not None and entry.adapter is not None and adapter is None:
            adapter = entry.adapter_path
        if entry is not None and drafter is None:
            drafter = entry.default_drafter
        if entry is not None:
            entry.apply_decoding(net.config, drafter)
        mask_from_tokenizer(net.config, tokenizer)
    if str(drafter) == "none":
        drafter = None
    if adapter is not None:
        if not Path(adapter).is_file():
            raise CloverError(f"adapter file {adapter} not found")
        load_adapter(net, Path(adapter))
        if not packed:
            net.to(DTYPES[dtype])
        adapter = str(adapter)
    if dtype in ("int4", "int8") and not packed:
        quantize_model(net, dtype)
    if adapter is not None:
        keep_float32(net)
    net.to(dev)
    if drafter is not None and not _is_drafter_file(drafter):  # a draft model
        d = _draft_model(str(drafter), net, tokenizer, dtype, progress, device, draft_wide)
        drafter = str(drafter)
    elif drafter is not None:  # self_spec draft="drafter" (models/drafter.py)
        if not Path(drafter).is_file():
            raise CloverError(f"drafter file {drafter} not found")
        # its own module: the model's state, casts and quantization leave it alone
        if dtype == "int4":  # its linears in 4 bits too (from the file's weights as they are)
            d = quantize_linears(load_drafter(Path(drafter), net, linear_dtype=torch.bfloat16))
            for m in d.modules():  # shapes the kernel does not tile: float32, as the rest
                if isinstance(m, torch.nn.Linear):
                    m.float()
            release_freed_memory()  # the file's tensors
        else:
            d = load_drafter(Path(drafter), net).to(dev)
        drafter = str(drafter)
    else:
        d = None
    if resolved is not None and resolved.entry is not None and resolved.entry.dots_x != 15:
        set_dots_x(net, resolved.entry.dots_x, d if isinstance(d, Drafter) else None)
    return Loaded(net, tokenizer, name, dtype, dev, directory, resolved, adapter, drafter, d)


def _is_drafter_file(drafter: str | Path) -> bool:
    """A drafter file (`clover train drafter` writes .safetensors) rather than a model: a
    registry name, a GGUF file, an HF directory or Hub repo."""
    return str(drafter).endswith(".safetensors")


# text whose tokens two tokenizers must agree on for one model to draft for the other
_PROBE = "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs)  # Größe, 平均 🙂\n"


def _draft_model(name: str, target: DiffusionLM, tokenizer: Tokenizer, dtype: str,
                 progress: bool, device: str, wide: str) -> DiffusionLM:  # fmt: skip
    """A whole model drafting for `target`, loaded as the target is (precision, device):
    it must read and write the same tokens."""
    try:
        loaded = load(name, dtype=dtype, progress=progress, device=device, drafter="none",
                      wide=wide)  # fmt: skip
    except CloverError as e:
        raise CloverError(f"drafter {name}: not a drafter file (.safetensors), and as a draft "
                          f"model: {e}") from e  # fmt: skip
    draft = loaded.model
    if draft.config.vocab_size != target.config.vocab_size or (
        loaded.tokenizer.encode(_PROBE) != tokenizer.encode(_PROBE)
    ):
        raise CloverError(
            f"drafter {name}: its tokenizer is not the model's ({draft.config.vocab_size} "
            f"tokens against {target.config.vocab_size}, or other ids for the same text); a "
            "draft model must share the model's tokenizer"
        )
    if not getattr(draft.config, "shifted", True):  # its logits are not next-token ones
        raise CloverError(f"drafter {name}: a model without token shift cannot draft")
    draft.draft_wide = wide  # its head's rows follow (`ModelDraftRunner.vocab_head`)
    entry = loaded.resolved.entry if loaded.resolved is not None else None
    if entry is not None and entry.drafter_path is not None:  # its answers' commonest tokens
        draft.draft_ids = drafter_vocabulary(Path(entry.drafter_path))
    return draft


def _overrides(resolved: ResolvedModel) -> dict:
    return dict(resolved.entry.overrides) if resolved.entry else {}
