"""Shared parts of the CPU design studies (``sink_tokens_cpu.py``, ``prerope_centering_cpu.py``):
evaluate arms of one budget teacher-forced on held-out windows and print/write the report."""

from __future__ import annotations

import time
from pathlib import Path

from tkv.calibrate.evaluate import evaluate_arms


class WrappedQuantizer:
    """Base of the studies' arm quantizers: wraps a layer quantizer ``q`` (kept as ``self.q``),
    names itself ``q.name + suffix`` and prices bytes as ``q`` does; subclasses override
    ``roundtrip(k, v)`` (float ``(B, H, T, d)`` → the pair the cache returns)."""

    def __init__(self, q, suffix: str = ""):
        self.q, self.name = q, q.name + suffix

    def roundtrip(self, k, v):
        return self.q.roundtrip(k, v)

    def bytes_per_token_head(self) -> float:
        return self.q.bytes_per_token_head()


HELD_OUT_FIRST = 6   # the bundle was fitted on the calibration text before window 6 (of 1,024)


def fit_windows(tokenizer):
    """The studies' fitting text: windows ``0 .. HELD_OUT_FIRST - 1`` of 1,024 tokens of
    WikiText-2 *valid* — everything before :func:`held_out_windows`, int64
    ``(HELD_OUT_FIRST, 1024)``."""
    from tkv.calibrate.data import default_calib_text, tokenize_windows

    return tokenize_windows(tokenizer, default_calib_text(), 1024,
                            HELD_OUT_FIRST).subset(0, HELD_OUT_FIRST)


def held_out_windows(tokenizer, count: int):
    """The studies' held-out text: ``count`` windows of 1,024 tokens of WikiText-2 *valid*
    from window :data:`HELD_OUT_FIRST` on (not used for calibration; never the test split),
    int64 ``(count, 1024)``."""
    from tkv.calibrate.data import default_calib_text, tokenize_windows

    return tokenize_windows(tokenizer, default_calib_text(), 1024,
                            HELD_OUT_FIRST + count).subset(HELD_OUT_FIRST, count)


TABLE_HEAD = ["| budget | arm | mean KL | KL ÷ baseline | ΔPPL | top-1 |",
              "|---|---|---:|---:|---:|---:|"]


def arm_rows(model, held, arms, budget: str) -> list[str]:
    """Markdown rows of ``arms`` (the first is the baseline every ratio names) at ``budget``:
    mean KL vs the uncompressed model, KL ratio, ΔPPL, top-1 agreement — teacher-forced on
    ``held`` (int64 ``(windows, tokens)``), every attention reading the arm's cache."""
    res = evaluate_arms(model, held, arms, decode=False, show_progress=True, desc=f"TKV@{budget}")
    kl0 = res.arms[0].tf.mean_kl
    return [f"| {budget} | {r.name} | {r.tf.mean_kl:.4f} | {r.tf.mean_kl / kl0:.2f} | "
            f"{100 * (r.tf.ppl / res.base.ppl - 1):+.2f} % | {100 * r.tf.top1_agree:.1f} % |"
            for r in res.arms]


def finish(lines: list[str], t0: float, out: str | Path, reading: str | None = None) -> None:
    """Append the reading (if any), the command line this process ran with and the wall time;
    print the report and write it to ``out``."""
    import sys

    if reading:
        lines += ["", reading]
    command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    lines += ["", f"Command: `{command}`; wall time {time.perf_counter() - t0:.0f} s "
              "(2-core CPU)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(out).write_text(text)


def parse_and_load(doc: str, bundle: str, windows: int, out: str, extra=None):
    """The studies' common command line (``--bundle --budgets --windows --threads --out``,
    plus what ``extra(parser)`` adds), then torch threads set, the model (SmolLM2 default) and
    the bundle loaded. Returns ``(args, loaded_model, bundle, t0)``."""
    import argparse

    import torch

    from tkv.calibrate.model import load_model
    from tkv.codec import CalibrationBundle

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--bundle", default=bundle)
    ap.add_argument("--budgets", default="4.0,3.0")
    ap.add_argument("--windows", type=int, default=windows)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=out)
    if extra is not None:
        extra(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    return a, load_model(None), CalibrationBundle.load(a.bundle), t0


def sqrtm(m, inverse: bool = False):
    """Symmetric square root (or inverse square root) of a symmetric positive semi-definite
    float64 matrix ``m``, eigenvalues clamped at 1e-12."""
    import torch

    w, v = torch.linalg.eigh((m + m.T) / 2)
    w = w.clamp_min(1e-12)
    return (v * (w.rsqrt() if inverse else w.sqrt())) @ v.T


def geometric_mean_root(a, b, eps: float = 1e-3):
    """``(A⁻¹ # B)^½`` — the symmetric root of the matrix geometric mean of ``A⁻¹`` and ``B``
    (``G A G = B``), float64 ``(d, d)``: the transform minimizing ``tr(P A Pᵀ)·tr(P⁻ᵀ B P⁻¹)``-type
    error bounds of the key / value preconditioning studies. Both second moments are
    ridge-regularized by ``eps`` × their mean eigenvalue first."""
    import torch

    d = a.shape[0]
    eye = torch.eye(d, dtype=torch.float64)
    a = a.double() + eps * a.trace() / d * eye
    b = b.double() + eps * b.trace() / d * eye
    ah, aih = sqrtm(a), sqrtm(a, inverse=True)
    return sqrtm(aih @ sqrtm(ah @ b @ ah) @ aih)

