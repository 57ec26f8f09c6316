"""The engine core's block managers over tkv specs (vLLM 0.20.1 scheduler side, CPU only),
built the way EngineCore builds them (``generate_scheduler_kv_cache_config``): a group of tkv
layers at one width, and a per-layer-width group (``UniformTypeKVCacheSpecs``), full and
sliding attention, with prefix caching — allocate, free, hit the cached prefix. vLLM picks
managers by exact spec type, so without the plugin's map entries this is a KeyError."""

from __future__ import annotations

import pytest

from tkv.vllm import startup

from .conftest import fake_vllm_config, make_bundle, make_layer


@pytest.fixture(autouse=True)
def _fresh_config():
    startup._CONFIGS.clear()
    yield
    startup._CONFIGS.clear()


def _kv_cache_config(monkeypatch, tmp_path, alloc, window):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    from tkv.vllm.spec import kv_cache_spec_for_layer

    monkeypatch.setenv("TKV_BITS", "3.5")
    monkeypatch.setenv("TKV_CALIBRATION_FILE",
                       str(make_bundle(tmp_path / "b.json", rows={"3.5": alloc})))
    vc = fake_vllm_config(block_size=16)
    vc.cache_config.num_gpu_blocks_override = None
    layers = {f"model.layers.{i}.self_attn.attn":
              make_layer(f"model.layers.{i}.self_attn.attn", sliding_window=window)
              for i in range(4)}
    vc.compilation_config.static_forward_context.update(layers)
    specs = {n: kv_cache_spec_for_layer(lay, vc) for n, lay in layers.items()}
    vc.model_config.original_max_model_len = vc.model_config.max_model_len = 1024
    vc.parallel_config.prefill_context_parallel_size = 1
    (cfg,) = get_kv_cache_configs(vc, [specs], [4 * 2**20])
    return cfg


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("mixed", [False, True])
def test_block_manager_allocates_and_hits_the_prefix_cache(patched_vllm, tmp_path,
                                                           monkeypatch, mixed, window):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import single_type_kv_cache_manager as stm
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.request import Request

    from tkv.codec.bundle import LayerAllocation

    alloc = (LayerAllocation((4, 3, 8, 2), (3, 3, 4, 2), "smartmix") if mixed
             else LayerAllocation.uniform(4, 4, 4))
    cfg = _kv_cache_config(monkeypatch, tmp_path, alloc, window)
    (group,) = cfg.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs) == mixed
    cfg = generate_scheduler_kv_cache_config([cfg])  # what EngineCore hands the scheduler
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    kvm = KVCacheManager(cfg, max_model_len=1024, hash_block_size=16, enable_caching=True,
                         max_num_batched_tokens=256)
    mgr = kvm.coordinator.single_type_managers[0]
    assert type(mgr) is (stm.SlidingWindowManager if window else stm.FullAttentionManager)

    prompt = list(range(100, 100 + 80))  # 5 full blocks

    def request(rid):
        return Request(rid, prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)

    r0 = request("r0")
    blocks, hit = kvm.get_computed_blocks(r0)
    assert hit == 0
    got = kvm.allocate_slots(r0, len(prompt))
    assert got is not None and len(got.get_block_ids()[0]) == 5
    kvm.free(r0)
    r1 = request("r1")
    blocks, hit = kvm.get_computed_blocks(r1)
    # full attention: the whole prefix but the last block (vLLM recomputes the last token);
    # sliding window 64: only the blocks the window still needs are real
    assert hit == 64
    assert kvm.allocate_slots(r1, len(prompt) - hit, hit, blocks) is not None
