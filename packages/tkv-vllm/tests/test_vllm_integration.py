"""With vLLM 0.20.1 installed and patched (nox -s vllm): plugin registration, CLI flags,
KV-cache specs and vLLM's own page/group bookkeeping over them, backend contract."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from tkv.codec.layout import ModelLayout, SlotLayout
from tkv.vllm import patching, startup

from .conftest import fake_model_config, fake_vllm_config, make_bundle, make_layer


@pytest.fixture(autouse=True)
def _fresh_config():
    startup._CONFIGS.clear()
    yield
    startup._CONFIGS.clear()


def test_installed_vllm_is_patched():
    pytest.importorskip("vllm", reason="vllm not installed (nox -s vllm installs it)")
    st = patching.status(patching.find_vllm_root())
    assert st.state is patching.PatchState.APPLIED, st.describe()


def test_plugin_registers_dtype_and_backend(patched_vllm):
    from vllm.config.cache import get_valid_cache_dtypes
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from tkv.vllm.backend import TurboAttnBackend

    assert "tkv" in get_valid_cache_dtypes()
    assert STR_DTYPE_TO_TORCH_DTYPE["tkv"] is torch.uint8
    # its own member, not an alias of CUSTOM (None) or TORCH_SDPA ("")
    assert E.TURBO_ATTN.name == "TURBO_ATTN"
    assert E.TURBO_ATTN is not E.CUSTOM and E.TURBO_ATTN is not E.TORCH_SDPA
    assert E["turbo-attn"] is E.TURBO_ATTN
    assert E.TURBO_ATTN.get_class() is TurboAttnBackend
    assert TurboAttnBackend.get_name() == "TURBO_ATTN"


def test_cli_flags(patched_vllm):
    """The two flags, built exactly the way vLLM's EngineArgs builds them (the full
    parser needs a device to compute other defaults)."""
    import argparse

    from vllm.config import CacheConfig
    from vllm.config.attention import AttentionConfig
    from vllm.engine.arg_utils import get_kwargs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", **get_kwargs(CacheConfig)["cache_dtype"])
    parser.add_argument("--attention-backend", **get_kwargs(AttentionConfig)["backend"])
    args = parser.parse_args(["--kv-cache-dtype", "tkv", "--attention-backend", "turbo-attn"])
    assert args.kv_cache_dtype == "tkv"
    assert CacheConfig(cache_dtype=args.kv_cache_dtype).cache_dtype == "tkv"
    assert AttentionConfig(backend=args.attention_backend).backend is E.TURBO_ATTN
    assert AttentionConfig(backend="TURBO_ATTN").backend is E.TURBO_ATTN
    with pytest.raises(ValueError, match="Unknown kv-cache dtype 'tkv8'"):
        CacheConfig(cache_dtype="tkv8")


def test_validate_hook_runs_at_config_time(patched_vllm, tmp_path, monkeypatch, caplog):
    """vLLM calls the plugin's validator from VllmConfig.__post_init__ (launching process):
    named errors there, and an unset backend becomes TURBO_ATTN."""
    from types import SimpleNamespace

    from vllm.config.cache import validate_plugin_cache_dtype
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from tkv.codec.errors import BundleGeometryError
    from tkv.vllm.errors import BackendMismatchError, UnsupportedModelError

    def cfg(model=None, backend=None):
        vc = fake_vllm_config(model)
        vc.cache_config.cache_dtype = "tkv"
        vc.attention_config = SimpleNamespace(backend=backend)
        return vc

    path = make_bundle(tmp_path / "b.json")
    monkeypatch.setenv("TKV_CALIBRATION_FILE", str(path))
    vc = cfg()
    validate_plugin_cache_dtype(vc)
    assert vc.attention_config.backend is E.TURBO_ATTN
    with pytest.raises(BackendMismatchError, match="FLASH_ATTN"):
        validate_plugin_cache_dtype(cfg(backend=E.FLASH_ATTN))
    with pytest.raises(BundleGeometryError):
        validate_plugin_cache_dtype(cfg(fake_model_config(num_layers=30)))
    with pytest.raises(UnsupportedModelError, match="MLA"):
        validate_plugin_cache_dtype(cfg(fake_model_config(use_mla=True)))
    # inside VllmConfig.__post_init__ pydantic shows only a ValueError's message: the hook
    # logs the class name first
    import logging

    with (caplog.at_level(logging.ERROR, logger="tkv.vllm"),
          pytest.raises(UnsupportedModelError)):
        validate_plugin_cache_dtype(cfg(fake_model_config(is_hybrid=True)))
    assert "tkv: UnsupportedModelError: " in caplog.text
    # every TKV_* kernel setting is checked here too (launching process)
    from tkv.kernels import PipelineConfigError

    monkeypatch.setenv("TKV_DECODE_PIPELINE", "yes")
    with pytest.raises(PipelineConfigError, match="TKV_DECODE_PIPELINE"):
        validate_plugin_cache_dtype(cfg())
    monkeypatch.delenv("TKV_DECODE_PIPELINE")
    from tkv.kernels import SingleSplitConfigError

    monkeypatch.setenv("TKV_DECODE_SINGLE_SPLIT", "on")
    with pytest.raises(SingleSplitConfigError, match="TKV_DECODE_SINGLE_SPLIT"):
        validate_plugin_cache_dtype(cfg())
    monkeypatch.delenv("TKV_DECODE_SINGLE_SPLIT")
    from tkv.kernels import MinSplitTilesConfigError

    monkeypatch.setenv("TKV_DECODE_MIN_SPLIT_TILES", "lots")
    with pytest.raises(MinSplitTilesConfigError, match="TKV_DECODE_MIN_SPLIT_TILES"):
        validate_plugin_cache_dtype(cfg())
    monkeypatch.delenv("TKV_DECODE_MIN_SPLIT_TILES")
    other = cfg(backend=E.FLASH_ATTN)
    other.cache_config.cache_dtype = "auto"
    validate_plugin_cache_dtype(other)  # other dtypes untouched
    import vllm.config.vllm as vcfg

    assert "validate_plugin_cache_dtype(self)" in inspect.getsource(vcfg.VllmConfig.__post_init__)


def _specs(vc, names_windows, head_size=64, num_kv_heads=2):
    from tkv.vllm.spec import kv_cache_spec_for_layer

    layers = {n: make_layer(n, head_size=head_size, num_kv_heads=num_kv_heads,
                            sliding_window=w) for n, w in names_windows}
    vc.compilation_config.static_forward_context.update(layers)
    return {n: kv_cache_spec_for_layer(lay, vc) for n, lay in layers.items()}


def _use_bundle(monkeypatch, tmp_path, rows=None, bits="3.5"):
    path = make_bundle(tmp_path / "b.json", rows=rows)
    monkeypatch.setenv("TKV_BITS", bits)
    monkeypatch.setenv("TKV_CALIBRATION_FILE", str(path))


def _vllm_cfg_for_groups(vc):
    vc.cache_config.num_gpu_blocks_override = None
    return vc


def test_spec_page_bytes_come_from_slot_layout(patched_vllm, tmp_path, monkeypatch):
    _use_bundle(monkeypatch, tmp_path)
    vc = fake_vllm_config(block_size=16)
    cfg = startup.tkv_config(vc)
    specs = _specs(vc, [(f"model.layers.{i}.self_attn.attn", None) for i in range(4)])
    assert len({(s.tkv_k_bits, s.tkv_v_bits) for s in specs.values()}) == 2
    for i, spec in enumerate(specs.values()):
        k, v = cfg.layer_bits(i)
        assert (spec.tkv_k_bits, spec.tkv_v_bits) == (k, v)
        assert spec.dtype is torch.uint8 and spec.head_size == 64
        assert spec.page_size_bytes == SlotLayout(64, 2, k, v, 16).page_bytes
        bigger = spec.copy_with_new_block_size(64)
        assert bigger.page_size_bytes == SlotLayout(64, 2, k, v, 64).page_bytes


def test_mixed_widths_share_one_block_pool_without_waste(patched_vllm, tmp_path, monkeypatch):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from tkv.codec.bundle import LayerAllocation

    vc = _vllm_cfg_for_groups(fake_vllm_config(block_size=16))
    alloc = LayerAllocation((4, 3, 8, 2), (3, 3, 4, 2), "smartmix")
    _use_bundle(monkeypatch, tmp_path, {"3.5": alloc})
    specs = _specs(vc, [(f"model.layers.{i}.self_attn.attn", None) for i in range(4)])
    groups = get_kv_cache_groups(vc, dict(specs))
    assert len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    mem = 10 * 2**20
    kcfg = get_kv_cache_config_from_groups(vc, groups, mem)
    ml = ModelLayout.from_allocation(64, 2, alloc.k_bits, alloc.v_bits, 16)
    assert kcfg.num_blocks * 16 == ml.tokens_that_fit(mem)
    sizes = {t.shared_by[0]: t.size for t in kcfg.kv_cache_tensors}
    for i, name in enumerate(specs):
        assert sizes[name] == ml.layers[i].page_bytes * kcfg.num_blocks
    # the full engine-core path and the token count vLLM reports at startup
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )

    vc.model_config.original_max_model_len = vc.model_config.max_model_len = 1024
    vc.parallel_config.prefill_context_parallel_size = 1
    (full,) = get_kv_cache_configs(vc, [dict(specs)], [mem])
    assert full.num_blocks == kcfg.num_blocks
    reported = int(get_max_concurrency_for_kv_cache_config(vc, full) * 1024)
    assert reported == ml.tokens_that_fit(mem)


def test_hybrid_model_groups_with_one_common_page(patched_vllm, tmp_path, monkeypatch):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    from tkv.codec.bundle import LayerAllocation

    vc = _vllm_cfg_for_groups(fake_vllm_config(block_size=16))
    alloc = LayerAllocation((4, 3, 8, 2), (3, 3, 4, 2), "smartmix")
    _use_bundle(monkeypatch, tmp_path, {"3.5": alloc})
    windows = [None, 64, None, 64]
    specs = _specs(vc, [(f"model.layers.{i}.self_attn.attn", w) for i, w in enumerate(windows)])
    page = SlotLayout(64, 2, 8, 4, 16).page_bytes  # widest allocated pair
    assert {s.page_size_bytes for s in specs.values()} == {page}
    groups = get_kv_cache_groups(vc, dict(specs))
    assert len(groups) == 2  # full and sliding: vLLM's usual hybrid grouping
    kcfg = get_kv_cache_config_from_groups(vc, groups, 10 * 2**20)
    assert all(t.size == page * kcfg.num_blocks for t in kcfg.kv_cache_tensors)


def test_hybrid_manager_off_keeps_per_layer_pages(patched_vllm, tmp_path, monkeypatch):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    from tkv.codec.bundle import LayerAllocation

    vc = _vllm_cfg_for_groups(fake_vllm_config(block_size=16, disable_hybrid=True))
    alloc = LayerAllocation((4, 3, 8, 2), (3, 3, 4, 2), "smartmix")
    _use_bundle(monkeypatch, tmp_path, {"3.5": alloc})
    windows = [None, 64, None, 64]
    specs = _specs(vc, [(f"model.layers.{i}.self_attn.attn", w) for i, w in enumerate(windows)])
    assert [s.page_size_bytes for s in specs.values()] == [
        SlotLayout(64, 2, k, v, 16).page_bytes for k, v in zip(alloc.k_bits, alloc.v_bits,
                                                                strict=True)]
    assert len(get_kv_cache_groups(vc, dict(specs))) == 1


def test_backend_contract(patched_vllm):
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    from tkv.vllm.backend import (
        TurboAttnBackend,
        TurboAttnImpl,
        TurboAttnMetadataBuilder,
    )
    from tkv.vllm.errors import PatchesNotAppliedError

    B = TurboAttnBackend
    assert B.get_impl_cls() is TurboAttnImpl and B.get_builder_cls() is TurboAttnMetadataBuilder
    assert B.forward_includes_kv_cache_update is False and B.accept_output_buffer is True
    assert B.supports_block_size(16) and B.supports_block_size(32) and not B.supports_block_size(8)
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cap = DeviceCapability(9, 0)  # H200
    # exactly the call CudaPlatform.get_attn_backend_cls makes for a selected backend
    ok = dict(AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="tkv",
                                      block_size=16)._asdict(), device_capability=cap)
    assert B.validate_configuration(**ok) == []
    assert B.validate_configuration(**{**ok, "use_non_causal": True})
    for change, reason in [({"use_mla": True}, "MLA"), ({"kv_cache_dtype": "auto"}, "kv_cache"),
                           ({"attn_type": AttentionType.ENCODER_DECODER}, "attention type"),
                           ({"attn_type": AttentionType.ENCODER_ONLY}, "attention type"),
                           ({"head_size": 96}, "head_size"), ({"has_sink": True}, "sink")]:
        reasons = B.validate_configuration(**{**ok, **change})
        assert any(reason in r for r in reasons), (change, reasons)
    with pytest.raises(PatchesNotAppliedError):
        B.get_kv_cache_shape(10, 16, 2, 64, "tkv")
    from tkv.vllm.spec import TkvFullAttentionSpec

    spec = TkvFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                                tkv_k_bits=5, tkv_v_bits=3)
    assert B.get_kv_cache_shape_for_spec(10, 16, spec) == (10, SlotLayout(64, 2, 5, 3, 16).page_bytes)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"alibi_slopes": [1.0, 2.0]}, "ALiBi"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"attn_type": "encoder_decoder"}, "attention type"),
    ({"kv_sharing_target_layer_name": "model.layers.0.attn"}, "sharing"),
    ({"kv_cache_dtype": "auto"}, "kv_cache_dtype"),
    ({"sinks": torch.zeros(4)}, "sinks"),
])
def test_impl_refuses_what_it_cannot_serve(patched_vllm, kwargs, match):
    from tkv.vllm.backend import TurboAttnImpl
    from tkv.vllm.errors import UnsupportedModelError

    base = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, kv_cache_dtype="tkv")
    with pytest.raises(UnsupportedModelError, match=match):
        TurboAttnImpl(**{**base, **kwargs})


def test_forward_path_has_no_host_sync(patched_vllm):
    """CUDA-graph discipline, checked on the source: nothing in the per-step path pulls a
    device value to the host or builds a tensor from host data."""
    from tkv.vllm import backend

    banned = re.compile(r"\.item\(|\.tolist\(|\.cpu\(|\.numpy\(|torch\.tensor\(|"
                        r"\.nonzero\(|torch\.where\([^,]*\)$|\.max\(\)\.|synchronize")
    for fn in (backend.TurboAttnImpl.forward, backend.TurboAttnImpl.do_kv_cache_update,
               backend.LayerState.loader):
        src = inspect.getsource(fn)
        code = "\n".join(line for line in src.splitlines()
                         if not line.strip().startswith(("#", '"""')))
        assert not banned.search(code), fn.__qualname__
    # the builder may only read host values from the *_cpu copies vLLM provides
    build = inspect.getsource(backend.TurboAttnMetadataBuilder.build)
    for m in re.finditer(r"int\(([^)]*)\)", build):
        assert any(ok in m.group(1) for ok in ("_cpu", "block_size", "reorder_batch_threshold")), \
            m.group(0)


