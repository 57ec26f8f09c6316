"""Fused compress + store in hand-written CUDA (``cuda/store_wht.cu``).

The same computation as ``compress_store(rotation="wht")`` (the Walsh–Hadamard butterflies),
in a layout Triton does not produce (docs/kernels.md, session 34): a vector's coordinates live
E to a lane across D/E lanes, so the butterflies are register FMAs and lane shuffles with no
shared-memory round trip, the per-coordinate constants stay in registers across a grid-stride
loop over tokens, and the Lloyd-Max search is replaced by a table lookup
(:mod:`tkv.kernels._quant_grid`): a cell from one fused multiply-add, one byte, one compare.

Scope (:func:`check_supported`): a :class:`~tkv.kernels.TkvLoader` whose rotation is a pure
power-of-two Hadamard (``k_store_hadamard`` / ``v_store_hadamard``), head_dim 64 / 128 / 256,
any K and V widths 2..8, key centering, channel scales, norm correction and sink offsets as
the loader has them, float32 / bfloat16 / float16 K and V whose base addresses are 16-byte
aligned and whose token and head strides are multiples of 16 bytes, a CUDA device of compute
capability ≥ 8.0.
"""

from __future__ import annotations

import functools
import math

import torch

from tkv.codec.errors import ShapeError, TkvError

from . import _nvrtc
from ._util import (
    UnsupportedKernelError,
    choice_from_env,
    cuda_device_refusal,
    read_at_import,
)
from .loaders import TkvLoader

__all__ = [
    "ENV_STORE_KERNEL",
    "STORE_KERNEL",
    "StoreKernelConfigError",
    "check_supported",
    "defines",
    "launch",
    "store_kernel_from_env",
    "supported",
]

SOURCE = "store_wht.cu"
ENTRY = "tkv_store_wht"
WARPS = 4
# defaults for :func:`launch`'s tuning keywords (elems: coordinates per lane, 8 or 16;
# ctas_per_sm: the grid's CTAs per SM before the grid-stride loop takes over, default 16);
# benchmarks override them to time variants
TUNING: dict[str, int] = {}
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_INT32_MAX = 2**31 - 1

ENV_STORE_KERNEL = "TKV_STORE_KERNEL"
_KERNELS = ("auto", "triton", "cuda")


class StoreKernelConfigError(TkvError, ValueError):
    """``TKV_STORE_KERNEL`` names no compress_store kernel."""


def store_kernel_from_env(environ=None) -> str:
    """``compress_store``'s kernel when the caller names none (``TKV_STORE_KERNEL``): ``auto``
    (default: the CUDA store where :func:`check_supported` accepts the call and no
    Triton-only option — ``block_t``, ``num_warps``, ``chunk``, a matrix ``rotation`` — is
    given, else the Triton store), ``triton`` or ``cuda`` (refused calls raise
    UnsupportedKernelError). The CUDA store is 2.2-2.8× the Triton store at 16K tokens and
    1.2× at 64 to 256; the 36-layer engine-like step is 0.2-0.3 % faster with it at 64 and
    256 sequences (docs/kernels.md, sessions 34-35), hence the default since session 35.
    Read once at import into :data:`STORE_KERNEL`.

    Raises:
        StoreKernelConfigError: any other value."""
    return choice_from_env(environ, ENV_STORE_KERNEL, _KERNELS, "auto",
                           StoreKernelConfigError,
                           "expected auto (default: the CUDA store where it applies, else "
                           "Triton), triton or cuda")


STORE_KERNEL = read_at_import(store_kernel_from_env)


def _vector_ok(x: torch.Tensor) -> bool:
    """16-byte loads: base address and token / head strides in multiples of 16 bytes."""
    es = x.element_size()
    return (x.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in x.stride()[:2])
            and all(0 <= s <= _INT32_MAX for s in x.stride()[:2]))


def check_supported(loader, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                    rotation: str) -> None:
    """Raise :class:`~tkv.kernels._util.UnsupportedKernelError` unless
    ``compress_store(kernel="cuda")`` can serve the call (module docstring: the scope).
    ``rotation`` is the one :func:`~tkv.kernels.store.store_rotation_for` resolved."""
    why = None
    if not isinstance(loader, TkvLoader):
        why = "needs a TkvLoader"
    elif rotation != "wht" or loader.k_store_quant is None:
        why = (f"runs the Walsh–Hadamard butterflies only (a pure power-of-two Hadamard "
               f"rotation, rotation 'auto' or 'wht'), got rotation {rotation!r}")
    elif loader.head_dim not in (64, 128, 256):
        why = f"needs head_dim 64, 128 or 256, got {loader.head_dim}"
    elif not (_vector_ok(key) and _vector_ok(value)):
        why = ("needs key and value with 16-byte aligned base addresses and token / head "
               "strides that are multiples of 16 bytes")
    elif (refusal := cuda_device_refusal(cache.device)) is not None:
        why = refusal
    elif torch.cuda.get_device_capability(cache.device) < (8, 0):
        why = "needs compute capability 8.0 or newer"
    if why:
        raise UnsupportedKernelError(f"compress_store(kernel='cuda') {why}")


