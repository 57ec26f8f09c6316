"""The tkv serving config of the running SGLang process: ``TKV_BITS`` /
``TKV_CALIBRATION_FILE`` loaded and validated by :func:`tkv.codec.config.load_config` (the
one shared implementation, also used by tkv-vllm), once per process and geometry."""

from __future__ import annotations

import logging
import os
import threading

from tkv.codec.config import ENV_BITS, ENV_CALIBRATION_FILE, TkvConfig, load_config

from .geometry import AttentionGeometry

__all__ = ["clear_config_cache", "tkv_config"]

log = logging.getLogger("tkv.sglang")
_lock = threading.Lock()
_cache: dict[tuple, TkvConfig] = {}


def tkv_config(geometry: AttentionGeometry) -> TkvConfig:
    """The validated :class:`~tkv.codec.config.TkvConfig` for ``geometry``, loaded on first
    use and cached per (geometry, ``TKV_BITS``, ``TKV_CALIBRATION_FILE``) in this process.

    Raises:
        TkvBitsError, FileNotFoundError, BundleSchemaError, BundleGeometryError (also for a
        bundle whose per-layer attention kinds or sliding window are not the model's),
        BudgetRowMissingError: see :mod:`tkv.codec.config`.
    """
    key = (geometry, os.environ.get(ENV_BITS), os.environ.get(ENV_CALIBRATION_FILE))
    with _lock:
        cfg = _cache.get(key)
        if cfg is None:
            cfg = load_config(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim)
            if cfg.bundle is not None:   # another model's bundle of the same shape
                g = cfg.bundle.geometry
                g.check_layer_kinds(geometry.layer_types, geometry.sliding_window)
                mismatch = g.name_mismatch(geometry.model)
                if mismatch:
                    log.warning("tkv: %s", mismatch)
            _cache[key] = cfg
            log.info(cfg.describe())
        return cfg


def clear_config_cache() -> None:
    """Forget loaded configs (tests)."""
    with _lock:
        _cache.clear()
