"""Varlen causal chunked prefill: prefix from the paged cache (inline dequant through the
loader) + the current chunk from the uncompressed new K/V, flash-attention tiling."""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from tkv.codec.errors import DtypeError, ShapeError

from ._planes import (
    accumulate,
    add_shift,
    fetch_kv,
    load_planes,
    load_shift,
    planes_dot,
    scores,
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
    check_no_overlap,
    check_out,
    check_positive_int,
    check_pow2,
    check_same_device,
    check_side_args_device,
    check_sm_scale,
    check_tensor,
    dot_dtype_for,
    next_pow2,
    tile_tokens,
)
from .dense_attention import DenseAttention, check_dense_output
from .loaders import Loader, bypass_fetch, check_loader, identity_dequant, sink_shift
from .rotate import rotate_rows, split_bf16

__all__ = ["DENSE_PREFIX_CAP", "dense_prefix_bytes", "prefill", "varlen_prefix_bytes",
           "varlen_prefix_rows"]

# Engines' bound on the decompress-once scratch (bytes, one buffer per device shared by all
# layers): batches whose prefixes need more read them inline.
DENSE_PREFIX_CAP = 512 << 20

_LOG2E = 1.4426950408889634
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _online_update(s, m_i, l_i):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@triton.jit
def _dense_fetch(base, aux, table, blk, off, mask_n, head, stride_block, stride_head,
                 stride_tok, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                 P3: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr):
    """A tile of the dense prefix scratch (:func:`_dequant_prefix_kernel`): rows already
    dequantized, norm applied, in the planar layout — returned as its ``NP`` planes (the
    "raw" value of this fetch), row_scale 1 (0 when masked)."""
    row = blk.to(tl.int64) * stride_block + off.to(tl.int64) * stride_tok + head * stride_head
    planes = load_planes(base, row, mask_n, NP, D_PAD, D_PAD, base.dtype.element_ty, True)
    return planes, tl.where(mask_n, 1.0, 0.0)


@triton.jit
def _dense_planes(raw, table, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                  P3: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr,
                  OUT_DTYPE: tl.constexpr):
    """The planes :func:`_dense_fetch` loaded, in the dot dtype."""
    out = ()
    for p in tl.static_range(NP):
        out = out + (raw[p].to(OUT_DTYPE),)
    return out


# Runtime arguments that change from step to step must not pick a Triton specialization,
# or a step whose values fall in a new class (an int equal to 1 or divisible by 16, a pointer
# 16-byte aligned or not) stalls on a compile — seconds, once per layer width pair, inside a
# serving run — and a warm-up (warm_prefix_variant) cannot cover every later step:
# * engines pass slices of their per-step metadata (e.g. vLLM's seq_lens[num_decodes:]),
#   whose start is aligned or not depending on the batch; both are read once per program;
# * the decompress-once path's block table is built per call: its stride / width
#   (``maxp // block_size``) and page count follow the batch's longest prefix (measured:
#   five compiles, 4 s, in the second of two identical vLLM SmartMix runs at 256 sequences,
#   H200 2026-11-30, session 12); they only index and bound-check the table.
_VARYING_INTS = ["s_bt", "max_blocks", "num_blocks"]


@triton.jit(do_not_specialize=[*_VARYING_INTS, "max_prefix", "row_limit"],
            do_not_specialize_on_alignment=["cu_q", "seq_lens", "ROW0"])
def _dequant_prefix_kernel(
        cu_q, seq_lens, block_table, s_bt, max_blocks, num_blocks,
        k_base, k_aux, k_table, k_sb, k_sh, k_st,
        v_base, v_aux, v_table, v_sb, v_sh, v_st,
        PK, PV, max_prefix, k_shift, v_shift, ROW0, row_limit,
        KB, VB, KW, VW,
        FETCH: tl.constexpr, DEQUANT: tl.constexpr, KP0: tl.constexpr, KP1: tl.constexpr,
        KP2: tl.constexpr, KP3: tl.constexpr, KNP: tl.constexpr, VP0: tl.constexpr,
        VP1: tl.constexpr, VP2: tl.constexpr, VP3: tl.constexpr, VNP: tl.constexpr,
        HKV: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, K_SINK: tl.constexpr,
        V_SINK: tl.constexpr, PACKED: tl.constexpr, MODEL: tl.constexpr = False,
        OPERAND: tl.constexpr = tl.float32, PM1: tl.constexpr = False):
    """Decompress the prefix of sequence ``program_id(1)``, KV head ``program_id(2)``, tokens
    ``[t·BLOCK_N, (t+1)·BLOCK_N)`` into the dense scratch ``PK``/``PV`` (rows
    ``(seq·max_prefix + pos)·HKV + head`` of ``D_PAD`` elements — ``PACKED``: rows
    ``(ROW0[seq] + pos)·HKV + head`` below ``row_limit``, sequences packed back to back as
    varlen attention reads them —, the loader's planar layout, norms applied — what the
    prefix loop of :func:`_prefill_kernel` would compute per tile). ``K_SINK`` / ``V_SINK``:
    a flagged row is written as ``|n|·tile + shift[head]``, so the dense attention that reads
    the rows needs nothing else. ``MODEL`` (the varlen path, session 24): the rows are written
    back in model space instead — ``k = y @ KB``, ``v = y @ VB`` for the planar tile ``y``
    (``KB`` / ``VB``: the loader's ``k_back_planar`` / ``v_back_planar``, bf16 hi/lo halves
    ``(2, D_PAD, D_PAD)``) — keys still centered (``k − μ``: the caller centers the chunk's
    keys the same way), so the attention that reads them takes the model's own query and
    values; needs ``HEAD_DIM == D_PAD``. ``PM1`` (session 26, opt-in): ``KB`` / ``VB`` are
    the maps' exact ±1 factors (bf16 ``(D_PAD, D_PAD)``, ``k_back_pm1`` / ``v_back_pm1``) and
    ``KW`` / ``VW`` their float32 column scales: ``k = (y @ S) · w``."""
    t = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_len = tl.load(cu_q + seq + 1) - tl.load(cu_q + seq)
    prefix = tl.minimum(tl.load(seq_lens + seq) - q_len, max_prefix)
    if PACKED:   # a sequence without new tokens attends nothing: no rows packed for it
        prefix = tl.where(q_len > 0, prefix, 0)
    if t * BLOCK_N >= prefix:
        return
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n, rk, ks, rv, vs = fetch_kv(
        pos, (pos < prefix) & (pos < max_blocks * BLOCK_SIZE),
        block_table + seq.to(tl.int64) * s_bt, num_blocks, kvh, k_base, k_aux, k_table,
        k_sb, k_sh, k_st, v_base, v_aux, v_table, v_sb, v_sh, v_st, FETCH, KP0, KP1, KP2,
        KP3, KNP, VP0, VP1, VP2, VP3, VNP, BLOCK_SIZE, D_PAD)
    if PACKED:
        row = tl.load(ROW0 + seq).to(tl.int64) + pos
        mask_n = mask_n & (row < row_limit)
        rows = (row * HKV + kvh) * D_PAD
    else:
        rows = ((seq.to(tl.int64) * max_prefix + pos) * HKV + kvh) * D_PAD
    k = DEQUANT(rk, k_table, KP0, KP1, KP2, KP3, KNP, D_PAD, tl.float32)
    v = DEQUANT(rv, v_table, VP0, VP1, VP2, VP3, VNP, D_PAD, tl.float32)
    if K_SINK:
        ks, kflag = split_flag(ks)
        k = add_shift(_scaled(k, ks, KNP), tl.where(kflag, 1.0, 0.0),
                      load_shift(k_shift, kvh, KNP, D_PAD, HEAD_DIM), KNP)
        ks = tl.where(mask_n, 1.0, 0.0)
    if V_SINK:
        vs, vflag = split_flag(vs)
        v = add_shift(_scaled(v, vs, VNP), tl.where(vflag, 1.0, 0.0),
                      load_shift(v_shift, kvh, VNP, D_PAD, HEAD_DIM), VNP)
        vs = tl.where(mask_n, 1.0, 0.0)
    if MODEL:
        cols = tl.arange(0, D_PAD)
        km = _unrotated(k, ks, KB, KW, KNP, D_PAD, BLOCK_N, OPERAND, PM1)
        vm = _unrotated(v, vs, VB, VW, VNP, D_PAD, BLOCK_N, OPERAND, PM1)
        ptr = rows[:, None] + cols[None, :]
        tl.store(PK + ptr, km.to(PK.dtype.element_ty), mask=mask_n[:, None])
        tl.store(PV + ptr, vm.to(PV.dtype.element_ty), mask=mask_n[:, None])
    else:
        store_planes(PK, rows, mask_n, k, ks, KNP, D_PAD, HEAD_DIM, True)
        store_planes(PV, rows, mask_n, v, vs, VNP, D_PAD, HEAD_DIM, True)


