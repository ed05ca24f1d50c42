"""`clover-lm-eval`: lm_eval's own command line with the "clover" model registered first.

lm_eval 0.4.13 cannot discover third-party models, so this is the thinnest faithful path: import
the integration (which registers "clover"), then call the entry point behind the `lm_eval`
console script with argv untouched. Nothing is parsed here, so every lm_eval flag keeps its
documented meaning; only Clover's own user errors are turned into a one-line message.
"""

from __future__ import annotations

import sys

import clover.integrations.lm_eval  # noqa: F401  (registers the "clover" model)
from clover.errors import CloverError


def main(argv: list[str] | None = None) -> int:
    """Run `lm_eval <argv>` (default: this process's arguments) with "clover" available."""
    from lm_eval.__main__ import cli_evaluate  # optional (`.[lm-eval]`)

    if argv is not None:
        # lm_eval's CLI reads sys.argv itself (it inserts the default "run" subcommand there)
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except CloverError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
