"""Calibration bundle: round trip, corruption and mismatch refused, budget rows, env config."""

import dataclasses
import json

import pytest
import torch

from tkv.codec import (
    BudgetRowMissingError,
    BundleGeometryError,
    BundleSchemaError,
    CalibrationBundle,
    LayerAllocation,
    LayerCalibration,
    ModelGeometry,
    ShapeError,
    TkvBitsError,
    fit_codebook,
    load_config,
    normalize_tkv_bits,
    resolve_allocation,
)
from tkv.codec.bundle import _digest


def make_bundle(num_layers=3, heads=2, d=64) -> CalibrationBundle:
    g = torch.Generator().manual_seed(0)
    layers = []
    for i in range(num_layers):
        cbs = {"k_bits_3": fit_codebook(torch.randn(20000, generator=g) * 1.1, 3, generator=g),
               "v_bits_4": fit_codebook(torch.randn(20000, generator=g), 4, generator=g)}
        offset = tuple(torch.randn(d, generator=g).tolist()) if i == 0 else None
        layers.append(LayerCalibration(
            tuple((torch.rand(d, generator=g) + 0.5).tolist()), None, cbs, offset))
    table = {"4.0": LayerAllocation.uniform(num_layers, 4, 4),
             "3.5": LayerAllocation((3,) * num_layers, (4,) * num_layers, "smartmix")}
    geo = ModelGeometry(num_layers, heads, d, model="tiny")
    return CalibrationBundle(geo, tuple(layers), table,
                             {"tool": "test", "corpus_sha256": "0" * 64}, {"kl": {"4.0": 0.01}}, 5)


def test_round_trip(tmp_path):
    b = make_bundle()
    p = b.save(tmp_path / "b.json")
    b2 = CalibrationBundle.load(p)
    assert b2.to_dict() == b.to_dict()
    assert b2.budgets() == ["3.5", "4.0"]
    assert b2.allocation(3.5).k_bits == (3, 3, 3)
    assert b2.allocation("4").source == "uniform"
    c = b2.codec(1, 3, 4)
    assert torch.equal(c.k.centroids, b.layers[1].codebooks["k_bits_3"].centroids)
    assert c.seed == 5 and c.k.channel_scales is not None and c.v.channel_scales is None
    assert c.k.channel_offset is None
    assert torch.allclose(b2.codec(0, 3, 4).k.channel_offset, torch.tensor(b.layers[0].k_channel_offset))
    codecs = b2.codecs("3.5")
    assert [x.k_bits for x in codecs] == [3, 3, 3]


def test_per_head_offset_round_trip_and_old_form(tmp_path):
    """A per-head offset (num_kv_heads*head_dim floats, head-major) saves, loads and builds a codec
    with a (H, head_dim) μ; the old head_dim form still loads as a shared (head_dim,) μ; a length
    that is neither is refused by name."""
    b = make_bundle()
    heads, d = b.geometry.num_kv_heads, b.geometry.head_dim
    mu = torch.randn(heads, d)
    layers = list(b.layers)
    layers[2] = dataclasses.replace(layers[2], k_channel_offset=tuple(mu.flatten().tolist()))
    b = dataclasses.replace(b, layers=tuple(layers))
    b2 = CalibrationBundle.load(b.save(tmp_path / "ph.json"))
    assert b2.layers[2].k_channel_offset == b.layers[2].k_channel_offset
    c = b2.codec(2, 4, 4)
    assert c.k.channel_offset.shape == (heads, d) and torch.allclose(c.k.channel_offset, mu)
    assert b2.codec(0, 4, 4).k.channel_offset.shape == (d,)   # old (shared) form unchanged
    assert b2.layers[2].k_offset_heads(d) == heads and b2.layers[0].k_offset_heads(d) is None
    assert b2.layers[2].offset_heads(d) == heads and b2.layers[0].offset_heads(d) is None
    sink = dataclasses.replace(b2.layers[0], v_sink_offset=tuple([0.5] * (heads * d)))
    assert sink.offset_heads(d) == heads and sink.k_offset_heads(d) is None
    x = torch.randn(5, heads, d)
    assert c.decompress_k(*c.compress_k(x)).shape == (5, heads, d)
    dd = b.to_dict()
    dd["layers"][2]["k_channel_offset"] = [0.0] * ((heads + 1) * d)
    with pytest.raises(BundleSchemaError, match=r"layers\[2\]\.k_channel_offset"):
        CalibrationBundle.from_dict(dd, verify_integrity=False)
    with pytest.raises(BundleGeometryError):
        b2.check_geometry(b.geometry.num_layers, heads + 1, d)
    # a TP rank's heads: the per-head rows are sliced, the shared μ is not
    for r in range(heads):
        cr = b2.codec(2, 4, 4, heads=range(r, r + 1))
        assert cr.k.channel_offset.shape == (1, d) and torch.equal(cr.k.channel_offset[0], mu[r])
        assert torch.equal(b2.codec(0, 4, 4, heads=range(r, r + 1)).k.channel_offset,
                           b2.codec(0, 4, 4).k.channel_offset)
    with pytest.raises(BundleGeometryError, match="outside"):
        b2.codec(2, 4, 4, heads=range(heads, heads + 1))


