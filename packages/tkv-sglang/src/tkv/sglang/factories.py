"""The two factories the patched SGLang calls for ``--kv-cache-dtype tkv``:
:func:`cell_size` (bytes per token, sizes the pool from profiled memory) and
:func:`create_pool` (builds :class:`~tkv.sglang.pool.TkvTokenToKVPool`). Both read the same
per-layer SlotLayouts, so the profiled token budget and the allocation agree to the byte.
"""

from __future__ import annotations

from tkv.codec.config import TkvConfig
from tkv.codec.errors import ShapeError
from tkv.codec.layout import SlotLayout
from tkv.codec.sharding import KvHeadShard, shard_kv_heads

from .cell_size import cell_size_bytes, worker_layouts
from .config import tkv_config
from .errors import UnsupportedFeatureError
from .geometry import geometry_from_model_config

__all__ = ["cell_size", "create_pool", "rank_shard", "runner_layouts"]


def rank_shard(runner) -> KvHeadShard:
    """The KV heads this worker's attention-TP rank holds: SGLang's models pass
    ``attn_tp_rank`` / ``attn_tp_size`` to ``QKVParallelLinear``, whose rule
    :func:`tkv.codec.shard_kv_heads` restates (replication when TP > KV heads included).

    Raises:
        ShapeError: head counts SGLang cannot shard, or a shard size that disagrees with
            ``ModelConfig.get_num_kv_heads`` (the heads SGLang gives this rank's attention).
    """
    from sglang.srt.layers.dp_attention import get_attention_tp_rank, get_attention_tp_size

    tp = int(get_attention_tp_size())
    rank = int(get_attention_tp_rank()) if tp > 1 else 0
    shard = shard_kv_heads(int(runner.model_config.get_total_num_kv_heads()), tp, rank)
    local = int(runner.model_config.get_num_kv_heads(tp))
    if shard.num_local_heads != local:
        raise ShapeError(f"tkv (SGLang): attention-TP rank {rank}/{tp} holds {local} KV heads, "
                         f"the QKVParallelLinear rule gives {shard.num_local_heads}")
    return shard


def runner_layouts(runner, num_layers: int | None = None,
                   num_kv_heads: int | None = None) -> tuple[TkvConfig, list[SlotLayout]]:
    """``(config, layouts)`` of the layers a ModelRunner holds (``num_kv_heads``: the rank's
    KV heads; default :func:`rank_shard`'s).

    Raises:
        UnsupportedFeatureError: draft worker, hybrid linear/Mamba model, looped layers, or a
            model kind refused by :func:`~tkv.sglang.geometry.geometry_from_model_config`.
        plus the tkv config errors (tkv.codec.config).
    """
    if getattr(runner, "is_draft_worker", False):
        raise UnsupportedFeatureError("tkv does not serve speculative-decoding draft workers yet")
    if getattr(runner, "mambaish_config", None) is not None:
        raise UnsupportedFeatureError(
            "--kv-cache-dtype tkv serves pure attention decoders; this model has "
            "linear-attention/Mamba layers")
    config = tkv_config(geometry_from_model_config(runner.model_config))
    n = runner.num_effective_layers if num_layers is None else num_layers
    if n != runner.end_layer - runner.start_layer:
        raise UnsupportedFeatureError(
            f"{n} KV layers for layers [{runner.start_layer}, {runner.end_layer}) (looped "
            "layers?); not supported by tkv")
    heads = rank_shard(runner).num_local_heads if num_kv_heads is None else num_kv_heads
    return config, worker_layouts(config, runner.start_layer, runner.start_layer + n,
                                  runner.page_size, heads)


def cell_size(runner, num_layers: int) -> int:
    """Bytes one token costs in this worker's tkv pool, across its ``num_layers`` layers."""
    return cell_size_bytes(runner_layouts(runner, num_layers)[1])


def create_pool(runner):
    """Build the worker's :class:`~tkv.sglang.pool.TkvTokenToKVPool`
    (``runner.max_total_num_tokens`` tokens)."""
    from .pool import TkvTokenToKVPool

    shard = rank_shard(runner)
    config, layouts = runner_layouts(runner, num_kv_heads=shard.num_local_heads)
    return TkvTokenToKVPool(
        runner.max_total_num_tokens, runner.page_size, config, layouts, runner.device,
        enable_memory_saver=runner.server_args.enable_memory_saver,
        start_layer=runner.start_layer, shard=shard)
