"""Startup checks of SGLang's ``ServerArgs`` for ``--kv-cache-dtype tkv`` (run by the patched
``ServerArgs.__post_init__`` in the launching process, before any worker is spawned).

Duck-typed on ServerArgs' attributes so it is unit-tested without the engine.
"""

from __future__ import annotations

import logging

from tkv.codec.sharding import shard_kv_heads

from .config import tkv_config
from .errors import UnsupportedFeatureError
from .geometry import geometry_from_model_config

__all__ = ["DEFAULT_PAGE_SIZE", "PAGE_SIZE_MULTIPLE", "check_server_args"]

log = logging.getLogger("tkv.sglang")

DEFAULT_PAGE_SIZE = 16
# SlotLayout pads each page region to 16 bytes; with page sizes that are multiples of 16 the
# padding is exactly zero (tkv.codec.layout), with page_size=1 it would dominate the page.
PAGE_SIZE_MULTIPLE = 16


def check_server_args(server_args, *, validate_model: bool = True) -> None:
    """Default ``page_size`` to 16, refuse what tkv cannot serve, and validate
    ``TKV_BITS`` / ``TKV_CALIBRATION_FILE`` against the model's geometry.

    Raises:
        UnsupportedFeatureError: page_size not a multiple of 16, speculative decoding,
            hierarchical cache / LMCache / HiSparse offload, PD disaggregation, context
            parallelism, or a model
            kind refused by :func:`~tkv.sglang.geometry.geometry_from_model_config`.
        TkvBitsError, FileNotFoundError, BundleSchemaError, BundleGeometryError,
        BudgetRowMissingError: bad tkv configuration (tkv.codec.config).
        LookupConfigError, SmallHeadGroupsConfigError, FusedQueryRotationConfigError,
        PrefillAttentionConfigError, MaxnregConfigError, PipelineConfigError,
        SingleSplitConfigError, MinSplitTilesConfigError, StoreRotationConfigError: a bad
        ``TKV_*`` kernel setting (``tkv.kernels.engine_kernel_settings``, whose effective
        values are logged). ImplConfigError: a bad ``TKV_SGLANG_IMPL``.
        ShapeError: a KV-head count the attention TP size cannot shard (neither divides the
        other; :func:`tkv.codec.shard_kv_heads`).
    """
    from tkv.kernels import engine_kernel_settings

    from .impl import impl_from_env
    from .prefill_attention import DEFAULT as PREFILL_DEFAULT

    log.info("tkv kernels: %s", engine_kernel_settings(prefill_default=PREFILL_DEFAULT).describe())
    impl_from_env()
    if server_args.page_size is None:
        server_args.page_size = DEFAULT_PAGE_SIZE
        log.info("tkv: page_size not given, using %d", DEFAULT_PAGE_SIZE)
    ps = server_args.page_size
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 1 or ps % PAGE_SIZE_MULTIPLE:
        raise UnsupportedFeatureError(
            f"--kv-cache-dtype tkv needs --page-size a multiple of {PAGE_SIZE_MULTIPLE} (tkv "
            f"pages are 16-byte aligned per region), got {ps}; use 16, 32, 64 or 128")
    refused = [
        (getattr(server_args, "speculative_algorithm", None) is not None,
         "speculative decoding (--speculative-algorithm): the draft model's KV cache is not "
         "tkv-aware yet"),
        (getattr(server_args, "enable_hierarchical_cache", False),
         "--enable-hierarchical-cache: the host KV pool copies pages in the bf16 layout"),
        (getattr(server_args, "enable_lmcache", False),
         "--enable-lmcache: LMCache stores pages in the bf16 layout"),
        (getattr(server_args, "enable_hisparse", False), "--enable-hisparse"),
        (getattr(server_args, "disaggregation_mode", "null") not in (None, "null"),
         "PD disaggregation (--disaggregation-mode): the transfer of packed pages is untested"),
        ((getattr(server_args, "attn_cp_size", 1) or 1) > 1
         or getattr(server_args, "enable_prefill_context_parallel", False),
         "context parallelism (--attn-cp-size > 1 / --enable-prefill-context-parallel): "
         "SGLang stores a context-parallel KV cache through an all-gather path the tkv pool "
         "does not implement"),
    ]
    for bad, what in refused:
        if bad:
            raise UnsupportedFeatureError(f"--kv-cache-dtype tkv does not support {what}")
    if validate_model:
        geometry = geometry_from_model_config(server_args.get_model_config())
        tkv_config(geometry)
        # the attention TP the workers will shard the KV heads over (SGLang's
        # compute_dp_attention_world_info): a count the engine cannot shard fails here, in the
        # launching process, as tkv-vllm's check does — not later inside a worker
        tp = int(getattr(server_args, "tp_size", 1) or 1)
        if getattr(server_args, "enable_dp_attention", False):
            tp //= int(getattr(server_args, "dp_size", 1) or 1)
        shard_kv_heads(geometry.num_kv_heads, max(tp, 1), 0)
