"""Device time per decode step, kernel by kernel, from two torch.profiler chrome traces.

An engine's decode step is what the cache format changes, but a profile of one ``generate``
also holds the prefill. Profile the same request shape twice — ``T`` and ``2T`` output tokens,
fresh prompts of equal length — and subtract: every kernel's count and device time over the
extra ``T`` decode steps, divided by ``T``, is its share of ONE decode step, prefill and
warm-up cancelled. Both e2e scripts use it (``vllm_e2e.py --profile``: torch.profiler in the
engine process; ``sglang_e2e.py --profile``: SGLang's ``Engine.start_profile``), so the two
engines' tables are computed the same way and compare line by line::

    python benchmarks/kernel_trace.py compare A.json B.json --labels vLLM SGLang

(``A.json`` / ``B.json``: a result JSON of either script, or its ``profile`` entry.) The sum of
a table is the GPU's busy time per step; set beside the measured wall time per decode step
it splits a gap into kernels and idle GPU (host work, launch gaps).
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# chrome-trace categories of device work (torch.profiler / Kineto)
DEVICE_CATEGORIES = {"kernel": "", "gpu_memcpy": "[memcpy] ", "gpu_memset": "[memset] "}


def kernel_totals(trace: str | Path) -> dict[str, tuple[int, float]]:
    """``{name: (count, device µs)}`` of every kernel / memcpy / memset event of a chrome
    trace (``.json`` or ``.json.gz``, as ``torch.profiler``'s ``export_chrome_trace`` writes).

    Raises:
        FileNotFoundError; ValueError: no ``traceEvents`` list in the file.
    """
    p = Path(trace)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    doc = json.loads(raw)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{p}: no traceEvents list (not a chrome trace)")
    out: dict[str, list] = {}
    for e in events:
        prefix = DEVICE_CATEGORIES.get(e.get("cat"))
        if prefix is None or e.get("ph") != "X":
            continue
        acc = out.setdefault(prefix + str(e.get("name")), [0, 0.0])
        acc[0] += 1
        acc[1] += float(e.get("dur", 0.0))
    return {k: (c, us) for k, (c, us) in out.items()}


def decode_step_kernels(short: dict[str, tuple[int, float]], long: dict[str, tuple[int, float]],
                        extra_steps: int) -> list[dict]:
    """Per kernel, its count and device µs in ONE decode step: ``(long − short) /
    extra_steps`` of two :func:`kernel_totals` (``long`` ran ``extra_steps`` more decode steps
    of the same batch). Rows ``{"name", "per_step", "us_per_step"}``, most time first; kernels
    whose difference is not positive (prefill-only, run-to-run noise) are left out.

    Raises:
        ValueError: ``extra_steps`` < 1.
    """
    if extra_steps < 1:
        raise ValueError(f"extra_steps must be >= 1, got {extra_steps}")
    rows = []
    for name, (c1, us1) in long.items():
        c0, us0 = short.get(name, (0, 0.0))
        if us1 - us0 > 0:
            rows.append({"name": name, "per_step": round((c1 - c0) / extra_steps, 2),
                         "us_per_step": round((us1 - us0) / extra_steps, 2)})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def step_summary(rows: list[dict], wall_ms_per_step: float | None = None) -> dict:
    """``{"device_ms_per_step", "kernels_per_step", "wall_ms_per_step", "gpu_busy"}`` of a
    :func:`decode_step_kernels` table; ``gpu_busy`` = device / wall time (None without a wall
    time): below 1 the step also waits on the host or on launch gaps."""
    dev = sum(r["us_per_step"] for r in rows) / 1e3
    return {"device_ms_per_step": round(dev, 4),
            "kernels_per_step": round(sum(r["per_step"] for r in rows), 1),
            "wall_ms_per_step": None if wall_ms_per_step is None else round(wall_ms_per_step, 4),
            "gpu_busy": None if not wall_ms_per_step else round(dev / wall_ms_per_step, 3)}


def measure_decode_step(generate: Callable[[int], object],
                        capture: Callable[[int, Path], Path], steps: int) -> dict:
    """The engine-independent half of the e2e scripts' ``--profile``: ``generate(tokens)`` runs
    a fresh batch with ``tokens`` output tokens unprofiled; ``capture(tokens, folder)`` runs
    one under the engine's profiler and returns the chrome trace it wrote under ``folder`` (a
    temporary folder, deleted afterwards). Both run ``steps`` and ``2·steps`` tokens.

    Returns ``{"walls": {"short": s, "long": s}, "rows": decode_step_kernels(...),
    "summary": step_summary(rows, wall ms of one decode step)}`` — the wall ms being the
    unprofiled difference / ``steps``.

    Raises:
        ValueError: ``steps`` < 1; whatever ``capture`` raises (e.g. no trace written)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    runs = {"short": steps, "long": 2 * steps}
    walls = {}
    for key, t in runs.items():
        t0 = time.perf_counter()
        generate(t)
        walls[key] = time.perf_counter() - t0
    totals = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, t in runs.items():
            folder = Path(tmp) / key
            folder.mkdir()
            totals[key] = kernel_totals(capture(t, folder))
    rows = decode_step_kernels(totals["short"], totals["long"], steps)
    return {"walls": walls, "rows": rows,
            "summary": step_summary(rows, 1e3 * (walls["long"] - walls["short"]) / steps)}


