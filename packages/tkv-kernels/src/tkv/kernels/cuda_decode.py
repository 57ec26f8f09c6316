"""Split-K paged decode for 4-bit K and V in hand-written CUDA (``cuda/decode_k4v4.cu``).

Why a CUDA kernel: the Triton split kernel spends about a third of its loop on choices made by
Triton and ptxas (table words copied from uniform registers before each byte permute, operand
fragments shuffled through shared memory, P's round trip between warps; docs/kernels.md,
session 32), and the one-warp Gluon kernel (:mod:`tkv.kernels.gluon_decode`) traded those for
a 16-row M padding and per-token address work. Here every register is placed by hand:

* the GQA group is the N dimension of ``mma.m16n8k16`` (``S^T = K·q^T``, ``O^T += V^T·P^T``),
  so the tokens fill M and nothing is padded for G ≤ 8;
* the code bytes of a lane are contiguous in the page: one vector copy per token, and the
  byte-permute lookup's outputs are the A-operand registers (the dot's k index and the value
  coordinates are relabellings, undone by the query load and the output store);
* P goes from the S^T accumulator to the B operand by one ``movmatrix.trans`` per 8 tokens;
* the warps of a CTA split the tokens (16-token steps) and merge once, at the end;
* copies go through a per-warp ``cp.async`` ring of ``NST`` stages;
* the byte tables are per-thread loads, so they stay in regular registers (``lut=1``, a
  tuning keyword of :func:`defines`: a 256-entry table of centroid pairs in shared memory
  instead, one shared load per code byte; docs/kernels.md, session 35) — with 8 warps per CTA
  the build of ``TKV_DECODE_CONTEXT=long`` (:func:`context_tuning`; session 36), and with two
  teams of 4 warps (one KV head each) for short sequences the default, ``auto`` (session 37);
* the split count fills one wave of the configuration's resident CTAs
  (:func:`resident_ctas`, :meth:`Workspace.cuda_splits_for`);
* ``schedule="balanced"`` (:func:`launch_balanced`, ``TKV_DECODE_SCHEDULE``): one grid of
  resident CTAs sharing the batch's 16-token steps equally (stream-K), for batches mixing
  long and short sequences.

Same inputs and partial outputs as the Triton split kernel (the reduce kernel is shared).
Scope (:func:`check_supported`): a :class:`~tkv.kernels.TkvLoader` with 4-bit K and V and a
byte-table lookup, head_dim 64 / 128 / 256, at most 8 query heads per KV head, block_size a
multiple of 16, bf16 or fp16 queries, sink offsets or not, a CUDA device of compute capability
≥ 8.0.
"""

from __future__ import annotations

import torch

from tkv.codec.errors import ShapeError, TkvError

from . import _nvrtc
from ._util import (
    UnsupportedKernelError,
    choice_from_env,
    cuda_device_refusal,
    read_at_import,
)
from .loaders import _PRMT_FAMILY, TkvLoader, sink_shift

__all__ = [
    "DECODE_CONTEXT",
    "DECODE_KERNEL",
    "DECODE_SCHEDULE",
    "ENV_DECODE_CONTEXT",
    "ENV_DECODE_KERNEL",
    "ENV_DECODE_SCHEDULE",
    "MERGE_MAX_SPLITS",
    "MERGE_SPLITS",
    "SCHEDULES",
    "TEAM_STEPS",
    "DecodeContextConfigError",
    "DecodeKernelConfigError",
    "DecodeScheduleConfigError",
    "check_supported",
    "context_tuning",
    "ctas_per_sm",
    "decode_context_from_env",
    "decode_kernel_from_env",
    "decode_schedule_from_env",
    "defines",
    "launch_balanced",
    "launch_split",
    "launch_tuning",
    "resident_ctas",
    "supported",
    "team_steps_for",
]

