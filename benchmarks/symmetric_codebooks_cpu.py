"""Symmetric fitted codebooks (CPU study): how much of the fitted Lloyd-Max codebooks' gain
over the Gaussian default survives the constraint ``c[n − 1 − i] = −c[i]``?

Why: a symmetric codebook lets a 2^b-entry lookup fold the code to a 2^(b−1)-entry magnitude
index plus a sign (``docs/kernels.md``, session 13): 5-bit sides could then use the 16-entry
byte-permute lookup instead of a gather. The Gaussian codebooks are symmetric; the fitted ones
are not (up to 7 % of the largest centroid at 5 bits in the committed SmolLM2 bundle).

Same data path as the calibration (``tkv.calibrate.calibrate.calibrate_model``): K/V collected
over the calibration windows of WikiText-2 *valid* (never the test split), per-layer channel
scales and key centering chosen the same way, standardized rotated coordinates, the last 25 %
of the tokens held out. Per layer, side and width: the held-out MSE of the Gaussian codebook,
of the unconstrained fit (what bundles ship) and of a symmetric fit
(``tkv.codec.fit_codebook(symmetric=True)``: Lloyd-Max on ``|x|`` for the positive half,
mirrored — the optimum for the sample and its mirror image). Run from the repository root::

    uv run --frozen python benchmarks/symmetric_codebooks_cpu.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from tkv.calibrate.collect import collect_kv
from tkv.calibrate.data import default_calib_text, tokenize_windows
from tkv.calibrate.fitting import standardized_coords
from tkv.calibrate.model import load_model
from tkv.calibrate.scales import choose_scales
from tkv.codec import HadamardRotation, fit_codebook, gaussian_codebook

WIDTHS = tuple(range(2, 9))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8, help="calibration windows of 512 tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/symmetric_codebooks_cpu.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lm = load_model(None)
    windows = tokenize_windows(lm.tokenizer, default_calib_text(), 512, a.windows)
    col = collect_kv(lm.model, windows.subset(0, a.windows), show_progress=False)
    geo = lm.geometry
    rot = HadamardRotation(geo.head_dim, 0)
    ntok = col.layers[0].k.shape[0]
    n_held = max(1, round(ntok * 0.25))
    train, held = slice(0, ntok - n_held), slice(ntok - n_held, ntok)
    g = torch.Generator().manual_seed(0)
    cap = 1 << 16
    # width → side → list over layers of (gaussian, fitted, symmetric) held-out MSE
    rows: dict[int, dict[str, list[tuple[float, float, float]]]] = {
        b: {"k": [], "v": []} for b in WIDTHS}
    for s in col.layers:
        sc = choose_scales(s, train, held, 0, center_keys="per-head")
        kx = s.k if sc.k_offset is None else s.k - sc.k_offset
        for side, x, sv in (("k", kx, sc.k_scales), ("v", s.v, sc.v_scales)):
            z = standardized_coords(x, sv, rot)
            tr, he = z[train].reshape(-1), z[held].reshape(-1)
            tr = tr[torch.randperm(tr.numel(), generator=g)[:cap]]
            he = he[torch.randperm(he.numel(), generator=g)[:cap]]
            for b in WIDTHS:
                fit = fit_codebook(tr, b, iters=60, generator=g)
                sym = fit_codebook(tr, b, iters=60, generator=g, symmetric=True)
                rows[b][side].append((gaussian_codebook(b).distortion(he), fit.distortion(he),
                                      sym.distortion(he)))
    lines = ["# Symmetric fitted codebooks — SmolLM2-135M-Instruct (held-out MSE)", "",
             f"Calibration text: {a.windows} × 512 tokens of WikiText-2 *valid* (the "
             "calibration's default windows), last 25 % of the tokens held out; never the test "
             f"split. {geo.num_layers} layers × K and V; MSE per coordinate in standardized "
             "units, mean over layers. Baseline named in every ratio: the Gaussian codebook "
             "(TurboQuant's default).", "",
             "| width | side | Gaussian MSE | fitted ÷ Gaussian | symmetric fit ÷ Gaussian | "
             "gain kept by the symmetric fit | layers where symmetric ≤ fitted |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for b in WIDTHS:
        for side in ("k", "v"):
            r = torch.tensor(rows[b][side], dtype=torch.float64)
            gm, fm, sm = r.mean(0).tolist()
            gain_fit, gain_sym = gm - fm, gm - sm
            kept = f"{gain_sym / gain_fit:.0%}" if gain_fit > 0 else "-"
            better = int((r[:, 2] <= r[:, 1]).sum())
            lines.append(f"| {b} | {side.upper()} | {gm:.3e} | {fm / gm:.4f} | {sm / gm:.4f} | "
                         f"{kept} | {better}/{r.shape[0]} |")
    lines += ["", f"Command: `python benchmarks/symmetric_codebooks_cpu.py --windows {a.windows}`;"
              f" wall time {time.perf_counter() - t0:.0f} s (2-core CPU)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
