"""Drift split study (CPU): how much of a budget's KL comes from the keys, the values and the
first token (the attention sink)?

Arms of the bundle's row with one side stored exactly (all tokens), with and without the first
token of each window exact as well. "K exact" leaves only the values' drift; "V exact" only
the keys'. Held-out: windows 6.. of 1,024 tokens of WikiText-2 *valid* (never the test split).
Run from the repository root::

    uv run --frozen python benchmarks/kv_drift_split_cpu.py --budgets 4.0 --windows 2
"""

from __future__ import annotations

import sys
from pathlib import Path

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


class Exact(WrappedQuantizer):
    """A layer quantizer with side ``keep`` ("k"/"v"/"") returned exactly, and (``sink``) the
    first token of the chunk exact on both sides (evaluation chunks are whole windows)."""

    def __init__(self, q, keep: str, sink: bool):
        super().__init__(q)
        self.keep, self.sink = keep, sink

    def roundtrip(self, k, v):
        kk, vv = self.q.roundtrip(k, v)
        kk = k if self.keep == "k" else kk
        vv = v if self.keep == "v" else vv
        if self.sink:
            kk, vv = kk.clone(), vv.clone()
            kk[:, :, :1], vv[:, :, :1] = k[:, :, :1], v[:, :, :1]
        return kk, vv


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(__doc__, "benchmarks/results/calibrate_smollm2_bundle.json",
                                       2, "benchmarks/results/kv_drift_split_cpu.md")
    held = held_out_windows(lm.tokenizer, a.windows)
    lines = [f"# Drift split study — SmolLM2-135M-Instruct, bundle `{Path(a.bundle).name}`", "",
             f"Held-out: {a.windows} windows × 1,024 tokens of WikiText-2 *valid* (windows 6..; never "
             "the test split). Teacher-forced, every attention reads the quantize-dequantized "
             "cache except the side named exact. Baseline named in every ratio: the bundle's "
             "row.", "", *TABLE_HEAD]
    for b in a.budgets.split(","):
        base = tkv_arm(bundle, bundle.allocation(b), f"TKV@{b}", "tkv")
        arms = [base]
        for keep, label in (("", "first token exact"), ("k", "K exact"), ("v", "V exact")):
            for sink in ((True,) if not keep else (False, True)):
                name = label + (" + first token exact" if keep and sink else "")
                arms.append(Arm(name, [Exact(q, keep, sink) for q in base.quantizers],
                                base.bytes_per_token_head, "tkv", base.meta))
        lines += arm_rows(lm.model, held, arms, b)
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