@triton.jit
def _unrotated(planes, scale, MB, MW, NP: tl.constexpr, D_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, OPERAND: tl.constexpr, PM1: tl.constexpr = False):
    """``Σ_p (planes[p] · scale[:, None]) @ M[rows of plane p]``: ``[BLOCK_N, D_PAD]`` float32
    — a planar tile taken back to model space. ``MB``: bf16 ``(2, D_PAD, D_PAD)``, M's hi and
    lo halves (:func:`~tkv.kernels.loaders._bf16_halves`); the tile is split hi/lo too
    (:func:`~tkv.kernels.rotate.split_bf16`): three
    tensor-core passes per plane (hi·hi + hi·lo + lo·hi, ~2^-16 relative, as
    ``rotate_rows(bf16_split=True)``). ``OPERAND``: the passes' operand dtype, bf16 (float32
    holding the same bf16 values under the interpreter). ``PM1``: ``MB`` is instead M's exact
    ±1 factor ``S`` (bf16 ``(D_PAD, D_PAD)``) and ``MW`` its float32 column scales ``w``
    (``M = S · diag(w)``): two passes per plane (hi·S + lo·S, the same ~2^-16 with S exact),
    half the matrix bytes, then the columns times ``w``."""
    W: tl.constexpr = D_PAD // NP
    j = tl.arange(0, W)
    n = tl.arange(0, D_PAD)
    acc = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for p in tl.static_range(NP):
        at = MB + (p * W + j)[:, None] * D_PAD + n[None, :]
        m_hi = tl.load(at).to(OPERAND)
        x_hi, x_lo = split_bf16(planes[p] * scale[:, None], OPERAND)
        acc = tl.dot(x_hi, m_hi, acc)
        if not PM1:
            acc = tl.dot(x_hi, tl.load(at + D_PAD * D_PAD).to(OPERAND), acc)
        acc = tl.dot(x_lo, m_hi, acc)
    if PM1:
        acc = acc * tl.load(MW + n)[None, :]
    return acc


@triton.jit
def _scaled(planes, scale, NP: tl.constexpr):
    """Each plane times ``scale[:, None]``."""
    out = ()
    for p in tl.static_range(NP):
        out = out + (planes[p] * scale[:, None],)
    return out


@triton.jit(do_not_specialize=[*_VARYING_INTS, "total_q"],
            do_not_specialize_on_alignment=["cu_q", "seq_lens"])
