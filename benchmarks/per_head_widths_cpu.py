"""Per-head widths study (CPU): would SmartMix reach its goal (KL ≤ 0.8× the best uniform
allocation at 4.0 bits/element) if each KV head of a layer could take its own (k_bits, v_bits)?

Today SmartMix picks one (k_bits, v_bits) per layer (SmolLM2: 30 layers × 3 KV heads). Here the
same solver runs at two granularities on the same measurements:

1. Sensitivity, measured (no distortion model): on calibration windows (WikiText-2 *valid*
   windows 0.., the text the bundle was fitted on), the mean KL of next-token distributions vs
   uncompressed when ONLY one (layer, side) — or one (layer, KV head, side) — reads a
   quantize-dequantized cache, at each width in ``--widths`` (default 3, 4, 5: the widths the
   shipped 4.0 row uses); ``--sens-windows`` windows of ``--sens-tokens`` tokens.
2. Allocation: an exact multiple-choice knapsack (dynamic programming over the code bytes;
   norms are the same for every width) minimizing the summed KL under the byte budget of
   uniform K4V4 — per layer (a choice for all three heads of a side at once) and per head.
3. Verification on held-out text (windows 6.. of WikiText-2 *valid*, never the test split):
   teacher-forced mean KL, ΔPPL and top-1 of uniform K4V4 (the named baseline), the per-layer
   allocation and the per-head allocation, every layer reading the bundle's calibrated codecs.

Run from the repository root::

    uv run --frozen python benchmarks/per_head_widths_cpu.py --sens-windows 2 --windows 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from tkv.calibrate.cache import QuantizedKVCache
from tkv.calibrate.data import default_calib_text, tokenize_windows
from tkv.calibrate.evaluate import Arm
from tkv.calibrate.metrics import compare_logits
from tkv.calibrate.model import load_model
from tkv.calibrate.progress import bar
from tkv.calibrate.quantizers import compress_bhtd, decompress_bhtd
from tkv.calibrate.runner import PrefixRunner
from tkv.codec import CalibrationBundle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import TABLE_HEAD, arm_rows, finish, held_out_windows

SIDES = ("k", "v")
_CODECS: dict = {}   # (bundle id, layer, bits) → codec, shared by every configuration


def roundtrip_side(codec, side: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` float ``(B, H, T, d)`` through the codec's K or V path (all heads)."""
    c = codec.k if side == "k" else codec.v
    return decompress_bhtd(c, *compress_bhtd(c, x), x.dtype)


class HeadSides:
    """One layer's quantizer with its own width per (KV head, side); ``None`` = exact.

    ``bits[side][h]``: the width of head ``h``'s side (or None). Codecs come from the bundle
    (per layer; a width pair's codec serves every head, each head keeps its own slice)."""

    def __init__(self, bundle: CalibrationBundle, layer: int, bits: dict[str, list]):
        self.bits = bits
        self.name = "per-head"
        self._codecs = {}
        for side in SIDES:
            for b in bits[side]:
                if b is not None and b not in self._codecs:
                    key = (id(bundle), layer, b)
                    if key not in _CODECS:
                        _CODECS[key] = bundle.codec(layer, b, b, check_finite=False)
                    self._codecs[b] = _CODECS[key]

    def roundtrip(self, k, v):
        out = []
        for side, x in (("k", k), ("v", v)):
            y = x
            for b in sorted({b for b in self.bits[side] if b is not None}):
                q = roundtrip_side(self._codecs[b], side, x)
                heads = [h for h, hb in enumerate(self.bits[side]) if hb == b]
                if y is x:
                    y = x.clone()
                y[:, heads] = q[:, heads]
            out.append(y)
        return out[0], out[1]

    def bytes_per_token_head(self) -> float:
        d = 64
        per = [d * b / 8 + 2 for side in SIDES for b in self.bits[side]]
        return sum(per) / len(self.bits["k"])


def measure(model, windows: torch.Tensor, bundle: CalibrationBundle, widths, num_layers: int,
            num_heads: int):
    """``kl[(layer, head or None, side, bits)]`` mean KL (nats per token) with only that
    layer (head) side quantized; head None = all heads of the layer."""
    configs = [(layer, h, s, b) for layer in range(num_layers)
               for h in (None, *range(num_heads)) for s in SIDES for b in widths]
    sums = dict.fromkeys(configs, 0.0)
    count = 0
    pb = bar(windows.shape[0] * len(configs), "sensitivity", True, "pass")
    for i in range(windows.shape[0]):
        run = PrefixRunner(model, windows[i:i + 1])
        blp = torch.log_softmax(run.base_logits, -1)
        for c in configs:
            layer, h, s, b = c
            bits = {side: [None] * num_heads for side in SIDES}
            for hh in (range(num_heads) if h is None else (h,)):
                bits[s][hh] = b
            qs = [None] * num_layers
            qs[layer] = HeadSides(bundle, layer, bits)
            logits = run.logits_from(layer, QuantizedKVCache(qs))
            sums[c] += compare_logits(run.base_logits, logits, None, blp).kl
            pb.update(1)
        count += run.base_logits.shape[0]
    pb.close()
    return {c: v / count for c, v in sums.items()}