def measure_run(generate: Callable[[int], object], capture: Callable[[int, Path], Path],
                tokens: int = 1) -> dict:
    """Every kernel of ONE whole generate, for the e2e scripts' ``--profile-prefill``: with
    ``tokens`` = 1 the run is the batch's prefill (all its extend steps) plus one sampling
    step, so the table is where the prefill's device time goes. ``generate(tokens)`` runs a
    fresh batch unprofiled (the wall time); ``capture(tokens, folder)`` runs one under the
    engine's profiler and returns its chrome trace (a temporary folder, deleted afterwards).

    Returns ``{"wall_s": s, "rows": rows, "summary": step_summary(rows, wall ms)}`` with
    :func:`decode_step_kernels`' row format, one "step" being the whole run: launches and
    device µs per run. ``gpu_busy`` well below 1 says the run waited on the host (Python,
    launches, scheduling), not on its kernels.

    Raises:
        ValueError: ``tokens`` < 1; whatever ``capture`` raises (e.g. no trace written)."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    t0 = time.perf_counter()
    generate(tokens)
    wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        rows = decode_step_kernels({}, kernel_totals(capture(tokens, Path(tmp))), 1)
    return {"wall_s": wall, "rows": rows, "summary": step_summary(rows, 1e3 * wall)}


def table(rows: list[dict], top: int = 30, per: str = "step") -> str:
    """Markdown table of the ``top`` rows of :func:`decode_step_kernels` plus the rest and the
    total; ``per``: what one row's counts are per (a decode ``step``, or a whole ``run``)."""
    total = sum(r["us_per_step"] for r in rows)
    lines = [f"| kernel | launches / {per} | µs / {per} | share |", "|---|---:|---:|---:|"]
    for r in rows[:top]:
        share = r["us_per_step"] / total if total else 0.0
        lines.append(f"| `{r['name'][:90]}` | {r['per_step']:g} | {r['us_per_step']:.1f} | "
                     f"{100 * share:.1f} % |")
    rest = rows[top:]
    if rest:
        lines.append(f"| ({len(rest)} more) | {sum(r['per_step'] for r in rest):g} | "
                     f"{sum(r['us_per_step'] for r in rest):.1f} | |")
    lines.append(f"| **total** | {sum(r['per_step'] for r in rows):g} | {total:.1f} | 100 % |")
    return "\n".join(lines)


def compare(a: list[dict], b: list[dict], labels: tuple[str, str] = ("A", "B"),
            top: int = 30) -> str:
    """Side-by-side markdown of two :func:`decode_step_kernels` tables: µs per step in each,
    their difference and ratio, the kernels with the largest absolute difference first (so a
    gap between two engines running the same kernels shows where it sits)."""
    ia = {r["name"]: r for r in a}
    ib = {r["name"]: r for r in b}
    names = sorted(set(ia) | set(ib), key=lambda n: -abs(
        ib.get(n, {}).get("us_per_step", 0.0) - ia.get(n, {}).get("us_per_step", 0.0)))
    la, lb = labels
    lines = [f"| kernel | {la} µs | {lb} µs | {lb} − {la} | {lb} ÷ {la} | launches {la} / {lb} |",
             "|---|---:|---:|---:|---:|---:|"]
    for n in names[:top]:
        ua, ub = ia.get(n, {}).get("us_per_step", 0.0), ib.get(n, {}).get("us_per_step", 0.0)
        ca, cb = ia.get(n, {}).get("per_step", 0), ib.get(n, {}).get("per_step", 0)
        ratio = f"{ub / ua:.2f}" if ua else "-"
        lines.append(f"| `{n[:80]}` | {ua:.1f} | {ub:.1f} | {ub - ua:+.1f} | {ratio} | "
                     f"{ca:g} / {cb:g} |")
    ta, tb = (sum(r["us_per_step"] for r in t) for t in (a, b))
    lines.append(f"| **total** | {ta:.1f} | {tb:.1f} | {tb - ta:+.1f} | "
                 f"{tb / ta if ta else float('nan'):.2f} | |")
    return "\n".join(lines)


def _rows(path: str) -> list[dict]:
    doc = json.loads(Path(path).read_text())
    prof = doc.get("profile", doc) if isinstance(doc, dict) else doc
    rows = prof.get("decode_kernels") if isinstance(prof, dict) else None
    if not isinstance(rows, list):
        raise SystemExit(f"{path}: no decode_kernels table (a result JSON of a --profile run?)")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="side-by-side decode-step kernels of two profiled runs")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--labels", nargs=2, default=["A", "B"])
    c.add_argument("--top", type=int, default=30)
    t = sub.add_parser("diff", help="decode-step kernels from two chrome traces")
    t.add_argument("short", help="trace of the T-token run")
    t.add_argument("long", help="trace of the run with EXTRA more tokens")
    t.add_argument("--extra-steps", type=int, required=True)
    t.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    if a.cmd == "compare":
        print(compare(_rows(a.a), _rows(a.b), tuple(a.labels), a.top))
    else:
        print(table(decode_step_kernels(kernel_totals(a.short), kernel_totals(a.long),
                                        a.extra_steps), a.top))


if __name__ == "__main__":
    main()
