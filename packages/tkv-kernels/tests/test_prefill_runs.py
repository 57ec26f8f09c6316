"""Prefill rows split into runs with / without a cached prefix (host-side planning)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tkv.kernels import MAX_PACKED_SPLITS, MAX_PREFILL_RUNS, PrefillRun, plan_prefill_runs


def test_vllm_chunked_prefill_step_splits_continuation_from_first_chunks():
    # after the decode rows: the prompt cut at the previous step's budget, then new prompts
    runs = plan_prefill_runs([480, 512, 512, 512], [32, 0, 0, 0], exact_min_query_len=1)
    assert runs == (PrefillRun(0, 1, 0, 480, 480, 32, False, True, 32),
                    PrefillRun(1, 4, 480, 2016, 512, 0, True, False, 0))


def test_no_prefix_lengths_is_one_inline_run():
    assert plan_prefill_runs([4, 9, 2], None) == (PrefillRun(0, 3, 0, 15, 9, None, False,
                                                             False, None),)


def test_short_single_row_is_not_exact_below_the_threshold():
    # a row no longer than vLLM's decode threshold may be an async spec-decode row whose CPU
    # length is optimistic: only the bound (inline / decompress-once) is used
    (run,) = plan_prefill_runs([3], [40], exact_min_query_len=3)
    assert run.max_prefix_len == 40 and not run.prefix_exact and not run.no_prefix
    (run,) = plan_prefill_runs([3], [40])       # exact lengths (SGLang): any chunk
    assert run.prefix_exact


def test_empty_rows_are_tolerated():
    # engine padding rows (0 new tokens) must not fail a serving step; they add no tokens
    runs = plan_prefill_runs([0, 5, 0], [0, 3, 3])
    assert [(r.row_lo, r.row_hi, r.tok_lo, r.tok_hi) for r in runs] == [(0, 1, 0, 0), (1, 3, 0, 5)]
    assert not any(r.prefix_exact for r in runs)
    assert plan_prefill_runs([0], [0]) == (PrefillRun(0, 1, 0, 0, 0, 0, True, False, 0),)


def test_too_many_alternations_fall_back_to_one_call():
    q, p = [5] * 6, [3, 0, 3, 0, 3, 0]
    (run,) = plan_prefill_runs(q, p, max_runs=4)
    assert (run.row_lo, run.row_hi, run.max_prefix_len, run.no_prefix) == (0, 6, 3, False)
    assert len(plan_prefill_runs(q, p, max_runs=6)) == 6


def test_empty_and_bad_arguments():
    assert plan_prefill_runs([], []) == ()
    for bad in (dict(query_lens=[2], prefix_lens=[0], max_runs=0),
                dict(query_lens=[2, -1], prefix_lens=[0, 0]),
                dict(query_lens=[2, 3], prefix_lens=[0]),
                dict(query_lens=[2], prefix_lens=[-1])):
        with pytest.raises(ValueError):
            plan_prefill_runs(**bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3).map(lambda x: x * 7)),
                min_size=1, max_size=12),
       st.integers(1, MAX_PREFILL_RUNS + 2), st.integers(0, 4))
def test_runs_cover_rows_in_order_and_agree_with_the_rows(rows, max_runs, threshold):
    q, p = [r[0] for r in rows], [r[1] for r in rows]
    runs = plan_prefill_runs(q, p, exact_min_query_len=threshold, max_runs=max_runs)
    assert 1 <= len(runs) <= max_runs
    assert (runs[0].row_lo, runs[0].tok_lo) == (0, 0)
    assert (runs[-1].row_hi, runs[-1].tok_hi) == (len(q), sum(q))
    for a, b in pairwise(runs):
        assert a.row_hi == b.row_lo and a.tok_hi == b.tok_lo
    for r in runs:
        rq, rp = q[r.row_lo:r.row_hi], p[r.row_lo:r.row_hi]
        assert r.tok_hi - r.tok_lo == sum(rq) and r.tok_lo == sum(q[:r.row_lo])
        assert r.max_query_len == max(rq) and r.max_prefix_len == max(rp)
        assert r.prefix_tokens == sum(rp)
        assert r.no_prefix == (max(rp) == 0)
        assert r.prefix_exact == (len(rq) == 1 and rp[0] > 0 and rq[0] > threshold)
        if len(runs) > 1:   # a split never mixes rows with and without a prefix
            assert len({x > 0 for x in rp}) == 1


def test_prefix_runs_are_cut_to_the_scratch():
    """max_packed_rows: a run of prefix-cache hits larger than the engine's scratch becomes
    consecutive calls that each fit (Σ prefix + query + 1 rows), first chunks untouched; a row
    too large alone is a call of its own; past MAX_PACKED_SPLITS calls it stays one call."""
    q, p = [512] * 32 + [300], [1024] * 32 + [0]
    runs = plan_prefill_runs(q, p, max_packed_rows=20_481)
    assert [(r.row_lo, r.row_hi, r.prefix_tokens) for r in runs] == [
        (0, 13, 13 * 1024), (13, 26, 13 * 1024), (26, 32, 6 * 1024), (32, 33, 0)]
    assert all(not r.prefix_exact for r in runs) and runs[-1].no_prefix
    runs = plan_prefill_runs([10, 10, 10], [100, 5000, 100], max_packed_rows=1000)
    assert [(r.row_lo, r.row_hi) for r in runs] == [(0, 1), (1, 2), (2, 3)]
    assert all(r.prefix_exact for r in runs)       # lone rows: SGLang-style exact lengths
    many = plan_prefill_runs([10] * (MAX_PACKED_SPLITS + 1), [100] * (MAX_PACKED_SPLITS + 1),
                             max_packed_rows=111)
    assert [(r.row_lo, r.row_hi) for r in many] == [(0, MAX_PACKED_SPLITS + 1)]
    assert plan_prefill_runs([5], [5], max_packed_rows=11)[0].row_hi == 1   # fits exactly
    # the one-call fallback of max_runs (rows with and without a prefix) is never cut
    (run,) = plan_prefill_runs([5] * 6, [3, 0, 3, 0, 3, 0], max_runs=4, max_packed_rows=12)
    assert (run.row_lo, run.row_hi, run.prefix_tokens) == (0, 6, 9)
    # an empty row (engine padding) packs nothing: it never starts a call, and its prefix
    # is not counted
    runs = plan_prefill_runs([10, 0, 10], [100, 5, 100], max_packed_rows=111)
    assert [(r.row_lo, r.row_hi, r.prefix_tokens) for r in runs] == [(0, 2, 100), (2, 3, 100)]
    for bad in (0, -3, True, 2.5):
        for q, p in (([5], [5]), ([5], None), ([], [])):
            with pytest.raises(ValueError, match="max_packed_rows"):
                plan_prefill_runs(q, p, max_packed_rows=bad)
    with pytest.raises(ValueError, match="exact_min_query_len"):
        plan_prefill_runs([0], [3], exact_min_query_len=-1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3).map(lambda x: x * 30)),
                min_size=1, max_size=12), st.integers(1, 300))
def test_cut_runs_cover_rows_and_fit(rows, max_rows):
    q, p = [r[0] for r in rows], [r[1] for r in rows]
    runs = plan_prefill_runs(q, p, max_packed_rows=max_rows)
    assert (runs[0].row_lo, runs[-1].row_hi) == (0, len(q))
    for a, b in pairwise(runs):
        assert a.row_hi == b.row_lo and a.tok_hi == b.tok_lo
    uncut = plan_prefill_runs(q, p)
    if len(uncut) == 1 and len({x > 0 for x in p}) == 2:   # the one-call fallback: not cut
        assert runs == uncut
        return
    for r in runs:
        rp, rq = p[r.row_lo:r.row_hi], q[r.row_lo:r.row_hi]
        assert r.prefix_tokens == sum(rp)                     # (no empty rows drawn here)
        assert len({x > 0 for x in rp}) == 1
        inside = next(u for u in uncut if u.row_lo <= r.row_lo and r.row_hi <= u.row_hi)
        pieces = [x for x in runs if inside.row_lo <= x.row_lo and x.row_hi <= inside.row_hi]
        if r.no_prefix or len(pieces) == 1:
            continue     # first chunks, or a run left whole (it fit, or too many pieces)
        assert r.row_hi - r.row_lo == 1 or sum(rp) + sum(rq) + 1 <= max_rows
        assert len(pieces) <= MAX_PACKED_SPLITS
