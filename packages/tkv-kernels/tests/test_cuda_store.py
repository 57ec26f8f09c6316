"""The hand-written CUDA store (``compress_store(kernel="cuda")``, tkv.kernels.cuda_store) and
its search-free quantization table (tkv.kernels._quant_grid).

On the CPU: the table reproduces the codec's Lloyd-Max rule ``#{b_j < z}`` (within float32
rounding at a boundary) for every width and for fitted codebooks; every configuration compiles
with NVRTC for sm_90 (no GPU needed); the scope checks and ``auto``'s routing refuse or fall
back by name. On a GPU: the codec and the Triton store agree with it on random slots, every
width pair, three input dtypes, key centering, channel scales and sink offsets; skipped slots
stay untouched; CUDA-graph replay equals eager.
"""

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tkv.codec import TurboKVCodec, unpack_codes
from tkv.kernels import TkvLoader, _nvrtc, _quant_grid, compress_store, cuda_store
from tkv.kernels._util import UnsupportedKernelError, interpreting
from tkv.kernels.testing import offset_codec

GPU = torch.cuda.is_available() and not interpreting()
gpu_only = pytest.mark.skipif(not GPU, reason="needs CUDA")
DEV = "cuda" if GPU else "cpu"


# ----------------------------------------------------------------------- the quantization table
def _adversarial(bounds: torch.Tensor, g) -> torch.Tensor:
    """Random standardized coordinates plus every boundary, its float32 neighbours, values
    a few ulps away, the saturation range and NaN."""
    b = bounds.float()
    up, down = torch.full_like(b, math.inf), torch.full_like(b, -math.inf)
    near = [b, torch.nextafter(b, up), torch.nextafter(b, down)]
    for _ in range(3):
        near.append(torch.nextafter(near[-2], up))
        near.append(torch.nextafter(near[-2], down))
    return torch.cat([torch.randn(50000, generator=g) * 1.5, torch.rand(5000, generator=g) * 40 - 20,
                      *near, torch.tensor([0.0, -0.0, 16.0, -16.0, 1e30, -1e30, math.nan])])


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("fitted", [False, True])
def test_table_reproduces_the_lloyd_max_rule(bits, fitted):
    """The kernel's arithmetic (emulated with its float32 roundings) gives ``#{b_j < z}``
    exactly except within a few float32 ulps of a boundary (there the neighbouring code, as
    any float32 evaluation of z may), 0 for NaN; 2-6 bits use cells, 7-8 the binary search."""
    g = torch.Generator().manual_seed(bits + 10 * fitted)
    side = TurboKVCodec(128, k_bits=bits, v_bits=bits, seed=3).k
    bounds, cents = side.boundaries, side.scaled_centroids
    if fitted:   # an asymmetric, unevenly spaced codebook (as fit_codebook may give)
        c = torch.sort(torch.randn(1 << bits, generator=g, dtype=torch.float64) * 1.3
                       + 0.4).values
        bounds, cents = (c[1:] + c[:-1]) / 2, c / math.sqrt(128)
    table, ncell = _quant_grid.build(bounds, cents, bits)
    assert table.dtype == torch.uint8 and table.numel() % 16 == 0
    # the codec's Gaussian codebooks use cells up to 6 bits; a random one may crowd two
    # boundaries (the binary search then), 7-8 bits never use cells
    assert (ncell > 0) == (bits <= 6) if not fitted else bits <= 6 or ncell == 0
    z = _adversarial(bounds, g)
    want = torch.searchsorted(bounds.float(), z, right=False).masked_fill(z != z, 0)
    got = _quant_grid.emulate(z, table, bits)
    assert got.min() >= 0 and got.max() < 1 << bits
    bad = got != want
    assert ((got - want).abs() <= 1).all()
    if bad.any():   # only next to a boundary: within 4 ulps of b_{min(code)}
        lo = torch.minimum(got, want)[bad]
        b = bounds.float()[lo]
        assert ((z[bad] - b).abs() <= 4 * torch.finfo(torch.float32).eps * b.abs().clamp_min(1)
                ).all()
    assert bad[:55000].float().mean() < 1e-4   # random coordinates: float32 ties only


