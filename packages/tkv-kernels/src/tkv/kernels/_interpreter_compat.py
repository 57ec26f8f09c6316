"""Compatibility shim for the Triton CPU interpreter (``TRITON_INTERPRET=1``) with NumPy ≥ 2.4.

Triton 3.6's interpreter stores scalars as 1-element arrays and converts loop bounds with
``int(array)``, which NumPy 2.4 rejects for arrays with ``ndim > 0`` ("only 0-dimensional
arrays can be converted to Python scalars"), so any kernel with a runtime loop bound fails
under the interpreter. We wrap the interpreter's tensor patching so that ``__index__`` reads the
single element instead. Applied only when the interpreter is on; compiled kernels are untouched.
"""

from __future__ import annotations

import os

__all__ = ["apply"]

_applied = False


def apply() -> None:
    """Install the shim once (no-op unless ``TRITON_INTERPRET=1``)."""
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton without the interpreter
        return
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None:  # pragma: no cover - a future triton changed its internals
        return

    def _patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patched
    _applied = True
