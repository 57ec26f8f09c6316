# ruff: noqa: B023, F821  (lambdas are timed immediately; names deleted after timing)
"""SmolLM2-135M's attention geometry on one GPU (Hq=9, Hkv=3, head_dim 64): what one layer of
tkv costs per engine step, device time AND host time, against bf16.

Built after the 2026-11-30 SGLang run, where tkv on SmolLM2 fell from 1.06x to 0.69x of bf16 at
64 sequences (decode ~36K -> ~30K tok/s, prefill ~440K -> ~210K tok/s in SGLang's log) while
the Qwen3-8B-like geometry improved. Rows (baseline named in each):

* decode at B=64 / 256, L=700 — device time under CUDA graphs (L2 flushed): tkv K4V4 per
  lookup (prmti = the default for the shared codebook, prmt = session 5's, pair, gather) and
  the bypass bf16 kernel; cuDNN SDPA on contiguous bf16 as the reference;
* compress_store at 64 and 8,192 new tokens — device time per (block_t, chunk);
* host time: wall microseconds per eager call WITHOUT synchronizing (what an engine's Python
  pays per layer outside CUDA graphs: argument checks + Triton launch), for decode,
  compress_store and the first-chunk prefill (16 x 512 tokens, no prefix), and the device
  time of that prefill against SDPA flash (causal, varlen as a batch).

Usage: python benchmarks/small_head_gpu.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import DEV, ROWS, bench, log, lookup_label, step_inputs, tkv_cache

from tkv.codec import TurboKVCodec
from tkv.kernels import BypassLoader, TkvLoader, Workspace, compress_store, decode, prefill

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def host_us(fn, n=50) -> float:
    """Wall microseconds per call of ``fn`` issued back to back with no synchronization (the
    GPU queue absorbs the work): the host cost an engine pays per call in eager mode."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def opts(block_t, chunk) -> dict:
    """compress_store keyword options, the defaults left out."""
    return {k: v for k, v in (("block_t", block_t), ("chunk", chunk)) if v is not None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ws = Workspace(256, 64, 256, DEV)
    codec = TurboKVCodec(D, 4, device=DEV)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for B, L in ((64, 700), (256, 700)):
        bt, sl, nblk, slots, q, kn, vn = step_inputs(B, L, HQ, HKV, D, BLOCK)
        base = dict(kernel="decode", B=B, L=L, Hq=HQ, Hkv=HKV, D=D)
        kc = torch.randn(B, HKV, L, D, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            f = lambda: torch.nn.functional.scaled_dot_product_attention(
                q.view(B, HQ, 1, D), kc, vc, enable_gqa=True)
            f()
            log({**base, "impl": "sdpa_cudnn bf16 (reference)", "ms": bench(f)})
        del kc, vc
        bl = BypassLoader(HKV, D, BLOCK, torch.bfloat16)
        kp = torch.randn(nblk, BLOCK, HKV, D, device=DEV, dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        log({**base, "impl": "tkv bypass bf16 paged", "ms": bench(
            lambda: decode(q, (kp, vp), bt, sl, bl, ws))})
        log({**base, "impl": "tkv bypass bf16 paged", "host_us": host_us(
            lambda: decode(q, (kp, vp), bt, sl, bl, ws))})
        del kp, vp
        cache = None
        for lookup in ("auto", "prmti", "prmt", "pair", "gather"):
            try:
                ld = TkvLoader(codec, HKV, BLOCK, lookup=lookup)
            except Exception as e:   # a lookup this version does not have
                log({**base, "impl": f"tkv K4V4 {lookup}", "error": str(e)[:100]})
                continue
            if cache is None:
                cache = tkv_cache(ld, nblk)
            try:
                lab = f"tkv K4V4 {lookup} ({lookup_label(ld)})"
            except AttributeError:   # an older TkvLoader
                lab = f"tkv K4V4 {lookup}"
            log({**base, "impl": lab, "splits": ws.splits_for(B, HKV),
                 "ms": bench(lambda: decode(q, cache, bt, sl, ld, ws))})
        ld = TkvLoader(codec, HKV, BLOCK)
        log({**base, "impl": "tkv K4V4 auto", "host_us": host_us(
            lambda: decode(q, cache, bt, sl, ld, ws))})
        for bt_, ch in ((None, None), (8, 32), (16, 32), (16, 64), (32, 64)):
            if ch and "chunk" not in compress_store.__code__.co_varnames:
                continue
            log({**base, "kernel": "compress_store", "impl": "tkv K4V4", "T": B,
                 "block_t": bt_ or "default", "chunk": ch or "default",
                 "ms": bench(lambda: compress_store(kn, vn, cache, slots, ld, **opts(bt_, ch)))})
        log({**base, "kernel": "compress_store", "impl": "tkv K4V4", "T": B, "host_us": host_us(
            lambda: compress_store(kn, vn, cache, slots, ld))})
        del cache
    # first chunks of 16 prompts x 512 tokens, as SGLang's 8,192-token extend batches
    ns, ql = 16, 512
    T = ns * ql
    ld = TkvLoader(codec, HKV, BLOCK)
    nblk = ns * ql // BLOCK
    cache = tkv_cache(ld, nblk)
    bt = torch.arange(nblk, dtype=torch.int32, device=DEV).view(ns, ql // BLOCK)
    sl = torch.full((ns,), ql, dtype=torch.int32, device=DEV)
    cu = torch.arange(0, T + 1, ql, dtype=torch.int32, device=DEV)
    slots = torch.arange(T, dtype=torch.int64, device=DEV)
    q = torch.randn(T, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(T, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    base = dict(kernel="prefill", T=T, seqs=ns, q_len=ql, Hq=HQ, Hkv=HKV, D=D)
    qs = q.view(ns, ql, HQ, D).transpose(1, 2)
    ks = k.view(ns, ql, HKV, D).transpose(1, 2)
    vs = v.view(ns, ql, HKV, D).transpose(1, 2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        f = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                     enable_gqa=True)
        try:
            f()
            log({**base, "impl": "sdpa_flash causal bf16 (reference)", "ms": bench(f)})
        except Exception as e:
            log({**base, "impl": "sdpa_flash causal bf16 (reference)", "error": str(e)[:120]})

    def pre():
        prefill(q, k, v, cu, sl, ql, cache, bt, ld, out=o, no_prefix=True)
    log({**base, "impl": "tkv prefill, first chunk (bypass)", "ms": bench(pre)})
    log({**base, "impl": "tkv prefill, first chunk (bypass)", "host_us": host_us(pre)})
    for bt_, ch in ((None, None), (16, 32), (32, 64)):
        if ch and "chunk" not in compress_store.__code__.co_varnames:
            continue
        log({**base, "kernel": "compress_store", "impl": "tkv K4V4", "block_t": bt_ or "default",
             "chunk": ch or "default", "ms": bench(
                 lambda: compress_store(k, v, cache, slots, ld, **opts(bt_, ch)))})
    log({**base, "kernel": "compress_store", "impl": "tkv K4V4", "host_us": host_us(
        lambda: compress_store(k, v, cache, slots, ld))})
    (out / "small_head_gpu.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    print("\n".join(json.dumps(r) for r in ROWS))


if __name__ == "__main__":
    main()
