"""The ``prmt`` codebook lookup (PTX inline assembly) checked on the CPU by executing its
exact assembly text with a small emulator of the four instructions it uses, on random code
bytes and random codebooks; the compiled path is checked against the float64 oracle by
``test_kernels.py::test_decode_lookup_variants`` on a GPU."""

import re

import pytest
import torch
import triton
import triton.language as tl

from tkv.kernels.loaders import _PRMT_LUT16 as _ASM
from tkv.kernels.loaders import _prmt_table, tkv_dequant

_PRMT_LUT16 = _ASM.value

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` default mode: byte n of the result is byte ``sel[4n+2:4n]`` of the
    8-byte value ``b:a``, or that byte's sign replicated when ``sel`` bit ``4n+3`` is set."""
    src = (b << 32) | a
    out = 0
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


def _run(asm: str, operands: dict[str, int], lane: int = 0) -> dict[str, int]:
    """Execute the inline-assembly block on 32-bit values (``$n`` operands preset) as the
    thread of ``lane`` (the special registers ``%laneid`` and ``%lanemask_eq``)."""
    regs = dict(operands, **{"%laneid": lane, "%lanemask_eq": 1 << lane})

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        if tok.isdigit():
            return int(tok)
        return regs[tok]

    ops = {"and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
           "xor.b32": lambda a, b: a ^ b, "not.b32": lambda a: ~a,
           "shr.b32": lambda a, b: a >> b, "shl.b32": lambda a, b: a << b,
           "mul.hi.u32": lambda a, b: (a * b) >> 32}
    if "mov.b32" in asm:
        ops["mov.b32"] = lambda a: a
    if "mov.u32" in asm:
        ops["mov.u32"] = lambda a: a
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [t.strip() for t in rest.split(",")]
        if op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op in ops:
            regs[args[0]] = ops[op](*(val(a) for a in args[1:])) & M32
        else:
            raise AssertionError(f"emulator lacks {op}")
    return regs


def _check_two_plane_asm(asm: str, want: list[int], codes, operands=None, lane: int = 0) -> None:
    """Run a two-plane 4-bit lookup asm (code bytes in $4; outputs $0 $1 = low-nibble codes
    of bytes 0-1 / 2-3, $2 $3 = high-nibble codes) on each 4-byte row of ``codes`` and compare
    with the codebook's 16-bit patterns ``want``."""
    for b in codes:
        x = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
        r = _run(asm, {**(operands or {}), "$4": x}, lane)
        lo = [r["$0"] & 0xFFFF, r["$0"] >> 16, r["$1"] & 0xFFFF, r["$1"] >> 16]
        hi = [r["$2"] & 0xFFFF, r["$2"] >> 16, r["$3"] & 0xFFFF, r["$3"] >> 16]
        assert lo == [want[c & 15] for c in b], (b, lo)
        assert hi == [want[c >> 4] for c in b], (b, hi)


def test_prmt_asm_uses_only_emulated_instructions():
    used = set(re.findall(r"^\s*([a-z]+\.[a-z0-9]+)\s", _PRMT_LUT16, re.M))
    assert used <= {"and.b32", "or.b32", "shr.b32", "prmt.b32"}, used


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_prmt_lookup_matches_codebook(half):
    g = torch.Generator().manual_seed(7)
    for trial in range(4):
        table = torch.randn(16, generator=g) * (0.05 + trial)
        words = [int(w) & M32 for w in _prmt_table(table, half)]
        want = (table.to(half).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
        # the asm reads the first register of each table operand ($5, $9, …, $33)
        operands = {f"${5 + 4 * i}": w for i, w in enumerate(words)}
        codes = torch.randint(0, 256, (64, 4), generator=g).tolist()
        codes += [[0, 0, 0, 0], [255, 255, 255, 255], [0x0F, 0xF0, 0x88, 0x77]]
        _check_two_plane_asm(_PRMT_LUT16, want, codes, operands)


def _packed_codebook(g: torch.Generator, trial: int, half: torch.dtype, lookup: int):
    """A random 16-entry codebook (scale 0.1 + trial): its centroids' 16-bit patterns, and the
    P0 constexpr of a 4-bit side (64 code bytes, LOOKUP ``lookup``) carrying its 8 byte-table
    words above bit 24, as ``TkvLoader.side_args`` packs them for prmt1/prmti."""
    from tkv.kernels.loaders import _TABLE_SHIFT

    table = torch.randn(16, generator=g) * (0.1 + trial)
    words = [int(w) & M32 for w in _prmt_table(table, half)]
    want = (table.to(half).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    p0 = 4 + 16 * 64 + 65536 * lookup + (sum(w << (32 * i) for i, w in enumerate(words))
                                         << _TABLE_SHIFT)
    return want, p0


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_prmt1_plane_asm_matches_codebook(half):
    """``prmt1``: the per-plane unary asm (tables as immediates) built at compile time from the
    table words packed into the P0 constexpr — emulated on random bytes and codebooks."""
    from tkv.kernels.loaders import _prmt1_asm

    g = torch.Generator().manual_seed(11)
    for trial in range(3):
        want, p0 = _packed_codebook(g, trial, half, 7)
        asm = [_prmt1_asm.fn(p0, plane) for plane in (0, 1)]
        for a in asm:
            used = set(re.findall(r"^\s*([a-z]+\.[a-z0-9]+)\s", a, re.M))
            assert used <= {"and.b32", "or.b32", "shr.b32", "prmt.b32", "mov.b32"}, used
            assert "$3" not in a   # unary: one input operand ($2), two output words
        codes = torch.randint(0, 256, (64, 4), generator=g).tolist()
        codes += [[0, 0, 0, 0], [255, 255, 255, 255], [0x0F, 0xF0, 0x88, 0x77]]
        for b in codes:
            x = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
            for plane, a in enumerate(asm):
                r = _run(a, {"$2": x})
                got = [r["$0"] & 0xFFFF, r["$0"] >> 16, r["$1"] & 0xFFFF, r["$1"] >> 16]
                assert got == [want[(c >> (4 * plane)) & 15] for c in b], (plane, b, got)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_prmti_asm_matches_codebook(half):
    """``prmti``: the two-plane asm of ``prmt`` with the 8 table words as immediates (packed
    into the P0 constexpr, so the code bytes $4 are the only operand) — emulated on random
    bytes and codebooks, same results as the codebook."""
    from tkv.kernels.loaders import _prmti_asm

    g = torch.Generator().manual_seed(13)
    for trial in range(3):
        want, p0 = _packed_codebook(g, trial, half, 9)
        asm = _prmti_asm.fn(p0)
        used = set(re.findall(r"^\s*([a-z]+\.[a-z0-9]+)\s", asm, re.M))
        assert used <= {"and.b32", "or.b32", "shr.b32", "prmt.b32", "mov.b32"}, used
        assert "$5" not in asm   # the code bytes are the only input operand
        codes = torch.randint(0, 256, (64, 4), generator=g).tolist()
        codes += [[0, 0, 0, 0], [255, 255, 255, 255], [0x0F, 0xF0, 0x88, 0x77]]
        _check_two_plane_asm(asm, want, codes)


def _antisymmetric_codebook(g: torch.Generator, scale: float) -> torch.Tensor:
    """16 sorted centroids with ``c[15 − i] = −c[i]`` exactly (random magnitudes)."""
    mags = (torch.rand(8, generator=g) * scale + 1e-3).sort().values
    return torch.cat([-mags.flip(0), mags])


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_prmts_asm_matches_codebook(half):
    """``prmts``: the antisymmetric form of prmti's asm (positive-half byte tables, sign from
    bit 3 of each code) emulated on random bytes, every byte value in every position, random
    antisymmetric codebooks and the codec's default ones — the same 16-bit values as the
    codebook (and so as prmti, bit for bit)."""
    from tkv.codec import TurboKVCodec
    from tkv.kernels.loaders import _TABLE_SHIFT, _antisymmetric_table, _prmts_asm

    g = torch.Generator().manual_seed(17)
    books = [TurboKVCodec(d, k_bits=4, v_bits=4, device="cpu").k.scaled_centroids
             for d in (64, 128, 256)]
    books += [_antisymmetric_codebook(g, s) for s in (0.05, 1.0, 40.0)]
    for table in books:
        words = [int(w) & M32 for w in _prmt_table(table, half)]
        assert _antisymmetric_table(words)
        want = (table.to(half).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
        p0 = 4 + 16 * 64 + 65536 * 13 + (sum(w << (32 * i) for i, w in enumerate(words))
                                          << _TABLE_SHIFT)
        asm = _prmts_asm.fn(p0)
        used = set(re.findall(r"^\s*([a-z]+\.[a-z0-9]+)\s", asm, re.M))
        assert used <= {"and.b32", "or.b32", "xor.b32", "not.b32", "shr.b32", "shl.b32",
                        "mul.hi.u32", "prmt.b32", "mov.b32"}, used
        assert "$5" not in asm   # the code bytes are the only input operand
        codes = torch.randint(0, 256, (48, 4), generator=g).tolist()
        codes += [[v, (v * 7) % 256, (v * 13 + 5) % 256, 255 - v] for v in range(256)]
        _check_two_plane_asm(asm, want, codes)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_resident_table_asm_gives_the_same_values_on_every_lane(half):
    """``resident_tables``: prmti's and prmts's asm with each lookup's first table word set
    from a per-thread zero ((%lanemask_eq >> %laneid) ^ 1) instead of an immediate — the same
    16-bit values as the codebook on every lane, only the first words changed in form."""
    from tkv.codec import TurboKVCodec
    from tkv.kernels.loaders import _RESIDENT_BIT, _TABLE_SHIFT, _prmti_asm, _prmts_asm

    g = torch.Generator().manual_seed(23)
    table = TurboKVCodec(128, k_bits=4, v_bits=4, device="cpu").k.scaled_centroids
    words = [int(w) & M32 for w in _prmt_table(table, half)]
    want = (table.to(half).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    tw = sum(w << (32 * i) for i, w in enumerate(words)) << _TABLE_SHIFT
    codes = torch.randint(0, 256, (32, 4), generator=g).tolist()
    codes += [[v, (v * 7) % 256, (v * 13 + 5) % 256, 255 - v] for v in range(0, 256, 5)]
    for code, asm_of in ((9, _prmti_asm), (13, _prmts_asm)):
        p0 = 4 + 16 * 64 + 65536 * code + tw
        plain, resident = asm_of.fn(p0), asm_of.fn(p0 + (1 << _RESIDENT_BIT))
        assert "%laneid" in resident and "%laneid" not in plain and "$5" not in resident
        moved = set(re.findall(r"mov\.b32 \w+, (0x[0-9a-f]+)", resident))
        assert len(moved) == len(set(re.findall(r"mov\.b32 \w+, (0x[0-9a-f]+)", plain))) // 2
        for lane in (0, 7, 31):
            _check_two_plane_asm(resident, want, codes, lane=lane)


def test_resident_tables_option_sets_its_bit_for_prmti_and_prmts_only(monkeypatch):
    """TkvLoader(resident_tables=True) marks P0 of prmti / prmts sides (bit _RESIDENT_BIT,
    below the table words) and of no other lookup; a non-bool is refused. (Kernel arguments
    as on a GPU: nothing runs.)"""
    from tkv.codec import TurboKVCodec
    from tkv.kernels import TkvLoader
    from tkv.kernels import loaders as loaders_mod
    from tkv.kernels.loaders import _RESIDENT_BIT

    monkeypatch.setattr(loaders_mod, "interpreting", lambda: False)

    cache = torch.zeros(2, 4096, dtype=torch.uint8)
    codec = TurboKVCodec(128, k_bits=4, v_bits=3, device="cpu")
    for lookup in ("prmti", "prmts", "prmt", "pair", "gather"):
        plain = TkvLoader(codec, 2, 16, lookup=lookup)
        res = TkvLoader(codec, 2, 16, lookup=lookup, resident_tables=True)
        for side in "kv":
            p, r = (ld.side_args(cache[:, :ld.layout.page_bytes], side, torch.bfloat16)[6]
                    for ld in (plain, res))
            marked = lookup in ("prmti", "prmts") and side == "k"   # V is 3-bit: prmtg
            assert r - p == (1 << _RESIDENT_BIT if marked else 0), (lookup, side)
            assert not (p >> _RESIDENT_BIT) & 1
    with pytest.raises(ValueError, match="resident_tables"):
        TkvLoader(codec, 2, 16, resident_tables="1")


def test_antisymmetric_table_check_is_exact():
    """Only a bit-exact antisymmetric codebook with a non-negative upper half qualifies for
    prmts: one ulp off in one entry, a descending order, or a random codebook do not."""
    from tkv.kernels.loaders import _antisymmetric_table

    g = torch.Generator().manual_seed(19)
    for half in (torch.float16, torch.bfloat16):
        book = _antisymmetric_codebook(g, 1.0)
        assert _antisymmetric_table(_prmt_table(book, half).tolist())
        bits = _prmt_table(book, half)
        off = book.to(half).clone()
        off[11] = torch.nextafter(off[11].float(), torch.tensor(9.0)).to(half)
        if off[11] == book.to(half)[11]:   # the float32 step vanished in the 16-bit type
            off[11] = (off[11].view(torch.int16) + 1).view(half)
        assert not _antisymmetric_table(_prmt_table(off.float(), half).tolist())
        assert not _antisymmetric_table(_prmt_table(book.flip(0), half).tolist())
        assert not _antisymmetric_table(_prmt_table(torch.randn(16, generator=g), half).tolist())
        assert bits.shape == (8,)


def test_prmts_selection_and_fallback(monkeypatch):
    """prmts on a 4-bit side with the default (antisymmetric) codebook: LOOKUP 12/13 in P0 with
    the 8 table words packed as for prmti, q·K^T kept, the register-cap / pipelining rules of
    prmti; a fitted codebook that is not antisymmetric falls back to prmti (after the
    per-codebook compile warning); a 2-bit side keeps the group lookup; the interpreter
    refuses it by name."""
    import tkv.kernels.loaders as L
    from tkv.codec import TurboKVCodec
    from tkv.codec.errors import DtypeError

    monkeypatch.setattr(L, "interpreting", lambda: False)
    codec = TurboKVCodec(128, k_bits=4, v_bits=2, device="cpu", seed=3)
    ld = L.TkvLoader(codec, 2, 16, lookup="prmts")
    cache = ld.layout.allocate(2, "cpu")
    for dot, code in ((torch.float16, L.LOOKUP_PRMTS_F16), (torch.bfloat16, L.LOOKUP_PRMTS_BF16)):
        p0 = ld.side_args(cache, "k", dot)[6]
        assert (p0 // 65536) % 256 == code
        words = [int(w) & M32 for w in _prmt_table(ld.k_table.cpu(), dot)]
        assert [(p0 >> (L._TABLE_SHIFT + 32 * i)) & M32 for i in range(8)] == words
    assert ld.lookup_name("k") == "prmts" and ld.lookup_name("v") == "prmt"
    assert not ld.k_operand_a(torch.bfloat16)
    k44 = L.TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4, device="cpu"), 8, 16,
                      lookup="prmts")
    assert k44.decode_num_stages(256, 528) == 2 and k44.decode_num_stages(2048, 528) == 1
    from tkv.codec.codebooks import default_codebook

    book = default_codebook(4, 128).centroids.clone()
    book[3] *= 1.01   # a fitted codebook that is not antisymmetric
    fitted = TurboKVCodec(128, k_bits=4, v_bits=4, device="cpu", k_codebook=book)
    monkeypatch.setattr(L, "_WARNED_PER_CODEBOOK", set())
    with pytest.warns(L.PerCodebookCompileWarning, match="prmts"):
        fb = L.TkvLoader(fitted, 1, 16, lookup="prmts")
    assert fb.lookup_name("k") == "prmti" and fb.lookup_name("v") == "prmts"
    monkeypatch.setattr(L, "interpreting", lambda: True)
    with pytest.raises(DtypeError, match="prmts"):
        ld.side_args(cache, "k", torch.bfloat16)


def test_lookup_selection_per_width_and_backend(monkeypatch):
    """Which lookup each side gets: on CUDA with 16-bit dots (the default ``auto``) prmti for a
    4-bit side with the shared default codebook, prmt for one with its own codebook (prmti
    would compile per codebook), pair tables for 2/3-bit sides; float32 gathers for float32
    dots (the interpreter) and for one-plane sides; an explicit prmt under the interpreter is
    a named error. 2/3-bit sides take the group prmt lookup (pair tables with ``lookup="pair"``). decode's register cap (TKV_PRMTI_MAXNREG, off by default): with prmti on
    a full grid only."""
    import tkv.kernels.loaders as L
    from tkv.codec import TurboKVCodec
    from tkv.codec.codebooks import default_codebook
    from tkv.codec.errors import DtypeError

    codec = TurboKVCodec(128, k_bits=4, v_bits=3, device="cpu", seed=1)
    cache = L.TkvLoader(codec, 2, 16).layout.allocate(2, "cpu")

    def code(ld, side, dot):
        return (ld.side_args(cache, side, dot)[6] // 65536) % 256

    monkeypatch.setattr(L, "interpreting", lambda: False)
    auto = L.TkvLoader(codec, 2, 16)
    assert code(auto, "k", torch.bfloat16) == L.LOOKUP_PRMTI_BF16
    assert code(auto, "k", torch.float16) == L.LOOKUP_PRMTI_F16
    assert code(auto, "v", torch.bfloat16) == L.LOOKUP_PRMTG_BF16     # 3 bits: group prmt
    assert code(auto, "v", torch.float16) == L.LOOKUP_PRMTG_F16
    assert (auto.lookup_name("k"), auto.lookup_name("v")) == ("prmti", "prmt")
    assert code(L.TkvLoader(codec, 2, 16, lookup="pair"), "v", torch.bfloat16) == L.LOOKUP_PAIR_BF16
    monkeypatch.setattr(L, "PRMTI_MAXNREG", 0)                        # the default: no cap
    assert auto.decode_maxnreg(1024, 528) is None
    monkeypatch.setattr(L, "PRMTI_MAXNREG", 128)                      # TKV_PRMTI_MAXNREG=128
    assert auto.decode_maxnreg(1024, 528) == 128
    assert auto.decode_maxnreg(256, 528) is None                      # too few CTAs
    # decode's pipelining (TKV_DECODE_PIPELINE, on by default): prmti on both sides of an
    # under-filled grid only
    k4v4 = L.TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4, device="cpu", seed=1), 2, 16)
    monkeypatch.setattr(L, "DECODE_PIPELINE", True)
    assert k4v4.decode_num_stages(256, 528) == 2
    assert k4v4.decode_num_stages(256, 528, torch.float16) == 2
    assert k4v4.decode_num_stages(528, 528) == 1                      # full grid
    assert k4v4.decode_num_stages(256, 528, block_n=64) == 1          # unmeasured / slower
    assert k4v4.decode_num_stages(256, 528, num_warps=8) == 1
    d64 = L.TkvLoader(TurboKVCodec(64, k_bits=4, v_bits=4, device="cpu", seed=1), 2, 16)
    assert d64.decode_num_stages(256, 528) == 1                       # head_dim 64: unmeasured
    assert auto.decode_num_stages(256, 528) == 1                      # 3-bit V: group prmt
    assert L.TkvLoader(k4v4.codec, 2, 16, lookup="pair").decode_num_stages(256, 528) == 1
    monkeypatch.setattr(L, "DECODE_PIPELINE", False)                  # TKV_DECODE_PIPELINE=0
    assert k4v4.decode_num_stages(256, 528) == 1
    fitted = TurboKVCodec(128, k_bits=4, v_bits=3, device="cpu", seed=1,
                          k_codebook=default_codebook(4, 128).centroids * 1.01)
    own = L.TkvLoader(fitted, 2, 16)
    assert code(own, "k", torch.bfloat16) == L.LOOKUP_PRMT_BF16
    assert own.decode_maxnreg(4096, 528) is None
    assert code(L.TkvLoader(codec, 2, 16, lookup="prmt"), "k", torch.bfloat16) == L.LOOKUP_PRMT_BF16
    assert code(L.TkvLoader(codec, 2, 16, lookup="pair"), "k", torch.bfloat16) == L.LOOKUP_PAIR_BF16
    assert code(L.TkvLoader(codec, 2, 16, lookup="shuffle"), "v", torch.float16) == L.LOOKUP_SHUFFLE
    assert code(L.TkvLoader(codec, 2, 16, lookup="gather"), "k", torch.bfloat16) == L.LOOKUP_GATHER
    monkeypatch.setattr(L, "interpreting", lambda: True)
    assert code(auto, "k", torch.float32) == L.LOOKUP_GATHER
    assert auto.lookup_name("k", torch.float32) == "gather"
    with pytest.raises(DtypeError):
        L.TkvLoader(codec, 2, 16, lookup="prmt").side_args(cache, "k", torch.bfloat16)
    with pytest.raises(DtypeError):
        L.TkvLoader(codec, 2, 16, lookup="prmt1").side_args(cache, "k", torch.bfloat16)


def test_prmt1_selection_packs_the_tables_and_swaps_qk(monkeypatch):
    """prmt1 on a 4-bit side: LOOKUP 6/7 in P0's low bits, the side's 8 byte-table words
    above bit 24, and decode told to use K as the A operand; a 3-bit side takes the group
    prmt lookup, tables as operands (and no swap is asked when K is not prmt1)."""
    import tkv.kernels.loaders as L
    from tkv.codec import TurboKVCodec

    monkeypatch.setattr(L, "interpreting", lambda: False)
    codec = TurboKVCodec(128, k_bits=4, v_bits=3, device="cpu", seed=2)
    ld = L.TkvLoader(codec, 2, 16, lookup="prmt1")
    cache = ld.layout.allocate(2, "cpu")
    p0 = ld.side_args(cache, "k", torch.bfloat16)[6]
    assert (p0 // 65536) % 256 == L.LOOKUP_PRMT1_BF16 and p0 % 16 == 4
    words = [int(w) & M32 for w in _prmt_table(ld.k_table.cpu(), torch.bfloat16)]
    assert [(p0 >> (L._TABLE_SHIFT + 32 * i)) & M32 for i in range(8)] == words
    assert (ld.side_args(cache, "k", torch.float16)[6] // 65536) % 256 == L.LOOKUP_PRMT1_F16
    assert (ld.side_args(cache, "v", torch.bfloat16)[6] // 65536) % 256 == L.LOOKUP_PRMTG_BF16
    assert ld.lookup_name("k") == "prmt1" and ld.k_operand_a(torch.bfloat16)
    assert not L.TkvLoader(codec, 2, 16).k_operand_a(torch.bfloat16)
    swapped = L.TkvLoader(TurboKVCodec(128, k_bits=3, v_bits=4, device="cpu"), 2, 16,
                          lookup="prmt1")
    assert not swapped.k_operand_a(torch.bfloat16) and swapped.lookup_name("v") == "prmt1"


def test_prmti_selection_packs_the_tables_without_swapping(monkeypatch):
    """prmti on a 4-bit side: LOOKUP 8/9 in P0, the 8 table words above bit 24 (as prmt1),
    scores stay q·K^T (no swap asked), a 3-bit side takes the group prmt lookup, and the
    interpreter refuses it by name (PTX inline assembly)."""
    import tkv.kernels.loaders as L
    from tkv.codec import TurboKVCodec
    from tkv.codec.errors import DtypeError

    monkeypatch.setattr(L, "interpreting", lambda: False)
    codec = TurboKVCodec(128, k_bits=4, v_bits=3, device="cpu", seed=3)
    ld = L.TkvLoader(codec, 2, 16, lookup="prmti")
    cache = ld.layout.allocate(2, "cpu")
    p0 = ld.side_args(cache, "k", torch.float16)[6]
    assert (p0 // 65536) % 256 == L.LOOKUP_PRMTI_F16
    words = [int(w) & M32 for w in _prmt_table(ld.k_table.cpu(), torch.float16)]
    assert [(p0 >> (L._TABLE_SHIFT + 32 * i)) & M32 for i in range(8)] == words
    assert (ld.side_args(cache, "k", torch.bfloat16)[6] // 65536) % 256 == L.LOOKUP_PRMTI_BF16
    assert ld.lookup_name("k") == "prmti" and ld.lookup_name("v") == "prmt"
    assert not ld.k_operand_a(torch.bfloat16)
    monkeypatch.setattr(L, "interpreting", lambda: True)
    with pytest.raises(DtypeError, match="prmti"):
        ld.side_args(cache, "k", torch.bfloat16)


def test_lookup_from_env_validates_tkv_lookup():
    """TKV_LOOKUP: unset/blank → "auto", any TkvLoader lookup name passes through, anything
    else is a LookupConfigError naming the variable and the choices."""
    from tkv.kernels import ENV_LOOKUP, LookupConfigError, lookup_from_env

    assert lookup_from_env({}) == "auto"
    assert lookup_from_env({ENV_LOOKUP: "  "}) == "auto"
    for name in ("auto", "pair", "gather", "shuffle", "prmt", "prmt1", "prmti", "prmts"):
        assert lookup_from_env({ENV_LOOKUP: name}) == name
    with pytest.raises(LookupConfigError, match=r"TKV_LOOKUP='prmt2'.*prmti"):
        lookup_from_env({ENV_LOOKUP: "prmt2"})
    # any case, as TKV_PREFILL_ATTENTION; the errors are TkvErrors too (one except clause)
    assert lookup_from_env({ENV_LOOKUP: " PRMTI "}) == "prmti"
    from tkv.codec.errors import TkvError

    assert issubclass(LookupConfigError, TkvError) and issubclass(LookupConfigError, ValueError)


def test_integer_env_options_refuse_huge_values_by_name():
    """A 5,000-digit TKV_DECODE_MIN_SPLIT_TILES used to escape as int()'s own ValueError
    ("Exceeds the limit (4300 digits)"); now the option's named error, message shortened."""
    from tkv.kernels import MinSplitTilesConfigError, decode_min_split_tiles_from_env

    with pytest.raises(MinSplitTilesConfigError, match=r"TKV_DECODE_MIN_SPLIT_TILES=.*5000 char"):
        decode_min_split_tiles_from_env({"TKV_DECODE_MIN_SPLIT_TILES": "7" * 5000})


@pytest.mark.parametrize("parse,name,error,default", [
    ("small_head_groups_from_env", "TKV_SMALL_HEAD_GROUPS", "SmallHeadGroupsConfigError", True),
    ("fused_query_rotation_from_env", "TKV_FUSED_QUERY_ROTATION",
     "FusedQueryRotationConfigError", True),
    ("decode_pipeline_from_env", "TKV_DECODE_PIPELINE", "PipelineConfigError", True),
    ("decode_single_split_from_env", "TKV_DECODE_SINGLE_SPLIT", "SingleSplitConfigError",
     True)])
def test_engine_flags_from_env(parse, name, error, default):
    """The engines' 0/1 kernel options: TKV_SMALL_HEAD_GROUPS, TKV_FUSED_QUERY_ROTATION,
    TKV_DECODE_PIPELINE and TKV_DECODE_SINGLE_SPLIT (both default on) — unset /
    blank → the default, 0 / 1 with blanks around them, anything else a named error."""
    import tkv.kernels as K

    fn, err = getattr(K, parse), getattr(K, error)
    assert fn({}) is default
    assert fn({name: " "}) is default
    assert fn({name: "0"}) is False
    assert fn({name: " 1 "}) is True
    for bad in ("yes", "2", "true", "on", "１"):
        with pytest.raises(err, match=name):
            fn({name: bad})


def test_engine_kernel_settings_parses_and_names_every_variable():
    """engine_kernel_settings: the thirteen TKV_* kernel settings in one call (the launch-time
    check of both engine adapters), the adapter's prefill default applied, a one-line
    description, and each bad value raising its own named error."""
    import tkv.kernels as K
    from tkv.kernels.loaders import MaxnregConfigError

    got = K.engine_kernel_settings({}, prefill_default="auto")
    assert got == ("auto", True, True, "auto", 0, True, True, 0, "auto", "auto", "auto", "split",
                   "auto")
    assert got.describe() == ("TKV_LOOKUP=auto TKV_SMALL_HEAD_GROUPS=1 "
                              "TKV_FUSED_QUERY_ROTATION=1 TKV_PREFILL_ATTENTION=auto "
                              "TKV_PRMTI_MAXNREG=0 TKV_DECODE_PIPELINE=1 "
                              "TKV_DECODE_SINGLE_SPLIT=1 TKV_DECODE_MIN_SPLIT_TILES=0 "
                              "TKV_STORE_ROTATION=auto TKV_DECODE_KERNEL=auto "
                              "TKV_STORE_KERNEL=auto TKV_DECODE_SCHEDULE=split "
                              "TKV_DECODE_CONTEXT=auto")
    env = {"TKV_LOOKUP": "prmt", "TKV_SMALL_HEAD_GROUPS": "0", "TKV_FUSED_QUERY_ROTATION": "0",
           "TKV_PREFILL_ATTENTION": "continuation", "TKV_PRMTI_MAXNREG": "128",
           "TKV_DECODE_PIPELINE": "0", "TKV_DECODE_SINGLE_SPLIT": "0",
           "TKV_DECODE_MIN_SPLIT_TILES": " 8 ", "TKV_STORE_ROTATION": " Matrix ",
           "TKV_DECODE_KERNEL": " Triton", "TKV_STORE_KERNEL": "CUDA",
           "TKV_DECODE_SCHEDULE": "Balanced ", "TKV_DECODE_CONTEXT": "LONG"}
    assert K.engine_kernel_settings(env) == ("prmt", False, False, "continuation", 128, False,
                                             False, 8, "matrix", "triton", "cuda", "balanced",
                                             "long")
    for name, bad, err in (("TKV_LOOKUP", "prmt9", K.LookupConfigError),
                           ("TKV_SMALL_HEAD_GROUPS", "on", K.SmallHeadGroupsConfigError),
                           ("TKV_FUSED_QUERY_ROTATION", "2", K.FusedQueryRotationConfigError),
                           ("TKV_PREFILL_ATTENTION", "fa2", K.PrefillAttentionConfigError),
                           ("TKV_PRMTI_MAXNREG", "12", MaxnregConfigError),
                           ("TKV_DECODE_PIPELINE", "yes", K.PipelineConfigError),
                           ("TKV_DECODE_SINGLE_SPLIT", "2", K.SingleSplitConfigError),
                           ("TKV_DECODE_MIN_SPLIT_TILES", "-1", K.MinSplitTilesConfigError),
                           ("TKV_STORE_ROTATION", "butterfly", K.StoreRotationConfigError),
                           ("TKV_DECODE_KERNEL", "gluon", K.DecodeKernelConfigError),
                           ("TKV_STORE_KERNEL", "gluon", K.StoreKernelConfigError),
                           ("TKV_DECODE_SCHEDULE", "stream-k", K.DecodeScheduleConfigError),
                           ("TKV_DECODE_CONTEXT", "8k", K.DecodeContextConfigError)):
        with pytest.raises(err, match=name):
            K.engine_kernel_settings({**env, name: bad})


@pytest.mark.parametrize("raw,want", [("", 0), (" ", 0), ("0", 0), (" 8 ", 8), ("4096", 4096),
                                      ("4097", None), ("-1", None), ("2.0", None), ("8k", None),
                                      ("８", None), ("+8", None)])
def test_min_split_tiles_env(raw, want):
    """TKV_DECODE_MIN_SPLIT_TILES: 0 / blank = off, 1..4096 tiles per split, anything else a
    named error."""
    import tkv.kernels as K

    if want is None:
        with pytest.raises(K.MinSplitTilesConfigError, match="TKV_DECODE_MIN_SPLIT_TILES"):
            K.decode_min_split_tiles_from_env({"TKV_DECODE_MIN_SPLIT_TILES": raw})
    else:
        assert K.decode_min_split_tiles_from_env({"TKV_DECODE_MIN_SPLIT_TILES": raw}) == want
    assert K.decode_min_split_tiles_from_env({}) == 0


@pytest.mark.parametrize("raw,want", [("", 0), ("0", 0), (" 128 ", 128), ("255", 255),
                                      ("12", None), ("300", None), ("lots", None), ("-1", None),
                                      ("1e2", None), ("12.0", None), ("²", None), ("１２８", None),
                                      ("1_28", None), ("+128", None)])
def test_prmti_maxnreg_env(monkeypatch, raw, want):
    """TKV_PRMTI_MAXNREG: 0 / empty = no register cap, 64..255 a cap, anything else a named
    error (at the engines' startup validation or the first kernel call), not a Triton failure
    at the first decode."""
    import tkv.kernels.loaders as L

    monkeypatch.setenv(L.ENV_PRMTI_MAXNREG, raw)
    if want is None:
        with pytest.raises(L.MaxnregConfigError, match="TKV_PRMTI_MAXNREG"):
            L._prmti_maxnreg_from_env()
    else:
        assert L._prmti_maxnreg_from_env() == want


@pytest.mark.parametrize("name,bad,error", [
    ("TKV_PRMTI_MAXNREG", "abc", "MaxnregConfigError"),
    ("TKV_DECODE_PIPELINE", "yes", "PipelineConfigError"),
    ("TKV_DECODE_SINGLE_SPLIT", "2", "SingleSplitConfigError"),
    ("TKV_DECODE_MIN_SPLIT_TILES", "-1", "MinSplitTilesConfigError"),
    ("TKV_STORE_ROTATION", "butterfly", "StoreRotationConfigError")])
def test_a_bad_import_time_setting_is_raised_at_use_not_at_import(name, bad, error):
    """The engines import tkv's kernels while registering their plugins: a bad value of a
    setting read at import must not raise there (vLLM's load_general_plugins would fail for
    every run, tkv or not; SGLang buried it under a usage dump — helper break-test, session
    28). The import succeeds; engine_kernel_settings() (the engines' launch-time check),
    Workspace, decode, prefill and compress_store raise the named error."""
    import os
    import subprocess
    import sys

    code = f"""
import torch, tkv.kernels as K
from tkv.codec import TurboKVCodec
def raises(fn):
    try:
        fn()
    except K.{error} as e:
        assert "{name}" in str(e), e
        return True
    return False
ld = K.TkvLoader(TurboKVCodec(64, 4), 1, 16)
cache = ld.layout.allocate(1)
x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
one = torch.ones(1, dtype=torch.int32)
calls = [K.engine_kernel_settings, lambda: K.Workspace(1, 1, 64, "cpu"),
         lambda: K.compress_store(x, x, cache, torch.zeros(1, dtype=torch.int64), ld),
         lambda: K.decode(x, cache, one.view(1, 1) * 0, one, ld, None),
         lambda: K.prefill(x, x, x, torch.tensor([0, 1], dtype=torch.int32), one, 1, cache,
                           one.view(1, 1) * 0, ld)]
print([raises(c) for c in calls])
"""
    env = {**os.environ, name: bad, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[True, True, True, True, True]", (r.stdout, r.stderr[-800:])


def test_immediate_table_lookup_with_a_fitted_codebook_warns_once(monkeypatch):
    """prmti / prmt1 bake the table into the kernel: asked for a fitted codebook they compile
    per layer, which an operator should hear about (once), while the shared default codebook
    and ``auto`` stay silent."""
    import warnings

    import tkv.kernels.loaders as L
    from tkv.codec import TurboKVCodec
    from tkv.codec.codebooks import default_codebook

    monkeypatch.setattr(L, "_WARNED_PER_CODEBOOK", set())
    fitted = TurboKVCodec(64, 4, device="cpu", seed=3,
                          k_codebook=default_codebook(4, 64).centroids * 1.02)
    shared = TurboKVCodec(64, 4, device="cpu", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        L.TkvLoader(shared, 1, 16, lookup="prmti")
        L.TkvLoader(fitted, 1, 16)                      # auto: prmt for the fitted side
    with pytest.warns(L.PerCodebookCompileWarning, match="compiles its own"):
        L.TkvLoader(fitted, 1, 16, lookup="prmti")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        L.TkvLoader(fitted, 1, 16, lookup="prmti")      # once per process


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_group_lut_asm_matches_codebook(bits, half):
    """The 2/3-bit group lookups (``_lut_asm``, ``pack=2``: two code groups per call, one
    output word per plane holding both groups' centroids) emulated on random group words and
    codebooks, plus the all-zero / all-one groups: every plane of both groups equals the
    codebook's 16-bit centroid."""
    from tkv.kernels._lut_asm import LUT_PACK, byte_table_words, lut_asm, lut_constraints

    asm = lut_asm(bits)
    used = set(re.findall(r"^\s*([a-z]+\.[a-z0-9]+)\s", asm, re.M))
    assert used <= {"and.b32", "or.b32", "shr.b32", "shl.b32", "prmt.b32"}, used
    np_, group_bits = {2: (4, 8), 3: (8, 24)}[bits]
    n_ops = len(lut_constraints(bits).split(","))
    assert n_ops == np_ + LUT_PACK * (1 + len(byte_table_words(torch.zeros(1 << bits))))
    g = torch.Generator().manual_seed(bits)
    for trial in range(3):
        table = torch.randn(1 << bits, generator=g) * (0.1 + trial)
        want = (table.to(half).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
        words = [int(w) & M32 for w in _prmt_table(table, half)]
        operands = {f"${np_ + LUT_PACK * (1 + i)}": w for i, w in enumerate(words)}
        groups = torch.randint(0, 1 << group_bits, (200, 2), generator=g).tolist()
        groups += [[0, (1 << group_bits) - 1], [(1 << group_bits) - 1, 0]]
        for a, b in groups:
            r = _run(asm, {**operands, f"${np_}": a, f"${np_ + 1}": b})
            for p in range(np_):
                ca, cb = (a >> (bits * p)) & ((1 << bits) - 1), (b >> (bits * p)) & ((1 << bits) - 1)
                assert r[f"${p}"] == want[ca] | want[cb] << 16, (bits, p, a, b)
    with pytest.raises(ValueError):
        lut_asm(5)


@triton.jit
def _dequant_tile(raw_ptr, table, out, P0: tl.constexpr, NP: tl.constexpr, N: tl.constexpr,
                  G: tl.constexpr):
    """``tkv_dequant`` of one ``[N, G]`` tile of code groups; plane p stored at ``out[p]``."""
    r = tl.arange(0, N)[:, None] * G + tl.arange(0, G)[None, :]
    planes = tkv_dequant(tl.load(raw_ptr + r), table, P0, 0, 0, 0, NP, G * NP, tl.float32)
    for p in tl.static_range(NP):
        tl.store(out + p * N * G + r, planes[p])


@pytest.mark.parametrize("bits", [2, 3])
def test_group_lookup_small_tile_fallback_gathers(bits):
    """A tile of fewer than 512 code groups (where ``pack=2`` could leave a thread one
    element) takes the float32 centroids stored after the byte tables: the dequant function
    itself, run under the interpreter on random groups, equals the codebook."""
    import tkv.kernels.loaders as L
    from tkv.kernels._util import interpreting

    if not interpreting():
        pytest.skip("the fallback is checked under TRITON_INTERPRET=1")
    np_, group_bits = {2: (4, 8), 3: (8, 24)}[bits]
    g = torch.Generator().manual_seed(5)
    table = torch.randn(1 << bits, generator=g)
    tab = L._prmt_group_table(table, torch.bfloat16)
    n, gr = 16, 16
    raw = torch.randint(0, 1 << group_bits, (n, gr), generator=g, dtype=torch.int32)
    out = torch.full((np_, n, gr), float("nan"))
    p0 = bits + 16 * 48 + 65536 * L.LOOKUP_PRMTG_BF16 + ((np_.bit_length() - 1) << L._GROUP_SHIFT)
    _dequant_tile[(1,)](raw, tab, out, P0=p0, NP=np_, N=n, G=gr)
    codes = torch.stack([(raw >> (bits * p)) & ((1 << bits) - 1) for p in range(np_)])
    assert torch.equal(out, table[codes.long()])

