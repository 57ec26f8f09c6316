"""turbo-attn: the vLLM v1 attention backend over the tkv packed paged KV cache.

``vllm serve MODEL --kv-cache-dtype tkv --attention-backend turbo-attn``

Thin glue over :mod:`tkv.kernels`:

* **store** (``do_kv_cache_update``): :func:`tkv.kernels.compress_store` writes every new
  token's K/V (rotate, quantize, pack, norms) into its slot — one launch per layer.
* **decode** rows (query length 1, first in the batch thanks to the batch reordering):
  :func:`tkv.kernels.decode` — split-K paged attention with inline dequant, GQA, sliding
  window, scratch from the one shared :class:`tkv.kernels.Workspace`.
* **prefill / chunked-prefill / spec-decode-verify** rows (query length > 1):
  :func:`tkv.kernels.prefill` — varlen causal flash-attention tiling; the cached prefix is
  read from the compressed cache with inline dequant, the chunk itself from the new
  uncompressed K/V (a first chunk is plain bf16 attention). ``TKV_PREFILL_ATTENTION=flash``
  hands first chunks and exact-prefix continuations to vLLM's FlashAttention
  (:mod:`tkv.vllm.prefill_attention`).

CUDA graphs: the builder reports ``UNIFORM_BATCH`` — decode batches (one token per request,
or ``1 + k`` for spec-decode verify) are captured whole on vLLM's persistent metadata
tensors; mixed / prefill batches run attention eagerly between graph pieces. Nothing in
``forward`` or ``do_kv_cache_update`` reads a device value on the host (no ``.item()``,
``.tolist()``, ``.cpu()``, no data-dependent shapes): every size comes from host ints the
builder already has.

Per-layer state (widths, codec tables on the device) is bound when vLLM asks the layer for
its KV-cache spec — before memory profiling and CUDA-graph capture — so nothing is allocated
later except transient prefill tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from tkv import kernels
from tkv.codec.errors import UnsupportedFeatureError
from tkv.codec.layout import SlotLayout
from tkv.kernels import PrefillRun, plan_prefill_runs, serves_head_dim
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from .errors import PatchesNotAppliedError, UnsupportedModelError
from .prefill_attention import prefill_attention
from .spec import TKV_DTYPE, kv_cache_spec_for_layer, page_plan
from .startup import layer_codec, layer_index, tkv_config, tp_shard
from .workspace import shared_prefill_scratch, shared_workspace

__all__ = ["TurboAttnBackend", "TurboAttnImpl", "TurboAttnMetadata", "TurboAttnMetadataBuilder"]

log = logging.getLogger("tkv.vllm")


class TurboAttnBackend(AttentionBackend):
    """vLLM attention backend ``TURBO_ATTN`` for ``--kv-cache-dtype tkv``."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [TKV_DTYPE]

    @staticmethod
    def get_name() -> str:
        return "TURBO_ATTN"

    @staticmethod
    def get_impl_cls() -> type[TurboAttnImpl]:
        return TurboAttnImpl

    @staticmethod
    def get_builder_cls() -> type[TurboAttnMetadataBuilder]:
        return TurboAttnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # A page is one block; multiples of 16 tokens make every SlotLayout region a
        # multiple of 16 bytes (zero padding), and keep kernel block == vLLM block.
        return [MultipleOf(16)]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # The randomized Walsh-Hadamard rotation needs a power-of-two head_dim (one rule,
        # also refused by name at startup: tkv.vllm.startup.check_model_supported).
        return serves_head_dim(head_size)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        raise PatchesNotAppliedError(
            "tkv page bytes depend on each layer's (k_bits, v_bits), which "
            "get_kv_cache_shape cannot see; this vLLM lacks tkv patch 0003 "
            "(get_kv_cache_shape_for_spec) or a code path (KV connectors) that tkv does not "
            "support. Run `tkv-vllm patch apply`.")

    @classmethod
    def get_kv_cache_shape_for_spec(cls, num_blocks: int, block_size: int, kv_cache_spec: Any,
                                    cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """``(num_blocks, page_bytes)`` with page_bytes from the spec's SlotLayout at
        ``block_size`` (the kernel block size vLLM chose)."""
        return (num_blocks, kv_cache_spec.layout(block_size).page_bytes)

    @classmethod
    def get_kv_cache_spec(cls, layer: torch.nn.Module, vllm_config: Any):
        """The layer's tkv spec (:func:`tkv.vllm.spec.kv_cache_spec_for_layer`); also binds
        the layer's device state and the shared workspace, before memory profiling."""
        spec = kv_cache_spec_for_layer(layer, vllm_config)
        bind_layer(layer, vllm_config)
        return spec


# ----------------------------------------------------------------------------- metadata
@dataclass
class TurboAttnMetadata(AttentionMetadata):
    """Per-batch metadata (shared by all layers of a KV-cache group).

    The batch is reordered decode-rows first. Decode rows have a uniform query length
    ``decode_query_len`` (1; or ``1 + num_speculative_tokens`` for spec-decode verify),
    the rest are prefill rows (first chunks, chunked-prefill continuations).

    Host ints: num_actual_tokens, num_reqs, num_decodes, num_decode_tokens,
    decode_query_len (upper bound of the decode rows' query lengths), num_prefills,
    num_prefill_tokens, block_size.
    Device tensors — vLLM's persistent buffers, so CUDA-graph replays see the same
    addresses: query_start_loc int32 (num_reqs + 1,), seq_lens int32 (≥ num_reqs,),
    block_table int32 (≥ num_reqs, max_blocks), slot_mapping int64.
    Eager batches with prefill rows only: ``prefill_runs`` — the prefill rows as runs of
    rows with / without a cached prefix, one :func:`tkv.kernels.prefill` call each
    (:mod:`tkv.kernels.prefill_runs` says why; row and token indices are the batch's), and
    ``prefill_cu_seqlens``, one int32 ``(rows + 1,)`` device tensor per run: its rows' query
    offsets rebased to 0.
    """

    num_actual_tokens: int
    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    decode_query_len: int
    num_prefills: int
    num_prefill_tokens: int
    block_size: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    prefill_runs: tuple[PrefillRun, ...] = ()
    prefill_cu_seqlens: tuple[torch.Tensor, ...] = ()


class TurboAttnMetadataBuilder(AttentionMetadataBuilder[TurboAttnMetadata]):
    """Builds :class:`TurboAttnMetadata`.

    CUDA graphs: ``UNIFORM_BATCH`` — decode-only batches with one uniform query length are
    captured whole: length 1 through :func:`tkv.kernels.decode`, spec-decode verify
    (``1 + k`` tokens per request, ``reorder_batch_threshold = 1 + k``) through
    :func:`tkv.kernels.prefill` on vLLM's persistent ``query_start_loc``. Mixed and prefill
    batches run attention eagerly.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TurboAttnMetadata:
        cam = common_attn_metadata
        if common_prefix_len:
            raise UnsupportedModelError("turbo-attn does not implement cascade attention")
        threshold = int(self.reorder_batch_threshold or 1)
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(cam, decode_threshold=threshold, require_uniform=True))
        # Host facts from vLLM's CPU copy of query_start_loc (no device sync).
        qsl_cpu = cam.query_start_loc_cpu
        decode_q = 1
        if num_decodes and num_decode_tokens != num_decodes:
            decode_q = int((qsl_cpu[1:num_decodes + 1] - qsl_cpu[:num_decodes]).max())
        md = TurboAttnMetadata(
            num_actual_tokens=cam.num_actual_tokens, num_reqs=cam.num_reqs,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            decode_query_len=decode_q, num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens, block_size=int(self.kv_cache_spec.block_size),
            query_start_loc=cam.query_start_loc, seq_lens=cam.seq_lens,
            block_table=cam.block_table_tensor, slot_mapping=cam.slot_mapping)
        if num_prefills:
            md.prefill_runs = _prefill_runs(cam, num_decodes, num_decode_tokens, threshold,
                                            self._packed_rows())
            md.prefill_cu_seqlens = tuple(
                (cam.query_start_loc[r.row_lo:r.row_hi + 1] - r.tok_lo).to(torch.int32)
                for r in md.prefill_runs)
        return md

    def _packed_rows(self) -> int | None:
        """The rows the device's prefill scratch holds for the kernels' varlen path
        (:func:`tkv.kernels.varlen_prefix_rows`; the spec's KV heads and head size), or None
        before it exists."""
        scratch = shared_prefill_scratch(self.device)
        if scratch is None:
            return None
        spec = self.kv_cache_spec
        return kernels.varlen_prefix_rows(scratch.numel() * scratch.element_size(),
                                          int(spec.num_kv_heads), int(spec.head_size))


def _prefill_runs(cam: CommonAttentionMetadata, num_decodes: int, num_decode_tokens: int,
                  threshold: int, max_packed_rows: int | None = None
                  ) -> tuple[PrefillRun, ...]:
    """The prefill rows ``num_decodes:num_reqs`` as :func:`tkv.kernels.plan_prefill_runs`
    runs, with the batch's row and token indices; prefix lengths from vLLM's CPU sequence
    lengths (:func:`_seq_lens_cpu`; exact only for rows longer than ``threshold``); runs of
    rows with a prefix cut to ``max_packed_rows`` (the scratch's varlen rows)."""
    r0, r1 = num_decodes, cam.num_reqs
    qsl = cam.query_start_loc_cpu
    q_lens = (qsl[r0 + 1:r1 + 1] - qsl[r0:r1]).tolist()
    sl = _seq_lens_cpu(cam)
    prefix = None if sl is None else [s - q for s, q in zip(sl[r0:r1].tolist(), q_lens,
                                                            strict=True)]
    return tuple(replace(r, row_lo=r.row_lo + r0, row_hi=r.row_hi + r0,
                         tok_lo=r.tok_lo + num_decode_tokens, tok_hi=r.tok_hi + num_decode_tokens)
                 for r in plan_prefill_runs(q_lens, prefix, exact_min_query_len=threshold,
                                            max_packed_rows=max_packed_rows))


def _seq_lens_cpu(cam: CommonAttentionMetadata) -> torch.Tensor | None:
    """vLLM's CPU sequence lengths (``seq_lens_cpu_upper_bound``: exact for prefill rows,
    optimistic only for async spec-decode rows; else the runner's ``_seq_lens_cpu``), or None
    when neither is there (then the kernels' inline prefill path, which needs no bound)."""
    sl = getattr(cam, "seq_lens_cpu_upper_bound", None)
    return getattr(cam, "_seq_lens_cpu", None) if sl is None else sl


# ----------------------------------------------------------------------------- per-layer state
@dataclass
class LayerState:
    """What one tkv layer needs at run time: its index, served widths, codec on the device
    and one :class:`tkv.kernels.TkvLoader` per block size."""

    index: int
    k_bits: int
    v_bits: int
    num_kv_heads: int
    codec: Any
    loaders: dict[int, Any]
    default_block_size: int
    lookup: str = "auto"
    small_head_groups: bool = True
    # TKV_PREFILL_ATTENTION (auto / flash / continuation): vLLM's FlashAttention, or None
    dense_attention: Any = None
    fused_query_rotation: bool = True   # TKV_FUSED_QUERY_ROTATION

    def loader(self, block_size: int) -> Any:
        ld = self.loaders.get(block_size)
        if ld is None:  # only if vLLM changed the kernel block size after binding
            ld = kernels.TkvLoader(self.codec, self.num_kv_heads, block_size, lookup=self.lookup,
                                   small_head_groups=self.small_head_groups,
                                   fused_query_rotation=self.fused_query_rotation)
            self.loaders[block_size] = ld
        return ld

    def layout(self, block_size: int) -> SlotLayout:
        return self.loader(block_size).layout


def _layer_device(layer: torch.nn.Module) -> torch.device:
    for t in list(layer.buffers()) + list(layer.parameters()):
        return t.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bind_layer(layer: Any, vllm_config: Any, device: torch.device | None = None) -> LayerState:
    """Create (once) the :class:`LayerState` of a tkv layer and size the shared workspace.

    Raises:
        UnsupportedModelError, the codec's config errors.
    """
    impl = layer.impl
    if getattr(impl, "_tkv_state", None) is not None:
        return impl._tkv_state
    cfg = tkv_config(vllm_config)
    if int(impl.head_size) != cfg.head_dim:
        # the page plan and the codec are sized for the model's head_dim: a layer with
        # another one would read pages of the wrong size
        raise UnsupportedModelError(
            f"tkv: layer {layer.layer_name} has head_size {impl.head_size}, the model's "
            f"head_dim is {cfg.head_dim} (per-layer head sizes are not supported)")
    plan = page_plan(vllm_config)
    idx = layer_index(layer.layer_name, cfg.num_layers)
    k_bits, v_bits = plan.served[idx]
    dev = _layer_device(layer) if device is None else torch.device(device)
    block = int(vllm_config.cache_config.block_size)
    # per-head offsets (key offset μ, sink offsets; bundle: num_kv_heads * head_dim floats) are
    # sliced to this TP rank's KV heads; the rank's head count must be the shard's, or the
    # rows would not match
    mu_heads = None if cfg.bundle is None else cfg.bundle.layers[idx].offset_heads(cfg.head_dim)
    shard = None
    if mu_heads is not None:
        shard = tp_shard(vllm_config)
        if shard.num_local_heads != int(impl.num_kv_heads):
            raise UnsupportedFeatureError(
                f"tkv: layer {layer.layer_name} has {impl.num_kv_heads} KV heads on this rank, "
                f"the TP shard {shard.num_local_heads} (heads {list(shard.heads)}): the "
                "bundle's per-head offsets cannot be sliced to this rank")
    codec = layer_codec(cfg, idx, k_bits, v_bits, dev, shard)
    # TKV_LOOKUP / TKV_SMALL_HEAD_GROUPS / TKV_PREFILL_ATTENTION / TKV_FUSED_QUERY_ROTATION,
    # validated here (startup)
    state = LayerState(idx, k_bits, v_bits, int(impl.num_kv_heads), codec, {}, block,
                       kernels.lookup_from_env(), kernels.small_head_groups_from_env(),
                       prefill_attention(dev, int(impl.head_size),
                                         vllm_config.model_config.dtype),
                       kernels.fused_query_rotation_from_env())
    state.loader(block)
    sc = vllm_config.scheduler_config
    shared_workspace(dev, int(sc.max_num_seqs), int(impl.num_heads), int(impl.head_size))
    shared_prefill_scratch(dev, int(vllm_config.model_config.max_model_len),
                           int(impl.num_kv_heads), int(impl.head_size), block,
                           int(getattr(sc, "max_num_batched_tokens", 0) or 0))
    impl._tkv_state = state
    return state


# ----------------------------------------------------------------------------- impl
class TurboAttnImpl(AttentionImpl[TurboAttnMetadata]):
    """Decoder self-attention (MHA/GQA/MQA, optional sliding window) over a tkv cache."""

    supports_quant_query_input: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs: Any) -> None:
        refusals = [
            (kv_cache_dtype != TKV_DTYPE, f"kv_cache_dtype={kv_cache_dtype!r} (needs 'tkv'; "
             "--kv-cache-dtype-skip-layers is not supported)"),
            (attn_type != AttentionType.DECODER, f"attention type {attn_type} (only decoder "
             "self-attention; encoder / cross / encoder-only attention are not supported)"),
            (alibi_slopes is not None, "ALiBi"),
            (bool(logits_soft_cap), "logits soft-capping"),
            (kwargs.get("sinks") is not None, "attention sinks"),
            (kv_sharing_target_layer_name is not None, "cross-layer KV-cache sharing"),
        ]
        bad = [why for cond, why in refusals if cond]
        if bad:
            raise UnsupportedModelError("turbo-attn cannot serve this layer: " + "; ".join(bad))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self._tkv_state: LayerState | None = None
        self._prefix_variant_warm = False
        # Validate TKV_BITS / TKV_CALIBRATION_FILE now: the first layer built fails the
        # engine with the codec's named error, before any KV cache is allocated.
        tkv_config(get_current_vllm_config())

    # -- helpers ------------------------------------------------------------------------
    def _state(self, layer: Any) -> LayerState:
        st = self._tkv_state
        if st is None:  # spec hook not reached (e.g. unit use); bind from the layer
            st = bind_layer(layer, get_current_vllm_config())
        return st

    @property
    def _window(self) -> int:
        return int(self.sliding_window or 0)

    # -- store ----------------------------------------------------------------------------
    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Compress and store ``key``/``value`` ``(num_tokens, num_kv_heads, head_dim)`` at
        ``slot_mapping`` (int64; vLLM already sliced it to the real tokens, -1 = skip)."""
        n = slot_mapping.shape[0]
        if n == 0:
            return
        st = self._state(layer)
        kernels.compress_store(key[:n], value[:n], kv_cache, slot_mapping,
                               st.loader(st.default_block_size))

    # -- attention ------------------------------------------------------------------------
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TurboAttnMetadata,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for ``query`` ``(num_tokens, num_heads, head_dim)``, reading K/V from
        the tkv cache (already updated by :meth:`do_kv_cache_update`); writes ``output``
        ``(num_tokens, num_heads, head_dim)``."""
        if output is None:
            raise UnsupportedModelError("turbo-attn needs vLLM's output buffer")
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedModelError("turbo-attn does not fuse output quantization")
        if attn_metadata is None:  # memory-profiling run: no KV cache yet
            return output.fill_(0)
        md = attn_metadata
        st = self._state(layer)
        loader = st.loader(md.block_size)
        ws = shared_workspace(query.device)
        nd, ndt = md.num_decodes, md.num_decode_tokens
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        q = query.view(query.shape[0], self.num_heads, self.head_size)
        kv_shape = (key.shape[0], self.num_kv_heads, self.head_size)
        k, v = key.view(kv_shape), value.view(kv_shape)
        if nd and md.decode_query_len == 1:
            kernels.decode(q[:nd], kv_cache, md.block_table[:nd], md.seq_lens[:nd], loader, ws,
                           out=out[:nd], sm_scale=self.scale, window=self._window)
        elif nd:  # spec-decode verify: 1 + k new tokens per request, causal among them
            kernels.prefill(q[:ndt], k[:ndt], v[:ndt], md.query_start_loc[:nd + 1],
                            md.seq_lens[:nd], md.decode_query_len, kv_cache,
                            md.block_table[:nd], loader, out=out[:ndt], sm_scale=self.scale,
                            window=self._window)
        if md.prefill_runs:
            scratch = shared_prefill_scratch(query.device)
            warmed = kernels.prefill_by_runs(
                q, k, v, md.prefill_runs, md.prefill_cu_seqlens, md.seq_lens, md.block_table,
                kv_cache, loader, out=out, sm_scale=self.scale, window=self._window,
                scratch=lambda run: scratch, dense_attention=st.dense_attention,
                warm=not self._prefix_variant_warm, warm_scratch=lambda n: scratch)
            self._prefix_variant_warm |= warmed
        return output
