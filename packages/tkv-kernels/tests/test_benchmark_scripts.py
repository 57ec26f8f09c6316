"""The benchmark scripts are run mostly on a borrowed GPU, where a script that does not even
compile costs a device call. These CPU checks catch that class here: every script under
``benchmarks/`` compiles (Python's own compiler, which also rejects what ruff's default rules
let through, e.g. a name used before its ``global`` declaration), and the GPU benchmarks'
argument parsers build (``--help``), which evaluates every option's default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def test_benchmark_scripts_found():
    assert len(SCRIPTS) >= 10, f"benchmarks/ moved? found {len(SCRIPTS)} scripts in {BENCHMARKS}"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_compiles(path: Path):
    compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize(("command", "option"), [
    (["kernels_gpu.py"], "--model-step-arms"), (["vllm_e2e.py", "all"], "--runs"),
    (["sglang_e2e.py", "all"], "--variants"), (["sass_decode_offline.py"], "--session18"),
    (["cuda_decode_gpu.py"], "--sink"), (["cuda_store_gpu.py"], "--model-step")],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_gpu_benchmark_argument_parser_builds(command: list[str], option: str):
    script, *sub = command
    res = subprocess.run([sys.executable, str(BENCHMARKS / script), *sub, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert option in res.stdout


def test_kernels_gpu_table_takes_rows_without_impl(tmp_path, monkeypatch):
    """The results table is written at the very end of a GPU hold: a logged error row without
    ``impl`` (a per-kernel breakdown that failed) crashed it in session 30, after every
    timing had run; the rows had to be recovered from stdout."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import kernels_gpu

    monkeypatch.setattr(kernels_gpu, "ROWS", [
        {"kernel": "copy", "impl": "torch copy_", "GBps": 3000.0, "ms": 0.0},
        {"kernel": "decode_step_breakdown", "B": 64, "error": "boom"},
        {"kernel": "decode", "B": 32, "impl": "tkv", "ms": 0.25, "GBps": 1000.0,
         "frac_copy": 0.33}])
    out = tmp_path / "t.md"
    kernels_gpu.table(3000.0, out, device="test device")
    text = out.read_text()
    assert "error: boom" in text and "| decode | B=32 | tkv |" in text


def test_cuda_store_gpu_table_takes_error_rows(monkeypatch):
    """cuda_store_gpu's table (written after every timing of a GPU hold) renders timed rows,
    agreement columns, failed rows and model-step rows from the shared row log."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cuda_bench
    import cuda_store_gpu

    base = {"kernel": "store", "T": 64, "Hkv": 8, "D": 128, "widths": "K4V4", "sink": True}
    monkeypatch.setattr(cuda_bench, "ROWS", [
        {"kernel": "copy", "GBps": 3000.0},
        {**base, "impl": "triton", "ms": 0.01, "GBps": 500.0, "frac_copy": 0.17},
        {**base, "impl": "cuda", "ms": 0.005, "GBps": 1000.0, "frac_copy": 0.33,
         "x_default": 2.0, "codes_equal": 0.9999, "norm_ulps": 1.0},
        {**base, "impl": "cuda elems=8", "error": "boom"},
        {"kernel": "model_step", "B": 64, "L": 640, "impl": "bf16", "ms": 5.0, "x_bf16": 1.0},
        {"kernel": "model_step", "B": 64, "L": 640, "impl": "tkv", "error": "oom"}])
    monkeypatch.setattr(cuda_store_gpu, "ROWS", cuda_bench.ROWS)
    monkeypatch.setattr(cuda_store_gpu.torch.cuda, "get_device_name", lambda: "test device")
    text = cuda_store_gpu.table(3000.0)
    assert "+ centering + sink | cuda | 0.0050 | 1000 | 33% | 2.0 | 0.9999 | 1.0 |" in text
    assert "error: boom" in text and "| 64 × 640 | tkv | error: oom" in text
