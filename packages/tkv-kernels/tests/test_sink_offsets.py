"""Sink offsets (the codec's ``k_sink_offset`` / ``v_sink_offset``) through the kernels.

Each vector is coded relative to its side's usual offset (K: μ or 0, V: 0) or to the sink
offset σ, whichever reconstructs it better; the second is flagged by the sign *bit* of its
bf16 norm. compress_store makes the same choice as the codec; decode, the inline prefill and
the decompress-once prefill (Triton loop and SDPA) add ``⟨q, σ − μ⟩`` to flagged keys' scores
and ``σ_v`` times the flagged softmax mass to the output. Everything is checked against the
float64 oracle (``reference``: decompresses each token with its flag) on fresh random
inputs in which a sizable fraction of tokens sits near σ — so ignoring a flag, or reading
a negative norm as a sign flip, is far outside the tolerance (checked: ``_flag_fraction``).
"""

import itertools

import pytest
import torch

from tkv.codec import TurboKVCodec
from tkv.codec.errors import ShapeError
from tkv.codec.packing import unpack_codes
from tkv.kernels import (
    SdpaDenseAttention,
    TkvLoader,
    Workspace,
    compress_store,
    cuda_decode,
    decode,
    prefill,
)
from tkv.kernels._util import interpreting
from tkv.kernels.reference import decode_reference, prefill_reference
from tkv.kernels.testing import (
    fill_cache,
    make_cache,
    make_paged_batch,
    relative_error,
    tolerance,
    tuning,
)

DEV = "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"


def _sink_codec(d, kb, vb, g, *, k_sink=True, v_sink=True, heads=None, center=True,
                scales=False, seed=0):
    """A codec with random sink offsets (large, so flags matter): per head ``(heads, d)``
    when ``heads`` is given, else shared ``(d,)``; optional key centering and channel
    scales."""
    shape = d if heads is None else (heads, d)
    mu = torch.randn(shape, generator=g) if center else None
    ks = (torch.rand(d, generator=g) + 0.5) if scales else None
    return TurboKVCodec(d, k_bits=kb, v_bits=vb, device=DEV, seed=seed, k_channel_offset=mu,
                        k_channel_scales=ks,
                        k_sink_offset=torch.randn(shape, generator=g) * 4 if k_sink else None,
                        v_sink_offset=torch.randn(shape, generator=g) * 4 if v_sink else None)


def _kv(n, hkv, d, codec, g, dtype=torch.bfloat16):
    """K/V ``(n, hkv, d)``: about a third of the tokens are sink-like (near σ), the rest near
    the usual offset."""
    sink = torch.rand(n, 1, 1, generator=g) < 0.35
    out = []
    for side in (codec.k, codec.v):
        base = 0.0 if side.channel_offset is None else side.channel_offset.cpu()
        center = base if side.sink_offset is None else torch.where(sink, side.sink_offset.cpu(),
                                                                   base)
        out.append((torch.randn(n, hkv, d, generator=g) + center).to(DEV, dtype))
    return out


def _flag_fraction(ld, cache, batch):
    """Fraction of the batch's stored tokens flagged, per side (sign bit of the norm)."""
    views = ld.layout.views(cache)
    frac = {}
    for side in ("k", "v"):
        flags = []
        for i in range(batch.seq_lens.shape[0]):
            s = batch.slots(i)
            flags.append(torch.signbit(views[f"{side}_norms"][s // ld.block_size, :,
                                                           s % ld.block_size]).flatten())
        frac[side] = torch.cat(flags).float().mean().item()
    return frac


