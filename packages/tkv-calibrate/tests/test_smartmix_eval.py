import math

import pytest
import torch

from tkv.calibrate.cache import QuantizedKVCache, TkvCache
from tkv.calibrate.calibrate import draft_bundle
from tkv.calibrate.evaluate import evaluate_arms
from tkv.calibrate.peers import (
    Fp8Quantizer,
    KiviQuantizer,
    VllmTurboQuantQuantizer,
    peer_arms,
    uncalibrated_arm,
)
from tkv.calibrate.sensitivity import measure_sensitivity
from tkv.calibrate.smartmix import (
    allocation_bytes,
    budget_cap_bytes,
    check_budget,
    predicted_drift,
    solve_mix,
    uniform_candidates,
)
from tkv.codec import ModelGeometry, ModelLayout, TkvBitsError


@pytest.fixture(scope="module")
def sensitivity(tiny, windows, calibration):
    return measure_sensitivity(tiny.model, windows[3:4], draft_bundle(calibration),
                               calibration.distortion, validation_per_width=3, show_progress=False)


def test_sensitivity_measured_and_validated(sensitivity, tiny):
    n = tiny.geometry.num_layers
    assert len(sensitivity.probe["k"]) == n and len(sensitivity.probe["v"]) == n
    assert all(x > 0 for x in sensitivity.probe["k"] + sensitivity.probe["v"])
    # Fewer bits must be predicted to cost more drift, for every layer and side.
    t = sensitivity.table()
    for side in ("k", "v"):
        assert torch.all(t[side][:, :-1] > t[side][:, 1:])
    c = sensitivity.correlation()
    assert c["n"] == 9 and c["spearman"] > 0.5


def test_sensitivity_validation_is_leave_one_out(sensitivity):
    """Each validation point is predicted with the exponent fitted on the OTHER points (least
    squares through 0 in log space), recomputed here from the measured values; the shipped
    exponent uses all of them."""
    import math

    s = sensitivity
    pts = [(layer, side, b, m, math.log(s.distortion(layer, side, b)
                                         / s.distortion(layer, side, s.probe_bits)),
            math.log(m / s.probe[side][layer])) for layer, side, b, m, _ in s.validation]
    assert math.isclose(s.gamma, sum(x * y for *_, x, y in pts) / sum(x * x for *_, x, y in pts),
                        rel_tol=1e-9)
    for i, (layer, side, *_) in enumerate(pts):
        rest = pts[:i] + pts[i + 1:]
        g = sum(x * y for *_, x, y in rest) / sum(x * x for *_, x, y in rest)
        want = s.probe[side][layer] * math.exp(g * pts[i][4])
        assert math.isclose(s.validation[i][4], want, rel_tol=1e-9)
        assert not math.isclose(g, s.gamma, rel_tol=1e-12)   # really left out


def test_budget_cap_is_priced_by_layout():
    geo = ModelGeometry(30, 3, 64)
    cap = budget_cap_bytes(geo, 4.0)
    assert cap == ModelLayout.uniform(30, 64, 3, 4, 4, 16).bytes_per_token == 30 * 3 * 68
    # 2.5 bits: the bytes of K2V3.
    assert budget_cap_bytes(geo, 2.5) == ModelLayout.uniform(30, 64, 3, 2, 3, 16).bytes_per_token
    for bad in (1.9, 8.5, float("nan"), "x"):
        with pytest.raises(TkvBitsError):
            check_budget(bad)


@pytest.mark.parametrize("budget", [2.0, 2.5, 3.0, 4.0, 5.5, 8.0])
def test_solver_respects_budget_and_beats_uniform_prediction(budget):
    g = torch.Generator().manual_seed(int(budget * 10))
    geo = ModelGeometry(6, 2, 32)
    base_k = torch.rand(6, 1, generator=g, dtype=torch.float64) * 10
    base_v = torch.rand(6, 1, generator=g, dtype=torch.float64)
    decay = 4.0 ** -torch.arange(7, dtype=torch.float64)
    pred = {"k": base_k * decay, "v": base_v * decay}
    cap = budget_cap_bytes(geo, budget)
    plan = solve_mix(pred, geo, cap)
    assert plan.bytes_per_token <= cap + 1e-9
    assert plan.bytes_per_token == allocation_bytes(geo, plan.allocation)
    assert math.isclose(plan.predicted_kl, predicted_drift(pred, plan.allocation.k_bits,
                                                           plan.allocation.v_bits))
    n = geo.num_layers
    for kb, vb in uniform_candidates(geo, cap):  # the exact optimum is never worse than uniform
        assert plan.predicted_kl <= predicted_drift(pred, (kb,) * n, (vb,) * n) + 1e-12


