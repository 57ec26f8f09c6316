# ruff: noqa: B023, F821  (lambdas are timed immediately; the cache is deleted after timing)
"""decode(kernel="cuda") (the hand-written CUDA split kernel) against the default Triton split
kernel on one GPU: one table, ratios to the Triton default in the same run, the copy bandwidth
measured in the same run.

* kernel rows: K4V4, Qwen3-8B-like attention (Hq=32, Hkv=8, head_dim 128, block_size 16) at
  the issue's decode shapes, plus head_dim 64 / 256 and SmolLM2's geometry; each CUDA variant
  (``cuda_decode.TUNING``: 16-token steps per iteration ``sub``, ring ``stages``, register
  budget ``min_ctas``; split count; ``lut`` / ``warps``; the balanced schedule) next to the
  Triton default on the same cache and query, with the configuration's CTAs per SM (the
  driver's occupancy) and the grid's waves. Skewed batches (``L=(long, short)``): one long
  sequence among short ones.
  Timed calls are whole ``decode`` calls (query rotation and, with several splits, the reduce
  pass included), from CUDA graphs with the L2 flushed (kernels_gpu.bench).
* ``--model-step``: kernels_gpu's 36-layer engine-like step, bf16 vs Triton default vs CUDA.

Usage: python benchmarks/cuda_decode_gpu.py --out DIR [--tag T] [--quick] [--model-step]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cuda_bench
import kernels_gpu as kg
from cuda_bench import ROWS, context, log, model_step_lines, write_results

from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader, Workspace, cuda_decode, decode
from tkv.kernels.testing import tuning

VARIANTS = [("cuda (decode's default, kernel='auto')", {}, {"kernel": None}),
            ("cuda 1 split", {}, {"num_splits": 1}), ("cuda 2 splits", {}, {"num_splits": 2}),
            # session 35: the codes dequantized through a shared 256-entry pair table; session
            # 36: its split counts (the tables' shared memory leaves 3 CTAs per SM at 4 warps,
            # 2 at 8, so the default split count's 512 CTAs at B=32 leave a partial wave)
            ("cuda lut=1 (shared pair tables)", {"lut": 1}, {}),
            ("cuda lut=1, 1 split", {"lut": 1}, {"num_splits": 1}),
            ("cuda lut=1, 4 splits", {"lut": 1}, {"num_splits": 4}),
            ("cuda lut=1 warps=8", {"lut": 1, "warps": 8}, {}),
            ("cuda lut=1 warps=8, 1 split", {"lut": 1, "warps": 8}, {"num_splits": 1}),
            # session 36: the balanced (stream-K) schedule, one wave of resident CTAs
            ("cuda balanced", {}, {"schedule": "balanced"}),
            ("cuda lut=1 balanced", {"lut": 1}, {"schedule": "balanced"}),
            ("cuda lut=1 warps=8 balanced", {"lut": 1, "warps": 8}, {"schedule": "balanced"}),
            # earlier sessions' tuning rows (--quick --all-variants)
            ("cuda 4 splits", {}, {"num_splits": 4}),
            ("cuda sub=1 stages=3", {"sub": 1, "stages": 3}, {}),
            ("cuda lut=1 sub=1 stages=3", {"lut": 1, "sub": 1, "stages": 3}, {}),
            ("cuda lut=1 warps=8, 4 splits", {"lut": 1, "warps": 8}, {"num_splits": 4}),
            ("cuda lut=1 warps=8 sub=1 stages=3", {"lut": 1, "warps": 8, "sub": 1, "stages": 3},
             {})]
# the tuning rows on TKV_DECODE_CONTEXT=short: their keywords are the whole tuning (the default
# profile, auto, would add its own); the first row is decode's default as shipped
VARIANTS = VARIANTS[:1] + [(lab, tune, {"_context": "short", **o}) for lab, tune, o in VARIANTS[1:]]
N_MAIN = 11   # --quick runs VARIANTS[:N_MAIN] unless --all-variants
# the full grid: the default, its split neighbours and the balanced schedule
FULL = [v for v in VARIANTS if v[0] in ("cuda (decode's default, kernel='auto')", "cuda 1 split",
                                        "cuda 2 splits", "cuda balanced",
                                        "cuda lut=1 balanced")]


def kernel_rows(shapes, copy_gbs, variants, sink=False):
    """``sink``: codecs with key centering and random K / V sink offsets; the random cache's
    norms then flag about half of the tokens (the sign bit), as a calibrated bundle's would
    some."""
    for (B, L, hq, hkv, d) in shapes:
        block = 16
        ws = Workspace(max(B, 1), hq, d, kg.DEV)
        skew = isinstance(L, tuple)   # (long, short): one long sequence, the rest short
        bt, sl, nblk = kg.paged(B, L[0] if skew else L, block)
        if skew:
            sl.fill_(L[1])
            sl[B // 2] = L[0]
        q = torch.randn(B, hq, d, device=kg.DEV, dtype=torch.bfloat16)
        offsets = {"k_channel_offset": torch.randn(d), "k_sink_offset": 4 * torch.randn(d),
                   "v_sink_offset": 4 * torch.randn(d)} if sink else {}
        ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=4, device=kg.DEV, **offsets), hkv, block)
        cache = kg.tkv_cache(ld, nblk)
        if sink:   # flag every other token of every head (sign bit of the norm)
            for name in ("k_norms", "v_norms"):
                nv = ld.layout.views(cache)[name]
                nv[..., ::2] = -nv[..., ::2]
        nbytes = int(sl.sum()) * ld.layout.bytes_per_token
        base = dict(B=B, L=L, Hq=hq, Hkv=hkv, D=d)
        if sink:
            base["sink"] = True
        ref = decode(q, cache, bt, sl, ld, ws, kernel="triton").float()
        tri = kg.bench(lambda: decode(q, cache, bt, sl, ld, ws, kernel="triton"))
        log({**base, "impl": "triton (the default until session 32)", "ms": tri,
             "frac_copy": nbytes / tri / 1e6 / copy_gbs})
        for label, tune, opts in variants:
            try:
                opts = {"kernel": "cuda", **opts}
                ctx = opts.pop("_context", cuda_decode.DECODE_CONTEXT)
                with tuning(cuda_decode, **tune), context(ctx):
                    out = decode(q, cache, bt, sl, ld, ws, **opts).float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    ms = kg.bench(lambda: decode(q, cache, bt, sl, ld, ws, **opts))
                    bal = opts.get("schedule") == "balanced"
                    defs = cuda_decode.defines(ld, d, hq // hkv, q.dtype, torch.bfloat16,
                                               qrot=True, epilogue=2 if bal else 0,
                                               balanced=bal, **cuda_decode.launch_tuning(d))
                    occ = cuda_decode.ctas_per_sm(defs, q.device)
                    splits = opts.get("num_splits") or ws.cuda_splits_for(
                        B, hkv,
                        cuda_decode.resident_ctas(ld, d, hq // hkv, torch.bfloat16, q.device))
            except Exception as e:
                log({**base, "impl": label, "error": str(e)[:200]})
                continue
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            if opts.get("schedule") == "balanced":   # one CTA per resident slot
                splits = occ * sms / (B * hkv)
            log({**base, "impl": label, "ms": ms, "frac_copy": nbytes / ms / 1e6 / copy_gbs,
                 "x_triton": round(tri / ms, 3), "rel_err_vs_triton": float(f"{err:.2e}"),
                 "ctas_per_sm": occ, "ctas": round(B * hkv * splits),
                 "waves": round(B * hkv * splits / (occ * sms), 2)})
        del cache
        torch.cuda.empty_cache()


def model_step_rows(shapes, layers=36):
    arms = [("bf16 store + bypass decode", "bf16", None),
            ("tkv K4V4 triton (the default until session 32)", {"kernel": "triton"}, None),
            ("tkv K4V4 default (kernel='auto': cuda)", {}, None),
            ("tkv K4V4 cuda lut=1 (shared pair tables)", {},
             lambda: cuda_bench.both(context("short"), tuning(cuda_decode, lut=1))),
            ("tkv K4V4 cuda lut=1 warps=8", {},
             lambda: cuda_bench.both(context("short"), tuning(cuda_decode, lut=1, warps=8))),
            ("tkv K4V4 cuda balanced", {"schedule": "balanced"}, lambda: context("short")),
            ("tkv K4V4 cuda lut=1 balanced", {"schedule": "balanced"},
             lambda: cuda_bench.both(context("short"), tuning(cuda_decode, lut=1)))]
    cuda_bench.model_step_rows(shapes, arms, layers)


def context_rows(copy_gbs) -> None:
    """``--context``: decode's default (kernel, tuning, split count all chosen by decode) under
    ``TKV_DECODE_CONTEXT=auto`` (the default), ``short`` and ``long`` side by side at the
    issue's long shapes, short ones, head_dim 64 / 256 and a skewed batch, then the 36-layer
    step at 8K / 2K / 640 tokens."""
    shapes = [(8, 8192, 32, 8, 128), (8, 32768, 32, 8, 128), (32, 8192, 32, 8, 128),
              (32, 32768, 32, 8, 128), (128, 8192, 32, 8, 128), (1, 32768, 32, 8, 128),
              (1, 131072, 32, 8, 128), (32, 8192, 32, 8, 64), (32, 8192, 32, 8, 256),
              (256, 640, 32, 8, 128), (64, (32768, 1024), 32, 8, 128)]
    variants = [(f"default, TKV_DECODE_CONTEXT={c}", {}, {"kernel": None, "_context": c})
                for c in ("auto", "short", "long")]
    kernel_rows(shapes, copy_gbs, variants)
    arms = [("bf16 store + bypass decode", "bf16", None)]
    arms += [(f"tkv K4V4 default, TKV_DECODE_CONTEXT={c}", {}, lambda c=c: context(c))
             for c in ("auto", "short", "long")]
    cuda_bench.model_step_rows(((32, 8192), (64, 2048), (64, 640), (256, 640)), arms)


def teams_rows(copy_gbs) -> None:
    """``--teams``: decode's default under ``TKV_DECODE_CONTEXT=short`` and ``long``, with the
    prologue orders ``early=0`` (the query loaded, rotated and packed, the pair tables filled,
    then the first pages copied) and ``early=1`` (the first pages' copies issued first), and
    the long build with two teams of 4 warps for short splits (``team_steps``), at long and
    short shapes and a length sweep at B=32; then 36-layer steps."""
    shapes = [(32, 8192, 32, 8, 128), (32, 32768, 32, 8, 128), (128, 8192, 32, 8, 128),
              (8, 32768, 32, 8, 128), (256, 640, 32, 8, 128), (64, 640, 32, 8, 128),
              (64, 2048, 32, 8, 128), (128, 2048, 32, 8, 128), (32, 2048, 32, 8, 128),
              (32, 4096, 32, 8, 128), (32, 16384, 32, 8, 128), (32, 8192, 32, 8, 64),
              (256, 640, 9, 3, 64), (128, (32768, 640), 32, 8, 128)]
    variants = [(f"default, TKV_DECODE_CONTEXT={c}, early={e}", {"early": e} if e else {},
                 {"kernel": None, "_context": c}) for c in ("short", "long") for e in (0, 1)]
    variants += [(f"long, early={e}, team_steps={t}", {"early": e, "team_steps": t},
                  {"kernel": None, "_context": "long"}) for e in (0, 1) for t in (32, 64, 128)]
    kernel_rows(shapes, copy_gbs, variants)
    arms = [("bf16 store + bypass decode", "bf16", None)]
    for c in ("short", "long"):
        arms.append((f"tkv K4V4 default, TKV_DECODE_CONTEXT={c}", {}, lambda c=c: context(c)))
        arms.append((f"tkv K4V4 default, TKV_DECODE_CONTEXT={c}, early=1", {},
                     lambda c=c: cuda_bench.both(context(c), tuning(cuda_decode, early=1))))
    for t in (64, 128):
        arms.append((f"tkv K4V4 long, early=1, team_steps={t}", {},
                     lambda t=t: cuda_bench.both(context("long"),
                                       tuning(cuda_decode, early=1, team_steps=t))))
    cuda_bench.model_step_rows(((32, 8192), (64, 2048), (64, 640), (256, 640)), arms)


def table(copy_gbs) -> str:
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}. Copy bandwidth "
             f"measured in this run: **{copy_gbs:.0f} GB/s**. Baseline: the Triton split kernel "
             "(decode's default until session 32) on the same cache; x_triton > 1 = the CUDA "
             "kernel is faster.",
             "", "| shape | impl | ms | % copy BW | x_triton | rel. err. vs Triton | CTAs/SM | "
             "waves |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in ROWS:
        if r.get("kernel") in ("model_step", "copy"):
            continue
        L = r["L"] if not isinstance(r["L"], list) else f"1×{r['L'][0]} + {r['B'] - 1}×{r['L'][1]}"
        shape = f"B={r['B']}, L={L}, Hq={r['Hq']}, Hkv={r['Hkv']}, D={r['D']}"
        if r.get("sink"):
            shape += ", sink offsets"
        if "error" in r:
            lines.append(f"| {shape} | {r['impl']} | error: {r['error'][:80]} | | | | | |")
            continue
        lines.append(f"| {shape} | {r['impl']} | {r['ms']:.4f} | {100 * r['frac_copy']:.0f}% | "
                     f"{r.get('x_triton', '')} | {r.get('rel_err_vs_triton', '')} | "
                     f"{r.get('ctas_per_sm', '')} | {r.get('waves', '')} |")
    lines += model_step_lines()
    return "\n".join(lines) + "\n"


def main():
    ap = cuda_bench.parser("B=32 L=8K and B=1 L=32K only")
    ap.add_argument("--sink", action="store_true",
                    help="only K4V4 with key centering and sink offsets (B=32 L=8K, 256 × 640)")
    ap.add_argument("--context", action="store_true",
                    help="only decode's default under TKV_DECODE_CONTEXT=auto, short and long, "
                         "with 36-layer steps")
    ap.add_argument("--teams", action="store_true",
                    help="only decode's default, short and long, with early=0 and 1 (the "
                         "prologue order) and the long build's teams, with 36-layer steps")
    ap.add_argument("--all-variants", action="store_true",
                    help="with --quick: every tuning row, not only the first N_MAIN")
    a = ap.parse_args()
    copy_gbs = cuda_bench.start()
    shapes = [(b, l, 32, 8, 128) for b in (1, 8, 32, 128) for l in (1024, 8192, 32768)]
    shapes += [(1, 131072, 32, 8, 128), (32, 8192, 32, 8, 64), (32, 8192, 32, 8, 256),
               (256, 640, 9, 3, 64), (64, 640, 32, 8, 128), (256, 640, 32, 8, 128),
               (64, (32768, 1024), 32, 8, 128), (128, (32768, 640), 32, 8, 128)]
    if a.quick:
        shapes = [(32, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (256, 640, 32, 8, 128),
                  (64, (32768, 1024), 32, 8, 128)]
    if a.context:
        context_rows(copy_gbs)
    elif a.teams:
        teams_rows(copy_gbs)
    elif a.sink:
        kernel_rows([(32, 8192, 32, 8, 128), (256, 640, 32, 8, 128)], copy_gbs, VARIANTS[:1],
                    sink=True)
    else:   # the full grid: FULL; --quick: tuning variants too
        variants = FULL if not a.quick else VARIANTS if a.all_variants else VARIANTS[:N_MAIN]
        kernel_rows(shapes, copy_gbs, variants)
    if a.model_step:
        model_step_rows(((64, 640), (256, 640)))
    write_results(a.out, "cuda_decode_gpu", a.tag, table(copy_gbs))


if __name__ == "__main__":
    sys.exit(main())