SOURCE = "decode_k4v4.cu"
ENTRY = "tkv_decode_k4v4"
WARPS = 4
_INT32_MAX = 2**31 - 1   # a window past it attends to everything, as no window does
SUB = 2   # 16-token steps per loop iteration at head_dim ≤ 128 (one softmax update for both)
MIN_STEPS = 32   # the balanced schedule's least 16-token steps per CTA (8 per warp)
TABLE_BYTES = 32768   # one shared pair table (lut=1): 256 entries × 32 replicas × 4 bytes
# defaults for :func:`defines`' tuning keywords (sub, stages, min_ctas, lut, warps) when a launch
# passes none; benchmarks override them to time variants
TUNING: dict[str, int] = {}
_Q_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def check_supported(loader, device, head_dim: int, group: int, dot_dtype) -> None:
    """Raise :class:`~tkv.kernels._util.UnsupportedKernelError` unless ``decode(kernel="cuda")``
    can serve the call (see the module docstring for the scope)."""
    why = None
    if not isinstance(loader, TkvLoader) or (loader.k_bits, loader.v_bits) != (4, 4):
        why = "needs a TkvLoader with 4-bit K and V sides"
    elif head_dim not in (64, 128, 256):
        why = f"needs head_dim 64, 128 or 256, got {head_dim}"
    elif group > 8:
        why = f"needs at most 8 query heads per KV head, got {group}"
    elif loader.block_size % 16:
        why = f"needs a block_size that is a multiple of 16, got {loader.block_size}"
    elif dot_dtype not in (torch.bfloat16, torch.float16):
        why = "needs bfloat16 or float16 queries"
    elif loader.lookup not in ("auto", *_PRMT_FAMILY) or any(
            (s, dot_dtype) not in loader._prmt for s in ("k", "v")):
        why = "needs the loader's byte tables (lookup 'auto' or a prmt lookup)"
    elif (refusal := cuda_device_refusal(device)) is not None:
        why = refusal
    elif torch.cuda.get_device_capability(device) < (8, 0):
        why = "needs compute capability 8.0 or newer (mma.m16n8k16, cp.async)"
    if why:
        raise UnsupportedKernelError(f"decode(kernel='cuda') {why}")


def cache_aligned(cache) -> bool:
    """Whether the cache's base address is 16-byte aligned (the kernel's 16-byte copies)."""
    return isinstance(cache, torch.Tensor) and cache.data_ptr() % 16 == 0


def supported(loader, device, head_dim: int, group: int, dot_dtype) -> bool:
    """Whether :func:`check_supported` accepts the call and this PyTorch has the NVRTC bindings
    the kernel is built with (``decode(kernel="auto")``'s test: without them ``auto`` runs the
    Triton kernel, while an explicit ``kernel="cuda"`` raises CudaCompileError)."""
    try:
        check_supported(loader, device, head_dim, group, dot_dtype)
    except UnsupportedKernelError:
        return False
    return _nvrtc.available()


ENV_DECODE_KERNEL = "TKV_DECODE_KERNEL"
_KERNELS = ("auto", "triton", "cuda")


class DecodeKernelConfigError(TkvError, ValueError):
    """``TKV_DECODE_KERNEL`` names no decode split kernel."""


def decode_kernel_from_env(environ=None) -> str:
    """``decode``'s split kernel when the caller names none (``TKV_DECODE_KERNEL``): ``auto``
    (default: the CUDA kernel where :func:`check_supported` accepts the call and no
    Triton-only option is given, else Triton), ``triton`` or ``cuda`` (refused calls raise
    UnsupportedKernelError). Read once at import into :data:`DECODE_KERNEL`; a bad value is
    raised by the engines' startup validation or the first kernel call.

    Raises:
        DecodeKernelConfigError: any other value."""
    return choice_from_env(environ, ENV_DECODE_KERNEL, _KERNELS, "auto", DecodeKernelConfigError,
                           "expected auto (the CUDA split kernel where it applies, else Triton),"
                           " triton or cuda")


DECODE_KERNEL = read_at_import(decode_kernel_from_env)

