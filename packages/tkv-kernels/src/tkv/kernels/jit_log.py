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

A listener already installed by someone else is kept and called after tkv's. Logging never
breaks a compile: a failed write (disk full, folder removed) warns once and is dropped.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "JitEvent", "install", "install_from_env", "install_from_env_or_log",
           "read_events"]

ENV = "TKV_JIT_LOG"
# "path": the file tkv's listener appends to (read at every event); "listener": tkv's
# listener (one per process, installed once); "warned": a write failure was reported
_INSTALLED: dict = {}
SOURCES = ("compile", "disk")


@dataclass(frozen=True)
class JitEvent:
    """One Triton JIT cache miss: ``start`` Unix time (s), ``seconds`` it took, ``pid``,
    ``kernel`` as ``module:qualname``, ``source``: ``"compile"`` (built), ``"disk"`` (loaded
    from Triton's cache folder) or ``"unknown"`` (a line written before session 13, when the
    log did not record it)."""

    start: float
    seconds: float
    pid: int
    kernel: str
    source: str = "unknown"


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


def _listener(*, src, metadata, metadata_group, times, cache_hit):
    """tkv's ``knobs.compilation.listener``: append one line to the current log path, then
    call the listener that was installed before tkv's (if any)."""
    path = _INSTALLED.get("path")
    if path is not None:
        try:
            secs = _seconds(times)
            line = (f"{time.time() - secs:.6f}\t{secs:.6f}\t{os.getpid()}\t{_kernel_name(src)}"
                    f"\t{SOURCES[1] if cache_hit else SOURCES[0]}\n")
            with open(path, "a") as f:
                f.write(line)
        except Exception as e:   # the log must never fail a kernel's compile
            if not _INSTALLED.get("warned"):
                _INSTALLED["warned"] = True
                warnings.warn(f"tkv.kernels.jit_log: cannot append to {path} ({e!r}); "
                              "JIT events are not logged", RuntimeWarning, stacklevel=2)
    prev = _INSTALLED.get("prev")
    if prev is not None:
        prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
             cache_hit=cache_hit)


def install(path: str | os.PathLike) -> None:
    """Append this process's Triton JIT events to ``path`` (created with its parent folder).
    Idempotent; installing another path only moves the log. tkv's listener is installed once
    per process, chaining the listener found then; a listener someone installs later around
    tkv's stays in place.

    Raises:
        OSError: ``path`` cannot be opened for appending.
    """
    from triton import knobs

    path = str(Path(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a"):
        pass
    _INSTALLED["path"] = path
    _INSTALLED.pop("warned", None)
    if _INSTALLED.get("listener") is None:
        _INSTALLED["prev"] = knobs.compilation.listener
        _INSTALLED["listener"] = _listener
        knobs.compilation.listener = _listener


def install_from_env() -> str | None:
    """:func:`install` at ``$TKV_JIT_LOG`` if it is set; returns the path (None if unset or
    blank).

    Raises:
        OSError: the path cannot be appended to (a directory, a parent that is a file, no
            permission), with a message naming ``TKV_JIT_LOG``. The engine plugins log it and
            carry on without the log: a diagnostic must not stop a process from serving.
    """
    path = (os.environ.get(ENV) or "").strip()
    if not path:
        return None
    try:
        install(path)
    except OSError as e:
        raise OSError(f"{ENV}={path!r}: cannot append Triton JIT events there "
                      f"({e.strerror or e}); set it to a writable file path or unset it") from None
    return path


def install_from_env_or_log(logger) -> str | None:
    """:func:`install_from_env` for engine plugins: an unusable ``TKV_JIT_LOG`` is logged as
    an error on ``logger`` (a :class:`logging.Logger`) and the process runs without the log."""
    try:
        return install_from_env()
    except OSError as e:
        logger.error("tkv: %s; Triton JIT events are not logged", e)
        return None


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
        if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] not in SOURCES):
            # 4 fields: a log written before the source field (source "unknown")
            raise ValueError(f"{p}:{n}: expected 5 tab-separated fields ending in compile or "
                             f"disk, got {line!r}")
        ev = JitEvent(float(parts[0]), float(parts[1]), int(parts[2]), *parts[3:])
        if (since is None or ev.start >= since) and (until is None or ev.start <= until):
            out.append(ev)
    return out
