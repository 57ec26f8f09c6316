"""Apply, revert and inspect the tkv patch series on an installed vLLM.

Users install vLLM from wheels, so there is no git checkout to ``git apply`` into. This
module applies the unified diffs of ``patches/vllm-v0.20.1/`` directly to the installed
``vllm`` package, in pure Python (no git, no ``patch`` binary needed on a serving host):

* every hunk is located by its exact old text (context + removed lines); a hunk whose
  new text is already there counts as applied, so :func:`apply` is idempotent;
* everything is checked before anything is written: a file where a hunk matches neither
  its old nor its new text (another vLLM build, a local edit) is a :class:`PatchConflictError`
  and nothing is touched;
* the vLLM tree's version (``vllm/_version.py``) must be exactly :data:`VLLM_VERSION`, otherwise
  :class:`VllmVersionError` (the series is written against that source only);
* :func:`revert` applies the series in reverse with the same checks.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from tkv.codec.errors import TkvError

__all__ = [
    "VLLM_VERSION",
    "FilePatch",
    "Hunk",
    "PatchConflictError",
    "PatchState",
    "SeriesStatus",
    "VllmNotFoundError",
    "VllmVersionError",
    "apply",
    "find_vllm_root",
    "load_series",
    "parse_patch",
    "revert",
    "series_dir",
    "status",
    "tree_version",
]

VLLM_VERSION = "0.20.1"
SERIES_NAME = f"vllm-v{VLLM_VERSION}"


class VllmNotFoundError(TkvError, ModuleNotFoundError):
    """No importable ``vllm`` package in this environment."""


class VllmVersionError(TkvError, RuntimeError):
    """The installed vLLM is not the version the patch series was written for."""


class PatchConflictError(TkvError, RuntimeError):
    """A hunk matches neither the unpatched nor the patched text of its file."""


class PatchState(StrEnum):
    """State of one patch (or of the whole series) on a vLLM tree."""

    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    PARTIAL = "partially applied"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class Hunk:
    """One ``@@`` hunk: the lines it expects (``old``) and the lines it writes (``new``),
    both including context, and its 1-based start line in the old file (a hint used
    only to pick among several identical matches)."""

    old: tuple[str, ...]
    new: tuple[str, ...]
    old_start: int


@dataclass(frozen=True)
class FilePatch:
    """The hunks of one file; ``path`` is relative to the vLLM tree root (the directory
    that contains the ``vllm`` package: the sdist root or ``site-packages``)."""

    path: str
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class PatchFile:
    """One ``NNNN-*.patch`` of the series: its name, header text and file patches."""

    name: str
    header: str
    files: tuple[FilePatch, ...]


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_patch(text: str, name: str = "<patch>") -> PatchFile:
    """Parse a ``git diff``-style unified diff (free-text header allowed before the
    first ``diff --git``). Only modifications of existing files are supported.

    Raises:
        ValueError: malformed diff (hunk line counts do not add up, file creation or
        deletion, a hunk outside a file section).
    """
    lines = text.splitlines()
    header: list[str] = []
    files: list[FilePatch] = []
    i = 0
    while i < len(lines) and not lines[i].startswith("diff --git "):
        header.append(lines[i])
        i += 1
    path: str | None = None
    hunks: list[Hunk] = []

    def flush() -> None:
        if path is not None:
            files.append(FilePatch(path, tuple(hunks)))

    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            flush()
            path, hunks = None, []
            i += 1
            continue
        if line.startswith("--- "):
            if line.strip() == "--- /dev/null":
                raise ValueError(f"{name}: file creation is not supported")
            i += 1
            continue
        if line.startswith("+++ "):
            target = line[4:].strip()
            if target == "/dev/null":
                raise ValueError(f"{name}: file deletion is not supported")
            path = target[2:] if target.startswith("b/") else target
            i += 1
            continue
        m = _HUNK_RE.match(line)
        if m:
            if path is None:
                raise ValueError(f"{name}: hunk before a +++ line at line {i + 1}")
            n_old = int(m.group(2) or 1)
            n_new = int(m.group(4) or 1)
            old: list[str] = []
            new: list[str] = []
            i += 1
            while len(old) < n_old or len(new) < n_new:
                if i >= len(lines):
                    raise ValueError(f"{name}: truncated hunk in {path}")
                body = lines[i]
                tag, rest = (body[:1], body[1:]) if body else (" ", "")
                if tag == " ":
                    old.append(rest)
                    new.append(rest)
                elif tag == "-":
                    old.append(rest)
                elif tag == "+":
                    new.append(rest)
                elif tag == "\\":  # "\ No newline at end of file"
                    pass
                else:
                    raise ValueError(f"{name}: bad hunk line {i + 1}: {body!r}")
                i += 1
            if len(old) != n_old or len(new) != n_new:
                raise ValueError(f"{name}: hunk line counts do not match in {path}")
            hunks.append(Hunk(tuple(old), tuple(new), int(m.group(1))))
            continue
        i += 1  # index/mode lines
    flush()
    if not files:
        raise ValueError(f"{name}: no file sections")
    return PatchFile(name, "\n".join(header).strip(), tuple(files))


def series_dir() -> Path:
    """Directory holding the ``NNNN-*.patch`` files: shipped inside the wheel as
    ``tkv/vllm/_patches/vllm-v0.20.1``, or the repository's ``patches/vllm-v0.20.1``
    for an editable install.

    Raises:
        FileNotFoundError: neither exists (broken install).
    """
    here = Path(__file__).resolve().parent
    candidates = [here / "_patches" / SERIES_NAME]
    candidates += [p / "patches" / SERIES_NAME for p in here.parents]
    for c in candidates:
        if c.is_dir() and any(c.glob("[0-9][0-9][0-9][0-9]-*.patch")):
            return c
    raise FileNotFoundError(f"tkv-vllm patch series {SERIES_NAME} not found (looked in "
                            f"{candidates[0]} and the source tree's patches/)")


def load_series(directory: Path | None = None) -> list[PatchFile]:
    """The parsed series, in file-name order (``0001-...`` first)."""
    d = series_dir() if directory is None else Path(directory)
    paths = sorted(d.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    if not paths:
        raise FileNotFoundError(f"no NNNN-*.patch files in {d}")
    return [parse_patch(p.read_text(), p.name) for p in paths]


def find_vllm_root() -> Path:
    """The directory containing the installed ``vllm`` package (usually site-packages),
    found without importing vLLM.

    Raises:
        VllmNotFoundError: vLLM not installed.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise VllmNotFoundError("vllm is not installed in this Python environment "
                                f"(pip install vllm=={VLLM_VERSION})")
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


