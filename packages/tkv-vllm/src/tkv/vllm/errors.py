"""Named errors of the vLLM adapter (all derive from :class:`tkv.codec.errors.TkvError`)."""

from __future__ import annotations

from tkv.codec.errors import TkvError, UnsupportedFeatureError

__all__ = ["BackendMismatchError", "PatchesNotAppliedError", "UnsupportedModelError"]


class UnsupportedModelError(UnsupportedFeatureError):
    """The model (or one of its attention layers) is something the turbo-attn backend cannot
    serve: MLA, encoder / cross / encoder-only attention, hybrid Mamba or linear-attention
    stacks, attention sinks, ALiBi, soft-capped logits. Raised at startup, before the KV
    cache is allocated — never silent garbage."""


class PatchesNotAppliedError(TkvError, RuntimeError):
    """The installed vLLM lacks the tkv patch series (run ``tkv-vllm patch apply``)."""


class BackendMismatchError(TkvError, ValueError):
    """``--kv-cache-dtype tkv`` was combined with an attention backend other than
    ``turbo-attn`` (only turbo-attn reads the tkv cache)."""
