"""Split-K paged decode with inline dequant (one query token per sequence)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tkv.codec.errors import DeviceMismatchError, ShapeError

from . import _nvrtc, cuda_decode, gluon_decode
from ._nvrtc import CudaCompileError
from ._planes import (
    accumulate,
    add_shift,
    fetch_kv,
    hadamard_rows,
    load_planes,
    load_shift,
    planes_dot,
    scores,
    scores_t,
    split_flag,
    store_planes,
    zero_planes,
)
from ._util import (
    check_dtype,
    check_flag,
    check_import_settings,
    check_int_tensor,
    check_last_dim_contiguous,
    check_out,
    check_positive_int,
    check_pow2,
    check_same_device,
    check_side_args_device,
    check_sm_scale,
    check_tensor,
    dot_dtype_for,
    interpreting,
    next_pow2,
    tile_tokens,
)
from .loaders import Loader, check_loader, sink_shift
from .rotate import rotate_rows, row_block, slab
from .workspace import Workspace, check_min_split_tiles

__all__ = ["decode"]

_LOG2E = 1.4426950408889634


@triton.jit
def _fetch_kv(t, t_end, L, start, cap, bt_row, num_blocks, kvh,
              k_base, k_aux, k_table, k_sb, k_sh, k_st, v_base, v_aux, v_table, v_sb, v_sh, v_st,
              FETCH: tl.constexpr, KP0: tl.constexpr, KP1: tl.constexpr, KP2: tl.constexpr,
              KP3: tl.constexpr, KNP: tl.constexpr, VP0: tl.constexpr, VP1: tl.constexpr,
              VP2: tl.constexpr, VP3: tl.constexpr, VNP: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):
    """Token tile ``t`` of the split (all tokens masked when ``t >= t_end``): see fetch_kv."""
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = (pos < L) & (pos >= start) & (pos < cap) & (t < t_end)
    return fetch_kv(pos, mask_n, bt_row, num_blocks, kvh, k_base, k_aux, k_table, k_sb, k_sh,
                    k_st, v_base, v_aux, v_table, v_sb, v_sh, v_st, FETCH, KP0, KP1, KP2, KP3,
                    KNP, VP0, VP1, VP2, VP3, VNP, BLOCK_SIZE, D_PAD)


@triton.jit
def _decode_split_kernel(
        Q, sq_s, sq_h, block_table, s_bt, seq_lens, max_blocks, num_blocks,
        k_base, k_aux, k_table, k_sb, k_sh, k_st,
        v_base, v_aux, v_table, v_sb, v_sh, v_st,
        part_o, part_lse, scale_log2, window, k_shift, v_shift, q_w, q_rot,
        Out, so_s, so_h, o_w,
        FETCH: tl.constexpr, DEQUANT: tl.constexpr, KP0: tl.constexpr, KP1: tl.constexpr,
        KP2: tl.constexpr, KP3: tl.constexpr, KNP: tl.constexpr, VP0: tl.constexpr,
        VP1: tl.constexpr, VP2: tl.constexpr, VP3: tl.constexpr, VNP: tl.constexpr,
        G: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_DTYPE: tl.constexpr, PREFETCH: tl.constexpr, SWAP_QK: tl.constexpr,
        K_SINK: tl.constexpr, V_SINK: tl.constexpr, QROT_LOG2: tl.constexpr,
        EPILOGUE: tl.constexpr, OROT_LOG2: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """One (sequence, KV head, split): the split's partial output (unnormalized accumulator
    over ``l``) and LSE. ``K_SINK`` / ``V_SINK`` (loaders.sink_shift): a key whose norm has
    its sign bit set scores ``|n|·⟨q, k̂⟩ + ⟨q, c_k⟩``; a flagged value adds ``c_v`` times its
    softmax weight (the flagged mass ``m_f`` is rescaled like ``l``): linear in p, so the
    split merge is unchanged. ``QROT_LOG2`` > 0: ``Q`` holds model-space queries, rotated here
    as ``H (q_w ⊙ q)`` into ``q_rot`` (float32 ``(num_seqs, num_q_heads, D_PAD)``; every split
    of a (sequence, KV head) writes the same rows) and read back after a CTA barrier
    (:func:`hadamard_rows`).

    ``EPILOGUE`` (:func:`_single_split_epilogue`): 0 writes the split's partial row and LSE for
    ``_decode_reduce_kernel``; with one split (``NUM_SPLITS == 1``) the normalized row is the
    answer, so 1 writes it to ``Out`` (rows ``seq · so_s + q_head · so_h``) as it is (rotated
    space, or an unrotated loader) and 2 unrotates it first as ``o_w ⊙ H o`` (``H`` of order
    ``2^OROT_LOG2 = D_PAD``; the row goes through ``part_o``, a CTA barrier, then
    :func:`hadamard_rows`) — no reduce launch.

    ``MIN_SPLIT_TILES`` > 0: a sequence of ``n`` tiles uses only ``min(NUM_SPLITS,
    max(1, ⌈n / MIN_SPLIT_TILES⌉))`` of its splits (the rest run no tile and write an empty
    partial, LSE −inf): short sequences are not cut into one or two tiles per CTA while long
    ones keep every split — decided per sequence on the device, so the grid stays static
    under CUDA graphs. With an ``EPILOGUE`` too, a sequence that uses one split is written
    final by its split 0 (:func:`_store_final`), which marks the partial row's LSE +inf so
    that ``_decode_reduce_kernel`` (``SKIP_FINAL``) leaves it alone."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < G
    qh = kvh * G + offs_h
    L = tl.load(seq_lens + seq)
    start = 0
    if window > 0:
        start = tl.maximum(L - window, 0)
    t0 = start // BLOCK_N
    # positions at or past the block table's capacity are masked (``_fetch_kv``): the loop
    # stops there, so a seq_lens entry far past it (broken metadata, up to 2³¹ − 1) costs no
    # tiles — and no int32 overflow in ``cdiv`` — instead of minutes of masked ones
    cap = max_blocks * BLOCK_SIZE
    t1 = tl.cdiv(tl.minimum(L, cap), BLOCK_N)
    if MIN_SPLIT_TILES > 0:   # length-aware: only the splits this sequence's tiles fill
        used = tl.minimum(tl.maximum(tl.cdiv(t1 - t0, MIN_SPLIT_TILES), 1), NUM_SPLITS)
        per = tl.cdiv(t1 - t0, used)
    else:
        per = tl.cdiv(t1 - t0, NUM_SPLITS)
    my0 = t0 + split * per
    my1 = tl.minimum(my0 + per, t1)
    bt_row = block_table + seq.to(tl.int64) * s_bt
    # PREFETCH: software pipeline — the K/V bytes of tile t+1 are fetched while tile t is
    # computed (costs the registers of one raw tile pair); the first tile's fetch is issued
    # before the query is loaded (and, QROT_LOG2, rotated)
    if PREFETCH:
        mask_n, rk, ks, rv, vs = _fetch_kv(
            my0, my1, L, start, cap, bt_row, num_blocks, kvh, k_base, k_aux, k_table, k_sb,
            k_sh, k_st, v_base, v_aux, v_table, v_sb, v_sh, v_st, FETCH, KP0, KP1, KP2, KP3,
            KNP, VP0, VP1, VP2, VP3, VNP, BLOCK_SIZE, BLOCK_N, D_PAD)
    if QROT_LOG2 > 0:
        rot_rows = (seq.to(tl.int64) * (G * tl.num_programs(1)) + qh) * D_PAD
        hadamard_rows(Q, seq.to(tl.int64) * sq_s + qh * sq_h, hmask, q_w, q_rot, rot_rows,
                      BLOCK_H, D_PAD, QROT_LOG2)
        tl.debug_barrier()
        q = load_planes(q_rot, rot_rows, hmask, KNP, D_PAD, HEAD_DIM, DOT_DTYPE)
    else:
        q = load_planes(Q, seq.to(tl.int64) * sq_s + qh * sq_h, hmask, KNP, D_PAD, HEAD_DIM,
                        DOT_DTYPE)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = zero_planes(BLOCK_H, VNP, D_PAD)
    if K_SINK:   # the flagged keys' score term, once per CTA (log2 units)
        qd = planes_dot(q, load_shift(k_shift, kvh, KNP, D_PAD, HEAD_DIM), KNP) * scale_log2
    if V_SINK:
        m_f = tl.zeros([BLOCK_H], tl.float32)
    for t in range(my0, my1):
        if PREFETCH:
            mask_nx, rkx, ksx, rvx, vsx = _fetch_kv(
                t + 1, my1, L, start, cap, bt_row, num_blocks, kvh, k_base, k_aux, k_table,
                k_sb, k_sh, k_st, v_base, v_aux, v_table, v_sb, v_sh, v_st, FETCH, KP0, KP1,
                KP2, KP3, KNP, VP0, VP1, VP2, VP3, VNP, BLOCK_SIZE, BLOCK_N, D_PAD)
        else:
            mask_n, rk, ks, rv, vs = _fetch_kv(
                t, my1, L, start, cap, bt_row, num_blocks, kvh, k_base, k_aux, k_table,
                k_sb, k_sh, k_st, v_base, v_aux, v_table, v_sb, v_sh, v_st, FETCH, KP0, KP1,
                KP2, KP3, KNP, VP0, VP1, VP2, VP3, VNP, BLOCK_SIZE, BLOCK_N, D_PAD)
        k = DEQUANT(rk, k_table, KP0, KP1, KP2, KP3, KNP, D_PAD, DOT_DTYPE)
        kscale = ks
        if K_SINK:
            kscale, kflag = split_flag(ks)
        if SWAP_QK:   # K as the A operand (see TkvLoader.k_operand_a)
            s = tl.trans(scores_t(q, k, KNP)) * (kscale * scale_log2)[None, :]
        else:
            s = scores(q, k, KNP) * (kscale * scale_log2)[None, :]
        if K_SINK:
            s += tl.where(kflag[None, :], qd[:, None], 0.0)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = DEQUANT(rv, v_table, VP0, VP1, VP2, VP3, VNP, D_PAD, DOT_DTYPE)
        vscale = vs
        if V_SINK:
            vscale, vflag = split_flag(vs)
            m_f = m_f * alpha + tl.sum(tl.where(vflag[None, :], p, 0.0), axis=1)
        acc = accumulate(acc, alpha, (p * vscale[None, :]).to(DOT_DTYPE), v, VNP)
        m_i = m_new
        if PREFETCH:
            mask_n, rk, ks, rv, vs = mask_nx, rkx, ksx, rvx, vsx
    if V_SINK:
        acc = add_shift(acc, m_f, load_shift(v_shift, kvh, VNP, D_PAD, HEAD_DIM), VNP)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    # a length past the block table's capacity is broken metadata: NaN rows (the reduce's
    # weighted sum keeps them NaN), never attention over a context cut at the table's end
    inv = tl.where(cap < L, float("nan"), inv)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    row = (seq.to(tl.int64) * (G * tl.num_programs(1)) + qh) * NUM_SPLITS + split
    out_rows = seq.to(tl.int64) * so_s + qh * so_h
    if EPILOGUE > 0 and NUM_SPLITS == 1:
        _store_final(acc, inv, Out, out_rows, part_o, row, hmask, o_w, EPILOGUE, VNP, D_PAD,
                     HEAD_DIM, BLOCK_H, OROT_LOG2)
    elif EPILOGUE > 0 and MIN_SPLIT_TILES > 0:
        # length-aware: a sequence that uses one split is final here; its split 0 marks the
        # row done (LSE +inf) for the reduce, its other splits write nothing
        if used == 1:
            if split == 0:
                _store_final(acc, inv, Out, out_rows, part_o, row, hmask, o_w, EPILOGUE, VNP,
                             D_PAD, HEAD_DIM, BLOCK_H, OROT_LOG2)
                tl.store(part_lse + row, tl.full([BLOCK_H], float("inf"), tl.float32),
                         mask=hmask)
        else:
            _store_partial(acc, inv, lse, part_o, part_lse, row, hmask, VNP, D_PAD)
    else:
        _store_partial(acc, inv, lse, part_o, part_lse, row, hmask, VNP, D_PAD)


