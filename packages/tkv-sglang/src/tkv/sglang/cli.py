"""``tkv-sglang`` command: manage the SGLang v0.5.11 patch series on an installed sglang.

Usage::

    tkv-sglang patch status  [--target DIR]
    tkv-sglang patch apply   [--target DIR]
    tkv-sglang patch revert  [--target DIR]

``--target`` is the directory holding the ``sglang`` package (default: the sglang importable
by this Python, found without importing it). Exit status: 0 on success (``status``: 0 when
every patch is applied, 1 when some are not, 2 on a conflict or version mismatch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import PatchError, SglangVersionError
from .patching import (
    APPLIED,
    CONFLICT,
    SGLANG_VERSION,
    apply_series,
    find_installed_sglang,
    patch_states,
    revert_series,
)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tkv-sglang",
                                description="tkv adapter for SGLang " + SGLANG_VERSION)
    sub = p.add_subparsers(dest="command", required=True)
    patch = sub.add_parser("patch", help="apply/revert/inspect the SGLang patch series")
    patch.add_argument("action", choices=["apply", "revert", "status"])
    patch.add_argument("--target", type=Path, default=None,
                       help="directory holding the sglang package (default: installed sglang)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tkv-sglang``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        root = args.target.resolve() if args.target else find_installed_sglang()
        if args.action == "apply":
            for line in apply_series(root):
                print(line)
            print(f"sglang {SGLANG_VERSION} at {root}: tkv patch series applied")
            return 0
        if args.action == "revert":
            for line in revert_series(root):
                print(line)
            print(f"sglang {SGLANG_VERSION} at {root}: tkv patch series reverted")
            return 0
        states = patch_states(root)
        for st in states:
            print(f"{st.state:10s} {st.patch.name}")
            if st.detail:
                print("           " + st.detail.replace("\n", "\n           "))
        if any(s.state == CONFLICT for s in states):
            return 2
        return 0 if all(s.state == APPLIED for s in states) else 1
    except (PatchError, SglangVersionError) as e:
        print(f"tkv-sglang: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
