"""Outlier-token study (CPU): is the remaining drift of a shipped row concentrated in a few
(token, KV head) vectors?

The codebook studies of session 13 (``symmetric_codebooks_cpu.md``,
``attention_weighted_codebooks_cpu.md``) found the KL moving with changes far too small to
matter on average — as if a few vectors set it. This measures it directly with the committed
sink-offset bundle: each budget's row (baseline, named "TKV@b") beside the same row with a
small share of each layer's (token, head) vectors kept exact — chosen

* by their own reconstruction error (an oracle: the largest ``‖x̂ − x‖`` per side),
* by model-space norm (a rule a store kernel could apply: the largest ``‖x‖``),
* at random (the control: the same count, no selection),

plus the first token exact (what the sink offset already targets). If the oracle at 1 %
removes most of the KL and the norm rule much of it, per-vector outlier storage is the lever;
if they remove only their share, the drift is spread out and a better per-side quantizer is.

Held-out text: windows 6.. of 1,024 tokens of WikiText-2 *valid* (not used for calibration;
never the test split). Run from the repository root::

    uv run --frozen python benchmarks/outlier_tokens_cpu.py --budgets 4.0,3.0 --windows 2
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tkv.calibrate.evaluate import Arm
from tkv.calibrate.pipeline import tkv_arm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import (
    TABLE_HEAD,
    WrappedQuantizer,
    arm_rows,
    finish,
    held_out_windows,
    parse_and_load,
)


class ExactShareQuantizer(WrappedQuantizer):
    """A layer's quantizer that returns the exact K (V) for a share ``frac`` of the (token,
    head) vectors of each chunk, chosen per side by ``rule``: ``"error"`` (largest
    reconstruction error), ``"norm"`` (largest norm), ``"random"`` (seeded), ``"first"`` (the
    first token of the chunk, ``frac`` ignored)."""

    def __init__(self, q, rule: str, frac: float, seed: int):
        super().__init__(q, f"+exact-{rule}")
        self.rule, self.frac = rule, frac
        self.g = torch.Generator().manual_seed(seed)

    def _mask(self, x: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
        b, h, t, _ = x.shape
        if self.rule == "first":
            m = torch.zeros(b, h, t, dtype=torch.bool)
            m[:, :, 0] = True
            return m
        n = max(1, round(self.frac * t))
        if self.rule == "error":
            score = (xh - x).float().norm(dim=-1)
        elif self.rule == "norm":
            score = x.float().norm(dim=-1)
        else:
            score = torch.rand(b, h, t, generator=self.g)
        idx = score.topk(n, dim=-1).indices
        return torch.zeros(b, h, t, dtype=torch.bool).scatter_(-1, idx, True)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor):
        kk, vv = self.q.roundtrip(k, v)
        mk, mv = self._mask(k, kk), self._mask(v, vv)
        return (torch.where(mk[..., None], k, kk), torch.where(mv[..., None], v, vv))


ARMS = (("first", 0.0, "first token exact"),
        ("error", 0.01, "1 % largest-error vectors exact (oracle)"),
        ("norm", 0.01, "1 % largest-norm vectors exact"),
        ("random", 0.01, "1 % random vectors exact (control)"),
        ("error", 0.05, "5 % largest-error vectors exact (oracle)"))


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(
        __doc__, "benchmarks/results/calibrate_smollm2_sink_offset_2026-11-30/tkv_bundle.json",
        2, "benchmarks/results/outlier_tokens_cpu.md")
    held = held_out_windows(lm.tokenizer, a.windows)
    lines = ["# Outlier-token study — SmolLM2-135M-Instruct, bundle "
             f"`{Path(a.bundle).parent.name}/{Path(a.bundle).name}`", "",
             f"Held-out: {a.windows} windows × 1,024 tokens of WikiText-2 *valid* (windows 6.., "
             "not used for calibration; never the test split). Teacher-forced, every attention "
             "reads the quantize-dequantized cache. Shares are per layer, per side, per KV head "
             "and window. Baseline named in every ratio: the bundle's row.", "", *TABLE_HEAD]
    for b in a.budgets.split(","):
        base = tkv_arm(bundle, bundle.allocation(b), f"TKV@{b} (bundle row)", "tkv")
        arms = [base] + [Arm(label, [ExactShareQuantizer(q, rule, frac, seed=i)
                                     for i, q in enumerate(base.quantizers)],
                             base.bytes_per_token_head) for rule, frac, label in ARMS]
        lines += arm_rows(lm.model, held, arms, b)
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
