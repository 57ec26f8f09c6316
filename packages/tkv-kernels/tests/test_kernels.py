"""Correctness of compress_store / decode / prefill against the float64 oracle.

Under TRITON_INTERPRET=1 (CPU, CI) the kernels run with float32 dots at tiny shapes; on a GPU
the same tests run compiled with fp16/bf16 tensor-core dots (looser tolerance)."""

import contextlib
import importlib
import itertools
import math
import signal
import threading
from unittest import mock

import pytest
import torch

from tkv.codec import TurboKVCodec
from tkv.codec.errors import BitWidthError, DeviceMismatchError, DtypeError, ShapeError
from tkv.codec.packing import unpack_codes
from tkv.kernels import (
    BypassLoader,
    Fp8Loader,
    SdpaDenseAttention,
    TkvLoader,
    Workspace,
    WorkspaceTooSmallError,
    compress_store,
    decode,
    dense_prefix_bytes,
    plan_prefill_runs,
    prefill,
    prefill_by_runs,
    varlen_prefix_bytes,
    varlen_prefix_rows,
)
from tkv.kernels._util import interpreting
from tkv.kernels.reference import attention_reference, decode_reference, prefill_reference
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


def _gen(seed):
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _scenario(loader, lens, seed, dtype=torch.bfloat16):
    g = _gen(seed)
    batch = make_paged_batch(lens, loader.block_size, DEV, generator=g)
    cache = make_cache(loader, batch.num_blocks, DEV, generator=g)
    for i, n in enumerate(lens):
        if n:
            kv = torch.randn(2, n, loader.num_kv_heads, loader.head_dim, generator=g)
            fill_cache(loader, cache, kv[0].to(DEV, dtype), kv[1].to(DEV, dtype), batch.slots(i))
    return batch, cache


def _ws(max_seqs=8, heads=32, d=256):
    return Workspace(max_seqs, heads, d, DEV, max_splits=8)


def _decode_check(loader, lens, group, seed, window=0, dtype=torch.bfloat16, splits=None,
                  ws=None, **kw):
    batch, cache = _scenario(loader, lens, seed, dtype)
    hq = loader.num_kv_heads * group
    q = (torch.randn(len(lens), hq, loader.head_dim) * 2).to(DEV, dtype)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, loader, ws or _ws(), out=out,
           window=window, num_splits=splits, block_n=loader.min_block_n, **kw)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, loader, window=window)
    assert _rel(out, ref) < _tol(dtype)
    return out, q, cache, batch


# --------------------------------------------------------------------- compress_store
@pytest.mark.parametrize("head_dim,kb,vb,rotation,block_t", [
    (64, 4, 4, "auto", None), (96, 3, 5, "auto", None), (128, 2, 8, "auto", None),
    (64, 7, 6, "auto", None), (256, 3, 4, "auto", None), (64, 4, 4, "tf32x3", None),
    (96, 3, 5, "tf32x3", None), (128, 4, 4, "auto", 64), (64, 3, 4, "split", 32),
    (96, 2, 6, "split", 64),   # padding coordinates inside 32-wide planes (norm correction)
    (128, 4, 3, "fp16", 64),   # float16 K and V through the scaled fp16 terms
    # butterflies (no rotation matrix): natural-order packing of every width, small tiles
    (64, 4, 4, "wht", None), (128, 2, 8, "wht", 64), (256, 3, 4, "wht", None),
    (64, 7, 6, "wht", 8), (16, 5, 4, "wht", None)])
def test_compress_store_matches_codec(head_dim, kb, vb, rotation, block_t):
    g = _gen(1)
    codec = TurboKVCodec(head_dim, k_bits=kb, v_bits=vb, device=DEV, seed=7)
    ld = TkvLoader(codec, 2, 16)
    nblk = 6
    cache = torch.randint(0, 256, (nblk, ld.layout.page_bytes), dtype=torch.uint8, generator=g)
    cache = cache.to(DEV)
    before = cache.clone()
    n = 37
    k = (torch.randn(n, 2, head_dim, generator=g) * 3).to(
        DEV, torch.float16 if rotation == "fp16" else torch.bfloat16)
    v = torch.randn(n, 2, head_dim, generator=g).to(DEV, torch.float16)
    slots = torch.randperm(nblk * 16, generator=g)[:n].to(DEV)
    slots[5] = -1  # skipped
    compress_store(k, v, cache, slots, ld, rotation="auto" if rotation == "fp16" else rotation,
                   block_t=block_t)
    views = ld.layout.views(cache)
    keep = slots >= 0
    s = slots[keep]
    b, o = s // 16, s % 16
    pk, nk = codec.compress_k(k[keep])
    pv, nv = codec.compress_v(v[keep])
    # codes bit-exact except (on GPU) for rare float32 ties at bucket boundaries
    ck = codec.k.quantize(k[keep])[0]
    got_k = unpack_codes(views["k_codes"][b, :, o], kb, head_dim)
    assert (got_k == ck).float().mean() > 0.999
    assert ((got_k - ck).abs() <= 1).all()
    butterflies = store_rotation_for("auto" if rotation == "fp16" else rotation, ld) == "wht"
    if interpreting() and head_dim <= 128 and not butterflies:  # one pass: bit-exact
        assert torch.equal(views["k_codes"][b, :, o], pk)
        assert torch.equal(views["v_codes"][b, :, o], pv)
        assert torch.equal(views["k_norms"][b, :, o], nk)
        assert torch.equal(views["v_norms"][b, :, o], nv)
    else:  # float32 rounding may differ: norms within one bf16 ulp, codes off by one rarely
        torch.testing.assert_close(views["k_norms"][b, :, o].float(), nk.float(), rtol=8e-3, atol=0)
        torch.testing.assert_close(views["v_norms"][b, :, o].float(), nv.float(), rtol=8e-3, atol=0)
        got_v = unpack_codes(views["v_codes"][b, :, o], vb, head_dim)
        assert (got_v == codec.v.quantize(v[keep])[0]).float().mean() > 0.999
    # untouched slots keep their bytes
    written = torch.zeros(nblk * 16, dtype=torch.bool, device=DEV)
    written[s] = True
    for name in ("k_codes", "v_codes"):
        vb_ = ld.layout.views(before)[name].transpose(1, 2).reshape(nblk * 16, 2, -1)
        va_ = views[name].transpose(1, 2).reshape(nblk * 16, 2, -1)
        assert torch.equal(vb_[~written], va_[~written])


@pytest.mark.parametrize("head_dim,kb,scales,offset", [(64, 4, False, False),
                                                     (96, 3, True, True), (128, 8, False, True)])
