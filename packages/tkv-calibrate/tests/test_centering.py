"""Key centering (the codec's ``k_channel_offset`` μ): fitting, selection, the bundle and the
TkvCache carrying it. Synthetic post-RoPE samples with a planted shared key mean."""

import json

import pytest
import torch

from tkv.calibrate.cache import TkvCache
from tkv.calibrate.calibrate import draft_bundle, fit_calibration
from tkv.calibrate.collect import KVCollection, LayerSamples
from tkv.calibrate.scales import choose_scales, key_offset
from tkv.codec import CalibrationBundle, ModelGeometry

H, D = 2, 32


def _samples(g, n=768, mean_scale=4.0) -> tuple[LayerSamples, torch.Tensor]:
    """One layer's samples: keys = N(0, 1) + μ (μ shared by the heads), values N(0, 1)."""
    mu = mean_scale * torch.randn(D, generator=g)
    k = torch.randn(n, H, D, generator=g) + mu
    v = torch.randn(n, H, D, generator=g)
    q = torch.randn(128, 2 * H, D, generator=g)
    q_sq = (q.double() ** 2).mean(dim=(0, 1))
    return LayerSamples(k, v, q, q_sq, None), mu


def test_key_offset_is_the_mean_over_tokens_and_heads():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(50, 3, 16, generator=g) * 3 + 1
    ref = k.double().reshape(-1, 16).mean(0)
    got = key_offset(k)
    assert got.dtype == torch.float32 and got.shape == (16,)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-6)


def test_choose_scales_centers_keys_with_a_shared_mean():
    g = torch.Generator().manual_seed(1)
    s, mu = _samples(g)
    train, held = slice(0, 512), slice(512, 768)
    sc = choose_scales(s, train, held, seed=0, center_keys="shared")
    assert sc.k_offset is not None and sc.k_offset.shape == (D,)
    # fitted on the training tokens only (not the held-out ones), close to the planted mean
    torch.testing.assert_close(sc.k_offset, key_offset(s.k[train]))
    assert (sc.k_offset - mu).abs().max() < 0.25
    # centering measured better than the best uncentered choice, which is no worse than plain
    assert sc.k_error < 0.5 * sc.k_error_uncentered
    assert sc.k_error_uncentered <= sc.k_error_unscaled + 1e-12
    off = choose_scales(s, train, held, seed=0, center_keys=False)
    assert off.k_offset is None
    assert off.k_error == off.k_error_uncentered == sc.k_error_uncentered


def test_per_head_offset_is_the_mean_over_tokens_per_head_and_beats_shared():
    """Planted per-head key means (heads differ): the per-head μ (H, D) is the float64 mean over
    the training tokens of each head, and its held-out key error beats the shared μ's."""
    g = torch.Generator().manual_seed(5)
    n = 768
    mu = 4.0 * torch.randn(H, D, generator=g)
    k = torch.randn(n, H, D, generator=g) + mu
    v = torch.randn(n, H, D, generator=g)
    q = torch.randn(128, 2 * H, D, generator=g)
    s = LayerSamples(k, v, q, (q.double() ** 2).mean(dim=(0, 1)), None)
    train, held = slice(0, 512), slice(512, 768)
    got = key_offset(k[train], per_head=True)
    assert got.dtype == torch.float32 and got.shape == (H, D)
    torch.testing.assert_close(got.double(), k[train].double().mean(0), rtol=0, atol=1e-6)
    per = choose_scales(s, train, held, seed=0, center_keys="per-head")
    shared = choose_scales(s, train, held, seed=0, center_keys="shared")
    assert per.k_offset.shape == (H, D) and shared.k_offset.shape == (D,)
    assert (per.k_offset - mu).abs().max() < 0.25
    assert per.k_error < 0.5 * shared.k_error
    assert per.k_error_uncentered == shared.k_error_uncentered
    assert choose_scales(s, train, held, seed=0, center_keys="off").k_offset is None
    with pytest.raises(ValueError, match="center_keys"):
        choose_scales(s, train, held, seed=0, center_keys="per-layer")


def _collection(g, layers=2, n=256):
    lays, mus = [], []
    for _ in range(layers):
        s, mu = _samples(g, n)
        lays.append(s)
        mus.append(mu)
    return KVCollection(lays, n, 2), mus


def test_bundle_carries_the_offset_and_tkv_cache_uses_it(tmp_path):
    g = torch.Generator().manual_seed(2)
    col, mus = _collection(g)
    geo = ModelGeometry(2, H, D)
    cal = fit_calibration(None, geo, torch.zeros(2, 128, dtype=torch.long), collection=col,
                          show_progress=False)
    assert cal.summary()["k_centered_layers"] == 2
    assert cal.summary()["k_logit_rel_mse_scaled"] < cal.summary()["k_logit_rel_mse_scaled_uncentered"]
    path = draft_bundle(cal).save(tmp_path / "b.json")
    raw = json.loads(path.read_text())
    # default centering is per head: H*D floats per layer, head-major
    assert all(len(layer["k_channel_offset"]) == H * D for layer in raw["layers"])
    b = CalibrationBundle.load(path)
    for i, sc in enumerate(cal.scales):
        codec = b.codec(i, 4, 4)
        torch.testing.assert_close(codec.k.channel_offset, sc.k_offset)
        assert codec.v.channel_offset is None
    # ablation: centering off writes no offset
    plain_cal = fit_calibration(None, geo, torch.zeros(2, 128, dtype=torch.long), collection=col,
                                show_progress=False, center_keys=False)
    assert plain_cal.summary()["k_centered_layers"] == 0
    plain_b = draft_bundle(plain_cal)
    raw = json.loads(plain_b.save(tmp_path / "plain.json").read_text())
    assert all("k_channel_offset" not in layer for layer in raw["layers"])
    assert plain_b.codec(0, 3, 3).k.channel_offset is None
    # TkvCache from the bundle stores k − μ and hands attention k̂ + μ: far better keys than
    # the same widths without the offset
    cache, plain = TkvCache.from_bundle(b, 4.0), TkvCache.from_bundle(plain_b, 4.0)
    k = torch.randn(1, H, 40, D, generator=g) + mus[0]
    v = torch.randn(1, H, 40, D, generator=g)
    kc, _ = cache.layers[0].update(k, v)
    kp, _ = plain.layers[0].update(k, v)
    err = lambda x: float(((x - k) ** 2).sum() / (k ** 2).sum())
    assert err(kc) < 0.5 * err(kp)


