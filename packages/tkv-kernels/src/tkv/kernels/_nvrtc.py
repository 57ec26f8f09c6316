"""Run-time compilation of tkv's CUDA C++ kernels (``tkv/kernels/cuda/*.cu``) with NVRTC.

NVRTC ships with PyTorch's CUDA wheels (``nvidia-cuda-nvrtc``), so this needs no CUDA toolkit,
no host compiler and no build step: a kernel is compiled to a cubin for the device's compute
capability the first time a configuration (its ``-D`` defines) is launched, then cached per
process. PyTorch's own NVRTC and driver bindings (``torch.cuda._utils``, the machinery behind
``torch.cuda._compile_kernel``) do the compiling, module loading and ``cuLaunchKernel`` on the
current stream, so launches are captured by CUDA graphs like any other kernel.
"""

from __future__ import annotations

import functools
import warnings
from importlib import resources

import torch

from tkv.codec.errors import TkvError

__all__ = ["CudaCompileError", "available", "compile_cubin", "ctas_per_sm", "kernel",
           "reserve_dynamic_smem", "source", "warn_fallback"]


class CudaCompileError(TkvError, RuntimeError):
    """A tkv CUDA kernel did not compile or load (NVRTC's log is in the message), or this
    PyTorch build has no NVRTC bindings."""


@functools.cache
def source(name: str) -> str:
    """The text of ``tkv/kernels/cuda/<name>``."""
    return (resources.files("tkv.kernels") / "cuda" / name).read_text()


def available() -> bool:
    """Whether this PyTorch exposes the NVRTC compile and module-load bindings used here."""
    try:
        from torch.cuda import _utils
    except ImportError:   # pragma: no cover - PyTorch without CUDA support compiled in
        return False
    return hasattr(_utils, "_nvrtc_compile") and hasattr(_utils, "_cuda_load_module")


def _options(defines: tuple[tuple[str, int], ...]) -> list[str]:
    return ["-std=c++17", *(f"-D{k}={int(v)}" for k, v in defines)]


def compile_cubin(name: str, entry: str, defines: dict[str, int], arch: str) -> bytes:
    """Compile ``tkv/kernels/cuda/<name>`` (kernel ``entry``, an ``extern "C"`` name) with
    ``defines`` for ``sm_<arch>`` (e.g. ``"90"``) to a cubin. Needs no GPU (the offline SASS
    tools use it).

    Raises:
        CudaCompileError: NVRTC refused the source (with its log) or is unavailable."""
    try:
        from torch.cuda import _utils
        compile_ = _utils._nvrtc_compile
    except (ImportError, AttributeError) as e:   # pragma: no cover - PyTorch without NVRTC
        raise CudaCompileError(f"this PyTorch ({torch.__version__}) has no NVRTC bindings") \
            from e
    try:
        cubin, _ = compile_(source(name), entry, arch,
                            nvcc_options=_options(tuple(sorted(defines.items()))))
    except (RuntimeError, OSError) as e:   # NVRTC's error, or no NVRTC library to load
        raise CudaCompileError(f"{name} with {defines}: {e}") from e
    return cubin


@functools.cache
def _load(name: str, entry: str, defines: tuple[tuple[str, int], ...], device_index: int):
    from torch.cuda import _utils
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = compile_cubin(name, entry, dict(defines), f"{major}{minor}")
    with torch.cuda.device(device_index):
        try:
            return _utils._cuda_load_module(cubin, [entry])[entry]
        except RuntimeError as e:
            raise CudaCompileError(f"{name}: loading {entry} failed: {e}") from e


def kernel(name: str, entry: str, defines: dict[str, int], device: torch.device):
    """The launchable kernel ``entry`` of ``tkv/kernels/cuda/<name>`` compiled with
    ``defines`` for ``device`` (compiled once per process and configuration). Call it as
    ``k(grid=(x, y, z), block=(n, 1, 1), args=[...])``: tensors pass as device pointers, ints
    as C ``int``, floats as C ``double`` (PyTorch's launcher), on the current stream.

    Raises:
        CudaCompileError: the source did not compile or load."""
    return _load(name, entry, tuple(sorted(defines.items())), torch.device(device).index
                 if torch.device(device).index is not None else torch.cuda.current_device())


def reserve_dynamic_smem(k, nbytes: int) -> None:
    """Allow kernel ``k`` (from :func:`kernel`) ``nbytes`` of dynamic shared memory per CTA
    (``cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)``, once per kernel and size; the
    driver's default allows only 48 KB minus the kernel's static shared memory). Launch with
    ``shared_mem=nbytes``.

    Raises:
        CudaCompileError: the driver refused the size (static + dynamic past the device's
            opt-in maximum per CTA)."""
    if getattr(k, "_tkv_dynamic_smem", 0) >= nbytes:
        return
    from torch.cuda import _utils
    try:
        _utils._check_cuda(_utils._get_gpu_runtime_library().cuFuncSetAttribute(
            k.func, 8, int(nbytes)))   # 8: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    except RuntimeError as e:
        raise CudaCompileError(f"{nbytes} bytes of dynamic shared memory refused: {e}") from e
    k._tkv_dynamic_smem = nbytes
    k._max_shared_mem_bytes = max(k._max_shared_mem_bytes, nbytes)   # PyTorch's launch check


def ctas_per_sm(k, threads: int, dynamic_smem: int = 0) -> int:
    """How many CTAs of kernel ``k`` (from :func:`kernel`) of ``threads`` threads with
    ``dynamic_smem`` bytes of dynamic shared memory one SM holds at once (the driver's
    ``cuOccupancyMaxActiveBlocksPerMultiprocessor``: registers, shared memory, warps); cached on
    the kernel per (threads, bytes). Reserve the dynamic shared memory first
    (:func:`reserve_dynamic_smem`).

    Raises:
        CudaCompileError: the driver call failed."""
    import ctypes
    cache = k.__dict__.setdefault("_tkv_ctas_per_sm", {})
    key = (int(threads), int(dynamic_smem))
    if key not in cache:
        from torch.cuda import _utils
        n = ctypes.c_int(0)
        try:
            _utils._check_cuda(_utils._get_gpu_runtime_library()
                               .cuOccupancyMaxActiveBlocksPerMultiprocessor(
                                   ctypes.byref(n), k.func, ctypes.c_int(key[0]),
                                   ctypes.c_size_t(key[1])))
        except RuntimeError as e:
            raise CudaCompileError(f"occupancy query failed: {e}") from e
        cache[key] = n.value
    return cache[key]


# the CUDA kernels whose auto fallback has warned in this process (one warning each)
FALLBACK_WARNED: set[str] = set()


def warn_fallback(what: str, env: str, err: Exception) -> None:
    """``kernel="auto"`` chose the CUDA ``what`` (e.g. ``"decode split kernel"``) but it could
    not be built: warn once per process and kernel (``env=triton`` silences it); the caller
    then runs its Triton kernel."""
    if what not in FALLBACK_WARNED:
        FALLBACK_WARNED.add(what)
        warnings.warn(f"tkv: the CUDA {what} could not be built, running the Triton kernel "
                      f"instead ({env}=triton silences this): {err}", RuntimeWarning,
                      stacklevel=3)
