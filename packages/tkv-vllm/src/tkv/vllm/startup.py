"""Startup configuration of the tkv backend inside vLLM: validated once per process.

``TKV_BITS`` / ``TKV_CALIBRATION_FILE`` are read by :func:`tkv.codec.config.load_config`
(never parsed here), against the served model's geometry taken from vLLM's
``ModelConfig``: ``num_layers = total_num_hidden_layers``, ``num_kv_heads =
total_num_kv_heads`` (whole model, before TP sharding), ``head_dim = head_size``. The
first attention layer built calls :func:`tkv_config`; every later call returns the same
object, so a bad bundle fails the engine before any KV-cache byte is allocated, with the
codec's named errors (``FileNotFoundError``, ``BundleSchemaError``,
``BundleGeometryError``, ``BudgetRowMissingError``, ``TkvBitsError``).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch

from tkv.codec.codec import TurboKVCodec
from tkv.codec.config import ENV_BITS, ENV_CALIBRATION_FILE, TkvConfig, load_config
from tkv.codec.errors import UnsupportedFeatureError
from tkv.codec.sharding import KvHeadShard, shard_kv_heads
from tkv.kernels import head_dim_refusal

from .errors import UnsupportedModelError

__all__ = ["check_bundle_matches_model", "check_engine_features", "check_model_supported",
           "check_parallel_supported",
           "layer_codec", "layer_index", "model_geometry", "tkv_config",
           "tp_shard"]

log = logging.getLogger("tkv.vllm")

_CONFIGS: dict[tuple, TkvConfig] = {}


def model_geometry(model_config: Any) -> tuple[int, int, int]:
    """``(num_layers, total_num_kv_heads, head_dim)`` of a vLLM ``ModelConfig``."""
    return (int(model_config.get_total_num_hidden_layers()),
            int(model_config.get_total_num_kv_heads()), int(model_config.get_head_size()))


def check_model_supported(model_config: Any) -> None:
    """Refuse models the turbo-attn backend cannot serve, naming the reason.

    Raises:
        UnsupportedModelError: MLA, encoder-decoder, hybrid Mamba/linear-attention,
        attention-free, no-op-layer or chunked-local-attention models, attention logit
        soft-capping (Gemma-2), ALiBi (BLOOM, MPT / Falcon with ``alibi``), learned attention
        sinks (gpt-oss), or a head_dim the kernels do not serve (power of two in 16..256).
        The backend refuses the same per layer (``TurboAttnImpl``); these are found in the
        model's config at launch, before an engine process starts.
    """
    name = getattr(model_config, "model", "the model")
    checks = (
        ("use_mla", "uses MLA (latent KV); tkv compresses per-head K/V only"),
        ("is_encoder_decoder", "is encoder-decoder (cross-attention is not supported)"),
        ("is_hybrid", "mixes attention with Mamba/linear-attention layers"),
        ("is_attention_free", "has no attention layers"),
        ("has_noops", "has no-op attention layers (layer indices would not match the bundle)"),
    )
    for attr, why in checks:
        if bool(getattr(model_config, attr, False)):
            raise UnsupportedModelError(
                f"--kv-cache-dtype tkv / --attention-backend turbo-attn: {name} {why}")
    text_cfg = getattr(model_config, "hf_text_config", None)
    model_type = str(getattr(text_cfg, "model_type", "") or "")
    attn_cfg = getattr(text_cfg, "attn_config", None)
    features = (
        (bool(getattr(text_cfg, "attn_logit_softcapping", None)),
         "attention logit soft-capping (attn_logit_softcapping)"),
        (model_type == "bloom" or bool(getattr(text_cfg, "alibi", False))
         or (isinstance(attn_cfg, dict) and bool(attn_cfg.get("alibi"))), "ALiBi"),
        (model_type == "gpt_oss", "learned attention sinks"),
    )
    for bad, what in features:
        if bad:
            raise UnsupportedModelError(
                f"--kv-cache-dtype tkv / --attention-backend turbo-attn: {name} uses {what}, "
                "which the turbo-attn kernels do not implement")
    if getattr(text_cfg, "attention_chunk_size", None):
        raise UnsupportedModelError(
            f"--kv-cache-dtype tkv: {name} uses chunked local attention (attention_chunk_size),"
            " whose KV-cache spec bypasses the tkv page layout")
    head = int(model_config.get_head_size())
    refusal = head_dim_refusal(head)
    if refusal:
        raise UnsupportedModelError(f"--kv-cache-dtype tkv: {name} has {refusal}")


def check_parallel_supported(vllm_config: Any) -> KvHeadShard:
    """Refuse parallel layouts tkv cannot shard and return rank 0's KV-head shard (the rule
    every rank uses), so a bad TP size fails at startup, not in a worker.

    Raises:
        UnsupportedFeatureError: decode / prefill context parallelism (their KV-cache paths
            bypass the tkv page layout). ShapeError: a TP size that does not divide the KV
            heads nor is a multiple of them (:func:`tkv.codec.sharding.shard_kv_heads`).
    """
    pc = vllm_config.parallel_config
    for attr, flag in (("decode_context_parallel_size", "--decode-context-parallel-size"),
                       ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        n = int(getattr(pc, attr, 1) or 1)
        if n > 1:
            raise UnsupportedFeatureError(
                f"--kv-cache-dtype tkv does not support context parallelism ({flag} {n}): "
                "its KV-cache paths bypass the tkv page layout")
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    return shard_kv_heads(int(vllm_config.model_config.get_total_num_kv_heads()), tp, 0)


def check_engine_features(vllm_config: Any) -> None:
    """Refuse engine options whose KV-cache paths bypass the tkv page layout, at launch (they
    used to fail in an engine-core process, a KV connector with a misleading "run
    `tkv-vllm patch apply`").

    Raises:
        UnsupportedFeatureError: a KV connector or KV offloading (``--kv-transfer-config``,
        ``--kv-offloading-size``: they move pages in vLLM's bf16 block shape),
        ``--kv-cache-dtype-skip-layers`` (every layer of a tkv model is tkv), or a
        ``--block-size`` that is not a multiple of 16 (tkv pages' 16-byte alignment; the
        backend's supported kernel block sizes).
    """
    cc = vllm_config.cache_config
    kt = getattr(vllm_config, "kv_transfer_config", None)
    block = getattr(cc, "block_size", None)
    refused = (
        (kt is not None and getattr(kt, "kv_connector", None) is not None,
         f"KV connectors (--kv-transfer-config {getattr(kt, 'kv_connector', None)})"),
        (getattr(cc, "kv_offloading_size", None) is not None,
         "KV offloading (--kv-offloading-size)"),
        (bool(getattr(cc, "kv_cache_dtype_skip_layers", None)),
         "--kv-cache-dtype-skip-layers (every attention layer of the model is served by tkv)"),
        (block is not None and (isinstance(block, bool) or not isinstance(block, int)
                                or block < 16 or block % 16),
         f"--block-size {block} (tkv pages need a multiple of 16 tokens: 16, 32, 64, ...)"),
    )
    for bad, what in refused:
        if bad:
            raise UnsupportedFeatureError(f"--kv-cache-dtype tkv does not support {what}")


def check_bundle_matches_model(config: TkvConfig, model_config: Any) -> None:
    """Beyond the geometry :func:`load_config` checks: the bundle's per-layer attention kinds
    and sliding window must be the served model's
    (:meth:`tkv.codec.ModelGeometry.check_layer_kinds`); a different model name only warns
    (a local path and a hub name of one model differ).

    Raises:
        BundleGeometryError: ``layer_types`` or ``sliding_window`` differ from the model's.
    """
    b = config.bundle
    if b is None:
        return
    g = b.geometry
    text_cfg = getattr(model_config, "hf_text_config", None)
    g.check_layer_kinds(getattr(text_cfg, "layer_types", None),
                        getattr(text_cfg, "sliding_window", None))
    mismatch = g.name_mismatch(getattr(model_config, "model", None))
    if mismatch:
        log.warning("tkv: %s", mismatch)


def tkv_config(vllm_config: Any, env: dict[str, str] | None = None) -> TkvConfig:
    """The process-wide validated :class:`TkvConfig` for the served model (cached on the
    geometry and the two environment variables)."""
    mc = vllm_config.model_config
    check_model_supported(mc)
    check_parallel_supported(vllm_config)
    check_engine_features(vllm_config)
    geo = model_geometry(mc)
    e = os.environ if env is None else env
    key = (*geo, e.get(ENV_BITS), e.get(ENV_CALIBRATION_FILE))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = load_config(*geo, env=e)
        check_bundle_matches_model(cfg, mc)
        _CONFIGS[key] = cfg
        log.warning("%s", cfg.describe())
    return cfg


def tp_shard(vllm_config: Any) -> KvHeadShard:
    """KV heads of this process's TP rank.

    Raises:
        UnsupportedFeatureError: TP > 1 but vLLM's TP group is not set up in this process, so
            the rank is unknown (guessing rank 0 would give other ranks rank 0's per-head
            offsets). ShapeError: heads and TP size do not shard.
    """
    pc = vllm_config.parallel_config
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    rank = 0
    if tp > 1:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except (ImportError, AssertionError, RuntimeError) as e:
            raise UnsupportedFeatureError(
                f"tkv: tensor_parallel_size={tp} but this process has no TP rank ({e!r}); "
                "the layer's per-head offsets cannot be sliced") from None
    return shard_kv_heads(vllm_config.model_config.get_total_num_kv_heads(), tp, rank)


_INT = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index(layer_name: str, num_layers: int) -> int:
    """Decoder-layer index of an attention layer named like ``model.layers.12.self_attn.attn``.

    Raises:
        UnsupportedModelError: no single layer index in the name, or one outside the model
        (e.g. a speculative-decoding drafter's own attention layers).
    """
    ints = [int(m) for m in _INT.findall(layer_name)]
    if len(ints) != 1:
        raise UnsupportedModelError(
            f"tkv: cannot tell the decoder-layer index of attention layer {layer_name!r}")
    i = ints[0]
    if not 0 <= i < num_layers:
        raise UnsupportedModelError(
            f"tkv: attention layer {layer_name!r} has index {i} outside the model's "
            f"{num_layers} layers (drafter / extra attention layers are not supported)")
    return i


def layer_codec(config: TkvConfig, layer: int, k_bits: int, v_bits: int,
                device: torch.device | str, shard: KvHeadShard | None = None) -> TurboKVCodec:
    """The codec of ``layer`` at the widths it is served at (the page plan's, which may be
    wider than the row's in common-page mode): :meth:`TkvConfig.codec` with ``bits`` — the
    bundle's channel scales, codebooks and seed when a bundle is set, Gaussian codebooks
    otherwise.

    ``shard``: this TP rank's KV heads. A bundle's per-head offsets (key offset μ, sink
    offsets; ``(H, head_dim)``) are sliced to ``shard.heads`` (replicated heads when ``H < T``
    included), so the rank's kernels center head h with μ[first_head + h]; shared
    ``(head_dim,)`` offsets are unaffected. None: all of the model's heads.

    Raises:
        ShapeError: a shard outside the model's KV heads. BitWidthError.
    """
    return config.codec(layer, device, shard=shard, bits=(k_bits, v_bits), check_finite=False)
