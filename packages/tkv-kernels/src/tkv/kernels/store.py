"""Fused compress + store: rotate, norm, quantize, pack and scatter new K/V into the paged
tkv cache in one launch (no intermediate tensor through HBM)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tkv.codec.errors import ShapeError, TkvError
from tkv.codec.packing import code_group

from . import _nvrtc, cuda_store
from ._nvrtc import CudaCompileError
from ._planes import hadamard_stage
from ._util import (
    check_dtype,
    check_import_settings,
    check_int_tensor,
    check_last_dim_contiguous,
    check_pow2,
    check_same_device,
    check_tensor,
    choice_from_env,
    interpreting,
    read_at_import,
)
from .loaders import TkvLoader

__all__ = ["StoreRotationConfigError", "compress_store", "store_rotation_from_env"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
# Compiled: the binary search's boundaries and the centroids come from select trees over scalars
# (no gathered tile to convert through shared memory). The Triton interpreter runs numpy ops per
# tile, where a tree of 2**bits − 1 selects costs far more than one gather: it takes the
# gathers (the same comparisons, the same values); tests flip this to check the trees on CPU.
_SEARCH_TREE = tl.constexpr(not interpreting())
_ROTATIONS = ("auto", "split", "tf32x3", "wht")
# the kernel's per-side rotation mode (K_SPLIT / V_SPLIT)
_TF32X3, _BF16_TERMS, _FP16_TERMS, _BUTTERFLIES = 0, 1, 2, 3

ENV_STORE_ROTATION = "TKV_STORE_ROTATION"
STORE_POLICIES = ("auto", "matrix")


class StoreRotationConfigError(TkvError, ValueError):
    """``TKV_STORE_ROTATION`` is not ``auto`` or ``matrix``."""


def store_rotation_from_env(environ=None) -> str:
    """What ``compress_store(rotation="auto")`` does, from ``TKV_STORE_ROTATION`` (read once
    at import as :data:`STORE_ROTATION`; any case, blanks ignored): ``"auto"`` (default) the
    Walsh–Hadamard butterflies wherever the rotation is a pure power-of-two Hadamard, else
    the tensor-core rotation; ``"matrix"`` the tensor-core rotation always (``"split"`` for
    16-bit K/V, ``"tf32x3"`` for float32: the default until session 28, kept as the A/B
    arm — ``vllm_e2e.py --runs tkvstorematrix``, ``sglang_e2e.py --variants storematrix``).

    Raises:
        StoreRotationConfigError: any other value (the message lists the choices).
    """
    return choice_from_env(environ, ENV_STORE_ROTATION, STORE_POLICIES, "auto",
                           StoreRotationConfigError,
                           f"choose one of {', '.join(STORE_POLICIES)} (default auto)")


STORE_ROTATION = read_at_import(store_rotation_from_env)


def store_rotation_for(rotation: str, loader) -> str:
    """The rotation :func:`compress_store` runs when asked for ``rotation`` with ``loader``:
    ``"wht"`` for ``"auto"`` where the loader's rotation is a pure power-of-two Hadamard
    (``k_store_hadamard``) and :data:`STORE_ROTATION` is ``"auto"``; else ``rotation`` as
    given (``"auto"`` then picks the matrix path per input dtype).

    Raises:
        ValueError: ``rotation`` is not one of ``auto``, ``split``, ``tf32x3``, ``wht``.
    """
    if rotation not in _ROTATIONS:
        raise ValueError(f"rotation must be one of {_ROTATIONS}, got {rotation!r}")
    if rotation == "auto" and loader.k_store_hadamard is not None and STORE_ROTATION == "auto":
        return "wht"   # the butterflies (the operator may pick TKV_STORE_ROTATION=matrix)
    return rotation


@triton.jit
def _bf16_rne(x):
    """float32 → bfloat16, round to nearest even, with integer ops (identical on the GPU and
    in the CPU interpreter, whose float cast truncates); ±inf stay ±inf, a NaN becomes the
    canonical bf16 NaN — the rounding add would overflow a NaN's bits (0x7FFFFFFF, what the
    GPU's arithmetic makes) into 0x8000, a flagged −0.0 norm that decodes finite."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x == x, r, 0x7FC0)
    return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bound_tree(preds, bounds, J: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                STRIDE: tl.constexpr, OFF: tl.constexpr):
    """Binary search step K's boundary ``bounds[m·STRIDE + OFF]``, ``m`` the K decisions so far
    (``preds[0]`` its most significant bit; ``M`` = the bits fixed above level J): a tree of
    2**K − 1 register selects over scalar (uniform) loads, each selecting on a decision
    itself — no per-element gather (whose tile Triton converts through shared memory into the
    tensor-core accumulator layout) and no integer compares."""
    if J == K:
        return tl.load(bounds + M * STRIDE + OFF)
    else:
        a = _bound_tree(preds, bounds, J + 1, K, 2 * M, STRIDE, OFF)
        b = _bound_tree(preds, bounds, J + 1, K, 2 * M + 1, STRIDE, OFF)
        return tl.where(preds[J], b, a)


