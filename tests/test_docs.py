"""The docs cite what exists: every results file, script, config, source path and doc page that
the README, `docs/` or CONTRIBUTING.md names is in the tree, and the README stays short.

Checked: `benchmarks/results/...` files named anywhere in a page, and repo-relative paths under
the prefixes below inside code (inline spans and fenced blocks) or as link targets. A path
written as a pattern (`bench-speed-<model>.json`, `runs/*`, `{a,b}`) is a pattern, not a
citation, and is left alone. While README.new.md exists, README.md is the page it replaces, and
only README.new.md is checked.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 250
PREFIXES = ("benchmarks", "scripts", "src", "configs", "docs", "model_cards")
RESULT_SUFFIXES = (".json", ".jsonl", ".png", ".csv", ".txt")
# a path: one of the prefixes at a word boundary, then path characters
PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(PREFIXES) + r")/[\w./+-]*)")
RESULT = re.compile(r"(?<![\w./~-])(benchmarks/results/[\w.+-]+)")
PATTERN_CHARS = "<{*[$"  # what follows a path written as a pattern
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    readme = "README.new.md" if (ROOT / "README.new.md").is_file() else "README.md"
    found = [ROOT / readme, *sorted((ROOT / "docs").glob("*.md"))]
    return found + [p for p in [ROOT / "CONTRIBUTING.md"] if p.is_file()]


def code_text(text: str) -> list[str]:
    """The page's code: inline spans, and fenced blocks line by line."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        out.extend([line] if fenced else SPAN.findall(line))
    return out


def paths_in(text: str, pattern: re.Pattern) -> list[str]:
    """Literal paths `pattern` finds in `text`: patterns and trailing punctuation left out."""
    out = []
    for m in pattern.finditer(text):
        after = text[m.end() : m.end() + 1]
        if after and after in PATTERN_CHARS:
            continue
        out.append(m.group(1).rstrip(".,:;"))
    return out


def cited(page: Path) -> set[str]:
    """Every repo-relative path the page cites (see the module docstring)."""
    text = page.read_text(encoding="utf-8")
    found = {p for p in paths_in(text, RESULT) if p.endswith(RESULT_SUFFIXES)}
    for code in code_text(text):
        found.update(paths_in(code, PATH))
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            found.add(str((page.parent / target).resolve().relative_to(ROOT)))
    return {p.rstrip("/") for p in found if p.rstrip("/")}


def test_the_checker_finds_citations_and_skips_patterns(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "See benchmarks/results/a.json and `python benchmarks/x.py --out y`.\n"
        "Patterns: `benchmarks/results/bench-<model>.json`, `configs/{a,b}.yaml`, "
        "`benchmarks/results/*.json`, benchmarks/results/ alone.\n"
        "```bash\nclover train drafter --config configs/c.yaml\n```\n"
        "A folder: `src/clover/kernels/`.\n",
        encoding="utf-8",
    )
    assert cited(page) == {
        "benchmarks/results/a.json",
        "benchmarks/x.py",
        "configs/c.yaml",
        "src/clover/kernels",
    }


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_cited_path_exists(page):
    missing = sorted(p for p in cited(page) if not (ROOT / p).exists())
    assert not missing, f"{page.name} cites paths that do not exist: {missing}"


def test_readme_is_short():
    if (ROOT / "README.new.md").is_file():
        pytest.skip("README.new.md has not replaced README.md yet")
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES}"


MAX_RESULT_BYTES = 512 * 1024
WEIGHTS = ("src/clover/drafters", "src/clover/adapters")


def result_files() -> list[Path]:
    """benchmarks/results as git would land it: tracked files and new ones it does not ignore
    (the plots a bench run draws beside its JSON are ignored: `clover bench plot` redraws
    them); every file where the tree is not a git checkout."""
    results = ROOT / "benchmarks" / "results"
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", str(results)],
            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return sorted(results.iterdir())
    return sorted(p for p in (ROOT / name for name in listed) if p.is_file())


def test_results_in_the_tree_are_cited_and_small():
    """benchmarks/results holds what a page quotes, as small files: a result no page cites is
    removed (git keeps it; a new run writes it again), and a bulky one does not land. A new
    result lands with the page that quotes it."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in [
        *pages(), ROOT / "MODEL_CARD.md", *sorted((ROOT / "model_cards").glob("*.md")),
        *sorted((ROOT / "configs").glob("*"))])  # fmt: skip
    files = result_files()
    uncited = [f.name for f in files if f.name not in text]
    assert not uncited, f"results no page cites (cite them or remove them): {uncited[:5]}"
    bulky = [f.name for f in files if f.stat().st_size > MAX_RESULT_BYTES]
    assert not bulky, f"results over {MAX_RESULT_BYTES // 1024} KB: {bulky}"


def test_only_the_shipped_weights_are_in_the_tree():
    """The weights in the package are the files the registry ships, one each: a new revision
    replaces its file (CONTRIBUTING.md), experiments' weights stay in runs/ (ignored)."""
    from clover.checkpoints.registry import KNOWN_MODELS

    shipped = {e.drafter_path for e in KNOWN_MODELS.values() if e.drafter}
    shipped |= {e.adapter_path for e in KNOWN_MODELS.values() if e.adapter}
    present = {p for d in WEIGHTS for p in (ROOT / d).glob("*") if p.is_file()}
    assert {p.resolve() for p in present} == {p.resolve() for p in shipped}
