"""Page plan (per-layer vs common pages): math equals tkv.codec.layout (TP head sharding:
tkv-codec's test_sharding.py)."""

from __future__ import annotations

import pytest

from tkv.codec.bundle import LayerAllocation
from tkv.codec.errors import ShapeError
from tkv.codec.layout import ModelLayout, SlotLayout
from tkv.vllm.pages import COMMON, PER_LAYER, plan_pages

MIX = LayerAllocation((4, 3, 8, 2, 5, 4), (3, 3, 4, 2, 6, 4), "smartmix")


def test_single_attention_kind_keeps_per_layer_widths():
    plan = plan_pages(MIX, 128, 8, [None] * 6)
    assert plan.mode == PER_LAYER
    assert plan.served == plan.allocated
    assert plan.capacity_loss(16) == 0.0
    ml = ModelLayout.from_allocation(128, 8, MIX.k_bits, MIX.v_bits, 16)
    assert plan.bytes_per_block(16) == sum(lay.page_bytes for lay in ml.layers)
    for i, lay in enumerate(ml.layers):
        assert plan.layout(i, 16) == lay
    # one sliding window everywhere is one kind too
    assert plan_pages(MIX, 128, 8, [4096] * 6).mode == PER_LAYER


def test_hybrid_serves_each_side_at_its_widest_and_reports_the_loss():
    """Common pages: every layer at (max k_bits, max v_bits) — MIX's widest-bytes pair is
    K8V4, but layer 4 was calibrated V6, so the common pair is K8V6 and no layer loses bits
    on either side."""
    kinds = [None, 4096, 4096, None, 4096, 4096]
    plan = plan_pages(MIX, 128, 8, kinds)
    assert plan.mode == COMMON
    assert set(plan.served) == {(max(MIX.k_bits), max(MIX.v_bits))} == {(8, 6)}
    for (ka, va), (ks, vs) in zip(plan.allocated, plan.served, strict=True):
        assert ks >= ka and vs >= va
    pages = {plan.layout(i, 32).page_bytes for i in range(6)}
    assert len(pages) == 1
    ideal = sum(SlotLayout(128, 8, k, v, 32).page_bytes for k, v in plan.allocated)
    assert plan.capacity_loss(32) == pytest.approx(1 - ideal / (6 * pages.pop()))
    assert 0 < plan.capacity_loss(32) < 1
    assert "fewer tokens" in plan.describe(32)


def test_hybrid_with_uniform_widths_or_manager_off_has_no_loss():
    kinds = [None, 4096] * 3
    uni = LayerAllocation.uniform(6, 4, 4)
    assert plan_pages(uni, 128, 8, kinds).mode == PER_LAYER
    assert plan_pages(MIX, 128, 8, kinds, hybrid_manager=False).mode == PER_LAYER


def test_empty_allocation_is_refused():
    with pytest.raises(ShapeError):
        plan_pages(LayerAllocation((), ()), 128, 8, [])


def test_hybrid_with_crossed_widths_never_narrows_a_side():
    """K5V3 beside K3V5 (SmartMix searches all 49 pairs): the served pair is K5V5, a page
    wider than either allocated one, never K5V3 for the K3V5 layer (helper break-test,
    session 28)."""
    alloc = LayerAllocation((5, 3, 4, 4), (3, 5, 4, 4), "smartmix")
    plan = plan_pages(alloc, 128, 8, [None, 4096] * 2)
    assert set(plan.served) == {(5, 5)}
    widest = max(SlotLayout(128, 8, k, v, 16).page_bytes for k, v in plan.allocated)
    assert plan.layout(0, 16).page_bytes > widest
    assert "K5V5" in plan.describe(16) and plan.capacity_loss(16) > 0
