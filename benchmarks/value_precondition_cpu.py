"""Value-preconditioning study (CPU): a full (non-diagonal) transform of the values before the
rotation, in place of the diagonal value channel scales.

The shipped codec stores ``R(v / s)`` with a diagonal ``s`` fitted to the value channel energy
and the o_proj column energy (``tkv.calibrate.scales``). The value error ``e`` reaches the
layer output as ``W_o e`` (weighted by attention), so with the second moments ``C = E vvᵀ`` and
``M = Σ_g W_gᵀ W_g`` (the o_proj columns of the KV head's GQA group) the rotated quantizer's
expected output error ``tr(A C Aᵀ) · tr(A⁻ᵀ M A⁻¹)`` for a transform ``u = A v`` is minimized by
``AᵀA = C⁻¹ # M`` (matrix geometric mean; the same bound the key-preconditioning study used
for keys with ``E qqᵀ``). On SmolLM2 the proxy (layer mean, calibration text) is 0.963 of no
scaling for the diagonal scales, 0.885 for one full ``A`` per layer and 0.779 for one per KV head
— this script measures what that does to the drift. A kernel would fold ``A`` into its dense
input rotation and ``A⁻¹`` into the output unrotation (per KV head: per-head matrices).

Arms (the V side only; keys as the bundle codes them): the bundle's row (baseline); a check
arm that sends the bundle's own diagonal scales through the study's path (Gaussian value
codebook; the value sink offset kept, moved into the transformed space); full ``A`` per layer;
full ``A`` per KV head. Fitted on WikiText-2 *valid* windows 0-5 of 1,024 tokens; held-out:
windows 6.. (never the test split). Run from the repository root::

    uv run --frozen python benchmarks/value_precondition_cpu.py --bundle tkv-calibration/tkv_bundle.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tkv.calibrate.collect import collect_kv
from tkv.calibrate.evaluate import Arm
from tkv.calibrate.pipeline import tkv_arm
from tkv.codec import TurboKVCodec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import (
    HELD_OUT_FIRST,
    TABLE_HEAD,
    WrappedQuantizer,
    arm_rows,
    finish,
    fit_windows,
    geometric_mean_root,
    held_out_windows,
    parse_and_load,
)


def value_transform(c: torch.Tensor, m: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """``A = (C⁻¹ # M)^½`` (float64 ``(d, d)``, symmetric) from the value second moment ``c``
    and the output metric ``m`` (:func:`design_study.geometric_mean_root`)."""
    return geometric_mean_root(c, m, eps)


class PreconditionedValues(WrappedQuantizer):
    """A layer quantizer: K as the bundle's codec codes it; V of head h as
    ``A_h⁻¹ · Q_h(A_h v)`` where ``Q_h`` is a plain codec of the layer's V width whose value sink
    offset is the bundle's, moved into the transformed space (``A_h σ_h``)."""

    def __init__(self, base, codecs: list[TurboKVCodec], mats: list[torch.Tensor]):
        super().__init__(base, "+A")
        self.codecs, self.a = codecs, [m.float() for m in mats]
        self.ainv = [torch.linalg.inv(m).float() for m in mats]

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor):
        kk, _ = self.q.roundtrip(k, v)
        out = torch.empty_like(v)
        for h in range(v.shape[1]):
            c = self.codecs[h]
            u = v[:, h].float() @ self.a[h].T
            uh = c.decompress_v(*c.compress_v(u))
            out[:, h] = (uh @ self.ainv[h].T).to(v.dtype)
        return kk, out


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(__doc__, "tkv-calibration/tkv_bundle.json", 4,
                                       "benchmarks/results/value_precondition_cpu.md")
    fit = fit_windows(lm.tokenizer)
    col = collect_kv(lm.model, fit, show_progress=False)
    held = held_out_windows(lm.tokenizer, a.windows)
    d = bundle.geometry.head_dim
    lines = [f"# Value-preconditioning study — SmolLM2-135M-Instruct, bundle `{a.bundle}`", "",
             f"Fitted on WikiText-2 *valid* windows 0-{HELD_OUT_FIRST - 1} (1,024 tokens each); "
             f"held-out: {a.windows} windows × 1,024 tokens of *valid* (windows "
             f"{HELD_OUT_FIRST}..; never the test split). Teacher-forced, every attention reads "
             "the quantize-dequantized cache. Baseline named in every ratio: the bundle's row "
             "(diagonal value scales).", "", *TABLE_HEAD]
    tags = ("check: the bundle's diagonal scales", "full A per layer", "full A per KV head")
    mats = {tag: [] for tag in tags}   # tag -> per layer: per-head (d, d) transforms (any budget)
    for li, s in enumerate(col.layers):
        h, g = s.v.shape[1], s.q.shape[1] // s.v.shape[1]
        w = s.o_proj.double()
        cs = [s.v[:, i].double().T @ s.v[:, i].double() / s.v.shape[0] for i in range(h)]
        ms = [sum(w[:, (i * g + j) * d:(i * g + j + 1) * d].T
                  @ w[:, (i * g + j) * d:(i * g + j + 1) * d] for j in range(g))
              for i in range(h)]
        sc = bundle.layers[li].v_channel_scales      # the codec holds them as float32
        mats[tags[0]].append([torch.diag(1 / torch.tensor(sc, dtype=torch.float32).double())
                              if sc is not None else torch.eye(d, dtype=torch.float64)] * h)
        mats[tags[1]].append([value_transform(sum(cs) / h, sum(ms) / h)] * h)
        mats[tags[2]].append([value_transform(cs[i], ms[i]) for i in range(h)])
    for b in a.budgets.split(","):
        alloc = bundle.allocation(b)
        base = tkv_arm(bundle, alloc, f"TKV@{b} (bundle row: diagonal value scales)", "tkv")
        arms = [base]
        for tag in tags:
            qs = []
            for li, per_head in enumerate(mats[tag]):
                sig = bundle.codec(li, alloc.k_bits[li], alloc.v_bits[li],
                                   check_finite=False).v.sink_offset
                codecs = []
                for i, m in enumerate(per_head):
                    so = None
                    if sig is not None:
                        si = sig.double().reshape(-1, d)
                        so = (m @ si[i if si.shape[0] > 1 else 0]).float()
                    codecs.append(TurboKVCodec(d, k_bits=alloc.k_bits[li], v_bits=alloc.v_bits[li],
                                               seed=bundle.seed, v_sink_offset=so,
                                               check_finite=False))
                qs.append(PreconditionedValues(base.quantizers[li], codecs, per_head))
            arms.append(Arm(tag, qs, base.bytes_per_token_head, "tkv", base.meta))
        lines += arm_rows(lm.model, held, arms, b)
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
