"""The per-layer paged tkv cache of one worker, in plain PyTorch: buffers laid out by
:class:`~tkv.codec.layout.SlotLayout`, and token-granular copy / gather / scatter on them.

SGLang addresses the KV cache by *token location* ``loc = page_id · page_size + offset``
(its paged allocator hands out whole pages, page 0 is the padding page padded tokens write
to); that is exactly SlotLayout's *slot*. Every region offset used here comes from
``SlotLayout.views`` — this module never computes a byte offset itself.

The reference store (:meth:`TkvPagedCache.store_reference`) compresses with the layer's
:class:`~tkv.codec.TurboKVCodec`; the serving path uses ``tkv.kernels.compress_store``
(bit-identical up to float32 rounding at bucket boundaries).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tkv.codec.codec import TurboKVCodec
from tkv.codec.errors import DtypeError, ShapeError
from tkv.codec.layout import SlotLayout

__all__ = ["REGIONS", "TkvPagedCache"]

REGIONS = ("k_codes", "k_norms", "v_codes", "v_norms")


class TkvPagedCache:
    """One uint8 ``(num_pages, layout.page_bytes)`` buffer per layer.

    Args:
        layouts: one SlotLayout per layer this worker holds (all with the same block_size =
            SGLang's page_size).
        num_pages: pages per layer, the padding page 0 included.
        device: where the buffers live.

    Raises:
        ShapeError: empty ``layouts``, mixed block sizes, ``num_pages < 2``.
    """

    def __init__(self, layouts: Sequence[SlotLayout], num_pages: int,
                 device: torch.device | str = "cpu"):
        if not layouts:
            raise ShapeError("TkvPagedCache needs at least one layer")
        sizes = {lay.block_size for lay in layouts}
        if len(sizes) != 1:
            raise ShapeError(f"all layers must share one page size, got {sorted(sizes)}")
        if num_pages < 2:
            raise ShapeError(f"num_pages must be ≥ 2 (page 0 is padding), got {num_pages}")
        self.layouts = list(layouts)
        self.page_size = sizes.pop()
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.buffers = [lay.allocate(num_pages, self.device) for lay in self.layouts]
        self._views = [lay.views(buf) for lay, buf in zip(self.layouts, self.buffers, strict=True)]

    @property
    def num_layers(self) -> int:
        return len(self.layouts)

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers."""
        return sum(b.numel() for b in self.buffers)

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        """SlotLayout views of layer ``layer`` (index into this worker's layers)."""
        return self._views[layer]

    def _split(self, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if loc.dtype not in (torch.int32, torch.int64):
            raise DtypeError(f"token locations must be int32/int64, got {loc.dtype}")
        loc = loc.to(device=self.device, dtype=torch.int64).reshape(-1)
        return torch.div(loc, self.page_size, rounding_mode="floor"), loc % self.page_size

    # ------------------------------------------------------------------ writes
    def store_reference(self, layer: int, loc: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, codec: TurboKVCodec) -> None:
        """Compress ``key``/``value`` ``(num_tokens, num_kv_heads, head_dim)`` with ``codec``
        and write them at token locations ``loc`` (int ``(num_tokens,)``) of ``layer``.

        Raises:
            ShapeError: shapes disagree with the layer's layout or with ``loc``.
            DtypeError / NonFiniteError: from the codec.
        """
        lay = self.layouts[layer]
        want = (loc.numel(), lay.num_kv_heads, lay.head_dim)
        if tuple(key.shape) != want or tuple(value.shape) != want:
            raise ShapeError(f"key/value must be {want} for layer {layer}, got "
                             f"{tuple(key.shape)} / {tuple(value.shape)}")
        page, off = self._split(loc)
        kc, kn = codec.compress_k(key)
        vc, vn = codec.compress_v(value)
        v = self._views[layer]
        v["k_codes"][page, :, off] = kc
        v["k_norms"][page, :, off] = kn
        v["v_codes"][page, :, off] = vc
        v["v_norms"][page, :, off] = vn

    def move(self, dst_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Copy every layer's K/V of tokens ``src_loc`` to ``dst_loc`` (same length). Used by
        speculative decoding to compact accepted tokens (``KVCache.move_kv_cache``)."""
        if dst_loc.numel() != src_loc.numel():
            raise ShapeError(f"move: {dst_loc.numel()} destinations for {src_loc.numel()} sources")
        dp, do = self._split(dst_loc)
        sp, so = self._split(src_loc)
        for v in self._views:
            for r in REGIONS:
                v[r][dp, :, do] = v[r][sp, :, so]

    def gather(self, layer: int, loc: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the four regions of tokens ``loc`` of ``layer``: codes ``(n, H,
        code_bytes)`` uint8, norms ``(n, H)`` bf16."""
        page, off = self._split(loc)
        return {r: t[page, :, off] for r, t in self._views[layer].items()}

    def scatter(self, layer: int, loc: torch.Tensor, regions: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`gather`: write the four regions at tokens ``loc`` of ``layer``."""
        page, off = self._split(loc)
        for r, t in self._views[layer].items():
            t[page, :, off] = regions[r].to(t.device)