@triton.jit
def _codes(y, inv, cols, bounds, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
           BITS: tl.constexpr, BLOCK_T: tl.constexpr, CH: tl.constexpr):
    """Lloyd-Max codes int32 [T, CH] of rotated coordinates ``y`` (columns ``cols``) scaled by
    ``inv`` = sqrt(d)/n: branch-free binary search over the 2**BITS − 1 sorted boundaries,
    code = #{b_j < z}; 0 at padding columns. Up to 5 bits each step's boundary comes from a
    select tree over scalars (:func:`_bound_tree`); 6-8 bits gather it from memory."""
    z = y * inv[:, None]
    code = tl.zeros([BLOCK_T, CH], dtype=tl.int32)
    preds = ()
    for step in tl.static_range(BITS):
        if BITS <= 5 and _SEARCH_TREE:
            bnd = _bound_tree(preds, bounds, 0, step, 0, 2 << (BITS - 1 - step),
                              (1 << (BITS - 1 - step)) - 1)
        else:
            bnd = tl.load(bounds + code + (1 << (BITS - 1 - step)) - 1)
        d = bnd < z
        preds = preds + (d,)
        code = tl.where(d, code + (1 << (BITS - 1 - step)), code)
    if HEAD_DIM < D_PAD:   # padding coordinates (planar chunks mix them into any chunk)
        code = tl.where((cols < HEAD_DIM)[None, :], code, 0)
    return code, preds


@triton.jit
def _centroid(code, preds, cols, table, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
              BITS: tl.constexpr):
    """``table[code]`` (the scaled centroid of each code, 0 at padding columns): up to 5 bits
    a select tree over scalars on the search's decisions ``preds`` (2**BITS − 1 selects, no
    gather and its layout conversion), else a gather."""
    if BITS <= 5 and _SEARCH_TREE:
        t = _bound_tree(preds, table, 0, BITS, 0, 1, 0)
    else:
        t = tl.load(table + code)
    if HEAD_DIM < D_PAD:
        t = tl.where((cols < HEAD_DIM)[None, :], t, 0.0)
    return t


