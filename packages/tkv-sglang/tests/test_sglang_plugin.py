"""With sglang==0.5.11 installed and patched (`tkv-sglang patch apply`): plugin registration,
server-args validation, the patched ModelRunner paths (dtype, cell size, pool) and the
turbo-attn backend on CPU against a float64 attention over codec round-tripped K/V.

Skipped cleanly when sglang is not installed (the default workspace run)."""

from __future__ import annotations

import json
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="sglang==0.5.11 not installed (nox session `sglang`)")

from tkv.codec import SlotLayout, TurboKVCodec
from tkv.kernels.testing import no_stream_sync
from tkv.sglang.cell_size import cell_size_bytes
from tkv.sglang.errors import UnsupportedFeatureError

MIXED_K = (3, 5, 8, 2)
MIXED_V = (4, 2, 6, 7)
PAGE = 16


@pytest.fixture(scope="module")
def sgl():
    """Heavy sglang modules, imported once with their import-time platform warnings muted,
    and the plugin registered."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from sglang.srt.mem_cache import kv_cache_dtype_registry as reg
        except ImportError:
            pytest.skip("sglang is not patched: run `tkv-sglang patch apply`")
        from sglang.srt.layers.attention import attention_registry
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.model_executor import model_runner, pool_configurator
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, prepare_server_args

        from tkv.sglang import plugin

        plugin.register()
        plugin.register()  # idempotent
    return SimpleNamespace(reg=reg, attention_registry=attention_registry,
                           Allocator=PagedTokenToKVPoolAllocator, ReqToTokenPool=ReqToTokenPool,
                           model_runner=model_runner, pool_configurator=pool_configurator,
                           ForwardMode=ForwardMode, Mixin=ModelRunnerKVCacheMixin,
                           choices=ATTENTION_BACKEND_CHOICES, prepare=prepare_server_args,
                           plugin=plugin)


@pytest.fixture
def tiny_model(tmp_path):
    """A local 4-layer Llama config (2 KV heads, head_dim 64): enough for ServerArgs."""
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}))
    return d


def _args(model, *extra):
    return ["--model-path", str(model), "--device", "cpu", "--skip-tokenizer-init", *extra]


# ----------------------------------------------------------------------------- registration
def test_plugin_is_an_entry_point_and_registers_dtype_and_backend(sgl):
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("tkv") == "tkv.sglang.plugin:register"
    spec = sgl.reg.get_kv_cache_dtype_spec("tkv")
    assert spec.torch_dtype == torch.uint8 and spec.attention_backends == ("turbo-attn",)
    assert "tkv" in sgl.reg.get_kv_cache_dtype_choices()
    assert sgl.attention_registry.ATTENTION_BACKENDS["turbo-attn"] is sgl.plugin.create_backend
    assert sgl.choices.count("turbo-attn") == 1


def test_server_args_accept_tkv_and_validate(sgl, tiny_model, tkv_env, bundle_file):
    tkv_env("4.5", bundle_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sa = sgl.prepare(_args(tiny_model, "--kv-cache-dtype", "tkv", "--attention-backend", "turbo-attn"))
        assert (sa.kv_cache_dtype, sa.attention_backend, sa.page_size) == ("tkv", "turbo-attn", 16)
        with pytest.raises(ValueError, match="can only be read by the attention backend"):
            sgl.prepare(_args(tiny_model, "--kv-cache-dtype", "tkv", "--attention-backend", "triton"))
        with pytest.raises(ValueError, match="only reads --kv-cache-dtype tkv"):
            sgl.prepare(_args(tiny_model, "--attention-backend", "turbo-attn"))
        with pytest.raises(UnsupportedFeatureError, match="multiple of 16"):
            sgl.prepare(_args(tiny_model, "--kv-cache-dtype", "tkv", "--attention-backend",
                              "turbo-attn", "--page-size", "8"))
        tkv_env("6.0", bundle_file)
        with pytest.raises(KeyError, match=r"6\.0"):
            sgl.prepare(_args(tiny_model, "--kv-cache-dtype", "tkv", "--attention-backend", "turbo-attn"))


# ----------------------------------------------------------------------------- model runner
class FakeRunner(SimpleNamespace):
    """The attributes of ModelRunner that the patched pool paths read."""


def _runner(sgl, fakes, layers=(0, 4), page=PAGE, tokens=32 * PAGE, device="cpu"):
    mc = fakes.ModelConfig()
    sa = SimpleNamespace(kv_cache_dtype="tkv", enable_memory_saver=False, page_size=page,
                         speculative_num_draft_tokens=None, disaggregation_mode="null",
                         attention_backend="turbo-attn", enable_pdmux=False,
                         speculative_algorithm=None)
    return FakeRunner(
        server_args=sa, model_config=mc, start_layer=layers[0], end_layer=layers[1],
        num_effective_layers=layers[1] - layers[0], page_size=page, device=device,
        mambaish_config=None, is_draft_worker=False, is_hybrid_swa=False, enable_hisparse=False,
        use_mla_backend=False, spec_algorithm=SimpleNamespace(is_dflash=lambda: False),
        max_total_num_tokens=tokens, max_running_requests=8, req_to_token_pool=None,
        token_to_kv_pool_allocator=None, hybrid_gdn_config=None, kv_cache_dtype=torch.uint8)


@pytest.fixture
def tp1(monkeypatch):
    import sglang.srt.layers.dp_attention as dpa

    monkeypatch.setattr(dpa, "get_attention_tp_size", lambda: 1)


def test_configure_kv_cache_dtype_takes_the_plugin_dtype(sgl, fakes):
    r = _runner(sgl, fakes)
    sgl.model_runner.ModelRunner.configure_kv_cache_dtype(r)
    assert r.kv_cache_dtype == torch.uint8


@pytest.mark.parametrize("layers", [(0, 4), (1, 3)])
def test_pool_configurator_prices_tokens_with_slotlayout(sgl, fakes, tkv_env, bundle_file, tp1,
                                                        layers):
    tkv_env("4.5", bundle_file)
    r = _runner(sgl, fakes, layers)
    conf = sgl.pool_configurator.create_memory_pool_configurator(r)
    assert type(conf).__name__ == "PluginKVCacheDtypePoolConfigurator"
    lays = [SlotLayout(64, 2, MIXED_K[i], MIXED_V[i], PAGE) for i in range(*layers)]
    assert conf._cell_size == cell_size_bytes(lays) == sum(l.page_bytes for l in lays) // PAGE
    pages = 1234
    cfg = conf.calculate_pool_sizes(pages * sum(l.page_bytes for l in lays) + 99, PAGE)
    assert cfg.max_total_num_tokens == pages * PAGE
    bf16 = sum(l.bf16_bytes_per_token for l in lays)
    assert bf16 / conf._cell_size == pytest.approx(
        bf16 / sum(l.bytes_per_token for l in lays))


def test_init_pools_builds_the_tkv_pool_and_paged_allocator(sgl, fakes, tkv_env, bundle_file, tp1):
    tkv_env("4.5", bundle_file)
    r = _runner(sgl, fakes)
    sgl.Mixin._init_pools(r)
    pool = r.token_to_kv_pool
    assert type(pool).__name__ == "TkvTokenToKVPool"
    assert isinstance(r.token_to_kv_pool_allocator, sgl.Allocator)
    lays = [SlotLayout(64, 2, kb, vb, PAGE) for kb, vb in zip(MIXED_K, MIXED_V, strict=True)]
    assert pool.layouts == lays
    assert [tuple(b.shape) for b in pool.paged.buffers] == [(32 + 1, l.page_bytes) for l in lays]
    assert pool.get_kv_size_bytes() == 33 * sum(l.page_bytes for l in lays)
    assert pool.get_key_buffer(2) is pool.paged.buffers[2]
    _ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert items == [l.page_bytes for l in lays] and lens == [33 * l.page_bytes for l in lays]
    # allocator hands out whole pages ≥ 1 (page 0 is padding)
    locs = r.token_to_kv_pool_allocator.alloc(3 * PAGE)
    assert locs.min() >= PAGE and (locs.view(3, PAGE) % PAGE == torch.arange(PAGE)).all()
    # store (reference impl on CPU), offload to host, wipe, load back: same bytes
    g = torch.Generator().manual_seed(3)
    layer = SimpleNamespace(layer_id=3)
    pool.set_kv_buffer(layer, locs, torch.randn(3 * PAGE, 2, 64, generator=g),
                       torch.randn(3 * PAGE, 2, 64, generator=g))
    before = [b.clone() for b in pool.paged.buffers]
    assert before[3].any() and not before[0].any()
    host = pool.get_cpu_copy(locs)
    for b in pool.paged.buffers:
        b.zero_()
    pool.load_cpu_copy(host, locs)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.paged.buffers, strict=True))


@pytest.mark.parametrize(("attr", "val", "match"), [
    ("mambaish_config", object(), "Mamba"),
    ("is_draft_worker", True, "draft"),
])
def test_pool_factory_refuses(sgl, fakes, tkv_env, tp1, attr, val, match):
    tkv_env()
    r = _runner(sgl, fakes)
    setattr(r, attr, val)
    from tkv.sglang.factories import create_pool

    with pytest.raises(UnsupportedFeatureError, match=match):
        create_pool(r)


# ----------------------------------------------------------------------------- backend
def _attention64(q, k, v, scale, qpos, kpos):
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) * scale
    s = s.masked_fill(~(kpos[None, :] <= qpos[:, None])[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), v)


class World:
    """A fake worker: runner + tkv pool + req_to_token, and per request the K/V it stored."""

    def __init__(self, sgl, fakes, monkeypatch, device="cpu"):
        import sglang.srt.layers.dp_attention as dpa

        monkeypatch.setattr(dpa, "get_attention_tp_size", lambda: 1)
        self.sgl = sgl
        self.device = torch.device(device)
        self.r = _runner(sgl, fakes, tokens=24 * PAGE, device=device)
        sgl.Mixin._init_pools(self.r)
        self.pool = self.r.token_to_kv_pool
        self.req_to_token = self.r.req_to_token_pool.req_to_token
        self.r.server_args.speculative_algorithm = None
        from tkv.sglang.backend import TurboAttnBackend

        self.backend = TurboAttnBackend(self.r)
        self.layer = SimpleNamespace(layer_id=1, tp_q_head_num=4, tp_k_head_num=2,
                                     tp_v_head_num=2, head_dim=64, qk_head_dim=64, v_head_dim=64,
                                     scaling=0.125, logit_cap=0.0, sliding_window_size=-1,
                                     is_cross_attention=False)
        self.codec: TurboKVCodec = self.pool.codec(1)
        self.k = {}
        self.v = {}
        self.g = torch.Generator().manual_seed(42)

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.device)

    def batch(self, mode, rows, seq_lens, ext=None):
        sl = torch.tensor(seq_lens)
        b = SimpleNamespace(forward_mode=mode, batch_size=len(rows),
                            req_pool_indices=torch.tensor(rows, device=self.device),
                            seq_lens=sl.to(self.device), seq_lens_cpu=sl,
                            encoder_lens=None, spec_info=None)
        if ext is not None:
            b.extend_seq_lens = torch.tensor(ext, dtype=torch.int32, device=self.device)
            b.extend_seq_lens_cpu = list(ext)
            b.extend_prefix_lens_cpu = [n - e for n, e in zip(seq_lens, ext, strict=True)]
        locs = [self.req_to_token[r, n - (ext[i] if ext else 1): n].long()
                for i, (r, n) in enumerate(zip(rows, seq_lens, strict=True))]
        b.out_cache_loc = torch.cat(locs)
        return b

    def extend(self, rows, prev, lens):
        """One extend batch through the backend — requests ``rows`` grow from ``prev`` to
        ``lens`` tokens, their bf16 K/V taken from ``self.k`` / ``self.v`` — checked against
        :meth:`expected` (bf16 tolerance); the metadata stays in ``backend.forward_metadata``."""
        bf = torch.bfloat16
        ext = [n - p for n, p in zip(lens, prev, strict=True)]
        fb = self.batch(self.sgl.ForwardMode.EXTEND, rows, lens, ext)
        self.backend.init_forward_metadata(fb)
        q = self.rand(sum(ext), 4, 64).to(bf)
        kk = torch.cat([self.k[r][p:n] for r, p, n in zip(rows, prev, lens, strict=True)])
        vv = torch.cat([self.v[r][p:n] for r, p, n in zip(rows, prev, lens, strict=True)])
        o = self.backend.forward_extend(q.reshape(len(q), -1), kk.to(bf).reshape(len(q), -1),
                                        vv.to(bf).reshape(len(q), -1), self.layer, fb)
        exp = self.expected(rows, lens, q.float(), ext, chunk_exact=True)
        assert torch.allclose(o.view(-1, 4, 64).double(), exp, atol=3e-2, rtol=3e-2)
        return ext

    def expected(self, rows, seq_lens, q, q_lens, chunk_exact):
        """float64: prefix K/V codec-round-tripped, the chunk exact (extend) or
        round-tripped too (decode, where the new token is read back from the cache)."""
        out, a = [], 0
        for r, n, ql in zip(rows, seq_lens, q_lens, strict=True):
            k, v = self.k[r][:n], self.v[r][:n]
            kr = self.codec.decompress_k(*self.codec.compress_k(k)).double()
            vr = self.codec.decompress_v(*self.codec.compress_v(v)).double()
            if chunk_exact:
                kr[n - ql:], vr[n - ql:] = k[n - ql:].double(), v[n - ql:].double()
            out.append(_attention64(q[a:a + ql], kr, vr, 0.125,
                                    torch.arange(n - ql, n, device=q.device),
                                    torch.arange(n, device=q.device)))
            a += ql
        return torch.cat(out)


@pytest.fixture
def world(sgl, fakes, tkv_env, bundle_file, monkeypatch):
    tkv_env("4.5", bundle_file)
    monkeypatch.setenv("TKV_SGLANG_IMPL", "reference")
    return World(sgl, fakes, monkeypatch)


def test_extend_then_chunked_prefill_then_decode_with_shared_prefix(world, sgl):
    w, FM = world, sgl.ForwardMode
    # request rows 1 and 2; pages deliberately out of order; row 2 shares row 1's first page
    # (a radix-cache prefix hit: same compressed page, read by both)
    pages1, pages2 = [7, 3, 12], [7, 5, 9]
    for row, pages in ((1, pages1), (2, pages2)):
        w.req_to_token[row, : len(pages) * PAGE] = torch.cat(
            [torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).int()
    w.k[1], w.v[1] = w.rand(40, 2, 64), w.rand(40, 2, 64)
    w.k[2], w.v[2] = w.rand(40, 2, 64), w.rand(40, 2, 64)
    w.k[2][:PAGE], w.v[2][:PAGE] = w.k[1][:PAGE], w.v[1][:PAGE]

    # 1) prefill row 1 (21 tokens) and row 2's shared page is then a prefix hit
    fb = w.batch(FM.EXTEND, [1], [21], [21])
    w.backend.init_forward_metadata(fb)
    assert w.backend.forward_metadata.block_table.tolist() == [[7, 3]]
    q = w.rand(21, 4, 64)
    o = w.backend.forward_extend(q, w.k[1][:21].reshape(21, -1), w.v[1][:21].reshape(21, -1),
                                 w.layer, fb)
    exp = w.expected([1], [21], q, [21], chunk_exact=True)
    assert torch.allclose(o.view(21, 4, 64).double(), exp, atol=1e-4)

    # 2) row 2: prefix = shared page (16 tokens, cached) + chunk of 9; row 1: chunk of 9 more
    fb = w.batch(FM.EXTEND, [2, 1], [25, 30], [9, 9])
    w.backend.init_forward_metadata(fb)
    md = w.backend.forward_metadata
    assert md.block_table.tolist() == [[7, 5], [7, 3]] and md.cu_seqlens_q.tolist() == [0, 9, 18]
    q = w.rand(18, 4, 64)
    kk = torch.cat([w.k[2][16:25], w.k[1][21:30]]).reshape(18, -1)
    vv = torch.cat([w.v[2][16:25], w.v[1][21:30]]).reshape(18, -1)
    o = w.backend.forward_extend(q, kk, vv, w.layer, fb)
    exp = w.expected([2, 1], [25, 30], q, [9, 9], chunk_exact=True)
    assert torch.allclose(o.view(18, 4, 64).double(), exp, atol=1e-4)

    # 3) decode one token each: everything read back compressed
    fb = w.batch(FM.DECODE, [1, 2], [31, 26])
    w.backend.init_forward_metadata(fb)
    assert w.backend.forward_metadata.block_table.tolist() == [[7, 3], [7, 5]]
    q = w.rand(2, 4, 64)
    kk = torch.stack([w.k[1][30], w.k[2][25]]).reshape(2, -1)
    vv = torch.stack([w.v[1][30], w.v[2][25]]).reshape(2, -1)
    o = w.backend.forward_decode(q.reshape(2, -1), kk, vv, w.layer, fb)
    exp = w.expected([1, 2], [31, 26], q, [1, 1], chunk_exact=False)
    assert torch.allclose(o.view(2, 4, 64).double(), exp, atol=1e-4)
    # the stored bytes are the codec's bytes (layer 1 is K5V2 in the mixed row)
    reg = w.pool.paged.gather(0 + 1, w.req_to_token[1, :31].long())
    kc, kn = w.codec.compress_k(w.k[1][:31])
    assert w.pool.layout(1).k_bits == 5 and torch.equal(reg["k_codes"], kc)
    assert torch.equal(reg["k_norms"], kn)


def test_cuda_graph_metadata_is_static_and_refilled_in_place(world, sgl):
    w, FM = world, sgl.ForwardMode
    for row, pages in ((1, [4, 2]), (2, [9, 1, 6])):
        w.req_to_token[row, : len(pages) * PAGE] = torch.cat(
            [torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).int()
    w.backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    rows = torch.tensor([1, 2, 0, 0])
    w.backend.init_forward_metadata_capture_cuda_graph(4, 4, rows, torch.ones(4, dtype=torch.int64),
                                                       None, FM.DECODE, None)
    cap = w.backend.forward_metadata
    ptrs = (cap.block_table.data_ptr(), cap.seq_lens.data_ptr())
    sl = torch.tensor([20, 40, 1, 1])
    w.backend.init_forward_metadata_replay_cuda_graph(4, rows, sl, int(sl.sum()), None,
                                                      FM.DECODE, None, sl)
    rep = w.backend.forward_metadata
    assert (rep.block_table.data_ptr(), rep.seq_lens.data_ptr()) == ptrs
    assert rep.seq_lens.tolist() == [20, 40, 1, 1]
    assert rep.block_table[:2, :3].tolist() == [[4, 2, 0], [9, 1, 6]]
    # eager metadata of the same batch names the same pages
    w.backend.init_forward_metadata(w.batch(FM.DECODE, [1, 2], [20, 40]))
    eager = w.backend.forward_metadata.block_table
    assert eager.tolist() == [[4, 2, 0], [9, 1, 6]]
    assert w.backend.get_cuda_graph_seq_len_fill_value() == 1
    with pytest.raises(UnsupportedFeatureError, match="decode batches only"):
        w.backend.init_forward_metadata_capture_cuda_graph(4, 4, rows, sl, None, FM.EXTEND, None)


def test_backend_refuses_what_it_cannot_serve(world, sgl):
    w, FM = world, sgl.ForwardMode
    fb = w.batch(FM.DECODE, [1], [1])
    w.backend.init_forward_metadata(fb)
    q = w.rand(1, 256)
    kv = w.rand(1, 128)
    for attr, val, match in (("logit_cap", 30.0, "soft-capping"),
                             ("is_cross_attention", True, "cross attention")):
        layer = SimpleNamespace(**vars(w.layer))
        setattr(layer, attr, val)
        with pytest.raises(UnsupportedFeatureError, match=match):
            w.backend.forward_decode(q, kv, kv, layer, fb)
    with pytest.raises(UnsupportedFeatureError, match="sinks"):
        w.backend.forward_decode(q, kv, kv, w.layer, fb, sinks=torch.zeros(4))
    fb.spec_info = object()
    with pytest.raises(UnsupportedFeatureError, match="speculative"):
        w.backend.init_forward_metadata(fb)
    w.r.token_to_kv_pool = object()
    from tkv.sglang.backend import TurboAttnBackend

    with pytest.raises(UnsupportedFeatureError, match="--kv-cache-dtype tkv"):
        TurboAttnBackend(w.r)


def test_window_conversion():
    from tkv.sglang.backend import _window

    assert _window(SimpleNamespace(sliding_window_size=-1)) == 0
    assert _window(SimpleNamespace(sliding_window_size=4095)) == 4096


def test_extend_and_decode_write_into_sglangs_preallocated_output(world, sgl):
    """SGLang's piecewise-CUDA-graph path leaves its output slice on
    ``forward_batch._attn_output`` and copies any other returned tensor into it: the backend
    writes into that buffer (returned as itself, values as without it, padding rows past the
    slice untouched) where it has the output's shape, dtype and device and shares no memory
    with q / K / V, and ignores it otherwise (the buffer then untouched)."""
    w, FM = world, sgl.ForwardMode
    w.req_to_token[1, : 2 * PAGE] = torch.cat(
        [torch.arange(p * PAGE, (p + 1) * PAGE) for p in (4, 9)]).int()
    w.k[1], w.v[1] = w.rand(20, 2, 64), w.rand(20, 2, 64)
    q = w.rand(19, 4, 64)
    kk, vv = w.k[1][:19].reshape(19, -1), w.v[1][:19].reshape(19, -1)
    fb = w.batch(FM.EXTEND, [1], [19], [19])
    w.backend.init_forward_metadata(fb)
    plain = w.backend.forward_extend(q, kk, vv, w.layer, fb)
    for buf in (torch.full((19, 256), float("nan"), device=w.device),        # (tokens, H·d)
                torch.full((19, 4, 64), float("nan"), device=w.device)):     # (tokens, H, d)
        fb._attn_output = buf
        o = w.backend.forward_extend(q, kk, vv, w.layer, fb)
        assert o.data_ptr() == buf.data_ptr() and o.shape == (19, 256)
        assert torch.equal(o, plain) and torch.equal(buf.reshape(19, 256), plain)
    padded = torch.full((24, 256), float("nan"), device=w.device)   # SGLang's output[:real]
    fb._attn_output = padded[:19]
    o = w.backend.forward_extend(q, kk, vv, w.layer, fb)
    assert o.data_ptr() == padded.data_ptr() and torch.equal(padded[:19], plain)
    assert torch.isnan(padded[19:]).all()
    for bad in (torch.full((19, 256), float("nan"), device=w.device, dtype=torch.float16),
                torch.full((20, 256), float("nan"), device=w.device),
                torch.full((256, 19), float("nan"), device=w.device).t()):   # not contiguous
        fb._attn_output = bad
        o = w.backend.forward_extend(q, kk, vv, w.layer, fb)
        assert o.data_ptr() != bad.data_ptr() and torch.equal(o, plain)
        assert torch.isnan(bad).all()
    # a buffer that shares memory with q or the chunk's K/V is never written
    qq, kk2 = q.reshape(19, 256).clone(), torch.cat([kk, kk], 1).clone()   # kk2[:, :128] = K
    for alias, qa, ka in ((qq, qq, kk), (kk2, q, kk2[:, :128])):
        keep = alias.clone()
        fb._attn_output = alias
        o = w.backend.forward_extend(qa, ka, vv, w.layer, fb)
        assert o.data_ptr() != alias.data_ptr() and torch.equal(o, plain)
        assert torch.equal(alias, keep)
    # decode: the same rule (one new token)
    fb = w.batch(FM.DECODE, [1], [20])
    w.backend.init_forward_metadata(fb)
    qd, kd, vd = w.rand(1, 256), w.k[1][19].reshape(1, -1), w.v[1][19].reshape(1, -1)
    plain = w.backend.forward_decode(qd, kd, vd, w.layer, fb)
    fb._attn_output = torch.full((1, 256), float("nan"), device=w.device)
    o = w.backend.forward_decode(qd, kd, vd, w.layer, fb)
    assert o.data_ptr() == fb._attn_output.data_ptr() and torch.equal(o, plain)


_TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _three_requests(w) -> None:
    """Requests 1-3 on scattered pages (2, 2 and 1 pages), bf16-exact K/V of 32 tokens each:
    the chunked-prefill scenarios' world (first chunks, continuations, a new request)."""
    bf = torch.bfloat16
    for row, pages in ((1, [6, 1]), (2, [2, 9]), (3, [4])):
        w.req_to_token[row, : len(pages) * PAGE] = torch.cat(
            [torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).int()
        w.k[row] = w.rand(32, 2, 64).to(bf).float()
        w.v[row] = w.rand(32, 2, 64).to(bf).float()


@pytest.mark.skipif(not _TRITON_OK, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("flash", [False, True])
def test_triton_extend_writes_into_a_padded_preallocated_output(sgl, fakes, tkv_env, bundle_file,
                                                               monkeypatch, flash):
    """The kernels' path (first chunks, continuations, a continuation beside a new request;
    with ``flash`` a stand-in sgl-kernel varlen that writes into ``out=``, as
    TKV_PREFILL_ATTENTION=auto binds FA3 on a GPU): the result lands in SGLang's
    ``output[:real]`` slice, equal to the reference, the padding rows untouched."""
    tkv_env("4.5", bundle_file)
    monkeypatch.setenv("TKV_SGLANG_IMPL", "triton")
    w = World(sgl, fakes, monkeypatch)
    if flash:
        from tkv.kernels import FlashVarlenAttention
        from tkv.kernels.testing import reference_flash_varlen

        w.backend.dense_attention = FlashVarlenAttention(
            lambda q, k, v, out=None, **kw: reference_flash_varlen(q, k, v, out=out, **kw),
            ver=3)
    _three_requests(w)
    made, returned = [], []
    batch, forward_extend = w.batch, w.backend.forward_extend

    def padded_batch(mode, rows, seq_lens, ext=None):
        b = batch(mode, rows, seq_lens, ext)
        full = torch.full((sum(ext) + 5, 256), float("nan"), dtype=torch.bfloat16, device=w.device)
        b._attn_output = full[:sum(ext)]
        made.append(full)
        return b

    def recording_extend(*a, **kw):
        returned.append(forward_extend(*a, **kw))
        return returned[-1]

    w.batch, w.backend.forward_extend = padded_batch, recording_extend
    for rows, prev, lens in (([1, 2], [0, 0], [20, 7]), ([1, 2], [20, 7], [29, 19]),
                             ([1, 3], [29, 0], [32, 11])):
        w.extend(rows, prev, lens)   # checks the values against the float64 reference
        assert returned[-1].data_ptr() == made[-1].data_ptr()
        assert torch.isnan(made[-1][-5:].float()).all()


@pytest.mark.skipif(not _TRITON_OK, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
def test_triton_impl_store_and_decode_match_the_reference(sgl, fakes, tkv_env, bundle_file,
                                                          monkeypatch):
    """tkv.kernels compress_store + split-K decode through the backend == float64 attention
    over codec round-tripped K/V (small shapes: runs under the Triton interpreter on CPU)."""
    kernels = pytest.importorskip("tkv.kernels")
    if not all(hasattr(kernels, n) for n in ("compress_store", "decode", "Workspace")):
        pytest.skip("tkv.kernels lacks compress_store/decode/Workspace")
    tkv_env("4.5", bundle_file)
    monkeypatch.setenv("TKV_SGLANG_IMPL", "triton")
    w = World(sgl, fakes, monkeypatch)
    assert w.pool.impl == "triton" and w.backend.impl == "triton"
    FM = sgl.ForwardMode
    for row, pages in ((1, [5, 2]), (2, [8, 3])):
        w.req_to_token[row, : len(pages) * PAGE] = torch.cat(
            [torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).int()
        w.k[row], w.v[row] = w.rand(32, 2, 64), w.rand(32, 2, 64)
    lens = [23, 30]
    # store every token through the kernel, then decode the last one of each request
    fb = w.batch(FM.EXTEND, [1, 2], lens, lens)
    kk = torch.cat([w.k[1][:23], w.k[2][:30]])
    vv = torch.cat([w.v[1][:23], w.v[2][:30]])
    w.pool.set_kv_buffer(w.layer, fb.out_cache_loc, kk, vv)
    ref_bytes = w.codec.compress_k(w.k[1][:23])
    got = w.pool.paged.gather(1, w.req_to_token[1, :23].long())
    assert (got["k_codes"] == ref_bytes[0]).float().mean() > 0.99   # boundary rounding only
    fb = w.batch(FM.DECODE, [1, 2], lens)
    w.backend.init_forward_metadata(fb)
    q = w.rand(2, 4, 64).to(torch.bfloat16)
    o = w.backend.forward_decode(q.reshape(2, -1), None, None, w.layer, fb, save_kv_cache=False)
    exp = w.expected([1, 2], lens, q.float(), [1, 1], chunk_exact=False)
    assert torch.allclose(o.view(2, 4, 64).double(), exp, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not _TRITON_OK, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("small_head_groups,flash", [("0", False), (None, False), (None, True)])
def test_triton_impl_chunked_prefill_matches_the_reference(sgl, fakes, tkv_env, bundle_file,
                                                           monkeypatch, small_head_groups, flash):
    """Extend through tkv.kernels.prefill: first chunk, then a second chunk whose prefix is
    read compressed from the pages the first chunk stored (TKV_SMALL_HEAD_GROUPS and
    TKV_FUSED_QUERY_ROTATION reach the pool's loaders too: unset = the defaults, on; 0 = per
    element and a separate query-rotation launch). ``flash``: the backend's
    dense_attention is FlashVarlenAttention over a fake sgl-kernel varlen (as
    TKV_PREFILL_ATTENTION=flash builds it on a GPU): the first chunks (two sequences, no
    prefix) go through it in one call, the two-sequence continuation does not."""
    kernels = pytest.importorskip("tkv.kernels")
    if not hasattr(kernels, "prefill"):
        pytest.skip("tkv.kernels lacks prefill")
    tkv_env("4.5", bundle_file)
    monkeypatch.setenv("TKV_SGLANG_IMPL", "triton")
    monkeypatch.setenv("TKV_LOOKUP", "gather")   # reaches the pool's loaders (exact here)
    monkeypatch.delenv("TKV_FUSED_QUERY_ROTATION", raising=False)
    if small_head_groups is None:
        monkeypatch.delenv("TKV_SMALL_HEAD_GROUPS", raising=False)
    else:   # with the separate decode query-rotation launch too (its loaders take it)
        monkeypatch.setenv("TKV_SMALL_HEAD_GROUPS", small_head_groups)
        monkeypatch.setenv("TKV_FUSED_QUERY_ROTATION", "0")
    w = World(sgl, fakes, monkeypatch)
    calls = []
    if flash:
        from tkv.kernels import FlashVarlenAttention
        from tkv.kernels.testing import reference_flash_varlen

        def fake_varlen(q, k, v, out=None, **kw):   # out=: writes_out, as FA3's
            assert kw["ver"] == 3
            calls.append(tuple(q.shape))
            return reference_flash_varlen(q, k, v, out=out, **kw)

        w.backend.dense_attention = FlashVarlenAttention(fake_varlen, ver=3)
    assert w.pool.loader(w.layer.layer_id).lookup == "gather"
    assert w.pool.loader(w.layer.layer_id).small_head_groups is (small_head_groups != "0")
    assert w.pool.loader(w.layer.layer_id).fused_query_rotation is (small_head_groups is None)
    _three_requests(w)
    # first chunks (one run: the bypass); two continuations (one run: the decompress-once
    # bound); a continuation then a new request (two runs: exact prefix, then the bypass)
    for rows, prev, lens, want in (
            ([1, 2], [0, 0], [20, 7], [(0, 2, 0, True, False)]),
            ([1, 2], [20, 7], [29, 19], [(0, 2, 20, False, False)]),
            ([1, 3], [29, 0], [32, 11], [(0, 1, 29, False, True), (1, 2, 0, True, False)])):
        ext = w.extend(rows, prev, lens)
        md = w.backend.forward_metadata
        assert [(r.row_lo, r.row_hi, r.max_prefix_len, r.no_prefix, r.prefix_exact)
                for r in md.runs] == want, md.runs
        assert [c.tolist() for c in md.run_cu_seqlens] == [
            [0, *torch.tensor(ext[r.row_lo:r.row_hi]).cumsum(0).tolist()] for r in md.runs]
        # the first chunks compile the prefix-reading variant right away
        assert w.layer.layer_id in w.backend._prefix_variant_warm
    # FlashAttention runs the first chunks: both requests at once, then the new request alone
    assert calls == ([(27, 4, 64), (11, 4, 64)] if flash else [])


@pytest.mark.skipif(not _TRITON_OK, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("flash", [False, True])
def test_triton_impl_radix_hits_take_one_varlen_call(sgl, fakes, tkv_env, bundle_file,
                                                     monkeypatch, flash):
    """Two requests whose prompts start with cached pages (radix-cache hits: 16 and 32 cached
    tokens) extend by 70 and 40 tokens: one run of two rows with a prefix. ``flash`` (a fake
    sgl-kernel varlen as TKV_PREFILL_ATTENTION=flash binds it): the kernels' varlen path —
    ONE call, 110 query rows over 48 + 110 packed key rows (``prefix_tokens`` from
    extend_prefix_lens_cpu, the scratch sized for exactly that); else the decompress-once
    Triton loop. Equal to the reference either way."""
    tkv_env("4.5", bundle_file)
    monkeypatch.setenv("TKV_SGLANG_IMPL", "triton")
    w = World(sgl, fakes, monkeypatch)
    calls = []
    if flash:
        from tkv.kernels import FlashVarlenAttention
        from tkv.kernels.testing import reference_flash_varlen

        def fake_varlen(q, k, v, out=None, **kw):
            calls.append((tuple(q.shape), tuple(k.shape), kw["max_seqlen_k"]))
            return reference_flash_varlen(q, k, v, out=out, **kw)

        w.backend.dense_attention = FlashVarlenAttention(fake_varlen, ver=3)
    bf = torch.bfloat16
    for row, pages in ((1, [6, 1, 10, 3, 14, 8]), (2, [2, 9, 5, 12, 0])):
        w.req_to_token[row, : len(pages) * PAGE] = torch.cat(
            [torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).int()
        w.k[row] = w.rand(len(pages) * PAGE, 2, 64).to(bf).float()
        w.v[row] = w.rand(len(pages) * PAGE, 2, 64).to(bf).float()
    # the cached prefixes, stored by an earlier extend (first chunks: the bypass, no call when
    # flash is off; one when on)
    for rows, prev, lens in (([1, 2], [0, 0], [16, 32]), ([1, 2], [16, 32], [86, 72])):
        w.extend(rows, prev, lens)
    (run,) = w.backend.forward_metadata.runs
    assert (run.max_prefix_len, run.prefix_tokens, run.no_prefix) == (32, 48, False)
    assert calls == ([((48, 4, 64), (48, 2, 64), 32), ((110, 4, 64), (158, 2, 64), 102)]
                     if flash else [])


def test_prefill_attention_choice_is_validated(sgl, monkeypatch):
    """TKV_PREFILL_ATTENTION in the SGLang backend: unset = auto (since session 32: FA3's
    first-chunk attention took half the device time of tkv's Triton kernel on SmolLM2), which
    falls back where FA3 cannot run (CPU, a GPU FA3 does not support, a float32 model); tkv
    keeps tkv's kernels everywhere; flash and continuation raise where FA3 cannot run;
    continuation leaves first chunks to tkv's kernels; bad values are named (the shared
    tkv.kernels parser)."""
    import sys
    from types import ModuleType

    from tkv.kernels import FlashVarlenAttention, PrefillAttentionConfigError
    from tkv.sglang import prefill_attention as pa

    bf16 = torch.bfloat16
    assert pa.DEFAULT == "auto"
    assert pa.prefill_attention("cpu", bf16, environ={}) is None
    assert pa.prefill_attention("cpu", bf16, environ={"TKV_PREFILL_ATTENTION": "auto"}) is None
    with pytest.raises(PrefillAttentionConfigError, match="CUDA"):
        pa.prefill_attention("cpu", bf16, environ={"TKV_PREFILL_ATTENTION": "flash"})
    with pytest.raises(PrefillAttentionConfigError, match="'fa2'"):
        pa.prefill_attention("cpu", bf16, environ={"TKV_PREFILL_ATTENTION": "fa2"})
    # the PyTorch reference implementation: validated too, flash refused, never a callable
    assert pa.prefill_attention("cuda:0", bf16, environ={}, impl="reference") is None
    assert pa.prefill_attention("cuda:0", bf16, environ={"TKV_PREFILL_ATTENTION": "auto"},
                                impl="reference") is None
    for bad, msg in (("fa2", "'fa2'"), ("flash", "reference"), ("continuation", "reference")):
        with pytest.raises(PrefillAttentionConfigError, match=msg):
            pa.prefill_attention("cuda:0", bf16, environ={"TKV_PREFILL_ATTENTION": bad},
                                 impl="reference")
    # sgl-kernel's flash module as seen on a CUDA machine (the staged one lacks flash_ops)
    fake = ModuleType("sgl_kernel.flash_attn")
    fake.flash_attn_varlen_func = lambda *a, **kw: None
    fake.is_fa3_supported = lambda dev: dev.index == 0
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_attn", fake)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Fake GPU")
    auto, flash = {"TKV_PREFILL_ATTENTION": "auto"}, {"TKV_PREFILL_ATTENTION": "flash"}
    fa = pa.prefill_attention("cuda:0", bf16, environ=auto)
    assert isinstance(fa, FlashVarlenAttention) and fa.extra == {"ver": 3}
    unset = pa.prefill_attention("cuda:0", bf16, environ={})       # the default is auto
    assert isinstance(unset, FlashVarlenAttention) and unset.first_chunks
    assert pa.prefill_attention("cuda:0", bf16, environ={"TKV_PREFILL_ATTENTION": "tkv"}) is None
    assert pa.prefill_attention("cuda:1", bf16, environ={}) is None   # FA3 unsupported there
    assert pa.prefill_attention("cuda:1", bf16, environ=auto) is None
    assert pa.prefill_attention("cuda:0", torch.float32, environ=auto) is None
    with pytest.raises(PrefillAttentionConfigError, match="Fake GPU"):
        pa.prefill_attention("cuda:1", bf16, environ=flash)
    with pytest.raises(PrefillAttentionConfigError, match="float32"):
        pa.prefill_attention("cuda:0", torch.float32, environ=flash)
    assert fa.first_chunks is True
    cont = {"TKV_PREFILL_ATTENTION": "continuation"}
    assert pa.prefill_attention("cuda:0", bf16, environ=cont).first_chunks is False
    with pytest.raises(PrefillAttentionConfigError, match=r"continuation: .*Fake GPU"):
        pa.prefill_attention("cuda:1", bf16, environ=cont)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_replay_matches_eager_without_host_sync(sgl, fakes, tkv_env,
                                                                  bundle_file, monkeypatch):
    """Capture turbo-attn decode in a CUDA graph, replay it with new lengths/pages/queries:
    equal to eager decode; the eager forward path never syncs with the host."""
    tkv_env("4.5", bundle_file)
    monkeypatch.setenv("TKV_SGLANG_IMPL", "triton")
    w = World(sgl, fakes, monkeypatch, device="cuda")
    FM = sgl.ForwardMode
    for row, pages in ((1, [5, 2, 11]), (2, [8, 3, 14]), (3, [6, 1, 9])):
        w.req_to_token[row, : len(pages) * PAGE] = torch.cat(
            [torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).int().cuda()
        w.k[row], w.v[row] = w.rand(48, 2, 64), w.rand(48, 2, 64)
        loc = w.req_to_token[row, :48].long()
        w.pool.set_kv_buffer(w.layer, loc, w.k[row].bfloat16(), w.v[row].bfloat16())
    bs = 2
    w.backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    rows = torch.tensor([1, 2], device="cuda")
    w.backend.init_forward_metadata_capture_cuda_graph(
        bs, bs, rows, torch.ones(bs, dtype=torch.int64, device="cuda"), None, FM.DECODE, None)
    q_static = torch.zeros(bs, 4 * 64, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w.backend.forward_decode(q_static, None, None, w.layer, None, save_kv_cache=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = w.backend.forward_decode(q_static, None, None, w.layer, None,
                                              save_kv_cache=False)
    for rows_l, lens in (([1, 2], [20, 33]), ([3, 1], [48, 7])):
        q = w.rand(bs, 4 * 64).bfloat16()
        r = torch.tensor(rows_l, device="cuda")
        sl = torch.tensor(lens)
        w.backend.init_forward_metadata_replay_cuda_graph(bs, r, sl.cuda(), int(sl.sum()), None,
                                                          FM.DECODE, None, sl)
        q_static.copy_(q)
        graph.replay()
        fb = w.batch(FM.DECODE, rows_l, lens)
        w.backend.init_forward_metadata(fb)
        torch.cuda.synchronize()
        with no_stream_sync():
            eager = w.backend.forward_decode(q, None, None, w.layer, fb, save_kv_cache=False)
        torch.cuda.synchronize()
        assert torch.allclose(out_static.float(), eager.float(), atol=2e-3, rtol=2e-3)
        exp = w.expected(rows_l, lens, q.float().view(bs, 4, 64), [1, 1], chunk_exact=False)
        assert torch.allclose(eager.view(bs, 4, 64).double(), exp, atol=3e-2, rtol=3e-2)


def test_installed_sglang_reports_applied(sgl, capsys):
    """`tkv-sglang patch status` on the installed (patched) sglang, found without --target."""
    from tkv.sglang import cli
    from tkv.sglang.patching import find_installed_sglang, read_tree_version

    root = find_installed_sglang()
    assert read_tree_version(root) == "0.5.11"
    assert cli.main(["patch", "status"]) == 0
    assert capsys.readouterr().out.count("applied ") == 2


@pytest.mark.parametrize(("tp", "heads"), [(2, 1), (4, 1)])
def test_tensor_parallel_rank_holds_its_heads_share(sgl, fakes, tkv_env, bundle_file, monkeypatch,
                                                   tmp_path, tp, heads):
    """Per attention-TP rank: SGLang's get_num_kv_heads(tp) heads per layer (replicated when
    tp > kv heads); the bundle (whole-model geometry) still validates; bytes follow
    SlotLayout; a bundle's per-head offsets (key offset μ, sink offsets: tkv-calibrate's
    default) are sliced to the rank's head — the rank stores exactly the bytes the
    whole-model codec writes for that head (QKVParallelLinear's rule: rank r holds head
    r // (tp / 2))."""
    import dataclasses

    import sglang.srt.layers.dp_attention as dpa

    from tkv.codec import CalibrationBundle, KvHeadShard

    g = torch.Generator().manual_seed(11)
    mu, sk, sv = (torch.randn(2, 64, generator=g) for _ in range(3))
    flat = lambda t: tuple(t.flatten().tolist())
    b = CalibrationBundle.load(bundle_file)
    layers = tuple(dataclasses.replace(c, k_channel_offset=flat(mu), k_sink_offset=flat(sk),
                                       v_sink_offset=flat(sv)) for c in b.layers)
    path = dataclasses.replace(b, layers=layers).save(tmp_path / "ph.json")
    monkeypatch.setattr(dpa, "get_attention_tp_size", lambda: tp)
    lays = [SlotLayout(64, heads, kb, vb, PAGE) for kb, vb in zip(MIXED_K, MIXED_V, strict=True)]
    k = torch.randn(PAGE, 2, 64, generator=g) * 2 + mu
    v = torch.randn(PAGE, 2, 64, generator=g)
    for rank in range(tp):
        monkeypatch.setattr(dpa, "get_attention_tp_rank", lambda rank=rank: rank)
        tkv_env("4.5", path)
        r = _runner(sgl, fakes)
        sgl.Mixin._init_pools(r)
        pool = r.token_to_kv_pool
        assert pool.layouts == lays
        assert list(pool.shard.heads) == [rank // (tp // 2)]
        conf = sgl.pool_configurator.create_memory_pool_configurator(r)
        assert conf._cell_size == cell_size_bytes(lays)
        h = pool.shard.first_head
        full = pool.config.codec(2)          # whole-model codec: both heads
        locs = torch.arange(PAGE, 2 * PAGE)
        pool.set_kv_buffer(SimpleNamespace(layer_id=2), locs, k[:, h:h + 1], v[:, h:h + 1])
        got = pool.paged.gather(2, locs)
        kc, kn = full.compress_k(k)
        vc, vn = full.compress_v(v)
        assert torch.equal(got["k_codes"], kc[:, h:h + 1]) and torch.equal(got["k_norms"], kn[:, h:h + 1])
        assert torch.equal(got["v_codes"], vc[:, h:h + 1]) and torch.equal(got["v_norms"], vn[:, h:h + 1])
        # the other head's offsets would code these keys differently: the slice matters
        other = pool.config.codec(2, shard=KvHeadShard(1, 1 - h, 1))
        assert not torch.equal(other.compress_k(k[:, h:h + 1])[0], got["k_codes"])


@pytest.mark.parametrize(("h", "t"), [(8, 1), (8, 2), (8, 4), (8, 8), (2, 4), (1, 8), (4, 8),
                                    (2, 2), (4, 16)])
def test_kv_head_rule_is_sglangs_qkv_parallel_linear(sgl, h, t):
    """tkv.codec.shard_kv_heads and loaded_kv_shard agree with the heads SGLang's own
    QKVParallelLinear loads on every rank: a k weight whose rows hold their head index goes
    through its weight_loader, and the rank's k slice holds exactly the shard's heads."""
    from sglang.srt.layers.linear import QKVParallelLinear

    from tkv.codec import shard_kv_heads
    from tkv.sglang.factories import loaded_kv_shard

    d, hq, hidden = 4, 16, 8
    w = torch.arange(h).repeat_interleave(d).float()[:, None].expand(h * d, hidden).contiguous()
    for r in range(t):
        m = QKVParallelLinear(hidden, d, hq, h, bias=False, tp_rank=r, tp_size=t)
        m.weight_loader(m.weight, w, "k")
        k_rows = m.weight.data[m.num_heads * d:(m.num_heads + m.num_kv_heads) * d, 0]
        s = shard_kv_heads(h, t, r)
        assert sorted(set(k_rows.long().tolist())) == list(s.heads)
        assert loaded_kv_shard(_decoder_model(m)) == s


def _decoder_model(qkv, vision_qkv=None):
    """A stand-in model: an optional vision tower's attention (a ``qkv_proj`` without a
    RadixAttention) first, then one decoder attention layer (``qkv_proj`` + ``attn`` with a
    ``layer_id``), as SGLang's Llama/Qwen attention modules hold them."""

    class Attn(torch.nn.Module):
        def __init__(self, qkv, layer_id):
            super().__init__()
            self.qkv_proj = qkv
            self.attn = SimpleNamespace(layer_id=layer_id) if layer_id is not None else None

    layers = [] if vision_qkv is None else [Attn(vision_qkv, None)]
    return torch.nn.Sequential(*layers, Attn(qkv, 0))


def test_rank_shard_refuses_a_model_sharded_over_another_group(sgl, fakes, monkeypatch):
    """Under DP attention a Llama-style model shards attention over the plain TP group while
    SGLang sizes the pool with the attention-TP group: a rank whose loaded KV heads are not
    the attention-TP shard is refused by name, never served with another head's offsets."""
    import sglang.srt.layers.dp_attention as dpa
    from sglang.srt.layers.linear import QKVParallelLinear

    from tkv.sglang.factories import rank_shard

    monkeypatch.setattr(dpa, "get_attention_tp_size", lambda: 2)
    monkeypatch.setattr(dpa, "get_attention_tp_rank", lambda: 1)
    r = _runner(sgl, fakes)                       # 2 KV heads: attention-TP rank 1 holds head 1
    assert list(rank_shard(r).heads) == [1]       # no model loaded yet: the rule alone
    r.model = _decoder_model(QKVParallelLinear(8, 64, 4, 2, bias=False, tp_rank=1, tp_size=2))
    assert list(rank_shard(r).heads) == [1]
    # a vision tower's attention (16 heads, before the decoder in module order) is not read
    vision = QKVParallelLinear(8, 16, 16, 16, bias=False, tp_rank=1, tp_size=2)
    r.model = _decoder_model(QKVParallelLinear(8, 64, 4, 2, bias=False, tp_rank=1, tp_size=2),
                             vision)
    assert list(rank_shard(r).heads) == [1]
    # plain TP 4 (rank 1 → head 0) while attention TP is 2 (rank 1 → head 1)
    r.model = _decoder_model(QKVParallelLinear(8, 64, 4, 2, bias=False, tp_rank=1, tp_size=4))
    with pytest.raises(UnsupportedFeatureError, match=r"loaded KV heads \[0\].*gives \[1\]"):
        rank_shard(r)


def test_pool_refuses_layouts_of_another_head_count(sgl, tkv_env, bundle_file):
    """The pool's layouts must hold the rank's heads (the shard's, or the model's unsharded)."""
    from tkv.codec import KvHeadShard, ShapeError
    from tkv.sglang.config import tkv_config
    from tkv.sglang.geometry import AttentionGeometry
    from tkv.sglang.pool import TkvTokenToKVPool

    tkv_env("4.5", bundle_file)
    cfg = tkv_config(AttentionGeometry(4, 2, 64))
    two = [cfg.slot_layout(i, PAGE) for i in range(4)]
    one = [cfg.slot_layout(i, PAGE, 1) for i in range(4)]
    with pytest.raises(ShapeError, match=r"layouts hold \[1\] KV heads, this rank 2"):
        TkvTokenToKVPool(4 * PAGE, PAGE, cfg, one, "cpu")
    with pytest.raises(ShapeError, match=r"layouts hold \[2\] KV heads, this rank 1"):
        TkvTokenToKVPool(4 * PAGE, PAGE, cfg, two, "cpu", shard=KvHeadShard(1, 1, 1))
    assert TkvTokenToKVPool(4 * PAGE, PAGE, cfg, one, "cpu", shard=KvHeadShard(1, 1, 1)).shard.first_head == 1


def test_plugin_installs_the_jit_log_from_env(sgl, tmp_path, monkeypatch):
    """TKV_JIT_LOG: the plugin logs the process's Triton JIT events (tkv.kernels.jit_log)."""
    from tkv.kernels.testing import check_register_installs_jit_log
    from tkv.sglang import plugin

    check_register_installs_jit_log(plugin.register, tmp_path / "jit.tsv", monkeypatch)


def test_keywords_exist_in_sgl_kernels_varlen():
    """Every keyword FlashVarlenAttention passes with ``ver=3`` (``out`` too, for first
    chunks) is a parameter of sgl-kernel's flash_attn_varlen_func — read from the installed
    source with ``ast`` (its CUDA ops are not loadable on CPU)."""
    import ast
    import importlib.util
    from pathlib import Path

    from tkv.kernels import FlashVarlenAttention

    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sgl-kernel not installed")
    src = Path(next(iter(spec.submodule_search_locations))) / "flash_attn.py"
    (fn,) = [n for n in ast.parse(src.read_text()).body
             if isinstance(n, ast.FunctionDef) and n.name == "flash_attn_varlen_func"]
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    seen = {}
    x = torch.zeros(2, 1, 8)
    FlashVarlenAttention(lambda q, k, v, **kw: seen.update(kw) or q, ver=3)(
        x, x, x, torch.tensor([0, 2]), torch.tensor([0, 2]), 2, 2, 1.0, 4, out=x)
    assert set(seen) <= params, set(seen) - params
    assert "out" in seen and seen["ver"] == 3
