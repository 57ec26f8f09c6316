"""GPU diagnostic: relative error of decode/prefill vs the float64 oracle over width pairs.

Run on a CUDA machine: ``PYTHONPATH=packages/tkv-codec/src:packages/tkv-kernels/src python
packages/tkv-kernels/tools/diag_gpu.py``. Prints one line per case as it goes (each new width
pair compiles new kernels: a few seconds each). Written to localise the compiled-GPU failures
listed in docs/kernels.md (the CPU interpreter passes all these cases)."""
import itertools

import torch

from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader, Workspace, decode, prefill
from tkv.kernels.reference import decode_reference, prefill_reference
from tkv.kernels.testing import fill_cache, make_cache, make_paged_batch

DEV = "cuda"
ws = Workspace(8, 32, 128, DEV, max_splits=8)


def scen(ld, lens, dtype):
    g = torch.Generator().manual_seed(1)
    b = make_paged_batch(lens, ld.block_size, DEV, generator=g)
    c = make_cache(ld, b.num_blocks, DEV, generator=g)
    kvs = []
    for i, n in enumerate(lens):
        kv = torch.randn(2, n, ld.num_kv_heads, ld.head_dim, generator=g).to(DEV, dtype)
        fill_cache(ld, c, kv[0], kv[1], b.slots(i))
        kvs.append(kv)
    return b, c, kvs


def rel(o, r):
    return ((o.double() - r).norm() / r.norm()).item()


for kb, vb in [(4, 4), (4, 3), (3, 4), (3, 3), (2, 2), (4, 2), (2, 4), (8, 8), (8, 4), (4, 8), (5, 5), (6, 6), (7, 7)]:
    for h, gq in [(2, 4), (1, 2)]:
        for bn in (16, 64):
            ld = TkvLoader(TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV), h, 16)
            b, c, _ = scen(ld, [33, 1, 16, 50], torch.bfloat16)
            q = torch.randn(4, h * gq, 64, device=DEV, dtype=torch.bfloat16)
            out = torch.full(q.shape, float("nan"), device=DEV)
            decode(q, c, b.block_table, b.seq_lens, ld, ws, out=out, block_n=bn)
            r = decode_reference(q, c, b.block_table, b.seq_lens, ld)
            o2 = torch.full(q.shape, float("nan"), device=DEV)
            decode(q, c, b.block_table, b.seq_lens, ld, ws, out=o2, block_n=bn, num_splits=1)
            print(f"decode K{kb}V{vb} H{h} G{gq} bn{bn}: {rel(out, r):.4f} splits1 {rel(o2, r):.4f}", flush=True)
for kb, vb in [(4, 4), (3, 4), (4, 3)]:
    for bm in (16, 64):
        ld = TkvLoader(TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV), 2, 16)
        pre, ql = [35, 16], [9, 12]
        lens = [p + q for p, q in zip(pre, ql, strict=False)]
        b, c, kvs = scen(ld, lens, torch.float16)
        q = torch.randn(sum(ql), 8, 64, device=DEV, dtype=torch.float16)
        k = torch.cat([kv[0, p:] for kv, p in zip(kvs, pre, strict=False)])
        v = torch.cat([kv[1, p:] for kv, p in zip(kvs, pre, strict=False)])
        cu = torch.tensor([0, *itertools.accumulate(ql)], dtype=torch.int32, device=DEV)
        out = torch.full(q.shape, float("nan"), device=DEV)
        prefill(q, k, v, cu, b.seq_lens, max(ql), c, b.block_table, ld, out=out, block_m=bm,
                block_n=16)
        r = prefill_reference(q, k, v, cu, b.seq_lens, c, b.block_table, ld)
        print(f"prefill K{kb}V{vb} bm{bm}: {rel(out, r):.4f}", flush=True)
