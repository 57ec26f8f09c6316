"""Which kernel runs the dense part of tkv's prefill in SGLang: tkv's own (Triton loop,
PyTorch SDPA over a decompressed prefix) or sgl-kernel's FlashAttention 3
(``TKV_PREFILL_ATTENTION``, parsed by the shared :func:`tkv.kernels.prefill_attention_from_env`
— the same variable and values as tkv-vllm).

With ``flash`` the extend path hands a batch of first chunks (no cached prefix) and a lone
exact-prefix continuation chunk to ``sgl_kernel.flash_attn.flash_attn_varlen_func`` (``ver=3``)
through :class:`tkv.kernels.FlashVarlenAttention`, as SGLang's own ``fa3`` backend computes
bf16 attention. Default ``tkv`` until the path has been timed on the H200 (written in session
14, after vLLM's 32K-prompt prefill measured 1.74 s with tkv's kernels against bf16's 1.25 s).
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


def prefill_attention(device: torch.device | str,
                      environ: dict[str, str] | None = None) -> FlashVarlenAttention | None:
    """The backend's ``dense_attention`` for :func:`tkv.kernels.prefill`: None for
    ``TKV_PREFILL_ATTENTION=tkv`` (default), sgl-kernel's FlashAttention 3 for ``flash``.
    Called once when the backend is built (startup).

    Raises:
        PrefillAttentionConfigError: unknown value; ``flash`` on a non-CUDA device, without
            sgl-kernel's flash-attention ops, or on a GPU sgl-kernel's FA3 does not support
            (it needs sm80/sm86/sm89/sm90 and CUDA ≥ 12.3).
    """
    def load():
        from sgl_kernel.flash_attn import flash_attn_varlen_func, is_fa3_supported
        return flash_attn_varlen_func, is_fa3_supported

    got = flash_device(device, environ, load)
    if got is None:
        return None
    dev, (flash_attn_varlen_func, is_fa3_supported) = got
    if not is_fa3_supported(dev):
        raise PrefillAttentionConfigError(
            f"{ENV_PREFILL_ATTENTION}=flash: sgl-kernel's FlashAttention 3 does not support "
            f"this GPU ({torch.cuda.get_device_name(dev)})")
    return FlashVarlenAttention(flash_attn_varlen_func, ver=3)
