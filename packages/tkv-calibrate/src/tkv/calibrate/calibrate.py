"""Steps 1–2 (and the bundle draft): collection → key centering + channel scales → fitted
codebooks.

:func:`fit_calibration` turns calibration windows into per-layer
:class:`tkv.codec.LayerCalibration` records plus the diagnostics the report shows (error
removed by the scales, codebook distortion vs Gaussian); :func:`draft_bundle` wraps them in a
:class:`tkv.codec.CalibrationBundle` so that ``bundle.codec(layer, k_bits, v_bits)`` builds
the calibrated codec used by every later step.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from tkv.codec import (
    CalibrationBundle,
    HadamardRotation,
    LayerAllocation,
    LayerCalibration,
    ModelGeometry,
)

from .collect import KVCollection, collect_kv, sink_offsets
from .fitting import MIN_FITTED_GAIN, SideCodebooks, fit_side_codebooks, standardized_coords
from .progress import bar
from .scales import ScaleChoice, choose_scales

__all__ = ["Calibration", "draft_bundle", "fit_calibration"]


@dataclass
class Calibration:
    """What steps 1–2 learned.

    Attributes:
        layers: per layer :class:`LayerCalibration` (scales, key offset μ, kept fitted
            codebooks).
        scales: per layer :class:`ScaleChoice` (errors with/without scales and centering).
        codebooks: per layer ``{"k": SideCodebooks, "v": SideCodebooks}``.
        num_tokens: calibration tokens collected. seconds: wall time per step.
        codebook_min_gain: the relative held-out MSE gain a fitted codebook needed to ship.
    """

    geometry: ModelGeometry
    layers: list[LayerCalibration]
    scales: list[ScaleChoice]
    codebooks: list[dict[str, SideCodebooks]]
    num_tokens: int
    seed: int = 0
    seconds: dict = field(default_factory=dict)
    codebook_min_gain: float = MIN_FITTED_GAIN

    def distortion(self, layer: int, side: str, bits: int) -> float:
        """Held-out codebook MSE the codec uses for ``layer``/``side`` at ``bits``."""
        return self.codebooks[layer][side].mse(bits)

    def summary(self) -> dict:
        """Report numbers: mean relative errors with/without scales, codebook gains."""
        n = len(self.scales)
        mean = lambda xs: sum(xs) / max(len(xs), 1)
        out = {
            "k_logit_rel_mse_unscaled": mean([s.k_error_unscaled for s in self.scales]),
            "k_logit_rel_mse_scaled_uncentered": mean([
                s.k_error if s.k_error_uncentered is None else s.k_error_uncentered
                for s in self.scales]),
            "k_logit_rel_mse_scaled": mean([s.k_error for s in self.scales]),
            "k_centered_layers": sum(s.k_offset is not None for s in self.scales),
            "v_output_rel_mse_unscaled": mean([s.v_error_unscaled for s in self.scales]),
            "v_output_rel_mse_scaled": mean([s.v_error for s in self.scales]),
            "k_scaled_layers": sum(s.k_scales is not None for s in self.scales),
            "v_scaled_layers": sum(s.v_scales is not None for s in self.scales),
            "num_layers": n,
            "codebook_min_gain": self.codebook_min_gain,
        }
        for side in ("k", "v"):
            for b in (2, 3, 4, 8):
                # gaussian: the default's held-out MSE; fit_candidate: every layer's fitted
                # codebook, kept or not; fitted: the codebook the bundle ships (a fit only
                # where it beat the default by MIN_FITTED_GAIN); kept: layers shipping a fit
                out[f"{side}{b}_codebook_mse_gaussian"] = mean(
                    [c[side].gaussian_mse[b] for c in self.codebooks])
                out[f"{side}{b}_codebook_mse_fit_candidate"] = mean(
                    [c[side].fitted_mse[b] for c in self.codebooks])
                out[f"{side}{b}_codebook_mse_fitted"] = mean(
                    [c[side].mse(b) for c in self.codebooks])
                out[f"{side}{b}_codebooks_kept"] = sum(b in c[side].books for c in self.codebooks)
        return out


def fit_calibration(model, geometry: ModelGeometry, windows: torch.Tensor, seed: int = 0,
                    held_fraction: float = 0.25, show_progress: bool = True,
                    collection: KVCollection | None = None,
                    center_keys: bool | str = "per-head",
                    codebook_min_gain: float = MIN_FITTED_GAIN,
                    sink_tokens: torch.Tensor | None = None) -> Calibration:
    """Collect K/V over ``windows`` (int64 ``(n, T)``), then fit the key offset μ, scales and
    codebooks per layer (a fitted codebook kept where it beats the Gaussian default's held-out
    MSE by more than ``codebook_min_gain``, relative; :func:`fit_side_codebooks`).

    The last ``held_fraction`` of the collected tokens (whole windows when n > 1) is held out
    to select scales (and whether to center) and judge codebooks; μ is fitted on the rest.
    ``center_keys``: ``"per-head"`` (default; True), ``"shared"`` or ``"off"`` (False; ablation,
    bundles then carry no offset). A per-head μ is stored flat, head-major
    (``num_kv_heads * head_dim`` floats). ``sink_tokens`` (int64 ``(n,)``, e.g. window starts
    of the calibration text): also the per-head sink offsets of every layer
    (:func:`tkv.calibrate.collect.sink_offsets`; served by tkv's kernels: the flag is the
    norm's sign bit, ``docs/kernels.md``).
    """
    t0 = time.perf_counter()
    col = collection or collect_kv(model, windows, show_progress=show_progress)
    t1 = time.perf_counter()
    ntok = col.layers[0].k.shape[0]
    n_held = max(1, round(ntok * held_fraction))
    train, held = slice(0, ntok - n_held), slice(ntok - n_held, ntok)
    rot = HadamardRotation(geometry.head_dim, seed)
    layers, scales, books = [], [], []
    pb = bar(len(col.layers), "scales+codebooks", show_progress, "layer")
    for s in col.layers:
        sc = choose_scales(s, train, held, seed, center_keys=center_keys)
        kx = s.k if sc.k_offset is None else s.k - sc.k_offset
        cbs = {}
        for side, x, sv in (("k", kx, sc.k_scales), ("v", s.v, sc.v_scales)):
            z = standardized_coords(x, sv, rot)
            cbs[side] = fit_side_codebooks(z[train], z[held], seed=seed,
                                           min_gain=codebook_min_gain)
        books.append(cbs)
        scales.append(sc)
        cb_map = {f"{side}_bits_{b}": cb for side in ("k", "v") for b, cb in cbs[side].books.items()}
        layers.append(LayerCalibration(
            None if sc.k_scales is None else tuple(sc.k_scales.tolist()),
            None if sc.v_scales is None else tuple(sc.v_scales.tolist()), cb_map,
            None if sc.k_offset is None else tuple(sc.k_offset.flatten().tolist())))
        pb.update(1)
    pb.close()
    if len(layers) != geometry.num_layers:
        from .errors import UnsupportedModelError
        raise UnsupportedModelError(
            f"recorded {len(layers)} attention layers, the config declares {geometry.num_layers}")
    if sink_tokens is not None:
        sinks = sink_offsets(model, sink_tokens)
        layers = [dataclasses.replace(lc, k_sink_offset=tuple(k.flatten().tolist()),
                                      v_sink_offset=tuple(v.flatten().tolist()))
                  for lc, (k, v) in zip(layers, sinks, strict=True)]
    t2 = time.perf_counter()
    return Calibration(geometry, layers, scales, books, col.num_tokens, seed,
                       {"collect": t1 - t0, "fit": t2 - t1}, float(codebook_min_gain))


def draft_bundle(cal: Calibration, table: dict | None = None, provenance: dict | None = None,
                 metrics: dict | None = None) -> CalibrationBundle:
    """A :class:`CalibrationBundle` of ``cal``; ``table`` defaults to one uniform K4V4 row."""
    n = cal.geometry.num_layers
    table = table or {"4.0": LayerAllocation.uniform(n, 4, 4)}
    return CalibrationBundle(cal.geometry, tuple(cal.layers), table, provenance or {},
                             metrics or {}, cal.seed)
