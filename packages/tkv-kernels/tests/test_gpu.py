"""GPU-only: CUDA-graph capture + replay equals eager; a realistic shape vs the oracle."""

import pytest
import torch

from tkv.codec import TurboKVCodec
from tkv.codec.packing import unpack_codes
from tkv.kernels import TkvLoader, Workspace, compress_store, decode, prefill
from tkv.kernels._util import interpreting
from tkv.kernels.reference import decode_reference
from tkv.kernels.testing import (
    fill_cache,
    make_cache,
    make_paged_batch,
    no_stream_sync,
    relative_error,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs CUDA"),
]


def _setup(seed=0, lens=(1000, 1, 333, 4097), d=128, hkv=8, group=4, block=16):
    torch.manual_seed(seed)
    codec = TurboKVCodec(d, k_bits=4, v_bits=4, device="cuda")
    ld = TkvLoader(codec, hkv, block)
    batch = make_paged_batch(list(lens), block, "cuda")
    cache = make_cache(ld, batch.num_blocks, "cuda")
    for i, n in enumerate(lens):
        kv = torch.randn(2, n, hkv, d, device="cuda", dtype=torch.bfloat16)
        fill_cache(ld, cache, kv[0], kv[1], batch.slots(i))
    return ld, batch, cache, hkv * group


def _decode_graph(q, cache, batch, ld, ws, out):
    """``(graph, eager)``: decode run eagerly (compile; ``eager`` = its output), warmed on a
    side stream, then captured into a CUDA graph whose output ``out`` is NaN-filled."""
    decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out)
    eager = out.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out)
    out.fill_(float("nan"))
    return g, eager


