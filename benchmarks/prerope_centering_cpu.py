"""Design study (CPU): key centering before RoPE instead of after it.

tkv centers keys with a per-head mean μ of the *post-RoPE* keys (``k_channel_offset``). A
constant pre-RoPE component of the keys becomes, after RoPE, a vector that turns with the
position, so a position-independent μ only removes its low-frequency part. The alternative
measured here subtracts ``RoPE_t(μ_pre)`` — the per-head mean of the keys *before* RoPE,
rotated to each token's position t — before compression and adds it back after (an engine
would add ``q · RoPE_t(μ_pre)`` to every score: one extra dot per token against a per-position
cos/sin table).

Two numbers per layer: the key energy left after each centering (``E‖k − offset‖² / E‖k‖²``,
μ fitted on calibration windows 0-3), then teacher-forced KL / ΔPPL of the shipped bundle's
4.0 and 3.0 rows with the shipped centering vs pre-RoPE centering (same widths, codebooks and
K channel scales — the scales were fitted for post-RoPE centering) and pre-RoPE centering
without K scales. Baseline named in every ratio: the bundle row as shipped.

Held-out text: windows 6.. of 1,024 tokens of WikiText-2 *valid* (not used for calibration;
never the test split). Llama-style RoPE (``rotate_half``) as transformers applies it. Run from
the repository root::

    uv run --frozen python benchmarks/prerope_centering_cpu.py            # 3 held-out windows
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tkv.calibrate.data import default_calib_text, tokenize_windows
from tkv.calibrate.evaluate import Arm
from tkv.calibrate.pipeline import tkv_arm
from tkv.calibrate.quantizers import TkvQuantizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from design_study import TABLE_HEAD, WrappedQuantizer, arm_rows, finish, parse_and_load


def pre_rope_keys(model, windows: torch.Tensor) -> dict[int, torch.Tensor]:
    """k_proj outputs (keys before RoPE) per layer: float32 ``(W, T, num_kv_heads · head_dim)``."""
    got: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda mod, inp, out, j=j: got.setdefault(j, []).append(out.detach()))
        for j, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            for w in windows:
                model(w[None])
    finally:
        for h in hooks:
            h.remove()
    return {j: torch.cat(v, 0) for j, v in got.items()}


def rope(model, x: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``(B, H, T, d)`` at positions 0..T-1, as the model applies it to keys."""
    cos, sin = model.model.rotary_emb(x, torch.arange(x.shape[2])[None])
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


class PreRopeCentered(WrappedQuantizer):
    """A layer's tkv quantizer with keys centered by ``RoPE_t(μ_pre)`` instead of the codec's
    constant post-RoPE μ. Evaluation caches see whole windows in one chunk (positions 0..T-1)."""

    def __init__(self, q: TkvQuantizer, mu_pre: torch.Tensor, model, k_scales: bool = True):
        super().__init__(q, " pre-RoPE")
        self.mu, self.model = mu_pre, model
        q.codec.k.channel_offset = None
        if not k_scales:
            q.codec.k.channel_scales = None

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor):
        off = rope(self.model, self.mu[None, :, None, :].expand(k.shape).to(k.dtype))
        kk, vv = self.q.roundtrip(k - off, v)
        return kk + off, vv


def main() -> None:
    a, lm, bundle, t0 = parse_and_load(
        __doc__, "benchmarks/results/calibrate_smollm2_full_2026-11-30/tkv_bundle.json", 3,
        "benchmarks/results/prerope_centering_cpu.md")
    m = lm.model
    text = tokenize_windows(lm.tokenizer, default_calib_text(), 1024, 6 + a.windows)
    held, fit = text.subset(6, a.windows), text.subset(0, 4)
    hkv, d = m.config.num_key_value_heads, m.config.head_dim

    pre = pre_rope_keys(m, fit)
    mu_pre, energy = {}, []
    for j, k in sorted(pre.items()):
        k = k.view(k.shape[0], k.shape[1], hkv, d).transpose(1, 2)       # (W, H, T, d)
        mu_pre[j] = k.mean((0, 2))                                        # (H, d)
        post = rope(m, k)
        raw = post.pow(2).sum(-1).mean()
        e_post = (post - post.mean((0, 2), keepdim=True)).pow(2).sum(-1).mean() / raw
        e_pre = (post - rope(m, mu_pre[j][None, :, None, :].expand(k.shape))).pow(2).sum(-1).mean() / raw
        energy.append((j, float(e_post), float(e_pre)))

    lines = [f"# Key centering before vs after RoPE — SmolLM2-135M-Instruct, bundle `{Path(a.bundle).name}`",
             "", "## Key energy left after centering (calibration windows 0-3, all heads)", "",
             "| layers | post-RoPE μ (shipped) | pre-RoPE μ, re-rotated per position |",
             "|---|---:|---:|"]
    for lo in range(0, len(energy), 10):
        part = energy[lo:lo + 10]
        lines.append(f"| {part[0][0]}–{part[-1][0]} | {sum(e[1] for e in part) / len(part):.3f} | "
                     f"{sum(e[2] for e in part) / len(part):.3f} |")
    lines.append(f"| all (mean) | {sum(e[1] for e in energy) / len(energy):.3f} | "
                 f"{sum(e[2] for e in energy) / len(energy):.3f} |")
    lines += ["", f"## Fidelity (held-out: {a.windows} windows × 1,024 tokens of WikiText-2 valid, "
              "teacher-forced, every attention reads the quantize-dequantized cache)", "",
              *TABLE_HEAD]
    for b in a.budgets.split(","):
        def arm(b=b):
            return tkv_arm(bundle, bundle.allocation(b), f"TKV@{b}", "tkv")
        base = arm()
        arms = [base,
                Arm(f"TKV@{b}, pre-RoPE centering (shipped K scales)",
                    [PreRopeCentered(q, mu_pre[i], m) for i, q in enumerate(arm().quantizers)],
                    base.bytes_per_token_head),
                Arm(f"TKV@{b}, pre-RoPE centering, no K scales",
                    [PreRopeCentered(q, mu_pre[i], m, k_scales=False)
                     for i, q in enumerate(arm().quantizers)], base.bytes_per_token_head)]
        lines += arm_rows(m, held, arms, b)
    finish(lines, t0, a.out)


if __name__ == "__main__":
    main()
