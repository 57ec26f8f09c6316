"""End-to-end tkv-sglang check on one GPU: KV capacity, greedy agreement, decode throughput,
OpenAI server.

Compares, in one run and on the same GPU, SGLang 0.5.11 with

* ``bf16`` — the baseline: bf16 KV cache (``--kv-cache-dtype auto``), attention backend
  ``--baseline-backend`` (default ``triton``: FlashAttention 3, SGLang's Hopper default,
  needs the 261 MiB ``flash_ops`` staged with ``stage --with-fa3``; ``fa3`` then works here);
* ``tkv@B`` — ``--kv-cache-dtype tkv --attention-backend turbo-attn`` (page size 16) at
  ``TKV_BITS=B``, for each ``--bits`` (default ``8.0 4.0``),

and writes, per model, a table with ratios against bf16:

1. KV-cache tokens SGLang allocated (``max_total_num_tokens``, from ``get_server_info()``;
   the scheduler's log line as fallback) at the same ``--mem`` (``mem_fraction_static``);
2. greedy agreement with bf16: 8 fixed prompts, first 32 tokens, ``ignore_eos``
   (exact-match prompts and mean matching-prefix fraction);
3. offline decode throughput (``sgl.Engine.generate``), CUDA graphs on: ``--batches``
   concurrent requests (default 64 and 256) of 512 random prompt tokens, 256 output tokens
   each, ``ignore_eos``; output tokens / wall second, prefill included, after a warm-up batch
   of other prompts of the same shape (all kernel variants compiled before timing).

Models: local HF folders with real weights (e.g. ``/tmp/tkv-models/smollm2-135m``) and
``qwen3-8b-like``: Qwen3-8B attention geometry (36 layers, Hq 32, Hkv 8, head_dim 128),
random weights (``load_format=dummy``, no tokenizer: prompts are token ids), built from a
config in ``OUT/models``; no download.

Without ``--bundle`` a uniform bundle (rows 4.0 = K4V4 and 8.0 = K8V8) is written per
model, so ``TKV_BITS=8`` is available (``tkv.codec`` refuses bits other than 4.0 without a
bundle); pass a ``tkv-calibrate`` bundle for SmartMix numbers.

Every (model, mode) runs in its own process group (``setsid``): a worker that builds one
``sgl.Engine`` (which starts its own scheduler and detokenizer processes), measures, writes
JSON and exits. The driver gives each a ``--timeout``, kills the whole group on timeout, on
exit, or 30 s after the result JSON appeared (SGLang's children otherwise keep the GPU
memory; a hanging shutdown costs no more), keeps its log, and goes on with the next mode
after a failure. The group being run is in ``OUT/current_server.pgid``.

Usage (GPU host; sglang patched with ``tkv-sglang patch apply``; packages/tkv-sglang/gpu/
session does all of it on the lent H200)::

    python benchmarks/sglang_e2e.py all --model /tmp/tkv-models/smollm2-135m qwen3-8b-like \\
        --out /tmp/e2e-sglang/job/results
    python benchmarks/sglang_e2e.py smoke --model /tmp/tkv-models/smollm2-135m --out DIR
    python benchmarks/sglang_e2e.py serve-check --model /tmp/tkv-models/smollm2-135m --port 30000

Output in ``--out``: ``<model>-<mode>.json`` and ``.log`` per run, ``<model>.json``,
``results.json`` (everything) and ``README.md`` (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# shared with the vLLM benchmark: same prompts, models, bundle and agreement metric
from vllm_e2e import (
    GREEDY_TOKENS,
    JIT_LEGEND,
    PREFIX_PROMPT_TOKENS,
    PROMPTS,
    REPEATS_HELP,
    VARIANTS,
    agreement,
    fresh_jit_log,
    jit_mark,
    prefix_cache_cell,
    random_prompt_ids,
    ratio_cell,
    resolve_model,
    timed_repeats,
    tkv_env,
    write_uniform_bundle,
)

KV_TOKENS_RE = re.compile(r"max_total_num_tokens=(\d+)")
PROMPT_LEN, OUTPUT_LEN = 512, 256
# engine-argument variants (`all --variants nopcg`), beside the environment ones in
# vllm_e2e.VARIANTS: the tkv engine with one sgl.Engine argument changed. nopcg: no piecewise
# prefill CUDA graphs, as the FA3 baseline runs (engine_kwargs) — session 27's SmolLM2 run
# had tkv's prefill at 1.2-2.8x FA3's time with the graphs on one side only
ENGINE_VARIANTS = {"nopcg": {"disable_piecewise_cuda_graph": True}}


# ----------------------------------------------------------------------------- worker
def engine_kwargs(a: argparse.Namespace) -> dict:
    """``sgl.Engine`` arguments of one run (``a``: the worker's arguments)."""
    kw = dict(model_path=a.model, mem_fraction_static=a.mem, random_seed=0,
              context_length=a.context_length, max_running_requests=max(a.batches),
              cuda_graph_max_bs=max(a.batches), disable_cuda_graph=a.eager,
              sampling_backend="pytorch", grammar_backend="none", log_level="info")
    if a.mode == "tkv":
        kw.update(kv_cache_dtype="tkv", attention_backend="turbo-attn", page_size=16)
    else:
        kw.update(kv_cache_dtype="auto", attention_backend=a.baseline_backend)
        if a.baseline_backend == "fa3":
            # SGLang 0.5.11's experimental piecewise prefill CUDA graphs fail at capture
            # with FA3 on the H200 (CUBLAS_STATUS_EXECUTION_FAILED at num_tokens=8192,
            # session 16); the error message's own workaround. Decode graphs stay on.
            kw.update(disable_piecewise_cuda_graph=True)
    kw.update(ENGINE_VARIANTS.get(getattr(a, "engine_variant", ""), {}))
    if a.dummy:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    return kw


def worker(a: argparse.Namespace) -> None:
    """One (model, mode) in this process: build the engine, measure, write ``a.result``."""
    import random

    import sglang as sgl

    kw = engine_kwargs(a)
    t0 = time.perf_counter()
    llm = sgl.Engine(**kw)
    res: dict = {"mode": a.mode, "tkv_bits": os.environ.get("TKV_BITS"),
                 "tkv_lookup": os.environ.get("TKV_LOOKUP", "auto"),
                 "tkv_prmti_maxnreg": os.environ.get("TKV_PRMTI_MAXNREG", "0"), "engine_kwargs": kw,
                 "startup_s": round(time.perf_counter() - t0, 1)}
    try:
        info = llm.get_server_info()
        res["kv_tokens"] = int(info["max_total_num_tokens"])
        res["attention_backend"] = info.get("attention_backend")
    except Exception as e:  # the log line is the fallback
        res["server_info_error"] = repr(e)

    greedy = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0.0, "ignore_eos": True}
    if a.dummy:
        rng = random.Random(1)
        ids = random_prompt_ids(rng, len(PROMPTS), 16)
        outs = llm.generate(input_ids=ids, sampling_params=greedy)
    else:
        outs = llm.generate(prompt=PROMPTS, sampling_params=greedy)
        res["greedy_text"] = [o.get("text") for o in outs]
    res["greedy"] = [list(o["output_ids"]) for o in outs]
    res["prefix_cache"] = radix_check(llm, greedy)

    if not a.greedy_only:
        rng = random.Random(0)
        sp = {"max_new_tokens": OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True}
        res["throughput"] = {}
        for n in a.batches:
            # warm-up: a whole batch of other prompts (no radix-cache hits in the timed run),
            # so that every kernel variant is compiled before timing (see vllm_e2e.py)
            llm.generate(input_ids=random_prompt_ids(rng, n, PROMPT_LEN),
                         sampling_params={"max_new_tokens": 16, "ignore_eos": True})

            def full(n=n):
                outs = llm.generate(input_ids=random_prompt_ids(rng, n, PROMPT_LEN),
                                    sampling_params=sp)
                toks = sum(len(o["output_ids"]) for o in outs)
                if toks != n * OUTPUT_LEN:
                    raise RuntimeError(f"{toks} output tokens, expected {n} x {OUTPUT_LEN}")

            def prefill(n=n):   # the same shape with one output token: the prefill's share
                llm.generate(input_ids=random_prompt_ids(rng, n, PROMPT_LEN),
                             sampling_params={**sp, "max_new_tokens": 1})

            res["throughput"][str(n)] = timed_repeats(n, OUTPUT_LEN, full, prefill, a.repeats)
        largest = max(a.batches)

        def make_ids():   # a fresh batch of the largest size, for the profiles
            return random_prompt_ids(rng, largest, PROMPT_LEN)

        if a.profile:
            res["profile"] = profile_decode(llm, make_ids, a.profile,
                                            Path(a.result).with_suffix(".profile.md"))
        if a.profile_prefill:
            res["profile_prefill"] = profile_prefill(llm, make_ids,
                                                     Path(a.result).with_suffix(".prefill.md"))
    Path(a.result).write_text(json.dumps(res, indent=1))
    llm.shutdown()


