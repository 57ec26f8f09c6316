"""The random orthogonal rotation: a sign-randomized, normalized Walsh–Hadamard transform.

``R x = (H_p ⊗ C_m) (s ⊙ x)`` where ``d = p * m`` with ``p`` the largest power of two dividing
``head_dim`` and ``m`` odd:

* ``s ∈ {±1}^d`` — seeded random signs (TurboQuant's randomized Hadamard, Zandieh et al.
  2025 Sec. 3; QuIP# Tseng et al. 2024 Sec. 3). They come from SplitMix64 (Steele et al. 2014)
  on ``(seed, index)``, so every device, torch version and kernel derives identical signs.
* ``H_p`` — the Walsh–Hadamard matrix of order ``p`` scaled by ``1/sqrt(p)`` (orthogonal,
  symmetric, self-inverse). Applied in ``O(p log p)`` as a Kronecker product of small
  radix-``r`` Hadamard factors (``H_p = H_{r1} ⊗ H_{r2} ⊗ ...``, r ≤ 16): one pass per factor,
  each a tiny ``r×r`` matmul over a reshaped view. No dense ``d×d`` matrix for power-of-two d.
* ``C_m`` — for ``m > 1`` only (head_dim 80 = 16·5, 96 = 32·3, 112 = 16·7, 192 = 64·3,
  576 = 64·9): the orthonormal DCT-II matrix of order ``m``,
  ``C[k, n] = sqrt(2/m) · c_k · cos(π (n + 1/2) k / m)``, ``c_0 = 1/sqrt(2)``, else 1.
  It is exactly orthogonal and dense, so ``H_p ⊗ C_m`` mixes every coordinate with every
  other (a block-diagonal Hadamard would not); cost ``O(d (log p + m))``.

The whole map is orthogonal: ``R^T R = I``, so ``⟨R q, R k⟩ = ⟨q, k⟩`` (scores are invariant)
and ``R^T`` undoes it. Layout: x is viewed as a ``(p, m)`` matrix in row-major order, i.e.
coordinate ``i`` is ``(i // m, i % m)``.
"""

from __future__ import annotations

import functools
import math

import torch

from .validation import check_seed

__all__ = ["HadamardRotation", "hadamard_matrix", "splitmix64_signs"]

_MASK64 = (1 << 64) - 1


def splitmix64_signs(seed: int, n: int) -> list[int]:
    """``n`` signs in {+1, -1}: bit 63 of SplitMix64 output ``i`` (state = seed, i = 1..n).

    Pure Python integers, so the sequence is identical on every platform and framework.
    """
    out = []
    state = seed & _MASK64
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        out.append(-1 if z >> 63 else 1)
    return out


@functools.cache
def _hadamard_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(n: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Unnormalized Sylvester Walsh–Hadamard matrix of order ``n`` (a power of two), ±1 entries."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    return _hadamard_cpu(n).to(device=device, dtype=dtype)


@functools.cache
def _dct_cpu(m: int) -> torch.Tensor:
    k = torch.arange(m, dtype=torch.float64)[:, None]
    n = torch.arange(m, dtype=torch.float64)[None, :]
    c = math.sqrt(2 / m) * torch.cos(math.pi * (n + 0.5) * k / m)
    c[0] /= math.sqrt(2)
    return c


def _radices(p: int, max_radix: int = 16) -> list[int]:
    out = []
    while p > 1:
        r = min(p, max_radix)
        out.append(r)
        p //= r
    return out


class HadamardRotation:
    """Seeded orthogonal rotation ``R`` of ``head_dim``-vectors (see module docstring).

    Args:
        head_dim: vector length d (≥ 1).
        seed: int seed of the ±1 signs, in ``[0, 2**64)`` (ValueError otherwise).
        device: where the small factor matrices live.

    Methods act on the last dim of float tensors ``(..., head_dim)`` and compute in float32
    (float64 inputs stay float64). No Python loop over vectors.
    """

    def __init__(self, head_dim: int, seed: int = 0, device: torch.device | str = "cpu"):
        if head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {head_dim}")
        self.head_dim = head_dim
        self.seed = check_seed(seed)
        self.device = torch.device(device)
        p = head_dim & -head_dim  # largest power of two dividing head_dim
        self.pow2 = p
        self.odd = head_dim // p
        self._radices = _radices(p)
        self.signs = torch.tensor(splitmix64_signs(seed, head_dim), dtype=torch.float32,
                                  device=self.device)
        self._cache: dict[tuple, tuple[list[torch.Tensor], torch.Tensor | None]] = {}

    # ------------------------------------------------------------------ factors
    def _factors(self, dtype: torch.dtype, device: torch.device):
        key = (dtype, device)
        if key not in self._cache:
            hs = [hadamard_matrix(r, dtype, device) / math.sqrt(r) for r in self._radices]
            c = _dct_cpu(self.odd).to(device=device, dtype=dtype) if self.odd > 1 else None
            self._cache[key] = (hs, c)
        return self._cache[key]

    def _apply(self, x: torch.Tensor, transpose: bool) -> torch.Tensor:
        # (H_p ⊗ C_m) vec(X) = vec(H_p X C_m^T) for X = x viewed as (p, m) row-major, and
        # H_p = H_r1 ⊗ H_r2 ⊗ ...: factor i left-multiplies the view (batch, r_i, rest).
        lead = x.shape[:-1]
        hs, c = self._factors(x.dtype, x.device)
        m = self.odd
        y = x.reshape(-1, self.pow2, m)
        if c is not None:
            y = y @ (c if transpose else c.T)
        n = y.shape[0]
        before = 1
        after = self.pow2 * m
        for r, h in zip(self._radices, hs, strict=True):
            after //= r
            if after == 1:
                y = y.reshape(-1, r) @ h  # H symmetric: x H == (H x^T)^T
            else:
                y = h @ y.reshape(n * before, r, after)
            before *= r
        return y.reshape(*lead, self.head_dim)

    # ------------------------------------------------------------------ public
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``R x``: signs, then ``H_p ⊗ C_m``. x ``(..., head_dim)`` float → same shape/dtype."""
        s = self.signs.to(device=x.device, dtype=x.dtype)
        return self._apply(x * s, transpose=False)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``R^T y`` (exact inverse): ``(H_p ⊗ C_m)^T``, then signs."""
        s = self.signs.to(device=y.device, dtype=y.dtype)
        return self._apply(y, transpose=True) * s

    def matrix(self, dtype=torch.float64) -> torch.Tensor:
        """Dense ``R`` ``(head_dim, head_dim)`` with ``R @ x == forward(x)`` (for tests/kernels)."""
        eye = torch.eye(self.head_dim, dtype=dtype, device=self.device)
        return self.forward(eye).T.contiguous()
