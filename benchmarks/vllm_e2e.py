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
``qwen3-8b-like`` — random weights (``load_format=dummy``) with Qwen3-8B attention geometry
(Hq=32, Hkv=8, head_dim 128, 36 layers), built from a config on the device, no download.

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


def resolve_model(spec: str, work: Path) -> tuple[Path, bool]:
    """(model dir, dummy weights?) — ``qwen3-8b-like`` is generated; ``smollm2`` is
    ``$TKV_MODEL`` (default ``/tmp/tkv-models/smollm2-135m``); anything else is a local
    directory (stage HF models on the host beforehand)."""
    if spec == "qwen3-8b-like":
        return make_qwen3_like(work), True
    if spec == "smollm2":  # the model ../shared/gpu stages on the device
        spec = os.environ.get("TKV_MODEL", "/tmp/tkv-models/smollm2-135m")
    p = Path(spec)
    if not (p / "config.json").is_file():
        raise SystemExit(f"{spec}: not a model directory with config.json")
    return p, False


# ----------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """One (model, mode) in this process; writes a JSON result."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=args.model, gpu_memory_utilization=args.gmu, seed=0,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp,
              **MODES[args.mode])
    if args.dummy:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res: dict = {"mode": args.mode, "tkv_bits": os.environ.get("TKV_BITS"), "tp": args.tp,
                 "enforce_eager": args.enforce_eager, "startup_s": time.perf_counter() - t0}
    cc = llm.llm_engine.vllm_config.cache_config
    if getattr(cc, "num_gpu_blocks", None):
        res["kv_tokens_blocks"] = int(cc.num_gpu_blocks) * int(cc.block_size)

    detok = {"detokenize": False} if args.dummy else {}
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, **detok)
    if args.dummy:
        import random

        rng = random.Random(1)
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 30000)
                                                  for _ in range(16)]) for _ in PROMPTS]
    else:
        prompts = PROMPTS
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
    if not args.dummy:
        res["greedy_text"] = [o.outputs[0].text for o in outs]

    if not args.greedy_only:
        import random

        rng = random.Random(0)
        sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, **detok)
        res["throughput"] = {}
        for n in args.batches:
            batch = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 30000)
                                                    for _ in range(512)]) for _ in range(n)]
            llm.generate(batch[: min(n, 8)],
                         SamplingParams(max_tokens=8, ignore_eos=True, **detok),
                         use_tqdm=False)  # warm-up
            t = time.perf_counter()
            llm.generate(batch, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            res["throughput"][str(n)] = {"seconds": dt, "output_tok_s": n * 256 / dt}
        if args.long_prompt and args.max_model_len >= args.long_prompt + 256:
            long = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 30000)
                                                   for _ in range(args.long_prompt)])]
            t = time.perf_counter()
            llm.generate(long, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            res["throughput"][f"1x{args.long_prompt}"] = {"seconds": dt,
                                                         "output_tok_s": 256 / dt}
    Path(args.result).write_text(json.dumps(res, indent=1))


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


def run_mode(model: Path, dummy: bool, mode: str, bits: str | None, bundle: Path | None,
             out: Path, opts: argparse.Namespace, greedy_only: bool = False) -> dict:
    """Run one (model, mode) worker subprocess and return its result dict
    (``{"mode", "failed": True, "rc", "log"}`` when it fails)."""
    tp = int(getattr(opts, "tp", 1) or 1)
    eager = bool(getattr(opts, "enforce_eager", False))
    tag = (f"{model.name}-{mode}{'-' + bits if bits else ''}{f'-tp{tp}' if tp > 1 else ''}"
           f"{'-eager' if eager else ''}")
    result = out / f"{tag}.json"
    result.unlink(missing_ok=True)
    long_prompt = getattr(opts, "long_prompt", 0) if dummy or getattr(opts, "long_real", False) \
        else 0
    max_len = getattr(opts, "long_max_model_len", opts.max_model_len) if long_prompt \
        else opts.max_model_len
    cmd = [sys.executable, os.path.abspath(__file__), "worker", "--model", str(model),
           "--mode", mode, "--result", str(result), "--gmu", str(opts.gmu),
           "--max-model-len", str(max_len), "--max-num-seqs", str(max(opts.batches)),
           "--long-prompt", str(long_prompt), "--tp", str(tp),
           "--batches", *map(str, opts.batches)]
    if dummy:
        cmd.append("--dummy")
    if greedy_only:
        cmd.append("--greedy-only")
    if eager:
        cmd.append("--enforce-eager")
    env = {**os.environ}
    env.pop("TKV_BITS", None)
    env.pop("TKV_CALIBRATION_FILE", None)
    if mode == "tkv":
        env["TKV_BITS"] = bits or "4.0"
        if bundle is not None:
            env["TKV_CALIBRATION_FILE"] = str(bundle)
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
                f"tok/s {k}" for k in base.get("throughput", {})) + " | ×bf16 (each) | ×tq4 (each) |",
            "|---|---|---|---|" + "---|" * len(base.get("throughput", {})) + "---|---|"]

    def kv(r):
        return r.get("kv_tokens_reported") or r.get("kv_tokens_blocks")

    for name, r in res.items():
        if r.get("failed"):
            rows.append(f"| {name} | FAILED | | | | |")
            continue
        ratio = f"{kv(r) / kv(base):.2f}" if kv(r) and kv(base) else "?"
        if base.get("greedy") and r.get("greedy"):
            ex, fr = agreement(base["greedy"], r["greedy"])
            agree = f"{ex}/{len(base['greedy'])} exact, {100 * fr:.0f}% prefix"
        else:
            agree = "-"
        tps = [r.get("throughput", {}).get(k, {}).get("output_tok_s") for k in
               base.get("throughput", {})]
        vs_b = [f"{t / base['throughput'][k]['output_tok_s']:.2f}" if t else "-"
                for t, k in zip(tps, base.get("throughput", {}), strict=True)]
        vs_t = [f"{t / tq['throughput'][k]['output_tok_s']:.2f}"
                if t and tq.get("throughput", {}).get(k) else "-"
                for t, k in zip(tps, base.get("throughput", {}), strict=True)]
        kv_s = f"{kv(r):,}" if kv(r) else "?"
        rows.append(f"| {name} | {kv_s} | {ratio} | {agree} | "
                    + " | ".join(f"{t:,.0f}" if t else "-" for t in tps)
                    + f" | {' / '.join(vs_b)} | {' / '.join(vs_t)} |")
    return "\n".join(rows) + "\n"


