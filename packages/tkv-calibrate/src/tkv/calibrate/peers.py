"""KV-cache formats people serve today, emulated in PyTorch from their published formulas, so
the report can put tkv beside them at equal bytes per token. None of this is tkv's codec.

* ``fp8-e4m3``: K and V cast to float8 e4m3 with one per-tensor scale ``amax / 448`` per
  layer and side (vLLM ``--kv-cache-dtype fp8`` with a calibrated per-tensor scale;
  transformers' ``Fp8QuantizedLayer``). 1 byte per element.
* ``KIVI int4`` (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
  Cache", Sec. 3): asymmetric min/max integer quantization, keys per channel over groups of 32
  tokens, values per token over groups of 32 channels; fp16 scale and zero point per group.
  A trailing partial token group is quantized on its own (KIVI would keep it in fp16: this
  is slightly pessimistic for KIVI on the last < 32 tokens).
* vLLM 0.20.1 TurboQuant presets (``--kv-cache-dtype turboquant_*``): keys normalized,
  randomized-Hadamard rotated, each coordinate on the Gaussian Lloyd-Max codebook, one fp16
  norm (``_nc``: the reconstructed unit vector is renormalized before the inverse rotation);
  ``k8v4`` keys are fp8 without rotation. Values: per-token asymmetric min/max uniform with
  fp16 scale + zero. Slot = ``ceil(d·kb/8) + 2`` (fp8 keys: ``d``) ``+ ceil(d·vb/8) + 4``
  bytes rounded up to even (196/134/118/102 B at head_dim 128). The first and last 2 layers
  stay bf16 (vLLM's boundary protection for dense models, capped at num_layers/2).
* uncalibrated TurboQuant: tkv's codec with Gaussian codebooks and no channel scales.
"""

from __future__ import annotations

import math

import torch

from tkv.codec import HadamardRotation, TurboKVCodec, gaussian_codebook

from .evaluate import Arm
from .quantizers import TkvQuantizer

__all__ = [
    "Fp8Quantizer",
    "KiviQuantizer",
    "VllmTurboQuantQuantizer",
    "bf16_bytes_per_token_head",
    "peer_arms",
    "uncalibrated_arm",
]

