"""The Loader protocol: how a kernel turns cache bytes into a K or V tile.

Every attention kernel in :mod:`tkv.kernels` is written once against one seam, the *tile
loader*: a ``@triton.jit`` function passed to the kernel as a ``tl.constexpr`` argument, so the
format is fixed at compile time and the inner loop has no runtime format branch. Its signature
(identical for every format, see ``docs/writing_a_loader.md``)::

    tile, row_scale = TILE(base, aux, table,          # pointers (format-defined meaning)
                           blk, off, mask_n,          # [BLOCK_N] physical block, in-block offset,
                                                      #   valid-token mask
                           head,                      # KV head (scalar)
                           offs_d, mask_d,            # [D_PAD] feature index, feature < head_dim
                           stride_block, stride_head, stride_tok,   # runtime ints
                           P0, P1, P2, P3,            # format constants (tl.constexpr)
                           OUT_DTYPE)                 # tl.float16 / tl.bfloat16 (dot operand)

returning ``tile`` ``[BLOCK_N, D_PAD]`` in ``OUT_DTYPE`` (finite everywhere, masked entries any
finite value) and ``row_scale`` ``[BLOCK_N]`` float32, a per-token factor that the kernel
applies once to that token's score (K) or softmax weight (V) — never per element. The
dequantized vector of token ``n`` is ``row_scale[n] * tile[n, :]``.

Formats here:

* :class:`TkvLoader` — the tkv packed cache (codes + bf16 norm + Lloyd-Max codebook), rotated
  space: ``tile = centroid[code] / sqrt(d)``, ``row_scale = norm``.
* :class:`BypassLoader` — raw bf16/fp16 paged K/V (vLLM's ``(num_blocks, block_size,
  num_kv_heads, head_dim)``), ``row_scale = 1``.
* :class:`Fp8Loader` — fp8-e4m3 paged K/V with per-tensor scales (vLLM's ``fp8_e4m3``
  kv-cache dtype), decoded with integer ops: the worked example of the docs.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
import triton
import triton.language as tl

from tkv.codec import TurboKVCodec
from tkv.codec.errors import DtypeError, ShapeError
from tkv.codec.layout import SlotLayout

from ._util import check_dtype, check_last_dim_contiguous, check_tensor, interpreting, next_pow2

__all__ = ["BypassLoader", "Fp8Loader", "Loader", "SideArgs", "TkvLoader"]

SideArgs = tuple  # (base, aux, table, stride_block, stride_head, stride_tok, P0, P1, P2, P3)


@runtime_checkable
class Loader(Protocol):
    """What a kernel needs from a KV-cache format (one per layer).

    Attributes:
        name: short format name.
        tile: the ``@triton.jit`` tile loader (module docstring gives its signature).
        rotated: True when cached K/V live in a rotated space, so queries must be rotated
            (:meth:`rotate_query_matrix`) and outputs unrotated (:meth:`unrotate_matrix`).
        head_dim, num_kv_heads, block_size: geometry (elements, heads, tokens per block).
        min_block_n: smallest tile (tokens) the tile function is correct for on this backend;
            decode and prefill raise their default tile to it and refuse an explicit smaller one.
    """

    name: str
    rotated: bool
    head_dim: int
    num_kv_heads: int
    block_size: int
    min_block_n: int

    @property
    def tile(self): ...

    def check_cache(self, cache) -> int:
        """Validate ``cache`` (raise named errors); return its number of blocks."""

    def side_args(self, cache, side: str) -> SideArgs:
        """Kernel arguments of side ``"k"`` or ``"v"`` for this cache."""

    def bytes_per_token(self) -> float:
        """Cache bytes one token of this layer occupies (all heads, K and V)."""


# ============================================================================ tkv
@triton.jit
def _tkv_tile_impl(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
                   stride_block, stride_head, stride_tok,
                   BITS_BYTES: tl.constexpr, CODES_OFF: tl.constexpr, NORMS_OFF: tl.constexpr,
                   NORM_HEAD: tl.constexpr, OUT_DTYPE: tl.constexpr, MODE: tl.constexpr):
    """tkv packed tile. base: uint8 cache; aux: the same cache viewed as bf16 (norms);
    table: float32 scaled centroids ``c / sqrt(d)``, ``2**BITS`` entries. Codes LSB-first
    (tkv.codec.packing): code i = bits [i*BITS, (i+1)*BITS) of the token's code bytes.
    ``BITS_BYTES = BITS + 16 * code_bytes`` (both compile-time constants)."""
    BITS: tl.constexpr = BITS_BYTES % 16
    CODE_BYTES: tl.constexpr = BITS_BYTES // 16
    BLOCK_N: tl.constexpr = blk.shape[0]
    D_PAD: tl.constexpr = offs_d.shape[0]
    page = blk.to(tl.int64) * stride_block                                  # [N] bytes
    row = page + CODES_OFF + head * stride_head + off.to(tl.int64) * stride_tok
    if BITS == 8 or (MODE == 2 and BITS == 4):
        # whole bytes per row, loaded contiguously (16-byte vectors). Widths 2 and 4 in the
        # default gather mode take the per-element path below: on the H200 (Triton 3.6) the
        # tl.join/tl.reshape re-interleave miscompiled for 16-token tiles feeding the P·V dot
        # (relative error ~3 at block_n=16, exact at 64; see docs/kernels.md).
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = D_PAD // PER
        offs_b = tl.arange(0, NB)
        bmask = mask_n[:, None] & (offs_b < CODE_BYTES)[None, :]
        byt = tl.load(base + (row[:, None] + offs_b[None, :]), mask=bmask, other=0)
        byt = byt.to(tl.int32)
        if PER == 1:
            code = byt
        elif PER == 2 and MODE == 2:
            code = byt  # pair table: one lookup per byte yields both codes' values
        elif PER == 2:
            code = tl.reshape(tl.join(byt & 15, byt >> 4), (BLOCK_N, D_PAD))
        else:
            nib = tl.reshape(tl.join(byt & 15, byt >> 4), (BLOCK_N, D_PAD // 2))
            code = tl.reshape(tl.join(nib & 3, nib >> 2), (BLOCK_N, D_PAD))
    else:
        # widths 3, 5, 6, 7: per-element byte reads; a code may straddle two bytes
        bit = offs_d * BITS
        byte = bit // 8
        sh = bit % 8
        m2 = mask_n[:, None] & mask_d[None, :]
        ptr = base + (row[:, None] + byte[None, :])
        w = tl.load(ptr, mask=m2, other=0).to(tl.int32)
        if (8 % BITS) != 0:
            need = (sh + BITS) > 8
            hi = tl.load(ptr + 1, mask=m2 & need[None, :], other=0).to(tl.int32)
            w = w | (hi << 8)
        code = (w >> sh[None, :]) & ((1 << BITS) - 1)
    if MODE == 2 and BITS == 4:
        # 256-entry table indexed by a whole byte: int32 = fp16(c[lo]) | fp16(c[hi]) << 16
        w = tl.load(table + code)
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        val = tl.reshape(tl.join(lo, hi), (BLOCK_N, D_PAD))
    elif MODE == 1:  # codebook lookup in registers: 2**BITS compare+select, no memory gather
        val = tl.zeros(code.shape, tl.float32)
        for i in tl.static_range(1 << BITS):
            val = tl.where(code == i, tl.load(table + i), val)
    else:  # gather from the (L1-resident) table
        val = tl.load(table + code)
    nidx = (page + NORMS_OFF) // 2 + head * NORM_HEAD + off
    norm = tl.load(aux + nidx, mask=mask_n, other=0.0).to(tl.float32)
    return val.to(OUT_DTYPE), norm


@triton.jit
def tkv_tile(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
             stride_block, stride_head, stride_tok,
             BITS_BYTES: tl.constexpr, CODES_OFF: tl.constexpr, NORMS_OFF: tl.constexpr,
             NORM_HEAD: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """tkv tile, codebook lookup by gather from the table in memory."""
    return _tkv_tile_impl(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
                          stride_block, stride_head, stride_tok, BITS_BYTES, CODES_OFF,
                          NORMS_OFF, NORM_HEAD, OUT_DTYPE, 0)


@triton.jit
def tkv_tile_select(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
                    stride_block, stride_head, stride_tok,
                    BITS_BYTES: tl.constexpr, CODES_OFF: tl.constexpr,
                    NORMS_OFF: tl.constexpr, NORM_HEAD: tl.constexpr,
                    OUT_DTYPE: tl.constexpr):
    """tkv tile, codebook lookup by a compare/select chain over the 2**BITS centroids."""
    return _tkv_tile_impl(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
                          stride_block, stride_head, stride_tok, BITS_BYTES, CODES_OFF,
                          NORMS_OFF, NORM_HEAD, OUT_DTYPE, 1)


@triton.jit
def tkv_tile_pair(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
                  stride_block, stride_head, stride_tok,
                  BITS_BYTES: tl.constexpr, CODES_OFF: tl.constexpr,
                  NORMS_OFF: tl.constexpr, NORM_HEAD: tl.constexpr,
                  OUT_DTYPE: tl.constexpr):
    """tkv tile; 4-bit sides look both nibbles of a byte up at once in a 256-entry table of
    fp16 pairs (the table pointer is then that int32 table); other widths gather."""
    return _tkv_tile_impl(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
                          stride_block, stride_head, stride_tok, BITS_BYTES, CODES_OFF,
                          NORMS_OFF, NORM_HEAD, OUT_DTYPE, 2)


def _pair_table(scaled: torch.Tensor) -> torch.Tensor:
    """int32 (256,): entry b = fp16(c[b & 15]) | fp16(c[b >> 4]) << 16 (4-bit tables)."""
    h = scaled.detach().cpu().to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    b = torch.arange(256)
    return (h[b & 15] | (h[b >> 4] << 16)).to(torch.int32)


class TkvLoader:
    """Per-layer tkv format: the codec's tables as device tensors + the layer's SlotLayout.

    Args:
        codec: the layer's :class:`~tkv.codec.TurboKVCodec` (its device is the kernels' device).
        num_kv_heads: KV heads of the layer (per TP rank).
        block_size: tokens per page.
        lookup: codebook lookup in the tile loader: ``"gather"`` / ``"auto"`` (memory gather
            from the table; default) or ``"select"`` (2**bits compare/select in registers).
            EXPERIMENTAL: "select" passes the CPU-interpreter tests but failed the compiled
            GPU tests on an H200 (see docs/kernels.md); do not use it in production.
            ``"pair"`` (4-bit sides): a 256-entry table of fp16 value pairs indexed by the
            whole byte, one lookup per two codes (fp16 centroids: ~1e-3 relative rounding);
            not yet run on a GPU.

    Attributes (device tensors, float32):
        k_table, v_table: ``(2**bits,)`` centroids / sqrt(head_dim) (SideCodec.scaled_centroids).
        k_bounds, v_bounds: ``(2**bits,)`` decision boundaries (standardized units), padded
            with +inf (compress_store's branch-free binary search).
        k_in, v_in: ``(d_pad, d_pad)`` ``A`` with ``R (x / s) = x @ A`` (prescale + rotation).
        q_in: ``(d_pad, d_pad)`` with ``rotate_query(q) = q @ q_in``.
        out_mat: ``(d_pad, d_pad)`` with ``unrotate_output(o) = o @ out_mat``.
        layout: the :class:`~tkv.codec.layout.SlotLayout` (the only source of offsets).
    """

    name = "tkv"
    rotated = True

    def __init__(self, codec: TurboKVCodec, num_kv_heads: int, block_size: int,
                 lookup: str = "auto"):
        if lookup not in ("auto", "gather", "select", "pair"):
            raise ValueError(f"lookup must be 'auto', 'gather', 'select' or 'pair', got {lookup!r}")
        self.lookup = lookup
        if not isinstance(codec, TurboKVCodec):
            raise DtypeError(f"codec must be a TurboKVCodec, got {type(codec).__name__}")
        self.codec = codec
        self.layout: SlotLayout = codec.layout(num_kv_heads, block_size)
        self.head_dim = codec.head_dim
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.k_bits, self.v_bits = codec.k_bits, codec.v_bits
        self.device = codec.device
        d, dp = self.head_dim, max(16, next_pow2(self.head_dim))
        self.d_pad = dp
        dev = self.device
        self.k_table = codec.k.scaled_centroids.to(dev, torch.float32).contiguous()
        self.v_table = codec.v.scaled_centroids.to(dev, torch.float32).contiguous()
        self.k_pair = _pair_table(self.k_table).to(dev) if self.k_bits == 4 else self.k_table
        self.v_pair = _pair_table(self.v_table).to(dev) if self.v_bits == 4 else self.v_table

        def bounds(side):
            b = side.boundaries.to(torch.float32).cpu()
            return torch.cat([b, torch.full((1,), math.inf)]).to(dev).contiguous()

        self.k_bounds, self.v_bounds = bounds(codec.k), bounds(codec.v)
        r = codec.rotation.matrix(torch.float64).cpu()  # R with R @ x = forward(x)

        def scales(side):
            s = side.channel_scales
            return torch.ones(d, dtype=torch.float64) if s is None else s.double().cpu()

        sk, sv = scales(codec.k), scales(codec.v)

        def pad(m):
            out = torch.zeros(dp, dp, dtype=torch.float64)
            out[:d, :d] = m
            return out.to(dev, torch.float32).contiguous()

        self.k_in = pad(torch.diag(1 / sk) @ r.T)       # x @ A = R (x / s_k)
        self.v_in = pad(torch.diag(1 / sv) @ r.T)
        self.q_in = pad(torch.diag(sk) @ r.T)           # q @ Q = R (q * s_k)
        self.out_mat = pad(r @ torch.diag(sv))          # o @ U = s_v * R^T o
        self.k_norm_correction = bool(codec.k.norm_correction)
        self.v_norm_correction = bool(codec.v.norm_correction)

    @property
    def min_block_n(self) -> int:
        """64 for the experimental pair lookup on the GPU: its tl.join/tl.reshape re-interleave
        miscompiled for smaller tiles on the H200 (Triton 3.6, docs/kernels.md); else 16."""
        return 64 if self.lookup == "pair" and not interpreting() else 16

    @property
    def tile(self):
        """``tkv_tile`` (gather lookup) unless ``lookup`` is "select" or "pair"."""
        return {"select": tkv_tile_select, "pair": tkv_tile_pair}.get(self.lookup, tkv_tile)

    def check_cache(self, cache) -> int:
        """``cache`` uint8 ``(num_blocks, page_bytes)`` contiguous, on the codec's device."""
        check_tensor(cache, "cache", 2)
        if cache.dtype != torch.uint8:
            raise DtypeError(f"a tkv cache is uint8, got {cache.dtype}")
        if cache.shape[1] != self.layout.page_bytes or not cache.is_contiguous():
            raise ShapeError(f"tkv cache must be contiguous (num_blocks, {self.layout.page_bytes})"
                             f" for {self.layout.describe()}, got {tuple(cache.shape)}")
        return cache.shape[0]

    def side_args(self, cache: torch.Tensor, side: str) -> SideArgs:
        lay = self.layout
        st = lay.strides()
        aux = cache.view(torch.bfloat16)
        if side == "k":
            kt = self.k_pair if self.lookup == "pair" else self.k_table
            return (cache, aux, kt, lay.page_bytes, st["k_head"], st["k_token"],
                    lay.k_bits + 16 * lay.k_code_bytes, lay.k_codes_offset, lay.k_norms_offset,
                    st["norm_head"])
        vt = self.v_pair if self.lookup == "pair" else self.v_table
        return (cache, aux, vt, lay.page_bytes, st["v_head"], st["v_token"],
                lay.v_bits + 16 * lay.v_code_bytes, lay.v_codes_offset, lay.v_norms_offset,
                st["norm_head"])

    def bytes_per_token(self) -> float:
        return self.layout.bytes_per_token

    def __repr__(self) -> str:
        return f"TkvLoader({self.layout.describe()})"


# ============================================================================ raw paged K/V
def _check_pair(cache, num_kv_heads, block_size, head_dim, dtypes, what):
    if not isinstance(cache, (tuple, list)) or len(cache) != 2:
        raise DtypeError(f"a {what} cache is a pair (k_cache, v_cache)")
    n = None
    for name, c in zip(("k_cache", "v_cache"), cache, strict=True):
        check_tensor(c, name, 4)
        check_dtype(c, name, dtypes)
        if tuple(c.shape[1:]) != (block_size, num_kv_heads, head_dim):
            raise ShapeError(f"{name} must be (num_blocks, {block_size}, {num_kv_heads}, "
                             f"{head_dim}), got {tuple(c.shape)}")
        check_last_dim_contiguous(c, name)
        if n is not None and c.shape[0] != n:
            raise ShapeError("k_cache and v_cache have different num_blocks")
        n = c.shape[0]
    if cache[0].device != cache[1].device:
        raise ShapeError("k_cache and v_cache on different devices")
    return n


@triton.jit
def bypass_tile(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
                stride_block, stride_head, stride_tok,
                P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
                OUT_DTYPE: tl.constexpr):
    """Raw fp16/bf16 paged tile: ``base[blk, off, head, :]``; row_scale 1 (0 when masked)."""
    row = blk.to(tl.int64) * stride_block + off.to(tl.int64) * stride_tok + head * stride_head
    m2 = mask_n[:, None] & mask_d[None, :]
    x = tl.load(base + (row[:, None] + offs_d[None, :]), mask=m2, other=0.0)
    return x.to(OUT_DTYPE), tl.where(mask_n, 1.0, 0.0)


class BypassLoader:
    """Raw bf16/fp16 paged KV through the same kernels (baseline and first-chunk path).

    Cache: a pair ``(k_cache, v_cache)``, each ``(num_blocks, block_size, num_kv_heads,
    head_dim)`` float16/bfloat16 with unit stride on head_dim (vLLM's flash layout, e.g.
    ``kv_cache[0], kv_cache[1]``). Not rotated: queries and outputs pass through unchanged.
    """

    name = "bypass"
    rotated = False

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.bfloat16):
        check_dtype(torch.empty(0, dtype=dtype), "dtype", (torch.float16, torch.bfloat16))
        self.num_kv_heads, self.head_dim, self.block_size, self.dtype = (
            num_kv_heads, head_dim, block_size, dtype)
        self.d_pad = max(16, next_pow2(head_dim))

    min_block_n = 16

    @property
    def tile(self):
        return bypass_tile

    def check_cache(self, cache) -> int:
        return _check_pair(cache, self.num_kv_heads, self.block_size, self.head_dim,
                           (self.dtype,), "bypass")

    def side_args(self, cache, side: str) -> SideArgs:
        c = cache[0] if side == "k" else cache[1]
        return (c, c, c, c.stride(0), c.stride(2), c.stride(1), 0, 0, 0, 0)

    def bytes_per_token(self) -> float:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).itemsize

    def __repr__(self) -> str:
        return (f"BypassLoader(kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"block={self.block_size}, {self.dtype})")


