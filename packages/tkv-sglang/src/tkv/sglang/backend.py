"""``turbo-attn``: SGLang attention backend reading the tkv compressed paged KV cache.

Per layer and forward pass:

* the new tokens' K/V are compressed into their slots (``TkvTokenToKVPool.set_kv_buffer``:
  ``tkv.kernels.compress_store``, one launch);
* decode: ``tkv.kernels.decode`` — split-K paged decode with inline dequant, scratch from one
  :class:`tkv.kernels.Workspace` shared by every layer;
* extend (prefill, chunked prefill, prefix-cache hits, mixed batches): ``tkv.kernels.prefill``
  — the cached prefix (radix-cache hits and earlier chunks) is read compressed from the
  cache, the chunk's own K/V attend exactly as computed (the kernels' prefill contract).

Metadata: a page-granular block table built from SGLang's ``req_to_token`` map (its paged
allocator keeps each request's tokens page-aligned, so ``req_to_token[r, j·page] //
page_size`` is page ``j`` of request ``r``; prefix sharing by the radix cache is therefore just
two block tables naming the same compressed pages) and int32 ``seq_lens``.

CUDA graphs (decode): every tensor the captured kernels touch — block table, seq_lens,
workspace, per-layer loader tables — is allocated before capture and refilled in place at
replay; the forward path has no ``.item()``/``.tolist()``/host copies (the host-side max
sequence length comes from ``seq_lens_cpu``, which SGLang already holds).

What the backend cannot serve is refused with :class:`~tkv.sglang.errors.UnsupportedFeatureError`:
logit soft-capping, attention sinks, cross attention, encoder inputs, speculative decoding.

Requires sglang (imported at module import).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from tkv.kernels import PrefillRun, plan_prefill_runs, shares_memory

from .errors import UnsupportedFeatureError
from .pool import TkvTokenToKVPool
from .prefill_attention import prefill_attention

__all__ = ["TurboAttnBackend", "TurboAttnMetadata", "reference_attention"]

log = logging.getLogger("tkv.sglang")


def _output_buffer(forward_batch, q3: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """The attention output ``(tokens, q_heads · head_dim)`` in ``q3``'s dtype and device
    (``q3``: ``(tokens, q_heads, head_dim)``): SGLang 0.5.11's piecewise-CUDA-graph path
    (``radix_attention.unified_attention_with_output``) leaves its preallocated output slice
    on ``forward_batch._attn_output`` for the backend to write into — FA3 does — and copies
    any other returned tensor into it, one device-to-device pass over the output per layer
    per extend batch (session 32's SmolLM2 prefill profile: 480 such copies, 2.2 ms of a
    99 ms prefill). That buffer is used when it has exactly this shape, dtype and device, is
    contiguous (viewed as ``(tokens, q_heads · head_dim)``) and shares no memory with ``q3``
    or ``inputs`` (the chunk's K/V: the kernels read them while they write the output, and
    refuse an overlap); otherwise (no such attribute, decode CUDA graphs, another shape or
    dtype) a new tensor, as before. SGLang 0.5.11's buffer is a fresh ``empty_like(q)``."""
    rows, hq, d = q3.shape
    buf = getattr(forward_batch, "_attn_output", None)
    if (isinstance(buf, torch.Tensor) and buf.dim() >= 1 and buf.shape[0] == rows
            and buf.numel() == rows * hq * d and buf.dtype == q3.dtype
            and buf.device == q3.device and buf.is_contiguous()
            and not any(x is not None and shares_memory(buf, x) for x in (q3, *inputs))):
        return buf.view(rows, hq * d)
    return q3.new_empty(rows, hq * d)