ENV_DECODE_CONTEXT = "TKV_DECODE_CONTEXT"
_CONTEXTS = ("auto", "short", "long")
TEAM_STEPS = 128   # the auto profile's team_steps: two teams per CTA up to 2K tokens per split
# decode()'s several splits merged in the kernel by the last split (launch_split, session 38)
# where the output is written by the kernel anyway, up to MERGE_MAX_SPLITS splits (the merging
# CTA folds them one by one: at 32 splits the reduce kernel's many CTAs were faster, H100 B=1:
# 0.0372 against 0.0382 ms at 32K tokens; at 4 splits, B=8 × 8K, the merge 0.0500 against
# 0.0508, 0.0524 against 0.0606 with the register lookups); False: the reduce kernel always
MERGE_SPLITS = True
MERGE_MAX_SPLITS = 8


class DecodeContextConfigError(TkvError, ValueError):
    """``TKV_DECODE_CONTEXT`` names no tuning of the CUDA decode kernel."""


def decode_context_from_env(environ=None) -> str:
    """Which contexts the CUDA decode kernel is built for (``TKV_DECODE_CONTEXT``):

    * ``auto`` (default): at head_dim ≤ 128 the shared pair tables (``lut=1``) with 8 warps per
      CTA, whose sequences of at most :data:`TEAM_STEPS` 16-token steps per split are served
      by two teams of 4 warps, one KV head each (``team_steps``) — the kernel chooses per
      sequence from the lengths on the device, so a CUDA graph serves any mix. H100 (session
      37): 72-86 % of copy bandwidth at 8K-32K tokens (B ≥ 32) against 60-73 % for ``short``,
      36-layer steps 0.3-9.7 % faster from 640 to 8K tokens. At head_dim 256 ``short``'s build.
    * ``short``: the byte-permute lookups in registers, 4 warps (sessions 33-36's default).
    * ``long``: the pair tables with 8 warps (4 at head_dim 256) for every sequence (session
      36; 20 % slower than ``auto`` at 640 tokens, equal from 8K).

    Read once at import into :data:`DECODE_CONTEXT`; a bad value is raised by the engines'
    startup validation or the first kernel call.

    Raises:
        DecodeContextConfigError: any other value."""
    return choice_from_env(environ, ENV_DECODE_CONTEXT, _CONTEXTS, "auto",
                           DecodeContextConfigError,
                           "expected auto (shared pair tables, 8 warps, two teams of 4 for "
                           "short sequences), short (register lookups, 4 warps) or long "
                           "(shared pair tables, 8 warps)")


DECODE_CONTEXT = read_at_import(decode_context_from_env)


def context_tuning(head_dim: int, context: str | None = None) -> dict[str, int]:
    """The tuning keywords of :func:`defines` a context profile (``context``, default
    :data:`DECODE_CONTEXT`) sets: none for ``short``; for ``long`` the pair tables with 8 warps
    (4 at head_dim 256, where 8 warps leave one CTA per SM: 0.386 against 0.347 ms at B=32,
    L=8K, H100); for ``auto`` the pair tables with 8 warps and ``team_steps`` =
    :data:`TEAM_STEPS` at head_dim ≤ 128, none at 256 (not timed at short contexts there)."""
    context = context or DECODE_CONTEXT
    if context == "long":
        return {"lut": 1, "warps": 8 if head_dim <= 128 else 4}
    if context == "auto" and head_dim <= 128:
        return {"lut": 1, "warps": 8, "team_steps": TEAM_STEPS}
    return {}


def launch_tuning(head_dim: int) -> dict[str, int]:
    """The tuning keywords a launch builds with when it passes none of its own: the context
    profile's (:func:`context_tuning`) overridden by :data:`TUNING` — one merge for the launch
    and for the occupancy its split count is sized by (:func:`resident_ctas`)."""
    return {**context_tuning(head_dim), **TUNING}


ENV_DECODE_SCHEDULE = "TKV_DECODE_SCHEDULE"
SCHEDULES = ("split", "balanced")


class DecodeScheduleConfigError(TkvError, ValueError):
    """``TKV_DECODE_SCHEDULE`` names no schedule of the CUDA decode kernel."""


