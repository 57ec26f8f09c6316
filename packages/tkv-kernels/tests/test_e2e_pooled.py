"""``benchmarks/e2e_pooled.py``: the pooled ratio of end-to-end runs and its bootstrap interval
(what docs/sglang.md's session-31 status against issue #6 rests on)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
SMOL = BENCHMARKS / "results" / "sglang_e2e_2026-12-06_s31_h100_smollm2_fa3"


@pytest.fixture
def pooled(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import e2e_pooled
    return e2e_pooled


def _job(d: Path, model: str, arm: str, cells: dict[str, list[float]]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tp = {b: {"output_tok_s": float(np.median(xs)),
              "runs": [{"output_tok_s": x, "decode_tok_s": 2 * x, "prefill_s": 1 / x}
                       for x in xs]} for b, xs in cells.items()}
    (d / f"{model}-{arm}.json").write_text(json.dumps({"mode": arm, "throughput": tp}))


def test_pools_every_run_of_every_job(pooled, tmp_path):
    rng = np.random.default_rng(1)
    base = {j: rng.uniform(90, 110, size=4).tolist() for j in "ab"}
    arm = {j: rng.uniform(95, 120, size=3).tolist() for j in "ab"}
    for j in "ab":
        _job(tmp_path / j, "m", "bf16", {"64": base[j]})
        _job(tmp_path / j, "m", "tkv", {"64": arm[j], "256": [1.0]})   # 256: arm only
    rows = pooled.table([tmp_path / "a", tmp_path / "b"], "m", "bf16", ["tkv"],
                        ["output_tok_s", "prefill_s"], resamples=4000, seed=0)
    assert [(r["metric"], r["batch"]) for r in rows] == [("output_tok_s", 64), ("prefill_s", 64)]
    r = rows[0]
    want = np.mean(arm["a"] + arm["b"]) / np.mean(base["a"] + base["b"])
    assert (r["n_base"], r["n_arm"]) == (8, 6)
    assert r["ratio"] == pytest.approx(want, rel=1e-12)
    assert r["lo"] < r["ratio"] < r["hi"]
    assert rows[1]["better"] == "lower"
    again = pooled.table([tmp_path / "a", tmp_path / "b"], "m", "bf16", ["tkv"],
                         ["output_tok_s"], resamples=4000, seed=0)
    assert again[0] == r                                     # seeded: reproducible


def test_constant_runs_give_a_point_interval(pooled):
    r, lo, hi = pooled.ratio_interval([100.0] * 5, [110.0] * 4, resamples=500, seed=3)
    assert r == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)


def test_interval_covers_the_true_ratio(pooled):
    """Fresh normal samples with a known ratio of means (1.05): the 95 % interval must cover
    it in most trials, and must not be so wide that it always does trivially."""
    rng = np.random.default_rng(7)
    covered, widths = 0, []
    for t in range(200):
        b = rng.normal(1000.0, 40.0, size=12)
        a = rng.normal(1050.0, 40.0, size=12)
        _, lo, hi = pooled.ratio_interval(b.tolist(), a.tolist(), resamples=2000, seed=t)
        covered += lo <= 1.05 <= hi
        widths.append(hi - lo)
    assert covered >= 170, covered                          # nominal 190 of 200; bootstrap
    assert 0.02 < float(np.median(widths)) < 0.08           # percentile is a little narrow


def test_missing_baseline_and_no_shared_cell_are_named_errors(pooled, tmp_path):
    _job(tmp_path / "a", "m", "tkv", {"64": [1.0, 2.0]})
    with pytest.raises(pooled.PooledInputError, match=r"no m-bf16\.json"):
        pooled.table([tmp_path / "a"], "m", "bf16", ["tkv"], ["output_tok_s"],
                     resamples=10, seed=0)
    _job(tmp_path / "a", "m", "bf16", {"256": [1.0, 2.0]})
    with pytest.raises(pooled.PooledInputError, match="no timed cell shared"):
        pooled.table([tmp_path / "a"], "m", "bf16", ["tkv"], ["output_tok_s"],
                     resamples=10, seed=0)
    assert pooled.main(["--model", "m", "--arm", "x", str(tmp_path / "a")]) == 2


def test_committed_session31_smollm2_table_is_what_the_script_prints(pooled, capsys):
    """The committed ``pooled.md`` is the script's output on the committed runs, and its
    headline (decode at 64 sequences, 13 runs per arm) is a plain ratio of the JSON's means."""
    dirs = [SMOL / f"run{i}" for i in (1, 2, 3)]
    assert pooled.main(["--model", "smollm2-135m", "--arm", "tkv-4.0", "--arm",
                        "tkv-4.0-nopcg", *map(str, dirs)]) == 0
    assert capsys.readouterr().out == (SMOL / "pooled.md").read_text()
    xs = {arm: [r["decode_tok_s"] for d in dirs
                for r in json.loads((d / f"smollm2-135m-{arm}.json").read_text())
                ["throughput"]["64"]["runs"]] for arm in ("bf16", "tkv-4.0")}
    assert len(xs["bf16"]) == len(xs["tkv-4.0"]) == 13
    row = next(r for r in pooled.table(dirs, "smollm2-135m", "bf16", ["tkv-4.0"],
                                       ["decode_tok_s"], resamples=2000, seed=0)
               if r["batch"] == 64)
    assert row["ratio"] == pytest.approx(np.mean(xs["tkv-4.0"]) / np.mean(xs["bf16"]))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"throughput": [1]}',
                                  '{"throughput": {"64": {"runs": [{"seconds": 1}]}}}',
                                  '{"throughput": {"64": {"runs": [{"output_tok_s": "x"}]}}}',
                                  '{"throughput": {"big": {"output_tok_s": 1.0}}}'])
