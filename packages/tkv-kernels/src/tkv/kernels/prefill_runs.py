"""How an engine hands a batch's prefill rows to :func:`tkv.kernels.prefill`: contiguous runs
of rows that do or do not have a cached prefix, one call each.

Why: a first chunk (no cached prefix) takes the prefill bypass — plain attention in model
space, through the engine's FlashAttention where one is bound. A call with even ONE row that
has a prefix takes the rotated path for all its rows: query, key, value and output of every
token rotated into the cache's space and back (``rotate_rows``) and the Triton loop. With
chunked prefill, vLLM fills a step's token budget with decode rows, then
``[the prompt the previous step could not finish][new prompts]``; as one call, the one
continuation row sent every new prompt of the step down the rotated path. Profiled on the
H200 (Qwen3-8B-like, 256 × 512-token prompts, ``max_num_batched_tokens`` 16,384: 7 such
mixed steps per run) those rotations took 447 ms of device time and the Triton loop 132 ms,
where FlashAttention needs ~100 ms — the whole of tkv-vllm's end-to-end gap to bf16
(``benchmarks/results/vllm_sglang_profile_2026-12-05_s22/``). Split into runs, the first
chunks keep the bypass and a lone continuation row takes the exact-prefix path (its prefix
decompressed once, only its own chunk rotated).

Host-side only (the engines' CPU copies of query and prefix lengths): no device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

__all__ = ["MAX_PACKED_SPLITS", "MAX_PREFILL_RUNS", "PrefillRun", "plan_prefill_runs"]

# More alternations than this (rows with and without a prefix interleaved) go to the kernels
# as one call: each run costs one launch per layer, and a single call is always correct.
MAX_PREFILL_RUNS = 4
# A run of rows with a prefix is cut into at most this many calls so that each call's packed
# rows (prefixes + chunks, the varlen path) fit the engine's scratch; one that would need
# more stays one call (the kernels then run their Triton paths).
MAX_PACKED_SPLITS = 8


@dataclass(frozen=True)
class PrefillRun:
    """Prefill rows ``row_lo:row_hi`` (indices among the rows planned) = token rows
    ``tok_lo:tok_hi`` (offsets from the first planned row's first token), one
    :func:`tkv.kernels.prefill` call.

    ``max_query_len``: the longest chunk (tokens) — the call's ``max_query_len``.
    ``max_prefix_len``: the longest cached prefix (tokens; None when the engine gave no prefix
    lengths) — the call's ``max_prefix_len``. ``no_prefix``: every row is a first chunk — the
    call's ``no_prefix``. ``prefix_exact``: one row whose prefix the engine knows exactly —
    the call's ``exact_prefix``. ``prefix_tokens``: the sum of the cached prefixes of the
    rows with new tokens (tokens; None without prefix lengths) — the call's
    ``prefix_tokens``, which sizes the varlen path's packed rows.
    """

    row_lo: int
    row_hi: int
    tok_lo: int
    tok_hi: int
    max_query_len: int
    max_prefix_len: int | None
    no_prefix: bool
    prefix_exact: bool
    prefix_tokens: int | None


def plan_prefill_runs(query_lens: Sequence[int], prefix_lens: Sequence[int] | None, *,
                      exact_min_query_len: int = 0, max_runs: int = MAX_PREFILL_RUNS,
                      max_packed_rows: int | None = None) -> tuple[PrefillRun, ...]:
    """Split prefill rows into runs of rows with / without a cached prefix, in row order.

    Args:
        query_lens: host ints, each row's new tokens (≥ 0: an empty row — engine padding —
            joins whichever run it falls into and adds no work).
        prefix_lens: host ints, each row's cached tokens (an upper bound is fine for the
            bound, but only exact lengths may make a run ``prefix_exact``), or None when the
            engine does not know them: then one run with no bound (the inline path).
        exact_min_query_len: a lone row is ``prefix_exact`` only with a longer chunk (vLLM:
            its ``reorder_batch_threshold`` — shorter rows may be async spec-decode rows whose
            CPU lengths are optimistic; SGLang's prefix lengths are exact: 0).
        max_runs: more runs than this → one run over all rows.
        max_packed_rows: the rows the engine's scratch holds for the kernels' varlen path
            (:func:`tkv.kernels.varlen_prefix_rows`), or None: a run of rows with a prefix
            whose packed rows ``Σ (prefix + query) + 1`` (rows with new tokens only: the
            kernels pack nothing for an empty row) exceed it is cut, in row order, into calls
            that fit (a row too large alone is a call of its own; an empty row never starts
            one), at most :data:`MAX_PACKED_SPLITS` of them — else it stays one call. The
            one-call fallback of ``max_runs`` is never cut.

    Returns:
        The runs, covering every row exactly once (empty for no rows).

    Raises:
        ValueError: ``max_runs`` or ``max_packed_rows`` not an int ≥ 1,
            ``exact_min_query_len`` not an int ≥ 0, lengths of different counts, a negative
            query or prefix length.
    """
    for name, v, lo in (("max_runs", max_runs, 1), ("exact_min_query_len", exact_min_query_len,
                                                     0),
                        ("max_packed_rows", 1 if max_packed_rows is None else max_packed_rows,
                         1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int ≥ {lo}, got {v!r}")
    q = [int(x) for x in query_lens]
    if any(x < 0 for x in q):
        raise ValueError(f"query lengths must be ≥ 0, got {q}")
    if not q:
        return ()
    tok = [0, *accumulate(q)]
    if prefix_lens is None:
        return (PrefillRun(0, len(q), 0, tok[-1], max(q), None, False, False, None),)
    p = [int(x) for x in prefix_lens]
    if len(p) != len(q) or any(x < 0 for x in p):
        raise ValueError(f"prefix_lens must be {len(q)} ints ≥ 0, got {p}")
    cuts = [0] + [i for i in range(1, len(q)) if (p[i] > 0) != (p[i - 1] > 0)]
    if len(cuts) > max_runs:
        cuts = [0]
    spans = []
    for a, b in zip(cuts, [*cuts[1:], len(q)], strict=True):
        # only runs whose rows all have a prefix (not the one-call fallback of max_runs)
        spans += _fit(q, p, a, b, max_packed_rows) if min(p[a:b]) > 0 else [(a, b)]
    runs = []
    for a, b in spans:
        mp = max(p[a:b])
        runs.append(PrefillRun(a, b, tok[a], tok[b], max(q[a:b]), mp, mp == 0,
                               b - a == 1 and mp > 0 and q[a] > exact_min_query_len,
                               _packed_prefix(q, p, a, b)))
    return tuple(runs)


def _packed_prefix(q: list[int], p: list[int], a: int, b: int) -> int:
    """Prefix tokens the kernels' varlen path packs for rows ``a:b``: the prefixes of the rows
    with new tokens (an empty row attends nothing, so its prefix is not read)."""
    return sum(map(_read_prefix, q[a:b], p[a:b]))


def _read_prefix(q_len: int, prefix: int) -> int:
    """Prefix tokens the varlen path packs for one row: its prefix, none without new tokens
    (the one packing rule; a row packs this plus its ``q_len`` chunk rows, and
    :func:`tkv.kernels.varlen_prefix_rows` adds the spare row)."""
    return prefix if q_len else 0


def _fit(q: list[int], p: list[int], a: int, b: int,
         max_rows: int | None) -> list[tuple[int, int]]:
    """Rows ``a:b`` (all with a prefix) as consecutive spans whose packed rows
    (:func:`_packed_prefix` + their tokens + 1 spare row) fit ``max_rows`` — greedy; a row too large
    alone on its own; an empty row (no packed rows) joins the span before it — or
    ``[(a, b)]`` when they already fit, when there is no bound, or when more than
    :data:`MAX_PACKED_SPLITS` spans would be needed."""
    if max_rows is None or _packed_prefix(q, p, a, b) + sum(q[a:b]) + 1 <= max_rows:
        return [(a, b)]
    spans, lo, used = [], a, 1
    for i in range(a, b):
        need = _read_prefix(q[i], p[i]) + q[i]
        if i > lo and need and used + need > max_rows:
            spans.append((lo, i))
            lo, used = i, 1
        used += need
    spans.append((lo, b))
    return spans if len(spans) <= MAX_PACKED_SPLITS else [(a, b)]