def supported(loader, key, value, cache, rotation: str) -> bool:
    """Whether :func:`check_supported` accepts the call and this PyTorch has the NVRTC
    bindings (``compress_store(kernel="auto")``'s test)."""
    try:
        check_supported(loader, key, value, cache, rotation)
    except UnsupportedKernelError:
        return False
    return _nvrtc.available()


def _store_align(cache: torch.Tensor, lay, st: dict, side: str, lane_bytes: int) -> int:
    """The alignment (bytes, ≤ 16) every lane's code store has: the gcd of the cache's base
    address, the page size, the side's code offset, head and token strides (``st`` =
    ``lay.strides()``) and the lane's byte offset (one source: the loader's SlotLayout)."""
    off = lay.k_codes_offset if side == "k" else lay.v_codes_offset
    g = 16
    for v in (cache.data_ptr(), lay.page_bytes, off, st[f"{side}_head"], st[f"{side}_token"],
              lane_bytes):
        g = math.gcd(g, int(v))
    return g


def defines(loader: TkvLoader, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, *,
            elems: int | None = None) -> dict[str, int]:
    """The ``-D`` defines of one configuration (the compile key; see the source's header).
    ``elems``: coordinates per lane, 8 or 16 (default 16; 8 at head_dim 64).

    Raises:
        ShapeError: ``elems`` not 8 or 16."""
    d = loader.head_dim
    e = elems or (8 if d <= 64 else 16)
    if e not in (8, 16):
        raise ShapeError(f"cuda store tuning: elems={e} (8 or 16)")
    out = dict(HEAD_DIM=d, E=e, WARPS=WARPS, BLOCK_SIZE=loader.block_size,
               K_MU=int(loader.k_mu is not None))
    lay = loader.layout
    st = lay.strides()
    for s, x in (("k", key), ("v", value)):
        bits = loader.k_bits if s == "k" else loader.v_bits
        S = s.upper()
        out.update({f"{S}_BITS": bits, f"{S}_KIND": _KIND[x.dtype],
                    f"{S}_NC": int(getattr(loader, f"{s}_norm_correction")),
                    f"{S}_SINK": int(getattr(loader, f"{s}_sink_shift") is not None),
                    f"{S}_NCELL": getattr(loader, f"{s}_store_ncell"),
                    f"{S}_ALIGN": _store_align(cache, lay, st, s, e * bits // 8)})
    return out


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
           slot_mapping: torch.Tensor, num_blocks: int, loader: TkvLoader, *,
           elems: int | None = None, ctas_per_sm: int | None = None) -> None:
    """Launch the CUDA store on grid ``(x, num_kv_heads, 2)`` (z: K, V), ``x`` capped at
    ``ctas_per_sm`` × the SM count over the heads and sides (default 16: H100, K4V4, 16K
    tokens, 0.0438 ms against 0.0464 at 8 and 0.0461 at 4,
    ``benchmarks/results/cuda_store_gpu_2026-12-06_s34_h100.md``); each warp then walks its
    token groups with a stride. Arguments as :func:`~tkv.kernels.compress_store`, already
    checked there (shapes, dtypes, devices) and by :func:`check_supported`.

    Raises:
        CudaCompileError: the kernel did not compile."""
    lay = loader.layout
    st = lay.strides()
    n = key.shape[0]
    cfg = {**TUNING, **({"elems": elems} if elems else {})}
    dfn = defines(loader, key, value, cache, elems=cfg.get("elems"))
    k = _nvrtc.kernel(SOURCE, ENTRY, dfn, cache.device)
    groups = -(-n // (32 // (lay.head_dim // dfn["E"])))
    dev = cache.device.index if cache.device.index is not None else torch.cuda.current_device()
    per = ctas_per_sm or cfg.get("ctas_per_sm", 16)
    cap = max(1, -(-per * _sm_count(dev) // (2 * lay.num_kv_heads)))
    gx = max(1, min(-(-groups // WARPS), cap))
    dummy = loader.k_store_quant

    def opt(t):
        return dummy if t is None else t

    args = [key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
            slot_mapping, n, num_blocks * lay.block_size, cache, lay.page_bytes,
            lay.k_codes_offset, st["k_head"], st["k_token"], lay.k_norms_offset,
            lay.v_codes_offset, st["v_head"], st["v_token"], lay.v_norms_offset,
            st["norm_head"], loader.k_store_hadamard, loader.v_store_hadamard, opt(loader.k_mu),
            0 if loader.k_mu is None or loader.k_mu.shape[0] == 1 else loader.d_pad,
            opt(loader.k_sink_shift), opt(loader.v_sink_shift), opt(loader.k_sink_delta),
            opt(loader.v_sink_delta), loader.k_inv_scale, loader.v_inv_scale,
            loader.k_store_quant, loader.v_store_quant]
    with torch.cuda.device(cache.device):   # PyTorch's launcher takes the current device's stream
        k(grid=(gx, lay.num_kv_heads, 2), block=(WARPS * 32, 1, 1), args=args)