def profile_decode(llm, make_ids, steps: int, path: Path) -> dict:
    """One decode step's kernels in SGLang as it serves, computed like ``vllm_e2e.py
    --profile`` (:func:`kernel_trace.measure_decode_step`): ``make_ids()`` (a fresh batch of
    prompt ids) generated with ``steps`` and ``2·steps`` greedy tokens, unprofiled (wall ms of
    one decode step) and under SGLang's own profiler (``Engine.start_profile``: the scheduler
    process's torch.profiler, GPU activity only; one decode step's kernels from the difference
    of the two traces). Writes ``path`` (markdown) and returns
    :func:`kernel_trace.step_summary` with the ``decode_kernels`` rows.

    Raises:
        RuntimeError: SGLang wrote no trace."""
    import kernel_trace as kt

    seen: dict = {}
    run, capture = _profiler_hooks(llm, make_ids, seen)
    m = kt.measure_decode_step(run, capture, steps)
    path.write_text(f"# one decode step ({2 * steps}-token run minus {steps}-token run, per "
                    f"step), {seen['prompts']} prompts of {PROMPT_LEN} tokens\n\n"
                    f"{m['summary']}\n\n" + kt.table(m["rows"]) + "\n")
    return {"prompts": seen["prompts"], "tokens": steps,
            "seconds": {k: round(v, 4) for k, v in m["walls"].items()}, "table": path.name,
            **m["summary"], "decode_kernels": m["rows"][:60]}