def test_tensor_parallel_rank_specs(patched_vllm, tmp_path, monkeypatch):
    """TP=2 over 2 KV heads: each rank's spec is the SlotLayout of its one head, the
    bundle (per-layer, per-head_dim tables) is used unsliced, and ranks' pages add up."""
    from tkv.vllm.errors import UnsupportedModelError
    from tkv.vllm.spec import kv_cache_spec_for_layer

    _use_bundle(monkeypatch, tmp_path)
    vc = fake_vllm_config(tp=2)
    cfg = startup.tkv_config(vc)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    specs = _specs(vc, [(n, None) for n in names], num_kv_heads=1)
    for i, s in enumerate(specs.values()):
        k, v = cfg.layer_bits(i)
        assert s.num_kv_heads == 1
        assert 2 * s.page_size_bytes == SlotLayout(64, 2, k, v, 16).page_bytes
    wrong = make_layer(names[0], num_kv_heads=2)
    with pytest.raises(UnsupportedModelError, match="KV heads on this rank"):
        kv_cache_spec_for_layer(wrong, vc)


@pytest.mark.parametrize(("h", "t"), [(8, 1), (8, 2), (8, 4), (8, 8), (4, 8), (2, 4), (1, 2),
                                    (1, 8), (32, 2)])
def test_kv_head_shards_follow_vllms_own_rule(patched_vllm, h, t):
    """Per-rank KV heads equal vLLM's ModelConfig.get_num_kv_heads, and a replicated rank
    owns head ``rank // replicas`` as QKVParallelLinear loads it (``tp_rank //
    num_kv_head_replicas``); every head is held by ``replicas`` ranks."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    from vllm.config import ModelConfig

    from tkv.codec.sharding import shard_kv_heads

    mc = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: h)
    per_rank = ModelConfig.get_num_kv_heads(mc, SimpleNamespace(tensor_parallel_size=t))
    # (read, not imported: vllm.model_executor.layers.linear needs CUDA libraries)
    linear = Path(importlib.util.find_spec("vllm.model_executor").submodule_search_locations[0])
    src = (linear / "layers" / "linear.py").read_text()
    assert "divide(tp_size, self.total_num_kv_heads)" in src  # replicas = T / H
    assert "self.tp_rank // self.num_kv_head_replicas" in src  # the rule mirrored below
    replicas = t // h if t >= h else 1
    holders = {}
    for r in range(t):
        s = shard_kv_heads(h, t, r)
        assert s.num_local_heads == per_rank and s.replicas == replicas
        if replicas > 1:
            assert list(s.heads) == [r // replicas]
        for x in s.heads:
            holders.setdefault(x, []).append(r)
    assert sorted(holders) == list(range(h))
    assert all(len(v) == replicas for v in holders.values())


def test_replicated_kv_head_rank_specs(patched_vllm, monkeypatch):
    """TP=2 over 1 KV head (replication): each rank's page is the whole 1-head SlotLayout —
    the same as at TP=1, so the KV memory per GPU does not shrink."""
    from tkv.vllm.spec import kv_cache_spec_for_layer

    monkeypatch.delenv("TKV_BITS", raising=False)
    monkeypatch.delenv("TKV_CALIBRATION_FILE", raising=False)
    pages = {}
    for tp in (1, 2):
        startup._CONFIGS.clear()
        vc = fake_vllm_config(fake_model_config(num_kv_heads=1), tp=tp)
        lay = make_layer("model.layers.0.self_attn.attn", num_kv_heads=1, num_heads=4)
        vc.compilation_config.static_forward_context[lay.layer_name] = lay
        with pytest.warns(UserWarning, match="no calibration bundle"):
            spec = kv_cache_spec_for_layer(lay, vc)
        assert spec.num_kv_heads == 1 and (spec.tkv_k_bits, spec.tkv_v_bits) == (4, 4)
        pages[tp] = spec.page_size_bytes
    assert pages[1] == pages[2] == SlotLayout(64, 1, 4, 4, 16).page_bytes


def test_model_runners_view_each_layer_with_its_own_page(patched_vllm, tmp_path, monkeypatch):
    """Patch 0003 at the call sites: both GPU model runners (v1 and v2) turn the raw int8
    buffers of a mixed-width model into uint8 (num_blocks, page_bytes(layer)) views."""
    import warnings
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    with warnings.catch_warnings():  # torch.jit deprecations raised by vLLM's imports
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.v1.worker.gpu import attn_utils
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.utils import AttentionGroup

    from tkv.codec.bundle import LayerAllocation
    from tkv.vllm.backend import TurboAttnBackend

    vc = _vllm_cfg_for_groups(fake_vllm_config(block_size=16))
    alloc = LayerAllocation((4, 3, 8, 2), (3, 3, 4, 2), "smartmix")
    _use_bundle(monkeypatch, tmp_path, {"3.5": alloc})
    specs = _specs(vc, [(f"model.layers.{i}.self_attn.attn", None) for i in range(4)])
    groups = get_kv_cache_groups(vc, dict(specs))
    kcfg = get_kv_cache_config_from_groups(vc, groups, 2**20)

    def raw_buffers():
        out = {}
        for t in kcfg.kv_cache_tensors:
            buf = torch.zeros(t.size, dtype=torch.int8)
            for name in t.shared_by:
                out[name] = buf
        return out

    runner = SimpleNamespace(
        runner_only_attn_layers=set(), cache_config=SimpleNamespace(cache_dtype="tkv"),
        kv_cache_config=kcfg,
        attn_groups=[[AttentionGroup(TurboAttnBackend, [n], s, 0) for n, s in specs.items()]])
    runner._kv_cache_spec_attn_group_iterator = (
        lambda: GPUModelRunner._kv_cache_spec_attn_group_iterator(runner))
    raw = raw_buffers()
    v1 = GPUModelRunner._reshape_kv_cache_tensors(runner, raw, [16])
    raw2 = raw_buffers()
    v2 = attn_utils._reshape_kv_cache(kcfg, raw2, {n: TurboAttnBackend for n in specs}, "tkv")
    for i, name in enumerate(specs):
        lay = SlotLayout(64, 2, alloc.k_bits[i], alloc.v_bits[i], 16)
        for views, buffers in ((v1, raw), (v2, raw2)):
            kv = views[name]
            assert kv.dtype is torch.uint8 and tuple(kv.shape) == (kcfg.num_blocks, lay.page_bytes)
            assert kv.is_contiguous() and kv.data_ptr() == buffers[name].data_ptr()
            lay.views(kv)  # the codec's own typed views accept it


def test_prefill_runs_from_host_metadata():
    """The metadata builder takes the prefill rows' cached prefixes from vLLM's CPU sequence
    lengths (``seq_lens_cpu_upper_bound``, else the runner's ``_seq_lens_cpu``): 0 = a first
    chunk (the prefill bypass), > 0 = a continuation (exact when alone in its run); no CPU
    lengths at all → one run with no bound (the general inline path)."""
    pytest.importorskip("vllm", reason="vllm not installed (nox -s vllm installs it)")
    from types import SimpleNamespace

    from tkv.vllm.backend import _prefill_runs

    qsl = torch.tensor([0, 1, 2, 7, 19], dtype=torch.int32)   # 2 decodes, prefills 5 and 12

    def runs(cam):
        cam.query_start_loc_cpu, cam.num_reqs = qsl, 4
        return [(r.row_lo, r.row_hi, r.tok_lo, r.tok_hi, r.max_prefix_len, r.no_prefix,
                 r.prefix_exact) for r in _prefill_runs(cam, 2, 2, 1)]

    first = SimpleNamespace(seq_lens_cpu_upper_bound=torch.tensor([30, 9, 5, 12]))
    assert runs(first) == [(2, 4, 2, 19, 0, True, False)]
    cont = SimpleNamespace(seq_lens_cpu_upper_bound=torch.tensor([30, 9, 5, 40]))
    assert runs(cont) == [(2, 3, 2, 7, 0, True, False), (3, 4, 7, 19, 28, False, True)]
    legacy = SimpleNamespace(seq_lens_cpu_upper_bound=None, _seq_lens_cpu=torch.tensor([3, 4, 5, 12]))
    assert runs(legacy) == [(2, 4, 2, 19, 0, True, False)]
    assert runs(SimpleNamespace()) == [(2, 4, 2, 19, None, False, False)]


def test_prefill_scratch_sized_from_max_model_len_and_capped():
    """One process-wide prefill scratch per device: a whole max_model_len prefix of K and V
    rows (16-bit, head_dim padded to a power of two) and the varlen path's max_model_len
    packed rows plus its spare row, grown only, capped."""
    from tkv.kernels import (
        DENSE_PREFIX_CAP,
        dense_prefix_bytes,
        varlen_prefix_bytes,
        varlen_prefix_rows,
    )
    from tkv.kernels._util import interpreting
    from tkv.vllm import workspace as W

    W._PREFILL_SCRATCH.clear()
    try:
        assert W.shared_prefill_scratch("cpu") is None
        a = W.shared_prefill_scratch("cpu", 4096, 8, 96)
        assert dense_prefix_bytes(1, 4096, 8, 128) == dense_prefix_bytes(1, 4096, 8, 96)
        assert a.numel() == varlen_prefix_bytes(4096, 0, 8, 96) > dense_prefix_bytes(1, 4096, 8, 96)
        row = 2 * 8 * 128 * (4 if interpreting() else 2)   # the dot dtype's bytes
        assert a.numel() == 4097 * row    # K and V rows, head_dim padded to 128, + 1 spare row
        assert W.shared_prefill_scratch("cpu", 4096, 8, 96, block_size=64) is a   # same pages
        # one step's prefix-cache hits too: max_model_len + max_num_batched_tokens rows
        b = W.shared_prefill_scratch("cpu", 4096, 8, 96, 16, 8192)
        assert b.numel() == varlen_prefix_bytes(4096, 8192, 8, 96) == (4096 + 8192 + 1) * row
        assert varlen_prefix_rows(b.numel(), 8, 96) == 4096 + 8192 + 1
        assert W.shared_prefill_scratch("cpu", 1024, 8, 96) is b      # smaller: kept
        assert W.shared_prefill_scratch("cpu") is b
        big = W.shared_prefill_scratch("cpu", 10**7, 64, 256)
        assert big.numel() == DENSE_PREFIX_CAP
    finally:
        W._PREFILL_SCRATCH.clear()


def test_plugin_installs_the_jit_log_from_env(patched_vllm, tmp_path, monkeypatch):
    """TKV_JIT_LOG: the plugin logs the process's Triton JIT events (tkv.kernels.jit_log)."""
    from tkv.kernels.testing import check_register_installs_jit_log
    from tkv.vllm import plugin

    check_register_installs_jit_log(plugin.register, tmp_path / "jit.tsv", monkeypatch)
