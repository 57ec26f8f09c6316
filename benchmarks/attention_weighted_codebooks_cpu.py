"""Attention-weighted codebooks (CPU study): fit each layer's Lloyd-Max codebooks with every
(token, KV head) weighted by how much attention it receives, instead of uniformly.

Why: a quantization error on token ``i`` moves an attention output by about ``p_i`` times it
(``δo = Σ_i p_i e_i`` for values, ``Σ_i p_i δs_i (v_i − o)`` for keys), so the expected output
error weighs each token's distortion by ``Σ_q p_i²`` over the queries — while a plain fit
weighs all tokens alike. The symmetric-fit study (``symmetric_codebooks_cpu.md``) found the
drift set by a few coordinates of a few tokens rather than the average distortion.

Weights ``w = (1 − α) / N + α · m / Σ m`` with ``m`` = Σ over the collection's strided query
sample (the GQA group's query heads, causal, within each calibration window) of ``p²``; α = 1
is pure attention weighting, α = 0 the shipped fit. Fitted on the bundle's calibration windows
(8 × 512 tokens of WikiText-2 *valid*, the bundle's channel scales and key offsets);
evaluated teacher-forced on held-out *valid* windows (window 6 on, 1,024 tokens; never the
test split) at the bundle's rows, every other part of the codec unchanged. Run from the
repository root::

    uv run --frozen python benchmarks/attention_weighted_codebooks_cpu.py --budgets 4.0,3.0
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch

from tkv.calibrate.collect import collect_kv
from tkv.calibrate.data import default_calib_text, tokenize_windows
from tkv.calibrate.fitting import standardized_coords
from tkv.calibrate.pipeline import tkv_arm
from tkv.codec import CalibrationBundle, Codebook, HadamardRotation, gaussian_codebook
from tkv.codec.codebooks import _lloyd_weighted

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import TABLE_HEAD, arm_rows, finish, held_out_windows, parse_and_load

FIT_T, FIT_N = 512, 8   # the bundle's calibration windows (tokens, count)
CAP = 1 << 16           # coordinate samples per fit (as the calibration)


def attention_mass(k: torch.Tensor, q: torch.Tensor, window: int, q_step: int) -> torch.Tensor:
    """``Σ p²`` received by each (token, KV head): float64 ``(tokens, num_kv_heads)`` from keys
    ``k`` ``(tokens, Hkv, d)`` and the strided query sample ``q`` ``(q_tokens, H, d)`` (query
    ``j`` of window ``w`` sits at position ``j * q_step`` of that window), causal softmax
    within each window, scaled by ``1/sqrt(d)``."""
    n, hkv, d = k.shape
    h = q.shape[1]
    g = h // hkv
    per_win = window // q_step
    out = torch.zeros(n, hkv, dtype=torch.float64)
    for w in range(n // window):
        kw = k[w * window:(w + 1) * window].double()                 # (T, Hkv, d)
        qw = q[w * per_win:(w + 1) * per_win].double()               # (Tq, H, d)
        pos = torch.arange(per_win) * q_step
        s = torch.einsum("qhd,tkd->hqt", qw, kw.repeat_interleave(g, 1)) / math.sqrt(d)
        mask = torch.arange(window)[None, :] > pos[:, None]
        p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)   # (H, Tq, T)
        out[w * window:(w + 1) * window] = (p ** 2).sum(1).view(hkv, g, window).sum(1).T
    return out


def weighted_fit(z: torch.Tensor, w: torch.Tensor, bits: int, g: torch.Generator) -> Codebook:
    """Weighted Lloyd-Max on coordinates ``z`` ``(tokens, heads, d)`` with per-(token, head)
    weights ``w`` (repeated over the ``d`` coordinates), ``CAP`` samples drawn uniformly."""
    x = z.reshape(-1).double()
    ww = w[..., None].expand_as(z).reshape(-1).double()
    idx = torch.randperm(x.numel(), generator=g)[:CAP]
    x, ww = x[idx], ww[idx]
    order = torch.argsort(x)
    return _lloyd_weighted(x[order], ww[order], bits, 60,
                           init=gaussian_codebook(bits).centroids.double(), tol=1e-9)


def reweighted_bundle(bundle: CalibrationBundle, col, alpha: float, widths) -> CalibrationBundle:
    """``bundle`` with the K and V codebooks of ``widths`` refit with attention weights."""
    geo = bundle.geometry
    rot = HadamardRotation(geo.head_dim, bundle.seed)   # the codec's rotation (every layer)
    g = torch.Generator().manual_seed(0)
    layers = []
    for lc, s in zip(bundle.layers, col.layers, strict=True):
        m = attention_mass(s.k, s.q, FIT_T, FIT_T // (s.q.shape[0] // FIT_N))
        w = (1 - alpha) / m.numel() + alpha * m / m.sum()
        mu = lc.k_offset_tensor(geo.head_dim)
        kx = s.k if mu is None else s.k - mu
        books = dict(lc.codebooks)
        for side, x, sc in (("k", kx, lc.k_channel_scales), ("v", s.v, lc.v_channel_scales)):
            z = standardized_coords(x, None if sc is None else torch.tensor(sc), rot)
            for b in widths:
                books[f"{side}_bits_{b}"] = weighted_fit(z, w, b, g)
        layers.append(dataclasses.replace(lc, codebooks=books))
    return dataclasses.replace(bundle, layers=tuple(layers))


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(
        __doc__, "benchmarks/results/calibrate_smollm2_sink_offset_2026-11-30/tkv_bundle.json",
        2, "benchmarks/results/attention_weighted_codebooks_cpu.md")
    fit = tokenize_windows(lm.tokenizer, default_calib_text(), FIT_T, FIT_N).subset(0, FIT_N)
    col = collect_kv(lm.model, fit, show_progress=False)
    held = held_out_windows(lm.tokenizer, a.windows)
    lines = ["# Attention-weighted codebooks — SmolLM2-135M-Instruct, bundle "
             f"`{Path(a.bundle).parent.name}/{Path(a.bundle).name}`", "",
             f"Fitted on {FIT_N} × {FIT_T} tokens of WikiText-2 *valid* (the bundle's calibration "
             f"windows); held-out: {a.windows} windows × 1,024 tokens of *valid* (windows 6..; "
             "never the test split). Teacher-forced, every attention reads the "
             "quantize-dequantized cache. Baseline named in every ratio: the bundle's row "
             "(codebooks fitted unweighted).", "", *TABLE_HEAD]
    for budget in a.budgets.split(","):
        alloc = bundle.allocation(budget)
        widths = sorted(set(alloc.k_bits) | set(alloc.v_bits))
        arms = [tkv_arm(bundle, alloc, f"TKV@{budget} (bundle)", "tkv")]
        for alpha in (0.5, 1.0):
            rb = reweighted_bundle(bundle, col, alpha, widths)
            arms.append(tkv_arm(rb, alloc, f"attention-weighted fits, α = {alpha}", "tkv"))
        lines += arm_rows(lm.model, held, arms, budget)
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
