"""One engine step's prefill rows through :func:`tkv.kernels.prefill`, run by run.

The engines (tkv-vllm, tkv-sglang) plan a step's prefill rows with
:func:`tkv.kernels.plan_prefill_runs` and hand each run to :func:`prefill`; right after the
first run of first chunks they compile the prefix-reading variant
(:func:`warm_prefix_variant`). This module is that loop, once, so both adapters make the same
calls with the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .dense_attention import DenseAttention
from .loaders import Loader
from .prefill import prefill, warm_prefix_variant
from .prefill_runs import PrefillRun

__all__ = ["prefill_by_runs"]


def prefill_by_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    runs: Sequence[PrefillRun], run_cu_seqlens: Sequence[torch.Tensor],
                    seq_lens: torch.Tensor, block_table: torch.Tensor, cache, loader: Loader, *,
                    out: torch.Tensor, sm_scale: float, window: int = 0,
                    scratch: Callable[[PrefillRun], torch.Tensor | None] | None = None,
                    dense_attention: DenseAttention | None = None,
                    warm: bool = False,
                    warm_scratch: Callable[[int], torch.Tensor | None] | None = None) -> bool:
    """Attention for a step's prefill rows, one :func:`prefill` call per run, into ``out``.

    Args:
        query: ``(total_q, num_q_heads, head_dim)`` fp16/bf16, the planned rows' new tokens
            (token row 0 = the first planned row's first token: the runs' ``tok_lo``/``tok_hi``
            index it).
        key, value: ``(total_q, num_kv_heads, head_dim)``, same dtype, the same tokens' K/V
            (already stored in ``cache`` by the step's ``compress_store``).
        runs: from :func:`tkv.kernels.plan_prefill_runs`, in row order.
        run_cu_seqlens: one int32 tensor per run, ``(run.row_hi − run.row_lo + 1,)`` on the
            device: the run's query offsets, starting at 0 (the call's ``cu_seqlens_q``).
        seq_lens: int32 ``(num_rows,)`` — each planned row's total length (prefix + chunk,
            tokens); ``block_table``: int32 ``(num_rows, max_blocks_per_seq)``.
        cache, loader: the layer's paged cache and its :class:`~tkv.kernels.Loader`.
        out: ``(total_q, num_q_heads, head_dim)``, written for every token row of every run.
        sm_scale, window: as :func:`prefill` (window 0 = full causal).
        scratch: the engine's prefill scratch for a run (called once per run; None = the
            run goes without, :func:`prefill` then never decompresses a prefix once).
        dense_attention: the engine's bound FlashAttention (:class:`DenseAttention`) or None.
        warm: compile the prefix-reading variant after the first run of first chunks
            (:func:`warm_prefix_variant`) — the caller passes True until this returns True.
        warm_scratch: scratch for that warm-up, given its chunk's token count.

    Returns:
        True when the prefix-reading variant was warmed by this call (the caller stops asking).

    Raises:
        ValueError: ``runs`` and ``run_cu_seqlens`` differ in length. Everything
        :func:`prefill` raises for a run's arguments.
    """
    if len(runs) != len(run_cu_seqlens):
        raise ValueError(f"prefill_by_runs: {len(runs)} runs but {len(run_cu_seqlens)} "
                            "cu_seqlens tensors (one per run)")
    warmed = False
    for run, cu in zip(runs, run_cu_seqlens, strict=True):
        a, b, r0, r1 = run.tok_lo, run.tok_hi, run.row_lo, run.row_hi
        prefill(query[a:b], key[a:b], value[a:b], cu, seq_lens[r0:r1], run.max_query_len,
                cache, block_table[r0:r1], loader, out=out[a:b], sm_scale=sm_scale,
                window=window, no_prefix=run.no_prefix, max_prefix_len=run.max_prefix_len,
                scratch=None if scratch is None else scratch(run),
                exact_prefix=run.prefix_exact, dense_attention=dense_attention,
                prefix_tokens=run.prefix_tokens)
        if warm and not warmed and run.no_prefix and b > a:
            # compile the prefix-reading variant now, not at the first continuation chunk
            warmed = True
            warm_prefix_variant(query[a:b], key[a:b], value[a:b], cache, block_table[r0:r1],
                                   loader, sm_scale=sm_scale, window=window,
                                   scratch=None if warm_scratch is None else warm_scratch(b - a),
                                   dense_attention=dense_attention)
    return warmed
