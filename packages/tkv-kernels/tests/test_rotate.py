"""tkv.kernels.rotate.rotate_rows against a float64 reference (CPU under TRITON_INTERPRET=1)."""

import pytest
import torch

from tkv.codec.errors import DtypeError, ShapeError
from tkv.kernels._util import interpreting
from tkv.kernels.rotate import RotateLaunch, launch_plan, rotate_rows

DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize(("t", "h", "k", "n", "xdt", "odt", "mu_rows"), [
    (37, 3, 64, 64, torch.bfloat16, torch.bfloat16, 3),    # keys: per-head centering
    (5, 9, 64, 64, torch.float16, torch.float32, None),    # decode queries -> float32
    (11, 2, 96, 128, torch.bfloat16, torch.bfloat16, 1),   # head_dim 96 into 128 planar columns
    (7, 4, 128, 96, torch.float32, torch.bfloat16, None),  # planar float32 rows back to 96
])
def test_rotate_rows_matches_float64(t, h, k, n, xdt, odt, mu_rows):
    args, _, ref = _strided_case(t, h, k, n, xdt, odt, mu_rows, seed=t * 131 + k)
    err = _rel_err(rotate_rows(*args).cpu(), ref)
    assert err < (4e-3 if odt != torch.float32 else 1e-5), err