@triton.jit
def _pack_store(code, cols, valid, cache, row, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
                CODE_BYTES: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr,
                BLOCK_T: tl.constexpr, CH: tl.constexpr, C0: tl.constexpr):
    """Pack codes int32 [T, CH] (natural columns C0..C0+CH) LSB-first and store their bytes
    at byte offset C0*BITS/8 of each valid token's code row (the fallback for planes
    narrower than a tensor-core tile: the groups are formed by a register reshape)."""
    cmask = cols < HEAD_DIM
    if BITS == 8:
        tl.store(cache + row[:, None] + cols[None, :], code.to(tl.uint8),
                 mask=valid[:, None] & cmask[None, :])
    else:
        NG: tl.constexpr = CH // GROUP
        if GROUP * BITS <= 32:   # 2/3/4 bits: the group word fits 32 bits (half the registers)
            WT: tl.constexpr = tl.int32
        else:                    # 5/6/7 bits: 40/48/56-bit group words
            WT: tl.constexpr = tl.int64
        c3 = tl.reshape(code.to(WT), (BLOCK_T, NG, GROUP))
        shifts = (tl.arange(0, GROUP) * BITS).to(WT)
        word = tl.sum(c3 << shifts[None, None, :], axis=2)          # [T, NG]
        _store_words(word, C0 // GROUP, valid, cache, row, CODE_BYTES, GROUP_BYTES, NG)


@triton.jit
def _store_words(word, G0, valid, cache, row, CODE_BYTES: tl.constexpr,
                 GROUP_BYTES: tl.constexpr, NG: tl.constexpr):
    """Store group words [T, NG] (groups G0..G0+NG of each token's codes, LSB-first) as their
    GROUP_BYTES bytes each (bytes past CODE_BYTES — padding groups — not written)."""
    gidx = G0 + tl.arange(0, NG)
    for k in tl.static_range(GROUP_BYTES):
        byte = ((word >> (8 * k)) & 0xFF).to(tl.uint8)
        bidx = gidx * GROUP_BYTES + k
        tl.store(cache + row[:, None] + bidx[None, :], byte,
                 mask=valid[:, None] & (bidx < CODE_BYTES)[None, :])


@triton.jit
def _norm_inv(ss, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(n, sqrt(d)/n)`` of squared norms ``ss`` [T] (``inv`` 0 where n = 0)."""
    n = tl.sqrt_rn(ss)
    sqrt_d = tl.full([BLOCK_T], math.sqrt(HEAD_DIM), tl.float32)
    return n, tl.where(n > 0, tl.div_rn(sqrt_d, tl.where(n > 0, n, 1.0)), 0.0)


@triton.jit
def _norm_corrected(n, usq):
    """Key norm correction: store ``n / ‖c[code]/sqrt(d)‖`` (``usq`` = Σ c[code]²) so that
    ``‖x̂‖ = ‖x‖`` (the codec's ``norm_correction``)."""
    return tl.div_rn(n, tl.maximum(tl.sqrt_rn(usq), 1e-12))


@triton.jit
def _chunk_cols(s, p, NPL: tl.constexpr, WID: tl.constexpr, CHW: tl.constexpr):
    """Chunk (sub-chunk ``s``, plane ``p``): its columns of ``A`` (planar order when NPL > 1:
    plane p holds coordinates NPL·j + p) and their natural coordinates, both [CHW]."""
    j = s * CHW + tl.arange(0, CHW)
    return p * WID + j, j * NPL + p


@triton.jit
def _rotated_chunk(x, A, a_scale, q, coord, valid, MU_ROT, mu_off, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, SPLIT: tl.constexpr, SUB_MU: tl.constexpr):
    """Columns ``q`` of ``x @ A`` (float32 ``[T, CHW]``), minus the rotated key offset at
    coordinates ``coord`` when ``SUB_MU``. ``SPLIT``: ``A`` holds the three 16-bit terms of
    :meth:`TkvLoader.store_rotation` (``SPLIT`` = 2: times the power of two ``a_scale``) and
    ``x`` is in their dtype — three plain dots, smallest term first; else ``A`` and ``x`` are
    float32, one ``tf32x3`` dot (Triton splits both operands in every program)."""
    a = A + tl.arange(0, D_PAD)[:, None] * D_PAD + q[None, :]
    if SPLIT:
        y = tl.dot(x, tl.load(a + 2 * D_PAD * D_PAD))
        y = tl.dot(x, tl.load(a + D_PAD * D_PAD), y)
        y = tl.dot(x, tl.load(a), y)
        if SPLIT == 2:   # fp16 terms: A was scaled by a power of two into fp16's range
            y = y * a_scale
    else:
        y = tl.dot(x, tl.load(a), input_precision="tf32x3")
    if SUB_MU:   # R((x − μ)/s) = x @ A − μ @ A
        mu = tl.load(MU_ROT + mu_off + coord, mask=coord < HEAD_DIM, other=0.0)
        y = tl.where(valid[:, None], y - mu[None, :], 0.0)
    return y


@triton.jit
def _centroid_sums(y, inv, coord, bounds, table, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BITS: tl.constexpr, BLOCK_T: tl.constexpr, CHW: tl.constexpr):
    """Per-token ``(Σ t², Σ t·y)`` over one chunk, ``t = c[code]/sqrt(d)`` the centroids the
    chunk's rotated coordinates ``y`` quantize to (``inv`` = sqrt(d)/n), and those codes
    (int32 ``[T, CHW]``; unused — and compiled away — where the caller recomputes them)."""
    code, preds = _codes(y, inv, coord, bounds, HEAD_DIM, D_PAD, BITS, BLOCK_T, CHW)
    t = _centroid(code, preds, coord, table, HEAD_DIM, D_PAD, BITS)
    return tl.sum(t * t, axis=1), tl.sum(t * y, axis=1), code


@triton.jit
def _pack_pass(xop, A, a_scale, valid, MU_ROT, mu_off, SHIFT, pick, inv, bounds, table, cache, row,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr,
               CODE_BYTES: tl.constexpr, NORM_CORR: tl.constexpr, GROUP: tl.constexpr,
               GROUP_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr,
               SUB_MU: tl.constexpr, SINK: tl.constexpr, NPL: tl.constexpr, WID: tl.constexpr,
               CHW: tl.constexpr, WT: tl.constexpr):
    """Rotate, quantize and store every column chunk of one side's tile; returns Σ c[code]²
    per token when ``NORM_CORR`` (else 0). ``SINK``: rows where ``pick`` is set are coded as
    ``y − SHIFT`` (the sink candidate, ``SHIFT`` the head's row of the rotated shift); ``inv``
    = sqrt(d)/n per row of the candidate being coded. Planar chunks (``NPL`` > 1) OR their
    codes into one group word per sub-chunk, stored once; natural order packs each chunk."""
    usq = tl.zeros([BLOCK_T], tl.float32)
    for s in tl.static_range(WID // CHW):
        word = tl.zeros([BLOCK_T, CHW], WT)
        for p in tl.static_range(NPL):
            q, coord = _chunk_cols(s, p, NPL, WID, CHW)
            y = _rotated_chunk(xop, A, a_scale, q, coord, valid, MU_ROT, mu_off, HEAD_DIM, D_PAD,
                               SPLIT, SUB_MU)
            if SINK:
                y = tl.where(pick[:, None], y - tl.load(SHIFT + coord)[None, :], y)
            code, preds = _codes(y, inv, coord, bounds, HEAD_DIM, D_PAD, BITS, BLOCK_T, CHW)
            if NORM_CORR:
                t = _centroid(code, preds, coord, table, HEAD_DIM, D_PAD, BITS)
                usq += tl.sum(t * t, axis=1)
            if NPL > 1:
                word = word | (code.to(WT) << (p * BITS))
            else:
                _pack_store(code, coord, valid, cache, row, HEAD_DIM, BITS, CODE_BYTES, GROUP,
                            GROUP_BYTES, BLOCK_T, CHW, s * CHW)
        if NPL > 1:
            _store_words(word, s * CHW, valid, cache, row, CODE_BYTES, GROUP_BYTES, CHW)
    return usq


@triton.jit
def _sink_choice(n, nb, ua, ca, ub, cb, ss, ssb, NORM_CORR: tl.constexpr):
    """The codec's sink-offset choice per token: ``(pick, n, nb)`` — ``pick`` where candidate
    b (coded against the sink offset) has the smaller rotated reconstruction error at its
    bf16 norm (ties and NaN b errors: a). ``ua``/``ub`` = Σ t², ``ca``/``cb`` = Σ t·y of each
    candidate's centroids t, ``ss``/``ssb`` its ‖y‖²; ``n``/``nb`` come back norm-corrected
    when ``NORM_CORR``."""
    if NORM_CORR:
        n = _norm_corrected(n, ua)
        nb = _norm_corrected(nb, ub)
    ha = _bf16_rne(n).to(tl.float32)
    hb = _bf16_rne(nb).to(tl.float32)
    ea = ha * ha * ua - 2.0 * ha * ca + ss          # ‖n̂·c[code] − y‖², expanded
    eb = hb * hb * ub - 2.0 * hb * cb + ssb
    pick = (eb < ea) | ((ea != ea) & (eb == eb))
    return pick, n, nb


@triton.jit
def _flagged_norm(pick, n, nb):
    """The stored bf16 norm: ``nb`` with its sign BIT set where ``pick``, else ``n``. The bit
    is set on the bf16 pattern: Triton's ``-x`` is ``0 − x``, which turns a flagged zero norm
    (x exactly σ) into +0.0 and would drop the flag."""
    bits = _bf16_rne(tl.where(pick, nb, n)).to(tl.int16, bitcast=True).to(tl.int32)
    bits = tl.where(pick, bits | 0x8000, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _butterfly_codes(xf, inv_s, ss, n, inv, valid, head, offs_d, W, bounds, table, SHIFT, DELTA,
                     cache, row, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
                     CODE_BYTES: tl.constexpr, NORM_CORR: tl.constexpr, GROUP: tl.constexpr,
                     GROUP_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, SINK: tl.constexpr,
                     LOG2D: tl.constexpr):
    """``rotation="wht"``: one side's tile rotated by ``LOG2D`` radix-2 butterfly stages in
    float32 registers — ``y = (w ⊙ (x − μ)) @ H`` (``W`` the loader's store Hadamard
    weights: signs, ``1/s`` and ``1/√d``) in natural coordinate order, no ``d × d`` operand
    read per program — then quantized, packed (natural order: groups by a register reshape)
    and stored. ``xf`` = x − μ (float32, masked rows 0), ``inv_s`` = 1/s ``[1, d]``, ``ss`` =
    ‖(x − μ)/s‖², ``(n, inv)`` its norm and sqrt(d)/n. Returns the bf16 norm to store
    (sink-flagged)."""
    y = xf * tl.load(W + offs_d)[None, :]
    for s in tl.static_range(LOG2D):
        y = hadamard_stage(y, BLOCK_T, HEAD_DIM, 1 << s)
    if SINK:   # both candidates at once: the whole rotated tile is in registers
        ua, ca, code = _centroid_sums(y, inv, offs_d, bounds, table, HEAD_DIM, HEAD_DIM, BITS,
                                      BLOCK_T, HEAD_DIM)
        xb = (xf - tl.load(DELTA + head * HEAD_DIM + offs_d)[None, :]) * inv_s   # (x − σ)/s
        ssb = tl.sum(xb * xb, axis=1)
        nb, invb = _norm_inv(ssb, HEAD_DIM, BLOCK_T)
        yb = y - tl.load(SHIFT + head * HEAD_DIM + offs_d)[None, :]
        ub, cb, code_b = _centroid_sums(yb, invb, offs_d, bounds, table, HEAD_DIM, HEAD_DIM,
                                        BITS, BLOCK_T, HEAD_DIM)
        pick, n, nb = _sink_choice(n, nb, ua, ca, ub, cb, ss, ssb, NORM_CORR)
        code = tl.where(pick[:, None], code_b, code)
        norm16 = _flagged_norm(pick, n, nb)
    else:
        code, preds = _codes(y, inv, offs_d, bounds, HEAD_DIM, HEAD_DIM, BITS, BLOCK_T, HEAD_DIM)
        if NORM_CORR:
            t = _centroid(code, preds, offs_d, table, HEAD_DIM, HEAD_DIM, BITS)
            n = _norm_corrected(n, tl.sum(t * t, axis=1))
        norm16 = _bf16_rne(n)
    _pack_store(code, offs_d, valid, cache, row, HEAD_DIM, BITS, CODE_BYTES, GROUP, GROUP_BYTES,
                BLOCK_T, HEAD_DIM, 0)
    return norm16


@triton.jit
def _matmul_codes(x, xf, inv_s, ss, n, inv, valid, head, offs_d, A, a_scale, bounds, table, MU_ROT,
                  mu_sh, SHIFT, DELTA, cache, row, HAS_MU: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, BITS: tl.constexpr, CODE_BYTES: tl.constexpr,
                  NORM_CORR: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr,
                  BLOCK_T: tl.constexpr, CH: tl.constexpr, SINK: tl.constexpr,
                  SPLIT: tl.constexpr, NPL: tl.constexpr):
    """``rotation="split"`` / ``"tf32x3"``: the rotation as tensor-core products ``x @ A``,
    one column chunk at a time (:func:`_pack_pass`), each chunk quantized and packed as it
    leaves the tensor cores. Arguments as :func:`_butterfly_codes` plus ``x`` (as loaded) and
    ``A`` (:meth:`TkvLoader.store_rotation`). Returns the bf16 norm to store."""
    if SPLIT:   # x as stored (16-bit: an exact operand); μ comes off after the rotation
        xop = x.to(A.dtype.element_ty)
    else:
        xop = xf
    SUB_MU: tl.constexpr = SPLIT > 0 and HAS_MU
    mu_off = head * mu_sh
    WID: tl.constexpr = D_PAD // NPL
    CHW: tl.constexpr = CH if CH < WID else WID
    if GROUP * BITS <= 32:
        WT: tl.constexpr = tl.int32
    else:
        WT: tl.constexpr = tl.int64
    if SINK:
        # two candidates: y_a = R((x − μ)/s) and y_b = R((x − σ)/s) = y_a − c_h (SHIFT row h);
        # keep the one with the smaller reconstruction error at its bf16 norm (ties and NaN
        # y_b errors: y_a), flag y_b by the norm's sign bit (the codec's quantize). Pass 1:
        # the per-token sums of both errors; pass 2: the winner's codes, recomputed, packed.
        xb = (xf - tl.load(DELTA + head * D_PAD + offs_d)[None, :]) * inv_s   # (x − σ) / s
        ssb = tl.sum(xb * xb, axis=1)
        nb, invb = _norm_inv(ssb, HEAD_DIM, BLOCK_T)
        ua = tl.zeros([BLOCK_T], tl.float32)
        ca = tl.zeros([BLOCK_T], tl.float32)
        ub = tl.zeros([BLOCK_T], tl.float32)
        cb = tl.zeros([BLOCK_T], tl.float32)
        for s in tl.static_range(WID // CHW):
            for p in tl.static_range(NPL):
                q, coord = _chunk_cols(s, p, NPL, WID, CHW)
                y = _rotated_chunk(xop, A, a_scale, q, coord, valid, MU_ROT, mu_off, HEAD_DIM, D_PAD,
                                   SPLIT, SUB_MU)
                u, c, _ = _centroid_sums(y, inv, coord, bounds, table, HEAD_DIM, D_PAD, BITS,
                                         BLOCK_T, CHW)
                ua += u
                ca += c
                yb = y - tl.load(SHIFT + head * D_PAD + coord)[None, :]
                u, c, _ = _centroid_sums(yb, invb, coord, bounds, table, HEAD_DIM, D_PAD, BITS,
                                         BLOCK_T, CHW)
                ub += u
                cb += c
        pick, n, nb = _sink_choice(n, nb, ua, ca, ub, cb, ss, ssb, NORM_CORR)
        _pack_pass(xop, A, a_scale, valid, MU_ROT, mu_off, SHIFT + head * D_PAD, pick,
                   tl.where(pick, invb, inv), bounds, table, cache, row, HEAD_DIM, D_PAD, BITS,
                   CODE_BYTES, False, GROUP, GROUP_BYTES, BLOCK_T, SPLIT, SUB_MU, True, NPL,
                   WID, CHW, WT)
        norm16 = _flagged_norm(pick, n, nb)
    else:
        usq = _pack_pass(xop, A, a_scale, valid, MU_ROT, mu_off, SHIFT, valid, inv, bounds, table, cache,
                         row, HEAD_DIM, D_PAD, BITS, CODE_BYTES, NORM_CORR, GROUP, GROUP_BYTES,
                         BLOCK_T, SPLIT, SUB_MU, False, NPL, WID, CHW, WT)
        if NORM_CORR:
            n = _norm_corrected(n, usq)
        norm16 = _bf16_rne(n)
    return norm16


@triton.jit
def _store_side(X, sx_t, sx_h, tok, valid, head, cache, aux, A, a_scale, INV_S, bounds, table, MU,
                MU_ROT, mu_sh, blk, off, page_bytes, SHIFT, DELTA, HAS_MU: tl.constexpr,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr,
                CODES_OFF: tl.constexpr, NORMS_OFF: tl.constexpr, CODE_BYTES: tl.constexpr,
                NORM_CORR: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr,
                BLOCK_T: tl.constexpr, HEAD_STRIDE: tl.constexpr, TOK_STRIDE: tl.constexpr,
                NORM_HEAD_STRIDE: tl.constexpr, CH: tl.constexpr, SINK: tl.constexpr,
                SPLIT: tl.constexpr, NPL: tl.constexpr, LOG2D: tl.constexpr):
    """One side (K or V) of BLOCK_T tokens of one KV head. The norm comes from the
    pre-rotation vector (``‖R v‖ = ‖v‖``, R orthogonal), so each column chunk of the rotation
    is quantized and packed as soon as it is computed (no rotated tile is kept). With
    ``NPL`` > 1 the chunks run over the code-group planes (``A`` in planar column order) and a
    group's codes are OR-ed into one word in registers; NPL = 1: natural order, the groups
    formed by ``_pack_store``'s reshape. ``SPLIT`` = 3 (``rotation="wht"``): ``A`` is the
    float32 Hadamard weight vector and :func:`_butterfly_codes` rotates the whole tile."""
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < HEAD_DIM
    x = tl.load(X + tok.to(tl.int64)[:, None] * sx_t + head * sx_h + offs_d[None, :],
                mask=valid[:, None] & dmask[None, :], other=0.0)
    xf = x.to(tl.float32)
    if HAS_MU:  # key centering (float32 rows of MU and MU_ROT; mu_sh = 0: one μ for all heads)
        mu = tl.load(MU + head * mu_sh + offs_d, mask=dmask, other=0.0)
        xf = tl.where(valid[:, None] & dmask[None, :], xf - mu[None, :], 0.0)
    inv_s = tl.load(INV_S + offs_d)[None, :]
    xs = xf * inv_s                                                  # (x − μ) / s
    ss = tl.sum(xs * xs, axis=1)                                     # ‖R((x − μ)/s)‖²
    n, inv = _norm_inv(ss, HEAD_DIM, BLOCK_T)
    row = blk * page_bytes + CODES_OFF + head * HEAD_STRIDE + off * TOK_STRIDE
    nidx = (blk * page_bytes + NORMS_OFF) // 2 + head * NORM_HEAD_STRIDE + off
    if SPLIT == 3:   # butterflies: x − μ rotated in float32 registers (HEAD_DIM = D_PAD = 2^k)
        norm16 = _butterfly_codes(xf, inv_s, ss, n, inv, valid, head, offs_d, A, bounds, table,
                                  SHIFT, DELTA, cache, row, HEAD_DIM, BITS, CODE_BYTES,
                                  NORM_CORR, GROUP, GROUP_BYTES, BLOCK_T, SINK, LOG2D)
    else:
        norm16 = _matmul_codes(x, xf, inv_s, ss, n, inv, valid, head, offs_d, A, a_scale, bounds,
                               table, MU_ROT, mu_sh, SHIFT, DELTA, cache, row, HAS_MU, HEAD_DIM,
                               D_PAD, BITS, CODE_BYTES, NORM_CORR, GROUP, GROUP_BYTES, BLOCK_T,
                               CH, SINK, SPLIT, NPL)
    tl.store(aux + nidx, norm16, mask=valid)


# num_tokens changes with every eager batch, and a caller may pass slot_mapping as a slice at
# any offset: no specialization on either (one variant per width pair, compiled at the first
# call; see prefill._VARYING_INTS). num_tokens only masks tokens; slots are read once.
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slots"])
def _compress_store_kernel(
        K, skt, skh, V, svt, svh, slots, num_tokens, num_slots, cache, aux,
        Ak, Av, ak_scale, av_scale, kinv_s, vinv_s, kbounds, vbounds, ktable, vtable, kmu, kmu_rot,
        kmu_sh, page_bytes, kshift, vshift, kdelta, vdelta,
        K_HAS_MU: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        K_BITS: tl.constexpr, K_CODES_OFF: tl.constexpr, K_NORMS_OFF: tl.constexpr,
        K_CODE_BYTES: tl.constexpr, K_NORM_CORR: tl.constexpr, K_GROUP: tl.constexpr,
        K_GROUP_BYTES: tl.constexpr,
        V_BITS: tl.constexpr, V_CODES_OFF: tl.constexpr, V_NORMS_OFF: tl.constexpr,
        V_CODE_BYTES: tl.constexpr, V_NORM_CORR: tl.constexpr, V_GROUP: tl.constexpr,
        V_GROUP_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, K_HEAD_STRIDE: tl.constexpr,
        K_TOK_STRIDE: tl.constexpr, V_HEAD_STRIDE: tl.constexpr, V_TOK_STRIDE: tl.constexpr,
        NORM_HEAD_STRIDE: tl.constexpr, CH: tl.constexpr, K_SINK: tl.constexpr,
        V_SINK: tl.constexpr, K_SPLIT: tl.constexpr, V_SPLIT: tl.constexpr,
        K_NPL: tl.constexpr, V_NPL: tl.constexpr, LOG2D: tl.constexpr):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    side = tl.program_id(2)   # 0: K, 1: V — separate programs: half the dependent chain each
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = tok < num_tokens
    slot = tl.load(slots + tok, mask=tm, other=-1)
    valid = tm & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    if side == 0:
        _store_side(K, skt, skh, tok, valid, head, cache, aux, Ak, ak_scale, kinv_s, kbounds,
                    ktable, kmu, kmu_rot, kmu_sh, blk, off, page_bytes, kshift, kdelta, K_HAS_MU,
                    HEAD_DIM, D_PAD, K_BITS, K_CODES_OFF, K_NORMS_OFF, K_CODE_BYTES, K_NORM_CORR,
                    K_GROUP, K_GROUP_BYTES, BLOCK_T, K_HEAD_STRIDE, K_TOK_STRIDE,
                    NORM_HEAD_STRIDE, CH, K_SINK, K_SPLIT, K_NPL, LOG2D)
    else:
        _store_side(V, svt, svh, tok, valid, head, cache, aux, Av, av_scale, vinv_s, vbounds,
                    vtable, kmu, kmu_rot, 0, blk, off, page_bytes, vshift, vdelta, False, HEAD_DIM,
                    D_PAD,
                    V_BITS, V_CODES_OFF, V_NORMS_OFF, V_CODE_BYTES, V_NORM_CORR, V_GROUP,
                    V_GROUP_BYTES, BLOCK_T, V_HEAD_STRIDE, V_TOK_STRIDE, NORM_HEAD_STRIDE, CH,
                    V_SINK, V_SPLIT, V_NPL, LOG2D)


def _store_kernel(kernel, loader, key, value, cache, rotation: str, *, triton_only: bool) -> str:
    """``"cuda"``, ``"auto-cuda"`` (auto chose CUDA: a compile failure falls back) or
    ``"triton"`` for ``compress_store(kernel=...)``.

    Raises:
        ValueError: an unknown ``kernel``. UnsupportedKernelError: ``"cuda"`` for a call the
        CUDA store cannot serve."""
    if kernel is None:
        kernel = cuda_store.STORE_KERNEL
    if kernel not in ("auto", "triton", "cuda"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'cuda', got {kernel!r}")
    if kernel == "auto":
        ok = not triton_only and cuda_store.supported(loader, key, value, cache, rotation)
        return "auto-cuda" if ok else "triton"
    if kernel == "cuda":
        cuda_store.check_supported(loader, key, value, cache, rotation)
    return kernel


def compress_store(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                   slot_mapping: torch.Tensor, loader: TkvLoader, *,
                   block_t: int | None = None, num_warps: int | None = None,
                   chunk: int | None = None, rotation: str = "auto",
                   kernel: str | None = None) -> None:
    """Compress new tokens' K and V and scatter them into their slots, in one launch.

    Per token and KV head h: ``y = R ((x − μ_h) / s)`` (key centering when the codec has a
    ``k_channel_offset`` μ, keys only: row h of a per-head ``(num_kv_heads, head_dim)`` μ, or
    the shared ``(head_dim,)`` μ; prescale; randomized WHT), ``n = ‖y‖`` (taken as
    ``‖(x − μ_h)/s‖`` before the rotation: R is orthogonal), codes = Lloyd-Max bucket of
    ``sqrt(d) · y / n`` (binary search over the boundaries), K norm stored as
    ``n / ‖c[code]/sqrt(d)‖`` when the codec's norm correction is on, codes packed LSB-first —
    the codec's ``compress_k`` / ``compress_v`` up to float32 rounding (a code at a bucket
    boundary, one bf16 ulp of a norm) (TurboQuant, Zandieh et al. 2025, Alg. 1). Design and
    timings: ``docs/kernels.md`` (sessions 9 and 28).

    With sink offsets (the codec's ``k_sink_offset`` / ``v_sink_offset``; the loader's
    ``k_sink_shift`` / ``v_sink_shift`` ``c_h``), each vector is also coded as
    ``y_b = y − c_h`` (relative to the sink offset σ) and the candidate with the smaller
    rotated reconstruction error at its bf16 norm wins; a ``y_b`` winner stores ``−n`` (the
    sign bit is the flag). Same rule as the codec's ``quantize``; near-ties may resolve
    differently under float32 rounding (both candidates are then equally good).

    Args:
        key, value: ``(num_tokens, num_kv_heads, head_dim)`` float16/bfloat16/float32, unit
            stride on head_dim (other strides free, e.g. views of a fused QKV output).
        cache: the layer's uint8 ``(num_blocks, page_bytes)`` cache (``loader.layout``).
        slot_mapping: int64 ``(num_tokens,)``, ``slot = block_id · block_size + offset``;
            ``-1`` (any negative) skips the token; slots ≥ ``num_blocks · block_size`` are
            skipped too (never written out of bounds).
        loader: the layer's :class:`TkvLoader`.
        block_t: tokens per program, a power of two. Default with the butterflies: 8 up to
            256 new tokens, then 16 (32 at head_dim ≥ 256) — H100, K4V4, 8 KV heads, head_dim
            128 (``benchmarks/results/kernels_gpu_2026-12-05_s28_store.md``): 64 tokens 3.9 µs
            at 8, 256 tokens 4.7 µs at 8 (16: 5.1), 16K tokens 99 µs at 16 (32: 137, 64: 123).
            With the matrix rotation: 8 up to 128 new tokens (decode steps: latency-bound,
            more programs), 16 up to 1,024, 64 above (the rotation operand is loaded once per
            64 tokens; H200, ``kernels_gpu_2026-11-30_s9_store_centroids.md``: 16K tokens
            0.160 ms at 64, 0.375 at 16).
        num_warps: Triton warps per program; default 8 for 128+ tokens per program, else 4.
        chunk: rotation columns per tensor-core pass (a power of two ≥ 16): default 64 up to
            head_dim 128, 32 above (registers; planar chunks never exceed one code plane).
        rotation: how ``x @ A`` runs on tensor cores. ``"split"``: the 16-bit ``x`` against
            the loader's three terms of ``A`` in its dtype (:meth:`TkvLoader.store_rotation`),
            float32 accuracy from three plain 16-bit dots; ``"tf32x3"``: ``x`` in float32, one
            ``tf32x3`` dot (Triton splits ``x`` and the ``A`` tile into tf32 pieces in every
            program: 1.9-3.6× slower at prefill sizes); ``"wht"``: no matrix — the rotation
            as ``log2(head_dim)`` radix-2 Walsh–Hadamard butterfly stages on the whole tile in
            float32 registers (``(w ⊙ (x − μ)) @ H``, :attr:`TkvLoader.k_store_hadamard`), in
            the codec's order of operations (μ off before the rotation), any input dtype;
            only where the rotation is a pure power-of-two Hadamard (head_dim a power of two
            ≥ 16), else ValueError. It reads no ``d × d`` operand per program (the matrix
            paths read 3 × 32 KB of ``A`` per side at head_dim 128 from L2): on an H100 1.3-2.3×
            the ``"split"`` path at every size (session 28, ``docs/kernels.md``).
            ``"auto"`` (default): ``"wht"`` where the rotation is a pure power-of-two
            Hadamard, else ``"split"`` for bfloat16 / float16 sides and ``"tf32x3"`` for
            float32; the operator's ``TKV_STORE_ROTATION=matrix``
            (:func:`store_rotation_from_env`) keeps the matrix paths.
        kernel: ``"triton"``, ``"cuda"`` (the hand-written store of
            :mod:`tkv.kernels.cuda_store`: the ``"wht"`` computation, head_dim 64/128/256,
            16-byte aligned K/V rows; refused calls raise UnsupportedKernelError) or
            ``"auto"`` (the CUDA store wherever it applies and none of ``block_t``,
            ``num_warps``, ``chunk`` is given; Triton otherwise, and with one RuntimeWarning
            if the CUDA store cannot be compiled). None (default): ``TKV_STORE_KERNEL``
            (:func:`~tkv.kernels.cuda_store.store_kernel_from_env`, default ``auto`` since
            session 35: the CUDA store is 2.2-2.8× faster at 16K tokens on an H100 and won
            the 36-layer engine-like step at 64 and 256 sequences).

    Values are not checked for NaN / ±inf (that would read them back to the host, a device
    sync inside every layer of a CUDA graph): a non-finite K/V element stores a non-finite
    norm, and attention over that token is NaN — loud downstream, where the codec's
    ``compress_k`` raises NonFiniteError at once. Likewise a vector beyond ~1.8e19 in norm
    (float32 Σx² overflows) stores an inf norm. At the other end Σx² underflows: a vector
    below ~1e-22 in norm loses its norm's precision and below ~1e-24 stores a norm of 0
    (decodes to its offset); the codec rescales such vectors (``compress_k``), the kernel
    does not (an extra pass per row for vectors far below any model's activations).

    Raises:
        DtypeError, ShapeError, DeviceMismatchError on malformed inputs (checked on the host,
        no device sync). UnsupportedKernelError: ``kernel="cuda"`` outside the CUDA store's
        scope. CudaCompileError: ``kernel="cuda"`` and the CUDA store did not compile.
        ValueError: unknown ``kernel`` or ``rotation``, ``"split"`` with a float32 side, or
        ``"wht"`` where the rotation is not a pure power-of-two Hadamard. A ``TKV_*``
        setting refused at import (its named error, e.g. StoreRotationConfigError).
    """
    check_import_settings()
    if not isinstance(loader, TkvLoader):
        raise TypeError(f"compress_store needs a TkvLoader, got {type(loader).__name__}")
    num_blocks = loader.check_cache(cache)
    lay = loader.layout
    for name, x in (("key", key), ("value", value)):
        check_tensor(x, name, 3)
        check_dtype(x, name, _FLOAT)
        if tuple(x.shape[1:]) != (lay.num_kv_heads, lay.head_dim):
            raise ShapeError(f"{name} must be (num_tokens, {lay.num_kv_heads}, {lay.head_dim}),"
                             f" got {tuple(x.shape)}")
        check_last_dim_contiguous(x, name)
    if key.shape[0] != value.shape[0]:
        raise ShapeError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    check_int_tensor(slot_mapping, "slot_mapping", torch.int64, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{key.shape[0]} tokens")
    check_same_device(cache.device, key=key, value=value, slot_mapping=slot_mapping,
                      tables=loader.k_table)
    n = key.shape[0]
    st = lay.strides()
    rotation = store_rotation_for(rotation, loader)
    kernel = _store_kernel(kernel, loader, key, value, cache, rotation,
                           triton_only=block_t is not None or num_warps is not None
                           or chunk is not None)
    if kernel != "triton":
        if n:
            try:
                cuda_store.launch(key, value, cache, slot_mapping, num_blocks, loader)
                return
            except CudaCompileError as err:
                if kernel == "cuda":
                    raise
                _nvrtc.warn_fallback("store", "TKV_STORE_KERNEL", err)   # auto: Triton below
        else:
            return
    if block_t is None:
        if rotation == "wht":   # H100 sweep, session 28: 8 to 256 tokens, then 16 (32 at d 256)
            block_t = 8 if n <= 256 else 32 if loader.d_pad >= 256 else 16
        else:
            block_t = 8 if n <= 128 else 16 if n <= 1024 else 64
    if num_warps is None:
        num_warps = 8 if block_t >= 128 else 4
    if chunk is None:
        chunk = 64 if loader.d_pad <= 128 else 32
    for name, val, lo in (("block_t", block_t, 1), ("chunk", chunk, 16), ("num_warps", num_warps, 1)):
        check_pow2(val, name, lo)
    modes, operands = [], []   # the kernel's K_SPLIT / V_SPLIT per side
    for name, x in (("key", key), ("value", value)):
        if rotation == "wht":
            w = loader.k_store_hadamard if name == "key" else loader.v_store_hadamard
            if w is None:
                raise ValueError(
                    f"rotation='wht' needs a pure power-of-two Hadamard rotation (head_dim a "
                    f"power of two >= 16), got head_dim {lay.head_dim}; use 'auto'")
            modes.append(_BUTTERFLIES)
            operands.append((w, 1.0))
            continue
        half = x.dtype in (torch.bfloat16, torch.float16)
        split = half if rotation == "auto" else rotation == "split"
        if split and not half:
            raise ValueError(f"rotation='split' needs bfloat16/float16 {name}, got {x.dtype}")
        modes.append(_TF32X3 if not split else _FP16_TERMS if x.dtype == torch.float16
                     else _BF16_TERMS)
        operands.append(loader.store_rotation(name[0], x.dtype if split else None))
    if n == 0:   # after every argument check: a bad call fails on an empty batch too
        return
    kg, kgb = code_group(lay.k_bits)
    vg, vgb = code_group(lay.v_bits)
    mu = loader.k_mu             # (1 or num_kv_heads, d_pad) or None; so is mu_rot
    mu_sh = 0 if mu is None or mu.shape[0] == 1 else loader.d_pad
    dummy = loader.k_table

    def opt(t):
        return dummy if t is None else t

    grid = (triton.cdiv(n, block_t), lay.num_kv_heads, 2)
    _compress_store_kernel[grid](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
        slot_mapping, n, num_blocks * lay.block_size, cache, cache.view(torch.bfloat16),
        operands[0][0], operands[1][0], operands[0][1], operands[1][1],
        loader.k_inv_scale, loader.v_inv_scale, loader.k_bounds, loader.v_bounds,
        loader.k_table, loader.v_table, opt(mu), opt(loader.k_mu_rot), mu_sh,
        lay.page_bytes, opt(loader.k_sink_shift), opt(loader.v_sink_shift),
        opt(loader.k_sink_delta), opt(loader.v_sink_delta),
        K_HAS_MU=mu is not None, HEAD_DIM=lay.head_dim, D_PAD=loader.d_pad, BLOCK_SIZE=lay.block_size,
        K_BITS=lay.k_bits, K_CODES_OFF=lay.k_codes_offset, K_NORMS_OFF=lay.k_norms_offset,
        K_CODE_BYTES=lay.k_code_bytes, K_NORM_CORR=loader.k_norm_correction, K_GROUP=kg,
        K_GROUP_BYTES=kgb,
        V_BITS=lay.v_bits, V_CODES_OFF=lay.v_codes_offset, V_NORMS_OFF=lay.v_norms_offset,
        V_CODE_BYTES=lay.v_code_bytes, V_NORM_CORR=loader.v_norm_correction, V_GROUP=vg,
        V_GROUP_BYTES=vgb, BLOCK_T=block_t, K_HEAD_STRIDE=st["k_head"],
        K_TOK_STRIDE=st["k_token"], V_HEAD_STRIDE=st["v_head"], V_TOK_STRIDE=st["v_token"],
        NORM_HEAD_STRIDE=st["norm_head"], CH=min(loader.d_pad, chunk),
        K_SINK=loader.k_sink_shift is not None, V_SINK=loader.v_sink_shift is not None,
        K_SPLIT=modes[0], V_SPLIT=modes[1], K_NPL=loader.group_planes("k"),
        V_NPL=loader.group_planes("v"), LOG2D=loader.d_pad.bit_length() - 1,
        num_warps=num_warps)
