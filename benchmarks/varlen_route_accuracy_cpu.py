"""Accuracy of prefill routes vs the float64 oracle (CPU, Triton interpreter).

Routes (same cache / inputs):
  model  : model-space varlen path, callable = FA2 emulation (bf16 q/k/v rows, P bf16, out bf16)
  planar : planar varlen path (forced), same callable
  tl_gpu : "Triton loop as on a GPU": planar rows (the decompress-once scratch rows = the
           planar varlen rows) in bf16, P bf16, fp32 accumulation, fp32 rotated output
           unrotated once -> emulated by the planar varlen path with a callable that rounds
           q/k/v and P to bf16 but not its output
  tl_cpu : the real Triton loop under the interpreter (float32 dots: no bf16 rounding)
Final out is bf16 (as the GPU benchmark: out = empty_like(q)) or float32 (--out32).

Session 25: why the model-space route's max abs difference to the Triton loop grew 2-4x on
the H100 (lost correlation, not lost accuracy; docs/kernels.md, "Session 25"). Results and
commands: benchmarks/results/varlen_route_accuracy_cpu.md. Run with TRITON_INTERPRET=1:

    TRITON_INTERPRET=1 uv run --frozen python benchmarks/varlen_route_accuracy_cpu.py [--random]
        [--k3v2] [--big] [--out32] [--no-cpu-loop]
"""
import argparse
import contextlib
import importlib
import itertools
import sys
from unittest import mock

import torch

from tkv.codec import TurboKVCodec
from tkv.kernels import TkvLoader, prefill, varlen_prefix_bytes
from tkv.kernels.reference import prefill_reference
from tkv.kernels.testing import fill_cache, make_cache, make_paged_batch

pm = importlib.import_module("tkv.kernels.prefill")
BF = torch.bfloat16


def rb(x):
    return x.to(BF).to(torch.float32)


class FAEmu:
    """FlashAttention-like numerics: bf16 q/k/v, fp32 scores, P rounded to bf16 for P@V
    (l from fp32 P), fp32 accumulation, output rounded to bf16 (round_out)."""

    def __init__(self, round_out=True, round_p=True, block=None):
        self.round_out, self.round_p, self.block = round_out, round_p, block

    def __call__(self, q, k, v, cu_q, cu_k, mq, mk, scale, window):
        assert window == 0
        out = torch.zeros(q.shape, dtype=torch.float32)
        cq, ck = cu_q.tolist(), cu_k.tolist()
        hq, hkv = q.shape[1], k.shape[1]
        g = hq // hkv
        for i in range(len(cq) - 1):
            qa, qb, ka, kb = cq[i], cq[i + 1], ck[i], ck[i + 1]
            lq, lk = qb - qa, kb - ka
            if lq == 0:
                continue
            qq = rb(q[qa:qb].float()).transpose(0, 1)                    # (hq, lq, d)
            kk = rb(k[ka:kb].float()).transpose(0, 1).repeat_interleave(g, 0)
            vv = rb(v[ka:kb].float()).transpose(0, 1).repeat_interleave(g, 0)
            s = (qq @ kk.transpose(1, 2)) * scale
            rel = (torch.arange(lq)[:, None] + (lk - lq) - torch.arange(lk)[None, :])
            s = s.masked_fill(~(rel >= 0), float("-inf"))
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m)
            l = p.sum(-1, keepdim=True)
            pp = rb(p) if self.round_p else p
            o = (pp @ vv) / l
            out[qa:qb] = o.transpose(0, 1)
        return rb(out) if self.round_out else out


def planar_route():
    """Force the planar route (the model-space test answers False)."""
    return mock.patch.object(pm, "_model_space_rows", lambda *a: False)


def tkv_cache_random(ld, nblocks, g):
    """The GPU benchmark's cache: random code bytes, norms uniform in 8..12."""
    cache = torch.randint(0, 256, (nblocks, ld.layout.page_bytes), dtype=torch.uint8, generator=g)
    v = ld.layout.views(cache)
    for name in ("k_norms", "v_norms"):
        v[name].copy_(torch.rand(v[name].shape, generator=g) * 4 + 8)
    return cache


def build(seed, prefix, qlens, kb, vb, hkv=2, group=4, d=128, data="filled"):
    g = torch.Generator().manual_seed(seed)
    ld = TkvLoader(TurboKVCodec(d, k_bits=kb, v_bits=vb), hkv, 16)
    batch = make_paged_batch([p + q for p, q in zip(prefix, qlens, strict=True)], 16, "cpu", generator=g)
    if data == "random":
        cache = tkv_cache_random(ld, batch.num_blocks, g)
    else:
        cache = make_cache(ld, batch.num_blocks, "cpu", generator=g)
    qs, ks, vs = [], [], []
    for i, (p, ql) in enumerate(zip(prefix, qlens, strict=True)):
        k = torch.randn(p + ql, hkv, d, generator=g).to(BF)
        v = torch.randn(p + ql, hkv, d, generator=g).to(BF)
        if data == "filled":
            fill_cache(ld, cache, k, v, batch.slots(i))
        ks.append(k[p:])
        vs.append(v[p:])
        qs.append(torch.randn(ql, hkv * group, d, generator=g).to(BF))
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    return ld, batch, cache, q, k, v, cu