def _prefill_kernel(
        Q, sq_t, sq_h, KN, sk_t, sk_h, VN, sv_t, sv_h, Out, so_t, so_h,
        cu_q, seq_lens, block_table, s_bt, max_blocks, num_blocks, total_q,
        k_base, k_aux, k_table, k_sb, k_sh, k_st,
        v_base, v_aux, v_table, v_sb, v_sh, v_st,
        scale_log2, window, k_shift, v_shift,
        FETCH: tl.constexpr, DEQUANT: tl.constexpr, KP0: tl.constexpr, KP1: tl.constexpr,
        KP2: tl.constexpr, KP3: tl.constexpr, KNP: tl.constexpr, VP0: tl.constexpr,
        VP1: tl.constexpr, VP2: tl.constexpr, VP3: tl.constexpr, VNP: tl.constexpr,
        G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_MT: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, PLANAR: tl.constexpr, NO_PREFIX: tl.constexpr,
        K_SINK: tl.constexpr = False,
        V_SINK: tl.constexpr = False):
    """One (query tile, sequence, KV head). Q/KN/VN/Out live in the loader's space (the wrapper
    rotates them for rotated loaders, in the planar layout: ``PLANAR``); every K/V operand,
    cached or new, is handled as the loader's planes so prefix and chunk share one
    accumulator. ``K_SINK`` / ``V_SINK``: flagged prefix tokens as in decode's split kernel
    (the chunk's own K/V are exact, never flagged). ``total_q``: rows of Q/KN/VN/Out —
    metadata reaching past them (``cu_q[seq + 1] > total_q``) reads and writes only the rows
    that exist, and those of the sequence become NaN (loud, never out of bounds); so do the
    rows of a sequence whose ``seq_lens`` entry is below its ``q_len`` or whose prefix is
    longer than ``max_blocks · BLOCK_SIZE``."""
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q0 = tl.load(cu_q + seq)
    q_end = tl.load(cu_q + seq + 1)
    broken = q_end > total_q
    q_len = tl.minimum(q_end, total_q) - q0
    if (tile * BLOCK_MT >= q_len) | (q0 < 0):
        return
    L = tl.load(seq_lens + seq)
    # a length below the chunk's is broken metadata (NaN rows): checked before ``L − q_len``,
    # which wraps around in int32 for a length near −2³¹ and would read as a huge prefix
    broken = broken | (q_len > L)
    prefix = L - q_len
    cap = max_blocks * BLOCK_SIZE                  # prefix tokens the block table can hold
    # a prefix longer than the block table holds is broken metadata too (NaN rows, as the
    # varlen path's verdict), never a context silently cut at the table's end; on the
    # decompress-once path the caller passes the pages both the real table and the scratch
    # hold, so this also covers a prefix longer than the scratch
    broken = broken | (prefix > cap)
    BLOCK_M: tl.constexpr = BLOCK_MT * G_PAD
    if NO_PREFIX:  # the caller promised first chunks only: fail loudly, never guess
        prefix = tl.where(prefix != 0, -1, prefix)
    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_MT + rows // G_PAD          # chunk-relative query index
    hh = rows % G_PAD
    rmask = (tok < q_len) & (hh < G)
    qh = kvh * G + hh
    q = load_planes(Q, (q0 + tok).to(tl.int64) * sq_t + qh * sq_h, rmask, KNP, D_PAD,
                    HEAD_DIM, DOT_DTYPE, PLANAR)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = zero_planes(BLOCK_M, VNP, D_PAD)
    if K_SINK:   # the flagged prefix keys' score term (log2 units)
        qd = planes_dot(q, load_shift(k_shift, kvh, KNP, D_PAD, HEAD_DIM), KNP) * scale_log2
    if V_SINK:
        m_f = tl.zeros([BLOCK_M], tl.float32)
    qpos = prefix + tok                            # absolute position of each query row
    tile_lo = prefix + tile * BLOCK_MT             # smallest query position of the tile
    # ---- prefix: read (compressed) from the paged cache through the loader
    lo = 0
    if window > 0:
        lo = tl.maximum(tile_lo - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    # tokens at or past the block table's capacity are masked: the loop stops there (a
    # seq_lens entry near 2³¹ would otherwise run ~2³¹ / BLOCK_N masked tiles)
    for n0 in range(lo, tl.minimum(prefix, cap), BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n, rk, ks, rv, vs = fetch_kv(
            pos, (pos < prefix) & (pos < cap),
            block_table + seq.to(tl.int64) * s_bt, num_blocks, kvh, k_base, k_aux, k_table,
            k_sb, k_sh, k_st, v_base, v_aux, v_table, v_sb, v_sh, v_st, FETCH, KP0, KP1, KP2,
            KP3, KNP, VP0, VP1, VP2, VP3, VNP, BLOCK_SIZE, D_PAD)
        k = DEQUANT(rk, k_table, KP0, KP1, KP2, KP3, KNP, D_PAD, DOT_DTYPE)
        if K_SINK:
            ks, kflag = split_flag(ks)
        s = scores(q, k, KNP) * (ks * scale_log2)[None, :]
        if K_SINK:
            s += tl.where(kflag[None, :], qd[:, None], 0.0)
        vis = mask_n[None, :] & (qpos >= 0)[:, None]
        if window > 0:
            vis = vis & ((qpos[:, None] - pos[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
        p, m_i, l_i, alpha = _online_update(s, m_i, l_i)
        v = DEQUANT(rv, v_table, VP0, VP1, VP2, VP3, VNP, D_PAD, DOT_DTYPE)
        if V_SINK:
            vs, vflag = split_flag(vs)
            m_f = m_f * alpha + tl.sum(tl.where(vflag[None, :], p, 0.0), axis=1)
        acc = accumulate(acc, alpha, (p * vs[None, :]).to(DOT_DTYPE), v, VNP)
    if V_SINK:   # the flagged values' shift, before the chunk loop rescales acc
        acc = add_shift(acc, m_f, load_shift(v_shift, kvh, VNP, D_PAD, HEAD_DIM), VNP)
    # ---- current chunk: uncompressed new K/V (same space and planes), causal
    hi = tl.minimum(q_len, (tile + 1) * BLOCK_MT)
    lo2 = 0
    if window > 0:
        lo2 = tl.maximum(tile * BLOCK_MT - window + 1, 0)
    lo2 = (lo2 // BLOCK_N) * BLOCK_N
    for j0 in range(lo2, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = j < q_len
        kv_off = (q0 + j).to(tl.int64)
        k = load_planes(KN, kv_off * sk_t + kvh * sk_h, jm, KNP, D_PAD, HEAD_DIM, DOT_DTYPE,
                        PLANAR)
        s = scores(q, k, KNP) * scale_log2
        vis = jm[None, :] & (j[None, :] <= tok[:, None])
        if window > 0:
            vis = vis & ((tok[:, None] - j[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
        p, m_i, l_i, alpha = _online_update(s, m_i, l_i)
        v = load_planes(VN, kv_off * sv_t + kvh * sv_h, jm, VNP, D_PAD, HEAD_DIM, DOT_DTYPE,
                        PLANAR)
        acc = accumulate(acc, alpha, p.to(DOT_DTYPE), v, VNP)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    inv = tl.where(broken, float("nan"), inv)
    if NO_PREFIX:
        inv = tl.where(prefix < 0, float("nan"), inv)
    store_planes(Out, (q0 + tok).to(tl.int64) * so_t + qh * so_h, rmask, acc, inv, VNP, D_PAD,
                 HEAD_DIM, PLANAR)


def prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
            cache, block_table: torch.Tensor, loader: Loader, *,
            out: torch.Tensor | None = None, sm_scale: float | None = None, window: int = 0,
            block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
            num_stages: int | None = None, no_prefix: bool = False,
            max_prefix_len: int | None = None, scratch: torch.Tensor | None = None,
            exact_prefix: bool = False,
            dense_attention: DenseAttention | None = None,
            prefix_tokens: int | None = None) -> torch.Tensor:
    """Varlen causal attention for (chunked) prefill, flash-attention tiling with tl.dot.

    Sequence ``i`` has ``q_len = cu_seqlens_q[i+1] − cu_seqlens_q[i]`` new tokens at absolute
    positions ``seq_lens[i] − q_len … seq_lens[i] − 1``. Its prefix (``seq_lens[i] − q_len``
    tokens) is read from ``cache`` through ``loader`` with inline dequant (tkv: rotated query,
    values unrotated once after the prefix loop); the chunk itself comes from the
    uncompressed ``key``/``value`` (so a first chunk is plain bf16 flash attention — the
    prefill bypass). GQA: the query heads of a KV head are packed into the M dimension.

    Args:
        query: ``(total_q, num_q_heads, head_dim)`` float16/bfloat16.
        key, value: ``(total_q, num_kv_heads, head_dim)``, same dtype (new tokens, model space).
        cu_seqlens_q: int32 ``(num_seqs + 1,)`` cumulative query lengths, starting at 0,
            ending at ``total_q`` (a sequence reaching past ``total_q`` is not read or
            written out of bounds: its existing rows become NaN).
        seq_lens: int32 ``(num_seqs,)`` total tokens per sequence (prefix + chunk). Broken
            metadata gives NaN rows for that sequence, never a guessed context: a length
            below its ``q_len``, or a prefix longer than the block table holds
            (``max_blocks_per_seq · block_size``; the loop stops there, so a length near 2³¹
            does not stall the launch either).
        max_query_len: host int ≥ every q_len (sizes the grid).
        cache, block_table, loader: as :func:`tkv.kernels.decode` (block_table int32
            ``(num_seqs, max_blocks_per_seq)``).
        out: optional ``(total_q, num_q_heads, head_dim)`` output (query dtype default):
            float16 / bfloat16 / float32, unit stride on head_dim, no expanded (stride-0)
            dim (ShapeError / DtypeError otherwise); must not share memory with ``key`` /
            ``value`` (ShapeError: other programs still read them while ``out`` is written),
            nor with ``query`` when a ``writes_out`` dense_attention writes into it. Rows the
            metadata does not cover (``max_query_len`` below a q_len, ``cu_seqlens_q[-1] <
            total_q``) are not written — NaN when ``out`` is allocated here.
        sm_scale: softmax scale (default ``1/sqrt(head_dim)``).
        window: sliding window (key visible iff ``q_pos − k_pos < window``; 0 = full).
        block_m, block_n, num_warps, num_stages: tiling overrides (defaults by head_dim).
        no_prefix: the caller guarantees ``seq_lens == q_len`` for every sequence (first
            chunks only; engines know it from host-side metadata): the prefill bypass — plain
            attention over the new K/V in model space, no rotation, the cache untouched. A
            sequence that does have a prefix gets NaN output rows (loud, never silent).
        max_prefix_len, scratch: the *decompress-once* path for rotated (tkv) loaders. With a
            host int ``max_prefix_len`` ≥ every sequence's prefix (engines know it from host
            metadata) and a ``scratch`` tensor (any dtype, contiguous, 16-byte aligned) of at
            least :func:`dense_prefix_bytes` bytes for ``max_prefix_len`` rounded up to whole
            pages, every prefix token is dequantized ONCE into ``scratch`` (planar rotated
            rows, norms applied), and the attention loop reads those 16-bit rows instead of
            re-dequantizing each prefix tile for every query tile. Used when a sequence spans
            more than one query tile (``max_query_len`` > the M tile's tokens) and the
            scratch fits; otherwise the inline path runs (it needs no bound). ``max_prefix_len``
            only sizes the scratch: on the dense path a sequence whose prefix exceeds the
            page-rounded bound gets NaN output rows (loud, never wrong numbers); block-table
            entries that are −1 or out of range mask their tokens exactly as the inline path
            does.
        exact_prefix: the caller guarantees ``max_prefix_len`` IS the prefix of the one
            sequence of the call (engines know it from host metadata: vLLM's CPU sequence
            lengths of prefill rows, SGLang's ``extend_prefix_lens_cpu``). Then a decompress-once
            call of ONE sequence without a sliding window runs its attention through PyTorch's
            SDPA instead of the Triton loop: the prefix rows are dequantized into ``scratch``,
            the chunk's rotated K/V rows appended after them, and the query attends to the
            ``prefix + q_len`` rows with a lower-right causal mask
            (``torch.nn.attention.bias.causal_lower_right``; FlashAttention-2 on CUDA, where
            SDPA must accept the call without its math fallback, else the Triton loop runs).
            Needs ``scratch`` for ``prefix + q_len`` tokens in whole pages. The promise covers
            the block table too: every page of the prefix valid (live prefixes in engines are;
            the other paths mask −1 / out-of-range pages, this one cannot). A broken promise
            (another prefix length, an invalid prefix page) gives NaN output rows. With a
            ``dense_attention`` callable the varlen path below runs instead (it needs no
            promise).
        dense_attention: optional varlen flash-attention callable
            (:class:`~tkv.kernels.dense_attention.DenseAttention`, e.g. an engine's
            FlashAttention 3) that then runs the attention of the paths whose keys are all
            16-bit rows: the ``no_prefix`` bypass (model space, the call's cu_seqlens for
            queries and keys, sliding window included; the same NaN rows for a broken
            promise) and the *varlen path* for sequences with a prefix — on the
            decompress-once conditions (``max_prefix_len``, a ``scratch`` of
            :func:`varlen_prefix_bytes` for ``prefix_tokens`` and ``total_q``, a chunk longer
            than the M tile's tokens), any number of sequences, ``exact_prefix`` or not,
            sliding window included: every prefix dequantized once and packed with its
            chunk's K/V rows, then ONE call with ``cu_seqlens_k`` (a sequence whose
            metadata breaks the bounds gets NaN rows). The prefix rows are taken back to
            model space inside the dequant kernel when ``head_dim`` is a power of two ≥ 16
            and every plane is ≥ 16 coordinates wide — the callable then gets the model's
            own query, keys and values, and no rotation pass runs (session 24) — else the
            rows stay in the planar rotated space (query and chunk rotated, output
            unrotated). With ``first_chunks = False`` on the callable, only the latter.
            Other calls ignore it. Its output is checked (shape, dtype, device: ShapeError /
            DtypeError). With ``writes_out = True`` on the callable (a bool, DtypeError
            otherwise) first chunks and model-space varlen calls get ``out=`` this call's
            ``out`` when it has the query's dtype (the dot dtype), and no copy of the
            returned rows is made when they are ``out``'s.
        prefix_tokens: optional host int ≥ the sum of the sequences' prefixes (tokens;
            engines know it from host metadata, an upper bound is fine): sizes the varlen
            path's packed rows (default ``num_seqs × max_prefix_len``): ``prefix_tokens +
            total_q`` rows hold the prefixes and the chunks, sequence after sequence; a
            sequence whose rows would end past them gets NaN rows (so does every later one),
            never a write outside ``scratch``.

    Rotated loaders (tkv): the wrapper rotates the query and the chunk's K/V into the cache's
    rotated space with three small float32 matmuls (no D×D tile inside the kernel, so head_dim
    256 works), the kernel runs entirely in that space, and one more matmul unrotates the
    output: ``<R(q*s_k), R(k/s_k)> = <q, k>`` and ``Σ_j p_j R(v_j/s_v)`` unrotates to
    ``Σ_j p_j v_j`` (TurboQuant Alg. 1 DeQuant is linear).

    Returns:
        ``out``. Raises DtypeError / ShapeError / DeviceMismatchError on malformed inputs
        (ShapeError also for ``block_m`` / ``num_warps`` not an int power of two, ``num_stages``
        < 1; DtypeError for a bool option that is not a bool), NonFiniteError for a NaN / inf
        ``sm_scale``, TypeError for a ``loader`` that is not a Loader. A ``TKV_*`` setting
        refused at import (its named error).
    """
    check_import_settings()
    if max_prefix_len is not None and (isinstance(max_prefix_len, bool) or not isinstance(
            max_prefix_len, int) or max_prefix_len < 0):
        raise ShapeError(f"max_prefix_len must be a host int ≥ 0 or None, got {max_prefix_len!r}")
    if scratch is not None and not isinstance(scratch, torch.Tensor):
        raise DtypeError(f"scratch must be a torch.Tensor or None, got {type(scratch).__name__}")
    check_flag(exact_prefix, "exact_prefix")
    if prefix_tokens is not None and (isinstance(prefix_tokens, bool) or not isinstance(
            prefix_tokens, int) or prefix_tokens < 0):
        raise ShapeError(f"prefix_tokens must be a host int ≥ 0 or None, got {prefix_tokens!r}")
    if dense_attention is not None and not callable(dense_attention):
        raise DtypeError("dense_attention must be a DenseAttention callable or None, got "
                         f"{type(dense_attention).__name__}")
    # False: first chunks stay on tkv's Triton bypass (TKV_PREFILL_ATTENTION=continuation)
    dense_first_chunks = check_flag(getattr(dense_attention, "first_chunks", True),
                                    "dense_attention.first_chunks")
    dense_writes_out = check_flag(getattr(dense_attention, "writes_out", False),
                                  "dense_attention.writes_out")
    check_loader(loader)
    check_flag(no_prefix, "no_prefix")
    if num_warps is not None:
        check_pow2(num_warps, "num_warps", 1, 16)
    if block_m is not None:
        check_pow2(block_m, "block_m", 1)
    if num_stages is not None:
        check_positive_int(num_stages, "num_stages")
    check_tensor(query, "query", 3)
    check_dtype(query, "query", (torch.float16, torch.bfloat16))
    tq, hq, d = query.shape
    # a loader may read tiles differently here than in decode (TkvLoader: its group planes
    # not interleaved, prefill_loader's docstring says why)
    loader = getattr(loader, "prefill_loader", lambda: loader)()
    hkv = loader.num_kv_heads
    if d != loader.head_dim or hq % hkv:
        raise ShapeError(f"query {tuple(query.shape)} does not fit loader (kv_heads={hkv}, "
                         f"head_dim={loader.head_dim})")
    for name, x in (("key", key), ("value", value)):
        check_tensor(x, name, 3)
        check_dtype(x, name, (query.dtype,))
        if tuple(x.shape) != (tq, hkv, d):
            raise ShapeError(f"{name} must be {(tq, hkv, d)}, got {tuple(x.shape)}")
        check_last_dim_contiguous(x, name)
    check_last_dim_contiguous(query, "query")
    check_int_tensor(cu_seqlens_q, "cu_seqlens_q", torch.int32, 1)
    check_int_tensor(seq_lens, "seq_lens", torch.int32, 1)
    check_int_tensor(block_table, "block_table", torch.int32, 2)
    ns = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != ns + 1 or block_table.shape[0] != ns:
        raise ShapeError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, block_table "
                         f"{tuple(block_table.shape)} do not match num_seqs={ns}")
    if block_table.stride(1) != 1:
        raise ShapeError("block_table must have unit stride on its last dim")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ShapeError(f"max_query_len must be a host int ≥ 0, got {max_query_len!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ShapeError(f"window must be an int ≥ 0 (0 = full attention), got {window!r}")
    num_blocks = loader.check_cache(cache)
    dot_dtype = dot_dtype_for(query.dtype)
    kargs = loader.side_args(cache, "k", dot_dtype)
    vargs = loader.side_args(cache, "v", dot_dtype)
    dev = query.device
    check_same_device(dev, key=key, value=value, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                      block_table=block_table, cache_k=kargs[0], cache_v=vargs[0])
    check_side_args_device(dev, kargs, vargs)
    scale = check_sm_scale(sm_scale, d)
    if out is None:
        # NaN until written: rows the metadata leaves out (max_query_len below a q_len,
        # cu_seqlens_q short of total_q) read as NaN, never as stale memory
        out = torch.full_like(query, float("nan"))
    else:
        check_out(out, (tq, hq, d), dev)
        # programs still read the chunk's K/V (every query tile of a sequence, every head of
        # its group) while others write out: an overlapping out would feed back into them
        check_no_overlap(out, key=key, value=value)
        if dense_writes_out:
            # the callable gets out= and the model's query (first chunks, the model-space
            # varlen path): FlashAttention reading a query it overwrites is undefined
            check_no_overlap(out, query=query)
    if ns == 0 or tq == 0 or max_query_len == 0:
        return out
    g = hq // hkv
    g_pad = next_pow2(g)
    d_pad = max(16, next_pow2(d))
    if block_m is None:  # rows of the M tile = query tokens x padded group
        block_m = 128 if d <= 128 else 64
    block_mt = max(1, block_m // g_pad)
    block_m = block_mt * g_pad
    if block_m < 16:
        block_mt = 16 // g_pad
    # tiles of the compressed prefix: the loader's decode tile, at most 64 tokens — 32 when a
    # side is 3/5/6/7-bit (8 planes or per-element codes). At head_dim 64, 64-token tiles
    # with a per-element side (3/5 bits) and a planar one (2/4 bits) crashed Triton 3.6's
    # code on the H200 (illegal address) or returned wrong rows (num_stages=2):
    # benchmarks/results/prefill_tile_bug_2026-11-30.md
    block_n = tile_tokens(block_n, d, loader.min_block_n,
                          small_head=64 if no_prefix else _prefix_tile(loader))
    if num_warps is None:
        num_warps = 8 if block_mt * g_pad >= 128 else 4
    if num_stages is None:
        # Triton's pipeliner would stage a packed format's codebook gathers through shared
        # memory (measured 1.5-2x slower in decode on the H200): one stage when the prefix is
        # read through a rotated (tkv) loader, two for plain tiles
        num_stages = 1 if loader.rotated and not no_prefix else 2
    final = None
    fetch, dequant = loader.fetch, loader.dequant
    planar = bool(loader.rotated) and not no_prefix
    if no_prefix and dense_attention is not None and dense_first_chunks:
        # the bypass through the caller's kernel, straight into ``out`` where it can write
        # there (FlashAttention's ``out=``: no copy of the chunk's output)
        _dense_into(dense_attention, (query, key, value, cu_seqlens_q, cu_seqlens_q,
                                      max_query_len, max_query_len, scale, window), out)
        return _nan_broken_rows(out, cu_seqlens_q, seq_lens, max_query_len)
    dense = (planar and scratch is not None and max_prefix_len is not None
             and max_prefix_len > 0 and max_query_len > block_mt)
    if dense:
        check_same_device(dev, scratch=scratch)
        dense = scratch.is_contiguous() and scratch.data_ptr() % 16 == 0
    # the varlen path: a callable and a scratch of varlen_prefix_bytes for the packed rows
    varlen = dense and dense_attention is not None
    if varlen:
        prefix_tokens = (ns * max_prefix_len if prefix_tokens is None
                         else min(prefix_tokens, ns * max_prefix_len))
        varlen = scratch.numel() * scratch.element_size() >= varlen_prefix_bytes(
            prefix_tokens, tq, hkv, d, dot_dtype)
        varlen_args = (cu_seqlens_q, seq_lens, max_prefix_len, prefix_tokens, max_query_len,
                       scratch, block_table, num_blocks, kargs, vargs, fetch, dequant, loader,
                       scale, window, dot_dtype, dense_attention, out)
    if varlen and _model_space_rows(loader, d, d_pad, kargs, vargs):
        _varlen_prefix_attention(query.to(dot_dtype), key, value, *varlen_args,
                                 model_space=True)
        return out
    if no_prefix:
        # prefill bypass: plain attention over the chunk in model space; the cache is never
        # read (a sequence with a prefix gets NaN rows: a broken promise fails loudly)
        fetch, dequant = bypass_fetch, identity_dequant
        kargs = vargs = (query, query, query, 0, 0, 0, d, 0, 0, 0, 1)
    elif planar:
        # rotated space, laid out as the loader's planes (contiguous plane loads):
        # <R(q*s_k), R(k/s_k)> = <q, k>; sum_j p_j R(v_j/s_v) unrotates to sum_j p_j v_j.
        # Key centering: the prefix is cached as R((k − μ)/s_k), so the chunk's keys are
        # centered too (k @ A − μ @ A); every score of a query row then drops by the same
        # q·μ, which softmax ignores.
        def rot(x, m, nh, mu=None):
            return rotate_rows(x, m, torch.empty(tq, nh, d_pad, dtype=dot_dtype, device=dev), mu)

        query, key, value = (rot(query, loader.q_in_planar, hq),
                             rot(key, loader.k_in_planar, hkv, loader.k_mu_planar),
                             rot(value, loader.v_in_planar, hkv))
        final = out
    bt, nblk, maxb, bs = block_table, num_blocks, block_table.shape[1], loader.block_size
    if varlen:
        _varlen_prefix_attention(query, key, value, *varlen_args, model_space=False)
        return out
    if planar:
        # rotated-space rows, NaN until written (rows the metadata leaves out stay NaN
        # through the unrotation instead of turning stale memory into numbers)
        out = torch.full((tq, hq, d_pad), float("nan"), dtype=torch.float32, device=dev)
    if dense:
        maxp = _whole_pages(max_prefix_len, bs)       # whole pages of prefix per sequence
        need = dense_prefix_bytes(ns, maxp, hkv, d, query.dtype)
        dense = scratch.numel() * scratch.element_size() >= need
    if dense and exact_prefix and ns == 1 and not window:
        rows = _whole_pages(max_prefix_len + tq, bs)
        if (scratch.numel() * scratch.element_size()
                >= dense_prefix_bytes(1, rows, hkv, d, query.dtype)
                and _exact_prefix_attention(query, key, value, out, cu_seqlens_q, seq_lens,
                                            max_prefix_len, maxp, rows, scratch, block_table,
                                            num_blocks, kargs, vargs, fetch, dequant, loader,
                                            scale, dot_dtype)):
            return rotate_rows(out, loader.out_planar, final)
    if dense:
        flat = scratch.view(-1).view(torch.uint8)[:need].view(dot_dtype)
        pk, pv = flat.view(2, ns * maxp * hkv * d_pad)
        _dequant_prefix(cu_seqlens_q, seq_lens, block_table, num_blocks, kargs, vargs, fetch,
                        dequant, loader, pk, pv, maxp, ns, hkv, d_pad)
        # the scratch as a paged cache with an identity block table: page i·(maxp/bs) + j
        # is page j of sequence i's prefix; −1 where the real table has no valid page there
        # (−1 or out of range: those tokens stay masked as inline; beyond its width: the
        # capacity check below makes the sequence's rows NaN, as inline)
        maxb = maxp // bs
        nblk = ns * maxb
        bt = torch.arange(nblk, dtype=torch.int32, device=dev).view(ns, maxb)
        real = torch.full((ns, maxb), -1, dtype=torch.int32, device=dev)
        w = min(maxb, block_table.shape[1])
        real[:, :w] = block_table[:, :w]
        bt = torch.where((real >= 0) & (real < num_blocks), bt, -1)
        page, tok = bs * hkv * d_pad, hkv * d_pad
        kargs = (pk, pk, pk, page, d_pad, tok, d_pad, 0, 0, 0, kargs[10])
        vargs = (pv, pv, pv, page, d_pad, tok, d_pad, 0, 0, 0, vargs[10])
        fetch, dequant, num_stages = _dense_fetch, _dense_planes, 2
    # inline prefix reads apply the sink shifts themselves; the dense rows already hold them,
    # and the bypass reads no cache
    k_shift, k_sink = sink_shift(loader, "k", cu_seqlens_q)
    v_shift, v_sink = sink_shift(loader, "v", cu_seqlens_q)
    k_sink, v_sink = (k_sink and planar and not dense), (v_sink and planar and not dense)
    grid = (triton.cdiv(max_query_len, block_mt), ns, hkv)
    _prefill_kernel[grid](
        query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1),
        value, value.stride(0), value.stride(1), out, out.stride(0), out.stride(1),
        # max_blocks: the pages the kernel lets a prefix span (longer: NaN rows); on the
        # dense path the real table's width too, which the identity table alone would hide
        cu_seqlens_q, seq_lens, bt, bt.stride(0), min(maxb, block_table.shape[1]),
        nblk, tq, *kargs[:6], *vargs[:6], scale * _LOG2E, window, k_shift, v_shift,
        FETCH=fetch, DEQUANT=dequant, KP0=kargs[6], KP1=kargs[7], KP2=kargs[8],
        KP3=kargs[9], KNP=kargs[10], VP0=vargs[6], VP1=vargs[7], VP2=vargs[8],
        VP3=vargs[9], VNP=vargs[10], G=g, G_PAD=g_pad, BLOCK_MT=block_mt, BLOCK_N=block_n,
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=loader.block_size, DOT_DTYPE=_TL[dot_dtype],
        PLANAR=planar, NO_PREFIX=bool(no_prefix), K_SINK=k_sink,
        V_SINK=v_sink, num_warps=num_warps, num_stages=num_stages)
    if final is not None:
        rotate_rows(out, loader.out_planar, final)
        out = final
    return out


# How the varlen path's dequant kernel takes prefix rows back to model space (session 26):
# "split3" (default) — the map's bf16 hi/lo halves, three tensor-core passes per plane;
# "pm1" — its exact ±1 factor and float32 column scales (``TkvLoader.k_back_pm1`` / ``_w``),
# two passes, half the matrix bytes, the same ~2^-16 precision. The kernel is compute-bound
# at short prefixes (docs/kernels.md, "Session 26"). Timed on an H200 in session 27: the
# kernel −23 % (198 → 151 µs at 32 × 1K prefixes), the whole path 1.015× there but
# 0.987-0.996× at 4K-16K prefixes, same oracle error — mixed, so "split3" stays the default.
MODEL_BACK_MAP = "split3"
_MODEL_BACK_MAPS = ("split3", "pm1")


def _dequant_prefix(cu_seqlens_q, seq_lens, block_table, num_blocks, kargs, vargs, fetch,
                    dequant, loader, pk, pv, maxp: int, ns: int, hkv: int, d_pad: int,
                    row0: torch.Tensor | None = None, row_limit: int = 0,
                    model_space: bool = False) -> None:
    """Launch :func:`_dequant_prefix_kernel`: the prefixes of ``ns`` sequences (at most ``maxp``
    tokens each) dequantized into ``pk`` / ``pv`` rows ``(seq·maxp + pos)·hkv + head`` — for
    the decompress-once Triton loop and for the SDPA path alike — or, with ``row0`` (int32
    ``(≥ ns,)`` on the device), token rows ``row0[seq] + pos`` below ``row_limit`` (the
    varlen path). ``model_space``: rows in model space (``MODEL``, through the loader's
    ``k_back_planar`` / ``v_back_planar``, or their ±1 factors: :data:`MODEL_BACK_MAP`).

    Raises:
        ValueError: :data:`MODEL_BACK_MAP` is not one of ``"split3"`` / ``"pm1"``."""
    tb = _prefix_tile(loader)
    k_shift, k_sink = sink_shift(loader, "k", pk)
    v_shift, v_sink = sink_shift(loader, "v", pk)
    if MODEL_BACK_MAP not in _MODEL_BACK_MAPS:
        raise ValueError(f"prefill.MODEL_BACK_MAP must be one of {_MODEL_BACK_MAPS}, "
                         f"got {MODEL_BACK_MAP!r}")
    pm1 = (model_space and MODEL_BACK_MAP == "pm1"
           and getattr(loader, "k_back_pm1", None) is not None
           and getattr(loader, "v_back_pm1", None) is not None)
    if pm1:
        kb, vb, kw, vw = loader.k_back_pm1, loader.v_back_pm1, loader.k_back_w, loader.v_back_w
    else:
        kb, vb = (loader.k_back_planar, loader.v_back_planar) if model_space else (pk, pv)
        kw, vw = kb, vb    # unread
    _dequant_prefix_kernel[(triton.cdiv(maxp, tb), ns, hkv)](
        cu_seqlens_q, seq_lens, block_table, block_table.stride(0), block_table.shape[1],
        num_blocks, *kargs[:6], *vargs[:6], pk, pv, maxp, k_shift, v_shift,
        seq_lens if row0 is None else row0, row_limit,
        kb, vb, kw, vw, MODEL=model_space, PM1=pm1,
        OPERAND=_TL[dot_dtype_for(torch.bfloat16)], PACKED=row0 is not None,
        FETCH=fetch, DEQUANT=dequant, KP0=kargs[6], KP1=kargs[7], KP2=kargs[8],
        KP3=kargs[9], KNP=kargs[10], VP0=vargs[6], VP1=vargs[7], VP2=vargs[8],
        VP3=vargs[9], VNP=vargs[10], HKV=hkv, HEAD_DIM=loader.head_dim, D_PAD=d_pad,
        BLOCK_SIZE=loader.block_size, BLOCK_N=tb, K_SINK=k_sink, V_SINK=v_sink, num_warps=4)


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape are the same elements of memory (same start and the
    same stride on every dim longer than 1)."""
    return a.data_ptr() == b.data_ptr() and all(
        sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if n > 1)


@triton.jit
def _nan_rows(out, s_t, s_h, head, a, b, HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr):
    """NaN into rows ``[a, b)`` of ``out`` for one head (nothing when ``b ≤ a``)."""
    cols = tl.arange(0, D_BLOCK)
    nan = tl.full([D_BLOCK], float("nan"), tl.float32)   # stored in out's dtype
    row = out + a.to(tl.int64) * s_t + head * s_h
    for _ in range(a, b):
        tl.store(row + cols, nan, mask=cols < HEAD_DIM)
        row += s_t


@triton.jit(do_not_specialize=["s_t", "s_h", "total", "num_seqs", "max_q"],
            do_not_specialize_on_alignment=["cu_q", "seq_lens", "flags"])
def _nan_broken_promise_kernel(out, s_t, s_h, cu_q, seq_lens, flags, total, num_seqs, max_q,
                               HAS_FLAGS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               D_BLOCK: tl.constexpr):
    """Program (sequence, head): if the sequence is broken, its rows of that head (those that
    exist) become NaN; the first sequence's program also poisons the rows before ``cu_q[0]``,
    the last one's the rows from ``cu_q[num_seqs]`` on (rows of no sequence, never written by
    the attention); else nothing is written. Broken: with ``HAS_FLAGS``, ``flags[seq] ≠ 0``
    (the varlen path's own verdict); else a prefix (``seq_len ≠ q_len``, a broken
    ``no_prefix`` promise), more rows than ``max_q`` (a varlen kernel's grid would not cover
    them), a start below row 0 or an end past ``out``'s ``total`` rows."""
    seq, head = tl.program_id(0), tl.program_id(1)
    a = tl.load(cu_q + seq)
    b_meta = tl.load(cu_q + seq + 1)
    b = tl.minimum(b_meta, total)
    if HAS_FLAGS:
        bad = tl.load(flags + seq) != 0
    else:
        bad = (a < 0) | (tl.load(seq_lens + seq) != b_meta - a) | (b_meta > total) | (
            b_meta - a > max_q)
    if bad:
        _nan_rows(out, s_t, s_h, head, tl.maximum(a, 0), b, HEAD_DIM, D_BLOCK)
    if seq == 0:
        _nan_rows(out, s_t, s_h, head, a - a, tl.minimum(a, total), HEAD_DIM, D_BLOCK)
    if seq == num_seqs - 1:
        _nan_rows(out, s_t, s_h, head, tl.maximum(b_meta, 0), total, HEAD_DIM, D_BLOCK)


def _nan_broken_rows(out: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                     max_query_len: int, flags: torch.Tensor | None = None) -> torch.Tensor:
    """NaN into the rows of ``out`` ``(total_q, num_q_heads, head_dim)`` (unit stride on
    head_dim) of broken sequences and of no sequence (before ``cu_seqlens_q[0]``, from
    ``cu_seqlens_q[-1]``) — decided on the device (no host sync); one small
    :func:`_nan_broken_promise_kernel` launch over ``(num_seqs, num_q_heads)`` that writes
    nothing when the metadata holds, instead of a pass over the whole output. Broken: with
    ``flags`` (uint8 ``(num_seqs,)``, the varlen path's per-sequence verdict) where it is
    nonzero; without, where the ``no_prefix`` promise breaks (``seq_len ≠ q_len``) or a
    sequence has more than ``max_query_len`` rows (the dense first-chunk path's guard)."""
    ns, hq, d = cu_seqlens_q.shape[0] - 1, out.shape[1], out.shape[2]
    if ns > 0 and out.shape[0] > 0:
        _nan_broken_promise_kernel[(ns, hq)](
            out, out.stride(0), out.stride(1), cu_seqlens_q, seq_lens,
            cu_seqlens_q if flags is None else flags, out.shape[0], ns, max_query_len,
            HAS_FLAGS=flags is not None, HEAD_DIM=d, D_BLOCK=next_pow2(d), num_warps=1)
    return out


def _exact_prefix_attention(query, key, value, out, cu_seqlens_q, seq_lens, prefix: int,
                            maxp: int, rows: int, scratch, block_table, num_blocks, kargs,
                            vargs, fetch, dequant, loader, scale: float, dot_dtype) -> bool:
    """:func:`prefill`'s SDPA path for ONE sequence whose prefix is exactly ``prefix`` tokens
    (``exact_prefix``, no ``dense_attention`` callable — that takes
    :func:`_varlen_prefix_attention`): rows ``[0, prefix)`` of K/V are the prefix dequantized
    into ``scratch`` (planar rotated, norms applied — :func:`_dequant_prefix_kernel`), rows
    ``[prefix, prefix + q_len)`` the chunk's rotated K/V; the rotated ``query`` attends to
    them through SDPA with a lower-right causal mask, written into ``out`` (float32
    ``(q_len, num_q_heads, d_pad)``). Returns False, having written nothing, where SDPA would
    take its math fallback on CUDA (memory ∝ q_len × keys); the caller then runs the Triton
    loop (also, with a RuntimeWarning, when SDPA itself raises, or when the block table is
    narrower than the prefix: broken metadata, NaN rows there). A broken promise — a prefix other than ``prefix``, a chunk not
    starting at row 0, a prefix page that is −1 or out of range — poisons ``out`` with NaN."""
    from torch.nn.attention.bias import causal_lower_right

    tq, hq, d_pad = query.shape
    hkv = key.shape[1]
    keys = prefix + tq
    npages = -(-prefix // loader.block_size)
    if block_table.shape[1] < npages:   # a table narrower than the prefix: the Triton loop's
        return False                    # capacity check makes its rows NaN
    flat = scratch.view(-1).view(torch.uint8)[:2 * rows * hkv * d_pad * query.element_size()]
    pk, pv = flat.view(dot_dtype).view(2, rows, hkv, d_pad)
    q4 = query.view(1, tq, hq, d_pad).transpose(1, 2)
    k4 = pk[:keys].view(1, keys, hkv, d_pad).transpose(1, 2)
    v4 = pv[:keys].view(1, keys, hkv, d_pad).transpose(1, 2)
    if query.is_cuda:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        if not can_use_flash_attention(SDPAParams(q4, k4, v4, None, 0.0, False, True), False):
            return False
    _dequant_prefix(cu_seqlens_q, seq_lens, block_table, num_blocks, kargs, vargs, fetch,
                    dequant, loader, pk, pv, maxp, 1, hkv, d_pad)
    pk[prefix:keys].copy_(key)
    pv[prefix:keys].copy_(value)
    try:
        o = torch.nn.functional.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=causal_lower_right(tq, keys), scale=scale,
            enable_gqa=True).transpose(1, 2)[0]   # (q_len, heads, d_pad)
    except RuntimeError as e:   # no SDPA kernel for these inputs: the Triton loop instead
        warnings.warn(f"tkv prefill: SDPA refused the decompress-once attention ({e}); "
                      "using the Triton loop", RuntimeWarning, stacklevel=3)
        return False
    # broken promises: another prefix length, a chunk not starting at row 0, or a prefix page
    # that is −1 / out of range (the other paths mask such tokens; this one cannot)
    pages = block_table[0, :npages]
    broken = ((seq_lens[0] - (cu_seqlens_q[1] - cu_seqlens_q[0])) != prefix) | (
        cu_seqlens_q[0] != 0) | ((pages < 0) | (pages >= num_blocks)).any()
    out.copy_(o)
    out.masked_fill_(broken, float("nan"))
    return True


def _row_bytes(num_kv_heads: int, head_dim: int, query_dtype: torch.dtype) -> int:
    """Bytes of one token row of the prefill scratch (decompress-once and varlen paths
    alike): K and V, ``num_kv_heads`` heads of ``max(16, next_pow2(head_dim))`` elements of
    the dot dtype for ``query_dtype``."""
    d_pad = max(16, next_pow2(head_dim))
    return 2 * num_kv_heads * d_pad * torch.empty(
        0, dtype=dot_dtype_for(query_dtype)).element_size()


def varlen_prefix_bytes(prefix_tokens: int, num_tokens: int, num_kv_heads: int,
                        head_dim: int, query_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of scratch :func:`prefill`'s varlen path (a ``dense_attention`` callable over
    decompressed prefixes) needs: K and V rows for ``prefix_tokens`` (the sum of the call's
    prefixes, tokens) plus the call's ``num_tokens`` chunk tokens plus one spare row, packed
    back to back (no page rounding), ``num_kv_heads`` heads of ``max(16,
    next_pow2(head_dim))`` elements of the dot dtype for ``query_dtype`` (as
    :func:`dense_prefix_bytes`)."""
    return (prefix_tokens + num_tokens + 1) * _row_bytes(num_kv_heads, head_dim, query_dtype)


def varlen_prefix_rows(scratch_bytes: int, num_kv_heads: int, head_dim: int,
                       query_dtype: torch.dtype = torch.bfloat16) -> int:
    """The packed rows (``Σ prefix + Σ chunk + 1`` tokens) a scratch of ``scratch_bytes``
    bytes holds for :func:`prefill`'s varlen path — the inverse of
    :func:`varlen_prefix_bytes`, for engines cutting prefill runs to fit
    (:func:`~tkv.kernels.plan_prefill_runs`'s ``max_packed_rows``).

    Raises:
        ValueError: ``scratch_bytes`` < 0, ``num_kv_heads`` or ``head_dim`` < 1 (or not
            ints)."""
    for name, v, lo in (("scratch_bytes", scratch_bytes, 0), ("num_kv_heads", num_kv_heads, 1),
                        ("head_dim", head_dim, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"varlen_prefix_rows: {name} must be an int ≥ {lo}, got {v!r}")
    return scratch_bytes // _row_bytes(num_kv_heads, head_dim, query_dtype)


def _varlen_prefix_attention(query, key, value, cu_seqlens_q, seq_lens, max_prefix: int,
                             prefix_tokens: int, max_query_len: int, scratch, block_table,
                             num_blocks, kargs, vargs, fetch, dequant, loader, scale: float,
                             window: int, dot_dtype, dense_attention: DenseAttention,
                             out: torch.Tensor, *, model_space: bool) -> None:
    """:func:`prefill`'s varlen path: every sequence's prefix (its real length taken on the
    device, at most ``max_prefix`` tokens, ``prefix_tokens`` for all together) is dequantized
    once into ``scratch`` (norms and sink shifts applied — :func:`_dequant_prefix_kernel`,
    ``PACKED``), its chunk's K/V rows right after it, sequences back to back; then ONE call
    of the caller's varlen ``dense_attention`` (an engine's FlashAttention) with
    ``cu_seqlens_k`` over those rows, window included (``prefix + q_len`` keys per
    sequence, bottom-right causal). Writes :func:`prefill`'s ``out`` (model space,
    ``(total_q, num_q_heads, head_dim)``); the caller has checked that ``scratch`` holds
    :func:`varlen_prefix_bytes` for ``prefix_tokens`` and ``total_q``.

    Two spaces (session 24):

    * ``model_space`` (:func:`_model_space_rows`): the prefix rows are dequantized straight
      back to model space (``_dequant_prefix_kernel``'s ``MODEL``), so ``query`` / ``key`` /
      ``value`` are the model's own rows (in the dot dtype) and the callable's output is
      :func:`prefill`'s (written in place through ``out=`` when it can): no rotation pass at
      all. At 32 × (1K prefix + 512) the rotated space cost ~2.3 ms around a 1.1 ms attention
      call on an H100 (``benchmarks/results/kernels_gpu_2026-12-05_s24_prefix_hits.md``).
    * otherwise the loader's planar rotated space (``query`` / ``key`` / ``value`` rotated
      by the caller, ``d_pad`` wide); the callable's 16-bit rows are unrotated into ``out``.

    Nothing is read on the host (no sync): ``cu_seqlens_k``, each chunk row's place and the
    guards are device tensors, and no write leaves the scratch's rows whatever the metadata.
    NaN output rows for a sequence that breaks the bounds — a prefix above ``max_prefix`` or
    below 0, the prefixes up to it above ``prefix_tokens``, a chunk longer than
    ``max_query_len``, ``cu_seqlens_q`` decreasing or past ``total_q``, a prefix page that is
    −1 / out of range or beyond the block table (engines' live prefixes have valid pages; the
    Triton paths would mask such tokens) — and for query rows outside every sequence."""
    tq, d_pad = query.shape[0], query.shape[2]
    hkv = key.shape[1]
    ns = seq_lens.shape[0]
    cap = prefix_tokens + tq                    # rows: the prefixes at their bound + chunks
    need = varlen_prefix_bytes(prefix_tokens, tq, hkv, loader.head_dim, dot_dtype)
    flat = scratch.view(-1).view(torch.uint8)[:need].view(dot_dtype)
    pk, pv = flat.view(2, cap + 1, hkv, d_pad)   # row ``cap``: where stray chunk rows go
    dev, i32 = query.device, torch.int32
    # query ranges clipped to [0, total_q] and made non-decreasing: what the attention and the
    # dequant kernel see; a sequence whose range this changed is broken (NaN rows below)
    cu = cu_seqlens_q.clamp(0, tq).cummax(0).values.to(i32)
    q_len = cu[1:] - cu[:-1]
    prefix = seq_lens - q_len
    clamped = prefix.clamp(0, max_prefix)
    pre = torch.where(q_len > 0, clamped, 0)    # no rows for a sequence without new tokens
    ends = torch.cumsum(pre + q_len, 0)         # int64: past ``cap`` only on broken promises
    cu_k = torch.zeros(ns + 1, dtype=i32, device=dev)
    cu_k[1:] = ends.clamp(max=cap)
    bs = loader.block_size
    npages = (pre + bs - 1) // bs
    needed = torch.arange(block_table.shape[1], device=dev)[None, :] < npages[:, None]
    bad_page = (needed & ((block_table < 0) | (block_table >= num_blocks))).any(1)
    changed = cu != cu_seqlens_q
    # q_len > max_query_len: the callable sizes its grid from max_query_len (FlashAttention
    # launches cdiv(max_seqlen_q, tile) query tiles), so such rows would come back unwritten
    broken = (changed[:-1] | changed[1:] | (prefix != clamped) | bad_page | (ends > cap)
              | (npages > block_table.shape[1]) | (q_len > max_query_len))
    _dequant_prefix(cu, seq_lens, block_table, num_blocks, kargs, vargs, fetch, dequant,
                    loader, pk, pv, max_prefix, ns, hkv, d_pad, row0=cu_k, row_limit=cap,
                    model_space=model_space)
    # chunk row t of sequence s goes to row cu_k[s] + pre[s] + (t − cu[s]) = t + (ends[s] −
    # cu[s+1]); rows outside every sequence or the scratch's rows go to the spare row
    t = torch.arange(tq, device=dev)
    seq = torch.searchsorted(cu[1:], t.to(i32), right=True).clamp(max=max(ns - 1, 0))
    inside = (t >= cu[seq]) & (t < cu[seq + 1])
    dst = t + ends[seq] - cu[seq + 1]
    dst = torch.where(inside & (dst < cap), dst, cap)
    # the chunk's rows (model space: keys centered as the cache's prefix keys are)
    _pack_chunk_rows(key, value, getattr(loader, "k_mu", None) if model_space else None,
                     pk, pv, dst)
    args = (query, pk[:cap], pv[:cap], cu, cu_k, max_query_len, max_prefix + max_query_len,
            scale, window)
    if model_space:
        _dense_into(dense_attention, args, out)
    else:
        # the callable's 16-bit rows straight into the unrotation: no float32 rows between
        rotate_rows(check_dense_output(dense_attention(*args), query), loader.out_planar, out)
    # NaN rows: broken sequences and rows of none (one small launch, no pass over ``out``)
    _nan_broken_rows(out, cu, seq_lens, max_query_len, flags=broken.view(torch.uint8))


@triton.jit(do_not_specialize=["sk_t", "sk_h", "sv_t", "sv_h", "s_mu", "sp_t", "sp_h",
                              "rows"])
def _pack_chunk_rows_kernel(K, sk_t, sk_h, V, sv_t, sv_h, MU, s_mu, PK, PV, sp_t, sp_h, DST,
                            rows, HAS_MU: tl.constexpr, D: tl.constexpr, D_BLOCK: tl.constexpr,
                            BLOCK_T: tl.constexpr):
    """Program (row tile, KV head): chunk rows ``t`` of ``K`` / ``V`` into packed rows
    ``DST[t]`` of ``PK`` / ``PV`` (their dtype), keys minus ``MU[head]`` in float32 first
    (``HAS_MU``)."""
    pid, h = tl.program_id(0), tl.program_id(1)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D_BLOCK)
    m = (t < rows)[:, None] & (cols < D)[None, :]
    dst = tl.load(DST + t, mask=t < rows, other=0).to(tl.int64)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64[:, None] * sk_t + h * sk_h + cols[None, :], mask=m, other=0.0)
    if HAS_MU:
        k = k.to(tl.float32) - tl.load(MU + h * s_mu + cols, mask=cols < D, other=0.0)[None, :]
    tl.store(PK + dst[:, None] * sp_t + h * sp_h + cols[None, :],
             k.to(PK.dtype.element_ty), mask=m)
    v = tl.load(V + t64[:, None] * sv_t + h * sv_h + cols[None, :], mask=m, other=0.0)
    tl.store(PV + dst[:, None] * sp_t + h * sp_h + cols[None, :],
             v.to(PV.dtype.element_ty), mask=m)


def _pack_chunk_rows(key: torch.Tensor, value: torch.Tensor, mu: torch.Tensor | None,
                     pk: torch.Tensor, pv: torch.Tensor, dst: torch.Tensor) -> None:
    """The varlen path's chunk rows into its packed rows, one launch: ``pk[dst[t]] = key[t] −
    μ`` and ``pv[dst[t]] = value[t]`` in ``pk``'s dtype (``key`` / ``value``: ``(total_q,
    num_kv_heads, D)``, unit stride on D; ``pk`` / ``pv``: ``(rows, num_kv_heads, D)``, same
    strides; ``dst``: int64 ``(total_q,)``; ``mu``: None or float32 ``(1 or num_kv_heads, ≥
    D)``, contiguous).

    Model space subtracts the loader's key offset μ (``k_mu``) in float32, one rounding, as the
    cache holds its prefix keys: every score of a query row then drops by the same ``q·μ``,
    which softmax ignores, and the 16-bit rows keep the centered keys' precision instead of
    rounding ``k̂ + μ`` (a large μ cost 5× the planar route's error with μ added back;
    session 24's break-test). Replaces the float32 centering and two ``index_copy_`` (five
    passes over the chunk's keys and values; session 25)."""
    rows, hkv, d = key.shape
    if rows == 0:
        return
    block_t = 16
    _pack_chunk_rows_kernel[(triton.cdiv(rows, block_t), hkv)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
        key if mu is None else mu, 0 if mu is None or mu.shape[0] == 1 else mu.stride(0),
        pk, pv, pk.stride(0), pk.stride(1), dst, rows, HAS_MU=mu is not None, D=d,
        D_BLOCK=next_pow2(d), BLOCK_T=block_t, num_warps=4)


def _model_space_rows(loader, head_dim: int, d_pad: int, kargs, vargs) -> bool:
    """Whether the varlen path can take the prefix back to model space inside the dequant
    kernel: the loader has the maps back (``k_back_planar`` / ``v_back_planar``: TkvLoader),
    ``head_dim`` is a power of two ≥ 16 (the rows are the model's, no padding for the callable
    to see) and planes are at least 16 coordinates wide (each plane's unrotation is one
    tensor-core dot over them)."""
    return (getattr(loader, "k_back_planar", None) is not None
            and getattr(loader, "v_back_planar", None) is not None
            and head_dim == d_pad and d_pad // max(kargs[10], vargs[10]) >= 16)


def _dense_into(dense_attention: DenseAttention, args: tuple, out: torch.Tensor) -> None:
    """``dense_attention(*args)`` into ``out`` (same shape, maybe another dtype): through
    ``out=`` when the callable takes it (``writes_out``) and the dtypes agree — FlashAttention
    writes there, no copy — else copied."""
    q = args[0]
    if getattr(dense_attention, "writes_out", False) and out.dtype == q.dtype:
        o = check_dense_output(dense_attention(*args, out=out), q)
        if not _same_elements(o, out):
            if o.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
                o = o.clone()   # another view of out's memory: copy_ would self-overlap
            out.copy_(o)
    else:
        out.copy_(check_dense_output(dense_attention(*args), q))


# query tokens of the warm-up's decompress-once call: more than any M tile's tokens (block_m
# ≤ 128 rows), so prefill takes that path
_WARM_DENSE_TOKENS = 129


def _prefix_tile(loader) -> int:
    """Tokens per tile of a compressed prefix read through ``loader``: its decode tile
    (``preferred_block_n``), at most 64."""
    return min(64, getattr(loader, "preferred_block_n", 64))


def _whole_pages(tokens: int, block_size: int) -> int:
    """``tokens`` rounded up to a multiple of ``block_size``."""
    return -(-tokens // block_size) * block_size


def dense_prefix_bytes(num_seqs: int, max_prefix_len: int, num_kv_heads: int, head_dim: int,
                       query_dtype: torch.dtype = torch.bfloat16, block_size: int = 1) -> int:
    """Bytes of scratch :func:`prefill`'s decompress-once path needs: K and V rows of
    ``num_seqs × max_prefix_len`` tokens, ``max_prefix_len`` rounded up to whole pages of
    ``block_size`` tokens (the loader's, as :func:`prefill` lays the scratch out),
    ``num_kv_heads`` heads of ``max(16, next_pow2(head_dim))`` elements of the dot dtype for
    ``query_dtype`` (the query's 16-bit type on CUDA, float32 under the Triton interpreter)."""
    return num_seqs * _whole_pages(max_prefix_len, block_size) * _row_bytes(
        num_kv_heads, head_dim, query_dtype)


def warm_prefix_variant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache,
                        block_table: torch.Tensor, loader: Loader, *,
                        sm_scale: float | None = None, window: int = 0,
                        scratch: torch.Tensor | None = None,
                        dense_attention: DenseAttention | None = None) -> torch.Tensor | None:
    """Compile the prefill variant that reads a compressed prefix, by running it once on a
    1-token chunk over a 1-token prefix into scratch; returns the scratch output (None when
    skipped). Engines call it right after their first ``prefill(..., no_prefix=True)``.

    First chunks take the prefill bypass, a different kernel specialization from the one
    continuation chunks, prefix-cache hits and spec-decode verify use; without this, the first
    such step stalls on a Triton compile (seconds — measured inside a vLLM throughput run on the
    H200, 2026-11-30). The call uses this batch's own tensors (``query``/``key``/``value`` of
    the chunk just prefilled, ``block_table`` rows of its sequences, the real ``cache``) so every
    runtime argument falls in the same specialization class as the real calls; it reads token
    0 of ``block_table``'s first row — the first sequence's, stored by this step, or whatever
    that page holds when an engine's row 0 is padding (a −1 or out-of-range page is masked) —
    and writes nothing but throwaway outputs: only the compile matters, never the values.
    Skipped while a CUDA graph is being captured.

    With ``scratch`` (the engine's prefill scratch) and a batch of more than
    ``_WARM_DENSE_TOKENS`` tokens, the decompress-once variant is compiled too: a chunk of
    that many of the batch's query rows over the same 1-token prefix (both variants' outputs
    land in throwaway buffers; the returned one is the 1-token call's) — and, with the
    engine's ``dense_attention``, once more through the varlen path (its packed dequant
    kernel), which prefix-cache hits and continuation chunks take then.

    Args: as :func:`prefill` (``query`` ``(≥1, num_q_heads, head_dim)``, ``block_table`` int32
    ``(≥1, max_blocks_per_seq)``; only row 0 and token 0 are used).
    """
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if query.shape[0] == 0 or block_table.shape[0] == 0:
        return None
    dev = query.device
    cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([2], dtype=torch.int32, device=dev)
    out = prefill(query[:1], key[:1], value[:1], cu, seq_lens, 1, cache, block_table[:1],
                  loader, out=torch.empty_like(query[:1]), sm_scale=sm_scale, window=window)
    n = _WARM_DENSE_TOKENS
    if scratch is not None and query.shape[0] >= n:
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        seq_lens = torch.tensor([n + 1], dtype=torch.int32, device=dev)
        for fn in (None, dense_attention) if dense_attention is not None else (None,):
            prefill(query[:n], key[:n], value[:n], cu, seq_lens, n, cache, block_table[:1],
                    loader, out=torch.empty_like(query[:n]), sm_scale=sm_scale, window=window,
                    max_prefix_len=1, scratch=scratch, dense_attention=fn)
    return out
