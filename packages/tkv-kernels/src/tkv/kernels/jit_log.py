"""Log this process's Triton JIT compiles to a file, to find stalls inside serving runs.

Triton compiles a kernel the first time it meets a new specialization (constexprs, integer
classes, pointer alignment) — seconds for the tkv kernels, once per layer width pair. Inside
an engine that is a step that suddenly takes seconds. Counting new entries of the on-disk
Triton cache misses every kernel an earlier process already compiled (a disk hit still goes
through the same path, only faster), and engines compile in their own worker processes. This
module installs Triton's JIT hooks (``triton.knobs.runtime.jit_cache_hook`` before, and
``jit_post_compile_hook`` after, every in-memory cache miss: compile or disk load) in the
process that runs the kernels and appends one line per event to a file shared by all
processes of a run.

Engines: set ``TKV_JIT_LOG=/path/file.tsv``; the tkv vLLM and SGLang plugins call
:func:`install_from_env` in every process they are loaded in. Line format (tab-separated):
``start`` (Unix time, seconds), ``seconds`` (compile or load time), ``pid``, ``kernel``
(``module:qualname``). :func:`read_events` parses it.

Hooks already installed by someone else are kept and called first (their return value is
returned, so a hook that skips compilation still does).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "JitEvent", "install", "install_from_env", "read_events"]

ENV = "TKV_JIT_LOG"
_INSTALLED: dict = {}   # "path": the file; "prev": the hooks found at the first install


@dataclass(frozen=True)
class JitEvent:
    """One Triton JIT cache miss: ``start`` Unix time (s), ``seconds`` it took, ``pid``,
    ``kernel`` as ``module:qualname``."""

    start: float
    seconds: float
    pid: int
    kernel: str


def _kernel_name(fn) -> str:
    module = getattr(fn, "module", None)
    module = getattr(module, "__name__", module)
    return f"{module}:{getattr(fn, 'name', '?')}"


def _event_key(kw) -> tuple:
    """What identifies one compile across the two hooks: Triton builds a new ``fn`` info
    object for each hook call, so the kernel (its JITFunction) and the specialization key."""
    fn = kw.get("fn")
    return id(getattr(fn, "jit_function", fn)), str(kw.get("key"))


def install(path: str | os.PathLike) -> None:
    """Append this process's Triton JIT events to ``path`` (created with its parent folder;
    idempotent per process; installing another path replaces the first, keeping any hooks
    that were there before tkv's).

    Raises:
        OSError: ``path`` cannot be opened for appending.
    """
    from triton import knobs

    path = str(Path(path))
    if _INSTALLED.get("path") == path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a"):
        pass
    starts: dict[tuple, float] = {}
    if "prev" not in _INSTALLED:   # the hooks someone else installed, before tkv's
        _INSTALLED["prev"] = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    prev_before, prev_after = _INSTALLED["prev"]

    def before(**kw):
        key = _event_key(kw)
        starts[key] = time.time()
        skip = prev_before(**kw) if prev_before else False
        if skip:   # an earlier hook skips the compile: no post hook will come
            starts.pop(key, None)
        return skip

    def after(**kw):
        t0 = starts.pop(_event_key(kw), None)
        now = time.time()
        t0 = now if t0 is None else t0
        with open(path, "a") as f:
            f.write(f"{t0:.6f}\t{now - t0:.6f}\t{os.getpid()}\t{_kernel_name(kw.get('fn'))}\n")
        return prev_after(**kw) if prev_after else None

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    _INSTALLED["path"] = path


def install_from_env() -> str | None:
    """:func:`install` at ``$TKV_JIT_LOG`` if it is set; returns the path (None if unset)."""
    path = os.environ.get(ENV)
    if not path:
        return None
    install(path)
    return path


def read_events(path: str | os.PathLike, since: float | None = None,
                until: float | None = None) -> list[JitEvent]:
    """Events logged at ``path`` whose start lies in ``[since, until]`` (either bound
    optional); ``[]`` when the file does not exist.

    Raises:
        ValueError: a malformed line.
    """
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 4:
            raise ValueError(f"{p}:{n}: expected 4 tab-separated fields, got {line!r}")
        ev = JitEvent(float(parts[0]), float(parts[1]), int(parts[2]), parts[3])
        if (since is None or ev.start >= since) and (until is None or ev.start <= until):
            out.append(ev)
    return out
