"""Which implementation of store/attention a worker runs.

* ``"triton"`` — :mod:`tkv.kernels` (fused compress-store, split-K paged decode, chunked
  prefill). Used on CUDA, and on CPU under ``TRITON_INTERPRET=1``.
* ``"reference"`` — plain PyTorch through :mod:`tkv.codec` (slow, exact semantics), used on
  CPU otherwise; CPU tests compare both.

``TKV_SGLANG_IMPL=triton|reference`` forces one.
"""

from __future__ import annotations

import torch

from tkv.codec.errors import TkvError

__all__ = ["ENV_IMPL", "ImplConfigError", "impl_from_env", "select_impl"]

ENV_IMPL = "TKV_SGLANG_IMPL"
IMPLS = ("triton", "reference")


class ImplConfigError(TkvError, ValueError):
    """``TKV_SGLANG_IMPL`` is set to something other than ``triton`` / ``reference``."""


def impl_from_env(environ=None) -> str | None:
    """The forced implementation (``TKV_SGLANG_IMPL``, any case, blanks ignored), or None when
    unset / blank. Checked at startup by :func:`tkv.sglang.server_args_check.check_server_args`.

    Raises:
        ImplConfigError: any other value."""
    from tkv.kernels.engine_env import choice_from_env

    forced = choice_from_env(environ, ENV_IMPL, ("", *IMPLS), "", ImplConfigError,
                             "use 'triton' or 'reference' (unset: triton on CUDA and under the "
                             "Triton interpreter, else reference)")
    return forced or None


def select_impl(device: torch.device | str) -> str:
    """``"triton"`` or ``"reference"`` for ``device`` (see module docstring; the interpreter
    as :func:`tkv.kernels.engine_env.interpreting` reads ``TRITON_INTERPRET``: 1 / true / yes /
    on).

    Raises:
        ImplConfigError: ``TKV_SGLANG_IMPL`` set to something else.
    """
    from tkv.kernels.engine_env import interpreting

    forced = impl_from_env()
    if forced:
        return forced
    if torch.device(device).type == "cuda" or interpreting():
        return "triton"
    return "reference"
