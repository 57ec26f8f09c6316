"""Per-layer page layouts of one SGLang worker and the per-token cell size SGLang sizes its
KV pool with. Every byte count comes from :class:`tkv.codec.layout.SlotLayout`."""

from __future__ import annotations

import math

from tkv.codec.config import TkvConfig
from tkv.codec.errors import ShapeError
from tkv.codec.layout import ModelLayout, SlotLayout

__all__ = ["cell_size_bytes", "worker_layouts"]


def worker_layouts(config: TkvConfig, start_layer: int, end_layer: int, page_size: int,
                   num_kv_heads: int) -> list[SlotLayout]:
    """SlotLayouts of layers ``start_layer .. end_layer - 1`` (this pipeline stage), with
    ``page_size`` tokens per page and ``num_kv_heads`` heads (this tensor-parallel rank).

    A bundle's per-head offsets need no check here: the pool slices them to the rank's heads
    (:meth:`TkvConfig.codec`'s ``shard``).

    Raises:
        ShapeError: layer range outside the model.
    """
    if not 0 <= start_layer < end_layer <= config.num_layers:
        raise ShapeError(f"layer range [{start_layer}, {end_layer}) outside the model's "
                         f"{config.num_layers} layers")
    return [config.slot_layout(i, page_size, num_kv_heads) for i in range(start_layer, end_layer)]


def cell_size_bytes(layouts: list[SlotLayout]) -> int:
    """Bytes one token costs across ``layouts`` (SGLang's ``cell_size``): the pages' bytes per
    token (:attr:`ModelLayout.bytes_per_token`, padding included), rounded up to whole bytes
    (exact for page sizes that are multiples of 16)."""
    return math.ceil(ModelLayout(tuple(layouts)).bytes_per_token)
