"""Host (Python) cost per call of tkv's kernel wrappers, every Triton launch a no-op (CPU).

An engine's eager steps (SGLang's extend, vLLM's prefill) pay each wrapper's argument checks,
planning and small torch ops on the host, per layer and call. This script times those alone:
``prefill`` (the first-chunk bypass), ``compress_store`` and ``decode`` with their Triton
kernels replaced by no-ops, on CPU tensors at SmolLM2's geometry (head_dim 64, 3 KV heads,
GQA 3, 16-token pages): 16 prompts × 512 tokens for prefill / store (one SGLang chunk of 8,192
tokens), 64 sequences × ~600 cached tokens for decode. Median of ``--repeats`` timings of
``--calls`` calls each. It measures the wrappers only; a launch itself (Triton's binder, the
driver) comes on top on a GPU. Baseline: none — absolute µs per call, for comparison with
step times (session 27: SmolLM2's SGLang prefill gap).

Run from the repository root (~10 s)::

    uv run --frozen python benchmarks/host_cost_cpu.py --out benchmarks/results/host_cost_cpu.md
"""

from __future__ import annotations

import argparse
import importlib
import platform
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch

from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader, Workspace, compress_store, decode, prefill
from tkv.kernels.testing import make_cache

# module → Triton kernels the three wrappers launch (replaced by no-ops)
_KERNELS = {"tkv.kernels.prefill": ("_prefill_kernel", "_nan_broken_promise_kernel"),
            "tkv.kernels.store": ("_compress_store_kernel",),
            "tkv.kernels.decode": ("_decode_split_kernel", "_decode_reduce_kernel")}


class _NoLaunch:
    """``kernel[grid](*args, **kwargs)`` that does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _time(fn, calls: int, repeats: int) -> float:
    """Median µs per call of ``fn`` over ``repeats`` runs of ``calls`` calls (one warm-up)."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    a = ap.parse_args()
    torch.manual_seed(0)
    d, hkv, group, bs = 64, 3, 3, 16
    ld = TkvLoader(TurboKVCodec(d, 4, seed=1), hkv, bs)
    nseq, qlen = 16, 512
    tq, pages = nseq * qlen, qlen // bs
    q = torch.randn(tq, hkv * group, d, dtype=torch.bfloat16)
    k = torch.randn(tq, hkv, d, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.arange(0, tq + 1, qlen, dtype=torch.int32)
    lens = torch.full((nseq,), qlen, dtype=torch.int32)
    table = torch.arange(nseq * pages, dtype=torch.int32).view(nseq, pages)
    cache = make_cache(ld, nseq * pages + 1, "cpu")
    slots = torch.arange(tq, dtype=torch.int64)
    out = torch.empty_like(q)
    qd, dout = q[:64], torch.empty_like(q[:64])
    dtable = table.repeat(4, 1)[:64].contiguous()
    dlens = torch.full((64,), 600, dtype=torch.int32)
    ws = Workspace(64, hkv * group, d, device="cpu")
    cases = {
        "prefill (no_prefix bypass), 16 × 512 tokens": lambda: prefill(
            q, k, v, cu, lens, qlen, cache, table, ld, out=out, no_prefix=True),
        "compress_store, 8,192 tokens": lambda: compress_store(k, v, cache, slots, ld),
        "decode, 64 sequences × 600 tokens": lambda: decode(
            qd, cache, dtable, dlens, ld, ws, out=dout),
    }
    with ExitStack() as stack:
        for mod, names in _KERNELS.items():
            m = importlib.import_module(mod)
            for name in names:
                stack.enter_context(mock.patch.object(m, name, _NoLaunch()))
        rows = [(name, _time(fn, a.calls, a.repeats)) for name, fn in cases.items()]
    lines = ["# Host cost of tkv's kernel wrappers, Triton launches as no-ops (CPU)", "",
             f"{platform.processor() or platform.machine()}, torch {torch.__version__}; "
             f"median of {a.repeats} × {a.calls} calls. Command: `uv run --frozen python "
             "benchmarks/host_cost_cpu.py`.", "",
             "| wrapper | µs per call |", "|---|---:|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
