"""Key centering (the codec's ``k_channel_offset`` μ) through the kernels.

compress_store stores ``k − μ``; decode needs nothing (every score of a row drops by the same
``q·μ``); prefill centers the uncompressed chunk keys too, so a query row that sees compressed
prefix keys and raw chunk keys still gets one uniform shift. Everything is checked against the
float64 oracle (which adds μ back, i.e. attends over the model-space keys) on fresh random
inputs whose keys carry a large shared mean, so a non-uniform shift would show at once.

Both forms of μ are covered: ``(head_dim,)`` shared by the KV heads, and per head
``(num_kv_heads, head_dim)`` (compress_store loads row μ[head], prefill subtracts μ[h] from
head h's chunk keys, the oracle adds μ[h] back), with keys whose mean differs per head."""

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
    decode,
    prefill,
    varlen_prefix_bytes,
)
from tkv.kernels._util import interpreting
from tkv.kernels.reference import (
    attention_reference,
    decode_reference,
    gather_kv,
    prefill_reference,
)
from tkv.kernels.store import store_rotation_for
from tkv.kernels.testing import (
    fill_cache,
    make_cache,
    make_paged_batch,
    relative_error,
    tolerance,
)

DEV = "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"


_tol = tolerance
_rel = relative_error


def _centered_codec(d, kb, vb, g, seed=0, scales=False, heads=None):
    """Codec with a random μ (not the keys' mean: centering is exact for any μ): ``(d,)``, or
    per head ``(heads, d)`` when ``heads`` is given."""
    mu = torch.randn(d if heads is None else (heads, d), generator=g) * 2
    ks = (torch.rand(d, generator=g) + 0.5) if scales else None
    return TurboKVCodec(d, k_bits=kb, v_bits=vb, device=DEV, seed=seed, k_channel_offset=mu,
                        k_channel_scales=ks)


def _keys(n, h, d, g, shift):
    """Keys with a large per-channel mean ``shift`` ``(d,)`` or per head ``(h, d)`` (real
    post-RoPE keys have one); float32 ``(n, h, d)``."""
    return torch.randn(n, h, d, generator=g) + shift


@pytest.mark.parametrize("head_dim,kb,vb,scales,per_head,rotation", [
    (64, 4, 4, False, False, "auto"), (96, 3, 5, True, False, "auto"),
    (256, 2, 4, False, False, "auto"), (64, 4, 4, False, True, "auto"),
    (96, 3, 5, True, True, "auto"),
    # butterflies subtract μ before the rotation, as the codec does
    (64, 4, 4, False, True, "wht"), (128, 3, 5, True, False, "wht")])
def test_compress_store_subtracts_key_offset(head_dim, kb, vb, scales, per_head, rotation):
    g = torch.Generator().manual_seed(head_dim + kb)
    h = 3 if per_head else 2
    codec = _centered_codec(head_dim, kb, vb, g, seed=5, scales=scales,
                            heads=h if per_head else None)
    ld = TkvLoader(codec, h, 16)
    nblk, n = 4, 29
    cache = torch.randint(0, 256, (nblk, ld.layout.page_bytes), dtype=torch.uint8,
                          generator=g).to(DEV)
    shift = torch.randn(h if per_head else 1, head_dim, generator=g) * 3
    k = _keys(n, h, head_dim, g, shift).to(DEV, torch.bfloat16)
    v = torch.randn(n, h, head_dim, generator=g).to(DEV, torch.bfloat16)
    slots = torch.randperm(nblk * 16, generator=g)[:n].to(DEV)
    compress_store(k, v, cache, slots, ld, rotation=rotation)
    views = ld.layout.views(cache)
    b, o = slots // 16, slots % 16
    pk, nk = codec.compress_k(k)
    ck = codec.k.quantize(k)[0]                       # the codec subtracts μ itself
    if per_head:  # plain-PyTorch check of the per-head subtraction: head i is centered by μ[i]
        plain = TurboKVCodec(head_dim, k_bits=kb, v_bits=vb, device=DEV, seed=5,
                             k_channel_scales=codec.k.channel_scales)
        for i in range(h):
            xi = k[:, i].float() - codec.k.channel_offset[i]
            assert torch.equal(plain.k.quantize(xi)[0], ck[:, i])
    got = unpack_codes(views["k_codes"][b, :, o], kb, head_dim)
    assert (got == ck).float().mean() > 0.999
    assert ((got - ck).abs() <= 1).all()
    if interpreting() and head_dim <= 128 and store_rotation_for(rotation, ld) != "wht":
        # the matrix path in one pass: bit-exact
        assert torch.equal(views["k_codes"][b, :, o], pk)
        assert torch.equal(views["k_norms"][b, :, o], nk)
    else:
        torch.testing.assert_close(views["k_norms"][b, :, o].float(), nk.float(), rtol=8e-3,
                                   atol=0)
    # values are never centered
    nv = codec.compress_v(v)[1]
    assert (unpack_codes(views["v_codes"][b, :, o], vb, head_dim)
            == codec.v.quantize(v)[0]).float().mean() > 0.999
    torch.testing.assert_close(views["v_norms"][b, :, o].float(), nv.float(), rtol=8e-3, atol=0)
    # and the stored keys decode (codec.decompress_k adds μ back) to the model-space keys
    rec = codec.decompress_k(views["k_codes"][b, :, o], views["k_norms"][b, :, o])
    plain = codec.decompress_k(pk, nk)
    torch.testing.assert_close(rec, plain, rtol=0, atol=0.2)


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_with_key_offset_matches_reference(per_head):
    g = torch.Generator().manual_seed(11)
    d, hkv, group = 64, 2, 4
    codec = _centered_codec(d, 3, 4, g, seed=2, scales=True, heads=hkv if per_head else None)
    ld = TkvLoader(codec, hkv, 16)
    lens = [37, 1, 20]
    batch = make_paged_batch(lens, 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    shift = torch.randn(hkv if per_head else 1, d, generator=g) * 3
    for i, n in enumerate(lens):
        k = _keys(n, hkv, d, g, shift).to(DEV, torch.bfloat16)
        v = torch.randn(n, hkv, d, generator=g).to(DEV, torch.bfloat16)
        fill_cache(ld, cache, k, v, batch.slots(i))
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(DEV, torch.bfloat16)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, Workspace(8, 32, 256, DEV),
           out=out, block_n=ld.min_block_n)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert _rel(out, ref) < _tol(torch.bfloat16)


