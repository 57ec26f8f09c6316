"""Step 2b: per-layer Lloyd-Max codebooks fitted on the rotated, normalized coordinates.

For each layer and side, the calibration vectors are prescaled by the chosen channel scales,
rotated with the codec's seeded WHT (:class:`tkv.codec.HadamardRotation`), normalized, and
multiplied by ``sqrt(head_dim)`` — the standardized units of :mod:`tkv.codec.codebooks` — and
:func:`tkv.codec.fit_codebook` (Lloyd 1982) fits one codebook per width 2–8 on the training
tokens. A fitted codebook is kept only where its MSE on held-out tokens beats the Gaussian
default (TurboQuant's); the distortions of both are recorded (they also feed the sensitivity
model, :mod:`tkv.calibrate.sensitivity`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tkv.codec import Codebook, HadamardRotation, fit_codebook, gaussian_codebook

__all__ = ["SideCodebooks", "fit_side_codebooks", "standardized_coords"]

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


@dataclass(frozen=True)
class SideCodebooks:
    """Codebooks of one layer side.

    Attributes:
        books: width → kept fitted :class:`Codebook` (widths where it beat Gaussian).
        fitted_mse, gaussian_mse: width → held-out MSE per coordinate (standardized units).
    """

    books: dict[int, Codebook]
    fitted_mse: dict[int, float]
    gaussian_mse: dict[int, float]

    def mse(self, bits: int) -> float:
        """Held-out distortion of the codebook the codec will use at ``bits``."""
        return self.fitted_mse[bits] if bits in self.books else self.gaussian_mse[bits]


def fit_side_codebooks(train: torch.Tensor, held: torch.Tensor, widths=WIDTHS,
                       max_samples: int = 1 << 16, seed: int = 0) -> SideCodebooks:
    """Fit codebooks on standardized coords ``train`` and judge them on ``held`` (any shapes)."""
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
        if fm[b] < gm[b]:
            books[b] = cb
    return SideCodebooks(books, fm, gm)
