"""Transformers caches that store K/V compressed and hand the dequantized K/V to attention.

* :class:`TkvCache` — each layer keeps the tkv packed codes and bf16 norms (the real
  compressed cache) plus the dequantized mirror attention reads; per-layer widths come from a
  calibration bundle row (or explicit codecs). ``model.generate(..., past_key_values=TkvCache(...))``
  works. This is the CPU reference arm the GPU kernels and engine adapters are checked against.
* :class:`QuantizedKVCache` — the same for any :class:`~tkv.calibrate.quantizers.KVQuantizer`
  (used for peers: fp8, KIVI, vLLM TurboQuant presets).

Prefill: ``prefill="compressed"`` (default) makes every attention call, prompt included, read
the dequantized cache (teacher-forced evaluation). ``prefill="bypass"`` lets the first chunk
(the prompt) attend to its own uncompressed K/V while storing it compressed, as vLLM/SGLang
prefill does; every later token reads the compressed cache. Layers given ``None`` stay
uncompressed (vLLM's boundary layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from tkv.codec import CalibrationBundle, TurboKVCodec
from tkv.codec.errors import ShapeError

from .quantizers import KVQuantizer, TkvQuantizer

__all__ = ["PREFILL_MODES", "QuantizedKVCache", "QuantizedKVLayer", "TkvCache", "TkvLayer"]

PREFILL_MODES = ("compressed", "bypass")


def _check_prefill(prefill: str) -> str:
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
    return prefill


class QuantizedKVLayer(DynamicLayer):
    """One layer: stores what ``quantizer.roundtrip`` returns; ``None`` = uncompressed.

    ``keys`` / ``values`` hold the dequantized K/V ``(B, H, T, d)`` that attention reads.
    """

    is_croppable = False

    def __init__(self, quantizer: KVQuantizer | None, prefill: str = "compressed"):
        super().__init__()
        self.quantizer = quantizer
        self.prefill = _check_prefill(prefill)

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.quantizer.roundtrip(k, v)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append K/V ``(B, H, T, d)`` (same shape both) and return what attention reads.

        Raises:
            ShapeError: K/V not 4-D, or of different shapes."""
        if key_states.dim() != 4 or tuple(value_states.shape) != tuple(key_states.shape):
            raise ShapeError(f"key/value states must both be (batch, kv_heads, tokens, head_dim), "
                             f"got {tuple(key_states.shape)} / {tuple(value_states.shape)}")
        if self.quantizer is None:
            return super().update(key_states, value_states)
        first = not self.is_initialized or self.keys.numel() == 0
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kq, vq = self._store(key_states, value_states)
        self.keys = torch.cat([self.keys, kq.to(key_states.dtype)], dim=-2)
        self.values = torch.cat([self.values, vq.to(value_states.dtype)], dim=-2)
        if first and self.prefill == "bypass":
            return key_states, value_states
        return self.keys, self.values


class TkvLayer(QuantizedKVLayer):
    """One layer of :class:`TkvCache`: packed codes + bf16 norms per side, and their decode.

    Attributes:
        k_codes, v_codes: uint8 ``(B, H, T, ceil(d·bits/8))``; k_norms, v_norms: bf16 ``(B, H, T)``.

    Every cache operation transformers applies to the dequantized K/V (beam-search
    ``reorder_cache``, ``crop``, ``reset``, ``batch_repeat_interleave``,
    ``batch_select_indices``) is applied to the codes and norms too, so that they always
    decode to what attention reads.
    """

    REGIONS = ("k_codes", "k_norms", "v_codes", "v_norms")

    def __init__(self, quantizer: TkvQuantizer | None, prefill: str = "compressed"):
        super().__init__(quantizer, prefill)
        self.k_codes = self.k_norms = self.v_codes = self.v_norms = None

    def _store(self, k, v):
        (kc, kn), (vc, vn) = self.quantizer.encode(k, v)
        cat = lambda old, new: new if old is None else torch.cat([old, new], dim=2)  # tokens
        self.k_codes, self.k_norms = cat(self.k_codes, kc), cat(self.k_norms, kn)
        self.v_codes, self.v_norms = cat(self.v_codes, vc), cat(self.v_norms, vn)
        return self.quantizer.decode((kc, kn), (vc, vn), k.dtype)

    def _apply(self, fn) -> None:
        """``fn`` on every held code / norm tensor (batch is dim 0, tokens dim 2 in all four)."""
        for name in self.REGIONS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    def reset(self) -> None:
        super().reset()
        self._apply(lambda t: None)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self.keys is not None:
            n = self.keys.shape[-2]
            self._apply(lambda t: t[:, :, :n])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._apply(lambda t: t[indices, ...])

    def compressed_bytes(self) -> int:
        """Bytes held by the packed codes and norms of this layer."""
        if self.k_codes is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.k_norms,
                                                          self.v_codes, self.v_norms))


