"""Search-free Lloyd-Max quantization for the CUDA store (``cuda/store_wht.cu``): the table.

The codec's code of a standardized coordinate ``z`` is ``#{b_j < z}`` over the side's
``2**bits − 1`` sorted decision boundaries (Lloyd-Max: Max 1960, Lloyd 1982; the codec's
``SideCodec.quantize``). A binary search costs ``bits`` dependent compares and loads per
coordinate. Instead the kernel cuts the line into ``ncell`` cells, no two boundaries in one
cell, and finds a coordinate's cell arithmetically:

    u    = sat(fma(y, A·sqrt(d)/n, B))      (float32, clamped to [0, 1]; NaN → 0; A·z + B)
    cell = rint(u · (ncell − 1))            (one FMA with 1.5·2^23: exact rounding)
    c    = cells[cell] / 4                  (the boundaries below the cell)
    code = c + (u_c < u)                    (u_j = fma(b_j, A, B), the boundaries in u)

so each coordinate costs two FMAs, one byte load, one boundary load and one compare. The
compare happens in u (an affine image of z), so a coordinate within float32 rounding of a
boundary may take the neighbouring code — as any float32 evaluation of z may. :func:`build`
chooses ``A``, ``B`` and the smallest ``ncell`` for which every cell — widened by a float32
rounding margin — holds at most one boundary, and checks that property exactly; it returns
``ncell = 0`` (the kernel then runs the binary search) when 256 cells cannot separate the
boundaries (7- and 8-bit codebooks, whose byte ``4·c`` would not fit, always do).

The table is one ``uint8`` tensor, the kernel's shared-memory image::

    [0:4] A (float32)  [4:8] B (float32)  [8:12] ncell (int32)  [12:16] zero
    [16 : 16 + 4·2**bits]            boundaries u_j (grid) or b_j (search), float32, the
                                     last one +inf
    [.. : .. + 4·2**bits]            scaled centroids t_c = c / sqrt(head_dim), float32 (the
                                     loader's ``k_table``: norm correction, sink errors)
    [.. : .. + 4·2**bits]            t_{c+1} (the last one repeated): with t_c, the cell's two
                                     candidates at the same offset 4·c
    [.. : .. + ncell]                cells: 4·c (the byte offset of boundary c), uint8
    zero padding to a multiple of 16 bytes
"""

from __future__ import annotations

import bisect
import itertools
import math
import struct

import torch

__all__ = ["HEADER_BYTES", "MAX_CELLS", "build", "emulate"]

HEADER_BYTES = 16
MAX_CELLS = 256
_GRID_MAX_BITS = 6   # 4·c fits a byte up to 6 bits (c ≤ 63)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _fma32(x: float, a: float, b: float) -> float:
    """float32 ``fma(x, a, b)`` of float32 values: exact in float64 (24-bit operands), one
    rounding to float32."""
    return _f32(x * a + b)


def _cells(bounds: list[float], ncell: int):
    """``(A, B, u_bounds, cells)`` for ``ncell`` cells — ``A``, ``B`` float32 values,
    ``u_bounds`` the float32 boundaries ``fma(b_j, A, B)`` — or None when some cell holds two
    boundaries. ``bounds``: float32 values, sorted, finite, at least two."""
    lo, hi = bounds[0], bounds[-1]
    w = (hi - lo) / (ncell - 3)       # b_0 in cell 1, the last boundary in cell ncell − 2
    z0 = lo - w
    scale = w * (ncell - 1)
    if not scale > 0:
        return None
    try:
        a, b = _f32(1.0 / scale), _f32(-z0 / scale)
        ub = [_fma32(x, a, b) for x in bounds]
    except OverflowError:   # struct refuses values beyond float32's range
        return None
    if not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or not 0 < ub[0] <= ub[-1] < 1:
        return None
    # cell k holds the float32 u with u·(ncell − 1) ∈ [k − ½, k + ½] exactly (the kernel's FMA
    # rounds u·(ncell − 1) + 1.5·2^23 once): at most one boundary per closed cell, and the
    # boundaries strictly inside (0, 1), so the saturation never changes a comparison
    # (ub is sorted — fma(b_j, A, B) with A > 0 is monotone — so counts are bisections)
    eps = 1e-9 / (ncell - 1)
    cells = []
    for k in range(ncell):
        lo_k, hi_k = (k - 0.5) / (ncell - 1) - eps, (k + 0.5) / (ncell - 1) + eps
        below = bisect.bisect_left(ub, lo_k)              # #{u_j < lo_k}
        if bisect.bisect_right(ub, hi_k) - below > 1:     # #{lo_k ≤ u_j ≤ hi_k}
            return None
        cells.append(below)
    return a, b, ub, cells


