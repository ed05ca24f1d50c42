"""A model name, a GGUF file or an HF directory -> a ready model + tokenizer (`load`).

The steps, in order, each decided here once:
1. resolve: a registry name (pulled if missing), a `.gguf` file, an HF directory, or a
   shape preset (random weights, the base model's tokenizer);
2. an HF-format directory: given, or a GGUF converted once into the user cache
   (`prepare_checkpoint`; `cache` keys it by the file's bytes);
3. precision and device: `auto` is int4 for a 4-bit GGUF source, else bfloat16 where the CPU
   has bf16 instructions, else float32; off the CPU, bfloat16 (int4/int8 are CPU kernels).
   int4 from a GGUF keeps the file's own levels: 4-bit types on the int4 kernel, wider ones on
   the int8 kernel in groups (`mark_source_levels`; scales travel in the converted checkpoint);
4. the weights are read in that dtype and adopted by the architecture (`hf_dir.model_from_state`,
   the family's `sanitize` maps names); the registry's decoding defaults and draft adapter are
   applied; weight-only quantization last; then the move to the device.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from clover.checkpoints import cache
from clover.checkpoints.gguf import QUANT_FILE, GGUFQuant, read_gguf
from clover.checkpoints.gguf_tokenizer import convert_gguf_tokenizer
from clover.checkpoints.hf_dir import (
    model_from_state,
    read_config,
    read_hf_dir,
    read_tensor,
    safetensors_files,
    save_checkpoint,
)
from clover.checkpoints.registry import BASE_MODEL, ResolvedModel, resolve
from clover.decoding.policies import check_model_defaults
from clover.errors import CloverError
from clover.models import build_model, make_config
from clover.models.base import DiffusionLM
from clover.quant import int4_fits
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
    directory: Path | None  # the HF-format directory read (None for a preset)
    resolved: ResolvedModel | None  # None for a preset
    adapter: str | None  # the draft adapter file attached, if any
    drafter: str | None = None  # the drafter file attached (`model.drafter`), if any


def prepare_checkpoint(resolved: ResolvedModel, progress: bool = True) -> Path:
    """An HF-format directory for the model, converting a GGUF file on first use (`cache`:
    keyed by the file's bytes; stale conversions are pruned before a new one is written)."""
    if resolved.kind == "hf":
        return resolved.path
    sha = cache.file_sha256(resolved.path, progress)
    pinned = resolved.entry.sha256 if resolved.entry else None
    if pinned is not None and sha != pinned:  # a split model's assembled file, changed since
        raise CloverError(
            f"{resolved.path} has sha256 {sha}, not the pinned {pinned}; delete it and run "
            f"`clover pull {resolved.entry.name}` to assemble it again"
        )
    overrides = resolved.entry.overrides if resolved.entry else {}
    target = cache.converted_dir(resolved.path, sha, overrides)
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        cache.note_use(target, resolved.path, sha)
        return target
    removed = cache.prune()  # before writing: a full disk may be full of stale copies
    if progress and removed:
        print(cache.removed_summary(removed), file=sys.stderr)
    config, state, quant = read_gguf(resolved.path, progress=progress)
    config.update(overrides)
    model = model_from_state(config, state, resolved.path.name, torch.float32)
    extras = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        extras = Path(tempfile.mkdtemp(prefix=f".{target.name}.extras.", dir=target.parent))
        convert_gguf_tokenizer(resolved.path, extras)
        quant.save(extras / QUANT_FILE)  # the file's own 4-bit levels, for the int4 kernel
        cache.write_sources(extras, resolved.path, sha)  # lands with the weights, atomically
        save_checkpoint(model, target, extra_files=sorted(extras.iterdir()))
    except OSError as e:
        need = sum(p.numel() for p in model.parameters()) * 4 / 1e9
        raise CloverError(
            f"cannot write the converted checkpoint ({need:.1f} GB, float32) to {target.parent}: "
            f"{e.strerror or e}; free space there or point $CLOVER_CACHE elsewhere"
        ) from None
    finally:
        if extras is not None:
            shutil.rmtree(extras, ignore_errors=True)
    return target


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
    instructions. Without them it ran at ~0.8 GFLOP/s (a 2-core AVX2 EPYC; float32: ~140)."""
    return device.type != "cpu" or cpu_has_bf16()


def auto_dtype(config: dict) -> str:
    """int4 for 4-bit GGUF sources (their own levels), else bfloat16 where the CPU has bf16
    instructions, else float32."""
    if not cpu_has_bf16():
        return "float32"
    if str(config.get("gguf_file_type", "")).startswith(FOUR_BIT_FILES):
        return "int4"
    return "bfloat16"


def int4_later(
    directory: Path, config: dict, wide: str = "int8"
) -> tuple[GGUFQuant | None, set[str]]:
    """For an int4 load of a converted GGUF: its record, and the weights the kernels will
    take from the file's own levels (`mark_source_levels`): read then, one at a time in
    float32, never as a bfloat16 copy. 4-bit types where the int4 kernel fits; wider ones
    (8-bit levels in groups of 16 or 32) where Clover's kernels run, unless `wide` is int4."""
    if wide not in ("int8", "int4"):
        raise CloverError(f"wide {wide!r}: int8 or int4")
    quant = GGUFQuant.read(directory)
    if quant is None:
        return None, set()
    from clover import kernels

    grouped_int8 = wide == "int8" and kernels.load() is not None
    with torch.device("meta"):
        probe = build_model(make_config(config))
    later = set()
    for module_name, module in probe.named_modules():
        name = f"{module_name}.weight"
        if not isinstance(module, nn.Linear) or module_name == "lm_head" or name not in quant.scale:
            continue
        if quant.bits(name) == 4 or wide == "int4":
            fits = int4_fits(module)
        else:
            group = module.in_features // quant.scale[name].shape[1]
            fits = grouped_int8 and group in (16, 32) and module.out_features % 16 == 0
        if fits:
            later.add(name)
    return quant, later


def mark_source_levels(
    net: DiffusionLM, quant: GGUFQuant, directory: Path, later: set[str], wide: str = "int8"
) -> int:
    """Give each linear in `later` (its weight on the meta device) `levels()`, which reads the
    weight and recovers the file's own levels, and `level_bits`: 4 for a 4-bit type (the int4
    kernel), 8 for a wider one (Q5_0, Q5_K, Q6_K, Q8_0: the int8 kernel in groups, no second
    rounding) unless `wide` is int4 (rounded to 4 bits: smaller and faster, not exact).
    -> how many linears were marked."""
    files = safetensors_files(directory)
    marked = 0
    for module_name, module in net.named_modules():
        name = f"{module_name}.weight"
        if isinstance(module, nn.Linear) and name in later:
            module.levels = partial(_levels_from_file, quant, files, name)
            module.level_bits = 4 if wide == "int4" else quant.bits(name)
            marked += 1
    return marked


def _levels_from_file(quant: GGUFQuant, files: list[Path], name: str) -> tuple:
    return quant.levels(name, read_tensor(files, name))


def mask_from_tokenizer(config: object, tokenizer: Tokenizer) -> None:
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
    from clover.models.clover import CloverModel, preset_config

    config = preset_config(name)
    if config.num_params > 2e9:
        raise CloverError(
            f"{name} is a shape preset of {config.num_params / 1e9:.1f}B parameters with no "
            "weights; `clover info` describes it, generation needs a checkpoint"
        )
    base = prepare_checkpoint(resolve(BASE_MODEL, progress=progress), progress)
    tokenizer = Tokenizer.from_dir(base)
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
) -> Loaded:
    """adapter: a draft adapter file to attach; a registry name that ships one attaches its
    own. drafter: a drafter file for self_spec draft="drafter" (a registry name that ships one
    loads its own unless another is given; "none": no drafter, and a default that drafted from
    it drafts from the rest of its sources, lookup at least). device: cpu, cuda, cuda:N or
    auto (`resolve_device`): weights load on the CPU, then move. wide (int4 from a GGUF): the
    kernel of tensors stored wider than 4 bits (`mark_source_levels`)."""
    if dtype not in DTYPES and dtype != "auto":
        raise CloverError(f"dtype {dtype!r}: choose auto or one of {', '.join(DTYPES)}")
    dev = resolve_device(device)
    dtype = device_dtype(dev, dtype)
    resolved, directory = None, None
    if model in PRESETS:
        net, tokenizer = _preset_model(model, progress)
        dtype = "float32" if dtype == "auto" else dtype
        net.to(DTYPES[dtype])
        name = model
    else:
        resolved = resolve(model, progress=progress)
        directory = prepare_checkpoint(resolved, progress)
        config = read_config(directory)
        make_config(config)  # an unknown or refused family says so before any weight is read
        if dtype == "auto":
            dtype = auto_dtype(config)
        quant, later = int4_later(directory, config, wide) if dtype == "int4" else (None, set())
        config, state = read_hf_dir(directory, DTYPES[dtype], later)
        net = model_from_state(config, state, str(directory), DTYPES[dtype])
        if quant is not None:
            mark_source_levels(net, quant, directory, later, wide)
        tokenizer = Tokenizer.from_dir(directory)
        name = resolved.name
        entry = resolved.entry
        if entry is not None and entry.adapter is not None and adapter is None:
            adapter = entry.adapter_path
        if entry is not None and entry.drafter is not None and drafter is None:
            drafter = entry.drafter_path
        if entry is not None:
            entry.apply_decoding(net.config, drafter)
        mask_from_tokenizer(net.config, tokenizer)
    if str(drafter) == "none":
        drafter = None
    check_model_defaults(net.config)
    if adapter is not None:
        from clover.models.adapter import load_adapter

        if not Path(adapter).is_file():
            raise CloverError(f"adapter file {adapter} not found")
        load_adapter(net, Path(adapter))
        net.to(DTYPES[dtype])
        adapter = str(adapter)
    if dtype in ("int4", "int8"):
        from clover.quant import quantize_model

        quantize_model(net, dtype)
        left = [n for n, p in net.named_parameters() if p.is_meta]
        if left:  # a weight left for its levels that the quantizer did not take
            raise CloverError(f"{name}: {left[0]} was not quantized from its GGUF levels")
    if adapter is not None:
        from clover.models.adapter import keep_float32

        keep_float32(net)
    net.to(dev)
    if drafter is not None:  # self_spec draft="drafter" (models/drafter.py)
        from clover.models.drafter import load_drafter

        if not Path(drafter).is_file():
            raise CloverError(f"drafter file {drafter} not found")
        # not a submodule: the model's own state, casts and quantization leave it alone
        d = load_drafter(Path(drafter), net).to(dev)
        if dtype == "int4":  # its linears in 4 bits too: a drafter pass is then ~its head
            from clover.quant import quantize_linears, release_freed_memory

            quantize_linears(d)
            release_freed_memory()  # its file's and float32 copies (~200 MB held otherwise)
        object.__setattr__(net, "drafter", d)
        drafter = str(drafter)
    if resolved is not None and resolved.entry is not None and resolved.entry.dots_x != 15:
        from clover.quant import set_dots_x

        set_dots_x(net, resolved.entry.dots_x)
    if getattr(net, "drafter", None) is not None and net.drafter.vocab is not None:
        from clover.decoding.drafting import DrafterRunner

        # its LM-head rows now (their x bits set above), not in the first answer (0.3 s, coder)
        DrafterRunner.vocab_head(net, net.drafter)
    return Loaded(net, tokenizer, name, dtype, dev, directory, resolved, adapter, drafter)
