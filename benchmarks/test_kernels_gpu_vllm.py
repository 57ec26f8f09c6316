"""CPU check of kernels_gpu.py's vLLM TurboQuant row (needs vLLM 0.20.1; not in the default run).

benchmarks/ is outside pytest's testpaths, so the default test run never imports vLLM. Run it
in an environment with vLLM, on CPU through Triton's interpreter (vLLM keeps Triton enabled
with zero drivers only when CUDA_VISIBLE_DEVICES is set and empty):

    CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 /tmp/vllm-venv/bin/python -m pytest \\
        benchmarks/test_kernels_gpu_vllm.py -q -p no:cacheprovider -W ignore

or on a GPU machine without the two variables. The reference is plain PyTorch in float64 that
reads vLLM's slot layout independently (key: 4-bit Lloyd-Max indices, low nibble first, then
the fp16 norm; value: 4-bit codes then fp16 scale and zero), undoes the Sylvester-Hadamard
rotation and runs softmax attention.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: run with CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1",
                allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels_gpu():
    spec = importlib.util.spec_from_file_location(
        "kernels_gpu", Path(__file__).with_name("kernels_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sylvester(d):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _fp16_at(cache, off):
    """(..., slot) uint8 -> (...) float64 from the little-endian fp16 at byte ``off``."""
    return cache[..., off:off + 2].contiguous().view(torch.float16)[..., 0].double()


def _nibbles(b):
    """(..., n) uint8 -> (..., 2n) int64 codes, low nibble first."""
    b = b.long()
    return torch.stack([b & 0xF, b >> 4], -1).flatten(-2)


def _dequant(kv_cache, centroids, d):
    """vLLM turboquant_4bit_nc slots (blocks, block, Hkv, slot) -> K, V (blocks, block, Hkv, d)
    float64 in model space."""
    kb = d // 2  # 4-bit key indices
    c = centroids.double()[_nibbles(kv_cache[..., :kb])]
    c = c / c.norm(dim=-1, keepdim=True)  # norm correction
    k = (c * _fp16_at(kv_cache, kb)[..., None]) @ _sylvester(d).to(c.device)  # undo rotation
    vo = kb + 2  # value part starts after the key part
    codes = _nibbles(kv_cache[..., vo:vo + d // 2]).double()
    v = codes * _fp16_at(kv_cache, vo + d // 2)[..., None] + _fp16_at(kv_cache, vo + d // 2 + 2)[..., None]
    return k, v


def _reference(q, k, v, bt, sl, block):
    """q (B, Hq, D); k, v (blocks, block, Hkv, D) float64 -> (B, Hq, D) float64."""
    B, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.empty(B, hq, d, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(sl[b])
        pos = torch.arange(n, device=q.device)
        phys = bt[b, pos // block].long()
        kb = k[phys, pos % block].repeat_interleave(hq // hkv, dim=1)  # (n, Hq, D)
        vb = v[phys, pos % block].repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), kb) / math.sqrt(d)
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), vb)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vllm_turboquant_decode_matches_float64_reference(dtype):
    from vllm.v1.attention.ops.triton_turboquant_decode import (
        triton_turboquant_decode_attention,
    )

    kg = _kernels_gpu()
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    B, hq, hkv, d, block = 3, 8, 2, 128, 16
    sl = torch.tensor([37, 1, 16], dtype=torch.int32, device=DEV)  # tail, length 1, full block
    nb = [-(-int(n) // block) for n in sl]
    nblk = sum(nb) + 2  # two blocks no request owns
    perm = torch.randperm(nblk, device=DEV).int()
    bt = torch.zeros(B, max(nb), dtype=torch.int32, device=DEV)
    i = 0
    for b, m in enumerate(nb):
        bt[b, :m] = perm[i:i + m]
        i += m
    q = 2 * torch.randn(B, hq, d, device=DEV, dtype=dtype)  # sharper softmax

    fn, info = kg.vllm_turboquant_decode(q, bt, sl, nblk, hkv, block, fill_chunk=40)

    # Slot size: 134 B per token per KV head at D=128 (issue text) = vLLM's own formula.
    assert info["slot_B"] == info["slot_B_aligned"] == 134 == (d // 2 + 2) + (d // 2 + 4)
    assert info["bytes_read"] == int(sl.sum()) * hkv * 134
    kv = info["kv_cache"]
    assert kv.shape == (nblk, block, hkv, 134) and kv.dtype == torch.uint8
    # The recorded call binds to vLLM's signature with the backend's arguments.
    kw = info["kwargs"]
    bound = inspect.signature(triton_turboquant_decode_attention).bind(**kw)
    assert set(bound.arguments) >= {"query", "kv_cache", "block_table", "seq_lens", "Pi",
                                    "centroids", "scale", "mid_o_buf", "max_num_kv_splits"}
    assert kw["kv_cache"] is kv and kw["block_table"] is bt and kw["seq_lens"] is sl
    assert kw["query"].shape == (B, hq, d) and kw["query"].dtype == dtype
    assert (kw["mse_bits"], kw["value_quant_bits"], kw["key_fp8"], kw["norm_correction"]) == (
        4, 4, False, True)
    assert kw["scale"] == pytest.approx(d ** -0.5)
    assert kw["max_num_kv_splits"] == info["splits"] == 32
    assert kw["mid_o_buf"].shape == (B, hq, 32, d + 1)

    # The store wrote real codes: dequantized N(0, 1) keys have norm ~ sqrt(D), values std ~ 1.
    k, v = _dequant(kv, info["layer"]._tq_centroids, d)
    kn = k.norm(dim=-1)
    assert 0.8 * math.sqrt(d) < kn.mean() < 1.2 * math.sqrt(d)
    assert 0.8 < v.std() < 1.2

    ref = _reference(q, k, v, bt, sl, block)
    out = fn()
    assert out.shape == (B, hq, d) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(info["out"].view(B, hq, d).double(), ref, atol=2e-2, rtol=2e-2)


def test_vllm_rows_logs_a_row_and_skips_without_vllm(monkeypatch):
    kg = _kernels_gpu()
    B, hq, hkv, d, block, L = 2, 4, 1, 128, 16, 20
    bt = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32, device=DEV)
    sl = torch.full((B,), L, dtype=torch.int32, device=DEV)
    q = torch.randn(B, hq, d, device=DEV, dtype=torch.bfloat16)
    base = dict(kernel="decode", B=B, L=L, Hq=hq, Hkv=hkv, D=d)
    monkeypatch.setattr(kg, "bench", lambda fn, rep=60: (fn(), 0.5)[1])
    kg.vllm_rows(base, q, bt, sl, 4, hkv, block, copy_gbs=1000.0)
    row = kg.ROWS[-1]
    assert row["impl"] == "vllm_turboquant_4bit_nc" and "error" not in row
    assert row["GBps"] == pytest.approx(B * L * hkv * 134 / 0.5 / 1e6)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    kg.vllm_rows(base, q, bt, sl, 4, hkv, block, copy_gbs=1000.0)
    assert kg.ROWS[-1]["error"].startswith("skipped: vLLM not importable")
