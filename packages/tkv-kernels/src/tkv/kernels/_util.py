"""Small shared helpers for the kernel wrappers: validation with named errors, sizes."""

from __future__ import annotations

import os

import torch

from tkv.codec.errors import DeviceMismatchError, DtypeError, ShapeError

__all__ = ["check_dtype", "check_int_tensor", "check_same_device", "check_tensor", "next_pow2"]


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ ``n`` (≥ 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_tensor(x, name: str, ndim: int | None = None) -> torch.Tensor:
    """Raise DtypeError unless ``x`` is a tensor; ShapeError unless it has ``ndim`` dims."""
    if not isinstance(x, torch.Tensor):
        raise DtypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ShapeError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    return x


def check_dtype(x: torch.Tensor, name: str, dtypes) -> None:
    """Raise DtypeError unless ``x.dtype`` is one of ``dtypes``."""
    if x.dtype not in tuple(dtypes):
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise DtypeError(f"{name} must be {names}, got {str(x.dtype).replace('torch.', '')}")


def check_int_tensor(x, name: str, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """An index tensor of exactly ``dtype`` and ``ndim`` dims with unit stride on its last dim
    (engine metadata: the kernels index its last dim directly; a strided view, e.g.
    ``slots[::2]``, would be read as if contiguous). Raises DtypeError / ShapeError."""
    check_tensor(x, name, ndim)
    check_dtype(x, name, (dtype,))
    if x.numel() > 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ShapeError(f"{name} must have unit stride on its last dim (e.g. .contiguous()), "
                         f"got strides {x.stride()}")
    return x


def check_same_device(device: torch.device, **tensors) -> None:
    """Raise DeviceMismatchError unless every tensor lives on ``device``."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise DeviceMismatchError(f"{name} is on {t.device}, expected {device}")


def check_last_dim_contiguous(x: torch.Tensor, name: str) -> None:
    """Kernels read the head_dim axis with unit stride."""
    if x.stride(-1) != 1:
        raise ShapeError(f"{name} must have unit stride on its last dim, got strides {x.stride()}")


def check_out(out: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """Validate a caller-provided output buffer: ``shape``, fp16/bf16/fp32, unit stride on the
    last dim, no stride-0 dim of size > 1 (an expanded tensor: several outputs would land on
    one element), on ``device``. Raises ShapeError / DtypeError / DeviceMismatchError."""
    check_tensor(out, "out", len(shape))
    if tuple(out.shape) != tuple(shape):
        raise ShapeError(f"out must be {tuple(shape)}, got {tuple(out.shape)}")
    if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride(), strict=True)):
        raise ShapeError(f"out has stride {tuple(out.stride())}: an expanded (broadcast) tensor, "
                         "whose rows share memory, cannot take an output")
    check_dtype(out, "out", (torch.float16, torch.bfloat16, torch.float32))
    check_last_dim_contiguous(out, "out")
    check_same_device(device, out=out)


def tile_tokens(block_n: int | None, head_dim: int, min_block_n: int,
                small_head: int = 64) -> int:
    """Key/value tile length in tokens for decode and prefill: ``block_n`` if given, else
    ``small_head`` for head_dim <= 128 and 32 above (register budget), raised to the loader's
    ``min_block_n``. Decode passes the loader's ``preferred_block_n`` (TkvLoader: 128 for
    2/4/8-bit sides, the fastest on the H200 for K4V4,
    benchmarks/results/kernels_gpu_2026-11-29_planes.md).

    Raises:
        ValueError: an explicit ``block_n`` that is not an int power of two (Triton tiles), or
            is below ``min_block_n``.
    """
    if block_n is None:
        return max(small_head if head_dim <= 128 else 32, min_block_n)
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n & (block_n - 1):
        raise ValueError(f"block_n must be an int power of two, got {block_n!r}")
    if block_n < min_block_n:
        raise ValueError(f"this loader needs block_n >= {min_block_n} here, got {block_n}")
    return block_n


def interpreting() -> bool:
    """True under the Triton CPU interpreter (``TRITON_INTERPRET`` set to any value Triton
    itself reads as true: 1 / true / yes / on, any case)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def dot_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Tensor-core operand dtype for a query dtype: the query's own fp16/bf16 on a GPU;
    float32 under the interpreter (its ``tl.dot`` multiplies bf16 bit patterns as integers)."""
    if interpreting():
        return torch.float32
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def flag_from_env(environ, name: str, default: str, error: type[ValueError],
                  meaning: str) -> bool:
    """A ``0`` / ``1`` engine option from the environment (unset or blank: ``default``);
    anything else raises ``error`` with ``meaning`` (what each value does) in the message."""
    env = os.environ if environ is None else environ
    v = env.get(name, default).strip() or default
    if v not in ("0", "1"):
        raise error(f"{name}={v!r}: use {meaning}")
    return v == "1"


def int_from_env(environ, name: str, ok, error: type[ValueError], expected: str) -> int:
    """A non-negative integer engine option from the environment: plain ASCII digits (unset
    or blank: 0); a value that is not digits, or for which ``ok(n)`` is false, raises
    ``error`` naming the variable, its value and ``expected``."""
    raw = (os.environ if environ is None else environ).get(name, "0").strip() or "0"
    n = int(raw) if raw.isascii() and raw.isdigit() else -1   # plain ASCII digits only
    if n < 0 or not ok(n):
        raise error(f"{name}={raw!r}: expected {expected}")
    return n
