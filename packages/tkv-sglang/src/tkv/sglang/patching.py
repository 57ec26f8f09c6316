"""Apply / revert / inspect the ``patches/sglang-v0.5.11`` series on an SGLang tree.

The series is made against the *installed layout* of SGLang: its paths are relative to the
directory that holds the ``sglang`` package (``site-packages`` for a wheel install). Each
patch is applied with ``git apply`` run as a plain patch tool in that directory (git's
repository discovery is fenced off with ``GIT_CEILING_DIRECTORIES``, so a venv living inside
some git work tree is still patched in place).

Per patch, the state is decided by dry runs: ``git apply --check`` succeeds → *unapplied*;
``git apply --check --reverse`` succeeds → *applied*; neither → *conflict* (the files were
changed by something else). ``apply`` and ``revert`` are idempotent and all-or-nothing: if a
patch fails midway, the patches this call already applied are reverted again.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchError, SglangVersionError

__all__ = [
    "SGLANG_VERSION",
    "PatchState",
    "apply_series",
    "find_installed_sglang",
    "patch_states",
    "read_tree_version",
    "revert_series",
    "series_dir",
    "series_patches",
]

SGLANG_VERSION = "0.5.11"
SERIES_NAME = f"sglang-v{SGLANG_VERSION}"

APPLIED, UNAPPLIED, CONFLICT = "applied", "unapplied", "conflict"


def series_dir() -> Path:
    """Folder of the patch series: the copy shipped inside the wheel
    (``tkv/sglang/_patches/sglang-v0.5.11``), else the repository's ``patches/`` folder.

    Raises:
        PatchError: neither exists.
    """
    here = Path(__file__).resolve().parent
    candidates = [here / "_patches" / SERIES_NAME]
    candidates += [p / "patches" / SERIES_NAME for p in here.parents]
    for c in candidates:
        if (c / "series").is_file():
            return c
    raise PatchError(f"patch series {SERIES_NAME} not found (looked in {candidates[0]} and "
                     "the repository's patches/ folder)")


def series_patches(directory: Path | None = None) -> list[Path]:
    """The patch files in application order, as listed by the ``series`` file."""
    d = directory or series_dir()
    names = [ln.strip() for ln in (d / "series").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise PatchError(f"series lists missing patch files: {missing}")
    return [d / n for n in names]


def find_installed_sglang() -> Path:
    """The directory holding the installed ``sglang`` package (site-packages), found without
    importing sglang.

    Raises:
        SglangVersionError: sglang is not installed.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SglangVersionError(
            f"sglang is not installed in this Python ({sys.executable}); "
            f"install sglang=={SGLANG_VERSION} first")
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def read_tree_version(root: Path) -> str | None:
    """SGLang version of the tree under ``root``: ``sglang-X.dist-info`` next to the package,
    else ``sglang/_version.py``; None when neither says."""
    for info in sorted(root.glob("sglang-*.dist-info")):
        meta = info / "METADATA"
        if meta.is_file():
            m = re.search(r"^Version:\s*(\S+)", meta.read_text(errors="replace"), re.M)
            if m:
                return m.group(1)
    vfile = root / "sglang" / "_version.py"
    if vfile.is_file():
        m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", vfile.read_text())
        if m:
            return m.group(1)
    return None


def check_version(root: Path) -> str:
    """Refuse a tree that is not SGLang 0.5.11.

    Raises:
        SglangVersionError: no ``sglang`` package under ``root``, or another version.
    """
    if not (root / "sglang" / "srt").is_dir():
        raise SglangVersionError(f"{root} does not hold an sglang package (no sglang/srt/)")
    v = read_tree_version(root)
    if v != SGLANG_VERSION:
        raise SglangVersionError(
            f"the patch series is for sglang {SGLANG_VERSION}, but {root} holds sglang "
            f"{v or '(unknown version)'}; install sglang=={SGLANG_VERSION}")
    return v


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    git = shutil.which("git")
    if git is None:
        raise PatchError("`git` is needed to apply the patch series (git apply); install git")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent), LC_ALL="C")
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return subprocess.run([git, "apply", *args], cwd=root, env=env, capture_output=True,
                          text=True, check=False)


