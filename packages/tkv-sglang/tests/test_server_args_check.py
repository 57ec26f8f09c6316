"""Startup checks run by the patched ServerArgs for --kv-cache-dtype tkv (duck-typed args)."""

from __future__ import annotations

import pytest

from tkv.codec import BudgetRowMissingError, BundleGeometryError
from tkv.sglang.errors import UnsupportedFeatureError
from tkv.sglang.server_args_check import check_server_args


def test_page_size_defaults_to_16(fakes, tkv_env, bundle_file):
    tkv_env("4.5", bundle_file)
    sa = fakes.ServerArgs()
    check_server_args(sa)
    assert sa.page_size == 16
    sa = fakes.ServerArgs(page_size=64)
    check_server_args(sa)
    assert sa.page_size == 64


@pytest.mark.parametrize("page", [1, 8, 24, 0])
def test_page_size_must_be_a_multiple_of_16(fakes, page):
    with pytest.raises(UnsupportedFeatureError, match="multiple of 16"):
        check_server_args(fakes.ServerArgs(page_size=page), validate_model=False)


@pytest.mark.parametrize(("kw", "match"), [
    ({"speculative_algorithm": "EAGLE"}, "speculative"),
    ({"enable_hierarchical_cache": True}, "hierarchical"),
    ({"enable_lmcache": True}, "lmcache"),
    ({"enable_hisparse": True}, "hisparse"),
    ({"disaggregation_mode": "prefill"}, "disaggregation"),
    ({"attn_cp_size": 2}, "context parallelism"),
    ({"enable_prefill_context_parallel": True}, "context parallelism"),
])
def test_unsupported_features_are_refused(fakes, kw, match):
    with pytest.raises(UnsupportedFeatureError, match=match):
        check_server_args(fakes.ServerArgs(**kw), validate_model=False)


def test_config_is_validated_against_the_model_at_startup(fakes, tkv_env, bundle_file):
    tkv_env("4.5", bundle_file)
    with pytest.raises(BundleGeometryError):
        check_server_args(fakes.ServerArgs(fakes.ModelConfig(kv_heads=8)))
    tkv_env("6.0", bundle_file)
    with pytest.raises(BudgetRowMissingError, match=r"rows present: 4\.0, 4\.5"):
        check_server_args(fakes.ServerArgs())


def test_unsupported_model_is_refused_at_startup(fakes, tkv_env):
    mc = fakes.ModelConfig()
    mc.is_hybrid_swa = True
    with pytest.raises(UnsupportedFeatureError, match="sliding-window"):
        check_server_args(fakes.ServerArgs(mc))


@pytest.mark.parametrize(("name", "bad"), [("TKV_DECODE_PIPELINE", "yes"),
                                           ("TKV_LOOKUP", "prmt9"),
                                           ("TKV_PREFILL_ATTENTION", "fa2")])
def test_kernel_settings_are_validated_at_startup(fakes, monkeypatch, name, bad):
    """Every TKV_* kernel setting is parsed in the launching process: a bad value stops the
    launch with its named error (message names the variable), before any worker starts."""
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        check_server_args(fakes.ServerArgs(), validate_model=False)


@pytest.mark.parametrize("bad", ["cuda", "Triton2", "x" * 100])
def test_impl_override_is_validated_at_startup(fakes, monkeypatch, bad):
    """TKV_SGLANG_IMPL used to fail only inside a worker's pool, with a plain ValueError
    (helper break-test, session 28): now the launching process refuses it by name."""
    from tkv.sglang.impl import ImplConfigError, select_impl

    monkeypatch.setenv("TKV_SGLANG_IMPL", bad)
    with pytest.raises(ImplConfigError, match="TKV_SGLANG_IMPL") as e:
        check_server_args(fakes.ServerArgs(), validate_model=False)
    assert len(str(e.value)) < 200
    with pytest.raises(ImplConfigError):
        select_impl("cpu")
    monkeypatch.setenv("TKV_SGLANG_IMPL", " Reference ")
    check_server_args(fakes.ServerArgs(), validate_model=False)
    assert select_impl("cpu") == "reference"


@pytest.mark.parametrize("flag", ["1", "true", "On"])
def test_impl_follows_the_kernels_reading_of_triton_interpret(monkeypatch, flag):
    """TRITON_INTERPRET=true runs tkv's kernels under the interpreter
    (tkv.kernels._util.interpreting); the pool must pick them too, not the reference."""
    from tkv.sglang.impl import select_impl

    monkeypatch.delenv("TKV_SGLANG_IMPL", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", flag)
    assert select_impl("cpu") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_impl("cpu") == "reference"


@pytest.mark.parametrize("kv_heads,kw,ok", [
    (3, dict(tp_size=2), False), (3, dict(tp_size=3), True), (2, dict(tp_size=4), True),
    (3, dict(tp_size=4, enable_dp_attention=True, dp_size=2), False),
    (4, dict(tp_size=4, enable_dp_attention=True, dp_size=2), True), (6, dict(tp_size=4), False)])
def test_kv_heads_that_attention_tp_cannot_shard_are_refused_at_startup(fakes, tkv_env,
                                                                       kv_heads, kw, ok):
    """3 KV heads over --tp 2 passed startup and failed inside a worker (tkv-vllm refused it
    at launch): the attention TP size (tp, or tp / dp with --enable-dp-attention) must divide
    the KV heads or be a multiple of them."""
    from tkv.codec import ShapeError

    tkv_env()   # no bundle: uniform K4V4 for any geometry (and its loud warning)
    sa = fakes.ServerArgs(fakes.ModelConfig(kv_heads=kv_heads), **kw)
    with pytest.warns(UserWarning, match="no calibration bundle"):
        if ok:
            check_server_args(sa)
        else:
            with pytest.raises(ShapeError, match=r"KV heads|TP ranks"):
                check_server_args(sa)
