"""Bit packing: exact round trip for every width, the documented LSB-first bit order."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tkv.codec import BitWidthError, DtypeError, ShapeError, pack_codes, unpack_codes
from tkv.codec.packing import packed_bytes


def _reference_pack(codes: list[int], bits: int) -> list[int]:
    """Straight transcription of the documented rule: code bit j -> stream bit i*b + j."""
    out = [0] * ((len(codes) * bits + 7) // 8)
    for i, c in enumerate(codes):
        for j in range(bits):
            if c >> j & 1:
                s = i * bits + j
                out[s // 8] |= 1 << (s % 8)
    return out


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("n", [1, 7, 64, 80, 97, 128, 576])
def test_round_trip_and_bit_order(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (5, 3, n), generator=g)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (5, 3, packed_bytes(n, bits)) == (5, 3, -(-n * bits // 8))
    assert torch.equal(unpack_codes(packed, bits, n), codes)
    ref = _reference_pack(codes[0, 0].tolist(), bits)
    assert packed[0, 0].tolist() == ref


def test_bit_order_golden():
    # 3-bit codes 1..8 (mod 8): stream 001 010 011 100 101 110 111 000, LSB first.
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    assert pack_codes(codes, 3).tolist() == [0b11010001, 0b01011000, 0b00011111]
    assert pack_codes(torch.tensor([0x3, 0xA]), 4).tolist() == [0xA3]


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(2, 8), n=st.integers(1, 300), lead=st.lists(st.integers(1, 3), max_size=2),
       seed=st.integers(0, 2**31 - 1))
def test_round_trip_property(bits, n, lead, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, n), generator=g)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, n), codes)


def test_bad_inputs():
    with pytest.raises(BitWidthError):
        pack_codes(torch.zeros(4, dtype=torch.int64), 9)
    with pytest.raises(BitWidthError):
        pack_codes(torch.zeros(4, dtype=torch.int64), 1)
    with pytest.raises(DtypeError):
        pack_codes(torch.zeros(4), 4)
    with pytest.raises(DtypeError):
        unpack_codes(torch.zeros(4, dtype=torch.int32), 4, 8)
    with pytest.raises(ShapeError):
        unpack_codes(torch.zeros(5, dtype=torch.uint8), 4, 8)
    with pytest.raises(DtypeError, match=r"torch\.Tensor"):
        pack_codes([1, 2], 4)
    with pytest.raises(DtypeError, match=r"torch\.Tensor"):
        unpack_codes(b"\x00", 4, 2)
    for n in (-1, 0, 8.0, True):
        with pytest.raises(ShapeError, match="num_codes"):
            unpack_codes(torch.zeros(4, dtype=torch.uint8), 4, n)


@pytest.mark.parametrize("bits,codes", [(4, [16, 0, 0, 0]), (3, [-1, 0, 0, 0, 0, 0, 0, 0]),
                                        (8, [300, 1]), (2, [0, 4])])
def test_out_of_range_codes_are_refused(bits, codes):
    """A code outside [0, 2**bits) would spill into its neighbours' bits (4 bits: [16, 0, 0, 0]
    unpacked as [0, 1, 0, 0]): refused by name, and check_range=False (the codec's own,
    in-range codes) skips the reduction."""
    with pytest.raises(BitWidthError, match=rf"\[0, {1 << bits}\)"):
        pack_codes(torch.tensor(codes), bits)
    ok = torch.tensor(codes).clamp(0, (1 << bits) - 1)
    assert torch.equal(unpack_codes(pack_codes(ok, bits), bits, len(codes)), ok)
    pack_codes(torch.tensor(codes), bits, check_range=False)   # no check, no error
