"""Write a GGUF file's embedded vocabulary out as tokenizer.json + tokenizer_config.json.

A GGUF stores its tokenizer as llama.cpp metadata (tokens, merges, token types, special ids,
chat template). Rebuilding a `tokenizers` pipeline from that is subtle (pre-tokenizer regexes
per model family, byte-level spelling, control tokens), and transformers already does it, so
we borrow its converter once per model and cache the result as plain files; serving then only
needs `clover.tokenizer.Tokenizer.from_dir`. transformers is imported inside the function
because importing it takes seconds. Output is written to a temporary sibling folder and renamed
into place, so a crash never leaves a half-written tokenizer behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from clover.errors import CloverError

__all__ = ["convert_gguf_tokenizer"]

# What transformers writes that only makes sense to transformers' own loader.
_DROPPED_CONFIG_KEYS = ("is_local", "local_files_only", "name_or_path", "backend")


def _gguf_tokenizer_fields(gguf_path: Path) -> tuple[bool | None, str | None]:
    """`tokenizer.ggml.add_bos_token` and `tokenizer.ggml.pre`, which transformers does not keep."""
    from gguf import GGUFReader  # gguf's reader: in the converting child only

    fields = GGUFReader(str(gguf_path)).fields
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    pre = fields.get("tokenizer.ggml.pre")
    return (
        None if add_bos is None else bool(add_bos.parts[add_bos.data[0]][0]),
        None if pre is None else bytes(pre.parts[pre.data[0]]).decode("utf-8"),
    )


def _fix_pre_tokenizer(tokenizer_file: Path, pre: str | None) -> None:
    """Match llama.cpp where transformers' converter falls back to the plain GPT-2 split.

    llama.cpp's "smollm" pre-tokenizer (SmolLM/SmolLM2, trained with single-digit numbers) first
    isolates every numeric character, then applies the GPT-2 regex. transformers does not know
    "smollm" and uses the GPT-2 regex alone, which glues a leading space to a number; SmolLM2's
    vocabulary has no such merge for ASCII digits, but does for others (" ½" came out as
    "ĠÂ" + "½" instead of "Ġ" + "Â½"). Digits + ByteLevel is the equivalent `tokenizers` pipeline.
    """
    if pre != "smollm":
        return
    import tokenizers  # in the converting child only
    from tokenizers import pre_tokenizers

    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.save(str(tokenizer_file))


def _write_tokenizer(gguf_path: Path, target: Path) -> None:
    # The file is local; keep the hub client from ever trying the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer  # heavy: in the converting child only

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except (ValueError, KeyError, OSError, NotImplementedError) as exc:
        raise CloverError(f"cannot convert the tokenizer embedded in {gguf_path}: {exc}") from None
    tokenizer.save_pretrained(str(target))

    config_path = target / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    for key in _DROPPED_CONFIG_KEYS:
        config.pop(key, None)
    # A class both transformers 4 and 5 can load, so the folder stays usable by other tools.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["clean_up_tokenization_spaces"] = False
    add_bos, pre = _gguf_tokenizer_fields(gguf_path)
    _fix_pre_tokenizer(target / "tokenizer.json", pre)
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    # Keep the template inside tokenizer_config.json: one file holds everything but the vocab.
    jinja_file = target / "chat_template.jinja"
    if jinja_file.is_file():
        config["chat_template"] = jinja_file.read_text(encoding="utf-8")
        jinja_file.unlink()
    elif isinstance(getattr(tokenizer, "chat_template", None), str):
        config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
    for extra in target.iterdir():  # e.g. special_tokens_map.json from older transformers
        if extra.name not in ("tokenizer.json", "tokenizer_config.json"):
            if extra.is_dir():
                shutil.rmtree(extra)
            else:
                extra.unlink()


def _write_in_child(gguf_path: Path, target: Path) -> None:
    """`_write_tokenizer` in a child process: transformers and its GGUF reader take a few
    hundred MB that a serving process would otherwise keep (a first start would peak above
    every later one). Its error comes back as this process's CloverError."""
    proc = subprocess.run(
        [sys.executable, "-m", "clover.checkpoints.gguf_tokenizer", str(gguf_path), str(target)],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise CloverError(lines[-1].removeprefix("error: ") if lines else
                          f"converting the tokenizer of {gguf_path} failed")  # fmt: skip


def convert_gguf_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write `out_dir/tokenizer.json` and `out_dir/tokenizer_config.json` (special tokens,
    add_bos_token, chat_template) for the vocabulary embedded in `gguf_path`.

    Works offline. An existing `out_dir` is replaced only once the new files are complete.
    A folder `<file>.tokenizer/` beside the GGUF holding both files (an earlier conversion's,
    carried to a machine without transformers, as `scripts/gpu_adapt.sh` does) is used as is.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().resolve()
    if not gguf_path.is_file():
        raise CloverError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    sidecar = gguf_path.with_name(gguf_path.name + ".tokenizer")
    names = ("tokenizer.json", "tokenizer_config.json")

    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        if all((sidecar / n).is_file() for n in names):
            for n in names:
                shutil.copyfile(sidecar / n, staging / n)
        else:
            _write_in_child(gguf_path, staging)
        if out_dir.exists():
            # Directories cannot be renamed over: move the old one aside first, then drop it.
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, retired / out_dir.name)
            os.replace(staging, out_dir)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":  # the child of `_write_in_child`: GGUF path, target folder
    try:
        _write_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))
    except CloverError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
