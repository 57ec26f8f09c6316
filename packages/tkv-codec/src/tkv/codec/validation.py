"""Input checks shared by the codec and the bundle: one place that turns bad input into a
named error with a clear message (see :mod:`tkv.codec.errors`)."""

from __future__ import annotations

import torch

from .errors import DeviceMismatchError, DtypeError, NonFiniteError, ShapeError

__all__ = [
    "FLOAT_DTYPES",
    "check_channel_offset",
    "check_channel_scales",
    "check_device",
    "check_vectors",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_device(t: torch.Tensor, device: torch.device, name: str) -> None:
    """Raise DeviceMismatchError unless ``t`` is on ``device`` (an index-less device matches any
    index of its type)."""
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        raise DeviceMismatchError(f"{name} is on {t.device}, but the codec lives on {device}")


def check_vectors(x: torch.Tensor, head_dim: int, device: torch.device, name: str,
                  check_finite: bool) -> None:
    """Validate a K/V/query tensor ``(..., head_dim)`` of a float dtype on ``device``.

    Raises:
        DtypeError: not a tensor of float16/bfloat16/float32/float64.
        ShapeError: 0-d, or last dim != head_dim.
        DeviceMismatchError: wrong device.
        NonFiniteError: NaN or Inf present (only when ``check_finite``).
    """
    if not isinstance(x, torch.Tensor):
        raise DtypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise DtypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}"
        )
    if x.dim() == 0 or x.shape[-1] != head_dim:
        raise ShapeError(f"{name} must have shape (..., {head_dim}), got {tuple(x.shape)}")
    check_device(x, device, name)
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(f"{name} holds {bad} NaN/Inf value(s); K/V must be finite")


def _channel_vector(v, head_dim: int, name: str) -> torch.Tensor:
    """A real ``(head_dim,)`` vector as float32 on the CPU (DtypeError for strings, complex or
    non-numeric input; ShapeError / NonFiniteError as the callers say)."""
    if isinstance(v, (str, bytes)):
        raise DtypeError(f"{name} must be a real tensor / sequence of numbers, got a string")
    try:
        t = torch.as_tensor(v).detach()
    except (TypeError, ValueError, RuntimeError) as e:
        raise DtypeError(f"{name} must be a real tensor / sequence of numbers: {e}") from None
    if t.is_complex() or t.dtype == torch.bool:
        raise DtypeError(f"{name} must be real numbers, got {t.dtype}")
    t = t.to("cpu", torch.float32)
    if t.shape != (head_dim,):
        raise ShapeError(f"{name} must have shape ({head_dim},), got {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteError(f"{name} must be finite")
    return t


def check_channel_scales(s, head_dim: int, name: str) -> torch.Tensor | None:
    """Return per-channel scales as a float32 CPU tensor ``(head_dim,)``, or None.

    Raises:
        ShapeError: not ``(head_dim,)``. DtypeError: not real numbers. NonFiniteError: NaN/Inf.
        ValueError: a scale below float32's smallest normal number (1.18e-38: zero, negative,
        or subnormal — ``1/s`` would overflow; the bundle refuses them too).
    """
    if s is None:
        return None
    t = _channel_vector(s, head_dim, name)
    if not bool((t >= torch.finfo(torch.float32).tiny).all()):
        raise ValueError(f"{name} must be positive normal float32 numbers (>= 1.18e-38), got "
                         f"min {float(t.min()):.3g}")
    return t


def check_channel_offset(m, head_dim: int, name: str) -> torch.Tensor | None:
    """Return a key offset μ as a float32 CPU tensor, or None.

    Two forms: ``(head_dim,)`` (one mean shared by every KV head of the layer) or
    ``(num_kv_heads, head_dim)`` (one mean per KV head; inputs then carry the head axis at -2).

    Raises:
        ShapeError: neither ``(head_dim,)`` nor ``(H, head_dim)`` with H >= 1. NonFiniteError: NaN/Inf.
    """
    if m is None:
        return None
    t = torch.as_tensor(m).detach().to("cpu", torch.float32)
    if t.dim() == 2:
        if t.shape[0] < 1 or t.shape[1] != head_dim:
            raise ShapeError(f"{name} must have shape ({head_dim},) or (num_kv_heads, {head_dim}), "
                             f"got {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{name} must be finite")
        return t
    if t.dim() != 1:
        raise ShapeError(f"{name} must have shape ({head_dim},) or (num_kv_heads, {head_dim}), "
                         f"got {tuple(t.shape)}")
    return _channel_vector(t, head_dim, name)


def check_seed(seed) -> int:
    """The rotation seed: an int in ``[0, 2**64)`` (SplitMix64's state is 64 bits, so other
    values would silently alias: ``2**64`` is ``0``, ``-1`` is ``2**64 - 1``).

    Raises:
        ValueError: a bool, a non-int, or an int outside the range (the message names it)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        shown = repr(seed) if len(repr(seed)) <= 40 else repr(seed)[:40] + "..."
        raise ValueError(f"seed must be an int in [0, 2**64), got {shown}")
    return seed
