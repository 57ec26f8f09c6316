"""SlotLayout: byte counts equal the codec's, aligned regions, zero-copy views, capacity."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tkv.codec import ModelLayout, ShapeError, SlotLayout, TurboKVCodec, effective_bits_per_element
from tkv.codec.layout import ALIGN


@settings(max_examples=80, deadline=None)
@given(d=st.sampled_from([64, 80, 96, 112, 128, 192, 256, 576]), h=st.integers(1, 16),
       kb=st.integers(2, 8), vb=st.integers(2, 8), b=st.sampled_from([1, 3, 8, 16, 32, 64, 128]))
def test_layout_geometry(d, h, kb, vb, b):
    lay = SlotLayout(d, h, kb, vb, b)
    codec = TurboKVCodec(d, k_bits=kb, v_bits=vb)
    assert lay.k_code_bytes == codec.k_packed_bytes == math.ceil(d * kb / 8)
    assert lay.v_code_bytes == codec.v_packed_bytes
    assert lay.k_slot_bytes == lay.k_code_bytes + 2
    offs = [lay.k_codes_offset, lay.k_norms_offset, lay.v_codes_offset, lay.v_norms_offset]
    assert all(o % ALIGN == 0 for o in offs) and lay.page_bytes % ALIGN == 0
    sizes = [h * b * lay.k_code_bytes, h * b * 2, h * b * lay.v_code_bytes, h * b * 2]
    for (o, n), nxt in zip(zip(offs, sizes, strict=True), [*offs[1:], lay.page_bytes], strict=True):
        assert o + n <= nxt  # regions do not overlap
    assert lay.page_bytes >= b * lay.ideal_bytes_per_token
    if b % 16 == 0:
        assert lay.padding_bytes == 0 and lay.overhead == 0


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b", [16, 32, 64, 128])
def test_capacity_overhead_at_most_3_percent(d, b):
    for kb in range(2, 9):
        lay = SlotLayout(d, 8, kb, kb, b)
        assert lay.overhead <= 0.03
    assert SlotLayout(128, 8, 4, 4, b).capacity_ratio >= 3.76
    assert SlotLayout(128, 8, 4, 4, b).capacity_ratio == pytest.approx(512 / 132)


def test_views_write_through_and_round_trip():
    lay = SlotLayout(96, 3, 3, 5, 16)
    codec = TurboKVCodec(96, k_bits=3, v_bits=5)
    cache = lay.allocate(4)
    v = lay.views(cache)
    assert v["k_codes"].shape == (4, 3, 16, lay.k_code_bytes)
    assert v["v_norms"].shape == (4, 3, 16) and v["v_norms"].dtype == torch.bfloat16
    x = torch.randn(3, 96)
    pk, nk = codec.compress_k(x)
    pv, nv = codec.compress_v(x)
    v["k_codes"][2, :, 5] = pk
    v["k_norms"][2, :, 5] = nk
    v["v_codes"][2, :, 5] = pv
    v["v_norms"][2, :, 5] = nv
    # Read back through byte offsets computed from the documented formulas.
    s = lay.strides()
    for h in range(3):
        off = lay.k_codes_offset + h * s["k_head"] + 5 * s["k_token"]
        assert torch.equal(cache[2, off: off + lay.k_code_bytes], pk[h])
        noff = lay.v_norms_offset + 2 * (h * s["norm_head"] + 5)
        assert torch.equal(cache[2, noff: noff + 2].view(torch.bfloat16)[0], nv[h])
    again = lay.views(cache)
    assert torch.allclose(codec.decompress_v(again["v_codes"][2, :, 5], again["v_norms"][2, :, 5]),
                          codec.decompress_v(pv, nv))
    assert cache[[0, 1, 3]].sum() == 0


def test_views_reject_bad_cache():
    lay = SlotLayout(64, 2, 4, 4, 16)
    with pytest.raises(ShapeError):
        lay.views(torch.zeros(2, lay.page_bytes + 1, dtype=torch.uint8))
    with pytest.raises(TypeError):
        lay.views(torch.zeros(2, lay.page_bytes))
    with pytest.raises(ShapeError):
        SlotLayout(64, 0, 4, 4, 16)
    with pytest.raises(ValueError):
        SlotLayout(64, 2, 9, 4, 16)


def test_model_layout_and_bits():
    assert effective_bits_per_element(128, 4, 4) == pytest.approx(4.125)
    assert effective_bits_per_element(64, 4, 4) == pytest.approx(4.25)
    m = ModelLayout.from_allocation(64, 3, [4, 3, 8], [4, 2, 8], 16)
    assert m.bytes_per_token == sum(lay.bytes_per_token for lay in m.layers)
    assert m.bf16_bytes_per_token == 3 * 2 * 3 * 64 * 2
    assert m.capacity_ratio == pytest.approx(m.bf16_bytes_per_token / m.bytes_per_token)
    per_block = sum(lay.page_bytes for lay in m.layers)
    assert m.tokens_that_fit(per_block * 10 + 5) == 160
    u = ModelLayout.uniform(30, 64, 3, 4, 4, 16)
    assert u.bits_per_element == pytest.approx(4.25)


def test_model_layout_refuses_empty_mixed_blocks_and_negative_budgets():
    from tkv.codec import ModelLayout, ShapeError, SlotLayout

    with pytest.raises(ShapeError, match="at least"):
        ModelLayout.uniform(0, 64, 2, 4, 4, 16)
    with pytest.raises(ShapeError, match="share a block size"):
        ModelLayout((SlotLayout(64, 2, 4, 4, 16), SlotLayout(64, 2, 4, 4, 32)))
    lay = ModelLayout.uniform(3, 64, 2, 4, 4, 16)
    assert lay.tokens_that_fit(0) == 0 and lay.tokens_that_fit(3 * lay.layers[0].page_bytes) == 16
    with pytest.raises(ValueError, match=">= 0"):
        lay.tokens_that_fit(-5)


def test_layout_helpers_name_bad_arguments():
    """allocate / tokens_that_fit / effective_bits_per_element / ModelLayout with bad
    arguments: named errors, not torch RuntimeError, ZeroDivisionError or a NaN conversion."""
    lay = SlotLayout(64, 2, 4, 4, 16)
    for n in (-1, 2.0, True, "3"):
        with pytest.raises(ShapeError, match="num_blocks"):
            lay.allocate(n)
    assert lay.allocate(0).shape == (0, lay.page_bytes)
    model = ModelLayout((lay, lay))
    for nbytes in (float("inf"), float("nan"), -1, "1e9"):
        with pytest.raises(ValueError, match="nbytes"):
            model.tokens_that_fit(nbytes)
    assert model.tokens_that_fit(10 ** 9) > 0
    for d in (0, -64, 64.0):
        with pytest.raises(ShapeError, match="head_dim"):
            effective_bits_per_element(d, 4, 4)
    with pytest.raises(ShapeError, match="entry 1 is a int"):
        ModelLayout((lay, 1))
