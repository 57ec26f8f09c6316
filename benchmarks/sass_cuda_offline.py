"""Offline (CPU, no GPU) anatomy of the hand-written CUDA split decode kernel for sm_90.

Compiles ``tkv/kernels/cuda/decode_k4v4.cu`` with NVRTC (PyTorch's bindings, as
``tkv.kernels._nvrtc`` does at run time) for the defines ``cuda_decode.defines`` gives a K4V4
``TkvLoader`` (Qwen3-8B-like attention: head_dim 128, 4 query heads per KV head, 16-token
pages, bf16 query rotated in the kernel, one split written unrotated) per tuning variant, and
disassembles the cubin with the ``cuobjdump`` that ships with Triton. Reports registers, stack
and local memory, and the main loop — the innermost backward branch that holds the
tensor-core instructions, one iteration = ``SUB`` 16-token steps of one warp — as
instructions per 32 tokens and warp with the main opcodes and the integer-pipe count (``PRMT``,
``LOP3``, ``SHF``, ``IADD3``, ``ISETP``, ``LEA``, ``FSEL``, ``FMNMX``, ``FSETP``, ``SEL``,
``VIADD``: the half-rate ALU pipe on Hopper). docs/kernels.md (sessions 33 and 35) uses these
numbers as the kernel's instruction budget. Run from the repository root::

    uv run --frozen python benchmarks/sass_cuda_offline.py --out benchmarks/results/X.md

Nothing is timed (see ``cuda_decode_gpu.py``).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton

from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader, _nvrtc, cuda_decode

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
ALU = {"PRMT", "LOP3", "SHF", "IADD3", "ISETP", "LEA", "FSEL", "FMNMX", "FSETP", "SEL", "VIADD"}
# (label, cuda_decode.defines tuning keywords)
VARIANTS = [("default (register byte permutes)", {}),
            ("sub=1 stages=3", {"sub": 1, "stages": 3}),
            ("lut=1 (shared pair tables)", {"lut": 1}),
            ("lut=1 warps=8", {"lut": 1, "warps": 8}),
            ("lut=1 warps=8 sub=1 stages=3", {"lut": 1, "warps": 8, "sub": 1, "stages": 3}),
            # session 36: the balanced (stream-K) schedule's builds
            ("balanced", {"balanced": True}),
            ("lut=1 balanced", {"lut": 1, "balanced": True}),
            ("lut=1 warps=8 balanced", {"lut": 1, "warps": 8, "balanced": True})]


def disassemble(defs: dict[str, int]) -> tuple[str, str]:
    """(SASS, resource usage) of the kernel built with ``defs`` for sm_90."""
    cubin = _nvrtc.compile_cubin(cuda_decode.SOURCE, cuda_decode.ENTRY, defs, "90")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(CUOBJDUMP), "-sass", str(path)], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([str(CUOBJDUMP), "-res-usage", str(path)], capture_output=True,
                             text=True, check=True).stdout
    return sass, res


def main_loop(sass: str) -> collections.Counter:
    """Opcode counts of the innermost backward branch that contains ``HMMA``."""
    recs = []   # (address, opcode, branch target or None)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            tgt = re.search(r"(0x[0-9a-f]+)", m.group(3)) if m.group(2) == "BRA" else None
            recs.append((int(m.group(1), 16), m.group(2).split(".")[0],
                         int(tgt.group(1), 16) if tgt else None))
    best = None
    for addr, _, tgt in recs:
        if tgt is None or tgt >= addr:
            continue
        ops = collections.Counter(op for a, op, _ in recs if tgt <= a <= addr)
        if ops["HMMA"] and (best is None or sum(ops.values()) < sum(best.values())):
            best = ops
    if best is None:
        raise RuntimeError("no loop with HMMA found in the SASS")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    a = ap.parse_args()
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4), 8, 16)
    rows = ["# CUDA split decode kernel, offline sm_90 anatomy (K4V4, head_dim 128, G = 4)", "",
            f"torch {torch.__version__} (NVRTC), cuobjdump from Triton {triton.__version__}. "
            "Command: `uv run --frozen python benchmarks/sass_cuda_offline.py --out <this "
            "file>`. Loop = one iteration of the main loop, normalized to 32 tokens of one warp; "
            "ALU = the integer-pipe opcodes listed in the script's docstring.", "",
            "| variant | registers | stack (B) | local (B) | MIN_CTAS | dynamic shared (B) | "
            "loop instr. / 32 tokens | ALU | LDS | top opcodes |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, tune in VARIANTS:
        defs = cuda_decode.defines(ld, 128, 4, torch.bfloat16, torch.bfloat16, qrot=True,
                                   epilogue=2, out_dtype=torch.bfloat16, **tune)
        sass, res = disassemble(defs)
        ops = main_loop(sass)
        per = 2 / defs["SUB"]   # iterations per 32 tokens
        field = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", res)}
        top = ", ".join(f"{o} {round(n * per)}" for o, n in ops.most_common(7))
        rows.append(f"| {label} | {field['REG']} | {field['STACK']} | {field['LOCAL']} | "
                    f"{defs['MIN_CTAS']} | {defs['DYN_BYTES']:,} | "
                    f"{round(sum(ops.values()) * per)} | "
                    f"{round(sum(n for o, n in ops.items() if o in ALU) * per)} | "
                    f"{round(ops['LDS'] * per)} | {top} |")
    table = "\n".join(rows) + "\n"
    print(table)
    if a.out:
        Path(a.out).write_text(table)


if __name__ == "__main__":
    main()
