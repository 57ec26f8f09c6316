"""Step 7: needle in a haystack — does the compressed cache still let the model retrieve a
fact planted deep in a long context?

Haystack: the shipped Paul Graham essays (the needle-in-a-haystack harness's haystack,
gkamradt/LLMTest_NeedleInAHaystack), concatenated in file-name order and cut to each context
length. A needle sentence is inserted at a depth (fraction of the context, snapped to the
next sentence end), the question is asked through the model's chat template, and the answer
is decoded greedily for ``max_new_tokens`` (≥ 24: the model restates the question for ~10
tokens before the digits). A cell passes when the needle's number appears in the answer.

Serving semantics: the prompt is prefilled once, uncompressed; every arm then stores that
prompt's K/V in its own cache (uncompressed: as is; TKV: compressed through
:class:`~tkv.calibrate.cache.TkvCache` with ``prefill="bypass"`` semantics) and decodes
reading it. So all arms see the same prompt and the same first token logits' inputs, exactly
as vLLM/SGLang would serve them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from tkv.codec import CalibrationBundle, TurboKVCodec

from .cache import TkvCache
from .data import haystack_dir
from .errors import TextTooShortError
from .progress import bar
from .runner import _cache_kw

__all__ = ["NEEDLES", "NeedleConfig", "build_prompt", "run_needle"]

NEEDLES = (
    ("The secret passcode for the blue door is 7314.",
     "What is the secret passcode for the blue door?", "7314"),
    ("The magic number of the green lighthouse is 5862.",
     "What is the magic number of the green lighthouse?", "5862"),
    ("The access code for the red vault is 9047.",
     "What is the access code for the red vault?", "9047"),
    ("The lucky number of the silver fox is 2689.",
     "What is the lucky number of the silver fox?", "2689"),
)


@dataclass
class NeedleConfig:
    """Grid of the needle test: context lengths (tokens), depths (fractions), needles, budgets."""

    lengths: tuple[int, ...] = (1024, 2048, 4096, 7168)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    num_needles: int = 2
    budgets: tuple[float, ...] = (4.0, 3.0)
    max_new_tokens: int = 32
    haystack: str | None = None
    seed: int = 0

    def validate(self) -> None:
        if not 1 <= self.num_needles <= len(NEEDLES):
            raise ValueError(f"num_needles must be in 1..{len(NEEDLES)}")
        if self.max_new_tokens < 24:
            raise ValueError("max_new_tokens must be >= 24 (answers are cut off below that)")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError("depths are fractions in [0, 1]")


def _haystack_text(folder: str | None) -> str:
    d = Path(folder) if folder else haystack_dir()
    files = sorted(d.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt essays in haystack folder {d}")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def build_prompt(tokenizer, haystack: str, length: int, depth: float, needle: str,
                 question: str) -> torch.Tensor:
    """Chat-template prompt ids ``(1, ≈length)`` with ``needle`` at ``depth`` of the context.

    Raises:
        TextTooShortError: the haystack has fewer tokens than ``length`` needs.
    """
    def render(context: str) -> list[int]:
        msg = (f"{context}\n\nBased only on the text above, answer the question. {question}")
        if getattr(tokenizer, "chat_template", None):
            out = tokenizer.apply_chat_template([{"role": "user", "content": msg}],
                                                add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return list(out)
        return tokenizer(msg, add_special_tokens=False)["input_ids"]

    overhead = len(render(needle))
    budget = length - overhead
    hay = tokenizer(haystack[: 8 * length], add_special_tokens=False)["input_ids"]
    if len(hay) < budget or budget <= 0:
        raise TextTooShortError(f"haystack holds {len(hay)} tokens, a {length}-token context "
                                f"needs {budget}")
    context = tokenizer.decode(hay[:budget], skip_special_tokens=True)
    pos = int(depth * len(context))
    m = re.compile(r"[.!?]\s").search(context, pos)
    cut = m.end() if m else pos
    context = context[:cut] + needle + " " + context[cut:]
    return torch.tensor([render(context)], dtype=torch.long)


def _greedy(model, first_logits: torch.Tensor, cache, steps: int, eos: set[int]) -> list[int]:
    kw = _cache_kw(model)
    out = []
    tok = int(first_logits.argmax())
    with torch.inference_mode():
        for _ in range(steps):
            out.append(tok)
            if tok in eos:
                break
            logits = model(torch.tensor([[tok]]), **{kw: cache, "use_cache": True}).logits[0, -1]
            tok = int(logits.argmax())
    return out


def run_needle(lm, bundle: CalibrationBundle | None, cfg: NeedleConfig | None = None,
               show_progress: bool = True) -> dict:
    """Pass rates of uncompressed vs TKV at ``cfg.budgets`` on the same prompts.

    With ``bundle`` None the TKV arms are uncalibrated TurboQuant at K=V=round(budget).

    Returns:
        ``{"cells": [...], "summary": {arm: "passed/total"}, "markdown": str}``.
    """
    cfg = cfg or NeedleConfig()
    cfg.validate()
    model, tok = lm.model, lm.tokenizer
    geo = lm.geometry
    hay = _haystack_text(cfg.haystack)
    eos = {i for i in [getattr(tok, "eos_token_id", None)] if i is not None}
    eos |= {i for i in (getattr(model.generation_config, "eos_token_id", None) or [])}\
        if isinstance(getattr(model.generation_config, "eos_token_id", None), list) else set()
    arms = ["uncompressed"] + [f"TKV@{b:g}" for b in cfg.budgets]

    def tkv_cache(b: float) -> TkvCache:
        if bundle is not None:
            return TkvCache.from_bundle(bundle, b, prefill="bypass")
        w = round(b)
        return TkvCache([TurboKVCodec(geo.head_dim, w, check_finite=False)
                         for _ in range(geo.num_layers)], prefill="bypass")

    cells = []
    grid = [(n, L, d) for n in range(cfg.num_needles) for L in cfg.lengths for d in cfg.depths]
    pb = bar(len(grid), "needle", show_progress, "cell")
    kw = _cache_kw(model)
    for ni, length, depth in grid:
        needle, question, answer = NEEDLES[ni]
        ids = build_prompt(tok, hay, length, depth, needle, question)
        raw = DynamicCache()
        with torch.inference_mode():
            first = model(ids, **{kw: raw, "use_cache": True}).logits[0, -1]
        prefix = [(layer.keys, layer.values) for layer in raw.layers]
        row = {"needle": ni, "length": int(ids.shape[1]), "target_length": length, "depth": depth}
        for arm in arms:
            if arm == "uncompressed":
                cache = DynamicCache()
                for i, (k, v) in enumerate(prefix):
                    cache.update(k, v, i)
            else:
                cache = tkv_cache(float(arm.split("@")[1]))
                cache.load_prefix(prefix)
            gen = _greedy(model, first, cache, cfg.max_new_tokens, eos)
            text = tok.decode(gen, skip_special_tokens=True)
            row[arm] = {"pass": answer in text, "answer": text.strip()}
        cells.append(row)
        pb.update(1)
    pb.close()
    summary = {a: f"{sum(c[a]['pass'] for c in cells)}/{len(cells)}" for a in arms}
    md = ["| arm | passed |", "|---|---:|"] + [f"| {a} | {summary[a]} |" for a in arms]
    md.append("")
    md.append(f"Grid: {cfg.num_needles} needle(s) × lengths {list(cfg.lengths)} tokens × depths "
              f"{list(cfg.depths)}; greedy, {cfg.max_new_tokens} new tokens; prompt prefilled "
              "uncompressed, stored compressed, decode reads the compressed cache"
              + ("" if bundle is not None else " (no bundle: uncalibrated TurboQuant)") + ".")
    fails = [f"needle {c['needle']} len {c['target_length']} depth {c['depth']}: "
             + ", ".join(f"{a} → {c[a]['answer'][:60]!r}" for a in arms if not c[a]["pass"])
             for c in cells if not all(c[a]["pass"] for a in arms)]
    if fails:
        md.append("\nMisses:\n")
        md += [f"- {f}" for f in fails]
    return {"cells": cells, "summary": summary, "markdown": "\n".join(md) + "\n",
            "config": {"lengths": list(cfg.lengths), "depths": list(cfg.depths),
                       "num_needles": cfg.num_needles, "budgets": list(cfg.budgets),
                       "max_new_tokens": cfg.max_new_tokens}}
