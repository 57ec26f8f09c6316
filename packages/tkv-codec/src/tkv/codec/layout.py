"""The one source of truth for the bytes of the tkv paged KV cache.

Codec, kernels, engine adapters and the capacity math all read sizes and offsets from here;
nothing else in tkv may restate these formulas.

Per token and KV head, a side (K or V) with ``b`` bits takes

* codes: ``ceil(head_dim · b / 8)`` bytes (LSB-first packing, :mod:`tkv.codec.packing`), and
* norm: 2 bytes (one bfloat16).

A *page* holds one block of ``block_size`` tokens of one layer, all ``num_kv_heads`` heads, K
and V, as four regions, each head-major so that one KV head's tile of a block is one
contiguous run of bytes (decode reads it with 16-byte vector loads)::

    offset 0              K codes   [num_kv_heads][block_size][k_code_bytes]   uint8
    k_norms_offset        K norms   [num_kv_heads][block_size]                 bfloat16
    v_codes_offset        V codes   [num_kv_heads][block_size][v_code_bytes]   uint8
    v_norms_offset        V norms   [num_kv_heads][block_size]                 bfloat16
    page_bytes            (end, rounded up to ALIGN)

Every region starts on an ``ALIGN`` = 16-byte boundary. When ``block_size`` is a multiple of
16 (vLLM/SGLang use 16..128) every region is already a multiple of 16 bytes, so the padding
is zero and the page costs exactly the ideal code + norm bytes. A cache tensor is
``uint8 (num_blocks, page_bytes)``; a slot (vLLM's ``slot_mapping`` entry) is
``block_id * block_size + offset_in_block``. ``docs/layout.md`` has the diagram.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .errors import DtypeError, ShapeError
from .packing import check_bits, packed_bytes

__all__ = [
    "ALIGN",
    "BF16_BYTES",
    "NORM_BYTES",
    "ModelLayout",
    "SlotLayout",
    "effective_bits_per_element",
    "side_slot_bytes",
]

ALIGN = 16
NORM_BYTES = 2  # one bfloat16 norm per vector
BF16_BYTES = 2


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def side_slot_bytes(head_dim: int, bits: int) -> int:
    """Bytes one token of one KV head takes on one side: ``ceil(head_dim·bits/8) + 2``.

    Raises:
        ShapeError: ``head_dim`` not a positive int. BitWidthError: bits outside 2..8."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ShapeError(f"head_dim must be a positive int, got {head_dim!r}")
    return packed_bytes(head_dim, bits) + NORM_BYTES


def effective_bits_per_element(head_dim: int, k_bits: int, v_bits: int) -> float:
    """Real cost in bits per K/V element, norms included:
    ``8 · (k_slot_bytes + v_slot_bytes) / (2 · head_dim)`` (K4V4 at d=128: 4.125)."""
    return 8 * (side_slot_bytes(head_dim, k_bits) + side_slot_bytes(head_dim, v_bits)) / (
        2 * head_dim
    )


@dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one layer's paged tkv cache (see module docstring for the diagram).

    Args:
        head_dim: elements per head vector.
        num_kv_heads: KV heads of this layer (per tensor-parallel rank if sharded).
        k_bits, v_bits: code widths 2..8.
        block_size: tokens per page (any positive int; multiples of 16 give zero padding).

    Attributes (all in bytes unless noted):
        k_code_bytes, v_code_bytes: packed codes per token per head.
        k_slot_bytes, v_slot_bytes: codes + norm per token per head.
        k_codes_offset, k_norms_offset, v_codes_offset, v_norms_offset: region starts in a page.
        page_bytes: bytes of one page (one block), a multiple of ALIGN.

    Raises:
        BitWidthError: widths outside 2..8. ShapeError: non-positive sizes.
    """

    head_dim: int
    num_kv_heads: int
    k_bits: int
    v_bits: int
    block_size: int
    k_code_bytes: int = field(init=False)
    v_code_bytes: int = field(init=False)
    k_codes_offset: int = field(init=False)
    k_norms_offset: int = field(init=False)
    v_codes_offset: int = field(init=False)
    v_norms_offset: int = field(init=False)
    page_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("head_dim", "num_kv_heads", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ShapeError(f"SlotLayout.{name} must be a positive int, got {v!r}")
        check_bits(self.k_bits, "k_bits")
        check_bits(self.v_bits, "v_bits")
        h, b = self.num_kv_heads, self.block_size
        kc = packed_bytes(self.head_dim, self.k_bits)
        vc = packed_bytes(self.head_dim, self.v_bits)
        k_norms = _align_up(h * b * kc)
        v_codes = _align_up(k_norms + h * b * NORM_BYTES)
        v_norms = _align_up(v_codes + h * b * vc)
        page = _align_up(v_norms + h * b * NORM_BYTES)
        for k, v in dict(k_code_bytes=kc, v_code_bytes=vc, k_codes_offset=0,
                         k_norms_offset=k_norms, v_codes_offset=v_codes, v_norms_offset=v_norms,
                         page_bytes=page).items():
            object.__setattr__(self, k, v)

    # ------------------------------------------------------------------ per token
    @property
    def k_slot_bytes(self) -> int:
        """K bytes per token per head: codes + bf16 norm."""
        return self.k_code_bytes + NORM_BYTES

    @property
    def v_slot_bytes(self) -> int:
        """V bytes per token per head: codes + bf16 norm."""
        return self.v_code_bytes + NORM_BYTES

    @property
    def ideal_bytes_per_token(self) -> int:
        """Code + norm bytes per token, all heads, K and V, without any padding."""
        return self.num_kv_heads * (self.k_slot_bytes + self.v_slot_bytes)

    @property
    def bytes_per_token(self) -> float:
        """Page bytes per token (padding included): ``page_bytes / block_size``."""
        return self.page_bytes / self.block_size

    @property
    def padding_bytes(self) -> int:
        """Alignment padding in one page."""
        return self.page_bytes - self.block_size * self.ideal_bytes_per_token

    @property
    def bf16_bytes_per_token(self) -> int:
        """What a bf16 cache spends per token on this layer: ``2 · num_kv_heads · head_dim · 2``."""
        return 2 * self.num_kv_heads * self.head_dim * BF16_BYTES

    @property
    def capacity_ratio(self) -> float:
        """Tokens resident per byte relative to bf16 (K4V4 at d=128: 512/132 ≈ 3.88×)."""
        return self.bf16_bytes_per_token / self.bytes_per_token

    @property
    def overhead(self) -> float:
        """Fraction of page bytes above the ideal code+norm bytes (0 for block_size % 16 == 0)."""
        return self.padding_bytes / self.page_bytes

    @property
    def bits_per_element(self) -> float:
        """Page bits per cached K/V element, norms and padding included."""
        return 8 * self.bytes_per_token / (2 * self.num_kv_heads * self.head_dim)

    # ------------------------------------------------------------------ strides for kernels
    def strides(self) -> dict[str, int]:
        """Element strides inside a page, for kernels: codes ``[head][token][byte]``, norms
        ``[head][token]`` (norm strides in bf16 elements)."""
        b = self.block_size
        return {
            "k_head": b * self.k_code_bytes, "k_token": self.k_code_bytes,
            "v_head": b * self.v_code_bytes, "v_token": self.v_code_bytes,
            "norm_head": b, "norm_token": 1,
        }

    # ------------------------------------------------------------------ tensors
    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed cache ``uint8 (num_blocks, page_bytes)``.

        Raises:
            ShapeError: ``num_blocks`` not an int ≥ 0."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ShapeError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        return torch.zeros(num_blocks, self.page_bytes, dtype=torch.uint8, device=device)

    def views(self, cache: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-copy views of a cache ``uint8 (num_blocks, page_bytes)``:

        ``k_codes`` uint8 ``(num_blocks, H, B, k_code_bytes)``, ``k_norms`` bf16 ``(num_blocks,
        H, B)``, ``v_codes``, ``v_norms`` likewise. Writing into a view writes the cache.

        Raises:
            DtypeError: cache not uint8. ShapeError: not 2-D, last dim ≠ page_bytes, or not
            unit stride on it (rows further apart than ``page_bytes`` are fine: the views
            follow the row stride; tkv's kernels need a contiguous cache and check it).
        """
        if cache.dtype != torch.uint8:
            raise DtypeError(f"a tkv cache is uint8, got {cache.dtype}")
        if cache.dim() != 2 or cache.shape[1] != self.page_bytes or cache.stride(1) != 1:
            raise ShapeError(
                f"a tkv cache must be (num_blocks, {self.page_bytes}) with unit stride on the "
                f"last dim, got shape {tuple(cache.shape)} strides {cache.stride()}"
            )
        n, h, b = cache.shape[0], self.num_kv_heads, self.block_size

        def codes(off: int, nbytes: int) -> torch.Tensor:
            return cache[:, off: off + h * b * nbytes].view(n, h, b, nbytes)

        def norms(off: int) -> torch.Tensor:
            return cache[:, off: off + h * b * NORM_BYTES].view(torch.bfloat16).view(n, h, b)

        return {
            "k_codes": codes(self.k_codes_offset, self.k_code_bytes),
            "k_norms": norms(self.k_norms_offset),
            "v_codes": codes(self.v_codes_offset, self.v_code_bytes),
            "v_norms": norms(self.v_norms_offset),
        }

    def describe(self) -> str:
        """One line: widths, bytes per token, page bytes, capacity vs bf16."""
        return (f"K{self.k_bits}V{self.v_bits} head_dim={self.head_dim} "
                f"kv_heads={self.num_kv_heads} block={self.block_size}: "
                f"{self.bytes_per_token:g} B/token, page {self.page_bytes} B, "
                f"{self.capacity_ratio:.3f}x vs bf16")


