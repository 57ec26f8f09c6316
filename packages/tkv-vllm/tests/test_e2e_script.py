"""The GPU end-to-end script's host-side parts (bundle, agreement, table) on CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tkv.codec.config import load_config

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_e2e.py"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("vllm_e2e", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_uniform_bundle_serves_bits_4_and_8(e2e, tmp_path):
    model = e2e.make_qwen3_like(tmp_path)
    bundle = e2e.write_uniform_bundle(model, tmp_path / "b.json")
    for bits, w in (("8.0", 8), ("4", 4)):
        cfg = load_config(36, 8, 128, env={"TKV_BITS": bits, "TKV_CALIBRATION_FILE": str(bundle)})
        assert set(cfg.allocation.k_bits) == set(cfg.allocation.v_bits) == {w}
    assert json.loads((model / "config.json").read_text())["num_key_value_heads"] == 8


def test_agreement_and_table(e2e):
    a = [[1, 2, 3] * 11, [5] * 32]
    b = [[1, 2, 3] * 11, [5] * 16 + [6] * 16]
    exact, frac = e2e.agreement(a, b)
    assert exact == 1 and frac == pytest.approx((1 + 0.5) / 2)
    tp = {"64": {"output_tok_s": 1000.0}, "256": {"output_tok_s": 2000.0}}
    res = {"bf16": {"kv_tokens_reported": 1000, "greedy": a, "throughput": tp},
           "tq4": {"kv_tokens_blocks": 2620, "greedy": b,
                   "throughput": {k: {"output_tok_s": v["output_tok_s"] / 2} for k, v in tp.items()}},
           "tkv@4.0": {"kv_tokens_reported": 3800, "greedy": b,
                       "throughput": {k: {"output_tok_s": v["output_tok_s"] * 1.1}
                                      for k, v in tp.items()}},
           "tkv@8.0": {"failed": True}}
    t = e2e.table("m", res)
    # results without decode_tok_s (written before it existed): decode ratios are "-"
    assert ("| tkv@4.0 | 3,800 | 3.80 | 1/2 exact, 75% prefix | 1,100 | 2,200 | 1.10 / 1.10 | "
            "- / - | 2.20 / 2.20 |") in t
    assert "| - / - | 2.20 / 2.20 | p1@16 |" in t  # first divergence, no logprobs
    assert "| tkv@8.0 | FAILED" in t
    # with the prefill-only timing: bf16 64 seqs 10 s in all, 2 s of it prefill; tkv 11 s / 3 s
    res["bf16"]["throughput"]["64"] = e2e.throughput_entry(64, 256, 10.0, 2.0)
    res["tkv@4.0"]["throughput"]["64"] = e2e.throughput_entry(64, 256, 11.0, 3.0)
    t = e2e.table("m", res)
    assert "| 1,490 | 2,200 | 0.91 / 1.10 | 1.00 / - | 2.98 / 2.20 |" in t


def test_throughput_entry_separates_prefill_from_decode(e2e):
    c = e2e.throughput_entry(256, 256, full_s=7.0, prefill_s=3.0)
    assert c["output_tok_s"] == pytest.approx(256 * 256 / 7.0, abs=0.1)
    assert c["decode_tok_s"] == pytest.approx(256 * 255 / 4.0, abs=0.1)
    assert e2e.throughput_entry(1, 256, 1.0, 1.5)["decode_tok_s"] is None
    assert e2e.ratio_cell(c, {"decode_tok_s": c["decode_tok_s"] / 2}, "decode_tok_s") == "2.00"
    assert e2e.ratio_cell(c, None, "decode_tok_s") == "-"
    assert e2e.ratio_cell({"decode_tok_s": None}, c, "decode_tok_s") == "-"


def test_timed_repeats_reports_the_median_run_and_counts_jit_compiles(e2e, tmp_path,
                                                                      monkeypatch):
    """The first timed run compiles two kernel variants (two new cache folders) and is slow;
    the reported cell is the median run, whose prefill and decode figures belong together,
    and every run is kept with its compile count."""
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    clock = iter([0.0, 9.0, 9.0, 10.0,      # run 1: full 9 s (compiles), prefill 1 s
                  20.0, 24.0, 24.0, 25.5,   # run 2: full 4 s, prefill 1.5 s
                  30.0, 35.0, 35.0, 36.0,   # run 3: full 5 s, prefill 1 s
                  40.0, 41.0, 41.0, 42.0])  # the single run below
    monkeypatch.setattr(e2e.time, "perf_counter", lambda: next(clock))
    fulls = []

    def full():
        fulls.append(1)
        if len(fulls) == 1:
            (cache / "variant-a").mkdir()
            (cache / "variant-b").mkdir()

    c = e2e.timed_repeats(64, 256, full, lambda: None, 3)
    assert [r["jit_compiles"] for r in c["runs"]] == [2, 0, 0]
    assert [r["seconds"] for r in c["runs"]] == [9.0, 4.0, 5.0]
    assert c["seconds"] == 5.0 and c["prefill_s"] == 1.0          # the median run, whole
    assert c["output_tok_s"] == pytest.approx(64 * 256 / 5.0, abs=0.1)
    assert c["statistic"] == "median of 3 by output_tok_s"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "absent"))
    one = e2e.timed_repeats(1, 256, lambda: None, lambda: None, 1)
    assert one["statistic"] == "one run" and one["runs"][0]["jit_compiles"] is None


def test_timed_repeats_counts_jit_log_events_and_the_table_marks_them(e2e, tmp_path,
                                                                       monkeypatch):
    """With $TKV_JIT_LOG (written by the engine's processes through tkv.kernels.jit_log),
    each timed run records the Triton events that started inside it — disk-cache loads too,
    which the cache-folder count misses — and the table marks the cell."""
    import os
    import time

    log = tmp_path / "run.jit.tsv"
    monkeypatch.setenv(e2e.JIT_LOG_ENV, str(log))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "absent"))
    log.write_text(f"{time.time() - 100:.6f}\t2.0\t1\tm:before_the_window\n")
    fulls = []

    def full():
        fulls.append(1)
        if len(fulls) == 2:   # the second run meets two loads (another process compiled them)
            with open(log, "a") as f:
                for name, src in (("_prefill_kernel", "compile"),
                                  ("_dequant_prefix_kernel", "disk")):
                    f.write(f"{time.time():.6f}\t0.75\t{os.getpid() + 1}\tm:{name}\t{src}\n")

    c = e2e.timed_repeats(256, 256, full, lambda: None, 3)
    assert [r["jit_events"] for r in c["runs"]] == [0, 2, 0]
    assert [r["jit_seconds"] for r in c["runs"]] == [0.0, 1.5, 0.0]
    assert [r["jit_disk_loads"] for r in c["runs"]] == [0, 1, 0]
    assert e2e.jit_mark(c) == " †1/3" and e2e.jit_mark({"runs": [{"jit_events": 0}]}) == ""
    # disk loads alone get their own mark; a compile in the same run wins
    disk_only = {"runs": [{"jit_events": 2, "jit_disk_loads": 2, "jit_compiles": 0},
                          {"jit_events": 0}, {"jit_events": 1, "jit_disk_loads": 0}]}
    assert e2e.jit_mark(disk_only) == " †1/3 ‡1/3"
    base = {"kv_tokens_reported": 10, "throughput": {"256": {"output_tok_s": 900.0}}}
    run = {"kv_tokens_reported": 38, "throughput": {"256": {**c, "output_tok_s": 1000.0}}}
    t = e2e.table("m", {"bf16": base, "tkv@4.0": run})
    assert "| 1,000 †1/3 |" in t and "`†n/m`" in t


def test_tp_refusal_follows_vllm_rules(e2e, tmp_path):
    """SmolLM2-135M (9 query heads, 3 KV heads) cannot run TP=2 in vLLM 0.20.1; the
    Qwen3-8B-like geometry (32/8) can, and so can replication (1 KV head, TP=2)."""
    def model(hq, hkv, name):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"num_attention_heads": hq,
                                                   "num_key_value_heads": hkv}))
        return d

    assert "(9) must be divisible by tensor parallel size (2)" in e2e.tp_unsupported(
        model(9, 3, "smollm2"), 2)
    assert e2e.tp_unsupported(e2e.make_qwen3_like(tmp_path), 2) is None
    assert e2e.tp_unsupported(model(8, 1, "mqa"), 2) is None
    assert "neither split nor replicated" in e2e.tp_unsupported(model(12, 3, "odd"), 2)


def test_tp_table_and_kv_memory_parse(e2e):
    log = ("(Worker_TP0 pid=11) INFO 11-29 [gpu_worker.py:441] Available KV cache memory: 52.5 GiB\n"
           "(Worker_TP1 pid=12) INFO 11-29 [gpu_worker.py:441] Available KV cache memory: 52.25 GiB\n")
    assert dict((w, float(g)) for w, g in e2e.KV_GIB_RE.findall(log)) == {
        "Worker_TP0": 52.5, "Worker_TP1": 52.25}
    g8 = [[1] * 32, [2] * 32]
    g4 = [[1] * 32, [2] * 16 + [3] * 16]
    tp = {"64": {"output_tok_s": 100.0}, "256": {"output_tok_s": 200.0}}
    res = {"bf16 tp2": {"kv_tokens_reported": 1000, "greedy": g8, "throughput": tp,
                        "kv_gib_by_process": {"Worker_TP0": 50.0, "Worker_TP1": 50.0}},
           "tkv@4.0 tp2": {"kv_tokens_reported": 3900, "greedy": g4, "throughput": {
               k: {"output_tok_s": v["output_tok_s"] * 1.2} for k, v in tp.items()}}}
    greedy = {"tkv@8.0 tp2 g": {"greedy": g8}, "tkv@8.0 tp1 g": {"greedy": g8},
              "tkv@4.0 tp2 g": {"greedy": g4}, "tkv@4.0 tp1 g": {"greedy": g8}}
    t = e2e.tp_table("m", 2, "4.0", res, greedy)
    assert "| bf16 tp2 | 1,000 | 1.00 | 50 / 50 | 100 | 200 | 1.00 / 1.00 | - / - |" in t
    assert "| tkv@4.0 tp2 | 3,900 | 3.90 | ? | 120 | 240 | 1.20 / 1.20 | - / - |" in t
    assert "| tkv@8.0 (goal: 8/8 equal) | 2/2 exact, 100% prefix |" in t
    assert "| tkv@4.0 (reported) | 1/2 exact, 75% prefix | - | p1@16 |" in t
    assert "| tkv@8.0 (goal: 8/8 equal) | 2/2 exact, 100% prefix | - | none |" in t
    assert "| tkv@4.0 vs bf16, both TP=2 (CUDA graphs) | 1/2 exact, 75% prefix | - | p1@16" in t
    assert "Same-context drift" in t
    assert "vs bf16, both TP=1 |" not in t  # no bf16 greedy runs given
    greedy |= {"bf16 tp2 g": {"greedy": g8}, "bf16 tp1 g": {"greedy": g8}}
    t = e2e.tp_table("m", 2, "4.0", res, greedy)
    assert "| tkv@8.0 vs bf16, both TP=1 | 2/2 exact, 100% prefix | - | none (from bf16) |" in t
    assert "| tkv@4.0 vs bf16, both TP=1 | 2/2 exact, 100% prefix |" in t
    assert "| tkv@4.0 vs bf16, both TP=2 | 1/2 exact, 75% prefix | - | p1@16 (from bf16) |" in t


def _stub_engines(e2e, tmp_path, monkeypatch, record) -> None:
    """Replace the engine runs of `all` / `tp` by ``record(model, mode, bits, opts,
    greedy_only, kw)`` (kw: run_mode's optional keywords), with generated models and no
    bundle writing."""
    def fake_run_mode(model, weights, mode, bits, bundle, out, o, greedy_only=False, **kw):
        record(model, mode, bits, o, greedy_only, kw)
        return {"greedy": [[1] * 32], "kv_tokens_reported": 10, "throughput": {}}

    monkeypatch.setattr(e2e, "run_mode", fake_run_mode)
    monkeypatch.setattr(e2e, "resolve_model",
                        lambda spec, work, weights, seed=0: (e2e.make_qwen3_like(
                            tmp_path / spec), "dummy"))
    monkeypatch.setattr(e2e, "write_uniform_bundle", lambda model, path: path)


def test_tp_greedy_models_selects_the_greedy_runs(e2e, tmp_path, monkeypatch):
    """`tp --greedy-models smollm2-x2`: the other models get only their bf16/tkv TP=N
    capacity+throughput runs (2 engines), the named one all 8."""
    calls = []
    _stub_engines(e2e, tmp_path, monkeypatch, lambda m, mode, bits, o, g, kw: calls.append(
        (m.parent.name, mode, bits, o.tp, g)))
    rc = e2e.main(["tp", "--model", "a", "b", "--greedy-models", "b",
                   "--out", str(tmp_path / "out")])
    assert rc == 0
    per = {m: [c for c in calls if c[0] == m] for m in ("a", "b")}
    assert [c[4] for c in per["a"]] == [False, False]
    assert len(per["b"]) == 8 and sum(c[4] for c in per["b"]) == 6


def test_same_context_drift_stops_after_the_first_divergence(e2e):
    """|Δ top-1 logprob| over the positions where both runs hold the same context: up to and
    including each prompt's first diverging token, never after it."""
    ref = {"greedy": [[5, 6, 7], [1, 2, 3]],
           "greedy_top2": [[[5, -1.0, 9, -2.0], [6, -1.5, 9, -2.0], [7, -0.5, 9, -2.0]],
                           [[1, -3.0, 9, -4.0], [2, -3.0, 9, -4.0], [3, -3.0, 9, -4.0]]]}
    other = {"greedy": [[5, 8, 7], [1, 2, 3]],
             "greedy_top2": [[[5, -1.25, 9, -2.0], [8, -1.0, 6, -1.6], [7, -9.0, 9, -9.5]],
                             [[1, -3.0, 9, -4.0], [2, -3.5, 9, -4.0], [3, -3.0, 9, -4.0]]]}
    d = e2e.same_context_drift(ref, other, n=3)
    # prompt 0: positions 0 (0.25) and 1 (0.5, the divergence); not 2. prompt 1: 0, 0.5, 0.
    assert d["positions"] == 5
    assert d["max"] == 0.5
    assert abs(d["mean"] - (0.25 + 0.5 + 0 + 0.5 + 0) / 5) < 1e-12
    assert e2e.drift_cell(ref, other) == "0.250 / 0.500 (5)"
    assert e2e.same_context_drift({"greedy": ref["greedy"]}, other) is None
    assert e2e.drift_cell({"greedy": ref["greedy"]}, other) == "-"


def test_run_mode_passes_the_block_size_to_the_worker(e2e, tmp_path, monkeypatch):
    """run_mode(block_size=64): the worker command carries `--block-size 64` (default 0 =
    vLLM's own), the worker parser takes it, and the run's files are named by the variant."""
    import argparse

    cmds = []
    monkeypatch.setattr(e2e, "run_worker", lambda cmd, env, log, timeout: cmds.append(cmd) or 1)
    opts = argparse.Namespace(gmu=0.5, max_model_len=4096, batches=[64, 256], timeout=5)
    for kw in ({}, {"variant": "block64", "block_size": 64}):
        res = e2e.run_mode(tmp_path / "m", "dummy", "tkv", "4.0", None, tmp_path, opts, **kw)
        assert res["failed"]
    assert [c[c.index("--block-size") + 1] for c in cmds] == ["0", "64"]
    assert "m-tkv-4.0-block64.json" in cmds[1][cmds[1].index("--result") + 1]
    with monkeypatch.context() as m:   # the worker's own parser accepts the flag
        got = []
        m.setattr(e2e, "worker", lambda args: got.append(args.block_size))
        assert e2e.main(cmds[1][2:]) == 0
    assert got == [64]


def test_run_worker_kills_the_engine_process_group(e2e, tmp_path):
    """An engine's children (vLLM's EngineCore) die with the run, also on timeout."""
    import os
    import sys
    import time

    pidfile = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
              "time.sleep(float(sys.argv[1]))")
    for sleep, timeout, rc in (("0", 30, 0), ("60", 3, 124)):
        log = tmp_path / f"w{sleep}.log"
        assert e2e.run_worker([sys.executable, "-c", script, sleep], dict(os.environ), log,
                              timeout) == rc
        assert "started" in log.read_text()
        assert not (tmp_path / "current_worker.pgid").exists()
        gc = int(pidfile.read_text())
        for _ in range(50):  # gone, or a zombie nobody reaped yet (no init in containers)
            try:
                stat = Path(f"/proc/{gc}/stat").read_text()
            except FileNotFoundError:
                break
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"grandchild {gc} survived the run")