def test_table_falls_back_to_the_search_for_crowded_boundaries():
    """Boundaries too close for 256 cells (or equal ones) give ncell = 0: the binary search."""
    c = torch.tensor([-3.0, -1.0, 0.0, 1e-7, 2e-7, 1.0, 2.0, 3.0], dtype=torch.float64)
    table, ncell = _quant_grid.build((c[1:] + c[:-1]) / 2, c / 8, 3)
    assert ncell == 0
    z = torch.tensor([-5.0, 5e-8, 1.5e-7, 0.9, math.nan])
    want = torch.tensor([0, 2, 3, 5, 0])   # #{b_j < z}: 5e-8 and 1.5e-7 are boundaries
    assert torch.equal(_quant_grid.emulate(z, table, 3), want)
    with pytest.raises(ValueError, match=r"2\.\.8"):
        _quant_grid.build(c[1:], c, 1)
    with pytest.raises(ValueError, match="boundaries"):
        _quant_grid.build(c[2:], c, 3)


# ------------------------------------------------------------------------- offline compile
def _cuobjdump() -> Path | None:
    import triton
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return p if p.exists() else None


class _FakeCache:
    """The one attribute :func:`cuda_store.defines` reads of the cache (its base address)."""

    def __init__(self, ptr=0):
        self._ptr = ptr

    def data_ptr(self):
        return self._ptr


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only PyTorch has no NVRTC")
@pytest.mark.parametrize("d,kb,vb,dtype,extras,elems", [
    (128, 4, 4, torch.bfloat16, {}, None),
    (128, 4, 4, torch.bfloat16, {"center": True, "sink": True}, None),
    (128, 3, 5, torch.float16, {"center": True}, 8),
    (64, 2, 8, torch.float32, {}, None),
    (256, 7, 6, torch.bfloat16, {"sink": True}, None)])
def test_compiles_offline(d, kb, vb, dtype, extras, elems, tmp_path):
    """NVRTC compiles every side variant for sm_90 on any machine; at head_dim 128 K4V4 fits
    128 registers (168 with sink offsets: two candidates in registers) without local
    memory."""
    kw = {}
    if extras.get("center"):
        kw["k_channel_offset"] = torch.randn(d)
    if extras.get("sink"):
        kw.update(k_sink_offset=torch.randn(d), v_sink_offset=torch.randn(d))
    ld = TkvLoader(TurboKVCodec(d, k_bits=kb, v_bits=vb, **kw), 2, 16)
    x = torch.empty(1, 2, d, dtype=dtype)
    defs = cuda_store.defines(ld, x, x, _FakeCache(), elems=elems)
    assert defs["K_SINK"] == defs["V_SINK"] == int(bool(extras.get("sink")))
    assert defs["K_NCELL"] == ld.k_store_ncell and (defs["K_NCELL"] > 0) == (kb <= 6)
    cubin = _nvrtc.compile_cubin(cuda_store.SOURCE, cuda_store.ENTRY, defs, "90")
    assert cubin[:4] == b"\x7fELF"
    tool = _cuobjdump()
    if tool is None or (d, kb, vb) != (128, 4, 4):
        return
    (tmp_path / "k.cubin").write_bytes(cubin)
    res = subprocess.run([str(tool), "-res-usage", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stdout
    budget = 192 if extras.get("sink") else 128
    assert int(re.search(r"REG:(\d+)", res).group(1)) <= budget and "LOCAL:0" in res, res


def test_alignment_comes_from_the_layout():
    """The code-store alignment is the gcd of the cache base, the page and the side's offsets
    and strides (tkv.codec.layout) and the lane's bytes; an odd base address gives bytes."""
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=3), 2, 16)
    x = torch.empty(1, 2, 128, dtype=torch.bfloat16)
    d = cuda_store.defines(ld, x, x, _FakeCache(0))
    st = ld.layout.strides()
    assert d["K_ALIGN"] == math.gcd(16, ld.layout.page_bytes, ld.layout.k_codes_offset,
                                    st["k_head"], st["k_token"], 8)
    assert d["V_ALIGN"] == math.gcd(16, ld.layout.page_bytes, ld.layout.v_codes_offset,
                                    st["v_head"], st["v_token"], 6)
    assert cuda_store.defines(ld, x, x, _FakeCache(1))["K_ALIGN"] == 1
    with pytest.raises(Exception, match="elems"):
        cuda_store.defines(ld, x, x, _FakeCache(), elems=4)


