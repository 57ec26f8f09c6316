# ruff: noqa: B023, F821  (lambdas are timed immediately; names deleted after timing)
"""tkv kernels on one GPU: decode / compress_store / prefill side by side with bf16 baselines.

One run, one table (markdown + raw JSON lines) with the device-to-device copy bandwidth
measured in the same run. Baselines named in each row:

* decode: torch SDPA bf16 on contiguous KV (cuDNN and flash backends, GQA), tkv's own
  BypassLoader on paged bf16 (same kernel, raw tiles), tkv K/V widths (TkvLoader), and
  vLLM 0.20.1's own TurboQuant decode at turboquant_4bit_nc when vLLM imports (cache filled
  by vLLM's store, call recorded from its backend's forward; else a "skipped: ..." row).
  GB/s counts the bytes the format must read (cache bytes of all tokens, all heads, K+V).
* compress_store: GB/s over bytes read (bf16 K+V) + written (packed codes + norms);
  ``--store-sweep`` adds the tiling × rotation sweep at prefill and decode token counts
  (Qwen3-8B-like, SmolLM2 and head_dim-256 heads, with and without sink offsets), each row's
  ratio to the default call in the same loop.
* prefill: TFLOP/s (causal FLOPs actually needed) for a 2K chunk over prefixes 0/8K/32K vs
  SDPA bf16 (flash, causal) at prefix 0 and SDPA with an explicit mask (efficient backend)
  over a prefix; tkv through TkvLoader (compressed prefix) and BypassLoader (bf16 prefix).

Usage: python benchmarks/kernels_gpu.py --out benchmarks/results [--quick] [--vllm-only]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import triton

from tkv.codec import TurboKVCodec
from tkv.kernels import (
    BypassLoader,
    TkvLoader,
    Workspace,
    compress_store,
    decode,
    dense_prefix_bytes,
    prefill,
)
from tkv.kernels.workspace import SINGLE_SPLIT_TARGETS

prefill_mod = importlib.import_module("tkv.kernels.prefill")   # the module, not the function

DEV = "cuda"
ROWS: list[dict] = []
LOOKUPS: tuple[str, ...] = ("gather", "pair", "shuffle", "prmt", "prmt1", "prmti",
                            "prmts")  # TkvLoader lookups
CUDA_KERNEL = False   # --cuda: decode rows and a model-step arm of decode(kernel="cuda")


TIMING = {"method": None}  # how the last bench() timed: "graph" or "eager" (logged per row)
_FLUSH_BYTES = 256 << 20      # > the H200's 50 MB L2: every timed call starts from HBM
# how _graph_ms empties the L2 before each call: "write" (do_bench's way: the buffer zeroed,
# which leaves up to the L2's size of dirty lines the timed call then writes back while it
# reads) or "read" (the buffer summed: the L2 left full of clean lines, as after an engine's
# weight-reading GEMMs)
FLUSH = "write"


def flush_l2(buf: torch.Tensor) -> None:
    """Evict the L2 by :data:`FLUSH`'s method (``buf``: ``_FLUSH_BYTES`` zeroed int8)."""
    if FLUSH == "read":
        buf.view(torch.float32).sum()
    else:
        buf.zero_()


def _graph_ms(fn, n=20, replays=7):
    """GPU ms per call of ``fn`` from CUDA graphs, L2 flushed before every call like
    ``do_bench`` does (:func:`flush_l2`, :data:`FLUSH`): graph A = n × (flush, fn), graph B =
    n × flush; median over replays of (A − B) / n. No Python launch overhead (what engines see
    under CUDA graphs)."""
    buf = torch.zeros(_FLUSH_BYTES, dtype=torch.int8, device=DEV)
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graphs = []
    with torch.cuda.stream(stream):
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(n):
                    flush_l2(buf)
                    if with_fn:
                        fn()
            graphs.append(g)
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        t = []
        for g in graphs:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            t.append(a.elapsed_time(b))
        times.append((t[0] - t[1]) / n)
    del graphs, buf
    return sorted(times)[len(times) // 2]


def bench(fn, rep=60):
    """Median ms of ``fn``: from CUDA graphs with the L2 flushed before every call
    (:func:`_graph_ms`), else — ``fn`` cannot be captured (host sync, CPU-side allocation) —
    eager ``do_bench`` calls (launch overhead included). ``TIMING["method"]`` says which;
    :func:`log` writes it into every row with a time."""
    try:
        ms = _graph_ms(fn)
        TIMING["method"] = "graph"
        return ms
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # capture refused / no memory
        torch.cuda.synchronize()
        TIMING["method"] = f"eager ({type(e).__name__})"
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def log(row):
    if "ms" in row and row.get("kernel") != "copy" and TIMING["method"]:
        row = {**row, "timing": TIMING["method"]}
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def timed_row(base: dict, impl: str, fn, *, moved: int | None = None,
              copy_gbs: float | None = None, ref_ms: float | None = None, **fields):
    """Time ``fn`` (:func:`bench`) and log one row ``{**base, impl, **fields, ms}`` with
    ``GBps`` when ``moved`` bytes are given, ``frac_copy`` when ``copy_gbs`` is too, and
    ``x_default = ref_ms / ms`` when ``ref_ms`` is; a failure logs the row with its error
    instead. Returns the ms, or None on failure."""
    try:
        ms = bench(fn)
    except Exception as e:
        log({**base, "impl": impl, **fields, "error": str(e)[:160]})
        return None
    row = {**base, "impl": impl, **fields, "ms": ms}
    if moved is not None:
        row["GBps"] = moved / ms / 1e6
        if copy_gbs is not None:
            row["frac_copy"] = moved / ms / 1e6 / copy_gbs
    if ref_ms is not None:
        row["x_default"] = round(ref_ms / ms, 3)
    log(row)
    return ms


def lookup_label(loader) -> str:
    """The lookups a TkvLoader really uses for K and V with bf16 dots (the requested
    ``lookup`` falls back per side, e.g. prmt → pair for a 3-bit side): e.g. "prmt/pair";
    "+r" with ``resident_tables``."""
    k, v = (loader.lookup_name(side) for side in "kv")
    return (k if k == v else f"{k}/{v}") + ("+r" if loader.resident_tables else "")


def copy_bandwidth():
    n = 1 << 30  # 2 GiB of bf16 each way
    a = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    b = torch.empty_like(a)
    # eager do_bench, not bench(): 4.3 GB per call dwarfs launch overhead, and inside CUDA
    # graphs with the L2 flush this copy measured 2,775 GB/s (2026-11-30 step run) against
    # 4,247 eager the same day — which made "% copy BW" read > 100 % for cuDNN
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=200, return_mode="median")
    gbs = 2 * a.numel() * 2 / ms / 1e6
    del a, b
    return gbs


