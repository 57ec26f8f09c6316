# ruff: noqa: B023, F821  (lambdas are timed immediately; the caches are deleted after timing)
"""compress_store(kernel="cuda") (the hand-written CUDA store, session 34) against the Triton
store (the default until session 34: Walsh–Hadamard butterflies) on one GPU: one table, ratios
to the Triton store in the same run, the copy bandwidth measured in the same run.

* kernel rows: bf16 K/V into a random-slot paged cache at prefill-sized (16K, 2K tokens) and
  decode-sized (256, 64 tokens) batches; Qwen3-8B-like heads (8 × 128), SmolLM2 (3 × 64) and
  head_dim 256; K4V4 plain, K4V4 with key centering + sink offsets (the shipped bundle's
  codec), other widths (K3V2, K5V4, K8V8: the binary-search fallback). GB/s over bytes read +
  written (kernels_gpu.store_bytes). Each CUDA variant (``cuda_store.TUNING``: coordinates per
  lane ``elems``, CTAs per SM ``ctas_per_sm``) also reports its agreement with the Triton
  store: the fraction of equal codes and the largest norm difference in bf16 ulps.
* ``--model-step``: kernels_gpu's 36-layer engine-like step with the store on Triton vs CUDA
  (decode on its default either way), and bf16.

Usage: python benchmarks/cuda_store_gpu.py --out DIR [--tag T] [--quick] [--model-step]
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cuda_bench
import kernels_gpu as kg
from cuda_bench import ROWS, log, model_step_lines, write_results

from tkv.kernels import TkvLoader, compress_store, cuda_store
from tkv.kernels.testing import offset_codec, tuning

VARIANTS = [("cuda (default tuning)", {}), ("cuda elems=8", {"elems": 8}),
            ("cuda ctas_per_sm=4", {"ctas_per_sm": 4}),
            ("cuda ctas_per_sm=16", {"ctas_per_sm": 16}),
            ("cuda ctas_per_sm=32", {"ctas_per_sm": 32})]


def _agreement(ld, cache_a, cache_b, slots):
    """(fraction of equal codes, largest |norm difference| in bf16 ulps of the larger) over
    the written slots of two caches."""
    va, vb = ld.layout.views(cache_a), ld.layout.views(cache_b)
    bs = ld.block_size
    b, o = slots // bs, slots % bs
    eq, n = 0, 0
    for name in ("k_codes", "v_codes"):
        a, c = va[name][b, :, o], vb[name][b, :, o]
        bits = ld.k_bits if name[0] == "k" else ld.v_bits
        if bits == 4:   # compare nibbles
            a = torch.stack([a & 15, a >> 4], -1)
            c = torch.stack([c & 15, c >> 4], -1)
        eq += (a == c).sum().item()
        n += a.numel()
    worst = 0.0
    for name in ("k_norms", "v_norms"):
        a, c = va[name][b, :, o].float(), vb[name][b, :, o].float()
        ulp = torch.maximum(a.abs(), c.abs()).clamp_min(1e-30) * 2.0 ** -7
        worst = max(worst, ((a - c).abs() / ulp).max().item())
    return eq / n, worst


def timed(base, impl, fn, moved, copy_gbs, ref_ms=None):
    """Time ``fn`` (kernels_gpu.bench: CUDA graph, L2 flushed) and log its row."""
    ms = kg.bench(fn)
    row = {**base, "impl": impl, "ms": ms, "GBps": moved / ms / 1e6,
           "frac_copy": moved / ms / 1e6 / copy_gbs}
    if ref_ms is not None:
        row["x_default"] = round(ref_ms / ms, 3)
    log(row)
    return ms


def kernel_rows(cases, copy_gbs, variants):
    g = torch.Generator().manual_seed(1)
    for T, hkv, d, kb, vb, sink in cases:
        # the shipped bundle's codec kind: key centering + sink offsets
        codec = offset_codec(d, kb, vb, hkv, g, center=sink, sink=sink, device=kg.DEV)
        ld = TkvLoader(codec, hkv, 16)
        k = torch.randn(T, hkv, d, device=kg.DEV, dtype=torch.bfloat16) * 2
        v = torch.randn_like(k)
        nblk = T // 16 + 1
        cache_t = ld.layout.allocate(nblk, kg.DEV)
        cache_c = ld.layout.allocate(nblk, kg.DEV)
        slots = torch.randperm(nblk * 16, device=kg.DEV)[:T]
        moved = kg.store_bytes(T, hkv, d, ld)
        base = dict(kernel="store", T=T, Hkv=hkv, D=d, widths=f"K{kb}V{vb}",
                    sink=bool(sink))
        compress_store(k, v, cache_t, slots, ld, kernel="triton")
        tri = timed(base, "triton (butterflies; the default until session 34)",
                    lambda: compress_store(k, v, cache_t, slots, ld, kernel="triton"), moved,
                    copy_gbs)
        for label, tune in variants:
            try:
                with tuning(cuda_store, **tune):
                    compress_store(k, v, cache_c, slots, ld, kernel="cuda")
                    torch.cuda.synchronize()
                    agree, ulps = _agreement(ld, cache_t, cache_c, slots)
                    timed({**base, "codes_equal": round(agree, 6), "norm_ulps": ulps}, label,
                          lambda: compress_store(k, v, cache_c, slots, ld, kernel="cuda"),
                          moved, copy_gbs, tri)
            except Exception as e:
                log({**base, "impl": label, "error": str(e)[:200]})
        del cache_t, cache_c, k, v
        torch.cuda.empty_cache()


@contextlib.contextmanager
def store_kernel(name):
    """compress_store's default kernel (``TKV_STORE_KERNEL`` as read at import) set to
    ``name`` while the step is built and timed."""
    old = cuda_store.STORE_KERNEL
    cuda_store.STORE_KERNEL = name
    try:
        yield
    finally:
        cuda_store.STORE_KERNEL = old


def model_step_rows(shapes, layers=36):
    arms = [("bf16 store + bypass decode", "bf16", None),
            ("tkv K4V4, Triton store (the default)", {}, lambda: store_kernel("triton")),
            ("tkv K4V4, CUDA store (TKV_STORE_KERNEL=auto)", {}, lambda: store_kernel("auto"))]
    cuda_bench.model_step_rows(shapes, arms, layers)


def table(copy_gbs) -> str:
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}. Copy bandwidth "
             f"measured in this run: **{copy_gbs:.0f} GB/s**. Baseline: the Triton store "
             "(compress_store's default until session 34) into a second cache with the same "
             "slots; x_default > 1 = the CUDA store is faster. codes equal / norm ulps: "
             "agreement with the Triton store's cache.",
             "", "| shape | impl | ms | GB/s | % copy BW | x_triton | codes equal | norm ulps |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in ROWS:
        if r.get("kernel") != "store":
            continue
        shape = f"T={r['T']}, Hkv={r['Hkv']}, D={r['D']}, {r['widths']}"
        if r.get("sink"):
            shape += " + centering + sink"
        if "error" in r:
            lines.append(f"| {shape} | {r['impl']} | error: {r['error'][:80]} | | | | | |")
            continue
        lines.append(f"| {shape} | {r['impl']} | {r['ms']:.4f} | {r['GBps']:.0f} | "
                     f"{100 * r['frac_copy']:.0f}% | {r.get('x_default', '')} | "
                     f"{r.get('codes_equal', '')} | {r.get('norm_ulps', '')} |")
    lines += model_step_lines()
    return "\n".join(lines) + "\n"


def main():
    ap = cuda_bench.parser("K4V4 at 16K tokens and 64 tokens only")
    a = ap.parse_args()
    copy_gbs = cuda_bench.start()
    cases = [(16384, 8, 128, 4, 4, False), (16384, 8, 128, 4, 4, True),
             (2048, 8, 128, 4, 4, False), (256, 8, 128, 4, 4, False), (64, 8, 128, 4, 4, False),
             (256, 8, 128, 4, 4, True), (8192, 3, 64, 4, 4, False), (8192, 3, 64, 4, 4, True),
             (16384, 8, 256, 4, 4, False), (16384, 8, 128, 3, 2, False),
             (16384, 8, 128, 5, 4, False), (16384, 8, 128, 8, 8, False)]
    if a.quick:
        cases = [cases[0], cases[1], cases[4]]
    kernel_rows(cases, copy_gbs, VARIANTS)
    if a.model_step:
        model_step_rows(((64, 640), (256, 640)))
    write_results(a.out, "cuda_store_gpu", a.tag, table(copy_gbs))


if __name__ == "__main__":
    sys.exit(main())
