"""tkv.calibrate — calibrate tkv for a model and report its quality.

The job (``tkv-calibrate`` / ``python -m tkv.calibrate``): collect post-RoPE K/V over
calibration text, fit per-channel scales and per-layer Lloyd-Max codebooks, measure per-layer
sensitivity, choose per-layer widths per bits-per-element budget (SmartMix, verified against
uniform), write a :class:`tkv.codec.CalibrationBundle`, and evaluate on held-out text beside
uncompressed and peer formats (report.md + report.png).

Public API::

    from tkv.calibrate import JobConfig, run_job, TkvCache
    res = run_job(JobConfig(out="tkv-calibration"))
    cache = TkvCache.from_bundle(CalibrationBundle.load(res.bundle_path), 4.0, prefill="bypass")
"""

import importlib

# Lazy (PEP 562): `tkv-calibrate --help` and argument errors must not wait for torch and
# transformers to import (tens of seconds on a busy 2-core machine).
_LAZY = {
    "QuantizedKVCache": "cache", "TkvCache": "cache",
    "CalibrateError": "errors", "ModelNotFoundError": "errors", "TextTooShortError": "errors",
    "UnsupportedModelError": "errors",
    "JobConfig": "pipeline", "JobResult": "pipeline", "run_job": "pipeline",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "CalibrateError",
    "JobConfig",
    "JobResult",
    "ModelNotFoundError",
    "QuantizedKVCache",
    "TextTooShortError",
    "TkvCache",
    "UnsupportedModelError",
    "run_job",
]