@pytest.mark.parametrize("widths,budget", [((2, 4), 3.0), ((2, 4, 8), 5.0), ((4,), 4.0),
                                           ((3, 5), 4.0)])
def test_solver_keeps_to_the_allowed_widths(widths, budget):
    """``widths`` (``--mix-widths``): every side of the solved mix and every uniform candidate
    uses only those widths, within the byte cap; a cap no allocation of them fits is a
    TkvBitsError naming the widths; bad width sets are TkvBitsErrors."""
    from tkv.calibrate.smartmix import check_widths

    g = torch.Generator().manual_seed(len(widths))
    geo = ModelGeometry(5, 2, 32)
    decay = 4.0 ** -torch.arange(7, dtype=torch.float64)
    pred = {s: torch.rand(5, 1, generator=g, dtype=torch.float64) * decay for s in "kv"}
    cap = budget_cap_bytes(geo, budget)
    plan = solve_mix(pred, geo, cap, widths)
    assert set(plan.allocation.k_bits) | set(plan.allocation.v_bits) <= set(widths)
    assert plan.bytes_per_token <= cap + 1e-9
    full = solve_mix(pred, geo, cap)
    assert full.predicted_kl <= plan.predicted_kl + 1e-12     # fewer choices never predict better
    assert all(kb in widths and vb in widths for kb, vb in uniform_candidates(geo, cap, widths))
    with pytest.raises(TkvBitsError, match=r"widths \[8\]"):
        solve_mix(pred, geo, budget_cap_bytes(geo, 3.0), (8,))
    assert check_widths([8, 2, 4, 2]) == (2, 4, 8)
    for bad in ([], [1], [9], [4.0], [True]):
        with pytest.raises(TkvBitsError):
            check_widths(bad)


def test_solver_exact_on_small_problem():
    """Brute force over all allocations of 2 layers agrees with the DP."""
    import itertools

    geo = ModelGeometry(2, 1, 16)
    g = torch.Generator().manual_seed(3)
    pred = {"k": torch.rand(2, 7, generator=g, dtype=torch.float64).sort(descending=True).values,
            "v": torch.rand(2, 7, generator=g, dtype=torch.float64).sort(descending=True).values}
    cap = budget_cap_bytes(geo, 3.5)
    best = min((predicted_drift(pred, (a, b), (c, d)), (a, b, c, d))
               for a, b, c, d in itertools.product(range(2, 9), repeat=4)
               if ModelLayout.from_allocation(16, 1, (a, b), (c, d), 16).bytes_per_token <= cap)
    assert math.isclose(solve_mix(pred, geo, cap).predicted_kl, best[0])


def test_tkv_cache_8bit_greedy_matches_uncompressed(tiny):
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    m = tiny.model
    g0 = m.generate(ids, max_new_tokens=12, do_sample=False)
    for prefill in ("bypass", "compressed"):
        cache = TkvCache.uniform(tiny.geometry.num_layers, 32, 8, 8, prefill=prefill)
        g1 = m.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
        assert torch.equal(g0, g1)
        assert cache.compressed_bytes() > 0
        assert cache.layers[0].k_codes.dtype == torch.uint8


def test_tkv_cache_stores_packed_codes_of_layout_size(tiny):
    cache = TkvCache.uniform(tiny.geometry.num_layers, 32, 3, 5)
    with torch.inference_mode():
        tiny.model(torch.randint(0, 256, (1, 10)), cache=cache, use_cache=True)
    lay = ModelLayout.uniform(tiny.geometry.num_layers, 32, 2, 3, 5, 16)
    assert cache.compressed_bytes() == 10 * sum(x.ideal_bytes_per_token for x in lay.layers)


