"""`clover export DRAFTER OUT --format llama.cpp`: a block drafter as a llama.cpp DFlash draft
model, which `llama-server -md OUT/drafter.gguf --spec-type draft-dflash` runs beside the
target's GGUF. llama.cpp's DFlash graph computes our block drafter's function tensor for
tensor (context features -> fc -> norm -> each layer's K/V; the block [token, MASK...] both
ways over it; the target's embeddings and head), so only the files change:

- OUT/draft/: config.json + model.safetensors as llama.cpp's converter (convert_hf_to_gguf.py)
  reads a DFlash draft (`dflash_config`, `dflash_state` in models/drafter.py). A draft
  vocabulary goes in as the target head's rows at its ids (float, from the target loaded
  here) with their ids (`d2t`).
- OUT/target/: what the converter's `--target-model-dir` reads: config.json (the family's HF
  architecture, which picks the vocabulary code) and the tokenizer files; no weights (the
  draft borrows the target's embeddings and head at run time).
- OUT/drafter.gguf: the converter run on both when llama.cpp's sources are at hand (its own
  gguf-py first on the path: the installed gguf package may predate DFlash).

The target's graph must publish each layer's input, which the draft reads: llama.cpp's llama
and qwen3 graphs do, its qwen2 graph does after scripts/build_llamacpp.sh's one-line patch.
The output of the last layer is never published, so a feature layer there is refused.
Chain drafters are refused: llama.cpp fills the block with MASK in one pass, while a chain
drafter reads each previous draft.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from clover.engine import LLM
from clover.errors import CloverError
from clover.hf.export import _check_target, _copy_tokenizer, _replace_dir, _write_json
from clover.models.drafter import dflash_config, dflash_state, load_drafter, read_drafter_config

__all__ = ["LlamaCppExport", "export_llamacpp", "target_config"]

OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}  # our dtype -> the converter's --outtype
# our config's decoding keys (and the GGUF's file type), which an HF config does not have
CLOVER_KEYS = ("mask_token_id", "mask_token", "shifted", "default_decoder", "block_size",
               "draft", "qkv_bias", "gguf_file_type")  # fmt: skip
CONVERTER = "convert_hf_to_gguf.py"
# what the converter imports beyond ours (its requirements-convert_hf_to_gguf.txt): it reads a
# vocabulary through sentencepiece before trying tokenizer.json, so a missing one fails there
CONVERTER_NEEDS = ("sentencepiece",)


@dataclass
class LlamaCppExport:
    out: Path
    gguf: Path | None  # None: not converted (no converter, or `missing` says what it lacks)
    convert: list[str]  # the converter's command line (with PYTHONPATH=`gguf_py`)
    gguf_py: Path
    target_gguf: Path | None  # the target's GGUF file, when it was loaded from one
    n_max: int  # drafts per pass: the drafter's block less its first token
    missing: tuple[str, ...] = ()  # packages the converter needs that this Python lacks

    def convert_line(self) -> str:
        return f"PYTHONPATH={shlex.quote(str(self.gguf_py))} {shlex.join(self.convert)}"

    def run_line(self) -> str:
        target = str(self.target_gguf) if self.target_gguf else "TARGET.gguf"
        draft = str(self.gguf or self.out / "drafter.gguf")
        return shlex.join(["llama-server", "-m", target, "-md", draft, "--spec-type",
                           "draft-dflash", "--spec-draft-n-max", str(self.n_max)])  # fmt: skip


def target_config(config: dict) -> dict:
    """Our model config dict (`to_dict`: its HF architecture included) -> the target's
    config.json for the converter: the standard keys only."""
    return {k: v for k, v in config.items() if k not in CLOVER_KEYS and v is not None}


def _write_folders(llm: LLM, drafter_file: Path, out: Path, dtype: str) -> None:
    """OUT/draft and OUT/target (see the module docstring) into the folder `out`."""
    drafter = load_drafter(drafter_file, llm.model)  # refused unless trained on this target
    n_layers = llm.model.config.num_hidden_layers
    if max(drafter.config.feature_layers) >= n_layers - 1:
        raise CloverError(f"{drafter_file}: feature layer {n_layers - 1} is the target's last "
                          "layer's output, which llama.cpp's graphs do not publish")  # fmt: skip
    head = None
    if drafter.vocab is not None:
        head = llm.model.head_weight().detach()[drafter.vocab].float()
    state = dflash_state(drafter, head)
    state = {k: (v if k == "d2t" else v.to(getattr(torch, dtype))).contiguous()
             for k, v in state.items()}  # fmt: skip
    draft, target = out / "draft", out / "target"
    draft.mkdir()
    target.mkdir()
    save_file(state, str(draft / "model.safetensors"), metadata={"format": "pt"})
    _write_json(draft / "config.json", dflash_config(drafter))
    _write_json(target / "config.json", target_config(llm.model.config.to_dict()))
    _copy_tokenizer(Path(llm.directory), target)


def _convert(result: LlamaCppExport) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(result.gguf_py),
                                                    env.get("PYTHONPATH")) if p)  # fmt: skip
    proc = subprocess.run(result.convert, env=env, capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
        raise CloverError(f"llama.cpp's converter failed ({result.convert_line()}):\n{tail}")


def export_llamacpp(
    drafter_file: str | Path,
    out_dir: str | Path,
    llamacpp_src: Path | None,
    *,
    dtype: str = "float32",
    force: bool = False,
    progress: bool = True,
) -> LlamaCppExport:
    """Write OUT/draft and OUT/target for the block drafter in `drafter_file`, then
    OUT/drafter.gguf where `llamacpp_src` (llama.cpp's source tree) holds the converter.
    dtype: the draft's weights (float32: the function our drafter computes; bfloat16)."""
    drafter_file, out = Path(drafter_file), Path(out_dir).expanduser()
    if dtype not in OUTTYPES:
        raise CloverError(f"export dtype {dtype!r}: choose {' or '.join(OUTTYPES)}")
    config = read_drafter_config(drafter_file)
    if config.chain:
        raise CloverError(f"{drafter_file}: a chain drafter reads each previous draft, while "
                          "llama.cpp's DFlash fills the block with MASK in one pass; only block "
                          "drafters (chain: false) export to llama.cpp")  # fmt: skip
    _check_target(out, force)  # before loading the target: a refusal should be instant

    llm = LLM(config.target, dtype="float32", progress=progress, drafter="none")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_folders(llm, drafter_file, staging, dtype)
        _check_target(out, force)  # it may have been filled while we loaded
        _replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    src = llamacpp_src if llamacpp_src is not None else Path("LLAMA_CPP_SRC")
    gguf = out / "drafter.gguf"
    resolved = llm.resolved
    result = LlamaCppExport(
        out=out,
        gguf=None,
        convert=[sys.executable, str(src / CONVERTER), str(out / "draft"), "--target-model-dir",
                 str(out / "target"), "--outtype", OUTTYPES[dtype], "--outfile", str(gguf)],
        gguf_py=src / "gguf-py",
        target_gguf=resolved.path if resolved is not None and resolved.kind == "gguf" else None,
        n_max=config.block_size - 1,
        missing=tuple(m for m in CONVERTER_NEEDS if importlib.util.find_spec(m) is None),
    )  # fmt: skip
    if llamacpp_src is not None and (src / CONVERTER).is_file() and not result.missing:
        _convert(result)
        result.gguf = gguf
    return result
