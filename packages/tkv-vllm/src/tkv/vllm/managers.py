"""Scheduler-side block managers for tkv KV-cache specs (vLLM v0.20.1, engine-core process).

vLLM picks a KV-cache group's block manager by the group spec's *exact* type
(``single_type_kv_cache_manager.spec_manager_map[type(spec)]``), so

* a group whose spec is :class:`~tkv.vllm.spec.TkvFullAttentionSpec` /
  :class:`~tkv.vllm.spec.TkvSlidingWindowSpec` (every layer at the same widths) needs its own
  map entry — without one, the engine core dies with ``KeyError`` before serving;
* a model with per-layer widths (a calibrated SmartMix row) gets ONE group whose spec is a
  ``UniformTypeKVCacheSpecs`` (same block size and attention kind, different page bytes per
  layer), which 0.20.1's coordinator cannot serve at all: ``spec_manager_map`` has no entry for
  it, and ``FullAttentionManager.find_longest_cache_hit`` (prefix caching) asserts a
  ``FullAttentionSpec``.

Block bookkeeping (block ids, prefix-cache hits, sliding-window recycling) depends only on the
block size, the attention kind and the window — never on page bytes. So the managers here are
vLLM's own, fed with one member spec of such a group: :func:`block_manager_spec`. Other
(non-tkv) specs are dispatched exactly as before.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core import kv_cache_coordinator as _coordinator
from vllm.v1.core import single_type_kv_cache_manager as _stm
from vllm.v1.kv_cache_interface import KVCacheSpec, UniformTypeKVCacheSpecs

from .spec import TkvFullAttentionSpec, TkvSlidingWindowSpec

__all__ = ["TkvFullAttentionManager", "TkvSlidingWindowManager", "block_manager_spec",
           "register_kv_cache_managers"]

_TKV_SPECS = (TkvFullAttentionSpec, TkvSlidingWindowSpec)


def block_manager_spec(kv_cache_spec: KVCacheSpec) -> KVCacheSpec:
    """The spec a block manager should see for a KV-cache group's spec.

    A ``UniformTypeKVCacheSpecs`` whose layers are all tkv layers of one kind (same type,
    block size and window; only the page bytes differ) → its first layer's spec. Anything
    else → unchanged.
    """
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        members = list(kv_cache_spec.kv_cache_specs.values())
        first = members[0] if members else None
        if first is not None and isinstance(first, _TKV_SPECS) and all(
                type(m) is type(first) and m.block_size == first.block_size
                and getattr(m, "sliding_window", None) == getattr(first, "sliding_window", None)
                for m in members):
            return first
    return kv_cache_spec


def _unwrap(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "kv_cache_spec" in kwargs:
        kwargs["kv_cache_spec"] = block_manager_spec(kwargs["kv_cache_spec"])
    return kwargs


class TkvFullAttentionManager(_stm.FullAttentionManager):
    """vLLM's ``FullAttentionManager`` for tkv full-attention groups (also per-layer-width
    groups: prefix-cache lookups get a member spec instead of the group's
    ``UniformTypeKVCacheSpecs``)."""

    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: Any) -> None:
        super().__init__(block_manager_spec(kv_cache_spec), **kwargs)

    @classmethod
    def find_longest_cache_hit(cls, *args: Any, **kwargs: Any):
        return super().find_longest_cache_hit(*args, **_unwrap(kwargs))


class TkvSlidingWindowManager(_stm.SlidingWindowManager):
    """vLLM's ``SlidingWindowManager`` for tkv sliding-window groups (see
    :class:`TkvFullAttentionManager`)."""

    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: Any) -> None:
        super().__init__(block_manager_spec(kv_cache_spec), **kwargs)

    @classmethod
    def find_longest_cache_hit(cls, *args: Any, **kwargs: Any):
        return super().find_longest_cache_hit(*args, **_unwrap(kwargs))


def _get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, max_num_batched_tokens: int,
                                   max_model_len: int, **kwargs: Any):
    """vLLM's ``get_manager_for_kv_cache_spec`` after :func:`block_manager_spec` (so a
    sliding per-layer-width group also gets its admission cap from a real window spec)."""
    return _ORIGINAL(block_manager_spec(kv_cache_spec), max_num_batched_tokens, max_model_len,
                     **kwargs)


_ORIGINAL = _stm.get_manager_for_kv_cache_spec


def register_kv_cache_managers() -> None:
    """Map the tkv specs to their managers and let the coordinator build managers for
    per-layer-width groups (idempotent; called by the plugin in every vLLM process)."""
    _stm.spec_manager_map[TkvFullAttentionSpec] = TkvFullAttentionManager
    _stm.spec_manager_map[TkvSlidingWindowSpec] = TkvSlidingWindowManager
    # kv_cache_coordinator imported the function by name: rebind it there.
    _coordinator.get_manager_for_kv_cache_spec = _get_manager_for_kv_cache_spec