def _prefill_case(ld, prefix, qlens, group, g, shift, dtype=torch.float16, **kw):
    lens = [p + q for p, q in zip(prefix, qlens, strict=True)]
    batch = make_paged_batch(lens, ld.block_size, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    hkv, d = ld.num_kv_heads, ld.head_dim
    qs, ks, vs = [], [], []
    for i, (p, ql) in enumerate(zip(prefix, qlens, strict=True)):
        k = _keys(p + ql, hkv, d, g, shift).to(DEV, dtype)
        v = torch.randn(p + ql, hkv, d, generator=g).to(DEV, dtype)
        fill_cache(ld, cache, k, v, batch.slots(i))
        ks.append(k[p:])
        vs.append(v[p:])
        qs.append(torch.randn(ql, hkv * group, d, generator=g).to(DEV, dtype))
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=DEV)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
    prefill(q, k, v, cu, batch.seq_lens, max(qlens), cache, batch.block_table, ld, out=out,
            block_m=16 * min(group, 2), block_n=ld.min_block_n, **kw)
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld)
    return out, ref, (q, k, v, cu, batch, cache)


@pytest.mark.parametrize("per_head", [False, True])
def test_chunked_prefill_with_key_offset_matches_reference(per_head):
    """Rows that mix compressed prefix keys and raw chunk keys (the non-uniform-shift trap)."""
    g = torch.Generator().manual_seed(21)
    d = 64
    codec = _centered_codec(d, 4, 3, g, seed=4, heads=2 if per_head else None)
    ld = TkvLoader(codec, 2, 16)
    shift = torch.randn(2 if per_head else 1, d, generator=g) * 3
    out, ref, _ = _prefill_case(ld, [35, 3, 0], [9, 17, 5], 2, g, shift)
    assert _rel(out, ref) < _tol(torch.float16)


class _Counted(SdpaDenseAttention):
    """SdpaDenseAttention that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
        self.calls += 1
        return super().__call__(q, k, v, cu_q, cu_k, max_q, max_k, scale, window)


class _IntoOut(_Counted):
    """A counted SdpaDenseAttention writing through ``out=`` (``writes_out``, as
    FlashAttention's varlen functions)."""

    writes_out = True

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window, out=None):
        o = super().__call__(q, k, v, cu_q, cu_k, max_q, max_k, scale, window)
        return o if out is None else out.copy_(o)