def decode_schedule_from_env(environ=None) -> str:
    """The CUDA decode kernel's work schedule when the caller names none
    (``TKV_DECODE_SCHEDULE``, ``decode(schedule=None)``): ``split`` (default: grid (sequences,
    KV heads, splits)) or ``balanced`` (stream-K: :func:`launch_balanced`). Read once at import
    into :data:`DECODE_SCHEDULE`; a bad value is raised by the engines' startup validation or
    the first kernel call.

    Raises:
        DecodeScheduleConfigError: any other value."""
    return choice_from_env(environ, ENV_DECODE_SCHEDULE, SCHEDULES, "split",
                           DecodeScheduleConfigError,
                           "expected split (each sequence cut into equal splits) or balanced "
                           "(the batch's steps shared equally by one wave of CTAs)")


DECODE_SCHEDULE = read_at_import(decode_schedule_from_env)


def _antisymmetric(loader: TkvLoader, side: str, half: torch.dtype) -> bool:
    """Whether the side's byte tables hold an antisymmetric codebook (the cheaper lookup), as
    the loader found from its host-side words when it was built (no device sync here, so a
    first call inside CUDA-graph capture is fine)."""
    return loader._prmt_antisymmetric[side, half]


def _min_ctas(head_dim: int, lut: int, same: bool, warps: int) -> int:
    """The default register budget as CTAs per SM: 4 (128 registers) for the register
    lookups, 2 at head_dim 256; with the pair tables what their shared memory allows: 4 warps
    3 CTAs with one table, else 2; 8 warps 2 CTAs with one table at head_dim ≤ 128, else 1
    (at head_dim 256, 128 registers would spill the operands)."""
    small = head_dim <= 128
    if not lut:
        return 4 if small else 2
    if warps > 4:
        return 2 if small and same else 1
    return 3 if small and same else 2