def knapsack(groups: list[list[tuple[int, float]]], cap: int) -> list[int]:
    """Exact multiple-choice knapsack: ``groups[g]`` = [(cost, value)], pick one per group,
    total cost ≤ cap (integers), minimum total value. Returns the chosen index per group."""
    inf = float("inf")
    best = [0.0] + [inf] * cap        # best[c] = min value with total cost exactly c
    choice = []
    for items in groups:
        nxt = [inf] * (cap + 1)
        pick = [-1] * (cap + 1)
        for c0 in range(cap + 1):
            if best[c0] == inf:
                continue
            for j, (cost, val) in enumerate(items):
                c1 = c0 + cost
                if c1 <= cap and best[c0] + val < nxt[c1]:
                    nxt[c1], pick[c1] = best[c0] + val, j
        choice.append(pick)
        best = nxt
    c = min(range(cap + 1), key=lambda x: best[x])
    out = []
    for g in range(len(groups) - 1, -1, -1):
        j = choice[g][c]
        out.append(j)
        c -= groups[g][j][0]
    return out[::-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="benchmarks/results/calibrate_smollm2_sink_offset_2026-11-30/"
                    "tkv_bundle.json")
    ap.add_argument("--widths", default="3,4,5")
    ap.add_argument("--sens-windows", type=int, default=2)
    ap.add_argument("--sens-tokens", type=int, default=512,
                    help="tokens per sensitivity window (each configuration reruns the model "
                         "from its layer: 1,440 passes at the defaults)")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/per_head_widths_cpu.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lm, bundle = load_model(None), CalibrationBundle.load(a.bundle)
    geo = bundle.geometry
    nl, nh = geo.num_layers, geo.num_kv_heads
    widths = [int(w) for w in a.widths.split(",")]
    sens_ids = tokenize_windows(lm.tokenizer, default_calib_text(), a.sens_tokens,
                                a.sens_windows).subset(0, a.sens_windows)
    kl = measure(lm.model, sens_ids, bundle, widths, nl, nh)
    t_sens = time.perf_counter() - t0
    # additivity check: sum over heads vs the whole layer, per (layer, side, width)
    ratios = [sum(kl[(layer, h, s, b)] for h in range(nh)) / max(kl[(layer, None, s, b)], 1e-12)
              for layer in range(nl) for s in SIDES for b in widths]
    # budgets in code-bit units (norms identical across widths): uniform K4V4
    layer_groups = [[(nh * b, kl[(layer, None, s, b)]) for b in widths]
                    for layer in range(nl) for s in SIDES]
    head_groups = [[(b, kl[(layer, h, s, b)]) for b in widths]
                   for layer in range(nl) for h in range(nh) for s in SIDES]
    cap = nl * nh * 2 * 4
    pl = knapsack(layer_groups, cap)
    ph = knapsack(head_groups, cap)
    arms = []
    uni = [HeadSides(bundle, layer, {s: [4] * nh for s in SIDES}) for layer in range(nl)]
    arms.append(Arm("uniform K4V4", uni, 68.0, "tkv"))
    per_layer, per_head, g = [], [], 0
    for layer in range(nl):
        bits = {s: [widths[pl[2 * layer + i]]] * nh for i, s in enumerate(SIDES)}
        per_layer.append(HeadSides(bundle, layer, bits))
        hb = {s: [None] * nh for s in SIDES}
        for h in range(nh):
            for s in SIDES:
                hb[s][h] = widths[ph[g]]
                g += 1
        per_head.append(HeadSides(bundle, layer, hb))
    mean_bits = [sum(sum(b for b in q.bits[s]) for q in qs for s in SIDES) / (nl * nh * 2)
                 for qs in (per_layer, per_head)]
    arms.append(Arm(f"per-layer mix (K/V {mean_bits[0]:.2f} bits)", per_layer, 68.0, "smartmix"))
    arms.append(Arm(f"per-head mix (K/V {mean_bits[1]:.2f} bits)", per_head, 68.0, "smartmix"))
    held = held_out_windows(lm.tokenizer, a.windows)
    pred = [sum(kl[(layer, None, s, 4)] for layer in range(nl) for s in SIDES),
            sum(v[j][1] for v, j in zip(layer_groups, pl, strict=True)),
            sum(v[j][1] for v, j in zip(head_groups, ph, strict=True))]
    lines = [f"# Per-head widths study — SmolLM2-135M-Instruct, bundle `{a.bundle}`", "",
             f"Sensitivity measured on {a.sens_windows} calibration windows × {a.sens_tokens} "
             f"tokens of WikiText-2 *valid* (the first ones); widths {widths}; "
             f"{len(kl)} single-(layer[, head], side) configurations ({t_sens:.0f} s). "
             f"Held-out verification: {a.windows} windows × 1,024 tokens of WikiText-2 *valid* "
             "(windows 6..; never the test split), teacher-forced, every attention reading the "
             "quantize-dequantized cache. Budget: uniform K4V4's code bytes (4.0 bits/element; "
             "norms are the same for every allocation). Baseline named in every ratio: uniform "
             "K4V4.", "",
             "Additivity of the per-head measurements (Σ over the 3 heads ÷ the whole layer, "
             f"per layer, side and width): median {sorted(ratios)[len(ratios) // 2]:.2f}, "
             f"range {min(ratios):.2f}–{max(ratios):.2f}.", "",
             "Predicted summed KL (calibration windows): uniform K4V4 "
             f"{pred[0]:.4f}, per-layer {pred[1]:.4f} ({pred[1] / pred[0]:.2f}×), per-head "
             f"{pred[2]:.4f} ({pred[2] / pred[0]:.2f}×).", "", *TABLE_HEAD]
    lines += arm_rows(lm.model, held, arms, "4.0")
    lines += ["", "Per-head widths (layer: K heads / V heads): " + "; ".join(
        f"{layer}: {'/'.join(map(str, q.bits['k']))} | {'/'.join(map(str, q.bits['v']))}"
        for layer, q in enumerate(per_head))]
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
