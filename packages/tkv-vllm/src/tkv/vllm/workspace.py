"""The one scratch :class:`tkv.kernels.Workspace` shared by every tkv layer of a process.

vLLM's own TurboQuant backend registers decode buffers on every attention layer
(``B·Hq·S·(D+1)`` floats each — tens of GiB on 32B models). Here all layers share one
workspace per device, sized for the largest layer and batch at bind time (before memory
profiling, so vLLM budgets it, and before CUDA-graph capture, so captured graphs always
see the same addresses).
"""

from __future__ import annotations

import torch

from tkv.kernels import DENSE_PREFIX_CAP, Workspace, dense_prefix_bytes, varlen_prefix_bytes

__all__ = ["shared_prefill_scratch", "shared_workspace"]

_WORKSPACES: dict[str, Workspace] = {}
_PREFILL_SCRATCH: dict[str, torch.Tensor] = {}


def _key(device: torch.device | str) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def shared_workspace(device: torch.device | str, max_num_seqs: int | None = None,
                     max_num_q_heads: int | None = None, max_head_dim: int | None = None
                     ) -> Workspace:
    """The process-wide workspace of ``device``.

    With sizes: create it, or replace it by a larger one if a layer needs more (only
    during binding, before any graph capture). Without sizes: return the existing one.

    Args:
        max_num_seqs: most sequences one decode call sees (vLLM's ``max_num_seqs``).
            max_num_q_heads: query heads per rank.
        max_head_dim: head_dim (elements).

    Raises:
        RuntimeError: asked for without sizes before any layer was bound.
    """
    key = _key(device)
    ws = _WORKSPACES.get(key)
    if max_num_seqs is None:
        if ws is None:
            raise RuntimeError(f"tkv: no workspace bound on {key} (layer not bound)")
        return ws
    need = (int(max_num_seqs), int(max_num_q_heads), int(max_head_dim))
    have = None if ws is None else (ws.max_num_seqs, ws.max_num_q_heads, ws.max_head_dim)
    if have is None or any(a < b for a, b in zip(have, need, strict=True)):
        if have is not None:
            need = tuple(max(a, b) for a, b in zip(have, need, strict=True))
        ws = Workspace(*need, device=key)
        _WORKSPACES[key] = ws
    return ws


def shared_prefill_scratch(device: torch.device | str, max_model_len: int | None = None,
                           num_kv_heads: int | None = None, head_dim: int | None = None,
                           block_size: int = 1,
                           max_num_batched_tokens: int = 0) -> torch.Tensor | None:
    """The process-wide scratch of :func:`tkv.kernels.prefill`'s decompress-once path
    (uint8, one per device, shared by every layer).

    With sizes (at bind time, before memory profiling so vLLM budgets it): create or grow it
    to hold one sequence's prefix of ``max_model_len`` tokens in whole pages of ``block_size``
    (K and V, 16-bit rows of
    ``num_kv_heads`` heads — :func:`tkv.kernels.dense_prefix_bytes`) and ``max_model_len +
    max_num_batched_tokens`` packed rows of prefixes and chunks (the varlen path through
    FlashAttention, :func:`tkv.kernels.varlen_prefix_bytes`: a run's prefixes plus its chunk
    tokens — one step's prefix-cache hits, which the metadata builder cuts into calls that
    fit), capped at :data:`tkv.kernels.DENSE_PREFIX_CAP` bytes; batches whose prefixes do
    not fit take the Triton paths. Without sizes: the existing buffer, or None."""
    key = _key(device)
    buf = _PREFILL_SCRATCH.get(key)
    if max_model_len is None:
        return buf
    n, h, d = int(max_model_len), int(num_kv_heads), int(head_dim)
    need = min(DENSE_PREFIX_CAP, max(dense_prefix_bytes(1, n, h, d, block_size=int(block_size)),
                                     varlen_prefix_bytes(n, int(max_num_batched_tokens), h,
                                                         d)))
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=torch.uint8, device=key)
        _PREFILL_SCRATCH[key] = buf
    return buf
