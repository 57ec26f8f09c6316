"""Bit packing of b-bit codes into bytes, LSB-first, for every width 2..8.

Bit order (one rule for every width)
------------------------------------
The codes ``c_0, c_1, ..., c_{n-1}`` of one vector form a little-endian bit stream: bit ``j``
of code ``c_i`` is stream bit ``i*b + j``, and stream bit ``s`` is bit ``s % 8`` of byte
``s // 8``. A vector of ``n`` codes therefore takes exactly ``ceil(n*b/8)`` bytes; the unused
high bits of the last byte are zero. For ``b = 4`` this is the familiar "low nibble first"
layout; for ``b = 3`` the 8 codes of a group fill 3 bytes, code 2 straddling bytes 0 and 1.

Implementation: codes are processed in groups of ``g = 8 / gcd(b, 8)`` codes, which fill
exactly ``g*b/8`` bytes (at most 56 bits, so one int64 word per group). All work is batched
tensor arithmetic; there is no Python loop over vectors.
"""

from __future__ import annotations

import math

import torch

from .errors import BitWidthError, DtypeError, ShapeError

__all__ = ["MAX_BITS", "MIN_BITS", "check_bits", "code_group", "pack_codes", "packed_bytes",
           "unpack_codes"]

MIN_BITS = 2
MAX_BITS = 8


def check_bits(bits: int, name: str = "bits") -> int:
    """Return ``bits`` as int if it is an integer in ``[2, 8]``.

    Raises:
        BitWidthError: ``bits`` is not an integer or lies outside ``2..8``.
    """
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise BitWidthError(f"{name} must be an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
    if not MIN_BITS <= bits <= MAX_BITS:
        raise BitWidthError(f"{name} must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")
    return bits


def packed_bytes(num_codes: int, bits: int) -> int:
    """Bytes taken by ``num_codes`` codes of ``bits`` bits: ``ceil(num_codes * bits / 8)``."""
    check_bits(bits)
    return (num_codes * bits + 7) // 8


def code_group(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of the smallest whole-byte group of ``bits``-bit codes:
    ``8 / gcd(bits, 8)`` codes in ``codes * bits / 8`` bytes (2→(4, 1), 3→(8, 3), 4→(2, 1),
    5→(8, 5), 6→(4, 3), 7→(8, 7), 8→(1, 1)). Kernels that unpack a group at a time use it."""
    g = 8 // math.gcd(bits, 8)
    return g, g * bits // 8


def pack_codes(codes: torch.Tensor, bits: int, *, check_range: bool = True) -> torch.Tensor:
    """Pack integer codes into bytes (LSB-first, see module docstring).

    Args:
        codes: integer tensor ``(..., n)`` with values in ``[0, 2**bits)``; any integer dtype.
        bits: code width, 2..8.
        check_range: refuse codes outside ``[0, 2**bits)`` (one min/max reduction and a host
            sync; such a code would spill into its neighbours' bits). The codec passes False
            for codes it made itself.

    Returns:
        uint8 tensor ``(..., ceil(n*bits/8))`` on the same device.

    Raises:
        BitWidthError: bad ``bits``, or (``check_range``) a code that does not fit in it.
        DtypeError: ``codes`` is not an integer tensor. ShapeError: ``codes`` is 0-d.
    """
    check_bits(bits)
    if not isinstance(codes, torch.Tensor):
        raise DtypeError(f"codes must be an integer torch.Tensor, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise DtypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0:
        raise ShapeError("codes must have at least one dimension")
    if check_range and codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= 1 << bits:
            raise BitWidthError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing, "
                                f"got values in [{lo}, {hi}]")
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    nbytes = (n * bits + 7) // 8
    if bits == 8:
        return codes.to(torch.uint8)
    g, gb = code_group(bits)
    ngroups = -(-n // g)
    # Word type: the g*bits bits of a group fit int32 for widths 2, 3, 4, 6 (<= 24 bits).
    wt = torch.int32 if g * bits <= 31 else torch.int64
    c = codes.to(wt)
    if ngroups * g != n:
        c = torch.nn.functional.pad(c, (0, ngroups * g - n))
    c = c.reshape(*lead, ngroups, g)
    if gb == 1:  # widths 2 and 4: one byte per group, OR the shifted codes directly
        out = c[..., 0].clone()
        for i in range(1, g):
            out |= c[..., i] << (i * bits)
        return out.to(torch.uint8).reshape(*lead, ngroups)[..., :nbytes]
    shifts = torch.arange(g, device=c.device, dtype=wt) * bits
    words = (c << shifts).sum(dim=-1, keepdim=True, dtype=wt)  # (..., ngroups, 1)
    byte_shifts = torch.arange(gb, device=c.device, dtype=wt) * 8
    out = ((words >> byte_shifts) & 0xFF).to(torch.uint8)  # (..., ngroups, gb)
    return out.reshape(*lead, ngroups * gb)[..., :nbytes]


def unpack_codes(packed: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`.

    Args:
        packed: uint8 tensor ``(..., ceil(num_codes*bits/8))``.
        bits: code width, 2..8.
        num_codes: codes per vector (``head_dim``).

    Returns:
        int64 tensor ``(..., num_codes)`` with values in ``[0, 2**bits)``.

    Raises:
        BitWidthError, DtypeError (not a uint8 tensor), ShapeError (``num_codes`` not a
        positive int, wrong last dim).
    """
    check_bits(bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise DtypeError(f"packed codes must be a uint8 torch.Tensor, got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)}")
    if isinstance(num_codes, bool) or not isinstance(num_codes, int) or num_codes < 1:
        raise ShapeError(f"num_codes must be a positive int, got {num_codes!r}")
    nbytes = (num_codes * bits + 7) // 8
    if packed.dim() == 0 or packed.shape[-1] != nbytes:
        raise ShapeError(
            f"packed last dim must be ceil({num_codes}*{bits}/8) = {nbytes} bytes, "
            f"got shape {tuple(packed.shape)}"
        )
    lead = packed.shape[:-1]
    if bits == 8:
        return packed.to(torch.int64)
    g, gb = code_group(bits)
    ngroups = -(-num_codes // g)
    mask = (1 << bits) - 1
    if gb == 1:  # widths 2 and 4
        p = packed.to(torch.int32).unsqueeze(-1)
        shifts = torch.arange(g, device=p.device, dtype=torch.int32) * bits
        codes = (p >> shifts) & mask
        return codes.reshape(*lead, nbytes * g)[..., :num_codes].to(torch.int64)
    wt = torch.int32 if g * bits <= 31 else torch.int64
    p = packed.to(wt)
    if ngroups * gb != nbytes:
        p = torch.nn.functional.pad(p, (0, ngroups * gb - nbytes))
    p = p.reshape(*lead, ngroups, gb)
    byte_shifts = torch.arange(gb, device=p.device, dtype=wt) * 8
    words = (p << byte_shifts).sum(dim=-1, keepdim=True, dtype=wt)
    shifts = torch.arange(g, device=p.device, dtype=wt) * bits
    codes = (words >> shifts) & mask
    return codes.reshape(*lead, ngroups * g)[..., :num_codes].to(torch.int64)
