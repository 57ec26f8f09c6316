"""Lloyd-Max codebooks: baked tables, exact-marginal option, fitting, validation."""

import pytest
import torch

from tkv.codec import Codebook, CodebookError, beta_codebook, fit_codebook, gaussian_codebook
from tkv.codec.codebooks import solve_gaussian_lloyd_max

# Lloyd-Max MSE of N(0,1) (Max 1960): the codec's distortion targets.
LLOYD_MAX_MSE = {2: 0.1175, 3: 0.03454, 4: 0.009497, 5: 0.002499, 6: 0.000642}


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_baked_tables_match_a_fresh_solve(bits):
    fresh = solve_gaussian_lloyd_max(bits, iters=50000, tol=1e-15)
    assert torch.allclose(gaussian_codebook(bits).centroids.double(), fresh, atol=1e-6)


@pytest.mark.parametrize("bits", range(2, 9))
def test_baked_tables_are_symmetric_sorted_and_optimal(bits):
    cb = gaussian_codebook(bits)
    c = cb.centroids
    assert c.numel() == 1 << bits and cb.boundaries.numel() == (1 << bits) - 1
    assert torch.all(c[1:] > c[:-1])
    assert torch.allclose(c, -c.flip(0))
    if bits in LLOYD_MAX_MSE:
        x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(bits))
        assert cb.distortion(x) == pytest.approx(LLOYD_MAX_MSE[bits], rel=0.02)


def test_beta_codebook_converges_to_gaussian():
    small = beta_codebook(16, 3)
    big = beta_codebook(1024, 3)
    g = gaussian_codebook(3).centroids
    assert (big.centroids - g).abs().max() < 0.01
    assert (small.centroids - g).abs().max() > (big.centroids - g).abs().max()


def test_fit_codebook_recovers_gaussian_and_beats_it_on_skewed_data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, generator=gen)
    fitted = fit_codebook(x, 3, generator=gen)
    assert (fitted.centroids - gaussian_codebook(3).centroids).abs().max() < 0.03
    skew = torch.distributions.Laplace(0.0, 2**-0.5).sample((400_000,))
    fl = fit_codebook(skew, 3, generator=gen)
    assert fl.distortion(skew) < gaussian_codebook(3).distortion(skew)


@pytest.mark.parametrize("bits", [2, 3, 5, 8])
def test_symmetric_fit(bits):
    """``symmetric=True``: exactly mirror-symmetric; on a skewed sample the free fit is better
    on that sample and the symmetric one on its mirror image and on both together (its own
    Lloyd-Max problem); the free fit of a skewed sample is not symmetric; Gaussian / Beta
    tables are."""
    gen = torch.Generator().manual_seed(bits)
    # skewed, mean 0: Gamma(2, rate 2) − 1 as (E1 + E2) / 2 − 1 with E ~ Exp(1), drawn from
    # ``gen`` so the sample does not depend on which tests ran before (global RNG)
    x = torch.empty(2, 200_000).exponential_(generator=gen).mean(0) - 1.0
    free = fit_codebook(x, bits, iters=100, generator=gen)
    sym = fit_codebook(x, bits, iters=100, generator=gen, symmetric=True)
    assert sym.symmetric and not free.symmetric
    assert gaussian_codebook(bits).symmetric and beta_codebook(64, min(bits, 4)).symmetric
    assert free.distortion(x) < sym.distortion(x)
    assert sym.distortion(-x) < free.distortion(-x)
    both = torch.cat([x, -x])   # the mirrored sample: the symmetric fit is its Lloyd-Max fit
    assert sym.distortion(both) <= free.distortion(both)
    assert sym.distortion(both) < gaussian_codebook(bits).distortion(both)
    # ties at 0 (30 % exact zeros, on the middle boundary): still symmetric, and a fixed point
    # of Lloyd's conditions for the folded problem — each positive centroid the mean of the
    # |z| in its cell (cells from 0, boundaries at the midpoints). The centroids are stored as
    # float32, so a sample within float32 rounding of a midpoint may sit in either neighbouring
    # cell: such samples widen the allowed gap by how far each could move that cell's mean.
    z = torch.where(torch.rand(x.shape, generator=gen) < 0.3, 0.0, x)
    zs = fit_codebook(z, bits, iters=2000, generator=gen, symmetric=True)
    assert zs.symmetric
    pos = zs.centroids.double()[1 << (bits - 1):]
    edges = torch.cat([torch.zeros(1, dtype=torch.float64), (pos[1:] + pos[:-1]) / 2,
                       torch.full((1,), float("inf"), dtype=torch.float64)])
    a = z.abs().double()
    ambiguous = torch.zeros_like(a, dtype=torch.bool)
    for e in edges[1:-1]:
        ambiguous |= (a - e).abs() <= 4 * torch.finfo(torch.float32).eps * e
    for j in range(pos.numel()):
        inside = (a >= edges[j]) & (a < edges[j + 1])
        cell = a[inside]
        if cell.numel():
            mean = float(cell.mean())
            near = a[((a >= edges[j] - 1e-3) & (a < edges[j + 1] + 1e-3)) & ambiguous]
            slack = float((near - mean).abs().sum()) / cell.numel()
            assert abs(mean - float(pos[j])) <= 1e-5 + slack, (j, mean, float(pos[j]), slack)


def test_codebook_validation():
    with pytest.raises(CodebookError):
        Codebook(torch.tensor([0.0, 1.0, 2.0]), 2)
    with pytest.raises(CodebookError):
        Codebook(torch.tensor([0.0, 2.0, 1.0, 3.0]), 2)
    with pytest.raises(CodebookError):
        Codebook(torch.tensor([0.0, 1.0, float("nan"), 3.0]), 2)
    with pytest.raises(CodebookError):
        Codebook.from_centroids([1.0, 2.0, 3.0])
    assert Codebook.from_centroids([-1.0, 0.0, 1.0, 2.0]).bits == 2
