"""How a batch's prefill rows are handed to :func:`tkv.kernels.prefill`: contiguous runs of
rows that do or do not have a cached prefix, one kernel call each.

Why: with chunked prefill vLLM fills a step's token budget with decode rows, then
``[continuation rows][first chunks]`` — the request whose prompt did not fit into the
previous step continues first, the new prompts follow. Handed to the kernels as ONE call,
the one continuation row forces the whole call off the prefill bypass: every first chunk
of the step is rotated into the cache's space and back (query, key, value, output) and runs
through the Triton loop instead of the engine's FlashAttention. Profiled on the H200
(Qwen3-8B-like, 256 × 512-token prompts, ``max_num_batched_tokens`` 16,384: 7 such mixed
steps per run): those rotations alone took 447 ms of device time and the Triton prefill
132 ms where FlashAttention needs ~100 ms — the whole of tkv-vllm's end-to-end gap to bf16
(``benchmarks/results/vllm_sglang_profile_2026-12-05_s22/``). Split into runs, the first
chunks go through the bypass (FlashAttention where bound), and a lone continuation row takes
the exact-prefix path (its prefix decompressed once, only its own chunk rotated).

Host-side only (vLLM's CPU copies of ``query_start_loc`` and the sequence lengths): no
device sync, nothing here is captured in a CUDA graph (mixed batches run eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

__all__ = ["MAX_PREFILL_RUNS", "PrefillRun", "plan_prefill_runs"]

# More alternations than this (rows with and without a prefix interleaved) go to the kernels
# as one call: each run costs one launch per layer, and a single call is always correct.
MAX_PREFILL_RUNS = 4


@dataclass(frozen=True)
class PrefillRun:
    """Prefill rows ``row_lo:row_hi`` of the batch (request indices) = token rows
    ``tok_lo:tok_hi``, handed to one :func:`tkv.kernels.prefill` call.

    ``max_query_len``: the longest chunk (tokens). ``max_prefix_len``: the longest cached
    prefix (tokens; None when the host does not know the sequence lengths — then the inline
    path, which needs no bound). ``no_prefix``: every row is a first chunk (the prefill
    bypass). ``prefix_exact``: one row whose prefix is exactly ``max_prefix_len`` (vLLM's CPU
    sequence lengths are exact for prefill rows longer than the decode threshold), so the
    kernels may run its attention densely over the decompressed prefix.
    """

    row_lo: int
    row_hi: int
    tok_lo: int
    tok_hi: int
    max_query_len: int
    max_prefix_len: int | None
    no_prefix: bool
    prefix_exact: bool


def plan_prefill_runs(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor | None,
                      row_lo: int, row_hi: int, decode_threshold: int,
                      max_runs: int = MAX_PREFILL_RUNS) -> tuple[PrefillRun, ...]:
    """Split prefill rows ``row_lo:row_hi`` into runs of rows with / without a cached prefix.

    Args:
        query_start_loc_cpu: int ``(num_reqs + 1,)`` host tensor, cumulative query lengths.
        seq_lens_cpu: int ``(≥ row_hi,)`` host tensor of sequence lengths (prefix + chunk;
            an upper bound is fine: a row whose bound leaves no prefix has none), or None.
        row_lo, row_hi: the prefill rows (after the decode rows).
        decode_threshold: vLLM's ``reorder_batch_threshold``: only a row with a longer chunk
            may be ``prefix_exact`` (shorter rows may be async spec-decode rows, whose CPU
            lengths are optimistic).
        max_runs: more runs than this → one run over all rows.

    Returns:
        The runs in row order, covering ``row_lo:row_hi`` exactly (empty when no rows).
        Raises ValueError on an empty or inverted row range with rows, or ``max_runs`` < 1.
    """
    if max_runs < 1:
        raise ValueError(f"max_runs must be ≥ 1, got {max_runs}")
    if row_hi <= row_lo:
        return ()
    qsl = query_start_loc_cpu[row_lo:row_hi + 1].tolist()
    q = [b - a for a, b in pairwise(qsl)]
    if seq_lens_cpu is None:
        return (PrefillRun(row_lo, row_hi, qsl[0], qsl[-1], max(q), None, False, False),)
    prefix = [s - ql for s, ql in zip(seq_lens_cpu[row_lo:row_hi].tolist(), q, strict=True)]
    cuts = [0] + [i for i in range(1, len(q)) if (prefix[i] > 0) != (prefix[i - 1] > 0)]
    if len(cuts) > max_runs:
        cuts = [0]
    runs = []
    for a, b in zip(cuts, [*cuts[1:], len(q)], strict=True):
        mp = max(prefix[a:b])
        runs.append(PrefillRun(
            row_lo + a, row_lo + b, qsl[a], qsl[b], max(q[a:b]), mp, mp <= 0,
            b - a == 1 and mp > 0 and q[a] > decode_threshold))
    return tuple(runs)
