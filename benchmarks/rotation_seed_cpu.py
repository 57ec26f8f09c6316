"""Rotation-seed study (CPU): how much of a budget's measured drift is the luck of the random
Walsh–Hadamard signs?

The codec's rotation is ``R = H · diag(s)`` with seeded random signs ``s`` (``tkv.codec.rotation``);
every other part of a bundle row — channel scales, key offset μ, sink offsets, per-layer widths —
is in model space and does not depend on the seed. This study serves one bundle row with the
rotation seed replaced (seed 0 is the one the bundle was fitted under; its per-layer codebooks,
fitted on seed-0 rotated coordinates, are kept for every seed — they are within 0.7 % of the
Gaussian codebook in held-out MSE, so the other seeds are at most slightly disadvantaged) and
measures, on the same held-out tokens:

* the spread over seeds of the mean KL and of ΔPPL (min, max, standard deviation);
* the window-sampling standard error of ΔPPL within one seed (standard deviation over windows
  of the per-window ΔPPL ÷ √windows; tokens of a window are correlated, windows much less).

Both say how far apart two honest measurements of "the same" format can land — the yardstick for
reading a ΔPPL goal a few tenths of a point away. Baseline named in every ratio: seed 0 (the
bundle's).

Held-out: windows 6.. of 1,024 tokens of WikiText-2 *valid* (never the test split). Run from the
repository root::

    uv run --frozen python benchmarks/rotation_seed_cpu.py --bundle tkv-calibration/tkv_bundle.json \\
        --budgets 4.0,3.0 --windows 8 --seeds 8
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path

import torch

from tkv.calibrate.evaluate import evaluate_arms
from tkv.calibrate.pipeline import tkv_arm
from tkv.codec import CalibrationBundle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import finish, held_out_windows, parse_and_load


def seed_arms(bundle: CalibrationBundle, budget: str, seeds: int) -> list:
    """One evaluation arm per rotation seed ``0 .. seeds - 1`` of ``bundle``'s row ``budget``."""
    alloc = bundle.allocation(budget)
    return [tkv_arm(dataclasses.replace(bundle, seed=s), alloc, f"seed {s}", "tkv")
            for s in range(seeds)]


def per_window(model, held: torch.Tensor, arms: list, budget: str):
    """Per arm, per window: ``(mean KL, ΔPPL %)`` of each window alone, and per arm the pooled
    ``(mean KL, ΔPPL %, top-1)`` over all windows (token-weighted, as the report computes)."""
    rows = {a.name: [] for a in arms}
    pooled = None
    for i in range(held.shape[0]):
        res = evaluate_arms(model, held[i:i + 1], arms, decode=False, show_progress=True,
                            desc=f"TKV@{budget} window {i + 1}/{held.shape[0]}")
        for r in res.arms:
            rows[r.name].append((r.tf.mean_kl, 100 * (r.tf.ppl / res.base.ppl - 1)))
        if pooled is None:
            pooled = (res.base, {r.name: r.tf for r in res.arms})
        else:
            pooled[0].add(res.base)
            for r in res.arms:
                pooled[1][r.name].add(r.tf)
    base, tallies = pooled
    total = {n: (t.mean_kl, 100 * (t.ppl / base.ppl - 1), 100 * t.top1_agree)
             for n, t in tallies.items()}
    return rows, total


def spread(xs: list[float]) -> tuple[float, float, float, float]:
    """``(mean, standard deviation, min, max)`` of ``xs``."""
    return statistics.fmean(xs), statistics.stdev(xs), min(xs), max(xs)


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(
        __doc__, "tkv-calibration/tkv_bundle.json", 8, "benchmarks/results/rotation_seed_cpu.md",
        extra=lambda ap: ap.add_argument("--seeds", type=int, default=8))
    held = held_out_windows(lm.tokenizer, a.windows)
    lines = [f"# Rotation-seed study — SmolLM2-135M-Instruct, bundle `{a.bundle}` "
             f"(fitted under seed {bundle.seed})", "",
             f"Held-out: {a.windows} windows × 1,024 tokens of WikiText-2 *valid* (windows 6..; never "
             "the test split). Teacher-forced, every attention reads the quantize-dequantized "
             "cache. Each arm is the bundle's row with only the rotation seed replaced. Baseline "
             f"named in every ratio: seed {bundle.seed}.", "",
             "| budget | seed | mean KL | KL ÷ seed 0 | ΔPPL | top-1 | window SE of ΔPPL |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    summary = ["", "| budget | KL mean ± sd over seeds (min-max) | ΔPPL mean ± sd over seeds "
               "(min-max) | ΔPPL window SE (mean over seeds) |", "|---|---|---|---|"]
    for b in a.budgets.split(","):
        arms = seed_arms(bundle, b, a.seeds)
        rows, total = per_window(lm.model, held, arms, b)
        kl0 = total[arms[0].name][0]
        ses = []
        for arm in arms:
            kl, dppl, top1 = total[arm.name]
            se = statistics.stdev([w[1] for w in rows[arm.name]]) / math.sqrt(a.windows)
            ses.append(se)
            lines.append(f"| {b} | {arm.name.split()[-1]} | {kl:.4f} | {kl / kl0:.3f} | "
                         f"{dppl:+.2f} % | {top1:.1f} % | {se:.2f} points |")
        km, ksd, klo, khi = spread([total[x.name][0] for x in arms])
        pm, psd, plo, phi = spread([total[x.name][1] for x in arms])
        summary.append(f"| {b} | {km:.4f} ± {ksd:.4f} ({klo:.4f}-{khi:.4f}; sd {100 * ksd / km:.1f} %) "
                       f"| {pm:+.2f} ± {psd:.2f} % ({plo:+.2f} to {phi:+.2f}) "
                       f"| {statistics.fmean(ses):.2f} points |")
    finish(lines + summary, t0, a.out, READING)


READING = ("Reading (2026-12-05): the mean KL is a property of the format — over 8 rotation "
           "seeds it moves by sd 1.5 % at 4.0 and 1.9 % at 3.0 — but ΔPPL is not: sd 0.29 points"
           " at 4.0 (+1.11 to +1.99 %) and 0.46 at 3.0 (+5.20 to +6.45 %), the size of its own "
           "window-sampling standard error (0.27 / 0.51 points on these 8 windows; about 0.19 / "
           "0.36 on the 16 the issue's goals use, if windows are independent). The 4.0 ΔPPL goal"
           " (≤ +1.08 %) is missed on the test split by 0.32 points with 16 windows (+1.40 %) "
           "and by 0.52 with the default job's 8 (+1.60 %): one to two seed standard deviations,"
           " so another seed could land on either side of it. Choosing the seed by its ΔPPL "
           "would tune to noise, and choosing it by KL gains at most 2 %: seed 0 keeps shipping,"
           " and the report's KL (primary metric) is the number to compare formats by.")


if __name__ == "__main__":
    main()
