"""Sink-offset study (CPU): a second, calibrated offset per layer for the attention sink.

The sink study (``sink_tokens_cpu.py``) found that storing the first token of a window exactly
cuts the teacher-forced KL at 4.0 bits/element to 0.78× — mostly its key — but an exact slot
needs a new page format. This study measures a design that keeps the slot layout as it is:

* calibration records, per layer and KV head, the mean key and value the model produces at
  position 0 (``μ_sink``; a token at position 0 attends only to itself, so these come from
  one-token forwards of the first tokens of the calibration windows, never the test split);
* the store quantizes each token either as today (key minus the key mean μ, value as is) or
  relative to the sink offset (key minus μ_sink, value minus μ_v,sink), whichever reconstructs
  the vector better — the encoder has the original, so it can try both;
* the choice is one bit per token, KV head and side: the sign bit of the stored bf16 norm,
  which norms never use. No byte is added; bytes per token are the row's.

Decode cost (not built here): a score gets ``q·(μ_sink − μ)`` added when its key's flag is
set (one dot per query row, computed with the query rotation); the value side accumulates the
softmax mass of flagged tokens and adds that times μ_v,sink once per output row.

Arms at each budget (baseline named in every ratio: the bundle's row): the dual offset on K,
on K and V, and, for reference, the sink study's "first token exact (K and V)".
Held-out text: windows 6.. of 1,024 tokens of WikiText-2 *valid* (not used for calibration;
never the test split). Run from the repository root::

    uv run --frozen python benchmarks/sink_offset_cpu.py                # 4.0 and 3.0, 4 windows
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tkv.calibrate.collect import sink_offsets, window_sink_tokens
from tkv.calibrate.evaluate import Arm
from tkv.calibrate.pipeline import tkv_arm
from tkv.calibrate.quantizers import TkvQuantizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import (
    TABLE_HEAD,
    WrappedQuantizer,
    arm_rows,
    finish,
    fit_windows,
    held_out_windows,
    parse_and_load,
)
from sink_tokens_cpu import SinkQuantizer


class SinkOffsetQuantizer(WrappedQuantizer):
    """A layer's quantizer where every (token, head) is stored either as the row stores it or
    relative to the sink offsets — whichever reconstructs it with the smaller squared error —
    on the K side (``sides`` "k"), the V side ("v") or both ("kv"). The flag would ride in the
    norm's sign bit."""

    def __init__(self, q: TkvQuantizer, mu_sink: tuple[torch.Tensor, torch.Tensor], sides: str):
        super().__init__(q, f"+sink offset {sides}")
        self.sides = sides
        mu = q.codec.k.channel_offset            # the codec's own key centering: (H, d), (d,)
        self.mu = None if mu is None else (mu if mu.dim() == 2 else mu[None]).float()
        self.mk, self.mv = mu_sink

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor):
        kk, vv = self.q.roundtrip(k, v)
        mk = self.mk[None, :, None, :].to(k.dtype)                 # (1, H, 1, d)
        mv = self.mv[None, :, None, :].to(v.dtype)
        mu = 0 if self.mu is None else self.mu[None, :, None, :].to(k.dtype)
        # the quantizer subtracts μ itself: feed k − μ_sink + μ so that it codes k − μ_sink
        kb, vb = self.q.roundtrip(k - mk + mu, v - mv)
        kb, vb = kb - mu + mk, vb + mv
        if "k" in self.sides:
            pick_k = ((kb - k) ** 2).sum(-1, keepdim=True) < ((kk - k) ** 2).sum(-1, keepdim=True)
            kk = torch.where(pick_k, kb, kk)
        if "v" in self.sides:
            pick_v = ((vb - v) ** 2).sum(-1, keepdim=True) < ((vv - v) ** 2).sum(-1, keepdim=True)
            vv = torch.where(pick_v, vb, vv)
        return kk, vv


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(__doc__, "benchmarks/results/calibrate_smollm2_bundle.json",
                                       4, "benchmarks/results/sink_offset_cpu.md")
    calib = fit_windows(lm.tokenizer)
    # windows 0-5 only, before the held-out ones
    firsts = window_sink_tokens(calib)
    mus = sink_offsets(lm.model, firsts)
    held = held_out_windows(lm.tokenizer, a.windows)
    n = bundle.geometry.num_layers
    lines = [f"# Sink-offset study — SmolLM2-135M-Instruct, bundle `{Path(a.bundle).name}`", "",
             f"μ_sink from one-token forwards of {firsts.numel()} window-start tokens of the "
             "calibration windows (WikiText-2 valid, windows 0-5). Held-out: "
             f"{a.windows} windows × 1,024 tokens of WikiText-2 *valid* (windows 6..). "
             "Teacher-forced, every attention reads the quantize-dequantized cache. Baseline "
             "named in every ratio: the bundle's row. Bytes per token: the row's (the flag is "
             "the norm's sign bit).", "", *TABLE_HEAD]
    q8 = [TkvQuantizer(bundle.codec(i, 8, 8, check_finite=False)) for i in range(n)]
    for b in a.budgets.split(","):
        base = tkv_arm(bundle, bundle.allocation(b), f"TKV@{b} (bundle row)", "tkv")
        arms = [base]
        for sides, label in (("k", "dual offset, K"), ("v", "dual offset, V"),
                             ("kv", "dual offset, K and V")):
            arms.append(Arm(label, [SinkOffsetQuantizer(q, mus[i], sides)
                                    for i, q in enumerate(base.quantizers)],
                            base.bytes_per_token_head))
        arms.append(Arm("first token exact (K and V), reference",
                        [SinkQuantizer(q, "kv", q8[i]) for i, q in enumerate(base.quantizers)],
                        base.bytes_per_token_head))
        lines += arm_rows(lm.model, held, arms, b)
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
