"""The two factories the patched SGLang calls for ``--kv-cache-dtype tkv``:
:func:`cell_size` (bytes per token, sizes the pool from profiled memory) and
:func:`create_pool` (builds :class:`~tkv.sglang.pool.TkvTokenToKVPool`). Both read the same
per-layer SlotLayouts, so the profiled token budget and the allocation agree to the byte.
"""

from __future__ import annotations

from tkv.codec.config import TkvConfig
from tkv.codec.layout import SlotLayout
from tkv.codec.sharding import KvHeadShard, shard_kv_heads

from .cell_size import cell_size_bytes, worker_layouts
from .config import tkv_config
from .errors import UnsupportedFeatureError
from .geometry import geometry_from_model_config

__all__ = ["cell_size", "create_pool", "loaded_kv_shard", "rank_shard", "runner_layouts"]


def rank_shard(runner) -> KvHeadShard:
    """The KV heads this worker's attention-TP rank holds.

    :func:`tkv.codec.shard_kv_heads` over SGLang's attention TP (``attn_tp_size`` /
    ``attn_tp_rank``; the rule of SGLang's ``QKVParallelLinear``, replication when TP > KV
    heads included) — the group SGLang sizes its KV pool with. Models do not all shard over
    that group (Qwen3 passes the attention-TP rank to ``QKVParallelLinear``, Llama and Qwen2 the
    plain TP rank; they differ under ``--enable-dp-attention``), so when the runner's model is
    loaded the shard is checked against the heads its first decoder attention layer's
    ``QKVParallelLinear`` actually loaded (:func:`loaded_kv_shard`; models without a fused
    ``qkv_proj`` are not checked): a mismatch would code the rank's heads with another head's
    per-head offsets.

    Raises:
        ShapeError: head counts SGLang cannot shard.
        UnsupportedFeatureError: the loaded model's KV heads on this rank are not the
            attention-TP shard.
    """
    from sglang.srt.layers.dp_attention import get_attention_tp_rank, get_attention_tp_size

    tp = int(get_attention_tp_size())
    rank = int(get_attention_tp_rank()) if tp > 1 else 0
    shard = shard_kv_heads(int(runner.model_config.get_total_num_kv_heads()), tp, rank)
    loaded = loaded_kv_shard(getattr(runner, "model", None))
    if loaded is not None and loaded != shard:
        raise UnsupportedFeatureError(
            f"tkv (SGLang): this rank's model loaded KV heads {list(loaded.heads)} "
            f"(its QKVParallelLinear), the attention-TP rank {rank}/{tp} that sizes the KV "
            f"pool gives {list(shard.heads)} — a model that shards "
            "attention over the plain TP group under --enable-dp-attention; not supported")
    return shard


_QKV_ATTRS = ("total_num_kv_heads", "num_kv_heads", "num_kv_head_replicas", "tp_rank", "tp_size")


def _decoder_qkv(model):
    """The ``QKVParallelLinear`` of the model's first decoder attention layer: a module's
    ``qkv_proj`` next to an ``attn`` with a ``layer_id`` (SGLang's ``RadixAttention``), so
    that a vision tower's attention (``VisionAttention``: other heads, no layer id) is never
    taken for it. None when ``model`` is None or has no such layer."""
    if model is None or not hasattr(model, "modules"):
        return None
    for m in model.modules():
        qkv, attn = getattr(m, "qkv_proj", None), getattr(m, "attn", None)
        if hasattr(attn, "layer_id") and all(hasattr(qkv, a) for a in _QKV_ATTRS):
            return qkv
    return None


def loaded_kv_shard(model) -> KvHeadShard | None:
    """The KV heads the first decoder attention layer of ``model`` loaded (its
    ``QKVParallelLinear``: k/v shard ``tp_rank // num_kv_head_replicas`` of ``num_kv_heads``
    heads; SGLang ``srt/layers/linear.py``, ``QKVParallelLinear.weight_loader``). None when
    ``model`` is None or has no ``qkv_proj`` beside a ``RadixAttention``."""
    m = _decoder_qkv(model)
    if m is None:
        return None
    n, rep = int(m.num_kv_heads), int(m.num_kv_head_replicas)
    return KvHeadShard(n, (int(m.tp_rank) // rep) * n, rep)


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