@dataclass
class TurboAttnMetadata:
    """Per-forward metadata shared by all layers.

    Attributes:
        block_table: int32 ``(batch, pages)``, physical page ids of each request.
        seq_lens: int32 ``(batch,)`` tokens in the cache per request after this step.
        cu_seqlens_q: int32 ``(batch + 1,)`` query offsets (extend only, else None).
        max_seq_len_q: longest query chunk (tokens; 1 for decode).
        runs: extend only — the requests as runs of requests with / without cached tokens
            (host-side ``extend_prefix_lens_cpu``), one :func:`tkv.kernels.prefill` call each
            (:mod:`tkv.kernels.prefill_runs` says why): first chunks take the prefill bypass,
            a lone request with a prefix the exact-prefix path (SGLang's prefix lengths are
            exact); one run with no bound when SGLang gives no CPU prefix lengths.
        run_cu_seqlens: one int32 ``(requests + 1,)`` device tensor per run, its query
            offsets rebased to 0.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    max_seq_len_q: int = 1
    runs: tuple[PrefillRun, ...] = ()
    run_cu_seqlens: tuple[torch.Tensor, ...] = ()


def _window(layer) -> int:
    """SGLang's ``sliding_window_size`` (keys ``q - w .. q`` visible, FlashAttention's
    ``window_size=(w, 0)``) as the kernels' ``window`` (the last ``window`` tokens including
    the query's own): ``w + 1``; 0 = full attention."""
    w = getattr(layer, "sliding_window_size", -1)
    return 0 if w is None or w < 0 else w + 1


def reference_attention(pool: TkvTokenToKVPool, layer_id: int, q: torch.Tensor,
                        key: torch.Tensor | None, value: torch.Tensor | None,
                        token_locs: list[torch.Tensor], q_lens: list[int], sm_scale: float,
                        window: int = 0) -> torch.Tensor:
    """Plain-PyTorch attention over the compressed cache (the ``"reference"`` implementation,
    with the kernels' semantics): request ``i`` has queries ``q[a:a+q_lens[i]]`` at the last
    ``q_lens[i]`` positions of its ``len(token_locs[i])`` tokens; its prefix tokens are
    decompressed from the cache with the layer's codec, its chunk's K/V taken from
    ``key``/``value`` (``None``: from the cache too, as for decode).

    Args:
        q: ``(total_q, Hq, D)``. key, value: ``(total_q, Hkv, D)`` or None.
        token_locs: per request, int64 token locations of all its tokens (prefix + chunk).
    Returns:
        ``(total_q, Hq, D)`` in q's dtype (computed in float32).
    """
    codec = pool.codec(layer_id)
    i = layer_id - pool.start_layer
    out = torch.zeros_like(q)
    a = 0
    for locs, ql in zip(token_locs, q_lens, strict=True):
        n = int(locs.numel())
        if ql == 0:
            continue
        pre = n - ql if key is not None else n
        ks, vs = [], []
        if pre:  # a first chunk has no cached prefix: nothing to gather or decompress
            reg = pool.paged.gather(i, locs[:pre])
            ks.append(codec.decompress_k(reg["k_codes"], reg["k_norms"]))
            vs.append(codec.decompress_v(reg["v_codes"], reg["v_norms"]))
        if key is not None:
            ks.append(key[a:a + ql].float())
            vs.append(value[a:a + ql].float())
        k, v = torch.cat(ks), torch.cat(vs)                    # (n, Hkv, D)
        qq = q[a:a + ql].float()                               # (ql, Hq, D)
        g = qq.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.einsum("mhd,nhd->hmn", qq, k) * sm_scale
        qpos = torch.arange(n - ql, n, device=q.device)
        kpos = torch.arange(n, device=q.device)
        vis = kpos[None, :] <= qpos[:, None]
        if window:
            vis &= qpos[:, None] - kpos[None, :] < window
        p = torch.softmax(s.masked_fill(~vis[None], float("-inf")), dim=-1)
        out[a:a + ql] = torch.einsum("hmn,nhd->mhd", p, v).to(q.dtype)
        a += ql
    return out