def test_store_rotation_terms_sum_to_the_planar_rotation(head_dim, kb, scales, offset):
    """compress_store's rotation operand: A's columns in the side's code-group planar order
    (column j·NP + p of A at planar position p·d_pad/NP + j), and rotation="split" feeds bf16
    tensor cores three bf16 terms of it: each term a bf16 value, their sum A itself (no bits
    lost). Also μ @ A (the rotated key offset) and 1/s (the pre-rotation norm)."""
    g = _gen(11)
    kw = {}
    if scales:
        kw["k_channel_scales"] = torch.rand(head_dim, generator=g) + 0.5
    if offset:
        kw["k_channel_offset"] = torch.randn(2, head_dim, generator=g) * 3
    codec = TurboKVCodec(head_dim, kb, device=DEV, **kw)
    ld = TkvLoader(codec, 2, 16)
    dp, npl = ld.d_pad, ld.group_planes("k")
    assert npl == (1 if kb == 8 else 8 // math.gcd(kb, 8))
    for side, a in (("k", ld.k_in), ("v", ld.v_in)):
        a = a.double().cpu()
        planar = torch.zeros_like(a)
        for pos in range(dp):          # plain loops: position p*dj + j holds column j*npl + p
            p, j = divmod(pos, dp // npl)
            if j * npl + p < head_dim:
                planar[:, pos] = a[:, j * npl + p]
        a32, one = ld.store_rotation(side, None)
        assert one == 1.0 and torch.equal(a32.double().cpu(), planar)
        terms, one = ld.store_rotation(side, torch.bfloat16)
        terms = terms.cpu()
        assert terms.shape == (3, dp, dp) and one == 1.0
        assert torch.equal(terms.float().to(torch.bfloat16).float(), terms.float())
        assert torch.equal(terms.double().sum(0), planar)
        assert terms[2].abs().max() <= planar.abs().max() * 2.0 ** -14   # ~2^-8 per term
        h, scale = ld.store_rotation(side, torch.float16)   # fp16: scaled into its range
        h = h.cpu()
        assert torch.equal(h.float().to(torch.float16).float(), h.float())
        assert 2.0 ** 14 <= h[0].abs().max() < 2.0 ** 15 and math.log2(scale).is_integer()
        err = (h.double().sum(0) * scale - planar).abs().max()
        assert err <= planar.abs().max() * 2.0 ** -30
    s = codec.k.channel_scales
    want = 1 / s.double().cpu() if s is not None else torch.ones(head_dim, dtype=torch.float64)
    torch.testing.assert_close(ld.k_inv_scale.double().cpu()[:head_dim], want)
    if offset:
        mu = codec.k.channel_offset.double().cpu()
        x = torch.randn(2, head_dim, dtype=torch.float64, generator=g)
        want = (x - mu) @ ld.k_in.double().cpu()[:head_dim]
        got = x @ ld.k_in.double().cpu()[:head_dim] - ld.k_mu_rot.double().cpu()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_compress_store_wht_rotation_refuses_non_hadamard_heads():
    """rotation="wht" needs a pure power-of-two Hadamard rotation: head_dim 96 (Hadamard ⊗
    DCT) has no store weights and is refused by name, before any launch; float32 K/V are
    fine (the butterflies run in float32 whatever the input)."""
    ld = TkvLoader(TurboKVCodec(96, 4, device=DEV), 1, 16)
    assert ld.k_store_hadamard is None and ld.v_store_hadamard is None
    cache = ld.layout.allocate(2, DEV)
    k = torch.randn(3, 1, 96).to(DEV, torch.bfloat16)
    slots = torch.arange(3, device=DEV)
    with pytest.raises(ValueError, match="power-of-two Hadamard"):
        compress_store(k, k, cache, slots, ld, rotation="wht")
    g = _gen(5)
    codec = TurboKVCodec(32, k_bits=3, v_bits=4, device=DEV, seed=2,
                         k_channel_scales=torch.rand(32, generator=g) + 0.5)
    ld = TkvLoader(codec, 1, 16)
    x = torch.randn(9, 1, 32, generator=g).to(DEV)
    cache = ld.layout.allocate(1, DEV)
    compress_store(x, x * 2, cache, torch.arange(9, device=DEV), ld, rotation="wht")
    views = ld.layout.views(cache)
    for side, bits, vals in (("k", 3, x), ("v", 4, x * 2)):
        codes = unpack_codes(views[f"{side}_codes"][0, :, :9].transpose(0, 1), bits, 32)
        assert (codes == getattr(codec, side).quantize(vals)[0]).float().mean() > 0.999


@pytest.mark.parametrize("policy,tokens,head_dim,butterflies", [
    ("auto", 8, 64, True), ("auto", 300, 128, True), ("matrix", 8, 64, False),
    ("matrix", 300, 64, False),
    ("auto", 8, 96, False)])   # head_dim 96: no pure Hadamard, the matrix rotation
def test_store_rotation_policy_picks_the_butterflies(monkeypatch, policy, tokens, head_dim,
                                                     butterflies):
    """rotation="auto" runs the butterflies wherever the rotation is a pure power-of-two
    Hadamard (the default since session 28), unless TKV_STORE_ROTATION=matrix (read at import
    into store.STORE_ROTATION): the butterflies never ask the loader for the rotation matrix,
    the matrix paths always do; an explicit rotation= is never overridden."""
    import tkv.kernels.store as store

    monkeypatch.setattr(store, "STORE_ROTATION", policy)
    ld = TkvLoader(TurboKVCodec(head_dim, 4, device=DEV), 1, 16)
    asked = []
    real = ld.store_rotation
    monkeypatch.setattr(ld, "store_rotation", lambda *a: asked.append(a) or real(*a))
    cache = ld.layout.allocate(tokens // 16 + 1, DEV)
    x = torch.randn(tokens, 1, head_dim, generator=_gen(3)).to(DEV, torch.bfloat16)
    slots = torch.arange(tokens, device=DEV)
    compress_store(x, x, cache, slots, ld)
    assert (not asked) == butterflies
    asked.clear()
    compress_store(x, x, cache, slots, ld, rotation="split")
    assert asked


@pytest.mark.parametrize("raw,want", [(None, "auto"), ("", "auto"), (" ", "auto"),
                                      (" Matrix ", "matrix"), ("AUTO", "auto"), ("wht", None),
                                      ("split", None), ("wht-decode", None),
                                      ("1", None), ("x" * 500, None), (1, None)])
def test_store_rotation_env(raw, want):
    from tkv.kernels import StoreRotationConfigError, store_rotation_from_env
    env = {} if raw is None else {"TKV_STORE_ROTATION": raw}
    if want is None:
        with pytest.raises(StoreRotationConfigError, match="TKV_STORE_ROTATION") as e:
            store_rotation_from_env(env)
        assert len(str(e.value)) < 200
    else:
        assert store_rotation_from_env(env) == want


@pytest.mark.parametrize("rotation", ["auto", "wht"])
@pytest.mark.parametrize("sink", [False, True])
def test_compress_store_stores_nan_for_a_nan_input(rotation, sink):
    """A NaN element stores a NaN norm — loud downstream, as documented. A NaN with bits
    0x7FFFFFFF (what GPU arithmetic makes; fp16 0x7FFF converts to it) used to overflow the
    integer bf16 rounding into 0x8000: a flagged −0.0 norm that decodes to the sink offset,
    finite (helper break-test, session 28); −NaN (0xFFFFFFFF) into +0.0."""
    g = _gen(17)
    kw = dict(k_sink_offset=(torch.randn(64, generator=g) * 4).bfloat16().float()) if sink else {}
    ld = TkvLoader(TurboKVCodec(64, 4, device=DEV, check_finite=False, **kw), 1, 16)
    k = torch.randn(4, 1, 64, generator=g).to(torch.float16)
    k.view(torch.int16)[0, 0, 5] = 0x7FFF          # fp16 NaN, all mantissa bits
    k.view(torch.int16)[1, 0, 9] = -1              # 0xFFFF: a negative NaN
    x = torch.randn(4, 1, 64, generator=g)
    x.view(torch.int32)[2, 0, 3] = 0x7FFFFFFF      # float32 NaN, all mantissa bits
    cache = ld.layout.allocate(1, DEV)
    slots = torch.arange(4, device=DEV)
    compress_store(k.to(DEV), k.to(DEV), cache, slots, ld, rotation=rotation)
    norms = ld.layout.views(cache)["k_norms"][0, 0, :4].float()
    assert torch.isnan(norms[:2]).all() and torch.isfinite(norms[2:]).all(), norms
    compress_store(x.to(DEV), x.to(DEV), cache, slots, ld, rotation=rotation)
    norms = ld.layout.views(cache)["v_norms"][0, 0, :4].float()
    assert torch.isnan(norms[2]) and torch.isfinite(norms[[0, 1, 3]]).all(), norms


def test_compress_store_checks_its_arguments_on_an_empty_batch():
    """A zero-token call returned before any argument check, so a misconfigured engine
    failed only at its first non-empty batch."""
    ld = TkvLoader(TurboKVCodec(96, 4, device=DEV), 1, 16)
    cache = ld.layout.allocate(1, DEV)
    x = torch.zeros(0, 1, 96, device=DEV, dtype=torch.bfloat16)
    s = torch.zeros(0, dtype=torch.int64, device=DEV)
    for kw, err in ((dict(rotation="bogus"), "rotation must be"),
                    (dict(rotation="wht"), "power-of-two Hadamard"),
                    (dict(block_t=3), "block_t")):
        with pytest.raises(ValueError, match=err):
            compress_store(x, x, cache, s, ld, **kw)
    with pytest.raises(ValueError, match="bfloat16/float16"):
        compress_store(x.float(), x.float(), cache, s, ld, rotation="split")
    compress_store(x, x, cache, s, ld)   # a valid empty call is a no-op


def test_compress_store_split_rotation_refuses_float32():
    codec = TurboKVCodec(64, 4, device=DEV)
    ld = TkvLoader(codec, 1, 16)
    cache = ld.layout.allocate(2, DEV)
    k = torch.randn(3, 1, 64).to(DEV, torch.float32)
    slots = torch.arange(3, device=DEV)
    with pytest.raises(ValueError, match="bfloat16/float16 key"):
        compress_store(k, k, cache, slots, ld, rotation="split")
    with pytest.raises(ValueError, match="rotation must be"):
        compress_store(k, k, cache, slots, ld, rotation="fp64")


def test_compress_store_channel_scales_and_no_norm_correction():
    g = _gen(2)
    d = 64
    ks = torch.rand(d, generator=g) + 0.5
    vs = torch.rand(d, generator=g) + 0.5
    codec = TurboKVCodec(d, 4, device=DEV, k_channel_scales=ks, v_channel_scales=vs,
                         k_norm_correction=False, k_codebook="beta")
    ld = TkvLoader(codec, 1, 16)
    lens = [21, 9]
    batch, cache = _scenario(ld, lens, 3)
    q = torch.randn(2, 4, d).to(DEV, torch.bfloat16)
    out = torch.full(q.shape, float("nan"), device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=out)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert _rel(out, ref) < _tol(torch.bfloat16)


# --------------------------------------------------------------------- every width pair
@pytest.mark.parametrize("kb", range(2, 9))
def test_every_width_pair_store_and_decode(kb):
    bad = {}
    for vb in range(2, 9):  # run all pairs, then report every failing one
        codec = TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV, seed=kb * 10 + vb)
        ld = TkvLoader(codec, 1, 16)
        try:
            _decode_check(ld, [19, 1], group=2, seed=kb * 10 + vb)
        except AssertionError as e:
            bad[(kb, vb)] = str(e).splitlines()[0][:80]
    assert not bad, f"failing (k_bits, v_bits): {bad}"


# --------------------------------------------------------------------- decode geometry
@pytest.mark.parametrize("head_dim,group,block_size,window,lens", [
    (64, 1, 16, 0, [33, 1, 16, 50]),
    (128, 4, 16, 0, [47, 5]),
    (96, 7, 32, 0, [70, 1, 31]),
    (64, 8, 16, 9, [40, 3, 17]),
    (128, 4, 64, 20, [130, 64]),
    (256, 2, 16, 0, [20, 1]),
])
def test_decode_tkv_geometry(head_dim, group, block_size, window, lens):
    codec = TurboKVCodec(head_dim, k_bits=4, v_bits=3, device=DEV, seed=head_dim)
    ld = TkvLoader(codec, 2, block_size)
    _decode_check(ld, lens, group, seed=group + block_size, window=window)


@pytest.mark.parametrize("head_dim,kb,vb,group,window,lens", [
    (64, 4, 4, 4, 0, [37, 1, 20]), (128, 2, 8, 7, 9, [40, 3]), (96, 4, 3, 1, 0, [33, 16])])
def test_decode_swap_qk_matches_reference(head_dim, kb, vb, group, window, lens):
    """``swap_qk=True`` (scores as K·q^T, the prmt1 orientation) with a lookup the interpreter
    runs (float32 gathers: exact, so the oracle's tolerance is the tight one): same attention
    as the float64 oracle."""
    codec = TurboKVCodec(head_dim, k_bits=kb, v_bits=vb, device=DEV, seed=head_dim + kb)
    ld = TkvLoader(codec, 2, 16, lookup="gather")
    _decode_check(ld, lens, group, seed=kb * 10 + vb, window=window, swap_qk=True)


_GPU_ONLY = pytest.mark.skipif(DEV == "cpu", reason="PTX inline assembly: CUDA only")


@pytest.mark.parametrize("lookup", ["auto", pytest.param("prmti", marks=_GPU_ONLY),
                                    pytest.param("prmts", marks=_GPU_ONLY)])
def test_decode_maxnreg_knob_matches_reference(lookup):
    """``maxnreg`` (a register cap for the split kernel; on the GPU with spills) changes the
    schedule, not the result; on the interpreter it is accepted and ignored."""
    codec = TurboKVCodec(128, k_bits=4, v_bits=4, device=DEV, seed=15)
    ld = TkvLoader(codec, 2, 16, lookup=lookup)
    _decode_check(ld, [37, 1, 200], 4, seed=15, maxnreg=128)


@pytest.mark.skipif(DEV == "cpu", reason="PTX inline assembly: CUDA only")
@pytest.mark.parametrize("kb,vb,dtype", [(4, 4, torch.bfloat16), (4, 3, torch.float16)])
def test_decode_prmt_swap_qk_matches_reference(kb, vb, dtype):
    """The prmt lookup (two planes per asm; the CUDA default before session 6) with scores as
    K·q^T — the orientation ``kernels_gpu.py --variants`` times against q·K^T."""
    codec = TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV, seed=kb + vb)
    ld = TkvLoader(codec, 2, 16, lookup="prmt")
    batch, cache = _scenario(ld, [37, 1, 20, 130], 17)
    q = torch.randn(4, 8, 64).to(DEV, dtype)
    out = torch.full(q.shape, float("nan"), device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=out, swap_qk=True)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert _rel(out, ref) < _tol(dtype)


def test_decode_many_rows_partial_row_block():
    """≥ 1024 (sequence, query head) rows: the reduce kernel takes 32 rows per program;
    45 · 24 = 1080 rows leave a partial last block (masked rows). The workspace keeps at least
    2 splits (``single_split_ctas=0``): with the default rule these 90 CTAs (CPU
    target_programs 8) would run one split, written by the split kernel, and the reduce
    kernel would not launch — the spy checks that it does."""
    import importlib

    decode_mod = importlib.import_module("tkv.kernels.decode")   # the module, not decode()
    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=21)
    ld = TkvLoader(codec, 2, 16)
    lens = [(i * 7) % 19 + 1 for i in range(45)]
    ws = Workspace(45, 24, 64, DEV, max_splits=8, single_split_ctas=0)
    real = decode_mod._decode_reduce_kernel
    grids = []

    class _Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]
    with mock.patch.object(decode_mod, "_decode_reduce_kernel", _Spy()):
        _decode_check(ld, lens, 12, seed=21, ws=ws)
    assert grids == [(-(-45 * 24 // 32),)], grids   # 34 programs, the last one partial


@pytest.mark.parametrize("lookup,kb,vb,dtype", [
    ("pair", 4, 4, torch.bfloat16), ("pair", 4, 2, torch.float16), ("pair", 2, 3, torch.bfloat16),
    ("gather", 4, 2, torch.float16), ("gather", 8, 4, torch.bfloat16),
    ("gather", 2, 8, torch.float16), ("shuffle", 4, 4, torch.bfloat16),
    ("shuffle", 2, 4, torch.float16), ("shuffle", 4, 8, torch.bfloat16),
    pytest.param("prmt", 4, 4, torch.bfloat16, marks=_GPU_ONLY),
    pytest.param("prmt", 4, 2, torch.float16, marks=_GPU_ONLY),
    pytest.param("prmt", 3, 4, torch.float16, marks=_GPU_ONLY),
    pytest.param("prmt1", 4, 4, torch.bfloat16, marks=_GPU_ONLY),
    pytest.param("prmt1", 4, 2, torch.float16, marks=_GPU_ONLY),
    pytest.param("prmt1", 3, 4, torch.float16, marks=_GPU_ONLY),
    pytest.param("prmti", 4, 4, torch.bfloat16, marks=_GPU_ONLY),
    pytest.param("prmti", 4, 2, torch.float16, marks=_GPU_ONLY),
    pytest.param("prmts", 4, 4, torch.bfloat16, marks=_GPU_ONLY),
    pytest.param("prmts", 4, 2, torch.float16, marks=_GPU_ONLY)])
def test_decode_lookup_variants(lookup, kb, vb, dtype):
    """Every plane count (NP = 4/2/1 for 2/4/8 bits) with every lookup, fp16 and bf16."""
    codec = TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV, seed=11)
    ld = TkvLoader(codec, 2, 16, lookup=lookup)
    batch, cache = _scenario(ld, [37, 1, 20], 13)
    q = torch.randn(3, 8, 64).to(DEV, dtype)
    out = torch.full(q.shape, float("nan"), device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=out, block_n=ld.min_block_n)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    # pair tables round centroids to the query's 16-bit type (fp16 under the interpreter)
    tol = 2e-3 if interpreting() and lookup == "pair" else _tol(dtype)
    assert _rel(out, ref) < tol
    with pytest.raises(ValueError):
        TkvLoader(codec, 2, 16, lookup="select")


@pytest.mark.parametrize("prefetch,block_n,groups", [(False, 16, False), (True, 32, True),
                                                     (False, 32, True)])
def test_decode_prefetch_variants(prefetch, block_n, groups):
    """With and without the software-pipelined fetch (tile t+1 loaded during tile t); the
    3-bit V side per element (16-token tiles allowed) or as interleaved 8-code groups (the
    default at head_dim 64: tiles of at least 32 tokens, ``min_block_n``)."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=3, device=DEV, seed=12)
    ld = TkvLoader(codec, 2, 16, small_head_groups=groups)
    assert ld.min_block_n == (32 if groups else 16)
    batch, cache = _scenario(ld, [70, 1, 33], 14)
    q = torch.randn(3, 8, 64).to(DEV, torch.float16)
    out = torch.full(q.shape, float("nan"), device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=out, block_n=block_n,
           prefetch=prefetch, num_splits=2)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert _rel(out, ref) < _tol(torch.float16)


@pytest.mark.parametrize("lookup,kb,vb,d", [("pair", 3, 3, 128), ("gather", 3, 4, 96),
                                             ("pair", 4, 3, 256), ("auto", 5, 6, 128),
                                             ("auto", 7, 2, 128), ("auto", 6, 5, 96),
                                             ("shuffle", 3, 5, 128)])
def test_decode_odd_width_planes(lookup, kb, vb, d):
    """Odd and 6-bit sides as whole-byte groups (3/5/7 bits: 8 codes in 3/5/7 bytes, int32 or
    int64 group words; 6 bits: 4 codes in 3 bytes) — pair and gather lookups, D_PAD padding
    (96) and 256."""
    codec = TurboKVCodec(d, k_bits=kb, v_bits=vb, device=DEV, seed=d)
    ld = TkvLoader(codec, 2, 16, lookup=lookup)
    assert max(ld.group_planes("k"), ld.group_planes("v")) >= 4
    batch, cache = _scenario(ld, [40, 1, 17], 15)
    q = torch.randn(3, 4, d).to(DEV, torch.float16)
    out = torch.full(q.shape, float("nan"), device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=out, block_n=ld.min_block_n)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    tol = 2e-3 if interpreting() and lookup == "pair" else _tol(torch.float16)
    assert _rel(out, ref) < tol


@_GPU_ONLY
@pytest.mark.parametrize("kb,vb,d,block_n,dtype", [
    (3, 3, 128, 32, torch.bfloat16), (3, 2, 128, 64, torch.float16),
    (2, 3, 256, 32, torch.bfloat16), (3, 4, 96, 32, torch.float16),
    (2, 2, 128, 128, torch.bfloat16), (3, 4, 128, 16, torch.bfloat16)])
def test_decode_group_prmt_lookup(kb, vb, d, block_n, dtype):
    """The 2/3-bit byte-permute group lookup (``auto`` on CUDA): tiles of ≥ 512 groups run the
    asm, smaller ones (a 3-bit K side, 16 tokens at head_dim 128) the float32 fallback; both equal the
    float64 oracle, fp16 and bf16, head_dim 96 (padding) / 128 / 256."""
    codec = TurboKVCodec(d, k_bits=kb, v_bits=vb, device=DEV, seed=d + kb)
    ld = TkvLoader(codec, 2, 16)
    assert "prmt" in {ld.lookup_name("k", dtype), ld.lookup_name("v", dtype)}
    batch, cache = _scenario(ld, [150, 1, 33, 64], 16, dtype)
    q = (torch.randn(4, 8, d) * 2).to(DEV, dtype)
    out = torch.full(q.shape, float("nan"), device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=out, block_n=block_n)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert _rel(out, ref) < _tol(dtype)


def test_planes_follow_widths():
    """Code groups: 2/4/8-bit sides fetch 4/2/1 codes per group, 3/5/7 bits 8, 6 bits 4, while
    a group plane keeps >= 16 coordinates (tensor-core K), else per element
    (``small_head_groups=False``); the kernels take at most ``planes`` of them, interleaved
    (default: 8-code groups to 2, others kept); bad ``planes`` is a ValueError. By default
    (``small_head_groups``) a 3/5/7-bit side too narrow for its 8 group planes is still
    fetched as 8-code groups when 2 interleaved planes keep >= 16 coordinates."""
    for kb, vb, d, want in [(4, 2, 64, (2, 4)), (8, 3, 128, (1, 8)), (2, 5, 96, (4, 8)),
                            (2, 4, 32, (1, 2)), (3, 3, 64, (1, 1)), (3, 7, 256, (8, 8)),
                            (6, 5, 128, (4, 8)), (6, 7, 64, (4, 1))]:
        codec = TurboKVCodec(d, k_bits=kb, v_bits=vb, device=DEV)
        ld = TkvLoader(codec, 1, 16, small_head_groups=False)
        assert (ld.group_planes("k"), ld.group_planes("v")) == want
        assert (ld.fetch_group_planes("k"), ld.fetch_group_planes("v")) == want
        assert (ld.planes("k"), ld.planes("v")) == tuple(2 if w == 8 else w for w in want)
        for cap in (1, 4, 8):
            ld = TkvLoader(codec, 1, 16, planes=cap, small_head_groups=False)
            assert (ld.planes("k"), ld.planes("v")) == tuple(min(w, cap) for w in want)
        grouped = TkvLoader(codec, 1, 16)   # the default: same store order, other fetch
        assert (grouped.group_planes("k"), grouped.group_planes("v")) == want
        fetch = tuple(8 if w == 1 and b in (3, 5, 7) and d // 2 >= 16 else w
                      for w, b in zip(want, (kb, vb), strict=True))
        assert (grouped.fetch_group_planes("k"), grouped.fetch_group_planes("v")) == fetch
        assert (grouped.planes("k"), grouped.planes("v")) == tuple(
            2 if w == 8 else w for w in fetch)
    for bad in (0, 3, 16, True, 2.0):
        with pytest.raises(ValueError, match="planes"):
            TkvLoader(TurboKVCodec(64, 4, device=DEV), 1, 16, planes=bad)


@pytest.mark.parametrize("kb,vb", [(3, 4), (5, 2), (4, 3), (6, 7), (3, 3), (7, 8)])
def test_per_element_sides_keep_32_token_tiles(kb, vb):
    """A per-element side (3/5/6/7 bits at head_dim 64: a group plane would hold < 16
    coordinates) keeps decode and prefill-prefix tiles at 32 tokens: 64-token prefix tiles
    with such a side fault on the H200 (session 8's tile bug; session 10's tile rule let these
    loaders pick 128 and the GPU suite failed with illegal addresses in session 11)."""
    from tkv.kernels.prefill import _prefix_tile
    ld = TkvLoader(TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV), 3, 16,
                   small_head_groups=False)
    assert 1 in (ld.group_planes("k"), ld.group_planes("v"))
    assert ld.preferred_block_n == 32
    assert _prefix_tile(ld.prefill_loader()) == 32
    # the default loader decodes such sides as 8-code groups, but its prefill view still
    # reads them per element: the same 32-token prefix tiles
    grouped = TkvLoader(TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV), 3, 16)
    assert _prefix_tile(grouped.prefill_loader()) == 32
    # the same widths at head_dim 128 are whole-byte groups again
    wide = TkvLoader(TurboKVCodec(128, k_bits=kb, v_bits=vb, device=DEV), 3, 16)
    assert 1 not in (wide.group_planes("k"), wide.group_planes("v")) or 8 in (kb, vb)


@pytest.mark.parametrize(("kb", "vb", "group"), [(3, 3, 3), (5, 4, 3), (4, 3, 1), (7, 5, 2),
                                              (3, 2, 3), (6, 5, 4)])
def test_small_head_groups_decode_matches_oracle(kb, vb, group):
    """``small_head_groups`` (the default): at head_dim 64 decode fetches whole 8-code groups
    of 3/5/7-bit sides (interleaved to 2 planes of 32) instead of reading them per element
    (``small_head_groups=False``); same cache bytes (compress_store unchanged), prefill still
    per element. Decode and prefill both match the float64 oracle; the per-element loader
    reads the same cache the same way."""
    codec = TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV)
    ld = TkvLoader(codec, 2, 16)
    assert ld.small_head_groups
    plain = TkvLoader(codec, 2, 16, small_head_groups=False)
    for side, bits in (("k", kb), ("v", vb)):
        odd = bits in (3, 5, 7)
        assert plain.group_planes(side) == ld.group_planes(side)   # the store is unchanged
        assert ld.fetch_group_planes(side) == (8 if odd else plain.fetch_group_planes(side))
        assert ld.planes(side) == (2 if odd else plain.planes(side))
        assert ld.prefill_loader().planes(side) == plain.prefill_loader().planes(side)
    view = ld.prefill_loader()
    assert view.preferred_block_n == 32 and view.fetch_group_planes("k") == plain.group_planes("k")
    out, q, cache, batch = _decode_check(ld, [70, 1, 33], group, seed=kb * 10 + vb)
    again = torch.empty_like(out)
    decode(q, cache, batch.block_table, batch.seq_lens, plain, _ws(), out=again)
    assert _rel(again, out) < _tol(torch.bfloat16)
    n = 9
    qc = (torch.randn(n, 2 * group, 64) * 2).to(DEV, torch.bfloat16)
    kc, vc = (torch.randn(n, 2, 64).to(DEV, torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    sl = batch.seq_lens[:1] + n
    res = torch.full(qc.shape, float("nan"), dtype=torch.float32, device=DEV)
    prefill(qc, kc, vc, cu, sl, n, cache, batch.block_table[:1], ld, out=res)
    ref = prefill_reference(qc, kc, vc, cu, sl, cache, batch.block_table[:1], ld)
    assert _rel(res, ref) < _tol(torch.bfloat16)


def test_prefill_loader_keeps_group_planes():
    """prefill reads through ``prefill_loader()``: the loader itself when nothing is
    interleaved, else a view (built at construction) with the group planes kept, the same
    tables and cache layout, and V tiles of 16 tokens allowed again."""
    plain = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=2, device=DEV), 2, 16)
    assert plain.prefill_loader() is plain and plain.min_block_n == 16
    ld = TkvLoader(TurboKVCodec(128, k_bits=3, v_bits=5, device=DEV), 2, 16)
    view = ld.prefill_loader()
    assert (ld.planes("k"), ld.planes("v"), ld.min_block_n) == (2, 2, 32)
    assert (view.planes("k"), view.planes("v"), view.min_block_n) == (8, 8, 16)
    assert view.k_table is ld.k_table and view.layout == ld.layout
    assert view.prefill_loader() is view and view.preferred_block_n == 32
    assert ld.preferred_block_n == 128
    assert not torch.equal(view.q_in_planar, ld.q_in_planar)


@pytest.mark.parametrize("planes", [1, 2, 8, None])
@pytest.mark.parametrize("kb,vb", [(3, 5), (2, 6), (7, 4)])
def test_decode_and_prefill_any_plane_cap(planes, kb, vb):
    """The group planes interleaved down to 1 / 2 planes (or kept: 8; None: the default rule)
    give the same attention as the float64 oracle, decode and prefill (which reads through
    ``prefill_loader``: group planes kept)."""
    n = planes or 3
    codec = TurboKVCodec(128, k_bits=kb, v_bits=vb, device=DEV, seed=n + kb)
    ld = TkvLoader(codec, 2, 16, planes=planes)
    _decode_check(ld, [40, 1, 17], 2, seed=kb * 10 + vb + n)
    _prefill_check(ld, [21, 5], [6, 3], 2, seed=n)


def test_decode_splits_and_rotated_io():
    codec = TurboKVCodec(64, 4, device=DEV)
    ld = TkvLoader(codec, 2, 16)
    batch, cache = _scenario(ld, [300, 12], 5)
    q = torch.randn(2, 8, 64).to(DEV, torch.float16)
    ws = _ws()
    outs = []
    # 16 splits: the reduce merges them in two unrolled groups of 8 (block_n=16: 19 tiles of
    # the 300-token sequence, 2 per split, the last splits one or none; 1 tile for 12)
    for sp, w in ((1, ws), (4, ws), (16, Workspace(2, 8, 64, DEV, max_splits=16, target_programs=512))):
        o = torch.full(q.shape, float("nan"), device=DEV)
        outs.append(decode(q, cache, batch.block_table, batch.seq_lens, ld, w, out=o,
                           num_splits=sp, block_n=ld.min_block_n))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-3, atol=1e-3)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert _rel(outs[2].float(), ref) < _tol(torch.float16)
    # rotated in / rotated out round trip through the codec's own rotation
    qr = codec.rotate_query(q.float())
    o_rot = torch.full(q.shape, float("nan"), device=DEV)
    decode(qr, cache, batch.block_table, batch.seq_lens, ld, ws, out=o_rot,
           query_rotated=True, output_rotated=True)
    torch.testing.assert_close(codec.unrotate_output(o_rot), outs[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", ["hadamard64", "calibrated128", "dct96", "rotated_out",
                                  "bypass", "bypass96", "fp8", "strided_bf16", "rule_window"])
def test_decode_single_split_epilogue(case):
    """One split: the split kernel writes ``out`` itself (EPILOGUE 1 as it is, 2 unrotated by
    ``out_hadamard`` butterflies; head_dim 96 has no Hadamard rotation, so the reduce pass
    stays) — equal to the float64 oracle and to the reduce pass (single_split_epilogue=False)
    for every loader kind, output dtype, a strided output, head_dim under d_pad (bypass96),
    and one split chosen by the workspace rule with a window and an empty sequence
    (rule_window); no reduce launch where fused."""
    import importlib
    decode_mod = importlib.import_module("tkv.kernels.decode")
    g = _gen(len(case))
    d = {"calibrated128": 128, "dct96": 96, "bypass96": 96}.get(case, 64)
    if case.startswith("bypass"):
        ld = BypassLoader(2, d, 16, torch.bfloat16)
    elif case == "fp8":
        ld = Fp8Loader(2, d, 16, torch.tensor([0.05], device=DEV),
                       torch.tensor([0.03], device=DEV))
    else:
        extra = {}
        if case == "calibrated128":
            extra = dict(k_channel_scales=torch.rand(d, generator=g) + 0.5,
                         v_channel_scales=torch.rand(d, generator=g) + 0.5,
                         k_channel_offset=torch.randn(2, d, generator=g),
                         v_sink_offset=torch.randn(2, d, generator=g) * 3)
        ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=3, device=DEV, seed=5, **extra), 2, 16)
        assert (ld.out_hadamard is None) == (case == "dct96")
    if getattr(ld, "out_hadamard", None) is not None:   # o @ out_mat == w ⊙ (o @ H), float64
        from tkv.codec.rotation import hadamard_matrix
        o64 = torch.randn(3, d, generator=g, dtype=torch.float64)
        torch.testing.assert_close(
            (o64 @ hadamard_matrix(d, torch.float64)) * ld.out_hadamard.double().cpu(),
            o64 @ ld.out_mat.double().cpu()[:d, :d], rtol=1e-6, atol=1e-6)
    lens = [45, 0, 70] if case == "rule_window" else [45, 1, 70]
    window = 20 if case == "rule_window" else 0
    batch, cache = _scenario(ld, lens, seed=len(case))
    q = (torch.randn(len(lens), 6, d, generator=g) * 2).to(DEV, torch.bfloat16)
    rotated = case == "rotated_out"
    # rule_window: the workspace picks one split itself (3 sequences · 2 KV heads ≥ 1 CTA)
    ws = Workspace(8, 32, 256, DEV, max_splits=8, single_split_ctas=1 if window else 0)
    splits = None if window else 1
    if window:
        assert ws.splits_for(len(lens), 2) == 1
    launches = []
    real = decode_mod._decode_reduce_kernel

    class _Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    outs = {}
    for fused in (True, False):
        if case == "strided_bf16":   # every other head of a wider buffer, bf16
            buf = torch.full((len(lens), 12, d), float("nan"), dtype=torch.bfloat16, device=DEV)
            out = buf[:, ::2]
        else:
            out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
        launches.clear()
        with mock.patch.object(decode_mod, "_decode_reduce_kernel", _Spy()):
            decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out,
                   num_splits=splits, block_n=ld.min_block_n, output_rotated=rotated,
                   window=window, single_split_epilogue=fused)
        assert len(launches) == (0 if fused and case != "dct96" else 1), (fused, launches)
        outs[fused] = out.float()
        if case == "strided_bf16":
            assert torch.isnan(buf[:, 1::2].float()).all()   # the other heads untouched
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld, window=window)
    if rotated:
        ref = ref.double() @ torch.linalg.inv(ld.out_mat.double()[:d, :d]).to(ref.device)
    if window:   # the empty sequence's rows are zeros
        assert torch.equal(outs[True][1], torch.zeros_like(outs[True][1]))
    tol = _tol(torch.bfloat16)
    if case == "strided_bf16":   # plus the bf16 output's own rounding (2⁻⁹ relative)
        tol = max(tol, 1e-2)
    assert _rel(outs[True], ref) < tol and _rel(outs[False], ref) < tol
    assert _rel(outs[True], outs[False]) < (1e-2 if case == "strided_bf16" else 1e-4)
    with pytest.raises(DtypeError, match="single_split_epilogue must be a bool"):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), single_split_epilogue=1)
    with pytest.raises(DtypeError, match="single_split_epilogue must be a bool"):   # empty too
        decode(q[:0], cache, batch.block_table[:0], batch.seq_lens[:0], ld, _ws(),
               single_split_epilogue="yes")
    if getattr(ld, "out_hadamard", None) is not None:   # a mutated / custom loader
        ld.out_hadamard = torch.ones(d + 1, device=DEV)
        with pytest.raises(ShapeError, match="out_hadamard"):
            decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), num_splits=1)
        ld.out_hadamard = torch.ones(d, device="meta")
        with pytest.raises(DeviceMismatchError, match="out_hadamard"):
            decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), num_splits=1)


@pytest.mark.parametrize("tiles", [2, 64])   # 2: several used splits; 64: one (final)
def test_decode_length_aware_splits(tiles):
    """decode(min_split_tiles=n): a sequence of t tiles fills only min(splits, max(1, ⌈t/n⌉))
    of its splits (the rest hold LSE −inf); one that uses a single split is written final by
    the split kernel, its LSE marked +inf for the reduce to skip (single_split_epilogue; off:
    an ordinary partial) — equal to the float64 oracle and to the plain partition, with a
    window, an empty sequence, GQA padding and sink offsets; the workspace's min_split_tiles is
    decode's default; a bad value is a ShapeError."""
    g = _gen(tiles)
    d, hkv = 64, 2
    codec = TurboKVCodec(d, k_bits=4, v_bits=3, device=DEV, seed=2,
                         k_sink_offset=torch.randn(hkv, d, generator=g) * 3)
    ld = TkvLoader(codec, hkv, 16)
    bn = ld.min_block_n
    lens = [9 * bn + 3, 0, 2 * bn, bn - 5, 24 * bn]
    batch, cache = _scenario(ld, lens, seed=tiles)
    q = (torch.randn(len(lens), 6, d, generator=g) * 2).to(DEV, torch.bfloat16)
    ws = Workspace(8, 32, 256, DEV, max_splits=8, target_programs=512, min_split_tiles=tiles)
    splits = ws.splits_for(len(lens), hkv)
    assert splits == 8
    _, lse = ws.partials(len(lens), 6, splits, ws.d_pad)
    for window in (0, 7 * bn):
        outs = []
        for n, fused in ((None, True), (None, False), (0, True)):   # None: the workspace's
            lse.fill_(float("nan"))                                  # min_split_tiles
            out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
            decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out, block_n=bn,
                   window=window, min_split_tiles=n, single_split_epilogue=fused)
            if n is None:   # which splits ran: LSE > −inf exactly for the used ones
                for i, n_tok in enumerate(lens):
                    first = max(n_tok - window, 0) // bn if window else 0
                    t = -(-n_tok // bn) - first
                    used = min(splits, max(1, -(-t // tiles)))
                    if used == 1 and fused:   # final in the split kernel: split 0 marked
                        assert (lse[i, :, 0] == float("inf")).all(), (i, n_tok, window)
                        assert torch.isnan(lse[i, :, 1:]).all()      # the others wrote nothing
                        continue
                    per = -(-t // used) if t else 0
                    want = [s * per < t for s in range(splits)]
                    got = (lse[i, 0] > float("-inf")).tolist()
                    assert got == want, (i, n_tok, window, got, want)
            outs.append(out)
        ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld, window=window)
        assert _rel(outs[0], ref) < _tol(torch.bfloat16)
        assert _rel(outs[0], outs[1]) < 1e-4   # same partition: fused or through the reduce
        # Another partition (8 splits): on a GPU P is rounded to bf16 for P·V after a
        # different running max, so the two differ by bf16 rounding (2⁻⁹ per weight; the
        # H200 measured 3.8e-4 / 4.7e-4 over the batch); the interpreter's float32 dots agree
        # to 1e-4. Per sequence, so a bug in one long sequence is not averaged away.
        for i, n_tok in enumerate(lens):
            if n_tok:
                assert _rel(outs[1][i], outs[2][i]) < (1e-4 if interpreting() else 5e-3), i
        assert torch.equal(outs[0][1], torch.zeros_like(outs[0][1]))   # the empty sequence
    for bad in (-1, 1.5, True, 4097):
        with pytest.raises(ShapeError, match="min_split_tiles"):
            decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, min_split_tiles=bad)
        with pytest.raises(ShapeError, match="min_split_tiles"):
            Workspace(4, 4, 64, DEV, min_split_tiles=bad)


def test_decode_zero_length_gives_zeros():
    codec = TurboKVCodec(64, 4, device=DEV)
    ld = TkvLoader(codec, 1, 16)
    batch, cache = _scenario(ld, [0, 7], 6)
    q = torch.randn(2, 2, 64).to(DEV, torch.bfloat16)
    out = torch.full(q.shape, float("nan"), device=DEV)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=out)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    assert _rel(out[1], ref[1]) < _tol(torch.bfloat16)


# --------------------------------------------------------------------- bypass / fp8
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bypass_decode_equals_plain_attention(dtype):
    ld = BypassLoader(2, 64, 16, dtype)
    lens = [29, 1, 16]
    g = _gen(8)
    batch = make_paged_batch(lens, 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV)
    q = torch.randn(3, 8, 64, generator=g).to(DEV, dtype)
    out = torch.full(q.shape, float("nan"), device=DEV)
    ks, vs = [], []
    for i, n in enumerate(lens):
        k = torch.randn(n, 2, 64, generator=g).to(DEV, dtype)
        v = torch.randn(n, 2, 64, generator=g).to(DEV, dtype)
        fill_cache(ld, cache, k, v, batch.slots(i))
        ks.append(k)
        vs.append(v)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=out)
    for i, n in enumerate(lens):  # plain attention on the raw tensors, no cache involved
        pos = torch.arange(n, device=DEV)
        ref = attention_reference(q[i:i + 1], ks[i], vs[i], pos[-1:], pos)[0]
        assert _rel(out[i], ref) < _tol(dtype)


def test_fp8_loader_decode_and_prefill():
    ld = Fp8Loader(2, 64, 16, torch.tensor([0.05], device=DEV), torch.tensor([0.03], device=DEV))
    _decode_check(ld, [30, 2, 17], group=4, seed=9)
    _prefill_check(ld, prefix=[20, 0], qlens=[7, 5], group=4, seed=10)


def test_fp8_tile_decodes_every_byte():
    """All 254 finite e4m3 encodings through the kernel's integer decoding: zero keys give
    uniform attention, so the output is the mean of the value rows, which hold every byte."""
    ld = Fp8Loader(1, 16, 16, torch.tensor([1.0], device=DEV), torch.tensor([0.5], device=DEV))
    allb = torch.arange(256, dtype=torch.uint8)
    allb = allb[(allb & 0x7F) != 0x7F]  # the two NaN encodings are never written by vLLM
    vals = torch.zeros(256, dtype=torch.uint8)
    vals[: allb.numel()] = allb
    expect = vals.view(torch.float8_e4m3fn).float().view(16, 16).mean(0) * 0.5
    vcache = vals.view(1, 16, 1, 16).to(DEV).view(torch.float8_e4m3fn)
    kcache = torch.zeros_like(vcache)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    q = torch.randn(1, 1, 16, device=DEV, dtype=torch.float16)
    out = torch.full((1, 1, 16), float("nan"), device=DEV)
    decode(q, (kcache, vcache), bt, torch.tensor([16], dtype=torch.int32, device=DEV), ld,
           _ws(), out=out)
    torch.testing.assert_close(out[0, 0].cpu(), expect, rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------- prefill
def _prefill_batch(loader, prefix, qlens, group, seed, dtype=torch.float16):
    """A prefill batch on fresh random data: each sequence's prefix + chunk K/V written into a
    paged cache (the whole sequence, as engines do), its chunk's K/V and queries returned.
    ``(q, k, v, cu_seqlens_q, batch, cache)``."""
    lens = [p + q for p, q in zip(prefix, qlens, strict=True)]
    g = _gen(seed)
    batch = make_paged_batch(lens, loader.block_size, DEV, generator=g)
    cache = make_cache(loader, batch.num_blocks, DEV, generator=g)
    hkv, d = loader.num_kv_heads, loader.head_dim
    qs, ks, vs = [], [], []
    for i, (p, ql) in enumerate(zip(prefix, qlens, strict=True)):
        kv = torch.randn(2, p + ql, hkv, d, generator=g).to(DEV, dtype)
        fill_cache(loader, cache, kv[0], kv[1], batch.slots(i))
        ks.append(kv[0, p:])
        vs.append(kv[1, p:])
        qs.append(torch.randn(ql, hkv * group, d, generator=g).to(DEV, dtype))
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=DEV)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cu, batch, cache


def _prefill_check(loader, prefix, qlens, group, seed, window=0, dtype=torch.float16, tol=None,
                   **kw):
    q, k, v, cu, batch, cache = _prefill_batch(loader, prefix, qlens, group, seed, dtype)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
    prefill(q, k, v, cu, batch.seq_lens, max(qlens), cache, batch.block_table, loader, out=out,
            window=window, block_m=16 * min(group, 2), block_n=loader.min_block_n, **kw)
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, loader,
                            window=window)
    assert _rel(out, ref) < (tol or _tol(dtype))


@pytest.mark.parametrize("head_dim,kb,vb,group,prefix,qlens,window", [
    (64, 4, 3, 4, [40, 0, 17], [19, 12, 33], 0),
    (128, 2, 4, 7, [33, 5], [20, 9], 11),
    (96, 4, 4, 1, [48, 16], [40, 1], 0),
])
def test_prefill_dense_prefix_matches_reference(head_dim, kb, vb, group, prefix, qlens, window):
    """The decompress-once path (prefix dequantized into scratch, then read as 16-bit rows):
    same attention as the float64 oracle, with K and V of different plane counts, GQA 1/4/7,
    a sliding window, and sequences without a prefix in the batch; the scratch was really
    written (it starts NaN-filled)."""
    codec = TurboKVCodec(head_dim, k_bits=kb, v_bits=vb, device=DEV, seed=head_dim + kb)
    ld = TkvLoader(codec, 2, 16)
    scratch = torch.full((1 << 20,), float("nan"), device=DEV)
    _prefill_check(ld, prefix, qlens, group, seed=kb + vb + group, window=window,
                   max_prefix_len=max(prefix) + 3, scratch=scratch)
    assert torch.isfinite(scratch[:64]).all()


@pytest.mark.parametrize("head_dim,kb,vb,group,prefix,qlen", [
    (64, 4, 3, 4, 40, 37),
    (96, 4, 4, 1, 48, 40),      # head_dim padded to 128 in the planar rows
    (128, 2, 4, 7, 33, 20),
])
def test_prefill_exact_prefix_runs_sdpa_and_matches_reference(head_dim, kb, vb, group, prefix,
                                                              qlen):
    """exact_prefix=True, one sequence: the decompress-once prefix plus the chunk's rotated
    rows go through SDPA (lower-right causal) — equal to the float64 oracle, SDPA really
    called once; a window, two sequences or a scratch too small for prefix + chunk keep the
    Triton loop (no SDPA call, same oracle)."""
    codec = TurboKVCodec(head_dim, k_bits=kb, v_bits=vb, device=DEV, seed=head_dim + vb)
    ld = TkvLoader(codec, 2, 16)
    from torch.nn.attention.bias import CausalBias

    # spy on the lower-right causal dispatch (patching F.sdpa itself would break it)
    with mock.patch.object(CausalBias, "_dispatch", wraps=CausalBias._dispatch) as spy:
        scratch = torch.full((1 << 20,), float("nan"), device=DEV)
        _prefill_check(ld, [prefix], [qlen], group, seed=kb + group, max_prefix_len=prefix,
                       scratch=scratch, exact_prefix=True)
        assert spy.call_count == 1
        _prefill_check(ld, [prefix], [qlen], group, seed=kb + group, window=9,
                       max_prefix_len=prefix, scratch=scratch, exact_prefix=True)
        _prefill_check(ld, [prefix, 5], [qlen, 3], group, seed=kb + group,
                       max_prefix_len=prefix, scratch=scratch, exact_prefix=True)
        nbytes = dense_prefix_bytes(1, prefix, 2, head_dim, torch.float16, block_size=16)
        prefix_only = torch.full((nbytes // 4,), float("nan"), device=DEV)   # the prefix's pages
        _prefill_check(ld, [prefix], [qlen], group, seed=kb + group, max_prefix_len=prefix,
                       scratch=prefix_only, exact_prefix=True)
        assert spy.call_count == 1
        assert not torch.isnan(prefix_only).all()   # the Triton decompress-once path ran


class _SpyDense(SdpaDenseAttention):
    """SdpaDenseAttention that records its calls' (q shape, k shape, max_seqlen_k, window)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
        self.calls.append((tuple(q.shape), tuple(k.shape), max_k, window))
        return super().__call__(q, k, v, cu_q, cu_k, max_q, max_k, scale, window)


@pytest.mark.parametrize("head_dim,group,qlens,window", [
    (64, 4, [19, 1, 33], 0), (96, 1, [12, 40], 7), (128, 7, [5, 17], 0)])
def test_prefill_bypass_through_dense_attention(head_dim, group, qlens, window):
    """no_prefix with a dense_attention callable: the caller's kernel runs the first chunks
    (one call over the whole varlen batch, window passed through) and the result equals the
    float64 oracle; the broken promise still gives NaN rows, only for its sequence."""
    codec = TurboKVCodec(head_dim, k_bits=4, v_bits=3, device=DEV, seed=5)
    ld = TkvLoader(codec, 2, 16)
    spy = _SpyDense()
    # the callable returns 16-bit rows (as FlashAttention does): one fp16 rounding more
    _prefill_check(ld, [0] * len(qlens), qlens, group, seed=head_dim + group, window=window,
                   no_prefix=True, dense_attention=spy, tol=max(_tol(torch.float16), 1e-3))
    assert spy.calls == [((sum(qlens), 2 * group, head_dim), (sum(qlens), 2, head_dim),
                          max(qlens), window)]
    g = _gen(7)
    batch = make_paged_batch([7 + 5, 9], 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    q = torch.randn(14, 2 * group, head_dim, generator=g).to(DEV, torch.float16)
    k = torch.randn(14, 2, head_dim, generator=g).to(DEV, torch.float16)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32, device=DEV)
    out = prefill(q, k, k, cu, batch.seq_lens, 9, cache, batch.block_table, ld, no_prefix=True,
                  dense_attention=spy)
    assert torch.isnan(out[:5]).all()        # sequence 0 has a 7-token prefix
    assert torch.isfinite(out[5:]).all()


class _SpyDenseOut(_SpyDense):
    """A DenseAttention that writes into ``out=`` (``writes_out``, as FlashAttention's varlen
    functions); ``detach`` makes it return a fresh tensor instead (a callable that ignores
    ``out``): prefill must still end up with the right rows."""

    writes_out = True

    def __init__(self, detach=False):
        super().__init__()
        self.outs, self.detach = [], detach

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window, out=None):
        o = super().__call__(q, k, v, cu_q, cu_k, max_q, max_k, scale, window)
        self.outs.append(out)
        if out is None or self.detach:
            return o
        return out.copy_(o)


@pytest.mark.parametrize("detach", [False, True])
def test_prefill_bypass_writes_into_out(detach):
    """A dense_attention with ``writes_out`` gets prefill's own output tensor as ``out=`` on
    first chunks (no copy of the chunk's rows) when it has the query's dtype (else none) —
    float64-oracle result either way, also when the callable returns another tensor; a broken promise still gives NaN rows for exactly its
    sequence (the device-side guard writes nothing else); ``writes_out`` must be a bool."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=21)
    ld = TkvLoader(codec, 2, 16)
    spy = _SpyDenseOut(detach)
    _prefill_check(ld, [0, 0, 0], [17, 1, 30], 3, seed=29, no_prefix=True, dense_attention=spy,
                   tol=max(_tol(torch.float16), 1e-3))
    assert spy.outs == [None]   # that check's out is float32: the callable cannot write it
    g = _gen(31)
    batch = make_paged_batch([5, 4 + 6, 9], 16, DEV, generator=g)   # sequence 1: a prefix
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    q = torch.randn(20, 6, 64, generator=g).to(DEV, torch.float16)
    k = torch.randn(20, 2, 64, generator=g).to(DEV, torch.float16)
    cu = torch.tensor([0, 5, 11, 20], dtype=torch.int32, device=DEV)
    out = torch.full((20, 6, 64), 7.0, dtype=torch.float16, device=DEV)
    got = prefill(q, k, k, cu, batch.seq_lens, 9, cache, batch.block_table, ld, no_prefix=True,
                  dense_attention=spy, out=out)
    assert got is out and spy.outs[-1] is out
    ref = SdpaDenseAttention()(q, k, k, cu, cu, 9, 9, 1 / 8, 0)
    assert torch.isnan(out[5:11]).all()
    assert torch.equal(out[:5], ref[:5]) and torch.equal(out[11:], ref[11:])
    # a callable returning another view of out's memory: the same elements with another
    # stride on a length-1 dim need no copy; a transposed view is copied safely (cloned
    # first, no self-overlap) — the callable writes with __setitem__, so every copy_ counted
    # here is prefill's
    q1, k1 = q[:6, :6], k[:6]
    cu1, sl1 = (torch.tensor(x, dtype=torch.int32, device=DEV) for x in ([0, 6], [6]))
    qs, ks = q1[:1], k1[:1]
    cus, sls = (torch.tensor(x, dtype=torch.int32, device=DEV) for x in ([0, 1], [1]))
    for view, single in ((lambda o: o.as_strided(o.shape, (7, 64, 1)), True),
                         (lambda o: o.transpose(0, 1), False)):
        class _View(_SpyDenseOut):
            def __call__(self, *a, out=None, view=view):
                out[:] = SdpaDenseAttention.__call__(self, *a)
                return view(out)

        qq, kk, cc, ss = (qs, ks, cus, sls) if single else (q1, k1, cu1, sl1)
        o1 = torch.empty(qq.shape, dtype=torch.float16, device=DEV)   # (1|6, 6, 64)
        want = SdpaDenseAttention()(qq, kk, kk, cc, cc, qq.shape[0], qq.shape[0], 1 / 8, 0)
        copies, real_copy = [], torch.Tensor.copy_

        def counted(self, *a, copies=copies, real_copy=real_copy, **kw):
            copies.append(1)
            return real_copy(self, *a, **kw)

        with mock.patch.object(torch.Tensor, "copy_", counted):
            got = prefill(qq, kk, kk, cc, ss, qq.shape[0], cache, batch.block_table[:1], ld,
                          no_prefix=True, dense_attention=_View(), out=o1)
        assert got is o1 and len(copies) == (0 if single else 1)
        assert torch.equal(o1, want if single else want.transpose(0, 1))
    # an expanded out (rows sharing memory) is refused by name on every path
    with pytest.raises(ShapeError, match="expanded"):
        prefill(q, k, k, cu, batch.seq_lens, 9, cache, batch.block_table, ld, no_prefix=True,
                dense_attention=spy, out=out[:1].expand(20, 6, 64))
    # out= on the query's own memory: FlashAttention would read rows it overwrites
    with pytest.raises(ShapeError, match="query"):
        prefill(q, k, k, cu, batch.seq_lens, 9, cache, batch.block_table, ld, no_prefix=True,
                dense_attention=spy, out=q)
    spy.writes_out = 1
    with pytest.raises(DtypeError, match="writes_out"):
        prefill(q, k, k, cu, batch.seq_lens, 9, cache, batch.block_table, ld, no_prefix=True,
                dense_attention=spy)


def test_nan_broken_rows_touches_only_broken_sequences():
    """The first-chunk guard on strided output rows: NaN exactly in the rows (every head) of
    sequences whose seq_len ≠ q_len or with more rows than max_query_len (a varlen kernel's
    grid would not cover them), and in rows of no sequence (before cu_seqlens_q[0], from
    cu_seqlens_q[-1]); every other element bit-for-bit unchanged, empty sequences and an
    empty batch fine."""
    from tkv.kernels.prefill import _nan_broken_rows

    g = _gen(37)
    for cu, sl, max_q, bad in (
            ([0, 3, 3, 10, 25], [3, 2, 9, 15], 15, [(3, 10)]),       # seqs 1 and 2 broken
            ([0, 3, 3, 10, 25], [3, 0, 7, 15], 14, [(10, 25)]),      # seq 3 longer than max_q
            ([2, 3, 3, 10, 20], [1, 0, 7, 10], 10, [(0, 2), (20, 25)]),   # rows of no seq
            ([-2, 3, 3, 10, 25], [5, 0, 7, 15], 15, [(0, 3)])):   # starts below row 0
        big = torch.randn(25, 5, 40, generator=g).to(DEV, torch.bfloat16)
        out = big[:, 1:4, :24]                        # strides (200, 40, 1): not contiguous
        before = big.clone()
        cu_t, sl_t = (torch.tensor(x, dtype=torch.int32, device=DEV) for x in (cu, sl))
        _nan_broken_rows(out, cu_t, sl_t, max_q)
        want = before.clone()
        for a, b in bad:
            want[a:b, 1:4, :24] = float("nan")
        assert torch.equal(big.isnan(), want.isnan()), (cu, sl, max_q)
        keep = ~want.isnan()
        assert torch.equal(big[keep], before[keep])
    _nan_broken_rows(out[:0], cu_t[:1], sl_t[:0], 0)


def test_prefill_exact_prefix_through_dense_attention():
    """exact_prefix with a dense_attention callable: it receives the rotated planar rows
    (prefix + chunk keys, head_dim padded 96 → 128) instead of SDPA, and the result equals the
    float64 oracle; two sequences and a window go to it too (the varlen path: one call,
    ``num_seqs × max_prefix_len + total_q`` rows by default, the window passed through)."""
    codec = TurboKVCodec(96, k_bits=4, v_bits=4, device=DEV, seed=9)
    ld = TkvLoader(codec, 2, 16)
    spy = _SpyDense()
    scratch = torch.full((1 << 20,), float("nan"), device=DEV)
    tol = max(_tol(torch.float16), 1e-3)
    _prefill_check(ld, [48], [40], 4, seed=13, max_prefix_len=48, scratch=scratch,
                   exact_prefix=True, dense_attention=spy, tol=tol)
    assert spy.calls == [((40, 8, 128), (88, 2, 128), 88, 0)]
    _prefill_check(ld, [48, 5], [40, 3], 4, seed=13, max_prefix_len=48, scratch=scratch,
                   exact_prefix=True, dense_attention=spy, tol=tol)
    _prefill_check(ld, [48], [40], 4, seed=13, window=9, max_prefix_len=48, scratch=scratch,
                   exact_prefix=True, dense_attention=spy, tol=tol)
    assert spy.calls[1:] == [((43, 8, 128), (139, 2, 128), 88, 0),
                             ((40, 8, 128), (88, 2, 128), 88, 9)]


@pytest.mark.parametrize("head_dim,kb,vb,group,prefix,qlens,window", [
    (64, 4, 3, 4, [40, 0, 17, 33], [19, 12, 33, 1], 0),
    (128, 2, 4, 7, [33, 5, 64], [20, 9, 40], 11),
    (96, 3, 5, 1, [48, 16], [40, 2], 0),
    (64, 8, 2, 8, [0, 70, 31], [35, 18, 26], 23),
])
def test_prefill_varlen_prefix_through_dense_attention(head_dim, kb, vb, group, prefix, qlens,
                                                       window):
    """Several sequences with (and without) a cached prefix through a dense_attention
    callable: each prefix dequantized once, packed with its chunk's rotated rows, ONE call
    with cu_seqlens_k = cumsum(prefix + q_len) — equal to the float64 oracle with GQA 1-8,
    K/V widths 2-8, head_dim 64/96/128, windows, length-1 chunks. ``prefix_tokens`` = the
    exact sum packs the rows tightly; a scratch one byte short of
    :func:`varlen_prefix_bytes` keeps the Triton loop (no call, same oracle; first case)."""
    codec = TurboKVCodec(head_dim, k_bits=kb, v_bits=vb, device=DEV, seed=head_dim + kb)
    ld = TkvLoader(codec, 2, 16)
    spy = _SpyDense()
    total, tq, mp = sum(prefix), sum(qlens), max(prefix)
    need = varlen_prefix_bytes(total, tq, 2, head_dim, torch.float16)
    dp = max(16, 1 << (head_dim - 1).bit_length())
    rows = need // (2 * 2 * dp * (4 if interpreting() else 2))
    assert rows == total + tq + 1
    tol = max(_tol(torch.float16), 1e-3)
    scratch = torch.full((need // 4 + 64,), float("nan"), device=DEV)
    _prefill_check(ld, prefix, qlens, group, seed=kb + vb + group, window=window,
                   max_prefix_len=mp + 3, scratch=scratch, dense_attention=spy,
                   prefix_tokens=total, tol=tol)
    assert spy.calls == [((tq, 2 * group, dp), (total + tq, 2, dp), mp + 3 + max(qlens),
                          window)]
    assert torch.isnan(scratch[need // 4:]).all()     # nothing written past the packed rows
    if head_dim == 64 and not window:   # (once: the Triton loop is slow under the interpreter)
        short = torch.full((need // 4 - 1,), float("nan"), device=DEV)
        _prefill_check(ld, prefix, qlens, group, seed=kb + vb + group, window=window,
                       max_prefix_len=mp + 3, scratch=short, dense_attention=spy,
                       prefix_tokens=total)
        assert len(spy.calls) == 1


def test_pm1_factor_is_exact_or_refused():
    """``_pm1_factor``: a Hadamard map with column scales (any row order) factors exactly;
    a rotation of another form, a near-±w matrix, a NaN entry or a zero column is refused."""
    from tkv.codec.rotation import hadamard_matrix
    from tkv.kernels.loaders import _pm1_factor

    g = _gen(3)
    h = hadamard_matrix(64, torch.float64)[torch.randperm(64, generator=g)]
    w = (torch.rand(64, generator=g, dtype=torch.float64) + 0.1) * 0.125
    m = (h * w[None, :]).float()
    s, ww = _pm1_factor(m)
    assert s.dtype == torch.bfloat16 and set(s.float().unique().tolist()) == {-1.0, 1.0}
    assert torch.equal((s.float() * ww[None, :]), m)
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    near = m.clone()
    near[5, 7] *= 1 + 4e-6
    nan = m.clone()
    nan[3, 3] = float("nan")
    zero = m.clone()
    zero[:, 9] = 0
    for bad in (q.float(), near, nan, zero):
        assert _pm1_factor(bad) == (None, None)


@pytest.mark.parametrize("head_dim,scales", [(128, False), (64, True)])
def test_prefill_varlen_model_space_pm1_back_map(head_dim, scales):
    """``prefill.MODEL_BACK_MAP = "pm1"`` (session 26, opt-in): the varlen path's dequant
    kernel takes prefix rows back to model space through the map's exact ±1 factor and
    float32 column scales (two passes) instead of its bf16 hi/lo halves (three): the same
    float64-oracle accuracy, with and without per-channel scales (non-uniform column scales),
    outputs equal to the default's to ~1e-5 (1e-3 on CUDA: bf16 scratch rows); the factor's
    scales are really read (doubled V scales move the output); an unknown value is a named
    error."""
    pm = importlib.import_module("tkv.kernels.prefill")
    g = _gen(head_dim)
    kw = ({"k_channel_scales": torch.rand(head_dim, generator=g) + 0.5,
           "v_channel_scales": torch.rand(head_dim, generator=g) + 0.5} if scales else {})
    ld = TkvLoader(TurboKVCodec(head_dim, 4, device=DEV, seed=5, **kw), 2, 16)
    assert ld.k_back_pm1 is not None and ld.v_back_pm1 is not None
    prefix, qlens, group = [40, 17], [19, 33], 4
    q, k, v, cu, batch, cache = _prefill_batch(ld, prefix, qlens, group, 17, torch.bfloat16)
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld)
    scratch = torch.full((1 << 20,), float("nan"), device=DEV)

    def run(back):
        out = torch.full(q.shape, float("nan"), device=DEV)
        with mock.patch.object(pm, "MODEL_BACK_MAP", back):
            prefill(q, k, v, cu, batch.seq_lens, max(qlens), cache, batch.block_table, ld,
                    out=out, max_prefix_len=max(prefix), scratch=scratch,
                    dense_attention=_SpyDense(), prefix_tokens=sum(prefix))
        return out

    split3, pm1 = run("split3"), run("pm1")
    tol = max(_tol(torch.bfloat16), 1e-3)
    assert _rel(split3, ref) < tol and _rel(pm1, ref) < tol
    # The interpreter's two maps agree to ~1e-5. On CUDA the scratch rows are rounded to bf16
    # by the tensor-core epilogue, and two float32 sums a few ulps apart round to neighbouring
    # bf16 values now and then (measured 2.5e-4 / 2.9e-4 on an H200, session 27)
    assert _rel(pm1, split3.double()) < (1e-5 if interpreting() else 1e-3)
    w = ld.v_back_w.clone()
    try:
        ld.v_back_w.mul_(2)
        assert _rel(run("pm1"), split3.double()) > 0.05   # the prefix values doubled
    finally:
        ld.v_back_w.copy_(w)
    with pytest.raises(ValueError, match="MODEL_BACK_MAP"):
        run("tf32")


def test_prefill_by_runs_matches_reference_and_warms_once():
    """An engine step's prefill rows — a continuation chunk, two first chunks, two prefix-cache
    hits — planned by plan_prefill_runs into three runs and run by prefill_by_runs (the loop
    both adapters share): equal to the float64 oracle over the whole batch; the scratch
    callable is asked once per run; the prefix variant is warmed once, after the run of first
    chunks, and only while the caller asks; a cu_seqlens list of the wrong length is named."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=3, device=DEV, seed=9)
    ld = TkvLoader(codec, 2, 16)
    prefix, qlens = [40, 0, 0, 17, 5], [3, 19, 12, 33, 9]
    q, k, v, cu, batch, cache = _prefill_batch(ld, prefix, qlens, 4, seed=31)
    runs = plan_prefill_runs(qlens, prefix)
    assert [(r.row_lo, r.row_hi, r.no_prefix, r.prefix_exact) for r in runs] == [
        (0, 1, False, True), (1, 3, True, False), (3, 5, False, False)]
    cus = [cu[r.row_lo:r.row_hi + 1] - r.tok_lo for r in runs]
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld)
    scratch = torch.full((1 << 20,), float("nan"), device=DEV)
    asked, spy = [], _SpyDense()

    def scratch_for(run):
        asked.append(run)
        return scratch

    for warm in (True, False):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
        with mock.patch("tkv.kernels.prefill_batch.warm_prefix_variant") as warm_spy:
            warmed = prefill_by_runs(q, k, v, runs, cus, batch.seq_lens, batch.block_table,
                                     cache, ld, out=out, sm_scale=64 ** -0.5, scratch=scratch_for,
                                     dense_attention=spy, warm=warm,
                                     warm_scratch=lambda n: scratch)
        assert warmed is warm and warm_spy.call_count == int(warm)
        if warm:
            assert warm_spy.call_args.args[0].shape == (31, 8, 64)  # the first chunks' rows
        assert _rel(out, ref) < max(_tol(torch.float16), 1e-3)
    assert asked == [*runs, *runs]
    assert [c[0] for c in spy.calls] == [(31, 8, 64), (42, 8, 64)] * 2   # bypass, varlen
    with pytest.raises(ValueError, match="one per run"):
        prefill_by_runs(q, k, v, runs, cus[:2], batch.seq_lens, batch.block_table, cache, ld,
                        out=torch.empty_like(q), sm_scale=0.125)


def test_prefill_varlen_prefix_broken_bounds_are_nan():
    """The varlen path's guards, decided on the device: a sequence whose prefix exceeds
    ``max_prefix_len`` or whose chunk exceeds ``max_query_len``, the sequences whose packed rows end past a too-small
    ``prefix_tokens`` (+ total_q), a sequence with an
    invalid prefix page and rows outside every sequence (cu_seqlens_q short of total_q) get
    NaN rows; every other sequence keeps its float64-oracle rows; no write leaves the
    scratch's packed rows."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=3)
    ld = TkvLoader(codec, 2, 16)
    prefix, qlens = [20, 40, 8, 30], [18, 17, 20, 19]
    q, k, v, cu, batch, cache = _prefill_batch(ld, prefix, qlens, 4, seed=41)
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld)
    rows = [(int(a), int(b)) for a, b in itertools.pairwise(cu.tolist())]
    tq = q.shape[0]

    def run(max_prefix, prefix_tokens, block_table=batch.block_table, cu_q=cu, max_q=20):
        spy = _SpyDense()
        need = varlen_prefix_bytes(prefix_tokens, tq, 2, 64, torch.float16)
        scratch = torch.full((need // 4 + 256,), float("nan"), device=DEV)
        out = prefill(q, k, v, cu_q, batch.seq_lens, max_q, cache, block_table, ld,
                      max_prefix_len=max_prefix, scratch=scratch, dense_attention=spy,
                      prefix_tokens=prefix_tokens, block_m=32)
        assert len(spy.calls) == 1 and torch.isnan(scratch[need // 4:]).all()
        return out

    def check(out, broken, seqs=None):
        for i, (a, b) in enumerate(rows[:seqs]):
            if i in broken:
                assert torch.isnan(out[a:b]).all(), i
            else:
                assert _rel(out[a:b], ref[a:b]) < max(_tol(torch.float16), 1e-3), i

    check(run(30, 200), {1})                       # sequence 1's 40-token prefix > 30
    # chunks longer than max_query_len (18, 20 and 19 rows over 17): a FlashAttention grid
    # sized from it would leave their last rows unwritten
    check(run(40, 98, max_q=17), {0, 2, 3})
    # rows for 40 prefix tokens + the 74 chunk tokens: sequence 1 ends at row 95, 2 at 123
    check(run(40, 40), {2, 3})
    bt = batch.block_table.clone()
    bt[2, 0] = -1                                  # sequence 2's only prefix page invalid
    check(run(40, 98, block_table=bt), {2})
    short = cu.clone()
    short[-1] -= 5                                 # the last 5 rows belong to no sequence
    out = run(40, 98, cu_q=short)
    check(out, set(), seqs=len(rows) - 1)
    # the last sequence now has 14 new tokens after a 35-token prefix (its seq_len kept)
    ref2 = prefill_reference(q[:tq - 5], k[:tq - 5], v[:tq - 5], short, batch.seq_lens, cache,
                             batch.block_table, ld)
    assert _rel(out[:tq - 5], ref2) < max(_tol(torch.float16), 1e-3)
    assert torch.isnan(out[tq - 5:]).all()
    with pytest.raises(ShapeError, match="prefix_tokens"):
        prefill(q, k, v, cu, batch.seq_lens, max(qlens), cache, batch.block_table, ld,
                prefix_tokens=-1)
    for bad in ((-1, 2, 64), (10, 0, 64), (10, 2, 0), (10.0, 2, 64), (True, 2, 64)):
        with pytest.raises(ValueError, match="varlen_prefix_rows"):
            varlen_prefix_rows(*bad)


def test_prefill_varlen_prefix_skips_sequences_without_new_tokens():
    """A sequence with a cached prefix but no new tokens (engine padding) in the middle of a
    varlen call packs no rows (``prefix_tokens`` counts only rows with new tokens, as
    plan_prefill_runs does): its neighbours keep their float64-oracle rows."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=3, device=DEV, seed=6)
    ld = TkvLoader(codec, 2, 16)
    prefix, qlens = [20, 33, 17], [40, 0, 25]
    spy = _SpyDense()
    scratch = torch.full((1 << 18,), float("nan"), device=DEV)
    _prefill_check(ld, prefix, qlens, 2, seed=61, max_prefix_len=33, scratch=scratch,
                   dense_attention=spy, prefix_tokens=37, tol=max(_tol(torch.float16), 1e-3))
    assert spy.calls == [((65, 4, 64), (37 + 65, 2, 64), 73, 0)]


class _SpyContinuationOnly(_SpyDense):
    """A DenseAttention for continuation chunks only (TKV_PREFILL_ATTENTION=continuation)."""

    first_chunks = False


def test_prefill_continuation_only_dense_attention():
    """first_chunks = False on the callable: first chunks run tkv's Triton bypass (no call,
    float64-oracle result, NaN rows for a broken promise), the exact-prefix continuation goes
    to the callable; FlashVarlenAttention carries the flag (a bool, shown in its repr)."""
    from tkv.kernels import FlashVarlenAttention

    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=11)
    ld = TkvLoader(codec, 2, 16)
    spy = _SpyContinuationOnly()
    _prefill_check(ld, [0, 0], [21, 6], 3, seed=17, no_prefix=True, dense_attention=spy)
    assert spy.calls == []
    scratch = torch.full((1 << 20,), float("nan"), device=DEV)
    _prefill_check(ld, [40], [24], 3, seed=19, max_prefix_len=40, scratch=scratch,
                   exact_prefix=True, dense_attention=spy, tol=max(_tol(torch.float16), 1e-3))
    assert spy.calls == [((24, 6, 64), (64, 2, 64), 64, 0)]
    # a broken no_prefix promise (sequence 0 has a 7-token prefix): NaN rows from the bypass
    g = _gen(23)
    batch = make_paged_batch([7 + 5, 9], 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    q = torch.randn(14, 6, 64, generator=g).to(DEV, torch.float16)
    k = torch.randn(14, 2, 64, generator=g).to(DEV, torch.float16)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32, device=DEV)
    out = prefill(q, k, k, cu, batch.seq_lens, 9, cache, batch.block_table, ld, no_prefix=True,
                  dense_attention=spy)
    assert torch.isnan(out[:5]).all() and torch.isfinite(out[5:]).all()
    assert len(spy.calls) == 1
    spy.first_chunks = 0    # not a bool: a named error, not a guess
    with pytest.raises(DtypeError, match="first_chunks"):
        prefill(q, k, k, cu, batch.seq_lens, 9, cache, batch.block_table, ld, no_prefix=True,
                dense_attention=spy)
    fa = FlashVarlenAttention(lambda *a, **kw: None, first_chunks=False, ver=3)
    assert fa.first_chunks is False and "first_chunks=False, ver=3" in repr(fa)
    assert FlashVarlenAttention(lambda *a, **kw: None, ver=3).first_chunks is True
    with pytest.raises(ValueError, match="first_chunks must be a bool"):
        FlashVarlenAttention(lambda *a, **kw: None, first_chunks="no")
    # writes_out: read from the varlen function's signature (an ``out`` parameter, as vLLM
    # 0.20.1's and sgl-kernel 0.4.2's have; flash-attn 2.x's has none), or given; an out=
    # tensor then goes through, none when not given
    seen = []

    def with_out(q, k, v, out=None, **kw):
        seen.append({**kw, "out": out} if out is not None else kw)

    def without_out(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, **kw):
        return q

    assert FlashVarlenAttention(without_out).writes_out is False
    assert FlashVarlenAttention(lambda *a, **kw: None).writes_out is False
    assert FlashVarlenAttention(without_out, writes_out=True).writes_out is True
    with pytest.raises(ValueError, match="writes_out must be a bool"):
        FlashVarlenAttention(without_out, writes_out=1)
    fa = FlashVarlenAttention(with_out, ver=3)
    assert fa.writes_out is True
    fa(q, k, k, cu, cu, 9, 9, 0.125, 0, out=q)
    fa(q, k, k, cu, cu, 9, 9, 0.125, 4)
    assert seen[0]["out"] is q and seen[0]["ver"] == 3 and "out" not in seen[1]
    assert seen[1]["window_size"] == (3, 0) and seen[0]["window_size"] == (-1, -1)
    assert fa.extra == {"ver": 3}


def test_prefill_attention_env_choice():
    """TKV_PREFILL_ATTENTION, shared by the engine adapters: auto / flash / tkv / continuation,
    the adapter's
    default when unset or blank, a named error otherwise (also for a bad default)."""
    from tkv.kernels import PrefillAttentionConfigError, prefill_attention_from_env

    assert prefill_attention_from_env({}) == "tkv"
    assert prefill_attention_from_env({}, default="auto") == "auto"
    assert prefill_attention_from_env({"TKV_PREFILL_ATTENTION": "  "}, default="auto") == "auto"
    assert prefill_attention_from_env({"TKV_PREFILL_ATTENTION": " Flash "}) == "flash"
    assert prefill_attention_from_env({"TKV_PREFILL_ATTENTION": "TKV"}, default="auto") == "tkv"
    assert prefill_attention_from_env({"TKV_PREFILL_ATTENTION": "continuation"}) == "continuation"
    assert prefill_attention_from_env({"TKV_PREFILL_ATTENTION": None}, default=" AUTO ") == "auto"
    with pytest.raises(PrefillAttentionConfigError, match="TKV_PREFILL_ATTENTION='fa3'"):
        prefill_attention_from_env({"TKV_PREFILL_ATTENTION": "fa3"})
    with pytest.raises(PrefillAttentionConfigError, match="default 'fa2'"):
        prefill_attention_from_env({}, default="fa2")   # an adapter bug, not the operator's


def test_flash_device_auto_falls_back_and_flash_insists(caplog):
    """flash_device: ``tkv`` never imports; ``auto`` gives None with an INFO line naming why
    (no CUDA device, ImportError, the engine's own ``unsupported`` reason); ``flash`` raises
    PrefillAttentionConfigError with the same reason (the ImportError kept as the cause); a
    supported CUDA device returns FlashDevice(device, what import_flash returned,
    first_chunks: False only for ``continuation``, which insists like ``flash``)."""
    import logging

    from tkv.kernels import PrefillAttentionConfigError, flash_device

    imports = []

    def ok():
        imports.append(1)
        return "kernels"

    def missing():
        raise ImportError("no module named fake_flash")

    env = {"TKV_PREFILL_ATTENTION": "tkv"}
    assert flash_device("cuda:0", env, ok) is None and not imports
    # a device torch refuses: a named error whatever the choice (not torch's RuntimeError)
    from tkv.codec.errors import DeviceMismatchError
    for bad in ("cuda:x", "gpu", 3.5, None):
        for choice in ("tkv", "auto", "flash"):
            with pytest.raises(DeviceMismatchError, match="not a device"):
                flash_device(bad, {"TKV_PREFILL_ATTENTION": choice}, ok)
    assert not imports
    cases = (("cpu", ok, None, "CUDA device"),
             ("cuda:0", missing, None, "fake_flash"),
             ("cuda:0", ok, lambda dev, imp: f"{imp} lack head_size 96 on {dev}",
              "lack head_size 96 on cuda:0"))
    for device, imp, unsupported, reason in cases:
        with caplog.at_level(logging.INFO, logger="tkv.kernels.dense_attention"):
            caplog.clear()
            assert flash_device(device, {}, imp, unsupported, default="auto") is None
        assert "auto" in caplog.text and reason in caplog.text
        with pytest.raises(PrefillAttentionConfigError, match=reason) as e:
            flash_device(device, {"TKV_PREFILL_ATTENTION": "flash"}, imp, unsupported)
        assert isinstance(e.value.__cause__, ImportError) == (imp is missing)
    # whatever the engine's import or check raises: auto falls back, flash names it
    def broken():
        raise OSError("libcudart.so.12: cannot open shared object file")

    def crashing(dev, imp):
        raise RuntimeError("CUDA error: no kernel image")

    for imp, unsupported, reason, cause in ((broken, None, "libcudart", OSError),
                                            (ok, crashing, "no kernel image", RuntimeError),
                                            (ok, lambda dev, imp: "", "unsupported", None)):
        assert flash_device("cuda:0", {}, imp, unsupported, default="auto") is None
        with pytest.raises(PrefillAttentionConfigError, match=reason) as e:
            flash_device("cuda:0", {"TKV_PREFILL_ATTENTION": "flash"}, imp, unsupported)
        assert (type(e.value.__cause__) if cause else e.value.__cause__) is cause
    seen = []
    got = flash_device("cuda:1", {}, ok, lambda dev, imp: seen.append((dev, imp)),
                       default="auto")
    assert got == (torch.device("cuda:1"), "kernels", True)
    assert (got.device, got.imported, got.first_chunks) == tuple(got)
    assert seen == [(torch.device("cuda:1"), "kernels")]
    # continuation: flash for continuation chunks only, and it insists like flash
    cont = {"TKV_PREFILL_ATTENTION": "continuation"}
    assert flash_device("cuda:1", cont, ok).first_chunks is False
    with pytest.raises(PrefillAttentionConfigError, match=r"=continuation: .*CUDA device"):
        flash_device("cpu", cont, ok)


@pytest.mark.parametrize("bad", ["shape", "dtype", "not_tensor", "not_callable"])
def test_prefill_dense_attention_bad_callback_is_named(bad):
    codec = TurboKVCodec(64, 4, device=DEV)
    ld = TkvLoader(codec, 2, 16)
    g = _gen(2)
    batch = make_paged_batch([6], 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    q = torch.randn(6, 8, 64, generator=g).to(DEV, torch.float16)
    k = torch.randn(6, 2, 64, generator=g).to(DEV, torch.float16)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=DEV)
    fn = {"shape": lambda q, *a: q[:3], "dtype": lambda q, *a: q.float(),
          "not_tensor": lambda q, *a: None, "not_callable": 3}[bad]
    with pytest.raises((ShapeError, DtypeError), match="dense_attention"):
        prefill(q, k, k, cu, batch.seq_lens, 6, cache, batch.block_table, ld, no_prefix=True,
                dense_attention=fn)


def test_prefill_exact_prefix_broken_promise_is_nan():
    """exact_prefix=True with a max_prefix_len that is not the sequence's prefix (longer or
    shorter) or an invalid prefix page, on the decompress-once path (chunk longer than one
    query tile): every output row is NaN, never a plausible wrong answer; a table narrower
    than the prefix too, through the Triton loop it falls back to; exact_prefix must be a
    bool."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=12)
    ld = TkvLoader(codec, 2, 16)
    g = _gen(44)
    batch = make_paged_batch([40 + 24], 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    kv = torch.randn(2, 64, 2, 64, generator=g).to(DEV, torch.float16)
    fill_cache(ld, cache, kv[0], kv[1], batch.slots(0))
    q = torch.randn(24, 8, 64, generator=g).to(DEV, torch.float16)
    cu = torch.tensor([0, 24], dtype=torch.int32, device=DEV)
    scratch = torch.empty(1 << 18, device=DEV)
    for promised in (36, 44):
        out = prefill(q, kv[0, 40:], kv[1, 40:], cu, batch.seq_lens, 24, cache,
                      batch.block_table, ld, block_m=32, max_prefix_len=promised,
                      scratch=scratch, exact_prefix=True)
        assert torch.isnan(out).all(), promised
    ok = prefill(q, kv[0, 40:], kv[1, 40:], cu, batch.seq_lens, 24, cache, batch.block_table,
                 ld, block_m=32, max_prefix_len=40, scratch=scratch, exact_prefix=True)
    assert torch.isfinite(ok).all()
    # invalid prefix pages (the other paths mask them): a hole or an out-of-range page is a
    # broken promise (NaN, whatever stale data the scratch holds); a table narrower than the
    # prefix is broken metadata on every path (NaN rows, as inline, since session 27)
    for page in (-1, batch.num_blocks + 3):
        bt = batch.block_table.clone()
        bt[0, 1] = page
        scratch.fill_(100.0)
        out = prefill(q, kv[0, 40:], kv[1, 40:], cu, batch.seq_lens, 24, cache, bt, ld,
                      block_m=32, max_prefix_len=40, scratch=scratch, exact_prefix=True)
        assert torch.isnan(out).all(), page
    narrow = batch.block_table[:, :2]
    inline = prefill(q, kv[0, 40:], kv[1, 40:], cu, batch.seq_lens, 24, cache, narrow, ld,
                     block_m=32)
    out = prefill(q, kv[0, 40:], kv[1, 40:], cu, batch.seq_lens, 24, cache, narrow, ld,
                  block_m=32, max_prefix_len=40, scratch=scratch, exact_prefix=True)
    assert torch.isnan(inline).all() and torch.isnan(out).all()
    with pytest.raises(DtypeError, match="exact_prefix"):
        prefill(q, kv[0, 40:], kv[1, 40:], cu, batch.seq_lens, 24, cache, batch.block_table,
                ld, max_prefix_len=40, scratch=scratch, exact_prefix=1)


def test_prefill_dense_prefix_limits():
    """A scratch too small for the batch → the inline path (same result, scratch untouched);
    a prefix longer than ``max_prefix_len`` → NaN rows for that sequence only (a broken
    promise is loud); a malformed ``max_prefix_len`` is a named error."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=8)
    ld = TkvLoader(codec, 2, 16)
    small = torch.full((64,), float("nan"), device=DEV)
    _prefill_check(ld, [30, 20], [17, 25], 4, seed=40, max_prefix_len=30, scratch=small)
    assert torch.isnan(small).all()
    g = _gen(41)
    batch = make_paged_batch([40 + 20, 8 + 20], 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    for i, n in enumerate((60, 28)):   # real compressed K/V in every slot the batch reads
        kv = torch.randn(2, n, 2, 64, generator=g).to(DEV, torch.float16)
        fill_cache(ld, cache, kv[0], kv[1], batch.slots(i))
    q = torch.randn(40, 8, 64, generator=g).to(DEV, torch.float16)
    k = torch.randn(40, 2, 64, generator=g).to(DEV, torch.float16)
    cu = torch.tensor([0, 20, 40], dtype=torch.int32, device=DEV)
    scratch = torch.empty(1 << 18, device=DEV)
    out = prefill(q, k, k, cu, batch.seq_lens, 20, cache, batch.block_table, ld,
                  block_m=32, max_prefix_len=8, scratch=scratch)
    assert torch.isnan(out[:20]).all()       # sequence 0 has a 40-token prefix > 16 (2 pages)
    assert torch.isfinite(out[20:]).all()
    with pytest.raises(ShapeError, match="max_prefix_len"):
        prefill(q, k, k, cu, batch.seq_lens, 20, cache, batch.block_table, ld,
                max_prefix_len=-1, scratch=scratch)
    with pytest.raises(DtypeError, match="scratch"):
        prefill(q, k, k, cu, batch.seq_lens, 20, cache, batch.block_table, ld,
                max_prefix_len=8, scratch=[0.0] * 1024)
    # an unaligned (but contiguous) scratch → inline path, correct, scratch untouched
    raw = torch.full((1 << 18,), float("nan"), device=DEV)
    inline = prefill(q, k, k, cu, batch.seq_lens, 20, cache, batch.block_table, ld, block_m=32)
    odd = prefill(q, k, k, cu, batch.seq_lens, 20, cache, batch.block_table, ld, block_m=32,
                  max_prefix_len=40, scratch=raw.view(torch.uint8)[1:])
    assert torch.isnan(raw).all() and torch.allclose(odd.float(), inline.float())


def test_prefill_dense_prefix_masks_invalid_pages_like_inline():
    """Block-table entries that are −1 / out of range: the decompress-once path masks those
    tokens exactly as the inline path does, whatever the scratch held before (NaN here). A
    table narrower than a sequence's prefix is broken metadata: NaN rows for it on both paths
    (session 27; both masked the missing pages before)."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=9)
    ld = TkvLoader(codec, 2, 16)
    g = _gen(43)
    batch = make_paged_batch([40 + 20, 33 + 20], 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    for i, n in enumerate((60, 53)):
        kv = torch.randn(2, n, 2, 64, generator=g).to(DEV, torch.float16)
        fill_cache(ld, cache, kv[0], kv[1], batch.slots(i))
    q = torch.randn(40, 8, 64, generator=g).to(DEV, torch.float16)
    k = torch.randn(40, 2, 64, generator=g).to(DEV, torch.float16)
    cu = torch.tensor([0, 20, 40], dtype=torch.int32, device=DEV)
    bt = batch.block_table.clone()
    bt[0, 1] = -1                       # a hole in sequence 0's prefix
    bt[1, 0] = batch.num_blocks + 5     # an out-of-range page in sequence 1's
    for table in (bt, bt[:, :2]):       # and a table narrower than both prefixes (32 tokens)
        inline = prefill(q, k, k, cu, batch.seq_lens, 20, cache, table, ld, block_m=32)
        scr = torch.full((1 << 18,), float("nan"), device=DEV)
        dense = prefill(q, k, k, cu, batch.seq_lens, 20, cache, table, ld, block_m=32,
                        max_prefix_len=40, scratch=scr)
        assert not torch.isnan(scr).all()        # the dense path ran
        if table.shape[1] == 2:
            assert torch.isnan(inline).all() and torch.isnan(dense).all()
            continue
        assert torch.isfinite(dense.float()).all()
        assert torch.allclose(dense.float(), inline.float(), atol=2e-3, rtol=2e-3)


def test_prefill_no_prefix_bypass_and_broken_promise():
    """no_prefix=True: first chunks run as plain attention (no rotation, cache untouched) and
    equal the oracle; a sequence that has a prefix after all gets NaN rows, never garbage."""
    codec = TurboKVCodec(64, k_bits=4, v_bits=3, device=DEV, seed=5)
    ld = TkvLoader(codec, 2, 16)
    _prefill_check(ld, [0, 0, 0], [19, 1, 33], 4, seed=31, no_prefix=True)
    g = _gen(32)
    batch = make_paged_batch([7 + 5, 9], 16, DEV, generator=g)
    cache = make_cache(ld, batch.num_blocks, DEV, generator=g)
    q = torch.randn(14, 8, 64, generator=g).to(DEV, torch.float16)
    k = torch.randn(14, 2, 64, generator=g).to(DEV, torch.float16)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32, device=DEV)
    out = prefill(q, k, k, cu, batch.seq_lens, 9, cache, batch.block_table, ld, no_prefix=True)
    assert torch.isnan(out[:5]).all()        # sequence 0 has a 7-token prefix
    assert torch.isfinite(out[5:]).all()


@pytest.mark.parametrize("head_dim,group,prefix,qlens,window", [
    (64, 4, [0, 0], [19, 1], 0),               # first chunk: pure bf16 path (prefill bypass)
    (64, 1, [35, 16, 0], [9, 1, 12], 0),
    (96, 7, [20, 3], [5, 17], 0),
    (128, 8, [40, 10], [8, 3], 11),
])
def test_prefill_tkv(head_dim, group, prefix, qlens, window):
    codec = TurboKVCodec(head_dim, k_bits=3, v_bits=4, device=DEV, seed=3)
    ld = TkvLoader(codec, 2, 16)
    _prefill_check(ld, prefix, qlens, group, seed=head_dim + group, window=window)


@pytest.mark.parametrize("lookup,kb,vb", [
    ("shuffle", 4, 4), pytest.param("prmt", 4, 4, marks=_GPU_ONLY),
    pytest.param("prmt1", 4, 4, marks=_GPU_ONLY), pytest.param("prmti", 4, 4, marks=_GPU_ONLY),
    pytest.param("prmts", 4, 4, marks=_GPU_ONLY), pytest.param("auto", 3, 2, marks=_GPU_ONLY)])
def test_prefill_tkv_lookups(lookup, kb, vb):
    """The register lookups in the prefill kernel's compressed-prefix loop (K4V4; K3V2: the
    2/3-bit group prmt)."""
    codec = TurboKVCodec(128, k_bits=kb, v_bits=vb, device=DEV, seed=6)
    ld = TkvLoader(codec, 2, 16, lookup=lookup)
    _prefill_check(ld, [37, 5], [6, 11], 4, seed=41)


def test_warm_prefix_variant_reads_token_0_and_writes_nothing():
    """The engines' compile warm-up: a 1-token chunk over the first sequence's token 0, output
    equal to the oracle, cache bytes untouched; skipped for empty batches."""
    from tkv.kernels import warm_prefix_variant

    codec = TurboKVCodec(64, k_bits=4, v_bits=3, device=DEV, seed=8)
    ld = TkvLoader(codec, 2, 16)
    batch, cache = _scenario(ld, [9, 4], 51)
    before = cache.clone()
    g = _gen(52)
    q = torch.randn(13, 8, 64, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(13, 2, 64, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(13, 2, 64, generator=g).to(DEV, torch.bfloat16)
    out = warm_prefix_variant(q, k, v, cache, batch.block_table, ld, window=0)
    assert torch.equal(cache, before)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    sl = torch.tensor([2], dtype=torch.int32, device=DEV)
    ref = prefill_reference(q[:1], k[:1], v[:1], cu, sl, cache, batch.block_table[:1], ld)
    assert _rel(out, ref) < max(_tol(torch.bfloat16), 8e-3)   # bf16 output rounding (2^-9)
    assert warm_prefix_variant(q[:0], k[:0], v[:0], cache, batch.block_table, ld) is None
    # with the engine's scratch and a batch of ≥ 129 tokens: the decompress-once variant too
    # (it writes the 1-token prefix into the scratch; the cache stays untouched)
    q2 = torch.randn(130, 8, 64, generator=g).to(DEV, torch.bfloat16)
    k2 = torch.randn(130, 2, 64, generator=g).to(DEV, torch.bfloat16)
    scratch = torch.full((1 << 16,), float("nan"), device=DEV)
    out2 = warm_prefix_variant(q2, k2, k2, cache, batch.block_table, ld, scratch=scratch)
    assert torch.isfinite(scratch[:64]).all() and torch.equal(cache, before)
    assert torch.isfinite(out2.float()).all()
    small = torch.full((1 << 16,), float("nan"), device=DEV)
    warm_prefix_variant(q2[:100], k2[:100], k2[:100], cache, batch.block_table, ld, scratch=small)
    assert torch.isnan(small).all()          # too few tokens for the dense path: not run
    # with the engine's dense_attention: the varlen path too (one call of 129 query rows over
    # the 1-token prefix + 129 chunk rows), after the Triton dense variant
    spy = _SpyDense()
    warm_prefix_variant(q2, k2, k2, cache, batch.block_table, ld, scratch=scratch,
                        dense_attention=spy)
    assert spy.calls == [((129, 8, 64), (130, 2, 64), 130, 0)] and torch.equal(cache, before)


def test_prefill_tkv_fused_rotation_and_head_dim_256():
    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=4)
    codec = TurboKVCodec(256, k_bits=4, v_bits=3, device=DEV, seed=5)
    _prefill_check(TkvLoader(codec, 1, 16), [17], [6], 2, seed=22)


def test_prefill_bypass_equals_plain_attention():
    ld = BypassLoader(2, 64, 16, torch.float16)
    _prefill_check(ld, prefix=[21, 0, 5], qlens=[6, 9, 1], group=4, seed=12, window=0)


# --------------------------------------------------------------------- errors
def test_named_errors_on_bad_input():
    codec = TurboKVCodec(64, 4, device=DEV)
    ld = TkvLoader(codec, 2, 16)
    ws = _ws()
    cache = ld.layout.allocate(4, DEV)
    bt = torch.zeros(2, 3, dtype=torch.int32, device=DEV)
    sl = torch.ones(2, dtype=torch.int32, device=DEV)
    q = torch.randn(2, 8, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(DtypeError):
        decode(q.int(), cache, bt, sl, ld, ws)
    with pytest.raises(ShapeError):
        decode(q[:, :7], cache, bt, sl, ld, ws)
    with pytest.raises(DtypeError):
        decode(q, cache, bt.long(), sl, ld, ws)
    with pytest.raises(DtypeError):
        decode(q, cache, bt, sl.long(), ld, ws)
    with pytest.raises(ShapeError):
        decode(q, cache[:, :-16], bt, sl, ld, ws)
    with pytest.raises(DtypeError):
        decode(q, cache.float(), bt, sl, ld, ws)
    with pytest.raises(ShapeError):
        decode(q, cache, bt[:1], sl, ld, ws)
    with pytest.raises(ShapeError):
        decode(q, cache, bt, sl, ld, ws, window=-1)
    with pytest.raises(ShapeError):
        decode(q, cache, bt, sl, ld, ws, num_splits=3)
    with pytest.raises(ShapeError, match="expanded"):   # rows sharing one memory row
        decode(q, cache, bt, sl, ld, ws, out=torch.empty(1, 8, 64, dtype=q.dtype,
                                                          device=DEV).expand(2, 8, 64))
    for bad in (0, 2.0, True, "2"):   # a launch option Triton would misread or crash on
        with pytest.raises(ShapeError, match="num_stages"):
            decode(q, cache, bt, sl, ld, ws, num_stages=bad)
        with pytest.raises(ShapeError, match="num_stages"):   # also for an empty batch
            decode(q[:0], cache, bt[:0], sl[:0], ld, ws, num_stages=bad)
    with pytest.raises(WorkspaceTooSmallError):
        decode(q, cache, bt, sl, ld, Workspace(1, 8, 64, DEV))
    for bad in (48, 24, 32.0, True, -16):   # before the kernel, not inside tl.arange
        with pytest.raises(ValueError, match="power of two"):
            decode(q, cache, bt, sl, ld, ws, block_n=bad)
    with pytest.raises(ValueError, match=">= 16"):
        decode(q, cache, bt, sl, ld, ws, block_n=8)
    k = torch.randn(3, 2, 64, device=DEV)
    with pytest.raises(DtypeError):
        compress_store(k, k, cache, torch.zeros(3, dtype=torch.int32, device=DEV), ld)
    with pytest.raises(ShapeError):
        compress_store(k, k[:2], cache, torch.zeros(3, dtype=torch.int64, device=DEV), ld)
    with pytest.raises(ShapeError):
        compress_store(k[..., :32], k, cache, torch.zeros(3, dtype=torch.int64, device=DEV), ld)
    with pytest.raises(DtypeError):
        compress_store(k.int(), k, cache, torch.zeros(3, dtype=torch.int64, device=DEV), ld)
    strided = torch.arange(6, dtype=torch.int64, device=DEV)[::2]   # read as contiguous: wrong
    with pytest.raises(ShapeError, match="unit stride"):
        compress_store(k, k, cache, strided, ld)
    with pytest.raises(ShapeError, match="unit stride"):
        decode(q, cache, bt, torch.stack([sl, sl], 1)[:, 0], ld, ws)
    for bad in (dict(block_t=True), dict(block_t=8.0), dict(num_warps=3), dict(chunk=48)):
        with pytest.raises(ShapeError, match="power of two"):
            compress_store(k, k, cache, torch.arange(3, device=DEV), ld, **bad)
    with pytest.raises(BitWidthError):
        TkvLoader(TurboKVCodec(64, 9), 2, 16)
    with pytest.raises(DtypeError):
        Fp8Loader(1, 64, 16, torch.ones(1, dtype=torch.float64), torch.ones(1))
    if DEV == "cuda":
        with pytest.raises(DeviceMismatchError):
            decode(q, cache, bt.cpu(), sl, ld, ws)
    bl = BypassLoader(2, 64, 16, torch.bfloat16)
    with pytest.raises(DtypeError):
        decode(q, torch.zeros(4, 16, 2, 64, device=DEV), bt, sl, bl, ws)
    with pytest.raises(ShapeError):
        kc = torch.zeros(4, 16, 2, 32, device=DEV, dtype=torch.bfloat16)
        decode(q, (kc, kc), bt, sl, bl, ws)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    with pytest.raises(ShapeError):
        prefill(q, k.bfloat16(), k.bfloat16(), cu, sl, 1, cache, bt, ld)
    with pytest.raises(DtypeError):
        prefill(q, q[:, :2], q[:, :2].half(), cu, sl, 1, cache, bt, ld)


def test_workspace_split_count_is_static_and_bounded():
    ws = Workspace(64, 32, 128, DEV, max_splits=16, target_programs=512, single_split_ctas=0)
    assert ws.splits_for(1, 8) == 16
    assert ws.splits_for(64, 8) == 2          # min_splits (default 2)
    assert Workspace(64, 32, 128, DEV, target_programs=512, min_splits=1).splits_for(64, 8) == 1
    for bad in (0, 3, 64, True):
        with pytest.raises(ShapeError):
            Workspace(4, 4, 64, DEV, max_splits=32, min_splits=bad)
    assert all(ws.splits_for(n, 8) & (ws.splits_for(n, 8) - 1) == 0 for n in range(1, 65))
    o, lse = ws.partials(4, 32, ws.splits_for(4, 8), 128)
    assert o.shape == (4, 32, 16, 128) and lse.shape == (4, 32, 16)
    with pytest.raises(ShapeError):
        Workspace(0, 32, 128, DEV)


def test_workspace_single_split_on_full_grids(monkeypatch):
    """From ``single_split_ctas`` CTAs (default SINGLE_SPLIT_TARGETS × target_programs while
    TKV_DECODE_SINGLE_SPLIT=1, the default; 0 otherwise) a batch runs one split; below, min_splits still
    holds; 0 never; a bad value is a ShapeError. The partial rows the workspace holds still
    bound every batch shape's need."""
    import tkv.kernels.workspace as W

    assert W.decode_single_split_from_env({}) is True       # on by default (session 19)
    monkeypatch.setattr(W, "DECODE_SINGLE_SPLIT", True)
    ws = Workspace(300, 32, 128, DEV, max_splits=16, target_programs=512)
    assert ws.single_split_ctas == W.SINGLE_SPLIT_TARGETS * 512
    cut = ws.single_split_ctas
    assert ws.splits_for(cut // 8, 8) == 1 and ws.splits_for(cut // 8 - 1, 8) == 2
    assert ws.splits_for(cut, 1) == 1 and ws.splits_for(cut - 1, 1) == 2
    assert "single_split_ctas=" in repr(ws)
    assert Workspace(300, 32, 128, DEV, target_programs=512, single_split_ctas=0).splits_for(
        300, 8) == 2
    assert Workspace(4, 4, 64, DEV, target_programs=8, single_split_ctas=3).splits_for(2, 2) == 1
    for n in range(1, 301):
        for hkv in (1, 2, 8, 32):
            ws.partials(n, 32, ws.splits_for(n, hkv), 128)   # fits: no error
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ShapeError, match="single_split_ctas"):
            Workspace(4, 4, 64, DEV, single_split_ctas=bad)
    monkeypatch.setattr(W, "DECODE_SINGLE_SPLIT", False)
    assert Workspace(300, 32, 128, DEV, target_programs=512).single_split_ctas == 0


def test_loader_protocol():
    from tkv.kernels import Loader

    codec = TurboKVCodec(64, 4, device=DEV)
    for ld in (TkvLoader(codec, 2, 16), BypassLoader(2, 64, 16),
               Fp8Loader(2, 64, 16, torch.ones(1, device=DEV), torch.ones(1, device=DEV))):
        assert isinstance(ld, Loader)
        assert ld.bytes_per_token() > 0
    assert TkvLoader(codec, 2, 16).bytes_per_token() == codec.layout(2, 16).bytes_per_token
    assert math.isclose(BypassLoader(2, 64, 16).bytes_per_token(), 2 * 2 * 64 * 2)
    # a codec with sink offsets gets the rotated shifts of the sides that have one
    ld = TkvLoader(TurboKVCodec(64, 4, device=DEV, v_sink_offset=torch.ones(2, 64)), 2, 16)
    assert ld.k_sink_shift is None and tuple(ld.v_sink_shift.shape) == (2, 64)


def test_check_metadata_names_the_bad_entry():
    from tkv.kernels import MetadataError, check_metadata

    bt = torch.tensor([[3, 1, 99], [0, 2, 7]], dtype=torch.int32)
    sl = torch.tensor([20, 33], dtype=torch.int32)
    check_metadata(8, 16, block_table=bt, seq_lens=sl)          # third block of seq 0 unused
    with pytest.raises(MetadataError, match=r"block_table\[1, 2\]"):
        check_metadata(7, 16, block_table=bt, seq_lens=sl)
    with pytest.raises(MetadataError, match="seq_lens"):
        check_metadata(8, 16, block_table=bt, seq_lens=torch.tensor([20, 49], dtype=torch.int32))
    with pytest.raises(MetadataError, match="q_len"):
        check_metadata(8, 16, block_table=bt, seq_lens=sl,
                       cu_seqlens_q=torch.tensor([0, 21, 22], dtype=torch.int32))
    check_metadata(8, 16, slot_mapping=torch.tensor([-1, 0, 127]))
    with pytest.raises(MetadataError, match="slot_mapping"):
        check_metadata(8, 16, slot_mapping=torch.tensor([-1, 128]))


@pytest.mark.skipif(not interpreting(), reason="flips the interpreter's search path")
@pytest.mark.parametrize("kb,vb,sink,rotation", [(2, 5, False, "auto"), (4, 3, True, "auto"),
                                                 (5, 2, True, "auto"), (4, 3, True, "wht"),
                                                 (2, 5, False, "wht")])
def test_store_search_trees_equal_the_gathers(monkeypatch, kb, vb, sink, rotation):
    """Compiled kernels take the binary search's boundaries and the centroids from select trees
    over scalars; the interpreter normally takes gathers. Both must write identical bytes
    (codes, norms, sink flags) — checked here by running the trees under the interpreter."""
    import tkv.kernels.store as store

    g = _gen(21)
    kw = {}
    if sink:
        kw = dict(k_sink_offset=torch.randn(2, 64, generator=g) * 3,
                  v_sink_offset=torch.randn(2, 64, generator=g))
    codec = TurboKVCodec(64, k_bits=kb, v_bits=vb, device=DEV, seed=3, **kw)
    ld = TkvLoader(codec, 2, 16)
    k = (torch.randn(40, 2, 64, generator=g) * 3).to(DEV, torch.bfloat16)
    v = torch.randn(40, 2, 64, generator=g).to(DEV, torch.bfloat16)
    if sink:
        k[:3] = codec.k.sink_offset.to(DEV, torch.bfloat16)
    slots = torch.randperm(64, generator=g)[:40].to(DEV)
    caches = []
    for tree in (False, True):
        monkeypatch.setattr(store, "_SEARCH_TREE", tree)
        cache = ld.layout.allocate(4, DEV)
        compress_store(k, v, cache, slots, ld, rotation=rotation)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    if sink:   # the flags really vary (some tokens coded against the sink offset)
        flags = torch.signbit(ld.layout.views(caches[1])["k_norms"].float())
        assert flags.any() and not flags.all()


def test_gluon_kernel_refuses_what_it_cannot_serve():
    """``decode(kernel=...)``: an unknown name is a ValueError; the Gluon kernel refuses the
    CPU / interpreter, non-4-bit sides, other lookups and sink offsets by name, before any
    launch."""
    from tkv.kernels.gluon_decode import UnsupportedKernelError, check_supported
    ld = TkvLoader(TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV), 2, 16)
    batch = make_paged_batch([5, 9], 16, DEV)
    cache = make_cache(ld, batch.num_blocks, DEV)
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16, device=DEV)
    ws = Workspace(2, 4, 64, DEV)
    with pytest.raises(ValueError, match="kernel must be"):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, kernel="cutlass")
    # On the CPU / interpreter the device is refused first; on a GPU this loader's default
    # lookup (not prmt) is.
    refusal = "CUDA device" if DEV == "cpu" else "prmt lookup"
    with pytest.raises(UnsupportedKernelError, match=refusal):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, kernel="gluon")
    odd = TkvLoader(TurboKVCodec(64, k_bits=3, v_bits=4, device=DEV), 2, 16)
    with pytest.raises(UnsupportedKernelError, match="4-bit"):
        check_supported(odd, "cuda", 64, 2, torch.bfloat16)
    with pytest.raises(UnsupportedKernelError):
        check_supported(ld, "cuda", 96, 2, torch.bfloat16)


@pytest.mark.parametrize("head_dim,kb,vb,group,window,dtype,calibrated,prefetch", [
    (64, 4, 4, 4, 0, torch.bfloat16, False, False),
    (128, 4, 4, 4, 0, torch.bfloat16, True, False),
    (64, 2, 2, 3, 7, torch.float16, True, False),     # 4 planes, GQA 3 (padded rows)
    (64, 3, 5, 1, 0, torch.bfloat16, True, True),     # 8-code groups, prefetch
    (128, 8, 6, 2, 0, torch.float16, False, False),
])
def test_decode_fused_query_rotation_matches_reference(head_dim, kb, vb, group, window, dtype,
                                                       calibrated, prefetch):
    """decode(fused_query_rotation=True): the split kernel rotates the model-space query
    itself (H (w ⊙ q), log2(head_dim) butterfly stages) — equal to the float64 oracle and to
    the rotate_rows path, with channel scales, key / sink offsets (calibrated), windows,
    padded GQA groups, every plane count and the prefetch pipeline."""
    g = _gen(head_dim + kb * 10 + vb)
    extra = {}
    if calibrated:
        hkv = 2
        extra = dict(k_channel_scales=torch.rand(head_dim, generator=g) + 0.5,
                     v_channel_scales=torch.rand(head_dim, generator=g) + 0.5,
                     k_channel_offset=torch.randn(hkv, head_dim, generator=g),
                     k_sink_offset=torch.randn(hkv, head_dim, generator=g) * 3,
                     v_sink_offset=torch.randn(hkv, head_dim, generator=g) * 3)
    codec = TurboKVCodec(head_dim, k_bits=kb, v_bits=vb, device=DEV, seed=3, **extra)
    ld = TkvLoader(codec, 2, 16, fused_query_rotation=False)   # the separate launch
    assert ld.q_hadamard is not None and ld.q_hadamard.shape == (head_dim,)
    # the weights are the rotation: (w ⊙ q) @ H == q @ q_in (float64)
    from tkv.codec.rotation import hadamard_matrix
    q64 = torch.randn(5, head_dim, generator=g, dtype=torch.float64)
    torch.testing.assert_close((q64 * ld.q_hadamard.double().cpu()) @ hadamard_matrix(
        head_dim, torch.float64), q64 @ ld.q_in.double().cpu()[:head_dim, :head_dim],
        rtol=1e-6, atol=1e-6)
    lens = [37, 1, 90]
    fused, q, cache, batch = _decode_check(ld, lens, group, seed=kb, window=window, dtype=dtype,
                                           prefetch=prefetch, fused_query_rotation=True)
    plain = torch.empty_like(fused)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=plain, window=window,
           block_n=ld.min_block_n, prefetch=prefetch)
    assert _rel(fused, plain) < 1e-2
    # the loader's option is decode's default, on unless the loader says otherwise (the
    # engines set it from the environment)
    ld_fused = TkvLoader(codec, 2, 16)
    assert ld_fused.fused_query_rotation is True
    by_loader = torch.empty_like(fused)
    decode(q, cache, batch.block_table, batch.seq_lens, ld_fused, _ws(), out=by_loader,
           window=window, block_n=ld.min_block_n, prefetch=prefetch)
    assert torch.equal(by_loader, fused)


def test_fused_query_rotation_bad_options_are_named():
    """TkvLoader's flags must be bools ("0" would read as True); a loader whose q_hadamard
    does not fit the head_dim is a ShapeError at the call, not NaN rows from the kernel."""
    codec = TurboKVCodec(48, 4, device=DEV)
    for kw in ({"fused_query_rotation": "0"}, {"small_head_groups": 1}):
        with pytest.raises(ValueError, match="must be a bool"):
            TkvLoader(codec, 2, 16, **kw)
    ld = TkvLoader(codec, 2, 16)
    ld.q_hadamard = torch.ones(48, device=DEV)    # a mutated / custom loader
    batch, cache = _scenario(ld, [20], 3)
    q = torch.randn(1, 4, 48).to(DEV, torch.bfloat16)
    with pytest.raises(ShapeError, match="q_hadamard"):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(),
               fused_query_rotation=True)
    with pytest.raises(DtypeError, match="fused_query_rotation must be a bool"):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(),
               fused_query_rotation="0")
    ld.q_hadamard = torch.ones(48, device="meta")   # another device than the query's
    with pytest.raises(DeviceMismatchError, match="q_hadamard"):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(),
               fused_query_rotation=True)


def test_decode_fused_query_rotation_falls_back_where_not_hadamard():
    """head_dim 96 (Hadamard ⊗ DCT rotation): no Hadamard weights; fused_query_rotation=True
    then runs the separate rotation (same output as without the flag, bit for bit)."""
    ld = TkvLoader(TurboKVCodec(96, 4, device=DEV), 2, 16)
    assert ld.q_hadamard is None
    out, q, cache, batch = _decode_check(ld, [20, 33], 2, seed=4, fused_query_rotation=True)
    plain = torch.empty_like(out)
    decode(q, cache, batch.block_table, batch.seq_lens, ld, _ws(), out=plain,
           block_n=ld.min_block_n, fused_query_rotation=False)
    assert torch.equal(out, plain)


def _small_prefill(ld, seed=3, prefix=(9, 0), qlens=(20, 5), group=2):
    """A small bfloat16 prefill batch on ``ld``: q, k, v, cu, seq_lens, block_table, cache."""
    q, k, v, cu, batch, cache = _prefill_batch(ld, prefix, qlens, group, seed, torch.bfloat16)
    return q, k, v, cu, batch.seq_lens, batch.block_table, cache


def test_truthy_options_and_launch_values_are_named_errors():
    """A string or int where a bool option goes would pick the other code path silently (an
    unrotated query read as rotated: wrong numbers); a NaN sm_scale would make every row NaN;
    a non-power-of-two launch value would crash inside Triton; a loader or workspace of the
    wrong type would fail on an attribute deep in the wrapper — each is refused by name."""
    from tkv.codec.errors import NonFiniteError

    ld = TkvLoader(TurboKVCodec(32, 4, device=DEV), 2, 16)
    batch, cache = _scenario(ld, [5, 17], seed=1)
    q = torch.randn(2, 4, 32, device=DEV, dtype=torch.bfloat16)
    ws = _ws()
    args = (q, cache, batch.block_table, batch.seq_lens, ld, ws)
    for name in ("query_rotated", "output_rotated", "prefetch", "swap_qk"):
        for bad in ("no", "False", 0, 1):
            with pytest.raises(DtypeError, match=name):
                decode(*args, **{name: bad})
    for bad in (float("nan"), float("inf"), "0.1"):
        with pytest.raises((NonFiniteError, DtypeError), match="sm_scale"):
            decode(*args, sm_scale=bad)
    for bad in (2.5, "2", True, 3):
        with pytest.raises(ShapeError, match="num_splits"):
            decode(*args, num_splits=bad)
    for bad in (0, 3, 32, 4.0):
        with pytest.raises(ShapeError, match="num_warps"):
            decode(*args, num_warps=bad)
    with pytest.raises(TypeError, match="Loader"):
        decode(q, cache, batch.block_table, batch.seq_lens, None, ws)
    with pytest.raises(TypeError, match="Workspace"):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, None)
    pq, pk, pv, cu, sl, bt, pc = _small_prefill(ld)
    pargs = (pq, pk, pv, cu, sl, 20, pc, bt, ld)
    with pytest.raises(DtypeError, match="no_prefix"):
        prefill(*pargs, no_prefix="no")
    with pytest.raises(NonFiniteError, match="sm_scale"):
        prefill(*pargs, sm_scale=float("nan"))
    for kw in (dict(block_m=48), dict(block_m=64.0), dict(block_m=0), dict(block_m=True),
               dict(num_warps=3), dict(num_warps=0)):
        with pytest.raises(ShapeError, match=next(iter(kw))):
            prefill(*pargs, **kw)
    with pytest.raises(ShapeError, match="num_stages"):
        prefill(*pargs, num_stages=0)
    with pytest.raises(TypeError, match="Loader"):
        prefill(pq, pk, pv, cu, sl, 20, pc, bt, "tkv")
    for bad in (dict(num_kv_heads=0), dict(head_dim=32.0), dict(block_size=0)):
        geo = {"num_kv_heads": 2, "head_dim": 32, "block_size": 16, **bad}
        with pytest.raises(ShapeError, match=next(iter(bad))):
            BypassLoader(**geo)
        with pytest.raises(ShapeError, match=next(iter(bad))):
            Fp8Loader(**geo, k_scale=torch.ones(1), v_scale=torch.ones(1))


def test_shares_memory_is_byte_range_intersection_in_one_storage():
    """tkv.kernels.shares_memory (the engines' check before writing into a buffer they were
    handed; prefill's overlap refusal uses it): views of one storage whose spans intersect,
    never separate storages or empty views; strided views by their spans."""
    from tkv.kernels import shares_memory

    x = torch.randn(6, 8)
    assert shares_memory(x[:3], x[2:]) and shares_memory(x, x[5, 7:])
    assert not shares_memory(x[:3], x[3:]) and not shares_memory(x, x.clone())
    assert not shares_memory(x[:0], x) and not shares_memory(x, x[2:2])
    assert shares_memory(x[:, :2], x[:, 6:])        # spans interleave: conservative
    assert not shares_memory(x[:2, :2], x[3:, :])
    assert shares_memory(x.view(torch.int32), x[1])  # another dtype, same bytes


def test_prefill_out_sharing_memory_with_key_or_value_is_refused():
    """Other programs still read the chunk's K/V while out is written: an out that overlaps
    them fed its own rows back (measured: relative error 0.35-0.40) — now a ShapeError."""
    bl = BypassLoader(2, 32, 16)
    pq, pk, pv, cu, sl, bt, _ = _small_prefill(bl, prefix=(0, 0), group=1)
    kv = torch.cat([pk, pv], 1)                       # (T, 4, 32): k and v share a tensor
    k, v = kv[:, :2], kv[:, 2:]
    cache = (torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16, device=DEV),) * 2
    for out in (kv[:, :2], kv[:, 2:], kv[:, 1:3]):
        with pytest.raises(ShapeError, match="shares memory"):
            prefill(pq, k, v, cu, sl, 20, cache, bt, bl, out=out, no_prefix=True)
    prefill(pq, k, v, cu, sl, 20, cache, bt, bl, out=pq.clone(), no_prefix=True)


@pytest.mark.parametrize("loader", ["tkv", "bypass"])
def test_prefill_metadata_past_the_tensors_is_nan_not_out_of_bounds(loader):
    """cu_seqlens_q ending past total_q used to read q/k/v and write out past their ends
    (heap corruption on the CPU); max_query_len below a q_len left rows of uninitialized
    scratch as numbers. Now a sequence reaching past total_q gets NaN in its existing rows,
    nothing is touched past them, and rows the grid does not cover are NaN; check_metadata
    names both with total_q."""
    from tkv.kernels import MetadataError, check_metadata

    ld = (TkvLoader(TurboKVCodec(32, 4, device=DEV), 2, 16) if loader == "tkv"
          else BypassLoader(2, 32, 16))
    pq, pk, pv, cu, sl, bt, pc = _small_prefill(ld)
    guard = torch.full((30, 4, 32), 7.0, dtype=torch.float32, device=DEV)
    out = guard[:25]                                   # rows 25.. must stay 7.0
    out.fill_(float("nan"))
    bad_cu = torch.tensor([0, 20, 29], dtype=torch.int32, device=DEV)   # 29 > total_q = 25
    bad_sl = sl + torch.tensor([0, 4], dtype=torch.int32, device=DEV)
    prefill(pq, pk, pv, bad_cu, bad_sl, 9, pc, bt, ld, out=out)
    assert torch.equal(guard[25:], torch.full_like(guard[25:], 7.0))
    assert torch.isnan(out[20:]).all() and torch.isfinite(out[:20]).all()
    with pytest.raises(MetadataError, match="ends at 29"):
        check_metadata(pc.shape[0] if loader == "tkv" else 8, 16, block_table=bt,
                       seq_lens=bad_sl, cu_seqlens_q=bad_cu, total_q=25)
    short = prefill(pq, pk, pv, cu, sl, 8, pc, bt, ld, block_m=16)   # grid covers 8 of 20
    assert torch.isnan(short[8:20]).all() and torch.isfinite(short[:8]).all()


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail the block (TimeoutError) after ``seconds`` of wall time: a loop over millions of
    masked tiles under the interpreter is a hang, and a hang must fail, not stall CI. POSIX
    main thread only (SIGALRM); elsewhere the block just runs."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# seq_lens of broken metadata far past the block table (an engine bug, a stale buffer): the
# kernels mask positions past the table's capacity; their loops used to run every masked
# tile up to the length — ~2³¹ / BLOCK_N tiles, a hang (minutes on a GPU, forever under the
# interpreter). Page-aligned lengths so that the table's valid pages hold exactly the
# sequence (past them: poison pages, masked), the output then equals the real length's.
_HUGE_LEN = 2 ** 31 - 2 ** 12


def test_decode_seq_len_past_the_block_table_runs_no_masked_tiles():
    ld = TkvLoader(TurboKVCodec(64, 4, device=DEV), 2, 16)
    batch, cache = _scenario(ld, [32, 17], seed=4)
    g = _gen(41)
    q = torch.randn(2, 4, 64, generator=g).to(DEV, torch.bfloat16)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    cap = batch.block_table.shape[1] * ld.block_size
    for length in (_HUGE_LEN, cap + 1):
        bad = batch.seq_lens.clone()
        bad[0] = length
        for splits in (1, 4):
            out = torch.full(q.shape, 7.0, device=DEV)   # float32: exact under the interpreter
            with _deadline(120):
                decode(q, cache, batch.block_table, bad, ld, _ws(), num_splits=splits, out=out)
            # broken metadata: NaN rows for it (session 27; before, attention over the
            # table's capacity), the other sequence exact
            assert torch.isnan(out[0]).all(), (length, splits)
            assert _rel(out[1], ref[1]) < _tol(torch.bfloat16), (length, splits)
    # a length exactly at the capacity is valid: a table of two pages, which sequence 0's
    # 32 tokens fill
    out = torch.full(q.shape, 7.0, device=DEV)
    decode(q, cache, batch.block_table[:, :2].contiguous(), batch.seq_lens, ld, _ws(), out=out)
    assert _rel(out, ref) < _tol(torch.bfloat16)


def test_prefill_seq_len_past_the_block_table_runs_no_masked_tiles():
    ld = TkvLoader(TurboKVCodec(32, 4, device=DEV), 2, 16)
    q, k, v, cu, batch, cache = _prefill_batch(ld, (16, 9), (20, 5), 2, 6, torch.bfloat16)
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld)
    bt = batch.block_table.clone()
    bt[0, 1:] = 10 ** 6          # sequence 0's prefix is its first page; the rest is poison
    huge = batch.seq_lens.clone()
    huge[0] = _HUGE_LEN
    out = torch.full(q.shape, 7.0, device=DEV)
    with _deadline(120):
        prefill(q, k, v, cu, huge, 20, cache, bt, ld, block_m=16, out=out)
    # a prefix longer than the table holds: NaN rows (session 27; the varlen path's verdict
    # already), the other sequence exact
    assert torch.isnan(out[:20]).all()
    assert _rel(out[20:], ref[20:]) < _tol(torch.bfloat16)


@pytest.mark.parametrize("length", [-2 ** 31, -1, 19])
def test_prefill_seq_len_below_the_chunk_is_nan(length):
    """A seq_lens entry below the sequence's q_len (20 here) is broken metadata: NaN rows for
    it, the other sequence exact. At −2³¹ the int32 ``L − q_len`` wraps to a huge prefix: it
    used to attend the whole cached row as a prefix (finite, wrong numbers)."""
    ld = TkvLoader(TurboKVCodec(32, 4, device=DEV), 2, 16)
    q, k, v, cu, batch, cache = _prefill_batch(ld, (16, 9), (20, 5), 2, 7, torch.bfloat16)
    ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld)
    bad = batch.seq_lens.clone()
    bad[0] = length
    out = torch.full(q.shape, 7.0, device=DEV)
    with _deadline(120):
        prefill(q, k, v, cu, bad, 20, cache, batch.block_table, ld, block_m=16, out=out)
    assert torch.isnan(out[:20]).all()
    assert _rel(out[20:], ref[20:]) < _tol(torch.bfloat16)


def test_check_metadata_shapes_and_lengths_without_a_block_table():
    from tkv.kernels import MetadataError, check_metadata

    sl = torch.tensor([5, 3], dtype=torch.int32)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    for kw, match in ((dict(block_table=bt[:1], seq_lens=sl), "1 rows for 2 seq_lens"),
                      (dict(block_table=bt[0], seq_lens=sl), "block_table must have 2 dim"),
                      (dict(seq_lens=sl, cu_seqlens_q=torch.tensor([0, 5])), "2 entries for 2"),
                      (dict(seq_lens=sl, cu_seqlens_q=torch.tensor([0, 2, 6])), "q_len 4 > seq_len 3"),
                      (dict(seq_lens=torch.tensor([-1, 3])), "negative"),
                      (dict(slot_mapping=torch.zeros(2, 2)), "slot_mapping must have 1 dim"),
                      (dict(cu_seqlens_q=torch.tensor([0, 3, 2])), "non-decreasing")):
        with pytest.raises(MetadataError, match=match):
            check_metadata(4, 16, **kw)
    check_metadata(4, 16, seq_lens=sl, cu_seqlens_q=torch.tensor([0, 2, 5]), total_q=5)


def test_torch_varlen_attention_maps_the_dense_contract(monkeypatch):
    """TorchVarlenAttention hands PyTorch's varlen_attn its own argument names: positional
    cu_seqlens and max lengths, ``scale=``, tkv's window as ``window_size=(window − 1, 0)``,
    causal ``(-1, 0)`` without one — checked through the varlen path and the bypass against
    the float64 oracle with a stand-in for varlen_attn (the real one needs CUDA: test_gpu)."""
    from tkv.kernels import TorchVarlenAttention

    fa = TorchVarlenAttention()
    seen = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert isinstance(max_q, int) and isinstance(max_k, int) and window_size[1] == 0
        seen.append(window_size)
        left = window_size[0]
        return SdpaDenseAttention()(q, k, v, cu_q, cu_k, max_q, max_k, scale,
                                    0 if left == -1 else left + 1)

    monkeypatch.setattr(fa, "_varlen", stand_in)
    assert fa.first_chunks and not fa.writes_out and "first_chunks=True" in repr(fa)
    codec = TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV, seed=4)
    ld = TkvLoader(codec, 2, 16)
    scratch = torch.full((1 << 18,), float("nan"), device=DEV)
    tol = max(_tol(torch.float16), 1e-3)
    for window in (0, 9):
        _prefill_check(ld, [30, 12], [40, 5], 2, seed=5, window=window, max_prefix_len=30,
                       scratch=scratch, dense_attention=fa, tol=tol)
        _prefill_check(ld, [0, 0], [21, 6], 2, seed=6, window=window, no_prefix=True,
                       dense_attention=fa, tol=tol)
    assert seen == [(-1, 0), (-1, 0), (8, 0), (8, 0)]
    with pytest.raises(ValueError, match="first_chunks"):
        TorchVarlenAttention(first_chunks=1)
    # PyTorch 2.10's varlen_attn (is_causal, no window_size): refused when built, by name

    def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                    return_aux=None, scale=None):
        raise AssertionError("never called")

    import torch.nn.attention.varlen as varlen_mod

    monkeypatch.setattr(varlen_mod, "varlen_attn", varlen_2_10)
    with pytest.raises(ImportError, match="window_size"):
        TorchVarlenAttention()