def run_route(route, ld, batch, cache, q, k, v, cu, prefix, qlens, out_dtype):
    need = varlen_prefix_bytes(sum(prefix), q.shape[0], ld.num_kv_heads, ld.head_dim, BF)
    fn = {"model": FAEmu(), "planar": FAEmu(), "tl_gpu": FAEmu(round_out=False),
          "tl_cpu": None}[route]
    ctx = planar_route if route in ("planar", "tl_gpu") else contextlib.nullcontext
    with ctx():
        out = prefill(q, k, v, cu, batch.seq_lens, max(qlens), cache, batch.block_table, ld,
                      out=torch.full(q.shape, float("nan"), dtype=torch.float32),
                      max_prefix_len=max(prefix),
                      scratch=torch.full((need // 4 + 64,), float("nan")),
                      dense_attention=fn, prefix_tokens=sum(prefix), block_m=16)
    # the interpreter stores fp32 -> bf16 by truncation (a GPU rounds to nearest even):
    # write float32 and round here, as the GPU's final store does
    return (rb(out) if out_dtype == BF else out).double()


def bf16_ulp(x):
    a = x.abs().clamp_min(1e-30).float()
    e = torch.floor(torch.log2(a))
    return (2.0 ** (e - 7)).double()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out32", action="store_true", help="float32 output instead of bf16")
    ap.add_argument("--random", action="store_true",
                    help="random-byte cache (as kernels_gpu.py) instead of one filled from data")
    ap.add_argument("--k3v2", action="store_true", help="K3V2 instead of K4V4")
    ap.add_argument("--big", action="store_true", help="1 x (1024 prefix + 256 chunk)")
    ap.add_argument("--no-cpu-loop", action="store_true",
                    help="skip the real Triton loop under the interpreter (the slow route)")
    args = ap.parse_args()
    out_dtype = torch.float32 if args.out32 else BF
    data = "random" if args.random else "filled"
    kb, vb = (3, 2) if args.k3v2 else (4, 4)
    prefix, qlens = [256, 512], [64, 128]
    if args.big:
        prefix, qlens = [1024], [256]
    seeds = [1, 2, 3]
    routes = ["model", "planar", "tl_gpu"] + ([] if args.no_cpu_loop else ["tl_cpu"])
    print(f"# data={data} K{kb}V{vb} out={out_dtype} prefix={prefix} qlens={qlens}")
    for seed in seeds:
        ld, batch, cache, q, k, v, cu = build(seed, prefix, qlens, kb, vb, data=data)
        ref = prefill_reference(q, k, v, cu, batch.seq_lens, cache, batch.block_table, ld)
        rms = ref.pow(2).mean().sqrt().item()
        outs = {r: run_route(r, ld, batch, cache, q, k, v, cu, prefix, qlens, out_dtype)
                for r in routes}
        ulp = bf16_ulp(ref)
        print(f"seed {seed}: ref rms {rms:.4f} max|ref| {ref.abs().max().item():.3f}")
        for r, o in outs.items():
            e = (o - ref).abs()
            i = int(e.argmax())
            t, h, c = i // (e.shape[1] * e.shape[2]), (i // e.shape[2]) % e.shape[1], i % e.shape[2]
            s = int(torch.searchsorted(cu[1:], torch.tensor(t, dtype=torch.int32), right=True))
            tc = t - int(cu[s])
            pos = prefix[s] + tc
            print(f"  {r:7s} maxabs {e.max().item():.3e} relF {(e.norm() / ref.norm()).item():.3e} "
                  f"max/rms {e.max().item() / rms:.3e}  max-ulps(|ref|>rms) {(e / ulp)[ref.abs() > rms].max().item():.2f} "
                  f"| argmax seq {s} chunk-tok {tc}/{qlens[s]} "
                  f"pos {pos} head {h} dim {c} ref {ref.flatten()[i].item():+.4f}")
        names = list(outs)
        pw = "  pairwise maxabs: " + " ".join(
            f"{a}-{b} {(outs[a] - outs[b]).abs().max().item():.3e}"
            for a, b in itertools.combinations(names, 2))
        print(pw)
        # error profile over chunk position for model route: max err in first 16 / mid / last 16
        e = (outs["model"] - ref).abs().amax((1, 2))
        for s in range(len(qlens)):
            es = e[int(cu[s]):int(cu[s + 1])]
            print(f"  model err by chunk pos seq{s}: first16 {es[:16].max().item():.2e} "
                  f"mid {es[16:-16].max().item():.2e} last16 {es[-16:].max().item():.2e}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
