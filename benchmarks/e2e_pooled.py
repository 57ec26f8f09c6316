"""Pool the timed runs of several end-to-end jobs into one ratio per cell, with a bootstrap
confidence interval (CPU; reads committed result JSON, runs nothing on a GPU).

Small models' steps are host-bound, and one ``sglang_e2e.py`` / ``vllm_e2e.py`` cell (median of
2-5 runs) moves by 10-20 % from one job to the next (session 31: SmolLM2 at 64 sequences,
tkv / FA3 = 0.89, 1.09 and 0.96 in three jobs of the same hold). One job's cell cannot then say
whether tkv is ahead. This script takes every run of every job (the ``runs`` list inside each
throughput cell, not the job's median), paired by job (an arm against the baseline runs of
the jobs that ran that arm), and per (arm, metric, batch) prints

* the mean over all runs for the baseline and for the arm, and their ratio (arm / baseline);
* a 95 % percentile-bootstrap interval of that ratio: both arms' runs resampled with
  replacement, independently, ``--resamples`` times (Efron & Tibshirani, *An Introduction to
  the Bootstrap*, 1993, ch. 13), seeded, so the table is reproducible; none where a side has
  a single run (no spread to resample).

Throughput metrics (``output_tok_s``, ``decode_tok_s``) are better when higher, ``prefill_s``
when lower; the table says which. Runs are treated as independent draws, which they are not
quite (runs of one job share an engine start), so read the interval as a lower bound on the
uncertainty.

Usage (the session-31 SmolLM2 jobs; every job directory holds ``<model>-<arm>.json``)::

    python benchmarks/e2e_pooled.py --model smollm2-135m --arm tkv-4.0 \\
        benchmarks/results/sglang_e2e_2026-12-06_s31_h100_smollm2_fa3/run{1,2,3}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

METRICS = {"output_tok_s": "higher", "decode_tok_s": "higher", "prefill_s": "lower"}


class PooledInputError(ValueError):
    """A job directory lacks the baseline's result, or no job has a timed cell to pool."""


def runs_of(path: Path, metric: str) -> dict[str, list[float]]:
    """``{batch: [metric of every timed run]}`` from one result JSON (``throughput`` →
    batch → ``runs``; a cell without ``runs``, as older results wrote, is one run); a file
    without throughput cells (greedy-only runs) gives ``{}``.

    Raises:
        PooledInputError: the file is not JSON, not a result object, or a timed run lacks
            ``metric`` (or holds a non-number there)."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PooledInputError(f"{path}: not JSON ({e})") from None
    cells = (data.get("throughput") or {}) if isinstance(data, dict) else None
    if not isinstance(cells, dict):
        raise PooledInputError(f"{path}: not an e2e result (no throughput object)")
    out = {}
    for batch, cell in cells.items():
        if not batch.isdigit() or not isinstance(cell, dict):
            raise PooledInputError(f"{path}: throughput entry {batch!r} is not a batch "
                                   "size's cell")
        runs = cell.get("runs", [cell])
        if not runs:
            raise PooledInputError(f"{path}: throughput cell {batch!r} has no runs")
        try:
            out[batch] = [float(r[metric]) for r in runs]
        except (KeyError, TypeError, ValueError):
            raise PooledInputError(f"{path}: throughput cell {batch!r} has a run without a "
                                   f"numeric {metric}") from None
    return out


def pooled(dirs: list[Path], model: str, arm: str, metric: str) -> dict[str, list[float]]:
    """Every run of ``<model>-<arm>.json`` across ``dirs``, per batch (``{}`` when no
    directory has the file)."""
    out: dict[str, list[float]] = {}
    for d in dirs:
        f = d / f"{model}-{arm}.json"
        if f.is_file():
            for batch, xs in runs_of(f, metric).items():
                out.setdefault(batch, []).extend(xs)
    return out


def ratio_interval(base: list[float], arm: list[float], *, resamples: int, seed: int,
                   level: float = 0.95) -> tuple[float, float | None, float | None]:
    """``(mean(arm) / mean(base), lo, hi)``: the ratio of means and its percentile-bootstrap
    interval at ``level`` (each sample resampled with replacement, independently). With fewer
    than 2 runs on either side there is no spread to resample: ``lo`` and ``hi`` are None.

    Raises:
        ValueError: ``resamples`` < 1, or an empty sample."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not base or not arm:
        raise ValueError("ratio_interval needs at least one run on each side")
    b, a = np.asarray(base, float), np.asarray(arm, float)
    if b.size < 2 or a.size < 2:
        return float(a.mean() / b.mean()), None, None
    rng = np.random.default_rng(seed)
    rb = rng.choice(b, size=(resamples, b.size)).mean(axis=1)
    ra = rng.choice(a, size=(resamples, a.size)).mean(axis=1)
    lo, hi = np.quantile(ra / rb, [(1 - level) / 2, (1 + level) / 2])
    return float(a.mean() / b.mean()), float(lo), float(hi)