def test_a_file_that_is_not_a_result_is_a_named_error(pooled, tmp_path, text):
    _job(tmp_path / "a", "m", "bf16", {"64": [1.0, 2.0]})
    (tmp_path / "a" / "m-tkv.json").write_text(text)
    with pytest.raises(pooled.PooledInputError, match=r"m-tkv\.json"):
        pooled.table([tmp_path / "a"], "m", "bf16", ["tkv"], ["output_tok_s"],
                     resamples=10, seed=0)


def test_a_cell_without_runs_counts_as_one_run(pooled, tmp_path):
    """Results written before the per-run list existed hold one number per cell."""
    _job(tmp_path / "a", "m", "bf16", {"64": [100.0, 100.0]})
    (tmp_path / "a" / "m-tkv.json").write_text(
        json.dumps({"throughput": {"64": {"output_tok_s": 120.0}}}))
    (row,) = pooled.table([tmp_path / "a"], "m", "bf16", ["tkv"], ["output_tok_s"],
                          resamples=100, seed=0)
    assert (row["n_arm"], row["ratio"], row["lo"], row["hi"]) == (1, 1.2, None, None)


def test_an_arm_is_paired_with_the_baseline_runs_of_its_own_jobs(pooled, tmp_path):
    """A job that did not run the arm adds nothing to its row: job-to-job drift (10-20 % on
    SmolLM2) would otherwise enter the ratio."""
    _job(tmp_path / "a", "m", "bf16", {"64": [100.0, 102.0]})
    _job(tmp_path / "a", "m", "tkv", {"64": [110.0, 112.0]})
    _job(tmp_path / "b", "m", "bf16", {"64": [200.0, 204.0]})   # a faster job, no tkv run
    (row,) = pooled.table([tmp_path / "a", tmp_path / "b"], "m", "bf16", ["tkv"],
                          ["output_tok_s"], resamples=100, seed=0)
    assert (row["jobs"], row["n_base"], row["n_arm"]) == (1, 2, 2)
    assert row["ratio"] == pytest.approx(111.0 / 101.0)


def test_a_single_run_side_gets_no_interval(pooled, tmp_path, capsys):
    _job(tmp_path / "a", "m", "bf16", {"64": [100.0]})
    _job(tmp_path / "a", "m", "tkv", {"64": [110.0, 130.0, 90.0]})
    assert pooled.ratio_interval([100.0], [110.0, 130.0, 90.0], resamples=10, seed=0) == (
        pytest.approx(1.1), None, None)
    assert pooled.main(["--model", "m", "--arm", "tkv", str(tmp_path / "a")]) == 0
    assert "| 1.100 | - (a side has 1 run) |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="resamples"):
        pooled.ratio_interval([1.0, 2.0], [1.0, 2.0], resamples=0, seed=0)


@pytest.mark.parametrize("args", [["--resamples", "0"], ["--resamples", "-1"],
                                  ["--json", "/nonexistent-dir/x.json"]])
def test_bad_options_are_refused_before_any_work(pooled, tmp_path, args, capsys):
    _job(tmp_path / "a", "m", "bf16", {"64": [1.0, 2.0]})
    _job(tmp_path / "a", "m", "tkv", {"64": [1.0, 2.0]})
    with pytest.raises(SystemExit) as e:
        pooled.main(["--model", "m", "--arm", "tkv", *args, str(tmp_path / "a")])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "error:" in captured.err


def test_an_empty_run_list_is_a_named_error(pooled, tmp_path):
    _job(tmp_path / "a", "m", "bf16", {"64": [1.0, 2.0]})
    (tmp_path / "a" / "m-tkv.json").write_text(json.dumps({"throughput": {"64": {"runs": []}}}))
    with pytest.raises(pooled.PooledInputError, match="has no runs"):
        pooled.table([tmp_path / "a"], "m", "bf16", ["tkv"], ["output_tok_s"],
                     resamples=10, seed=0)