def _profiler_hooks(llm, make_ids, seen: dict):
    """``(run, capture)`` for :mod:`kernel_trace`: ``run(t)`` generates a fresh batch
    (``make_ids()``) with ``t`` greedy tokens, recording its size in ``seen["prompts"]``;
    ``capture(t, folder)`` does the same under SGLang's own profiler (``Engine.start_profile``:
    the scheduler process's torch.profiler, GPU activity only) and returns the chrome trace.

    Raises (from ``capture``):
        RuntimeError: SGLang wrote no trace."""
    def run(t):
        ids = make_ids()
        seen["prompts"] = len(ids)
        llm.generate(input_ids=ids, sampling_params={"max_new_tokens": t, "temperature": 0.0,
                                                     "ignore_eos": True})

    def capture(t, folder):
        llm.start_profile(output_dir=str(folder), activities=["GPU"], with_stack=False,
                          record_shapes=False)
        run(t)
        llm.stop_profile()
        traces = sorted(folder.glob("*.trace.json*"))
        if not traces:
            raise RuntimeError(f"SGLang's profiler wrote no trace into {folder}")
        return traces[0]

    return run, capture


def profile_prefill(llm, make_ids, path: Path) -> dict:
    """Where a batch's prefill goes, kernel by kernel (session 31: SmolLM2's extend batches
    took 23-32 ms under tkv against FA3's 18-20 ms, cause unknown): ``make_ids()`` generated
    with ONE token, unprofiled (wall) and under SGLang's profiler
    (:func:`kernel_trace.measure_run`): every kernel of the run — all the batch's extend steps
    and one sampling step — with launches and device µs, and ``gpu_busy`` = device / wall time
    (well below 1: the prefill waits on the host). Writes ``path`` (markdown) and returns the
    summary with the ``prefill_kernels`` rows.

    Raises:
        RuntimeError: SGLang wrote no trace."""
    import kernel_trace as kt

    seen: dict = {}
    run, capture = _profiler_hooks(llm, make_ids, seen)
    m = kt.measure_run(run, capture, 1)
    path.write_text(f"# one prefill: {seen['prompts']} prompts of {PROMPT_LEN} tokens generated "
                    f"with 1 token (every kernel of the run)\n\n{m['summary']}\n\n"
                    + kt.table(m["rows"], per="run") + "\n")
    return {"prompts": seen["prompts"], "seconds": round(m["wall_s"], 4), "table": path.name,
            **m["summary"], "prefill_kernels": m["rows"][:60]}