def defines(loader: TkvLoader, head_dim: int, group: int, q_dtype: torch.dtype,
            dot_dtype: torch.dtype, *, qrot: bool = False, epilogue: int = 0,
            out_dtype: torch.dtype = torch.float32, sub: int | None = None,
            stages: int | None = None, min_ctas: int | None = None,
            lut: int | None = None, warps: int | None = None, early: int | None = None,
            team_steps: int | None = None, balanced: bool = False,
            merge_splits: bool = False) -> dict[str, int]:
    """The ``-D`` defines of one kernel configuration (the compile key; see the source's
    header). ``sub``: 16-token steps per loop iteration (default 2 at head_dim ≤ 128, else
    1); ``stages``: ring stages per warp (default ``2·sub``, 3 for one step at head_dim ≤
    128); ``min_ctas``: the register budget as CTAs per SM (default :func:`_min_ctas`: 4, 2
    at head_dim 256; with ``lut=1`` what the shared memory allows);
    ``lut``: 0 (default) the byte-permute lookups in registers, 1 the shared pair tables
    (``TABLE_BYTES`` per distinct codebook, one for both sides when K's and V's byte tables
    are equal; all of the kernel's shared memory is then dynamic, ``DYN_BYTES``);
    ``warps``: warps per CTA (4 or 8; 8 needs ``lut=1``, whose dynamic shared memory has no
    48 KB static limit); ``early``: 0 (default) or 1, the first ring groups issued before the
    query prologue (rotation, packing) and, with ``lut=1`` on the split schedule, before the
    pair tables are filled — the query rows then get their own shared area
    (:func:`_query_area`) instead of sharing the ring's; ``team_steps``: 0 / None (default) or
    the most 16-token steps per split at which a sequence is served by two teams of 4 warps,
    one per KV head (needs ``warps=8`` and the split schedule; builds ``TEAMS=1``, the
    threshold is a kernel argument, see :func:`team_steps_for`); ``balanced``: the balanced
    (stream-K) schedule of :func:`launch_balanced` (needs ``epilogue`` 1 or 2);
    ``merge_splits``: several splits on the split schedule merged in the kernel by the split
    that finishes last (``MERGE_SPLITS``, see :func:`launch_split`; needs ``epilogue`` 1 or
    2)."""
    if balanced and not epilogue:
        raise ShapeError("cuda decode: the balanced schedule writes the output itself "
                         "(epilogue 1 or 2)")
    if merge_splits and (balanced or not epilogue):
        raise ShapeError("cuda decode: merge_splits writes the output of the split schedule "
                         "(epilogue 1 or 2, not balanced)")
    sub = sub or (SUB if head_dim <= 128 else 1)
    nst = stages or (2 * sub if sub > 1 or head_dim > 128 else 3)
    lut, warps, early, team_steps = lut or 0, warps or WARPS, early or 0, team_steps or 0
    teams = int(team_steps > 0)
    if (sub not in (1, 2) or nst % sub or not 2 * sub <= nst <= 8
            or not 1 <= (min_ctas or 1) <= 8 or lut not in (0, 1)
            or warps not in ((4, 8) if lut else (4,)) or early not in (0, 1)
            or isinstance(team_steps, bool) or not isinstance(team_steps, int)
            or team_steps < 0 or (teams and (warps != 8 or balanced))):
        raise ShapeError(f"cuda decode tuning: sub={sub} (1 or 2), stages={nst} (a multiple of "
                         f"sub in [2·sub, 8]), min_ctas={min_ctas} (1..8), lut={lut} (0 or 1),"
                         f" warps={warps} (4, or 8 with lut=1), early={early} (0 or 1), "
                         f"team_steps={team_steps!r} (an int ≥ 0; > 0 needs warps=8 and the "
                         f"split schedule)")
    same = loader._prmt_host["k", dot_dtype] == loader._prmt_host["v", dot_dtype]
    tab = lut * TABLE_BYTES * (1 if same else 2)
    # the kernel's SMEM_BYTES (its static_assert checks this bound): the per-warp cp.async
    # ring, or the warps' merge rows, whichever is larger
    k_sink = loader.k_sink_shift is not None
    area = _smem_area(head_dim, group, warps, nst, teams,
                      _query_area(head_dim, group, early, qrot or k_sink, teams))
    return dict(HEAD_DIM=head_dim, GROUP=group, WARPS=warps, SUB=sub, NST=nst,
                BLOCK_SIZE=loader.block_size, Q_KIND=_Q_KIND[q_dtype], QROT=int(qrot),
                DOT_BF16=int(dot_dtype == torch.bfloat16),
                K_SYM=int(_antisymmetric(loader, "k", dot_dtype)),
                V_SYM=int(_antisymmetric(loader, "v", dot_dtype)),
                EPILOGUE=epilogue, OUT_KIND=_Q_KIND[out_dtype],
                K_SINK=int(k_sink),
                V_SINK=int(loader.v_sink_shift is not None),
                MIN_CTAS=min_ctas or _min_ctas(head_dim, lut, same, warps),
                LUT=lut, TAB_SAME=int(same and lut), TAB_BYTES=tab,
                DYN_BYTES=tab + area if lut else 0, BALANCED=int(bool(balanced)), EARLY=early,
                TEAMS=teams, MERGE_SPLITS=int(bool(merge_splits)))


def ctas_per_sm(defs: dict[str, int], device) -> int:
    """How many CTAs of the configuration ``defs`` (from :func:`defines`) one SM of ``device``
    holds at once (registers, shared memory; the driver's occupancy calculator) — the slots a
    split count's grid fills. Compiles the configuration if this process has not.

    Raises:
        CudaCompileError: the kernel did not compile or the driver query failed."""
    k = _nvrtc.kernel(SOURCE, ENTRY, defs, device)
    if defs["DYN_BYTES"]:
        _nvrtc.reserve_dynamic_smem(k, defs["DYN_BYTES"])
    return _nvrtc.ctas_per_sm(k, defs["WARPS"] * 32, defs["DYN_BYTES"])


