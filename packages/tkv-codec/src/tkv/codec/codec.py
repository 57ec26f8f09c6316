"""TurboKVCodec: the TurboQuant K/V codec (Zandieh et al., "TurboQuant: Online Vector
Quantization with Near-optimal Distortion Rate", 2025, Algorithm 1 "TurboQuant_mse").

Per vector ``x ∈ R^d`` (one head of one token), compression is

1. optional per-channel prescale ``x' = x / s`` (outlier channels; queries get ``q · s`` so
   ``⟨q, k⟩`` is unchanged);
2. rotation ``y = R x'`` with the seeded randomized Walsh–Hadamard transform of
   :mod:`tkv.codec.rotation` (Alg. 1 line 1, with R a fast structured rotation);
3. one norm per vector, ``n = ‖y‖``, stored in bfloat16, and the unit vector ``u = y / n``;
4. each coordinate ``z_i = sqrt(d) · u_i`` (≈ N(0, 1), Lemma 1) mapped to the nearest centroid
   of a Lloyd-Max codebook (Alg. 1 line 5, ``idx_j = argmin_k |y_j − c_k|``);
5. the ``b``-bit indices packed LSB-first (:mod:`tkv.codec.packing`).

Decompression is ``x̂ = s ⊙ Rᵀ (n · c[idx] / sqrt(d))`` (Alg. 1 DeQuant). Attention can instead
stay in rotated space: ``⟨rotate_query(q), decompress_k_rotated(...)⟩ = ⟨q, x̂_k⟩`` and
``unrotate_output(Σ p_j · decompress_v_rotated(...)_j) = Σ p_j x̂_v,j``.

Expected distortion, norm correction off, unit x: ``E‖x − x̂‖² = D_b`` with ``D_b`` the
Lloyd-Max MSE of the codebook (0.1175, 0.0345, 0.0095 at b = 2, 3, 4), below the paper's
bound ``(√3 π / 2) · 4^(−b)`` (Theorem 1).
"""

from __future__ import annotations

import math

import torch

from .codebooks import Codebook, default_codebook
from .errors import CodebookError, DtypeError, NonFiniteError, ShapeError
from .layout import SlotLayout
from .packing import check_bits, pack_codes, packed_bytes, unpack_codes
from .rotation import HadamardRotation
from .validation import (
    check_channel_offset,
    check_channel_scales,
    check_device,
    check_seed,
    check_vectors,
)

__all__ = ["SideCodec", "TurboKVCodec"]


def _as_codebook(cb, bits: int, head_dim: int, name: str) -> Codebook:
    if cb is None:
        return default_codebook(bits, head_dim)
    if isinstance(cb, str):
        return default_codebook(bits, head_dim, kind=cb)
    if not isinstance(cb, Codebook):
        cb = Codebook.from_centroids(cb)
    if cb.bits != bits:
        raise CodebookError(f"{name} has {cb.bits} bits but the codec uses {bits} bits")
    return cb