# ============================================================================ fp8 e4m3
@triton.jit
def fp8_e4m3_tile(base, aux, table, blk, off, mask_n, head, offs_d, mask_d,
                  stride_block, stride_head, stride_tok,
                  P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
                  OUT_DTYPE: tl.constexpr):
    """fp8-e4m3fn tile read as bytes. e4m3 ``s eeee mmm`` (bias 7) maps exactly onto fp16
    ``s 0eeee mmm0000000`` (bias 15) times 2**8, normals and subnormals alike, so decoding is
    two masks, two shifts and a bitcast; the 2**8 and the per-tensor scale go to row_scale."""
    row = blk.to(tl.int64) * stride_block + off.to(tl.int64) * stride_tok + head * stride_head
    m2 = mask_n[:, None] & mask_d[None, :]
    b = tl.load(base + (row[:, None] + offs_d[None, :]), mask=m2, other=0).to(tl.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    x = h.to(tl.int16).to(tl.float16, bitcast=True)
    scale = tl.load(table) * 256.0
    return x.to(OUT_DTYPE), tl.where(mask_n, scale, 0.0)


class Fp8Loader:
    """fp8-e4m3 paged KV with per-tensor float32 scales (value = fp8 · scale), vLLM-style.

    Args:
        num_kv_heads, head_dim, block_size: geometry.
        k_scale, v_scale: float32 tensors of one element on the cache's device.

    Cache: ``(k_cache, v_cache)``, each ``(num_blocks, block_size, num_kv_heads, head_dim)``
    ``torch.float8_e4m3fn`` (or its uint8 view). NaN encodings (0x7F/0xFF) are not decoded as
    NaN (they read as ±480): vLLM never writes them.
    """

    name = "fp8_e4m3"
    rotated = False

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int,
                 k_scale: torch.Tensor, v_scale: torch.Tensor):
        for nm, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(s, nm)
            check_dtype(s, nm, (torch.float32,))
            if s.numel() != 1:
                raise ShapeError(f"{nm} must hold one element, got shape {tuple(s.shape)}")
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.k_scale, self.v_scale = k_scale.reshape(1), v_scale.reshape(1)
        self.d_pad = max(16, next_pow2(head_dim))

    min_block_n = 16

    @property
    def tile(self):
        return fp8_e4m3_tile

    def check_cache(self, cache) -> int:
        return _check_pair(cache, self.num_kv_heads, self.block_size, self.head_dim,
                           (torch.float8_e4m3fn, torch.uint8), "fp8")

    def side_args(self, cache, side: str) -> SideArgs:
        c = cache[0] if side == "k" else cache[1]
        c = c.view(torch.uint8)
        s = self.k_scale if side == "k" else self.v_scale
        return (c, c, s, c.stride(0), c.stride(2), c.stride(1), 0, 0, 0, 0)

    def bytes_per_token(self) -> float:
        return 2 * self.num_kv_heads * self.head_dim

    def __repr__(self) -> str:
        return (f"Fp8Loader(kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"block={self.block_size})")