def test_goal_lines_check_bytes_vllm_ratio_and_needle():
    from tkv.calibrate.report import goal_lines

    def row(name, group, b, kl, dppl, budget=None):
        r = {"name": name, "group": group, "bytes_per_token_head": b, "kl": kl,
             "delta_ppl_pct": dppl}
        if budget is not None:
            r["budget"] = budget
        return r

    rows = [row("TKV@4 SmartMix", "smartmix", 68, 0.02, 1.5, 4.0),
            row("TKV@4 uniform K4V4", "tkv", 68, 0.03, 2.0, 4.0),
            row("TKV@5 SmartMix", "smartmix", 84, 0.006, 0.5, 5.0),
            row("KIVI int4 (K/ch g32, V/tok)", "peer", 80, 0.015, 1.1),
            row("fp8-e4m3 per-tensor", "peer", 128, 0.007, 0.7),
            row("vLLM turboquant_4bit_nc (2+2 bf16)", "peer", 94.8, 0.045, 4.0)]
    needle = {"summary": {"uncompressed": "10/12", "TKV@4": "9/12", "TKV@3": "11/12"}}
    md = "\n".join(goal_lines(rows, needle))
    assert "KL ≤ 0.0153 | 0.0200 | no (1.31× the goal)" in md
    assert "KL ratio ≤ 0.8 | 0.67 | yes" in md
    assert "0.85 × KIVI int4 (K/ch g32, V/tok) (68.0) | 68.0 | yes" in md
    assert "0.67 × fp8-e4m3 per-tensor (85.3) | 84.0 | yes" in md
    assert "KL ratio ≤ 0.5 | 0.44 | yes" in md
    assert "needle TKV@4 | passes = uncompressed (10/12) | 9/12 | no (1 cell(s) fewer)" in md
    assert "needle TKV@3 | misses ≤ 1 of 12 | 1 missed | yes" in md
    from tkv.calibrate.report import goal_verdicts

    v = goal_verdicts(rows, needle)
    assert len(v) == md.count("\n| ") - 1 and all(len(t) == 5 for t in v)   # - the header
    missed = [t for t in v if not t[-1].startswith("yes")]
    assert ("4", "TKV@4 SmartMix", "KL ≤ 0.0153", "0.0200", "no (1.31× the goal)") in missed
    assert ("4", "needle TKV@4", "passes = uncompressed (10/12)", "9/12",
            "no (1 cell(s) fewer)") in missed
    assert all(t[-1] == "yes" for t in v if t not in missed)


def test_goal_lines_keep_rejected_mix_goal_byte_miss_amounts_and_token_note():
    """A 4.0 mix rejected on held-out text ships the uniform row: the SmartMix goal still shows,
    as missed (ratio 1); a byte goal missed says by how many bytes; an evaluation on fewer than
    the goals' 16 × 1,024 test tokens says so under the table."""
    from tkv.calibrate.report import goal_lines, goal_verdicts

    rows = [{"name": "TKV@4 SmartMix (rejected)", "group": "smartmix-rejected", "budget": 4.0,
             "bytes_per_token_head": 68, "kl": 0.018, "delta_ppl_pct": 1.7},
            {"name": "TKV@4 uniform K4V4", "group": "tkv", "budget": 4.0,
             "bytes_per_token_head": 72, "kl": 0.015, "delta_ppl_pct": 1.0},
            {"name": "KIVI int4 (K/ch g32, V/tok)", "group": "peer", "bytes_per_token_head": 80,
             "kl": 0.015, "delta_ppl_pct": 1.1}]
    md = "\n".join(goal_lines(rows, windows=(8, 1024)))
    assert ("| 4 | SmartMix (mix rejected, uniform shipped) vs TKV@4 uniform K4V4 | "
            "KL ratio ≤ 0.8 | 1.00 | no (by 0.20) |") in md
    assert "(68.0) | 72.0 | no (+4.0 B over) |" in md
    assert "16 × 1,024 test tokens; this evaluation used 8 × 1,024" in md
    assert "this evaluation used" not in "\n".join(goal_lines(rows, windows=(16, 1024)))
    assert ("4", "SmartMix (mix rejected, uniform shipped) vs TKV@4 uniform K4V4",
            "KL ratio ≤ 0.8", "1.00", "no (by 0.20)") in goal_verdicts(rows)