# ------------------------------------------------------------------ scope and routing (any box)
def test_refuses_what_it_cannot_serve():
    """Outside its scope kernel='cuda' refuses by name before any launch; 'auto' takes Triton."""
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4, device=DEV), 2, 16)
    k = torch.randn(5, 2, 128, device=DEV, dtype=torch.bfloat16)
    cache = ld.layout.allocate(2, DEV)
    check = cuda_store.check_supported
    if not GPU:
        with pytest.raises(UnsupportedKernelError, match="CUDA device"):
            check(ld, k, k, cache, "wht")
    with pytest.raises(UnsupportedKernelError, match="butterflies"):
        check(ld, k, k, cache, "split")
    odd = TkvLoader(TurboKVCodec(96, k_bits=4, v_bits=4, device=DEV), 2, 16)
    k96 = torch.randn(5, 2, 96, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedKernelError, match="butterflies"):
        check(odd, k96, k96, odd.layout.allocate(2, DEV), "split")
    wide = torch.randn(5, 2, 132, device=DEV, dtype=torch.bfloat16)[..., :128]  # 264-byte rows
    with pytest.raises(UnsupportedKernelError, match="16-byte"):
        check(ld, wide, k, cache, "wht")
    with pytest.raises(ValueError, match="kernel must be"):
        compress_store(k, k, cache, torch.arange(5, device=DEV), ld, kernel="fast")


def test_auto_routing(monkeypatch):
    """TKV_STORE_KERNEL picks the default (auto since session 35); 'auto' runs the CUDA store
    only where it applies and no Triton tiling option is given."""
    calls = []
    monkeypatch.setattr(cuda_store, "supported", lambda *a: True)
    monkeypatch.setattr(cuda_store, "launch", lambda *a, **kw: calls.append("cuda"))
    ld = TkvLoader(TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV), 2, 16)
    k = torch.randn(3, 2, 64, device=DEV, dtype=torch.bfloat16)
    cache = ld.layout.allocate(1, DEV)
    slots = torch.arange(3, device=DEV)
    assert cuda_store.store_kernel_from_env({}) == "auto"
    monkeypatch.setattr(cuda_store, "STORE_KERNEL", "auto")
    compress_store(k, k, cache, slots, ld)
    assert calls == ["cuda"]
    compress_store(k, k, cache, slots, ld, block_t=8)       # a Triton tiling option: Triton
    compress_store(k, k, cache, slots, ld, kernel="triton")
    assert calls == ["cuda"]
    monkeypatch.setattr(cuda_store, "STORE_KERNEL", "triton")
    compress_store(k, k, cache, slots, ld)
    assert calls == ["cuda"]
    monkeypatch.setattr(cuda_store, "supported", lambda *a: False)
    monkeypatch.setattr(cuda_store, "STORE_KERNEL", "auto")
    compress_store(k, k, cache, slots, ld)
    assert calls == ["cuda"]


def test_compile_failure_under_auto_falls_back_with_one_warning(monkeypatch):
    calls = []

    def broken(*a, **kw):
        calls.append("cuda")
        raise _nvrtc.CudaCompileError("nvrtc: boom")

    monkeypatch.setattr(cuda_store, "supported", lambda *a: True)
    monkeypatch.setattr(cuda_store, "launch", broken)
    monkeypatch.setattr(cuda_store, "STORE_KERNEL", "auto")
    monkeypatch.setattr(_nvrtc, "FALLBACK_WARNED", set())
    ld = TkvLoader(TurboKVCodec(64, k_bits=4, v_bits=4, device=DEV), 2, 16)
    k = torch.randn(3, 2, 64, device=DEV, dtype=torch.bfloat16)
    cache = ld.layout.allocate(1, DEV)
    slots = torch.arange(3, device=DEV)
    with pytest.warns(RuntimeWarning, match="TKV_STORE_KERNEL=triton"):
        compress_store(k, k, cache, slots, ld)
    written = cache.clone()
    assert written.any()   # the Triton store ran
    monkeypatch.setattr(cuda_store, "check_supported", lambda *a: None)
    with pytest.raises(_nvrtc.CudaCompileError):
        compress_store(k, k, cache, slots, ld, kernel="cuda")