def _fake_session(tmp_path, fail_on: str):
    """A gpu_session.sh environment on CPU: empty env.sh, and a fake python that passes the
    heredoc checks (``python -``) and fails (rc 3) when its arguments contain ``fail_on``."""
    import os
    import stat

    env_sh = tmp_path / "env.sh"
    env_sh.write_text("# test env\n")
    py = tmp_path / "fakepy"
    py.write_text("#!/usr/bin/env bash\n"
                  f'case "$*" in *"{fail_on}"*) echo "fake failure: $*" >&2; exit 3 ;; esac\n'
                  '[[ "${1:-}" == - ]] && cat > /dev/null\n'
                  'echo "fake ok: $*"\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "TKV_ENV_SH": str(env_sh), "TKV_E2E_DIR": str(tmp_path / "e2e"),
            "TKV_EP_DIR": str(tmp_path / "ep"), "PYTHON": str(py)}


@pytest.mark.parametrize("fail_on", ["patch apply", "patch status", "NO-SUCH-STEP"])
def test_gpu_session_setup_fails_when_a_step_fails(tmp_path, fail_on):
    """`setup` stops at the first failing step and says so (it used to print SETUP OK:
    errexit is off inside a `{ ...; } || die` group)."""
    import subprocess

    script = _PATH.parent / "gpu_session.sh"
    p = subprocess.run(["bash", str(script), "setup"], env=_fake_session(tmp_path, fail_on),
                       capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    if fail_on == "NO-SUCH-STEP":
        assert p.returncode == 0, out
        assert "SETUP OK" in out and "fake ok: -m tkv.vllm.cli patch status" in out
    else:
        assert p.returncode != 0, out
        assert "SETUP OK" not in out
        assert f"fake failure: -m tkv.vllm.cli {fail_on}" in out
        assert "GPU_SESSION FAILED: setup rc=3" in out
        if fail_on == "patch apply":  # nothing after the failed step ran
            assert "plugin discovery" not in out


@pytest.mark.parametrize("cvd", [None, "1"])
def test_gpu_session_job_cmd_names_visible_gpus_only_when_set(tmp_path, cvd):
    """A job's ``cmd`` file is the command to rerun: with CUDA_VISIBLE_DEVICES unset it must
    not say ``CUDA_VISIBLE_DEVICES=`` (copied, that hides every GPU)."""
    import subprocess

    env = _fake_session(tmp_path, "NO-SUCH-STEP")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    script = _PATH.parent / "gpu_session.sh"
    # (not the `kernels` mode: it runs the real kernel tests with the machine's python3)
    p = subprocess.run(["bash", str(script), "start", "all", "--model", "x"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    cmd = (tmp_path / "e2e" / "jobs" / "e2e" / "cmd").read_text()
    assert cmd.startswith("CUDA_VISIBLE_DEVICES=1 ") if cvd else "CUDA_VISIBLE" not in cmd


TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
}


def test_qwen3_weight_names_match_transformers_and_8b_size(e2e):
    """The checkpoint names/shapes are exactly Qwen3ForCausalLM's state dict (the names
    vLLM 0.20.1's Qwen3 loader consumes); the full Qwen3-8B-like geometry is 8.19e9
    parameters, 16.4 GB in bf16 (Qwen3-8B's own count)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shapes = e2e.qwen3_weight_shapes(TINY_QWEN3)
    with torch.device("meta"):
        ref = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in TINY_QWEN3.items()
                                              if k not in ("architectures", "model_type")}))
    assert {k: tuple(v.shape) for k, v in ref.state_dict().items()} == shapes
    big = e2e.qwen3_weight_shapes(e2e.QWEN3_8B_LIKE)
    n = sum(e2e._numel(s) for s in big.values())
    assert n == 8_190_735_360
    assert len(big) == 36 * 11 + 3
    assert big["model.layers.35.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert big["model.layers.0.self_attn.q_norm.weight"] == (128,)


def test_random_checkpoint_loads_in_transformers_and_is_seeded(e2e, tmp_path):
    """A tiny-config checkpoint (several shards) loads into transformers' Qwen3ForCausalLM
    on CPU with no missing/unexpected/mismatched tensor; weights ~ N(0, 0.02²) in bf16,
    norms 1; the same seed gives the same bytes, another seed other weights; a second call
    is skipped; an interrupted write (no marker) is rebuilt."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    d = tmp_path / "ckpt"
    t = e2e.write_random_checkpoint(d, TINY_QWEN3, seed=3, device="cpu",
                                    shard_gib=40_000 / 2**30)
    assert not t["skipped"] and t["shards"] > 2
    assert t["bytes"] == 2 * sum(e2e._numel(s) for s in e2e.qwen3_weight_shapes(TINY_QWEN3).values())
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(e2e.qwen3_weight_shapes(TINY_QWEN3))
    files = {}
    for f in sorted(set(index["weight_map"].values())):
        files.update(load_file(str(d / f)))
    assert all(v.dtype == torch.bfloat16 for v in files.values())
    model, info = Qwen3ForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16,
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    sd = model.state_dict()
    for name, w in files.items():
        assert torch.equal(sd[name], w), name
        if w.ndim == 1:
            assert torch.all(w == 1), name
    emb = files["model.embed_tokens.weight"].double()
    assert emb.mean().abs() < 0.002 and abs(emb.std().item() - 0.02) < 0.0005
    # deterministic in the seed
    again = e2e.write_random_checkpoint(tmp_path / "again", TINY_QWEN3, seed=3, device="cpu",
                                        shard_gib=40_000 / 2**30)
    assert not again["skipped"]
    for f in set(index["weight_map"].values()):
        assert (d / f).read_bytes() == (tmp_path / "again" / f).read_bytes()
    other = e2e.write_random_checkpoint(tmp_path / "other", TINY_QWEN3, seed=4, device="cpu")
    assert not other["skipped"]
    o = load_file(str(tmp_path / "other" / "model-00001-of-00001.safetensors"))
    assert not torch.equal(o["model.embed_tokens.weight"], files["model.embed_tokens.weight"])
    # present -> skipped; a different seed or config is rebuilt; no marker -> rebuilt
    assert e2e.write_random_checkpoint(d, TINY_QWEN3, seed=3, device="cpu")["skipped"]
    (d / e2e.RANDOM_CKPT_MARKER).unlink()
    assert not e2e.write_random_checkpoint(d, TINY_QWEN3, seed=3, device="cpu")["skipped"]
    assert (d / e2e.RANDOM_CKPT_MARKER).is_file() and not (tmp_path / "ckpt.tmp").exists()


def test_divergences_report_the_reference_top2_gap(e2e):
    """`top2_of` reads vLLM's {token_id: Logprob} (top-2 plus the sampled token); the
    divergence cell names prompt@token, ref's top-1 − top-2 gap, tie, and ¬2nd."""
    from types import SimpleNamespace as L

    pos = {7: L(logprob=-0.5, rank=1), 9: L(logprob=-0.52, rank=2), 4: L(logprob=-3.0, rank=9)}
    assert e2e.top2_of(pos) == [7, -0.5, 9, -0.52]
    assert e2e.top2_of({7: L(logprob=0.0, rank=1)}) == [7, 0.0, None, None]
    ref = {"greedy": [[1, 2, 3], [1, 2, 3], [5, 6, 7]],
           "greedy_top2": [[[1, -0.1, 8, -2.0], [2, -0.2, 9, -0.21], [3, 0, 4, -1]],
                           [[1, -0.1, 8, -2.0], [2, -0.2, 9, -0.5], [3, 0, 4, -1]],
                           [[5, -0.1, 8, -2.0], [6, -0.2, 9, -0.5], [7, 0, 4, -1]]]}
    other = {"greedy": [[1, 9, 3], [1, 4, 3], [5, 6, 7]]}
    ds = e2e.divergences(ref, other, n=3)
    assert [(d["prompt"], d["pos"], d["ref_tok"], d["other_tok"]) for d in ds] == [
        (0, 1, 2, 9), (1, 1, 2, 4)]
    assert ds[0]["gap"] == pytest.approx(0.01) and ds[0]["other_is_top2"]
    assert ds[1]["gap"] == pytest.approx(0.3) and not ds[1]["other_is_top2"]
    old = e2e.divergence_cell(ref, other)
    assert old == "p0@1 Δ0.010 tie, p1@1 Δ0.300 ¬2nd"
    assert e2e.divergence_cell({"greedy": ref["greedy"]}, other) == "p0@1, p1@1"
    assert e2e.divergence_cell(ref, ref) == "none"


def test_parse_smoke_log_and_bf16_spacing(e2e):
    log = ("SMOKE\n\n[0] 'The capital of France is'\n  bf16     : ' Paris.'\n"
           "  tkv@8.0  : \" Paris's\"\n\n[1] 'x'\n  bf16     : 'a\\nb'\n  tkv@8.0  : 'c'\n")
    runs = e2e.parse_smoke_log(log)
    assert runs["bf16"]["greedy_text"][:2] == [" Paris.", "a\nb"]
    assert runs["tkv@8.0"]["greedy_text"][:2] == [" Paris's", "c"]
    assert e2e.bf16_spacing(20.0) == 0.125 and e2e.bf16_spacing(-1.5) == 2 ** -7


def test_tp_loads_one_seeded_checkpoint_at_every_tp_size(e2e, tmp_path, monkeypatch):
    """`tp` (default --weights random) writes the checkpoint once and runs every engine,
    TP=2 and TP=1, on that same directory with load_format=auto (worker --weights random);
    `all` keeps load_format=dummy unless asked."""
    calls, written = [], []
    monkeypatch.setenv("TKV_CKPT_DIR", str(tmp_path / "ckpt"))

    def fake_ensure(d, seed, timeout=900):  # the real one writes weights + config.json
        written.append((d, seed))
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(e2e.QWEN3_8B_LIKE))
        (d / e2e.RANDOM_CKPT_MARKER).write_text(json.dumps(
            {"seed": seed, "std": 0.02, "timing": {"bytes": 16 * 2**30, "shards": 5,
                                                    "total_s": 40.0}}))

    monkeypatch.setattr(e2e, "ensure_random_checkpoint", fake_ensure)

    def fake_run_mode(model, weights, mode, bits, bundle, out, opts, greedy_only=False):
        calls.append((model, weights, mode, bits, opts.tp))
        return {"mode": mode, "greedy": [[1] * 32] * 8, "kv_tokens_reported": 10}

    monkeypatch.setattr(e2e, "run_mode", fake_run_mode)
    monkeypatch.setattr(e2e, "write_uniform_bundle", lambda m, p: p)
    assert e2e.main(["tp", "--model", "qwen3-8b-like", "--out", str(tmp_path / "o"),
                     "--batches", "64"]) == 0
    assert written == [(tmp_path / "ckpt", 0)]
    assert {c[0] for c in calls} == {tmp_path / "ckpt"} and {c[1] for c in calls} == {"random"}
    assert {c[4] for c in calls} == {1, 2}
    readme = (tmp_path / "o" / "README.md").read_text()
    assert "one seeded checkpoint" in readme and "16.0 GiB in 5 safetensors shards" in readme
    calls.clear()
    assert e2e.main(["all", "--model", "qwen3-8b-like", "--out", str(tmp_path / "a"),
                     "--runs", "bf16"]) == 0
    assert [c[1] for c in calls] == ["dummy"] and len(written) == 1


_VLLM_LOAD = r'''
import glob, json, socket, sys
import torch
import vllm.platforms as P
from vllm.platforms.cpu import CpuPlatform
P._current_platform = CpuPlatform()  # this process only: vLLM's model code on CPU
from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from safetensors.torch import load_file

d = sys.argv[1]
mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype="bfloat16")
vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    with torch.device("cpu"):
        m = Qwen3ForCausalLM(vllm_config=vc)
    files = sorted(glob.glob(d + "/*.safetensors"))
    loaded = m.load_weights(safetensors_weights_iterator(files, False))
    params = dict(m.named_parameters())
    w = {}
    for f in files:
        w.update(load_file(f))
    p = "model.layers.1."
    qkv = torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                     w[p + "self_attn.v_proj.weight"]])
    gu = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
    print(json.dumps({"missing": sorted(set(params) - set(loaded)),
                      "qkv": torch.equal(params[p + "self_attn.qkv_proj.weight"], qkv),
                      "gate_up": torch.equal(params[p + "mlp.gate_up_proj.weight"], gu),
                      "lm_head": torch.equal(params["lm_head.weight"], w["lm_head.weight"])}))
'''


def test_vllm_qwen3_loader_consumes_the_random_checkpoint(e2e, tmp_path):
    """vLLM 0.20.1's own Qwen3ForCausalLM.load_weights (CPU, in a subprocess: the platform
    is forced to CPU there) initializes every parameter from the checkpoint, stacking
    q/k/v into qkv_proj and gate/up into gate_up_proj byte for byte."""
    import subprocess
    import sys

    pytest.importorskip("vllm", reason="vllm not installed (nox -s vllm installs it)")
    d = tmp_path / "ckpt"
    e2e.write_random_checkpoint(d, TINY_QWEN3, seed=1, device="cpu", shard_gib=40_000 / 2**30)
    p = subprocess.run([sys.executable, "-c", _VLLM_LOAD, str(d)], capture_output=True,
                       text=True, timeout=600, env={**__import__("os").environ,
                                                    "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"missing": [], "qkv": True, "gate_up": True, "lm_head": True}


def test_widen_heads_keeps_the_function(e2e, tmp_path):
    """smollm2-x2 (issue #7, TP=2 on real weights): a checkpoint with every attention head
    repeated twice computes the same logits as the original (transformers, float32, a tiny
    random Llama with SmolLM2's GQA group of 3 query heads per KV head, 2 KV heads)."""
    import torch
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=6,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # non-trivial attention: larger q/k weights than the init's
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    src = tmp_path / "src"
    model.save_pretrained(src, safe_serialization=True)
    dst = e2e.widen_heads(src, tmp_path / "x2", 2)
    wide_cfg = json.loads((dst / "config.json").read_text())
    assert (wide_cfg["num_attention_heads"], wide_cfg["num_key_value_heads"],
            wide_cfg["head_dim"]) == (12, 4, 16)
    assert e2e.tp_unsupported(dst, 4) is None and e2e.tp_unsupported(src, 4) is not None
    wide = transformers.LlamaForCausalLM.from_pretrained(dst, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        a, b = model(ids).logits, wide(ids).logits
    assert a.abs().max() > 0.1
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert e2e.widen_heads(src, dst, 2) == dst  # written once (marker)


def test_gpu_session_after_chains_jobs_and_stop_job_ends_one(tmp_path):
    """`TKV_AFTER=a ... start` starts only once job a has ended; `stop-job NAME` ends a
    running job's process group and returns once it is gone (fake python, CPU). Job a runs
    6 s: longer than `start`'s own 3 s exit check, so b is queued while a still runs."""
    import os
    import stat
    import subprocess
    import time

    mark = tmp_path / "a-done"
    py = tmp_path / "fakepy"
    py.write_text("#!/usr/bin/env bash\n"
                  f'case "$*" in *slow*) sleep 6; touch "{mark}" ;; '
                  f'*forever*) sleep 60 ;; '
                  f'*after*) [[ -f "{mark}" ]] && echo AFTER-OK || echo AFTER-TOO-EARLY ;; esac\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "env.sh").write_text("# test env\n")
    env = {**os.environ, "TKV_ENV_SH": str(tmp_path / "env.sh"), "TKV_E2E_DIR": str(tmp_path / "e2e"),
           "TKV_EP_DIR": str(tmp_path / "ep"), "PYTHON": str(py)}
    script = str(_PATH.parent / "gpu_session.sh")

    def session(*args, **extra):
        return subprocess.run(["bash", script, *args], env={**env, **extra},
                              capture_output=True, text=True, timeout=60)

    assert session("start", "serve-check", "slow", TKV_JOB="a").returncode == 0
    p = session("start", "serve-check", "after", TKV_JOB="b", TKV_AFTER="a")
    assert p.returncode == 0 and "after job a" in p.stdout, p.stdout + p.stderr
    jobs = tmp_path / "e2e" / "jobs"
    deadline = time.time() + 30
    while time.time() < deadline and not (jobs / "b" / "rc").is_file():
        time.sleep(0.2)
    assert (jobs / "b" / "job.log").read_text().strip() == "AFTER-OK"

    assert session("start", "serve-check", "forever", TKV_JOB="c").returncode == 0
    p = session("stop-job", "c")
    assert p.returncode == 0 and "job c stopped" in p.stdout, p.stdout + p.stderr
    pid = int((jobs / "c" / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_prefix_cache_check_reports_hits_agreement_and_drift(e2e):
    """The second identical request's prefill reads cached blocks: the check records both
    requests' cached tokens, token agreement and the same-context logprob drift; an engine
    error is recorded, not raised."""
    from types import SimpleNamespace as NS

    def out(tokens, lps, cached):
        return NS(num_cached_tokens=cached, outputs=[NS(token_ids=tokens, logprobs=[
            {t: NS(logprob=lp), 99: NS(logprob=lp - 1.0)} for t, lp in zip(tokens, lps, strict=True)])])

    calls = iter([out([5, 6, 7], [-0.5, -0.2, -0.1], 0), out([5, 6, 8], [-0.6, -0.2, -0.3], 320)])
    pc = e2e.prefix_cache_check(lambda ids: next(calls))
    assert pc["prompt_tokens"] == e2e.PREFIX_PROMPT_TOKENS
    assert (pc["cached_first"], pc["cached_second"], pc["equal"]) == (0, 320, False)
    assert pc["drift"]["positions"] == 3 and abs(pc["drift"]["max"] - 0.2) < 1e-9
    assert e2e.prefix_cache_cell({"prefix_cache": pc}) == (
        "320/333 cached, tokens differ, drift 0.100/0.200")

    def broken(ids):
        raise RuntimeError("engine down")

    assert "engine down" in e2e.prefix_cache_check(broken)["error"]
    assert e2e.prefix_cache_cell({"prefix_cache": {"error": "x"}}) == "ERROR"
    assert e2e.prefix_cache_cell({}) == "-"


def test_all_block64_runs_set_the_engine_block_size(e2e, tmp_path, monkeypatch):
    """`all --runs bf16 bf16block64 tkv tkvblock64`: the block64 runs pass block_size=64 to
    the engine (no extra environment) under their own names; the plain runs vLLM's default."""
    calls = []
    _stub_engines(e2e, tmp_path, monkeypatch, lambda m, mode, bits, o, g, kw: calls.append(
        (mode, bits, kw)))
    assert e2e.main(["all", "--model", "a", "--runs", "bf16", "bf16block64", "tkv",
                     "tkvblock64", "--out", str(tmp_path / "out")]) == 0
    assert calls == [("bf16", None, {}), ("bf16", None, {"variant": "block64", "block_size": 64}),
                     ("tkv", "4.0", {}), ("tkv", "4.0", {"variant": "block64", "block_size": 64})]
    (res,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    assert list(res) == ["bf16", "bf16 block64", "tkv@4.0", "tkv@4.0 block64"]


def test_all_tkvflash_run_sets_the_prefill_attention(e2e, tmp_path, monkeypatch):
    """`all --runs tkv tkvflash tkvtriton tkvcont tkvqrot tkvnoqrot tkvnopipe tkvsplit1 tkvsplit2
    tkvtiles4 tkvnreg128 tkvstorematrix`: the variant engines get TKV_PREFILL_ATTENTION=flash /
    =tkv / =continuation, TKV_FUSED_QUERY_ROTATION=1 / =0, TKV_DECODE_PIPELINE=0,
    TKV_DECODE_SINGLE_SPLIT=1 / =0, TKV_DECODE_MIN_SPLIT_TILES=4, TKV_PRMTI_MAXNREG=128 or
    TKV_STORE_ROTATION=matrix in their environment and their own file names and table
    rows; the plain tkv run none (tkv-vllm's defaults)."""
    calls = []
    _stub_engines(e2e, tmp_path, monkeypatch, lambda m, mode, bits, o, g, kw: calls.append(
        (mode, bits, kw)))
    rc = e2e.main(["all", "--model", "a", "--runs", "tkv", "tkvflash", "tkvtriton", "tkvcont",
                   "tkvqrot", "tkvnoqrot", "tkvnopipe", "tkvsplit1", "tkvsplit2", "tkvtiles4",
                   "tkvnreg128", "tkvstorematrix", "--out", str(tmp_path / "out")])
    assert rc == 0
    assert calls == [("tkv", "4.0", {}),
                     ("tkv", "4.0", {"extra_env": {"TKV_PREFILL_ATTENTION": "flash"},
                                     "variant": "flash"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_PREFILL_ATTENTION": "tkv"},
                                     "variant": "triton"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_PREFILL_ATTENTION": "continuation"},
                                     "variant": "cont"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_FUSED_QUERY_ROTATION": "1"},
                                     "variant": "qrot"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_FUSED_QUERY_ROTATION": "0"},
                                     "variant": "noqrot"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_DECODE_PIPELINE": "0"},
                                     "variant": "nopipe"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_DECODE_SINGLE_SPLIT": "1"},
                                     "variant": "split1"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_DECODE_SINGLE_SPLIT": "0"},
                                     "variant": "split2"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_DECODE_MIN_SPLIT_TILES": "4"},
                                     "variant": "tiles4"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_PRMTI_MAXNREG": "128"},
                                     "variant": "nreg128"}),
                     ("tkv", "4.0", {"extra_env": {"TKV_STORE_ROTATION": "matrix"},
                                     "variant": "storematrix"})]
    (res,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    assert list(res) == ["tkv@4.0", "tkv@4.0 flash", "tkv@4.0 triton", "tkv@4.0 cont",
                         "tkv@4.0 qrot", "tkv@4.0 noqrot", "tkv@4.0 nopipe",
                         "tkv@4.0 split1", "tkv@4.0 split2", "tkv@4.0 tiles4",
                         "tkv@4.0 nreg128", "tkv@4.0 storematrix"]


# ----------------------------------------------------------------------------- profiles
def _trace(path, kernels, gz=False):
    """A chrome trace with ``kernels`` = {name: (count, µs each)} as kernel events, plus CPU
    and runtime events that must not count."""
    import gzip

    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 5.0},
          {"ph": "i", "cat": "kernel", "name": "instant", "dur": 7.0}]
    for name, (n, us) in kernels.items():
        cat = "gpu_memcpy" if name == "Memcpy DtoD" else "kernel"
        ev += [{"ph": "X", "cat": cat, "name": name, "dur": us}] * n
    raw = json.dumps({"traceEvents": ev}).encode()
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


@pytest.fixture(scope="module")
def kt():
    spec = importlib.util.spec_from_file_location("kernel_trace", _PATH.parent / "kernel_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _engine_trace(steps, decode_us=10.0, prefill_launches=5):
    """Kernels of a generate with ``steps`` decode steps of 36 layers (fixed prefill part)."""
    return {"_decode_split_kernel": (36 * steps, decode_us), "nvjet_gemm": (72 * steps + 30, 4.0),
            "_prefill_kernel": (prefill_launches, 100.0), "Memcpy DtoD": (steps, 1.0)}


def test_kernel_trace_subtracts_the_prefill_and_divides_by_the_steps(kt, tmp_path):
    short = kt.kernel_totals(_trace(tmp_path / "s.json", _engine_trace(16)))
    long = kt.kernel_totals(_trace(tmp_path / "l.json.gz", _engine_trace(32), gz=True))
    assert short["_decode_split_kernel"] == (576, 5760.0) and "aten::mm" not in short
    rows = kt.decode_step_kernels(short, long, 16)
    assert [r["name"] for r in rows] == ["_decode_split_kernel", "nvjet_gemm", "[memcpy] Memcpy DtoD"]
    assert rows[0] == {"name": "_decode_split_kernel", "per_step": 36.0, "us_per_step": 360.0}
    assert rows[1]["per_step"] == 72.0 and rows[1]["us_per_step"] == 288.0
    s = kt.step_summary(rows, wall_ms_per_step=1.0)
    assert s == {"device_ms_per_step": 0.649, "kernels_per_step": 109.0,
                 "wall_ms_per_step": 1.0, "gpu_busy": 0.649}
    assert kt.step_summary(rows)["gpu_busy"] is None
    text = kt.table(rows, top=2)
    assert "(1 more)" in text and "| **total** | 109 | 649.0 | 100 % |" in text
    # two engines running the same kernels: the gap sits in the decode kernel
    slow = kt.decode_step_kernels(
        kt.kernel_totals(_trace(tmp_path / "s2.json", _engine_trace(16, decode_us=11.0))),
        kt.kernel_totals(_trace(tmp_path / "l2.json", _engine_trace(32, decode_us=11.0))), 16)
    cmp = kt.compare(rows, slow, ("SGLang", "vLLM"))
    first = cmp.splitlines()[2]
    assert first.startswith("| `_decode_split_kernel` | 360.0 | 396.0 | +36.0 | 1.10 |")
    with pytest.raises(ValueError):
        kt.decode_step_kernels(short, long, 0)
    (tmp_path / "bad.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="traceEvents"):
        kt.kernel_totals(tmp_path / "bad.json")


def test_kernel_trace_compare_cli_reads_result_jsons(kt, tmp_path, capsys):
    rows = [{"name": "k", "per_step": 1, "us_per_step": 2.0}]
    (tmp_path / "a.json").write_text(json.dumps({"profile": {"decode_kernels": rows}}))
    (tmp_path / "b.json").write_text(json.dumps({"decode_kernels": rows}))
    kt.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--labels", "x", "y"])
    assert "| `k` | 2.0 | 2.0 | +0.0 | 1.00 | 1 / 1 |" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text(json.dumps({"profile": {}}))
    with pytest.raises(SystemExit, match="no decode_kernels"):
        kt.main(["compare", str(tmp_path / "bad.json"), str(tmp_path / "b.json")])


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_profile_decode_runs_both_lengths_and_writes_the_tables(e2e, tmp_path):
    """vLLM's profile_decode on CPU with a stand-in LLM: steps and 2·steps tokens, unprofiled
    and profiled (CPU activity only here: no kernels, so the decode table is empty), the
    operator tables and the decode-step section written, the summary returned."""
    import torch

    calls = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False):
            calls.append(params)
            x = torch.randn(64, 64)
            for _ in range(params):
                x = x @ x.T / 64
            return []

    out = e2e.profile_decode(FakeLLM(), lambda: [1, 2, 3], lambda t: t, 4,
                             tmp_path / "run.profile.txt")
    assert calls == [4, 8, 4, 8]
    text = (tmp_path / "run.profile.txt").read_text()
    assert "## by device time" in text and "## one decode step (8-token run minus 4-token" in text
    assert out["tokens"] == 4 and out["prompts"] == 3 and out["decode_kernels"] == []
    assert out["device_ms_per_step"] == 0 and out["wall_ms_per_step"] is not None
