"""``--smoke``, every bench's tiny run: the same code path at tiny sizes, in
seconds, so that a bench that breaks fails CI (.ci/run runs each one so;
bench/README.md). Its figures mean nothing; its exit status does."""

from __future__ import annotations

import argparse
import sys


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None, **tiny) -> argparse.Namespace:
    """``ap.parse_args()`` with ``--smoke`` added: with it, ``tiny`` are the defaults
    (a flag given beside ``--smoke`` still wins)."""
    argv = sys.argv[1:] if argv is None else argv
    shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in tiny.items())
    ap.add_argument("--smoke", action="store_true", help=f"a tiny run for CI, in seconds ({shown})")
    if "--smoke" in argv:
        ap.set_defaults(**tiny)
    return ap.parse_args(argv)
