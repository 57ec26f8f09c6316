"""Which implementation of store/attention a worker runs.

* ``"triton"`` — :mod:`tkv.kernels` (fused compress-store, split-K paged decode, chunked
  prefill). Used on CUDA, and on CPU under ``TRITON_INTERPRET=1``.
* ``"reference"`` — plain PyTorch through :mod:`tkv.codec` (slow, exact semantics), used on
  CPU otherwise; CPU tests compare both.

``TKV_SGLANG_IMPL=triton|reference`` forces one.
"""

from __future__ import annotations

import os

import torch

__all__ = ["ENV_IMPL", "select_impl"]

ENV_IMPL = "TKV_SGLANG_IMPL"


def select_impl(device: torch.device | str) -> str:
    """``"triton"`` or ``"reference"`` for ``device`` (see module docstring).

    Raises:
        ValueError: ``TKV_SGLANG_IMPL`` set to something else.
    """
    forced = os.environ.get(ENV_IMPL, "").strip().lower()
    if forced:
        if forced not in ("triton", "reference"):
            raise ValueError(f"{ENV_IMPL} must be 'triton' or 'reference', got {forced!r}")
        return forced
    if torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "reference"
