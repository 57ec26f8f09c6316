# ruff: noqa: B023  (lambdas are timed immediately)
"""The Gluon split kernel (``tkv.kernels.gluon_decode``) vs the Triton one on one GPU.

Correctness first (float64 oracle and the Triton kernel on random K/V, random non-contiguous
pages, ragged lengths incl. 1, GQA 3/4/8, head_dim 64/128, windows), then decode times side
by side (CUDA graphs, L2 flushed; baseline: the Triton split kernel with its default lookup).

    PYTHONPATH=packages/tkv-codec/src:packages/tkv-kernels/src python3 benchmarks/gluon_decode_gpu.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernels_gpu import _graph_ms

from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader, Workspace, decode
from tkv.kernels.reference import decode_reference
from tkv.kernels.testing import fill_cache, make_cache, make_paged_batch, relative_error
from tkv.kernels.workspace import WorkspaceTooSmallError

DEV = "cuda"


def setup(lens, hq, hkv, d, bs, g, lookup="prmt"):
    ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=4, device=DEV), hkv, bs, lookup=lookup)
    pb = make_paged_batch(lens, bs, DEV, generator=g)
    cache = make_cache(ld, pb.num_blocks, DEV, generator=g)
    slots = torch.cat([pb.slots(i) for i in range(len(lens))])
    n = slots.numel()
    k = torch.randn(n, hkv, d, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(n, hkv, d, generator=g).to(DEV, torch.bfloat16)
    fill_cache(ld, cache, k, v, slots)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEV, torch.bfloat16)
    return ld, pb, cache, q


def check(args) -> int:
    g = torch.Generator().manual_seed(11)
    bad = 0
    for hq, hkv, d, bs, lens, win, bn in [
            (32, 8, 128, 16, [1, 37, 300, 1024, 77], 0, 32),
            (32, 8, 128, 16, [1, 37, 300, 1024, 77], 100, 32),
            (9, 3, 64, 16, [5, 700, 129, 1], 0, 32),
            (16, 2, 128, 32, [513, 2, 1000], 0, 64),
            (28, 4, 128, 16, [999, 17], 0, 32),
            (32, 4, 64, 64, [4000, 33, 64], 0, 64)]:
        ld, pb, cache, q = setup(lens, hq, hkv, d, bs, g)
        ws = Workspace(len(lens), hq, d, DEV)
        ref = decode_reference(q, cache, pb.block_table, pb.seq_lens, ld, window=win)
        tri = decode(q, cache, pb.block_table, pb.seq_lens, ld, ws, window=win).double()
        for splits in (None, 8):
            glu = decode(q, cache, pb.block_table, pb.seq_lens, ld, ws, window=win,
                         kernel="gluon", block_n=bn, num_splits=splits).double()
            e_ref, e_tri = relative_error(glu, ref), relative_error(glu, tri)
            ok = e_ref < 2.5e-2 and e_tri < 1e-2 and torch.isfinite(glu).all()
            bad += not ok
            print(f"check Hq={hq} Hkv={hkv} D={d} bs={bs} lens={lens} win={win} bn={bn} "
                  f"splits={splits}: rel err vs float64 {e_ref:.2e}, vs triton {e_tri:.2e} "
                  f"(triton vs float64 {relative_error(tri, ref):.2e}) {'OK' if ok else 'FAIL'}")
    return bad


def times(args) -> None:
    g = torch.Generator().manual_seed(5)
    print("\n| shape | triton (auto lookup) ms | gluon variant | ms | triton / gluon |")
    print("|---|---:|---|---:|---:|")
    for b, L, hq, hkv, d in [(32, 8192, 32, 8, 128), (64, 640, 32, 8, 128),
                             (256, 640, 32, 8, 128), (1, 32768, 32, 8, 128),
                             (64, 700, 9, 3, 64), (128, 2048, 32, 8, 128)]:
        ld, pb, cache, q = setup([L] * b, hq, hkv, d, 16, g, lookup="auto")
        ldp = TkvLoader(ld.codec, hkv, 16, lookup="prmt")
        ws = Workspace(b, hq, d, DEV, max_splits=64)
        out = torch.empty_like(q)
        # like for like: the Gluon kernel takes a query rotated by the separate launch, so the
        # Triton baseline does too (the in-kernel rotation is the Triton default since s16)
        base = _graph_ms(lambda: decode(q, cache, pb.block_table, pb.seq_lens, ld, ws, out=out,
                                        fused_query_rotation=False))
        sp0 = ws.splits_for(b, hkv)
        for bn in (32, 64):
            for sp in sorted({sp0, min(64, 2 * sp0), min(64, 4 * sp0)}):
                try:
                    ms = _graph_ms(lambda: decode(q, cache, pb.block_table, pb.seq_lens, ldp,
                                                  ws, out=out, kernel="gluon", block_n=bn,
                                                  num_splits=sp))
                except WorkspaceTooSmallError:
                    continue   # the workspace's partial rows cap the splits at this batch
                print(f"| B={b} L={L} Hq={hq} Hkv={hkv} D={d} | {base:.4f} | block_n {bn}, "
                      f"{sp} splits | {ms:.4f} | {base / ms:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-times", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    bad = check(args)
    if not args.no_times:
        times(args)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