def radix_check(llm, greedy: dict) -> dict:
    """Radix cache (prefix sharing) on the engine's pages: one random prompt of
    ``PREFIX_PROMPT_TOKENS`` tokens generated twice; the second request's prefix comes from
    the radix cache (for tkv: compressed pages read back by the prefill kernels). Records
    both requests' ``meta_info["cached_tokens"]`` and whether the greedy tokens agree (the
    vLLM check's fields, no logprobs); an engine error is recorded, never raised."""
    import random

    ids = random_prompt_ids(random.Random(7), 1, PREFIX_PROMPT_TOKENS)[0]
    try:
        a, b = (llm.generate(input_ids=[ids], sampling_params=greedy)[0] for _ in range(2))
    except Exception as e:  # a failed check must not cost the run
        return {"error": repr(e)[:300]}
    return {"prompt_tokens": len(ids),
            "cached_first": int(a.get("meta_info", {}).get("cached_tokens") or 0),
            "cached_second": int(b.get("meta_info", {}).get("cached_tokens") or 0),
            "equal": list(a["output_ids"]) == list(b["output_ids"]), "drift": None}


# ----------------------------------------------------------------------------- driver
def _kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group led by ``proc``, then SIGKILL whatever is left after
    ``grace`` seconds; ``proc`` is reaped (a zombie leader would keep the group alive)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def run_group(cmd: list[str], env: dict, log: Path, timeout: float, out: Path,
              result: Path | None = None, linger: float = 30.0) -> int | None:
    """Run ``cmd`` in a new session (its own process group), output into ``log``; kill the
    group when it exits, ``linger`` s after ``result`` appeared (a hanging engine shutdown
    costs no more), or after ``timeout`` s. Returns the exit status (None: killed)."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        (out / "current_server.pgid").write_text(str(p.pid))
        t0, done_at = time.time(), None
        rc: int | None = None
        try:
            while True:
                try:
                    rc = p.wait(timeout=2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.time()
                if done_at is None and result is not None and result.is_file():
                    done_at = now
                if now - t0 > timeout or (done_at is not None and now - done_at > linger):
                    break
        finally:
            _kill_group(p)
            p.wait()
            (out / "current_server.pgid").unlink(missing_ok=True)
    return rc


def run_mode(model: Path, dummy: bool, mode: str, bits: str | None, bundle: Path | None,
             out: Path, o: argparse.Namespace, greedy_only: bool = False,
             variant: str = "") -> dict:
    """One (model, mode) in its own process group; the result dict (``failed`` on error).
    ``variant``: a key of ``vllm_e2e.VARIANTS`` — the tkv engine runs with that extra
    environment (e.g. ``flash``: ``TKV_PREFILL_ATTENTION=flash``) — or of
    :data:`ENGINE_VARIANTS` (one ``sgl.Engine`` argument changed, e.g. ``nopcg``); its files
    are tagged with it."""
    tag = f"{model.name}-{mode}{'-' + bits if bits else ''}{'-' + variant if variant else ''}"
    result = out / f"{tag}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "worker", "--model", str(model), "--mode", mode,
           "--result", str(result), "--mem", str(o.mem), "--context-length",
           str(o.context_length), "--baseline-backend", o.baseline_backend,
           "--batches", *map(str, o.batches), "--repeats", str(getattr(o, "repeats", 3))]
    if dummy:
        cmd.append("--dummy")
    if greedy_only:
        cmd.append("--greedy-only")
    if o.eager:
        cmd.append("--eager")
    if getattr(o, "profile", 0) and not greedy_only:
        cmd += ["--profile", str(o.profile)]
    if getattr(o, "profile_prefill", False) and not greedy_only:
        cmd.append("--profile-prefill")
    if variant in ENGINE_VARIANTS:
        cmd += ["--engine-variant", variant]
    extra_env = VARIANTS.get(variant, {})
    env = {**tkv_env(mode, bits, bundle), **extra_env, "PYTHONUNBUFFERED": "1",
           **fresh_jit_log(out, tag)}
    log = out / f"{tag}.log"
    extra = "".join(f"{k}={v} " for k, v in extra_env.items())
    print(f"== {tag}: {extra}TKV_BITS={env.get('TKV_BITS', '-')} {' '.join(cmd[2:])}",
          flush=True)
    t = time.perf_counter()
    rc = run_group(cmd, env, log, o.timeout, out, result=result)
    dt = time.perf_counter() - t
    text = log.read_text(errors="replace")
    if not result.is_file():  # results on disk count even if the engine's shutdown hung
        why = f"timed out after {o.timeout}s" if rc is None else f"rc={rc}"
        print(f"   FAILED ({why}, {dt:.0f}s); log: {log}\n{text[-3000:]}", flush=True)
        return {"mode": mode, "tkv_bits": bits, "failed": why, "log_tail": text[-3000:]}
    res = json.loads(result.read_text())
    res["exit"] = rc
    m = KV_TOKENS_RE.findall(text)
    if m:
        res["kv_tokens_log"] = int(m[-1])
        res.setdefault("kv_tokens", int(m[-1]))
    res["wall_s"] = round(dt, 1)
    print(f"   done in {dt:.0f}s: kv_tokens={res.get('kv_tokens')} "
          f"throughput={ {k: v['output_tok_s'] for k, v in res.get('throughput', {}).items()} }",
          flush=True)
    return res


def table(model: str, res: dict[str, dict]) -> str:
    """Markdown table of one model's runs, ratios against ``res['bf16']``."""
    base = res.get("bf16", {})
    bt = base.get("throughput", {})
    ks = sorted({k for r in res.values() for k in r.get("throughput", {})}, key=int)
    head = ["run", "KV tokens", "×bf16", "greedy = bf16 (32 tok)",
            *(f"tok/s @{k}" for k in ks), "tok/s ×bf16", "decode ×bf16",
            "radix-cache hit (2nd request)", "startup s"]
    rows = [f"### {model}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in res.items():
        if r.get("failed"):
            rows.append(f"| {name} | FAILED: {r['failed']} |" + " |" * (len(head) - 2))
            continue
        kv, kvb = r.get("kv_tokens"), base.get("kv_tokens")
        ratio = f"{kv / kvb:.2f}" if kv and kvb else "-"
        if base.get("greedy") and r.get("greedy"):
            ex, fr = agreement(base["greedy"], r["greedy"])
            agree = f"{ex}/{len(base['greedy'])} exact, {100 * fr:.0f}% prefix"
        else:
            agree = "-"
        tc = [r.get("throughput", {}).get(k) for k in ks]
        tps = [c.get("output_tok_s") if c else None for c in tc]
        vs = [ratio_cell(c, bt.get(k), "output_tok_s") for c, k in zip(tc, ks, strict=True)]
        vd = [ratio_cell(c, bt.get(k), "decode_tok_s") for c, k in zip(tc, ks, strict=True)]
        cells = [name, f"{kv:,}" if kv else "?", ratio, agree,
                 *(f"{t:,.0f}{jit_mark(c)}" if t else "-" for t, c in zip(tps, tc, strict=True)),
                 " / ".join(vs) or "-",
                 " / ".join(vd) or "-", prefix_cache_cell(r), str(r.get("startup_s", "-"))]
        rows.append("| " + " | ".join(cells) + " |")
    texts = [(n, r["greedy_text"][0]) for n, r in res.items() if r.get("greedy_text")]
    if texts:
        rows += ["", f"Greedy text, prompt 1 ({PROMPTS[0]!r}):", ""]
        rows += [f"* {n}: {t!r}" for n, t in texts]
    return "\n".join(rows) + "\n\n" + JIT_LEGEND + "\n"


def run_models(o: argparse.Namespace, bits_full: list[str], bits_greedy: list[str]) -> None:
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# tkv-sglang end-to-end ({time.strftime('%Y-%m-%d %H:%M')} UTC)", "",
          f"SGLang 0.5.11; mem_fraction_static={o.mem}; context_length={o.context_length}; "
          f"baseline: bf16 KV cache, attention backend `{o.baseline_backend}`; tkv: "
          "`--kv-cache-dtype tkv --attention-backend turbo-attn --page-size 16`; "
          f"throughput: batches {o.batches} x {PROMPT_LEN}-token prompts, {OUTPUT_LEN} output "
          f"tokens, CUDA graphs {'OFF' if o.eager else 'on'}, PyTorch sampler.", "",
          "Command: `" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) + "`", ""]
    everything: dict = {}
    for spec in o.model:
        try:
            model, weights = resolve_model(spec, out / "models")
            dummy = weights == "dummy"   # "real" / "random" checkpoints load their files
        except SystemExit as e:
            print(f"== {spec}: skipped ({e})", flush=True)
            md.append(f"### {spec}\n\nskipped: {e}\n")
            continue
        bundle = Path(o.bundle) if o.bundle else write_uniform_bundle(
            model, out / f"{model.name}-uniform-bundle.json")
        res = {"bf16": run_mode(model, dummy, "bf16", None, None, out, o,
                                greedy_only=not bits_full)}
        for b in bits_full:
            res[f"tkv@{b}"] = run_mode(model, dummy, "tkv", b, bundle, out, o)
            for v in getattr(o, "variants", []):   # the same run, one engine setting changed
                res[f"tkv@{b} {v}"] = run_mode(model, dummy, "tkv", b, bundle, out, o,
                                              variant=v)
        for b in bits_greedy:
            if b not in bits_full:
                res[f"tkv@{b}"] = run_mode(model, dummy, "tkv", b, bundle, out, o,
                                           greedy_only=True)
        everything[model.name] = res
        (out / f"{model.name}.json").write_text(json.dumps(res, indent=1))
        t = table(model.name + (" (random weights)" if dummy else ""), res)
        print(t, flush=True)
        md.append(t)
        (out / "results.json").write_text(json.dumps(everything, indent=1))
        (out / "README.md").write_text("\n".join(md))
    if getattr(o, "serve", False):
        real = next((m for m in o.model if m != "qwen3-8b-like"), None)
        if real is None:
            md.append("### serve-check\n\nskipped: needs a model with a tokenizer\n")
        else:
            ok, detail = serve_check_run(real, o, out)
            everything["serve_check"] = {"ok": ok, **detail}
            md.append("### OpenAI server (`python -m sglang.launch_server`, tkv@"
                      f"{o.serve_bits}, port {o.port}): {'OK' if ok else 'FAILED'}\n\n"
                      f"```\n{json.dumps(detail, indent=1)[:3000]}\n```\n")
    (out / "results.json").write_text(json.dumps(everything, indent=1))
    (out / "README.md").write_text("\n".join(md))
    print(f"results in {out}", flush=True)