@triton.jit
def _store_partial(acc, inv, lse, part_o, part_lse, row, hmask, VNP: tl.constexpr,
                   D_PAD: tl.constexpr):
    """A split's normalized partial row (``part_o``, natural coordinate order) and its LSE
    (``part_lse``) for ``_decode_reduce_kernel``."""
    store_planes(part_o, row * D_PAD, hmask, acc, inv, VNP, D_PAD, D_PAD)
    tl.store(part_lse + row, lse, mask=hmask)


@triton.jit
def _store_final(acc, inv, Out, out_rows, part_o, row, hmask, o_w, EPILOGUE: tl.constexpr,
                 VNP: tl.constexpr, D_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_H: tl.constexpr, OROT_LOG2: tl.constexpr):
    """A split's normalized row as the layer output (rows ``Out + out_rows``): as it is
    (EPILOGUE 1) or unrotated as ``o_w ⊙ H o`` (EPILOGUE 2: through its ``part_o`` row, a CTA
    barrier and :func:`hadamard_rows`)."""
    if EPILOGUE == 1:
        store_planes(Out, out_rows, hmask, acc, inv, VNP, D_PAD, HEAD_DIM)
    else:
        store_planes(part_o, row * D_PAD, hmask, acc, inv, VNP, D_PAD, D_PAD)
        tl.debug_barrier()
        hadamard_rows(part_o, row * D_PAD, hmask, o_w, Out, out_rows, BLOCK_H, D_PAD,
                      OROT_LOG2, POST=True)


