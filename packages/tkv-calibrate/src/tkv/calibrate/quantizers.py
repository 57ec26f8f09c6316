"""The K/V quantizer protocol used by the evaluation caches, and the tkv quantizer.

A quantizer acts on one layer's K/V chunk as the cache stores them (after RoPE):
``roundtrip(k, v)`` with ``k, v`` float ``(batch, num_kv_heads, tokens, head_dim)`` returns
what attention reads back after storage (same shape and dtype). ``bytes_per_token_head``
is the storage cost of one token of one KV head, K and V together, in bytes.

Peers (fp8, KIVI, vLLM TurboQuant presets) live in :mod:`tkv.calibrate.peers`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from tkv.codec import SlotLayout, TurboKVCodec
from tkv.codec.errors import ShapeError

__all__ = ["KVQuantizer", "TkvQuantizer"]

# Block size used to price tkv slots: vLLM/SGLang use multiples of 16, where SlotLayout has no
# padding, so the price is exactly the code + norm bytes.
PRICE_BLOCK_SIZE = 16


@runtime_checkable
class KVQuantizer(Protocol):
    """One layer's K/V storage format (see module docstring)."""

    name: str

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def bytes_per_token_head(self) -> float:
        ...


def compress_bhtd(side, x: torch.Tensor):
    """``side.compress`` (a :class:`tkv.codec.codec.SideCodec`: ``codec.k`` / ``codec.v``) for
    HF-layout vectors float ``(B, H, T, d)`` → uint8 codes ``(B, H, T, packed_bytes)``, bf16
    norms ``(B, H, T)``. Per-head offsets ``(H, d)`` (key centering, sink offsets) need the head
    axis at -2, so the call then goes through a ``(B, T, H, d)`` view."""
    if side.offset_heads is None:
        return side.compress(x)
    if x.dim() < 3:
        raise ShapeError(f"{side.name} input must be (..., num_kv_heads, T, head_dim) with "
                         f"per-head offsets, got {tuple(x.shape)}")
    c, n = side.compress(x.transpose(-3, -2))
    return c.transpose(-3, -2), n.transpose(-2, -1)


def decompress_bhtd(side, codes: torch.Tensor, norms: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`compress_bhtd`: codes ``(B, H, T, pb)``, norms ``(B, H, T)`` →
    vectors ``(B, H, T, d)`` in ``dtype`` (per-head offsets added back to their heads)."""
    if side.offset_heads is None:
        return side.decompress(codes, norms, dtype)
    return side.decompress(codes.transpose(-3, -2), norms.transpose(-2, -1),
                           dtype).transpose(-3, -2)


class TkvQuantizer:
    """tkv storage of one layer: :class:`tkv.codec.TurboKVCodec` compress → decompress.

    Args:
        codec: the layer's codec (widths, rotation, channel scales, codebooks).
        name: label for reports.

    ``encode`` returns the packed representation the cache keeps (uint8 codes
    ``(B, H, T, ceil(d·bits/8))`` and bf16 norms ``(B, H, T)`` per side); ``decode`` turns it
    back into float K/V. Bytes are priced by :class:`tkv.codec.SlotLayout`.
    """

    def __init__(self, codec: TurboKVCodec, name: str | None = None):
        self.codec = codec
        self.name = name or f"tkv K{codec.k_bits}V{codec.v_bits}"

    def encode(self, k: torch.Tensor, v: torch.Tensor):
        """``(k, v)`` float ``(B, H, T, d)`` → ``((k_codes, k_norms), (v_codes, v_norms))``."""
        return compress_bhtd(self.codec.k, k), compress_bhtd(self.codec.v, v)

    def decode(self, kp, vp, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed K/V from :meth:`encode` → float K/V ``(B, H, T, d)`` in ``dtype``."""
        return (decompress_bhtd(self.codec.k, *kp, dtype),
                decompress_bhtd(self.codec.v, *vp, dtype))

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kp, vp = self.encode(k, v)
        return self.decode(kp, vp, k.dtype)

    def layout(self, num_kv_heads: int = 1) -> SlotLayout:
        """This layer's :class:`SlotLayout` at ``PRICE_BLOCK_SIZE``."""
        return self.codec.layout(num_kv_heads, PRICE_BLOCK_SIZE)

    def bytes_per_token_head(self) -> float:
        return self.layout(1).bytes_per_token