def build(boundaries: torch.Tensor, centroids: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """The side's quantization table (module docstring) and its ``ncell`` (0: binary search).

    Args:
        boundaries: ``(2**bits − 1,)`` sorted decision boundaries, standardized units (the
            codec's ``SideCodec.boundaries``), any float dtype, any device.
        centroids: ``(2**bits,)`` scaled centroids ``c / sqrt(head_dim)`` (``k_table``).
        bits: the side's width, 2..8.

    Returns:
        ``(table, ncell)``: ``table`` a CPU ``uint8`` tensor (move it to the device once, at
        loader construction: never inside CUDA-graph capture).

    Raises:
        ValueError: ``bits`` outside 2..8, or tensors of the wrong length.
    """
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    nb = 1 << bits
    bnd = boundaries.detach().double().cpu().reshape(-1)
    cen = centroids.detach().float().cpu().reshape(-1)
    if bnd.shape[0] != nb - 1 or cen.shape[0] != nb:
        raise ValueError(f"{bits}-bit side needs {nb - 1} boundaries and {nb} centroids, got "
                         f"{bnd.shape[0]} and {cen.shape[0]}")
    # the kernel compares float32 z with float32 boundaries: build on those values
    b32 = bnd.float()
    vals = b32.double().tolist()
    found = None
    if (bits <= _GRID_MAX_BITS and bool(torch.isfinite(b32).all())
            and all(x < y for x, y in itertools.pairwise(vals))):
        for ncell in range(8, MAX_CELLS + 1):
            found = _cells(vals, ncell)
            if found is not None:
                break
    if found is None:   # the binary search: standardized boundaries
        a, b, ub, cells = 0.0, 0.0, vals, []
    else:
        a, b, ub, cells = found
    ncell = len(cells)
    size = HEADER_BYTES + 12 * nb + ncell
    out = torch.zeros((size + 15) // 16 * 16, dtype=torch.uint8)
    out[:HEADER_BYTES] = torch.frombuffer(bytearray(struct.pack("<ffii", a, b, ncell, 0)),
                                          dtype=torch.uint8)
    bounds = torch.tensor([*ub, math.inf], dtype=torch.float32)
    out[HEADER_BYTES:HEADER_BYTES + 4 * nb] = bounds.view(torch.uint8)
    out[HEADER_BYTES + 4 * nb:HEADER_BYTES + 8 * nb] = cen.contiguous().view(torch.uint8)
    above = torch.cat([cen[1:], cen[-1:]]).contiguous()   # centroid c + 1 (the last repeated)
    out[HEADER_BYTES + 8 * nb:HEADER_BYTES + 12 * nb] = above.view(torch.uint8)
    out[HEADER_BYTES + 12 * nb:size] = torch.tensor([4 * c for c in cells], dtype=torch.uint8)
    return out, ncell


def emulate(z: torch.Tensor, table: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's codes for float32 ``z`` from ``table`` (:func:`build`), on the CPU, with
    its float32 arithmetic (each FMA rounded once) — the kernel's ``y = z`` at a vector scale
    of exactly ``A`` (grid mode) or 1 (search). Within float32 rounding of ``#{b_j < z}``
    (the codec's rule; exactly it in search mode); 0 for NaN. Returns int64 codes."""
    nb = 1 << bits
    a, b, ncell, _ = struct.unpack("<ffii", bytes(table[:HEADER_BYTES].tolist()))
    bounds = table[HEADER_BYTES:HEADER_BYTES + 4 * nb].clone().view(torch.float32)
    z32 = z.float()
    nan = z32 != z32
    if ncell == 0:
        return torch.searchsorted(bounds[:-1], z32, right=False).masked_fill(nan, 0)
    cells = table[HEADER_BYTES + 12 * nb:HEADER_BYTES + 12 * nb + ncell].long()
    u = (z32.double() * a + b).float().clamp(0.0, 1.0)   # fma: exact in float64, one rounding
    u = torch.where(nan, torch.zeros_like(u), u)
    cell = torch.round(u.double() * (ncell - 1)).long()   # RNE, as the magic-number FMA
    c = cells[cell] // 4
    return c + (bounds[c] < u).long()
