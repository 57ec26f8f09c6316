"""Which kernel runs the dense part of tkv's prefill in SGLang: tkv's own (Triton loop,
PyTorch SDPA over a decompressed prefix) or sgl-kernel's FlashAttention 3
(``TKV_PREFILL_ATTENTION``, parsed by the shared :func:`tkv.kernels.prefill_attention_from_env`
— the same variable and values as tkv-vllm).

With ``flash`` the extend path hands a batch of first chunks (no cached prefix) and a lone
exact-prefix continuation chunk to ``sgl_kernel.flash_attn.flash_attn_varlen_func`` (``ver=3``)
through :class:`tkv.kernels.FlashVarlenAttention`, as SGLang's own ``fa3`` backend computes
bf16 attention. ``auto`` uses it where it can run, else tkv's kernels (logged);
``continuation`` only for the continuation chunk (first chunks: tkv's Triton kernel).

Default ``auto``, as tkv-vllm's, since session 32. Session 16 (H200, SmolLM2, one wall-clock run)
had kept ``tkv``: 0.79 s for FA3 against 0.46 s. Session 32's kernel profile of one 256 × 512-token
prefill of SmolLM2 on an H200 (``benchmarks/results/sglang_e2e_2026-12-06_s32_h200_smollm2_prefill/``)
measured the first-chunk attention itself: 26.4 ms in tkv's Triton ``_prefill_kernel`` against
13.6 ms in sgl-kernel's FA3, and the whole prefill's device time 109.4 against 98.6 ms. That
wall clock was host-bound (GPU busy 13-15 %), which is why session 16's single run misled. On
Qwen3-8B-like (session 27) the two tied.
"""

from __future__ import annotations

import torch

from tkv.kernels import (
    ENV_PREFILL_ATTENTION,
    FlashVarlenAttention,
    PrefillAttentionConfigError,
    flash_device,
    prefill_attention_from_env,
)

__all__ = ["prefill_attention"]


DEFAULT = "auto"


def prefill_attention(device: torch.device | str, dtype: torch.dtype,
                      environ: dict[str, str] | None = None, *,
                      impl: str = "triton") -> FlashVarlenAttention | None:
    """The backend's ``dense_attention`` for :func:`tkv.kernels.prefill`: sgl-kernel's
    FlashAttention 3, or None for tkv's own kernels (``TKV_PREFILL_ATTENTION``: ``auto``
    default, ``tkv``, ``flash``, ``continuation``). ``dtype``: the model's activation dtype (FA3 takes
    float16 / bfloat16). Called once when the backend is built (startup). ``impl``: the
    backend's ``TKV_SGLANG_IMPL``; ``reference`` (plain PyTorch attention) never takes a
    dense_attention, but the variable is still validated, and ``flash`` / ``continuation``
    are refused there rather than ignored.

    Raises:
        PrefillAttentionConfigError: unknown value; ``flash`` / ``continuation`` where it
            cannot run: a non-CUDA
            device, no sgl-kernel flash-attention ops, a GPU sgl-kernel's FA3 does not
            support (it needs sm80/sm86/sm89/sm90 and CUDA ≥ 12.3), a float32 model.
        DeviceMismatchError: ``device`` is not a device (``tkv.kernels.flash_device``).
    """
    def load():
        from sgl_kernel.flash_attn import flash_attn_varlen_func, is_fa3_supported
        return flash_attn_varlen_func, is_fa3_supported

    def unsupported(dev, imported) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashAttention 3 takes float16 / bfloat16, the model runs {dtype}"
        if not imported[1](dev):
            return ("sgl-kernel's FlashAttention 3 does not support this GPU "
                    f"({torch.cuda.get_device_name(dev)})")
        return None

    if impl != "triton":
        choice = prefill_attention_from_env(environ, DEFAULT)
        if choice in ("flash", "continuation"):
            raise PrefillAttentionConfigError(
                f"{ENV_PREFILL_ATTENTION}={choice}: TKV_SGLANG_IMPL={impl} runs plain PyTorch "
                "attention, no FlashAttention")
        return None
    got = flash_device(device, environ, load, unsupported, default=DEFAULT)
    if got is None:
        return None
    return FlashVarlenAttention(got.imported[0], first_chunks=got.first_chunks, ver=3)
