"""Named errors of the SGLang adapter (all derive from :class:`tkv.codec.errors.TkvError`)."""

from __future__ import annotations

from tkv.codec.errors import TkvError, UnsupportedFeatureError

# UnsupportedFeatureError is tkv.codec.errors.UnsupportedFeatureError, shared with tkv-vllm.
__all__ = ["PatchError", "SglangVersionError", "UnsupportedFeatureError"]


class SglangVersionError(TkvError, RuntimeError):
    """The installed (or targeted) SGLang is not the version the patch series was made for."""


class PatchError(TkvError, RuntimeError):
    """The patch series neither applies nor reverts cleanly (the tree was modified), or the
    patched SGLang registry is missing (``tkv-sglang patch apply`` was not run)."""
