"""Helpers the two CUDA-kernel benchmarks share (``cuda_decode_gpu.py``, ``cuda_store_gpu.py``):
their row log, the 36-layer model-step table and the result files (the tuning context is
``tkv.kernels.testing.tuning``). Not a script."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import kernels_gpu as kg
import torch

ROWS: list[dict] = []


def log(row: dict) -> None:
    """Keep ``row`` for the table and print it as one JSON line."""
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def context(name: str):
    """``TKV_DECODE_CONTEXT=name`` for the block (cuda_decode.DECODE_CONTEXT patched)."""
    from unittest import mock

    from tkv.kernels import cuda_decode
    return mock.patch.object(cuda_decode, "DECODE_CONTEXT", name)


def both(a, b):
    """Both context managers ``a`` and ``b`` as one."""
    stack = contextlib.ExitStack()
    stack.enter_context(a)
    stack.enter_context(b)
    return stack


def model_step_rows(shapes, arms, layers: int = 36) -> None:
    """Time kernels_gpu's ``layers``-layer engine-like step per (B, L) in ``shapes`` for each
    arm ``(label, attn, setting)``: ``attn`` as ``kg.make_model_step`` takes it (``"bf16"``
    is the baseline of ``x_bf16``), ``setting`` a context-manager factory held while the step
    is built and timed, or None."""
    for B, L in shapes:
        ref = None
        for label, attn, setting in arms:
            try:
                with setting() if setting else contextlib.nullcontext():
                    step = kg.make_model_step(B, L, attn, layers=layers)
                    ms = kg.bench(step)
            except Exception as e:
                log({"kernel": "model_step", "B": B, "L": L, "impl": label, "error": str(e)[:200]})
                continue
            ref = ms if attn == "bf16" else ref
            log({"kernel": "model_step", "B": B, "L": L, "layers": layers, "impl": label,
                 "ms": ms, "x_bf16": round(ref / ms, 3) if ref else None})
            del step
            torch.cuda.empty_cache()


def model_step_lines() -> list[str]:
    """Markdown lines for the logged ``model_step`` rows (none: no lines)."""
    steps = [r for r in ROWS if r.get("kernel") == "model_step"]
    if not steps:
        return []
    lines = ["", "36-layer engine-like step (kernels_gpu.make_model_step); x_bf16 > 1 = faster "
             "than bf16:", "", "| B × L | impl | ms | x_bf16 |", "|---|---|---:|---:|"]
    for r in steps:
        lines.append(f"| {r['B']} × {r['L']} | {r['impl']} | "
                     + (f"error: {r['error'][:80]} | |" if "error" in r
                        else f"{r['ms']:.3f} | {r['x_bf16']} |"))
    return lines


def write_results(out: str, name: str, tag: str, table: str) -> None:
    """``<out>/<name>[_<tag>].jsonl`` (every row) and ``.md`` (the table), then print it."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{tag}" if tag else name
    (d / f"{stem}.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (d / f"{stem}.md").write_text(table)
    print(table)


def parser(quick_help: str) -> argparse.ArgumentParser:
    """The options both scripts take: ``--out``, ``--tag``, ``--quick``, ``--model-step``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--model-step", action="store_true")
    return ap


def start() -> float:
    """Seed torch, measure and log the device's copy bandwidth (GB/s, read + write)."""
    torch.manual_seed(0)
    copy_gbs = kg.copy_bandwidth()
    log({"kernel": "copy", "GBps": copy_gbs})
    return copy_gbs
