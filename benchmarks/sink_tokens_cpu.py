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

import argparse
import time
from pathlib import Path

import torch

from tkv.calibrate.data import default_calib_text, tokenize_windows
from tkv.calibrate.evaluate import Arm, evaluate_arms
from tkv.calibrate.model import load_model
from tkv.calibrate.pipeline import tkv_arm
from tkv.calibrate.quantizers import TkvQuantizer
from tkv.codec import CalibrationBundle


class SinkQuantizer:
    """A layer's quantizer with the first ``sink`` tokens of each chunk stored differently:
    ``mode`` "kv" / "k" / "v" keeps that side exact, "8bit" stores both at K8V8 (``q8``).
    The evaluation caches see whole windows in one chunk, so chunk position = token position."""

    def __init__(self, q: TkvQuantizer, mode: str, q8: TkvQuantizer, sink: int = 1):
        self.q, self.mode, self.q8, self.sink, self.name = q, mode, q8, sink, f"{q.name}+sink"

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

    def bytes_per_token_head(self) -> float:
        return self.q.bytes_per_token_head()


MODES = (("kv", "first token exact (K and V)"), ("k", "first token: K exact"),
         ("v", "first token: V exact"), ("8bit", "first token at K8V8"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="benchmarks/results/calibrate_smollm2_bundle.json")
    ap.add_argument("--budgets", default="4.0,3.0")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/sink_tokens_cpu.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lm = load_model(None)
    bundle = CalibrationBundle.load(a.bundle)
    held = tokenize_windows(lm.tokenizer, default_calib_text(), 1024, 6 + a.windows).subset(6, a.windows)
    n = bundle.geometry.num_layers
    q8 = [TkvQuantizer(bundle.codec(i, 8, 8, check_finite=False)) for i in range(n)]
    lines = [f"# Attention-sink study — SmolLM2-135M-Instruct, bundle `{Path(a.bundle).name}`", "",
             f"Held-out: {a.windows} windows × 1,024 tokens of WikiText-2 *valid* (windows 6.., not "
             "used for calibration; never the test split). Teacher-forced, every attention reads the "
             "quantize-dequantized cache. Baseline named in every ratio: the bundle's row.", "",
             "| budget | arm | mean KL | KL ÷ baseline | ΔPPL | top-1 |", "|---|---|---:|---:|---:|---:|"]
    for b in a.budgets.split(","):
        base = tkv_arm(bundle, bundle.allocation(b), f"TKV@{b} (bundle row)", "tkv")
        arms = [base] + [Arm(label, [SinkQuantizer(q, m, q8[i]) for i, q in enumerate(base.quantizers)],
                             base.bytes_per_token_head) for m, label in MODES]
        res = evaluate_arms(lm.model, held, arms, decode=False, show_progress=True, desc=f"TKV@{b}")
        kl0 = res.arms[0].tf.mean_kl
        for r in res.arms:
            lines.append(f"| {b} | {r.name} | {r.tf.mean_kl:.4f} | {r.tf.mean_kl / kl0:.2f} | "
                         f"{100 * (r.tf.ppl / res.base.ppl - 1):+.2f} % | {100 * r.tf.top1_agree:.1f} % |")
    lines += ["", f"Command: `python benchmarks/sink_tokens_cpu.py --budgets {a.budgets} --windows "
              f"{a.windows}`; wall time {time.perf_counter() - t0:.0f} s (2-core CPU)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
