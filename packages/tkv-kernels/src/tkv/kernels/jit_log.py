"""Log this process's Triton JIT compiles to a file, to find stalls inside serving runs.

Triton compiles a kernel the first time it meets a new specialization (constexprs, integer
classes, pointer alignment) — seconds for the tkv kernels, once per layer width pair. Inside
an engine that is a step that suddenly takes seconds. Counting new entries of the on-disk
Triton cache misses every kernel an earlier process already compiled (a disk hit still goes
through the same path, only faster), and engines compile in their own worker processes. This
module installs Triton's compilation listener (``triton.knobs.compilation.listener``, called
by ``triton.compile`` at the end of every compile and of every load from the disk cache —
i.e. on every in-memory cache miss of a kernel launch) in the process that runs the kernels
and appends one line per event to a file shared by all processes of a run.

Not the runtime JIT hooks (``knobs.runtime.jit_cache_hook`` / ``jit_post_compile_hook``):
with one set, Triton 3.6 first serializes the launch's constexprs with ``json.dumps``, which
raises ``TypeError`` for a kernel taking a ``@triton.jit`` function as a constexpr — as
every tkv attention kernel does (the Loader protocol's ``FETCH`` / ``DEQUANT``). Session 13
found that inside vLLM: the first engine with ``TKV_JIT_LOG`` set died at its first decode.

Engines: set ``TKV_JIT_LOG=/path/file.tsv``; the tkv vLLM and SGLang plugins call
:func:`install_from_env` in every process they are loaded in. Line format (tab-separated):
``start`` (Unix time, seconds), ``seconds`` (compile or load time), ``pid``, ``kernel``
(``module:qualname``), ``source`` (``compile`` or ``disk``). :func:`read_events` parses it.

A listener already installed by someone else is kept and called after tkv's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "JitEvent", "install", "install_from_env", "read_events"]

ENV = "TKV_JIT_LOG"
_INSTALLED: dict = {}   # "path": the file; "prev": the listener found at the first install


@dataclass(frozen=True)
class JitEvent:
    """One Triton JIT cache miss: ``start`` Unix time (s), ``seconds`` it took, ``pid``,
    ``kernel`` as ``module:qualname``, ``source``: ``"compile"`` (built) or ``"disk"``
    (loaded from Triton's cache folder)."""

    start: float
    seconds: float
    pid: int
    kernel: str
    source: str = "compile"


def _kernel_name(src) -> str:
    """``module:qualname`` of the kernel a ``triton.compile`` source holds (an ASTSource's
    JITFunction), else the source's ``name``."""
    fn = getattr(src, "fn", None)
    if fn is not None:
        qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "?")
        return f"{getattr(fn, 'module', '?')}:{qual}"
    return f"?:{getattr(src, 'name', '?')}"


def _seconds(times) -> float:
    """Total of a ``triton.knobs.CompileTimes`` (microseconds per phase) in seconds."""
    total = times.ir_initialization + sum(d for _, d in times.lowering_stages)
    return (total + times.store_results) / 1e6


def install(path: str | os.PathLike) -> None:
    """Append this process's Triton JIT events to ``path`` (created with its parent folder;
    idempotent per process; installing another path replaces the first, keeping a listener
    that was there before tkv's).

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
    if "prev" not in _INSTALLED:   # the listener someone else installed, before tkv's
        _INSTALLED["prev"] = knobs.compilation.listener
    prev = _INSTALLED["prev"]

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        now = time.time()
        secs = _seconds(times)
        with open(path, "a") as f:
            f.write(f"{now - secs:.6f}\t{secs:.6f}\t{os.getpid()}\t{_kernel_name(src)}\t"
                    f"{'disk' if cache_hit else 'compile'}\n")
        if prev is not None:
            prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                 cache_hit=cache_hit)

    knobs.compilation.listener = listener
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
        if len(parts) not in (4, 5):   # 4: logs written before the source field
            raise ValueError(f"{p}:{n}: expected 5 tab-separated fields, got {line!r}")
        ev = JitEvent(float(parts[0]), float(parts[1]), int(parts[2]), *parts[3:])
        if (since is None or ev.start >= since) and (until is None or ev.start <= until):
            out.append(ev)
    return out
