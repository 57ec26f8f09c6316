"""Attention-sink study (CPU): what storing the first token of a sequence better would buy.

The first token of every sequence is an attention sink in most heads: it receives a large
share of the softmax mass, so its quantization error moves every attention row. This script
measures, with the shipped calibration bundle and the real SmolLM2-135M, the teacher-forced
KL and ΔPPL of each budget's row (baseline, named "TKV@b") beside the same row with the
first token of the window stored

* exactly (K and V; K only; V only) — upper bounds, and
* at 8 bits (K8V8 with the layer's calibrated codebooks) — what a sink slot of 8-bit codes
  would cost: one extra slot per sequence.

Held-out text: windows 6..6+n of 1,024 tokens of the *calibration* split (WikiText-2 valid;
the bundle was fitted on its first 11 windows of 512 tokens), never the test split — this is a
design study. Run from the repository root::

    uv run --frozen python benchmarks/sink_tokens_cpu.py                # 4.0 and 3.0, 4 windows
    uv run --frozen python benchmarks/sink_tokens_cpu.py --budgets 4.0 --windows 8

Prints a markdown table (KL ratios vs the baseline row) and writes it to ``--out``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tkv.calibrate.evaluate import Arm
from tkv.calibrate.pipeline import tkv_arm
from tkv.calibrate.quantizers import TkvQuantizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import (
    TABLE_HEAD,
    WrappedQuantizer,
    arm_rows,
    finish,
    held_out_windows,
    parse_and_load,
)


class SinkQuantizer(WrappedQuantizer):
    """A layer's quantizer with the first ``sink`` tokens of each chunk stored differently:
    ``mode`` "kv" / "k" / "v" keeps that side exact, "8bit" stores both at K8V8 (``q8``).
    The evaluation caches see whole windows in one chunk, so chunk position = token position."""

    def __init__(self, q: TkvQuantizer, mode: str, q8: TkvQuantizer, sink: int = 1):
        super().__init__(q, "+sink")
        self.mode, self.q8, self.sink = mode, q8, sink

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor):
        kk, vv = self.q.roundtrip(k, v)
        s = min(self.sink, k.shape[2])
        if s == 0:
            return kk, vv
        kk, vv = kk.clone(), vv.clone()
        if self.mode == "8bit":
            kk[:, :, :s], vv[:, :, :s] = self.q8.roundtrip(k[:, :, :s], v[:, :, :s])
        if "k" in self.mode:
            kk[:, :, :s] = k[:, :, :s]
        if "v" in self.mode:
            vv[:, :, :s] = v[:, :, :s]
        return kk, vv


MODES = (("kv", "first token exact (K and V)"), ("k", "first token: K exact"),
         ("v", "first token: V exact"), ("8bit", "first token at K8V8"))


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(__doc__, "benchmarks/results/calibrate_smollm2_bundle.json",
                                       4, "benchmarks/results/sink_tokens_cpu.md")
    held = held_out_windows(lm.tokenizer, a.windows)
    n = bundle.geometry.num_layers
    q8 = [TkvQuantizer(bundle.codec(i, 8, 8, check_finite=False)) for i in range(n)]
    lines = [f"# Attention-sink study — SmolLM2-135M-Instruct, bundle `{Path(a.bundle).name}`", "",
             f"Held-out: {a.windows} windows × 1,024 tokens of WikiText-2 *valid* (windows 6.., not "
             "used for calibration; never the test split). Teacher-forced, every attention reads the "
             "quantize-dequantized cache. Baseline named in every ratio: the bundle's row.", "",
             *TABLE_HEAD]
    for b in a.budgets.split(","):
        base = tkv_arm(bundle, bundle.allocation(b), f"TKV@{b} (bundle row)", "tkv")
        arms = [base] + [Arm(label, [SinkQuantizer(q, m, q8[i]) for i, q in enumerate(base.quantizers)],
                             base.bytes_per_token_head) for m, label in MODES]
        lines += arm_rows(lm.model, held, arms, b)
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