@dataclass(frozen=True)
class PatchState:
    """State of one patch of the series on a tree: ``applied``, ``unapplied`` or
    ``conflict`` (detail: git's message)."""

    patch: Path
    state: str
    detail: str = ""


def _state(root: Path, patch: Path) -> PatchState:
    fwd = _git(root, "--check", str(patch))
    if fwd.returncode == 0:
        return PatchState(patch, UNAPPLIED)
    rev = _git(root, "--check", "--reverse", str(patch))
    if rev.returncode == 0:
        return PatchState(patch, APPLIED)
    # neither direction: a file of an applied patch edited since shows only in the reverse
    # check (the forward one just says the patch is already there) — report both
    detail = "\n".join(
        f"{what}: {(r.stderr or r.stdout).strip()}" for what, r in
        (("as unapplied (git apply --check)", fwd),
         ("as applied (git apply --check --reverse)", rev)))
    return PatchState(patch, CONFLICT, detail)


def patch_states(root: Path | None = None, *, check: bool = True) -> list[PatchState]:
    """State of every patch of the series on ``root`` (default: the installed sglang).

    Note: a patch whose changes depend on an earlier unapplied patch reports ``conflict``
    only if its hunks really overlap; this series' patches touch disjoint hunks."""
    root = Path(root) if root is not None else find_installed_sglang()
    if check:
        check_version(root)
    return [_state(root, p) for p in series_patches()]


def apply_series(root: Path | None = None) -> list[str]:
    """Apply the series to ``root`` (default: the installed sglang). Idempotent.

    Returns:
        one line per patch: ``"applied NAME"`` or ``"already applied NAME"``.
    Raises:
        SglangVersionError: not SGLang 0.5.11. PatchError: a patch conflicts (nothing is
        left half-applied).
    """
    root = Path(root) if root is not None else find_installed_sglang()
    check_version(root)
    done: list[Path] = []
    out = []
    for st in patch_states(root, check=False):
        if st.state == APPLIED:
            out.append(f"already applied {st.patch.name}")
            continue
        if st.state == CONFLICT:
            _undo(root, done)
            raise PatchError(f"{st.patch.name} does not apply to {root} (files changed by "
                             f"something else?):\n{st.detail}")
        res = _git(root, str(st.patch))
        if res.returncode != 0:
            _undo(root, done)
            raise PatchError(f"git apply {st.patch.name} failed in {root}:\n{res.stderr}")
        done.append(st.patch)
        out.append(f"applied {st.patch.name}")
    return out


def revert_series(root: Path | None = None) -> list[str]:
    """Revert the series on ``root`` (default: the installed sglang), last patch first.
    Idempotent, and all-or-nothing like :func:`apply_series`: a patch that fails to revert
    re-applies the ones already reverted. Raises like :func:`apply_series`."""
    root = Path(root) if root is not None else find_installed_sglang()
    check_version(root)
    states = patch_states(root, check=False)
    conflicts = [s for s in states if s.state == CONFLICT]
    if conflicts:
        raise PatchError(f"{conflicts[0].patch.name} neither applies nor reverts cleanly on "
                         f"{root}:\n{conflicts[0].detail}")
    out = []
    done: list[Path] = []
    for st in reversed(states):
        if st.state == UNAPPLIED:
            out.append(f"not applied {st.patch.name}")
            continue
        res = _git(root, "--reverse", str(st.patch))
        if res.returncode != 0:
            for p in reversed(done):   # back to the state we found
                _git(root, str(p))
            raise PatchError(f"git apply --reverse {st.patch.name} failed in {root} (the "
                             f"patches reverted before it were re-applied):\n{res.stderr}")
        done.append(st.patch)
        out.append(f"reverted {st.patch.name}")
    return out


def _undo(root: Path, done: list[Path]) -> None:
    for p in reversed(done):
        _git(root, "--reverse", str(p))
