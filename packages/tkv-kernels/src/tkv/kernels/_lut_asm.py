"""PTX byte-permute codebook lookups for 2- and 3-bit code groups (``lookup="prmt"``).

A codebook of ``2**bits`` 16-bit float centroids is held as two *byte tables* — the
centroids' low bytes and their high bytes, 4 entries per 32-bit word (:func:`byte_table_words`).
PTX ``prmt.b32 d, a, b, sel`` picks, for each of the 4 bytes of ``d``, one of the 8 bytes of
``b:a`` by a 3-bit selector nibble; so one ``prmt`` looks up 4 codes of an 8-entry table. A
third and fourth ``prmt`` pair each code's low and high byte into a 16-bit float. Nothing
touches memory: the tables are register operands of the asm (any codebook, no recompile per
layer), and the result is in the registers the code words arrived in — the same elementwise
layout, so Triton converts it into the tensor-core operand layout like any other tile.

Per call (``pack=2``: two code groups, i.e. two elements of the int32 tile that the loader
fetched) the asm returns one int32 per plane holding the two elements' 16-bit centroids
(element 0 in the low half), the convention of ``tl.inline_asm_elementwise`` for 16-bit
results. Instruction counts (PTX, before ptxas merges and/shift/or into ``LOP3``):

* 2 bits (a byte of 4 codes per group, 4 planes): the low-byte and high-byte tables fit one
  ``prmt`` source pair, so the selector ``[c, c+4, c', c'+4]`` yields two centroids in one
  ``prmt``: 6 instructions per 2 codes.
* 3 bits (8 codes in 3 bytes per group, 8 planes): the 8 codes are spread to one nibble each
  (3 mask/shift/or rounds), two groups' nibbles of a plane pair merged into one selector, then
  2 table ``prmt`` + 2 pairing ``prmt`` per 4 codes: 44 instructions per 16 codes.

(4-bit groups: ``loaders._prmt_lut16_asm``, 16-entry tables merged on bit 3.) The texts are
executed by a small PTX emulator in ``tests/test_prmt_lookup.py`` against random codebooks.
"""

from __future__ import annotations

import torch

__all__ = ["LUT_PACK", "byte_table_words", "lut_asm", "lut_constraints", "table_words"]

LUT_PACK = 2   # elements (code groups) per asm call


def table_words(bits: int) -> int:
    """32-bit words of one byte table of a ``bits``-bit codebook (``2**bits`` bytes, ≥ 1)."""
    return max(1, (1 << bits) // 4)


def byte_table_words(half_bits: torch.Tensor) -> torch.Tensor:
    """int32 ``(2 * table_words,)``: the low-byte table then the high-byte table of 16-bit
    float bit patterns ``half_bits`` (int, ``(2**bits,)``, values 0..65535); entry ``i`` is
    byte ``i % 4`` of word ``i // 4`` of its table."""
    h = half_bits.to(torch.int64)
    sh = torch.tensor([0, 8, 16, 24])
    lo, hi = (h & 0xFF).view(-1, 4), (h >> 8).view(-1, 4)
    words = torch.cat([(lo << sh).sum(1), (hi << sh).sum(1)])
    return torch.where(words < 2**31, words, words - 2**32).to(torch.int32)


def _planes(bits: int) -> int:
    return {2: 4, 3: 8}[bits]


def lut_constraints(bits: int) -> str:
    """Constraint string: one ``=r`` per plane, ``LUT_PACK`` ``r`` for the code groups, then
    ``LUT_PACK`` ``r`` per table word (broadcast scalars; the asm reads the first)."""
    n_in = LUT_PACK * (1 + 2 * table_words(bits))
    return ",".join(["=r"] * _planes(bits) + ["r"] * n_in)


def _spread3(w: str, out: str) -> list[str]:
    """3-bit codes ``c0..c7`` at bits ``3i`` of ``w`` → nibble ``i`` of ``out`` (bit 3 of
    each nibble clear): move codes 4-7 up by 4, then codes 2-3 / 6-7 by 2, then the odd codes
    by 1."""
    lines = []
    src = w
    for dst, keep, move, shift in (("w1", 0x00000FFF, 0x00FFF000, 4),
                                   ("w2", 0x003F003F, 0x0FC00FC0, 2),
                                   (out, 0x07070707, 0x38383838, 1)):
        lines += [f"and.b32 t0, {src}, 0x{keep:08x};", f"and.b32 t1, {src}, 0x{move:08x};",
                  f"shl.b32 t1, t1, {shift};", f"or.b32 {dst}, t0, t1;"]
        src = dst
    return lines


def lut_asm(bits: int) -> str:
    """PTX text of the ``bits``-bit lookup (2 or 3), ``pack=2``. Operands: outputs ``$0..``
    (one per plane), then the two code groups (int32: a byte of 4 two-bit codes, or 24 bits
    of 8 three-bit codes, LSB first), then the byte-table words (:func:`byte_table_words`),
    each ``LUT_PACK`` registers wide.

    Raises:
        ValueError: ``bits`` not 2 or 3.
    """
    if bits not in (2, 3):
        raise ValueError(f"the prmt group lookup covers 2- and 3-bit codes, got {bits}")
    np_ = _planes(bits)
    a, b = f"${np_}", f"${np_ + 1}"
    tw = table_words(bits)
    tab = [f"${np_ + LUT_PACK * (1 + i)}" for i in range(2 * tw)]   # lo words, then hi words
    lines = ["{"]
    if bits == 2:
        lo, hi = tab
        lines += [".reg .b32 t, x, y, z;", f"shl.b32 t, {b}, 8;", f"or.b32 x, {a}, t;"]
        for p in range(np_):   # plane p: codes at bits 2p of both bytes → [c, c+4, c', c'+4]
            lines += [f"shr.b32 y, x, {2 * p};", "and.b32 y, y, 0x0303;", "shl.b32 z, y, 4;",
                      "or.b32 z, z, y;", "or.b32 z, z, 0x4040;", f"prmt.b32 ${p}, {lo}, {hi}, z;"]
    else:
        lo0, lo1, hi0, hi1 = tab
        lines += [".reg .b32 t0, t1, w1, w2, sa, sb, sel, l, h;"]
        lines += _spread3(a, "sa") + _spread3(b, "sb")
        for k in range(4):   # planes 2k, 2k+1: byte k of sa / sb holds their two nibbles
            lines += [f"prmt.b32 sel, sa, sb, 0x{k | (4 + k) << 4:04x};",
                      f"prmt.b32 l, {lo0}, {lo1}, sel;", f"prmt.b32 h, {hi0}, {hi1}, sel;",
                      f"prmt.b32 ${2 * k}, l, h, 0x6240;", f"prmt.b32 ${2 * k + 1}, l, h, 0x7351;"]
    lines.append("}")
    return "\n".join(lines) + "\n"
