"""Startup validation: TKV_BITS / TKV_CALIBRATION_FILE through tkv.codec.config with named
errors, refusal of models the backend cannot serve, layer indices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tkv.codec.errors import (
    BudgetRowMissingError,
    BundleGeometryError,
    BundleSchemaError,
    TkvBitsError,
)
from tkv.vllm import startup
from tkv.vllm.errors import UnsupportedModelError

from .conftest import fake_model_config, fake_vllm_config, make_bundle


@pytest.fixture(autouse=True)
def _fresh_cache():
    startup._CONFIGS.clear()
    yield
    startup._CONFIGS.clear()


def test_bundle_row_is_resolved_once(tmp_path):
    path = make_bundle(tmp_path / "b.json")
    env = {"TKV_BITS": "3.5", "TKV_CALIBRATION_FILE": str(path)}
    vc = fake_vllm_config()
    cfg = startup.tkv_config(vc, env)
    assert cfg.tkv_bits == "3.5" and cfg.allocation.source == "smartmix"
    assert cfg.layer_bits(0) == (4, 3) and cfg.layer_bits(1) == (3, 3)
    assert startup.tkv_config(vc, env) is cfg  # validated once, cached


def test_no_bundle_is_uniform_k4v4_with_loud_warning():
    with pytest.warns(UserWarning, match="no calibration bundle"):
        cfg = startup.tkv_config(fake_vllm_config(), {})
    assert set(zip(cfg.allocation.k_bits, cfg.allocation.v_bits, strict=True)) == {(4, 4)}


@pytest.mark.parametrize(("env", "exc"), [
    ({"TKV_BITS": "9"}, TkvBitsError),
    ({"TKV_BITS": "four"}, TkvBitsError),
    ({"TKV_BITS": "3.0"}, BudgetRowMissingError),  # no bundle: only 4.0
])
def test_bad_bits_are_named_errors(env, exc):
    with pytest.raises(exc):
        startup.tkv_config(fake_vllm_config(), env)


def test_missing_row_missing_file_bad_geometry_bad_json(tmp_path):
    path = make_bundle(tmp_path / "b.json")
    with pytest.raises(BudgetRowMissingError, match=r"rows present: 3\.5, 4\.0"):
        startup.tkv_config(fake_vllm_config(), {"TKV_BITS": "3.0",
                                                "TKV_CALIBRATION_FILE": str(path)})
    with pytest.raises(FileNotFoundError, match="TKV_CALIBRATION_FILE"):
        startup.tkv_config(fake_vllm_config(), {"TKV_CALIBRATION_FILE": str(tmp_path / "no")})
    other = fake_vllm_config(fake_model_config(num_layers=4, num_kv_heads=8, head_dim=64))
    with pytest.raises(BundleGeometryError, match="num_kv_heads"):
        startup.tkv_config(other, {"TKV_CALIBRATION_FILE": str(path)})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BundleSchemaError):
        startup.tkv_config(fake_vllm_config(), {"TKV_CALIBRATION_FILE": str(bad)})


@pytest.mark.parametrize("flag", ["use_mla", "is_encoder_decoder", "is_hybrid",
                                  "is_attention_free", "has_noops"])
def test_unsupported_models_are_refused(flag):
    vc = fake_vllm_config(fake_model_config(**{flag: True}))
    with pytest.raises(UnsupportedModelError, match="tkv"):
        startup.tkv_config(vc, {})


def test_chunked_local_attention_is_refused():
    from types import SimpleNamespace

    mc = fake_model_config()
    mc.hf_text_config = SimpleNamespace(attention_chunk_size=8192)
    with pytest.raises(UnsupportedModelError, match="chunked local attention"):
        startup.tkv_config(fake_vllm_config(mc), {})


@pytest.mark.parametrize("text_cfg,match", [
    (dict(model_type="gemma2", attn_logit_softcapping=50.0), "soft-capping"),
    (dict(model_type="bloom"), "ALiBi"),
    (dict(model_type="falcon", alibi=True), "ALiBi"),
    (dict(model_type="mpt", attn_config={"alibi": True}), "ALiBi"),
    (dict(model_type="gpt_oss"), "attention sinks"),
])
def test_attention_features_the_kernels_lack_are_refused_at_launch(text_cfg, match):
    """Gemma-2's soft-capping, ALiBi and gpt-oss's learned sinks used to pass the launch-time
    check and fail in TurboAttnImpl inside an engine process (helper break-test, session
    28); the model's config tells at launch."""
    from types import SimpleNamespace

    mc = fake_model_config()
    mc.hf_text_config = SimpleNamespace(**text_cfg)
    with pytest.raises(UnsupportedModelError, match=match):
        startup.tkv_config(fake_vllm_config(mc), {})
    mc.hf_text_config = SimpleNamespace(model_type="llama", attn_logit_softcapping=None,
                                        attn_config={"alibi": False})
    startup.check_model_supported(mc)


