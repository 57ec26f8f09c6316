"""The split-K decode kernel compiles for the H200 (sm_90a) on any box, GPU or not: Triton →
PTX → the ptxas that ships with Triton (``benchmarks/sass_decode_offline.py --session18``).
Catches what the interpreter cannot: a kernel signature the compiler refuses, and a register
or spill regression of the default launch (prmti, 4 warps, query rotated in the kernel) and
of session 18's variants (one split writing the layer output, length-aware split-K)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "sass_decode_offline.py"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_decode_split_kernel_compiles_for_sm90a_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    out = tmp_path / "sass.md"
    subprocess.run([sys.executable, str(SCRIPT), "--session18", "--out", str(out)], cwd=ROOT,
                   env=env, check=True, capture_output=True, text=True, timeout=600)
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()
            if line.startswith("| prmti")]
    assert len(rows) == 3, rows   # the default and session 18's two variants
    for label, regs, spills, *_ in rows:
        # 168 registers = 3 CTAs of 4 warps per SM (docs/kernels.md, session 6)
        assert int(regs) <= 168 and int(spills) == 0, (label, regs, spills)
    assert re.search(r"EPILOGUE 2", out.read_text()) and "MIN_SPLIT_TILES 4" in out.read_text()
