"""``tkv-vllm`` console command.

::

    tkv-vllm patch status   [--root DIR]   # per-patch state on the installed vLLM
    tkv-vllm patch apply    [--root DIR]   # idempotent; refuses vLLM != 0.20.1
    tkv-vllm patch revert   [--root DIR]   # back to stock vLLM 0.20.1
    tkv-vllm patch list                    # the series and each patch's header

``--root`` names a vLLM tree other than the installed one (the directory holding the
``vllm`` package: an unpacked sdist or a site-packages). Exit status: 0 on success (for
``status``: series fully applied), 1 when ``status`` finds it not (fully) applied,
2 on refusal (wrong version, conflict, vLLM missing).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tkv.codec.errors import TkvError

from . import patching


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tkv-vllm", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("patch", help="manage the tkv patch series on vLLM "
                        f"{patching.VLLM_VERSION}")
    act = pp.add_subparsers(dest="action", required=True)
    for name, help_ in (("apply", "apply the series (idempotent)"),
                        ("revert", "revert the series (idempotent)"),
                        ("status", "show the state of each patch")):
        a = act.add_parser(name, help=help_)
        a.add_argument("--root", type=Path, default=None,
                       help="vLLM tree root (default: the installed vllm's site-packages)")
    act.add_parser("list", help="list the patches of the series with their headers")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tkv-vllm`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.action == "list":
            for pf in patching.load_series():
                print(f"== {pf.name}\n{pf.header}\n")
            return 0
        root = args.root if args.root is not None else patching.find_vllm_root()
        if args.action == "status":
            st = patching.status(root)
            print(st.describe())
            return 0 if st.state is patching.PatchState.APPLIED else 1
        fn = patching.apply if args.action == "apply" else patching.revert
        changed = fn(root)
        verb = "applied to" if args.action == "apply" else "reverted from"
        if changed:
            print(f"tkv patch series {verb} vLLM {patching.VLLM_VERSION} at {root}; "
                  f"{len(changed)} file(s) changed:")
            for c in changed:
                print(f"  {c}")
        else:
            print(f"nothing to do: series already {'applied' if args.action == 'apply' else 'reverted'} "
                  f"at {root}")
        return 0
    except (TkvError, OSError) as e:
        hint = " (is the vLLM install writable? try the same Python/user that installed it)" \
            if isinstance(e, PermissionError) else ""
        print(f"tkv-vllm: error: {e}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
