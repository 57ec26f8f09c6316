"""Greedy agreement with bf16 on SmolLM2-135M (real weights), CPU: tkv caches beside arms that
change only the arithmetic, not the cache (the noise floor of the test itself).

Issue #5 asks tkv at ``TKV_BITS=8`` to match bf16's greedy text for the first 32 tokens in
≥ 7 of 8 fixed prompts (``benchmarks/vllm_e2e.py``'s ``PROMPTS``). On the H200, vLLM's own
bf16 with and without CUDA graphs agreed on 5/8 of them, tkv@8 on 3/8-6/8 (docs/vllm.md).
This script measures, on CPU with transformers, how often an arm whose *only* change is
rounding (attention kernel, matmul precision) keeps bf16's text, next to tkv@8 / tkv@4 (the
codec's real compress → decompress, prefill bypass as vLLM's first chunk) — same prompts,
same token count, greedy, ``ignore_eos`` (no early stop).

Arms (reference: bf16 weights and activations, SDPA attention, transformers' DynamicCache):

* ``bf16-eager``: bf16, the eager attention implementation (other summation order).
* ``fp32``: float32 weights and activations (what bf16 rounds away).
* ``kv-noise 2^-9`` / ``kv-noise 2^-7``: bf16, K/V of every cached token multiplied by
  (1 + ε), ε uniform in ±2⁻⁹ (one more bf16 rounding's worth) or ±2⁻⁷ per element, on the
  cache only (prefill bypass, like the tkv arms).
* ``fp8``: bf16, K/V through fp8 e4m3 (``tkv.calibrate.peers.Fp8Quantizer``: amax scale per
  stored chunk — finer than vLLM's fixed per-layer scale), prefill bypass.
* ``tkv@8`` / ``tkv@4``: bf16, :class:`tkv.calibrate.cache.TkvCache` uniform K8V8 / K4V4
  (Gaussian codebooks, no bundle: what vLLM's smoke serves without a bundle), prefill bypass.

For each arm: prompts whose 32 tokens equal the reference's, the mean common prefix, and per
divergence the reference's top-1 − top-2 logprob gap (nats) at the first differing token,
computed in float32 by the reference arm along its own tokens.

    uv run --frozen python benchmarks/greedy_noise_floor_cpu.py [--tokens 32] [--seeds 3]

``--seeds`` repeats the noise arm and the tkv arms with other rotation / noise seeds.
Results: ``benchmarks/results/greedy_noise_floor_cpu.md``.
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from tkv.calibrate.cache import QuantizedKVCache, TkvCache
from tkv.calibrate.model import load_model
from tkv.calibrate.peers import Fp8Quantizer


def _vllm_e2e():
    """``benchmarks/vllm_e2e.py`` as a module — its ``PROMPTS`` and its greedy metrics
    (``agreement``, ``divergences``); it imports vLLM lazily, so loading it on CPU is fine."""
    spec = importlib.util.spec_from_file_location(
        "vllm_e2e", Path(__file__).with_name("vllm_e2e.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _NoiseQuantizer:
    """A stand-in "quantizer" for :class:`QuantizedKVCache`: returns K/V times (1 + ε), ε
    uniform in ±``rel`` per element (seeded), in the input dtype."""

    def __init__(self, rel: float, seed: int):
        self.rel = rel
        self.gen = torch.Generator().manual_seed(seed)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def noisy(x):
            e = (torch.rand(x.shape, generator=self.gen) * 2 - 1) * self.rel
            return (x.float() * (1 + e)).to(x.dtype)
        return noisy(k), noisy(v)


def _generate(model, ids: torch.Tensor, tokens: int, cache) -> list[int]:
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             past_key_values=cache, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _gap(model, ids: torch.Tensor, gen: list[int], pos: int) -> float:
    """Top-1 − top-2 logprob (float32) of ``model`` at generated position ``pos`` along
    ``gen`` (teacher-forced)."""
    full = torch.cat([ids[0], torch.tensor(gen[:pos], dtype=ids.dtype)])[None]
    with torch.inference_mode():
        logits = model(full).logits[0, -1].float()
    top = torch.log_softmax(logits, -1).topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (32)")
    p.add_argument("--seeds", type=int, default=3,
                   help="seeds of the noise and tkv arms (rotation / noise draws), default 3")
    a = p.parse_args()
    e2e = _vllm_e2e()
    prompts = list(e2e.PROMPTS)
    bf = load_model(dtype=torch.bfloat16)
    fp = load_model(dtype=torch.float32)
    tok = bf.tokenizer
    layers, hd = bf.geometry.num_layers, bf.geometry.head_dim
    ids = [tok(t, return_tensors="pt").input_ids for t in prompts]
    print(f"# greedy agreement with bf16 SDPA, {bf.name}, {len(prompts)} prompts x "
          f"{a.tokens} tokens, torch {torch.__version__}, CPU\n")

    ref = [_generate(bf.model, x, a.tokens, DynamicCache()) for x in ids]

    def eager(x):
        bf.model.set_attn_implementation("eager")
        try:
            return _generate(bf.model, x, a.tokens, DynamicCache())
        finally:
            bf.model.set_attn_implementation("sdpa")

    arms: list[tuple[str, Callable[[torch.Tensor], list[int]]]] = [
        ("bf16-eager", eager),
        ("fp32", lambda x: _generate(fp.model, x, a.tokens, DynamicCache())),
    ]
    for e in (9, 7):
        for s in range(a.seeds):
            arms.append((f"kv-noise 2^-{e} s{s}", lambda x, e=e, s=s: _generate(
                bf.model, x, a.tokens,
                QuantizedKVCache([_NoiseQuantizer(2.0 ** -e, 1000 * s + i)
                                  for i in range(layers)], "bypass"))))
    arms.append(("fp8", lambda x: _generate(
        bf.model, x, a.tokens, QuantizedKVCache([Fp8Quantizer(hd)] * layers, "bypass"))))
    for bits in (8, 4):
        for s in range(a.seeds):
            arms.append((f"tkv@{bits} s{s}", lambda x, b=bits, s=s: _generate(
                bf.model, x, a.tokens, TkvCache.uniform(layers, hd, b, b, "bypass", seed=s))))

    print("| arm | = bf16 (all tokens) | mean common prefix | first divergences "
          "(prompt@token: bf16's top-1 − top-2 gap, nats) | s |")
    print("|---|---|---|---|---|")
    for name, run in arms:
        t0 = time.perf_counter()
        gen = [run(x) for x in ids]
        equal, prefix = e2e.agreement(ref, gen, a.tokens)
        div = [f"p{d['prompt']}@{d['pos']}: "
               f"{_gap(fp.model, ids[d['prompt']], ref[d['prompt']], d['pos']):.3f}"
               for d in e2e.divergences({"greedy": ref}, {"greedy": gen}, a.tokens)]
        print(f"| {name} | {equal}/{len(ids)} | {prefix:.0%} | "
              f"{', '.join(div) or 'none'} | {time.perf_counter() - t0:.0f} |", flush=True)
    print("\nGaps are computed by the float32 model along bf16's own tokens (teacher-forced).")


if __name__ == "__main__":
    main()
