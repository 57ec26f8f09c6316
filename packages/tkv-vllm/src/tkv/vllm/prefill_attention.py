"""Which kernel runs the dense part of tkv's prefill in vLLM: tkv's own (Triton loop, PyTorch
SDPA over a decompressed prefix) or vLLM's FlashAttention (``TKV_PREFILL_ATTENTION``).

:func:`tkv.kernels.prefill` hands two paths to a :class:`tkv.kernels.DenseAttention` callable
when it gets one: a prompt's first chunk (no cached prefix: plain attention over 16-bit K/V)
and an exact-prefix continuation chunk (the prefix dequantized once, then attention over
16-bit rotated rows). Here that callable is vLLM's ``flash_attn_varlen_func`` at the version
vLLM itself picks (FlashAttention 3 on Hopper) — what vLLM's bf16 KV cache runs. Session 14
measured why it matters: one 32K prompt on the Qwen3-8B-like model prefilled in 1.74 s with
tkv's kernels against bf16's 1.25 s (``benchmarks/results/vllm_e2e_2026-12-01_s14_qwen/``).

Default ``tkv`` until the ``flash`` path has run end to end on the H200 (written in session
14 without a GPU left to time it); ``flash`` is validated at startup: a CPU-only process, a
vLLM without its flash-attention extension or a platform where vLLM picks none is a
:class:`PrefillAttentionConfigError`, never a silent fallback.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tkv.codec.errors import TkvError

__all__ = ["ENV_PREFILL_ATTENTION", "PrefillAttentionConfigError", "VllmFlashAttention",
           "prefill_attention"]

ENV_PREFILL_ATTENTION = "TKV_PREFILL_ATTENTION"
_CHOICES = ("tkv", "flash")


class PrefillAttentionConfigError(TkvError, ValueError):
    """``TKV_PREFILL_ATTENTION`` is not ``tkv`` / ``flash``, or ``flash`` was asked for where
    vLLM's flash-attention kernels cannot run."""


class VllmFlashAttention:
    """A :class:`tkv.kernels.DenseAttention` over vLLM's ``flash_attn_varlen_func``.

    Args:
        fa_version: the FlashAttention version vLLM picked for this GPU
            (``vllm.v1.attention.backends.fa_utils.get_flash_attn_version``; 3 on Hopper).
        varlen: the function (``vllm.vllm_flash_attn.flash_attn_varlen_func``; injectable for
            tests).
    """

    def __init__(self, fa_version: int, varlen: Any):
        self.fa_version = int(fa_version)
        self._varlen = varlen

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 scale, window):
        # tkv's window: keys with q_pos − k_pos < window, i.e. FlashAttention's left size
        # window − 1 (and 0 to the right: causal)
        return self._varlen(q, k, v, max_seqlen_q=int(max_seqlen_q), cu_seqlens_q=cu_seqlens_q,
                            max_seqlen_k=int(max_seqlen_k), cu_seqlens_k=cu_seqlens_k,
                            softmax_scale=float(scale), causal=True,
                            window_size=[int(window) - 1, 0] if window else None,
                            fa_version=self.fa_version)

    def __repr__(self) -> str:
        return f"VllmFlashAttention(fa_version={self.fa_version})"


_CACHE: dict[str, VllmFlashAttention | None] = {}


def prefill_attention(device: torch.device | str, head_size: int,
                      environ: dict[str, str] | None = None) -> VllmFlashAttention | None:
    """The ``dense_attention`` the backend passes to :func:`tkv.kernels.prefill`: None for
    ``TKV_PREFILL_ATTENTION=tkv`` (the default), vLLM's FlashAttention for ``flash``.
    Called at layer binding (startup); cached per device.

    Raises:
        PrefillAttentionConfigError: unknown value; ``flash`` on a non-CUDA device, without
            vLLM's flash-attention extension, or where vLLM reports no FlashAttention
            version for ``head_size``.
    """
    env = os.environ if environ is None else environ
    choice = env.get(ENV_PREFILL_ATTENTION, "tkv").strip().lower() or "tkv"
    if choice not in _CHOICES:
        raise PrefillAttentionConfigError(
            f"{ENV_PREFILL_ATTENTION}={choice!r}: use 'tkv' (default: tkv's Triton / SDPA "
            "prefill) or 'flash' (vLLM's FlashAttention for first chunks and exact-prefix "
            "continuation chunks)")
    if choice == "tkv":
        return None
    dev = torch.device(device)
    key = f"{dev}:{head_size}"
    if key in _CACHE:
        return _CACHE[key]
    if dev.type != "cuda":
        raise PrefillAttentionConfigError(
            f"{ENV_PREFILL_ATTENTION}=flash needs a CUDA device (layer on {dev})")
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise PrefillAttentionConfigError(
            f"{ENV_PREFILL_ATTENTION}=flash: vLLM's flash-attention extension is not "
            f"importable ({e})") from e
    version = get_flash_attn_version(head_size=head_size)
    if version is None:
        raise PrefillAttentionConfigError(
            f"{ENV_PREFILL_ATTENTION}=flash: vLLM reports no FlashAttention version for "
            f"head_size {head_size} on this platform")
    fa = _CACHE[key] = VllmFlashAttention(version, flash_attn_varlen_func)
    return fa
