"""tkv.kernels — Triton and CUDA kernels reading the tkv packed paged KV cache with inline
dequant.

Public API: :class:`TkvLoader` (per-layer tkv format), :class:`BypassLoader`,
:class:`Fp8Loader`, the :class:`Loader` protocol, :class:`Workspace` (shared scratch),
:func:`compress_store`, :func:`decode`, :func:`prefill` (+ :func:`warm_prefix_variant`,
:func:`dense_prefix_bytes`, :func:`plan_prefill_runs` — how an engine splits a batch's
prefill rows into calls — and the :class:`DenseAttention` seam for an engine's
flash-attention kernel);
:mod:`tkv.kernels.reference` is the
float64 oracle. See docs/kernels.md and docs/writing_a_loader.md.
"""

from . import _interpreter_compat
from ._util import UnsupportedKernelError, shares_memory
from .cuda_decode import (
    ENV_DECODE_CONTEXT,
    ENV_DECODE_KERNEL,
    ENV_DECODE_SCHEDULE,
    DecodeContextConfigError,
    DecodeKernelConfigError,
    DecodeScheduleConfigError,
    decode_context_from_env,
    decode_kernel_from_env,
    decode_schedule_from_env,
)
from .cuda_store import ENV_STORE_KERNEL, StoreKernelConfigError, store_kernel_from_env
from .decode import decode
from .dense_attention import (
    ENV_PREFILL_ATTENTION,
    DenseAttention,
    FlashDevice,
    FlashVarlenAttention,
    PrefillAttentionConfigError,
    SdpaDenseAttention,
    TorchVarlenAttention,
    flash_device,
    prefill_attention_from_env,
)
from .engine_env import EngineKernelSettings, engine_kernel_settings
from .loaders import (
    ENV_DECODE_PIPELINE,
    ENV_FUSED_QUERY_ROTATION,
    ENV_LOOKUP,
    ENV_SMALL_HEAD_GROUPS,
    BypassLoader,
    Fp8Loader,
    FusedQueryRotationConfigError,
    Loader,
    LookupConfigError,
    MaxnregConfigError,
    PerCodebookCompileWarning,
    PipelineConfigError,
    SmallHeadGroupsConfigError,
    TkvLoader,
    decode_pipeline_from_env,
    fused_query_rotation_from_env,
    lookup_from_env,
    small_head_groups_from_env,
)
from .prefill import (
    DENSE_PREFIX_CAP,
    dense_prefix_bytes,
    prefill,
    varlen_prefix_bytes,
    varlen_prefix_rows,
    warm_prefix_variant,
)
from .prefill_batch import prefill_by_runs
from .prefill_runs import MAX_PACKED_SPLITS, MAX_PREFILL_RUNS, PrefillRun, plan_prefill_runs
from .store import (
    ENV_STORE_ROTATION,
    StoreRotationConfigError,
    compress_store,
    store_rotation_from_env,
)
from .validate import (
    SERVED_HEAD_DIMS,
    MetadataError,
    check_metadata,
    head_dim_refusal,
    serves_head_dim,
)
from .workspace import (
    ENV_DECODE_MIN_SPLIT_TILES,
    ENV_DECODE_SINGLE_SPLIT,
    MinSplitTilesConfigError,
    SingleSplitConfigError,
    Workspace,
    WorkspaceTooSmallError,
    decode_min_split_tiles_from_env,
    decode_single_split_from_env,
)

# Must run before any kernel is launched under TRITON_INTERPRET=1 (patches loop-bound
# conversion at launch time, so importing the kernel modules first is fine).
_interpreter_compat.apply()

__version__ = "0.1.0"

__all__ = [
    "DENSE_PREFIX_CAP",
    "ENV_DECODE_CONTEXT",
    "ENV_DECODE_KERNEL",
    "ENV_DECODE_MIN_SPLIT_TILES",
    "ENV_DECODE_PIPELINE",
    "ENV_DECODE_SCHEDULE",
    "ENV_DECODE_SINGLE_SPLIT",
    "ENV_FUSED_QUERY_ROTATION",
    "ENV_LOOKUP",
    "ENV_PREFILL_ATTENTION",
    "ENV_SMALL_HEAD_GROUPS",
    "ENV_STORE_KERNEL",
    "ENV_STORE_ROTATION",
    "MAX_PACKED_SPLITS",
    "MAX_PREFILL_RUNS",
    "SERVED_HEAD_DIMS",
    "BypassLoader",
    "DecodeContextConfigError",
    "DecodeKernelConfigError",
    "DecodeScheduleConfigError",
    "DenseAttention",
    "EngineKernelSettings",
    "FlashDevice",
    "FlashVarlenAttention",
    "Fp8Loader",
    "FusedQueryRotationConfigError",
    "Loader",
    "LookupConfigError",
    "MaxnregConfigError",
    "MetadataError",
    "MinSplitTilesConfigError",
    "PerCodebookCompileWarning",
    "PipelineConfigError",
    "PrefillAttentionConfigError",
    "PrefillRun",
    "SdpaDenseAttention",
    "SingleSplitConfigError",
    "SmallHeadGroupsConfigError",
    "StoreKernelConfigError",
    "StoreRotationConfigError",
    "TkvLoader",
    "TorchVarlenAttention",
    "UnsupportedKernelError",
    "Workspace",
    "WorkspaceTooSmallError",
    "check_metadata",
    "compress_store",
    "decode",
    "decode_context_from_env",
    "decode_kernel_from_env",
    "decode_min_split_tiles_from_env",
    "decode_pipeline_from_env",
    "decode_schedule_from_env",
    "decode_single_split_from_env",
    "dense_prefix_bytes",
    "engine_kernel_settings",
    "flash_device",
    "fused_query_rotation_from_env",
    "head_dim_refusal",
    "lookup_from_env",
    "plan_prefill_runs",
    "prefill",
    "prefill_attention_from_env",
    "prefill_by_runs",
    "serves_head_dim",
    "shares_memory",
    "small_head_groups_from_env",
    "store_kernel_from_env",
    "store_rotation_from_env",
    "varlen_prefix_bytes",
    "varlen_prefix_rows",
    "warm_prefix_variant",
]
