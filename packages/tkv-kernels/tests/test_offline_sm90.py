"""The split-K decode kernel compiles for the H200 (sm_90a) on any box, GPU or not: Triton →
PTX → the ptxas that ships with Triton (``benchmarks/sass_decode_offline.py --session18``).
Catches what the interpreter cannot: a kernel signature the compiler refuses, and a register
or spill regression of the default launch (prmti, 4 warps, query rotated in the kernel), of
session 18's variants (one split writing the layer output, length-aware split-K) and of the
antisymmetric-table lookup prmts (session 29)."""

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
    # prmts (session 29): prmti's values from half the tables — the same occupancy, and fewer
    # loop instructions than the default launch it would replace
    sym = [line.split("|")[1:-1] for line in out.read_text().splitlines()
           if line.startswith("| prmts")]
    assert len(sym) == 1, sym
    _, regs, spills, _, loop, *_ = sym[0]
    assert int(regs) <= 168 and int(spills) == 0, sym[0]
    assert int(loop.replace(",", "")) < 0.9 * int(rows[0][4].replace(",", "")), (sym[0], rows[0])


# The varlen path's helper kernels for sm_90 (session 25: added without a GPU hold after
# them). Run in a subprocess: under TRITON_INTERPRET=1 the kernels are interpreted functions.
# Compiles a Triton (or, with ``source=GluonASTSource``, Gluon) kernel for sm_90 from a
# signature: pointer types in ``ptrs``, constexprs in ``consts``, every other argument i32.
_BUILD = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, ptrs, consts, warps, source=ASTSource):
    names = fn.arg_names
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in names}
    src = source(fn=fn, signature=sig, constexprs={(names.index(k),): v
                                                   for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
'''


def _compile_offline(script: str, done: str) -> None:
    """Run ``_BUILD + script`` in a subprocess without ``TRITON_INTERPRET`` (compile, not
    interpret: under the interpreter the kernels are plain functions); it must print ``done``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _BUILD + script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and done in res.stdout, res.stderr[-2000:]


_HELPERS = r'''
from tkv.kernels.prefill import _nan_broken_promise_kernel, _pack_chunk_rows_kernel

for kv, has_mu in (("*bf16", True), ("*bf16", False), ("*fp32", True), ("*fp16", False)):
    k = build(_pack_chunk_rows_kernel,
              {"K": kv, "V": kv, "MU": "*fp32", "PK": "*bf16" if kv != "*fp16" else "*fp16",
               "PV": "*bf16" if kv != "*fp16" else "*fp16", "DST": "*i64"},
              {"HAS_MU": has_mu, "D": 128, "D_BLOCK": 128, "BLOCK_T": 16}, 4)
    assert "st.global" in k.asm["ptx"], "_pack_chunk_rows_kernel"
for flags, has in (("*u8", True), ("*i32", False)):
    k = build(_nan_broken_promise_kernel,
              {"out": "*bf16", "cu_q": "*i32", "seq_lens": "*i32", "flags": flags},
              {"HAS_FLAGS": has, "HEAD_DIM": 128, "D_BLOCK": 128}, 1)
    assert "st.global" in k.asm["ptx"], "_nan_broken_promise_kernel"
print("compiled 6 variants")
'''


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_varlen_helper_kernels_compile_for_sm90a():
    """_pack_chunk_rows_kernel (bf16 / float32 / fp16 rows, with and without the key offset)
    and _nan_broken_promise_kernel (the varlen path's flags and the bypass's own check)
    compile to sm_90 cubins on any box: Triton → PTX → ptxas."""
    _compile_offline(_HELPERS, "compiled 6 variants")


_GLUON = r'''
from triton.experimental.gluon._runtime import GluonASTSource
from tkv.kernels import gluon_decode as gd

fn = gd.gluon_decode_split_kernel
k = build(fn, {"Q": "*bf16", "block_table": "*i32", "seq_lens": "*i32", "k_base": "*u8",
               "k_aux": "*u8", "k_table": "*i32", "v_base": "*u8", "v_aux": "*u8",
               "v_table": "*i32", "part_o": "*fp32", "part_lse": "*fp32", "scale_log2": "fp32"},
          {"KP1": 0, "KP2": 0, "KP3": 0, "VP1": 0, "VP2": 0, "VP3": 0, "G": 4, "HEAD_DIM": 128,
           "BLOCK_SIZE": 16, "BLOCK_N": 64, "NUM_SPLITS": 4, "LK": gd.k_layout(64, 128),
           "LV": gd.v_layout(64, 128)}, 1, source=GluonASTSource)
assert "max_blocks" in fn.arg_names and k.asm["cubin"], "no cubin"
print("compiled gluon split kernel")
'''


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_gluon_decode_kernel_compiles_for_sm90a():
    """The experimental Gluon split kernel (``decode(kernel="gluon")``, CUDA only: no
    interpreter run on CPU) compiles to an sm_90 cubin on any box, with the block table's
    width (``max_blocks``) among its arguments since session 26 (it bounds the token loop
    and the table reads, as the Triton kernel does)."""
    _compile_offline(_GLUON, "compiled gluon split kernel")
