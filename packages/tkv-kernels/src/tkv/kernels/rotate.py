"""Rows of ``(tokens or sequences, heads, features)`` tensors times a small matrix, in one
launch: the query rotation of decode, and prefill's rotations into the loader's planar space
and back.

``Y[t, h] = X[t, h] @ M − μ[h]`` in float32 on tensor cores (``tf32x3``: three TF32 passes,
float32 accuracy), read in the input's dtype and written in the output's — no float32
copies of the activations in between. Until session 12 prefill used ``x.float() @ M`` then
``.to(dtype)``: a float32 copy, a float32 cuBLAS GEMM without tensor cores
(``sm80_xmma_gemm_f32f32…ffma``) and a cast. In a profiled vLLM run (SmolLM2, 256 prompts ×
64 tokens, H200, ``benchmarks/results/vllm_e2e_2026-11-30_s12_jit/1_profile/``) the GEMM and
copy time above the bf16 run's was ~40 ms of device time, against 37 ms for the prefill
attention kernel itself. (This kernel has not been timed on the GPU yet.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tkv.codec.errors import ShapeError

from ._util import (
    check_flag,
    check_positive_int,
    check_pow2,
    dot_dtype_for,
    interpreting,
    next_pow2,
)

__all__ = ["RotateLaunch", "launch_plan", "rotate_rows", "row_block", "slab"]

_TL_DOT = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def split_bf16(x, OPERAND: tl.constexpr):
    """``(hi, lo)``: ``hi = bf16(x)``, ``lo = bf16(x − hi)`` in the dot operand dtype
    ``OPERAND`` — two bf16 tensor-core operands whose sum is float32 ``x`` to ~2^-16
    relative (bf16 operands hold bf16 values as float32 under the interpreter, whose
    ``tl.dot`` multiplies bf16 bit patterns as integers). The host twin for constant
    matrices is ``loaders._bf16_halves``."""
    hi = x.to(tl.bfloat16)
    lo = (x.to(tl.float32) - hi.to(tl.float32)).to(tl.bfloat16)
    return hi.to(OPERAND), lo.to(OPERAND)


@triton.jit
def _store_rows(acc, Y, sy_t, sy_h, MU, s_mu, t, h, rmask, offs_n, nmask,
                HAS_MU: tl.constexpr):
    """The rotation kernels' epilogue: ``acc − MU[h]`` (when ``HAS_MU``) cast to Y's dtype
    into rows ``(t, h)`` of ``Y``, columns ``offs_n`` where ``nmask``."""
    if HAS_MU:
        acc -= tl.load(MU + h[:, None] * s_mu + offs_n[None, :],
                       mask=rmask[:, None] & nmask[None, :], other=0.0)
    tl.store(Y + t[:, None] * sy_t + h[:, None] * sy_h + offs_n[None, :],
             acc.to(Y.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


# num_rows = tokens (or sequences) · heads changes with every eager batch: no specialization
# on its value (prefill._VARYING_INTS); it only masks rows.
@triton.jit(do_not_specialize=["num_rows"])
def _rotate_rows_kernel(X, sx_t, sx_h, M, sm, Y, sy_t, sy_h, MU, s_mu, num_rows,
                        HQ: tl.constexpr, BLOCK_R: tl.constexpr, K_IN: tl.constexpr,
                        K_PAD: tl.constexpr, N_OUT: tl.constexpr, N_PAD: tl.constexpr,
                        KC: tl.constexpr, HAS_MU: tl.constexpr, BF16_SPLIT: tl.constexpr,
                        X_BF16: tl.constexpr, OPERAND: tl.constexpr):
    """``Y[r] = X[r] @ M[:K_IN, :N_OUT] (− MU[r % HQ])`` for rows ``r = t · HQ + h``: float32
    tf32x3 tensor-core passes over KC-row slabs of M (the fp32 slab is split hi/lo in
    registers), output cast to Y's dtype. ``BF16_SPLIT``: bf16 tensor-core passes instead,
    M = M_hi + M_lo in bf16 (and X = X_hi + X_lo unless ``X_BF16``: X is bf16, exact) —
    2 passes for bf16 rows, 3 otherwise, ~2^-16 relative error. ``OPERAND``: the dot operand
    dtype of those passes, bf16 (float32 holding the same bf16 values under the interpreter,
    whose ``tl.dot`` multiplies bf16 bit patterns as integers)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    xrow = X + t[:, None] * sx_t + h[:, None] * sx_h
    offs_n = tl.arange(0, N_PAD)
    nmask = offs_n < N_OUT
    acc = tl.zeros([BLOCK_R, N_PAD], tl.float32)
    for c in tl.static_range(K_PAD // KC):
        kc = c * KC + tl.arange(0, KC)
        kmask = kc < K_IN
        x = tl.load(xrow + kc[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        m = tl.load(M + kc[:, None] * sm + offs_n[None, :],
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        if BF16_SPLIT:
            m_hi, m_lo = split_bf16(m, OPERAND)
            x_hi, x_lo = split_bf16(x, OPERAND)
            if not X_BF16:   # X's low half (zero for bf16 rows: no third pass)
                acc = tl.dot(x_lo, m_hi, acc)
            acc = tl.dot(x_hi, m_hi, acc)
            acc = tl.dot(x_hi, m_lo, acc)
        else:
            acc = tl.dot(x.to(tl.float32), m, acc, input_precision="tf32x3")
    _store_rows(acc, Y, sy_t, sy_h, MU, s_mu, t, h, rmask, offs_n, nmask, HAS_MU)


@triton.jit(do_not_specialize=["num_rows"])
def _rotate_rows_persistent_kernel(X, sx_t, sx_h, M, sm, Y, sy_t, sy_h, MU, s_mu, num_rows,
                                   HQ: tl.constexpr, BLOCK_R: tl.constexpr,
                                   K_IN: tl.constexpr, K_PAD: tl.constexpr,
                                   N_OUT: tl.constexpr, N_PAD: tl.constexpr,
                                   HAS_MU: tl.constexpr, X_BF16: tl.constexpr,
                                   OPERAND: tl.constexpr, STAGES: tl.constexpr):
    """:func:`_rotate_rows_kernel`'s product for many rows: each program splits M into bf16
    hi/lo halves ONCE and keeps them for every ``BLOCK_R``-row tile it then takes (tiles
    ``pid, pid + programs, …``; ``STAGES``-deep software pipeline over the tiles' loads), so
    neither the matrix reads nor its split are paid per tile. Products as ``BF16_SPLIT``:
    ``X_hi·M_hi + X_hi·M_lo (+ X_lo·M_hi)``, float32 accumulation, ~2^-16 relative."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_k = tl.arange(0, K_PAD)
    kmask = offs_k < K_IN
    offs_n = tl.arange(0, N_PAD)
    nmask = offs_n < N_OUT
    m = tl.load(M + offs_k[:, None] * sm + offs_n[None, :],
                mask=kmask[:, None] & nmask[None, :], other=0.0)
    m_hi, m_lo = split_bf16(m, OPERAND)
    for tile in tl.range(pid, tl.cdiv(num_rows, BLOCK_R), nprog, num_stages=STAGES):
        r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < num_rows
        t = (r // HQ).to(tl.int64)
        h = r % HQ
        x = tl.load(X + t[:, None] * sx_t + h[:, None] * sx_h + offs_k[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        x_hi, x_lo = split_bf16(x, OPERAND)
        acc = tl.dot(x_hi, m_hi)
        acc = tl.dot(x_hi, m_lo, acc)
        if not X_BF16:   # X's low half (zero for bf16 rows: no third pass)
            acc = tl.dot(x_lo, m_hi, acc)
        _store_rows(acc, Y, sy_t, sy_h, MU, s_mu, t, h, rmask, offs_n, nmask, HAS_MU)


# From this many rows (prefill chunks: 2K tokens x 32 heads) rotate_rows runs the persistent
# kernel (session 25, launch_plan), or with persistent=False 128 rows per program with 8
# warps: 1.18x (bf16 query rows) / 1.20x (float32 output rows) the 32-row launch at 523K rows
# of 128 on the H200, where 64 rows measured 0.61-0.86x
# (benchmarks/results/kernels_gpu_2026-12-05_s22_mixed_prefill.md). Decode's query
# rotations stay on row_block below it (a batch reaches it only at 2,048 sequences × 32
# query heads; it then takes the persistent launch, ~2^-16 relative instead of float32's).
_WIDE_ROWS = 65536


def _persistent_programs(device: torch.device) -> int:
    """Programs of the persistent rotation: 2 per SM (4 under the interpreter, enough to
    exercise the tile loop's stride)."""
    if interpreting() or device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


class RotateLaunch(NamedTuple):
    """How :func:`rotate_rows` launches: the persistent kernel or one tile per program, rows
    per tile, warps, and the persistent loop's pipeline depth (unused otherwise)."""

    persistent: bool
    block_r: int
    num_warps: int
    num_stages: int


def launch_plan(rows: int, k_pad: int, n_pad: int, *, block_r: int | None = None,
                num_warps: int | None = None, persistent: bool | None = None,
                num_stages: int | None = None) -> RotateLaunch:
    """:func:`rotate_rows`' launch for ``rows`` rows of ``k_pad`` → ``n_pad`` (padded)
    features; None arguments take the defaults below, given ones are checked.

    Defaults: the persistent kernel (2 programs per SM, 64-row tiles, 4 warps, a 3-deep
    pipeline) from :data:`_WIDE_ROWS` rows with both padded dimensions ≤ 128 — on an H100
    (benchmarks/results/kernels_gpu_2026-12-05_s25_rotate_prefix_hits.md) 0.114 ms for 523K
    bf16 query rows of 128 (5.0× the one-tile launch's 0.576 ms, 78 % of copy bandwidth),
    0.115 ms for 523K output rows from bf16 (5.0×), 0.149 ms from float32 (4.0×), 0.060 ms
    for 131K centered key rows (3.1×); the one config that ran in all four (8 warps with
    3 stages and 128-row tiles was faster on the first three, and out of shared memory on the
    key rows). Below that, one tile per program: 128 rows from :data:`_WIDE_ROWS` rows
    (not reached then: the persistent launch takes them, unless ``persistent=False``), else
    :func:`row_block`, 8 warps.

    Raises:
        ShapeError: ``rows`` not an int ≥ 0, ``k_pad`` / ``n_pad`` not a power of two ≥ 16,
            ``block_r`` / ``num_warps`` not a power of two in range, ``persistent``
            not a bool or None, ``persistent=True`` for a matrix over 128 × 128 (padded),
            ``num_stages`` not a positive int.
    """
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise ShapeError(f"launch_plan: rows must be an int ≥ 0, got {rows!r}")
    for name, v in (("k_pad", k_pad), ("n_pad", n_pad)):
        check_pow2(v, name, 16, 1 << 16)
    wide = rows >= _WIDE_ROWS and n_pad <= 128
    fits = k_pad <= 128 and n_pad <= 128
    if persistent is None:
        persistent = wide and fits
    elif check_flag(persistent, "persistent") and not fits:
        # both bf16 halves of the matrix stay in one program for its whole life
        raise ShapeError(f"rotate_rows(persistent=True) takes matrices up to 128 × 128 "
                         f"(padded), got {k_pad} × {n_pad}")
    if block_r is not None:
        br = check_pow2(block_r, "block_r", 16, 256)
    elif persistent:
        br = 64
    elif wide:
        br = 128   # prefill-sized: the matrix read once per 128 rows (H200: 1.18-1.20x)
    else:
        br = row_block(rows, n_pad)
    warps = check_pow2(num_warps if num_warps is not None else (4 if persistent else 8),
                       "num_warps", 1, 16)
    stages = check_positive_int(3 if num_stages is None else num_stages, "num_stages")
    return RotateLaunch(persistent, br, warps, stages)


def row_block(num_rows: int, n_pad: int) -> int:
    """Rows per program of the rotation (and decode's reduce) kernels: 32 (the matrix read
    once per 32 rows); 16 for small batches, so that they still spread over a few programs,
    and for 256-wide rows (ptxas sm_90a, 8 warps: 16 rows fit the registers, 32 spill KBs)."""
    return 32 if num_rows >= 1024 and n_pad <= 128 else 16


def slab(n_pad: int) -> int:
    """Rows of the matrix per tf32x3 tensor-core pass (the fp32 slab ``[KC, n_pad]`` is split
    hi/lo in registers): 32 (at most n_pad), 16 for 256-wide rows."""
    return min(32, n_pad) if n_pad <= 128 else 16


def rotate_rows(x: torch.Tensor, m: torch.Tensor, out: torch.Tensor,
                mu: torch.Tensor | None = None, *, block_r: int | None = None,
                num_warps: int | None = None, bf16_split: bool = False,
                persistent: bool | None = None, programs: int | None = None,
                num_stages: int | None = None) -> torch.Tensor:
    """``out[t, h] = x[t, h] @ m − mu[h]`` (one launch; float32 accuracy — tf32x3 — or, on the
    persistent launch, bf16 hi/lo passes: ~2^-16 relative error on ``m``'s products).

    Args:
        x: ``(T, H, K)`` float16 / bfloat16 / float32, unit stride on the last dim.
        m: float32 ``(K, N)``, unit stride on the last dim (rows of ``K`` features, ``N``
            outputs; e.g. the top-left block of a padded matrix).
        out: ``(T, H, N)`` any float dtype, unit stride on the last dim (written).
        mu: optional float32 ``(1 or H, N)`` contiguous, subtracted per head (``1``: shared).
        block_r, num_warps: launch overrides (rows per program — default 64 on the persistent
            launch, else 128 from 65,536 rows of ≤ 128 outputs, else :func:`row_block`; warps,
            default 4 persistent, else 8), powers of two (ShapeError otherwise) — tuning knobs
            (``benchmarks/kernels_gpu.py --rotate`` sweeps them).
        bf16_split: bf16 hi/lo tensor-core passes instead of tf32x3 (~2^-16 relative error
            instead of float32's; bf16 rows need 2 passes, others 3) on the one-tile launch.
            Timed in session 25 (H100, 523K bf16 rows): 4.1× the tf32x3 launch with 4 warps
            and 128-row tiles, behind the persistent launch's 5.0×; no caller passes it.
        persistent: a fixed grid of ``programs`` programs (default: 2 per SM, 4 under the
            interpreter), each splitting ``m`` into bf16 hi/lo once and looping over
            ``block_r``-row tiles with a ``num_stages``-deep pipeline (default 3)
            (:func:`_rotate_rows_persistent_kernel`; ``bf16_split``'s accuracy). None (the
            default): persistent from :data:`_WIDE_ROWS` rows when both padded matrix
            dimensions are ≤ 128 (:func:`launch_plan`; measured 3.1-5.0× the other launch on
            an H100, session 25), else the one-tile-per-program launch.

    Returns:
        ``out``. Raises ShapeError on mismatched shapes or strides (host-side checks).
    """
    if x.dim() != 3 or out.dim() != 3 or m.dim() != 2:
        raise ShapeError(f"rotate_rows needs x (T, H, K), m (K, N), out (T, H, N); got "
                         f"{tuple(x.shape)}, {tuple(m.shape)}, {tuple(out.shape)}")
    t, h, k = x.shape
    if m.shape[0] != k or tuple(out.shape) != (t, h, m.shape[1]):
        raise ShapeError(f"rotate_rows: x {tuple(x.shape)} @ m {tuple(m.shape)} does not give "
                         f"out {tuple(out.shape)}")
    if x.stride(2) != 1 or out.stride(2) != 1 or m.stride(1) != 1 or m.dtype != torch.float32:
        raise ShapeError("rotate_rows needs unit-stride rows and a float32 matrix with unit "
                         "column stride")
    n = m.shape[1]
    if mu is not None and (mu.dim() != 2 or mu.shape[0] not in (1, h) or mu.shape[1] != n
                           or not mu.is_contiguous() or mu.dtype != torch.float32):
        raise ShapeError(f"rotate_rows: mu must be contiguous float32 (1 or {h}, {n}), got "
                         f"{tuple(mu.shape)} {mu.dtype}")
    rows = t * h
    if rows == 0:
        return out
    k_pad, n_pad = max(16, next_pow2(k)), max(16, next_pow2(n))
    check_flag(bf16_split, "bf16_split")
    plan = launch_plan(rows, k_pad, n_pad, block_r=block_r, num_warps=num_warps,
                       persistent=persistent, num_stages=num_stages)
    if plan.persistent:
        grid = _persistent_programs(x.device) if programs is None else check_positive_int(
            programs, "programs")
        _rotate_rows_persistent_kernel[(min(grid, triton.cdiv(rows, plan.block_r)),)](
            x, x.stride(0), x.stride(1), m, m.stride(0), out, out.stride(0), out.stride(1),
            m if mu is None else mu, 0 if mu is None or mu.shape[0] == 1 else n, rows,
            HQ=h, BLOCK_R=plan.block_r, K_IN=k, K_PAD=k_pad, N_OUT=n, N_PAD=n_pad,
            HAS_MU=mu is not None, X_BF16=x.dtype == torch.bfloat16,
            OPERAND=_TL_DOT[dot_dtype_for(torch.bfloat16)], STAGES=plan.num_stages,
            num_warps=plan.num_warps)
        return out
    br = plan.block_r
    _rotate_rows_kernel[(triton.cdiv(rows, br),)](
        x, x.stride(0), x.stride(1), m, m.stride(0), out, out.stride(0), out.stride(1),
        m if mu is None else mu, 0 if mu is None or mu.shape[0] == 1 else n, rows,
        HQ=h, BLOCK_R=br, K_IN=k, K_PAD=k_pad, N_OUT=n, N_PAD=n_pad,
        KC=min(slab(n_pad), k_pad), HAS_MU=mu is not None, BF16_SPLIT=bf16_split,
        X_BF16=x.dtype == torch.bfloat16, OPERAND=_TL_DOT[dot_dtype_for(torch.bfloat16)],
        num_warps=plan.num_warps)
    return out