def _check_out_dtype(dtype, what: str) -> None:
    """An output dtype must be a real floating dtype (float16/bfloat16/float32/float64).

    Raises:
        DtypeError: anything else (an integer, bool or complex dtype would truncate silently)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise DtypeError(f"{what}: output dtype must be a floating dtype, got {dtype!r}")


class SideCodec:
    """The codec of one side (K or V): rotation, norm, Lloyd-Max quantizer, packing.

    Built by :class:`TurboKVCodec`; kernels and engines use its tensors directly:
    ``centroids`` (float32 ``(2**bits,)``, standardized units), ``channel_scales``
    (float32 ``(head_dim,)`` or None), ``rotation``.
    """

    def __init__(self, name: str, head_dim: int, bits: int, rotation: HadamardRotation,
                 codebook: Codebook, channel_scales: torch.Tensor | None,
                 norm_correction: bool, device: torch.device, check_finite: bool,
                 channel_offset: torch.Tensor | None = None,
                 sink_offset: torch.Tensor | None = None):
        self.name = name
        self.head_dim = head_dim
        self.bits = bits
        self.rotation = rotation
        self.codebook = codebook
        self.norm_correction = norm_correction
        self.device = device
        self.check_finite = check_finite
        self.packed_bytes = packed_bytes(head_dim, bits)
        self.centroids = codebook.centroids.to(device)
        self.boundaries = codebook.boundaries.to(device)
        # Host copy for the compare-count quantizer: no device sync per compress call.
        self._boundary_list = codebook.boundaries.tolist()
        self._scaled_centroids = (codebook.centroids.double() / math.sqrt(head_dim)).float().to(device)
        self._scaled_sq = self._scaled_centroids.square()
        self.channel_scales = None if channel_scales is None else channel_scales.to(device)
        self.channel_offset = None if channel_offset is None else channel_offset.to(device)
        self.sink_offset = None if sink_offset is None else sink_offset.to(device)
        if (self.channel_offset is not None and self.sink_offset is not None
                and self.channel_offset.dim() == 2 and self.sink_offset.dim() == 2
                and self.channel_offset.shape != self.sink_offset.shape):
            raise ShapeError(f"{name} sink offset {tuple(self.sink_offset.shape)} and channel "
                             f"offset {tuple(self.channel_offset.shape)} hold different KV heads")
        # Byte-indexed dequant table for widths whose codes never straddle a byte (2, 4, 8):
        # row j holds the 8/bits standardized-and-scaled values that byte j encodes, so
        # decompression is one table lookup per byte, no unpacking.
        self._byte_table = None
        if 8 % bits == 0:
            per = 8 // bits
            byte = torch.arange(256, device=device)[:, None]
            idx = (byte >> (torch.arange(per, device=device) * bits)) & ((1 << bits) - 1)
            self._byte_table = self._scaled_centroids[idx]  # (256, per) float32

    @property
    def offset_heads(self) -> int | None:
        """Number of KV heads of a per-head ``channel_offset`` or ``sink_offset``
        ``(num_kv_heads, head_dim)``; None for shared ``(head_dim,)`` offsets or none."""
        for m in (self.channel_offset, self.sink_offset):
            if m is not None and m.dim() == 2:
                return int(m.shape[0])
        return None

    def sink_shift_rotated(self, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
        """Rotated-space shift of flagged vectors, ``c = R((σ − μ) / s)`` (σ the sink offset,
        μ the channel offset or 0, s the channel scales): ``(head_dim,)`` for shared offsets,
        ``(num_kv_heads, head_dim)`` when either is per head; None without a sink offset.

        A flagged vector's rotated reconstruction relative to μ is
        ``decompress_rotated(...) + c``, so attention kernels that work in rotated space add
        ``⟨q_rot, c⟩`` to flagged keys' scores and ``c`` × the flagged softmax mass to the
        output (``docs/kernels.md``, sink offsets). Computed in ``dtype`` (float64 default)."""
        if self.sink_offset is None:
            return None
        return self._rotated(self.sink_offset.to(dtype), self.channel_offset)

    def _check_heads(self, lead: torch.Size, name: str, shape, last: int | None = None) -> None:
        """A per-head offset needs the KV-head axis just before the last dim (head_dim, or
        ``last`` = the packed bytes of a packed tensor): ``lead[-1] == H``."""
        h = self.offset_heads
        if h is not None and (len(lead) == 0 or lead[-1] != h):
            raise ShapeError(
                f"{name} must have shape (..., {h}, {last or self.head_dim}) (the per-head "
                f"{'key' if self.name == 'K' else 'value'} offsets (channel or sink) "
                f"hold {h} KV heads), got {tuple(shape)}")

    @property
    def scaled_centroids(self) -> torch.Tensor:
        """Dequant table, float32 ``(2**bits,)`` on the codec's device: ``centroids / sqrt(head_dim)``.
        A rotated coordinate is ``norm * scaled_centroids[code]`` (kernels read this table)."""
        return self._scaled_centroids

    def _nearest_centroid(self, z: torch.Tensor) -> torch.Tensor:
        """Index of the Lloyd-Max cell of each standardized coordinate (int64, like ``z``).
        Widths <= 4 count the boundaries below ``z`` (at most 15 compares, much faster than a
        binary search on CPU); wider codebooks use ``torch.bucketize``. Both give the same
        index: ``#{k : boundary_k < z}``."""
        zb = z.to(self.boundaries.dtype)
        if self.bits <= 4:
            acc = torch.zeros(zb.shape, dtype=torch.uint8, device=zb.device)
            for b in self._boundary_list:
                acc += zb > b
            return acc.long()
        return torch.bucketize(zb, self.boundaries)

    # -------------------------------------------------------------- compress
    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` float ``(..., head_dim)`` → ``(packed uint8 (..., packed_bytes), norms bf16 (...))``.

        Raises DtypeError, ShapeError, DeviceMismatchError, NonFiniteError (see validation).
        """
        check_vectors(x, self.head_dim, self.device, f"{self.name} input", self.check_finite)
        self._check_heads(x.shape[:-1], f"{self.name} input", x.shape)
        codes, norms = self.quantize(x)
        if self.check_finite and not bool(torch.isfinite(norms).all()):
            raise NonFiniteError(
                f"{self.name} input: a vector's norm (after its offset and channel scales) "
                f"exceeds the bf16 range (max {torch.finfo(torch.bfloat16).max:.3g}); largest "
                f"|x| {float(x.abs().max()):.3g}")
        return pack_codes(codes, self.bits, check_range=False), norms   # in range by construction

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked codes int64 ``(..., head_dim)`` and bf16 norms ``(...)``, no validation.

        With a ``sink_offset`` each vector is coded twice — relative to ``channel_offset`` (or
        0) and relative to ``sink_offset`` — and the candidate whose rotated reconstruction
        ``n · c[code] / sqrt(d)`` is closer to the rotated input wins (ties: the first); the
        second is flagged by a negative norm (the bf16 sign bit; :meth:`decompress` reads it
        with ``torch.signbit``, so a zero norm keeps its flag)."""
        xf = x.float() if x.dtype != torch.float64 else x
        if self.sink_offset is None:
            return self._quantize_rotated(self._rotated(xf, self.channel_offset))
        ya, yb = self._rotated(xf, self.channel_offset), self._rotated(xf, self.sink_offset)
        (ca, na), (cb, nb) = self._quantize_rotated(ya), self._quantize_rotated(yb)
        ea, eb = self._rotated_error(ya, ca, na), self._rotated_error(yb, cb, nb)
        # the sink candidate also wins where the usual one overflowed (NaN error)
        pick = (eb < ea) | (torch.isnan(ea) & ~torch.isnan(eb))
        return (torch.where(pick.unsqueeze(-1), cb, ca),
                torch.where(pick, -nb, na).to(torch.bfloat16))

    def _rotated(self, xf: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        """``R ((x − offset) / s)``: the vector the quantizer sees, in ``xf``'s dtype."""
        if offset is not None:
            xf = xf - offset.to(xf.dtype)
        if self.channel_scales is not None:
            xf = xf / self.channel_scales.to(xf.dtype)
        return self.rotation.forward(xf)

    def _rotated_error(self, y, codes, norms) -> torch.Tensor:
        """Squared error ``‖n · c[code] / sqrt(d) − y‖²`` per vector of the rotated input ``y``
        (:meth:`_rotated`), with the norm as stored (bf16): the sink-offset choice's criterion."""
        table = self._scaled_centroids.to(y.dtype)
        rec = table[codes] * norms.to(y.dtype).unsqueeze(-1)
        return (rec - y).square().sum(dim=-1)

    def _quantize_rotated(self, y: torch.Tensor):
        """Codes int64 and bf16 norms of a rotated input ``y`` (:meth:`_rotated`)."""
        n = torch.linalg.vector_norm(y, dim=-1)
        # Σy² overflows although y is finite (|y| ≳ 1e18 in float32), or underflows to a norm
        # of 0 or a few subnormal ulps (|y| ≲ 1e-19): the norm of y / max|y|, scaled back, is
        # exact where it fits (the bf16 cast below still overflows past 3.4e38; bf16 holds
        # norms down to float32's 1.2e-38, subnormal to 9.2e-41; below that a norm stores 0).
        # One host sync, the finiteness check's.
        tiny_norm = math.sqrt(torch.finfo(y.dtype).tiny) * 2 ** 12
        bad = ~torch.isfinite(n) | (n < tiny_norm)
        if self.check_finite and bool(bad.any()):   # only those rows (zero vectors stay 0)
            yb = y[bad]
            a = yb.abs().amax(dim=-1, keepdim=True)
            a = torch.where(a > 0, a, torch.ones_like(a))
            n = n.clone()
            n[bad] = torch.linalg.vector_norm(yb / a, dim=-1) * a[..., 0]
        inv = torch.where(n > 0, math.sqrt(self.head_dim) / n, torch.zeros_like(n))
        z = y * inv.unsqueeze(-1)
        codes = self._nearest_centroid(z)
        if self.norm_correction:
            # Store n / ‖û‖ so that ‖x̂‖ = ‖x‖ (before bf16 rounding); ‖û‖ > 0 always since a
            # unit vector's codes cannot all map to a zero centroid (zero x gives n = 0 → 0).
            un = self._scaled_sq[codes].sum(dim=-1).sqrt().to(n.dtype)
            n = n / un.clamp_min(1e-12)
        return codes, n.to(torch.bfloat16)

    # -------------------------------------------------------------- decompress
    def _check_packed(self, packed: torch.Tensor, norms: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> None:
        _check_out_dtype(dtype, f"{self.name} decompress")
        if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
            raise DtypeError(f"{self.name} packed codes must be a uint8 tensor")
        if packed.dim() == 0 or packed.shape[-1] != self.packed_bytes:
            raise ShapeError(
                f"{self.name} packed codes must have shape (..., {self.packed_bytes}) "
                f"(head_dim={self.head_dim}, bits={self.bits}), got {tuple(packed.shape)}"
            )
        if not isinstance(norms, torch.Tensor) or not norms.dtype.is_floating_point:
            raise DtypeError(f"{self.name} norms must be a floating tensor (bfloat16)")
        if norms.shape != packed.shape[:-1]:
            raise ShapeError(
                f"{self.name} norms must have shape {tuple(packed.shape[:-1])}, "
                f"got {tuple(norms.shape)}"
            )
        check_device(packed, self.device, f"{self.name} packed codes")
        check_device(norms, self.device, f"{self.name} norms")
        if self.check_finite and not bool(torch.isfinite(norms).all()):
            raise NonFiniteError(f"{self.name} norms contain NaN or ±inf (a corrupt slot, or "
                                 f"a norm that overflowed bf16 at compress time)")

    def decompress_rotated(self, packed: torch.Tensor, norms: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rotated-space reconstruction ``ŷ = |n| · c[idx] / sqrt(d)``, ``(..., head_dim)`` in
        ``dtype`` (computed in float64 when ``dtype`` is float64, for reference oracles); the
        vector relative to the offset its norm's sign selects (see :meth:`decompress`).

        Raises:
            DtypeError: ``dtype`` not a floating dtype; packed / norms of the wrong dtype.
            ShapeError, DeviceMismatchError: packed / norms of the wrong shape or device.
            NonFiniteError: a NaN / ±inf norm, when the codec checks values (``check_finite``,
                a device sync)."""
        self._check_packed(packed, norms, dtype)
        work = torch.float64 if dtype == torch.float64 else torch.float32
        if self._byte_table is not None and work == torch.float32:
            vals = torch.nn.functional.embedding(packed.long(), self._byte_table)
            per_byte = self._byte_table.shape[1]          # codes per byte (8 // bits)
            vals = vals.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
            vals = vals[..., : self.head_dim]
            return (vals * norms.to(work).abs().unsqueeze(-1)).to(dtype)
        codes = unpack_codes(packed, self.bits, self.head_dim)
        table = self._scaled_centroids if work == torch.float32 else (
            self.centroids.double() / math.sqrt(self.head_dim))
        y = table[codes] * norms.to(work).abs().unsqueeze(-1)
        return y.to(dtype)

    def decompress(self, packed: torch.Tensor, norms: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Original-space reconstruction ``x̂ = s ⊙ Rᵀ ŷ + μ``: ``(..., head_dim)`` ``dtype``.
        With a per-head μ ``(H, head_dim)``, ``packed`` must be ``(..., H, packed_bytes)``
        (ShapeError otherwise) and μ[h] is added to head h. With a ``sink_offset``, vectors
        whose norm has its sign bit set get the sink offset instead of μ.

        Raises:
            DtypeError: ``dtype`` not a floating dtype; packed / norms of the wrong dtype.
            ShapeError, DeviceMismatchError: packed / norms of the wrong shape or device.
            NonFiniteError: a NaN / ±inf norm (with ``check_finite``)."""
        _check_out_dtype(dtype, f"{self.name} decompress")
        if isinstance(packed, torch.Tensor):
            self._check_heads(packed.shape[:-1], f"{self.name} packed", packed.shape,
                              self.packed_bytes)
        work = torch.float64 if dtype == torch.float64 else torch.float32
        x = self.rotation.inverse(self.decompress_rotated(packed, norms, work))
        if self.channel_scales is not None:
            x = x * self.channel_scales.to(work)
        if self.sink_offset is not None:
            base = 0 if self.channel_offset is None else self.channel_offset.to(work)
            x = x + torch.where(torch.signbit(norms).unsqueeze(-1), self.sink_offset.to(work),
                                base)
        elif self.channel_offset is not None:
            x = x + self.channel_offset.to(work)
        return x.to(dtype)


class TurboKVCodec:
    """TurboQuant codec for one attention layer's K and V (module docstring gives the math).

    Args:
        head_dim: vector length d (any positive int; power-of-two d uses a pure fast WHT,
            others the exact ``H_p ⊗ DCT_m`` scheme of :mod:`tkv.codec.rotation`).
        bit_width: default width for both sides, 2..8.
        k_bits, v_bits: per-side widths (default ``bit_width``), 2..8, odd widths included.
        device: where the codec's tables live; inputs must be on the same device.
        seed: seed of the rotation's random signs (K and V share one rotation), an int in
            ``[0, 2**64)`` (SplitMix64's state; others would alias).
        k_norm_correction: store ``‖y‖ / ‖û‖`` for keys so that ``‖x̂‖ = ‖x‖``. Why keys and not
            values: Lloyd-Max centroids are conditional means, so ``E‖û‖² = 1 − D_b < 1`` and every
            reconstructed key is shrunk; logits ``q·k`` shrink with it, i.e. a systematic
            temperature rise that flattens every attention row the same way. Restoring the norm
            removes that bias (errors become rotations of k, not shrinkage). For values the
            conditional-mean reconstruction is already the unbiased, MSE-optimal estimate of
            ``Σ p_j v_j``; rescaling would amplify the error instead.
        k_channel_scales, v_channel_scales: positive float ``(head_dim,)`` prescales or None.
        k_channel_offset: key mean μ subtracted before compression (None: no centering), float
            ``(head_dim,)`` (one mean shared by all KV heads) or ``(num_kv_heads, head_dim)`` (one
            mean per KV head; ``compress_k``/``decompress_k`` then require keys of shape
            ``(..., num_kv_heads, head_dim)`` and raise ShapeError otherwise). Exact for attention: a score ``⟨q, k⟩ = ⟨q, k − μ⟩ + ⟨q, μ⟩`` only
            gains a per-query constant, which softmax ignores, so kernels attend over the
            centered keys (``decompress_k_rotated``) unchanged while ``decompress_k`` adds μ
            back. Removing the shared mean shrinks what the quantizer has to spend bits on.
        k_sink_offset, v_sink_offset: a second offset per side (same shapes as
            ``k_channel_offset``; None: off), for attention sinks: each vector is coded
            relative to ``k_channel_offset`` (V: 0) or to the sink offset, whichever
            reconstructs it better in rotated space, the choice stored as the sign of its bf16
            norm — no extra bytes (``benchmarks/results/sink_offset_cpu.md``: 0.72-0.74× the
            teacher-forced KL of SmolLM2's 4.0 row with the position-0 mean key and value).
            Attention over such keys adds ``⟨q, sink − μ⟩`` to the scores of flagged keys (a
            per-query constant no longer) and ``σ_v`` times the flagged softmax mass to the
            output; tkv's kernels do both (:meth:`SideCodec.sink_shift_rotated`).
        k_codebook, v_codebook: a :class:`Codebook` (or ``2**bits`` centroids) of the side's
            width, ``"gaussian"`` (default) or ``"beta"`` (exact sphere marginal for head_dim).
        check_finite: reject NaN/Inf inputs with NonFiniteError (a device sync; turn off in
            hot paths).

    Raises:
        BitWidthError: a width outside 2..8. CodebookError: codebook size ≠ ``2**bits``.
        ShapeError / NonFiniteError / ValueError: malformed channel scales.
        ValueError: a ``seed`` that is not an int in ``[0, 2**64)``.

    Example::

        codec = TurboKVCodec(head_dim=128, bit_width=4, device="cpu")
        packed, norms = codec.compress_k(torch.randn(8, 128))   # uint8 (8, 64), bf16 (8,)
        recon = codec.decompress_k(packed, norms)                # float32 (8, 128)
    """

    def __init__(self, head_dim: int, bit_width: int = 4, *, k_bits: int | None = None,
                 v_bits: int | None = None, device: torch.device | str = "cpu", seed: int = 0,
                 k_norm_correction: bool = True, k_channel_scales=None, v_channel_scales=None,
                 k_codebook=None, v_codebook=None, check_finite: bool = True,
                 k_channel_offset=None, k_sink_offset=None, v_sink_offset=None):
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ShapeError(f"head_dim must be a positive int, got {head_dim!r}")
        check_bits(bit_width, "bit_width")
        self.head_dim = head_dim
        self.k_bits = check_bits(bit_width if k_bits is None else k_bits, "k_bits")
        self.v_bits = check_bits(bit_width if v_bits is None else v_bits, "v_bits")
        self.device = torch.device(device)
        self.seed = check_seed(seed)
        self.rotation = HadamardRotation(head_dim, seed, self.device)
        ks = check_channel_scales(k_channel_scales, head_dim, "k_channel_scales")
        vs = check_channel_scales(v_channel_scales, head_dim, "v_channel_scales")
        km = check_channel_offset(k_channel_offset, head_dim, "k_channel_offset")
        ksk = check_channel_offset(k_sink_offset, head_dim, "k_sink_offset")
        vsk = check_channel_offset(v_sink_offset, head_dim, "v_sink_offset")
        self.k = SideCodec("K", head_dim, self.k_bits, self.rotation,
                           _as_codebook(k_codebook, self.k_bits, head_dim, "k_codebook"), ks,
                           k_norm_correction, self.device, check_finite, channel_offset=km,
                           sink_offset=ksk)
        self.v = SideCodec("V", head_dim, self.v_bits, self.rotation,
                           _as_codebook(v_codebook, self.v_bits, head_dim, "v_codebook"), vs,
                           False, self.device, check_finite, sink_offset=vsk)

    @property
    def has_sink_offset(self) -> bool:
        """True when either side codes vectors relative to a second (sink) offset."""
        return self.k.sink_offset is not None or self.v.sink_offset is not None

    # ------------------------------------------------------------------ sizes
    @property
    def k_packed_bytes(self) -> int:
        """Bytes of one packed key: ``ceil(head_dim * k_bits / 8)`` (norm not included)."""
        return self.k.packed_bytes

    @property
    def v_packed_bytes(self) -> int:
        """Bytes of one packed value: ``ceil(head_dim * v_bits / 8)`` (norm not included)."""
        return self.v.packed_bytes

    def layout(self, num_kv_heads: int, block_size: int) -> SlotLayout:
        """The paged-cache :class:`~tkv.codec.layout.SlotLayout` for this codec's widths."""
        return SlotLayout(self.head_dim, num_kv_heads, self.k_bits, self.v_bits, block_size)

    # ------------------------------------------------------------------ K / V
    def compress_k(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``(..., head_dim)`` float16/bfloat16/float32 → ``(uint8 (..., k_packed_bytes),
        bfloat16 norms (...))``. Raises DtypeError/ShapeError/DeviceMismatchError/NonFiniteError."""
        return self.k.compress(x)

    def compress_v(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Values; as :meth:`compress_k` with ``v_packed_bytes`` (no norm correction)."""
        return self.v.compress(x)

    def decompress_k(self, packed: torch.Tensor, norms: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(uint8 (..., k_packed_bytes), norms (...))`` → keys ``(..., head_dim)`` in ``dtype``."""
        return self.k.decompress(packed, norms, dtype)

    def decompress_v(self, packed: torch.Tensor, norms: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """As :meth:`decompress_k`, for values."""
        return self.v.decompress(packed, norms, dtype)

    def decompress_k_rotated(self, packed: torch.Tensor, norms: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Keys in rotated, prescaled (and centered, if ``k_channel_offset``) space
        ``R ((k − μ) / s_k)``, ``(..., head_dim)``; pair with :meth:`rotate_query`."""
        return self.k.decompress_rotated(packed, norms, dtype)

    def decompress_v_rotated(self, packed: torch.Tensor, norms: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values in rotated, prescaled space ``R (v / s_v)``; pair with :meth:`unrotate_output`."""
        return self.v.decompress_rotated(packed, norms, dtype)

    # ------------------------------------------------------------------ rotated attention
    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """``R (q ⊙ s_k)``: query ``(..., head_dim)`` into the keys' rotated space, float32
        (float64 stays float64). Then ``⟨rotate_query(q), decompress_k_rotated(k)⟩ = ⟨q, k̂⟩``."""
        check_vectors(q, self.head_dim, self.device, "query", self.k.check_finite)
        qf = q.float() if q.dtype != torch.float64 else q
        if self.k.channel_scales is not None:
            qf = qf * self.k.channel_scales.to(qf.dtype)
        return self.rotation.forward(qf)

    def unrotate_output(self, o: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s_v ⊙ Rᵀ o``: attention output computed on rotated values back to model space.
        ``o`` ``(..., head_dim)``; returns ``dtype`` (default: ``o.dtype``)."""
        check_vectors(o, self.head_dim, self.device, "attention output", self.v.check_finite)
        if dtype is not None:
            _check_out_dtype(dtype, "unrotate_output")
        of = o.float() if o.dtype != torch.float64 else o
        x = self.rotation.inverse(of)
        if self.v.channel_scales is not None:
            x = x * self.v.channel_scales.to(x.dtype)
        return x.to(o.dtype if dtype is None else dtype)

    def __repr__(self) -> str:
        return (f"TurboKVCodec(head_dim={self.head_dim}, k_bits={self.k_bits}, "
                f"v_bits={self.v_bits}, device={str(self.device)!r}, seed={self.seed})")