@pytest.mark.parametrize("per_head", [False, True])
def test_varlen_prefix_path_with_key_offset_matches_reference(per_head):
    """Prefix-cache hits of centered keys through the varlen path (one dense_attention call):
    the prefixes are dequantized straight back to model space, still centered, and attended
    next to the chunk's keys centered the same way (session 24) — the float64 oracle, through
    ``out=`` and through a returned tensor alike. A chunk left uncentered would put every
    prefix key off by μ against it (the trap above)."""
    g = torch.Generator().manual_seed(23)
    d = 64
    codec = _centered_codec(d, 4, 3, g, seed=5, scales=per_head, heads=2 if per_head else None)
    ld = TkvLoader(codec, 2, 16)
    shift = torch.randn(2 if per_head else 1, d, generator=g) * 3
    prefix, qlens = [35, 3, 0, 20], [9, 17, 5, 1]
    need = varlen_prefix_bytes(sum(prefix), sum(qlens), 2, d, torch.float16)
    scratch = torch.full((need // 4 + 16,), float("nan"), device=DEV)
    into, plain = _IntoOut(), _Counted()
    for fn in (into, plain):
        out, ref, _ = _prefill_case(ld, prefix, qlens, 2, g, shift, max_prefix_len=35,
                                    scratch=scratch, dense_attention=fn,
                                    prefix_tokens=sum(prefix))
        # one 16-bit rounding of the rows more than the Triton loop
        assert _rel(out, ref) < max(_tol(torch.float16), 1e-3)
    assert into.calls == plain.calls == 1      # the varlen path ran, once each


def test_reference_adds_offset_back_and_centering_is_exact_for_attention():
    """The oracle's prefix keys are model-space (k̂ + μ): attending over them equals attending
    over the centered keys (k̂) together with centered chunk keys — the identity prefill uses."""
    g = torch.Generator().manual_seed(5)
    d = 64
    codec = _centered_codec(d, 4, 4, g, seed=1)
    ld = TkvLoader(codec, 1, 16)
    shift = torch.randn(d, generator=g) * 3
    out, ref, (q, k, v, _cu, batch, cache) = _prefill_case(ld, [20], [6], 2, g, shift)
    kp, vp = gather_kv(cache, ld, batch.block_table[0], 20)
    mu = codec.k.channel_offset.double()
    kc = torch.cat([kp - mu, k.double() - mu])        # every key centered
    pos = torch.arange(26, device=q.device)
    centered = attention_reference(q, kc, torch.cat([vp, v.double()]), pos[20:], pos)
    torch.testing.assert_close(centered, ref, rtol=1e-9, atol=1e-9)
    mixed = attention_reference(q, torch.cat([kp - mu, k.double()]), torch.cat([vp, v.double()]),
                                pos[20:], pos)
    assert _rel(mixed, ref) > 1e-2                    # the trap is real at this μ
    assert _rel(out, ref) < _tol(torch.float16)       # and the kernel avoids it


def test_reference_adds_per_head_offset_back():
    """Per-head μ (H, d): the oracle's gathered keys equal, head by head, the codec's own
    decompress_k (μ[h] added to head h), and the kernels' chunked prefill over a prefix of
    per-head-centered keys matches the oracle (the chunk keys are centered per head too)."""
    g = torch.Generator().manual_seed(7)
    d, hkv = 64, 2
    codec = _centered_codec(d, 4, 4, g, seed=3, heads=hkv)
    ld = TkvLoader(codec, hkv, 16)
    shift = torch.randn(hkv, d, generator=g) * 3
    out, ref, (q, k, v, _cu, batch, cache) = _prefill_case(ld, [20], [6], 2, g, shift)
    kp, _ = gather_kv(cache, ld, batch.block_table[0], 20)
    views = ld.layout.views(cache)
    pos = torch.arange(20, device=q.device)
    blocks = batch.block_table[0].long()[pos // 16]
    own = codec.decompress_k(views["k_codes"][blocks, :, pos % 16],
                             views["k_norms"][blocks, :, pos % 16], torch.float64)
    torch.testing.assert_close(kp, own, rtol=1e-9, atol=1e-9)
    mu = codec.k.channel_offset.double()
    full = torch.cat([kp - mu, k.double() - mu])      # every key centered by its head's μ
    kpos = torch.arange(26, device=q.device)
    centered = attention_reference(q, full, torch.cat([gather_kv(cache, ld, batch.block_table[0],
                                                                 20)[1], v.double()]),
                                   kpos[20:], kpos)
    torch.testing.assert_close(centered, ref, rtol=1e-9, atol=1e-9)
    assert _rel(out, ref) < _tol(torch.float16)


def test_loader_refuses_per_head_offset_of_another_head_count():
    """A per-head μ for 3 heads on a layer (rank) with 2 KV heads would center a head with
    another head's mean: refused by name."""
    codec = TurboKVCodec(64, 4, device=DEV, k_channel_offset=torch.zeros(3, 64))
    with pytest.raises(ShapeError, match=r"per-head K offset \(channel or sink\) holds 3"):
        TkvLoader(codec, 2, 16)
    TkvLoader(codec, 3, 16)