def test_sink_offsets_round_trip_slice_per_rank_and_reach_the_codec(tmp_path):
    """k_sink_offset / v_sink_offset (per head, head-major; or shared) save, load, build a codec
    with sink offsets (sliced to a TP rank's heads like the key offset); bundles without them
    are unchanged; a bad length is refused by name."""
    b = make_bundle()
    heads, d = b.geometry.num_kv_heads, b.geometry.head_dim
    sk, sv = torch.randn(heads, d), torch.randn(d)
    layers = list(b.layers)
    layers[1] = dataclasses.replace(layers[1], k_sink_offset=tuple(sk.flatten().tolist()),
                                    v_sink_offset=tuple(sv.tolist()))
    b = dataclasses.replace(b, layers=tuple(layers))
    b2 = CalibrationBundle.load(b.save(tmp_path / "sink.json"))
    assert (b2.layers[1].k_sink_offset, b2.layers[1].v_sink_offset) == (
        b.layers[1].k_sink_offset, b.layers[1].v_sink_offset)
    c = b2.codec(1, 4, 3)
    assert c.has_sink_offset and not b2.codec(0, 4, 4).has_sink_offset
    assert torch.allclose(c.k.sink_offset, sk) and torch.allclose(c.v.sink_offset, sv)
    x = torch.randn(4, heads, d)
    assert c.decompress_v(*c.compress_v(x)).shape == (4, heads, d)
    cr = b2.codec(1, 4, 3, heads=range(1, 2))
    assert torch.equal(cr.k.sink_offset[0], sk[1]) and torch.equal(cr.v.sink_offset, sv)
    assert "k_sink_offset" not in make_bundle().to_dict()["layers"][1]
    dd = b.to_dict()
    dd["layers"][1]["v_sink_offset"] = [0.0] * (d + 1)
    with pytest.raises(BundleSchemaError, match=r"layers\[1\]\.v_sink_offset"):
        CalibrationBundle.from_dict(dd, verify_integrity=False)


def test_missing_row_lists_rows():
    b = make_bundle()
    with pytest.raises(BudgetRowMissingError, match=r"rows present: 3\.5, 4\.0"):
        b.allocation(3.0)
    with pytest.raises(TkvBitsError):
        b.allocation(9)
    with pytest.raises(TkvBitsError):
        b.allocation("four")


def test_geometry_mismatch_refused_by_name():
    b = make_bundle()
    with pytest.raises(BundleGeometryError, match="num_kv_heads: bundle 2, model 8"):
        b.check_geometry(3, 8, 64)
    with pytest.raises(BundleGeometryError, match="head_dim"):
        resolve_allocation(b, "4.0", 3, 2, 128)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d["geometry"].pop("head_dim"), "geometry.head_dim"),
    (lambda d: d["layers"].pop(), "layers"),
    (lambda d: d["byte_budget_table"]["4.0"]["k_bits"].__setitem__(0, 9), r"k_bits\[0\]"),
    (lambda d: d["byte_budget_table"].update({"9.5": d["byte_budget_table"]["4.0"]}), "9.5"),
    (lambda d: d["layers"][0]["codebooks"]["k_bits_3"]["centroids"].pop(), "centroids"),
    (lambda d: d["layers"][0].update(k_channel_scales=[-1.0] * 64), "k_channel_scales"),
    (lambda d: d["layers"][0]["codebooks"].update(q_bits_3={}), "q_bits_3"),
    (lambda d: d["layers"][0].update(k_channel_offset=[0.0] * 3), "k_channel_offset"),
])
def test_malformed_bundles_refused(tmp_path, mutate, match):
    d = make_bundle().to_dict()
    mutate(d)
    d["integrity"] = _digest({k: v for k, v in d.items() if k != "integrity"})   # resealed
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(BundleSchemaError, match=match):
        CalibrationBundle.load(p)


