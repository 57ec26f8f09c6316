"""Named errors of tkv.calibrate.

Each derives from :class:`tkv.codec.errors.TkvError` (and the built-in a caller would expect),
so ``except ValueError`` keeps working. The CLI turns every :class:`TkvError` into one clear
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

from tkv.codec.errors import TkvError

__all__ = [
    "CalibrateError",
    "JobConfigError",
    "ModelNotFoundError",
    "TextEncodingError",
    "TextTooShortError",
    "UnsupportedModelError",
]


class CalibrateError(TkvError, RuntimeError):
    """Base class of calibration errors."""


class ModelNotFoundError(CalibrateError, FileNotFoundError):
    """``--model`` names no local Hugging Face folder or GGUF file (or the bundled GGUF is gone)."""


class UnsupportedModelError(CalibrateError, ValueError):
    """The model has no attention layers tkv supports (decoder self-attention with a KV cache
    of ``(batch, num_kv_heads, tokens, head_dim)`` tensors, full attention)."""


class TextTooShortError(CalibrateError, ValueError):
    """A calibration/evaluation text holds fewer tokens than the requested windows need."""


class TextEncodingError(CalibrateError, ValueError):
    """A calibration/evaluation text file is not UTF-8."""


class JobConfigError(CalibrateError, ValueError):
    """A :class:`tkv.calibrate.pipeline.JobConfig` setting out of range (what the CLI's
    argument parser refuses, for callers that build the config themselves)."""