class TurboAttnBackend(AttentionBackend):
    """SGLang ``AttentionBackend`` over :class:`~tkv.sglang.pool.TkvTokenToKVPool`.

    Args:
        model_runner: SGLang's ModelRunner (its ``token_to_kv_pool`` must be a tkv pool).

    Raises:
        UnsupportedFeatureError: the pool is not a tkv pool (``--kv-cache-dtype tkv``
            missing), or speculative decoding is configured.
    """

    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, TkvTokenToKVPool):
            raise UnsupportedFeatureError(
                "--attention-backend turbo-attn reads the tkv cache only; pass "
                "--kv-cache-dtype tkv")
        if getattr(model_runner.server_args, "speculative_algorithm", None) is not None:
            raise UnsupportedFeatureError("turbo-attn does not support speculative decoding yet")
        self.pool = pool
        self.device = torch.device(model_runner.device)
        self._prefix_variant_warm: set[int] = set()  # layers whose prefix prefill is compiled
        self.page_size = model_runner.page_size
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.max_pages = math.ceil(self.req_to_token.shape[1] / self.page_size)
        mc = model_runner.model_config
        tp = self._attention_tp_size()
        self.num_q_heads = max(1, mc.num_attention_heads // tp)
        self.head_dim = mc.head_dim
        self.impl = pool.impl
        self.max_num_seqs = max(1, int(model_runner.max_running_requests or 1))
        self.workspace = None
        self._retired_workspaces: list = []
        self._prefill_scratch: torch.Tensor | None = None
        self.forward_metadata: TurboAttnMetadata | None = None
        # TKV_PREFILL_ATTENTION (validated now: startup): None, or sgl-kernel's FA3
        self.dense_attention = prefill_attention(self.device, mc.dtype, impl=self.impl)
        # with FlashAttention bound: runs of radix hits cut to what the scratch can grow to
        self._packed_rows = None
        if self.dense_attention is not None and pool.layouts:
            from tkv.kernels import DENSE_PREFIX_CAP, varlen_prefix_rows

            lay = pool.layouts[0]   # every layer has the same KV heads and head_dim
            self._packed_rows = varlen_prefix_rows(DENSE_PREFIX_CAP, lay.num_kv_heads,
                                                   lay.head_dim)
        self._cuda_graph_block_table = None
        self._cuda_graph_seq_lens = None
        pool.prepare()

    @staticmethod
    def _attention_tp_size() -> int:
        try:
            from sglang.srt.layers.dp_attention import get_attention_tp_size

            return get_attention_tp_size()
        except (AssertionError, RuntimeError, AttributeError):
            return 1

    # ---------------------------------------------------------------- workspace
    def _ensure_workspace(self, num_seqs: int):
        if self.impl != "triton":
            return None
        if self.workspace is None or self.workspace.max_num_seqs < num_seqs:
            from tkv.kernels import Workspace

            if self.workspace is not None:
                # captured CUDA graphs hold raw pointers into the old scratch: keep it alive
                self._retired_workspaces.append(self.workspace)
            self.workspace = Workspace(max(num_seqs, self.max_num_seqs), self.num_q_heads,
                                       self.head_dim, self.device)
        return self.workspace

    def _scratch_for(self, num_seqs: int, max_prefix_len: int | None, num_kv_heads: int,
                     dtype: torch.dtype, max_query_len: int = 0, prefix_tokens: int | None = None,
                     num_tokens: int = 0) -> torch.Tensor | None:
        """The decompress-once prefill scratch for this extend (grown on demand — extend
        runs eagerly, never inside a captured graph — up to DENSE_PREFIX_CAP bytes); None
        when the batch's prefixes need more (the kernels then read the prefix inline). With a
        dense_attention (FlashAttention) bound and ``prefix_tokens`` known: room for the
        varlen path's packed rows (the run's prefixes and its ``num_tokens`` chunk tokens,
        :func:`tkv.kernels.varlen_prefix_bytes`). Else one sequence: room for its prefix AND
        its chunk (``max_query_len`` tokens), which the kernels' SDPA path (``exact_prefix``)
        lays out after the prefix; several: their prefixes in whole pages."""
        from tkv.kernels import DENSE_PREFIX_CAP, dense_prefix_bytes, varlen_prefix_bytes

        if not max_prefix_len:
            return None
        # the sizes each path needs, most capable first; the first within the cap is grown to
        sizes = []
        if self.dense_attention is not None and prefix_tokens is not None:
            sizes.append(varlen_prefix_bytes(prefix_tokens, num_tokens, num_kv_heads,
                                             self.head_dim, dtype))
        rows = max_prefix_len + (max_query_len if num_seqs == 1 else 0)
        for r in (rows, max_prefix_len) if rows > max_prefix_len else (rows,):
            sizes.append(dense_prefix_bytes(num_seqs, r, num_kv_heads, self.head_dim, dtype,
                                            block_size=self.page_size))
        need = next((n for n in sizes if n <= DENSE_PREFIX_CAP), None)
        if need is None:
            return None
        if self._prefill_scratch is None or self._prefill_scratch.numel() < need:
            self._prefill_scratch = torch.empty(need, dtype=torch.uint8, device=self.device)
        return self._prefill_scratch

    # ---------------------------------------------------------------- metadata
    def _block_table(self, req_pool_indices: torch.Tensor, max_len: int) -> torch.Tensor:
        """int32 ``(batch, ceil(max_len / page_size))`` page ids from ``req_to_token``."""
        pages = max(1, math.ceil(max_len / self.page_size))
        first_tokens = self.req_to_token[req_pool_indices, : pages * self.page_size: self.page_size]
        return torch.div(first_tokens, self.page_size, rounding_mode="floor").to(torch.int32)

    def init_forward_metadata(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        if getattr(forward_batch, "encoder_lens", None) is not None:
            raise UnsupportedFeatureError("turbo-attn does not serve encoder/cross attention")
        if getattr(forward_batch, "spec_info", None) is not None:
            raise UnsupportedFeatureError("turbo-attn does not support speculative decoding yet")
        if mode.is_idle():
            self.forward_metadata = None
            return
        bs = forward_batch.batch_size
        max_len = int(forward_batch.seq_lens_cpu[:bs].max()) if bs else 0
        block_table = self._block_table(forward_batch.req_pool_indices, max_len)
        seq_lens = forward_batch.seq_lens.to(torch.int32)
        if mode.is_decode():
            self._ensure_workspace(bs)
            self.forward_metadata = TurboAttnMetadata(block_table, seq_lens)
            return
        ext = forward_batch.extend_seq_lens
        cu = torch.nn.functional.pad(torch.cumsum(ext, dim=0, dtype=torch.int32), (1, 0))
        ext_cpu = [int(x) for x in forward_batch.extend_seq_lens_cpu]   # list or CPU tensor
        pre_cpu = getattr(forward_batch, "extend_prefix_lens_cpu", None)
        runs = plan_prefill_runs(ext_cpu, None if pre_cpu is None else [int(x) for x in pre_cpu],
                                 max_packed_rows=self._packed_rows)
        self.forward_metadata = TurboAttnMetadata(
            block_table, seq_lens, cu, max(ext_cpu, default=0), runs,
            tuple(cu[r.row_lo:r.row_hi + 1] - r.tok_lo for r in runs))

    # ---------------------------------------------------------------- CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate every buffer a captured decode touches (block table, seq_lens,
        workspace); replays refill them in place."""
        self._cuda_graph_block_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int32,
                                                   device=self.device)
        self._cuda_graph_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._ensure_workspace(max_bs)

    def _check_graph_mode(self, forward_mode, spec_info, encoder_lens) -> None:
        if spec_info is not None:
            raise UnsupportedFeatureError("turbo-attn does not support speculative decoding yet")
        if encoder_lens is not None:
            raise UnsupportedFeatureError("turbo-attn does not serve encoder/cross attention")
        if not forward_mode.is_decode_or_idle():
            raise UnsupportedFeatureError(
                f"turbo-attn captures decode batches only, got {forward_mode}")

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices,
                                                 seq_lens, encoder_lens, forward_mode,
                                                 spec_info):
        self._check_graph_mode(forward_mode, spec_info, encoder_lens)
        table = self._cuda_graph_block_table[:bs]
        sl = self._cuda_graph_seq_lens[:bs]
        sl.copy_(seq_lens[:bs])
        table.copy_(self._block_table(req_pool_indices[:bs], self.max_pages * self.page_size))
        self.forward_metadata = TurboAttnMetadata(table, sl)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens,
                                                seq_lens_sum, encoder_lens, forward_mode,
                                                spec_info, seq_lens_cpu):
        self._check_graph_mode(forward_mode, spec_info, encoder_lens)
        table = self._cuda_graph_block_table[:bs]
        sl = self._cuda_graph_seq_lens[:bs]
        sl.copy_(seq_lens[:bs])
        max_len = int(seq_lens_cpu[:bs].max()) if bs else 0
        fresh = self._block_table(req_pool_indices[:bs], max_len)
        table[:, : fresh.shape[1]].copy_(fresh)
        self.forward_metadata = TurboAttnMetadata(table, sl)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---------------------------------------------------------------- forward
    def _check_layer(self, layer, kwargs) -> None:
        if getattr(layer, "logit_cap", 0):
            raise UnsupportedFeatureError(
                f"layer {layer.layer_id}: logit soft-capping is not supported by turbo-attn")
        if getattr(layer, "is_cross_attention", False):
            raise UnsupportedFeatureError("turbo-attn does not serve cross attention")
        if kwargs.get("sinks") is not None:
            raise UnsupportedFeatureError("turbo-attn does not support attention sinks")
        if layer.qk_head_dim != layer.v_head_dim:
            raise UnsupportedFeatureError("turbo-attn needs qk_head_dim == v_head_dim")

    def _store(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None:
            self.pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)

    def _token_locs(self, forward_batch) -> list[torch.Tensor]:
        lens = forward_batch.seq_lens_cpu.tolist()
        rows = forward_batch.req_pool_indices.tolist()
        return [self.req_to_token[r, :n].to(torch.int64) for r, n in zip(rows, lens, strict=True)]

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        self._check_layer(layer, kwargs)
        self._store(layer, forward_batch, k, v, save_kv_cache)
        md = self.forward_metadata
        hq, d = layer.tp_q_head_num, layer.head_dim
        q3 = q.view(-1, hq, d)
        out = _output_buffer(forward_batch, q3, k, v)
        if self.impl == "triton":
            from tkv.kernels import decode

            decode(q3, self.pool.get_key_buffer(layer.layer_id), md.block_table, md.seq_lens,
                   self.pool.loader(layer.layer_id), self.workspace, out=out.view(-1, hq, d),
                   sm_scale=layer.scaling, window=_window(layer))
        else:
            locs = self._token_locs(forward_batch)
            out.view(-1, hq, d).copy_(reference_attention(
                self.pool, layer.layer_id, q3, None, None, locs, [1] * len(locs),
                layer.scaling, _window(layer)))
        return out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        self._check_layer(layer, kwargs)
        if k is None:
            raise UnsupportedFeatureError("turbo-attn extend needs the chunk's K/V "
                                          "(cross-layer KV sharing is not supported)")
        self._store(layer, forward_batch, k, v, save_kv_cache)
        md = self.forward_metadata
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q3, k3, v3 = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        out = _output_buffer(forward_batch, q3, k3, v3)
        if self.impl == "triton":
            from tkv.kernels import prefill_by_runs

            lid = layer.layer_id
            warmed = prefill_by_runs(
                q3, k3, v3, md.runs, md.run_cu_seqlens, md.seq_lens, md.block_table,
                self.pool.get_key_buffer(lid), self.pool.loader(lid), out=out.view(-1, hq, d),
                sm_scale=layer.scaling, window=_window(layer),
                scratch=lambda run: self._scratch_for(
                    run.row_hi - run.row_lo, run.max_prefix_len, hkv, q3.dtype,
                    run.max_query_len, run.prefix_tokens, run.tok_hi - run.tok_lo),
                dense_attention=self.dense_attention,
                warm=lid not in self._prefix_variant_warm,
                warm_scratch=lambda n: self._scratch_for(1, self.page_size, hkv, q3.dtype, n, 1,
                                                         n))
            if warmed:
                self._prefix_variant_warm.add(lid)
        else:
            out.view(-1, hq, d).copy_(reference_attention(
                self.pool, layer.layer_id, q3, k3, v3, self._token_locs(forward_batch),
                [int(x) for x in forward_batch.extend_seq_lens_cpu], layer.scaling,
                _window(layer)))
        return out