def test_corruption_detected(tmp_path):
    p = make_bundle().save(tmp_path / "b.json")
    d = json.loads(p.read_text())
    d["byte_budget_table"]["4.0"]["v_bits"][1] = 3  # valid schema, silently different
    p.write_text(json.dumps(d))
    with pytest.raises(BundleSchemaError, match="integrity"):
        CalibrationBundle.load(p)
    p.write_text(p.read_text()[:-40])
    with pytest.raises(BundleSchemaError, match="not valid JSON"):
        CalibrationBundle.load(p)
    with pytest.raises(FileNotFoundError):
        CalibrationBundle.load(tmp_path / "nope.json")


def test_no_bundle_defaults_to_k4v4_loudly():
    with pytest.warns(UserWarning, match="uniform K4V4"):
        a = resolve_allocation(None, None, 30)
    assert a.k_bits == (4,) * 30 and a.source == "default"
    with pytest.raises(BudgetRowMissingError, match="needs a calibration bundle"):
        resolve_allocation(None, "3.0", 30)


def test_load_config_from_env(tmp_path):
    p = make_bundle().save(tmp_path / "b.json")
    cfg = load_config(3, 2, 64, {"TKV_BITS": "3.5", "TKV_CALIBRATION_FILE": str(p)})
    assert cfg.layer_bits(0) == (3, 4) and cfg.allocation.source == "smartmix"
    assert cfg.slot_layout(0, 16, num_kv_heads=1).num_kv_heads == 1
    assert cfg.codec(2).k.codebook is not None
    assert "3.5" in cfg.describe()
    with pytest.raises(FileNotFoundError, match="TKV_CALIBRATION_FILE"):
        load_config(3, 2, 64, {"TKV_CALIBRATION_FILE": str(tmp_path / "missing.json")})
    with pytest.raises(BudgetRowMissingError):
        load_config(3, 2, 64, {"TKV_BITS": "6.0", "TKV_CALIBRATION_FILE": str(p)})
    with pytest.raises(BundleGeometryError):
        load_config(30, 2, 64, {"TKV_CALIBRATION_FILE": str(p)})
    with pytest.raises(TkvBitsError):
        load_config(3, 2, 64, {"TKV_BITS": "1.5"})
    with pytest.warns(UserWarning):
        cfg = load_config(3, 2, 64, {})
    assert cfg.bundle is None and cfg.layer_bits(1) == (4, 4)
    # a bundle with sink offsets (tkv-calibrate's default) is served: the layer's codec has them
    b = make_bundle()
    layers = list(b.layers)
    layers[1] = dataclasses.replace(layers[1], v_sink_offset=tuple([0.5] * 64))
    ps = dataclasses.replace(b, layers=tuple(layers)).save(tmp_path / "sink.json")
    cfg = load_config(3, 2, 64, {"TKV_CALIBRATION_FILE": str(ps)})
    assert cfg.codec(1).has_sink_offset and not cfg.codec(0).has_sink_offset
    with pytest.raises(BundleGeometryError):
        load_config(3, 4, 64, {"TKV_CALIBRATION_FILE": str(ps)})


