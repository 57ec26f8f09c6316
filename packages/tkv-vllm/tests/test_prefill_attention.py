"""TKV_PREFILL_ATTENTION in tkv-vllm: validation at binding, and FlashVarlenAttention's mapping
onto vLLM 0.20.1's ``flash_attn_varlen_func`` keywords (CPU; the forward path through it is in
forward_check.py)."""

from __future__ import annotations

import inspect

import pytest
import torch

from tkv.kernels import FlashVarlenAttention, PrefillAttentionConfigError, SdpaDenseAttention
from tkv.kernels.testing import reference_flash_varlen


def test_default_is_auto_flash_insists_and_bad_values_are_named(patched_vllm, monkeypatch):
    """Unset = auto: tkv's kernels where vLLM's FlashAttention cannot run (a CPU device, a
    float32 model, no FlashAttention version for the head size), vLLM's flash_attn_varlen_func
    at vLLM's version where it can; flash raises for the same reasons; tkv is always None."""
    from vllm.v1.attention.backends import fa_utils

    from tkv.vllm import prefill_attention as pa

    bf16 = torch.bfloat16
    assert pa.DEFAULT == "auto"
    assert pa.prefill_attention("cpu", 128, bf16, environ={}) is None
    assert pa.prefill_attention("cpu", 128, bf16, environ={"TKV_PREFILL_ATTENTION": " TKV "}) is None
    with pytest.raises(PrefillAttentionConfigError, match="'fa3'"):
        pa.prefill_attention("cpu", 128, bf16, environ={"TKV_PREFILL_ATTENTION": "fa3"})
    with pytest.raises(PrefillAttentionConfigError, match="CUDA"):
        pa.prefill_attention("cpu", 128, bf16, environ={"TKV_PREFILL_ATTENTION": "flash"})
    # a CUDA device as vLLM sees it (the extension is never called here): the version vLLM
    # picks per head size decides; a float32 model never gets FlashAttention
    version = {"v": 3}
    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda head_size=None, **kw:
                        version["v"] if head_size in (64, 128, 256) else None)
    monkeypatch.setattr(pa, "_CACHE", {})
    fa = pa.prefill_attention("cuda:0", 128, bf16, environ={})
    assert isinstance(fa, FlashVarlenAttention) and fa.extra == {"fa_version": 3}
    assert pa.prefill_attention("cuda:0", 128, bf16, environ={}) is fa    # cached
    version["v"] = 2     # vLLM's pick changed (another attention config in the process)
    assert pa.prefill_attention("cuda:0", 128, bf16, environ={}).extra == {"fa_version": 2}
    version["v"] = 3
    assert pa.prefill_attention("cuda:0", 96, bf16, environ={}) is None
    assert pa.prefill_attention("cuda:0", 128, torch.float32, environ={}) is None
    flash = {"TKV_PREFILL_ATTENTION": "flash"}
    with pytest.raises(PrefillAttentionConfigError, match="head_size 96"):
        pa.prefill_attention("cuda:0", 96, bf16, environ=flash)
    with pytest.raises(PrefillAttentionConfigError, match="float32"):
        pa.prefill_attention("cuda:0", 128, torch.float32, environ=flash)
    assert pa.prefill_attention("cuda:0", 64, torch.float16, environ=flash).extra == {
        "fa_version": 3}
    # continuation: the same FlashAttention, first chunks left to tkv's Triton bypass (own
    # cache entry), and it insists like flash
    cont = {"TKV_PREFILL_ATTENTION": "continuation"}
    fc = pa.prefill_attention("cuda:0", 128, bf16, environ=cont)
    assert fc.first_chunks is False and fc.extra == {"fa_version": 3} and fa.first_chunks
    with pytest.raises(PrefillAttentionConfigError, match=r"continuation: .*head_size 96"):
        pa.prefill_attention("cuda:0", 96, bf16, environ=cont)


def test_keywords_exist_in_vllms_varlen(patched_vllm):
    """Every keyword FlashVarlenAttention passes (plus fa_version, and ``out`` for first
    chunks) is a parameter of vLLM 0.20.1's flash_attn_varlen_func (read from its source; the CUDA extension is not loaded)."""
    from vllm.vllm_flash_attn import flash_attn_interface

    params = inspect.signature(flash_attn_interface.flash_attn_varlen_func).parameters
    seen = {}
    FlashVarlenAttention(lambda q, k, v, **kw: seen.update(kw) or q, fa_version=3)(
        *(torch.zeros(2, 1, 8),) * 3, torch.tensor([0, 2]), torch.tensor([0, 2]), 2, 2, 1.0, 4,
        out=torch.zeros(2, 1, 8))   # first chunks: prefill's own output (writes_out)
    assert set(seen) <= set(params), set(seen) - set(params)
    assert seen["window_size"] == (3, 0) and seen["causal"] is True


@pytest.mark.parametrize("window", [0, 5])
def test_flash_varlen_attention_maps_the_contract(patched_vllm, window):
    """causal=True, the version, the scale and the window as FlashAttention's (window − 1, 0);
    with a reference varlen behind it the result equals SdpaDenseAttention's."""
    seen = {}

    def varlen(q, k, v, **kw):
        seen.update(kw)
        return reference_flash_varlen(q, k, v, **kw)

    g = torch.Generator().manual_seed(window)
    q = torch.randn(9, 4, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(13, 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(13, 2, 64, generator=g).to(torch.bfloat16)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    fa = FlashVarlenAttention(varlen, fa_version=3)
    out = fa(q, k, v, cu_q, cu_k, 5, 7, 0.125, window)
    assert seen["causal"] is True and seen["fa_version"] == 3
    assert seen["softmax_scale"] == 0.125
    assert seen["window_size"] == ((window - 1, 0) if window else (-1, -1))
    assert (seen["max_seqlen_q"], seen["max_seqlen_k"]) == (5, 7)
    ref = SdpaDenseAttention()(q, k, v, cu_q, cu_k, 5, 7, 0.125, window)
    assert torch.equal(out, ref)
    # bottom-right causal: the first query of sequence 0 (4 queries, 6 keys) sees keys 0..2
    row = torch.softmax((k[:3, 0].float() @ q[0, 0].float()) * 0.125, 0) @ v[:3, 0].float()
    if not window:
        torch.testing.assert_close(out[0, 0].float(), row, rtol=1e-2, atol=1e-2)