def _smem_area(head_dim: int, group: int, warps: int, nst: int, teams: int = 0,
               q_area: int = 0) -> int:
    """The kernel's SMEM_BYTES (its static_assert checks this bound): the per-warp cp.async
    ring and the query rows' own area after it (``q_area``, :func:`_query_area`), or the
    warps' merge rows (and one merged row set per KV head a CTA may serve: 2 with
    ``teams``), whichever is larger (bytes)."""
    stage = (2 * head_dim // 8 + 4 * head_dim // 16) * 32 + 64
    heads = 2 if teams else 1
    return max(warps * nst * stage + q_area,
               (warps * (group * head_dim + 24) + heads * group * head_dim) * 4)


def _query_area(head_dim: int, group: int, early: int, rows: bool, teams: int = 0) -> int:
    """The kernel's Q_AREA: with ``early`` and query rows in shared memory (``rows``: a
    rotation in the kernel or sink offsets), their own area after the ring —
    per KV head the CTA may serve (2 with ``teams``), ``group`` float32 rows of ``head_dim``
    and 8 score words (bytes); else 0."""
    heads = 2 if teams else 1
    return (heads * group * head_dim + 8 * heads) * 4 if early and rows else 0


def resident_ctas(loader: TkvLoader, head_dim: int, group: int, dot_dtype: torch.dtype,
                  device) -> int:
    """CTAs per SM of the configuration a launch would build (the context profile and
    :data:`TUNING` applied): its register budget (``MIN_CTAS``, the kernel's
    ``__launch_bounds__``) limited by the SM's shared memory (1 KB reserved per CTA) and 64
    warps — what :meth:`Workspace.cuda_splits_for` fills one wave of. Host-side arithmetic, no
    compile, so the split count never depends on what this process compiled first. A lower
    bound of the driver's count (:func:`ctas_per_sm`), equal to it for every configuration the
    context profiles build (sm_90, session 36: 4 / 3 / 2 for the register lookups / pair
    tables / 8-warp pair tables at head_dim 128, 4 / 2 at 64, 2 / 2 / 1 at 256); the 4-warp
    pair tables at head_dim 64 fit 4 where the budget promises 3. With ``early=1`` the query
    rows' own area is counted as if the query were rotated in the kernel (the larger of the
    two). Off a CUDA device (tests) the register budget alone."""
    if any((s, dot_dtype) not in loader._prmt_host for s in "kv"):
        return 4   # no byte tables for this dtype: check_supported refuses the launch anyway
    d = defines(loader, head_dim, group, torch.float32, dot_dtype, qrot=True,
                **launch_tuning(head_dim))
    n = min(d["MIN_CTAS"], 64 // d["WARPS"])
    if torch.device(device).type != "cuda":
        return n
    per_sm = torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor
    smem = d["DYN_BYTES"] or _smem_area(
        head_dim, group, d["WARPS"], d["NST"], d["TEAMS"],
        _query_area(head_dim, group, d["EARLY"], True, d["TEAMS"]))
    return max(1, min(n, per_sm // (smem + 1024)))


def launch_split(q, block_table, seq_lens, num_blocks: int, cache, loader: TkvLoader,
                 part_o, part_lse, scale_log2: float, window: int, *, group: int,
                 splits: int, dot_dtype: torch.dtype, q_w: torch.Tensor | None = None,
                 epilogue: int = 0, out: torch.Tensor | None = None,
                 o_w: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                 **config) -> None:
    """Launch the CUDA split kernel on grid ``(num_seqs, num_kv_heads, splits)``.

    ``q``: ``(num_seqs, num_q_heads, head_dim)`` (float32 / bf16 / fp16, unit stride on
    head_dim), rotated — or, with ``q_w`` (float32 ``(head_dim,)``, the loader's
    ``q_hadamard``), in model space and rotated in the kernel as ``H (q_w ⊙ q)``.
    ``epilogue`` (as ``decode._single_split_epilogue``): 0 writes the partial rows and LSEs
    (log2 units) into ``part_o`` / ``part_lse`` as ``decode._decode_split_kernel`` does, for
    the reduce kernel; 1 writes the normalized rows to ``out``; 2 writes them unrotated as
    ``o_w ⊙ H o``. With 1 or 2 and several splits the kernel merges the splits itself
    (``MERGE_SPLITS``): each writes its partial rows, and the one that finishes last (int32
    ``counters``, at least ``num_seqs · num_kv_heads`` zeros, e.g.
    :meth:`Workspace.counters`; it leaves them zero) merges them by their LSEs and writes
    the output — no reduce launch. ``config``: :func:`defines`' tuning keywords.

    Raises:
        ShapeError: several splits with epilogue 1 or 2 and no ``counters`` (or too few, not
            int32, not contiguous, on another device).
        UnsupportedKernelError: the cache's base is not 16-byte aligned.
        CudaCompileError: the kernel did not compile."""
    merge = splits > 1 and bool(epilogue)
    if merge and (counters is None or counters.numel() < q.shape[0] * loader.num_kv_heads
                  or counters.dtype != torch.int32 or counters.device != q.device
                  or not counters.is_contiguous()):
        raise ShapeError(f"cuda decode: merging {splits} splits in the kernel needs contiguous "
                         f"int32 counters on {q.device} for {q.shape[0] * loader.num_kv_heads} "
                         f"(sequence, KV head) pairs")
    defs, tune = _defines_for(q, cache, loader, group, dot_dtype, q_w, epilogue, out,
                              {**config, "merge_splits": merge})
    teams = 0
    if defs["TEAMS"]:
        teams = team_steps_for(tune["team_steps"], q.shape[0], loader.num_kv_heads, splits,
                               _resident_slots(defs, q.device))
    _launch(defs, (q.shape[0], loader.num_kv_heads, splits), q, block_table, seq_lens,
            num_blocks, cache, loader, part_o, part_lse, scale_log2, window, splits, dot_dtype,
            q_w, out if epilogue else None, o_w, counters if merge else part_lse, 0, teams)


def launch_balanced(q, block_table, seq_lens, num_blocks: int, cache, loader: TkvLoader,
                    workspace, scale_log2: float, window: int, *, group: int,
                    dot_dtype: torch.dtype, out: torch.Tensor, epilogue: int,
                    q_w: torch.Tensor | None = None, o_w: torch.Tensor | None = None,
                    min_steps: int | None = None, **config) -> None:
    """Launch the CUDA kernel with the balanced (stream-K) schedule: one grid of as many CTAs
    as the GPU holds at once (SMs × :func:`ctas_per_sm`), the batch's (sequence, KV head)
    pairs laid end to end as one run of 16-token steps and cut into equal shares, one per CTA
    (at least ``min_steps`` steps each, default :data:`MIN_STEPS`, so short batches use fewer
    CTAs). A pair cut across
    CTAs is merged by the CTA that finishes its part last (counters in ``workspace``, reset
    by the merging CTA, so CUDA-graph replays start from zero); no reduce launch. The work
    per CTA is the same whatever the sequence lengths (a long sequence among short ones is
    spread over many CTAs), and the grid never leaves a partial wave.

    Arguments as :func:`launch_split`; ``out`` (``(num_seqs, num_q_heads, head_dim)``) gets
    the normalized rows, unrotated as ``o_w ⊙ H o`` with ``epilogue=2``, as they are with 1.

    Raises:
        UnsupportedKernelError: the cache's base is not 16-byte aligned.
        WorkspaceTooSmallError: the workspace's partial rows or counters are too few.
        CudaCompileError: the kernel did not compile."""
    defs, _ = _defines_for(q, cache, loader, group, dot_dtype, q_w, epilogue, out,
                           {**config, "balanced": True})   # teams are the split schedule's
    min_steps = MIN_STEPS if min_steps is None else min_steps
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
        raise ShapeError(f"min_steps must be an int ≥ 1, got {min_steps!r}")
    ctas = min(_resident_slots(defs, q.device), workspace.balanced_ctas)
    if ctas < 1:
        raise _nvrtc.CudaCompileError(f"the balanced schedule's kernel fits no CTA on an SM "
                                      f"({defs})")
    part_o, part_lse, counters = workspace.balanced_scratch(
        ctas, group, loader.head_dim, q.shape[0] * loader.num_kv_heads)
    _launch(defs, (ctas, 1, 1), q, block_table, seq_lens, num_blocks, cache, loader, part_o,
            part_lse, scale_log2, window, 1, dot_dtype, q_w, out, o_w, counters, min_steps, 0)


TEAM_FILL = 0.875   # the least share of a wave the teams' CTAs must fill (team_steps_for)


def team_steps_for(team_steps: int, num_seqs: int, num_kv_heads: int, splits: int,
                   slots: int) -> int:
    """The ``team_steps`` a launch passes the kernel (``TEAMS=1`` builds): ``team_steps``
    when the CTAs left working with every sequence in teams — ``num_seqs`` ×
    ⌈``num_kv_heads`` / 2⌉ × ``splits`` — still fill :data:`TEAM_FILL` of a wave of
    ``slots`` resident CTAs (SMs × CTAs per SM), else 0 (8 warps per pair: teams would halve
    the working CTAs and idle SMs). A function of the launch shape only (static under CUDA
    graphs); the lengths choose per sequence in the kernel."""
    working = num_seqs * ((num_kv_heads + 1) // 2) * splits
    return team_steps if num_kv_heads > 1 and working >= TEAM_FILL * slots else 0


def _resident_slots(defs: dict[str, int], device) -> int:
    """The CTAs of configuration ``defs`` the whole GPU holds at once: SMs × :func:`ctas_per_sm`
    (the driver's count; a balanced grid's size, the wave a teams launch must fill)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    with torch.cuda.device(device):
        return sms * ctas_per_sm(defs, device)


def _defines_for(q, cache, loader, group, dot_dtype, q_w, epilogue, out, config):
    """The launch's defines and the tuning keywords they were built from (the context profile,
    :data:`TUNING` and ``config`` merged; a profile's ``team_steps`` dropped for the balanced
    schedule)."""
    lay = loader.layout
    st = lay.strides()
    d = loader.head_dim
    if not cache_aligned(cache):
        raise UnsupportedKernelError("decode(kernel='cuda') needs a 16-byte aligned cache")
    if st["k_token"] != d // 2 or st["v_token"] != d // 2:   # 4-bit sides: d/2 code bytes
        raise UnsupportedKernelError(f"decode(kernel='cuda'): token strides {st}")
    out_dtype = out.dtype if epilogue else torch.float32
    tune = {**launch_tuning(d), **config}
    if tune.get("balanced"):   # a context profile's teams do not apply to the balanced schedule
        tune.pop("team_steps", None)
    return defines(loader, d, group, q.dtype, dot_dtype, qrot=q_w is not None,
                   epilogue=epilogue, out_dtype=out_dtype, **tune), tune


def _launch(defs, grid, q, block_table, seq_lens, num_blocks, cache, loader, part_o, part_lse,
            scale_log2, window, splits, dot_dtype, q_w, out, o_w, counters, min_steps,
            team_steps):
    lay = loader.layout
    st = lay.strides()
    k = _nvrtc.kernel(SOURCE, ENTRY, defs, q.device)
    smem = defs["DYN_BYTES"]
    ktab, vtab = loader._prmt["k", dot_dtype][0], loader._prmt["v", dot_dtype][0]
    dummy = part_lse
    k_shift, v_shift = sink_shift(loader, "k", dummy)[0], sink_shift(loader, "v", dummy)[0]
    args = [q, q.stride(0), q.stride(1), block_table, block_table.stride(0), seq_lens,
            block_table.shape[1], num_blocks, cache, lay.page_bytes,
            lay.k_codes_offset, st["k_head"], lay.k_norms_offset,
            lay.v_codes_offset, st["v_head"], lay.v_norms_offset, st["norm_head"],
            ktab, vtab, part_o, part_lse, float(scale_log2),
            min(int(window), _INT32_MAX),   # C int: a larger window is the same as none
            splits, dummy if q_w is None else q_w, dummy if out is None else out,
            0 if out is None else out.stride(0), 0 if out is None else out.stride(1),
            dummy if o_w is None else o_w, k_shift, v_shift, q.shape[0], loader.num_kv_heads,
            counters, int(min_steps), int(team_steps)]
    with torch.cuda.device(q.device):   # PyTorch's launcher takes the current device's stream
        if smem:
            _nvrtc.reserve_dynamic_smem(k, smem)
        k(grid=grid, block=(defs["WARPS"] * 32, 1, 1), args=args, shared_mem=smem)
