"""Split-K paged decode for 4-bit K and V sides written in Gluon (explicit layouts; CUDA only).

Why a second kernel: the Triton split kernel (``decode._decode_split_kernel``) dequantizes a
tile in the load's blocked layout and Triton moves the 16-bit tile through shared memory into
the tensor-core operand layout; with the table words in uniform registers ptxas copies one into
a regular register before every byte permute, and the query fragments are re-shuffled every
tile (offline SASS: 6.9 instructions per code, ``docs/kernels.md``). Here the layouts are
chosen by hand so that none of that happens:

* one warp per program, so the softmax statistics and the ``P`` operand never leave the warp;
* the code bytes are loaded straight into the ``mma.m16n8k16`` operand layouts (16-byte loads
  for K, 8-byte loads for V) and looked up in place by the ``prmt`` byte-table asm
  (``loaders._PRMT_LUT16``): its outputs *are* the operand registers;
* the dot's K index is a relabelling of the code bytes (a thread's bytes are contiguous in
  memory), compensated once per program by loading the query with the same permutation; the
  value coordinates are relabelled likewise and undone by the output store's addresses;
* the table words come from per-thread loads, so they live in 8 regular registers.

Same inputs and partial outputs as the Triton split kernel (the reduce kernel is shared).
Scope: both sides 4-bit with the prmt lookup, head_dim 32..256 a power of two, G ≤ 16 query
heads per KV head, no sink offsets; :func:`check_supported` says whether a call qualifies.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ._util import UnsupportedKernelError, interpreting
from .loaders import _PRMT_CONSTRAINTS, _PRMT_LUT16, LOOKUP_PRMT_BF16, TkvLoader

__all__ = ["UnsupportedKernelError", "check_supported", "k_layout", "launch_split", "v_layout"]


def k_layout(block_n: int, head_dim: int) -> gl.BlockedLayout:
    """Layout of a K code tile ``[block_n, head_dim/2]`` uint8: lane ``4g + t`` holds the
    ``head_dim/8`` contiguous bytes ``t·head_dim/8 …`` of tokens ``g, g+8, …`` (one vector load
    per token)."""
    return gl.BlockedLayout([1, head_dim // 8], [8, 4], [1, 1], [1, 0])


def v_layout(block_n: int, head_dim: int) -> gl.DistributedLinearLayout:
    """Layout of a V code tile ``[block_n, head_dim/2]`` uint8: lane ``4g + t`` holds bytes
    ``g·head_dim/16 …`` (contiguous) of tokens ``2t, 2t+1, 2t+8, 2t+9, …`` — the token pairs of
    the ``mma`` B operand of ``P·V``."""
    vb = head_dim // 16
    reg = [[0, 1 << i] for i in range(vb.bit_length() - 1)] + [[1, 0]]
    reg += [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    lane = [[2, 0], [4, 0], [0, vb], [0, 2 * vb], [0, 4 * vb]]
    return gl.DistributedLinearLayout(reg, lane, [], [], [block_n, head_dim // 2])


@gluon.jit
def _lookup(codes, tab, LUT: gl.constexpr, CONSTRAINTS: gl.constexpr):
    """4-bit codes (uint8 tensor, any layout) -> (low-nibble, high-nibble) centroids as bf16,
    same layout: the prmt asm with the 8 table words ``tab`` as register operands."""
    lo, hi = gl.inline_asm_elementwise(
        LUT, CONSTRAINTS, [codes, tab[0], tab[1], tab[2], tab[3], tab[4], tab[5], tab[6], tab[7]],
        dtype=(gl.int16, gl.int16), is_pure=True, pack=4)
    return lo.to(gl.bfloat16, bitcast=True), hi.to(gl.bfloat16, bitcast=True)


@gluon.jit
def _table(table, R: gl.constexpr, C: gl.constexpr, LAYOUT: gl.constexpr):
    """The 8 prmt table words as ``[R, C]`` tensors in ``LAYOUT`` (each element the same
    per-thread load, so the words sit in regular registers, not uniform ones)."""
    z = gl.zeros([R, C], gl.int32, LAYOUT)
    return (gl.load(table + z), gl.load(table + 1 + z), gl.load(table + 2 + z),
            gl.load(table + 3 + z), gl.load(table + 4 + z), gl.load(table + 5 + z),
            gl.load(table + 6 + z), gl.load(table + 7 + z))


@gluon.jit
def _blocks(bt_row, pos, lim, start, num_blocks, BLOCK_SIZE: gl.constexpr):
    """(valid mask, physical block) of absolute token positions ``pos`` (valid: in
    ``[start, lim)``, ``lim`` = the sequence's length capped at the block table's capacity,
    and a page in range)."""
    m = (pos < lim) & (pos >= start)
    blk = gl.load(bt_row + pos // BLOCK_SIZE, mask=m, other=0)
    m = m & (blk >= 0) & (blk < num_blocks)
    return m, gl.where(m, blk, 0).to(gl.int64)


@gluon.jit
def gluon_decode_split_kernel(
        Q, sq_s, sq_h, block_table, s_bt, seq_lens, max_blocks, num_blocks,
        k_base, k_aux, k_table, k_sb, k_sh, k_st,
        v_base, v_aux, v_table, v_sb, v_sh, v_st,
        part_o, part_lse, scale_log2, window,
        KP1: gl.constexpr, KP2: gl.constexpr, KP3: gl.constexpr,
        VP1: gl.constexpr, VP2: gl.constexpr, VP3: gl.constexpr,
        G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
        LK: gl.constexpr, LV: gl.constexpr):
    """One (sequence, KV head, split) on one warp: partial output and LSE as
    ``decode._decode_split_kernel`` writes them (natural coordinate order, log2 units)."""
    NB: gl.constexpr = HEAD_DIM // 2      # code bytes per token
    TB: gl.constexpr = HEAD_DIM // 8      # K bytes per lane per token
    VB: gl.constexpr = HEAD_DIM // 16     # V bytes per lane per token
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    seq = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    L = gl.load(seq_lens + seq)
    start = 0
    if window > 0:
        start = gl.maximum(L - window, 0)
    t0 = start // BLOCK_N
    # positions past the block table's capacity are not read (as decode's Triton kernel):
    # a seq_lens entry beyond it reads no table entry out of its row and runs no extra tile
    lim = gl.minimum(L, max_blocks * BLOCK_SIZE)
    t1 = gl.cdiv(lim, BLOCK_N)
    per = gl.cdiv(t1 - t0, NUM_SPLITS)
    my0 = t0 + split * per
    my1 = gl.minimum(my0 + per, t1)
    bt_row = block_table + seq.to(gl.int64) * s_bt

    # the query, once: dot index k of the K planes is code byte beta(k) (a lane's bytes are
    # contiguous in the page), low nibble = coordinate 2·byte, high nibble = 2·byte + 1
    hq = gl.arange(0, 16, layout=gl.SliceLayout(1, DA))
    kk = gl.arange(0, NB, layout=gl.SliceLayout(0, DA))
    beta = TB * ((kk >> 1) & 3) + 4 * (kk >> 4) + 2 * ((kk >> 3) & 1) + (kk & 1)
    qp = Q + seq.to(gl.int64) * sq_s + (kvh * G + hq)[:, None] * sq_h + 2 * beta[None, :]
    qm = (hq < G)[:, None]
    q_lo = gl.load(qp, mask=qm, other=0.0).to(gl.bfloat16)
    q_hi = gl.load(qp + 1, mask=qm, other=0.0).to(gl.bfloat16)

    kb = gl.arange(0, NB, layout=gl.SliceLayout(0, LK))
    vb = gl.arange(0, NB, layout=gl.SliceLayout(0, LV))
    ktab = _table(k_table, NB, BLOCK_N, DB)
    vtab = _table(v_table, BLOCK_N, NB, DB)
    m_i = gl.full([16], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([16], gl.float32, ROW)
    acc_lo = gl.zeros([16, NB], gl.float32, MMA)
    acc_hi = gl.zeros([16, NB], gl.float32, MMA)
    for t in range(my0, my1):
        base = t * BLOCK_N
        # K codes: [N, NB] -> relabel bytes -> [NB, N] in the B-operand layout (no movement)
        pk = base + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LK))
        mk, bk = _blocks(bt_row, pk, lim, start, num_blocks, BLOCK_SIZE)
        rk = bk * k_sb + KP1 + kvh * k_sh + (pk % BLOCK_SIZE) * k_st
        kc = gl.load(k_base + rk[:, None] + kb[None, :], mask=mk[:, None], other=0)
        kc = gl.permute(gl.reshape(kc, [BLOCK_N, 4, TB // 4, 2, 2]), [0, 2, 3, 1, 4])
        kc = gl.convert_layout(gl.permute(gl.reshape(kc, [BLOCK_N, NB]), [1, 0]), DB,
                               assert_trivial=True)
        k_lo, k_hi = _lookup(kc, ktab, _PRMT_LUT16, _PRMT_CONSTRAINTS)
        s = mma_v2(q_lo, k_lo, gl.zeros([16, BLOCK_N], gl.float32, MMA))
        s = mma_v2(q_hi, k_hi, s)
        # norms in the score columns
        pc = base + gl.arange(0, BLOCK_N, layout=COL)
        mc, bc = _blocks(bt_row, pc, lim, start, num_blocks, BLOCK_SIZE)
        kn = gl.load(k_aux + (bc * k_sb + KP2) // 2 + kvh * KP3 + pc % BLOCK_SIZE, mask=mc,
                     other=0.0).to(gl.float32)
        vn = gl.load(v_aux + (bc * v_sb + VP2) // 2 + kvh * VP3 + pc % BLOCK_SIZE, mask=mc,
                     other=0.0).to(gl.float32)
        s = s * (kn * scale_log2)[None, :]
        s = gl.where(mc[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        # V codes: [N, NB] -> relabel bytes (lane g's bytes become columns g, g+8, ...)
        pv = base + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LV))
        mv, bv = _blocks(bt_row, pv, lim, start, num_blocks, BLOCK_SIZE)
        rv = bv * v_sb + VP1 + kvh * v_sh + (pv % BLOCK_SIZE) * v_st
        vc = gl.load(v_base + rv[:, None] + vb[None, :], mask=mv[:, None], other=0)
        vc = gl.permute(gl.reshape(vc, [BLOCK_N, 8, VB]), [0, 2, 1])
        vc = gl.convert_layout(gl.reshape(vc, [BLOCK_N, NB]), DB, assert_trivial=True)
        v_lo, v_hi = _lookup(vc, vtab, _PRMT_LUT16, _PRMT_CONSTRAINTS)
        pa = gl.convert_layout((p * vn[None, :]).to(gl.bfloat16), DA)
        acc_lo = mma_v2(pa, v_lo, acc_lo * alpha[:, None])
        acc_hi = mma_v2(pa, v_hi, acc_hi * alpha[:, None])
    inv = 1.0 / gl.where(l_i > 0, l_i, 1.0)
    inv = gl.where(lim < L, float("nan"), inv)   # a length past the table: NaN rows
    lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    h = gl.arange(0, 16, layout=ROW)
    row = (seq.to(gl.int64) * (G * gl.num_programs(1)) + kvh * G + h) * NUM_SPLITS + split
    n = gl.arange(0, NB, layout=COL)
    coord = 2 * (VB * (n % 8) + n // 8)     # value column n of a plane holds byte gamma(n)
    op = part_o + row[:, None] * HEAD_DIM + coord[None, :]
    om = (h < G)[:, None]
    gl.store(op, acc_lo * inv[:, None], mask=om)
    gl.store(op + 1, acc_hi * inv[:, None], mask=om)
    gl.store(part_lse + row, lse, mask=h < G)


def check_supported(loader, device, head_dim: int, group: int, dot_dtype) -> None:
    """Raise :class:`UnsupportedKernelError` unless the Gluon split kernel can serve the call:
    a CUDA device (not the Triton interpreter: Gluon kernels do not run there), a
    :class:`~tkv.kernels.TkvLoader` with 4-bit K and V sides using the ``prmt`` lookup (so
    ``lookup="prmt"``), bf16 queries, head_dim 32..256 a power of two, at most 16 query heads
    per KV head, no sink offsets."""
    why = None
    if not isinstance(loader, TkvLoader) or (loader.k_bits, loader.v_bits) != (4, 4):
        why = "needs a TkvLoader with 4-bit K and V sides"
    elif head_dim < 32 or head_dim > 256 or head_dim & (head_dim - 1):
        why = f"needs head_dim a power of two in [32, 256], got {head_dim}"
    elif group > 16:
        why = f"needs at most 16 query heads per KV head, got {group}"
    elif loader.k_sink_shift is not None or loader.v_sink_shift is not None:
        why = "does not implement sink offsets"
    elif torch.device(device).type != "cuda" or interpreting():
        why = "needs a CUDA device (Gluon kernels do not run under TRITON_INTERPRET)"
    elif dot_dtype != torch.bfloat16:
        why = "needs bfloat16 queries"
    elif any(loader._lookup(s, dot_dtype)[1] != LOOKUP_PRMT_BF16 for s in ("k", "v")):
        why = "needs the loader's prmt lookup (TkvLoader(..., lookup='prmt'))"
    if why:
        raise UnsupportedKernelError(f"decode(kernel='gluon') {why}")


def launch_split(q, block_table, seq_lens, num_blocks, kargs, vargs, part_o, part_lse,
                 scale_log2: float, window: int, *, num_kv_heads: int, group: int,
                 head_dim: int, block_size: int, splits: int, block_n: int) -> None:
    """Launch :func:`gluon_decode_split_kernel` on grid ``(num_seqs, num_kv_heads, splits)``
    (arguments as ``decode._decode_split_kernel``'s)."""
    gluon_decode_split_kernel[(q.shape[0], num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), block_table, block_table.stride(0), seq_lens,
        block_table.shape[1], num_blocks,
        *kargs[:6], *vargs[:6], part_o, part_lse, scale_log2, window,
        KP1=kargs[7], KP2=kargs[8], KP3=kargs[9], VP1=vargs[7], VP2=vargs[8], VP3=vargs[9],
        G=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=splits, LK=k_layout(block_n, head_dim), LV=v_layout(block_n, head_dim),
        num_warps=1)
