"""What both harnesses share: decoder configs as strings, the machine record, statistics,
results files.

A config string is `decoder[:block[:threshold]]`: `ar`, `low_confidence:32:0.95`,
`self_spec:4`; `low_confidence:4:0.9:slide` is the sliding window; a self_spec draft source
other than the block's masks is a third field: `self_spec:4:lookup`,
`self_spec:4:mask+lookup`, and a fourth, `fixed`, drafts the most the block allows instead of
what this machine's pass costs make pay (`self_spec:16:lookup+store:fixed`); a drafter's
drafts verified as a tree of N tokens add `treeN` (`self_spec:16:drafter:fixed:tree15`). It is
what the CLI takes and what the results files use as row names, so a row in a JSON file can
be pasted back onto the command line. `default` stands for the loaded model's own default
decoding (the coder 0.5B's is `self_spec:4:drafter+lookup`); rows carry the name of what it
stood for.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shlex
import statistics
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from clover.decoding.policies import DRAFTS, Policy
from clover.decoding.settings import GenerationSettings
from clover.errors import CloverError
from clover.files import atomic_write_text
from clover.models.base import ConfigMixin


@dataclass(frozen=True)
class DecoderConfig:
    decoder: str = "ar"
    block_size: int = 1
    threshold: float = 0.95
    draft: str = "mask"  # self_spec only
    slide: bool = False  # low_confidence only: a sliding window
    adaptive: bool = True  # self_spec only: False (`:fixed`) drafts the most the block allows
    tree: int = 0  # self_spec with a drafter: `:treeN`, trees of N drafted tokens

    def __post_init__(self) -> None:
        if self.decoder == "ar" and self.block_size != 1:
            raise CloverError("ar has no block size")
        self.policy()  # the policy's own checks (`decoding/policies.py`)

    @classmethod
    def parse(cls, text: str) -> DecoderConfig:
        parts = text.strip().split(":")
        try:
            if parts[0] == "ar" and len(parts) == 1:
                return cls()
            if parts[0] == "low_confidence" and len(parts) in (2, 3, 4):
                if len(parts) == 4 and parts[3] != "slide":
                    raise ValueError(parts[3])
                threshold = float(parts[2]) if len(parts) >= 3 else 0.95
                return cls("low_confidence", int(parts[1]), threshold, slide=len(parts) == 4)
            if parts[0] == "self_spec" and len(parts) in (2, 3, 4, 5):
                options = parts[3:]
                tree = [int(o[4:]) for o in options if o.startswith("tree") and o[4:].isdigit()]
                if len(tree) + options.count("fixed") != len(options) or len(tree) > 1:
                    raise ValueError(options)
                draft = parts[2] if len(parts) >= 3 else "mask"
                fixed, nodes = "fixed" in options, tree[0] if tree else 0
                return cls("self_spec", int(parts[1]), draft=draft, adaptive=not fixed, tree=nodes)
        except ValueError:
            pass
        raise CloverError(
            f"config {text!r}: use ar, low_confidence:BLOCK[:THRESHOLD[:slide]] or "
            f"self_spec:BLOCK[:{'|'.join(DRAFTS)}[:fixed][:treeN]]"
        )

    @property
    def name(self) -> str:
        if self.decoder == "ar":
            return "ar"
        if self.decoder == "self_spec":
            tail = "" if self.draft == "mask" and self.adaptive else f":{self.draft}"
            tree = f":tree{self.tree}" if self.tree else ""
            return f"self_spec:{self.block_size}{tail}{'' if self.adaptive else ':fixed'}{tree}"
        tail = ":slide" if self.slide else ""
        return f"low_confidence:{self.block_size}:{self.threshold:g}{tail}"

    @classmethod
    def model_default(cls, config: ConfigMixin) -> DecoderConfig:
        """The decoding a model runs when a request names none (`LLM.default_settings`)."""
        decoder = getattr(config, "default_decoder", "ar")
        if decoder == "ar":
            return cls()
        block = int(getattr(config, "block_size", 32))
        if decoder == "self_spec":
            return cls("self_spec", block, draft=getattr(config, "draft", "mask"))
        return cls(decoder, block)

    def settings(self, max_tokens: int) -> GenerationSettings:
        return GenerationSettings(
            decoder=self.decoder,
            block_size=self.block_size,
            threshold=self.threshold,
            max_tokens=max_tokens,
            draft=self.draft,
            slide=self.slide,
            adaptive=self.adaptive,
            tree=self.tree,
        )

    def policy(self) -> Policy:
        return self.settings(1).policy()


def parse_configs(
    text: str | list[str], default: DecoderConfig | None = None
) -> list[DecoderConfig]:
    """A comma list or a list of config strings -> configs (duplicates dropped, in order);
    `default` is what the word `default` stands for (the model's own decoding, known once it
    is loaded: None checks everything else and keeps `ar` in its place)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    configs = [
        (default or DecoderConfig()) if t.strip() == "default" else DecoderConfig.parse(t)
        for t in items
        if t.strip()
    ]
    if not configs:
        raise CloverError("no decoder configs given")
    return list(dict.fromkeys(configs))


def verify_passes(accepted: list[int]) -> dict | None:
    """self_spec: what each verify pass with a draft kept -> the mean tokens it yielded (the
    kept drafts plus the target's own token: DFlash's acceptance length) and a histogram."""
    if not accepted:
        return None
    return {
        "passes_with_a_draft": len(accepted),
        "mean_tokens_per_verify_pass": round(1 + sum(accepted) / len(accepted), 3),
        "kept_per_pass_histogram": {str(k): accepted.count(k) for k in range(max(accepted) + 1)},
    }


def machine() -> dict:

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # other work on the machine slows every row; the 1-minute load average at the start
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def spread(values: list[float], digits: int = 2) -> dict:
    """median, min, max and count of repeated measurements."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MB.

    Linux: VmHWM of /proc/self/status, the high-water mark of this process's own memory
    since exec. Not ru_maxrss: a child started by fork + exec inherits its parent's
    ru_maxrss, so a small engine probed from a big parent would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# environment variables that change what a run computes (the kernels' paths and x's bits): a
# result's command carries those that are set, so that rerunning it reruns the same thing
RESULT_ENV = ("CLOVER_KERNELS", "CLOVER_KERNEL_ISA", "CLOVER_INT8_DOTS", "CLOVER_DOTS_X")


def command_line() -> str:
    """The command that made a result, as a shell line: `VAR=value` for the RESULT_ENV that
    are set, then the program and its arguments."""
    prog = Path(sys.argv[0]).name
    env = [f"{k}={os.environ[k]}" for k in RESULT_ENV if k in os.environ]
    return shlex.join([*env, prog if prog == "clover" else sys.argv[0], *sys.argv[1:]])


def model_label(model: str) -> str:
    """A file-name-safe label for a model name or path."""

    stem = Path(model).name if ("/" in model or model.endswith(".gguf")) else model
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem.removesuffix(".gguf"))


def write_results(report: dict, out: str | Path) -> Path:
    return atomic_write_text(out, json.dumps(report, indent=1) + "\n")
