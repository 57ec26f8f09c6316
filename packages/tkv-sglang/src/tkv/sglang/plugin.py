"""SGLang general plugin (entry-point group ``sglang.srt.plugins``, name ``tkv``).

SGLang calls :func:`register` in every process before parsing arguments. It registers

* KV-cache dtype ``tkv`` (needs the patch series: ``tkv-sglang patch apply``): torch dtype
  uint8, pool factory and cell-size factory (:mod:`tkv.sglang.factories`), startup checks
  (:mod:`tkv.sglang.server_args_check`), readable only by ``turbo-attn``, which is also the
  default backend when none is given;
* attention backend ``turbo-attn`` (:class:`tkv.sglang.backend.TurboAttnBackend`), which
  reads only ``tkv`` caches.

Idempotent. On a wrong SGLang version or an unpatched install it raises a named error
(SGLang logs it and carries on without tkv, so ``--kv-cache-dtype tkv`` is then rejected by
argparse).
"""

from __future__ import annotations

import importlib.metadata
import logging

import torch

from .errors import PatchError, SglangVersionError
from .patching import SGLANG_VERSION

__all__ = ["ATTENTION_BACKEND", "KV_CACHE_DTYPE", "create_backend", "register"]

log = logging.getLogger("tkv.sglang")

KV_CACHE_DTYPE = "tkv"
ATTENTION_BACKEND = "turbo-attn"


def create_backend(runner):
    """``ATTENTION_BACKENDS['turbo-attn']``: build the backend for a ModelRunner."""
    from .backend import TurboAttnBackend

    return TurboAttnBackend(runner)


def _check_version() -> None:
    try:
        v = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as e:
        raise SglangVersionError("sglang is not installed") from e
    if v != SGLANG_VERSION:
        raise SglangVersionError(
            f"tkv-sglang supports sglang {SGLANG_VERSION}, found {v}; tkv is not registered")


def register() -> None:
    """Register ``tkv`` and ``turbo-attn`` with SGLang (see module docstring).

    Raises:
        SglangVersionError: sglang missing or not 0.5.11.
        PatchError: the patch series is not applied.

    With ``TKV_JIT_LOG`` set, also logs this process's Triton JIT events there
    (:mod:`tkv.kernels.jit_log`).
    """
    from tkv.kernels import jit_log

    jit_log.install_from_env_or_log(log)
    _check_version()
    try:
        from sglang.srt.mem_cache import kv_cache_dtype_registry as reg
    except ImportError as e:
        raise PatchError(
            "sglang is not patched for plugin KV-cache dtypes: run `tkv-sglang patch apply` "
            "(then restart); --kv-cache-dtype tkv is unavailable") from e
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .factories import cell_size, create_pool
    from .server_args_check import check_server_args

    reg.register_kv_cache_dtype(
        reg.KVCacheDtypeSpec(
            name=KV_CACHE_DTYPE,
            torch_dtype=torch.uint8,
            create_pool=create_pool,
            cell_size=cell_size,
            attention_backends=(ATTENTION_BACKEND,),
            default_attention_backend=ATTENTION_BACKEND,
            check_server_args=check_server_args,
        ),
        override=True,
    )
    reg.register_attention_backend_kv_cache_dtypes(ATTENTION_BACKEND, [KV_CACHE_DTYPE])
    if ATTENTION_BACKENDS.get(ATTENTION_BACKEND) is not create_backend:
        register_attention_backend(ATTENTION_BACKEND)(create_backend)
    if ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([ATTENTION_BACKEND])
    log.info("tkv: registered --kv-cache-dtype %s and --attention-backend %s",
             KV_CACHE_DTYPE, ATTENTION_BACKEND)