def test_prefill_bypass_reads_raw_prompt(tiny):
    """With bypass the prompt's logits equal the uncompressed ones; compressed ones differ."""
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = tiny.model(ids).logits
        byp = tiny.model(ids, cache=TkvCache.uniform(4, 32, 2, 2, "bypass"), use_cache=True).logits
        com = tiny.model(ids, cache=TkvCache.uniform(4, 32, 2, 2), use_cache=True).logits
    torch.testing.assert_close(byp, ref)
    assert not torch.allclose(com, ref, atol=1e-3)


def test_peer_quantizers_bytes_and_error():
    d = 64
    assert Fp8Quantizer(d).bytes_per_token_head() == 128
    assert KiviQuantizer(d).bytes_per_token_head() == 80
    expect = {"turboquant_k8v4": 100, "turboquant_4bit_nc": 70, "turboquant_3bit_nc": 54}
    for p, b in expect.items():
        assert VllmTurboQuantQuantizer(d, p).bytes_per_token_head() == b
    # At head_dim 128 the published slot sizes: 196/134/118/102.
    assert [VllmTurboQuantQuantizer(128, p).bytes_per_token_head() for p in
            ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
             "turboquant_3bit_nc")] == [196, 134, 118, 102]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 40, d, generator=g), torch.randn(1, 2, 40, d, generator=g)
    errs = {}
    for q in (Fp8Quantizer(d), KiviQuantizer(d), VllmTurboQuantQuantizer(d, "turboquant_4bit_nc"),
              VllmTurboQuantQuantizer(d, "turboquant_3bit_nc")):
        kh, vh = q.roundtrip(k, v)
        assert kh.shape == k.shape and vh.shape == v.shape
        errs[q.name] = float(((kh - k) ** 2).mean() / (k ** 2).mean())
        assert 0 < errs[q.name] < 0.2
    assert errs["vLLM turboquant_4bit_nc"] < errs["vLLM turboquant_3bit_nc"]
    with pytest.raises(ValueError):
        VllmTurboQuantQuantizer(d, "turboquant_9bit")


def test_evaluate_arms_metrics(tiny, windows, calibration):
    n = tiny.geometry.num_layers
    arms = [uncalibrated_arm(n, 32, 8), uncalibrated_arm(n, 32, 2), *peer_arms(n, 32)]
    res = evaluate_arms(tiny.model, windows[4:6], arms, show_progress=False)
    r = {a.name: a for a in res.arms}
    k8, k2 = r["uncalibrated TurboQuant K8V8"], r["uncalibrated TurboQuant K2V2"]
    assert 0 <= k8.tf.mean_kl < k2.tf.mean_kl
    assert k8.tf.top1_agree >= k2.tf.top1_agree
    assert k2.decode.positions == 2 * 32 and k2.tf.positions == 2 * 64
    assert res.base.ppl > 1 and math.isfinite(k2.tf.ppl)
    # vLLM presets keep 2+2 boundary layers uncompressed (of 4 → capped at 2 layers each end).
    arm = next(a for a in arms if "k8v4" in a.name)
    assert arm.quantizers[0] is None


def test_quantized_cache_load_prefix_rejects_wrong_layers():
    from tkv.codec.errors import ShapeError

    c = QuantizedKVCache([None, None])
    with pytest.raises(ShapeError):
        c.load_prefix([(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))])


def _decoded(layer):
    """What the layer's packed codes and norms decode to, ``(B, H, T, d)`` per side."""
    return layer.quantizer.decode((layer.k_codes, layer.k_norms), (layer.v_codes, layer.v_norms),
                                  layer.keys.dtype)


def _codes_match_mirror(cache):
    for layer in cache.layers:
        k, v = _decoded(layer)
        assert k.shape == layer.keys.shape and torch.equal(k, layer.keys)
        assert torch.equal(v, layer.values)


