"""Which kernel runs the dense part of tkv's prefill in vLLM: tkv's own (Triton loop, PyTorch
SDPA over a decompressed prefix) or vLLM's FlashAttention (``TKV_PREFILL_ATTENTION``, parsed
by the shared :func:`tkv.kernels.prefill_attention_from_env`).

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
:class:`~tkv.kernels.PrefillAttentionConfigError`, never a silent fallback.
"""

from __future__ import annotations

import torch

from tkv.kernels import (
    ENV_PREFILL_ATTENTION,
    FlashVarlenAttention,
    PrefillAttentionConfigError,
    flash_device,
)

__all__ = ["prefill_attention"]

_CACHE: dict[str, FlashVarlenAttention] = {}


def prefill_attention(device: torch.device | str, head_size: int,
                      environ: dict[str, str] | None = None) -> FlashVarlenAttention | None:
    """The ``dense_attention`` the backend passes to :func:`tkv.kernels.prefill`: None for
    ``TKV_PREFILL_ATTENTION=tkv`` (the default), vLLM's FlashAttention for ``flash``.
    Called at layer binding (startup); cached per device and head size.

    Raises:
        PrefillAttentionConfigError: unknown value; ``flash`` on a non-CUDA device, without
            vLLM's flash-attention extension, or where vLLM reports no FlashAttention
            version for ``head_size``.
    """
    def load():
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        return get_flash_attn_version, flash_attn_varlen_func

    got = flash_device(device, environ, load)
    if got is None:
        return None
    dev, (get_flash_attn_version, flash_attn_varlen_func) = got
    key = f"{dev}:{head_size}"
    if key in _CACHE:
        return _CACHE[key]
    version = get_flash_attn_version(head_size=head_size)
    if version is None:
        raise PrefillAttentionConfigError(
            f"{ENV_PREFILL_ATTENTION}=flash: vLLM reports no FlashAttention version for "
            f"head_size {head_size} on this platform")
    fa = _CACHE[key] = FlashVarlenAttention(flash_attn_varlen_func, fa_version=version)
    return fa
