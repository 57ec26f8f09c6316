"""Offset-fit study (CPU): fit the codec's two key offsets (and the value sink offset) by
(weighted) 2-means instead of "key mean + mean key at position 0".

Since session 8 every vector is coded relative to one of two offsets per layer and KV head —
the key mean μ (values: 0) or the sink offset σ (the mean K/V the model produces at position
0) — whichever reconstructs it better; the choice rides in the sign bit of the bf16 norm (no
bytes; ``sink_offset_cpu.md``). The codec's error is proportional to ``‖(x − c)/s‖²`` for the
chosen offset ``c``, so the pair of offsets that minimizes the error is a 2-means clustering of
the scaled vectors under that nearest-offset rule. What matters for attention is not every
token alike, though: a key's error moves the softmax in proportion to the attention its key
receives (Σᵢ pᵢⱼ), a value's error the output in proportion to Σᵢ pᵢⱼ². Arms, each fitted on
the calibration windows (WikiText-2 *valid* windows 0-5), all served by today's kernels (only
the bundle's offsets change):

* the bundle's row (baseline: μ, σ as calibrated);
* unweighted 2-means from (μ, σ) (K: both offsets move; V: the first offset stays 0, the
  codec has no value centering);
* 2-means weighted by attention received (K: Σᵢ pᵢⱼ, V: Σᵢ pᵢⱼ²), summed over the query heads
  of each KV head's GQA group;
* the same with the weights' square root (between the two).

Held-out text: windows 6.. of 1,024 tokens of WikiText-2 *valid* (never the test split).
Run from the repository root::

    uv run --frozen python benchmarks/offset_fit_cpu.py --bundle tkv-calibration/tkv_bundle.json
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from tkv.calibrate.collect import collect_kv
from tkv.calibrate.pipeline import tkv_arm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import (
    HELD_OUT_FIRST,
    TABLE_HEAD,
    arm_rows,
    finish,
    fit_windows,
    held_out_windows,
    parse_and_load,
)

ITERS = 15


def attention_received(q: torch.Tensor, k: torch.Tensor, windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key token and KV head: Σᵢ pᵢⱼ and Σᵢ pᵢⱼ² over the causal softmax of every query
    row and every query head of the key's GQA group. q float ``(T, Hq, d)``, k ``(T, Hkv, d)``
    with ``T = windows · window``; returns two float ``(T, Hkv)``."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    w = t // windows
    s1, s2 = torch.zeros(t, hkv), torch.zeros(t, hkv)
    mask = torch.ones(w, w, dtype=torch.bool).tril()
    for n in range(windows):
        qs = q[n * w:(n + 1) * w].transpose(0, 1)                               # (Hq, w, d)
        ks = k[n * w:(n + 1) * w].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        p = ((qs @ ks.transpose(1, 2)) / d ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        s1[n * w:(n + 1) * w] = p.sum(1).reshape(hkv, hq // hkv, w).sum(1).T
        s2[n * w:(n + 1) * w] = (p ** 2).sum(1).reshape(hkv, hq // hkv, w).sum(1).T
    return s1, s2


def two_means(x: torch.Tensor, c: torch.Tensor, w: torch.Tensor, pin_first: bool) -> torch.Tensor:
    """Weighted 2-means of rows ``x`` (N, d) with weights ``w`` (N,) from centers ``c`` (2, d);
    ``pin_first`` keeps center 0 fixed. Returns the centers (2, d)."""
    c = c.clone()
    for _ in range(ITERS):
        a = torch.cdist(x, c).argmin(1)
        for j in range(2):
            if j == 0 and pin_first:
                continue
            m = a == j
            if m.any() and w[m].sum() > 0:
                c[j] = (w[m, None] * x[m]).sum(0) / w[m].sum()
    return c


def fitted_bundle(bundle, coll, received, weighting: str):
    """``bundle`` with every layer's k_channel_offset / k_sink_offset / v_sink_offset refitted
    on ``coll`` (a :class:`KVCollection` with every query kept) by 2-means under ``weighting``
    ("none", "attn", "sqrt"); ``received``: per layer, :func:`attention_received` of ``coll``."""
    d = bundle.geometry.head_dim
    layers = []
    for cal, ls, (w1, w2) in zip(bundle.layers, coll.layers, received, strict=True):
        sk = torch.tensor(cal.k_channel_scales) if cal.k_channel_scales else torch.ones(d)
        sv = torch.tensor(cal.v_channel_scales) if cal.v_channel_scales else torch.ones(d)
        mu, ksig, vsig = (cal.k_offset_tensor(d), cal.sink_offset_tensor("k", d),
                          cal.sink_offset_tensor("v", d))
        hkv = ls.k.shape[1]
        new_mu, new_ks, new_vs = [], [], []
        for h in range(hkv):
            wk = {"none": torch.ones(len(w1)), "attn": w1[:, h], "sqrt": w1[:, h].sqrt()}[weighting]
            wv = {"none": torch.ones(len(w2)), "attn": w2[:, h], "sqrt": w2[:, h].sqrt()}[weighting]
            m = mu[h] if mu.dim() == 2 else mu
            c = two_means(ls.k[:, h] / sk, torch.stack([m, ksig[h] if ksig.dim() == 2 else ksig]) / sk,
                          wk, pin_first=False) * sk
            new_mu.append(c[0])
            new_ks.append(c[1])
            v0 = torch.stack([torch.zeros(d), vsig[h] if vsig.dim() == 2 else vsig]) / sv
            new_vs.append(two_means(ls.v[:, h] / sv, v0, wv, pin_first=True)[1] * sv)
        flat = lambda xs: tuple(float(v) for v in torch.stack(xs).reshape(-1))
        layers.append(dataclasses.replace(cal, k_channel_offset=flat(new_mu),
                                          k_sink_offset=flat(new_ks), v_sink_offset=flat(new_vs)))
    return dataclasses.replace(bundle, layers=tuple(layers))


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(__doc__, "tkv-calibration/tkv_bundle.json", 4,
                                       "benchmarks/results/offset_fit_cpu.md")
    calib = fit_windows(lm.tokenizer)
    coll = collect_kv(lm.model, calib, q_per_window=1024)
    received = [attention_received(ls.q, ls.k, coll.windows) for ls in coll.layers]
    fits = {w: fitted_bundle(bundle, coll, received, w) for w in ("none", "attn", "sqrt")}
    held = held_out_windows(lm.tokenizer, a.windows)
    lines = [f"# Offset-fit study — SmolLM2-135M-Instruct, bundle `{a.bundle}`", "",
             f"Offsets refitted on WikiText-2 *valid* windows 0-{HELD_OUT_FIRST - 1} "
             f"(1,024 tokens each), {ITERS} Lloyd iterations from the bundle's offsets. Held-out: "
             f"{a.windows} windows × 1,024 tokens of *valid* (windows {HELD_OUT_FIRST}..). "
             "Teacher-forced, every attention reads the quantize-dequantized cache. Baseline "
             "named in every ratio: the bundle's row. Bytes per token: the row's.", "", *TABLE_HEAD]
    for b in a.budgets.split(","):
        alloc = bundle.allocation(b)
        arms = [tkv_arm(bundle, alloc, f"TKV@{b} (bundle row)", "tkv")]
        for w, label in (("none", "2-means"), ("attn", "2-means, attention-weighted"),
                         ("sqrt", "2-means, √attention-weighted")):
            arms.append(tkv_arm(fits[w], alloc, label, "tkv"))
        lines += arm_rows(lm.model, held, arms, b)
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
