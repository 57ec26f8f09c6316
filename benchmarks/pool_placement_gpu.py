"""Does page placement in an engine-sized KV pool slow tkv's decode? (one GPU)

The engine-like model step of ``kernels_gpu.py`` shares one KV cache, sized to the pages it
uses, across all layers. An engine does not: each layer owns a tensor of the whole pool
(vLLM's Qwen3-8B-like run at ``gpu_memory_utilization`` 0.5: 92,638 tkv pages of 16 tokens,
16,896 B each, 1.56 GB per layer; bf16: 23,871 pages of 64 KB), and a sequence's pages lie
wherever the block allocator put them. At equal block_size a sequence has as many pages in
either format, but a tkv page is 3.9× smaller and the pool (the same bytes) holds 3.9× more of
them: a sequence's K/V are read as smaller, more widely scattered pieces.

This script times the attention layers of one decode step (36 by default: only
``tkv.kernels.decode`` per layer, each layer its own pool-sized cache, one CUDA graph of the
calls) for B sequences of L cached tokens with the sequences' pages either packed (sequence
i owns pages ``[i·n, (i+1)·n)``) or scattered (distinct pages drawn at random from the whole
pool), for tkv K4V4 at block_size 16 and 64 and for bf16 (``BypassLoader``, the same kernel
reading raw bf16 pages; vLLM's own FlashAttention is not used here). Baseline named in every ratio: the
same configuration with packed pages.

Run on the GPU from the repository root with tkv's src folders on ``PYTHONPATH``::

    python3 benchmarks/pool_placement_gpu.py --out benchmarks/results/pool_placement_gpu.md

``--small`` runs tiny shapes (also on CPU under ``TRITON_INTERPRET=1``: a check that the
script runs, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tkv.codec import TurboKVCodec
from tkv.kernels import BypassLoader, TkvLoader, Workspace, decode
from tkv.kernels._util import interpreting

# vLLM 0.20.1, Qwen3-8B-like (Hq=32, Hkv=8, head_dim 128, 36 layers), gpu_memory_utilization
# 0.5 on the H200 (benchmarks/results/vllm_e2e_2026-12-04_s19_split1/): KV tokens per pool
POOL_TOKENS = {"tkv": 1_482_208, "bf16": 381_936}


def block_table(num_seqs: int, pages: int, pool_pages: int, placement: str,
                device: str, gen: torch.Generator) -> torch.Tensor:
    """int32 ``(num_seqs, pages)``: packed (consecutive pages per sequence from page 0) or
    scattered (distinct pages drawn uniformly from the whole pool)."""
    need = num_seqs * pages
    if need > pool_pages:
        raise ValueError(f"{need} pages do not fit a pool of {pool_pages}")
    if placement == "packed":
        ids = torch.arange(need, device=device)
    else:
        ids = torch.randperm(pool_pages, device=device, generator=gen)[:need]
    return ids.to(torch.int32).view(num_seqs, pages)


def caches(kind: str, loader, layers: int, pool_pages: int, block: int, hkv: int, d: int,
           device: str):
    """One zero-filled pool-sized cache per layer. The kernels have no data-dependent
    branches or trip counts (codes are table indices, norms multipliers), so the contents are
    assumed not to change the timing; not measured here."""
    if kind == "bf16":
        return [tuple(torch.zeros(pool_pages, block, hkv, d, dtype=torch.bfloat16,
                                  device=device) for _ in range(2)) for _ in range(layers)]
    return [torch.zeros(pool_pages, loader.layout.page_bytes, dtype=torch.uint8, device=device)
            for _ in range(layers)]


def layers_step(q, layer_caches, bt, sl, loader, ws, out):
    """The attention of one decode step: ``decode`` once per layer, each on its own cache."""
    def step():
        for c in layer_caches:
            decode(q, c, bt, sl, loader, ws, out=out)
    return step


def time_layers(fn, replays: int) -> float:
    """Median ms of ``fn`` (one decode call per layer) replayed from one CUDA graph; eager timing
    under the interpreter / on CPU."""
    if not torch.cuda.is_available() or interpreting():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--lens", type=int, nargs="+", default=[640, 1280])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    ap.add_argument("--out", default=None, help="markdown table (and .jsonl rows beside it)")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    hq, hkv, d = 32, 8, 128
    pool_tokens = dict(POOL_TOKENS)
    if a.small:
        a.batches, a.lens, a.layers, hq, hkv, d = [2], [40], 2, 4, 2, 64
        pool_tokens = {"tkv": 1024, "bf16": 512}
    gen = torch.Generator(device=device).manual_seed(0)
    configs = [("bf16", 16), ("tkv", 16), ("tkv", 64)]
    rows = []
    for kind, block in configs:
        if kind == "bf16":
            loader = BypassLoader(hkv, d, block, torch.bfloat16)
        else:
            loader = TkvLoader(TurboKVCodec(d, 4, device=device), hkv, block)
        pool_pages = pool_tokens[kind] // block
        cs = caches(kind, loader, a.layers, pool_pages, block, hkv, d, device)
        ws = Workspace(max(a.batches), hq, d, device)
        for L in a.lens:
            for B in a.batches:
                pages = -(-L // block)
                if B * pages > pool_pages:   # more tokens than this format's pool holds
                    print(json.dumps({"impl": f"{kind} block_size {block}", "B": B, "L": L,
                                      "skipped": f"{B * pages} pages > pool {pool_pages}"}))
                    continue
                q = torch.randn(B, hq, d, device=device, generator=gen).to(torch.bfloat16)
                out = torch.empty_like(q)
                sl = torch.full((B,), L, dtype=torch.int32, device=device)
                base = None
                for placement in ("packed", "scattered"):
                    bt = block_table(B, pages, pool_pages, placement, device, gen)
                    ms = time_layers(layers_step(q, cs, bt, sl, loader, ws, out), a.replays)
                    base = base or ms
                    row = {"impl": f"{kind} block_size {block}", "B": B, "L": L,
                           "placement": placement, "pool_pages": pool_pages,
                           "page_bytes": (2 * block * hkv * d * 2 if kind == "bf16"
                                          else loader.layout.page_bytes),
                           "layers": a.layers, "ms": round(ms, 4),
                           "x_packed": round(base / ms, 3)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del cs
        if device == "cuda":
            torch.cuda.empty_cache()
    lines = ["| impl | B | L | placement | pool pages | page bytes (per layer) | "
             f"ms ({a.layers} layers) | × packed |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['impl']} | {r['B']} | {r['L']} | {r['placement']} | {r['pool_pages']:,} | "
              f"{r['page_bytes']:,} | {r['ms']:.3f} | {r['x_packed']:.3f} |"
              for r in rows]
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        dev = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
        out.write_text(f"# Page placement in an engine-sized pool — {dev}\n\n"
                       f"Command: `python3 benchmarks/pool_placement_gpu.py "
                       f"--batches {' '.join(map(str, a.batches))} --lens "
                       f"{' '.join(map(str, a.lens))} --layers {a.layers}`; torch "
                       f"{torch.__version__}. Baseline of each ratio: the same configuration "
                       f"with packed pages.\n\n{table}\n")
        out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