@dataclass(frozen=True)
class ModelLayout:
    """Per-layer :class:`SlotLayout` s of a whole model (layers may differ in widths).

    Args:
        layers: one SlotLayout per attention layer, in layer order.
    """

    layers: tuple[SlotLayout, ...]

    def __post_init__(self) -> None:
        """Raises ShapeError: no layers, a non-SlotLayout entry, or layers with different
        block sizes (every layer of a paged cache holds the same tokens per block)."""
        layers = tuple(self.layers)
        if not layers:
            raise ShapeError("a ModelLayout needs one SlotLayout per attention layer (at least "
                             "one), got none")
        bad = [i for i, lay in enumerate(layers) if not isinstance(lay, SlotLayout)]
        if bad:
            raise ShapeError(f"a ModelLayout holds SlotLayouts; entry {bad[0]} is a "
                             f"{type(layers[bad[0]]).__name__}")
        sizes = {lay.block_size for lay in layers}
        if len(sizes) > 1:
            raise ShapeError(f"layers of one ModelLayout share a block size, got {sorted(sizes)}")
        object.__setattr__(self, "layers", layers)

    @classmethod
    def uniform(cls, num_layers: int, head_dim: int, num_kv_heads: int, k_bits: int,
                v_bits: int, block_size: int) -> ModelLayout:
        """Every layer with the same widths."""
        return cls(tuple(SlotLayout(head_dim, num_kv_heads, k_bits, v_bits, block_size)
                         for _ in range(num_layers)))

    @classmethod
    def from_allocation(cls, head_dim: int, num_kv_heads: int, k_bits: Sequence[int],
                        v_bits: Sequence[int], block_size: int) -> ModelLayout:
        """Layers with per-layer widths (a SmartMix allocation)."""
        if len(k_bits) != len(v_bits):
            raise ShapeError(f"k_bits has {len(k_bits)} layers, v_bits {len(v_bits)}")
        return cls(tuple(SlotLayout(head_dim, num_kv_heads, kb, vb, block_size)
                         for kb, vb in zip(k_bits, v_bits, strict=True)))

    @property
    def bytes_per_token(self) -> float:
        """Cache bytes per token across all layers (page padding included)."""
        return sum(lay.bytes_per_token for lay in self.layers)

    @property
    def bf16_bytes_per_token(self) -> int:
        """bf16 cache bytes per token across all layers."""
        return sum(lay.bf16_bytes_per_token for lay in self.layers)

    @property
    def capacity_ratio(self) -> float:
        """Resident tokens relative to bf16 at equal memory."""
        return self.bf16_bytes_per_token / self.bytes_per_token

    @property
    def bits_per_element(self) -> float:
        """Average bits per cached K/V element over the model, norms and padding included."""
        elems = sum(2 * lay.num_kv_heads * lay.head_dim for lay in self.layers)
        return 8 * self.bytes_per_token / elems

    def tokens_that_fit(self, nbytes: int) -> int:
        """Whole blocks' worth of tokens a memory budget of ``nbytes`` holds (every layer
        holds the same number of blocks).

        Raises:
            ValueError: ``nbytes`` negative, not finite, or not a number."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) \
                or not math.isfinite(nbytes) or nbytes < 0:
            raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
        block = self.layers[0].block_size
        per_block = sum(lay.page_bytes for lay in self.layers)
        return int(nbytes // per_block) * block
