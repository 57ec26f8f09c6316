"""Fused compress + store: rotate, norm, quantize, pack and scatter new K/V into the paged
tkv cache in one launch (no intermediate tensor through HBM)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tkv.codec.errors import ShapeError
from tkv.codec.packing import code_group

from ._util import (
    check_dtype,
    check_int_tensor,
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
)
from .loaders import TkvLoader

__all__ = ["compress_store"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _bf16_rne(x):
    """float32 → bfloat16, round to nearest even, with integer ops (identical on the GPU and
    in the CPU interpreter, whose float cast truncates). x finite."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _codes(y, inv, cols, bounds, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
           BLOCK_T: tl.constexpr, CH: tl.constexpr):
    """Lloyd-Max codes int32 [T, CH] of rotated coordinates ``y`` (columns ``cols``) scaled by
    ``inv`` = sqrt(d)/n: branch-free lower bound over the 2**BITS − 1 sorted boundaries,
    code = #{b_j < z}; 0 at padding columns."""
    z = y * inv[:, None]
    code = tl.zeros([BLOCK_T, CH], dtype=tl.int32)
    for step in tl.static_range(BITS):
        half = 1 << (BITS - 1 - step)
        cand = code + half
        bnd = tl.load(bounds + cand - 1)
        code = tl.where(bnd < z, cand, code)
    return tl.where((cols < HEAD_DIM)[None, :], code, 0)


@triton.jit
def _quant_pack(y, inv, cols, valid, cache, row, bounds, table, HEAD_DIM: tl.constexpr,
                BITS: tl.constexpr, CODE_BYTES: tl.constexpr, NORM_CORR: tl.constexpr,
                GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr, BLOCK_T: tl.constexpr,
                CH: tl.constexpr, C0: tl.constexpr):
    """Quantize rotated coordinates ``y`` [T, CH] (columns C0..C0+CH) and store their packed
    bytes (byte offset C0*BITS/8; CH*BITS is a multiple of 8). Returns sum of c[code]^2."""
    cmask = cols < HEAD_DIM
    code = _codes(y, inv, cols, bounds, HEAD_DIM, BITS, BLOCK_T, CH)
    usq = tl.zeros([BLOCK_T], tl.float32)
    if NORM_CORR:
        c = tl.load(table + code)
        c = tl.where(cmask[None, :], c, 0.0)
        usq = tl.sum(c * c, axis=1)
    _pack_store(code, cols, valid, cache, row, HEAD_DIM, BITS, CODE_BYTES, GROUP, GROUP_BYTES,
                BLOCK_T, CH, C0)
    return usq


