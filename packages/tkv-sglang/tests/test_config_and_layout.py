"""Config validation (shared tkv.codec.config), geometry refusals, per-worker layouts and the
cell size SGLang sizes its pool with — all equal to tkv.codec.layout.SlotLayout."""

from __future__ import annotations

import json

import pytest

from tkv.codec import (
    BudgetRowMissingError,
    BundleGeometryError,
    BundleSchemaError,
    SlotLayout,
    TkvBitsError,
)
from tkv.codec.errors import ShapeError
from tkv.sglang.cell_size import cell_size_bytes, worker_layouts
from tkv.sglang.config import tkv_config
from tkv.sglang.errors import UnsupportedFeatureError
from tkv.sglang.geometry import AttentionGeometry, geometry_from_model_config

MIXED_K = (3, 5, 8, 2)
MIXED_V = (4, 2, 6, 7)
GEO = AttentionGeometry(4, 2, 64)


def test_no_bundle_is_uniform_k4v4_with_a_loud_warning(tkv_env):
    tkv_env()
    with pytest.warns(UserWarning, match="no calibration bundle"):
        cfg = tkv_config(GEO)
    assert [cfg.layer_bits(i) for i in range(4)] == [(4, 4)] * 4
    assert tkv_config(GEO) is cfg  # validated once per process


@pytest.mark.parametrize(("bits", "bundle", "err"), [
    ("nine", None, TkvBitsError),
    ("9", None, TkvBitsError),
    ("nan", None, TkvBitsError),
    ("3.0", None, BudgetRowMissingError),          # another budget needs a bundle
    ("4.0", "/nonexistent/bundle.json", FileNotFoundError),
    ("5.0", "BUNDLE", BudgetRowMissingError),      # bundle without that row
])
def test_bad_configuration_is_a_named_error(tkv_env, bundle_file, bits, bundle, err):
    tkv_env(bits, bundle_file if bundle == "BUNDLE" else bundle)
    with pytest.raises(err):
        tkv_config(GEO)


def test_bundle_for_another_model_is_refused(tkv_env, bundle_file):
    tkv_env("4.5", bundle_file)
    with pytest.raises(BundleGeometryError, match="num_kv_heads"):
        tkv_config(AttentionGeometry(4, 8, 64))


def test_corrupted_bundle_is_refused(tkv_env, bundle_file):
    d = json.loads(bundle_file.read_text())
    d["byte_budget_table"]["4.5"]["k_bits"][0] = 6
    bundle_file.write_text(json.dumps(d))
    tkv_env("4.5", bundle_file)
    with pytest.raises(BundleSchemaError, match="integrity"):
        tkv_config(GEO)


def test_mixed_row_gives_per_layer_layouts(tkv_env, bundle_file):
    tkv_env("4.5", bundle_file)
    cfg = tkv_config(GEO)
    lays = worker_layouts(cfg, 0, 4, 16, 2)
    assert [(l.k_bits, l.v_bits) for l in lays] == list(zip(MIXED_K, MIXED_V, strict=True))
    assert lays == [SlotLayout(64, 2, kb, vb, 16) for kb, vb in zip(MIXED_K, MIXED_V, strict=True)]
    # a pipeline stage holds a slice; a TP rank holds fewer heads
    assert worker_layouts(cfg, 1, 3, 32, 1) == [SlotLayout(64, 1, 5, 2, 32), SlotLayout(64, 1, 8, 6, 32)]
    with pytest.raises(ShapeError):
        worker_layouts(cfg, 2, 5, 16, 2)


def test_per_head_key_offset_refused_on_a_sharded_rank(tkv_env, bundle_file, tmp_path):
    """A per-head key offset (2 KV heads) is served on a rank holding both heads; a TP rank
    holding 1 head is refused by name (never centered with another head's mean); a shared
    offset is fine on any rank."""
    import dataclasses

    from tkv.codec import CalibrationBundle

    b = CalibrationBundle.load(bundle_file)
    layers = list(b.layers)
    layers[2] = dataclasses.replace(layers[2], k_channel_offset=tuple([0.5] * (2 * 64)))
    layers[0] = dataclasses.replace(layers[0], k_channel_offset=tuple([0.5] * 64))
    path = dataclasses.replace(b, layers=tuple(layers)).save(tmp_path / "ph.json")
    tkv_env("4.5", path)
    cfg = tkv_config(GEO)
    assert len(worker_layouts(cfg, 0, 4, 16, 2)) == 4
    assert len(worker_layouts(cfg, 0, 2, 16, 1)) == 2          # shared μ on layer 0: fine
    with pytest.raises(UnsupportedFeatureError, match=r"per-head offsets .* for 2 KV heads"):
        worker_layouts(cfg, 0, 4, 16, 1)
    assert cfg.codec(2).k.channel_offset.shape == (2, 64)
    # per-head sink offsets (tkv-calibrate's default) next to a shared μ: refused the same way
    layers[2] = dataclasses.replace(layers[2], k_channel_offset=tuple([0.5] * 64),
                                    v_sink_offset=tuple([0.25] * (2 * 64)))
    path = dataclasses.replace(b, layers=tuple(layers)).save(tmp_path / "sink.json")
    tkv_env("4.5", path)
    cfg = tkv_config(GEO)
    assert len(worker_layouts(cfg, 0, 4, 16, 2)) == 4
    with pytest.raises(UnsupportedFeatureError, match="no-sink-offset"):
        worker_layouts(cfg, 0, 4, 16, 1)


@pytest.mark.parametrize("page", [16, 32, 64, 128])
def test_cell_size_is_slotlayout_bytes_per_token(tkv_env, bundle_file, page):
    tkv_env("4.5", bundle_file)
    lays = worker_layouts(tkv_config(GEO), 0, 4, page, 2)
    cs = cell_size_bytes(lays)
    assert cs * page == sum(l.page_bytes for l in lays)          # exact: no padding at x16
    assert cs == sum(l.ideal_bytes_per_token for l in lays)
    # a pool of N pages sized with this cell size holds exactly N pages of every layer
    budget = 1000 * sum(l.page_bytes for l in lays) + 7
    assert budget // cs // page * page == 1000 * page


def test_cell_size_rounds_up_with_padding():
    lays = [SlotLayout(64, 3, 3, 3, 5)]                           # block 5: padded regions
    assert lays[0].padding_bytes > 0
    assert cell_size_bytes(lays) * 5 >= lays[0].page_bytes
    assert (cell_size_bytes(lays) - 1) * 5 < lays[0].page_bytes


def test_geometry_from_model_config(fakes):
    assert geometry_from_model_config(fakes.ModelConfig()) == GEO


@pytest.mark.parametrize(("change", "match"), [
    ({"attention_arch": type("A", (), {"name": "MLA"})()}, "MLA"),
    ({"is_hybrid_swa": True}, "sliding-window"),
    ({"is_encoder_decoder": True}, "encoder-decoder"),
    ({"num_attention_layers": 8}, "attention layers"),
    ({"v_head_dim": 128}, "v_head_dim"),
])
def test_unsupported_models_are_refused(fakes, change, match):
    mc = fakes.ModelConfig()
    for k, v in change.items():
        setattr(mc, k, v)
    with pytest.raises(UnsupportedFeatureError, match=match):
        geometry_from_model_config(mc)
