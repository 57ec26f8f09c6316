"""Device-side smoke / comparison run of SGLang 0.5.11: bf16 KV cache vs ``--kv-cache-dtype tkv
--attention-backend turbo-attn`` on one GPU, side by side in one run.

NOT yet run on the H200 (written on a CPU machine; the first device session runs it and
moves the measured table to benchmarks/). Each configuration runs in its own subprocess (one
``sglang.Engine`` per process, so GPU memory is freed in between) and prints one JSON line;
the parent prints the table with ratios vs bf16 (the baseline).

    python benchmarks/sglang_e2e.py --model /tmp/tkv-models/smollm2-135m --mem 0.5 \
        --configs bf16 tkv:8.0 tkv:4.0 --concurrency 64 256

Per configuration: KV-cache tokens SGLang allocated (``max_total_num_tokens``), greedy
output ids of 8 fixed prompts (first 32 tokens; agreement vs bf16 is reported), and decode
throughput (output tokens/s) at each concurrency, 512-token prompts, 256 output tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Translate to German: The weather is nice today.",
    "A list of prime numbers: 2, 3, 5,",
    "Photosynthesis is the process by which",
    "In 1969, the Apollo 11 mission",
]


def run_one(args, config: str) -> dict:
    import random

    import sglang as sgl

    kw = dict(model_path=args.model, mem_fraction_static=args.mem, random_seed=0,
              log_level="warning", sampling_backend="pytorch")
    if config.startswith("tkv"):
        bits = config.split(":")[1] if ":" in config else "4.0"
        os.environ["TKV_BITS"] = bits
        kw.update(kv_cache_dtype="tkv", attention_backend="turbo-attn", page_size=16)
    else:
        kw.update(kv_cache_dtype="auto", page_size=16)
    t0 = time.time()
    llm = sgl.Engine(**kw)
    info = llm.get_server_info()
    res = {"config": config, "startup_s": round(time.time() - t0, 1),
           "kv_tokens": int(info["max_total_num_tokens"])}
    outs = llm.generate(PROMPTS, {"max_new_tokens": 32, "temperature": 0})
    res["greedy_ids"] = [o["output_ids"] if "output_ids" in o else o["text"] for o in outs]
    res["greedy_text"] = [o["text"] for o in outs]
    rng = random.Random(0)
    res["decode_tok_s"] = {}
    for c in args.concurrency:
        prompts = [[rng.randrange(100, 20000) for _ in range(512)] for _ in range(c)]
        llm.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 8})  # warm
        t = time.time()
        outs = llm.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 256, "temperature": 0, "ignore_eos": True})
        dt = time.time() - t
        res["decode_tok_s"][str(c)] = round(sum(len(o["output_ids"]) for o in outs) / dt, 1)
    llm.shutdown()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--mem", type=float, default=0.5, help="mem_fraction_static")
    p.add_argument("--configs", nargs="+", default=["bf16", "tkv:8.0", "tkv:4.0"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[64, 256])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args, args.one)), flush=True)
        return 0
    results = []
    for cfg in args.configs:
        cmd = [sys.executable, __file__, "--model", args.model, "--mem", str(args.mem),
               "--concurrency", *map(str, args.concurrency), "--one", cfg]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"[{cfg}] FAILED rc={proc.returncode}\n{proc.stderr[-4000:]}", flush=True)
            results.append({"config": cfg, "error": proc.stderr[-2000:]})
            continue
        results.append(json.loads(line[7:]))
    base = next((r for r in results if r.get("config") == "bf16" and "error" not in r), None)
    print(f"{'config':10s} {'kv_tokens':>12s} {'x bf16':>7s} {'greedy=bf16':>11s} "
          + " ".join(f"{'tok/s@' + str(c):>12s} {'x':>5s}" for c in args.concurrency))
    for r in results:
        if "error" in r:
            print(f"{r['config']:10s} FAILED")
            continue
        kv_x = r["kv_tokens"] / base["kv_tokens"] if base else float("nan")
        agree = (sum(a == b for a, b in zip(r["greedy_ids"], base["greedy_ids"], strict=True))
                 if base else -1)
        cols = []
        for c in args.concurrency:
            v = r["decode_tok_s"][str(c)]
            bx = v / base["decode_tok_s"][str(c)] if base else float("nan")
            cols.append(f"{v:12.1f} {bx:5.2f}")
        print(f"{r['config']:10s} {r['kv_tokens']:12d} {kv_x:7.2f} {agree:>8d}/{len(PROMPTS)} "
              + " ".join(cols))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
