"""Offline (CPU, no GPU) anatomy of the split-K decode kernel for the H200 (sm_90a).

Compiles ``tkv.kernels.decode._decode_split_kernel`` with the exact constexprs a CPU
``TkvLoader`` gives (K4V4, head_dim 128, 4 query heads per KV head, 16-token pages, bf16 dots)
through Triton 3.6 → PTX → the ptxas / cuobjdump that ship with Triton, for each variant below,
and reports ptxas registers / spills, shared memory per CTA, and the SASS of the main loop (the
longest backward branch = one BLOCK_N-token tile of K and V): instructions per thread and the
main opcodes. Warp-instructions per 128 tokens = loop instructions × warps × 128 / BLOCK_N —
the proxy docs/kernels.md uses for this ALU/latency-bound kernel. Run from the repository root::

    uv run --frozen python benchmarks/sass_decode_offline.py     # ~1 min, 2-core CPU

Prints a markdown table and writes it to ``--out``.
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
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tkv.kernels._util as util
from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader
from tkv.kernels import loaders as loaders_mod
from tkv.kernels.decode import _decode_split_kernel

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PTRS = {"Q": "*fp32", "block_table": "*i32", "seq_lens": "*i32", "k_base": "*u8",
        "k_aux": "*bf16", "k_table": "*i32", "v_base": "*u8", "v_aux": "*bf16",
        "v_table": "*i32", "part_o": "*fp32", "part_lse": "*fp32", "q_w": "*fp32",
        "q_rot": "*fp32", "Out": "*bf16", "o_w": "*fp32"}
ALIGNED = set(PTRS) | {"k_sb", "v_sb", "sq_s", "s_bt", "k_sh", "k_st", "v_sh", "v_st", "sq_h",
                       "so_s", "so_h"}
# (label, lookup, num_warps, BLOCK_N, swap_qk or None = the loader's choice, maxnreg)
VARIANTS = [("prmt (default to session 5)", "prmt", 4, 128, None, None),
            ("prmt, 8 warps", "prmt", 8, 128, None, None),
            ("prmt, 64-token tiles", "prmt", 4, 64, None, None),
            ("prmt, swap_qk", "prmt", 4, 128, True, None),
            ("prmt1, 4 warps", "prmt1", 4, 128, None, None),
            ("prmt1, 8 warps", "prmt1", 8, 128, None, None),
            ("prmti, 4 warps", "prmti", 4, 128, None, None),
            ("prmti, 8 warps", "prmti", 8, 128, None, None),
            ("prmti, maxnreg 128 (default, large grids)", "prmti", 4, 128, None, 128)]
# session 29: prmti's values from the antisymmetric codebook's half tables
PRMTS_LABEL = "prmts, 4 warps, query rotated in-kernel"
# the same with the query rotated in the kernel (decode(fused_query_rotation=True), session 15)
QROT_VARIANTS = [("prmti, 4 warps, query rotated in-kernel", "prmti", 4, 128, None, None),
                 ("prmti, maxnreg 128, query rotated in-kernel", "prmti", 4, 128, None, 128),
                 (PRMTS_LABEL, "prmts", 4, 128, None, None),
                 ("prmts, maxnreg 128, query rotated in-kernel", "prmts", 4, 128, None, 128)]
# session 18 (query rotated in-kernel, the default): one split writing the layer output itself
# (EPILOGUE 2: unrotated by butterflies), and length-aware split-K (MIN_SPLIT_TILES)
# (label, extra constexprs)
SESSION18_VARIANTS = [
    ("prmti, 4 warps, qrot, one split writing out (EPILOGUE 2)",
     {"NUM_SPLITS": 1, "EPILOGUE": 2, "OROT_LOG2": 7}),
    ("prmti, 4 warps, qrot, length-aware split-K (MIN_SPLIT_TILES 4, one-split rows final)",
     {"MIN_SPLIT_TILES": 4, "EPILOGUE": 2, "OROT_LOG2": 7})]


# session 32: the default kernel (query rotated in-kernel, one split writing the output) with
# the lookups' first table words resident in regular registers (TkvLoader(resident_tables=))
_DEFAULT_KERNEL = {"NUM_SPLITS": 1, "EPILOGUE": 2, "OROT_LOG2": 7}
RESIDENT_VARIANTS = [
    (f"{lk}{', resident tables' if res else ''}{f', maxnreg {mx}' if mx else ''}", lk, 4, 128,
     None, mx, (4, 4), 2, True, _DEFAULT_KERNEL, res)
    for lk in ("prmti", "prmts") for res, mx in ((False, None), (True, None), (True, 168))]


# --widths: 2/3-bit sides, pair tables vs the register byte-permute group lookup, and the
# group planes the kernels take (session 10)
# (label, lookup, num_warps, BLOCK_N, swap_qk, maxnreg, (k_bits, v_bits), planes)
WIDTH_VARIANTS = [(f"K{kb}V{vb} {lk}, {npl} planes, {bn}-token tiles", lk, 4, bn, None, None,
                   (kb, vb), npl)
                  for kb, vb, bns in ((3, 3, (32, 64)), (2, 2, (128,)), (4, 3, (64,)))
                  for lk, npls in (("pair", (8,)), ("auto", (8, 2, 1))) for npl in npls
                  for bn in bns]


def compile_variant(lookup, warps, block_n, swap, maxnreg, tmp: Path, widths=(4, 4), planes=2,
                    qrot=False, extra=None, resident=False):
    """ptxas info line, shared bytes and the SASS text of one variant (``extra``: constexprs
    overriding the defaults, e.g. ``{"EPILOGUE": 2, ...}``; ``resident``: the loader's
    ``resident_tables``)."""
    ld = TkvLoader(TurboKVCodec(128, k_bits=widths[0], v_bits=widths[1]), 8, 16, lookup=lookup,
                   planes=planes, resident_tables=resident)
    cache = torch.zeros(4, ld.layout.page_bytes, dtype=torch.uint8)
    ka, va = (ld.side_args(cache, s, torch.bfloat16) for s in ("k", "v"))
    consts = dict(FETCH=ld.fetch, DEQUANT=ld.dequant, KP0=ka[6], KP1=ka[7], KP2=ka[8],
                  KP3=ka[9], KNP=ka[10], VP0=va[6], VP1=va[7], VP2=va[8], VP3=va[9], VNP=va[10],
                  G=4, BLOCK_H=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=block_n,
                  NUM_SPLITS=2, DOT_DTYPE=tl.bfloat16, PREFETCH=False, K_SINK=False, V_SINK=False,
                  QROT_LOG2=7 if qrot else 0, EPILOGUE=0, OROT_LOG2=0, MIN_SPLIT_TILES=0,
                  SWAP_QK=ld.k_operand_a(torch.bfloat16) if swap is None else swap)
    consts.update(extra or {})
    names = _decode_split_kernel.arg_names
    sig = {a: PTRS.get(a, "constexpr" if a in consts else "fp32" if a == "scale_log2" else "i32")
           for a in names}
    if qrot:   # the model-space bf16 query
        sig["Q"] = "*bf16"
    src = ASTSource(fn=_decode_split_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                           if a in ALIGNED})
    opts = {"num_warps": warps, "num_stages": 1, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx, obj = tmp / "k.ptx", tmp / "k.o"
    ptx.write_text(k.asm["ptx"])
    info = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", obj],
                          capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([BIN / "cuobjdump", "-sass", obj], capture_output=True, text=True,
                          check=True).stdout
    return info, k.metadata.shared, sass


def loop_ops(sass: str) -> tuple[int, collections.Counter, int, int]:
    """Instructions of the longest backward-branch loop, opcode counts, and the IMAD.U32 /
    IMAD.MOV (register copies) among them."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    lo, hi = 0, -1
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > hi - lo:
            lo, hi = int(m.group(1), 16), addr
    body = [t for a, t in ins if lo <= a <= hi]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+ ", "", t).split()[0].split(".")[0] for t in body)
    return (len(body), ops, sum("IMAD.U32" in t for t in body),
            sum("IMAD.MOV" in t for t in body))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/sass_decode_offline.md")
    ap.add_argument("--widths", action="store_true",
                    help="2/3-bit sides: pair tables vs the group prmt lookup (WIDTH_VARIANTS)")
    ap.add_argument("--session18", action="store_true",
                    help="only the query-rotated prmti and prmts kernels and session 18's "
                    "variants")
    ap.add_argument("--resident", action="store_true",
                    help="only the default kernel with and without resident table words "
                    "(RESIDENT_VARIANTS, session 32)")
    a = ap.parse_args()
    variants = WIDTH_VARIANTS if a.widths else (
        [(*v, (4, 4), 2, False) for v in VARIANTS] + [(*v, (4, 4), 2, True) for v in QROT_VARIANTS]
        + [(label, "prmti", 4, 128, None, None, (4, 4), 2, True, extra)
           for label, extra in SESSION18_VARIANTS])
    if a.session18:
        variants = [v for v in variants if v[0] in (QROT_VARIANTS[0][0], PRMTS_LABEL)
                    or len(v) > 9]
    if a.resident:
        variants = RESIDENT_VARIANTS
    # the prmt lookups refuse the interpreter; here nothing runs, the kernel is only compiled
    loaders_mod.interpreting = util.interpreting = lambda: False
    what = "2/3-bit sides" if a.widths else "K4V4"
    rows = [f"# Split-K decode kernel, offline sm_90a anatomy ({what}, head_dim 128, G=4, bf16)",
            "", f"Triton {triton.__version__}; ptxas/cuobjdump from Triton's bundle. Command: "
            "`uv run --frozen python benchmarks/sass_decode_offline.py"
            f"{' --widths' if a.widths else ''}{' --session18' if a.session18 else ''}"
            f"{' --resident' if a.resident else ''}`.", "",
            "| variant | registers | spills (B) | shared (B) | loop instr / thread | "
            "warp-instr per 128 tokens | PRMT | IMAD.U32 | IMAD.MOV | LDS+STS+LDSM | HMMA |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as d:
        for label, lookup, warps, block_n, swap, maxnreg, widths, planes, *rest in variants:
            qrot, extra, resident = (*rest, *(False, None, False)[len(rest):])
            info, shared, sass = compile_variant(lookup, warps, block_n, swap, maxnreg, Path(d),
                                                 widths, planes, bool(qrot), extra, resident)
            regs = re.search(r"Used (\d+) registers", info).group(1)
            spill = re.search(r"(\d+) bytes spill stores", info).group(1)
            n, ops, imad_u, imad_mov = loop_ops(sass)
            rows.append(f"| {label} | {regs} | {spill} | {shared:,} | {n:,} | "
                        f"{n * warps * 128 // block_n:,} | {ops['PRMT']} | {imad_u} | {imad_mov} | "
                        f"{ops['LDS'] + ops['STS'] + ops['LDSM']} | {ops['HMMA']} |")
            print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
