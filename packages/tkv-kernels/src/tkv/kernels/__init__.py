"""tkv.kernels — Triton kernels reading the tkv packed paged KV cache with inline dequant."""

from . import _interpreter_compat

_interpreter_compat.apply()

from .decode import decode  # noqa: E402
from .loaders import BypassLoader, Fp8Loader, Loader, TkvLoader
from .prefill import prefill
from .store import compress_store
from .workspace import Workspace, WorkspaceTooSmallError

__version__ = "0.1.0"

__all__ = ["BypassLoader", "Fp8Loader", "Loader", "TkvLoader", "Workspace",
           "WorkspaceTooSmallError", "compress_store", "decode", "prefill"]