@pytest.mark.parametrize("change,match", [
    (lambda vc: setattr(vc, "kv_transfer_config", SimpleNamespace(kv_connector="LMCache")),
     "KV connectors"),
    (lambda vc: setattr(vc.cache_config, "kv_offloading_size", 4.0), "KV offloading"),
    (lambda vc: setattr(vc.cache_config, "kv_cache_dtype_skip_layers", ["0"]),
     "skip-layers"),
    (lambda vc: setattr(vc.cache_config, "block_size", 8), "--block-size 8"),
    (lambda vc: setattr(vc.cache_config, "block_size", 24), "--block-size 24"),
])
def test_engine_options_that_bypass_tkv_pages_are_refused_at_launch(change, match):
    """KV connectors / offloading (they failed in get_kv_cache_shape with a misleading "run
    `tkv-vllm patch apply`"), skip-layers and block sizes off the multiple of 16 (the
    selector's "block_size not supported" in an engine process) — all at launch now."""
    from tkv.codec.errors import UnsupportedFeatureError

    vc = fake_vllm_config()
    change(vc)
    with pytest.raises(UnsupportedFeatureError, match=match):
        startup.check_engine_features(vc)
    ok = fake_vllm_config()
    ok.kv_transfer_config = SimpleNamespace(kv_connector=None)
    ok.cache_config.block_size = 64
    startup.check_engine_features(ok)
    ok.cache_config.block_size = None   # vLLM picks one later
    startup.check_engine_features(ok)


def test_layer_index():
    assert startup.layer_index("model.layers.12.self_attn.attn", 36) == 12
    assert startup.layer_index("layers.0.attn", 1) == 0
    with pytest.raises(UnsupportedModelError, match="outside"):
        startup.layer_index("model.layers.36.self_attn.attn", 36)
    with pytest.raises(UnsupportedModelError, match="cannot tell"):
        startup.layer_index("model.attn", 36)


def test_tp_shard_from_config():
    vc = fake_vllm_config(fake_model_config(num_kv_heads=8), tp=1)
    assert startup.tp_shard(vc).num_local_heads == 8


def test_per_head_key_offset_is_sliced_to_the_tp_rank(tmp_path):
    """A bundle with a per-head key offset μ (4 KV heads): each TP rank's codec carries exactly
    the rows of its KV heads (vLLM's QKVParallelLinear rule, replication when H < T included),
    so kernels on a rank center head h with μ[first_head + h]; the shared form is untouched."""
    import dataclasses

    import torch

    from tkv.codec.bundle import CalibrationBundle
    from tkv.codec.sharding import shard_kv_heads

    h, d = 4, 64
    b = CalibrationBundle.load(make_bundle(tmp_path / "b.json", num_kv_heads=h, head_dim=d))
    mu = torch.randn(h, d)
    layers = list(b.layers)
    layers[1] = dataclasses.replace(layers[1], k_channel_offset=tuple(mu.flatten().tolist()))
    sv = torch.randn(h, d)     # per-head V sink offset next to layer 0's shared μ
    layers[0] = dataclasses.replace(layers[0], k_channel_offset=tuple(mu[0].tolist()),
                                    v_sink_offset=tuple(sv.flatten().tolist()))
    path = dataclasses.replace(b, layers=tuple(layers)).save(tmp_path / "ph.json")
    vc = fake_vllm_config(fake_model_config(num_kv_heads=h, head_dim=d))
    cfg = startup.tkv_config(vc, {"TKV_BITS": "4.0", "TKV_CALIBRATION_FILE": str(path)})
    full = startup.layer_codec(cfg, 1, 4, 4, "cpu")
    assert torch.equal(full.k.channel_offset, mu)
    for tp in (1, 2, 4, 8):
        for rank in range(tp):
            shard = shard_kv_heads(h, tp, rank)
            c = startup.layer_codec(cfg, 1, 4, 4, "cpu", shard)
            assert torch.equal(c.k.channel_offset, mu[list(shard.heads)])
            assert c.k.offset_heads == shard.num_local_heads
            shared = startup.layer_codec(cfg, 0, 4, 4, "cpu", shard)
            assert torch.equal(shared.k.channel_offset, mu[0])
            assert torch.equal(shared.v.sink_offset, sv[list(shard.heads)])
    assert cfg.bundle.layers[0].offset_heads(d) == h    # so the backend asks for the shard
    # a rank's codec compresses its local heads exactly as the full codec does those heads
    shard = shard_kv_heads(h, 2, 1)
    c = startup.layer_codec(cfg, 1, 4, 4, "cpu", shard)
    x = torch.randn(5, h, d) + mu
    pf, nf = full.compress_k(x)
    pr, nr = c.compress_k(x[:, list(shard.heads)])
    assert torch.equal(pf[:, list(shard.heads)], pr) and torch.equal(nf[:, list(shard.heads)], nr)