def _strided_case(t, h, k, n, xdt, odt, mu_rows, seed):
    """``[x, m, out, mu]`` on DEV — x ``(t, h, k)`` strided rows (unit stride inside a row),
    out a NaN-filled view with 2 / 3 columns of margin (``out_big``, returned on DEV too) —
    and the float64 ``x @ m − mu``."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(t, h + 1, k + 8, generator=g).to(xdt)
    x = big[:, 1:, 3:3 + k]
    m = torch.randn(k, n, generator=g) / k ** 0.5
    mu = None if mu_rows is None else torch.randn(mu_rows, n, generator=g)
    out_big = torch.full((t, h, n + 5), float("nan"), dtype=odt, device=DEV)
    args = [a.to(DEV) if a is not None else None for a in (x, m, None, mu)]
    args[2] = out_big[:, :, 2:2 + n]
    ref = x.double() @ m.double() - (0 if mu is None else mu.double()[:, None, :].transpose(0, 1))
    return args, out_big, ref


def _rel_err(res, ref) -> float:
    return ((res.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(("block_r", "num_warps"), [(64, 4), (128, 8)])
def test_rotate_rows_launch_overrides_give_the_same_rows(block_r, num_warps):
    # more rows per program than the default (the matrix read once per block_r rows)
    g = torch.Generator().manual_seed(block_r)
    x = torch.randn(53, 3, 128, generator=g).to(torch.bfloat16)
    m = torch.randn(128, 128, generator=g) / 128 ** 0.5
    mu = torch.randn(3, 128, generator=g)
    ref = x.double() @ m.double() - mu.double()[None]
    res = rotate_rows(x.to(DEV), m.to(DEV), torch.empty(53, 3, 128, device=DEV), mu.to(DEV),
                      block_r=block_r, num_warps=num_warps).cpu()
    assert ((res.double() - ref).norm() / ref.norm()).item() < 1e-5
    for bad in ({"block_r": 48}, {"block_r": 8}, {"num_warps": 3}, {"block_r": 64.0}):
        with pytest.raises(ShapeError):
            rotate_rows(x.to(DEV), m.to(DEV), torch.empty(53, 3, 128, device=DEV), **bad)


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float16, torch.float32])
def test_rotate_rows_bf16_split_is_close_to_float64(xdt):
    # bf16 hi/lo passes: ~2^-16 relative, far below a bf16 output's rounding (2^-9)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 3, 128, generator=g).to(xdt)
    m = torch.randn(128, 128, generator=g) / 128 ** 0.5
    mu = torch.randn(3, 128, generator=g)
    ref = x.double() @ m.double() - mu.double()[None]
    res = rotate_rows(x.to(DEV), m.to(DEV), torch.empty(37, 3, 128, device=DEV), mu.to(DEV),
                      bf16_split=True).cpu()
    assert ((res.double() - ref).norm() / ref.norm()).item() < 1e-4
    with pytest.raises(DtypeError):
        rotate_rows(x.to(DEV), m.to(DEV), torch.empty(37, 3, 128, device=DEV), bf16_split=1)


def test_rotate_rows_prefill_sized_default_launch():
    # from 65,536 rows the default launch takes 128 rows per program (rows not a multiple of it)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2051, 32, 128, generator=g).to(torch.bfloat16)
    m = torch.randn(128, 128, generator=g) / 128 ** 0.5
    res = rotate_rows(x.to(DEV), m.to(DEV), torch.empty(2051, 32, 128, dtype=torch.bfloat16,
                                                        device=DEV)).cpu()
    ref = x.double() @ m.double()
    assert ((res.double() - ref).norm() / ref.norm()).item() < 4e-3


def test_rotate_rows_writes_only_its_columns():
    x = torch.randn(4, 2, 64).to(DEV)
    m = torch.randn(64, 64).to(DEV)
    out_big = torch.full((4, 2, 70), float("nan"), device=DEV)
    rotate_rows(x, m, out_big[:, :, 3:67])
    assert torch.isnan(out_big[:, :, :3]).all() and torch.isnan(out_big[:, :, 67:]).all()
    assert torch.isfinite(out_big[:, :, 3:67]).all()


@pytest.mark.parametrize("bad", ["k", "out", "mu", "dtype", "stride"])
def test_rotate_rows_refuses_malformed_input(bad):
    x = torch.randn(4, 2, 64)
    m = torch.randn(64, 32)
    out = torch.empty(4, 2, 32)
    mu = None
    if bad == "k":
        m = torch.randn(48, 32)
    elif bad == "out":
        out = torch.empty(4, 3, 32)
    elif bad == "mu":
        mu = torch.randn(3, 32)
    elif bad == "dtype":
        m = m.double()
    else:
        x = torch.randn(4, 2, 128)[:, :, ::2]
    with pytest.raises(ShapeError):
        rotate_rows(x, m, out, mu)


@pytest.mark.parametrize(("t", "h", "k", "n", "xdt", "odt", "mu_rows", "block_r"), [
    (53, 3, 128, 128, torch.bfloat16, torch.bfloat16, 3, 16),   # 10 tiles over 4 programs
    (29, 5, 64, 64, torch.float32, torch.bfloat16, 1, 32),      # float32 rows: 3 passes
    (11, 2, 96, 128, torch.float16, torch.float32, None, 16),   # head_dim 96 into 128 columns
])
def test_rotate_rows_persistent_matches_float64(t, h, k, n, xdt, odt, mu_rows, block_r):
    # the persistent launch: bf16 hi/lo halves of m split once per program, tiles looped
    args, out_big, ref = _strided_case(t, h, k, n, xdt, odt, mu_rows, seed=t * 7 + n)
    res = rotate_rows(*args, persistent=True, block_r=block_r).cpu()
    err = _rel_err(res, ref)
    assert err < (4e-3 if odt != torch.float32 else 1e-4), err
    assert torch.isnan(out_big.cpu()[:, :, :2]).all() and torch.isnan(out_big.cpu()[:, :, -3:]).all()
    # one program walking every tile gives the same rows
    one = rotate_rows(*args[:2], torch.empty_like(args[2]), args[3], persistent=True,
                      block_r=block_r, programs=1).cpu()
    assert torch.equal(one, res)


def test_rotate_rows_persistent_refuses_what_it_cannot_hold():
    x = torch.randn(4, 2, 256).to(DEV)
    with pytest.raises(ShapeError):
        rotate_rows(x, torch.randn(256, 256).to(DEV), torch.empty(4, 2, 256, device=DEV),
                    persistent=True)
    x, m, out = torch.randn(4, 2, 64).to(DEV), torch.randn(64, 64).to(DEV), torch.empty(4, 2, 64)
    for bad in ({"programs": 0}, {"num_stages": 0}, {"programs": 2.0}, {"persistent": 1}):
        with pytest.raises((ShapeError, DtypeError)):
            rotate_rows(x, m, out.to(DEV), **({"persistent": True} | bad))


def test_launch_plan_defaults_and_overrides():
    """Prefill-sized row counts take the persistent launch (2 programs per SM, 64-row tiles,
    4 warps, 3 stages: session 25's H100 sweep); fewer rows, wider matrices or
    persistent=False keep the one-tile launch; overrides are kept and checked."""
    wide = 65536
    assert launch_plan(8 * wide, 128, 128) == RotateLaunch(True, 64, 4, 3)
    assert launch_plan(wide, 16, 16).persistent
    assert launch_plan(wide - 1, 128, 128) == RotateLaunch(False, 32, 8, 3)
    assert launch_plan(100, 128, 128) == RotateLaunch(False, 16, 8, 3)
    assert launch_plan(8 * wide, 128, 128, persistent=False) == RotateLaunch(False, 128, 8, 3)
    assert launch_plan(8 * wide, 256, 128) == RotateLaunch(False, 128, 8, 3)   # K too wide
    assert launch_plan(8 * wide, 128, 256) == RotateLaunch(False, 16, 8, 3)    # N too wide
    assert launch_plan(8 * wide, 128, 128, block_r=128, num_warps=8, num_stages=2) == \
        RotateLaunch(True, 128, 8, 2)
    assert launch_plan(10, 64, 64, persistent=True) == RotateLaunch(True, 64, 4, 3)
    for bad in ({"persistent": True, "k_pad": 256}, {"block_r": 48}, {"num_warps": 3},
                {"num_stages": 0}, {"persistent": 1}, {"block_r": 512}, {"rows": -5},
                {"rows": 1.5}, {"k_pad": 96}, {"n_pad": 8}):
        kw = {"rows": 8 * wide, "k_pad": 128, "n_pad": 128} | bad
        with pytest.raises((ShapeError, DtypeError)):
            launch_plan(kw.pop("rows"), kw.pop("k_pad"), kw.pop("n_pad"), **kw)


def test_rotate_rows_takes_the_persistent_launch_from_wide_rows():
    """65,536 rows (the threshold) of 16 → 16 into float32: the default call equals the
    explicit persistent launch bit for bit, differs from the tf32x3 launch in the last bits,
    and both match the float64 product."""
    g = torch.Generator().manual_seed(25)
    x = torch.randn(8192, 8, 16, generator=g).to(DEV, torch.bfloat16)
    m = torch.randn(16, 16, generator=g).to(DEV)
    ref = x.double().cpu() @ m.double().cpu()
    auto = rotate_rows(x, m, torch.empty(8192, 8, 16, device=DEV)).cpu()
    pers = rotate_rows(x, m, torch.empty(8192, 8, 16, device=DEV), persistent=True).cpu()
    tf32 = rotate_rows(x, m, torch.empty(8192, 8, 16, device=DEV), persistent=False).cpu()
    assert torch.equal(auto, pers) and not torch.equal(auto, tf32)
    assert _rel_err(auto, ref) < 1e-4 and _rel_err(tf32, ref) < 1e-5
