"""Lloyd-Max scalar codebooks for the rotated coordinates.

Units: every codebook in tkv lives in *standardized* units. After the random rotation a unit
vector's coordinate ``u_i`` has variance ``1/d``; the codebook quantizes ``z = sqrt(d) * u_i``,
which has variance 1. A codebook for ``b`` bits holds ``2**b`` sorted centroids and
``2**b - 1`` decision boundaries (the midpoints between neighbouring centroids, the nearest-
neighbour condition of Lloyd-Max).

Three sources of codebooks:

* :func:`gaussian_codebook` — the Lloyd-Max quantizer for N(0, 1) (Max 1960, Lloyd 1982);
  the TurboQuant paper (Zandieh et al. 2025, Sec. 3.1) uses it because a coordinate of a
  randomly rotated unit vector in high dimension is ~N(0, 1/d). Baked into
  :mod:`tkv.codec._gaussian_tables` (solved once, offline, by :func:`solve_gaussian_lloyd_max`),
  so importing tkv never runs an iterative solve.
* :func:`beta_codebook` — the exact marginal of a coordinate of a uniform point on the sphere
  S^{d-1}: ``f(u) ∝ (1 - u²)^((d-3)/2)`` (TurboQuant, Lemma 1). Solved on demand, cached.
* :func:`fit_codebook` — Lloyd's algorithm on samples (calibration fits per-layer codebooks).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .errors import CodebookError
from .packing import check_bits

__all__ = [
    "Codebook",
    "beta_codebook",
    "default_codebook",
    "fit_codebook",
    "gaussian_codebook",
    "solve_gaussian_lloyd_max",
]


@dataclass(frozen=True, eq=False)
class Codebook:
    """A scalar quantizer in standardized units (see module docstring).

    Attributes:
        centroids: float32 ``(2**bits,)``, strictly increasing.
        boundaries: float32 ``(2**bits - 1,)``, midpoints of consecutive centroids.
        bits: code width, 2..8.

    Raises:
        CodebookError: size is not ``2**bits``, entries non-finite or not strictly increasing.
    """

    centroids: torch.Tensor
    bits: int

    def __post_init__(self) -> None:
        check_bits(self.bits)
        c = torch.as_tensor(self.centroids).detach().to(device="cpu", dtype=torch.float64)
        if c.dim() != 1 or c.numel() != 1 << self.bits:
            raise CodebookError(
                f"a {self.bits}-bit codebook needs {1 << self.bits} centroids, "
                f"got shape {tuple(c.shape)}"
            )
        if not torch.isfinite(c).all():
            raise CodebookError("codebook centroids must be finite")
        if not (c[1:] > c[:-1]).all():
            raise CodebookError("codebook centroids must be strictly increasing")
        c = c.to(torch.float32).double()  # boundaries from the stored float32 centroids
        if not (c[1:] > c[:-1]).all():
            raise CodebookError("codebook centroids collapse in float32")
        object.__setattr__(self, "centroids", c.to(torch.float32))
        object.__setattr__(self, "boundaries", ((c[1:] + c[:-1]) / 2).to(torch.float32))

    boundaries: torch.Tensor = None  # type: ignore[assignment]  # set in __post_init__

    @classmethod
    def from_centroids(cls, centroids, bits: int | None = None) -> Codebook:
        """Build from a sequence/tensor of ``2**bits`` centroids (``bits`` inferred if None).

        Raises:
            CodebookError: not a real 1-D sequence of numbers, or a size that is not a power
            of two."""
        if isinstance(centroids, (str, bytes, int, float)) or (
                isinstance(centroids, torch.Tensor) and (centroids.is_complex()
                                                         or centroids.dim() != 1)):
            raise CodebookError(f"a codebook is a 1-D sequence of 2**bits real centroids, got "
                                f"{type(centroids).__name__}")
        try:
            c = torch.as_tensor(centroids, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise CodebookError(f"a codebook is a 1-D sequence of 2**bits real centroids: "
                                f"{e}") from None
        if c.dim() != 1:
            raise CodebookError(f"a codebook is 1-D, got shape {tuple(c.shape)}")
        if bits is None:
            n = c.numel()
            bits = n.bit_length() - 1
            if n < 1 or 1 << bits != n:
                raise CodebookError(f"codebook size must be a power of two, got {n}")
        return cls(c, bits)

    def distortion(self, samples: torch.Tensor) -> float:
        """Mean squared error of quantizing ``samples`` (standardized units) with this codebook."""
        x = samples.reshape(-1).to(torch.float64)
        idx = torch.bucketize(x, self.boundaries.to(torch.float64))
        return float(((x - self.centroids.to(torch.float64)[idx]) ** 2).mean())

    @property
    def symmetric(self) -> bool:
        """Whether ``centroids[n − 1 − i] == −centroids[i]`` for every ``i`` (to float32
        rounding) — the Gaussian and Beta codebooks are,
        and :func:`fit_codebook` with ``symmetric=True`` makes fits so; each mirrored pair is
        compared against its own magnitude, 1e-6 relative). A symmetric ``b``-bit
        codebook is determined by its ``2**(b−1)`` positive centroids (a lookup can fold a code
        to a magnitude index and a sign)."""
        c = self.centroids.double()
        pair = torch.maximum(c.abs(), c.flip(0).abs())
        return bool(((c + c.flip(0)).abs() <= 1e-6 * pair).all())

    def to_dict(self) -> dict:
        """JSON-ready ``{"centroids": [...], "boundaries": [...]}`` (floats)."""
        return {"centroids": self.centroids.tolist(), "boundaries": self.boundaries.tolist()}


# --------------------------------------------------------------------------- Gaussian
def _phi(t: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _cdf_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # P(a < X < b) for X ~ N(0,1), accurate in both tails.
    s = 1 / math.sqrt(2)
    return torch.where(
        a >= 0,
        0.5 * (torch.erfc(a * s) - torch.erfc(b * s)),
        torch.where(b <= 0, 0.5 * (torch.erfc(-b * s) - torch.erfc(-a * s)),
                    0.5 * (torch.erf(b * s) - torch.erf(a * s))),
    )


def solve_gaussian_lloyd_max(bits: int, iters: int = 20000, tol: float = 1e-14) -> torch.Tensor:
    """Solve the Lloyd-Max quantizer of N(0, 1) in float64 (Max 1960, eqs. 9-10).

    Alternates the two optimality conditions: boundaries are midpoints of centroids; each
    centroid is the conditional mean ``(φ(a) - φ(b)) / (Φ(b) - Φ(a))`` of its cell ``(a, b)``.

    Returns:
        float64 ``(2**bits,)`` centroids. Slow for 8 bits (seconds); used offline to bake
        :mod:`tkv.codec._gaussian_tables` and by the test that checks the baked tables.
    """
    check_bits(bits)
    n = 1 << bits
    # Start from the quantiles of N(0,1) at cell mid-probabilities (close to optimal).
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    c = math.sqrt(2) * torch.erfinv(2 * p - 1)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(iters):
        t = (c[1:] + c[:-1]) / 2
        a = torch.cat([-inf, t])
        b = torch.cat([t, inf])
        new = (_phi(a) - _phi(b)) / _cdf_diff(a, b)
        delta = float((new - c).abs().max())
        c = new
        if delta < tol:
            break
    return c


@functools.cache
def gaussian_codebook(bits: int) -> Codebook:
    """The baked Lloyd-Max codebook of N(0, 1) for ``bits`` in 2..8 (cached, no solve).

    Its MSE per unit-variance coordinate is ≈ 0.1175, 0.03454, 0.009497, 0.002499, 0.000642,
    0.000163, 0.0000411 for b = 2..8 (Max 1960, Table; TurboQuant Thm. 1 quotes 0.117, 0.03,
    0.009 for b = 2, 3, 4).
    """
    from ._gaussian_tables import GAUSSIAN_LLOYD_MAX

    check_bits(bits)
    half = torch.tensor(GAUSSIAN_LLOYD_MAX[bits], dtype=torch.float64)
    return Codebook(torch.cat([-half.flip(0), half]), bits)


# --------------------------------------------------------------------------- exact sphere marginal
@functools.cache
def beta_codebook(head_dim: int, bits: int, grid: int = 1 << 18, iters: int = 3000) -> Codebook:
    """Lloyd-Max codebook for the exact marginal of a uniformly random unit vector's coordinate.

    A coordinate ``u`` of a uniform point on S^{d-1} has density ``∝ (1 - u²)^((d-3)/2)`` on
    ``[-1, 1]`` (TurboQuant, Lemma 1); the codebook quantizes ``z = sqrt(d) u``. It converges
    to :func:`gaussian_codebook` as d grows and is slightly better for small ``head_dim``.
    Solved numerically on a ``grid``-point float64 grid (cached per (head_dim, bits)).

    Raises:
        BitWidthError: bad bits. ValueError: head_dim < 3.
    """
    check_bits(bits)
    if head_dim < 3:
        raise ValueError(f"beta_codebook needs head_dim >= 3, got {head_dim}")
    d = head_dim
    u = torch.linspace(-1, 1, grid + 1, dtype=torch.float64)
    u = (u[1:] + u[:-1]) / 2
    logw = 0.5 * (d - 3) * torch.log1p(-u * u)
    w = torch.exp(logw - logw.max())
    z = u * math.sqrt(d)
    return _lloyd_weighted(z, w, bits, iters, init=gaussian_codebook(bits).centroids.double())


def _lloyd_weighted(x: torch.Tensor, w: torch.Tensor, bits: int, iters: int,
                    init: torch.Tensor, tol: float = 1e-12) -> Codebook:
    """Lloyd iterations on sorted support points ``x`` with weights ``w`` (float64)."""
    return Codebook(_lloyd_centroids(x, w, iters, init, tol), bits)


def _lloyd_centroids(x: torch.Tensor, w: torch.Tensor, iters: int, init: torch.Tensor,
                     tol: float = 1e-12) -> torch.Tensor:
    """Lloyd iterations from centroids ``init`` (float64, increasing, any count) on sorted
    support points ``x`` with weights ``w``; returns the float64 centroids."""
    cw = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(w, 0)])
    cwx = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(w * x, 0)])
    c = init.clone()
    for _ in range(iters):
        t = (c[1:] + c[:-1]) / 2
        edges = torch.cat([torch.tensor([0]), torch.searchsorted(x, t), torch.tensor([x.numel()])])
        mass = cw[edges[1:]] - cw[edges[:-1]]
        msum = cwx[edges[1:]] - cwx[edges[:-1]]
        new = torch.where(mass > 0, msum / mass.clamp_min(1e-300), c)
        # Keep strictly increasing even when a cell is empty (tiny nudge).
        new = torch.maximum(new, torch.cat([new[:1], new[:-1] + 1e-9]))
        delta = float((new - c).abs().max())
        c = new
        if delta < tol:
            break
    return c


def fit_codebook(samples: torch.Tensor, bits: int, iters: int = 200,
                 max_samples: int = 1 << 22, generator: torch.Generator | None = None,
                 symmetric: bool = False) -> Codebook:
    """Fit a Lloyd-Max codebook to samples (Lloyd 1982, "Least squares quantization in PCM").

    Args:
        samples: float tensor of any shape, standardized units (``sqrt(d) * u_i`` of rotated,
            normalized vectors). At most ``max_samples`` are used (random subset).
        bits: code width 2..8. Initialised from the Gaussian codebook, so a fitted codebook is
            never worse on its training samples than the Gaussian one.
        symmetric: fit the codebook constrained to ``c[n − 1 − i] = −c[i]``
            (:attr:`Codebook.symmetric`): the optimum for the samples together with their
            mirror image, whose middle decision boundary is 0 — so Lloyd's algorithm on
            ``|x|`` for the ``2**(bits−1)`` positive centroids (first cell from 0; started
            from the Gaussian codebook's positive half), mirrored. The rotated coordinates
            are symmetric in distribution (the WHT's random signs flip half of them), so the
            constraint removes sampling noise from the average: on SmolLM2 it lowers the
            held-out MSE at every width for K and from 5 bits for V and matches the free fit
            elsewhere, yet the held-out KL of the default job moved by up to 15 % either way
            (the tails matter more than the average), so tkv-calibrate keeps free fits
            (``benchmarks/results/symmetric_codebooks_cpu.md``).

    Returns:
        :class:`Codebook`.

    Raises:
        ValueError: fewer than ``2**bits`` samples, or non-finite samples.
    """
    check_bits(bits)
    x = samples.detach().reshape(-1).to("cpu", torch.float64)
    if x.numel() < (1 << bits):
        raise ValueError(f"need at least {1 << bits} samples to fit a {bits}-bit codebook")
    if not torch.isfinite(x).all():
        raise ValueError("codebook samples must be finite")
    if x.numel() > max_samples:
        idx = torch.randperm(x.numel(), generator=generator)[:max_samples]
        x = x[idx]
    init = gaussian_codebook(bits).centroids.double()
    if not symmetric:
        x, _ = torch.sort(x)
        return _lloyd_weighted(x, torch.ones_like(x), bits, iters, init=init, tol=1e-9)
    a, _ = torch.sort(x.abs())
    pos = _lloyd_centroids(a, torch.ones_like(a), iters, init[1 << (bits - 1):], tol=1e-9)
    return Codebook(torch.cat([-pos.flip(0), pos]), bits)


def default_codebook(bits: int, head_dim: int | None = None, kind: str = "gaussian") -> Codebook:
    """The codebook used when none is given: ``kind`` is ``"gaussian"`` (default) or ``"beta"``.

    Raises:
        BitWidthError: bad bits. CodebookError: another ``kind``, or ``"beta"`` without a
        head_dim ≥ 3 (its density needs d ≥ 3)."""
    if kind == "gaussian":
        return gaussian_codebook(bits)
    if kind == "beta":
        if head_dim is None or head_dim < 3:
            raise CodebookError(f"the beta codebook needs head_dim >= 3, got {head_dim!r}")
        return beta_codebook(head_dim, bits)
    raise CodebookError(f"codebook kind must be 'gaussian' or 'beta', got {kind!r}")
