# ruff: noqa: B023, F821  (lambdas are timed immediately; the inputs are deleted after timing)
"""Where a CUDA decode call's time goes: a per-CTA timeline of decode's default build.

For each shape (K4V4, Hq=32, Hkv=8, head_dim 128, block_size 16, random pages) this script

* times decode's default call (CUDA graphs, L2 flushed: ``kernels_gpu.bench``), with several
  splits also through the reduce kernel instead of the in-kernel merge
  (``cuda_decode.MERGE_SPLITS = False``), the split kernel's launch alone, and a streaming
  read of the same number of bytes (``torch.sum`` over float32: the read-only reference a
  kernel reading the cache could reach at that size), next to the copy bandwidth measured in
  the same run;
* launches the same build once more with ``PROBE=1`` (``cuda/decode_k4v4.cu``'s timeline
  probe: ``%globaltimer`` at each CTA's entry, after its prologue, after its first and ninth
  ring waits, after warp 0's loop, when every warp is done, at exit) after an L2 flush, five
  times, and prints the median run's phases: launch spread, prologue, first-page latency, the
  per-iteration time of the first 8 iterations against the rest, the loop, the warps' skew,
  the epilogue, and how the CTAs' ends spread (the tail of the wave);
* does both with the L2 emptied by writing a 256 MB buffer (do_bench's flush, the default of
  every earlier table: it leaves the L2 full of dirty lines the timed call writes back) and by
  reading it (the L2 left clean, as an engine's weight-reading GEMMs leave it).

Usage: python benchmarks/decode_timeline_gpu.py --out DIR [--tag T] [--shapes B:L ...]
       [--contexts auto short long] [--early] [--flush write read] [--runs N] [--model-step]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cuda_bench
import kernels_gpu as kg

from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader, Workspace, cuda_decode, decode
from tkv.kernels.testing import capture_cuda_decode_launch, probe_cuda_decode, tuning

SHAPES = ["32:8192", "8:8192", "8:32768", "32:32768", "1:131072", "1:32768", "128:8192",
          "256:640"]


def probe_run(launch, flush):
    """One PROBE=1 launch after an L2 flush (``kernels_gpu.flush_l2``): int64 (ctas,
    PROBE_WORDS) timestamps (ns)."""
    kg.flush_l2(flush)
    return probe_cuda_decode(launch)


def phases(p: torch.Tensor, sub: int) -> dict:
    """Phase statistics (µs) of one probe run; CTAs with no steps for warp 0 (a team's idle
    CTA, an empty split) count only for the launch spread and the span."""
    t0 = int(p[:, 0].min())
    us = (p[:, :7] - t0).double() / 1e3
    steps = (p[:, 7] >> 32).long()
    work = steps > 0
    w = us[work]
    n_it = (steps[work] + sub - 1) // sub
    med = lambda x: float(x.median()) if x.numel() else float("nan")
    late = n_it > 9
    ramp = (w[:, 3] - w[:, 2]) / 8
    steady = (w[late, 4] - w[late, 3]) / (n_it[late] - 9).double()
    ends = us[:, 6]
    we = w[:, 6]
    span = float(ends.max())
    # fraction of the span during which ≥ 95 % of the working CTAs are in their loop
    grid_t = torch.linspace(0, span, 2000, dtype=torch.float64)
    inside = ((w[:, 1:2] <= grid_t) & (grid_t <= w[:, 4:5])).double().mean(0)
    return {
        "span_us": round(span, 2),
        "entry_spread_us": round(float(us[:, 0].max()), 2),
        "prologue_us": round(med(w[:, 1] - w[:, 0]), 2),
        "first_wait_us": round(med(w[:, 2] - w[:, 1]), 2),
        "iter_first8_us": round(med(ramp[n_it > 8]), 3),
        "iter_steady_us": round(med(steady), 3),
        "loop_p50_us": round(med(w[:, 4] - w[:, 1]), 2),
        "loop_max_us": round(float((w[:, 4] - w[:, 1]).max()), 2) if w.numel() else None,
        "warp_skew_us": round(med(w[:, 5] - w[:, 4]), 2),
        "epilogue_us": round(med(w[:, 6] - w[:, 5]), 2),
        "first_end_us": round(float(we.min()), 2),
        "end_p50_us": round(med(we), 2),
        "end_p90_us": round(float(we.quantile(0.9)), 2),
        "last_end_us": round(float(we.max()), 2),
        "loop_start_p90_us": round(float(w[:, 1].quantile(0.9)), 2),
        "full_share": round(float((inside >= 0.95).double().mean()), 3),
        "ctas": int(p.shape[0]), "working_ctas": int(work.sum()),
        "sms": int(p[:, 7].bitwise_and(0xffffffff).unique().numel()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--shapes", nargs="*", default=SHAPES, help="B:L pairs")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--flush", nargs="*", default=["write", "read"], choices=["write", "read"],
                    help="how the L2 is emptied before each timed call (kernels_gpu.FLUSH)")
    ap.add_argument("--contexts", nargs="*", default=["auto"],
                    help="TKV_DECODE_CONTEXT values to probe (auto, short, long)")
    ap.add_argument("--early", action="store_true",
                    help="each context also with early=1 (the prefetched prologue)")
    ap.add_argument("--model-step", action="store_true",
                    help="then 36-layer engine-like steps: bf16, each context (and early=1)")
    args = ap.parse_args()
    hq, hkv, d, block = 32, 8, 128, 16
    variants = [(c, {}) for c in args.contexts]
    if args.early:
        variants += [(c, {"early": 1}) for c in args.contexts]
    copy_gbs = kg.copy_bandwidth()
    dev_name = torch.cuda.get_device_name()
    rows = []
    flush = torch.zeros(kg._FLUSH_BYTES, dtype=torch.int8, device=kg.DEV)
    for spec in args.shapes:
        B, L = (int(x) for x in spec.split(":"))
        ws = Workspace(B, hq, d, kg.DEV)
        bt, sl, nblk = kg.paged(B, L, block)
        q = torch.randn(B, hq, d, device=kg.DEV, dtype=torch.bfloat16)
        ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=4, device=kg.DEV), hkv, block)
        cache = kg.tkv_cache(ld, nblk)
        nbytes = int(int(sl.sum()) * ld.layout.bytes_per_token)
        x = torch.empty(nbytes // 4, dtype=torch.float32, device=kg.DEV).normal_()
        for fl in args.flush:
            kg.FLUSH = fl
            ms_read = kg.bench(lambda: x.sum())
            for ctx, tune in variants:
                with cuda_bench.context(ctx), tuning(cuda_decode, **tune):
                    call = lambda: decode(q, cache, bt, sl, ld, ws)
                    seen = capture_cuda_decode_launch(call)
                    defs, grid, largs = seen["defs"], seen["grid"], seen["args"]
                    ms = kg.bench(call)
                    ms_reduce = None
                    if grid[2] > 1:   # several splits: also through the reduce kernel
                        with mock.patch.object(cuda_decode, "MERGE_SPLITS", False):
                            ms_reduce = round(kg.bench(call), 4)
                    ms_split = kg.bench(lambda: cuda_decode._launch(defs, grid, *largs))
                    runs = [phases(probe_run(seen, flush), defs["SUB"])
                            for _ in range(args.runs)]
                runs.sort(key=lambda r: r["span_us"])
                row = {"B": B, "L": L, "context": ctx + "".join(f", {k}={v}" for k, v in
                                                                tune.items()),
                       "flush": fl, "device": dev_name,
                       "copy_GBps": round(copy_gbs), "MB": round(nbytes / 1e6, 1),
                       "ms": round(ms, 4), "frac_copy": round(nbytes / ms / 1e6 / copy_gbs, 3),
                       "ms_reduce_pass": ms_reduce,
                       "ms_split_kernel": round(ms_split, 4), "ms_read_ref": round(ms_read, 4),
                       "read_ref_frac_copy": round(nbytes / ms_read / 1e6 / copy_gbs, 3),
                       "grid": list(grid), "lut": defs["LUT"], "warps": defs["WARPS"],
                       "teams": defs["TEAMS"], "probe_spans_us": [r["span_us"] for r in runs],
                       **runs[len(runs) // 2]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del seen, largs
        kg.FLUSH = "write"
        del x
        del cache
        torch.cuda.empty_cache()
    cols = ["B", "L", "context", "flush", "MB", "ms", "frac_copy", "ms_reduce_pass",
            "ms_split_kernel",
            "read_ref_frac_copy", "span_us", "entry_spread_us", "prologue_us", "first_wait_us", "iter_first8_us",
            "iter_steady_us", "loop_p50_us", "loop_max_us", "warp_skew_us", "epilogue_us",
            "first_end_us", "end_p50_us", "last_end_us", "full_share"]
    lines = [f"decode timeline ({dev_name}, copy {copy_gbs:.0f} GB/s; K4V4 Hq 32 Hkv 8 D 128; "
             "µs from the first CTA's entry, medians over CTAs of the median-span probe run)",
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c)) for c in cols) + " |" for r in rows]
    steps = []
    if args.model_step:
        cuda_bench.ROWS.clear()
        arms = [("bf16 store + bypass decode", "bf16", None)]
        for ctx, tune in variants:
            label = f"tkv K4V4 default, TKV_DECODE_CONTEXT={ctx}" + "".join(
                f", {k}={v}" for k, v in tune.items())
            arms.append((label, {}, lambda c=ctx, t=tune: cuda_bench.both(
                cuda_bench.context(c), tuning(cuda_decode, **t))))
        cuda_bench.model_step_rows(((32, 8192), (8, 8192), (64, 2048), (256, 640)), arms)
        steps = cuda_bench.model_step_lines()
        rows += cuda_bench.ROWS
    lines += steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode_timeline_gpu" + (f"_{args.tag}" if args.tag else "")
    (out / f"{stem}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
