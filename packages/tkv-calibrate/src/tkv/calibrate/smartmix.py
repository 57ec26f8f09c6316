"""Step 4: SmartMix — per-layer ``(k_bits, v_bits)`` minimizing predicted drift under a budget.

Budget semantics: ``TKV_BITS = β`` buys the memory of a uniform cache whose K and V codes
average β bits per element, norms included — e.g. β = 4.0 is the bytes of uniform K4V4 (68 B
per token per KV head at head_dim 64), β = 2.5 the bytes of K2V3. The byte cap is
interpolated between the uniform ⌊β⌋ and ⌈β⌉ caches, both priced by
:class:`tkv.codec.ModelLayout` / :class:`tkv.codec.SlotLayout` (codes + bf16 norms, block 16),
and every candidate allocation is priced by the same layout — so the budget the user asks for
is the memory they get.

Solver: the predicted drift is additive over layers and sides (first-order independence of
small perturbations), so the problem is a multiple-choice knapsack; it is solved exactly by
dynamic programming over the layout's integer bytes per token (49 width pairs per layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import torch

from tkv.codec import LayerAllocation, ModelGeometry, ModelLayout, SlotLayout
from tkv.codec.bundle import normalize_tkv_bits
from tkv.codec.errors import NonFiniteError, ShapeError, TkvBitsError

from .quantizers import PRICE_BLOCK_SIZE

__all__ = [
    "DEFAULT_BUDGETS",
    "MixPlan",
    "allocation_bytes",
    "budget_cap_bytes",
    "check_budget",
    "check_widths",
    "solve_mix",
    "uniform_candidates",
]

DEFAULT_BUDGETS = (2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0)
WIDTHS = tuple(range(2, 9))


def check_budget(b: float) -> float:
    """A budget in bits per element; raises TkvBitsError outside [2.0, 8.0] (the TKV_BITS rule
    of :func:`tkv.codec.bundle.normalize_tkv_bits`)."""
    return float(normalize_tkv_bits(b))


def _uniform_bytes(geo: ModelGeometry, kb: int, vb: int) -> float:
    return ModelLayout.uniform(geo.num_layers, geo.head_dim, geo.num_kv_heads, kb, vb,
                               PRICE_BLOCK_SIZE).bytes_per_token


def budget_cap_bytes(geo: ModelGeometry, budget: float) -> float:
    """Cache bytes per token (all layers, K+V, norms) that ``budget`` buys (module docstring)."""
    b = check_budget(budget)
    lo, hi = math.floor(b), math.ceil(b)
    t = b - lo
    return (1 - t) * _uniform_bytes(geo, lo, lo) + t * _uniform_bytes(geo, hi, hi)


def allocation_bytes(geo: ModelGeometry, alloc: LayerAllocation) -> float:
    """Cache bytes per token of a per-layer allocation, priced by ModelLayout."""
    return ModelLayout.from_allocation(geo.head_dim, geo.num_kv_heads, alloc.k_bits, alloc.v_bits,
                                       PRICE_BLOCK_SIZE).bytes_per_token


def uniform_candidates(geo: ModelGeometry, cap: float,
                       widths=WIDTHS) -> list[tuple[int, int]]:
    """Every uniform ``(k_bits, v_bits)`` with both widths in ``widths`` whose bytes fit
    ``cap``."""
    return [(kb, vb) for kb in widths for vb in widths if _uniform_bytes(geo, kb, vb) <= cap + 1e-9]


def check_widths(widths) -> tuple[int, ...]:
    """The widths SmartMix may give a side (``--mix-widths``): a non-empty set of ints in
    2..8, returned sorted. Decode speed depends on the widths (H200, session 10, B=32, L=8K:
    K2V2 0.24 ms, K4V4 0.26, K3V3 0.50, K8V8 0.63, K5V5 0.82, K6V6 1.1; ``docs/kernels.md``):
    ``(2, 4)`` keeps every layer on the two fastest, trading some fidelity per byte.

    Raises:
        TkvBitsError: empty, not a collection, or a width that is not an int in 2..8.
    """
    try:
        out = sorted(set(widths))
    except TypeError:   # None, a bare int, unhashable or unorderable items
        raise TkvBitsError(f"SmartMix widths must be a collection of ints in 2..8, got "
                           f"{widths!r}") from None
    if not out or any(isinstance(w, bool) or not isinstance(w, int) or not 2 <= w <= 8
                      for w in out):
        raise TkvBitsError(f"SmartMix widths must be ints in 2..8, got {list(widths)!r}")
    return tuple(out)


def _check_predictions(pred, num_layers: int, widths: tuple[int, ...]) -> None:
    """``pred`` must map ``"k"`` and ``"v"`` to ``(num_layers, 7)`` tensors, finite in the
    columns of ``widths`` (ShapeError / NonFiniteError naming the side)."""
    cols = [w - 2 for w in widths]
    for side in ("k", "v"):
        t = pred.get(side) if isinstance(pred, dict) else None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (num_layers, len(WIDTHS)):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError(f"pred[{side!r}] must be a ({num_layers}, {len(WIDTHS)}) tensor of "
                             f"predicted KL per layer for widths 2..8, got {got}")
        if not bool(torch.isfinite(t[:, cols].double()).all()):
            raise NonFiniteError(f"pred[{side!r}] holds NaN / inf for widths {list(widths)}")


@dataclass(frozen=True)
class MixPlan:
    """A solved allocation: widths, predicted drift (sum of per-layer KL), bytes per token."""

    allocation: LayerAllocation
    predicted_kl: float
    bytes_per_token: float


def predicted_drift(pred: dict[str, torch.Tensor], k_bits, v_bits) -> float:
    """Sum of per-layer predicted KL for widths (``pred[side]`` is ``(L, 7)`` over 2..8)."""
    return float(sum(pred["k"][i, kb - 2] + pred["v"][i, vb - 2]
                     for i, (kb, vb) in enumerate(zip(k_bits, v_bits, strict=True))))


def solve_mix(pred: dict[str, torch.Tensor], geo: ModelGeometry, cap: float,
              widths=WIDTHS) -> MixPlan:
    """Exact multiple-choice knapsack: minimize Σ pred_k[l, kb] + pred_v[l, vb] subject to the
    layout-priced bytes per token ≤ ``cap``.

    Args:
        pred: ``{"k": (L, 7), "v": (L, 7)}`` predicted KL per layer for widths 2..8 (L =
            ``geo.num_layers``; finite where a width in ``widths`` reads it).
        geo: the model geometry (prices each pair by :class:`~tkv.codec.SlotLayout`).
        cap: bytes per token for all layers (:func:`budget_cap_bytes`), a positive finite
            number; a cap above the widest allocation is that allocation's bytes.
        widths: the widths a side may take (default all, 2..8; :func:`check_widths`).

    Raises:
        TkvBitsError: bad ``widths`` or ``cap``, or no allocation of those widths fits ``cap``.
        ShapeError: ``pred`` without ``"k"`` / ``"v"`` tensors of shape ``(L, 7)``.
        NonFiniteError: a NaN / inf prediction for a width that ``widths`` allows.
    """
    widths = check_widths(widths)
    n = geo.num_layers
    _check_predictions(pred, n, widths)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) \
            or cap <= 0:
        raise TkvBitsError(f"the byte cap must be a positive finite number of bytes per "
                           f"token, got {cap!r}")
    opts = [(kb, vb, round(SlotLayout(geo.head_dim, geo.num_kv_heads, kb, vb,
                                          PRICE_BLOCK_SIZE).bytes_per_token))
            for kb in widths for vb in widths]
    g = reduce(math.gcd, [c for _, _, c in opts])
    cap = min(cap, n * max(c for _, _, c in opts))   # no table past the widest allocation
    units = math.floor(cap / g + 1e-9)
    inf = float("inf")
    dp = torch.full((units + 1,), inf, dtype=torch.float64)
    dp[0] = 0.0
    choice = torch.full((n, units + 1), -1, dtype=torch.long)
    for layer in range(n):
        new = torch.full_like(dp, inf)
        for j, (kb, vb, c) in enumerate(opts):
            cu = c // g
            if cu > units:
                continue
            cand = dp[: units + 1 - cu] + float(pred["k"][layer, kb - 2] + pred["v"][layer, vb - 2])
            better = cand < new[cu:]
            new[cu:] = torch.where(better, cand, new[cu:])
            choice[layer, cu:] = torch.where(better, torch.full_like(cand, j, dtype=torch.long),
                                             choice[layer, cu:])
        dp = new
    if not torch.isfinite(dp).any():
        raise TkvBitsError(f"no allocation with widths {list(widths)} fits {cap:g} bytes per "
                           "token")
    u = int(torch.argmin(dp))
    best = float(dp[u])
    ks, vs = [0] * n, [0] * n
    for layer in range(n - 1, -1, -1):
        j = int(choice[layer, u])
        kb, vb, c = opts[j]
        ks[layer], vs[layer] = kb, vb
        u -= c // g
    alloc = LayerAllocation(tuple(ks), tuple(vs), "smartmix")
    return MixPlan(alloc, best, allocation_bytes(geo, alloc))