def test_tkv_cache_codes_follow_every_cache_operation(tiny):
    """Beam search, crop, batch select / repeat and reset keep the packed codes decoding to
    exactly the K/V attention reads (they used to touch only the dequantized mirror)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    cache = TkvCache.uniform(tiny.geometry.num_layers, 32, 4, 3)
    tiny.model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=2, cache=cache)
    _codes_match_mirror(cache)
    cache.reorder_cache(torch.tensor([3, 0, 2, 1]))
    _codes_match_mirror(cache)
    t = cache.layers[0].keys.shape[-2]
    cache.crop(-3)
    assert cache.layers[0].k_codes.shape[2] == cache.layers[0].k_norms.shape[2] == t - 3
    _codes_match_mirror(cache)
    cache.batch_select_indices(torch.tensor([1, 3]))
    _codes_match_mirror(cache)
    cache.batch_repeat_interleave(2)
    assert cache.layers[1].v_codes.shape[0] == 4
    _codes_match_mirror(cache)
    cache.reset()
    assert cache.compressed_bytes() == 0
    with torch.inference_mode():   # reused at another batch size: a fresh cache, no stale codes
        tiny.model(ids[:1, :5], cache=cache, use_cache=True)
    assert cache.layers[0].k_codes.shape[:3] == (1, 2, 5)
    _codes_match_mirror(cache)


def test_tkv_cache_refuses_bad_shapes_and_missing_layers(tiny):
    from tkv.codec.errors import ShapeError

    cache = TkvCache.uniform(2, 32, 4, 4)
    k = torch.randn(1, 2, 3, 32)
    with pytest.raises(ShapeError, match="both be"):
        cache.update(k, torch.randn(1, 2, 4, 32), 0)
    with pytest.raises(ShapeError, match="both be"):
        cache.update(k[0], k[0], 0)
    with pytest.raises(ShapeError, match="built for 2 layers"):   # a 4-layer model
        tiny.model(torch.randint(0, 256, (1, 4)), cache=cache, use_cache=True)


def test_solver_names_bad_inputs():
    """solve_mix is public: a bad cap, widths or prediction table is a named error at the
    call, never an IndexError / KeyError / a terabyte allocation inside the solver; a cap past
    the widest allocation is that allocation."""
    from tkv.codec.errors import NonFiniteError, ShapeError

    geo = ModelGeometry(num_layers=3, num_kv_heads=2, head_dim=64)
    pred = {"k": torch.rand(3, 7), "v": torch.rand(3, 7)}
    for cap in (-5, 0, float("nan"), float("inf"), "100", True):
        with pytest.raises(TkvBitsError, match="byte cap"):
            solve_mix(pred, geo, cap)
    for widths in ((), None, 4, (1, 4), ("4",)):
        with pytest.raises(TkvBitsError, match="widths"):
            solve_mix(pred, geo, 500.0, widths=widths)
    for bad in ({"k": pred["k"]}, {"k": pred["k"], "v": torch.rand(3, 3)},
                {"k": pred["k"], "v": torch.rand(2, 7)}, None):
        with pytest.raises(ShapeError, match="pred"):
            solve_mix(bad, geo, 500.0)
    nan = {"k": pred["k"].clone(), "v": pred["v"]}
    nan["k"][1, 2] = float("nan")   # width 4
    with pytest.raises(NonFiniteError, match="pred"):
        solve_mix(nan, geo, 500.0)
    solve_mix(nan, geo, 500.0, widths=(2, 3, 5))   # the NaN column is not a candidate
    huge = solve_mix(pred, geo, 1e12)
    assert huge.allocation == solve_mix(pred, geo, 1e6).allocation


def test_arm_row_capacity_is_rounded_once_when_printed():
    """256 B (bf16, head_dim 64) over 68 B (K4V4) is 3.7647×: the report prints it .2f, so the
    row must not round it to 3.765 first (that printed 3.77×, session 29)."""
    from tkv.calibrate.evaluate import ArmResult
    from tkv.calibrate.metrics import Tally

    t = Tally(kl=0.1, top1=9, nll=20.0, positions=10, nll_positions=10)
    row = ArmResult("K4V4", "tkv", 68.0, t, Tally()).row(base_ppl=7.0, bf16_bytes=256.0)
    assert f"{row['capacity_vs_bf16']:.2f}" == "3.76"
    assert row["capacity_vs_bf16"] == pytest.approx(256 / 68, abs=5e-5)