def run_all(o: argparse.Namespace) -> None:
    run_models(o, bits_full=[b for b in o.bits if b in o.throughput_bits],
               bits_greedy=o.bits)


def smoke(o: argparse.Namespace) -> None:
    """Quick: one real model, eager, greedy only, bf16 vs tkv@8 (and tkv@4)."""
    o.eager, o.batches = True, [8]
    run_models(o, bits_full=[], bits_greedy=o.bits)
    res = json.loads((Path(o.out) / "results.json").read_text())
    bad = [f"{m}:{k}" for m, rs in res.items() for k, r in rs.items() if r.get("failed")]
    if bad:
        raise SystemExit(f"smoke FAILED: {bad}")


# ----------------------------------------------------------------------------- server
def serve_check_run(model: str, o: argparse.Namespace, out: Path) -> tuple[bool, dict]:
    """``python -m sglang.launch_server`` with the tkv flags on ``o.port``; POST one
    ``/v1/completions``; kill the server's process group. Returns (ok, details)."""
    import urllib.request

    m = Path(model)
    bundle = Path(o.bundle) if o.bundle else write_uniform_bundle(
        m, out / f"{m.name}-uniform-bundle.json")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(m),
           "--kv-cache-dtype", "tkv", "--attention-backend", "turbo-attn", "--page-size", "16",
           "--host", "127.0.0.1", "--port", str(o.port), "--mem-fraction-static", str(o.mem),
           "--context-length", str(o.context_length), "--sampling-backend", "pytorch",
           "--grammar-backend", "none", "--random-seed", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TKV_BITS": o.serve_bits,
           "TKV_CALIBRATION_FILE": str(bundle)}
    log = out / f"serve-{m.name}-tkv-{o.serve_bits}.log"
    print("$ TKV_BITS=" + o.serve_bits + " " + " ".join(cmd[1:]), flush=True)
    detail: dict = {"cmd": " ".join(cmd[1:]), "log": str(log)}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        srv = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    (out / "current_server.pgid").write_text(str(srv.pid))
    base = f"http://127.0.0.1:{o.port}"
    try:
        deadline = time.time() + o.timeout
        while True:
            if srv.poll() is not None:
                raise RuntimeError(f"server exited with {srv.returncode}")
            if time.time() > deadline:
                raise TimeoutError(f"server not healthy after {o.timeout}s")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        detail["ready_s"] = round(time.perf_counter() - t0, 1)
        body = json.dumps({"model": str(m), "prompt": PROMPTS[0], "max_tokens": 16,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            ans = json.loads(r.read())
        detail["response"] = ans
        text = ans["choices"][0]["text"]
        detail["text"] = text
        ok = bool(text)
    except Exception as e:  # reported; the run goes on
        detail["error"] = repr(e)
        detail["log_tail"] = log.read_text(errors="replace")[-3000:]
        ok = False
    finally:
        _kill_group(srv)
        srv.wait()
        (out / "current_server.pgid").unlink(missing_ok=True)
    print(f"serve-check: {'OK' if ok else 'FAILED'} {json.dumps(detail)[:2000]}", flush=True)
    return ok, detail


def serve_check(o: argparse.Namespace) -> None:
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    ok, detail = serve_check_run(o.model[0], o, out)
    (out / "serve_check.json").write_text(json.dumps({"ok": ok, **detail}, indent=1))
    if not ok:
        raise SystemExit(1)


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("all", "smoke", "serve-check"):
        a = sub.add_parser(name)
        a.add_argument("--model", nargs="+", default=["qwen3-8b-like"],
                       help="model directories and/or 'qwen3-8b-like'")
        a.add_argument("--out", default="benchmarks/results/sglang_e2e"
                       + ("" if name == "all" else "_" + name.replace("-", "_")))
        a.add_argument("--mem", type=float, default=0.5, help="mem_fraction_static")
        a.add_argument("--context-length", type=int, default=4096)
        a.add_argument("--timeout", type=int, default=600, help="seconds per run")
        a.add_argument("--bundle", default=None, help="calibration bundle (default: uniform)")
        a.add_argument("--port", type=int, default=30000)
        a.add_argument("--serve-bits", default="8.0", help="TKV_BITS of the server check")
        a.add_argument("--baseline-backend", default="triton",
                       help="attention backend of the bf16 run (fa3 needs stage --with-fa3)")
        if name != "serve-check":
            a.add_argument("--bits", nargs="+", default=["8.0", "4.0"],
                           help="TKV_BITS values to run (greedy + KV tokens)")
        if name == "all":
            a.add_argument("--throughput-bits", nargs="+", default=["4.0"],
                           help="of --bits, those that also get the throughput runs "
                                "(default 4.0: the KV-capacity configuration)")
            a.add_argument("--batches", type=int, nargs="+", default=[64, 256])
            a.add_argument("--variants", nargs="+", default=[],
                           choices=sorted({*VARIANTS, *ENGINE_VARIANTS}),
                           help="after each throughput tkv run, the same run with one engine "
                           "setting changed (vllm_e2e.VARIANTS; e.g. flash = "
                           "TKV_PREFILL_ATTENTION=flash: sgl-kernel's FlashAttention 3 for "
                           "first chunks and, through the varlen path, continuation chunks "
                           "and radix hits, what the default auto takes where FA3 runs; "
                           "triton = tkv: tkv's Triton / SDPA prefill) or one sgl.Engine "
                           "argument (ENGINE_VARIANTS: nopcg = disable_piecewise_cuda_graph, "
                           "as the fa3 baseline runs)")
            a.add_argument("--eager", action="store_true", help="disable CUDA graphs")
            a.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP)
            a.add_argument("--serve", action="store_true",
                           help="finish with serve-check on the first real model")
            a.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                           help="after the throughput runs, the largest batch × TOKENS and "
                           "× 2·TOKENS tokens, unprofiled and under SGLang's profiler: one "
                           "decode step's kernels (2T − T, kernel_trace.py; wall vs device "
                           "ms), next to each throughput run's JSON (0: off)")
            a.add_argument("--profile-prefill", action="store_true",
                           help="after the throughput runs, the largest batch generated with "
                           "one token, unprofiled and under SGLang's profiler: every kernel "
                           "of its prefill, device vs wall time (<tag>.prefill.md)")
    w = sub.add_parser("worker")
    w.add_argument("--model", required=True)
    w.add_argument("--mode", choices=("bf16", "tkv"), required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--mem", type=float, default=0.5)
    w.add_argument("--context-length", type=int, default=4096)
    w.add_argument("--baseline-backend", default="triton")
    w.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    w.add_argument("--dummy", action="store_true")
    w.add_argument("--greedy-only", action="store_true")
    w.add_argument("--eager", action="store_true")
    w.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP)
    w.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                   help="profile_decode over the largest batch, TOKENS and 2·TOKENS tokens "
                   "(0: off)")
    w.add_argument("--profile-prefill", action="store_true",
                   help="profile_prefill over the largest batch (one output token)")
    w.add_argument("--engine-variant", default="", choices=("", *sorted(ENGINE_VARIANTS)),
                   help="an ENGINE_VARIANTS key: its sgl.Engine arguments on top")
    o = p.parse_args(argv)
    {"all": run_all, "smoke": smoke, "serve-check": serve_check, "worker": worker}[o.cmd](o)


if __name__ == "__main__":
    main()