class QuantizedKVCache(Cache):
    """A cache whose layer ``i`` stores K/V through ``quantizers[i]`` (``None``: uncompressed).

    Args:
        quantizers: one :class:`KVQuantizer` or None per decoder layer.
        prefill: ``"compressed"`` or ``"bypass"`` (module docstring).
    """

    layer_cls = QuantizedKVLayer

    def __init__(self, quantizers: Sequence[KVQuantizer | None], prefill: str = "compressed"):
        _check_prefill(prefill)
        super().__init__(layers=[self.layer_cls(q, prefill) for q in quantizers])
        self.quantizers = list(quantizers)
        self.prefill = prefill

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        """transformers' ``Cache.update`` for attention layer ``layer_idx``.

        Raises:
            ShapeError: ``layer_idx`` has no layer here (the model has more attention layers
                than the cache was given quantizers / codecs for), or bad K/V shapes."""
        if not 0 <= layer_idx < len(self.layers):
            raise ShapeError(f"attention layer {layer_idx} has no entry in this cache: it was "
                             f"built for {len(self.layers)} layers (one quantizer / codec or None "
                             "per decoder layer of the model)")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def load_prefix(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store already computed (uncompressed-prefill) K/V ``(B, H, T, d)`` per layer, as if a
        prompt had been prefilled: each layer compresses them; nothing is returned.

        Raises:
            ShapeError: ``len(kv)`` differs from the number of layers.
        """
        if len(kv) != len(self.layers):
            raise ShapeError(f"prefix has {len(kv)} layers, cache has {len(self.layers)}")
        for layer, (k, v) in zip(self.layers, kv, strict=True):
            layer.update(k, v)


class TkvCache(QuantizedKVCache):
    """The tkv KV cache for transformers (see module docstring).

    Args:
        codecs: one :class:`tkv.codec.TurboKVCodec` (or None = uncompressed) per layer.
        prefill: ``"compressed"`` (default) or ``"bypass"``.

    Example::

        bundle = CalibrationBundle.load("tkv_bundle.json")
        cache = TkvCache.from_bundle(bundle, 4.0, prefill="bypass")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    """

    layer_cls = TkvLayer

    def __init__(self, codecs: Sequence[TurboKVCodec | None], prefill: str = "compressed"):
        super().__init__([None if c is None else TkvQuantizer(c) for c in codecs], prefill)

    @classmethod
    def from_bundle(cls, bundle: CalibrationBundle, tkv_bits: float | str,
                    prefill: str = "compressed", device="cpu") -> TkvCache:
        """Per-layer codecs of the bundle's ``tkv_bits`` row (raises BudgetRowMissingError)."""
        return cls(bundle.codecs(tkv_bits, device=device, check_finite=False), prefill)

    @classmethod
    def uniform(cls, num_layers: int, head_dim: int, k_bits: int, v_bits: int,
                prefill: str = "compressed", seed: int = 0) -> TkvCache:
        """Uncalibrated uniform tkv (Gaussian codebooks, no channel scales)."""
        return cls([TurboKVCodec(head_dim, k_bits=k_bits, v_bits=v_bits, seed=seed,
                                 check_finite=False) for _ in range(num_layers)], prefill)

    def compressed_bytes(self) -> int:
        """Bytes of packed codes + norms held over all layers."""
        return sum(layer.compressed_bytes() for layer in self.layers if isinstance(layer, TkvLayer))