def test_bundle_nan_duplicates_and_unsavable_contents_are_schema_errors(tmp_path):
    """NaN in a hashed bundle, two rows for one TKV_BITS ("4" and "4.0"), and a bundle built
    with contents load would refuse: BundleSchemaError by name, nothing written."""
    b = make_bundle()
    d = b.to_dict()
    d["metrics"] = {"kl": float("nan")}                      # json.loads accepts NaN
    (tmp_path / "nan.json").write_text(json.dumps(d))
    with pytest.raises(BundleSchemaError, match="NaN"):
        CalibrationBundle.load(tmp_path / "nan.json")
    with pytest.raises(BundleSchemaError, match="NaN"):
        dataclasses.replace(b, metrics={"kl": float("nan")}).save(tmp_path / "x.json")
    d = b.to_dict()
    d["byte_budget_table"]["4"] = d["byte_budget_table"]["3.5"]
    with pytest.raises(BundleSchemaError, match=r"byte_budget_table\.4.*second row for TKV_BITS=4\.0"):
        CalibrationBundle.from_dict(d, verify_integrity=False)
    bad = dataclasses.replace(b, byte_budget_table={"4.0": LayerAllocation((9, 9, 9), (4, 4, 4))})
    with pytest.raises(BundleSchemaError, match="outside"):
        bad.save(tmp_path / "bad.json")
    layers = list(b.layers)
    layers[0] = dataclasses.replace(layers[0], k_channel_scales=(1.0, 2.0, 3.0))
    with pytest.raises(BundleSchemaError, match="k_channel_scales"):
        dataclasses.replace(b, layers=tuple(layers)).save(tmp_path / "bad2.json")
    assert not (tmp_path / "bad.json").exists() and not (tmp_path / "bad2.json").exists()


def test_config_layer_index_and_head_count_are_checked(tmp_path):
    cfg = load_config(3, 2, 64, {"TKV_CALIBRATION_FILE": str(make_bundle().save(tmp_path / "b.json"))})
    for bad in (3, -1, True, 1.0):
        with pytest.raises(IndexError, match=r"outside 0\.\.2"):
            cfg.layer_bits(bad)
    with pytest.raises(IndexError):
        cfg.codec(5)
    with pytest.raises(ShapeError):
        cfg.slot_layout(0, 16, num_kv_heads=0)
    assert cfg.slot_layout(0, 16).num_kv_heads == 2


@pytest.mark.parametrize("geo", [(0, 2, 64), (3, 0, 64), (3, 2, -1), ("3", 2, 64), (3, True, 64)])
def test_load_config_refuses_a_bad_geometry(geo):
    with pytest.raises(ShapeError, match="positive int"):
        load_config(*geo, {})


def test_schema_version_must_be_the_integer():
    d = make_bundle().to_dict()
    for bad in (True, 1.0, "1"):
        d["schema_version"] = bad
        with pytest.raises(BundleSchemaError, match="schema_version"):
            CalibrationBundle.from_dict(d, verify_integrity=False)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["layers"][0].update(k_chanel_scales=d["layers"][0].pop("k_channel_scales")),
     r"layers\[0\]: unknown field\(s\) 'k_chanel_scales'"),
    (lambda d: d.update(byte_budget_tabel=d.pop("byte_budget_table")), "byte_budget_tabel|missing"),
    (lambda d: d.update(notes="hand-written"), r"bundle: unknown field\(s\) 'notes'"),
    (lambda d: d["geometry"].update(layer_type=["full"] * 3), r"geometry: unknown field"),
    (lambda d: d["byte_budget_table"]["4.0"].update(k_bit=[4, 4, 4]), r"unknown field.*k_bit"),
    (lambda d: d["layers"][0]["codebooks"]["k_bits_3"].update(scale=1.0), r"unknown field.*scale"),
    (lambda d: d["layers"][0]["codebooks"].update(
        k_bits_04=d["layers"][0]["codebooks"].pop("k_bits_3")), "k_bits_04.*plain ASCII digit"),
    (lambda d: d["layers"][0]["codebooks"].update(
        {"k_bits_\u0664": d["layers"][0]["codebooks"].pop("v_bits_4")}), "plain ASCII digit"),
    (lambda d: d["layers"][1].update(k_channel_scales=[1e-300] * 64), "smallest normal float32"),
    (lambda d: d["layers"][1].update(k_channel_scales=[1e300] * 64), "float32 range"),
    (lambda d: d["layers"][0].update(k_channel_offset=[1e39] * 64), "float32 range"),
    (lambda d: d["layers"][0].update(k_channel_offset=[10 ** 400] * 64), "non-finite"),
    (lambda d: d.update(seed=-1), r"seed: -1 outside \[0, 18446744073709551615\]"),
    (lambda d: d.update(seed=2 ** 64), "seed: .* outside"),
])
def test_hand_edits_that_would_be_ignored_or_overflow_are_refused(tmp_path, mutate, match):
    """Resealed (valid integrity) but wrong: a misspelled field would silently drop its
    calibration, a non-canonical codebook key would never be looked up, a scale outside the
    float32 range would fail only inside a codec — each is a named BundleSchemaError on load,
    and the message names the file."""
    d = make_bundle().to_dict()
    mutate(d)
    d["integrity"] = _digest({k: v for k, v in d.items() if k != "integrity"})
    p = tmp_path / "edited.json"
    p.write_text(json.dumps(d))
    with pytest.raises(BundleSchemaError, match=match) as e:
        CalibrationBundle.load(p)
    assert "edited.json" in str(e.value)


