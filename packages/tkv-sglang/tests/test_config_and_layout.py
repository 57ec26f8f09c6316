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


def test_bundle_of_a_model_with_other_layer_kinds_is_refused(tkv_env, bundle_file):
    """Same shape, but the served model's config lists sliding layers the bundle (calibrated
    on an all-full-attention model) never saw: BundleGeometryError naming the layer."""
    tkv_env("4.5", bundle_file)
    kinds = ("full_attention", "sliding_attention") * 2
    with pytest.raises(BundleGeometryError, match="layer 1 is 'full' attention in the bundle"):
        tkv_config(AttentionGeometry(4, 2, 64, kinds, 512))
    assert tkv_config(AttentionGeometry(4, 2, 64, ("full_attention",) * 4, None)).bundle


def test_bundle_of_another_model_name_only_warns(tkv_env, bundle_file, caplog, fakes):
    """Same geometry, another name (SGLang's model_path): used, with one warning naming both."""
    tkv_env("4.5", bundle_file)
    mc = fakes.ModelConfig(model_path="/models/Llama-3.1-8B")
    with caplog.at_level("WARNING", logger="tkv.sglang"):
        assert tkv_config(geometry_from_model_config(mc)).bundle is not None
    assert "made for 'tiny-test'" in caplog.text and "Llama-3.1-8B" in caplog.text
    caplog.clear()
    mc = fakes.ModelConfig(model_path="/models/tiny-test-v2")
    with caplog.at_level("WARNING", logger="tkv.sglang"):
        tkv_config(geometry_from_model_config(mc))
    assert "made for" not in caplog.text


def test_geometry_reads_layer_kinds_and_window_from_the_text_config():
    from types import SimpleNamespace

    mc = SimpleNamespace(num_hidden_layers=2, head_dim=64, get_total_num_kv_heads=lambda: 2,
                         hf_text_config=SimpleNamespace(
                             layer_types=["full_attention", "sliding_attention"],
                             sliding_window=256))
    g = geometry_from_model_config(mc)
    assert (g.layer_types, g.sliding_window) == (("full_attention", "sliding_attention"), 256)
    mc.hf_text_config = SimpleNamespace()
    g = geometry_from_model_config(mc)
    assert (g.layer_types, g.sliding_window) == (None, None)


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


def test_per_head_offsets_are_served_on_a_sharded_rank(tkv_env, bundle_file, tmp_path):
    """A per-head key offset and per-head sink offsets (2 KV heads, tkv-calibrate's default
    bundle form) on a TP rank holding 1 head: the rank's layouts are built (no refusal since
    session 20) and its codec carries its own head's rows, never another head's."""
    import dataclasses

    import torch

    from tkv.codec import CalibrationBundle, shard_kv_heads

    b = CalibrationBundle.load(bundle_file)
    mu, sk, sv = torch.randn(2, 64), torch.randn(2, 64), torch.randn(2, 64)
    flat = lambda t: tuple(t.flatten().tolist())
    layers = list(b.layers)
    layers[2] = dataclasses.replace(layers[2], k_channel_offset=flat(mu), k_sink_offset=flat(sk),
                                    v_sink_offset=flat(sv))
    layers[0] = dataclasses.replace(layers[0], k_channel_offset=flat(mu[0]))
    path = dataclasses.replace(b, layers=tuple(layers)).save(tmp_path / "ph.json")
    tkv_env("4.5", path)
    cfg = tkv_config(GEO)
    assert worker_layouts(cfg, 0, 4, 16, 1) == [SlotLayout(64, 1, kb, vb, 16)
                                                for kb, vb in zip(MIXED_K, MIXED_V, strict=True)]
    assert cfg.codec(2).k.channel_offset.shape == (2, 64)
    for rank in (0, 1):
        c = cfg.codec(2, shard=shard_kv_heads(2, 2, rank))
        assert torch.equal(c.k.channel_offset, mu[rank:rank + 1])
        assert torch.equal(c.k.sink_offset, sk[rank:rank + 1])
        assert torch.equal(c.v.sink_offset, sv[rank:rank + 1])
        assert torch.equal(cfg.codec(0, shard=shard_kv_heads(2, 2, rank)).k.channel_offset, mu[0])


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
    ({"head_dim": 96, "v_head_dim": 96}, "head_dim 96"),
    ({"head_dim": 512, "v_head_dim": 512}, "head_dim 512"),
])
def test_unsupported_models_are_refused(fakes, change, match):
    mc = fakes.ModelConfig()
    for k, v in change.items():
        setattr(mc, k, v)
    with pytest.raises(UnsupportedFeatureError, match=match):
        geometry_from_model_config(mc)
