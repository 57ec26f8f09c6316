"""Prefill rows split into runs with / without a cached prefix (host-side, no vLLM needed)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tkv.vllm.prefill_runs import MAX_PREFILL_RUNS, PrefillRun, plan_prefill_runs


def _batch(q_lens, prefixes):
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor([p + q for p, q in zip(prefixes, q_lens, strict=True)], dtype=torch.int32)
    return qsl, sl


def test_vllm_chunked_prefill_step_splits_continuation_from_first_chunks():
    # decodes (rows 0-2), then the prompt cut at the previous step's budget, then new prompts
    q = [1, 1, 1, 480, 512, 512, 512]
    p = [700, 650, 513, 32, 0, 0, 0]
    qsl, sl = _batch(q, p)
    runs = plan_prefill_runs(qsl, sl, 3, 7, decode_threshold=1)
    assert runs == (PrefillRun(3, 4, 3, 483, 480, 32, False, True),
                    PrefillRun(4, 7, 483, 2019, 512, 0, True, False))


def test_no_host_lengths_is_one_inline_run():
    qsl, _ = _batch([4, 9, 2], [0, 5, 0])
    assert plan_prefill_runs(qsl, None, 0, 3, 1) == (PrefillRun(0, 3, 0, 15, 9, None, False,
                                                                False),)


def test_short_single_row_is_not_exact():
    # a row no longer than the decode threshold may be an async spec-decode row: its CPU
    # length is optimistic, so only the bound (inline / decompress-once) is used
    qsl, sl = _batch([3], [40])
    (run,) = plan_prefill_runs(qsl, sl, 0, 1, decode_threshold=3)
    assert run.max_prefix_len == 40 and not run.prefix_exact and not run.no_prefix


def test_too_many_alternations_fall_back_to_one_call():
    q = [5] * 6
    p = [3, 0, 3, 0, 3, 0]
    qsl, sl = _batch(q, p)
    (run,) = plan_prefill_runs(qsl, sl, 0, 6, 1, max_runs=4)
    assert (run.row_lo, run.row_hi, run.max_prefix_len, run.no_prefix) == (0, 6, 3, False)
    assert len(plan_prefill_runs(qsl, sl, 0, 6, 1, max_runs=6)) == 6


def test_empty_and_bad_arguments():
    qsl, sl = _batch([2], [0])
    assert plan_prefill_runs(qsl, sl, 1, 1, 1) == ()
    with pytest.raises(ValueError, match="max_runs"):
        plan_prefill_runs(qsl, sl, 0, 1, 1, max_runs=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3).map(lambda x: x * 7)),
                min_size=1, max_size=12),
       st.integers(0, 3), st.integers(1, MAX_PREFILL_RUNS + 2), st.integers(1, 4))
def test_runs_cover_rows_in_order_and_agree_with_the_rows(rows, lo, max_runs, threshold):
    q = [1] * lo + [r[0] for r in rows]
    p = [9] * lo + [r[1] for r in rows]
    qsl, sl = _batch(q, p)
    hi = len(q)
    runs = plan_prefill_runs(qsl, sl, lo, hi, threshold, max_runs=max_runs)
    assert 1 <= len(runs) <= max_runs
    assert runs[0].row_lo == lo and runs[-1].row_hi == hi
    for a, b in pairwise(runs):
        assert a.row_hi == b.row_lo and a.tok_hi == b.tok_lo
    for r in runs:
        rq, rp = q[r.row_lo:r.row_hi], p[r.row_lo:r.row_hi]
        assert (r.tok_lo, r.tok_hi) == (int(qsl[r.row_lo]), int(qsl[r.row_hi]))
        assert r.max_query_len == max(rq) and r.max_prefix_len == max(rp)
        assert r.no_prefix == (max(rp) == 0)
        assert r.prefix_exact == (len(rq) == 1 and rp[0] > 0 and rq[0] > threshold)
        if len(runs) > 1:   # a split never mixes rows with and without a prefix
            assert len({x > 0 for x in rp}) == 1
