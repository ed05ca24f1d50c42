"""The project's quality suite (`benchmarks/suites/quality.jsonl`, one JSON object per line):
its items, read and checked here, for `clover bench quality` and for keeping training prompts
clear of it (`data/self_prompts.py`)."""

from __future__ import annotations

import json
from pathlib import Path

from clover.errors import CloverError

KINDS = ("code", "math", "fact", "open")
SUITE = "quality.jsonl"


def default_suite_path() -> Path:
    """benchmarks/suites/quality.jsonl of the source tree (or of the working directory)."""
    here = Path(__file__).resolve().parents[3] / "benchmarks" / "suites" / SUITE
    return here if here.is_file() else Path("benchmarks") / "suites" / SUITE


def load_suite(path: str | Path | None = None, limit: int | None = None,
               kinds: tuple[str, ...] = KINDS) -> list[dict]:  # fmt: skip
    """Items of a suite file of the given kinds; `limit` keeps the first N of each kind in turn
    (so a short run still covers every kind)."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise CloverError(f"unknown suite kinds {unknown}: choose from {', '.join(KINDS)}")
    path = Path(path) if path else default_suite_path()
    if not path.is_file():
        raise CloverError(f"suite file not found: {path}")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if item.get("kind") not in KINDS or not item.get("prompt") or not item.get("id"):
            raise CloverError(f"{path}:{n}: an item needs id, prompt and kind in {KINDS}")
        if item["kind"] in kinds:
            items.append(item)
    if limit is not None:
        by_kind = {k: [i for i in items if i["kind"] == k] for k in KINDS}
        rounds = [by_kind[k][j] for j in range(len(items)) for k in KINDS if j < len(by_kind[k])]
        items = rounds[:limit]
    return items
