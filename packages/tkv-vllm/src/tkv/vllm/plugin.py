"""The ``vllm.general_plugins`` entry point of tkv-vllm (``tkv = tkv.vllm.plugin:register``).

vLLM calls :func:`register` once in every process it starts (API server, engine core,
workers) before it parses ``--kv-cache-dtype`` / ``--attention-backend``. It registers

* the KV-cache dtype ``tkv`` (storage ``torch.uint8``: ``(num_blocks, page_bytes)`` pages),
* the attention backend ``TURBO_ATTN`` (``--attention-backend turbo-attn``) →
  :class:`tkv.vllm.backend.TurboAttnBackend`;
* with ``TKV_JIT_LOG=FILE``, a log of every Triton compile / disk-cache load of the process
  (:mod:`tkv.kernels.jit_log`: finds compile stalls inside a serving run).

Both need the tkv patch series in vLLM (``tkv-vllm patch apply``). On an unpatched vLLM
this logs an error saying so and registers nothing: a plugin must not break vLLM for users
who do not ask for tkv, and ``--kv-cache-dtype tkv`` is then refused by vLLM itself.
Model-dependent configuration (``TKV_BITS``, ``TKV_CALIBRATION_FILE``, the model's
geometry and architecture) is validated by :func:`validate`, which vLLM calls when it builds
the ``VllmConfig`` in the launching process (patch 0001) — named errors before any engine
process starts or any weight is loaded. Workers re-use the same validation, once each.
"""

from __future__ import annotations

import logging

import torch

from tkv.codec.errors import TkvError

from .errors import BackendMismatchError, PatchesNotAppliedError

__all__ = ["BACKEND_PATH", "TKV_DTYPE", "check_patched", "register", "validate"]

log = logging.getLogger("tkv.vllm")

TKV_DTYPE = "tkv"
BACKEND_PATH = "tkv.vllm.backend.TurboAttnBackend"


def check_patched() -> None:
    """Raise :class:`PatchesNotAppliedError` unless the installed vLLM has the tkv hooks."""
    import vllm.config.cache as cache
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    missing = []
    if not hasattr(cache, "register_kv_cache_dtype"):
        missing.append("0001 kv-cache dtype registry")
    if "TURBO_ATTN" not in AttentionBackendEnum.__members__:
        missing.append("0002 TURBO_ATTN backend slot")
    if not hasattr(AttentionBackend, "get_kv_cache_shape_for_spec"):
        missing.append("0003 spec/shape from backend")
    if missing:
        raise PatchesNotAppliedError(
            "vLLM is missing tkv patches (" + ", ".join(missing) + "); run "
            "`tkv-vllm patch apply` in this environment")


def validate(vllm_config) -> None:
    """``validate`` hook of the ``tkv`` dtype: config errors, model refusals, and the
    attention backend — unset becomes ``TURBO_ATTN`` (so ``--attention-backend`` may be
    omitted), any other backend is refused.

    Also parses every ``TKV_*`` kernel setting (``tkv.kernels.engine_kernel_settings``) and
    logs the effective values, so a bad one stops the launch before an engine process starts.

    Raises:
        BackendMismatchError, UnsupportedModelError (incl. a head_dim the kernels do not
        serve), UnsupportedFeatureError (context parallelism), ShapeError (a TP size that
        does not shard the KV heads), the codec's config errors (TkvBitsError,
        FileNotFoundError, BundleSchemaError, BundleGeometryError — also a bundle whose
        layer kinds or sliding window are not the model's — BudgetRowMissingError), and the
        kernel settings' (LookupConfigError,
        SmallHeadGroupsConfigError, FusedQueryRotationConfigError,
        PrefillAttentionConfigError, MaxnregConfigError, PipelineConfigError,
        SingleSplitConfigError, MinSplitTilesConfigError, StoreRotationConfigError);
        UnsupportedFeatureError also for KV connectors / offloading, skip-layers and block
        sizes off the multiple of 16; UnsupportedModelError also for soft-capping, ALiBi and
        learned sinks (:func:`tkv.vllm.startup.check_engine_features`,
        :func:`~tkv.vllm.startup.check_model_supported`). Each is logged with its class name
        first: inside ``VllmConfig.__post_init__`` pydantic reports a ValueError as a
        ValidationError carrying only the message.
    """
    try:
        _validate(vllm_config)
    except (TkvError, OSError) as e:
        # vLLM runs this hook inside VllmConfig.__post_init__, where pydantic turns a
        # ValueError (every named config error is one) into a ValidationError that shows the
        # message but not the class: log the name, then raise the error unchanged
        log.error("tkv: %s: %s", type(e).__name__, e)
        raise


def _validate(vllm_config) -> None:
    from tkv.kernels import engine_kernel_settings
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .prefill_attention import DEFAULT as PREFILL_DEFAULT
    from .startup import tkv_config

    ac = vllm_config.attention_config
    if ac.backend is None:
        ac.backend = AttentionBackendEnum.TURBO_ATTN
        log.info("tkv: --kv-cache-dtype tkv selects --attention-backend turbo-attn")
    elif ac.backend is not AttentionBackendEnum.TURBO_ATTN:
        raise BackendMismatchError(
            f"--kv-cache-dtype tkv needs --attention-backend turbo-attn, got {ac.backend.name}")
    tkv_config(vllm_config)
    log.info("tkv kernels: %s",
             engine_kernel_settings(prefill_default=PREFILL_DEFAULT).describe())


def register() -> None:
    """Register the ``tkv`` KV-cache dtype and the ``TURBO_ATTN`` backend (idempotent).
    With ``TKV_JIT_LOG`` set, also log this process's Triton JIT events there
    (:mod:`tkv.kernels.jit_log`)."""
    from tkv.kernels import jit_log

    jit_log.install_from_env_or_log(log)
    try:
        check_patched()
    except PatchesNotAppliedError as e:
        log.error("tkv-vllm: %s; --kv-cache-dtype tkv is unavailable.", e)
        return
    from vllm.config.cache import register_kv_cache_dtype
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_kv_cache_dtype(TKV_DTYPE, torch.uint8, validate=validate)
    register_backend(AttentionBackendEnum.TURBO_ATTN, BACKEND_PATH)
    _register_spec_managers()


def _register_spec_managers() -> None:
    """vLLM picks a layer's block manager by the spec's exact type
    (``single_type_kv_cache_manager.spec_manager_map[type(spec)]``): map tkv's spec
    subclasses to the managers of their parents (same block bookkeeping, other page bytes).
    A per-layer-width group (``UniformTypeKVCacheSpecs``) reaches the scheduler as one of its
    member specs (``generate_scheduler_kv_cache_config``), so these two entries cover it."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    from .spec import TkvFullAttentionSpec, TkvSlidingWindowSpec

    stm.spec_manager_map.setdefault(TkvFullAttentionSpec, stm.FullAttentionManager)
    stm.spec_manager_map.setdefault(TkvSlidingWindowSpec, stm.SlidingWindowManager)
