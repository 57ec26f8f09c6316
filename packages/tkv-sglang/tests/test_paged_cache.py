"""TkvPagedCache: pages laid out by SlotLayout, token-granular store/move/gather/scatter
agree with the codec on fresh random K/V."""

from __future__ import annotations

import pytest
import torch

from tkv.codec import DtypeError, ShapeError, SlotLayout, TurboKVCodec
from tkv.sglang.paged_cache import TkvPagedCache

H, D, PAGE = 2, 64, 16


def _cache(bits=((3, 5), (8, 2)), pages=6):
    lays = [SlotLayout(D, H, kb, vb, PAGE) for kb, vb in bits]
    codecs = [TurboKVCodec(D, k_bits=kb, v_bits=vb, seed=7 + i) for i, (kb, vb) in enumerate(bits)]
    return TkvPagedCache(lays, pages), codecs


def test_buffers_follow_slotlayout():
    c, _ = _cache()
    assert [tuple(b.shape) for b in c.buffers] == [(6, l.page_bytes) for l in c.layouts]
    assert all(b.dtype == torch.uint8 for b in c.buffers)
    assert c.nbytes == 6 * sum(l.page_bytes for l in c.layouts)


def test_store_reference_writes_codec_bytes_at_slots():
    g = torch.Generator().manual_seed(0)
    c, codecs = _cache()
    loc = torch.tensor([16, 17, 45, 33, 80])       # pages 1,1,2,2,5 — any order
    k = torch.randn(5, H, D, generator=g)
    v = torch.randn(5, H, D, generator=g)
    c.store_reference(1, loc, k, v, codecs[1])
    reg = c.gather(1, loc)
    kc, kn = codecs[1].compress_k(k)
    vc, vn = codecs[1].compress_v(v)
    assert torch.equal(reg["k_codes"], kc) and torch.equal(reg["k_norms"], kn)
    assert torch.equal(reg["v_codes"], vc) and torch.equal(reg["v_norms"], vn)
    # explicit SlotLayout arithmetic for one token: page 2, offset 13, head 1
    lay = c.layouts[1]
    page = c.buffers[1][2]
    start = lay.k_codes_offset + (1 * PAGE + 13) * lay.k_code_bytes
    assert torch.equal(page[start: start + lay.k_code_bytes], kc[2, 1])
    # decompressed K is close to the input (8-bit K on layer 1)
    rk = codecs[1].decompress_k(reg["k_codes"], reg["k_norms"])
    assert torch.allclose(rk, k, atol=0.05 * k.abs().max())
    # other layer untouched
    assert not c.buffers[0].any()


def test_move_copies_all_layers_and_gather_scatter_round_trip():
    g = torch.Generator().manual_seed(1)
    c, codecs = _cache()
    src = torch.tensor([20, 21, 22])
    for i in range(2):
        c.store_reference(i, src, torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g),
                          codecs[i])
    before = [c.gather(i, src) for i in range(2)]
    dst = torch.tensor([64, 65, 79])
    c.move(dst, src)
    for i in range(2):
        after = c.gather(i, dst)
        assert all(torch.equal(after[r], before[i][r]) for r in after)
    c2, _ = _cache()
    for i in range(2):
        c2.scatter(i, src, before[i])
        assert all(torch.equal(c2.gather(i, src)[r], before[i][r]) for r in before[i])


def test_bad_inputs_are_named_errors():
    c, codecs = _cache()
    with pytest.raises(ShapeError):
        c.store_reference(0, torch.tensor([1, 2]), torch.randn(2, H, 32), torch.randn(2, H, 32), codecs[0])
    with pytest.raises(DtypeError):
        c.gather(0, torch.tensor([1.0]))
    with pytest.raises(ShapeError):
        TkvPagedCache([SlotLayout(D, H, 4, 4, 16), SlotLayout(D, H, 4, 4, 32)], 4)
    with pytest.raises(ShapeError):
        c.move(torch.tensor([1, 2]), torch.tensor([3]))
