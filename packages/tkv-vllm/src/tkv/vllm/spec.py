"""vLLM KV-cache specs of tkv layers: page bytes from :class:`tkv.codec.layout.SlotLayout`.

A tkv layer's cache is ``uint8 (num_blocks, page_bytes)`` with ``page_bytes =
SlotLayout(head_dim, num_kv_heads_per_rank, k_bits, v_bits, block_size).page_bytes``. The
specs carry the served widths and recompute the page from SlotLayout for whatever
``block_size`` vLLM gives them (``copy_with_new_block_size`` keeps them right). How widths
are chosen per layer (per-layer pages, or one common page for hybrid models) is
:mod:`tkv.vllm.pages`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from tkv.codec.layout import SlotLayout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

from .errors import UnsupportedModelError
from .pages import PagePlan, plan_pages
from .startup import check_parallel_supported, layer_index, tkv_config

__all__ = ["TKV_DTYPE", "TkvFullAttentionSpec", "TkvSlidingWindowSpec", "kv_cache_spec_for_layer",
           "page_plan", "tkv_attention_layers"]

log = logging.getLogger("tkv.vllm")

TKV_DTYPE = "tkv"
_LOGGED: set[str] = set()


def _layout(spec: Any, block_size: int | None = None) -> SlotLayout:
    return SlotLayout(spec.head_size, spec.num_kv_heads, spec.tkv_k_bits, spec.tkv_v_bits,
                      spec.block_size if block_size is None else block_size)


def _merge_widths(cls: type, specs: list, merged: Any) -> Any:
    first = (specs[0].tkv_k_bits, specs[0].tkv_v_bits)
    if any((s.tkv_k_bits, s.tkv_v_bits) != first for s in specs):
        # vLLM detects non-uniform specs through AssertionError (is_kv_cache_spec_uniform).
        raise AssertionError(f"{cls.__name__}: layers with different (k_bits, v_bits) "
                             "cannot share one KV-cache group spec")
    return replace(merged, tkv_k_bits=first[0], tkv_v_bits=first[1])


class _TkvPages:
    """Page bytes of a tkv spec from :class:`SlotLayout` (the one source of the layout);
    mixed in before vLLM's spec class so it overrides ``real_page_size_bytes``."""

    def layout(self, block_size: int | None = None) -> SlotLayout:
        """SlotLayout of one page (``block_size`` defaults to the spec's)."""
        return _layout(self, block_size)

    @property
    def real_page_size_bytes(self) -> int:
        return self.layout().page_bytes


@dataclass(frozen=True, kw_only=True)
class TkvFullAttentionSpec(_TkvPages, FullAttentionSpec):
    """Full-attention spec of a tkv layer (also used for sliding layers when vLLM's hybrid
    KV-cache manager is off: ``sliding_window`` set, allocated as full attention).

    Attributes:
        tkv_k_bits, tkv_v_bits: widths the layer is served at (2..8).
        (inherited) head_size = head_dim, num_kv_heads per TP rank, dtype = torch.uint8.
    """

    tkv_k_bits: int = 4
    tkv_v_bits: int = 4

    @classmethod
    def merge(cls, specs: list) -> TkvFullAttentionSpec:
        return _merge_widths(cls, specs, super().merge(specs))


@dataclass(frozen=True, kw_only=True)
class TkvSlidingWindowSpec(_TkvPages, SlidingWindowSpec):
    """Sliding-window spec of a tkv layer (vLLM frees blocks outside the window)."""

    tkv_k_bits: int = 4
    tkv_v_bits: int = 4

    # merge: KVCacheSpec.merge asserts every layer's spec is equal, widths included.


def tkv_attention_layers(vllm_config: Any) -> dict[str, Any]:
    """The engine's attention layers that own a tkv cache (``kv_cache_dtype == "tkv"``, not
    sharing another layer's cache), by layer name, in registration order."""
    ctx = vllm_config.compilation_config.static_forward_context
    return {name: lay for name, lay in ctx.items()
            if getattr(lay, "kv_cache_dtype", None) == TKV_DTYPE
            and getattr(lay, "kv_sharing_target_layer_name", None) is None}


def _hybrid_manager(vllm_config: Any) -> bool:
    return not bool(getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager",
                            False))


def page_plan(vllm_config: Any) -> PagePlan:
    """The :class:`PagePlan` of this engine (per-layer or common pages), computed from the
    validated config, this rank's KV heads and the sliding windows of the tkv layers."""
    cfg = tkv_config(vllm_config)
    shard = check_parallel_supported(vllm_config)   # every rank holds as many heads as rank 0
    kinds = [lay.sliding_window for lay in tkv_attention_layers(vllm_config).values()]
    plan = plan_pages(cfg.allocation, cfg.head_dim, shard.num_local_heads, kinds,
                      _hybrid_manager(vllm_config))
    msg = plan.describe(int(vllm_config.cache_config.block_size))
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        log.warning("%s", msg)
    return plan


def kv_cache_spec_for_layer(layer: Any, vllm_config: Any) -> KVCacheSpec:
    """The KV-cache spec of tkv attention layer ``layer`` (a vLLM ``Attention`` module).

    Raises:
        UnsupportedModelError (unsupported model / layer), the codec's config errors.
    """
    cfg = tkv_config(vllm_config)
    plan = page_plan(vllm_config)
    idx = layer_index(layer.layer_name, cfg.num_layers)
    if int(layer.num_kv_heads) != plan.num_kv_heads:
        raise UnsupportedModelError(
            f"tkv: layer {layer.layer_name} has {layer.num_kv_heads} KV heads on this rank, "
            f"the model config implies {plan.num_kv_heads}")
    k_bits, v_bits = plan.served[idx]
    common = dict(block_size=int(vllm_config.cache_config.block_size),
                  num_kv_heads=int(layer.num_kv_heads), head_size=int(layer.head_size),
                  head_size_v=int(layer.head_size), dtype=torch.uint8,
                  tkv_k_bits=k_bits, tkv_v_bits=v_bits)
    window = layer.sliding_window
    if window is not None:
        kinds = {lay.sliding_window for lay in tkv_attention_layers(vllm_config).values()}
        if _hybrid_manager(vllm_config) or len(kinds) == 1:
            return TkvSlidingWindowSpec(sliding_window=int(window), **common)
        return TkvFullAttentionSpec(sliding_window=int(window), **common)
    return TkvFullAttentionSpec(**common)
