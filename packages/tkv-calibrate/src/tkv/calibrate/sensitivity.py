"""Step 3: per-layer sensitivity — the drift (mean KL of next-token distributions vs
uncompressed, teacher-forced) that compressing one layer's K or V alone costs at each width.

Measured directly at a probe width for every layer and side (only that layer's K, or V,
reads a quantize-dequantized cache; the window reruns from that layer on). Other widths are
predicted with a distortion model: KL is second order in the perturbation, whose energy is
proportional to the codebook distortion ``D`` (held-out MSE of the codebook the codec will
use, :mod:`tkv.calibrate.fitting`), so

    KL(l, side, b) ≈ KL(l, side, b_probe) · (D(l, side, b) / D(l, side, b_probe)) ** γ

with one exponent ``γ`` (≈ 1 in the small-error regime) fitted by least squares in log space
on a validation sample measured at other widths. The report gives the Pearson correlation of
log predicted vs log measured KL and the Spearman rank correlation on that sample, each point
predicted out of sample: with the ``γ`` fitted on the other points (leave-one-out), so the
correlation validates the proxy rather than its own fit.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tkv.codec import CalibrationBundle

from .cache import QuantizedKVCache
from .metrics import compare_logits
from .progress import bar
from .quantizers import compress_bhtd, decompress_bhtd
from .runner import PrefixRunner

__all__ = ["Sensitivity", "SideQuantizer", "measure_sensitivity"]

SIDES = ("k", "v")
KL_FLOOR = 1e-9


class SideQuantizer:
    """Quantizes one side (``"k"`` or ``"v"``) of a layer with a codec, leaves the other exact."""

    def __init__(self, codec, side: str):
        self.codec, self.side = codec, side
        self.name = f"{side.upper()}{codec.k_bits if side == 'k' else codec.v_bits}"

    def roundtrip(self, k, v):
        if self.side == "k":
            return decompress_bhtd(self.codec.k, *compress_bhtd(self.codec.k, k), k.dtype), v
        return k, decompress_bhtd(self.codec.v, *compress_bhtd(self.codec.v, v), v.dtype)

    def bytes_per_token_head(self) -> float:  # pragma: no cover - not priced
        return float("nan")


def _rank(x: list[float]) -> torch.Tensor:
    t = torch.tensor(x, dtype=torch.float64)
    return torch.argsort(torch.argsort(t)).double()


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den > 0 else float("nan")


@dataclass
class Sensitivity:
    """Measured per-layer KL at the probe width and the fitted distortion model.

    Attributes:
        probe_bits: width measured for every layer and side.
        probe: ``probe[side][l]`` = measured mean KL with only layer l's side at probe_bits.
        distortion: ``distortion(l, side, bits)`` → held-out codebook MSE.
        gamma: exponent fitted on the whole validation sample (what :meth:`predict` uses).
        validation: list of (layer, side, bits, measured, predicted), each point predicted with
            the exponent fitted on the other points (leave-one-out).
    """

    probe_bits: int
    probe: dict[str, list[float]]
    distortion: Callable[[int, str, int], float]
    gamma: float = 1.0
    validation: list[tuple[int, str, int, float, float]] = field(default_factory=list)
    seconds: float = 0.0

    def predict(self, layer: int, side: str, bits: int, gamma: float | None = None) -> float:
        """Predicted mean KL (nats) of compressing only ``layer``'s ``side`` at ``bits``, with
        exponent ``gamma`` (default: the fitted :attr:`gamma`)."""
        base = max(self.probe[side][layer], KL_FLOOR)
        r = self.distortion(layer, side, bits) / self.distortion(layer, side, self.probe_bits)
        return base * r ** (self.gamma if gamma is None else gamma)

    def table(self, widths=range(2, 9)) -> dict[str, torch.Tensor]:
        """``{"k": (L, len(widths)), "v": ...}`` predicted KL, float64."""
        n = len(self.probe["k"])
        return {s: torch.tensor([[self.predict(layer, s, b) for b in widths] for layer in range(n)],
                                dtype=torch.float64) for s in SIDES}

    def correlation(self) -> dict:
        """Pearson (log-log) and Spearman correlation of predicted (leave-one-out) vs measured
        on the validation sample."""
        if len(self.validation) < 3:
            return {"n": len(self.validation), "pearson_log": float("nan"), "spearman": float("nan")}
        m = [max(v[3], KL_FLOOR) for v in self.validation]
        p = [max(v[4], KL_FLOOR) for v in self.validation]
        lm = torch.tensor(m, dtype=torch.float64).log()
        lp = torch.tensor(p, dtype=torch.float64).log()
        return {"n": len(m), "pearson_log": _pearson(lm, lp), "spearman": _pearson(_rank(m), _rank(p))}


def measure_sensitivity(model, windows: torch.Tensor, bundle: CalibrationBundle,
                        distortion: Callable[[int, str, int], float], probe_bits: int = 3,
                        validation_widths=(2, 4, 6), validation_per_width: int = 4,
                        seed: int = 0, show_progress: bool = True) -> Sensitivity:
    """Measure every layer's K and V at ``probe_bits`` and a validation sample at other widths.

    Args:
        windows: int64 ``(n, T)`` calibration windows (not the evaluation text).
        bundle: draft bundle with this model's scales and codebooks (``bundle.codec``).
        distortion: as :attr:`Sensitivity.distortion`.
    """
    import time

    t0 = time.perf_counter()
    num_layers = bundle.geometry.num_layers
    rng = random.Random(seed)
    configs = [(layer, s, probe_bits) for layer in range(num_layers) for s in SIDES]
    sample = []
    for b in validation_widths:
        picks = rng.sample([(layer, s) for layer in range(num_layers) for s in SIDES],
                           min(validation_per_width, 2 * num_layers))
        sample += [(layer, s, b) for layer, s in picks]
    todo = configs + sample
    sums = {c: 0.0 for c in todo}
    count = 0
    codecs: dict = {}
    pb = bar(windows.shape[0] * len(todo), "sensitivity", show_progress, "pass")
    for i in range(windows.shape[0]):
        ids = windows[i:i + 1]
        run = PrefixRunner(model, ids)
        blp = torch.log_softmax(run.base_logits, -1)
        for c in todo:
            layer, side, b = c
            key = (layer, b)
            if key not in codecs:
                codecs[key] = bundle.codec(layer, b, b, check_finite=False)
            qs = [None] * num_layers
            qs[layer] = SideQuantizer(codecs[key], side)
            logits = run.logits_from(layer, QuantizedKVCache(qs))
            sums[c] += compare_logits(run.base_logits, logits, None, blp).kl
            pb.update(1)
        count += run.base_logits.shape[0]
        del run, blp
    pb.close()
    kl = {c: v / count for c, v in sums.items()}
    probe = {s: [kl[(layer, s, probe_bits)] for layer in range(num_layers)] for s in SIDES}
    sens = Sensitivity(probe_bits, probe, distortion)
    # Fit gamma: log(KL_b / KL_probe) = gamma * log(D_b / D_probe), least squares through 0;
    # each validation point is then predicted with the gamma of the other points.
    fit = {}   # sample point -> (x, y) of the regression, for points above the KL floor
    for c in sample:
        layer, s, b = c
        m, m0 = kl[c], probe[s][layer]
        if m > KL_FLOOR and m0 > KL_FLOOR:
            fit[c] = (math.log(distortion(layer, s, b) / distortion(layer, s, probe_bits)),
                      math.log(m / m0))
    sxy = sum(x * y for x, y in fit.values())
    sxx = sum(x * x for x, _ in fit.values())
    if sxx > 0:
        sens.gamma = sxy / sxx

    def held_out_gamma(c) -> float:
        x, y = fit.get(c, (0.0, 0.0))
        return (sxy - x * y) / (sxx - x * x) if sxx - x * x > 0 else sens.gamma

    sens.validation = [(layer, s, b, kl[(layer, s, b)],
                        sens.predict(layer, s, b, held_out_gamma((layer, s, b))))
                       for (layer, s, b) in sample]
    sens.seconds = time.perf_counter() - t0
    return sens
