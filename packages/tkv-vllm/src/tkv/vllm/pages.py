"""How the tkv layers' pages live in vLLM's block pool (no vLLM import here).

vLLM v0.20.1 allocates KV blocks from one pool; a block id means the same tokens in every
layer of a KV-cache group. Two situations:

* **per-layer pages** (every model whose tkv layers are one attention kind: all full
  attention, or all sliding with one window — the common case): each layer keeps the
  bundle's own ``(k_bits, v_bits)`` and its own ``SlotLayout.page_bytes``; vLLM's
  ``UniformTypeKVCacheSpecs`` puts all layers in one group with one block table and sizes
  each layer's tensor ``page_bytes(layer) · num_blocks``. Zero waste.
* **common page** (hybrid full + sliding models under vLLM's hybrid KV-cache manager, which
  needs one page size across its groups): every layer is *served at the widest widths of
  each side* — ``(max k_bits, max v_bits)`` over the layers — so no layer gets fewer bits
  than allocated on either side (never worse quality) and no page holds dead padding. When
  one layer holds both maxima that is the widest allocated page (same bytes); when the maxima
  sit in different layers (K5V3 beside K3V5) the common page is wider than any allocated one.
  The capacity lost against per-layer pages is reported at startup
  (:meth:`PagePlan.capacity_loss`).

Page bytes always come from :class:`tkv.codec.layout.SlotLayout`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from tkv.codec.bundle import LayerAllocation
from tkv.codec.errors import ShapeError
from tkv.codec.layout import SlotLayout

__all__ = ["COMMON", "PER_LAYER", "PagePlan", "plan_pages"]

PER_LAYER = "per-layer"
COMMON = "common"


@dataclass(frozen=True)
class PagePlan:
    """Widths every layer is served at, and why.

    Attributes:
        mode: ``"per-layer"`` or ``"common"`` (see module docstring).
        allocated: ``(k_bits, v_bits)`` per layer from the bundle / default allocation.
        served: ``(k_bits, v_bits)`` per layer actually stored (``== allocated`` in
            per-layer mode; ``(max k_bits, max v_bits)`` over the layers for every layer in
            common mode).
        head_dim: elements per head. num_kv_heads: KV heads per TP rank.
    """

    mode: Literal["per-layer", "common"]
    allocated: tuple[tuple[int, int], ...]
    served: tuple[tuple[int, int], ...]
    head_dim: int
    num_kv_heads: int

    def layout(self, layer: int, block_size: int) -> SlotLayout:
        """SlotLayout of ``layer`` as served (its cache is ``uint8 (num_blocks, page_bytes)``)."""
        k, v = self.served[layer]
        return SlotLayout(self.head_dim, self.num_kv_heads, k, v, block_size)

    def _pages(self, widths: Sequence[tuple[int, int]], block_size: int) -> int:
        return sum(SlotLayout(self.head_dim, self.num_kv_heads, k, v, block_size).page_bytes
                   for k, v in widths)

    def capacity_loss(self, block_size: int) -> float:
        """Fraction of resident tokens lost against per-layer pages:
        ``1 − Σ page(allocated) / Σ page(served)`` (0.0 in per-layer mode)."""
        return 1.0 - self._pages(self.allocated, block_size) / self._pages(self.served, block_size)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block id costs across all layers (what vLLM divides memory by)."""
        return self._pages(self.served, block_size)

    def describe(self, block_size: int) -> str:
        """One startup-log line."""
        bf16 = block_size * sum(self.layout(i, block_size).bf16_bytes_per_token
                                for i in range(len(self.served)))
        per_block = self.bytes_per_block(block_size)
        s = (f"tkv pages ({self.mode}): {len(self.served)} layers, {per_block} B per "
             f"{block_size}-token block, {bf16 / per_block:.3f}x tokens vs bf16")
        if self.mode == COMMON:
            k, v = self.served[0]
            s += (f"; hybrid attention needs one page size: every layer served at K{k}V{v}, "
                  f"{100 * self.capacity_loss(block_size):.1f}% fewer tokens than per-layer "
                  f"pages")
        return s


def plan_pages(allocation: LayerAllocation, head_dim: int, num_kv_heads: int,
               attention_kinds: Sequence[Hashable], hybrid_manager: bool = True) -> PagePlan:
    """Choose per-layer or common pages.

    Args:
        allocation: per-layer widths (``TkvConfig.allocation``).
        head_dim, num_kv_heads: geometry (num_kv_heads per TP rank).
        attention_kinds: one hashable per tkv attention layer present in the engine, e.g.
            its sliding window (``None`` for full attention).
        hybrid_manager: vLLM's hybrid KV-cache manager is on (``False`` when
            ``--disable-hybrid-kv-cache-manager``: sliding layers are then allocated as full
            attention and per-layer pages work for every model).

    Raises:
        ShapeError: empty allocation.
    """
    pairs = tuple(zip(allocation.k_bits, allocation.v_bits, strict=True))
    if not pairs:
        raise ShapeError("allocation has no layers")
    hybrid = hybrid_manager and len(set(attention_kinds)) > 1
    if not hybrid or len(set(pairs)) == 1:
        return PagePlan(PER_LAYER, pairs, pairs, head_dim, num_kv_heads)
    # each side at its widest: every layer keeps at least its calibrated bits on both sides
    # (the widest-bytes pair alone would serve a K3V5 layer at K5V3 beside it)
    w = (max(k for k, _ in pairs), max(v for _, v in pairs))
    return PagePlan(COMMON, pairs, (w,) * len(pairs), head_dim, num_kv_heads)
