"""Attention steps shared by decode and prefill: the paged K/V tile fetch and the
tensor-core steps over coordinate planes.

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
    """Rows ``ptr + rows[m]`` (element offsets) as a tuple of ``NP`` planes
    ``[M, D_PAD // NP]`` of ``DTYPE``. Interleaved rows (natural coordinate order, unit stride,
    ``HEAD_DIM`` wide): strided reads, coordinates ≥ HEAD_DIM read 0. ``PLANAR`` rows
    (``D_PAD`` wide, already in :func:`planar_index` order): contiguous reads. Masked rows
    read 0."""
    planes = ()
    for p in tl.static_range(NP):
        planes = planes + (_plane(ptr, rows, rmask, p, NP, D_PAD, HEAD_DIM, DTYPE, PLANAR),)
    return planes


@triton.jit
def hadamard_stage(x, M: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    """One radix-2 butterfly stage of the Walsh–Hadamard transform along the last axis of
    ``x [M, D]``: coordinates ``i`` and ``i + H`` (bit ``log2 H`` of ``i`` clear) become their
    sum and difference."""
    y = tl.permute(tl.reshape(x, [M, D // (2 * H), 2, H]), 0, 1, 3, 2)
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), 0, 1, 3, 2)
    return tl.reshape(y, [M, D])


@triton.jit
def hadamard_rows(ptr, rows, rmask, w, out, out_rows, M: tl.constexpr, D: tl.constexpr,
                  LOG2D: tl.constexpr, POST: tl.constexpr = False):
    """Write ``H (w ⊙ x)`` (``POST``: ``w ⊙ (H x)``) as rows ``out + out_rows[m]`` (in
    ``out``'s dtype) for the rows ``x = ptr + rows[m]`` (``H`` the unnormalized Sylvester
    Walsh–Hadamard matrix of order ``D = 2^LOG2D``; ``w`` float32 ``(D,)``: the rotation's
    signs, channel scales and ``1/√D`` in one vector): ``LOG2D`` butterfly stages in float32
    registers, no ``D × D`` matrix. Masked rows are not written.

    Decode uses it twice. Queries (``w`` before): model-space rows into float32 rows that the
    split kernel reads back with :func:`load_planes` after a CTA barrier — straight from the
    butterflies, Triton keeps the query planes in tensor-core operand registers for the whole
    loop (244 instead of 168 registers per thread at head_dim 128, offline sm_90a: one CTA
    per SM less). Single-split outputs (``w`` after): the normalized rotated-space rows back
    to model space, written to the layer output."""
    c = tl.arange(0, D)
    x = tl.load(ptr + rows[:, None] + c[None, :], mask=rmask[:, None], other=0.0)
    x = x.to(tl.float32)
    if not POST:
        x = x * tl.load(w + c)[None, :]
    for s in tl.static_range(LOG2D):
        x = hadamard_stage(x, M, D, 1 << s)
    if POST:
        x = x * tl.load(w + c)[None, :]
    tl.store(out + out_rows[:, None] + c[None, :], x.to(out.dtype.element_ty),
             mask=rmask[:, None])


@triton.jit
def store_planes(ptr, rows, rmask, planes, scale, NP: tl.constexpr, D_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr, PLANAR: tl.constexpr = False):
    """Inverse of :func:`load_planes`, each plane times ``scale[:, None]`` (padding
    coordinates and masked rows not written)."""
    j = tl.arange(0, D_PAD // NP)
    for p in tl.static_range(NP):
        x = (planes[p] * scale[:, None]).to(ptr.dtype.element_ty)
        if PLANAR:
            tl.store(ptr + rows[:, None] + (p * (D_PAD // NP) + j)[None, :], x,
                     mask=rmask[:, None])
        else:
            c = j * NP + p
            tl.store(ptr + rows[:, None] + c[None, :], x,
                     mask=rmask[:, None] & (c < HEAD_DIM)[None, :])


@triton.jit
def merge_planes(planes, GP: tl.constexpr, NP: tl.constexpr):
    """``GP`` group planes → ``NP`` planes (``NP`` divides ``GP``, both ≤ 8 powers of two):
    group plane ``r`` holds coordinates ``GP*g + r``, output plane ``p`` coordinates
    ``NP*j + p`` — so it is group planes ``r = NP*s + p`` (s = 0 … GP/NP − 1) interleaved with
    ``s`` fastest (``j = (GP/NP)*g + s``). ``tl.interleave`` of even and odd ``s`` recursively
    (a register-level join + reshape): a packed format fetches whole code groups but hands
    the kernels fewer, wider planes (fewer, larger tensor-core dots)."""
    out = ()
    for p in tl.static_range(NP):
        if GP == NP:
            x = planes[p]
        elif GP // NP == 2:
            x = tl.interleave(planes[p], planes[NP + p])
        elif GP // NP == 4:
            x = tl.interleave(tl.interleave(planes[p], planes[2 * NP + p]),
                              tl.interleave(planes[NP + p], planes[3 * NP + p]))
        else:
            tl.static_assert(GP // NP == 8, "merge_planes: GP / NP must be 2, 4 or 8")
            x = tl.interleave(
                tl.interleave(tl.interleave(planes[p], planes[4 * NP + p]),
                              tl.interleave(planes[2 * NP + p], planes[6 * NP + p])),
                tl.interleave(tl.interleave(planes[NP + p], planes[5 * NP + p]),
                              tl.interleave(planes[3 * NP + p], planes[7 * NP + p])))
        out = out + (x,)
    return out


@triton.jit
def scores(q, k, NP: tl.constexpr):
    """``Σ_p q_p k_pᵀ``: ``[M, N]`` float32 from tuples of ``[M, D/NP]`` query and
    ``[N, D/NP]`` key planes (one tensor-core dot per plane, accumulated in place)."""
    s = tl.dot(q[0], tl.trans(k[0]))
    for p in tl.static_range(1, NP):
        s = tl.dot(q[p], tl.trans(k[p]), s)
    return s


@triton.jit
def scores_t(q, k, NP: tl.constexpr):
    """``Σ_p k_p q_pᵀ``: the transposed scores ``[N, M]`` float32 — K tiles as the A operand
    (on Hopper, wgmma takes A from registers, so a K tile whose dequant Triton can hoist to
    the load never goes through shared memory as 16-bit planes)."""
    s = tl.dot(k[0], tl.trans(q[0]))
    for p in tl.static_range(1, NP):
        s = tl.dot(k[p], tl.trans(q[p]), s)
    return s


@triton.jit
def zero_planes(M: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr):
    """A tuple of ``NP`` float32 zero accumulators ``[M, D_PAD // NP]``."""
    acc = ()
    for p in tl.static_range(NP):
        acc = acc + (tl.zeros([M, D_PAD // NP], tl.float32),)
    return acc


@triton.jit
def accumulate(acc, alpha, p, v, NP: tl.constexpr):
    """Online-softmax value step per plane: ``acc_p ← alpha[:, None] · acc_p + p @ v_p``
    (``acc_p`` ``[M, D/NP]`` float32, ``p`` ``[M, N]`` in the dot dtype, ``v_p``
    ``[N, D/NP]``); returns the new tuple."""
    out = ()
    for i in tl.static_range(NP):
        out = out + (tl.dot(p, v[i], acc[i] * alpha[:, None]),)
    return out


@triton.jit
def fetch_kv(pos, mask_n, bt_row, num_blocks, kvh,
             k_base, k_aux, k_table, k_sb, k_sh, k_st, v_base, v_aux, v_table, v_sb, v_sh, v_st,
             FETCH: tl.constexpr, KP0: tl.constexpr, KP1: tl.constexpr, KP2: tl.constexpr,
             KP3: tl.constexpr, KNP: tl.constexpr, VP0: tl.constexpr, VP1: tl.constexpr,
             VP2: tl.constexpr, VP3: tl.constexpr, VNP: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, D_PAD: tl.constexpr):
    """Memory half of the K and V tiles of absolute token positions ``pos`` [BLOCK_N] of one
    sequence (``bt_row``: its block-table row) through the loader's ``FETCH``; tokens outside
    ``mask_n`` or with an out-of-range block id are masked. Returns ``(mask_n, raw_k,
    row_scale_k, raw_v, row_scale_v)``."""
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0)
    mask_n = mask_n & (blk >= 0) & (blk < num_blocks)
    blk = tl.where(mask_n, blk, 0)
    off = pos % BLOCK_SIZE
    rk, ks = FETCH(k_base, k_aux, k_table, blk, off, mask_n, kvh, k_sb, k_sh, k_st,
                   KP0, KP1, KP2, KP3, KNP, D_PAD)
    rv, vs = FETCH(v_base, v_aux, v_table, blk, off, mask_n, kvh, v_sb, v_sh, v_st,
                   VP0, VP1, VP2, VP3, VNP, D_PAD)
    return mask_n, rk, ks, rv, vs


# ---- sink offsets (loaders.sink_shift): flagged rows carry |row_scale|·tile + shift[head]
@triton.jit
def split_flag(row_scale):
    """``(|row_scale|, flag)``: the flag is the sign *bit* (a flagged zero norm is −0.0, for
    which ``row_scale < 0`` is false)."""
    return tl.abs(row_scale), row_scale.to(tl.int32, bitcast=True) < 0


@triton.jit
def load_shift(ptr, head, NP: tl.constexpr, D_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Row ``head`` of a float32 ``(num_kv_heads, D_PAD)`` natural-order shift as ``NP``
    planes ``[1, D_PAD // NP]``."""
    one = tl.arange(0, 1)
    return load_planes(ptr, head * D_PAD + one, one < 1, NP, D_PAD, HEAD_DIM, tl.float32)


@triton.jit
def planes_dot(q, c, NP: tl.constexpr):
    """``Σ_p Σ_j q_p[m, j] · c_p[0, j]``: ``[M]`` float32 — a query row's dot with a shift
    (the score term ``⟨q_rot, c⟩`` of a flagged key)."""
    acc = tl.sum(q[0].to(tl.float32) * c[0], axis=1)
    for p in tl.static_range(1, NP):
        acc += tl.sum(q[p].to(tl.float32) * c[p], axis=1)
    return acc


@triton.jit
def add_shift(acc, w, c, NP: tl.constexpr):
    """``acc_p + w[:, None] · c_p`` per plane (the output term: a shift times the softmax
    mass ``w`` of the flagged values)."""
    out = ()
    for p in tl.static_range(NP):
        out = out + (acc[p] + w[:, None] * c[p],)
    return out
