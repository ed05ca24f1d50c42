"""The learning curve of one drafter run, or of a run and the runs it continued (`init: FILE`).

Usage: python benchmarks/drafter_curve.py runs/drafter-coder runs/drafter-coder-v4 \
           [--out benchmarks/results/drafter-curve-....json]

Runs are given oldest first; each is a `clover train drafter` output directory. What the curve
holds: `clover.train.curve`. Prints the held-out evaluations, then the curve as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clover.errors import CloverError
from clover.train.curve import curve


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories, oldest first")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    try:
        result = curve(args.runs)
    except CloverError as e:
        raise SystemExit(str(e)) from None
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    for e in result["evals"]:
        print(f"step {e['step']:>6}  minute {e['minutes']:>6}  held-out {e['heldout']}  "
              f"unseen kinds {e['heldout_kinds']}", file=sys.stderr)  # fmt: skip
    print(text)


if __name__ == "__main__":
    main()