def test_an_integer_past_pythons_conversion_limit_is_a_schema_error(tmp_path):
    """json.loads refuses integers of more than 4,300 digits with a plain ValueError: the
    bundle loader reports it as BundleSchemaError naming the file (a short message)."""
    d = make_bundle().to_dict()
    d["seed"] = 123456789
    text = json.dumps(d).replace("123456789", "9" * 5000)
    assert "9" * 5000 in text
    p = tmp_path / "huge.json"
    p.write_text(text)
    with pytest.raises(BundleSchemaError, match=r"huge\.json") as e:
        CalibrationBundle.load(p)
    assert len(str(e.value)) < 600


def test_integrity_is_required_unless_resealing_on_purpose(tmp_path):
    """Deleting ``integrity`` no longer disables the check; ``verify_integrity=False`` (still
    fully validated) then ``save`` is the documented way to keep a deliberate edit."""
    d = make_bundle().to_dict()
    d.pop("integrity")
    d["byte_budget_table"]["4.0"]["v_bits"][1] = 3
    p = tmp_path / "b.json"
    p.write_text(json.dumps(d))
    with pytest.raises(BundleSchemaError, match=r"no integrity field.*reseal"):
        CalibrationBundle.load(p)
    CalibrationBundle.from_dict(json.loads(p.read_text()), verify_integrity=False).save(p)
    assert CalibrationBundle.load(p).allocation(4.0).v_bits == (4, 3, 4)
    d["layers"][0]["k_channel_scales"] = [0.0] * 64
    with pytest.raises(BundleSchemaError, match="k_channel_scales"):
        CalibrationBundle.from_dict(d, verify_integrity=False)


def test_load_names_directories_and_deep_nesting(tmp_path):
    with pytest.raises(FileNotFoundError, match="is a directory"):
        CalibrationBundle.load(tmp_path)
    p = tmp_path / "deep.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BundleSchemaError, match="not valid JSON"):
        CalibrationBundle.load(p)
    with pytest.raises(FileNotFoundError, match="is a directory"):
        load_config(3, 2, 64, {"TKV_CALIBRATION_FILE": str(tmp_path)})


def test_blank_tkv_bits_is_the_default_and_the_missing_row_says_so(tmp_path):
    p = str(make_bundle().save(tmp_path / "b.json"))
    assert load_config(3, 2, 64, {"TKV_BITS": "   ", "TKV_CALIBRATION_FILE": p}).tkv_bits == "4.0"
    b = make_bundle()
    only = dataclasses.replace(b, byte_budget_table={"3.5": b.byte_budget_table["3.5"]})
    q = str(only.save(tmp_path / "only35.json"))
    with pytest.raises(BudgetRowMissingError, match=r"TKV_BITS is unset, so it defaulted to 4\.0"):
        load_config(3, 2, 64, {"TKV_CALIBRATION_FILE": q})
    with pytest.raises(BudgetRowMissingError) as e:
        load_config(3, 2, 64, {"TKV_BITS": "4", "TKV_CALIBRATION_FILE": q})
    assert "defaulted" not in str(e.value)