@pytest.mark.parametrize("raw,want", [(None, "auto"), (" CUDA ", "cuda"), ("Triton", "triton")])
def test_store_kernel_env(raw, want):
    env = {} if raw is None else {"TKV_STORE_KERNEL": raw}
    assert cuda_store.store_kernel_from_env(env) == want


def test_store_kernel_env_refuses_other_values():
    with pytest.raises(cuda_store.StoreKernelConfigError, match="TKV_STORE_KERNEL"):
        cuda_store.store_kernel_from_env({"TKV_STORE_KERNEL": "gluon"})


# --------------------------------------------------------------------------------- on a GPU
def _codes(views, name, b, o, bits, d):
    return unpack_codes(views[name][b, :, o], bits, d)


@gpu_only
@pytest.mark.parametrize("d,kb,vb,dtype,center,scales,sink", [
    (128, 4, 4, torch.bfloat16, False, False, False),
    (128, 4, 4, torch.bfloat16, True, False, True),
    (128, 3, 2, torch.float16, True, True, False),
    (64, 5, 6, torch.float32, False, True, True),
    (256, 8, 7, torch.bfloat16, True, False, False),
    (64, 2, 8, torch.bfloat16, False, False, True),
    (128, 6, 3, torch.float32, True, True, True)])
def test_matches_the_codec_and_the_triton_store(d, kb, vb, dtype, center, scales, sink):
    """Random slots (one skipped by −1, one past the cache), a poisoned cache: the CUDA store
    writes what the codec's compress writes (codes bit-exact but for float32 ties at a
    boundary, norms within one bf16 ulp) and what the Triton store writes; other slots keep
    their bytes."""
    g = torch.Generator().manual_seed(d + kb)
    hkv = 3
    codec = offset_codec(d, kb, vb, hkv, g, center=center, scales=scales, sink=sink, seed=5)
    ld = TkvLoader(codec, hkv, 16)
    nblk, n = 9, 101
    cache = torch.randint(0, 256, (nblk, ld.layout.page_bytes), dtype=torch.uint8,
                          generator=g).cuda()
    before, tri = cache.clone(), cache.clone()
    k = (torch.randn(n, hkv, d, generator=g) * 3).to("cuda", dtype)
    v = torch.randn(n, hkv, d, generator=g).to("cuda", dtype)
    if sink:   # a few tokens at the sink offset itself (flagged, zero residual)
        k[:4] = codec.k.sink_offset.reshape(-1, d).expand(hkv, d)[None].to(dtype)
    slots = torch.randperm(nblk * 16, generator=g)[:n].cuda()
    slots[7] = -1
    slots[8] = nblk * 16 + 3   # past the cache: skipped
    compress_store(k, v, cache, slots, ld, kernel="cuda")
    compress_store(k, v, tri, slots, ld, kernel="triton")
    keep = (slots >= 0) & (slots < nblk * 16)
    s = slots[keep]
    b, o = s // 16, s % 16
    views, tviews = ld.layout.views(cache), ld.layout.views(tri)
    for side, bits, x in (("k", kb, k), ("v", vb, v)):
        got = _codes(views, f"{side}_codes", b, o, bits, d)
        want_t = _codes(tviews, f"{side}_codes", b, o, bits, d)
        assert (got == want_t).float().mean() > 0.999
        assert ((got - want_t).abs() <= 1).all()
        if not sink:   # the codec's own compress (sink choice: compared with Triton above)
            sc = codec.k if side == "k" else codec.v
            want = sc.quantize(x[keep].float())[0]
            assert (got == want).float().mean() > 0.999
        nk, nt = views[f"{side}_norms"][b, :, o].float(), tviews[f"{side}_norms"][b, :, o].float()
        torch.testing.assert_close(nk, nt, rtol=8e-3, atol=0)
        assert ((nk < 0) == (nt < 0)).float().mean() > 0.99   # the sink flag (sign bit)
    written = torch.zeros(nblk * 16, dtype=torch.bool, device="cuda")
    written[s] = True
    for name in ("k_codes", "v_codes", "k_norms", "v_norms"):   # bit patterns: the poison
        bits = (lambda t: t.view(torch.int16)) if "norms" in name else (lambda t: t)  # has NaNs
        va = bits(views[name]).transpose(1, 2).reshape(nblk * 16, hkv, -1)
        vb_ = bits(ld.layout.views(before)[name]).transpose(1, 2).reshape(nblk * 16, hkv, -1)
        assert torch.equal(va[~written], vb_[~written])


