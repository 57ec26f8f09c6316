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
    (["sglang_e2e.py", "all"], "--variants"), (["sass_decode_offline.py"], "--session18")],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_gpu_benchmark_argument_parser_builds(command: list[str], option: str):
    script, *sub = command
    res = subprocess.run([sys.executable, str(BENCHMARKS / script), *sub, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert option in res.stdout