@pytest.mark.skipif(DEV != "cpu", reason="the Triton kernel on CPU tensors: the interpreter")
def test_auto_routes_to_the_cuda_kernel_unless_a_triton_option_is_given(monkeypatch):
    """``decode(kernel=None)`` reads ``TKV_DECODE_KERNEL`` (default ``auto``): ``auto`` takes
    the CUDA kernel wherever it is supported and no Triton-only option is given (with its own
    split rule), else the Triton kernel; ``triton`` always the Triton kernel. Checked on the
    CPU with the CUDA kernel's support test and launch replaced by a recorder."""
    import importlib
    dmod = importlib.import_module("tkv.kernels.decode")   # the module (decode is shadowed)
    from tkv.kernels import _nvrtc, cuda_decode
    ld = TkvLoader(TurboKVCodec(64, k_bits=4, v_bits=4), 2, 16)
    batch = make_paged_batch([40, 7], 16, "cpu")
    cache = make_cache(ld, batch.num_blocks, "cpu")
    for i, n in enumerate((40, 7)):
        kv = torch.randn(2, n, 2, 64, dtype=torch.bfloat16)
        fill_cache(ld, cache, kv[0], kv[1], batch.slots(i))
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    ws = Workspace(2, 4, 64, "cpu", target_programs=8)
    calls = []
    monkeypatch.setattr(cuda_decode, "supported", lambda *a: True)
    monkeypatch.setattr(cuda_decode, "check_supported", lambda *a: None)

    def fake_launch(q, bt, sl, nb, cache, loader, part_o, part_lse, *a, splits, **kw):
        # finite partials for the reduce pass (an interpreted kernel that raises on garbage
        # would leave the interpreter's patches behind for later tests)
        part_o.zero_()
        part_lse.zero_()
        calls.append(("cuda", splits))

    monkeypatch.setattr(cuda_decode, "launch_split", fake_launch)
    real = dmod._decode_split_kernel

    class Recorder:   # the Triton split kernel, recorded, then run as usual
        def __getitem__(self, grid):
            calls.append(("triton", grid[2]))
            return real[grid]

    monkeypatch.setattr(dmod, "_decode_split_kernel", Recorder())
    monkeypatch.setattr(cuda_decode, "DECODE_KERNEL", "auto")

    def run(**kw):
        decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, **kw)

    run(num_splits=1)
    assert calls[-1] == ("cuda", 1)
    run()
    assert calls[-1] == ("cuda", ws.cuda_splits_for(2, 2))
    for opt in ({"block_n": 32}, {"num_warps": 8}, {"maxnreg": 128}, {"prefetch": True},
                {"min_split_tiles": 2}, {"kernel": "triton"}):
        run(**opt)
        assert calls[-1][0] == "triton", opt
    monkeypatch.setattr(cuda_decode, "DECODE_KERNEL", "triton")
    run()
    assert calls[-1] == ("triton", ws.splits_for(2, 2))
    monkeypatch.setattr(cuda_decode, "DECODE_KERNEL", "auto")
    # the balanced schedule (TKV_DECODE_SCHEDULE / schedule=): where the kernel writes the
    # output itself and no split count is given; otherwise the split schedule
    def fake_balanced(q, bt, sl, nb, cache, loader, workspace, *a, epilogue, **kw):
        calls.append(("balanced", epilogue))

    monkeypatch.setattr(cuda_decode, "launch_balanced", fake_balanced)
    run(schedule="balanced")
    assert calls[-1] == ("balanced", 2)   # unrotated in the kernel
    run(schedule="balanced", output_rotated=True)
    assert calls[-1] == ("balanced", 1)
    for opt in ({"num_splits": 2}, {"single_split_epilogue": False}, {"kernel": "triton"}):
        run(schedule="balanced", **opt)
        assert calls[-1][0] in ("cuda", "triton"), opt
    monkeypatch.setattr(cuda_decode, "DECODE_SCHEDULE", "balanced")
    run()
    assert calls[-1] == ("balanced", 2)
    monkeypatch.setattr(cuda_decode, "DECODE_SCHEDULE", "split")
    run()
    assert calls[-1] == ("cuda", ws.cuda_splits_for(2, 2))
    for kern in ("cuda", "triton"):   # refused whichever kernel runs
        with pytest.raises(ValueError, match="schedule"):
            run(schedule="stream-k", kernel=kern)
    # the CUDA kernel cannot be built: auto warns once and decodes with Triton (same splits);
    # an explicit kernel="cuda" raises
    def broken(*a, **kw):
        raise _nvrtc.CudaCompileError("no NVRTC here")

    monkeypatch.setattr(cuda_decode, "launch_split", broken)
    monkeypatch.setattr(_nvrtc, "FALLBACK_WARNED", set())
    with pytest.warns(RuntimeWarning, match="Triton kernel"):
        run()
    assert calls[-1] == ("triton", ws.cuda_splits_for(2, 2))
    with pytest.raises(_nvrtc.CudaCompileError):
        run(kernel="cuda")
    monkeypatch.setattr(cuda_decode, "supported", lambda *a: False)
    run()
    assert calls[-1][0] == "triton"