def _filled(ld, lens, g, dtype=torch.bfloat16):
    batch = make_paged_batch(lens, ld.block_size, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    kvs = []
    for i, n in enumerate(lens):
        k, v = _kv(n, ld.num_kv_heads, ld.head_dim, ld.codec, g, dtype)
        fill_cache(ld, cache, k, v, batch.slots(i))
        kvs.append((k, v))
    frac = _flag_fraction(ld, cache, batch)
    for side, sc in (("k", ld.codec.k), ("v", ld.codec.v)):
        if sc.sink_offset is None:
            assert frac[side] == 0.0
        else:   # the test data really exercises both candidates
            assert 0.15 < frac[side] < 0.6, frac
    return batch, cache, kvs


# ------------------------------------------------------------------------ compress_store
def _rotated_error(sc, x, packed, norms):
    """``‖(x̂ − x)/s‖²`` per vector in float64: the rotated-space error (R is orthogonal)."""
    xh = sc.decompress(packed, norms, torch.float64)
    s = 1.0 if sc.channel_scales is None else sc.channel_scales.double()
    return ((xh - x.double()) / s).square().sum(-1)


@pytest.mark.parametrize("head_dim,kb,vb,heads,center,scales,rotation", [
    (64, 4, 4, None, True, False, "auto"),
    (96, 3, 5, 2, True, True, "auto"),
    (128, 2, 8, 2, False, False, "auto"),
    (64, 6, 7, None, True, True, "auto"),
    (64, 4, 4, None, True, False, "wht"),   # butterflies: both candidates from one tile
    (128, 6, 7, 2, True, True, "wht"),
])
def test_compress_store_makes_the_codecs_choice(head_dim, kb, vb, heads, center, scales,
                                               rotation):
    """The stored flag and codes are the codec's (``quantize``) for ≥ 97 % of the vectors;
    where the choice differs (float32 near-ties), the kernel's reconstruction is as good as
    the codec's (within 1 %), and never a wrong sign flip."""
    g = torch.Generator().manual_seed(head_dim + kb + vb)
    h = heads or 2
    codec = _sink_codec(head_dim, kb, vb, g, heads=heads, center=center, scales=scales,
                        seed=3)
    ld = TkvLoader(codec, h, 16)
    n, nblk = 61, 5
    cache = torch.randint(0, 256, (nblk, ld.layout.page_bytes), dtype=torch.uint8,
                          generator=g).to(DEV)
    k, v = _kv(n, h, head_dim, codec, g)
    slots = torch.randperm(nblk * 16, generator=g)[:n].to(DEV)
    compress_store(k, v, cache, slots, ld, rotation=rotation)
    views = ld.layout.views(cache)
    b, o = slots // 16, slots % 16
    for side, sc, x in (("k", codec.k, k), ("v", codec.v, v)):
        codes_ref, norms_ref = sc.quantize(x)
        got_codes = unpack_codes(views[f"{side}_codes"][b, :, o], sc.bits, head_dim)
        got_norms = views[f"{side}_norms"][b, :, o]
        same = torch.signbit(got_norms) == torch.signbit(norms_ref)
        assert same.float().mean() >= 0.97, (side, same.float().mean())
        assert 0.15 < torch.signbit(norms_ref).float().mean() < 0.6
        agree = (got_codes == codes_ref)[same]
        assert agree.float().mean() > 0.999
        torch.testing.assert_close(got_norms.float()[same], norms_ref.float()[same],
                                   rtol=8e-3, atol=0)
        e_got = _rotated_error(sc, x, views[f"{side}_codes"][b, :, o], got_norms)
        e_ref = _rotated_error(sc, x, sc.compress(x)[0], norms_ref)
        assert (e_got <= e_ref * 1.01 + 1e-6).all(), (side, (e_got / e_ref).max())


@pytest.mark.parametrize("scales,center,rotation", [(False, False, "auto"), (True, True, "auto"),
                                                   (True, True, "wht"), (False, True, "wht")])
def test_compress_store_flags_a_vector_equal_to_the_sink_offset(scales, center, rotation):
    """A key / value exactly equal to its sink offset (e.g. the BOS token's K/V at position 0
    taken as σ) codes to a zero norm that must keep its flag: −0.0, as the codec stores it.
    (Triton's unary minus is ``0 − x``: negating +0.0 gives +0.0 and would drop the flag.)
    With channel scales (and key centering) too: the kernel forms ``(x − μ − (σ − μ))/s``
    from the float32 ``σ − μ`` it subtracts like ``x − μ``, exactly 0 — it used to subtract
    a rounded ``(σ − μ)/s`` from ``(x − μ)/s`` and store a tiny norm with random codes
    (helper break-test, session 28); the codes are then the codec's (the middle code)."""
    g = torch.Generator().manual_seed(13)
    d, h = 64, 2
    sk = torch.randn(h, d, generator=g).bfloat16().float() * 4    # bf16-representable σ
    sv = torch.randn(h, d, generator=g).bfloat16().float() * 4
    kw = {}
    if scales:
        kw.update(k_channel_scales=torch.rand(d, generator=g) + 0.5,
                  v_channel_scales=torch.rand(d, generator=g) + 0.5)
    if center:
        kw.update(k_channel_offset=torch.randn(h, d, generator=g))
    codec = TurboKVCodec(d, k_bits=4, v_bits=4, device=DEV, seed=2, k_sink_offset=sk,
                         v_sink_offset=sv, **kw)
    ld = TkvLoader(codec, h, 16)
    batch = make_paged_batch([20], 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    k = torch.randn(20, h, d, generator=g)
    v = torch.randn(20, h, d, generator=g)
    k[0], v[0] = sk, sv                     # token 0 IS the sink
    k, v = k.to(DEV, torch.bfloat16), v.to(DEV, torch.bfloat16)
    compress_store(k, v, cache, batch.slots(0), ld, rotation=rotation)
    views = ld.layout.views(cache)
    s = batch.slots(0)
    for side, x, sc in (("k", k, codec.k), ("v", v, codec.v)):
        got = views[f"{side}_norms"][s // 16, :, s % 16]
        ref_codes, ref = sc.quantize(x)
        assert torch.signbit(ref[0]).all()                        # the codec flags it
        assert torch.equal(torch.signbit(got[0]), torch.signbit(ref[0])), got[0]
        assert (got[0].float() == 0).all(), got[0]
        codes = unpack_codes(views[f"{side}_codes"][s[:1] // 16, :, s[:1] % 16], 4, d)[0]
        assert torch.equal(codes, ref_codes[0])
    q = torch.randn(1, 2 * h, d, generator=g).to(DEV, torch.bfloat16)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, Workspace(8, 32, 256, DEV),
           out=out, block_n=ld.min_block_n)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert relative_error(out, ref) < tolerance(torch.bfloat16)


def test_compress_store_without_sink_side_keeps_positive_norms():
    """Only K has a sink offset: V is coded as before (no flag ever set)."""
    g = torch.Generator().manual_seed(2)
    codec = _sink_codec(64, 4, 4, g, v_sink=False)
    ld = TkvLoader(codec, 2, 16)
    assert ld.k_sink_shift is not None and ld.v_sink_shift is None
    _filled(ld, [40], g)


# ------------------------------------------------------------------------ decode
@pytest.mark.parametrize("head_dim,kb,vb,group,heads,k_sink,v_sink,window,lookup", [
    (64, 4, 4, 4, None, True, True, 0, "auto"),
    (64, 3, 5, 1, 2, True, True, 0, "gather"),     # one plane (3 bits at head_dim 64)
    (128, 2, 8, 7, 2, True, False, 0, "pair"),
    (96, 4, 3, 8, None, False, True, 13, "auto"),  # head_dim padded to 128, sliding window
    (64, 6, 7, 2, 2, True, True, 0, "auto"),
])
def test_decode_with_sink_offsets_matches_reference(head_dim, kb, vb, group, heads, k_sink,
                                                    v_sink, window, lookup):
    g = torch.Generator().manual_seed(head_dim * kb + vb)
    codec = _sink_codec(head_dim, kb, vb, g, k_sink=k_sink, v_sink=v_sink, heads=heads,
                        scales=kb == 3, seed=1)
    ld = TkvLoader(codec, 2, 16, lookup=lookup)
    lens = [57, 1, 33, 16]
    batch, cache, _ = _filled(ld, lens, g)
    q = torch.randn(len(lens), 2 * group, head_dim, generator=g).to(DEV, torch.bfloat16)
    for splits in (1, 4):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
        decode(q, cache, batch.block_table, batch.seq_lens, ld, Workspace(8, 32, 256, DEV),
               out=out, block_n=ld.min_block_n, num_splits=splits, window=window)
        ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld, window=window)
        # pair tables hold 16-bit centroids even under the interpreter (test_kernels' bound)
        tol = 2e-3 if interpreting() and lookup == "pair" else tolerance(torch.bfloat16)
        assert relative_error(out, ref) < tol


def test_decode_reads_a_flagged_zero_norm():
    """A flagged zero norm is −0.0 (``norm < 0`` is false): its key is exactly σ and its value
    σ_v. Norms of some tokens are overwritten with −0.0 and +0.0 in the cache; decode agrees
    with the oracle, which decodes the first as σ and the second as μ / 0."""
    g = torch.Generator().manual_seed(9)
    codec = _sink_codec(64, 4, 4, g)
    ld = TkvLoader(codec, 2, 16)
    batch, cache, _ = _filled(ld, [40], g)
    views = ld.layout.views(cache)
    s = batch.slots(0)
    for side in ("k", "v"):
        nv = views[f"{side}_norms"]
        nv[s[:6] // 16, :, s[:6] % 16] = -0.0
        nv[s[6:9] // 16, :, s[6:9] % 16] = 0.0
    assert torch.signbit(views["k_norms"][s[0] // 16, 0, s[0] % 16])
    q = torch.randn(1, 4, 64, generator=g).to(DEV, torch.bfloat16) * 3
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, Workspace(8, 32, 256, DEV),
           out=out, block_n=ld.min_block_n)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert relative_error(out, ref) < tolerance(torch.bfloat16)


# ------------------------------------------------------------------------ prefill
def _prefill_case(ld, prefix, qlens, group, g, **kw):
    lens = [p + q for p, q in zip(prefix, qlens, strict=True)]
    batch, cache, kvs = _filled(ld, lens, g, torch.float16)
    q = torch.cat([torch.randn(ql, ld.num_kv_heads * group, ld.head_dim, generator=g)
                   for ql in qlens]).to(DEV, torch.float16)
    k = torch.cat([kv[0][p:] for kv, p in zip(kvs, prefix, strict=True)])
    v = torch.cat([kv[1][p:] for kv, p in zip(kvs, prefix, strict=True)])
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=DEV)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
    prefill(q, k, v, cu, batch.seq_lens, max(qlens), cache, batch.block_table, ld, out=out,
            block_m=16 * min(group, 2), block_n=ld.min_block_n, **kw)
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld,
                            window=kw.get("window", 0))
    assert relative_error(out, ref) < tolerance(torch.float16)


@pytest.mark.parametrize("head_dim,kb,vb,group,heads,k_sink,v_sink", [
    (64, 4, 4, 4, None, True, True),
    (96, 3, 5, 1, 2, True, True),
    (64, 2, 4, 2, 2, False, True),
    (128, 4, 2, 7, None, True, False),
])
@pytest.mark.parametrize("path", ["inline", "dense", "sdpa", "varlen"])
def test_prefill_with_sink_offsets_matches_reference(head_dim, kb, vb, group, heads, k_sink,
                                                     v_sink, path):
    """Chunks over a compressed prefix, each prefill path: inline dequant in the Triton loop
    (with a sequence that has no prefix, and a sliding window), the decompress-once rows read
    by the Triton loop, those rows plus the chunk through SDPA (``exact_prefix``, one
    sequence), and the varlen path (several sequences' rows packed for one dense_attention
    call, a window included)."""
    g = torch.Generator().manual_seed(head_dim + kb * vb + group)
    codec = _sink_codec(head_dim, kb, vb, g, k_sink=k_sink, v_sink=v_sink, heads=heads,
                        scales=True, seed=2)
    ld = TkvLoader(codec, 2, 16)
    scratch = torch.full((1 << 20,), float("nan"), device=DEV)
    if path == "inline":
        _prefill_case(ld, [37, 0, 18], [21, 9, 5], group, g)
        _prefill_case(ld, [37, 18], [21, 5], group, g, window=11)
    elif path == "dense":
        _prefill_case(ld, [37, 0, 18], [21, 19, 33], group, g, max_prefix_len=40,
                      scratch=scratch)
        assert torch.isfinite(scratch[:64]).all()
    elif path == "sdpa":
        _prefill_case(ld, [45], [37], group, g, max_prefix_len=45, scratch=scratch,
                      exact_prefix=True)
        assert torch.isfinite(scratch[:64]).all()
    else:
        calls = []

        class _Counted(SdpaDenseAttention):
            def __call__(self, *a):
                calls.append(a[-1])
                return super().__call__(*a)

        _prefill_case(ld, [37, 0, 18], [21, 19, 33], group, g, max_prefix_len=40,
                      scratch=scratch, dense_attention=_Counted(), prefix_tokens=55, window=13)
        assert calls == [13]


def test_loader_refuses_per_head_sink_offset_of_another_head_count():
    """A per-head σ for 3 heads on a layer (rank) with 2 KV heads: refused by name."""
    for kw in ({"k_sink_offset": torch.zeros(3, 64)}, {"v_sink_offset": torch.zeros(3, 64)}):
        codec = TurboKVCodec(64, 4, device=DEV, **kw)
        with pytest.raises(ShapeError, match="holds 3 KV heads"):
            TkvLoader(codec, 2, 16)
        TkvLoader(codec, 3, 16)


def test_sink_shift_is_the_rotated_offset_difference():
    """``c = R((σ − μ)/s)``: for a vector x, coding against σ sees ``R((x − μ)/s) − c``."""
    g = torch.Generator().manual_seed(4)
    codec = _sink_codec(64, 4, 4, g, heads=2, scales=True)
    x = torch.randn(5, 2, 64, generator=g, dtype=torch.float64).to(DEV)
    sk = codec.k
    ya = sk._rotated(x, sk.channel_offset)
    yb = sk._rotated(x, sk.sink_offset)
    torch.testing.assert_close(ya - sk.sink_shift_rotated(), yb, rtol=1e-10, atol=1e-10)
    ld = TkvLoader(codec, 2, 16)
    torch.testing.assert_close(ld.k_sink_shift[:, :64].double(), sk.sink_shift_rotated(),
                               rtol=1e-6, atol=1e-6)
    assert TurboKVCodec(64, 4, device=DEV).k.sink_shift_rotated() is None


@pytest.mark.skipif(DEV != "cuda", reason="the CUDA split kernel needs a GPU")
@pytest.mark.parametrize("head_dim,group,heads,k_sink,v_sink,scales,window", [
    (128, 4, None, True, True, False, 0), (64, 3, 2, True, True, True, 0),
    (128, 8, 2, True, False, False, 21), (64, 1, None, False, True, False, 0)])
def test_cuda_decode_with_sink_offsets_matches_reference(head_dim, group, heads, k_sink, v_sink,
                                                         scales, window):
    """The CUDA split kernel (``decode(kernel="cuda")``, K4V4) adds ``⟨q, c_k⟩`` to flagged keys'
    scores and ``c_v`` × the flagged softmax mass to the output: it agrees with the float64
    oracle and with the Triton kernel at 1 split (the single-split epilogue) and 4 (the reduce
    pass), shared and per-head offsets, key centering, channel scales, windows; with the
    first pages issued before the query prologue (``early=1``) too."""
    g = torch.Generator().manual_seed(head_dim + group)
    codec = _sink_codec(head_dim, 4, 4, g, k_sink=k_sink, v_sink=v_sink, heads=heads,
                        scales=scales, seed=3)
    ld = TkvLoader(codec, 2, 16)
    lens = [300, 1, 47, 16, 129]
    batch, cache, _ = _filled(ld, lens, g)
    q = torch.randn(len(lens), 2 * group, head_dim, generator=g).to(DEV, torch.bfloat16)
    ws = Workspace(8, 32, 256, DEV)
    args = (q, cache, batch.block_table, batch.seq_lens, ld, ws)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld, window=window)
    for splits, early in ((1, 0), (4, 0), (1, 1), (4, 1)):
        with tuning(cuda_decode, early=early):
            out = decode(*args, num_splits=splits, window=window, kernel="cuda")
        tri = decode(*args, num_splits=splits, window=window, kernel="triton")
        assert relative_error(out.float(), ref) < tolerance(torch.bfloat16), (splits, early)
        assert relative_error(out.float(), tri.double()) < 1e-2, (splits, early)