@pytest.mark.parametrize("single_split_ctas", [0, 1], ids=["splits", "one_split_rule"])
def test_decode_cuda_graph_replay_equals_eager(single_split_ctas):
    """Capture + replay equal eager, then new inputs through the same graph match the oracle:
    with split-K + the reduce pass, and with the workspace's one-split rule (the default on
    full grids, forced here by a threshold of 1 CTA: the split kernel writes the output)."""
    ld, batch, cache, hq = _setup()
    ns = batch.seq_lens.shape[0]
    ws = Workspace(16, 64, 256, "cuda", single_split_ctas=single_split_ctas)
    assert (ws.splits_for(ns, ld.num_kv_heads) == 1) == bool(single_split_ctas)
    q = torch.randn(ns, hq, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.full((ns, hq, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    g, eager = _decode_graph(q, cache, batch, ld, ws, out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new inputs through the same graph: new query, one more token in each sequence
    q.copy_(torch.randn_like(q))
    new_k = torch.randn(ns, ld.num_kv_heads, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.stack([batch.slots(i, int(n), int(n) + 1)[0]
                         for i, n in enumerate(batch.seq_lens.tolist())])
    compress_store(new_k, new_k, cache, slots, ld)
    batch.seq_lens += 1
    g.replay()
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 2.5e-2


@pytest.mark.parametrize("rotation", ["split", "wht"])
def test_compress_store_cuda_graph_replay_equals_eager(rotation):
    ld, batch, cache, _ = _setup(lens=(64, 50))
    k = torch.randn(40, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(40, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = batch.slots(0)[:40].clone()
    compress_store(k, v, cache, slots, ld, rotation=rotation)
    eager = cache.clone()
    cache2 = make_cache(ld, batch.num_blocks, "cuda")
    cache2.copy_(eager)
    cache2.view(-1)[: 1000].fill_(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compress_store(k, v, cache2, slots, ld, rotation=rotation)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        compress_store(k, v, cache2, slots, ld, rotation=rotation)
    cache2.copy_(make_cache(ld, batch.num_blocks, "cuda"))
    cache2.copy_(eager)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(cache2, eager)


@pytest.mark.parametrize("tokens,block_t,num_warps", [(64, None, None), (2048, None, None),
                                                      (16384, 64, 4), (16384, 128, 8)])
def test_compress_store_butterflies_equal_the_matrix_rotation(tokens, block_t, num_warps):
    """rotation="wht" (butterflies, the default since session 28) against the tensor-core
    rotation ("split") on the Qwen3-8B-like head geometry with key centering and sink
    offsets, compiled: the same
    codes except float32 ties at bucket boundaries (≥ 99.99 %, never more than one bucket
    apart), norms within one bf16 ulp, the same sink flags on ≥ 99.5 % of vectors."""
    g = torch.Generator().manual_seed(tokens)
    codec = TurboKVCodec(128, 4, device="cuda", seed=5,
                         k_channel_offset=torch.randn(8, 128, generator=g),
                         k_sink_offset=torch.randn(8, 128, generator=g) * 4)
    ld = TkvLoader(codec, 8, 16)
    k = (torch.randn(tokens, 8, 128, generator=g) * 2).to("cuda", torch.bfloat16)
    v = torch.randn(tokens, 8, 128, generator=g).to("cuda", torch.bfloat16)
    k[:5] = codec.k.sink_offset.to("cuda", torch.bfloat16)   # exactly σ: flagged, zero norm
    nblk = tokens // 16 + 2
    slots = torch.randperm(nblk * 16, generator=g)[:tokens].to("cuda")
    views = []
    for rotation in ("split", "wht"):
        cache = ld.layout.allocate(nblk, "cuda")
        compress_store(k, v, cache, slots, ld, rotation=rotation, block_t=block_t,
                       num_warps=num_warps)
        views.append(ld.layout.views(cache))
    b, o = slots // 16, slots % 16
    for side, bits in (("k", 4), ("v", 4)):
        ca, cw = (unpack_codes(vw[f"{side}_codes"][b, :, o], bits, 128) for vw in views)
        na, nw = (vw[f"{side}_norms"][b, :, o] for vw in views)
        same_flag = torch.signbit(na) == torch.signbit(nw)
        assert same_flag.float().mean() >= 0.995
        assert (ca == cw)[same_flag].float().mean() >= 0.9999
        assert ((ca - cw)[same_flag].abs() <= 1).all()
        torch.testing.assert_close(nw[same_flag].float(), na[same_flag].float(), rtol=8e-3,
                                   atol=0)
    assert torch.signbit(views[1]["k_norms"][b[:5], :, o[:5]]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prmts_decode_and_prefill_equal_prmti_bit_for_bit(dtype):
    """prmts yields prmti's 16-bit centroids from half the tables (the default codebook is
    antisymmetric), so decode — split-K with the reduce and the one-split rule — and the
    prefill kernel's compressed-prefix loop give identical outputs with either lookup."""
    ld, batch, cache, hq = _setup(seed=29)
    sym = TkvLoader(ld.codec, ld.num_kv_heads, ld.block_size, lookup="prmts")
    ref = TkvLoader(ld.codec, ld.num_kv_heads, ld.block_size, lookup="prmti")
    assert (sym.lookup_name("k", dtype), ref.lookup_name("k", dtype)) == ("prmts", "prmti")
    ns = batch.seq_lens.shape[0]
    q = torch.randn(ns, hq, 128, device="cuda", dtype=dtype)
    for single in (0, 1):
        ws = Workspace(16, 64, 256, "cuda", single_split_ctas=single)
        a = decode(q, cache, batch.block_table, batch.seq_lens, sym, ws)
        b = decode(q, cache, batch.block_table, batch.seq_lens, ref, ws)
        assert torch.isfinite(a).all() and torch.equal(a, b)
    # prefill: a 40-token chunk after each cached prefix (the lookup reads the prefix inline)
    ql = 40
    qp = torch.randn(ns * ql, hq, 128, device="cuda", dtype=dtype)
    kv = torch.randn(2, ns * ql, ld.num_kv_heads, 128, device="cuda", dtype=dtype)
    cu = torch.arange(0, (ns + 1) * ql, ql, device="cuda", dtype=torch.int32)
    sl = batch.seq_lens + ql   # the chunk comes from kv, the prefix from the table's pages
    outs = [prefill(qp, kv[0], kv[1], cu, sl, ql, cache, batch.block_table, lk)
            for lk in (sym, ref)]
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("lookup", ["prmti", "prmts"])
@pytest.mark.parametrize("maxnreg", [None, 168])
def test_resident_tables_decode_and_prefill_equal_the_plain_lookup_bit_for_bit(lookup, maxnreg):
    """resident_tables only changes how the first table word of each byte permute reaches
    its register (a per-thread zero XOR the word): decode — one split and several — and the
    prefill kernel's compressed-prefix loop give identical outputs with and without it."""
    ld, batch, cache, hq = _setup(seed=31)
    plain = TkvLoader(ld.codec, ld.num_kv_heads, ld.block_size, lookup=lookup)
    res = TkvLoader(ld.codec, ld.num_kv_heads, ld.block_size, lookup=lookup,
                    resident_tables=True)
    ns = batch.seq_lens.shape[0]
    q = torch.randn(ns, hq, 128, device="cuda", dtype=torch.bfloat16)
    for single in (0, 1):
        ws = Workspace(16, 64, 256, "cuda", single_split_ctas=single)
        a = decode(q, cache, batch.block_table, batch.seq_lens, res, ws, maxnreg=maxnreg)
        b = decode(q, cache, batch.block_table, batch.seq_lens, plain, ws, maxnreg=maxnreg)
        assert torch.isfinite(a).all() and torch.equal(a, b)
    ql = 40
    qp = torch.randn(ns * ql, hq, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, ns * ql, ld.num_kv_heads, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (ns + 1) * ql, ql, device="cuda", dtype=torch.int32)
    sl = batch.seq_lens + ql
    outs = [prefill(qp, kv[0], kv[1], cu, sl, ql, cache, batch.block_table, lk)
            for lk in (res, plain)]
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


def test_prefill_realistic_shape_vs_sdpa():
    torch.manual_seed(3)
    ld = __import__("tkv.kernels", fromlist=["x"]).BypassLoader(8, 128, 16, torch.bfloat16)
    n = 1024
    q = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    sl = torch.tensor([n], dtype=torch.int32, device="cuda")
    bt = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    kc = torch.zeros(1, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = prefill(q, k, v, cu, sl, n, (kc, kc), bt, ld)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2


def test_prefill_exact_prefix_sdpa_equals_triton_dense_path():
    """A 300-token chunk over a compressed 1,000-token prefix (GQA 4, head_dim 128): the SDPA
    path (``exact_prefix=True``: FlashAttention-2 over the decompressed prefix + chunk) and the
    Triton decompress-once loop give the same attention; a broken promise is NaN."""
    from tkv.kernels import dense_prefix_bytes

    ld, batch, cache, hq = _setup(seed=4, lens=(1300,))
    q = torch.randn(300, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    scratch = torch.empty(dense_prefix_bytes(1, 1300, 8, 128, block_size=16),
                          dtype=torch.uint8, device="cuda")
    args = (q, k, v, cu, batch.seq_lens, 300, cache, batch.block_table, ld)
    tri = prefill(*args, max_prefix_len=1000, scratch=scratch)
    sdpa = prefill(*args, max_prefix_len=1000, scratch=scratch, exact_prefix=True)
    rel = ((sdpa.float() - tri.float()).norm() / tri.float().norm()).item()
    assert rel < 1e-2, rel
    assert torch.isnan(prefill(*args, max_prefix_len=1008, scratch=scratch,
                               exact_prefix=True)).all()


class _DeviceOnlySdpa:
    """A DenseAttention for ONE sequence per call that never reads a device value on the host
    (lower-right causal SDPA on the whole call: what the exact-prefix path and a one-prompt
    bypass hand over), counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
        from torch.nn.attention.bias import causal_lower_right

        assert window == 0
        self.calls += 1
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=causal_lower_right(q.shape[0], k.shape[0]), scale=scale,
            enable_gqa=True)
        return o[0].transpose(0, 1).contiguous()


def test_prefill_dense_attention_paths_match_and_never_sync():
    """prefill(dense_attention=...) on the GPU: a one-prompt first chunk and a 300-token
    exact-prefix continuation over a compressed 1,000-token prefix go through the callable
    (one call each), equal the Triton paths, and neither prefill call synchronizes the stream
    (torch.cuda sync debug mode "error"): the engines' FlashAttention hand-off adds no stall."""
    from tkv.kernels import dense_prefix_bytes

    ld, batch, cache, hq = _setup(seed=5, lens=(1300,))
    fn = _DeviceOnlySdpa()
    q = torch.randn(300, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    first = torch.tensor([300], dtype=torch.int32, device="cuda")
    scratch = torch.empty(dense_prefix_bytes(1, 1300, 8, 128, block_size=16),
                          dtype=torch.uint8, device="cuda")
    args = (q, k, v, cu, batch.seq_lens, 300, cache, batch.block_table, ld)
    tri_first = prefill(q, k, v, cu, first, 300, cache, batch.block_table, ld, no_prefix=True)
    tri = prefill(*args, max_prefix_len=1000, scratch=scratch)
    torch.cuda.synchronize()
    with no_stream_sync():
        got_first = prefill(q, k, v, cu, first, 300, cache, batch.block_table, ld,
                            no_prefix=True, dense_attention=fn)
        got = prefill(*args, max_prefix_len=1000, scratch=scratch, exact_prefix=True,
                      dense_attention=fn)
    assert fn.calls == 2
    for a, b in ((got_first, tri_first), (got, tri)):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 1e-2, rel


@pytest.mark.parametrize("window", [0, 700])
def test_prefill_varlen_path_through_torch_flash_matches_triton(window):
    """Prefix-cache hits on the GPU: four sequences with compressed prefixes (1,000 / 1 /
    333 / 4,097 tokens) and chunks of 300 / 17 / 129 / 64 tokens through PyTorch's own varlen
    FlashAttention (TorchVarlenAttention: the varlen path, one call, no stream sync) equal the
    decompress-once Triton loop, with and without a sliding window; a first-chunk batch
    through it equals the Triton bypass."""
    from tkv.kernels import TorchVarlenAttention, dense_prefix_bytes, varlen_prefix_bytes

    lens, q_lens = (1300, 18, 462, 4161), (300, 17, 129, 64)
    prefix = [n - q for n, q in zip(lens, q_lens, strict=True)]
    ld, batch, cache, hq = _setup(seed=11, lens=lens)
    tq = sum(q_lens)
    q = torch.randn(tq, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tq, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    scratch = torch.empty(max(varlen_prefix_bytes(sum(prefix), tq, 8, 128),
                              dense_prefix_bytes(4, max(prefix), 8, 128, block_size=16)),
                          dtype=torch.uint8, device="cuda")
    args = (q, k, v, cu, batch.seq_lens, max(q_lens), cache, batch.block_table, ld)
    kw = dict(max_prefix_len=max(prefix), scratch=scratch, window=window)
    tri = prefill(*args, **kw)
    fa = TorchVarlenAttention()
    torch.cuda.synchronize()
    with no_stream_sync():
        got = prefill(*args, **kw, dense_attention=fa, prefix_tokens=sum(prefix))
    rel = ((got.float() - tri.float()).norm() / tri.float().norm()).item()
    assert rel < 1e-2, rel
    first = cu[1:] - cu[:-1]
    a = prefill(q, k, v, cu, first, max(q_lens), cache, batch.block_table, ld, no_prefix=True,
                window=window)
    b = prefill(q, k, v, cu, first, max(q_lens), cache, batch.block_table, ld, no_prefix=True,
                window=window, dense_attention=fa)
    rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
    assert rel < 1e-2, rel


def test_sink_offsets_match_reference_on_gpu():
    """Sink offsets with 16-bit dots and the CUDA lookups (prmti at K4V4, pair at 3 bits):
    compress_store then decode, and the three prefill paths (inline, decompress-once, SDPA),
    against the float64 oracle; a third of the tokens sit near σ (flagged)."""
    from tkv.kernels import dense_prefix_bytes
    from tkv.kernels.reference import prefill_reference

    torch.manual_seed(5)
    d, hkv, group, block = 128, 8, 4, 16
    for kb, vb in ((4, 4), (3, 4)):
        sk, sv = torch.randn(2, hkv, d) * 4
        codec = TurboKVCodec(d, k_bits=kb, v_bits=vb, device="cuda", k_sink_offset=sk,
                             v_sink_offset=sv, k_channel_offset=torch.randn(hkv, d))
        ld = TkvLoader(codec, hkv, block)
        lens = (700, 1, 333)
        batch = make_paged_batch(list(lens), block, "cuda")
        cache = make_cache(ld, batch.num_blocks, "cuda")
        news = []
        for i, n in enumerate(lens):
            near = (torch.rand(n, 1, 1) < 0.35).cuda()
            k = torch.randn(n, hkv, d, device="cuda") + torch.where(
                near, sk.cuda(), codec.k.channel_offset)
            v = torch.randn(n, hkv, d, device="cuda") + torch.where(near, sv.cuda(), 0.0)
            fill_cache(ld, cache, k.bfloat16(), v.bfloat16(), batch.slots(i))
            news.append((k[-100:].bfloat16(), v[-100:].bfloat16()))
        flags = torch.signbit(ld.layout.views(cache)["k_norms"].float()).float().mean()
        assert 0.1 < flags < 0.7, flags
        q = torch.randn(len(lens), hkv * group, d, device="cuda", dtype=torch.bfloat16)
        out = decode(q, cache, batch.block_table, batch.seq_lens, ld,
                     Workspace(16, 32, 256, "cuda"))
        ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 2.5e-2, (kb, rel)
        # prefill: the last 100 tokens of sequence 0 as the chunk over its first 600
        qc = torch.randn(100, hkv * group, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
        sl, bt = batch.seq_lens[:1], batch.block_table[:1]
        scratch = torch.empty(dense_prefix_bytes(1, 700, hkv, d, block_size=block),
                              dtype=torch.uint8, device="cuda")
        ref = prefill_reference(qc, *news[0], cu, sl, cache, bt, ld)
        for kw in ({}, dict(max_prefix_len=600, scratch=scratch),
                   dict(max_prefix_len=600, scratch=scratch, exact_prefix=True)):
            o = prefill(qc, *news[0], cu, sl, 100, cache, bt, ld, **kw)
            rel = ((o.double() - ref).norm() / ref.norm()).item()
            assert rel < 2.5e-2, (kb, kw.keys(), rel)


@pytest.mark.parametrize("kb,vb", [(3, 4), (5, 2), (5, 4), (4, 3), (6, 7)])
def test_prefill_head_dim_64_mixed_planes_default_tiles(kb, vb):
    """head_dim 64 with a per-element side (3/5 bits: one plane) next to a planar one, at the
    default tiles, inline and decompress-once: equal to the float64 oracle. With 64-token
    prefix tiles this crashed (illegal address) or returned wrong rows on the H200
    (benchmarks/results/prefill_tile_bug_2026-11-30.md); a SmolLM2 bundle row hits it."""
    from tkv.kernels import dense_prefix_bytes
    from tkv.kernels.reference import prefill_reference

    torch.manual_seed(kb * 10 + vb)
    d, hkv, group = 64, 3, 3
    ld = TkvLoader(TurboKVCodec(d, k_bits=kb, v_bits=vb, device="cuda"), hkv, 16)
    batch = make_paged_batch([300], 16, "cuda")
    cache = make_cache(ld, batch.num_blocks, "cuda")
    kv = torch.randn(2, 300, hkv, d, device="cuda", dtype=torch.bfloat16)
    fill_cache(ld, cache, kv[0], kv[1], batch.slots(0))
    q = torch.randn(140, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 140], dtype=torch.int32, device="cuda")
    args = (q, kv[0, 160:], kv[1, 160:], cu, batch.seq_lens, 140, cache, batch.block_table, ld)
    ref = prefill_reference(*args[:5], cache, batch.block_table, ld)
    scratch = torch.empty(dense_prefix_bytes(1, 300, hkv, d, block_size=16), dtype=torch.uint8,
                          device="cuda")
    for kw in ({}, dict(max_prefix_len=160, scratch=scratch)):
        out = prefill(*args, **kw)
        torch.cuda.synchronize()
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 2.5e-2, (kw.keys(), rel)


@pytest.mark.parametrize("groups", [True, False])
@pytest.mark.parametrize("kb,vb", [(3, 3), (5, 4), (4, 3), (3, 2), (5, 5), (7, 6)])
def test_small_head_groups_match_oracle_at_head_dim_64(kb, vb, groups):
    """At head_dim 64 (SmolLM2's heads), on CUDA with the default lookups, both decode paths of
    3/5/7-bit sides — ``small_head_groups=True`` (the default: 8-code groups interleaved to 2
    planes of 32, 128-token decode tiles) and ``False`` (per element, the A/B setting): decode
    through a CUDA graph and prefill (inline, decompress-once) equal the float64 oracle."""
    from tkv.kernels import dense_prefix_bytes
    from tkv.kernels.reference import prefill_reference

    torch.manual_seed(kb * 10 + vb)
    d, hkv, group = 64, 3, 3
    codec = TurboKVCodec(d, k_bits=kb, v_bits=vb, device="cuda")
    ld = TkvLoader(codec, hkv, 16, small_head_groups=groups)
    lens = [700, 1, 333, 129]
    batch = make_paged_batch(lens, 16, "cuda")
    cache = make_cache(ld, batch.num_blocks, "cuda")
    for i, n in enumerate(lens):
        kv = torch.randn(2, n, hkv, d, device="cuda", dtype=torch.bfloat16)
        fill_cache(ld, cache, kv[0], kv[1], batch.slots(i))
    q = torch.randn(len(lens), hkv * group, d, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(8, hkv * group, d, "cuda")
    out = torch.empty_like(q)
    g, eager = _decode_graph(q, cache, batch, ld, ws, out)
    g.replay()
    torch.cuda.synchronize()
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert relative_error(out.float(), ref) < 2.5e-2 and torch.equal(out, eager)
    qc = torch.randn(140, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(140, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 140], dtype=torch.int32, device="cuda")
    sl = batch.seq_lens[:1] + 140
    ref = prefill_reference(qc, kc, vc, cu, sl, cache, batch.block_table[:1], ld)
    scratch = torch.empty(dense_prefix_bytes(1, 840, hkv, d, block_size=16), dtype=torch.uint8,
                          device="cuda")
    for kw in ({}, dict(max_prefix_len=700, scratch=scratch)):
        o = prefill(qc, kc, vc, cu, sl, 140, cache, batch.block_table[:1], ld, **kw)
        torch.cuda.synchronize()
        assert relative_error(o.float(), ref) < 2.5e-2, kw.keys()


@pytest.mark.parametrize("d,hkv,group,block,window", [(128, 8, 4, 16, 0), (64, 3, 3, 16, 100),
                                                     (128, 2, 7, 32, 0), (64, 4, 8, 64, 0)])
def test_gluon_decode_matches_oracle_and_triton(d, hkv, group, block, window):
    """The experimental Gluon split kernel (``decode(kernel="gluon")``, K4V4 prmt) equals
    the float64 oracle within bf16 rounding and the Triton split kernel within 1e-2, at its
    default tile and at 8 splits (ragged lengths incl. 1, random pages, GQA 3-8, windows)."""
    torch.manual_seed(3)
    lens = [1, 37, 300, 1024, 77]
    ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=4, device="cuda"), hkv, block, lookup="prmt")
    batch = make_paged_batch(lens, block, "cuda")
    cache = make_cache(ld, batch.num_blocks, "cuda")
    for i, n in enumerate(lens):
        kv = torch.randn(2, n, hkv, d, device="cuda", dtype=torch.bfloat16)
        fill_cache(ld, cache, kv[0], kv[1], batch.slots(i))
    q = torch.randn(len(lens), hkv * group, d, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(8, 64, 256, "cuda")
    args = (q, cache, batch.block_table, batch.seq_lens, ld, ws)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld, window=window)
    tri = decode(*args, window=window).double()
    for splits in (None, 8):
        out = decode(*args, window=window, kernel="gluon", num_splits=splits).double()
        assert torch.isfinite(out).all()
        assert ((out - ref).norm() / ref.norm()).item() < 2.5e-2
        assert ((out - tri).norm() / tri.norm()).item() < 1e-2


def _variants(kernel) -> int:
    """Compiled specializations of a ``@triton.jit`` kernel on the current device."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


def test_batch_shaped_arguments_compile_one_variant():
    """Eager engine steps (mixed prefill + decode) change token counts, row counts and the
    decompress-once path's prefix pages every step. None of them may select a new Triton
    specialization (value 1, divisibility by 16): each new class was a compile of seconds per
    layer width pair inside a timed vLLM run (session 12). One warm call per kernel, then
    calls whose batch-shaped integers fall in every class (1, 16·k, other): no new variant,
    and the outputs stay right (decompress-once vs inline prefill)."""
    import importlib

    from tkv.kernels import dense_prefix_bytes

    # the modules (the package exports functions of the same names)
    decode_mod, prefill_mod, rotate_mod, store_mod = (
        importlib.import_module(f"tkv.kernels.{m}")
        for m in ("decode", "prefill", "rotate", "store"))

    torch.manual_seed(5)
    d, hkv, group, block = 64, 3, 3, 16   # SmolLM2's heads; K5V4: decode fetches the 5-bit
    # side as 8-code groups (the default), prefill reads it per element
    hq = hkv * group
    ld = TkvLoader(TurboKVCodec(d, k_bits=5, v_bits=4, device="cuda"), hkv, block)
    lens = [700, 600, 520, 17, 1]
    batch = make_paged_batch(lens, block, "cuda")
    cache = make_cache(ld, batch.num_blocks, "cuda")

    # compress_store: token counts 1, 16, 7, 33, 96, ... (within one block_t bucket, ≤ 128:
    # the bucket is a deliberate tile choice), slot_mapping slices at odd offsets
    st = store_mod._compress_store_kernel
    fill_kv = torch.randn(2, 700, hkv, d, device="cuda", dtype=torch.bfloat16)
    fill_cache(ld, cache, fill_kv[0, :1], fill_kv[1, :1], batch.slots(0, 0, 1))
    n0 = _variants(st)
    sizes = (16, 7, 33, 1, 96, 64, 128)
    for i, n in enumerate(lens):
        a, k = (1 if i == 0 else 0), 0
        while a < n:
            b = min(n, a + sizes[k % len(sizes)])
            fill_cache(ld, cache, fill_kv[0, a:b], fill_kv[1, a:b], batch.slots(i, a, b))
            a, k = b, k + 1
    assert _variants(st) == n0

    # decode (split + reduce kernels; the query rotated inside the split kernel, the default,
    # and by the separate rotation kernel): 1, 7, 16 sequences (9, 63, 144 rows), splits fixed
    ws = Workspace(16, hq, d, "cuda")
    kernels = (rotate_mod._rotate_rows_kernel, decode_mod._decode_split_kernel,
               decode_mod._decode_reduce_kernel)
    for fused in (True, False):
        for k, ns in enumerate((1, 7, 16)):
            rows = torch.arange(ns, device="cuda") % len(lens)
            q = torch.randn(ns, hq, d, device="cuda", dtype=torch.bfloat16)
            decode(q, cache, batch.block_table[rows].contiguous(),
                   batch.seq_lens[rows].contiguous(), ld, ws, num_splits=4,
                   fused_query_rotation=fused)
            if k == 0:
                v0 = [_variants(kern) for kern in kernels]
        assert [_variants(kern) for kern in kernels] == v0, fused

    # decompress-once prefill over prefixes of 1 (warm-up), 2, 5, 16, 32, 33 whole pages, each
    # checked against the inline path
    pre, deq = prefill_mod._prefill_kernel, prefill_mod._dequant_prefix_kernel
    scratch = torch.empty(dense_prefix_bytes(1, 700, hkv, d, block_size=block),
                          dtype=torch.uint8, device="cuda")
    chunk = 150
    for k, prefix in enumerate((1, 20, 70, 250, 512, 520)):
        total = prefix + chunk
        q = torch.randn(chunk, hq, d, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(2, chunk, hkv, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
        sl = torch.tensor([total], dtype=torch.int32, device="cuda")
        args = (q, kv[0], kv[1], cu, sl, chunk, cache, batch.block_table[:1], ld)
        dense = prefill(*args, max_prefix_len=prefix, scratch=scratch)
        inline = prefill(*args)   # reads the real block table: constant arguments
        assert relative_error(dense.float(), inline.float()) < 1e-2
        if k == 0:
            p0, q0 = _variants(pre), _variants(deq)
    assert (_variants(pre), _variants(deq)) == (p0, q0)


def test_jit_log_records_a_real_compile(tmp_path):
    """A kernel's first launch in this process (a compile, or a load from Triton's disk
    cache) lands in the log; its second launch does not."""
    import triton
    import triton.language as tl

    from tkv.kernels import jit_log
    from tkv.kernels.testing import jit_hooks_isolated

    @triton.jit
    def _plus(x, y):
        return x + y

    @triton.jit   # a function constexpr, as tkv's FETCH / DEQUANT (broke the runtime hooks)
    def _jit_log_probe(x, F: tl.constexpr, SALT: tl.constexpr):
        tl.store(x, F(tl.load(x), SALT))

    with jit_hooks_isolated():
        jit_log.install(tmp_path / "jit.tsv")
        x = torch.zeros(1, device="cuda")
        salt = 3   # the kernel object is new: its first launch is an in-memory miss
        _jit_log_probe[(1,)](x, F=_plus, SALT=salt)
        _jit_log_probe[(1,)](x, F=_plus, SALT=salt)   # in-memory hit: no second event
        torch.cuda.synchronize()
        ev = jit_log.read_events(tmp_path / "jit.tsv")
        # the name is module:qualname (here ...test_jit_log_records_a_real_compile.<locals>.)
        assert [e.kernel.rsplit(".", 1)[-1] for e in ev] == ["_jit_log_probe"]
        assert ev[0].seconds > 0 and x.item() == 2 * salt