def paged(num_seqs, seq_len, block, device=DEV):
    nblk = -(-seq_len // block)
    total = num_seqs * nblk
    perm = torch.randperm(total, device=device).int()
    bt = perm.view(num_seqs, nblk)
    sl = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    return bt, sl, total


def last_slots(bt, seq_len, block):
    """int64 slot of each sequence's last token (where a decode step stores its new K/V)."""
    return bt[:, (seq_len - 1) // block].long() * block + (seq_len - 1) % block


def step_inputs(B, L, hq, hkv, d, block, device=DEV):
    """A decode step's inputs: ``(block_table, seq_lens, num_blocks, slots, q, new_k,
    new_v)`` for B sequences of L tokens (random pages; bf16 q / K / V of the new token)."""
    bt, sl, nblk = paged(B, L, block, device)
    q = torch.randn(B, hq, d, device=device, dtype=torch.bfloat16)
    kn = torch.randn(B, hkv, d, device=device, dtype=torch.bfloat16)
    return bt, sl, nblk, last_slots(bt, L, block), q, kn, torch.randn_like(kn)


def tkv_cache(ld, nblocks, device=DEV, generator=None):
    """A tkv cache of random code bytes with finite positive norms (8..12): timing input."""
    cache = torch.randint(0, 256, (nblocks, ld.layout.page_bytes), dtype=torch.uint8,
                          device=device, generator=generator)
    v = ld.layout.views(cache)
    for name in ("k_norms", "v_norms"):
        v[name].copy_(torch.rand(v[name].shape, device=device, generator=generator) * 4 + 8)
    return cache


VLLM_TQ_PRESET = "turboquant_4bit_nc"  # the comparison point (4-bit K and V)


def vllm_turboquant_decode(q, bt, sl, num_blocks, hkv, block=16, preset=VLLM_TQ_PRESET,
                           fill_chunk=1 << 17):
    """vLLM 0.20.1's own TurboQuant decode on a paged cache filled by vLLM's own store.

    Everything is vLLM's: ``TurboQuantAttentionImpl`` (the backend object a layer holds), the
    cache shape from ``TurboQuantAttentionBackend.get_kv_cache_shape``, the centroids from
    ``get_centroids`` and the decode scratch buffers that ``Attention._init_turboquant_buffers``
    registers on the layer (``_tq_mid_o_buf`` (B, Hq, S, D+1) float32, ``_tq_output_buf``
    (B, Hq, D), ``_tq_lse_buf`` (B, Hq), S = ``tq_max_kv_splits_for_cuda_graph``). Every slot
    of every block is filled through ``impl.do_kv_cache_update`` (vLLM's fused
    ``triton_turboquant_store``: Hadamard rotation, Lloyd-Max key indices + fp16 key norm,
    per-token min/max asymmetric value codes + fp16 scale/zero) from random N(0, 1) K/V in q's
    dtype, ``fill_chunk`` tokens per call. ``impl.forward`` then runs once on a pure decode
    batch (one query token per request) with the module's ``triton_turboquant_decode_attention``
    intercepted, so the call returned for timing carries exactly the arguments the backend
    passes (rotated-query GEMM + stage-1 split-KV kernel + stage-2 LSE merge + cast).

    Args:
        q: query (B, Hq, D) bfloat16/float16, model space (not rotated).
        bt: block table int32 (B, max_blocks), physical block ids in [0, num_blocks).
        sl: seq_lens int32 (B,), tokens per request (all already in the cache).
        num_blocks: physical blocks in the cache.
        hkv: KV heads.
        block: tokens per block (vLLM's TurboQuant accepts 16/32/64/128).
        preset: a ``TQ_PRESETS`` name (``--kv-cache-dtype``).
        fill_chunk: tokens per store call while filling.

    Returns:
        ``(fn, info)``: ``fn()`` launches vLLM's decode with the recorded arguments and returns
        (B, Hq, D) in q's dtype; ``info`` has ``kv_cache`` (num_blocks, block, Hkv, slot) uint8,
        ``slot_B`` (bytes the kernels read per token per KV head: ``TurboQuantConfig.slot_size``),
        ``slot_B_aligned`` (allocated), ``bytes_read`` (sum(sl) * Hkv * slot_B), ``splits``,
        ``kwargs`` (the recorded call), ``out`` (forward's output, (B, Hq * D)), ``impl``,
        ``layer``, ``vllm_version``.

    Raises:
        ImportError: vLLM is not importable (its own import error, or a missing module).
        Exception: anything else means vLLM's TurboQuant API differs from 0.20.1's.
    """
    import vllm
    import vllm.v1.attention.backends.turboquant_attn as tqa
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    B, hq, d = q.shape
    dev = q.device
    vcfg = VllmConfig(device_config=DeviceConfig(device=dev.type))
    with set_current_vllm_config(vcfg):
        impl = tqa.TurboQuantAttentionImpl(num_heads=hq, head_size=d, scale=d ** -0.5,
                                           num_kv_heads=hkv, kv_cache_dtype=preset)
    tq = TurboQuantConfig.from_cache_dtype(preset, d)
    shape = tqa.TurboQuantAttentionBackend.get_kv_cache_shape(num_blocks, block, hkv, d, preset)
    if tuple(shape) != (num_blocks, block, hkv, tq.slot_size_aligned):
        raise RuntimeError(f"cache shape {shape} is not (blocks, block, Hkv, slot)")
    # The layer: the buffers vLLM's Attention registers for TurboQuant (one decode batch of B).
    layer = torch.nn.Module()
    layer.register_buffer("_tq_centroids", get_centroids(d, tq.centroid_bits).to(dev))
    splits = vcfg.attention_config.tq_max_kv_splits_for_cuda_graph
    layer.register_buffer("_tq_mid_o_buf", torch.empty(B, hq, splits, d + 1, device=dev))
    layer.register_buffer("_tq_output_buf", torch.empty(B, hq, d, device=dev))
    layer.register_buffer("_tq_lse_buf", torch.empty(B, hq, device=dev))
    kv_cache = torch.zeros(shape, dtype=torch.uint8, device=dev)
    nslots = num_blocks * block
    for s0 in range(0, nslots, fill_chunk):
        n = min(fill_chunk, nslots - s0)
        k = torch.randn(n, hkv * d, device=dev, dtype=q.dtype)
        v = torch.randn_like(k)
        slots = torch.arange(s0, s0 + n, device=dev, dtype=torch.int64)
        impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
    meta = tqa.TurboQuantMetadata(
        seq_lens=sl, slot_mapping=torch.full((B,), -1, dtype=torch.int64, device=dev),
        block_table=bt, query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev),
        num_actual_tokens=B, max_query_len=1, max_seq_len=int(sl.max()), is_prefill=False,
        num_decodes=B, num_decode_tokens=B)
    real = tqa.triton_turboquant_decode_attention
    calls = []

    def spy(*a, **kw):
        calls.append((a, kw))
        return real(*a, **kw)

    knew = torch.randn(B, hkv * d, device=dev, dtype=q.dtype)
    out = torch.empty(B, hq * d, device=dev, dtype=q.dtype)
    tqa.triton_turboquant_decode_attention = spy
    try:
        impl.forward(layer, q.reshape(B, hq * d), knew, knew, kv_cache, meta, output=out)
    finally:
        tqa.triton_turboquant_decode_attention = real
    if len(calls) != 1:
        raise RuntimeError(f"forward made {len(calls)} decode calls, expected 1")
    a, kw = calls[0]
    nread = int(sl.sum()) * hkv * tq.slot_size
    info = dict(kv_cache=kv_cache, slot_B=tq.slot_size, slot_B_aligned=tq.slot_size_aligned,
                bytes_read=nread, splits=kw.get("max_num_kv_splits"), kwargs=kw, out=out,
                impl=impl, layer=layer, vllm_version=vllm.__version__)
    return (lambda: real(*a, **kw)), info


def vllm_rows(base, q, bt, sl, nblk, hkv, block, copy_gbs):
    """One row: vLLM 0.20.1's TurboQuant decode (``VLLM_TQ_PRESET``) on the same paged shape;
    GB/s over the cache bytes it must read (sum(sl) * Hkv * slot bytes). Logs a
    ``skipped: <reason>`` row when vLLM is absent or its API differs."""
    impl = f"vllm_{VLLM_TQ_PRESET}"
    try:
        import vllm  # noqa: F401
    except Exception as e:  # absent, or its import fails on this torch
        log({**base, "impl": impl, "error": f"skipped: vLLM not importable ({type(e).__name__}: "
             f"{str(e)[:100]})"})
        return
    try:
        fn, info = vllm_turboquant_decode(q, bt, sl, nblk, hkv, block)
        fn()
        ms = bench(fn)
    except Exception as e:
        log({**base, "impl": impl, "error": f"skipped: vLLM API differs from 0.20.1 "
             f"({type(e).__name__}: {str(e)[:120]})"})
        return
    nbytes = info["bytes_read"]
    log({**base, "impl": impl, "vllm": info["vllm_version"], "slot_B": info["slot_B"],
         "splits": info["splits"], "ms": ms, "GBps": nbytes / ms / 1e6,
         "frac_copy": nbytes / ms / 1e6 / copy_gbs})
    del fn, info


def decode_rows(cfgs, widths, copy_gbs, tune):
    ws = Workspace(128, 64, 256, DEV)
    for (B, L, hq, hkv, d) in cfgs:
        block = 16
        bt, sl, nblk = paged(B, L, block)
        q = torch.randn(B, hq, d, device=DEV, dtype=torch.bfloat16)
        base = dict(kernel="decode", B=B, L=L, Hq=hq, Hkv=hkv, D=d)
        # bf16 SDPA, contiguous KV
        kc = torch.randn(B, hkv, L, d, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bf16_bytes = 2 * B * L * hkv * d * 2
        q4 = q.view(B, hq, 1, d)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(
                        q4, kc, vc, enable_gqa=True)
                    f()
                    ms = bench(f)
                log({**base, "impl": name, "ms": ms, "GBps": bf16_bytes / ms / 1e6,
                     "frac_copy": bf16_bytes / ms / 1e6 / copy_gbs})
            except Exception as e:  # backend refuses this shape
                log({**base, "impl": name, "error": str(e)[:120]})
        del kc, vc
        # bypass loader on paged bf16
        bl = BypassLoader(hkv, d, block, torch.bfloat16)
        kp = torch.randn(nblk, block, hkv, d, device=DEV, dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        ms = bench(lambda: decode(q, (kp, vp), bt, sl, bl, ws))
        log({**base, "impl": "tkv_bypass_bf16_paged", "ms": ms, "GBps": bf16_bytes / ms / 1e6,
             "frac_copy": bf16_bytes / ms / 1e6 / copy_gbs})
        del kp, vp
        vllm_rows(base, q, bt, sl, nblk, hkv, block, copy_gbs)
        for kb, vb in widths:
            codec = TurboKVCodec(d, k_bits=kb, v_bits=vb, device=DEV)
            # "<lookup>+r": the same lookup with resident_tables (session 32)
            lds = {lk: TkvLoader(codec, hkv, block, lookup=lk.removesuffix("+r"),
                                 resident_tables=lk.endswith("+r")) for lk in LOOKUPS}
            ld = lds[next(iter(lds))]
            cache = tkv_cache(ld, nblk)
            nbytes = B * L * ld.layout.bytes_per_token
            opts = [dict(lookup=lk) for lk in lds]
            # resident prmti is 186 registers offline (2 CTAs per SM): also capped at 168 (3)
            opts += [dict(lookup=lk, maxnreg=168) for lk in lds if lk.endswith("+r")]
            if CUDA_KERNEL and (kb, vb) == (4, 4):   # the hand-written CUDA split kernel
                opts += [dict(lookup="auto", kernel="cuda")]
                opts += [dict(lookup="auto", kernel="cuda", num_splits=n) for n in (1, 2, 4, 8)]
            if tune:
                opts = [dict(block_n=bn, num_warps=nw, lookup=lk)
                        for bn in (64, 128, 256) for nw in (4, 8) for lk in lds
                        if lk != "gather"]
            for o in opts:
                # the lookup rows time the Triton kernel (since session 33 decode's default
                # runs the CUDA kernel for K4V4: the --cuda rows)
                o = {"kernel": "triton", **o}
                lk = o.pop("lookup", next(iter(lds)))
                if lk not in lds:   # e.g. the --cuda rows' "auto": built once per width pair
                    lds[lk] = TkvLoader(codec, hkv, block, lookup=lk)
                ld = lds[lk]
                try:
                    ms = bench(lambda o=o: decode(q, cache, bt, sl, ld, ws, **o))
                except Exception as e:
                    log({**base, "impl": f"tkv_K{kb}V{vb}", **o, "error": str(e)[:160]})
                    continue
                log({**base, "impl": f"tkv_K{kb}V{vb}_{lookup_label(ld)}", **o, "ms": ms,
                     "GBps": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / copy_gbs})
            del cache
        torch.cuda.empty_cache()


def store_rows(copy_gbs):
    for d, T in ((128, 16384), (128, 2048), (64, 16384), (256, 16384)):
        hkv = 8
        for kb, vb in ((4, 4), (3, 3), (8, 8)):
            codec = TurboKVCodec(d, k_bits=kb, v_bits=vb, device=DEV)
            ld = TkvLoader(codec, hkv, 16)
            nblk = T // 16 + 1
            cache = ld.layout.allocate(nblk, DEV)
            k = torch.randn(T, hkv, d, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            slots = torch.randperm(nblk * 16, device=DEV)[:T]
            nbytes = store_bytes(T, hkv, d, ld)
            variants = [{}]
            if (d, T, kb) == (128, 16384, 4):  # tile sweep at the main shape
                variants += [dict(chunk=64), dict(block_t=32), dict(num_warps=8)]
            for o in variants:
                row = {"kernel": "compress_store", "T": T, "Hkv": hkv, "D": d,
                       "impl": f"K{kb}V{vb}", **o}
                try:
                    ms = bench(lambda o=o: compress_store(k, v, cache, slots, ld, **o))
                except Exception as e:
                    log({**row, "error": str(e)[:160]})
                    continue
                log({**row, "ms": ms, "GBps": nbytes / ms / 1e6,
                     "frac_copy": nbytes / ms / 1e6 / copy_gbs})


def store_sweep_rows(copy_gbs):
    """compress_store tiling × rotation sweep (bf16 K/V, K4V4, random slots): tokens per
    program ``block_t`` × warps × ``rotation`` ("tf32x3": Triton splits x and A in every
    program; "split": bf16 x against the loader's three bf16 terms of A), at prefill-sized
    and decode-sized token counts, Qwen3-8B-like (8 × 128), SmolLM2 (3 × 64) and head_dim 256
    heads, without and with sink offsets. ``x_default`` = the default call's time over the
    row's (> 1: faster than the default)."""
    g = torch.Generator().manual_seed(1)
    for T, hkv, d, sink in ((16384, 8, 128, False), (16384, 8, 128, True), (2048, 8, 128, False),
                            (256, 8, 128, False), (64, 8, 128, False), (8192, 3, 64, False),
                            (8192, 3, 64, True), (16384, 8, 256, False)):
        kw = {}
        if sink:
            kw = dict(k_sink_offset=torch.randn(hkv, d, generator=g) * 4,
                      v_sink_offset=torch.randn(hkv, d, generator=g) * 4)
        ld = TkvLoader(TurboKVCodec(d, 4, device=DEV, **kw), hkv, 16)
        k = torch.randn(T, hkv, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nblk = T // 16 + 1
        cache = ld.layout.allocate(nblk, DEV)
        slots = torch.randperm(nblk * 16, device=DEV)[:T]
        moved = store_bytes(T, hkv, d, ld)
        base = dict(kernel="store_sweep", T=T, Hkv=hkv, D=d)
        name = "tkv K4V4" + ("+sink" if sink else "")
        ref = timed_row(base, f"{name} compress_store (default)",
                        lambda: compress_store(k, v, cache, slots, ld), moved=moved,
                        copy_gbs=copy_gbs, x_default=1.0)
        tiles = [(8, 4), (16, 4), (32, 4)] if T <= 256 else [(16, 4), (32, 4), (64, 4),
                                                             (64, 8), (128, 8)]
        rots = [("split", *t) for t in tiles] + [("tf32x3", *tiles[-3])]
        if ld.k_store_hadamard is not None:   # butterflies (session 28): every tile
            rots += [("wht", *t) for t in tiles]
        for rot, bt_, nw in rots:
            opts = dict(rotation=rot, block_t=bt_, num_warps=nw)
            timed_row(base, f"{name} compress_store",
                      lambda o=opts: compress_store(k, v, cache, slots, ld, **o),
                      moved=moved, copy_gbs=copy_gbs, ref_ms=ref, **opts)
        del cache, k, v
        torch.cuda.empty_cache()


def prefill_inputs(ql, prefix, hq, hkv, d, block):
    """One sequence's prefill step: ``(row base, FLOPs, (q, k, v, cu_seqlens_q, seq_lens,
    block_table, num_blocks))`` for a ``ql``-token chunk over ``prefix`` cached tokens (random
    pages; bf16 q / K / V of the chunk)."""
    flops = 4 * hq * d * (ql * prefix + ql * (ql + 1) / 2)
    base = dict(kernel="prefill", q_len=ql, prefix=prefix, Hq=hq, Hkv=hkv, D=d)
    q = torch.randn(ql, hq, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(ql, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, ql], dtype=torch.int32, device=DEV)
    sl = torch.tensor([prefix + ql], dtype=torch.int32, device=DEV)
    bt, _, nblk = paged(1, prefix + ql, block)
    return base, flops, (q, k, v, cu, sl, bt, nblk)


def prefill_rows():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hq, hkv, d, ql, block = 32, 8, 128, 2048, 16
    for prefix in (0, 8192, 32768):
        L = prefix + ql
        base, flops, (q, k, v, cu, sl, bt, nblk) = prefill_inputs(ql, prefix, hq, hkv, d, block)
        # SDPA baseline
        kf = torch.randn(1, hkv, L, d, device=DEV, dtype=torch.bfloat16)
        vf = torch.randn_like(kf)
        qf = q.transpose(0, 1)[None]
        try:
            if prefix == 0:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(
                        qf, kf, vf, is_causal=True, enable_gqa=True)
                    f()
                    ms = bench(f)
                name = "sdpa_flash_causal"
            else:
                mask = (torch.arange(L, device=DEV)[None, :]
                        <= (prefix + torch.arange(ql, device=DEV))[:, None])
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(
                        qf, kf, vf, attn_mask=mask, enable_gqa=True)
                    f()
                    ms = bench(f)
                name = "sdpa_masked"
            log({**base, "impl": name, "ms": ms, "TFLOPs": flops / ms / 1e9})
        except Exception as e:
            log({**base, "impl": "sdpa", "error": str(e)[:160]})
        del kf, vf
        bl = BypassLoader(hkv, d, block, torch.bfloat16)
        kp = torch.randn(nblk, block, hkv, d, device=DEV, dtype=torch.bfloat16)
        ms = bench(lambda: prefill(q, k, v, cu, sl, ql, (kp, kp), bt, bl))
        log({**base, "impl": "tkv_bypass_bf16_paged", "ms": ms, "TFLOPs": flops / ms / 1e9})
        del kp
        codec = TurboKVCodec(d, 4, device=DEV)
        ld = TkvLoader(codec, hkv, block)
        cache = tkv_cache(ld, nblk)
        if prefix == 0:  # first chunk: the engines' prefill bypass (no rotation)
            ms = bench(lambda: prefill(q, k, v, cu, sl, ql, cache, bt, ld, no_prefix=True))
            log({**base, "impl": "tkv_K4V4_no_prefix", "ms": ms, "TFLOPs": flops / ms / 1e9})
        if prefix:  # decompress-once: the prefix dequantized into scratch, then 16-bit rows
            # room for prefix + chunk: what the SDPA path (exact_prefix) lays out
            scratch = torch.empty(dense_prefix_bytes(1, prefix + ql, hkv, d), dtype=torch.uint8,
                                  device=DEV)
            try:   # decompress-once, then SDPA (FlashAttention-2) over prefix + chunk
                ms = bench(lambda: prefill(q, k, v, cu, sl, ql, cache, bt, ld,
                                           max_prefix_len=prefix, scratch=scratch,
                                           exact_prefix=True))
                log({**base, "impl": "tkv_K4V4 decompress-once + SDPA (exact_prefix)",
                     "ms": ms, "TFLOPs": flops / ms / 1e9})
            except Exception as e:
                log({**base, "impl": "tkv_K4V4 decompress-once + SDPA", "error": str(e)[:160]})
            for lk in ("prmt", "prmti"):
                ldl = TkvLoader(codec, hkv, block, lookup=lk)
                try:
                    ms = bench(lambda ldl=ldl: prefill(q, k, v, cu, sl, ql, cache, bt, ldl,
                                                       max_prefix_len=prefix, scratch=scratch))
                    log({**base, "impl": "tkv_K4V4 decompress-once", "lookup": lk, "ms": ms,
                         "TFLOPs": flops / ms / 1e9})
                except Exception as e:
                    log({**base, "impl": "tkv_K4V4 decompress-once", "error": str(e)[:160]})
            del scratch
        for bm, bn, nw, st in ((128, 64, 8, 1), (128, 64, 8, 2), (128, 32, 8, 1),
                               (64, 64, 4, 1), (128, 128, 8, 1)):
            try:
                ms = bench(lambda: prefill(q, k, v, cu, sl, ql, cache, bt, ld, block_m=bm,
                                           block_n=bn, num_warps=nw, num_stages=st))
                log({**base, "impl": "tkv_K4V4", "block_m": bm, "block_n": bn, "num_warps": nw,
                     "num_stages": st, "ms": ms, "TFLOPs": flops / ms / 1e9})
            except Exception as e:
                log({**base, "impl": "tkv_K4V4", "block_m": bm, "error": str(e)[:160]})
        del cache
        torch.cuda.empty_cache()


def mixed_prefill_rows(copy_gbs, chunk=512, num_rows=32):
    """vLLM's chunked-prefill mixed step at kernel level (session 22's profile:
    ``results/vllm_sglang_profile_2026-12-05_s22/``): one continuation row (a 32-token cached
    prefix, a 480-token chunk) then 31 first chunks of 512 tokens — 16,352 prefill tokens,
    Qwen3-8B-like heads, K4V4. ``one call``: the prefill rows in one :func:`prefill` call
    (tkv-vllm until session 22: every first chunk rotated and run through the Triton loop);
    ``runs``: the continuation row alone (exact prefix: SDPA over the decompressed prefix)
    plus the first chunks through the bypass (tkv.vllm.prefill_runs); ``all first chunks``:
    the bypass over every row, the floor. Then ``rotate_rows`` at the step's rows
    (:func:`rotate_sweep_rows`)."""
    hq, hkv, d, block = 32, 8, 128, 16
    q_lens, prefixes = [chunk - 32] + [chunk] * (num_rows - 1), [32] + [0] * (num_rows - 1)
    seq = [p + q for p, q in zip(prefixes, q_lens, strict=True)]
    total = sum(q_lens)
    nb = [-(-s // block) for s in seq]
    nblk = sum(nb)
    perm = torch.randperm(nblk, device=DEV).int()
    bt = torch.full((len(seq), max(nb)), -1, dtype=torch.int32, device=DEV)
    at = 0
    for i, n in enumerate(nb):
        bt[i, :n] = perm[at:at + n]
        at += n
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)
    sl = torch.tensor(seq, dtype=torch.int32, device=DEV)
    q = torch.randn(total, hq, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(total, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, block)
    cache = tkv_cache(ld, nblk, device=DEV)
    scratch = torch.empty(dense_prefix_bytes(len(seq), 2 * chunk, hkv, d), dtype=torch.uint8,
                          device=DEV)
    base = dict(kernel="mixed_prefill", rows=len(seq), tokens=total, Hq=hq, Hkv=hkv, D=d)
    a = q_lens[0]
    cu0, cu1 = cu[:2], cu[1:] - a

    def one_call():
        prefill(q, k, v, cu, sl, chunk, cache, bt, ld, out=out, max_prefix_len=32,
                scratch=scratch)

    def runs():
        prefill(q[:a], k[:a], v[:a], cu0, sl[:1], a, cache, bt[:1], ld, out=out[:a],
                max_prefix_len=32, scratch=scratch, exact_prefix=True)
        prefill(q[a:], k[a:], v[a:], cu1, sl[1:], chunk, cache, bt[1:], ld, out=out[a:],
                no_prefix=True)

    def floor():
        prefill(q, k, v, cu, cu[1:] - cu[:-1], chunk, cache, bt, ld, out=out, no_prefix=True)

    ref = None
    for impl, fn in (("one call (before)", one_call), ("runs (tkv-vllm now)", runs),
                     ("all first chunks (floor)", floor)):
        ms = timed_row(base, impl, fn, ref_ms=ref)
        ref = ref if ref is not None else ms
    runs()
    split = out.clone()
    one_call()
    log({**base, "impl": "runs vs one call: max abs diff",
         "value": float((split.float() - out.float()).abs().max())})
    del cache, scratch
    torch.cuda.empty_cache()
    rotate_sweep_rows(copy_gbs, tokens=total)


def prefix_hits_rows(copy_gbs):
    """Prefill rows with cached prefixes (prefix-cache / radix hits, chunked continuations)
    at Qwen3-8B-like heads, K4V4, bf16: ``R`` rows with a ``P``-token compressed prefix and a
    ``C``-token chunk, one :func:`prefill` call each way. Baseline (x_default = 1): the
    decompress-once Triton loop, what such a run took before session 23 (and still does
    without a dense_attention callable); ``varlen path``: every prefix decompressed once
    (back to model space since session 24: no rotation of the query, the chunk or the
    output) and packed with its chunk's rows, ONE call of PyTorch's varlen FlashAttention-2
    (TorchVarlenAttention; the engines pass their own FA3 the same way); the same with
    ``prefill.MODEL_BACK_MAP = "pm1"`` (session 26: the dequant kernel's map back to model
    space as its exact ±1 factor, two tensor-core passes instead of three); ``bf16 FA2``: the
    same FlashAttention over the raw bf16 prefix + chunk in model space, no cache (what a
    bf16 engine does, the floor). Also the varlen path's max abs difference to the Triton
    loop and, at 32 × (1K + 512), the routes' errors against the float64 oracle
    (:func:`tkv.kernels.reference.prefill_reference`) and the varlen path's and the floor's
    device time kernel by kernel (:func:`_kernel_breakdown`; ``busy_us``: their sum, launch
    gaps excluded)."""
    from tkv.kernels import TorchVarlenAttention, varlen_prefix_bytes
    hq, hkv, d, block = 32, 8, 128, 16
    fa = TorchVarlenAttention()
    ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, block)
    for R, P, C in ((32, 1024, 512), (8, 4096, 2048), (2, 8192, 8192), (1, 16384, 16384)):
        seq = [P + C] * R
        nb = [-(-n // block) for n in seq]
        nblk = sum(nb)
        perm = torch.randperm(nblk, device=DEV).int()
        bt = torch.full((R, max(nb)), -1, dtype=torch.int32, device=DEV)
        at = 0
        for i, n in enumerate(nb):
            bt[i, :n] = perm[at:at + n]
            at += n
        cu = torch.arange(0, (R + 1) * C, C, dtype=torch.int32, device=DEV)
        cu_k = torch.arange(0, (R + 1) * (P + C), P + C, dtype=torch.int32, device=DEV)
        sl = torch.tensor(seq, dtype=torch.int32, device=DEV)
        total = R * C
        q = torch.randn(total, hq, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(total, hkv, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kf = torch.randn(R * (P + C), hkv, d, device=DEV, dtype=torch.bfloat16)
        vf = torch.randn_like(kf)
        out = torch.empty_like(q)
        cache = tkv_cache(ld, nblk, device=DEV)
        scratch = torch.empty(max(dense_prefix_bytes(R, P, hkv, d, block_size=block),
                                  varlen_prefix_bytes(R * P, total, hkv, d)),
                              dtype=torch.uint8, device=DEV)
        base = dict(kernel="prefix_hits", rows=R, prefix=P, chunk=C, Hq=hq, Hkv=hkv, D=d)
        flops = 4 * hq * d * R * (C * P + C * C / 2)

        def triton_loop():
            prefill(q, k, v, cu, sl, C, cache, bt, ld, out=out, max_prefix_len=P,
                    scratch=scratch)

        def varlen():
            prefill(q, k, v, cu, sl, C, cache, bt, ld, out=out, max_prefix_len=P,
                    scratch=scratch, dense_attention=fa, prefix_tokens=R * P)

        def varlen_pm1():   # session 26's opt-in back map: exact ±1 factor, two passes
            with mock.patch.object(prefill_mod, "MODEL_BACK_MAP", "pm1"):
                varlen()

        def floor():
            fa(q, kf, vf, cu, cu_k, C, P + C, d ** -0.5, 0)

        ref = None
        for impl, fn in (("Triton loop (before, baseline)", triton_loop),
                         ("varlen path (torch FA2)", varlen),
                         ("varlen path, ±1 back map (MODEL_BACK_MAP=pm1)", varlen_pm1),
                         ("bf16 FA2 (floor)", floor)):
            ms = timed_row(base, impl, fn, ref_ms=ref)
            if ms is not None:
                ROWS[-1]["TFLOPs"] = round(flops / ms / 1e9, 1)
            ref = ref if ref is not None else ms
        if R == 32:   # where the path is furthest above the floor (session 25: 1.61x)
            for impl, fn in (("varlen path", varlen), ("varlen path pm1", varlen_pm1),
                             ("bf16 FA2", floor)):
                row = {**base, "kernel": "prefix_hits_breakdown", "impl": impl}
                try:
                    br = _kernel_breakdown(fn, calls=10)
                    log({**row, "us_per_kernel": {k: round(v, 1) for k, v in br.items()},
                         "busy_us": round(sum(br.values()), 1)})
                except Exception as e:
                    log({**row, "error": str(e)[:160]})
        try:
            triton_loop()
            a = out.clone()
            varlen()
            log({**base, "impl": "varlen vs Triton loop: max abs diff",
                 "value": float((a.float() - out.float()).abs().max())})
            if R == 32:   # each route against the float64 oracle (one shape: it is slow)
                from tkv.kernels.reference import prefill_reference
                ref64 = prefill_reference(q, k, v, cu, sl, cache, bt, ld)
                b = out.clone()
                varlen_pm1()
                for impl, o in (("Triton loop", a), ("varlen path", b),
                                ("varlen path pm1", out)):
                    err = o.double() - ref64
                    log({**base, "impl": f"{impl} vs float64 oracle: max abs error",
                         "value": float(err.abs().max()),
                         "rel_err": float(err.norm() / ref64.norm())})
                del ref64, err
        except Exception as e:
            log({**base, "impl": "varlen vs Triton loop", "error": str(e)[:160]})
        del cache, scratch, kf, vf
        torch.cuda.empty_cache()


def rotate_sweep_rows(copy_gbs, tokens=16352):
    """``rotate_rows`` at prefill sizes (Qwen3-8B-like heads, K4V4 loader's matrices): the
    rows of one 16,352-token step — 523K query rows (bf16 → bf16), the same count of output
    rows from FlashAttention's bf16 (the varlen path since session 24) and from float32 (the
    Triton loop), 131K key rows with per-head centering. Baseline (x_default = 1): the
    one-tile launch (``persistent=False``: tf32x3, 128 rows × 8 warps from 65,536 rows; the
    default until session 25). Then the default call (the persistent launch since session
    25: :func:`tkv.kernels.rotate.launch_plan`). Variants: launch
    overrides of rows per program × warps × bf16 hi/lo passes (``bf16_split``; session 22),
    and the persistent launch (session 24: m split into bf16 hi/lo once per program, tiles
    looped) over tile rows × warps × pipeline stages × programs per SM. GB/s over the rows'
    bytes read + written; ``rel_err``: ‖y − y₆₄‖ / ‖y₆₄‖ against a float64 product."""
    from tkv.kernels.rotate import rotate_rows
    hq, hkv, d = 32, 8, 128
    ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, 16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mu = torch.randn(hkv, d, device=DEV) * 0.1
    cases = (("query rows", tokens, hq, torch.bfloat16, ld.q_in_planar, None),
             ("output rows from bf16", tokens, hq, torch.bfloat16, ld.out_planar, None),
             ("output rows from float32", tokens, hq, torch.float32, ld.out_planar, None),
             ("key rows", tokens, hkv, torch.bfloat16, ld.k_in_planar, mu))
    variants = [("override", dict(block_r=br, num_warps=nw, bf16_split=sp))
                for br, nw, sp in ((32, 8, False), (64, 8, False), (128, 4, False),
                                   (32, 8, True), (128, 8, True), (128, 4, True))]
    for br, nw, st, per_sm in ((64, 4, 2, 2), (64, 8, 2, 2), (128, 8, 2, 2), (64, 4, 3, 2),
                               (128, 8, 3, 1), (64, 4, 2, 4)):
        variants.append(("persistent", dict(persistent=True, block_r=br, num_warps=nw,
                                            num_stages=st, programs=per_sm * sms)))
    for what, t, h, xdt, m, mu_ in cases:
        x = torch.randn(t, h, d, device=DEV).to(xdt)
        y = torch.empty(t, h, m.shape[1], device=DEV, dtype=torch.bfloat16)
        ref = (x.double().view(-1, d) @ m.double()).view(t, h, -1)
        if mu_ is not None:
            ref -= mu_.double()[None]
        moved = x.numel() * x.element_size() + y.numel() * y.element_size()
        base = dict(kernel="rotate_rows", what=what, rows=t * h, K=d, N=m.shape[1])

        def err():
            return round(float((y.double() - ref).norm() / ref.norm()), 7)
        ms0 = timed_row(base, "one-tile tf32x3 (before, baseline)",
                        lambda: rotate_rows(x, m, y, mu_, persistent=False),
                        moved=moved, copy_gbs=copy_gbs)
        if ms0 is not None:
            ROWS[-1]["rel_err"] = err()
        for name, kw in (("default (launch_plan)", {}), *variants):
            ms = timed_row(base, name, lambda kw=kw: rotate_rows(x, m, y, mu_, **kw),
                           moved=moved, copy_gbs=copy_gbs, ref_ms=ms0,
                           **{k: v for k, v in kw.items() if k != "persistent"})
            if ms is not None:
                ROWS[-1]["rel_err"] = err()
        del x, y, ref
        torch.cuda.empty_cache()


def sink_rows(copy_gbs):
    """What sink offsets cost: the same kernels with a K4V4 codec without and with K and V sink
    offsets (random per-head σ; in the decode/prefill caches a third of the tokens flagged),
    default lookup (prmti). Baseline: the row without ``+sink`` of the same shape."""
    hq, hkv, d, block = 32, 8, 128, 16
    g = torch.Generator().manual_seed(0)
    codecs = (("tkv_K4V4", TurboKVCodec(d, 4, device=DEV)),
              ("tkv_K4V4+sink", TurboKVCodec(d, 4, device=DEV,
                                             k_sink_offset=torch.randn(hkv, d, generator=g) * 4,
                                             v_sink_offset=torch.randn(hkv, d, generator=g) * 4)))
    ws = Workspace(256, 64, 256, DEV)

    def flagged_cache(ld, nblk):
        cache = tkv_cache(ld, nblk)
        for side in ("k_norms", "v_norms"):
            nv = ld.layout.views(cache)[side]
            nv.copy_(torch.where(torch.rand_like(nv, dtype=torch.float32) < 1 / 3, -nv, nv))
        return cache

    for B, L in ((32, 8192), (64, 640), (256, 640), (1, 32768)):
        bt, sl, nblk = paged(B, L, block)
        q = torch.randn(B, hq, d, device=DEV, dtype=torch.bfloat16)
        base = dict(kernel="decode", B=B, L=L, Hq=hq, Hkv=hkv, D=d)
        cache = flagged_cache(TkvLoader(codecs[0][1], hkv, block), nblk)
        for name, codec in codecs:
            ld = TkvLoader(codec, hkv, block)
            nbytes = B * L * ld.layout.bytes_per_token
            ms = bench(lambda ld=ld: decode(q, cache, bt, sl, ld, ws))
            log({**base, "impl": f"{name}_{lookup_label(ld)}", "ms": ms,
                 "GBps": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / copy_gbs})
        del cache
    for T in (64, 256, 16384):
        k = torch.randn(T, hkv, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nblk = T // block + 1
        slots = torch.randperm(nblk * block, device=DEV)[:T]
        for name, codec in codecs:
            ld = TkvLoader(codec, hkv, block)
            cache = ld.layout.allocate(nblk, DEV)
            nbytes = store_bytes(T, hkv, d, ld)
            ms = bench(lambda ld=ld, cache=cache: compress_store(k, v, cache, slots, ld))
            log({"kernel": "compress_store", "T": T, "Hkv": hkv, "D": d, "impl": name, "ms": ms,
                 "GBps": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / copy_gbs})
    ql, prefix = 2048, 8192
    base, flops, (q, k, v, cu, sl, bt, nblk) = prefill_inputs(ql, prefix, hq, hkv, d, block)
    scratch = torch.empty(dense_prefix_bytes(1, prefix + ql, hkv, d), dtype=torch.uint8,
                          device=DEV)
    cache = flagged_cache(TkvLoader(codecs[0][1], hkv, block), nblk)
    for name, codec in codecs:
        ld = TkvLoader(codec, hkv, block)
        for path, kw in (("inline", {}),
                         ("decompress-once", dict(max_prefix_len=prefix, scratch=scratch)),
                         ("decompress-once + SDPA", dict(max_prefix_len=prefix, scratch=scratch,
                                                         exact_prefix=True))):
            try:
                ms = bench(lambda ld=ld, kw=kw: prefill(q, k, v, cu, sl, ql, cache, bt, ld, **kw))
                log({**base, "impl": f"{name} {path}", "ms": ms, "TFLOPs": flops / ms / 1e9})
            except Exception as e:
                log({**base, "impl": f"{name} {path}", "error": str(e)[:160]})
    del cache, scratch
    torch.cuda.empty_cache()


def table(copy_gbs, path, device=None):
    device = device or torch.cuda.get_device_name()
    lines = [f"# tkv kernels on {device} ({time.strftime('%Y-%m-%d')})",
             "", f"torch {torch.__version__}, triton {triton.__version__}. Device-to-device copy "
             f"bandwidth measured in this run: **{copy_gbs:.0f} GB/s** (read + write).", "",
             "| kernel | shape | impl | opts | ms | GB/s | % copy BW | TFLOP/s |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in ROWS:
        r = {"impl": "", **r}   # an error row of a breakdown carries no impl: never crash here
        shape = ", ".join(f"{k}={r[k]}" for k in ("B", "L", "T", "q_len", "prefix", "rows",
                                                   "tokens", "what", "Hq", "Hkv", "D") if k in r)
        opts = ", ".join(f"{k}={r[k]}" for k in ("lookup", "swap_qk", "maxnreg", "block_n",
                                                  "num_warps", "num_stages", "prefetch",
                                                  "num_splits", "auto_splits", "block_m",
                                                  "block_t", "block_r", "bf16_split", "programs", "chunk",
                                                  "rotation",
                                                  "layers",
                                                  "x_default",
                                                  "x_bf16", "rel_err", "ctas",
                                                  "rule_stages", "arm", "rule_splits",
                                                  "single_split_epilogue",
                                                  "min_split_tiles") if k in r
                         and (r["kernel"].endswith("_variant") or k not in ("lookup", "swap_qk")))
        if "error" in r:
            lines.append(f"| {r['kernel']} | {shape} | {r['impl']} | {opts} | error: "
                         f"{r['error'][:60]} | | | |")
            continue
        if "us_per_kernel" in r:
            parts = "; ".join(f"{k} {v:.1f} µs" for k, v in list(r["us_per_kernel"].items())[:10])
            if "busy_us" in r:
                parts += f"; busy total {r['busy_us']:.1f} µs"
            lines.append(f"| {r['kernel']} | {shape} | {r['impl']} | {parts} | | | | |")
            continue
        if "ms" not in r:   # a check row (e.g. rel_err), no time
            vals = "; ".join(f"{k} {r[k]:.3g}" for k in ("rel_err", "value") if k in r)
            lines.append(f"| {r['kernel']} | {shape} | {r['impl']} | {vals} | | | | |")
            continue
        gbs = f"{r['GBps']:.0f}" if "GBps" in r else ""
        fr = f"{100 * r['frac_copy']:.0f}%" if "frac_copy" in r else ""
        tf = f"{r['TFLOPs']:.0f}" if "TFLOPs" in r else ""
        lines.append(f"| {r['kernel']} | {shape} | {r['impl']} | {opts} | {r['ms']:.4f} | {gbs} |"
                     f" {fr} | {tf} |")
    Path(path).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def split_rows(copy_gbs):
    """Short contexts: the split-K count (Workspace.splits_for picks it from the batch shape
    alone) swept for the bf16 BypassLoader and tkv K4V4 — the skeleton's own overhead."""
    ws = Workspace(128, 64, 256, DEV)
    hq, hkv, d, block = 32, 8, 128, 16
    for B, L in ((32, 1024), (8, 1024), (128, 1024)):
        bt, sl, nblk = paged(B, L, block)
        q = torch.randn(B, hq, d, device=DEV, dtype=torch.bfloat16)
        bl = BypassLoader(hkv, d, block, torch.bfloat16)
        kp = torch.randn(nblk, block, hkv, d, device=DEV, dtype=torch.bfloat16)
        ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, block)
        cache = tkv_cache(ld, nblk)
        base = dict(kernel="decode", B=B, L=L, Hq=hq, Hkv=hkv, D=d)
        for name, loader, c, nbytes in (("tkv_bypass_bf16_paged", bl, (kp, kp),
                                         2 * B * L * hkv * d * 2),
                                        (f"tkv_K4V4_{lookup_label(ld)}", ld, cache,
                                         B * L * ld.layout.bytes_per_token)):
            for sp in (1, 2, 4, 8, 16):
                ms = bench(lambda sp=sp, loader=loader, c=c: decode(q, c, bt, sl, loader, ws,
                                                                  num_splits=sp))
                log({**base, "impl": name, "num_splits": sp, "auto_splits":
                     ws.splits_for(B, hkv), "ms": ms, "GBps": nbytes / ms / 1e6,
                     "frac_copy": nbytes / ms / 1e6 / copy_gbs})
        del kp, cache
        torch.cuda.empty_cache()


def _kernel_breakdown(fn, calls=20):
    """{CUDA kernel name: µs per call of ``fn``} from torch.profiler over ``calls`` eager
    calls (launch gaps excluded: device time of each kernel only)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            out[ev.key[:60]] = t / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def store_bytes(T: int, hkv: int, d: int, ld) -> int:
    """Bytes compress_store moves for T new tokens: bf16 K and V read, packed slots written
    (codes + norms, ``layout.ideal_bytes_per_token``), int64 slot_mapping read."""
    return 2 * T * hkv * d * 2 + T * ld.layout.ideal_bytes_per_token + T * 8


def step_rows(copy_gbs, shapes=((64, 640), (256, 640), (256, 2048), (1, 32768))):
    """One layer's attention work in a decode step as the engines run it, at the shapes of the
    e2e throughput runs (Qwen3-8B-like geometry; 512-token prompts + 256 generated → ~640
    tokens of context on average; and one 32K sequence): store the B new K/V tokens into the
    paged cache, then decode. tkv = compress_store + decode (query rotation, split-K,
    reduce + unrotate); bf16 = index_copy_ into a paged bf16 cache + tkv's BypassLoader decode
    (same skeleton); cuDNN SDPA bf16 on contiguous KV (no store) as the named reference.
    Each tkv step also gets a per-kernel device-time breakdown (torch.profiler)."""
    hq, hkv, d, block = 32, 8, 128, 16
    ws = Workspace(256, 64, 256, DEV)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for B, L in shapes:
        bt, sl, nblk, slots, q, kn, vn = step_inputs(B, L, hq, hkv, d, block)
        base = dict(kernel="decode_step", B=B, L=L, Hq=hq, Hkv=hkv, D=d)
        bf16_bytes = 2 * B * L * hkv * d * 2
        kc = torch.randn(B, hkv, L, d, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(
                    q.view(B, hq, 1, d), kc, vc, enable_gqa=True)
                f()
                ms = bench(f)
            log({**base, "impl": "sdpa_cudnn (no store)", "ms": ms,
                 "GBps": bf16_bytes / ms / 1e6, "frac_copy": bf16_bytes / ms / 1e6 / copy_gbs})
        except Exception as e:
            log({**base, "impl": "sdpa_cudnn (no store)", "error": str(e)[:120]})
        del kc, vc
        bl = BypassLoader(hkv, d, block, torch.bfloat16)
        kp = torch.randn(nblk, block, hkv, d, device=DEV, dtype=torch.bfloat16)
        vp = torch.randn_like(kp)

        def bf16_step():
            kp.view(-1, hkv, d).index_copy_(0, slots, kn)
            vp.view(-1, hkv, d).index_copy_(0, slots, vn)
            decode(q, (kp, vp), bt, sl, bl, ws)
        ms = bench(bf16_step)
        log({**base, "impl": "bf16 store + tkv_bypass decode", "ms": ms,
             "GBps": bf16_bytes / ms / 1e6, "frac_copy": bf16_bytes / ms / 1e6 / copy_gbs})
        del kp, vp
        ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, block)
        ldp = TkvLoader(ld.codec, hkv, block, lookup="prmt")
        cache = tkv_cache(ld, nblk)
        nbytes = B * L * ld.layout.bytes_per_token

        def tkv_step():
            compress_store(kn, vn, cache, slots, ld)
            decode(q, cache, bt, sl, ld, ws)

        def timed(impl, fn, moved=nbytes, **fields):
            timed_row(base, impl, fn, moved=moved, copy_gbs=copy_gbs, **fields)

        auto = dict(lookup=lookup_label(ld), splits=ws.splits_for(B, hkv))
        # the store moves its own bytes (B new tokens), not the cache the decode reads
        timed("tkv K4V4 compress_store", lambda: compress_store(kn, vn, cache, slots, ld),
              moved=store_bytes(B, hkv, d, ld), **auto)
        timed("tkv K4V4 decode", lambda: decode(q, cache, bt, sl, ld, ws), **auto)
        timed("tkv K4V4 store + decode", tkv_step, **auto)
        # the session-5 default for comparison: prmt (table words as operands), no register
        # cap (the variants sweep, --variants, has the full grid)
        timed("tkv K4V4 decode prmt", lambda: decode(q, cache, bt, sl, ldp, ws, maxnreg=0),
              lookup="prmt")
        if (B, L) == (256, 640):   # split-K x tile sweep at the throughput runs' shape
            for sp in (1, 2, 4, 8):
                for bn in (64, 128):
                    timed("tkv K4V4 decode", lambda sp=sp, bn=bn: decode(
                        q, cache, bt, sl, ld, ws, num_splits=sp, block_n=bn),
                        num_splits=sp, block_n=bn, auto_splits=ws.splits_for(B, hkv))
        try:
            br = _kernel_breakdown(tkv_step)
            log({**base, "kernel": "decode_step_breakdown", "impl": "tkv K4V4",
                 "us_per_kernel": {k: round(v, 2) for k, v in br.items()}})
        except Exception as e:
            log({**base, "kernel": "decode_step_breakdown", "impl": "tkv K4V4",
                 "error": str(e)[:160]})
        del cache
        torch.cuda.empty_cache()


def variant_rows(copy_gbs, shapes=((64, 640), (256, 640), (256, 2048), (1, 32768))):
    """Tuning sweep at the decode-step shapes (Qwen3-8B-like, K4V4): split-K decode over
    lookup (prmt / prmti / prmts) × K as the A operand (swap_qk) × a register cap (maxnreg: more
    CTAs per SM against spills), and compress_store over tokens per program × warps ×
    rotation chunk. Every row carries ``x_default`` = the default configuration's time
    (``decode(...)`` / ``compress_store(...)`` with no options, timed in the same loop) over
    the variant's: > 1 means the variant is faster."""
    hq, hkv, d, block = 32, 8, 128, 16
    ws = Workspace(256, 64, 256, DEV)
    codec = TurboKVCodec(d, 4, device=DEV)
    loaders = {lk: TkvLoader(codec, hkv, block, lookup=lk)
               for lk in ("auto", "prmt", "prmti", "prmts")}
    for B, L in shapes:
        bt, sl, nblk, slots, q, kn, vn = step_inputs(B, L, hq, hkv, d, block)
        cache = tkv_cache(loaders["auto"], nblk)
        nbytes = B * L * loaders["auto"].layout.bytes_per_token
        base = dict(kernel="decode_variant", B=B, L=L, Hq=hq, Hkv=hkv, D=d,
                    splits=ws.splits_for(B, hkv))
        ref = timed_row(base, "tkv K4V4 decode (default)",
                        lambda: decode(q, cache, bt, sl, loaders["auto"], ws), moved=nbytes,
                        copy_gbs=copy_gbs, lookup=lookup_label(loaders["auto"]), x_default=1.0)
        for lk in ("prmt", "prmti", "prmts"):
            for swap in (False, True):
                for nreg in (None, 128, 112):
                    opts = dict(swap_qk=swap, maxnreg=nreg)
                    timed_row(base, "tkv K4V4 decode",
                              lambda o=opts, lk=lk: decode(q, cache, bt, sl, loaders[lk], ws, **o),
                              moved=nbytes, copy_gbs=copy_gbs, ref_ms=ref, lookup=lk, **opts)
        ld = loaders["auto"]
        moved = store_bytes(B, hkv, d, ld)
        sbase = {**base, "kernel": "store_variant"}
        sref = timed_row(sbase, "tkv K4V4 compress_store (default)",
                         lambda: compress_store(kn, vn, cache, slots, ld), moved=moved,
                         x_default=1.0)
        for bt_ in (8, 16, 32):
            for nw in (2, 4, 8):
                for ch in (32, 64):
                    opts = dict(block_t=bt_, num_warps=nw, chunk=ch)
                    timed_row(sbase, "tkv K4V4 compress_store",
                              lambda o=opts: compress_store(kn, vn, cache, slots, ld, **o),
                              moved=moved, ref_ms=sref, **opts)
                # the butterfly rotation (session 28): no chunks, no rotation operand
                opts = dict(block_t=bt_, num_warps=nw, rotation="wht")
                timed_row(sbase, "tkv K4V4 compress_store",
                          lambda o=opts: compress_store(kn, vn, cache, slots, ld, **o),
                          moved=moved, ref_ms=sref, **opts)
        del cache
        torch.cuda.empty_cache()


# Qwen3-8B-like decoder layer (hidden, q heads, KV heads, head_dim, MLP width)
MODEL_DIMS = (4096, 32, 8, 128, 12288)


def make_model_step(B, L, attn, *, layers=36, dims=MODEL_DIMS, block=16, device=DEV,
                    seed=0):
    """An engine-like decode step: ``layers`` × (RMS norm, QKV GEMM, attention, o_proj GEMM,
    RMS norm, gate/up GEMM, SiLU·mul, down GEMM) for ``B`` sequences of ``L`` cached tokens,
    one weight set and one KV cache shared by all layers (each layer still streams its
    hundreds of MB, far past the L2). Unlike the isolated per-kernel rows, the attention
    kernels here run between cuBLAS GEMMs, as in vLLM's FULL decode graphs.

    ``attn``: ``"bf16"`` (index_copy_ store + BypassLoader decode, the same skeleton), ``"none"``
    (the GEMMs alone: attention's share) or a dict of a tkv configuration ``{"lookup": ...,
    "maxnreg": ..., "store_rotation": ...}`` (K4V4, compress_store + decode). Returns ``step()`` → the last hidden
    state, float-finite (RMS-normed each layer)."""
    hidden, hq, hkv, d, inter = dims
    g = torch.Generator(device=device).manual_seed(seed)

    def w(i, o):
        return torch.randn(i, o, device=device, generator=g).div_(i ** 0.5).to(torch.bfloat16)

    wqkv, wo = w(hidden, (hq + 2 * hkv) * d), w(hq * d, hidden)
    wgu, wd = w(hidden, 2 * inter), w(inter, hidden)
    bt, sl, nblk = paged(B, L, block, device)
    slots = last_slots(bt, L, block)
    x0 = torch.randn(B, hidden, device=device, generator=g).to(torch.bfloat16)
    ws = Workspace(max(B, 1), hq, d, device)
    out = torch.empty(B, hq, d, device=device, dtype=torch.bfloat16)
    if attn == "none":
        def attend(q, k, v):
            return q
    elif attn == "bf16":
        bl = BypassLoader(hkv, d, block, torch.bfloat16)
        kp = torch.randn(nblk, block, hkv, d, device=device, generator=g).to(torch.bfloat16)
        vp = torch.randn_like(kp)

        def attend(q, k, v):
            kp.view(-1, hkv, d).index_copy_(0, slots, k)
            vp.view(-1, hkv, d).index_copy_(0, slots, v)
            return decode(q, (kp, vp), bt, sl, bl, ws, out=out)
    elif "codecs" in attn:
        # one codec per layer (e.g. a calibration bundle row: fitted codebooks, channel
        # scales, key / sink offsets, per-layer widths), each layer its own loader and cache
        # as in an engine
        per_layer = []
        for codec in attn["codecs"]:
            ld = TkvLoader(codec, hkv, block, lookup=attn.get("lookup", "auto"),
                           small_head_groups=attn.get("small_head_groups", True))
            per_layer.append((ld, tkv_cache(ld, nblk, device, g)))
        layer_no = [0]

        def attend(q, k, v):
            ld, cache = per_layer[layer_no[0] % len(per_layer)]
            layer_no[0] += 1
            compress_store(k, v, cache, slots, ld)
            return decode(q, cache, bt, sl, ld, ws, out=out)
    else:
        # per-layer (k_bits, v_bits): "widths" (cycled over the layers), default K4V4; one
        # loader and one cache per distinct pair, shared by the layers that use it
        widths = attn.get("widths", [(4, 4)])
        per = {}
        for kb, vb in dict.fromkeys(widths):
            ld = TkvLoader(TurboKVCodec(d, k_bits=kb, v_bits=vb, device=device), hkv, block,
                           lookup=attn.get("lookup", "auto"), planes=attn.get("planes"),
                           small_head_groups=attn.get("small_head_groups", True),
                           resident_tables=attn.get("resident_tables", False))
            per[kb, vb] = ld, tkv_cache(ld, nblk, device, g)
        opts = {k: v for k, v in attn.items()
                if k not in ("lookup", "widths", "planes", "small_head_groups",
                             "store_rotation", "resident_tables")}
        rotation = attn.get("store_rotation", "auto")
        layer_no = [0]

        def attend(q, k, v):
            ld, cache = per[widths[layer_no[0] % len(widths)]]
            layer_no[0] += 1
            compress_store(k, v, cache, slots, ld, rotation=rotation)
            return decode(q, cache, bt, sl, ld, ws, out=out, **opts)

    def rms(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def step():
        x = x0
        if attn not in ("none", "bf16"):
            layer_no[0] = 0
        for _ in range(layers):
            qkv = rms(x) @ wqkv
            q = qkv[:, : hq * d].view(B, hq, d)
            k = qkv[:, hq * d: (hq + hkv) * d].view(B, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(B, hkv, d)
            x = x + attend(q, k, v).reshape(B, hq * d) @ wo
            gu = rms(x) @ wgu
            x = x + (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ wd
        return x

    return step


# SmolLM2-135M decoder layer (hidden, q heads, KV heads, head_dim, MLP width), 30 layers
SMOLLM2_DIMS = (576, 9, 3, 64, 1536)
SMOLLM2_BUNDLE = "results/calibrate_smollm2_sink_offset_2026-11-30/tkv_bundle.json"


def smollm2_step_rows(copy_gbs, shapes=((64, 640), (256, 640)), rows=("4.0", "3.0")):
    """Engine-like decode steps at SmolLM2-135M's geometry (30 layers, head_dim 64, 9 q / 3
    KV heads, GQA 3) — the model of the vLLM SmartMix run where tkv@4.0 ran 0.20× bf16 at
    256 sequences: GEMMs alone, bf16 (store + bypass decode), uniform K4V4 (Gaussian
    codebooks) and the committed bundle's rows with their own per-layer codecs (widths,
    fitted codebooks, channel scales, key / sink offsets), each also with
    ``small_head_groups=False`` loaders (3/5/7-bit sides at head_dim 64 read per element, as
    before session 13; the default fetches them as 8-code groups).
    Then, at the largest batch, the per-kernel device time of one step (torch.profiler) for
    bf16 and each bundle row: where the step's time goes, by kernel."""
    bundle = _smollm2_bundle()
    layers = 30
    arms = [("GEMMs only (no attention)", "none"), ("bf16 store + bypass decode", "bf16"),
            ("tkv K4V4 uniform", {})]
    for row in rows:
        arms.append((f"tkv bundle {row} row widths, Gaussian codebooks",
                     {"widths": _bundle_row_widths(row)}))
        arms.append((f"tkv bundle {row} row codecs", {"codecs": bundle.codecs(row, DEV)}))
        arms.append((f"tkv bundle {row} row codecs, per-element 3/5/7-bit sides",
                     {"codecs": bundle.codecs(row, DEV), "small_head_groups": False}))

    def profiled(attn) -> bool:   # bf16, uniform K4V4 and the bundle rows' own codecs
        return attn == "bf16" or (isinstance(attn, dict) and ("codecs" in attn or not attn))

    _model_step_arms(arms, shapes, layers, dims=SMOLLM2_DIMS, model="smollm2",
                     breakdown=profiled)


def _smollm2_bundle():
    """The committed SmolLM2 calibration bundle (:data:`SMOLLM2_BUNDLE`)."""
    from tkv.codec import CalibrationBundle
    return CalibrationBundle.load(Path(__file__).parent / SMOLLM2_BUNDLE)


def _bundle_row_widths(row: str) -> list[tuple[int, int]]:
    """Per-layer (k_bits, v_bits) of a TKV_BITS row of the committed SmolLM2 calibration
    bundle (30 layers; a 36-layer model step cycles them)."""
    a = _smollm2_bundle().allocation(row)
    return list(zip(a.k_bits, a.v_bits, strict=True))


def width_rows(copy_gbs, shapes=((32, 8192), (256, 640))):
    """Decode at widths other than K4V4 (the SmartMix rows' layers: 2/3/5/6-bit sides): the
    session-9 path (pair tables for 2/3 bits, every code group its own plane: 8 planes at
    3/5 bits) against session 10's (register byte-permute lookup for 2/3 bits, group planes
    interleaved to ``planes`` = 2 by default, or 1), at 32/64/128-token tiles; then
    engine-like model steps (:func:`make_model_step`) whose 36 layers take the widths of the
    SmolLM2 bundle's 3.0 / 4.0 / 5.0 rows, old vs new path, beside bf16 and uniform K4V4."""
    ws = Workspace(256, 64, 256, DEV)
    pairs = [(3, 3), (2, 2), (3, 2), (4, 3), (5, 3), (5, 5), (6, 6)]
    opts = [("pair", 8, None), ("auto", 2, None), ("auto", 2, 64), ("auto", 2, 128),
            ("auto", 1, 64)]
    for B, L in shapes:
        bt, sl, nblk = paged(B, L, 16)
        q = torch.randn(B, 32, 128, device=DEV, dtype=torch.bfloat16)
        base = dict(kernel="decode", B=B, L=L, Hq=32, Hkv=8, D=128)
        for kb, vb in [(4, 4), *pairs]:
            codec = TurboKVCodec(128, k_bits=kb, v_bits=vb, device=DEV)
            cache = None
            for lk, npl, bn in opts:
                if (kb, vb) == (4, 4) and (lk, npl) != ("auto", 2):
                    continue
                ld = TkvLoader(codec, 8, 16, lookup=lk, planes=npl)
                cache = tkv_cache(ld, nblk) if cache is None else cache
                nbytes = B * L * ld.layout.bytes_per_token
                o = {} if bn is None else {"block_n": bn}
                label = f"tkv_K{kb}V{vb}_{lookup_label(ld)}_{ld.planes('k')}x{ld.planes('v')}pl"
                try:
                    ms = bench(lambda o=o, ld=ld: decode(q, cache, bt, sl, ld, ws, **o))
                except Exception as e:
                    log({**base, "impl": label, **o, "error": str(e)[:160]})
                    continue
                log({**base, "impl": label, **o, "ms": ms, "GBps": nbytes / ms / 1e6,
                     "frac_copy": nbytes / ms / 1e6 / copy_gbs})
            del cache
        torch.cuda.empty_cache()
    arms = [("bf16 store + bypass decode", "bf16"), ("tkv K4V4 (default)", {})]
    for row in ("3.0", "4.0", "5.0"):
        w = _bundle_row_widths(row)
        arms += [(f"tkv SmolLM2 {row} row widths, session-9 path (pair, 8 planes)",
                  {"widths": w, "lookup": "pair", "planes": 8}),
                 (f"tkv SmolLM2 {row} row widths, default", {"widths": w})]
    _model_step_arms(arms, ((64, 640), (256, 640)), 36)


MODEL_STEP_ARMS: tuple[str, ...] = ()   # --model-step-arms: label substrings to keep (bf16 always)


def model_step_rows(copy_gbs, shapes=((64, 640), (256, 640)), layers=36):
    """Engine-like decode steps (:func:`make_model_step`, Qwen3-8B-like, 36 layers, one CUDA
    graph per step) for bf16 and tkv K4V4 configurations, ``x_bf16`` = bf16's step time over
    the configuration's (> 1: faster than bf16). Built after session 6, where the fastest
    isolated decode variant (prmti with a 128-register cap) was 2× slower inside vLLM: this
    checks kernel variants in an engine-like sequence of launches before they become
    defaults."""
    arms = [("GEMMs only (no attention)", "none"), ("bf16 store + bypass decode", "bf16"),
            ("tkv K4V4 default (kernel='auto': the CUDA kernel since session 33)", {}),
            ("tkv K4V4 prmt", {"lookup": "prmt"}),
            ("tkv K4V4 prmti (the default until session 32)", {"lookup": "prmti"}),
            ("tkv K4V4 prmti, maxnreg 128", {"lookup": "prmti", "maxnreg": 128}),
            ("tkv K4V4 prmti, store by the rotation matrix", {"store_rotation": "split"}),
            ("tkv K4V4 prmts (antisymmetric tables)", {"lookup": "prmts"}),
            ("tkv K4V4 prmts, maxnreg 128", {"lookup": "prmts", "maxnreg": 128}),
            # session 32: the lookups' first table words resident in regular registers
            ("tkv K4V4 prmti, resident tables", {"lookup": "prmti", "resident_tables": True}),
            ("tkv K4V4 prmti, resident tables, maxnreg 168",
             {"lookup": "prmti", "resident_tables": True, "maxnreg": 168}),
            ("tkv K4V4 prmts, resident tables", {"lookup": "prmts", "resident_tables": True}),
            ("tkv K4V4 prmts, resident tables, maxnreg 168",
             {"lookup": "prmts", "resident_tables": True, "maxnreg": 168}),
            # session 33: the hand-written CUDA split kernel (tkv.kernels.cuda_decode)
            ("tkv K4V4 cuda kernel", {"kernel": "cuda"}),
            ("tkv K4V4 cuda kernel, 1 split", {"kernel": "cuda", "num_splits": 1})]
    # the lookup / register / store arms time the Triton kernel
    arms = [(lb, at if not isinstance(at, dict) or not at or "kernel" in at
             else {"kernel": "triton", **at}) for lb, at in arms]
    if MODEL_STEP_ARMS:   # a short hold: bf16 (the baseline) and the arms asked for
        arms = [(lb, at) for lb, at in arms
                if at == "bf16" or any(k in lb for k in MODEL_STEP_ARMS)]
    _model_step_arms(arms, shapes, layers)


def qrot_rows(copy_gbs, shapes=((64, 640), (256, 640), (1, 32768))):
    """The query rotation inside the split kernel (``decode(fused_query_rotation=True)``,
    session 15) against the separate ``rotate_rows`` launch, Qwen3-8B-like K4V4: one layer's
    store + decode per shape (``x_default`` > 1: the fused one is faster), its per-kernel
    breakdown at the first shape, then engine-like 36-layer model steps (one CUDA graph each)
    for bf16, the separate launch and the fused rotation (the default since session 16) at the
    first two shapes."""
    hq, hkv, d, block = 32, 8, 128, 16
    ws = Workspace(256, 64, 256, DEV)
    for i, (B, L) in enumerate(shapes):
        bt, sl, nblk, slots, q, kn, vn = step_inputs(B, L, hq, hkv, d, block)
        base = dict(kernel="decode_step", B=B, L=L, Hq=hq, Hkv=hkv, D=d)
        ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, block)
        cache = tkv_cache(ld, nblk)
        nbytes = B * L * ld.layout.bytes_per_token
        steps = {}
        for fused in (False, True):
            def step(fused=fused):
                compress_store(kn, vn, cache, slots, ld)
                decode(q, cache, bt, sl, ld, ws, fused_query_rotation=fused)
            steps[fused] = step
        ref = timed_row(base, "tkv K4V4 store + decode (rotate_rows)", steps[False],
                        moved=nbytes, copy_gbs=copy_gbs)
        timed_row(base, "tkv K4V4 store + decode (query rotated in-kernel)", steps[True],
                  moved=nbytes, copy_gbs=copy_gbs, ref_ms=ref)
        a = decode(q, cache, bt, sl, ld, ws, fused_query_rotation=False)
        b = decode(q, cache, bt, sl, ld, ws, fused_query_rotation=True)
        log({**base, "kernel": "decode_check", "impl": "fused vs rotate_rows",
             "rel_err": ((a.float() - b.float()).norm() / a.float().norm()).item()})
        if i == 0:
            for fused, step in steps.items():
                try:
                    br = _kernel_breakdown(step)
                    log({**base, "kernel": "decode_step_breakdown",
                         "impl": f"tkv K4V4 fused_query_rotation={fused}",
                         "us_per_kernel": {k: round(v, 2) for k, v in br.items()}})
                except Exception as e:
                    log({**base, "kernel": "decode_step_breakdown", "error": str(e)[:160]})
        del cache
        torch.cuda.empty_cache()
    arms = [("bf16 store + bypass decode", "bf16"),
            ("tkv K4V4 (rotate_rows)", {"fused_query_rotation": False}),
            ("tkv K4V4, query rotated in-kernel", {"fused_query_rotation": True})]
    _model_step_arms(arms, shapes[:2], 36)


def _variant_row(base, fn, ref_out, ref_ms, *, moved, copy_gbs, **fields):
    """Run decode variant ``fn`` once against ``ref_out`` (``rel_err`` in the row), then time it
    (:func:`timed_row`, ``x_default`` against ``ref_ms``); a failing variant logs its error.
    Returns the ms, or None."""
    try:
        o = fn().float()
        err = float(f"{((o - ref_out).norm() / ref_out.norm()).item():.3g}")
    except Exception as e:
        log({**base, "impl": "tkv K4V4 decode", **fields, "error": str(e)[:160]})
        return None
    return timed_row({**base, "rel_err": err}, "tkv K4V4 decode", fn, moved=moved,
                     copy_gbs=copy_gbs, ref_ms=ref_ms, **fields)


def stage_rows(copy_gbs, shapes=((64, 640), (256, 640), (256, 2048), (32, 8192), (1, 32768))):
    """Software pipelining of the split-K decode's code-tile loads (session 17): Triton's
    ``num_stages`` > 1 with the default prmti lookup (Qwen3-8B-like K4V4, the query rotated
    in-kernel). The pair-table lookups of sessions 1-4 measured 1.5-2x slower pipelined
    (Triton staged their codebook gathers through shared memory); prmti has no gathers, and
    offline (sm_90a) ``num_stages=2`` turns the uint8 tile loads into ``cp.async`` copies
    (12 LDGSTS per 128-token tile; 186 instead of 168 registers, loop 1,866 vs 1,769
    instructions). Each row: ``x_default`` = the default's time over the variant's (> 1:
    faster), ``rel_err`` against the default's output. Then 36-layer engine-like model
    steps for the variants that won alone."""
    hq, hkv, d, block = 32, 8, 128, 16
    ws = Workspace(256, 64, 256, DEV)
    ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, block)
    variants = [dict(num_stages=st, block_n=bn, num_warps=nw)
                for st, bn, nw in ((1, 64, 4), (2, 64, 4), (2, 128, 4), (3, 64, 4), (3, 128, 4),
                                   (2, 128, 8), (2, 64, 8))]
    wins = collections.Counter()
    for B, L in shapes:
        bt, sl, nblk, _, q, _, _ = step_inputs(B, L, hq, hkv, d, block)
        cache = tkv_cache(ld, nblk)
        nbytes = B * L * ld.layout.bytes_per_token
        base = dict(kernel="decode_stages", B=B, L=L, Hq=hq, Hkv=hkv, D=d,
                    splits=ws.splits_for(B, hkv), lookup=lookup_label(ld))
        ref_out = decode(q, cache, bt, sl, ld, ws).float()
        ref = timed_row(base, "tkv K4V4 decode (default)", lambda: decode(q, cache, bt, sl, ld, ws),
                        moved=nbytes, copy_gbs=copy_gbs, x_default=1.0)
        for opts in variants:
            ms = _variant_row(base, lambda o=opts: decode(q, cache, bt, sl, ld, ws, **o),
                              ref_out, ref, moved=nbytes, copy_gbs=copy_gbs, **opts)
            if ms is not None and ref is not None and ms < ref:
                wins[tuple(sorted(opts.items()))] += 1
        del cache
        torch.cuda.empty_cache()
    arms = [("bf16 store + bypass decode", "bf16"), ("tkv K4V4 (default)", {})]
    arms += [(f"tkv K4V4 {dict(k)}", dict(k)) for k, _ in wins.most_common(2)]
    _model_step_arms(arms, ((64, 640), (256, 640)), 36)


def stage_small_rows(copy_gbs, shapes=((1, 8192), (1, 32768), (1, 131072), (2, 8192),
                                       (2, 32768), (4, 32768), (8, 32768))):
    """Small decode batches (session 17): the default (``decode_num_stages``: pipelined on
    grids under ``target_programs`` CTAs) against one stage (the old default) and two
    stages forced, each at the workspace's 32 splits and at up to 128 (``max_splits=128``:
    more CTAs instead of pipelining). ``x_default`` > 1: faster than the default."""
    hq, hkv, d, block = 32, 8, 128, 16
    ws = Workspace(8, 64, 256, DEV)
    ws128 = Workspace(8, 64, 256, DEV, max_splits=128)
    ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, block)
    for B, L in shapes:
        bt, sl, nblk, _, q, _, _ = step_inputs(B, L, hq, hkv, d, block)
        cache = tkv_cache(ld, nblk)
        nbytes = B * L * ld.layout.bytes_per_token
        splits = ws.splits_for(B, hkv)
        base = dict(kernel="decode_small", B=B, L=L, Hq=hq, Hkv=hkv, D=d,
                    ctas=B * hkv * splits, target=ws.target_programs,
                    rule_stages=ld.decode_num_stages(B * hkv * splits, ws.target_programs))
        ref_out = decode(q, cache, bt, sl, ld, ws, num_stages=1).float()
        ref = timed_row({**base, "num_splits": splits}, "tkv K4V4 decode (default)",
                        lambda: decode(q, cache, bt, sl, ld, ws), moved=nbytes,
                        copy_gbs=copy_gbs, x_default=1.0)
        arms = [(ws, splits)]
        if ws128.splits_for(B, hkv) != splits:   # 128 max splits change this batch's grid
            arms.append((ws128, ws128.splits_for(B, hkv)))
        for w, sp in arms:
            for st in (1, 2):
                _variant_row(base, lambda w=w, st=st: decode(q, cache, bt, sl, ld, w,
                                                             num_stages=st),
                             ref_out, ref, moved=nbytes, copy_gbs=copy_gbs, num_stages=st,
                             num_splits=sp)
        del cache
        torch.cuda.empty_cache()


def split_rule_rows(copy_gbs, batches=(32, 64, 96, 128, 192, 256), lens=(640, 2048, 8192)):
    """One split on full grids (session 18; the default since session 19): the rule
    (``single_split_ctas = SINGLE_SPLIT_TARGETS × target_programs`` CTAs, as
    ``TKV_DECODE_SINGLE_SPLIT=1`` sets it; one split's output written by the split kernel
    itself) against the earlier rule, at least 2 splits always (``x_default`` is against
    that one, the default until session 19, whatever the environment says), one split with
    the reduce pass kept, 2 splits and the length-aware arms, K4V4 at the vLLM shapes; then
    36-layer model steps of both rules beside bf16 at the e2e shapes."""
    hq, hkv, d, block = 32, 8, 128, 16
    ws_old = Workspace(max(batches), 64, 256, DEV, single_split_ctas=0)
    ws = Workspace(max(batches), 64, 256, DEV,
                   single_split_ctas=SINGLE_SPLIT_TARGETS * ws_old.target_programs)
    ld = TkvLoader(TurboKVCodec(d, 4, device=DEV), hkv, block)
    for L in lens:
        for B in batches:
            bt, sl, nblk, _, q, _, _ = step_inputs(B, L, hq, hkv, d, block)
            cache = tkv_cache(ld, nblk)
            nbytes = B * L * ld.layout.bytes_per_token
            old = ws_old.splits_for(B, hkv)
            base = dict(kernel="decode_split_rule", B=B, L=L, Hq=hq, Hkv=hkv, D=d,
                        ctas_one_split=B * hkv, single_split_ctas=ws.single_split_ctas,
                        rule_splits=ws.splits_for(B, hkv))
            ref_out = decode(q, cache, bt, sl, ld, ws_old).float()
            ref = timed_row({**base, "num_splits": old}, "tkv K4V4 decode (min 2 splits)",
                            lambda: decode(q, cache, bt, sl, ld, ws_old), moved=nbytes,
                            copy_gbs=copy_gbs, x_default=1.0)
            variants = [("rule", {}, ws), ("1 split", {"num_splits": 1}, ws),
                        ("1 split + reduce", {"num_splits": 1, "single_split_epilogue": False},
                         ws)]
            if old != 2:
                variants.append(("2 splits", {"num_splits": 2}, ws))
            # length-aware split-K on the default rule's grid (decode(min_split_tiles=n))
            variants += [(f"min {n} tiles per split", {"min_split_tiles": n}, ws_old)
                         for n in (2, 4, 8)]
            for label, opts, w in variants:
                _variant_row(base, lambda o=opts, w=w: decode(q, cache, bt, sl, ld, w, **o),
                             ref_out, ref, moved=nbytes, copy_gbs=copy_gbs, arm=label, **opts)
            del cache
            torch.cuda.empty_cache()
    arms = [("bf16 store + bypass decode", "bf16")]
    for B in (64, 256):
        old, new = ws_old.splits_for(B, hkv), ws.splits_for(B, hkv)
        arms_b = [*arms, (f"tkv K4V4 (rule: {new} split(s))", {"num_splits": new}),
                  (f"tkv K4V4 (min 2 splits: {old})", {"num_splits": old}),
                  (f"tkv K4V4 ({old} splits, min 4 tiles per split)",
                   {"num_splits": old, "min_split_tiles": 4})]
        _model_step_arms(arms_b, ((B, 640),), 36)


def _model_step_arms(arms, shapes, layers, dims=MODEL_DIMS, model=None, breakdown=None):
    """Time each (label, attn) arm's model step per (B, L); ``x_bf16`` against the bf16 arm.
    ``breakdown(attn)``: also log the per-kernel device time of one step of that arm at the
    last shape (:func:`_kernel_breakdown`)."""
    _, hq, hkv, d, _ = dims
    for i, (B, L) in enumerate(shapes):
        base = dict(kernel="model_step", B=B, L=L, Hq=hq, Hkv=hkv, D=d, layers=layers)
        if model:
            base["model"] = model
        ref = None
        for label, attn in arms:
            try:
                step = make_model_step(B, L, attn, layers=layers, dims=dims)
                ms = bench(step)
            except Exception as e:
                log({**base, "impl": label, "error": str(e)[:300]})
                continue
            if attn == "bf16":
                ref = ms
            row = {**base, "impl": label, "ms": ms}
            if ref is not None:
                row["x_bf16"] = round(ref / ms, 3)
            log(row)
            if breakdown is not None and i == len(shapes) - 1 and breakdown(attn):
                try:
                    kb = _kernel_breakdown(step, calls=5)
                    log({**base, "kernel": "model_step_breakdown", "impl": label,
                         "us_per_kernel": {k: round(v, 1) for k, v in list(kb.items())[:25]}})
                except Exception as e:
                    log({**base, "kernel": "model_step_breakdown", "impl": label,
                         "error": str(e)[:300]})
            del step
            torch.cuda.empty_cache()


def main():
    global LOOKUPS, MODEL_STEP_ARMS, CUDA_KERNEL   # set from --lookups, --model-step-arms, --cuda
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true",
                    help="sweep decode tile options at B=32 L=8K and split-K at short contexts")
    ap.add_argument("--tag", default="")
    ap.add_argument("--vllm-only", action="store_true",
                    help="decode at the main shapes only (K4V4 + baselines + vLLM TurboQuant); "
                         "no D=64/256, other widths, compress_store or prefill")
    ap.add_argument("--prefill", action="store_true",
                    help="the prefill rows (SDPA, bf16 bypass, tkv inline and decompress-once "
                         "at prefix 0 / 8K / 32K) also with --vllm-only")
    ap.add_argument("--step", action="store_true",
                    help="per-layer decode step (store + decode) at the e2e shapes, with a "
                         "per-kernel breakdown, before the other rows")
    ap.add_argument("--variants", action="store_true",
                    help="only the tuning sweep at the decode-step shapes (variant_rows)")
    ap.add_argument("--model-step", action="store_true",
                    help="engine-like 36-layer decode steps (GEMMs + attention) per config")
    ap.add_argument("--model-step-arms", default="",
                    help="comma-separated label substrings: only those --model-step arms "
                         "(and the bf16 baseline), e.g. 'prmti (default),prmts'")
    ap.add_argument("--sink", action="store_true",
                    help="also the sink-offset rows first (decode, compress_store, prefill "
                         "without and with sink offsets)")
    ap.add_argument("--store-sweep", action="store_true",
                    help="also the compress_store tiling x rotation sweep first")
    ap.add_argument("--widths", action="store_true",
                    help="only decode at 2/3/5-bit sides, pair vs register lookup, and model "
                         "steps with the SmolLM2 bundle rows' per-layer widths (width_rows)")
    ap.add_argument("--smollm2-step", action="store_true",
                    help="only engine-like decode steps at SmolLM2's geometry with the "
                         "committed bundle's per-layer codecs, and their per-kernel breakdown")
    ap.add_argument("--qrot", action="store_true",
                    help="only the in-kernel query rotation vs rotate_rows: per-layer steps, "
                         "breakdown, 36-layer model steps (qrot_rows)")
    ap.add_argument("--stages", action="store_true",
                    help="only the decode software-pipelining sweep (num_stages x block_n x "
                         "warps) and model steps of the winners (stage_rows)")
    ap.add_argument("--split-rule", action="store_true",
                    help="alone: one split on full grids vs at least 2 (session 18), kernel "
                    "rows and model steps")
    ap.add_argument("--stages-small", action="store_true",
                    help="only small decode batches: the pipelining rule vs 1 / 2 stages at 32 "
                         "and 128 max splits (stage_small_rows)")
    ap.add_argument("--mixed-prefill", action="store_true",
                    help="alone: vLLM's chunked-prefill mixed step at kernel level, one call "
                         "vs runs, and the rotate_rows launch sweep (mixed_prefill_rows)")
    ap.add_argument("--prefix-hits", action="store_true",
                    help="alone: prefill rows with cached prefixes, the Triton loop vs the "
                         "varlen path through FlashAttention (prefix_hits_rows)")
    ap.add_argument("--rotate", action="store_true",
                    help="alone (with --prefix-hits if given too): rotate_rows at prefill "
                         "sizes, default vs bf16_split vs the persistent launch "
                         "(rotate_sweep_rows)")
    ap.add_argument("--cuda", action="store_true",
                    help="also time decode(kernel='cuda') (the hand-written CUDA split kernel)")
    ap.add_argument("--lookups", default=",".join(LOOKUPS),
                    help="comma-separated TkvLoader lookups to time (default: all of them)")
    a = ap.parse_args()
    LOOKUPS = tuple(a.lookups.split(","))
    CUDA_KERNEL = a.cuda
    MODEL_STEP_ARMS = tuple(k for k in a.model_step_arms.split(",") if k)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    log({"kernel": "copy", "impl": "torch copy_", "GBps": copy_gbs, "ms": 0.0})
    tag = f"_{a.tag}" if a.tag else ""
    def write():
        table(copy_gbs, out / f"kernels_gpu{tag}.md")
        (out / f"kernels_gpu{tag}.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")

    def guarded(fn, kernel, impl):   # a block of rows that must not cost the rest of the run
        try:
            fn(copy_gbs)
        except Exception as e:
            log({"kernel": kernel, "impl": impl, "error": str(e)[:160]})

    if a.model_step:
        guarded(model_step_rows, "model_step", "model step rows")
    if a.sink:
        guarded(sink_rows, "sink", "sink rows")
    if a.store_sweep:
        guarded(store_sweep_rows, "store_sweep", "store sweep")
    # modes that run their rows alone: the first one given, in this precedence (the two
    # pipelining sweeps together)
    stages = [fn for flag, fn in ((a.stages_small, stage_small_rows), (a.stages, stage_rows))
              if flag]
    prefill_sweeps = [fn for flag, fn in ((a.rotate, rotate_sweep_rows),
                                          (a.prefix_hits, prefix_hits_rows)) if flag]
    alone = next((fns for flag, fns in ((bool(prefill_sweeps), prefill_sweeps),
                                        (a.mixed_prefill, [mixed_prefill_rows]),
                                        (a.split_rule, [split_rule_rows]),
                                        (a.smollm2_step, [smollm2_step_rows]),
                                        (bool(stages), stages), (a.qrot, [qrot_rows]),
                                        (a.widths, [width_rows]), (a.variants, [variant_rows]))
                  if flag), None)
    if alone:
        for fn in alone:
            fn(copy_gbs)
        write()
        return
    if a.step:
        guarded(step_rows, "decode_step", "step rows")
    if a.tune:
        decode_rows([(32, 8192, 32, 8, 128)], [(4, 4)], copy_gbs, tune=True)
        guarded(split_rows, "decode", "split-K sweep")
    main_cfgs = [(b, l, 32, 8, 128) for b in (1, 8, 32, 128) for l in (1024, 8192, 32768)]
    main_cfgs.append((1, 131072, 32, 8, 128))
    if a.quick:
        main_cfgs = [(32, 8192, 32, 8, 128), (1, 32768, 32, 8, 128)]
    decode_rows(main_cfgs, [(4, 4)], copy_gbs, tune=False)
    if not a.vllm_only:
        decode_rows([(32, 8192, 32, 8, 64), (32, 8192, 32, 8, 256)], [(4, 4)], copy_gbs,
                    tune=False)
        decode_rows([(32, 8192, 32, 8, 128)], [(2, 2), (3, 3), (5, 5), (6, 6), (7, 7), (8, 8),
                                               (4, 2), (5, 3)], copy_gbs, tune=False)
        store_rows(copy_gbs)
    if a.prefill or not a.vllm_only:
        prefill_rows()
    write()


if __name__ == "__main__":
    sys.exit(main())