def table(dirs: list[Path], model: str, baseline: str, arms: list[str], metrics: list[str], *,
          resamples: int, seed: int) -> list[dict]:
    """One row per (arm, metric, batch) that both the baseline and the arm have. Paired by
    job: an arm is compared with the baseline runs of the directories that hold the arm's
    file only (a job that did not run the arm contributes nothing to its row, so job-to-job
    drift does not enter the ratio); ``jobs`` in the row counts them.

    Raises:
        PooledInputError: a directory has no ``<model>-<baseline>.json``, or no arm shares a
            timed cell with the baseline.
    """
    missing = [str(d) for d in dirs if not (d / f"{model}-{baseline}.json").is_file()]
    if missing:
        raise PooledInputError(f"no {model}-{baseline}.json in: {', '.join(missing)}")
    rows = []
    for arm in arms:
        jobs = [d for d in dirs if (d / f"{model}-{arm}.json").is_file()]
        for metric in metrics:
            base, other = pooled(jobs, model, baseline, metric), pooled(jobs, model, arm, metric)
            for batch in sorted(set(base) & set(other), key=int):
                r, lo, hi = ratio_interval(base[batch], other[batch], resamples=resamples,
                                           seed=seed)
                rows.append({"arm": arm, "metric": metric, "better": METRICS[metric],
                             "batch": int(batch), "jobs": len(jobs),
                             "n_base": len(base[batch]),
                             "n_arm": len(other[batch]),
                             "base_mean": float(np.mean(base[batch])),
                             "arm_mean": float(np.mean(other[batch])),
                             "ratio": r, "lo": lo, "hi": hi})
    if not rows:
        raise PooledInputError(f"no timed cell shared by {baseline} and {', '.join(arms)} "
                               f"for {model} in {len(dirs)} directories")
    return rows


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def markdown(rows: list[dict], baseline: str) -> str:
    """The rows as one markdown table (ratios to 3 decimals)."""
    head = (f"| arm | metric | better | batch | jobs | runs {baseline} / arm | {baseline} mean "
            "| arm mean | arm / " + baseline + " | 95 % bootstrap interval |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|\n")
    return head + "".join(
        f"| {r['arm']} | {r['metric']} | {r['better']} | {r['batch']} | {r['jobs']} | "
        f"{r['n_base']} / {r['n_arm']} | {_num(r['base_mean'])} | {_num(r['arm_mean'])} | "
        f"{r['ratio']:.3f} | "
        + ("- (a side has 1 run)" if r["lo"] is None else f"[{r['lo']:.3f}, {r['hi']:.3f}]")
        + " |\n" for r in rows)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="job result directories")
    ap.add_argument("--model", required=True, help="the result files' model prefix, "
                    "e.g. smollm2-135m or qwen3-8b-like")
    ap.add_argument("--baseline", default="bf16", help="the baseline arm (file suffix)")
    ap.add_argument("--arm", action="append", required=True, dest="arms",
                    help="an arm (file suffix), e.g. tkv-4.0; repeat for more")
    ap.add_argument("--metric", action="append", choices=list(METRICS), dest="metrics",
                    help="repeat for more (default: all three)")
    ap.add_argument("--resamples", type=_positive, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    if a.json and not a.json.parent.is_dir():
        ap.error(f"--json {a.json}: no directory {a.json.parent}")
    try:
        rows = table(a.dirs, a.model, a.baseline, a.arms, a.metrics or list(METRICS),
                     resamples=a.resamples, seed=a.seed)
    except PooledInputError as e:
        print(f"e2e_pooled: {e}", file=sys.stderr)
        return 2
    print(markdown(rows, a.baseline), end="")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