def test_layer_kinds_and_window_of_the_served_model_are_compared():
    g = ModelGeometry(3, 2, 64, ("full", "sliding", "full"), 128, "m")
    g.check_layer_kinds(["full_attention", "sliding_attention", "full_attention"], 128)
    g.check_layer_kinds(("full", "sliding", "full"), None)        # window not listed
    g.check_layer_kinds(None, 128)                                # kinds not listed
    g.check_layer_kinds(["full_attention"] * 5, 128)              # another count: not listed
    with pytest.raises(BundleGeometryError, match="layer 1 is 'sliding' attention in the bundle"):
        g.check_layer_kinds(["full_attention"] * 3)
    with pytest.raises(BundleGeometryError, match="sliding_window 128, the model being served 64"):
        g.check_layer_kinds(None, 64)


@pytest.mark.parametrize(("served", "other"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", False),   # hub name containing the bundle's
    ("/models/smollm2-135m-instruct/", False),          # local path, case and slash
    ("smollm2", False),                                  # the bundle's name contains it
    ("meta-llama/Llama-3.1-8B", True),
    ("", False), (None, False),                          # no name: nothing to compare
])
def test_name_mismatch_compares_last_path_components(served, other):
    msg = ModelGeometry(3, 2, 64, model="SmolLM2-135M-Instruct").name_mismatch(served)
    assert (msg is not None) is other
    if other:
        assert f"made for 'SmolLM2-135M-Instruct', the served model is {served!r}" in msg
    assert ModelGeometry(3, 2, 64).name_mismatch(served) is None   # bundle without a name


def test_tkv_bits_error_shortens_a_huge_value():
    with pytest.raises(TkvBitsError, match=r"got '44444.*\.\.\. \(5002 characters\)") as e:
        normalize_tkv_bits("4" * 5000)
    assert len(str(e.value)) < 120


def test_bundle_codec_names_bad_layer_and_heads():
    """bundle.codec(layer, ...): a float / str / bool layer, or heads that are not KV-head
    ints, are named errors (a float layer was a TypeError from list indexing, True was
    accepted as layer 1)."""
    b = make_bundle()
    for layer in (1.0, "1", True, -1, 3):
        with pytest.raises(IndexError, match="layer must be an int"):
            b.codec(layer, 4, 4)
    for heads in (2, [0.0], [True], [5], []):
        with pytest.raises(BundleGeometryError):
            b.codec(0, 4, 4, heads=heads)
    assert b.codec(0, 4, 4, heads=range(1, 2)).k_bits == 4


def test_model_geometry_names_bad_sizes_and_layer_types(tmp_path):
    """ModelGeometry("2", ...) was a TypeError deep in a comparison; layer_types 0 or {} in a
    bundle silently became all-full. Now: ShapeError on construction, BundleSchemaError on
    load; an absent or empty list still means every layer full."""
    for kw in (dict(num_layers="2"), dict(num_kv_heads=0), dict(head_dim=64.0),
               dict(layer_types=("full",)), dict(layer_types=("full", "local")),
               dict(layer_types="full")):
        with pytest.raises(ShapeError, match="ModelGeometry"):
            ModelGeometry(**{**dict(num_layers=2, num_kv_heads=1, head_dim=64), **kw})
    assert ModelGeometry(2, 1, 64).layer_types == ("full", "full")
    assert ModelGeometry(2, 1, 64, ["sliding", "full"]).layer_types == ("sliding", "full")
    for bad in (0, {}, "full"):
        d = make_bundle().to_dict()
        d["geometry"]["layer_types"] = bad
        d["integrity"] = _digest({k: v for k, v in d.items() if k != "integrity"})
        p = tmp_path / "g.json"
        p.write_text(json.dumps(d))
        with pytest.raises(BundleSchemaError, match="layer_types"):
            CalibrationBundle.load(p)


def test_calibration_file_that_is_not_a_regular_readable_file(tmp_path, monkeypatch):
    """TKV_CALIBRATION_FILE=/dev/null said "no such file"; an unreadable bundle was a bare
    PermissionError that did not name the variable (helper break-test, session 28)."""
    import os
    from pathlib import Path

    from tkv.codec import load_config

    if os.path.exists("/dev/null"):
        with pytest.raises(FileNotFoundError, match="not a regular file"):
            load_config(3, 2, 64, env={"TKV_CALIBRATION_FILE": "/dev/null"})
    p = make_bundle().save(tmp_path / "b.json")

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(PermissionError, match=r"TKV_CALIBRATION_FILE=.*cannot be read"):
        load_config(3, 2, 64, env={"TKV_CALIBRATION_FILE": str(p)})
