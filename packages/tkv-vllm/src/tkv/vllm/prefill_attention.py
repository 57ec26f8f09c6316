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

Default ``auto`` since session 15 measured it on the H200
(``benchmarks/results/vllm_e2e_2026-12-01_s15_qwen_flash/``: the 32K prompt's prefill 1.75 s →
1.28 s, the request 0.81× → 0.93× bf16; 512-token prompts end to end within the runs' spread):
vLLM's FlashAttention wherever it can run, else tkv's kernels (logged). ``continuation``
sends only exact-prefix continuation chunks to it (first chunks: tkv's Triton bypass kernel;
an A/B configuration, see :func:`tkv.kernels.prefill_attention_from_env`). ``flash`` insists: a
CPU-only process, a vLLM without its flash-attention extension, a platform where vLLM picks no
FlashAttention version for the head size, or a model dtype other than float16 / bfloat16 is a
:class:`~tkv.kernels.PrefillAttentionConfigError`, never a silent fallback. ``tkv`` keeps
tkv's own kernels.
"""

from __future__ import annotations

import torch

from tkv.kernels import FlashVarlenAttention, flash_device

__all__ = ["prefill_attention"]

_CACHE: dict[str, FlashVarlenAttention] = {}
DEFAULT = "auto"


def prefill_attention(device: torch.device | str, head_size: int, dtype: torch.dtype,
                      environ: dict[str, str] | None = None) -> FlashVarlenAttention | None:
    """The ``dense_attention`` the backend passes to :func:`tkv.kernels.prefill`: vLLM's
    FlashAttention (``flash_attn_varlen_func`` at the version vLLM picks for ``head_size``),
    or None for tkv's own kernels — see the module docstring for ``auto`` / ``flash`` /
    ``continuation`` / ``tkv``. ``dtype``: the model's activation dtype (FlashAttention takes float16 /
    bfloat16). Called at layer binding (startup); cached per device, head size, dtype and the
    FlashAttention version vLLM reports.

    Raises:
        PrefillAttentionConfigError: unknown value; ``flash`` / ``continuation`` where it
            cannot run (no CUDA
            device, no vLLM flash-attention extension, no FlashAttention version for
            ``head_size``, a float32 model).
        DeviceMismatchError: ``device`` is not a device (``tkv.kernels.flash_device``).
    """
    versions: dict[str, int] = {}

    def load():
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        return get_flash_attn_version, flash_attn_varlen_func

    def unsupported(dev, imported) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashAttention takes float16 / bfloat16, the model runs {dtype}"
        version = imported[0](head_size=head_size)
        if version is None:
            return f"vLLM reports no FlashAttention version for head_size {head_size} here"
        versions["fa"] = version
        return None

    got = flash_device(device, environ, load, unsupported, default=DEFAULT)
    if got is None:
        return None
    flash_attn_varlen_func = got.imported[1]
    # vLLM's FlashAttention pick can change per config
    key = f"{got.device}:{head_size}:{dtype}:fa{versions['fa']}:{got.first_chunks}"
    if key not in _CACHE:
        _CACHE[key] = FlashVarlenAttention(flash_attn_varlen_func, first_chunks=got.first_chunks,
                                           fa_version=versions["fa"])
    return _CACHE[key]
