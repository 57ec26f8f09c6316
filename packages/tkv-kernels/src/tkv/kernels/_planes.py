"""Tensor-core attention steps over coordinate planes (shared by decode and prefill).

A tile loader returns a K or V tile as ``NP`` planes (``tkv.kernels.loaders`` module doc):
plane ``p`` holds coordinates ``NP * j + p``. Because ``q·k = Σ_p q_p·k_p`` and
``(P V)[:, NP*j + p] = (P V_p)[:, j]``, attention never needs the planes re-interleaved:
queries are loaded, scores accumulated and outputs stored plane by plane with strided
coordinates. Planes ``p ≥ NP`` are ignored (callers pass any tensor of the right shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def planar_index(num_planes: int, head_dim: int, d_pad: int) -> torch.Tensor:
    """int64 ``(d_pad,)``: the coordinate held at each position of the *planar* layout
    ``[plane 0 | plane 1 | …]`` (position ``p * d_pad/NP + j`` holds ``NP*j + p``), −1 where
    that coordinate is ≥ head_dim (padding)."""
    dj = d_pad // num_planes
    pos = torch.arange(d_pad)
    coord = (pos % dj) * num_planes + pos // dj
    return torch.where(coord < head_dim, coord, -1)


def to_planar_columns(m: torch.Tensor, num_planes: int, head_dim: int, d_pad: int):
    """``(r, head_dim) -> (r, d_pad)``: the columns of ``m`` in planar order, zeros at padding
    (so ``x @ to_planar_columns(M)`` is ``x @ M`` laid out as planes)."""
    idx = planar_index(num_planes, head_dim, d_pad).to(m.device)
    out = m[:, idx.clamp(min=0)]
    return out * (idx >= 0).to(m.dtype)[None, :]


@triton.jit
def _plane(ptr, rows, rmask, P: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr,
           HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, PLANAR: tl.constexpr):
    j = tl.arange(0, D_PAD // NP)
    if PLANAR:
        x = tl.load(ptr + rows[:, None] + (P * (D_PAD // NP) + j)[None, :],
                    mask=rmask[:, None], other=0.0)
    else:
        c = j * NP + P
        x = tl.load(ptr + rows[:, None] + c[None, :],
                    mask=rmask[:, None] & (c < HEAD_DIM)[None, :], other=0.0)
    return x.to(DTYPE)


@triton.jit
def load_planes(ptr, rows, rmask, NP: tl.constexpr, D_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, PLANAR: tl.constexpr = False):
    """Rows ``ptr + rows[m]`` (element offsets) as ``NP`` planes ``[M, D_PAD // NP]`` of
    ``DTYPE``. Interleaved rows (natural coordinate order, unit stride, ``HEAD_DIM`` wide):
    strided reads, coordinates ≥ HEAD_DIM read 0. ``PLANAR`` rows (``D_PAD`` wide, already
    in :func:`planar_index` order): contiguous reads. Masked rows read 0."""
    x0 = _plane(ptr, rows, rmask, 0, NP, D_PAD, HEAD_DIM, DTYPE, PLANAR)
    x1 = x0
    x2 = x0
    x3 = x0
    if NP > 1:
        x1 = _plane(ptr, rows, rmask, 1, NP, D_PAD, HEAD_DIM, DTYPE, PLANAR)
    if NP > 2:
        x2 = _plane(ptr, rows, rmask, 2, NP, D_PAD, HEAD_DIM, DTYPE, PLANAR)
        x3 = _plane(ptr, rows, rmask, 3, NP, D_PAD, HEAD_DIM, DTYPE, PLANAR)
    return x0, x1, x2, x3


@triton.jit
def _store_plane(ptr, rows, rmask, x, P: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr, PLANAR: tl.constexpr):
    j = tl.arange(0, D_PAD // NP)
    if PLANAR:
        tl.store(ptr + rows[:, None] + (P * (D_PAD // NP) + j)[None, :],
                 x.to(ptr.dtype.element_ty), mask=rmask[:, None])
    else:
        c = j * NP + P
        tl.store(ptr + rows[:, None] + c[None, :], x.to(ptr.dtype.element_ty),
                 mask=rmask[:, None] & (c < HEAD_DIM)[None, :])


@triton.jit
def store_planes(ptr, rows, rmask, x0, x1, x2, x3, NP: tl.constexpr, D_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr, PLANAR: tl.constexpr = False):
    """Inverse of :func:`load_planes` (padding coordinates and masked rows not written)."""
    _store_plane(ptr, rows, rmask, x0, 0, NP, D_PAD, HEAD_DIM, PLANAR)
    if NP > 1:
        _store_plane(ptr, rows, rmask, x1, 1, NP, D_PAD, HEAD_DIM, PLANAR)
    if NP > 2:
        _store_plane(ptr, rows, rmask, x2, 2, NP, D_PAD, HEAD_DIM, PLANAR)
        _store_plane(ptr, rows, rmask, x3, 3, NP, D_PAD, HEAD_DIM, PLANAR)


@triton.jit
def scores(q0, q1, q2, q3, k0, k1, k2, k3, NP: tl.constexpr):
    """``Σ_p q_p k_pᵀ``: ``[M, N]`` float32 from ``[M, D/NP]`` query and ``[N, D/NP]`` key
    planes (one tensor-core dot per plane, accumulated in place)."""
    s = tl.dot(q0, tl.trans(k0))
    if NP > 1:
        s = tl.dot(q1, tl.trans(k1), s)
    if NP > 2:
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.dot(q3, tl.trans(k3), s)
    return s


@triton.jit
def accumulate(a0, a1, a2, a3, alpha, p, v0, v1, v2, v3, NP: tl.constexpr):
    """Online-softmax value step per plane: ``a_p ← alpha[:, None] · a_p + p @ v_p``
    (``a_p`` ``[M, D/NP]`` float32, ``p`` ``[M, N]`` in the dot dtype, ``v_p`` ``[N, D/NP]``)."""
    a0 = tl.dot(p, v0, a0 * alpha[:, None])
    if NP > 1:
        a1 = tl.dot(p, v1, a1 * alpha[:, None])
    if NP > 2:
        a2 = tl.dot(p, v2, a2 * alpha[:, None])
        a3 = tl.dot(p, v3, a3 * alpha[:, None])
    return a0, a1, a2, a3
