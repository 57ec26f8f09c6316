"""Every layer width of a calibration bundle through every kernel, against the float64 oracle.

A bundle row can give each layer its own (k_bits, v_bits), fitted codebooks, key offsets and
sink offsets; the kernel tests cover such features one by one on random codecs. This runs the
bundle's own codecs: for each requested row and each distinct (k_bits, v_bits) in it, the
layer's codec goes through ``compress_store``, ``decode`` and the three prefill paths (inline,
decompress-once, decompress-once + SDPA) on random K/V, and each output is compared with the
oracle (``tkv.kernels.reference``). It found the head_dim-64 prefill tile bug
(``benchmarks/results/prefill_tile_bug_2026-11-30.md``).

    PYTHONPATH=packages/tkv-codec/src:packages/tkv-kernels/src \\
        python3 benchmarks/bundle_kernels_gpu.py --rows 3.0 4.0 5.0 [--device cuda]

Each width's codec also writes random tokens through ``compress_store`` and the packed codes,
norms and sink flags are compared with the codec's own ``compress_k`` / ``compress_v``
(:func:`check_store`). Prints one line per (row, widths); exits 1 if any relative error exceeds
``--tol`` (default 2.5e-2, the bf16 bound of the GPU tests) or the store disagrees with the
codec beyond float32 rounding. Under ``TRITON_INTERPRET=1 --device cpu`` it runs on
CPU (slow: minutes per row).
"""

from __future__ import annotations

import argparse
import sys

import torch

from tkv.codec import CalibrationBundle
from tkv.kernels import TkvLoader, Workspace, decode, dense_prefix_bytes, prefill
from tkv.kernels.reference import decode_reference, prefill_reference
from tkv.kernels.testing import fill_cache, make_cache, make_paged_batch, relative_error

DEFAULT_BUNDLE = "benchmarks/results/calibrate_smollm2_sink_offset_2026-11-30/tkv_bundle.json"


def check_layer(codec, num_kv_heads: int, group: int, device: str, g: torch.Generator,
                small_head_groups: bool = True):
    """Relative errors ``(decode, [inline, decompress-once, sdpa])`` of one layer's codec
    (``small_head_groups``: the TkvLoader option, default on)."""
    d = codec.head_dim
    ld = TkvLoader(codec, num_kv_heads, 16, small_head_groups=small_head_groups)
    lens = [40, 1, 17]
    batch = make_paged_batch(lens, 16, device, generator=g)
    cache = make_cache(ld, batch.num_blocks, device, generator=g)
    for i, n in enumerate(lens):
        k = (torch.randn(n, num_kv_heads, d, generator=g) * 3).to(device, torch.bfloat16)
        v = torch.randn(n, num_kv_heads, d, generator=g).to(device, torch.bfloat16)
        fill_cache(ld, cache, k, v, batch.slots(i))
    hq = num_kv_heads * group
    q = torch.randn(len(lens), hq, d, generator=g).to(device, torch.bfloat16)
    out = decode(q, cache, batch.block_table, batch.seq_lens, ld, Workspace(8, hq, d, device))
    r_dec = relative_error(out.float(),
                           decode_reference(q, cache, batch.block_table, batch.seq_lens, ld))
    qc, kc, vc = (torch.randn(10, h, d, generator=g).to(device, torch.bfloat16)
                  for h in (hq, num_kv_heads, num_kv_heads))
    cu = torch.tensor([0, 10], dtype=torch.int32, device=device)
    sl, bt = batch.seq_lens[:1], batch.block_table[:1]
    ref = prefill_reference(qc, kc, vc, cu, sl, cache, bt, ld)
    scratch = torch.empty(dense_prefix_bytes(1, 64, num_kv_heads, d, block_size=16),
                          dtype=torch.uint8, device=device)
    r_pre = []
    for kw in ({}, dict(max_prefix_len=30, scratch=scratch, block_m=16),
               dict(max_prefix_len=30, scratch=scratch, exact_prefix=True, block_m=16)):
        o = prefill(qc, kc, vc, cu, sl, 10, cache, bt, ld, **kw)
        r_pre.append(relative_error(o.float(), ref))
    return ld, r_dec, r_pre


