"""Per-layer page layouts of one SGLang worker and the per-token cell size SGLang sizes its
KV pool with. Every byte count comes from :class:`tkv.codec.layout.SlotLayout`."""

from __future__ import annotations

import math

from tkv.codec.config import TkvConfig
from tkv.codec.errors import ShapeError
from tkv.codec.layout import ModelLayout, SlotLayout

from .errors import UnsupportedFeatureError

__all__ = ["cell_size_bytes", "check_key_offset_heads", "worker_layouts"]


def worker_layouts(config: TkvConfig, start_layer: int, end_layer: int, page_size: int,
                   num_kv_heads: int) -> list[SlotLayout]:
    """SlotLayouts of layers ``start_layer .. end_layer - 1`` (this pipeline stage), with
    ``page_size`` tokens per page and ``num_kv_heads`` heads (this tensor-parallel rank).

    Raises:
        ShapeError: layer range outside the model.
        UnsupportedFeatureError: the bundle has a per-head key offset μ for one of these layers
            and this rank holds another number of KV heads than the bundle (TP > 1): the pool
            does not slice μ to the rank's heads yet (check_key_offset_heads).
    """
    if not 0 <= start_layer < end_layer <= config.num_layers:
        raise ShapeError(f"layer range [{start_layer}, {end_layer}) outside the model's "
                         f"{config.num_layers} layers")
    for i in range(start_layer, end_layer):
        check_key_offset_heads(config, i, num_kv_heads)
    return [config.slot_layout(i, page_size, num_kv_heads) for i in range(start_layer, end_layer)]


def check_key_offset_heads(config: TkvConfig, layer: int, num_kv_heads: int) -> None:
    """Refuse per-head offsets ``(H, head_dim)`` — the key offset μ or a sink offset — on a
    rank that holds ``num_kv_heads`` ≠ H KV heads (tensor/attention parallelism shards or
    replicates heads): the SGLang pool builds the codec from the whole bundle entry, so head h
    would be coded with another head's offsets — silently wrong attention. Shared
    ``(head_dim,)`` offsets are fine on any rank.

    Raises:
        UnsupportedFeatureError: the case above, naming the layer and both head counts.
    """
    b = config.bundle
    heads = None if b is None else b.layers[layer].offset_heads(config.head_dim)
    if heads is not None and heads != num_kv_heads:
        raise UnsupportedFeatureError(
            f"tkv (SGLang): layer {layer}'s calibration bundle has per-head offsets (key offset "
            f"or sink offsets) for {heads} KV heads, this rank holds {num_kv_heads} "
            "(TP/attention-TP > 1); slicing them per rank is not supported in the SGLang pool "
            "yet: serve with --tp 1, or recalibrate with `tkv-calibrate --center-keys shared "
            "--no-sink-offset`")


def cell_size_bytes(layouts: list[SlotLayout]) -> int:
    """Bytes one token costs across ``layouts`` (SGLang's ``cell_size``): the pages' bytes per
    token (:attr:`ModelLayout.bytes_per_token`, padding included), rounded up to whole bytes
    (exact for page sizes that are multiples of 16)."""
    return math.ceil(ModelLayout(tuple(layouts)).bytes_per_token)
