"""The varlen prefill path's two routes against the float64 oracle at large key offsets (CPU).

``tkv.kernels.prefill`` with a ``dense_attention`` callable packs every sequence's
dequantized prefix with its chunk and makes one call (the varlen path). Since session 24 it
runs in model space where it can: the prefix rows come back from the dequant kernel still
centered (``k − μ``) and the chunk's keys are centered the same way in float32, so the
16-bit rows the callable reads keep the centered keys' precision. The planar route rotates
query, chunk and output instead. This script compares both routes with the Triton loop (no
callable) on one batch — K4V4, head_dim 128, two KV heads, GQA 2, prefixes 100 / 60 tokens,
chunks 20 / 18 — with a key offset μ that grows by ``extra`` in 4 of 128 channels, the
callable's query, key and value rows rounded to bf16 / fp16 first (what FlashAttention reads
on a GPU; under the interpreter tkv's rows are float32). Metric: ‖out − ref‖ / ‖ref‖ against
``prefill_reference`` (float64). Baseline: the planar route.

Run from the repository root (Triton interpreter, ~1 min)::

    TRITON_INTERPRET=1 uv run --frozen python benchmarks/varlen_centering_cpu.py
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import sys
from unittest import mock

import torch

from tkv.codec import TurboKVCodec
from tkv.kernels import SdpaDenseAttention, TkvLoader, prefill, varlen_prefix_bytes
from tkv.kernels.reference import prefill_reference
from tkv.kernels.testing import fill_cache, make_cache, make_paged_batch

# the module (tkv.kernels re-exports the function ``prefill`` under the same name)
prefill_module = importlib.import_module("tkv.kernels.prefill")


class RoundedRows(SdpaDenseAttention):
    """SdpaDenseAttention over rows rounded to ``dtype`` (a 16-bit FlashAttention's inputs)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, q, k, v, *args):
        r = [x.to(self.dtype).to(x.dtype) for x in (q, k, v)]
        return super().__call__(*r, *args)


def planar_route():
    """Force the planar route (the model-space test answers False)."""
    return mock.patch.object(prefill_module, "_model_space_rows", lambda *a: False)


def case(dtype: torch.dtype, extra: float, prefix=(100, 60), qlens=(20, 18), d=128,
         hkv=2, group=2) -> dict[str, float]:
    g = torch.Generator().manual_seed(5)
    mu = torch.randn(d, generator=g) * 2
    mu[:4] += extra
    ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=4, seed=1, k_channel_offset=mu), hkv, 16)
    batch = make_paged_batch([p + q for p, q in zip(prefix, qlens, strict=True)], 16, "cpu",
                             generator=g)
    cache = make_cache(ld, batch.num_blocks, "cpu", generator=g)
    qs, ks, vs = [], [], []
    for i, (p, ql) in enumerate(zip(prefix, qlens, strict=True)):
        k = (torch.randn(p + ql, hkv, d, generator=g) + mu).to(dtype)
        v = torch.randn(p + ql, hkv, d, generator=g).to(dtype)
        fill_cache(ld, cache, k, v, batch.slots(i))
        ks.append(k[p:])
        vs.append(v[p:])
        qs.append(torch.randn(ql, hkv * group, d, generator=g).to(dtype))
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld)
    need = varlen_prefix_bytes(sum(prefix), q.shape[0], hkv, d, dtype)
    errs = {}
    for route, ctx, fn in (("Triton loop", contextlib.nullcontext, None),
                           ("planar route", planar_route, RoundedRows(dtype)),
                           ("model-space route", contextlib.nullcontext, RoundedRows(dtype))):
        with ctx():
            out = prefill(q, k, v, cu, batch.seq_lens, max(qlens), cache, batch.block_table,
                          ld, out=torch.empty(q.shape), max_prefix_len=max(prefix),
                          scratch=torch.full((need // 4 + 64,), float("nan")),
                          dense_attention=fn, prefix_tokens=sum(prefix), block_m=16)
        errs[route] = ((out.double() - ref).norm() / ref.norm()).item()
    return errs


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        sys.exit("run with TRITON_INTERPRET=1 (no GPU)")
    print("| rows | μ extra | Triton loop | planar route (baseline) | model-space route | "
          "× planar |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float16):
        for extra in (0.0, 30.0, 100.0):
            e = case(dtype, extra)
            print(f"| {str(dtype).split('.')[1]} | {extra:g} | {e['Triton loop']:.2e} | "
                  f"{e['planar route']:.2e} | {e['model-space route']:.2e} | "
                  f"{e['model-space route'] / e['planar route']:.2f} |")


if __name__ == "__main__":
    main()
