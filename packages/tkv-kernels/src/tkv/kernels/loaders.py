"""The Loader protocol: how a kernel turns cache bytes into a K or V tile.

Every attention kernel in :mod:`tkv.kernels` is written once against one seam, the *tile
loader*: two ``@triton.jit`` functions passed to the kernel as ``tl.constexpr`` arguments, so
the format is fixed at compile time and the inner loop has no runtime format branch. Their
signatures (identical for every format, see ``docs/writing_a_loader.md``)::

    raw, row_scale = FETCH(base, aux, table,      # pointers (format-defined meaning)
                           blk, off, mask_n,      # [BLOCK_N] physical block, in-block offset,
                                                  #   valid-token mask
                           head,                  # KV head (scalar)
                           stride_block, stride_head, stride_tok,   # runtime ints
                           P0, P1, P2, P3,        # format constants (tl.constexpr)
                           NP, D_PAD)             # planes (1, 2 or 4), padded head_dim
    planes = DEQUANT(raw, table, P0, P1, P2, P3, NP, D_PAD,
                     OUT_DTYPE)                   # tl.float16 / tl.bfloat16 (dot operand)

``FETCH`` does every memory access that depends on the token (the kernels issue it one tile
ahead, so the loads of tile ``t+1`` are in flight while tile ``t`` is computed); ``raw`` is any
tensor (e.g. packed bytes). ``DEQUANT`` turns it into the tile, split into a tuple of ``NP``
*coordinate planes* (NP = 1, 2, 4 or 8): ``planes[p]`` is ``[BLOCK_N, D_PAD // NP]`` and holds
coordinates ``NP * j + p`` (``j = 0 … D_PAD/NP − 1``). With ``NP = 1`` it is the ordinary
``[BLOCK_N, D_PAD]`` tile. Planes let a packed format hand over the codes of one group of
bytes without re-interleaving them in registers: a 4-bit byte holds coordinates ``2j`` (low
nibble, plane 0) and ``2j + 1`` (high nibble, plane 1), and a dot product over ``d`` is the
sum of the planes' dot products, so the kernels run one tensor-core ``tl.dot`` per plane and
load queries and store outputs with the same strided coordinates. ``row_scale``
``[BLOCK_N]`` float32 is a per-token factor that the kernel applies once to that token's score
(K) or softmax weight (V) — never per element. The dequantized vector of token ``n`` is
``row_scale[n] * tile[n, :]``; every tile entry is finite (masked entries any finite value).

Formats here:

* :class:`TkvLoader` — the tkv packed cache (codes + bf16 norm + Lloyd-Max codebook), rotated
  space: ``tile = centroid[code] / sqrt(d)``, ``row_scale = norm``. With sink offsets (an
  optional extension, :func:`sink_shift`) a norm whose sign bit is set flags a token coded
  against the sink offset: its vector is ``|norm|·tile + shift[head]``; the kernels add the
  shift's score term and output term themselves (``docs/kernels.md``).
* :class:`BypassLoader` — raw bf16/fp16 paged K/V (vLLM's ``(num_blocks, block_size,
  num_kv_heads, head_dim)``), ``row_scale = 1``.
* :class:`Fp8Loader` — fp8-e4m3 paged K/V with per-tensor scales (vLLM's ``fp8_e4m3``
  kv-cache dtype), decoded with integer ops: the worked example of the docs.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Protocol, runtime_checkable

import torch
import triton
import triton.language as tl

from tkv.codec import TurboKVCodec
from tkv.codec.codebooks import default_codebook
from tkv.codec.errors import DtypeError, ShapeError, TkvError
from tkv.codec.layout import SlotLayout
from tkv.codec.packing import code_group

from . import _quant_grid
from ._lut_asm import byte_table_words, lut_asm, lut_constraints
from ._planes import merge_planes, to_planar_columns
from ._util import (
    check_dtype,
    check_last_dim_contiguous,
    check_positive_int,
    check_tensor,
    choice_from_env,
    int_from_env,
    interpreting,
    next_pow2,
    read_at_import,
)
from ._util import flag_from_env as _flag_from_env

__all__ = ["BypassLoader", "Fp8Loader", "Loader", "SideArgs", "TkvLoader"]

SideArgs = tuple  # (base, aux, table, stride_block, stride_head, stride_tok, P0, P1, P2, P3, NP)


@runtime_checkable
class Loader(Protocol):
    """What a kernel needs from a KV-cache format (one per layer).

    Attributes:
        name: short format name.
        fetch, dequant: the ``@triton.jit`` tile loader halves (module docstring).
        rotated: True when cached K/V live in a rotated space, so queries must be rotated
            (:meth:`rotate_query_matrix`) and outputs unrotated (:meth:`unrotate_matrix`).
        head_dim, num_kv_heads, block_size: geometry (elements, heads, tokens per block).
        min_block_n: smallest tile (tokens) the tile functions are correct for on this backend;
            decode and prefill raise their default tile to it and refuse an explicit smaller one.
    """

    name: str
    rotated: bool
    head_dim: int
    num_kv_heads: int
    block_size: int
    min_block_n: int

    fetch: object
    dequant: object

    def check_cache(self, cache) -> int:
        """Validate ``cache`` (raise named errors); return its number of blocks."""

    def planes(self, side: str) -> int:
        """Coordinate planes (1, 2 or 4) of side ``"k"``/``"v"`` tiles (``NP``, module doc)."""

    def side_args(self, cache, side: str, dot_dtype: torch.dtype = torch.float32) -> SideArgs:
        """Kernel arguments of side ``"k"`` or ``"v"`` for this cache:
        ``(base, aux, table, stride_block, stride_head, stride_tok, P0, P1, P2, P3, NP)``;
        ``dot_dtype`` is the tensor-core operand dtype the kernel will use."""

    def bytes_per_token(self) -> float:
        """Cache bytes one token of this layer occupies (all heads, K and V)."""


_LOADER_TYPES: set[type] = set()   # classes already found to implement Loader


def check_loader(loader) -> None:
    """Raise TypeError unless ``loader`` implements :class:`Loader`. The structural check
    (``isinstance`` on the runtime-checkable protocol, ~30 µs) runs once per loader class;
    later calls are a set lookup, so a per-layer kernel call pays nothing measurable."""
    t = type(loader)
    if t in _LOADER_TYPES:
        return
    if not isinstance(loader, Loader):
        raise TypeError(f"loader must implement tkv.kernels.Loader (TkvLoader, BypassLoader, "
                        f"Fp8Loader, ...), got {t.__name__}")
    _LOADER_TYPES.add(t)


def _hadamard_weights(q_in: torch.Tensor, d_pad: int, device) -> torch.Tensor | None:
    """``w`` (float32 ``(d,)`` on ``device``) with ``q_in = diag(w) @ H`` (``H`` the
    unnormalized Sylvester Walsh–Hadamard matrix of order d), or None when d is not a power of
    two ≥ 16 or ``q_in`` (float64 ``(d, d)``) has any other form (off-diagonal mass of
    ``q_in @ H / d`` above 1e-6 of its diagonal)."""
    d = q_in.shape[0]
    if d != d_pad or d < 16:
        return None
    from tkv.codec.rotation import hadamard_matrix
    m = q_in @ hadamard_matrix(d, torch.float64) / d
    w = torch.diagonal(m).clone()
    if (m - torch.diag(w)).abs().max() > 1e-6 * w.abs().max():
        return None
    return w.to(device, torch.float32).contiguous()


# ============================================================================ tkv
LOOKUP_GATHER, LOOKUP_PAIR_F16, LOOKUP_PAIR_BF16 = 0, 1, 2
LOOKUP_SHUFFLE, LOOKUP_PRMT_F16, LOOKUP_PRMT_BF16 = 3, 4, 5
LOOKUP_PRMT1_F16, LOOKUP_PRMT1_BF16 = 6, 7
LOOKUP_PRMTI_F16, LOOKUP_PRMTI_BF16 = 8, 9
LOOKUP_PRMTG_F16, LOOKUP_PRMTG_BF16 = 10, 11   # 2/3-bit groups (_lut_asm), tables as operands
LOOKUP_PRMTS_F16, LOOKUP_PRMTS_BF16 = 12, 13   # prmti for antisymmetric codebooks
_LOOKUP_NAMES = {LOOKUP_GATHER: "gather", LOOKUP_PAIR_F16: "pair", LOOKUP_PAIR_BF16: "pair",
                 LOOKUP_SHUFFLE: "shuffle", LOOKUP_PRMT_F16: "prmt", LOOKUP_PRMT_BF16: "prmt",
                 LOOKUP_PRMT1_F16: "prmt1", LOOKUP_PRMT1_BF16: "prmt1",
                 LOOKUP_PRMTI_F16: "prmti", LOOKUP_PRMTI_BF16: "prmti",
                 LOOKUP_PRMTG_F16: "prmt", LOOKUP_PRMTG_BF16: "prmt",
                 LOOKUP_PRMTS_F16: "prmts", LOOKUP_PRMTS_BF16: "prmts"}
# lookups whose byte tables travel as immediates in the asm text (packed into P0)
_IMMEDIATE_TABLES = (LOOKUP_PRMT1_F16, LOOKUP_PRMT1_BF16, LOOKUP_PRMTI_F16, LOOKUP_PRMTI_BF16,
                     LOOKUP_PRMTS_F16, LOOKUP_PRMTS_BF16)
# the two-plane immediate-table lookups (prmti and its antisymmetric form prmts): decode's
# register cap and pipelining rules (decode_maxnreg, decode_num_stages) apply to both
_PRMTI = frozenset((LOOKUP_PRMTI_F16, LOOKUP_PRMTI_BF16, LOOKUP_PRMTS_F16, LOOKUP_PRMTS_BF16))
# prmts with a codebook that is not antisymmetric (_antisymmetric_table): prmti, same half type
_PRMTS_FALLBACK = {LOOKUP_PRMTS_F16: LOOKUP_PRMTI_F16, LOOKUP_PRMTS_BF16: LOOKUP_PRMTI_BF16}
# P0 = BITS + 16 * CODE_BYTES + 65536 * LOOKUP + 2**_GROUP_SHIFT * log2(group planes)
#      (+ 2**_RESIDENT_BIT for prmti / prmts with resident_tables)
#      (+ the prmt1 / prmti table words from bit _TABLE_SHIFT)
_GROUP_SHIFT = 24   # the jit functions read it as (P0 // 16777216) % 8 (= 2**24; ≤ 3 bits)
_RESIDENT_BIT = 27
_TABLE_SHIFT = 28


@triton.constexpr_function   # plain Python when called from Python; see _prmt1_asm
def _prmt_lut8(t0: str, t1: str, t2: str, t3: str, x: str, s: str, dst: str) -> list[str]:
    """PTX: ``dst`` byte n = byte ``code_n`` of the 16-entry byte table in registers
    ``t0..t3`` (entries 0-7 from ``t0:t1``, 8-15 from ``t2:t3``, merged by selector ``s``)."""
    return [f"prmt.b32 a, {t0}, {t1}, {x};", f"prmt.b32 b, {t2}, {t3}, {x};",
            f"prmt.b32 {dst}, a, b, {s};"]


@triton.constexpr_function
def _mov_immediates(regs, words) -> list[str]:
    """PTX ``mov.b32`` of each table word into its register (prmt1 / prmti asm text)."""
    return [f"mov.b32 {r}, 0x{int(w) & 0xFFFFFFFF:08x};" for r, w in zip(regs, words, strict=True)]


@triton.constexpr_function
def _resident_words(regs, words) -> list[str]:
    """PTX setting each register to its table word through a per-thread zero
    (``(%lanemask_eq >> %laneid) ^ 1``, which ptxas cannot fold): ``resident_tables``.

    SASS ``PRMT`` takes one of its two data words as an immediate and the other only from a
    regular register. A constant table word lands in a uniform register, and ptxas copies it
    into a regular one before every lookup (``IMAD.U32``: 256 per thread per 128-token tile
    of the decode loop with prmti, 128 with prmts). A per-thread value is loop-invariant but
    not constant: ptxas hoists it and keeps it resident in a regular register instead."""
    lines = [".reg .b32 zl, zm;", "mov.u32 zl, %laneid;", "mov.u32 zm, %lanemask_eq;",
             "shr.b32 zl, zm, zl;", "xor.b32 zl, zl, 1;"]
    return lines + [f"xor.b32 {r}, zl, 0x{int(w) & 0xFFFFFFFF:08x};"
                    for r, w in zip(regs, words, strict=True)]


@triton.constexpr_function
def _table_word_lines(regs, words, first, resident) -> list[str]:
    """PTX loading the table ``words`` into ``regs``: all as immediates, or with
    ``resident`` the registers in ``first`` (each byte permute's first data word) through
    :func:`_resident_words` and the rest as immediates."""
    if not resident:
        return _mov_immediates(regs, words)
    pairs = list(zip(regs, words, strict=True))
    rest = [p for p in pairs if p[0] not in first]
    res = [p for p in pairs if p[0] in first]
    return (_mov_immediates([r for r, _ in rest], [w for _, w in rest])
            + _resident_words([r for r, _ in res], [w for _, w in res]))


@triton.constexpr_function   # plain Python from Python; _prmti_asm calls it at compile time
def _prmt_lut16_asm(words=None, resident=False) -> str:
    """4-bit codes -> 16-bit centroids with byte permutes, 4 code bytes (8 codes) per call: PTX
    ``prmt`` picks 4 of 8 source bytes by 3-bit selectors, so the 16-entry tables of the
    centroids' low bytes ($5 $9 $13 $17) and high bytes ($21 $25 $29 $33) are looked up as
    entries 0-7 / 8-15 and merged on bit 3 of each code (the selector 0x3210 | bit3 << 2);
    the last four prmt pair each code's low and high byte into a 16-bit float. Outputs: $0 $1
    the low-nibble codes (plane 0) of bytes 0-1 / 2-3, $2 $3 the high-nibble codes (plane 1).
    22 integer instructions per 4 bytes, no memory access, any register layout.

    ``words`` (8 ints, as :func:`_prmt_table`): the tables as immediates in the text instead
    of operands (``lookup="prmti"``; the only operand is then $4, the code bytes);
    ``resident``: the first word of each lookup pair through :func:`_resident_words`."""
    lines = ["{", ".reg .b32 x, s, xs, ss, a, b, l0, l1, h0, h1;",
             "and.b32 x, $4, 0x77777777;", "shr.b32 s, $4, 1;", "and.b32 s, s, 0x44444444;",
             "or.b32 s, s, 0x32103210;", "shr.b32 xs, x, 16;", "shr.b32 ss, s, 16;"]
    lo_t, hi_t = ("$5", "$9", "$13", "$17"), ("$21", "$25", "$29", "$33")
    if words is not None:
        lo_t, hi_t = ("T0", "T1", "T2", "T3"), ("U0", "U1", "U2", "U3")
        lines.insert(1, ".reg .b32 " + ", ".join(lo_t + hi_t) + ";")
        # resident: the words prmt reads as its first data operand (_prmt_lut8)
        lines[2:2] = _table_word_lines(lo_t + hi_t, words, ("T0", "T2", "U0", "U2"), resident)
    for x, sel, lo, hi in (("x", "s", "l0", "h0"), ("xs", "ss", "l1", "h1")):  # bytes 0-1, 2-3
        lines += _prmt_lut8(*lo_t, x, sel, lo)     # centroid low bytes
        lines += _prmt_lut8(*hi_t, x, sel, hi)     # centroid high bytes
    lines += ["prmt.b32 $0, l0, h0, 0x6240;", "prmt.b32 $1, l1, h1, 0x6240;",
              "prmt.b32 $2, l0, h0, 0x7351;", "prmt.b32 $3, l1, h1, 0x7351;", "}"]
    return "\n".join(lines) + "\n"


@triton.constexpr_function   # called by _prmt1_asm at compile time (and by tests)
def _prmt_plane_asm(words: list[int], plane: int) -> str:
    """4-bit codes -> 16-bit centroids of ONE plane (``plane`` 0: low nibbles, 1: high
    nibbles) of 4 code bytes, as *unary* inline assembly: the 8 byte-table words are
    immediates (``words``: as :func:`_prmt_table`, low-byte words then high-byte words), so
    the only operand is the code bytes ($2; outputs $0 $1 = 4 centroids). Triton hoists a
    dot operand's layout conversion only through pure unary inline asm (its
    ``isPureUnaryInlineAsm``), so with this form the conversion moves onto the uint8 code
    tile — 4× fewer shared-memory bytes than converting the 16-bit planes. 17 integer
    instructions per 4 codes (+ 8 immediate moves ptxas can keep in registers)."""
    regs = ("T0", "T1", "T2", "T3", "U0", "U1", "U2", "U3")
    lines = ["{", ".reg .b32 t, X, x, s, a, b, lo, hi, " + ", ".join(regs) + ";"]
    lines += _mov_immediates(regs, words)
    if plane:
        lines += ["shr.b32 t, $2, 4;", "and.b32 t, t, 0x0F0F0F0F;"]
    else:
        lines += ["and.b32 t, $2, 0x0F0F0F0F;"]
    # the plane's 4 nibbles, one per byte, into the low 16 bits of X (nibble n = code n)
    lines += ["shr.b32 X, t, 4;", "or.b32 X, X, t;", "prmt.b32 X, X, 0, 0x0020;",
              "and.b32 x, X, 0x7777;", "shr.b32 s, X, 1;", "and.b32 s, s, 0x4444;",
              "or.b32 s, s, 0x3210;"]
    lines += _prmt_lut8("T0", "T1", "T2", "T3", "x", "s", "lo")    # centroid low bytes
    lines += _prmt_lut8("U0", "U1", "U2", "U3", "x", "s", "hi")    # centroid high bytes
    lines += ["prmt.b32 $0, lo, hi, 0x5140;", "prmt.b32 $1, lo, hi, 0x7362;", "}"]
    return "\n".join(lines) + "\n"


@triton.constexpr_function
def _table_words(p0) -> list[int]:
    """The 8 byte-table words packed into ``P0`` above bit ``_TABLE_SHIFT`` (prmt1 / prmti;
    the inverse of ``TkvLoader``'s packing)."""
    t = int(p0) >> _TABLE_SHIFT
    return [(t >> (32 * i)) & 0xFFFFFFFF for i in range(8)]


@triton.constexpr_function
def _prmt1_asm(p0, plane):
    """Compile time: the :func:`_prmt_plane_asm` text of the table words packed in ``P0``."""
    return _prmt_plane_asm(_table_words(p0), int(plane))


@triton.constexpr_function   # plain Python from Python; _prmts_asm calls it at compile time
def _prmt_sym16_asm(words, resident=False) -> str:
    """:func:`_prmt_lut16_asm` for an *antisymmetric* codebook (``c[15 − i] = −c[i]`` bit for
    bit in the 16-bit float, :func:`_antisymmetric_table`; the default Lloyd-Max codebooks of
    :mod:`tkv.codec` are): same operand ($4, the code bytes) and outputs ($0 $1 plane 0, $2 $3
    plane 1), same 16-bit values. Only the positive half's byte tables are used (``words``
    2-3 low bytes, 6-7 high bytes of entries 8-15, as immediates):

    * magnitude index ``j = i − 8`` for ``i ≥ 8`` and ``7 − i`` below, 8 codes at once:
      ``j = ~(x ^ t) & 0x77777777`` with ``t = hi32((x & 0x88888888) · 7·2²⁹)`` (7 in each
      nibble of a code with bit 3 set);
    * one ``prmt`` per 4 codes and byte (8-entry tables: one register pair, no merge);
    * the sign (bit 3 of the code clear) set in the high bytes from ``prmt``'s sign-replicate
      mode: the msb of byte ``k`` of ``x << 4`` is bit 3 of code ``2k``, of ``x`` that of
      code ``2k + 1``, so selectors ``0xD9C8`` / ``0xFBEA`` give 0xFF per positive code.

    17 SASS instructions per 4 bytes (8 codes) once ptxas fuses the logic into LOP3 (prmti's
    asm: 21), with 4 table words instead of 8.
    Offline sm_90a (decode's split kernel, K4V4, head_dim 128, 4 warps, query rotated
    in-kernel): 1,468 loop instructions per thread per 128-token tile against prmti's 1,769,
    167 registers, no spills (``benchmarks/results/sass_decode_offline_2026-12-06_s29.md``).
    ``resident``: M0 and N0 (each lookup's first data word) through :func:`_resident_words`."""
    w = [int(v) & 0xFFFFFFFF for v in words]
    lines = ["{", ".reg .b32 M0, M1, N0, N1, t, j, jh, v, n, la, lb, ha, hb;"]
    lines += _table_word_lines(("M0", "M1", "N0", "N1"), (w[2], w[3], w[6], w[7]), ("M0", "N0"),
                               resident)
    # 7 in every nibble whose code has bit 3 set: (x & 0x88888888) · 7 / 8, exactly, as the
    # high word of the 64-bit product with 7 · 2^29 (no carries between nibbles); then the
    # negative codes' nibbles are flipped: j = ~(x ^ t) & 0x77777777
    lines += ["and.b32 t, $4, 0x88888888;", "mul.hi.u32 t, t, 0xE0000000;",
              "xor.b32 j, $4, t;", "not.b32 j, j;", "and.b32 j, j, 0x77777777;",
              "shr.b32 jh, j, 16;",
              "prmt.b32 la, M0, M1, j;", "prmt.b32 lb, M0, M1, jh;",      # low bytes
              "prmt.b32 ha, N0, N1, j;", "prmt.b32 hb, N0, N1, jh;",      # high bytes, |c|
              "shl.b32 v, $4, 4;"]
    for sel, h in (("0xD9C8", "ha"), ("0xFBEA", "hb")):   # codes 0-3 / 4-7: the sign bits
        lines += [f"prmt.b32 n, v, $4, {sel};", "not.b32 n, n;", "and.b32 n, n, 0x80808080;",
                  f"or.b32 {h}, {h}, n;"]
    lines += ["prmt.b32 $0, la, ha, 0x6240;", "prmt.b32 $1, lb, hb, 0x6240;",
              "prmt.b32 $2, la, ha, 0x7351;", "prmt.b32 $3, lb, hb, 0x7351;", "}"]
    return "\n".join(lines) + "\n"


def _antisymmetric_table(words) -> bool:
    """Whether the 8 byte-table words of a 16-entry 16-bit codebook (:func:`_prmt_table`)
    hold an antisymmetric one — entry ``15 − i`` equal to entry ``i`` with the sign bit
    flipped, for every ``i``, and the upper half non-negative — so that
    :func:`_prmt_sym16_asm` reproduces :func:`_prmt_lut16_asm` exactly."""
    w = [int(v) & 0xFFFFFFFF for v in words]
    lo = [(w[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(16)]
    hi = [(w[4 + i // 4] >> (8 * (i % 4))) & 0xFF for i in range(16)]
    return all(lo[15 - i] == lo[i] and hi[15 - i] == hi[i] ^ 0x80 for i in range(16)) and \
        all(h < 0x80 for h in hi[8:])


_PRMT_LUT16: tl.constexpr = tl.constexpr(_prmt_lut16_asm())


@triton.constexpr_function
def _prmti_asm(p0):
    """Compile time: :func:`_prmt_lut16_asm` with the table words packed in ``P0`` as
    immediates (``lookup="prmti"``; resident when ``P0`` has bit ``_RESIDENT_BIT``)."""
    return _prmt_lut16_asm(_table_words(p0), bool((int(p0) >> _RESIDENT_BIT) & 1))


@triton.constexpr_function
def _prmts_asm(p0):
    """Compile time: :func:`_prmt_sym16_asm` of the table words packed in ``P0``
    (``lookup="prmts"``; TkvLoader packs only antisymmetric tables with that code; resident
    when ``P0`` has bit ``_RESIDENT_BIT``)."""
    return _prmt_sym16_asm(_table_words(p0), bool((int(p0) >> _RESIDENT_BIT) & 1))


# outputs: 2 planes x 4 16-bit values (2 regs each); inputs: 4 code bytes (1 reg), then the 8
# table words, each an int32 tensor (pack=4: 4 regs each, all equal; the asm reads the first)
_PRMT_CONSTRAINTS: tl.constexpr = tl.constexpr("=r,=r,=r,=r,r" + ",r" * 32)


_LUT2: tl.constexpr = tl.constexpr(lut_asm(2))
_LUT3: tl.constexpr = tl.constexpr(lut_asm(3))
_LUT2_CONSTRAINTS: tl.constexpr = tl.constexpr(lut_constraints(2))
_LUT3_CONSTRAINTS: tl.constexpr = tl.constexpr(lut_constraints(3))
# the group lookups' pack=2 needs ≥ 2 elements per thread: tiles of ≥ 512 groups are safe up to
# 8 warps; smaller ones gather from the float32 centroids stored after the byte tables
_LUT_MIN_GROUPS: tl.constexpr = tl.constexpr(512)


@triton.jit
def _prmt_group_planes(raw, table, BITS: tl.constexpr, NP: tl.constexpr, HALF: tl.constexpr,
                       OUT_DTYPE: tl.constexpr):
    """2/3-bit code groups (int32 tile) → ``NP`` planes by the byte-permute asm of
    :mod:`._lut_asm` (``table``: int32 byte-table words, then the float32 centroids)."""
    NW: tl.constexpr = 2 * max(1, (1 << BITS) // 4)   # byte-table words (lo + hi)
    w = raw.to(tl.int32)
    planes = ()
    if w.numel >= _LUT_MIN_GROUPS:
        t = ()
        for i in tl.static_range(NW):
            t = t + (tl.load(table + i),)
        if BITS == 2:
            bits16 = tl.inline_asm_elementwise(_LUT2, _LUT2_CONSTRAINTS, [w, t[0], t[1]],
                                               dtype=(tl.int16,) * NP, is_pure=True, pack=2)
        else:
            bits16 = tl.inline_asm_elementwise(_LUT3, _LUT3_CONSTRAINTS,
                                               [w, t[0], t[1], t[2], t[3]],
                                               dtype=(tl.int16,) * NP, is_pure=True, pack=2)
        for p in tl.static_range(NP):
            planes = planes + (bits16[p].to(HALF, bitcast=True).to(OUT_DTYPE),)
    else:
        cent = table.to(tl.pointer_type(tl.float32), bitcast=True) + NW
        for p in tl.static_range(NP):
            code = (w >> (BITS * p)) & ((1 << BITS) - 1)
            planes = planes + (tl.load(cent + code).to(OUT_DTYPE),)
    return planes


@triton.jit
def _half_pair(w, HALF: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """int32 holding two 16-bit floats (``HALF`` bit patterns) -> (low, high) in OUT_DTYPE."""
    lo = (w & 0xFFFF).to(tl.int16).to(HALF, bitcast=True).to(OUT_DTYPE)
    hi = (w >> 16).to(tl.int16).to(HALF, bitcast=True).to(OUT_DTYPE)
    return lo, hi


@triton.jit
def tkv_fetch(base, aux, table, blk, off, mask_n, head, stride_block, stride_head, stride_tok,
              P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
              NP: tl.constexpr, D_PAD: tl.constexpr):
    """tkv packed tile, memory half: ``(raw, norm)``.

    base: the uint8 cache; aux: the same cache viewed as bf16 (norms). Codes are LSB-first
    (tkv.codec.packing): code i = bits [i*BITS, (i+1)*BITS) of the token's code bytes.
    Constants: ``P0 = BITS + 16 * CODE_BYTES + 65536 * LOOKUP + 2**24 * log2(GP)`` (GP: the
    side's group planes, :meth:`TkvLoader.group_planes`), ``P1`` codes offset, ``P2``
    norms offset (bytes in the page), ``P3`` norms per head.

    Planar widths (``GP > 1``, or 8 bits): the token's codes come in *groups* of ``GP`` codes
    in ``BITS * GP / 8`` whole bytes (one byte for 2/4/8 bits; 3 bytes of 4 codes for 6 bits;
    3/5/7 bytes of 8 codes for 3/5/7 bits); ``raw`` = the groups ``[BLOCK_N, D_PAD // GP]``
    (the bytes themselves, one contiguous row per token, or the little-endian group words:
    int32 up to 4 bytes, int64 above). Otherwise (``GP = 1``, head_dim too small for 16
    coordinates per plane): ``raw`` = the codes ``[BLOCK_N, D_PAD]`` uint8, read per element
    (one or two bytes each: a code may straddle two bytes).
    """
    BITS: tl.constexpr = P0 % 16
    CODE_BYTES: tl.constexpr = (P0 // 16) % 4096
    GP: tl.constexpr = 1 << ((P0 // 16777216) % 8)   # group planes (codes per fetched group)
    GROUP_BYTES: tl.constexpr = BITS * GP // 8
    page = blk.to(tl.int64) * stride_block                                  # [N] bytes
    row = page + P1 + head * stride_head + off.to(tl.int64) * stride_tok
    nidx = (page + P2) // 2 + head * P3 + off
    norm = tl.load(aux + nidx, mask=mask_n, other=0.0).to(tl.float32)
    if GP == 1 and BITS != 8:
        offs_d = tl.arange(0, D_PAD)
        bit = offs_d * BITS
        byte = bit // 8
        sh = bit % 8
        m2 = mask_n[:, None] & (byte < CODE_BYTES)[None, :]
        ptr = base + (row[:, None] + byte[None, :])
        w = tl.load(ptr, mask=m2, other=0).to(tl.int32)
        if (8 % BITS) != 0:
            need = ((sh + BITS) > 8) & ((byte + 1) < CODE_BYTES)
            hi = tl.load(ptr + 1, mask=mask_n[:, None] & need[None, :], other=0).to(tl.int32)
            w = w | (hi << 8)
        raw = ((w >> sh[None, :]) & ((1 << BITS) - 1)).to(tl.uint8)
    elif GROUP_BYTES <= 1:
        offs_j = tl.arange(0, D_PAD // GP)
        bmask = mask_n[:, None] & (offs_j < CODE_BYTES)[None, :]
        raw = tl.load(base + (row[:, None] + offs_j[None, :]), mask=bmask, other=0)
    else:
        if GROUP_BYTES <= 4:
            WT: tl.constexpr = tl.int32
        else:  # 5/7 bits: 8 codes in 5/7 bytes
            WT: tl.constexpr = tl.int64
        gb = tl.arange(0, D_PAD // GP) * GROUP_BYTES
        gmask = mask_n[:, None] & (gb < CODE_BYTES)[None, :]
        ptr = base + (row[:, None] + gb[None, :])
        raw = tl.load(ptr, mask=gmask, other=0).to(WT)
        for k in tl.static_range(1, GROUP_BYTES):
            raw = raw | (tl.load(ptr + k, mask=gmask, other=0).to(WT) << (8 * k))
    return raw, norm


@triton.jit
def tkv_dequant(raw, table, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                P3: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr,
                OUT_DTYPE: tl.constexpr):
    """tkv packed tile, arithmetic half: ``raw`` (:func:`tkv_fetch`) → tuple of ``NP`` planes
    of ``centroid[code] / sqrt(d)`` (rotated space; ``row_scale`` = the norm).

    The lookup first yields the ``GP`` *group planes* (GP from ``P0``: the codes per fetched
    group): group plane ``r`` of group ``g`` (coordinate ``GP*g + r``) is one shift and mask
    of the group word. LOOKUP 1/2 (2/3/4 bits): one gather per *two* codes from a
    ``2**(2*BITS)``-entry table of fp16/bf16 centroid pairs yields group planes ``r, r+1``.
    LOOKUP 0: one gather per code from the float32 centroid table (``table``). LOOKUP ≥ 4:
    PTX byte permutes (4-bit bytes; 2/3-bit groups: :mod:`._lut_asm`). When the kernels take
    fewer planes than the groups hold (``NP < GP``, :meth:`TkvLoader.planes`), the group
    planes are interleaved into ``NP`` wider ones (:func:`._planes.merge_planes`).
    """
    BITS: tl.constexpr = P0 % 16
    LOOKUP: tl.constexpr = (P0 // 65536) % 256
    GP: tl.constexpr = 1 << ((P0 // 16777216) % 8)   # group planes the fetch delivered
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS * GP > 32:   # 5/7-bit groups: 40/56-bit words
        w = raw.to(tl.int64)
    else:
        w = raw.to(tl.int32)
    planes = ()
    if LOOKUP >= 4:   # the prmt family: planes from the code tile, no memory access
        if LOOKUP % 2 == 0:   # LOOKUP_PRMT*_F16 are even, *_BF16 odd
            HALF: tl.constexpr = tl.float16
        else:
            HALF: tl.constexpr = tl.bfloat16
        if LOOKUP == 10 or LOOKUP == 11:   # LOOKUP_PRMTG_*: 2/3-bit groups, tables as operands
            planes = _prmt_group_planes(raw, table, BITS, GP, HALF, OUT_DTYPE)
        else:   # 4 bits: 2 planes from the byte tile
            if LOOKUP >= 12:   # LOOKUP_PRMTS_*: prmti's outputs from the antisymmetric tables
                bits16 = tl.inline_asm_elementwise(
                    _prmts_asm(P0), "=r,=r,=r,=r,r", [raw.to(tl.uint8)],
                    dtype=(tl.int16, tl.int16), is_pure=True, pack=4)
            elif LOOKUP >= 8:   # LOOKUP_PRMTI_*: the two-plane asm of prmt, tables as immediates
                bits16 = tl.inline_asm_elementwise(
                    _prmti_asm(P0), "=r,=r,=r,=r,r", [raw.to(tl.uint8)],
                    dtype=(tl.int16, tl.int16), is_pure=True, pack=4)
            elif LOOKUP >= 6:   # LOOKUP_PRMT1_*: one unary asm per plane, tables as immediates
                bits16 = ()
                for p in tl.static_range(2):
                    bits16 = bits16 + (tl.inline_asm_elementwise(
                        _prmt1_asm(P0, p), "=r,=r,r", [raw], dtype=tl.int16, is_pure=True, pack=4),)
            else:   # LOOKUP_PRMT_*: the table words as operands
                t = ()
                for i in tl.static_range(8):
                    t = t + (tl.load(table + i),)
                bits16 = tl.inline_asm_elementwise(
                    _PRMT_LUT16, _PRMT_CONSTRAINTS,
                    [raw.to(tl.uint8), t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]],
                    dtype=(tl.int16, tl.int16), is_pure=True, pack=4)
            for p in tl.static_range(2):
                planes = planes + (bits16[p].to(HALF, bitcast=True).to(OUT_DTYPE),)
    elif LOOKUP == 3:   # LOOKUP_SHUFFLE, ≤ 5 bits: per-code tl.gather from a register table
        NE: tl.constexpr = 1 << BITS
        tab = tl.load(table + tl.arange(0, NE)[:, None]
                      + tl.zeros([NE, D_PAD // GP], tl.int32)).to(OUT_DTYPE)
        for p in tl.static_range(GP):
            code = ((w >> (BITS * p)) & MASK).to(tl.int32)
            planes = planes + (tl.gather(tab, code, 0),)
    elif LOOKUP == 0:
        for p in tl.static_range(GP):
            code = ((w >> (BITS * p)) & MASK).to(tl.int32)
            planes = planes + (tl.load(table + code).to(OUT_DTYPE),)
    else:
        if LOOKUP == 1:
            HALF: tl.constexpr = tl.float16
        else:
            HALF: tl.constexpr = tl.bfloat16
        PMASK: tl.constexpr = (1 << (2 * BITS)) - 1
        for p in tl.static_range(0, GP, 2):
            lo, hi = _half_pair(tl.load(table + ((w >> (BITS * p)) & PMASK)), HALF, OUT_DTYPE)
            planes = planes + (lo, hi)
    return merge_planes(planes, GP, NP)


def _half_bits(scaled: torch.Tensor, half: torch.dtype) -> torch.Tensor:
    """int32 bit patterns (0..65535) of a codebook rounded to the 16-bit float ``half``."""
    return scaled.detach().cpu().to(half).view(torch.int16).to(torch.int32) & 0xFFFF


def _pair_table(scaled: torch.Tensor, bits: int, half: torch.dtype) -> torch.Tensor:
    """int32 pair table of a codebook: ``2**(2*bits)`` entries indexed by two adjacent codes
    (a 4-bit byte, a 2-bit nibble, 6 bits of a 3-bit group): entry
    ``i = fp(c[i & m]) | fp(c[i >> bits]) << 16`` with ``fp`` the 16-bit float ``half`` (its
    bit pattern) and ``m = 2**bits − 1``."""
    n = 1 << (2 * bits)
    h = _half_bits(scaled, half)
    i = torch.arange(n)
    return (h[i & ((1 << bits) - 1)] | (h[i >> bits] << 16)).to(torch.int32)


def _prmt_table(scaled: torch.Tensor, half: torch.dtype) -> torch.Tensor:
    """int32 byte tables of a codebook for the prmt lookups: for 16 entries (``_PRMT_LUT16``)
    words 0-3 the low bytes of the 16-bit float ``half`` centroids (entry ``i`` = byte
    ``i % 4`` of word ``i // 4``), words 4-7 their high bytes; 4 / 8 entries: 1 + 1 / 2 + 2
    words (:func:`._lut_asm.byte_table_words`)."""
    return byte_table_words(_half_bits(scaled, half))


def _prmt_group_table(scaled: torch.Tensor, half: torch.dtype) -> torch.Tensor:
    """int32 table of the 2/3-bit group lookup (LOOKUP_PRMTG_*): the byte-table words, then
    the float32 centroids' bit patterns (the small-tile fallback gathers them)."""
    return torch.cat([_prmt_table(scaled, half),
                      scaled.detach().cpu().float().contiguous().view(torch.int32)])


_PRMT_FAMILY = ("prmt", "prmt1", "prmti", "prmts")   # 4-bit byte-permute lookups (PTX, CUDA)
_LOOKUPS = ("auto", "pair", "gather", "shuffle", *_PRMT_FAMILY)
ENV_LOOKUP = "TKV_LOOKUP"


class LookupConfigError(TkvError, ValueError):
    """``TKV_LOOKUP`` names no codebook lookup of :class:`TkvLoader`."""


ENV_SMALL_HEAD_GROUPS = "TKV_SMALL_HEAD_GROUPS"
ENV_FUSED_QUERY_ROTATION = "TKV_FUSED_QUERY_ROTATION"


class SmallHeadGroupsConfigError(TkvError, ValueError):
    """``TKV_SMALL_HEAD_GROUPS`` is neither ``0`` nor ``1``."""


class FusedQueryRotationConfigError(TkvError, ValueError):
    """``TKV_FUSED_QUERY_ROTATION`` is neither ``0`` nor ``1``."""


def small_head_groups_from_env(environ=None) -> bool:
    """The :class:`TkvLoader` option ``small_head_groups`` for the engines' loaders:
    ``TKV_SMALL_HEAD_GROUPS=1`` (the default) or ``0`` (3/5/7-bit sides at head_dim 64 read per
    element, as before session 13: an A/B knob).

    Raises:
        SmallHeadGroupsConfigError: any other value.
    """
    return _flag_from_env(environ, ENV_SMALL_HEAD_GROUPS, "1", SmallHeadGroupsConfigError,
                          "1 (default: fetch 3/5/7-bit sides at head_dim 64 as 8-code groups) "
                          "or 0 (read them per element)")


def fused_query_rotation_from_env(environ=None) -> bool:
    """The :class:`TkvLoader` option ``fused_query_rotation`` for the engines' loaders:
    ``TKV_FUSED_QUERY_ROTATION=1`` (the default: the split-K decode kernel rotates the query
    in registers) or ``0`` (one ``rotate_rows`` launch before it: an A/B knob). Measured on
    the H200 with vLLM, Qwen3-8B-like (session 16): 0.94 / 0.96 / 0.93× → 0.96 / 0.95 / 0.94×
    bf16 end to end at 64 / 256 sequences / one 32K sequence (decode 0.94 / 0.96 / 0.90× →
    0.98 / 0.95 / 0.92×).

    Raises:
        FusedQueryRotationConfigError: any other value.
    """
    return _flag_from_env(environ, ENV_FUSED_QUERY_ROTATION, "1", FusedQueryRotationConfigError,
                          "1 (default: the decode kernel rotates the query in registers) or 0 "
                          "(a separate query-rotation launch)")


def lookup_from_env(environ=None) -> str:
    """The codebook lookup an operator picks for the engines' loaders with ``TKV_LOOKUP``
    (default ``"auto"``; the choices are :class:`TkvLoader`'s ``lookup`` values — an
    experimental lookup can be served end to end without code changes).

    Raises:
        LookupConfigError: an unknown name (the message lists the choices).
    """
    return choice_from_env(environ, ENV_LOOKUP, _LOOKUPS, "auto", LookupConfigError,
                           f"not a tkv codebook lookup; choose one of {', '.join(_LOOKUPS)} "
                           "(default auto)")


def _is_default_codebook(codec: TurboKVCodec, side: str) -> bool:
    """Whether a side's codebook is the shared default (Gaussian Lloyd-Max) one for its width
    and head_dim — the same table in every layer, hence one compile of an immediate-table
    lookup for all of them."""
    sc = codec.k if side == "k" else codec.v
    ref = default_codebook(sc.bits, codec.head_dim).centroids
    got = sc.codebook.centroids
    return got.shape == ref.shape and torch.equal(got.detach().cpu().to(ref.dtype), ref.cpu())


class PerCodebookCompileWarning(UserWarning):
    """An immediate-table lookup (prmti / prmts / prmt1) was asked for a fitted, per-layer
    codebook."""


_WARNED_PER_CODEBOOK = set()


def _warn_per_codebook_compiles(lookup: str) -> None:
    """Warn once per process and lookup: the table is baked into the kernel, so every layer
    with its own codebook compiles its own decode / prefill kernels (per split count too) —
    minutes of compiling at an engine's first start with per-layer calibrated codebooks."""
    if lookup in _WARNED_PER_CODEBOOK:
        return
    _WARNED_PER_CODEBOOK.add(lookup)
    warnings.warn(f"lookup={lookup!r} with a fitted (non-default) codebook: the table is "
                  "compiled into the kernel, so each layer with its own codebook compiles its own "
                  "kernels (one per split count); expect a long first start. lookup='auto' uses "
                  "prmt for such layers; calibrating with --codebook-min-gain 0.02 ships the "
                  "shared default codebook instead.", PerCodebookCompileWarning, stacklevel=3)


ENV_PRMTI_MAXNREG = "TKV_PRMTI_MAXNREG"


class MaxnregConfigError(TkvError, ValueError):
    """``TKV_PRMTI_MAXNREG`` is neither 0 nor a register count in 64..255."""


def _prmti_maxnreg_from_env(environ=None) -> int:
    """decode's register cap with prmti (:meth:`TkvLoader.decode_maxnreg`): none by default
    (0), or the operator's ``TKV_PRMTI_MAXNREG`` (64..255), read once at import.

    Why no cap by default: in isolation (CUDA-graph timing, ``kernels_gpu.py --variants``)
    128 registers made the K4V4 split kernel 1.12-1.19× faster at 64-256 sequences, but
    end to end in vLLM 0.20.1 (Qwen3-8B-like, H200, ``benchmarks/results/
    vllm_e2e_2026-11-30d/``) the same cap cut output tok/s to 0.51× / 0.78× of bf16 at 64 /
    256 sequences, against 0.93× / 0.96× without it. The capped kernel spills (76 B per
    thread); why that costs so much more inside the engine than alone is not understood yet."""
    return int_from_env(environ, ENV_PRMTI_MAXNREG, lambda n: not n or 64 <= n <= 255,
                        MaxnregConfigError, "0 (no cap) or 64..255 registers per thread")


PRMTI_MAXNREG = read_at_import(_prmti_maxnreg_from_env)

ENV_DECODE_PIPELINE = "TKV_DECODE_PIPELINE"


class PipelineConfigError(TkvError, ValueError):
    """``TKV_DECODE_PIPELINE`` is neither ``0`` nor ``1``."""


def decode_pipeline_from_env(environ=None) -> bool:
    """Whether decode may software-pipeline its code-tile loads on under-filled grids
    (:meth:`TkvLoader.decode_num_stages`): ``TKV_DECODE_PIPELINE=1`` (the default) or ``0``
    (one stage always: an A/B knob). Read once at import into :data:`DECODE_PIPELINE`; a bad
    value is raised by the engines' startup validation or the first kernel call
    (:func:`._util.read_at_import`).

    Raises:
        PipelineConfigError: any other value.
    """
    return _flag_from_env(environ, ENV_DECODE_PIPELINE, "1", PipelineConfigError,
                          "1 (default: pipeline the split-K decode on grids under the "
                          "workspace's target_programs CTAs) or 0 (one stage always)")


DECODE_PIPELINE = read_at_import(decode_pipeline_from_env)


def _pm1_factor(m: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(S, w)`` with ``m = S · diag(w)``, ``S`` bfloat16 ±1 (exact) and ``w`` float32
    ``(m.shape[1],)`` — a randomized Walsh–Hadamard map with per-column scales, whatever its
    row order — or ``(None, None)`` when ``m`` (float32 2-D) has another form (an entry off
    ±w_j by more than 1e-6 relative — float32 rounding of a true ±w_j is ~6e-8 —, a zero
    column, a non-finite entry)."""
    w = m[0].double()
    if not bool(torch.isfinite(m).all()) or bool((w == 0).any()):
        return None, None
    s = m.double() / w[None, :]
    if bool(((s.abs() - 1).abs() > 1e-6).any()):
        return None, None
    return s.sign().to(torch.bfloat16).contiguous(), w.float().contiguous()


def _bf16_halves(m: torch.Tensor) -> torch.Tensor:
    """bfloat16 ``(2, *m.shape)``: ``hi = bf16(m)``, ``lo = bf16(m − hi)`` — two bf16
    tensor-core operands whose sum is the float32 ``m`` to ~2^-16 relative."""
    hi = m.to(torch.bfloat16)
    return torch.stack([hi, (m - hi.float()).to(torch.bfloat16)]).contiguous()


class TkvLoader:
    """Per-layer tkv format: the codec's tables as device tensors + the layer's SlotLayout.

    Args:
        codec: the layer's :class:`~tkv.codec.TurboKVCodec` (its device is the kernels' device).
        num_kv_heads: KV heads of the layer (per TP rank).
        block_size: tokens per page.
        lookup: codebook lookup in the tile loader. ``"pair"``: 2-, 3- and 4-bit sides with
            planes gather 16-bit *pairs* of centroids (one lookup per two codes, in the
            query's 16-bit float type), other widths gather float32 centroids; with float32
            dots (the interpreter) it uses float16 pairs. ``"prmt"``: 2-, 3- and 4-bit sides
            with planes and 16-bit dots look codes up with PTX byte permutes over the
            centroids' byte tables held in registers (no memory access; CUDA only, DtypeError
            under the interpreter): 4 bits 22 integer instructions per 8 codes, 3 bits 44 per
            16, 2 bits 6 per 2 (:mod:`._lut_asm`); other sides as ``"pair"``. ``"auto"``
            (default): on CUDA, a 4-bit side with the shared default codebook uses
            ``"prmti"`` (below), one with its own (fitted) codebook ``"prmt"`` — ``"prmti"``
            compiles one kernel per distinct codebook, so per-layer codebooks would compile
            once per layer and split count; 2/3-bit sides ``"prmt"`` (any codebook: the
            tables are operands) — they used ``"pair"`` until session 10 (K4V4 decode on the
            H200: prmt 0.300 ms vs 0.378 ms with pairs, ``benchmarks/results/
            kernels_gpu_2026-11-30_lookups.md``); float32 gathers under the interpreter. ``"gather"``: one float32 gather per code for every width.
            ``"shuffle"``: 3-, 4- and 5-bit sides with planes look codes up in a register copy
            of the codebook (``tl.gather``, warp shuffles): 1.15 vs 1.38 ms at K5V5, slower
            at K4V4 (2-bit tables crashed Triton 3.6's ThreadLocality pass, hence not offered).
            ``"prmt1"`` (experimental): like ``"prmt"`` but one *unary*
            asm per plane with the byte tables as immediates (one compile per distinct
            codebook), and decode computes ``K · q^T`` (:meth:`k_operand_a`) so Triton can
            convert the uint8 code tile instead of the 16-bit planes into the tensor-core
            operand layout (offline sm_90a: shared memory per CTA 40 KB → 12 KB); measured
            slower than ``"prmt"`` on the H200 (decode B=256, L=640: 236 vs 205 µs).
            ``"prmti"``: ``"prmt"``'s two-plane asm with the byte tables as immediates (one
            compile per distinct codebook), so the code bytes are its only operand: Triton
            then converts the uint8 code tile rather than the 16-bit planes into the
            tensor-core operand layout (shared memory per CTA 40,960 → 12,288 B, offline
            sm_90a), with q·K^T kept. On the H200 (K4V4 decode, Qwen3-8B-like heads;
            ``benchmarks/results/kernels_gpu_2026-11-30_variants.md``): 1.02-1.13× prmt's
            speed in isolation; end to end in vLLM (Qwen3-8B-like, ``benchmarks/results/
            vllm_e2e_2026-11-30d/``) 5,938 / 9,041 output tok/s at 64 / 256 sequences vs
            prmt's 5,035 / 7,223 in the same session. An optional register cap
            (:meth:`decode_maxnreg`) is off by default.
            ``"prmts"`` (opt-in; on an H100 the split kernel 2.6 % faster, the 36-layer
            Qwen3-8B-like step 2.9 % slower at 64 sequences and 1.5 % faster at 256 —
            ``benchmarks/results/kernels_gpu_2026-12-06_s30_h100.md``): ``"prmti"`` for a side whose
            16-bit codebook is antisymmetric (``c[15 − i] = −c[i]`` bit for bit; the default
            Lloyd-Max codebooks are), the same values from the positive half's 8-entry byte
            tables and the code's sign bit (:func:`_prmt_sym16_asm`): offline sm_90a the
            split kernel's loop has 1,468 instead of 1,769 instructions per thread per tile.
            4-bit sides with a codebook that is not antisymmetric, and 2/3-bit sides, as
            with ``"prmti"``.

        planes: at most this many coordinate planes per side for the attention kernels
            (1, 2, 4 or 8; default None: 2 for 3/5/7-bit sides, else the group's codes): a
            side whose code groups hold more codes (2 bits: 4, 3/5/7 bits: 8, 6 bits: 4) has
            its group planes interleaved in registers after the lookup (:meth:`planes`).
        small_head_groups: decode fetches whole 8-code groups of 3/5/7-bit sides also where
            a group plane holds fewer than 16 coordinates (head_dim 64: 8), interleaved to 2
            planes of 32 (:meth:`fetch_group_planes`); default True. False reads such sides
            per element. The cache bytes are the same; prefill keeps reading them per
            element. On the H200 (SmolLM2 geometry, 256 sequences × 640 tokens, 30 layers,
            ``benchmarks/results/kernels_gpu_2026-12-01_s13_smollm2_step.md``) the decode
            split kernel takes 1.65 ms instead of 2.34 ms per step with the SmartMix 4.0
            row's codecs and 2.18 ms instead of 3.81 ms with the 3.0 row's.
        resident_tables: prmti / prmts sides set the first table word of each byte permute
            from a per-thread zero (:func:`_resident_words`), so ptxas keeps it in a regular
            register instead of copying it from a uniform one before every lookup; the same
            values. Default False (opt-in, session 32: offline sm_90a the default split
            kernel's loop falls from 1,779 to 1,520 instructions per thread per tile with
            prmti at 186 registers instead of 168, and from 1,481 to 1,357 with prmts at the
            same 168. On an H100 the decode kernel alone gains 1-7 % (K4V4 B=32, L=8K: 0.2668
            ms prmti, 0.2500 ms prmts resident with ``maxnreg=168``), but no variant beats
            plain prmti in the 36-layer Qwen3-8B-like step at 64 sequences (1.047× bf16
            against 1.013-1.022×); at 256 sequences prmts resident is the fastest (1.156×
            against 1.135×); ``benchmarks/results/kernels_gpu_2026-12-06_s32_h100_resident.md``).
        fused_query_rotation: :func:`~tkv.kernels.decode` rotates the query inside its
            split-K kernel (``q_hadamard``; where the rotation is a power-of-two Hadamard)
            unless the call says otherwise; default True. False keeps the separate
            ``rotate_rows`` launch (an A/B knob). Measured on the H200: 36-layer
            Qwen3-8B-like steps 0.988× → 1.000× bf16 at 64 sequences, equal at 256
            (session 15, ``benchmarks/results/kernels_gpu_2026-12-01_s15_qrot.md``); vLLM
            end to end 0.94 / 0.96 / 0.93× → 0.96 / 0.95 / 0.94× bf16 at 64 / 256 / one
            32K sequence (session 16, ``benchmarks/results/vllm_e2e_2026-12-04_s16_qwen_qrot``).

    Raises:
        ValueError: unknown ``lookup``, ``planes`` not 1/2/4/8, ``small_head_groups`` /
            ``fused_query_rotation`` / ``resident_tables`` not a bool. DtypeError: ``codec``
            is not a TurboKVCodec.
        ShapeError: a per-head ``k_channel_offset`` whose head count is not ``num_kv_heads``.
        ShapeError also for a per-head sink offset with another head count.

    Attributes (device tensors, float32 unless noted):
        k_table, v_table: ``(2**bits,)`` centroids / sqrt(head_dim) (SideCodec.scaled_centroids).
        k_bounds, v_bounds: ``(2**bits,)`` decision boundaries (standardized units), padded
            with +inf (compress_store's branch-free binary search).
        k_in, v_in: ``(d_pad, d_pad)`` ``A`` with ``R (x / s) = x @ A`` (prescale + rotation).
        k_mu, k_mu_rot: ``(1 or num_kv_heads, d_pad)`` the key offset μ and ``μ @ A_k`` (so
            that ``R((x − μ)/s) = x @ A_k − μ @ A_k``), or None without a key offset.
        k_inv_scale, v_inv_scale: ``(d_pad,)`` ``1/s`` (0 at padding): ``‖R((x − μ)/s)‖`` is
            taken before the rotation (R is orthogonal).
        k_sink_delta, v_sink_delta: ``(num_kv_heads, d_pad)`` ``σ_h − μ_h`` in model space
            (``σ_h`` for values), subtracted in float32 as compress_store forms ``x − μ_h``,
            so a vector equal to σ gives exactly 0 (the sink candidate's ``(x − σ)/s`` is
            ``(x − μ − delta)/s``), or None without a sink offset.
        k_store_hadamard, v_store_hadamard: float32 ``(head_dim,)`` ``w`` with
            ``x @ k_in = (w ⊙ x) @ H`` (``H`` the unnormalized Sylvester Walsh–Hadamard
            matrix; ``w`` = the rotation's signs, ``1/s`` and ``1/√d``) where the rotation is
            a pure power-of-two Hadamard (as :attr:`q_hadamard`), else None:
            ``compress_store(rotation="wht")`` rotates by butterflies with it.
        k_store_quant, v_store_quant: uint8 tables of the CUDA store's search-free Lloyd-Max
            quantization (:mod:`tkv.kernels._quant_grid`), with ``k_store_ncell`` /
            ``v_store_ncell`` their cell counts (0: binary search), where the store
            Hadamards exist, else None.
        q_in: ``(d_pad, d_pad)`` with ``rotate_query(q) = q @ q_in``.
        q_hadamard: float32 ``(head_dim,)`` ``w`` with ``q @ q_in = (w ⊙ q) @ H`` (``H`` the
            unnormalized Sylvester Walsh–Hadamard matrix) where the rotation is a pure
            power-of-two Hadamard (``head_dim`` a power of two ≥ 16, checked against q_in to
            1e-6), else None: decode's in-kernel query rotation
            (``decode(fused_query_rotation=True)``).
        out_mat: ``(d_pad, d_pad)`` with ``unrotate_output(o) = o @ out_mat``.
        out_hadamard: float32 ``(head_dim,)`` ``w`` with ``o @ out_mat = w ⊙ (o @ H)`` where
            the rotation is a pure power-of-two Hadamard (as ``q_hadamard``), else None:
            decode's single-split epilogue unrotates in the split kernel with it.
        q_in_planar, k_in_planar, v_in_planar: ``(head_dim, d_pad)``: q_in / k_in / v_in with
            the output columns in the side's planar layout (``_planes.planar_index``).
        out_planar: ``(d_pad, head_dim)``: out_mat taking planar-layout (V planes) rows.
        k_mu_planar: ``(1 or num_kv_heads, d_pad)`` ``μ @ k_in_planar`` (prefill centers the
            chunk's keys as ``k @ k_in_planar − k_mu_planar``), or None without a key offset.
        k_back_planar, v_back_planar: bfloat16 ``(2, d_pad, head_dim)``: hi and lo halves
            (hi + lo = the float32 matrix to ~2^-16 relative) of ``R·diag(s_k)`` /
            ``R·diag(s_v)`` with rows in the side's planar order — planar rows back to model
            space (prefill's varlen path dequantizes prefixes straight into model space).
        k_back_pm1, k_back_w, v_back_pm1, v_back_w: the same maps factored exactly as a
            bfloat16 ±1 ``(d_pad, head_dim)`` matrix times float32 column scales
            ``(head_dim,)`` (a randomized Hadamard rotation always factors so), or None.
        k_sink_shift, v_sink_shift: ``(num_kv_heads, d_pad)`` (natural coordinate order, zero
            padding) rotated shift ``c_h = R((σ_h − μ_h)/s)`` of the side's *flagged* vectors
            (codec ``sink_shift_rotated``), or None when the side has no sink offset. A
            flagged token's norm has its sign bit set; its vector is ``|norm|·tile + c_h``
            (:func:`sink_shift`).
        layout: the :class:`~tkv.codec.layout.SlotLayout` (the only source of offsets).
    """

    name = "tkv"
    rotated = True

    @property
    def min_block_n(self) -> int:
        """Smallest token tile: 32 when the V side's group planes are interleaved (planes <
        group planes) — Triton 3.6 on sm_90 computes ``P @ V`` wrongly when V is an interleaved
        tile and the dot's K dimension (the tile's tokens) is 16 (found and bracketed on the
        H200 in session 10: 16 tokens wrong at every width / warp count, 32+ exact;
        ``benchmarks/triton_interleave_dot_bug.py`` reproduces it); else 16."""
        return 32 if self.planes("v") < self.fetch_group_planes("v") else 16

    def __init__(self, codec: TurboKVCodec, num_kv_heads: int, block_size: int,
                 lookup: str = "auto", planes: int | None = None,
                 small_head_groups: bool = True, fused_query_rotation: bool = True,
                 resident_tables: bool = False):
        if lookup not in _LOOKUPS:
            raise ValueError(f"lookup must be one of {_LOOKUPS}, got {lookup!r}")
        if planes is not None and (isinstance(planes, bool) or not isinstance(planes, int)
                                   or planes not in (1, 2, 4, 8)):
            raise ValueError(f"planes must be None, 1, 2, 4 or 8, got {planes!r}")
        self.lookup = lookup
        self.max_planes = planes
        for name, flag in (("small_head_groups", small_head_groups),
                           ("fused_query_rotation", fused_query_rotation),
                           ("resident_tables", resident_tables)):
            if not isinstance(flag, bool):   # "0" / "false" would read as True
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        self.small_head_groups = small_head_groups
        self.fused_query_rotation = fused_query_rotation
        self.resident_tables = resident_tables
        self._prefill_view = None
        if not isinstance(codec, TurboKVCodec):
            raise DtypeError(f"codec must be a TurboKVCodec, got {type(codec).__name__}")
        for side in (codec.k, codec.v):
            mu_heads = side.offset_heads
            if mu_heads is not None and mu_heads != num_kv_heads:
                # a per-head offset must hold exactly this layer's (per-rank) KV heads: a wrong
                # row would center head h with another head's mean (silently wrong attention)
                raise ShapeError(
                    f"the codec's per-head {side.name} offset (channel or sink) holds {mu_heads}"
                    f" KV heads, the layer has {num_kv_heads} (slice it to this rank's heads)")
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
        self._pairs, self._prmt, self._prmt_words = {}, {}, {}
        self._prmt_antisymmetric = {}   # (side, half) -> the byte tables are antisymmetric
        self._prmt_host = {}   # (side, half) -> the 4-bit byte-table words as host ints
        for side, bits, table in (("k", self.k_bits, self.k_table), ("v", self.v_bits,
                                                                      self.v_table)):
            if bits in (2, 3, 4) and lookup in ("auto", "pair", *_PRMT_FAMILY):
                for half, code in ((torch.float16, LOOKUP_PAIR_F16),
                                   (torch.bfloat16, LOOKUP_PAIR_BF16)):
                    self._pairs[side, half] = (_pair_table(table, bits, half).to(dev), code)
            if bits in (2, 3) and lookup in ("auto", *_PRMT_FAMILY):
                for half, code in ((torch.float16, LOOKUP_PRMTG_F16),
                                   (torch.bfloat16, LOOKUP_PRMTG_BF16)):
                    self._prmt[side, half] = (_prmt_group_table(table, half).to(dev), code)
            if bits == 4 and lookup in ("auto", *_PRMT_FAMILY):
                eff = lookup
                if lookup == "auto":   # prmti compiles per codebook: only the shared default
                    eff = "prmti" if _is_default_codebook(codec, side) else "prmt"
                elif lookup in ("prmti", "prmt1", "prmts") and not _is_default_codebook(codec,
                                                                                         side):
                    _warn_per_codebook_compiles(lookup)
                codes = {"prmt1": (LOOKUP_PRMT1_F16, LOOKUP_PRMT1_BF16),
                         "prmti": (LOOKUP_PRMTI_F16, LOOKUP_PRMTI_BF16),
                         "prmts": (LOOKUP_PRMTS_F16, LOOKUP_PRMTS_BF16)}.get(
                             eff, (LOOKUP_PRMT_F16, LOOKUP_PRMT_BF16))
                for half, code in zip((torch.float16, torch.bfloat16), codes, strict=True):
                    words = _prmt_table(table, half)
                    host = words.tolist()
                    antisym = _antisymmetric_table(host)   # host words: no sync
                    self._prmt_antisymmetric[side, half] = antisym
                    self._prmt_host[side, half] = tuple(host)
                    if code in _PRMTS_FALLBACK and not antisym:
                        code = _PRMTS_FALLBACK[code]   # prmti: any codebook
                    self._prmt[side, half] = (words.to(dev), code)
                    if code in _IMMEDIATE_TABLES:  # one constexpr int (no host sync per call)
                        self._prmt_words[side, code] = sum(
                            (int(w) & 0xFFFFFFFF) << (32 * i) for i, w in enumerate(words.tolist()))

        def bounds(side):
            b = side.boundaries.to(torch.float32).cpu()
            return torch.cat([b, torch.full((1,), math.inf)]).to(dev).contiguous()

        self.k_bounds, self.v_bounds = bounds(codec.k), bounds(codec.v)

        def rows(m):   # (r, d) float64 -> (r, d_pad) float32 on the device, zero padding
            out = torch.zeros(m.shape[0], dp, dtype=torch.float64)
            out[:, :d] = m.cpu()
            return out.to(dev, torch.float32).contiguous()

        def sink_shift(side):   # c_h = R((σ_h − μ_h)/s), natural order, zero-padded to d_pad
            c = side.sink_shift_rotated(torch.float64)
            return None if c is None else rows(c.reshape(-1, d).expand(num_kv_heads, d))

        self.k_sink_shift, self.v_sink_shift = sink_shift(codec.k), sink_shift(codec.v)
        r = codec.rotation.matrix(torch.float64).cpu()  # R with R @ x = forward(x)

        def scales(side):
            s = side.channel_scales
            return torch.ones(d, dtype=torch.float64) if s is None else s.double().cpu()

        sk, sv = scales(codec.k), scales(codec.v)

        def pad(m):
            out = torch.zeros(dp, dp, dtype=torch.float64)
            out[:d, :d] = m
            return out.to(dev, torch.float32).contiguous()

        a_k = torch.diag(1 / sk) @ r.T
        a_v = torch.diag(1 / sv) @ r.T
        self.k_in = pad(a_k)                            # x @ A = R (x / s_k)
        self.v_in = pad(a_v)
        # compress_store(rotation="wht"): x @ A = (w ⊙ x) @ H by butterflies, no matrix
        self.k_store_hadamard = _hadamard_weights(a_k, dp, dev)
        self.v_store_hadamard = _hadamard_weights(a_v, dp, dev)
        # the CUDA store's search-free quantization tables (built here, not inside a capture)
        self.k_store_quant = self.v_store_quant = None
        self.k_store_ncell = self.v_store_ncell = 0
        if self.k_store_hadamard is not None and self.v_store_hadamard is not None:
            for side, sc in (("k", codec.k), ("v", codec.v)):
                table, ncell = _quant_grid.build(sc.boundaries, sc.scaled_centroids, sc.bits)
                setattr(self, f"{side}_store_quant", table.to(dev))
                setattr(self, f"{side}_store_ncell", ncell)
        mu = codec.k.channel_offset
        self.k_mu = self.k_mu_rot = None
        if mu is not None:             # compress_store: x − μ, or x @ A_k − μ @ A_k
            mu = mu.double().cpu().reshape(-1, d)
            self.k_mu, self.k_mu_rot = rows(mu), rows(mu @ a_k)
        self.k_inv_scale, self.v_inv_scale = (rows((1 / sc)[None, :])[0] for sc in (sk, sv))

        def sink_delta(side):   # σ − μ in model space, one row per KV head, float32 arithmetic
            if side.sink_offset is None:
                return None
            m = side.sink_offset.float().cpu().reshape(-1, d)
            if side.channel_offset is not None:   # as the kernel forms x − μ: x = σ gives 0
                m = m - side.channel_offset.float().cpu().reshape(-1, d)
            return rows(m.expand(num_kv_heads, d))

        self.k_sink_delta, self.v_sink_delta = sink_delta(codec.k), sink_delta(codec.v)
        self._store_rotation = {}
        self.q_in = pad(torch.diag(sk) @ r.T)           # q @ Q = R (q * s_k)
        self.q_hadamard = _hadamard_weights(torch.diag(sk) @ r.T, dp, dev)
        u = r @ torch.diag(sv)
        self.out_mat = pad(u)                           # o @ U = s_v * R^T o
        # U = H diag(w) ⇔ Uᵀ = diag(w) H: o @ U = w ⊙ (H o)
        self.out_hadamard = _hadamard_weights(u.T, dp, dev)
        self.k_norm_correction = bool(codec.k.norm_correction)
        self.v_norm_correction = bool(codec.v.norm_correction)
        # the same maps with columns in each side's planar layout (prefill: contiguous planes)
        self._planar_maps()
        # prefill's view (group planes kept) built now, not at a first prefill that could fall
        # inside an engine's CUDA-graph capture; it shares every table but the planar maps
        if any(self.planes(s) != self.fetch_group_planes(s) for s in "kv"):
            view = copy.copy(self)
            view.max_planes = 8
            view._planar_maps()
            self._prefill_view = view

    def _planar_maps(self) -> None:
        """q_in / k_in / v_in / out_mat with columns in the kernels' planar layout (:meth:`planes`)."""
        d, dp = self.head_dim, self.d_pad
        knp, vnp = self.planes("k"), self.planes("v")
        self.q_in_planar = to_planar_columns(self.q_in[:d, :d], knp, d, dp).contiguous()
        self.k_in_planar = to_planar_columns(self.k_in[:d, :d], knp, d, dp).contiguous()
        self.v_in_planar = to_planar_columns(self.v_in[:d, :d], vnp, d, dp).contiguous()
        self.out_planar = to_planar_columns(self.out_mat[:d, :d].T, vnp, d, dp).T.contiguous()
        self.k_mu_planar = None if self.k_mu is None else (
            self.k_mu[:, :d].double() @ self.k_in_planar.double()).float().contiguous()
        # prefill's varlen path takes prefix rows back to model space in its dequant kernel:
        # R·diag(s_k) (the query's map, transposed) and R·diag(s_v) with rows in planar order
        self.k_back_planar = _bf16_halves(self.q_in_planar.T)
        self.v_back_planar = _bf16_halves(self.out_planar)
        # the same maps as an exact ±1 matrix and column scales (session 26, opt-in:
        # prefill.MODEL_BACK_MAP): two bf16 passes instead of three, half the matrix bytes
        self.k_back_pm1, self.k_back_w = _pm1_factor(self.q_in_planar.T.contiguous())
        self.v_back_pm1, self.v_back_w = _pm1_factor(self.out_planar)

    fetch = tkv_fetch
    dequant = tkv_dequant

    def store_rotation(self, side: str, dtype: torch.dtype | None) -> tuple[torch.Tensor, float]:
        """compress_store's rotation operand for side ``"k"``/``"v"``: ``(terms, scale)`` with
        ``x @ A = (x @ Σ terms) · scale``, ``A`` (:attr:`k_in` / :attr:`v_in`) with its columns
        in the side's code-group planar order (:func:`~tkv.kernels._planes.planar_index` with
        :meth:`group_planes`; natural order for one plane), so that each column chunk holds one
        position of consecutive code groups and the packed bytes are OR-ed in registers.

        ``dtype=None``: float32 ``(d_pad, d_pad)``, scale 1 (the kernel's ``tf32x3`` dot).
        ``dtype`` bfloat16 / float16: ``(3, d_pad, d_pad)`` terms of that dtype,
        ``A·2^e = A₀ + A₁ + A₂`` (``A₀ = rnd(A·2^e)``, ``A₁ = rnd(A·2^e − A₀)``, ...): 3 × 8
        significand bits for bf16 (= float32's 24: exact), 3 × 11 for fp16, whose narrower
        exponent range takes the power-of-two ``2^e`` (largest entry in [2^14, 2^15); ``scale
        = 2^-e``, exact; only entries below ~2^-24 of the largest lose their last terms to
        subnormals). A 16-bit vector times them on tensor cores (exact products, float32
        accumulation) is ``x @ A`` at float32 accuracy with nothing split in the kernel — what
        ``tf32x3`` does per program (the split idea: Ootomo & Yokota, "Recovering single
        precision accuracy from Tensor Cores while surpassing the FP32 theoretical peak
        performance", IJHPCA 2022). Under the Triton interpreter the terms are float32
        tensors holding those values (its 16-bit dots are not float products). Cached."""
        key = side, dtype, interpreting()
        if key not in self._store_rotation:
            a = (self.k_in if side == "k" else self.v_in).double()
            a = to_planar_columns(a[:, :self.head_dim], self.group_planes(side), self.head_dim,
                                  self.d_pad)
            scale = 1.0
            if dtype is None:
                a = a.float()
            else:
                if dtype == torch.float16:
                    e = 14 - math.floor(math.log2(a.abs().max().item()))
                    a, scale = a * 2.0 ** e, 2.0 ** -e
                terms = []
                for _ in range(3):
                    terms.append(a.to(dtype))
                    a = a - terms[-1].double()
                a = torch.stack(terms)
                a = a.float() if interpreting() else a
            self._store_rotation[key] = a.contiguous(), scale
        return self._store_rotation[key]

    def group_planes(self, side: str) -> int:
        """Codes per packed group of a side as compress_store writes them (``GP``): one
        whole-byte group, ``8 / gcd(bits, 8)`` (2→4, 3→8, 4→2, 5→8, 6→4, 7→8, 8→1), while a
        plane keeps ≥ 16 coordinates (tensor-core K); else 1 (per-element, e.g. 3 bits at
        head_dim 64). compress_store packs in this order (:meth:`store_rotation`); either way
        the bytes are the same LSB-first stream (code ``i`` = coordinate ``i``)."""
        bits = self.k_bits if side == "k" else self.v_bits
        np_, _ = code_group(bits)
        return np_ if self.d_pad // np_ >= 16 else 1

    def fetch_group_planes(self, side: str) -> int:
        """Codes per fetched group in the attention kernels' tile loader: :meth:`group_planes`,
        except with ``small_head_groups`` where that is 1 for a 3/5/7-bit side but the planes
        the groups are interleaved into (:meth:`planes`' cap, 2 by default) hold ≥ 16
        coordinates: then whole 8-code groups (head_dim 64: 8 group planes of 8 → 2 of 32)."""
        gp = self.group_planes(side)
        if not self.small_head_groups or gp != 1:
            return gp
        np_, _ = code_group(self.k_bits if side == "k" else self.v_bits)
        return np_ if np_ > 1 and self.d_pad // self._merged_planes(np_) >= 16 else gp

    def _merged_planes(self, gp: int) -> int:
        """Planes that ``gp`` group planes are interleaved into: at most the constructor's
        ``planes``, by default 2 for 8-code groups, else all ``gp`` kept."""
        cap = self.max_planes if self.max_planes is not None else (2 if gp == 8 else gp)
        return min(gp, cap)

    def prefill_loader(self) -> TkvLoader:
        """The loader :func:`~tkv.kernels.prefill` reads the compressed prefix through: this
        one when no side interleaves its group planes, else a view of it that keeps them
        (``planes=8``, same tables and cache format; built at construction). Triton 3.6 fails
        to compile the prefill kernel with interleaved 3- or 6-bit group planes
        (``TritonGPUOptimizeDotOperands``, every tile size, H200 session 10), so only decode
        takes the interleaved planes."""
        return self if self._prefill_view is None else self._prefill_view

    def planes(self, side: str) -> int:
        """Coordinate planes the attention kernels take for a side (``NP``): the group planes
        (:meth:`group_planes`) interleaved down to at most ``planes`` (constructor). By
        default 8-code groups (3/5/7 bits) are interleaved to 2 planes and 4-code groups (2/6
        bits) kept: on the H200 (``benchmarks/results/kernels_gpu_2026-11-30_s10_planes.md``,
        B=32, L=8K) K3V3 decode 1.02 → 0.50 ms, K4V3 1.03 → 0.36, K5V5 1.38 → 0.82, while
        2-bit sides were slower interleaved (K2V2 0.24 → 0.40) and 6-bit ones unchanged."""
        return self._merged_planes(self.fetch_group_planes(side))

    @property
    def preferred_block_n(self) -> int:
        """Decode tile length (tokens, head_dim ≤ 128) that fits the registers: 128 when every
        side is 2-bit or takes ≤ 2 planes (4/8 bits, and 3/5/7 bits interleaved to 2: K3V3
        0.50 ms at 128 vs 0.55 at 64 and 0.66 at 32 on the H200, session 10); 32 for 6-bit
        sides and un-interleaved 8-code groups (64+ token tiles spill, ptxas sm_90a), and for
        per-element sides (3/5/6/7 bits whose group plane would hold < 16 coordinates, e.g.
        head_dim 64): prefill's prefix tile follows this value (``prefill._prefix_tile``), and
        64-token prefix tiles with a per-element side next to a planar one fault on the H200
        (illegal address; ``benchmarks/results/prefill_tile_bug_2026-11-30.md``, session 8 —
        re-found in session 11 after session 10's rule had let such loaders pick 128)."""
        def fits(side: str, bits: int) -> bool:
            if self.fetch_group_planes(side) == 1 and bits != 8:
                return False   # per-element reads
            return self.planes(side) <= 2 or bits == 2
        return 128 if fits("k", self.k_bits) and fits("v", self.v_bits) else 32

    def check_cache(self, cache) -> int:
        """``cache`` uint8 ``(num_blocks, page_bytes)`` contiguous, on the codec's device."""
        check_tensor(cache, "cache", 2)
        if cache.dtype != torch.uint8:
            raise DtypeError(f"a tkv cache is uint8, got {cache.dtype}")
        if cache.shape[1] != self.layout.page_bytes or not cache.is_contiguous():
            raise ShapeError(f"tkv cache must be contiguous (num_blocks, {self.layout.page_bytes})"
                             f" for {self.layout.describe()}, got {tuple(cache.shape)}")
        return cache.shape[0]

    def _lookup(self, side: str, dot_dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """``(table, LOOKUP_* code)`` that side ``side`` uses with ``dot_dtype`` dots (the
        ``lookup`` option resolved per side; see the class docstring)."""
        half = torch.bfloat16 if dot_dtype == torch.bfloat16 else torch.float16
        if dot_dtype == torch.float32 and self.lookup == "auto":
            half = None   # float32 dots (interpreter): exact float32 centroids
        if self.fetch_group_planes(side) == 1:
            half = None   # one plane: per-code gathers from the float32 table
        interp = interpreting()
        if self.lookup in _PRMT_FAMILY and interp and (side, half) in self._prmt:
            raise DtypeError(f"lookup={self.lookup!r} is PTX inline assembly: it needs a CUDA "
                             "device, not the Triton interpreter (use lookup='pair' there)")
        table, code = self.k_table if side == "k" else self.v_table, LOOKUP_GATHER
        if (side, half) in self._prmt and not interp:
            table, code = self._prmt[side, half]
        elif (side, half) in self._pairs:
            table, code = self._pairs[side, half]
        bits = self.k_bits if side == "k" else self.v_bits
        if self.lookup == "shuffle" and bits in (3, 4, 5) and self.fetch_group_planes(side) > 1:
            code = LOOKUP_SHUFFLE
        return table, code

    def decode_maxnreg(self, num_ctas: int, target_ctas: int,
                       dot_dtype: torch.dtype = torch.bfloat16) -> int | None:
        """Register cap for decode's split kernel (Triton ``maxnreg``) with ``num_ctas`` CTAs
        in the grid: :data:`PRMTI_MAXNREG` when it is set (``TKV_PRMTI_MAXNREG``; default
        0 = none), a side uses ``"prmti"`` and the grid has at least ``target_ctas`` (the
        workspace's ``target_programs``, 4 per SM: enough CTAs for an extra one per SM to
        hide latency); else None (the compiler's choice). 128 registers (168 → 128: 3 → 4
        CTAs of 4 warps per SM, 76 B of spills) measured 1.12-1.19× at 1,024-4,096 CTAs and
        0.95× at 256 in isolation, but far slower end to end in vLLM
        (:func:`_prmti_maxnreg_from_env`), hence off by default."""
        if num_ctas < target_ctas or not PRMTI_MAXNREG:
            return None
        return PRMTI_MAXNREG if self._side_lookups(dot_dtype) & _PRMTI else None

    def decode_num_stages(self, num_ctas: int, target_ctas: int,
                          dot_dtype: torch.dtype = torch.bfloat16, *, block_n: int = 128,
                          num_warps: int = 4) -> int:
        """Triton ``num_stages`` for decode's split kernel.

        Args:
            num_ctas: CTAs in the split kernel's grid (num_seqs · num_kv_heads · splits).
            target_ctas: the workspace's ``target_programs`` (4 per SM by default).
            dot_dtype: the tensor-core dot dtype (torch.float16 / torch.bfloat16).
            block_n, num_warps: the launch's tile length (tokens) and warps.

        Returns 2 (the code-tile loads become ``cp.async`` copies issued a tile ahead) when
        :data:`DECODE_PIPELINE` is on (``TKV_DECODE_PIPELINE``, default 1), both sides use
        ``"prmti"``, the launch is the measured one (head_dim 128, 128-token tiles, 4 warps)
        and the grid is under ``target_ctas`` — the split count hit ``max_splits`` and the
        chip holds under one CTA per scheduler slot, so load latency is exposed; else 1.

        Measured on the H200 (session 17, ``kernels_gpu.py --stages`` / ``--stages-small``,
        K4V4, Hkv=8): 1.04-1.15× faster pipelined at one sequence of 8K-128K tokens (256 CTAs),
        1.08-1.09× at two (512 CTAs); on grids of ≥ 1,024 CTAs (≥ 4 sequences) 0.89-0.94× at
        128-token tiles (186 instead of 168 registers: 2 CTAs per SM instead of 3), and 8
        warps or 64-token tiles pipelined lost at every size measured. Other head sizes are
        unmeasured and keep one stage. Pair / gather lookups stay at one stage: Triton
        stages their codebook gathers through shared memory (1.5-2× slower, session 1)."""
        if (not DECODE_PIPELINE or num_ctas >= target_ctas or self.head_dim != 128
                or block_n != 128 or num_warps != 4):
            return 1
        return 2 if self._side_lookups(dot_dtype) <= _PRMTI else 1

    def _side_lookups(self, dot_dtype: torch.dtype) -> set[int]:
        """The lookup codes the K and V sides use with ``dot_dtype`` dots."""
        return {self._lookup(s, dot_dtype)[1] for s in ("k", "v")}

    def lookup_name(self, side: str, dot_dtype: torch.dtype = torch.bfloat16) -> str:
        """The lookup side ``"k"``/``"v"`` really uses with ``dot_dtype`` dots: "prmt",
        "prmt1", "prmti", "prmts", "pair", "shuffle" or "gather" (a requested ``lookup``
        falls back per side)."""
        return _LOOKUP_NAMES[self._lookup(side, dot_dtype)[1]]

    def k_operand_a(self, dot_dtype: torch.dtype) -> bool:
        """Whether decode should compute scores as ``K · q^T`` (K tiles as the tensor-core A
        operand, fed from registers on Hopper) rather than ``q · K^T``: True when the K side
        uses ``prmt1``, whose unary asm lets Triton convert the uint8 code tile — not the
        16-bit planes — into the operand layout (no ``tl.trans`` between load and dot)."""
        return self._lookup("k", dot_dtype)[1] in (LOOKUP_PRMT1_F16, LOOKUP_PRMT1_BF16)

    def side_args(self, cache: torch.Tensor, side: str,
                  dot_dtype: torch.dtype = torch.float32) -> SideArgs:
        """Kernel arguments of side ``"k"``/``"v"``; ``dot_dtype`` (the tensor-core operand
        dtype) picks the lookup and the 16-bit type of its tables (see ``lookup``)."""
        lay = self.layout
        st = lay.strides()
        aux = cache.view(torch.bfloat16)
        table, code = self._lookup(side, dot_dtype)
        bits = lay.k_bits if side == "k" else lay.v_bits
        code_bytes = lay.k_code_bytes if side == "k" else lay.v_code_bytes
        gp = self.fetch_group_planes(side)
        p0 = bits + 16 * code_bytes + 65536 * code + (gp.bit_length() - 1 << _GROUP_SHIFT)
        if (side, code) in self._prmt_words:   # prmt1/prmti: the tables travel in the constexpr
            p0 += self._prmt_words[side, code] << _TABLE_SHIFT
            if self.resident_tables and code in _PRMTI:
                p0 += 1 << _RESIDENT_BIT
        if side == "k":
            return (cache, aux, table, lay.page_bytes, st["k_head"], st["k_token"],
                    p0, lay.k_codes_offset, lay.k_norms_offset, st["norm_head"], self.planes("k"))
        return (cache, aux, table, lay.page_bytes, st["v_head"], st["v_token"],
                p0, lay.v_codes_offset, lay.v_norms_offset, st["norm_head"], self.planes("v"))

    def bytes_per_token(self) -> float:
        return self.layout.bytes_per_token

    def __repr__(self) -> str:
        return f"TkvLoader({self.layout.describe()}, lookup={self.lookup})"


def sink_shift(loader, side: str, dummy: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Kernel arguments of a side's *sink shift*: ``(shift, True)`` when the loader flags rows
    by the sign bit of their ``row_scale`` (tkv codecs with sink offsets): a flagged token's
    vector is ``|row_scale|·tile + shift[head]``, ``shift`` float32 ``(num_kv_heads, d_pad)``
    in natural coordinate order (:attr:`TkvLoader.k_sink_shift`). Otherwise ``(dummy,
    False)``: row scales are used as they are (any loader without the optional
    ``k_sink_shift`` / ``v_sink_shift`` attributes, e.g. bypass and fp8)."""
    shift = getattr(loader, f"{side}_sink_shift", None)
    return (dummy, False) if shift is None else (shift, True)


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
def bypass_fetch(base, aux, table, blk, off, mask_n, head, stride_block, stride_head,
                 stride_tok, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                 P3: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr):
    """Raw fp16/bf16 paged tile: ``base[blk, off, head, :]`` (``P0`` = head_dim); row_scale
    1 (0 when masked)."""
    offs_d = tl.arange(0, D_PAD)
    row = blk.to(tl.int64) * stride_block + off.to(tl.int64) * stride_tok + head * stride_head
    m2 = mask_n[:, None] & (offs_d < P0)[None, :]
    x = tl.load(base + (row[:, None] + offs_d[None, :]), mask=m2, other=0.0)
    return x, tl.where(mask_n, 1.0, 0.0)


@triton.jit
def identity_dequant(raw, table, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                     P3: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr,
                     OUT_DTYPE: tl.constexpr):
    """One plane: the fetched tile itself, cast to the dot dtype."""
    return (raw.to(OUT_DTYPE),)


def _check_geometry(num_kv_heads, head_dim, block_size) -> None:
    """Raise ShapeError unless every geometry value is a positive int (a float head_dim or a
    zero block_size would otherwise reach the kernels as a malformed constant)."""
    for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("block_size", block_size)):
        check_positive_int(v, name)


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
        _check_geometry(num_kv_heads, head_dim, block_size)
        check_dtype(torch.empty(0, dtype=dtype), "dtype", (torch.float16, torch.bfloat16))
        self.num_kv_heads, self.head_dim, self.block_size, self.dtype = (
            num_kv_heads, head_dim, block_size, dtype)
        self.d_pad = max(16, next_pow2(head_dim))

    min_block_n = 16
    fetch = bypass_fetch
    dequant = identity_dequant

    def check_cache(self, cache) -> int:
        return _check_pair(cache, self.num_kv_heads, self.block_size, self.head_dim,
                           (self.dtype,), "bypass")

    def planes(self, side: str) -> int:
        return 1

    def side_args(self, cache, side: str, dot_dtype: torch.dtype = torch.float32) -> SideArgs:
        c = cache[0] if side == "k" else cache[1]
        return (c, c, c, c.stride(0), c.stride(2), c.stride(1), self.head_dim, 0, 0, 0, 1)

    def bytes_per_token(self) -> float:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).itemsize

    def __repr__(self) -> str:
        return (f"BypassLoader(kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"block={self.block_size}, {self.dtype})")


# ============================================================================ fp8 e4m3
@triton.jit
def fp8_e4m3_dequant(raw, table, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                     P3: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr,
                     OUT_DTYPE: tl.constexpr):
    """fp8-e4m3fn bytes (fetched by :func:`bypass_fetch` from the uint8 view). e4m3
    ``s eeee mmm`` (bias 7) maps exactly onto fp16 ``s 0eeee mmm0000000`` (bias 15) times
    2**8, normals and subnormals alike, so decoding is two masks, two shifts and a bitcast;
    the 2**8 and the per-tensor scale are in row_scale (:func:`fp8_e4m3_fetch`)."""
    b = raw.to(tl.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return (h.to(tl.int16).to(tl.float16, bitcast=True).to(OUT_DTYPE),)


@triton.jit
def fp8_e4m3_fetch(base, aux, table, blk, off, mask_n, head, stride_block, stride_head,
                   stride_tok, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                   P3: tl.constexpr, NP: tl.constexpr, D_PAD: tl.constexpr):
    """fp8 bytes of ``base[blk, off, head, :]`` (``P0`` = head_dim); row_scale = the
    per-tensor scale (``table``, one float32) · 2**8, 0 when masked."""
    raw, one = bypass_fetch(base, aux, table, blk, off, mask_n, head, stride_block,
                            stride_head, stride_tok, P0, P1, P2, P3, NP, D_PAD)
    return raw, one * (tl.load(table) * 256.0)


class Fp8Loader:
    """fp8-e4m3 paged KV with per-tensor float32 scales (value = fp8 · scale), vLLM-style.

    Args:
        num_kv_heads, head_dim, block_size: geometry (positive ints; ShapeError otherwise).
        k_scale, v_scale: float32 tensors of one element on the cache's device (decode and
            prefill raise DeviceMismatchError for a scale elsewhere).

    Cache: ``(k_cache, v_cache)``, each ``(num_blocks, block_size, num_kv_heads, head_dim)``
    ``torch.float8_e4m3fn`` (or its uint8 view). NaN encodings (0x7F/0xFF) are not decoded as
    NaN (they read as ±480): vLLM never writes them.
    """

    name = "fp8_e4m3"
    rotated = False

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int,
                 k_scale: torch.Tensor, v_scale: torch.Tensor):
        _check_geometry(num_kv_heads, head_dim, block_size)
        for nm, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(s, nm)
            check_dtype(s, nm, (torch.float32,))
            if s.numel() != 1:
                raise ShapeError(f"{nm} must hold one element, got shape {tuple(s.shape)}")
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.k_scale, self.v_scale = k_scale.reshape(1), v_scale.reshape(1)
        self.d_pad = max(16, next_pow2(head_dim))

    min_block_n = 16
    fetch = fp8_e4m3_fetch
    dequant = fp8_e4m3_dequant

    def check_cache(self, cache) -> int:
        return _check_pair(cache, self.num_kv_heads, self.block_size, self.head_dim,
                           (torch.float8_e4m3fn, torch.uint8), "fp8")

    def planes(self, side: str) -> int:
        return 1

    def side_args(self, cache, side: str, dot_dtype: torch.dtype = torch.float32) -> SideArgs:
        c = cache[0] if side == "k" else cache[1]
        c = c.view(torch.uint8)
        s = self.k_scale if side == "k" else self.v_scale
        return (c, c, s, c.stride(0), c.stride(2), c.stride(1), self.head_dim, 0, 0, 0, 1)

    def bytes_per_token(self) -> float:
        return 2 * self.num_kv_heads * self.head_dim

    def __repr__(self) -> str:
        return (f"Fp8Loader(kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"block={self.block_size})")
