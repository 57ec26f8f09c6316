"""Offline (CPU, no GPU) anatomy of ``compress_store``'s kernel for the H200 (sm_90a).

Compiles ``tkv.kernels.store._compress_store_kernel`` with the constexprs ``compress_store``
passes for a K4V4 loader (8 KV heads, 16-token pages, bf16 K/V) through Triton 3.6 → PTX →
the ptxas / cuobjdump that ship with Triton, per tile variant, and reports registers, spills,
shared memory and SASS instructions *per element and side* (the kernel has no loop: the whole
program's SASS, half of it per side, × warps × 32 lanes / (tokens × head_dim)) with the main
opcodes — the proxy ``docs/kernels.md`` (session 9) used to rework the kernel. Run from the
repository root::

    uv run --frozen python benchmarks/sass_store_offline.py      # ~2 min, 2-core CPU
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tkv.kernels._util as util
from tkv.codec import TurboKVCodec
from tkv.codec.packing import code_group
from tkv.kernels import TkvLoader
from tkv.kernels import loaders as loaders_mod
from tkv.kernels import store as store_mod
from tkv.kernels.store import _compress_store_kernel

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
F32 = "*fp32"
# (tokens per program, warps, rotation, sink offsets); rotation as compress_store names it
VARIANTS = [(16, 4, "tf32x3", False), (16, 4, "split", False), (64, 4, "split", False),
            (64, 8, "split", False), (128, 8, "split", False), (32, 4, "split", True),
            # session 28: the butterfly rotation (no d × d operand), decode and prefill tiles
            (8, 4, "split", False), (8, 4, "wht", False), (16, 4, "wht", False),
            (64, 4, "wht", False), (64, 8, "wht", False), (128, 8, "wht", False),
            (8, 4, "split", True), (8, 4, "wht", True), (32, 4, "wht", True)]
# session 32's one-dot ±1 rotation ("pm1", measured slower than "wht" and removed) is at fbaf2b3
MODES = {"tf32x3": store_mod._TF32X3, "split": store_mod._BF16_TERMS,
         "wht": store_mod._BUTTERFLIES}


def compile_store(block_t, warps, rotation, sink, head_dim=128, bits=4):
    """ptxas info, shared bytes and SASS of one configuration."""
    ld = TkvLoader(TurboKVCodec(head_dim, bits), 8, 16)
    lay, st = ld.layout, ld.layout.strides()
    kg, kgb = code_group(bits)
    consts = dict(K_HAS_MU=False, HEAD_DIM=head_dim, D_PAD=ld.d_pad, BLOCK_SIZE=16,
                  BLOCK_T=block_t, NORM_HEAD_STRIDE=st["norm_head"],
                  CH=min(ld.d_pad, 64 if ld.d_pad <= 128 else 32),
                  LOG2D=ld.d_pad.bit_length() - 1)
    for s in ("K", "V"):
        lo = s.lower()
        consts.update({f"{s}_BITS": bits, f"{s}_CODES_OFF": getattr(lay, f"{lo}_codes_offset"),
                       f"{s}_NORMS_OFF": getattr(lay, f"{lo}_norms_offset"),
                       f"{s}_CODE_BYTES": getattr(lay, f"{lo}_code_bytes"),
                       f"{s}_NORM_CORR": getattr(ld, f"{lo}_norm_correction"),
                       f"{s}_GROUP": kg, f"{s}_GROUP_BYTES": kgb,
                       f"{s}_HEAD_STRIDE": st[f"{lo}_head"], f"{s}_TOK_STRIDE": st[f"{lo}_token"],
                       f"{s}_SINK": sink, f"{s}_SPLIT": MODES[rotation],
                       f"{s}_NPL": ld.group_planes(lo)})
    a = "*bf16" if rotation == "split" else F32
    ptrs = {"K": "*bf16", "V": "*bf16", "slots": "*i64", "cache": "*u8", "aux": "*bf16",
            "Ak": a, "Av": a}
    names = _compress_store_kernel.arg_names
    ptrs.update(ak_scale="fp32", av_scale="fp32")
    sig = {n: ptrs.get(n, "constexpr" if n in consts else
                       F32 if n in ("kinv_s", "vinv_s", "kbounds", "vbounds", "ktable", "vtable",
                                    "kmu", "kmu_rot", "kshift", "vshift", "kdelta", "vdelta")
                       else "i32") for n in names}
    aligned = set(ptrs) | {"skt", "skh", "svt", "svh", "page_bytes"}
    src = ASTSource(fn=_compress_store_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                           if n in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": 1})
    with tempfile.TemporaryDirectory() as tmp:
        ptx, obj = Path(tmp) / "k.ptx", Path(tmp) / "k.o"
        ptx.write_text(k.asm["ptx"])
        info = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", obj],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([BIN / "cuobjdump", "-sass", obj], capture_output=True,
                              text=True, check=True).stdout
    return info, k.metadata.shared, sass


def load_bytes(body: list[str]) -> int:
    """Bytes one thread's global loads (``LDG``, predicated ones counted as taken) request in
    the whole program: the L2/HBM traffic the program waits on (x, the rotation operand,
    boundaries and centroids)."""
    width = {"": 4, "U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
    total = 0
    for t in body:
        op = re.sub(r"^@!?U?P\w+ ", "", t).split()[0]
        if op.startswith("LDG"):
            mods = [m for m in op.split(".")[1:] if m in width]
            total += width[mods[-1]] if mods else 4
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--rotations", default=",".join(MODES),
                    help="comma-separated rotations to compile (default: all)")
    a = ap.parse_args()
    wanted = set(a.rotations.split(","))
    if not wanted <= set(MODES):
        ap.error(f"--rotations: choose from {', '.join(MODES)}")
    loaders_mod.interpreting = util.interpreting = lambda: False   # compile only, never run
    rows = ["# compress_store kernel, offline sm_90a anatomy (K4V4, head_dim 128, 8 KV heads, "
            "bf16 K/V)", "",
            f"Triton {triton.__version__}; ptxas/cuobjdump from Triton's bundle. Command: `uv run "
            "--frozen python benchmarks/sass_store_offline.py --out <this file>`. Per element "
            "and side = program SASS / 2 × warps × 32 / (tokens × 128). LDG KB = the bytes the "
            "program's global loads request, all threads (a scalar load every thread issues — "
            "boundaries, centroids — counts once per thread; the rotation operand and x are "
            "vector loads), half per side. Nothing is timed: see docs/kernels.md.", "",
            "| tokens | warps | rotation | sink | registers | spills (B) | shared (B) | "
            "instr./element/side | LDG KB/program/side | top opcodes |",
            "|---:|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for bt, w, rotation, sink in (v for v in VARIANTS if v[2] in wanted):
        info, shared, sass = compile_store(bt, w, rotation, sink)
        body = [m.group(1) for m in (re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
                                     for line in sass.splitlines()) if m]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+ ", "", t).split()[0].split(".")[0]
                                  for t in body)
        per = len(body) / 2 * w * 32 / (bt * 128)
        top = ", ".join(f"{o} {n}" for o, n in ops.most_common(6))
        regs = re.search(r"Used (\d+) registers", info).group(1)
        spill = re.search(r"(\d+) bytes spill stores", info).group(1)
        rows.append(f"| {bt} | {w} | {rotation} | {sink} | {regs} | {spill} | {shared:,} | "
                    f"{per:.1f} | {load_bytes(body) / 2 * w * 32 / 1024:.1f} | {top} |")
        print(rows[-1], flush=True)
    if a.out:
        Path(a.out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
