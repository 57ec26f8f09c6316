"""Small shared helpers for the kernel wrappers: validation with named errors, sizes."""

from __future__ import annotations

import math
import os

import torch

from tkv.codec.errors import DeviceMismatchError, DtypeError, NonFiniteError, ShapeError, TkvError

__all__ = ["check_dtype", "check_int_tensor", "check_same_device", "check_tensor", "next_pow2"]


class UnsupportedKernelError(ValueError):
    """``decode(kernel=...)`` named an alternative split kernel ("gluon", "cuda") for a call
    it cannot serve (each kernel's ``check_supported`` says why)."""


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


def check_flag(value, name: str) -> bool:
    """A host ``bool`` option (``"no"`` / ``"False"`` / ``0`` would otherwise read as a truth
    value and silently pick the other code path). Raises DtypeError."""
    if not isinstance(value, bool):
        raise DtypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_positive_int(value, name: str) -> int:
    """A host int ≥ 1 (geometry, launch stages); a bool, float or string raises ShapeError
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShapeError(f"{name} must be a positive int, got {value!r}")
    return value


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale as a float: ``1/sqrt(head_dim)`` for None. Raises DtypeError for a
    non-number, NonFiniteError for NaN / ±inf (every output row would be NaN)."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, int | float):
        raise DtypeError(f"sm_scale must be a float or None, got {sm_scale!r}")
    v = float(sm_scale)
    if not math.isfinite(v):
        raise NonFiniteError(f"sm_scale must be finite, got {sm_scale!r}")
    return v


def check_pow2(value, name: str, lo: int = 1, hi: int | None = None) -> int:
    """A host int that is a power of two in ``[lo, hi]`` (Triton tile sizes, warps, split
    counts). Raises ShapeError naming ``name`` (a float, a bool or a string included)."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < lo
            or value & (value - 1) or (hi is not None and value > hi)):
        span = f"[{lo}, {hi}]" if hi is not None else f"≥ {lo}"
        raise ShapeError(f"{name} must be an int power of two {span}, got {value!r}")
    return value


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges the views ``a`` and ``b`` span in one storage intersect (empty
    views never do). Host-side pointer arithmetic only (no sync); conservative for strided
    views (their spans, not their exact elements)."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, a1 = span(a)
    b0, b1 = span(b)
    return a0 < b1 and b0 < a1


def check_no_overlap(out: torch.Tensor, **inputs: torch.Tensor) -> None:
    """Raise ShapeError if ``out`` shares memory with one of ``inputs`` that other programs
    still read while ``out`` is written (e.g. prefill's chunk K/V): :func:`shares_memory`."""
    for name, x in inputs.items():
        if x is not None and shares_memory(out, x):
            raise ShapeError(f"out shares memory with {name}, which the kernel still reads "
                             "while it writes out: pass a separate output buffer")


def check_side_args_device(device: torch.device, kargs, vargs) -> None:
    """Every tensor a loader hands the kernels (cache views, codebook tables, scales) is on
    ``device``. Raises DeviceMismatchError naming the side and argument."""
    for side, args in (("k", kargs), ("v", vargs)):
        for i, t in enumerate(args):
            if isinstance(t, torch.Tensor) and t.device != device:
                raise DeviceMismatchError(f"the loader's {side} argument {i} (cache view, table "
                                          f"or scale) is on {t.device}, expected {device}")


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


def _shown(raw: str) -> str:
    """An environment value as an error message quotes it: at most 40 characters."""
    return raw if len(raw) <= 40 else raw[:40] + f"... ({len(raw)} characters)"


def int_from_env(environ, name: str, ok, error: type[ValueError], expected: str) -> int:
    """A non-negative integer engine option from the environment: plain ASCII digits (unset
    or blank: 0); a value that is not digits, or for which ``ok(n)`` is false, raises
    ``error`` naming the variable, its value and ``expected``."""
    raw = (os.environ if environ is None else environ).get(name, "0").strip() or "0"
    # plain ASCII digits only, and few enough that int() answers (it refuses > 4300 digits)
    n = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else -1
    if n < 0 or not ok(n):
        raise error(f"{name}={_shown(raw)!r}: expected {expected}")
    return n


def choice_from_env(environ, name: str, choices, default: str, error: type[ValueError],
                    expected: str) -> str:
    """A named engine option from the environment: one of ``choices``, any case, blanks
    around it ignored (unset or blank: ``default``); anything else raises ``error`` naming
    the variable, its value and ``expected`` (what each choice does)."""
    env = os.environ if environ is None else environ
    v = str(env.get(name) or "").strip().lower() or default
    if v not in choices:
        raise error(f"{name}={_shown(v)!r}: {expected}")
    return v


# settings read once when a kernel module is imported, whose value was refused (see below)
_IMPORT_SETTING_ERRORS: list[TkvError] = []


def read_at_import(parse):
    """``parse()`` of the process environment, for a setting read once when its kernel module
    is imported (``TKV_PRMTI_MAXNREG``, ``TKV_DECODE_PIPELINE``, ``TKV_DECODE_SINGLE_SPLIT``,
    ``TKV_DECODE_MIN_SPLIT_TILES``, ``TKV_STORE_ROTATION``, ``TKV_DECODE_KERNEL``,
    ``TKV_STORE_KERNEL``, ``TKV_DECODE_SCHEDULE``, ``TKV_DECODE_CONTEXT``). A value ``parse`` refuses is not raised
    here: the engines import
    tkv's kernels while registering their plugins, where a raise breaks every run of that
    engine, tkv or not (vLLM's ``load_general_plugins``), or is buried under a usage dump
    (SGLang). It is kept, the default (``parse({})``) stands in,
    and :func:`check_import_settings` raises it — the engines' launch-time validation
    (``engine_kernel_settings``) and every ``decode`` / ``prefill`` / ``compress_store`` /
    ``Workspace`` call run it first, so nothing ever runs on the stand-in."""
    try:
        return parse()
    except TkvError as e:
        _IMPORT_SETTING_ERRORS.append(e)
        return parse({})


def check_import_settings() -> None:
    """Raise the first import-time setting error :func:`read_at_import` kept (its named
    error, e.g. ``MaxnregConfigError``), if any."""
    if _IMPORT_SETTING_ERRORS:
        raise _IMPORT_SETTING_ERRORS[0]


def cuda_device_refusal(device) -> str | None:
    """Why a hand-written CUDA kernel cannot run on ``device`` here — not a CUDA device (named),
    the Triton interpreter is on (``TRITON_INTERPRET=1``), or PyTorch was built without CUDA —
    or None when it can."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"needs a CUDA device, got {dev.type}"
    if interpreting():
        return "does not run under the Triton interpreter (TRITON_INTERPRET=1)"
    if torch.version.cuda is None:
        return "needs a PyTorch built with CUDA"
    return None
