"""The two factories the patched SGLang calls for ``--kv-cache-dtype tkv``:
:func:`cell_size` (bytes per token, sizes the pool from profiled memory) and
:func:`create_pool` (builds :class:`~tkv.sglang.pool.TkvTokenToKVPool`). Both read the same
per-layer SlotLayouts, so the profiled token budget and the allocation agree to the byte.
"""

from __future__ import annotations

from tkv.codec.config import TkvConfig
from tkv.codec.layout import SlotLayout

from .cell_size import cell_size_bytes, worker_layouts
from .config import tkv_config
from .errors import UnsupportedFeatureError
from .geometry import geometry_from_model_config

__all__ = ["cell_size", "create_pool", "runner_layouts"]


def _num_kv_heads_per_rank(runner) -> int:
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    return runner.model_config.get_num_kv_heads(get_attention_tp_size())


def runner_layouts(runner, num_layers: int | None = None,
                   num_kv_heads: int | None = None) -> tuple[TkvConfig, list[SlotLayout]]:
    """``(config, layouts)`` of the layers a ModelRunner holds.

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
    heads = _num_kv_heads_per_rank(runner) if num_kv_heads is None else num_kv_heads
    return config, worker_layouts(config, runner.start_layer, runner.start_layer + n,
                                  runner.page_size, heads)


def cell_size(runner, num_layers: int) -> int:
    """Bytes one token costs in this worker's tkv pool, across its ``num_layers`` layers."""
    return cell_size_bytes(runner_layouts(runner, num_layers)[1])


def create_pool(runner):
    """Build the worker's :class:`~tkv.sglang.pool.TkvTokenToKVPool`
    (``runner.max_total_num_tokens`` tokens)."""
    from .pool import TkvTokenToKVPool

    config, layouts = runner_layouts(runner)
    return TkvTokenToKVPool(
        runner.max_total_num_tokens, runner.page_size, config, layouts, runner.device,
        enable_memory_saver=runner.server_args.enable_memory_saver,
        start_layer=runner.start_layer)