def check_store(codec, ld, device: str, g: torch.Generator, n: int = 200):
    """compress_store vs the codec on ``n`` random bf16 tokens (a few of them exactly the
    sink offset when the codec has one): ``(code agreement, max relative norm difference,
    flag agreement)`` over K and V. Float32 rounding differs between the two (the kernel's
    norm is taken before the rotation), so rare codes at bucket boundaries, one bf16 ulp of a
    norm and near-tie sink choices may differ; anything more is a bug."""
    from tkv.codec.packing import unpack_codes
    from tkv.kernels import compress_store

    h, d = ld.num_kv_heads, codec.head_dim
    k = (torch.randn(n, h, d, generator=g) * 3).to(device, torch.bfloat16)
    v = torch.randn(n, h, d, generator=g).to(device, torch.bfloat16)
    for x, side in ((k, codec.k), (v, codec.v)):
        if side.sink_offset is not None:   # BOS-like tokens: exactly σ (flagged, zero norm)
            x[:4] = side.sink_offset.to(device).expand(4, h, d).to(torch.bfloat16)
    cache = ld.layout.allocate(-(-n // ld.block_size), device)
    slots = torch.arange(n, device=device)
    compress_store(k, v, cache, slots, ld)
    views = ld.layout.views(cache)
    b, o = slots // ld.block_size, slots % ld.block_size
    agree, ndiff, flags = 1.0, 0.0, 1.0
    for name, x, side, comp in (("k", k, codec.k, codec.compress_k),
                                ("v", v, codec.v, codec.compress_v)):
        pc, nc = comp(x)
        got = unpack_codes(views[f"{name}_codes"][b, :, o], side.bits, d)
        want = unpack_codes(pc, side.bits, d)
        gn, wn = views[f"{name}_norms"][b, :, o].float(), nc.float()
        same = torch.signbit(gn) == torch.signbit(wn)
        flags = min(flags, same.float().mean().item())
        agree = min(agree, (got == want)[same].float().mean().item())
        rel = ((gn - wn).abs() / wn.abs().clamp_min(1e-6))[same & (wn != 0)]
        ndiff = max(ndiff, rel.max().item() if rel.numel() else 0.0)
    return agree, ndiff, flags


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=DEFAULT_BUNDLE)
    ap.add_argument("--rows", nargs="+", default=["4.0"], help="TKV_BITS rows to check")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--group", type=int, default=None,
                    help="query heads per KV head (default: num_kv_heads, e.g. 3 for SmolLM2)")
    ap.add_argument("--tol", type=float, default=2.5e-2)
    ap.add_argument("--per-element", action="store_true",
                    help="loaders with small_head_groups=False (3/5/7-bit sides at head_dim "
                         "64 read per element instead of as 8-code groups)")
    a = ap.parse_args(argv)
    b = CalibrationBundle.load(a.bundle)
    hkv = b.geometry.num_kv_heads
    group = a.group or hkv
    g = torch.Generator().manual_seed(0)
    worst, store_ok = 0.0, True
    for row in a.rows:
        alloc = b.allocation(row)
        seen = set()
        for layer, widths in enumerate(zip(alloc.k_bits, alloc.v_bits, strict=True)):
            if widths in seen:
                continue
            seen.add(widths)
            codec = b.codec(layer, *widths, a.device, check_finite=False)
            ld, r_dec, r_pre = check_layer(codec, hkv, group, a.device, g,
                                           not a.per_element)
            worst = max(worst, r_dec, *r_pre)
            agree, ndiff, flags = check_store(codec, ld, a.device, g)
            store_ok = store_ok and agree >= 0.999 and ndiff <= 8e-3 and flags >= 0.98
            print(f"row {row} layer {layer} K{widths[0]}V{widths[1]} lookups "
                  f"{ld.lookup_name('k')}/{ld.lookup_name('v')} sink={codec.has_sink_offset}: "
                  f"decode {r_dec:.2e}, prefill inline / decompress-once / sdpa "
                  + " / ".join(f"{r:.2e}" for r in r_pre)
                  + f"; store vs codec: codes {agree:.4%}, norms {ndiff:.1e}, flags {flags:.2%}",
                  flush=True)
    print(f"worst relative error {worst:.2e} (tolerance {a.tol}); store vs codec "
          f"{'ok' if store_ok else 'MISMATCH'} (codes >= 99.9 %, norms <= 8e-3, flags >= 98 %)")
    return 0 if worst <= a.tol and store_ok else 1


if __name__ == "__main__":
    sys.exit(main())
