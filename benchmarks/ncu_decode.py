"""Decode kernels for Nsight Compute: one launch of ``_decode_split_kernel`` per config.

Run under ncu on the GPU (hardware counters; leave the clocks alone), e.g.::

    ncu --clock-control none --kernel-name regex:_decode_split_kernel \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section LaunchStats --section MemoryWorkloadAnalysis \\
        python benchmarks/ncu_decode.py

``--kernel cuda`` profiles the hand-written CUDA split kernel instead (``--kernel-name
regex:tkv_decode_k4v4``); ``--lut 1`` its shared-pair-table lookup, ``--warps 8`` 8 warps per
CTA (with ``--lut 1``), ``--splits N`` a split count other than the workspace's,
``--schedule balanced`` the balanced (stream-K) schedule.

Configs (Qwen3-8B-like attention: Hq=32, Hkv=8, head_dim 128, block_size 16), in order:
K4V4 (CUDA default lookup) and bf16 BypassLoader at B=256, L=640 (the e2e throughput runs'
decode steps), then K4V4 at B=32, L=8192. One launch each; nothing is timed here.
"""

from __future__ import annotations

import torch

from tkv.codec import TurboKVCodec
from tkv.kernels import BypassLoader, TkvLoader, Workspace, cuda_decode, decode


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="triton", choices=("triton", "cuda"),
                    help="decode's split kernel for the tkv configs (cuda: tkv_decode_k4v4)")
    ap.add_argument("--lut", type=int, default=0, choices=(0, 1),
                    help="with --kernel cuda: cuda_decode's lookup (1: the shared pair tables)")
    ap.add_argument("--warps", type=int, default=4, choices=(4, 8),
                    help="with --kernel cuda: warps per CTA (8 needs --lut 1)")
    ap.add_argument("--splits", type=int, default=None,
                    help="split-K count of the tkv launches (default: the workspace's)")
    ap.add_argument("--schedule", default=None, choices=("split", "balanced"),
                    help="with --kernel cuda: the work schedule (default: decode's)")
    a = ap.parse_args()
    kernel = a.kernel
    cuda_decode.TUNING.update(lut=a.lut, warps=a.warps)
    dev = "cuda"
    torch.manual_seed(0)
    hq, hkv, d, block = 32, 8, 128, 16
    ws = Workspace(256, hq, d, dev)
    for B, L, kind in ((256, 640, "tkv"), (256, 640, "bf16"), (32, 8192, "tkv")):
        nblk = B * (-(-L // block))
        bt = torch.randperm(nblk, device=dev).int().view(B, -1)
        sl = torch.full((B,), L, dtype=torch.int32, device=dev)
        q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
        if kind == "tkv":
            ld = TkvLoader(TurboKVCodec(d, 4, device=dev), hkv, block)
            cache = torch.randint(0, 256, (nblk, ld.layout.page_bytes), dtype=torch.uint8,
                                  device=dev)
            views = ld.layout.views(cache)
            for name in ("k_norms", "v_norms"):
                views[name].copy_(torch.rand_like(views[name], dtype=torch.float32) + 1)
            print(f"B={B} L={L} tkv K4V4 lookup={ld.lookup_name('k')}", flush=True)
        else:
            ld = BypassLoader(hkv, d, block, torch.bfloat16)
            kp = torch.randn(nblk, block, hkv, d, device=dev, dtype=torch.bfloat16)
            cache = (kp, torch.randn_like(kp))
            print(f"B={B} L={L} bf16 bypass", flush=True)
        # the served default: for tkv, the query rotated inside the split kernel since session
        # 16 (profiles before it show a separate rotate_rows launch)
        decode(q, cache, bt, sl, ld, ws,
               **({"kernel": kernel, "num_splits": a.splits, "schedule": a.schedule}
                  if kind == "tkv" else {}))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
