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
    assert "| tkv@4.0 | 3,800 | 3.80 | 1/2 exact, 75% prefix | 1,100 | 2,200 | 1.10 / 1.10 | 2.20 / 2.20 |" in t
    assert "| tkv@8.0 | FAILED" in t


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
    assert "| bf16 tp2 | 1,000 | 1.00 | 50 / 50 | 100 | 200 | 1.00 / 1.00 |" in t
    assert "| tkv@4.0 tp2 | 3,900 | 3.90 | ? | 120 | 240 | 1.20 / 1.20 |" in t
    assert "| tkv@8.0 (goal: 8/8 equal) | 2/2 exact, 100% prefix |" in t
    assert "| tkv@4.0 (reported) | 1/2 exact, 75% prefix |" in t
    assert "| tkv@4.0 vs bf16, both TP=2 (CUDA graphs) | 1/2 exact, 75% prefix |" in t


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