@triton.jit
def _pack_store(code, cols, valid, cache, row, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
                CODE_BYTES: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr,
                BLOCK_T: tl.constexpr, CH: tl.constexpr, C0: tl.constexpr):
    """Pack codes int32 [T, CH] (columns C0..C0+CH) LSB-first and store their bytes at byte
    offset C0*BITS/8 of each valid token's code row."""
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
        gidx = tl.arange(0, NG)
        for k in tl.static_range(GROUP_BYTES):
            byte = ((word >> (8 * k)) & 0xFF).to(tl.uint8)
            bidx = (C0 * BITS) // 8 + gidx * GROUP_BYTES + k
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
def _candidate(ys, ss, bounds, table, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               BITS: tl.constexpr, NORM_CORR: tl.constexpr, BLOCK_T: tl.constexpr,
               CH: tl.constexpr):
    """One sink-offset candidate (rotated chunks ``ys``, ``ss = ‖y‖²``): ``(n, codes, err)``
    with ``n`` the norm to store (norm-corrected), ``codes`` its per-chunk codes and ``err =
    ‖n̂·c[code] − y‖²`` at the bf16 norm ``n̂`` as stored — the codec's ``_rotated_error``,
    expanded as ``n̂²·Σc² − 2n̂·Σc·y + ‖y‖²`` (per-token sums, no reconstruction kept)."""
    n, inv = _norm_inv(ss, HEAD_DIM, BLOCK_T)
    usq = tl.zeros([BLOCK_T], tl.float32)
    cy = tl.zeros([BLOCK_T], tl.float32)
    codes = ()
    for c in tl.static_range(D_PAD // CH):
        cols = c * CH + tl.arange(0, CH)
        code = _codes(ys[c], inv, cols, bounds, HEAD_DIM, BITS, BLOCK_T, CH)
        t = tl.where((cols < HEAD_DIM)[None, :], tl.load(table + code), 0.0)
        usq += tl.sum(t * t, axis=1)
        cy += tl.sum(t * ys[c], axis=1)
        codes = codes + (code,)
    if NORM_CORR:
        n = _norm_corrected(n, usq)
    nb = _bf16_rne(n).to(tl.float32)
    return n, codes, nb * nb * usq - 2.0 * nb * cy + ss


@triton.jit
def _store_side(X, sx_t, sx_h, tok, valid, head, cache, aux, A, bounds, table, MU, mu_sh, blk, off,
                page_bytes, SHIFT, HAS_MU: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr,
                CODES_OFF: tl.constexpr, NORMS_OFF: tl.constexpr, CODE_BYTES: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, NORM_CORR: tl.constexpr, GROUP: tl.constexpr,
                GROUP_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_STRIDE: tl.constexpr,
                TOK_STRIDE: tl.constexpr, NORM_HEAD_STRIDE: tl.constexpr, CH: tl.constexpr,
                SINK: tl.constexpr):
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < HEAD_DIM
    x = tl.load(X + tok.to(tl.int64)[:, None] * sx_t + head * sx_h + offs_d[None, :],
                mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    if HAS_MU:  # key centering: x - mu[head] (float32; mu_sh = 0: one mu shared by all heads)
        mu = tl.load(MU + head * mu_sh + offs_d, mask=dmask, other=0.0)
        x = tl.where(valid[:, None] & dmask[None, :], x - mu[None, :], 0.0)
    page = blk * page_bytes
    row = page + CODES_OFF + head * HEAD_STRIDE + off * TOK_STRIDE
    # rotation by column chunks of CH (the chunk of A is a tf32x3 dot operand held in
    # registers: whole 128x128 tiles spilled), rotated chunks kept for the norm, then quantized
    ys = ()
    ss = tl.zeros([BLOCK_T], tl.float32)
    for c in tl.static_range(D_PAD // CH):
        cols = c * CH + tl.arange(0, CH)
        y = tl.dot(x, tl.load(A + offs_d[:, None] * D_PAD + cols[None, :]),
                   input_precision="tf32x3")                           # R (x / s), [T, CH]
        ss += tl.sum(y * y, axis=1)
        ys = ys + (y,)
    if SINK:
        # two candidates: y_a = R((x − μ)/s) and y_b = R((x − σ)/s) = y_a − c_h (SHIFT row
        # h); keep the one with the smaller reconstruction error (ties and NaN y_b errors:
        # y_a), pack its codes, flag y_b by storing −n (the codec's quantize)
        ysb = ()
        ssb = tl.zeros([BLOCK_T], tl.float32)
        for c in tl.static_range(D_PAD // CH):
            cols = c * CH + tl.arange(0, CH)
            yb = ys[c] - tl.load(SHIFT + head * D_PAD + cols)[None, :]
            ssb += tl.sum(yb * yb, axis=1)
            ysb = ysb + (yb,)
        na, ca, ea = _candidate(ys, ss, bounds, table, HEAD_DIM, D_PAD, BITS, NORM_CORR,
                                BLOCK_T, CH)
        nb, cb, eb = _candidate(ysb, ssb, bounds, table, HEAD_DIM, D_PAD, BITS, NORM_CORR,
                                BLOCK_T, CH)
        pick = (eb < ea) | ((ea != ea) & (eb == eb))
        for c in tl.static_range(D_PAD // CH):
            cols = c * CH + tl.arange(0, CH)
            _pack_store(tl.where(pick[:, None], cb[c], ca[c]), cols, valid, cache, row,
                        HEAD_DIM, BITS, CODE_BYTES, GROUP, GROUP_BYTES, BLOCK_T, CH, c * CH)
        # the flag is the sign BIT, set on the bf16 pattern: Triton's `-x` is `0 − x`, which
        # turns a flagged zero norm (x exactly σ) into +0.0 and would drop the flag
        bits = _bf16_rne(tl.where(pick, nb, na)).to(tl.int16, bitcast=True).to(tl.int32)
        bits = tl.where(pick, bits | 0x8000, bits)
        norm16 = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        n, inv = _norm_inv(ss, HEAD_DIM, BLOCK_T)
        usq = tl.zeros([BLOCK_T], tl.float32)
        for c in tl.static_range(D_PAD // CH):
            cols = c * CH + tl.arange(0, CH)
            usq += _quant_pack(ys[c], inv, cols, valid, cache, row, bounds, table, HEAD_DIM,
                               BITS, CODE_BYTES, NORM_CORR, GROUP, GROUP_BYTES, BLOCK_T, CH,
                               c * CH)
        if NORM_CORR:
            n = _norm_corrected(n, usq)
        norm16 = _bf16_rne(n)
    nidx = (page + NORMS_OFF) // 2 + head * NORM_HEAD_STRIDE + off
    tl.store(aux + nidx, norm16, mask=valid)


@triton.jit
def _compress_store_kernel(
        K, skt, skh, V, svt, svh, slots, num_tokens, num_slots, cache, aux,
        Ak, Av, kbounds, vbounds, ktable, vtable, kmu, kmu_sh, page_bytes, kshift, vshift,
        K_HAS_MU: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        K_BITS: tl.constexpr, K_CODES_OFF: tl.constexpr, K_NORMS_OFF: tl.constexpr,
        K_CODE_BYTES: tl.constexpr, K_NORM_CORR: tl.constexpr, K_GROUP: tl.constexpr,
        K_GROUP_BYTES: tl.constexpr,
        V_BITS: tl.constexpr, V_CODES_OFF: tl.constexpr, V_NORMS_OFF: tl.constexpr,
        V_CODE_BYTES: tl.constexpr, V_NORM_CORR: tl.constexpr, V_GROUP: tl.constexpr,
        V_GROUP_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, K_HEAD_STRIDE: tl.constexpr,
        K_TOK_STRIDE: tl.constexpr, V_HEAD_STRIDE: tl.constexpr, V_TOK_STRIDE: tl.constexpr,
        NORM_HEAD_STRIDE: tl.constexpr, CH: tl.constexpr, K_SINK: tl.constexpr,
        V_SINK: tl.constexpr):
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
        _store_side(K, skt, skh, tok, valid, head, cache, aux, Ak, kbounds, ktable, kmu, kmu_sh,
                    blk, off, page_bytes, kshift, K_HAS_MU, HEAD_DIM, D_PAD, K_BITS, K_CODES_OFF,
                    K_NORMS_OFF, K_CODE_BYTES, BLOCK_SIZE, K_NORM_CORR, K_GROUP, K_GROUP_BYTES,
                    BLOCK_T, K_HEAD_STRIDE, K_TOK_STRIDE, NORM_HEAD_STRIDE, CH, K_SINK)
    else:
        _store_side(V, svt, svh, tok, valid, head, cache, aux, Av, vbounds, vtable, kmu, 0, blk,
                    off, page_bytes, vshift, False, HEAD_DIM, D_PAD, V_BITS, V_CODES_OFF,
                    V_NORMS_OFF, V_CODE_BYTES, BLOCK_SIZE, V_NORM_CORR, V_GROUP, V_GROUP_BYTES,
                    BLOCK_T, V_HEAD_STRIDE, V_TOK_STRIDE, NORM_HEAD_STRIDE, CH, V_SINK)


def compress_store(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                   slot_mapping: torch.Tensor, loader: TkvLoader, *,
                   block_t: int | None = None, num_warps: int = 4,
                   chunk: int | None = None) -> None:
    """Compress new tokens' K and V and scatter them into their slots, in one launch.

    Per token and KV head h: ``y = R ((x − μ_h) / s)`` (key centering when the codec has a
    ``k_channel_offset`` μ, keys only: row h of a per-head ``(num_kv_heads, head_dim)`` μ, or
    the shared ``(head_dim,)`` μ; prescale; randomized WHT), ``n = ‖y‖``,
    codes = Lloyd-Max bucket of ``sqrt(d) · y / n`` (binary search over the boundaries),
    K norm stored as ``n / ‖c[code]/sqrt(d)‖`` when the codec's norm correction is on,
    codes packed LSB-first — bit-for-bit the codec's ``compress_k`` / ``compress_v`` up to
    float32 rounding at bucket boundaries (TurboQuant, Zandieh et al. 2025, Alg. 1).

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
        block_t, num_warps: tokens per program (a power of two; default 8 for ≤ 128 new
            tokens, else 16) and Triton warps.
        chunk: rotation columns per tensor-core pass (a power of two ≥ 16; the tf32x3
            operand lives in registers). Default 64 up to head_dim 128, 32 above (ptxas
            sm_90a: whole 128×128 tiles spill 1.7 KB per thread; 8 × 64 uses 239 registers
            and no spills, 16 × 64 spills 48-80 B). Measured on the H200 (K4V4, 8 KV heads,
            head_dim 128, ``benchmarks/results/kernels_gpu_2026-11-30_variants.md``): 8 × 64
            takes 8.5 µs at 1 and 64 new tokens (16 × 32: 12.5), 16 × 64 11.7 µs at 256
            (16 × 32: 13.3); these defaults are the ones of the best vLLM end-to-end run
            (``benchmarks/results/vllm_e2e_2026-11-30d/``, run b).

    Raises:
        DtypeError, ShapeError, DeviceMismatchError on malformed inputs (checked on the host,
        no device sync).
    """
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
    if n == 0:
        return
    st = lay.strides()
    # float32 (head_dim,) (shared by the KV heads) or (num_kv_heads, head_dim) (row per head,
    # checked against the layout by TkvLoader), or None
    mu = loader.codec.k.channel_offset
    mu_sh = 0
    if mu is not None:
        mu = mu.to(cache.device, torch.float32).contiguous()
        mu_sh = lay.head_dim if mu.dim() == 2 else 0
    if block_t is None:
        block_t = 8 if n <= 128 else 16
    if chunk is None:
        chunk = 64 if loader.d_pad <= 128 else 32
    if block_t < 1 or block_t & (block_t - 1):
        raise ShapeError(f"block_t must be a power of two, got {block_t}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ShapeError(f"chunk must be a power of two >= 16, got {chunk}")
    kg, kgb = code_group(lay.k_bits)
    vg, vgb = code_group(lay.v_bits)
    kshift, vshift = loader.k_sink_shift, loader.v_sink_shift
    grid = (triton.cdiv(n, block_t), lay.num_kv_heads, 2)
    _compress_store_kernel[grid](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
        slot_mapping, n, num_blocks * lay.block_size, cache, cache.view(torch.bfloat16),
        loader.k_in, loader.v_in, loader.k_bounds, loader.v_bounds, loader.k_table,
        loader.v_table, loader.k_table if mu is None else mu, mu_sh, lay.page_bytes,
        loader.k_table if kshift is None else kshift, loader.v_table if vshift is None else vshift,
        K_HAS_MU=mu is not None, HEAD_DIM=lay.head_dim, D_PAD=loader.d_pad, BLOCK_SIZE=lay.block_size,
        K_BITS=lay.k_bits, K_CODES_OFF=lay.k_codes_offset, K_NORMS_OFF=lay.k_norms_offset,
        K_CODE_BYTES=lay.k_code_bytes, K_NORM_CORR=loader.k_norm_correction, K_GROUP=kg,
        K_GROUP_BYTES=kgb,
        V_BITS=lay.v_bits, V_CODES_OFF=lay.v_codes_offset, V_NORMS_OFF=lay.v_norms_offset,
        V_CODE_BYTES=lay.v_code_bytes, V_NORM_CORR=loader.v_norm_correction, V_GROUP=vg,
        V_GROUP_BYTES=vgb, BLOCK_T=block_t, K_HEAD_STRIDE=st["k_head"],
        K_TOK_STRIDE=st["k_token"], V_HEAD_STRIDE=st["v_head"], V_TOK_STRIDE=st["v_token"],
        NORM_HEAD_STRIDE=st["norm_head"], CH=min(loader.d_pad, chunk), K_SINK=kshift is not None,
        V_SINK=vshift is not None, num_warps=num_warps)
