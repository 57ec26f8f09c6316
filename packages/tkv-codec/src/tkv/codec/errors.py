"""Named exceptions raised by tkv.

Every error tkv raises on bad input derives from :class:`TkvError`, and also from the
built-in exception a Python user would expect (``ValueError``, ``TypeError``, ``KeyError``),
so ``except ValueError`` keeps working for callers that do not know about tkv.
"""

from __future__ import annotations

__all__ = [
    "BitWidthError",
    "BudgetRowMissingError",
    "BundleError",
    "BundleGeometryError",
    "BundleSchemaError",
    "CodebookError",
    "DeviceMismatchError",
    "DtypeError",
    "NonFiniteError",
    "ShapeError",
    "TkvBitsError",
    "TkvError",
    "UnsupportedFeatureError",
]


class TkvError(Exception):
    """Base class of every error raised by tkv."""


class ShapeError(TkvError, ValueError):
    """A tensor has the wrong shape (for example its last dim is not ``head_dim``)."""


class DtypeError(TkvError, TypeError):
    """A tensor has a dtype the operation does not accept (for example an integer K/V)."""


class DeviceMismatchError(TkvError, ValueError):
    """A tensor lives on a different device than the codec or the other operands."""


class NonFiniteError(TkvError, ValueError):
    """A tensor holds NaN or Inf where finite values are required."""


class BitWidthError(TkvError, ValueError):
    """A bit width is outside the supported range 2..8 (or not an integer)."""


class CodebookError(TkvError, ValueError):
    """A codebook is malformed: wrong size, unsorted, or non-finite entries."""


class BundleError(TkvError, ValueError):
    """Base class of calibration-bundle errors."""


class BundleSchemaError(BundleError):
    """A calibration bundle does not follow the schema (missing key, wrong type, bad version)."""


class BundleGeometryError(BundleError):
    """A calibration bundle was made for a different model geometry than the one served."""


class BudgetRowMissingError(BundleError, KeyError):
    """``TKV_BITS`` names a budget that the bundle's ``byte_budget_table`` has no row for."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class TkvBitsError(TkvError, ValueError):
    """``TKV_BITS`` is not a number in [2.0, 8.0]."""


class UnsupportedFeatureError(TkvError, ValueError):
    """A model or engine feature the tkv cache cannot serve (MLA, encoder/cross attention,
    Mamba/linear attention, attention sinks, ...). Engine adapters raise it (or a subclass) at
    startup, before any KV cache memory is allocated, never serving silent garbage."""
