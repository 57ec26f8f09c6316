"""Step 2a: per-channel scales for K and V (one ``(head_dim,)`` vector per layer, shared by
its KV heads), chosen to minimize the error attention actually sees.

The codec stores ``x̂ = s ⊙ Rᵀ Q(R (x / s))`` and queries are multiplied by ``s``. After the
random rotation the quantization error ``ε`` of ``R(x/s)`` is close to isotropic with energy
``∝ ‖x / s‖² D_b`` (D_b: the codebook distortion), so the error in original space is
``e = s ⊙ Rᵀ ε`` with ``E e_c² ∝ s_c² · Σ_j E x_j² / s_j²``.

* Keys: the attention logit error is ``q · e``; with a diagonal model of ``E qqᵀ``,
  ``E (q·e)² ∝ (Σ_c E q_c² s_c²)(Σ_j E k_j² / s_j²)``, minimized (Cauchy–Schwarz) at
  ``s_c = (E k_c² / E q_c²)^(1/4)`` — the square-root balancing of SmoothQuant
  (Xiao et al. 2023, eq. 4 with α = 1/2) applied to the q·k product.
* Values: the output error is ``W_o e`` (o_proj); with ``w_c = diag(Σ_h W_hᵀ W_h)_c`` over the
  query heads of the group, ``s_c = (E v_c² / w_c)^(1/4)`` by the same argument.

Scales are normalized to geometric mean 1. For each layer and side three strengths are tried
— none, half (exponent 1/8) and full (1/4) — and the one with the lowest *measured* error on
held-out calibration tokens (real codec, 4 bits) is kept: relative logit MSE
``Σ (q·k − q·k̂)² / Σ (q·k)²`` for keys, relative ``‖W_o (v − v̂)‖²`` for values.

Key centering (``center_keys``, the codec's ``k_channel_offset`` μ): post-RoPE keys carry a
large per-channel mean shared by all tokens, which a per-vector-normalized codec quantizes
again in every token. ``"per-head"`` (default): μ is the mean of the training keys over
tokens, one ``(head_dim,)`` row per KV head (``(num_kv_heads, head_dim)``, the minimizer of
``E‖k_h − μ_h‖²`` for every head; on SmolLM2 it removes about 60 % of the key energy vs 18 %
for one shared mean). ``"shared"``: one ``(head_dim,)`` mean over tokens and KV heads. Subtracting it is exact for attention (each score of a query row shifts by the
same ``q·μ``). Keys are then scaled with the statistics of ``k − μ``; the three strengths are
tried with and without μ, and the lowest held-out error (always measured on model-space keys,
the codec adds μ back) wins, so a layer is centered only where it measured better.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tkv.codec import TurboKVCodec

from .collect import LayerSamples

__all__ = ["ScaleChoice", "choose_scales", "k_logit_error", "key_offset", "v_output_error"]

STRENGTHS = (0.0, 0.5, 1.0)
PROBE_BITS = 4
MAX_RATIO = 16.0
MAX_QUERIES = 256  # queries per layer used for the held-out logit error
MAX_HELD = 1024  # held-out tokens per layer used for selection


@dataclass(frozen=True)
class ScaleChoice:
    """Chosen scales of one layer and the held-out errors with and without them.

    Attributes:
        k_scales, v_scales: float32 ``(head_dim,)`` or None (no scaling won).
        k_error, v_error: relative held-out error with the chosen scales (at PROBE_BITS).
        k_error_unscaled, v_error_unscaled: the same without scales.
        k_strength, v_strength: 0, 0.5 or 1.
        k_offset: float32 key mean μ subtracted before compression, ``(num_kv_heads, head_dim)``
            (per-head centering) or ``(head_dim,)`` (shared), or None
            (not centered: centering off, or it did not measure better).
        k_error_uncentered: the best held-out key error without μ (equals ``k_error`` when
            centering is off or lost).
    """

    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    k_error: float
    v_error: float
    k_error_unscaled: float
    v_error_unscaled: float
    k_strength: float
    v_strength: float
    k_offset: torch.Tensor | None = None
    k_error_uncentered: float | None = None


def _normalize(ratio: torch.Tensor, power: float) -> torch.Tensor:
    s = ratio.clamp_min(1e-12).double() ** power
    s = s / torch.exp(torch.log(s).mean())
    lo, hi = 1 / MAX_RATIO ** 0.5, MAX_RATIO ** 0.5
    return s.clamp(lo, hi).float()


def _group_weights(o_proj: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor | None:
    """``(num_kv_heads, d, d)`` output-error metrics ``Σ_{h in group} W_hᵀ W_h``."""
    if o_proj is None or o_proj.shape[1] != num_heads * head_dim:
        return None
    w = o_proj.view(o_proj.shape[0], num_heads, head_dim)
    per_head = torch.einsum("ohc,ohd->hcd", w.double(), w.double())
    g = num_heads // num_kv_heads
    return per_head.view(num_kv_heads, g, head_dim, head_dim).sum(1)


def k_logit_error(k: torch.Tensor, k_hat: torch.Tensor, q: torch.Tensor) -> float:
    """Relative attention-logit MSE ``Σ (q·(k−k̂))² / Σ (q·k)²`` over all (query, key) pairs of
    each GQA group. k, k_hat ``(N, Hkv, d)``, q ``(M, Hq, d)``."""
    hkv, hq = k.shape[1], q.shape[1]
    g = hq // hkv
    num = den = 0.0
    diff = (k - k_hat).float()
    for h in range(hq):
        kv = h // g
        qh = q[:, h].float()
        num += float(((qh @ diff[:, kv].T) ** 2).sum(dtype=torch.float64))
        den += float(((qh @ k[:, kv].float().T) ** 2).sum(dtype=torch.float64))
    return num / max(den, 1e-30)


def v_output_error(v: torch.Tensor, v_hat: torch.Tensor, metric: torch.Tensor | None) -> float:
    """Relative output error ``Σ eᵀ M e / Σ vᵀ M v`` (``M`` per KV head, identity if None)."""
    e = (v - v_hat).float()
    x = v.float()
    if metric is None:
        return float((e ** 2).sum(dtype=torch.float64) / (x ** 2).sum(dtype=torch.float64).clamp_min(1e-30))
    m = metric.float()
    # Σ_n e_nᵀ M_h e_n per head h: ((e @ M) * e) summed, as batched matmuls.
    num = ((torch.einsum("nhc,hcd->nhd", e, m) * e).sum(dtype=torch.float64))
    den = ((torch.einsum("nhc,hcd->nhd", x, m) * x).sum(dtype=torch.float64))
    return float(num / den.clamp_min(1e-30))


CENTER_MODES = ("per-head", "shared", "off")


def center_mode(center_keys: bool | str) -> str:
    """Normalize ``center_keys``: ``True`` → ``"per-head"``, ``False`` → ``"off"``, or one of
    :data:`CENTER_MODES` (ValueError otherwise)."""
    if center_keys is True:
        return "per-head"
    if center_keys is False:
        return "off"
    if center_keys not in CENTER_MODES:
        raise ValueError(f"center_keys must be one of {CENTER_MODES}, got {center_keys!r}")
    return center_keys


def key_offset(k: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """Key mean μ (accumulated in float64): k float ``(tokens, num_kv_heads, head_dim)`` →
    float32 ``(num_kv_heads, head_dim)`` (``per_head``: mean over tokens) or ``(head_dim,)``
    (mean over tokens and KV heads)."""
    return k.double().mean(dim=0 if per_head else (0, 1)).float()


def choose_scales(s: LayerSamples, train: slice, held: slice, seed: int = 0,
                  center_keys: bool | str = "per-head") -> ScaleChoice:
    """Fit and select the K and V channel scales (and the key offset) of one layer (module
    docstring).

    Args:
        s: the layer's samples. train, held: token ranges for fitting and for selection.
        center_keys: ``"per-head"`` (or True), ``"shared"``, ``"off"`` (or False): which key
            offset μ (fitted on ``train``) is also tried; kept only if it lowers the held-out
            key error.
    """
    d = s.k.shape[-1]
    k_tr, v_tr = s.k[train], s.v[train]
    k_ho, v_ho = s.k[held], s.v[held]
    q_ho = s.q[:: max(1, s.q.shape[0] // MAX_QUERIES)]
    if k_ho.shape[0] > MAX_HELD:
        k_ho, v_ho = k_ho[-MAX_HELD:], v_ho[-MAX_HELD:]
    metric = _group_weights(s.o_proj, s.num_heads, s.num_kv_heads, d)
    mode = center_mode(center_keys)
    offsets = [None] if mode == "off" else [None, key_offset(k_tr, per_head=mode == "per-head")]
    if metric is not None:
        w = torch.diagonal(metric, dim1=1, dim2=2).mean(0)
    else:
        w = torch.ones(d, dtype=torch.float64)
    v_ratio = (v_tr.double() ** 2).mean(dim=(0, 1)) / w.clamp_min(1e-12)

    def err(side: str, scales, offset=None) -> float:
        codec = TurboKVCodec(d, PROBE_BITS, seed=seed, check_finite=False,
                             k_channel_scales=scales if side == "k" else None,
                             v_channel_scales=scales if side == "v" else None,
                             k_channel_offset=offset)
        if side == "k":
            kh = codec.decompress_k(*codec.compress_k(k_ho))
            return k_logit_error(k_ho, kh, q_ho)
        vh = codec.decompress_v(*codec.compress_v(v_ho))
        return v_output_error(v_ho, vh, metric)

    # keys: every strength with and without the offset; values: strengths only
    best_k, best_k_plain, kb = None, None, None
    for off in offsets:
        kc = k_tr.double() if off is None else k_tr.double() - off.double()
        k_ratio = (kc ** 2).mean(dim=(0, 1)) / s.q_sq.clamp_min(1e-12)
        for st in STRENGTHS:
            sc = None if st == 0 else _normalize(k_ratio, 0.25 * st)
            e = err("k", sc, off)
            if st == 0 and off is None:
                kb = e
            if best_k is None or e < best_k[0]:
                best_k = (e, sc, st, off)
            if off is None and (best_k_plain is None or e < best_k_plain):
                best_k_plain = e
    best_v, vb = None, None
    for st in STRENGTHS:
        sc = None if st == 0 else _normalize(v_ratio, 0.25 * st)
        e = err("v", sc)
        if st == 0:
            vb = e
        if best_v is None or e < best_v[0]:
            best_v = (e, sc, st)
    ke, ks, kst, koff = best_k
    ve, vs, vst = best_v
    return ScaleChoice(ks, vs, ke, ve, kb, vb, kst, vst, koff, best_k_plain)
