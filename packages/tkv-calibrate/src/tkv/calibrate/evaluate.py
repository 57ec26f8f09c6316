"""Evaluation arms and the two fidelity metrics of the report, each on the same tokens.

* Teacher-forced: the whole window in one pass with every attention reading the
  quantize-dequantized cache (``prefill="compressed"``): perplexity of the window's next
  tokens, mean KL(uncompressed ‖ compressed) and top-1 agreement over all positions.
* Decode path as served: the first ``prefix`` tokens are prefilled uncompressed (their K/V
  taken from the uncompressed pass — the same numbers an uncompressed prefill computes) and
  stored compressed; the remaining tokens are then decoded teacher-forced reading the
  compressed cache (one chunk: causal attention makes it identical to token-by-token decode,
  each token reading its own just-written compressed K/V as vLLM does). KL and top-1 over
  the decoded positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .cache import QuantizedKVCache
from .metrics import Tally, compare_logits
from .progress import bar
from .quantizers import KVQuantizer
from .runner import PrefixRunner, forward_logits

__all__ = ["Arm", "ArmResult", "EvalResult", "evaluate_arms", "measure_kl"]


@dataclass
class Arm:
    """A storage format for every layer.

    Attributes:
        name: label. quantizers: per layer, None = uncompressed bf16.
        bytes_per_token_head: average over layers of K+V bytes per token per KV head.
        group: report group ("baseline", "tkv", "smartmix", "peer", "uncalibrated").
        meta: free-form (widths, budget).
    """

    name: str
    quantizers: Sequence[KVQuantizer | None]
    bytes_per_token_head: float
    group: str = "tkv"
    meta: dict = field(default_factory=dict)

    def cache(self) -> QuantizedKVCache:
        return QuantizedKVCache(list(self.quantizers), prefill="compressed")


@dataclass
class ArmResult:
    """Measured metrics of one arm (see module docstring)."""

    name: str
    group: str
    bytes_per_token_head: float
    tf: Tally
    decode: Tally
    meta: dict = field(default_factory=dict)

    def row(self, base_ppl: float, bf16_bytes: float) -> dict:
        ppl = self.tf.ppl
        return {
            "name": self.name, "group": self.group,
            "bytes_per_token_head": round(self.bytes_per_token_head, 3),
            "capacity_vs_bf16": round(bf16_bytes / self.bytes_per_token_head, 4),   # printed .2f: one rounding
            "ppl": round(ppl, 4), "delta_ppl_pct": round(100 * (ppl / base_ppl - 1), 3),
            "kl": self.tf.mean_kl, "top1": round(self.tf.top1_agree, 5),
            "decode_kl": self.decode.mean_kl if self.decode.positions else None,
            "decode_top1": round(self.decode.top1_agree, 5) if self.decode.positions else None,
            **{k: v for k, v in self.meta.items() if isinstance(v, int | float | str | list)},
        }


@dataclass
class EvalResult:
    """Baseline perplexity and one :class:`ArmResult` per arm; tokens counted."""

    base: Tally
    arms: list[ArmResult]
    windows: int
    window: int
    prefix: int
    seconds: float = 0.0

    def rows(self, bf16_bytes: float) -> list[dict]:
        return [a.row(self.base.ppl, bf16_bytes) for a in self.arms]


def evaluate_arms(model, windows: torch.Tensor, arms: Sequence[Arm], prefix: int | None = None,
                  decode: bool = True, show_progress: bool = True, desc: str = "evaluate") -> EvalResult:
    """Teacher-forced and decode-path metrics of ``arms`` over ``windows`` (int64 ``(n, T)``).

    Loops windows outermost so only one window's uncompressed logits are held in memory.
    ``prefix`` defaults to ``T // 2``.
    """
    import time

    t0 = time.perf_counter()
    n, t = windows.shape
    p = t // 2 if prefix is None else prefix
    base = Tally()
    res = {a.name: ArmResult(a.name, a.group, a.bytes_per_token_head, Tally(), Tally(), dict(a.meta))
           for a in arms}
    pb = bar(n * (1 + len(arms)), desc, show_progress, "pass")
    for i in range(n):
        ids = windows[i:i + 1]
        targets = torch.cat([ids[0, 1:], torch.tensor([-1])])
        run = PrefixRunner(model, ids)
        blp = torch.log_softmax(run.base_logits, -1)
        base.add(compare_logits(run.base_logits, run.base_logits, targets, blp))
        pb.update(1)
        for a in arms:
            r = res[a.name]
            logits = forward_logits(model, ids, a.cache())
            r.tf.add(compare_logits(run.base_logits, logits, targets, blp))
            del logits
            if decode:
                cache = a.cache()
                cache.load_prefix([(k[:, :, :p], v[:, :, :p]) for k, v in run.kv])
                dl = forward_logits(model, ids[:, p:], cache)
                r.decode.add(compare_logits(run.base_logits[p:], dl, None, blp[p:]))
            pb.update(1)
        del run, blp
    pb.close()
    return EvalResult(base, [res[a.name] for a in arms], n, t, p, time.perf_counter() - t0)


def measure_kl(model, windows: torch.Tensor, quantizer_sets: Sequence[Sequence[KVQuantizer | None]],
               show_progress: bool = True, desc: str = "measure") -> list[float]:
    """Teacher-forced mean KL of each per-layer quantizer set over ``windows`` (for SmartMix
    verification)."""
    tallies = [Tally() for _ in quantizer_sets]
    pb = bar(windows.shape[0] * len(quantizer_sets), desc, show_progress, "pass")
    for i in range(windows.shape[0]):
        ids = windows[i:i + 1]
        base = forward_logits(model, ids, None)
        blp = torch.log_softmax(base, -1)
        for tl, qs in zip(tallies, quantizer_sets, strict=True):
            tl.add(compare_logits(base, forward_logits(model, ids, QuantizedKVCache(list(qs))),
                                  None, blp))
            pb.update(1)
    pb.close()
    return [t.mean_kl for t in tallies]