@pytest.mark.parametrize("head_dim", [8, 48, 80, 96, 512])
def test_unservable_head_dim_is_refused_at_startup_by_name(head_dim):
    """vLLM's own refusal comes later, in the worker, without naming tkv or the sizes."""
    vc = fake_vllm_config(fake_model_config(head_dim=head_dim))
    with pytest.raises(UnsupportedModelError, match=r"head_dim .*16, 32, 64, 128, 256"):
        startup.tkv_config(vc, {})


@pytest.mark.parametrize(("heads", "tp"), [(8, 3), (6, 4), (3, 2), (2, 3)])
def test_tp_size_that_does_not_shard_the_kv_heads_fails_at_startup(heads, tp):
    from tkv.codec.errors import ShapeError

    vc = fake_vllm_config(fake_model_config(num_kv_heads=heads), tp=tp)
    with pytest.raises(ShapeError, match="TP"):
        startup.tkv_config(vc, {})


@pytest.mark.parametrize("attr", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused(attr):
    from tkv.codec.errors import UnsupportedFeatureError

    vc = fake_vllm_config()
    setattr(vc.parallel_config, attr, 2)
    with pytest.raises(UnsupportedFeatureError, match="context parallelism"):
        startup.tkv_config(vc, {})


def test_bundle_of_another_model_with_the_same_shape(tmp_path, caplog):
    """Same (layers, KV heads, head_dim): the attention kinds and sliding window are compared
    too; a different name only warns."""
    import json
    from types import SimpleNamespace

    from tkv.codec.bundle import CalibrationBundle

    path = make_bundle(tmp_path / "b.json")
    env = {"TKV_CALIBRATION_FILE": str(path)}
    mc = fake_model_config(hf_text_config=SimpleNamespace(
        layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=128))
    with pytest.raises(BundleGeometryError, match="layer 1 is 'full' attention in the bundle"):
        startup.tkv_config(fake_vllm_config(mc), env)
    d = json.loads(path.read_text())
    d["geometry"].update(layer_types=["full", "sliding"] * 2, sliding_window=64)
    CalibrationBundle.from_dict(d, verify_integrity=False).save(path)
    startup._CONFIGS.clear()
    with pytest.raises(BundleGeometryError, match="sliding_window 64"):
        startup.tkv_config(fake_vllm_config(mc), env)
    d["geometry"].update(sliding_window=128, model="meta-llama/Llama-3.1-8B")
    CalibrationBundle.from_dict(d, verify_integrity=False).save(path)
    startup._CONFIGS.clear()
    with caplog.at_level("WARNING", logger="tkv.vllm"):
        startup.tkv_config(fake_vllm_config(mc), env)
    assert "made for 'meta-llama/Llama-3.1-8B'" in caplog.text


def test_tp_rank_unknown_is_an_error_not_rank_0():
    from tkv.codec.errors import UnsupportedFeatureError

    pytest.importorskip("vllm", reason="vllm not installed (nox -s vllm installs it)")
    with pytest.raises(UnsupportedFeatureError, match="no TP rank"):
        startup.tp_shard(fake_vllm_config(fake_model_config(num_kv_heads=4), tp=2))
