"""Experiment: per-head K (and V) mean removal, emulated outside the codec.

The job ships key centering with one offset per layer shared by its KV heads (the codec's
``k_channel_offset``, fitted in :mod:`tkv.calibrate.scales`); this module emulates what the
codec cannot store — a mean per KV head, and value centering — so their value can be
measured against it. Post-RoPE keys of SmolLM2-135M carry ~60 % of their energy in a
per-channel mean shared by all tokens (measured on 512 ``valid`` tokens). The codec quantizes
``‖x‖``-normalized vectors, so that shared component is quantized again in every token.
Removing it is free for keys — ``q·(k − μ_k)`` differs from ``q·k`` by ``q·μ_k``, the same for
every key of a query row, which softmax ignores — and cheap for values
(``Σ_j p_j (v_j − μ_v) + μ_v`` since the attention weights sum to 1):

    python -m tkv.calibrate.centering --bundle tkv-calibration/tkv_bundle.json

It re-fits scales and codebooks on per-head-centered K/V (same calibration windows as the
job, the job's own per-layer centering off), keeps each bundle row's per-layer widths, and
evaluates teacher-forced on the test text.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from .calibrate import draft_bundle, fit_calibration
from .collect import KVCollection, collect_kv
from .data import default_calib_text, default_eval_text, tokenize_windows
from .evaluate import Arm, evaluate_arms
from .model import load_model
from .pipeline import _bundle_arms, tkv_arm
from .quantizers import TkvQuantizer
from .report import table_rows

__all__ = ["CenteredQuantizer", "center_collection", "main"]


class CenteredQuantizer:
    """A :class:`TkvQuantizer` applied to ``k − μ_k`` (and ``v − μ_v``); offsets added back.

    Args:
        inner: the tkv quantizer. mu_k, mu_v: float ``(num_kv_heads, head_dim)`` or None.
    """

    def __init__(self, inner: TkvQuantizer, mu_k: torch.Tensor | None, mu_v: torch.Tensor | None):
        self.inner, self.mu_k, self.mu_v = inner, mu_k, mu_v
        self.name = inner.name + " centered"

    def roundtrip(self, k, v):
        mk = 0 if self.mu_k is None else self.mu_k[None, :, None, :].to(k.dtype)
        mv = 0 if self.mu_v is None else self.mu_v[None, :, None, :].to(v.dtype)
        kh, vh = self.inner.roundtrip(k - mk, v - mv)
        return kh + mk, vh + mv

    def bytes_per_token_head(self) -> float:
        return self.inner.bytes_per_token_head()


def center_collection(col: KVCollection, values: bool) -> tuple[KVCollection, list, list]:
    """Per-layer, per-head channel means ``(H, d)`` of K (and V) and the centered collection."""
    layers, mk, mv = [], [], []
    for s in col.layers:
        a = s.k.mean(0)
        b = s.v.mean(0) if values else None
        mk.append(a)
        mv.append(b)
        layers.append(replace(s, k=s.k - a, v=s.v - b if values else s.v))
    return KVCollection(layers, col.num_tokens, col.windows), mk, mv


def main(argv: list[str] | None = None) -> int:
    from tkv.codec import CalibrationBundle

    p = argparse.ArgumentParser(prog="python -m tkv.calibrate.centering", description=__doc__)
    p.add_argument("--bundle", required=True)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--collect-windows", type=int, default=8)
    a = p.parse_args(argv)
    bundle = CalibrationBundle.load(a.bundle)
    lm = load_model()
    geo = lm.geometry
    cal_ids = tokenize_windows(lm.tokenizer, default_calib_text(), 512, a.collect_windows).subset(
        0, a.collect_windows)
    ev_ids = tokenize_windows(lm.tokenizer, default_eval_text(), 1024, a.eval_windows).subset(
        0, a.eval_windows)
    col = collect_kv(lm.model, cal_ids)
    arms: list[Arm] = [x for x in _bundle_arms(bundle) if x.group == "smartmix"]
    for values in (False, True):
        ccol, mk, mv = center_collection(col, values)
        cal = fit_calibration(lm.model, geo, cal_ids, bundle.seed, collection=ccol,
                              center_keys=False)
        cb = draft_bundle(cal)
        tag = "K+V centered" if values else "K centered"
        for key in bundle.budgets():
            alloc = bundle.allocation(key)
            base = tkv_arm(cb, alloc, "", "tkv")
            qs = [CenteredQuantizer(q, mk[i], mv[i]) for i, q in enumerate(base.quantizers)]
            arms.append(Arm(f"TKV@{float(key):g} {alloc.source} widths, {tag}", qs,
                            base.bytes_per_token_head, "smartmix", {"budget": float(key)}))
    ev = evaluate_arms(lm.model, ev_ids, arms, decode=False, desc="evaluate centering")
    for r in table_rows(ev, lm.name, 4 * geo.head_dim):
        print(f"| {r['name']} | {r['bytes_per_token_head']:.1f} | {r['delta_ppl_pct']:+.2f} % | "
              f"{r['kl']:.4f} | {100 * r['top1']:.1f} % |")
    print(f"({ev.seconds:.0f} s evaluating; norms and offsets: the offset costs "
          f"{geo.head_dim * 2} B per layer and KV head, not per token)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