@gpu_only
def test_long_batches_strided_views_and_few_ctas():
    """A fused-QKV view (token stride 3·Hkv·d) and a grid of one CTA per (head, side): every
    warp walks many token groups; the result equals a wide grid's and the Triton store's."""
    g = torch.Generator().manual_seed(3)
    hkv, d, n = 2, 128, 3000
    ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=4, device="cuda"), hkv, 16)
    qkv = torch.randn(n, 3, hkv, d, generator=g).to("cuda", torch.bfloat16)
    k, v = qkv[:, 1], qkv[:, 2]
    nblk = n // 16 + 2
    slots = torch.randperm(nblk * 16, generator=g)[:n].cuda()
    a, b, t = (ld.layout.allocate(nblk, "cuda") for _ in range(3))
    compress_store(k, v, a, slots, ld, kernel="cuda")
    cuda_store.launch(k, v, b, slots, nblk, ld, ctas_per_sm=1)   # 1 CTA per SM at most
    compress_store(k, v, t, slots, ld, kernel="triton")
    assert torch.equal(a, b)
    va, vt = ld.layout.views(a), ld.layout.views(t)
    for name in ("k_codes", "v_codes"):
        assert (va[name] == vt[name]).float().mean() > 0.998


@gpu_only
def test_nan_input_stores_a_nan_norm_and_valid_codes():
    ld = TkvLoader(TurboKVCodec(64, k_bits=4, v_bits=4, device="cuda"), 1, 16)
    k = torch.randn(4, 1, 64, device="cuda", dtype=torch.bfloat16)
    k[1, 0, 5] = math.nan
    k[2, 0, 7] = math.inf
    cache = ld.layout.allocate(1, "cuda")
    compress_store(k, k, cache, torch.arange(4, device="cuda"), ld, kernel="cuda")
    n = ld.layout.views(cache)["k_norms"][0, 0, :4].float()
    assert n[1].isnan() and n[2].isinf() and n[[0, 3]].isfinite().all()


@gpu_only
def test_graph_replay_equals_eager():
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4, device="cuda",
                                k_channel_offset=torch.randn(128)), 8, 16)
    k = torch.randn(40, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(64, device="cuda")[:40]
    eager = ld.layout.allocate(4, "cuda")
    compress_store(k, v, eager, slots, ld, kernel="cuda")
    cache = ld.layout.allocate(4, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compress_store(k, v, cache, slots, ld, kernel="cuda")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compress_store(k, v, cache, slots, ld, kernel="cuda")
    cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cache, eager)


def test_cuda_device_refusal_names_the_reason(monkeypatch):
    """The CUDA kernels' device refusal says which of its three reasons holds."""
    from tkv.kernels import _util

    assert _util.cuda_device_refusal("cpu") == "needs a CUDA device, got cpu"
    monkeypatch.setattr(_util, "interpreting", lambda: True)
    assert "TRITON_INTERPRET=1" in _util.cuda_device_refusal("cuda")
    monkeypatch.setattr(_util, "interpreting", lambda: False)
    monkeypatch.setattr(_util.torch.version, "cuda", None)
    assert "built with CUDA" in _util.cuda_device_refusal("cuda")
    monkeypatch.setattr(_util.torch.version, "cuda", "13.0")
    assert _util.cuda_device_refusal("cuda:0") is None
