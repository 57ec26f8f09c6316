"""Every ``TKV_*`` setting of the kernels that the engine adapters expose, parsed and checked
in one call: the launching process validates them all before an engine process starts (each
parser also runs where its value is used — at import or when a layer binds — so workers
never run on an unchecked value either; a value refused at import is raised by the first
kernel call, :func:`._util.read_at_import`).

Also the two helpers an engine adapter needs for settings of its own, public here so that
adapters do not import the private ``_util``: :func:`choice_from_env` (a named option, one
of a fixed set, with a named error) and :func:`interpreting` (``TRITON_INTERPRET`` read as
Triton reads it)."""

from __future__ import annotations

from typing import NamedTuple

from ._util import choice_from_env, interpreting
from .cuda_decode import (
    decode_context_from_env,
    decode_kernel_from_env,
    decode_schedule_from_env,
)
from .cuda_store import store_kernel_from_env
from .dense_attention import prefill_attention_from_env
from .loaders import (
    _prmti_maxnreg_from_env,
    decode_pipeline_from_env,
    fused_query_rotation_from_env,
    lookup_from_env,
    small_head_groups_from_env,
)
from .store import store_rotation_from_env
from .workspace import decode_min_split_tiles_from_env, decode_single_split_from_env

__all__ = ["EngineKernelSettings", "choice_from_env", "engine_kernel_settings", "interpreting"]


class EngineKernelSettings(NamedTuple):
    """The kernels' engine-facing settings as parsed from the environment."""

    lookup: str                   # TKV_LOOKUP
    small_head_groups: bool       # TKV_SMALL_HEAD_GROUPS
    fused_query_rotation: bool    # TKV_FUSED_QUERY_ROTATION
    prefill_attention: str        # TKV_PREFILL_ATTENTION (the adapter's default applied)
    prmti_maxnreg: int            # TKV_PRMTI_MAXNREG (0: no cap)
    decode_pipeline: bool         # TKV_DECODE_PIPELINE
    decode_single_split: bool     # TKV_DECODE_SINGLE_SPLIT
    decode_min_split_tiles: int   # TKV_DECODE_MIN_SPLIT_TILES (0: off)
    store_rotation: str           # TKV_STORE_ROTATION
    decode_kernel: str            # TKV_DECODE_KERNEL
    store_kernel: str             # TKV_STORE_KERNEL
    decode_schedule: str          # TKV_DECODE_SCHEDULE
    decode_context: str           # TKV_DECODE_CONTEXT

    def describe(self) -> str:
        """One log line, e.g. ``TKV_LOOKUP=auto TKV_SMALL_HEAD_GROUPS=1 ...``."""
        def v(x):
            return str(int(x)) if isinstance(x, bool) else str(x)
        return " ".join(f"TKV_{name.upper()}={v(val)}" for name, val in self._asdict().items())


def engine_kernel_settings(environ=None, prefill_default: str = "tkv") -> EngineKernelSettings:
    """Parse every engine-facing kernel setting from ``environ`` (None: ``os.environ``; then
    the returned ``TKV_PRMTI_MAXNREG`` / ``TKV_DECODE_PIPELINE`` / ``TKV_DECODE_SINGLE_SPLIT``
    / ``TKV_DECODE_MIN_SPLIT_TILES`` / ``TKV_STORE_ROTATION`` / ``TKV_DECODE_KERNEL`` /
    ``TKV_STORE_KERNEL`` / ``TKV_DECODE_SCHEDULE`` / ``TKV_DECODE_CONTEXT`` are the values this process read at import, the ones its kernels
    use — the current values are still validated).

    Args:
        environ: a mapping of environment variables, or None for the process environment.
        prefill_default: the adapter's ``TKV_PREFILL_ATTENTION`` default (``auto`` in both
            tkv-vllm and, since session 32, tkv-sglang).

    Raises:
        LookupConfigError, SmallHeadGroupsConfigError, FusedQueryRotationConfigError,
        PrefillAttentionConfigError, MaxnregConfigError, PipelineConfigError,
        SingleSplitConfigError, MinSplitTilesConfigError, StoreRotationConfigError,
        DecodeKernelConfigError, StoreKernelConfigError, DecodeScheduleConfigError,
        DecodeContextConfigError: the first setting with a value its
        parser refuses (the message names the variable).
    """
    from . import cuda_decode, cuda_store, loaders, store, workspace
    from ._util import check_import_settings

    check_import_settings()   # what this process refused at import, whatever ``environ`` says

    # validated either way; the five read once at import are reported as this process uses
    # them when the environment is the process's own
    maxnreg, pipeline = _prmti_maxnreg_from_env(environ), decode_pipeline_from_env(environ)
    single = decode_single_split_from_env(environ)
    tiles = decode_min_split_tiles_from_env(environ)
    rotation = store_rotation_from_env(environ)
    kernel = decode_kernel_from_env(environ)
    store_kernel = store_kernel_from_env(environ)
    schedule = decode_schedule_from_env(environ)
    context = decode_context_from_env(environ)
    if environ is None:
        maxnreg, pipeline = loaders.PRMTI_MAXNREG, loaders.DECODE_PIPELINE
        single, tiles = workspace.DECODE_SINGLE_SPLIT, workspace.DECODE_MIN_SPLIT_TILES
        rotation = store.STORE_ROTATION
        kernel = cuda_decode.DECODE_KERNEL
        store_kernel = cuda_store.STORE_KERNEL
        schedule = cuda_decode.DECODE_SCHEDULE
        context = cuda_decode.DECODE_CONTEXT
    return EngineKernelSettings(
        lookup_from_env(environ), small_head_groups_from_env(environ),
        fused_query_rotation_from_env(environ),
        prefill_attention_from_env(environ, prefill_default), maxnreg, pipeline, single, tiles,
        rotation, kernel, store_kernel, schedule, context)