_VERSION_RE = re.compile(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", re.M)


def tree_version(root: Path) -> str:
    """vLLM version of the tree at ``root`` (an sdist root or site-packages), read from
    ``vllm/_version.py`` without importing it.

    Raises:
        VllmNotFoundError: no ``vllm/_version.py`` under ``root``.
    """
    f = Path(root) / "vllm" / "_version.py"
    if not f.is_file():
        raise VllmNotFoundError(f"{root} does not contain a vllm package (no vllm/_version.py)")
    m = _VERSION_RE.search(f.read_text())
    if m is None:
        raise VllmVersionError(f"cannot read the vLLM version from {f}")
    return m.group(1)


def check_vllm_version(version: str) -> None:
    """Refuse any vLLM but 0.20.1 (a local build tag such as ``+cu130`` is accepted).

    Raises:
        VllmVersionError: naming both versions.
    """
    if re.fullmatch(re.escape(VLLM_VERSION) + r"(\+[0-9A-Za-z.]+)?", version) is None:
        raise VllmVersionError(
            f"tkv-vllm's patch series is for vllm=={VLLM_VERSION}, but vllm {version} is "
            f"installed; install vllm=={VLLM_VERSION} (the series is not portable)")


def _find(lines: list[str], block: Sequence[str], hint: int) -> int | None:
    """Start index of ``block`` in ``lines``; the occurrence closest to ``hint`` when
    the block occurs several times; None when absent."""
    n = len(block)
    if n == 0:
        return None
    first = block[0]
    hits = [i for i in range(len(lines) - n + 1)
            if lines[i] == first and tuple(lines[i:i + n]) == tuple(block)]
    if not hits:
        return None
    return min(hits, key=lambda i: abs(i - (hint - 1)))


def _locate(lines: list[str], h: Hunk) -> tuple[str | None, int]:
    """Which side of hunk ``h`` the file holds: ``("old", i)``, ``("new", i)`` or
    ``(None, -1)``. When both texts occur (a short hunk repeated elsewhere), the
    occurrence nearer the hunk's line number decides."""
    i_old = _find(lines, h.old, h.old_start)
    i_new = _find(lines, h.new, h.old_start)
    if i_old is None and i_new is None:
        return None, -1
    if i_new is None:
        return "old", i_old  # type: ignore[return-value]
    if i_old is None:
        return "new", i_new
    d_old, d_new = abs(i_old - (h.old_start - 1)), abs(i_new - (h.old_start - 1))
    return ("old", i_old) if d_old < d_new else ("new", i_new)


def _hunk_state(lines: list[str], h: Hunk) -> PatchState:
    side, _ = _locate(lines, h)
    return {"old": PatchState.NOT_APPLIED, "new": PatchState.APPLIED,
            None: PatchState.CONFLICT}[side]


def _combine(states: Sequence[PatchState]) -> PatchState:
    s = set(states)
    if PatchState.CONFLICT in s:
        return PatchState.CONFLICT
    if s == {PatchState.APPLIED}:
        return PatchState.APPLIED
    if s == {PatchState.NOT_APPLIED}:
        return PatchState.NOT_APPLIED
    return PatchState.PARTIAL


@dataclass(frozen=True)
class SeriesStatus:
    """Per-patch state of the series on one tree, and the overall state."""

    root: Path
    patches: tuple[tuple[str, PatchState], ...]

    @property
    def state(self) -> PatchState:
        return _combine([s for _, s in self.patches])

    def describe(self) -> str:
        rows = [f"vLLM tree: {self.root}"] + [f"  {n}: {s.value}" for n, s in self.patches]
        rows.append(f"series: {self.state.value}")
        return "\n".join(rows)


def _read(root: Path, fp: FilePatch) -> tuple[list[str], bool]:
    p = root / fp.path
    if not p.is_file():
        raise PatchConflictError(f"{fp.path}: not found under {root}")
    text = p.read_text()
    return text.splitlines(), text.endswith("\n")


def status(root: Path | None = None, series: list[PatchFile] | None = None) -> SeriesStatus:
    """State of every patch of the series on ``root`` (default: the installed vLLM)."""
    root = find_vllm_root() if root is None else Path(root)
    check_vllm_version(tree_version(root))
    series = load_series() if series is None else series
    out = []
    for pf in series:
        states = []
        for fp in pf.files:
            try:
                lines, _ = _read(root, fp)
            except PatchConflictError:
                states.append(PatchState.CONFLICT)
                continue
            states += [_hunk_state(lines, h) for h in fp.hunks]
        out.append((pf.name, _combine(states)))
    return SeriesStatus(root, tuple(out))


def _transform(root: Path, series: list[PatchFile], reverse: bool) -> dict[Path, str]:
    """New contents of every file the series touches, computed in memory and fully
    checked; raises PatchConflictError before anything is written."""
    contents: dict[str, tuple[list[str], bool]] = {}
    order = list(reversed(series)) if reverse else series
    for pf in order:
        for fp in pf.files:
            if fp.path not in contents:
                contents[fp.path] = _read(root, fp)
            lines, eol = contents[fp.path]
            hunks = list(reversed(fp.hunks)) if reverse else list(fp.hunks)
            for h in hunks:
                src, dst = (h.new, h.old) if reverse else (h.old, h.new)
                side, at = _locate(lines, h)
                if side is None:
                    raise PatchConflictError(
                        f"{pf.name}: {fp.path} around line {h.old_start} matches neither the "
                        f"vLLM {VLLM_VERSION} text nor the patched text; nothing was changed")
                if side == ("old" if reverse else "new"):
                    continue  # already in the wanted state
                lines[at:at + len(src)] = list(dst)
            contents[fp.path] = (lines, eol)
    return {root / p: "\n".join(lines) + ("\n" if eol else "")
            for p, (lines, eol) in contents.items()}


def _write(files: dict[Path, str]) -> list[Path]:
    """Write the changed files all-or-nothing: every new text goes to a temp file next to
    its target first; targets are then replaced, and restored if any replacement fails.

    Raises:
        PermissionError / OSError: the tree is not writable (nothing is left changed).
    """
    todo = {p: t for p, t in files.items() if p.read_text() != t}
    originals = {p: p.read_text() for p in todo}
    tmps: dict[Path, Path] = {}
    try:
        for path, text in todo.items():
            tmp = path.with_name(path.name + ".tkv-tmp")
            tmp.write_text(text)
            tmps[path] = tmp
        done = []
        try:
            for path, tmp in tmps.items():
                tmp.replace(path)
                done.append(path)
        except OSError:
            for path in done:
                path.write_text(originals[path])
            raise
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
    return list(todo)


def _run_series(root: Path | None, series: list[PatchFile] | None, reverse: bool) -> list[Path]:
    root = find_vllm_root() if root is None else Path(root)
    check_vllm_version(tree_version(root))
    series = load_series() if series is None else series
    return _write(_transform(root, series, reverse=reverse))


def apply(root: Path | None = None, series: list[PatchFile] | None = None) -> list[Path]:
    """Apply the series (idempotent). Returns the files changed (empty if already applied).

    Raises:
        VllmNotFoundError, VllmVersionError (installed vLLM), PatchConflictError.
    """
    return _run_series(root, series, reverse=False)


def revert(root: Path | None = None, series: list[PatchFile] | None = None) -> list[Path]:
    """Revert the series (idempotent). Returns the files changed.

    Raises:
        VllmNotFoundError, VllmVersionError (installed vLLM), PatchConflictError.
    """
    return _run_series(root, series, reverse=True)
