"""Step 2b: per-layer Lloyd-Max codebooks fitted on the rotated, normalized coordinates.

For each layer and side, the calibration vectors are prescaled by the chosen channel scales,
rotated with the codec's seeded WHT (:class:`tkv.codec.HadamardRotation`), normalized, and
multiplied by ``sqrt(head_dim)`` — the standardized units of :mod:`tkv.codec.codebooks` — and
:func:`tkv.codec.fit_codebook` (Lloyd 1982) fits one codebook per width 2–8 on the training
tokens. A fitted codebook is kept only where its MSE on held-out tokens is below the
Gaussian default's (TurboQuant's) by more than a margin, ``min_gain`` (default
:data:`MIN_FITTED_GAIN` = 0: any gain); the distortions of both are recorded (they also feed the
sensitivity model, :mod:`tkv.calibrate.sensitivity`).

The margin is a serving trade-off (``tkv-calibrate run --codebook-min-gain``): a per-layer
codebook costs the serving kernels — the fastest 4-bit decode lookup (``prmti``) bakes the
table into the kernel, so ``TkvLoader``'s ``auto`` uses it only for the shared default codebook
and falls back to ``prmt`` otherwise (vLLM end to end, Qwen3-8B-like: prmti 0.93× / 0.96× of
bf16, prmt 0.79× / 0.77×; ``benchmarks/results/vllm_e2e_2026-11-30d/``). On SmolLM2-135M the fits
lower held-out MSE by ≤ 0.7 %, yet a 2 % margin (no fitted codebook shipped) raised the test
KL of the uniform rows by 2-3 % at 4 and 5 bits (``benchmarks/results/
calibrate_smollm2_shared_codebooks.md``), so the default keeps every gain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tkv.codec import Codebook, HadamardRotation, fit_codebook, gaussian_codebook

__all__ = ["MIN_FITTED_GAIN", "SideCodebooks", "fit_side_codebooks", "standardized_coords"]

WIDTHS = tuple(range(2, 9))


def standardized_coords(x: torch.Tensor, scales: torch.Tensor | None,
                        rotation: HadamardRotation) -> torch.Tensor:
    """``sqrt(d) · R(x/s) / ‖R(x/s)‖`` for x ``(..., d)`` float → float32 ``(..., d)``."""
    xf = x.float()
    if scales is not None:
        xf = xf / scales
    y = rotation.forward(xf)
    n = torch.linalg.vector_norm(y, dim=-1, keepdim=True).clamp_min(1e-30)
    return y * (math.sqrt(x.shape[-1]) / n)


# relative held-out MSE gain a fitted codebook needs over the Gaussian default to be kept
# (0: any gain; see the module docstring for the serving trade-off)
MIN_FITTED_GAIN = 0.0


@dataclass(frozen=True)
class SideCodebooks:
    """Codebooks of one layer side.

    Attributes:
        books: width → kept fitted :class:`Codebook` (widths where it beat Gaussian by more
            than the margin).
        fitted_mse, gaussian_mse: width → held-out MSE per coordinate (standardized units).
    """

    books: dict[int, Codebook]
    fitted_mse: dict[int, float]
    gaussian_mse: dict[int, float]

    def mse(self, bits: int) -> float:
        """Held-out distortion of the codebook the codec will use at ``bits``."""
        return self.fitted_mse[bits] if bits in self.books else self.gaussian_mse[bits]


def fit_side_codebooks(train: torch.Tensor, held: torch.Tensor, widths=WIDTHS,
                       max_samples: int = 1 << 16, seed: int = 0,
                       min_gain: float = MIN_FITTED_GAIN) -> SideCodebooks:
    """Fit codebooks on standardized coords ``train`` and judge them on ``held`` (any shapes):
    a fitted codebook is kept where its held-out MSE is below ``(1 − min_gain)`` × the
    Gaussian default's (``min_gain`` default :data:`MIN_FITTED_GAIN`; 0 keeps any gain)."""
    g = torch.Generator().manual_seed(seed)
    held_flat = held.reshape(-1)
    if held_flat.numel() > max_samples:
        held_flat = held_flat[torch.randperm(held_flat.numel(), generator=g)[:max_samples]]
    train_flat = train.reshape(-1)
    if train_flat.numel() > max_samples:
        train_flat = train_flat[torch.randperm(train_flat.numel(), generator=g)[:max_samples]]
    books, fm, gm = {}, {}, {}
    for b in widths:
        cb = fit_codebook(train_flat, b, iters=60, max_samples=max_samples, generator=g)
        fm[b] = cb.distortion(held_flat)
        gm[b] = gaussian_codebook(b).distortion(held_flat)
        if fm[b] < gm[b] * (1.0 - min_gain):
            books[b] = cb
    return SideCodebooks(books, fm, gm)