FP8_MAX = 448.0
VLLM_PRESETS = {  # name: (key bits or "fp8", value bits, norm correction)
    "turboquant_k8v4": ("fp8", 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
BOUNDARY_LAYERS = 2


def bf16_bytes_per_token_head(head_dim: int) -> int:
    """An uncompressed bf16 K+V slot: ``2 sides · head_dim · 2 bytes``."""
    return 4 * head_dim


def _fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax().float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def _asym_uniform(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min/max quantization along ``dim`` with fp16 scale and zero point."""
    lo = x.amin(dim=dim, keepdim=True).half().float()
    hi = x.amax(dim=dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).half().float().clamp_min(1e-8)
    q = torch.clamp(torch.round((x - lo) / scale), 0, levels)
    return (q * scale + lo).to(x.dtype)


class Fp8Quantizer:
    """fp8 e4m3 K and V, per-tensor scale (module docstring)."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.name = "fp8-e4m3 per-tensor"

    def roundtrip(self, k, v):
        return _fp8_roundtrip(k), _fp8_roundtrip(v)

    def bytes_per_token_head(self) -> float:
        return 2 * self.head_dim  # + 2 per-tensor fp32 scales per layer, negligible per token


class KiviQuantizer:
    """KIVI-style int4: K per channel over token groups, V per token over channel groups."""

    def __init__(self, head_dim: int, bits: int = 4, group: int = 32):
        self.head_dim, self.bits, self.group = head_dim, bits, group
        self.name = f"KIVI int{bits} (g{group})"

    def roundtrip(self, k, v):
        b, h, t, d = k.shape
        g = self.group
        pieces = []
        for s in range(0, t, g):  # K: per channel over groups of g tokens
            pieces.append(_asym_uniform(k[:, :, s:s + g].float(), self.bits, dim=2))
        kq = torch.cat(pieces, dim=2).to(k.dtype)
        gv = min(g, d)
        vv = v.float().reshape(b, h, t, d // gv, gv)
        vq = _asym_uniform(vv, self.bits, dim=-1).reshape(b, h, t, d).to(v.dtype)
        return kq, vq

    def bytes_per_token_head(self) -> float:
        d, g = self.head_dim, self.group
        codes = 2 * math.ceil(d * self.bits / 8)
        k_meta = d * 4 / g           # fp16 scale+zero per channel per g tokens
        v_meta = (d // min(g, d)) * 4  # fp16 scale+zero per channel group per token
        return codes + k_meta + v_meta


class VllmTurboQuantQuantizer:
    """One of vLLM 0.20.1's TurboQuant presets (module docstring)."""

    def __init__(self, head_dim: int, preset: str, seed: int = 0):
        if preset not in VLLM_PRESETS:
            raise ValueError(f"unknown vLLM TurboQuant preset {preset!r}; "
                             f"known: {', '.join(VLLM_PRESETS)}")
        self.head_dim, self.preset = head_dim, preset
        self.k_bits, self.v_bits, self.nc = VLLM_PRESETS[preset]
        self.name = f"vLLM {preset}"
        self.rotation = HadamardRotation(head_dim, seed)
        if self.k_bits != "fp8":
            cb = gaussian_codebook(self.k_bits)
            self.centroids = cb.centroids
            self.boundaries = cb.boundaries

    def _keys(self, k: torch.Tensor) -> torch.Tensor:
        if self.k_bits == "fp8":
            return _fp8_roundtrip(k)
        d = self.head_dim
        x = k.float()
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        u = x / n.clamp_min(1e-30)
        z = self.rotation.forward(u) * math.sqrt(d)
        c = self.centroids[torch.bucketize(z, self.boundaries)] / math.sqrt(d)
        if self.nc:
            c = c / torch.linalg.vector_norm(c, dim=-1, keepdim=True).clamp_min(1e-30)
        return (self.rotation.inverse(c) * n.half().float()).to(k.dtype)

    def roundtrip(self, k, v):
        return self._keys(k), _asym_uniform(v.float(), self.v_bits, dim=-1).to(v.dtype)

    def bytes_per_token_head(self) -> float:
        d = self.head_dim
        kb = d if self.k_bits == "fp8" else math.ceil(d * self.k_bits / 8) + 2
        slot = kb + math.ceil(d * self.v_bits / 8) + 4
        return slot + slot % 2


def _avg_bytes(quantizers, head_dim: int) -> float:
    return sum(bf16_bytes_per_token_head(head_dim) if q is None else q.bytes_per_token_head()
               for q in quantizers) / len(quantizers)


def uncalibrated_arm(num_layers: int, head_dim: int, bits: int, seed: int = 0) -> Arm:
    """Uniform tkv K=V=``bits`` with Gaussian codebooks and no channel scales."""
    qs = [TkvQuantizer(TurboKVCodec(head_dim, bits, seed=seed, check_finite=False))
          for _ in range(num_layers)]
    return Arm(f"uncalibrated TurboQuant K{bits}V{bits}", qs, _avg_bytes(qs, head_dim),
               "uncalibrated", {"k_bits": bits, "v_bits": bits})


def peer_arms(num_layers: int, head_dim: int, seed: int = 0) -> list[Arm]:
    """fp8, KIVI int4 and the four vLLM TurboQuant presets (boundary layers bf16)."""
    arms = []
    for name, q in (("fp8-e4m3 per-tensor", Fp8Quantizer(head_dim)),
                    ("KIVI int4 (K/ch g32, V/tok)", KiviQuantizer(head_dim))):
        qs = [q] * num_layers
        arms.append(Arm(name, qs, _avg_bytes(qs, head_dim), "peer",
                        {"slot_bytes": q.bytes_per_token_head()}))
    nb = min(BOUNDARY_LAYERS, num_layers // 2)
    for preset in VLLM_PRESETS:
        q = VllmTurboQuantQuantizer(head_dim, preset, seed)
        qs = [None if i < nb or i >= num_layers - nb else q for i in range(num_layers)]
        arms.append(Arm(f"vLLM {preset} ({nb}+{nb} bf16)", qs, _avg_bytes(qs, head_dim), "peer",
                        {"slot_bytes": q.bytes_per_token_head()}))
    return arms
