"""Tensor-parallel sharding of the tkv KV cache: which KV heads a rank holds.

vLLM and SGLang shard KV heads across (attention) TP ranks the same way, in their
``QKVParallelLinear`` (vLLM ``model_executor/layers/linear.py``, SGLang
``srt/layers/linear.py``: ``num_kv_head_replicas`` and ``shard_id = tp_rank //
num_kv_head_replicas``): with ``H = total_num_kv_heads`` and ``T`` the (attention) TP size,

* ``H ≥ T`` (``H % T == 0``): rank ``r`` owns heads ``[r·H/T, (r+1)·H/T)``;
* ``H < T`` (``T % H == 0``): every head is replicated on ``T/H`` ranks, rank ``r`` owns
  head ``r // (T/H)`` (one head per rank).

The tkv cache of a rank is then the :class:`~tkv.codec.layout.SlotLayout` of its local
heads. A layer's rotation, codebooks, channel scales and a shared key offset act on
``head_dim`` and are shared by all heads, so every rank loads the same bundle entry; the
per-head offsets ``(num_kv_heads, head_dim)`` (key offset μ, sink offsets) are the only
per-head tensors, sliced to
:attr:`KvHeadShard.heads` (:meth:`tkv.codec.CalibrationBundle.codec`'s ``heads``;
:meth:`tkv.codec.config.TkvConfig.codec`'s ``shard``). Engine-free: the adapters only ask
their engine for the rank and size.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ShapeError

__all__ = ["KvHeadShard", "shard_kv_heads"]


@dataclass(frozen=True)
class KvHeadShard:
    """KV heads one TP rank holds.

    Attributes:
        num_local_heads: KV heads in this rank's cache (``num_kv_heads`` of its SlotLayout).
        first_head: global index of its first KV head.
        replicas: how many ranks hold the same heads (1 unless ``H < T``).
    """

    num_local_heads: int
    first_head: int
    replicas: int

    @property
    def heads(self) -> range:
        """Global indices of the KV heads of this rank."""
        return range(self.first_head, self.first_head + self.num_local_heads)


def shard_kv_heads(total_num_kv_heads: int, tp_size: int, tp_rank: int) -> KvHeadShard:
    """The :class:`KvHeadShard` of ``tp_rank`` (the engines' QKVParallelLinear rule, see module doc).

    Raises:
        ShapeError: non-int or non-positive sizes, rank out of range, or head counts that the engines
        cannot shard (neither ``H % T == 0`` nor ``T % H == 0``).
    """
    h, t, r = total_num_kv_heads, tp_size, tp_rank
    for name, v in (("total_num_kv_heads", h), ("tp_size", t), ("tp_rank", r)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ShapeError(f"{name} must be an int, got {v!r}")
    if h < 1 or t < 1:
        raise ShapeError(f"total_num_kv_heads={h} and tp_size={t} must be ≥ 1")
    if not 0 <= r < t:
        raise ShapeError(f"tp_rank={r} outside 0..{t - 1}")
    if h >= t:
        if h % t:
            raise ShapeError(f"{h} KV heads cannot be split over {t} TP ranks")
        n = h // t
        return KvHeadShard(n, r * n, 1)
    if t % h:
        raise ShapeError(f"{t} TP ranks cannot replicate {h} KV heads evenly")
    rep = t // h
    return KvHeadShard(1, r // rep, rep)
