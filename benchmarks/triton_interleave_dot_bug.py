"""Triton 3.6 / sm_90 miscompile found in session 10: ``tl.dot(P, V)`` where ``V`` is
``tl.interleave`` of two tiles gathered from uint8 codes is wrong when the dot's K dimension
(V's rows, the tokens) is 16, and exact from 32 on — at every V width and 4 or 8 warps.

``TkvLoader.min_block_n`` is 32 for a loader whose V side interleaves its code-group planes
because of it. Run on a CUDA GPU to check a newer Triton (prints one line per case, BAD where
the dot is wrong)::

    python3 benchmarks/triton_interleave_dot_bug.py

H200, torch 2.11.0+cu130, triton 3.6.0 (2026-11-30): BAD at N=16 for G=8/16/32 and 4/8 warps,
OK for N=32/64/128 (``benchmarks/results/triton_interleave_dot_bug_2026-11-30.txt``).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _interleaved_pv(R, T, P, O, N: tl.constexpr, G: tl.constexpr):
    r = tl.arange(0, N)[:, None] * G + tl.arange(0, G)[None, :]
    w = tl.load(R + r).to(tl.int32)                      # [N, G] bytes of four 2-bit codes
    a = tl.load(T + (w & 3)).to(tl.float16)              # codes 0 and 2 of each byte
    b = tl.load(T + ((w >> 4) & 3)).to(tl.float16)
    v = tl.interleave(a, b)                              # [N, 2G]
    rp = tl.arange(0, 16)[:, None] * N + tl.arange(0, N)[None, :]
    s = tl.dot(tl.load(P + rp), v)                       # [16, 2G], K dimension = N
    ro = tl.arange(0, 16)[:, None] * (2 * G) + tl.arange(0, 2 * G)[None, :]
    tl.store(O + ro, s)


def main():
    for warps in (4, 8):
        for n in (16, 32, 64, 128):
            for g in (8, 16, 32):
                raw = torch.randint(0, 256, (n, g), device="cuda", dtype=torch.uint8)
                table = torch.randn(4, device="cuda")
                vals = [table[(raw.long() >> s) & 3].half().float() for s in (0, 4)]
                want = torch.stack(vals, -1).reshape(n, 2 * g)
                p = torch.randn(16, n, device="cuda").half()
                out = torch.empty(16, 2 * g, device="cuda")
                _interleaved_pv[(1,)](raw, table, p, out, n, g, num_warps=warps)
                err = (out - p.float() @ want).abs().max().item()
                print(f"warps={warps} N={n} G={g}: {'OK' if err < 1e-3 else 'BAD'} (max err {err:.3g})")


if __name__ == "__main__":
    main()