# num_rows = num_seqs · num_q_heads changes with every eager batch (mixed prefill + decode
# steps): no specialization on its value (see prefill._VARYING_INTS); it only masks rows.
@triton.jit(do_not_specialize=["num_rows"])
def _decode_reduce_kernel(part_o, part_lse, Out, so_s, so_h, U, num_rows,
                          HQ: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
                          D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, KC: tl.constexpr,
                          SPLIT_UNROLL: tl.constexpr, UNROTATE: tl.constexpr,
                          SKIP_FINAL: tl.constexpr):
    """LSE merge of the split-K partials of ``BLOCK_R`` (sequence, query head) rows, then
    (UNROTATE) ``out = merged @ U`` as tf32x3 tensor-core passes over KC-row slabs of U (the
    merged row is kept as KC-column slabs, so no [BLOCK_R, D] tf32x3 operand sits in
    registers): U is read once per BLOCK_R rows — all heads of several sequences — not once
    per KV head. The LSEs of all splits are one [BLOCK_R, NUM_SPLITS] load; the partial rows
    are read ``SPLIT_UNROLL`` splits at a time (an unrolled group, all its loads in flight
    together), so the dependent chain is NUM_SPLITS / SPLIT_UNROLL loads long — at one
    sequence and 32 splits the chain, not the bytes, is what the merge costs. ``SKIP_FINAL``:
    rows whose first split's LSE is +inf were written final by the split kernel
    (length-aware split-K, one split used) and are neither read nor written here."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)      # row = seq · HQ + q head
    rmask = r < num_rows
    base = r.to(tl.int64) * NUM_SPLITS
    lse = tl.load(part_lse + base[:, None] + tl.arange(0, NUM_SPLITS)[None, :],
                  mask=rmask[:, None], other=float("-inf"))
    if SKIP_FINAL:   # split 0 always writes its LSE; the other splits of a final row do not
        first = tl.load(part_lse + base, mask=rmask, other=float("-inf"))
        rmask = rmask & (first != float("inf"))
        lse = tl.where(rmask[:, None], lse, float("-inf"))
    m = tl.max(lse, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.sum(tl.exp2(lse - m_safe[:, None]), axis=1)
    # merge: SPLIT_UNROLL splits per step, each split's row read as D_PAD/KC slabs; the
    # merged row stays as a tuple of slabs
    NC: tl.constexpr = D_PAD // KC
    slabs = ()
    for c in tl.static_range(NC):
        slabs = slabs + (tl.zeros([BLOCK_R, KC], tl.float32),)
    for s0 in range(0, NUM_SPLITS, SPLIT_UNROLL):
        for u in tl.static_range(SPLIT_UNROLL):
            s = s0 + u
            w = tl.exp2(tl.load(part_lse + base + s, mask=rmask, other=float("-inf")) - m_safe)
            row = part_o + (base + s)[:, None] * D_PAD
            merged = ()
            for c in tl.static_range(NC):
                o = tl.load(row + (c * KC + tl.arange(0, KC))[None, :], mask=rmask[:, None],
                            other=0.0)
                merged = merged + (slabs[c] + w[:, None] * o,)
            slabs = merged
    inv = 1.0 / tl.where(den > 0, den, 1.0)
    optr = Out + (r // HQ).to(tl.int64)[:, None] * so_s + (r % HQ)[:, None] * so_h
    offs_d = tl.arange(0, D_PAD)
    acc = tl.zeros([BLOCK_R, D_PAD], tl.float32)
    for c in tl.static_range(NC):
        kc = c * KC + tl.arange(0, KC)
        a = slabs[c] * inv[:, None]
        if UNROTATE:
            u = tl.load(U + kc[:, None] * D_PAD + offs_d[None, :])
            acc = tl.dot(a, u, acc, input_precision="tf32x3")
        else:
            tl.store(optr + kc[None, :], a.to(Out.dtype.element_ty),
                     mask=rmask[:, None] & (kc < HEAD_DIM)[None, :])
    if UNROTATE:
        tl.store(optr + offs_d[None, :], acc.to(Out.dtype.element_ty),
                 mask=rmask[:, None] & (offs_d < HEAD_DIM)[None, :])


def _single_split_epilogue(loader, splits: int, unrotate: bool, d: int, d_pad: int,
                           dev: torch.device, enabled: bool,
                           min_split_tiles: int = 0) -> tuple[int, torch.Tensor | None, int]:
    """``(EPILOGUE, o_w, OROT_LOG2)`` of the split kernel (see ``_decode_split_kernel``).

    With one split — the grid's, or (``min_split_tiles`` > 0) a sequence's own — and
    ``enabled``, the split kernel writes the layer output itself: as it is (1) when no
    unrotation is due, or unrotated by ``loader.out_hadamard`` butterflies (2) when the
    rotation is a power-of-two Hadamard (``head_dim == d_pad``); otherwise (0) the partials go
    through ``_decode_reduce_kernel`` (its tf32x3 ``out_mat`` product).

    Raises:
        DeviceMismatchError: ``loader.out_hadamard`` is not on the query's device.
        ShapeError: ``loader.out_hadamard`` is not float32 ``(head_dim,)``.
    """
    if not enabled or (splits != 1 and not min_split_tiles):
        return 0, None, 0
    if not unrotate:
        return 1, None, 0
    w = getattr(loader, "out_hadamard", None)
    if w is None or d != d_pad:
        return 0, None, 0
    if w.device != dev:
        raise DeviceMismatchError(f"loader.out_hadamard is on {w.device}, the query on {dev}")
    if tuple(w.shape) != (d,) or w.dtype != torch.float32:
        raise ShapeError(f"loader.out_hadamard {tuple(w.shape)} {w.dtype}: the single-split "
                         f"unrotation needs float32 ({d},)")
    return 2, w, d.bit_length() - 1


def _split_unroll(splits: int, d_pad: int) -> int:
    """Splits merged per unrolled step of the reduce kernel (their loads in flight together):
    8 partial rows of 16 × 128 float32 = 64 registers per thread at 8 warps; 4 at head_dim
    256."""
    return min(splits, 8 if d_pad <= 128 else 4)

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def decode(query: torch.Tensor, cache, block_table: torch.Tensor, seq_lens: torch.Tensor,
           loader: Loader, workspace: Workspace, *, out: torch.Tensor | None = None,
           sm_scale: float | None = None, window: int = 0, query_rotated: bool = False,
           output_rotated: bool = False, num_splits: int | None = None,
           block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
           prefetch: bool = False, swap_qk: bool | None = None,
           maxnreg: int | None = None, kernel: str | None = None,
           fused_query_rotation: bool | None = None,
           single_split_epilogue: bool = True,
           min_split_tiles: int | None = None, schedule: str | None = None) -> torch.Tensor:
    """Paged decode attention, one query token per sequence, reading the cache through
    ``loader`` with inline dequant (split-K over the sequence, LSE merge of the splits).

    GQA: the ``num_q_heads / num_kv_heads`` query heads sharing a KV head are the M dimension
    of the tensor-core dots, so each cache byte is read once per KV head. Scores use the
    per-token ``row_scale`` (tkv: the norm) once per token; so does P (for V).
    CUDA-graph safe: no host sync; grid = ``(num_seqs, num_kv_heads, splits)`` where splits
    depends only on ``num_seqs`` and ``num_kv_heads`` (:meth:`Workspace.splits_for`; the CUDA
    kernel's :meth:`Workspace.cuda_splits_for`); scratch from ``workspace``.

    Args:
        query: ``(num_seqs, num_q_heads, head_dim)`` float16/bfloat16 in model space (or, with
            ``query_rotated=True`` and a rotated loader, already ``loader.q_in``-rotated, any
            float dtype). Unit stride on head_dim.
        cache: the layer's cache in the loader's format (tkv: uint8 ``(num_blocks,
            page_bytes)``; bypass/fp8: ``(k_cache, v_cache)``).
        block_table: int32 ``(num_seqs, max_blocks_per_seq)``; entries past a sequence's last
            block are never read.
        seq_lens: int32 ``(num_seqs,)`` tokens in the cache per sequence (the new token
            included); 0 gives a zero output. A length past the block table's capacity
            (``max_blocks_per_seq · block_size``) is broken metadata: that sequence's rows are
            NaN, and the launch neither reads outside the table nor runs its masked tiles.
        loader: :class:`TkvLoader`, :class:`BypassLoader`, :class:`Fp8Loader` or any Loader.
        workspace: the shared :class:`Workspace`.
        out: optional ``(num_seqs, num_q_heads, head_dim)`` output (query dtype by default):
            float16 / bfloat16 / float32, unit stride on head_dim, no expanded (stride-0)
            dim (ShapeError / DtypeError otherwise).
        sm_scale: softmax scale (default ``1/sqrt(head_dim)``).
        window: sliding window in tokens (attend to the last ``window`` tokens; 0 = full).
        query_rotated: the query is already in the loader's rotated space.
        output_rotated: leave the output in rotated space (fold ``loader.out_mat`` into
            o_proj) instead of unrotating it.
        num_splits: override the split-K count (power of two ≤ workspace.max_splits). The
            workspace's partial rows are sized for its own rule (:meth:`Workspace.splits_for`),
            so more splits than that rule gives a batch of this size can raise
            WorkspaceTooSmallError (e.g. forcing 2 splits on a batch the rule runs in one).
        block_n, num_warps, num_stages: tile length (tokens; default the loader's
            ``preferred_block_n`` (else 64) for head_dim ≤ 128, 32 above) and Triton launch
            options. ``num_stages`` > 1 lets Triton's pipeliner issue the next tiles' loads
            ahead (``cp.async``); it stages codebook gathers through shared memory, which
            measured slower. None (default): the loader's ``decode_num_stages`` for this grid
            and launch if it has one (TkvLoader: 2 with prmti at head_dim 128, 128-token
            tiles and 4 warps on grids under ``workspace.target_programs`` CTAs;
            ``TKV_DECODE_PIPELINE=0`` turns it off), else 1.
        maxnreg: cap on the split kernel's registers per thread (Triton's ``maxnreg``):
            fewer registers, more CTAs per SM, possibly spills (prmti at 4 warps: 168 → 128
            registers = 3 → 4 CTAs per SM with 76 B of spills, offline sm_90a). None (default):
            the loader's ``decode_maxnreg`` for this grid if it has one (TkvLoader: the
            operator's ``TKV_PRMTI_MAXNREG`` with prmti on grids of ≥
            ``workspace.target_programs`` CTAs, no cap by default), else the compiler's
            choice; 0: the compiler's choice.
        swap_qk: compute scores as ``K · q^T`` (K tiles as the tensor-core A operand)
            instead of ``q · K^T``; default: the loader's ``k_operand_a(dot_dtype)`` if it
            has one (TkvLoader with ``lookup="prmt1"``), else False. Same result.
        kernel: the split kernel. ``"cuda"``: the hand-written CUDA kernel
            (:mod:`tkv.kernels.cuda_decode`; K4V4 with the byte-table lookups, head_dim 64 /
            128 / 256, ≤ 8 query heads per KV head, block_size a multiple of 16, sink offsets
            or not; its own split rule, :meth:`Workspace.cuda_splits_for`; 1.5-1.8× the
            Triton kernel at B=32, L=8K on an H100). ``"triton"``: the Triton kernel (every
            loader and width). ``"auto"``: the CUDA kernel where it can serve the call and
            none of the Triton-only options (``block_n``, ``num_warps``, ``num_stages``,
            ``prefetch``, ``swap_qk``, ``maxnreg``, ``min_split_tiles``) is given, else
            Triton. ``"gluon"``: the experimental one-warp Gluon kernel
            (:mod:`tkv.kernels.gluon_decode`; K4V4 with ``lookup="prmt"``, bf16; 0.78× the
            Triton kernel, session 11). None (default): ``TKV_DECODE_KERNEL`` (default
            ``auto``). ``"cuda"`` and ``"gluon"`` raise
            :class:`~tkv.kernels._util.UnsupportedKernelError` on calls outside their scope.
            Same result (to bf16 rounding of the operands).
        prefetch: fetch tile ``t+1``'s bytes while tile ``t`` is computed (software
            pipeline). Off by default: on the H200 it helped 32-token tiles (0.46 vs 0.49 ms)
            but not the faster 128-token ones (0.44 vs 0.38 ms), K4V4 B=32 L=8K.
        fused_query_rotation: rotate the model-space query inside the split kernel (each
            program: its query heads times ``loader.q_hadamard``, then log2(head_dim)
            Walsh–Hadamard butterfly stages in float32 registers) instead of one
            ``rotate_rows`` launch before it: one dependent launch and the rotated-query
            round trip through the workspace less per decode call. Only where the rotation
            is a power-of-two Hadamard (``loader.q_hadamard`` not None), the Triton or CUDA
            kernel and an unrotated query; otherwise the separate rotation runs. None (default):
            the loader's ``fused_query_rotation`` (TkvLoader: True unless constructed with
            False; the engines: ``TKV_FUSED_QUERY_ROTATION``, default 1).
        single_split_epilogue: with one split (``num_splits=1``, or ``Workspace.splits_for``
            on full grids with ``TKV_DECODE_SINGLE_SPLIT=1``) the split kernel normalizes its
            row and writes ``out`` itself — unrotated by Walsh–Hadamard butterflies
            (``loader.out_hadamard``) where the rotation is a power-of-two Hadamard — so the
            reduce launch and the partials' round trip are skipped; the CUDA kernel with
            several splits (up to :data:`cuda_decode.MERGE_MAX_SPLITS`) merges them itself, in
            the split that finishes last (:data:`cuda_decode.MERGE_SPLITS`, default True; the
            partials then stay in the L2), so it needs no reduce launch either. False: always
            the reduce pass (an A/B knob; same result to float32 rounding). The Gluon kernel
            always uses the reduce pass.
        min_split_tiles: length-aware split-K — each sequence uses only
            ``min(splits, max(1, ⌈tiles / min_split_tiles⌉))`` of the grid's splits (tiles of
            ``block_n`` tokens inside its window), decided on the device; the others stay
            empty; with ``single_split_epilogue`` a sequence that uses one split is written
            final by the split kernel (the reduce pass skips its rows). 0: every split gets
            ``⌈tiles / splits⌉`` tiles (the default). None (default):
            ``workspace.min_split_tiles`` (the engines: ``TKV_DECODE_MIN_SPLIT_TILES``,
            default 0). Triton kernel only.
        schedule: the CUDA kernel's work schedule. ``"split"``: grid (sequences, KV heads,
            splits), each sequence cut into ``num_splits`` equal splits (a long sequence among
            short ones keeps its CTAs busy after the rest are done); ``"balanced"``: one grid
            of as many CTAs as the GPU holds, the batch's (sequence, KV head) pairs laid end to
            end and cut into equal shares of 16-token steps, the pairs cut across CTAs merged
            in the kernel (stream-K; no reduce launch; :func:`cuda_decode.launch_balanced`) —
            used where the kernel writes the output itself (``single_split_epilogue``) and no
            ``num_splits`` is given. None (default): :data:`cuda_decode.DECODE_SCHEDULE`.

    Returns:
        ``out``. Raises DtypeError / ShapeError / DeviceMismatchError /
        WorkspaceTooSmallError on malformed inputs (host-side checks only; ShapeError also
        for a ``window``, ``num_splits`` (an int power of two), ``num_warps`` (power of two
        ≤ 16), ``num_stages`` or ``min_split_tiles`` out of range; DtypeError for a bool
        option that is not a bool), NonFiniteError for a NaN / inf ``sm_scale``, TypeError
        for a ``loader`` / ``workspace`` of the wrong type, ValueError for an unknown
        ``kernel`` or ``schedule``. A ``TKV_*`` setting refused at import (its named error, e.g.
        MaxnregConfigError).
    """
    check_import_settings()
    check_loader(loader)
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a tkv.kernels.Workspace, got "
                        f"{type(workspace).__name__}")
    for name, flag in (("query_rotated", query_rotated), ("output_rotated", output_rotated),
                       ("prefetch", prefetch)):
        check_flag(flag, name)
    if swap_qk is not None:
        check_flag(swap_qk, "swap_qk")
    check_pow2(num_warps, "num_warps", 1, 16)
    check_tensor(query, "query", 3)
    ns, hq, d = query.shape
    hkv = loader.num_kv_heads
    if d != loader.head_dim:
        raise ShapeError(f"query head_dim {d} ≠ loader head_dim {loader.head_dim}")
    if hq % hkv:
        raise ShapeError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if query_rotated and loader.rotated:
        check_dtype(query, "query", (torch.float16, torch.bfloat16, torch.float32))
    else:
        check_dtype(query, "query", (torch.float16, torch.bfloat16))
    check_last_dim_contiguous(query, "query")
    num_blocks = loader.check_cache(cache)
    check_int_tensor(block_table, "block_table", torch.int32, 2)
    check_int_tensor(seq_lens, "seq_lens", torch.int32, 1)
    if block_table.shape[0] != ns or seq_lens.shape[0] != ns:
        raise ShapeError(f"block_table {tuple(block_table.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match num_seqs={ns}")
    if block_table.stride(1) != 1:
        raise ShapeError("block_table must have unit stride on its last dim")
    dev = query.device
    dot_dtype = dot_dtype_for(query.dtype)
    if kernel is None:
        kernel = cuda_decode.DECODE_KERNEL
    if kernel not in ("auto", "triton", "gluon", "cuda"):
        raise ValueError(f"kernel must be 'auto', 'triton', 'gluon' or 'cuda', got {kernel!r}")
    if schedule is None:
        schedule = cuda_decode.DECODE_SCHEDULE
    if schedule not in cuda_decode.SCHEDULES:
        raise ValueError(f"schedule must be one of {cuda_decode.SCHEDULES}, got {schedule!r}")
    if kernel == "auto":   # the CUDA kernel unless it cannot serve the call or a Triton option
        triton_only = (block_n is not None or num_warps != 4 or num_stages is not None
                       or prefetch or swap_qk is not None or maxnreg is not None
                       or bool(min_split_tiles) or bool(workspace.min_split_tiles))
        kernel = "cuda" if not triton_only and cuda_decode.cache_aligned(cache) and \
            cuda_decode.supported(loader, dev, d, hq // hkv, dot_dtype) else "triton"
        auto_cuda = kernel == "cuda"
    else:
        auto_cuda = False
    if kernel == "gluon":
        gluon_decode.check_supported(loader, dev, d, hq // hkv, dot_dtype)
    elif kernel == "cuda" and not auto_cuda:   # auto already tested it (supported())
        cuda_decode.check_supported(loader, dev, d, hq // hkv, dot_dtype)
    kargs = loader.side_args(cache, "k", dot_dtype)
    vargs = loader.side_args(cache, "v", dot_dtype)
    check_same_device(dev, block_table=block_table, seq_lens=seq_lens, cache_k=kargs[0],
                      cache_v=vargs[0], workspace=workspace._part_lse)
    check_side_args_device(dev, kargs, vargs)
    scale = check_sm_scale(sm_scale, d)
    if window is None:
        window = 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ShapeError(f"window must be an int ≥ 0 (0 = full attention), got {window!r}")
    if out is None:
        out_dtype = query.dtype if query.dtype != torch.float32 else torch.bfloat16
        out = torch.empty(ns, hq, d, dtype=out_dtype, device=dev)
    else:
        check_out(out, (ns, hq, d), dev)
    if num_stages is not None:
        check_positive_int(num_stages, "num_stages")
    check_flag(single_split_epilogue, "single_split_epilogue")
    min_split_tiles = check_min_split_tiles(
        workspace.min_split_tiles if min_split_tiles is None else min_split_tiles)
    if ns == 0:
        return out
    d_pad = max(16, next_pow2(d))
    g = hq // hkv
    block_h = max(16, next_pow2(g))
    if num_splits is not None:
        splits = check_pow2(num_splits, "num_splits", 1, workspace.max_splits)
    elif kernel == "cuda":
        splits = workspace.cuda_splits_for(
            ns, hkv, cuda_decode.resident_ctas(loader, d, hq // hkv, dot_dtype, dev))
    else:
        splits = workspace.splits_for(ns, hkv)
    part_o, part_lse = workspace.partials(ns, hq, splits, d_pad)
    q = query
    br = row_block(ns * hq, d_pad)   # (sequence, head) rows per reduce program
    # in-kernel query rotation: weights, its output rows, butterfly stages
    q_w, q_rot, qrot_log2 = part_lse, part_lse, 0
    if loader.rotated and not query_rotated:
        hw = getattr(loader, "q_hadamard", None)
        if fused_query_rotation is None:
            fused_query_rotation = getattr(loader, "fused_query_rotation", False)
        check_flag(fused_query_rotation, "fused_query_rotation")   # "0" would read as True
        if fused_query_rotation and kernel in ("triton", "cuda") and hw is not None:
            if hw.device != dev:
                raise DeviceMismatchError(f"loader.q_hadamard is on {hw.device}, the query on "
                                          f"{dev}")
            if d != d_pad or tuple(hw.shape) != (d,):
                raise ShapeError(f"loader.q_hadamard {tuple(hw.shape)}: the in-kernel query "
                                 f"rotation needs ({d},) and a power-of-two head_dim ≥ 16")
            q_w, qrot_log2 = hw, d.bit_length() - 1
            q_rot = workspace.rotated_queries(ns, hq, d)
        else:
            q = rotate_rows(query, loader.q_in[:d, :d], workspace.rotated_queries(ns, hq, d))
    if kernel == "gluon" and block_n is None:
        block_n = 32   # one warp: 64-token tiles spill at head_dim 128 (ptxas sm_90a)
    block_n = tile_tokens(block_n, d, loader.min_block_n,
                          small_head=getattr(loader, "preferred_block_n", 64))
    if swap_qk is None:
        swap_qk = bool(getattr(loader, "k_operand_a", lambda _: False)(dot_dtype))
    k_shift, k_sink = sink_shift(loader, "k", part_lse)
    v_shift, v_sink = sink_shift(loader, "v", part_lse)
    if maxnreg is None and not interpreting():
        maxnreg = getattr(loader, "decode_maxnreg", lambda *_: None)(
            ns * hkv * splits, workspace.target_programs, dot_dtype)
    if num_stages is None:
        rule = getattr(loader, "decode_num_stages", None)
        num_stages = 1 if interpreting() or rule is None else rule(
            ns * hkv * splits, workspace.target_programs, dot_dtype, block_n=block_n,
            num_warps=num_warps)
    unrotate = bool(loader.rotated and not output_rotated)
    epilogue, o_w, orot_log2 = _single_split_epilogue(
        loader, splits, unrotate, d, d_pad, dev,
        single_split_epilogue and kernel in ("triton", "cuda"),
        min_split_tiles if kernel == "triton" else 0)
    if kernel == "cuda":
        # the epilogue the kernel writes the output with, whatever the split count: the
        # balanced schedule's, and the split schedule's (several splits merged in the kernel)
        one_epilogue, one_o_w, _ = _single_split_epilogue(
            loader, 1, unrotate, d, d_pad, dev, single_split_epilogue)
        bal_epilogue = one_epilogue if schedule == "balanced" and num_splits is None else 0
        split_epilogue = one_epilogue if splits == 1 or (
            cuda_decode.MERGE_SPLITS and splits <= cuda_decode.MERGE_MAX_SPLITS) else 0
        try:
            if bal_epilogue:
                cuda_decode.launch_balanced(
                    q, block_table, seq_lens, num_blocks, cache, loader, workspace,
                    scale * _LOG2E, window, group=g, dot_dtype=dot_dtype, out=out,
                    epilogue=bal_epilogue, q_w=q_w if qrot_log2 else None, o_w=one_o_w)
                return out
            cuda_decode.launch_split(
                q, block_table, seq_lens, num_blocks, cache, loader, part_o, part_lse,
                scale * _LOG2E, window, group=g, splits=splits, dot_dtype=dot_dtype,
                q_w=q_w if qrot_log2 else None, epilogue=split_epilogue, out=out,
                o_w=one_o_w,
                counters=workspace.counters(ns * hkv) if split_epilogue and splits > 1 else None)
            if split_epilogue:
                return out
        except CudaCompileError as e:
            if not auto_cuda:
                raise
            # auto: the Triton kernel, same splits and epilogue
            _nvrtc.warn_fallback("decode split kernel", "TKV_DECODE_KERNEL", e)
            kernel = "triton"
    if kernel == "gluon":
        gluon_decode.launch_split(
            q, block_table, seq_lens, num_blocks, kargs, vargs, part_o, part_lse,
            scale * _LOG2E, window, num_kv_heads=hkv, group=g, head_dim=d,
            block_size=loader.block_size, splits=splits, block_n=block_n)
    elif kernel == "triton":
        _decode_split_kernel[(ns, hkv, splits)](
            q, q.stride(0), q.stride(1), block_table, block_table.stride(0), seq_lens,
            block_table.shape[1], num_blocks, *kargs[:6], *vargs[:6], part_o, part_lse,
            scale * _LOG2E, window, k_shift, v_shift, q_w, q_rot,
            # the output only where the split kernel writes it: the reduce path's compile key
            # stays independent of out's dtype and strides
            *((out, out.stride(0), out.stride(1)) if epilogue else (part_lse, 0, 0)),
            part_lse if o_w is None else o_w,
            FETCH=loader.fetch, DEQUANT=loader.dequant, KP0=kargs[6], KP1=kargs[7],
            KP2=kargs[8], KP3=kargs[9], KNP=kargs[10], VP0=vargs[6], VP1=vargs[7],
            VP2=vargs[8], VP3=vargs[9], VNP=vargs[10], G=g, BLOCK_H=block_h, HEAD_DIM=d,
            D_PAD=d_pad, BLOCK_SIZE=loader.block_size, BLOCK_N=block_n, NUM_SPLITS=splits,
            DOT_DTYPE=_TL[dot_dtype], PREFETCH=prefetch, SWAP_QK=bool(swap_qk),
            K_SINK=k_sink, V_SINK=v_sink, QROT_LOG2=qrot_log2, EPILOGUE=epilogue,
            OROT_LOG2=orot_log2, MIN_SPLIT_TILES=0 if splits == 1 else min_split_tiles,
            num_warps=num_warps, num_stages=num_stages,
            **({"maxnreg": int(maxnreg)} if maxnreg else {}))
    if epilogue and splits == 1:
        return out
    u = loader.out_mat if unrotate else part_lse
    _decode_reduce_kernel[(triton.cdiv(ns * hq, br),)](
        part_o, part_lse, out, out.stride(0), out.stride(1), u, ns * hq,
        HQ=hq, BLOCK_R=br, HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=splits, KC=slab(d_pad),
        SPLIT_UNROLL=_split_unroll(splits, d_pad), UNROTATE=unrotate,
        SKIP_FINAL=bool(epilogue and min_split_tiles), num_warps=8)
    return out