def run_all(opts: argparse.Namespace) -> int:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# tkv-vllm end-to-end ({time.strftime('%Y-%m-%d %H:%M')})", "",
          f"gpu_memory_utilization={opts.gmu}; baseline: bf16 KV cache (vLLM auto); "
          f"batches {opts.batches} × 512-token prompts, 256 output tokens, CUDA graphs on.", "",
          "Command: `" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) + "`", ""]
    failed: list[str] = []
    for spec in opts.model:
        model, dummy = resolve_model(spec, out / "models")
        bundle = Path(opts.bundle) if opts.bundle else write_uniform_bundle(
            model, out / f"{model.name}-uniform-bundle.json")
        runs = {"bf16": ("bf16", None, None, False), "tq4": ("tq4", None, None, False),
                "tkv": ("tkv", opts.bits, bundle, False), "tkv8": ("tkv", "8.0", bundle, True)}
        res = {}
        for r in opts.runs:
            mode, bits, b, greedy_only = runs[r]
            res[f"{mode}@{bits}" if bits else mode] = run_mode(model, dummy, mode, bits, b, out,
                                                               opts, greedy_only=greedy_only)
            # partial results after every engine run (poll picks them up)
            (out / f"{model.name}.json").write_text(json.dumps(res, indent=1))
        t = table(model.name + (" (random weights)" if dummy else ""), res)
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
        model, dummy = resolve_model(spec, out / "models")
        why = tp_unsupported(model, tp)
        if why:
            line = f"### {model.name}: not run at TP={tp} — {why}\n"
            print(line, flush=True)
            md.append(line)
            continue
        bundle = Path(opts.bundle) if opts.bundle else write_uniform_bundle(
            model, out / f"{model.name}-uniform-bundle.json")

        def go(mode, bits, t, greedy_only, eager, _model=model, _dummy=dummy, _bundle=bundle):
            o = argparse.Namespace(**{**vars(opts), "tp": t, "enforce_eager": eager,
                                      "long_prompt": 0})
            return run_mode(_model, _dummy, mode, bits, _bundle if mode == "tkv" else None,
                            out, o, greedy_only=greedy_only)

        ge = opts.greedy_eager
        res = {f"bf16 tp{tp}": go("bf16", None, tp, False, False),
               f"tkv@{opts.bits} tp{tp}": go("tkv", opts.bits, tp, False, False)}
        greedy = {}
        for bits in ("8.0", opts.bits):
            if f"tkv@{bits} tp{tp} g" in greedy:
                continue
            greedy[f"tkv@{bits} tp{tp} g"] = go("tkv", bits, tp, True, ge)
            greedy[f"tkv@{bits} tp1 g"] = go("tkv", bits, 1, True, ge)
        if opts.bf16_tp1:  # how much TP alone moves greedy tokens (all-reduce order)
            greedy[f"bf16 tp{tp} g"] = go("bf16", None, tp, True, ge)
            greedy["bf16 tp1 g"] = go("bf16", None, 1, True, ge)
        allres = {**res, **greedy}
        (out / f"{model.name}-tp{tp}.json").write_text(json.dumps(allres, indent=1))
        failed |= any(r.get("failed") for r in allres.values())
        md.append(tp_table(model.name + (" (random weights)" if dummy else ""), tp, opts.bits,
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
            "KV GiB per GPU | " + " | ".join(f"tok/s {k}" for k in keys) + " | ×bf16 (each) |",
            "|---|---|---|---|" + "---|" * len(keys) + "---|"]
    for label, r in res.items():
        if r.get("failed"):
            rows.append(f"| {label} | FAILED (rc={r.get('rc')}) | | | " + "| " * len(keys) + "|")
            continue
        ratio = f"{kv(r) / kv(base):.2f}" if kv(r) and kv(base) else "?"
        gib = " / ".join(f"{v:g}" for v in r.get("kv_gib_by_process", {}).values()) or "?"
        tps = [r.get("throughput", {}).get(k, {}).get("output_tok_s") for k in keys]
        vs = [f"{t / base['throughput'][k]['output_tok_s']:.2f}" if t else "-"
              for t, k in zip(tps, keys, strict=True)]
        rows.append(f"| {label} | {kv(r):,} | {ratio} | {gib} | " if kv(r) else
                    f"| {label} | ? | {ratio} | {gib} | ")
        rows[-1] += " | ".join(f"{t:,.0f}" if t else "-" for t in tps) + f" | {' / '.join(vs)} |"
    rows += ["", f"| greedy ({GREEDY_TOKENS} tokens, 8 prompts) | TP={tp} vs TP=1 |", "|---|---|"]
    pairs = [("tkv@8.0", "goal: 8/8 equal"), (f"tkv@{bits}", "reported"), ("bf16", "reference")]
    seen = set()
    for pre, note in pairs:
        a, b = greedy.get(f"{pre} tp{tp} g"), greedy.get(f"{pre} tp1 g")
        if a is None or b is None or pre in seen:
            continue
        seen.add(pre)
        if a.get("failed") or b.get("failed"):
            rows.append(f"| {pre} ({note}) | FAILED |")
            continue
        ex, fr = agreement(b["greedy"], a["greedy"])
        rows.append(f"| {pre} ({note}) | {ex}/{len(a['greedy'])} exact, {100 * fr:.0f}% prefix |")
    tkv_g = res.get(f"tkv@{bits} tp{tp}", {})
    if base.get("greedy") and tkv_g.get("greedy"):
        ex, fr = agreement(base["greedy"], tkv_g["greedy"])
        rows.append(f"| tkv@{bits} vs bf16, both TP={tp} (CUDA graphs) | {ex}/{len(base['greedy'])}"
                    f" exact, {100 * fr:.0f}% prefix |")
    return "\n".join(rows) + "\n"


def serve_check(opts: argparse.Namespace) -> None:
    """`vllm serve` with the tkv flags answers /v1/completions."""
    import urllib.request

    port = opts.port
    model, dummy = resolve_model(opts.model[0], Path("/tmp/tkv-e2e-models"))
    if dummy:
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
    model, dummy = resolve_model(opts.model[0], out / "models")
    bundle = Path(opts.bundle) if opts.bundle else write_uniform_bundle(
        model, out / f"{model.name}-uniform-bundle.json")
    runs = {"bf16": run_mode(model, dummy, "bf16", None, None, out, opts, greedy_only=True)}
    for b in opts.bits:
        runs[f"tkv@{b}"] = run_mode(model, dummy, "tkv", b, bundle, out, opts, greedy_only=True)
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
            line += f"; greedy = bf16: {ex}/{len(PROMPTS)} exact, {100 * fr:.0f}% prefix"
            if r.get("tkv_bits", "").startswith("8") and ex < len(PROMPTS) - 1:
                line += "   <<< BELOW GOAL (>= 7/8 at TKV_BITS=8)"
        print(line + ("   FAILED" if r.get("failed") else ""), flush=True)
    if not dummy and not base.get("failed"):
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
        if name == "tp":
            a.add_argument("--out", default="benchmarks/results/vllm_tp2")
            a.add_argument("--bits", default="4.0", help="TKV_BITS of the capacity/throughput "
                           "run and of the reported TP agreement (8.0 is always compared)")
            a.add_argument("--bundle", default=None, help="calibration bundle (default: uniform)")
            a.add_argument("--batches", type=int, nargs="+", default=[64, 256])
            a.add_argument("--greedy-eager", action=argparse.BooleanOptionalAction, default=True,
                           help="greedy TP comparisons with enforce_eager on both sides")
            a.add_argument("--bf16-tp1", action="store_true",
                           help="also compare bf16 TP=N with bf16 TP=1 (TP's own effect)")
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
            a.add_argument("--long-prompt", type=int, default=32768)
            a.add_argument("--long-max-model-len", type=int, default=33280)
            a.add_argument("--long-real", action="store_true",
                           help="also run the long prompt on real-weight models")
            a.add_argument("--runs", nargs="+", choices=["bf16", "tq4", "tkv", "tkv8"],
                           default=["bf16", "tq4", "tkv", "tkv8"],
                           help="engine runs per model: bf16, vLLM turboquant_4bit_nc, tkv at "
                           "--bits (capacity+greedy+throughput), tkv at 8.0 (greedy only)")
        if name == "serve-check":
            a.add_argument("--port", type=int, default=8011)
    w = sub.add_parser("worker")
    w.add_argument("--model", required=True)
    w.add_argument("--mode", choices=sorted(MODES), required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--gmu", type=float, default=0.5)
    w.add_argument("--max-model-len", type=int, default=4096)
    w.add_argument("--max-num-seqs", type=int, default=256)
    w.add_argument("--long-prompt", type=int, default=0)
    w.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    w.add_argument("--dummy", action="store_true")
    w.add_argument("--greedy-only", action="store_true")
    w.add_argument("--enforce-eager", action="store_true")
    w.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    args = p.parse_args(argv)
    rc = {"all": run_all, "smoke": smoke, "tp": run_tp, "serve-check": serve_check,
          "worker": worker}[args.cmd](args)
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
