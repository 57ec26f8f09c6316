"""compress_store(kernel="cuda") against the Triton store and the codec on one GPU: for each
configuration (base, key centering, channel scales, sink offsets, fp16 / f32 inputs, K8V8,
K3V2, head_dim 256 / 64, 1 / 8 KV heads, 5 / 1,000 tokens) and side, the fraction of codes
equal to the Triton store's (the baseline) and to the codec's ``quantize``, the number of
vectors with any unequal code and the largest relative norm difference. Prints one line per
configuration.

Usage: python benchmarks/cuda_store_agreement_gpu.py
"""

from __future__ import annotations

import torch

from tkv.codec import unpack_codes
from tkv.kernels import TkvLoader, compress_store
from tkv.kernels.testing import offset_codec

CONFIGS = [("base", {}), ("center", dict(center=True)), ("scales", dict(scales=True)),
           ("sink", dict(sink=True)), ("fp16", dict(dtype=torch.float16)),
           ("f32", dict(dtype=torch.float32)), ("k8v8", dict(kb=8, vb=8)),
           ("k3v2", dict(kb=3, vb=2)), ("d256", dict(d=256)), ("d64", dict(d=64)),
           ("hkv1", dict(hkv=1)), ("hkv8", dict(hkv=8)), ("n5", dict(n=5)),
           ("n1000", dict(n=1000))]


def run(name, d=128, kb=4, vb=4, dtype=torch.bfloat16, center=False, scales=False, sink=False,
        hkv=3, n=101):
    g = torch.Generator().manual_seed(7)
    codec = offset_codec(d, kb, vb, hkv, g, center=center, scales=scales, sink=sink, seed=5)
    ld = TkvLoader(codec, hkv, 16)
    nblk = max(9, n // 16 + 2)
    k = (torch.randn(n, hkv, d, generator=g) * 3).to("cuda", dtype)
    v = torch.randn(n, hkv, d, generator=g).to("cuda", dtype)
    slots = torch.randperm(nblk * 16, generator=g)[:n].cuda()
    cuda, tri = ld.layout.allocate(nblk, "cuda"), ld.layout.allocate(nblk, "cuda")
    compress_store(k, v, cuda, slots, ld, kernel="cuda")
    compress_store(k, v, tri, slots, ld, kernel="triton")
    b, o = slots // 16, slots % 16
    vc, vt = ld.layout.views(cuda), ld.layout.views(tri)
    out = []
    for side, bits, x in (("k", kb, k), ("v", vb, v)):
        cc = unpack_codes(vc[f"{side}_codes"][b, :, o], bits, d)
        ct = unpack_codes(vt[f"{side}_codes"][b, :, o], bits, d)
        ref = (codec.k if side == "k" else codec.v).quantize(x.float())[0]
        nc, nt = vc[f"{side}_norms"][b, :, o].float(), vt[f"{side}_norms"][b, :, o].float()
        bad = (cc != ct).any(-1)
        rel = ((nc - nt).abs() / nt.abs().clamp_min(1e-30)).max().item()
        out.append(f"{side}: cu=tri {(cc == ct).float().mean().item():.4f} "
                   f"cu=codec {(cc == ref).float().mean().item():.4f} "
                   f"tri=codec {(ct == ref).float().mean().item():.4f} "
                   f"badvec {bad.sum().item()}/{bad.numel()} normrel {rel:.2e}")
    print(name, " | ".join(out), flush=True)


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    for name, kw in CONFIGS:
        run(name, **kw)


if __name__ == "__main__":
    main()
