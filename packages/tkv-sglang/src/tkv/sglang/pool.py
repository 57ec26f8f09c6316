"""``TkvTokenToKVPool``: SGLang's token-to-KV pool for ``--kv-cache-dtype tkv``.

Pages follow :class:`tkv.codec.layout.SlotLayout` with per-layer (k_bits, v_bits) from the
calibration bundle (:func:`tkv.sglang.config.tkv_config`); SGLang's ``page_size`` is the
layout's ``block_size`` and SGLang's token location is the layout's slot. Page 0 is the
padding page (SGLang's allocators never hand it out; padded tokens of CUDA-graph batches
write there), as in ``MHATokenToKVPool``.

Requires sglang (imported at module import).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import KVCache
from tkv.codec.config import TkvConfig
from tkv.codec.errors import ShapeError
from tkv.codec.layout import SlotLayout
from tkv.codec.sharding import KvHeadShard

from .impl import select_impl
from .paged_cache import TkvPagedCache

__all__ = ["TkvTokenToKVPool"]

log = logging.getLogger("tkv.sglang")


class TkvTokenToKVPool(KVCache):
    """Token-to-KV pool storing K/V compressed (tkv codec) in SlotLayout pages.

    Args:
        size: token capacity (a multiple of ``page_size``), padding page excluded.
        page_size: tokens per page (SlotLayout block_size).
        config: the validated :class:`~tkv.codec.config.TkvConfig`.
        layouts: SlotLayout of each layer this worker holds (``start_layer`` first).
        device, enable_memory_saver, start_layer: as for ``MHATokenToKVPool``.
        shard: the KV heads of this attention-TP rank (:func:`tkv.sglang.factories.rank_shard`);
            a bundle's per-head offsets are sliced to them. None: the model's heads, unsharded.

    Raises:
        ShapeError: ``shard`` holds another number of heads than ``layouts``.

    ``get_key_buffer(layer_id)`` and ``get_value_buffer(layer_id)`` both return the layer's
    uint8 ``(num_pages, page_bytes)`` page tensor (K and V share a page); read it through
    :meth:`layout`/:meth:`loader`, never as a ``(tokens, heads, head_dim)`` tensor.
    """

    def __init__(self, size: int, page_size: int, config: TkvConfig,
                 layouts: Sequence[SlotLayout], device: str | torch.device,
                 enable_memory_saver: bool = False, start_layer: int = 0,
                 shard: KvHeadShard | None = None):
        heads = {lay.num_kv_heads for lay in layouts}
        want = config.num_kv_heads if shard is None else shard.num_local_heads
        if heads != {want}:
            raise ShapeError(f"tkv (SGLang): layouts hold {sorted(heads)} KV heads, this rank "
                             f"{want} ({'unsharded' if shard is None else list(shard.heads)})")
        super().__init__(size, page_size, torch.uint8, len(layouts), str(device),
                         enable_memory_saver, start_layer, start_layer + len(layouts) - 1)
        self.config = config
        self.shard = shard
        self.layouts = list(layouts)
        self.impl = select_impl(device)
        num_pages = size // page_size + 1
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), (
            torch.cuda.use_mem_pool(self.custom_mem_pool)
            if self.enable_custom_mem_pool else nullcontext()
        ):
            self.paged = TkvPagedCache(self.layouts, num_pages, device)
        self._codecs: dict[int, object] = {}
        self._loaders: dict[int, object] = {}
        self._finalize_allocation_log(size)

    # ---------------------------------------------------------------- per layer
    def _idx(self, layer_id: int) -> int:
        i = layer_id - self.start_layer
        if not 0 <= i < self.layer_num:
            raise IndexError(f"layer {layer_id} not held by this worker "
                             f"(layers {self.start_layer}..{self.start_layer + self.layer_num - 1})")
        return i

    def layout(self, layer_id: int) -> SlotLayout:
        """SlotLayout of model layer ``layer_id``."""
        return self.layouts[self._idx(layer_id)]

    def codec(self, layer_id: int):
        """The layer's :class:`~tkv.codec.TurboKVCodec` on the pool's device (cached), its
        per-head offsets sliced to this rank's heads."""
        i = self._idx(layer_id)
        if i not in self._codecs:
            self._codecs[i] = self.config.codec(layer_id, self.device, shard=self.shard,
                                                check_finite=False)
        return self._codecs[i]

    def loader(self, layer_id: int):
        """The layer's ``tkv.kernels.TkvLoader`` (cached; built at first use)."""
        i = self._idx(layer_id)
        if i not in self._loaders:
            from tkv.kernels import (
                TkvLoader,
                fused_query_rotation_from_env,
                lookup_from_env,
                small_head_groups_from_env,
            )

            lay = self.layouts[i]
            self._loaders[i] = TkvLoader(self.codec(layer_id), lay.num_kv_heads, lay.block_size,
                                         lookup=lookup_from_env(),
                                         small_head_groups=small_head_groups_from_env(),
                                         fused_query_rotation=fused_query_rotation_from_env())
        return self._loaders[i]

    def prepare(self) -> None:
        """Build every layer's codec and loader now (before CUDA-graph capture: no lazy
        allocation may happen inside a captured region)."""
        for lid in range(self.start_layer, self.start_layer + self.layer_num):
            self.codec(lid)
            if self.impl == "triton":
                self.loader(lid)

    # ---------------------------------------------------------------- KVCache API
    def get_kv_size_bytes(self) -> int:
        return self.paged.nbytes

    def _get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.paged.buffers[self._idx(layer_id)]

    _get_value_buffer = _get_key_buffer

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return self._get_key_buffer(layer_id)

    get_value_buffer = get_key_buffer

    def get_kv_buffer(self, layer_id: int):
        buf = self.get_key_buffer(layer_id)
        return buf, buf

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor, k_scale=None, v_scale=None,
                      layer_id_override: int | None = None) -> None:
        """Compress and store K/V ``(num_tokens, num_kv_heads, head_dim)`` (any float dtype)
        at token locations ``loc`` (int64 ``(num_tokens,)``). fp8 ``k_scale``/``v_scale`` of
        the checkpoint do not apply (tkv keeps its own per-vector norms) and are ignored."""
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        i = self._idx(layer_id)
        lay = self.layouts[i]
        k = cache_k.reshape(-1, lay.num_kv_heads, lay.head_dim)
        v = cache_v.reshape(-1, lay.num_kv_heads, lay.head_dim)
        if self.impl == "triton":
            from tkv.kernels import compress_store

            compress_store(k, v, self.paged.buffers[i], loc.to(torch.int64), self.loader(layer_id))
        else:
            self.paged.store_reference(i, loc, k, v, self.codec(layer_id))

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        self.paged.move(tgt_loc, src_loc)

    def get_cpu_copy(self, indices, mamba_indices=None):
        idx = torch.as_tensor(indices, dtype=torch.int64, device=self.device)
        out = [{r: t.to("cpu") for r, t in self.paged.gather(i, idx).items()}
               for i in range(self.layer_num)]
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()
        return out

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        idx = torch.as_tensor(indices, dtype=torch.int64, device=self.device)
        for i, regions in enumerate(kv_cache_cpu):
            self.paged.scatter(i, idx, regions)
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()

    def get_contiguous_buf_infos(self):
        """``(data_ptrs, data_lens, item_lens)`` per layer; one item is one page."""
        bufs = self.paged.buffers
        return ([b.data_ptr() for b in bufs], [b.nbytes for b in bufs],
                [lay.page_bytes for lay in self.layouts])
