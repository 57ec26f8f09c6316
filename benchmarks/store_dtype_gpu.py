"""compress_store by input dtype on one GPU: bf16 / fp16 K and V through the default
``rotation="auto"`` (three 16-bit terms of the rotation) side by side with ``tf32x3`` (the
fp16 path before session 9), K4V4, Hkv=8, head_dim 128, 16,384 and 256 new tokens; CUDA
graphs, L2 flushed (``kernels_gpu.bench``). Baseline named in each ratio: the bf16 default.

    PYTHONPATH=packages/tkv-codec/src:packages/tkv-kernels/src python3 benchmarks/store_dtype_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import bench

from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader, compress_store


def main() -> None:
    ld = TkvLoader(TurboKVCodec(128, 4, device="cuda"), 8, 16)
    print("| T | input | rotation | ms | x bf16 default |\n|---:|---|---|---:|---:|")
    for T in (16384, 256):
        nblk = T // 16 + 1
        cache = ld.layout.allocate(nblk, "cuda")
        slots = torch.randperm(nblk * 16, device="cuda")[:T]
        x = torch.randn(T, 8, 128, device="cuda")
        ref = None
        for dt, rot in ((torch.bfloat16, "auto"), (torch.float16, "auto"),
                        (torch.float16, "tf32x3")):
            k, v = x.to(dt), x.flip(0).to(dt)
            ms = bench(lambda k=k, v=v, c=cache, s=slots, rot=rot:
                       compress_store(k, v, c, s, ld, rotation=rot))
            ref = ref or ms
            print(f"| {T} | {str(dt)[6:]} | {rot} | {ms:.4f} | {ref / ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
