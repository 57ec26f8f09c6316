"""The SGLang end-to-end script's driver on CPU: which models load real weights.

On 2026-11-30 the driver unpacked ``resolve_model``'s weights *string* as a bool, so a model
with real weights ("real" is truthy) ran with ``--dummy`` (random weights): the first GPU smoke
measured SmolLM2's geometry, not SmolLM2. The engine runs are stubbed here (``run_mode``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def e2e():
    sys.path.insert(0, str(_BENCH))  # sglang_e2e imports its shared helpers from vllm_e2e
    try:
        spec = importlib.util.spec_from_file_location("sglang_e2e", _BENCH / "sglang_e2e.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(_BENCH))


def test_real_models_load_real_weights_and_generated_ones_are_dummy(e2e, tmp_path, monkeypatch):
    real = tmp_path / "real-model"
    real.mkdir()
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "head_dim": 16}
    (real / "config.json").write_text(json.dumps(cfg))
    calls = []

    def fake_run_mode(model, dummy, mode, bits, bundle, out, o, greedy_only=False):
        calls.append((model.name, dummy, mode, bits))
        return {"kv_tokens": 1000 if mode == "bf16" else 3760, "greedy": [[1, 2]] * 8}

    monkeypatch.setattr(e2e, "run_mode", fake_run_mode)
    monkeypatch.setattr(e2e, "write_uniform_bundle", lambda model, path: path)
    o = argparse.Namespace(out=str(tmp_path / "out"), mem=0.5, context_length=4096,
                           baseline_backend="triton", batches=[8], eager=True, bundle=None,
                           model=[str(real), "qwen3-8b-like"], serve=False)
    e2e.run_models(o, ["4.0"], ["8.0"])
    by_model = {}
    for name, dummy, _mode, _bits in calls:
        by_model.setdefault(name, set()).add(dummy)
    assert by_model["real-model"] == {False}
    assert by_model["qwen3-8b-like"] == {True}
    assert {(m, b) for n, _, m, b in calls if n == "real-model"} == {
        ("bf16", None), ("tkv", "4.0"), ("tkv", "8.0")}
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "real-model (random weights)" not in readme
    assert "qwen3-8b-like (random weights)" in readme


def test_table_reports_end_to_end_and_decode_ratios(e2e):
    """Throughput cells come from vllm_e2e.throughput_entry (full run + prefill-only run):
    the table shows the end-to-end ratio and the decode-only ratio side by side."""
    entry = sys.modules["vllm_e2e"].throughput_entry
    res = {"bf16": {"kv_tokens": 1000, "greedy": [[1] * 32],
                    "throughput": {"64": entry(64, 256, 10.0, 2.0)}},
           "tkv@4.0": {"kv_tokens": 3760, "greedy": [[1] * 32],
                       "throughput": {"64": entry(64, 256, 9.0, 3.0)}}}
    t = e2e.table("m", res)
    assert "| tok/s ×bf16 | decode ×bf16 | radix-cache hit (2nd request) |" in t
    # e2e 10/9 = 1.11; decode (10-2)/(9-3) = 1.33
    assert "| tkv@4.0 | 3,760 | 3.76 | 1/1 exact, 100% prefix | 1,820 | 1.11 | 1.33 | - |" in t


def test_radix_check_reads_cached_tokens_from_meta_info(e2e):
    """Two identical requests: the second one's meta_info cached_tokens and token agreement;
    an engine error is recorded, not raised."""
    class Engine:
        def __init__(self):
            self.n = 0

        def generate(self, input_ids, sampling_params):
            self.n += 1
            assert len(input_ids) == 1 and len(input_ids[0]) == e2e.PREFIX_PROMPT_TOKENS
            return [{"output_ids": [1, 2, 3], "meta_info": {"cached_tokens": 0 if self.n == 1
                                                            else 320}}]

    pc = e2e.radix_check(Engine(), {})
    assert (pc["cached_first"], pc["cached_second"], pc["equal"]) == (0, 320, True)
    assert sys.modules["vllm_e2e"].prefix_cache_cell({"prefix_cache": pc}) == (
        "320/333 cached, same tokens")

    class Broken:
        def generate(self, **kw):
            raise RuntimeError("no engine")

    assert "no engine" in e2e.radix_check(Broken(), {})["error"]


def test_gpu_session_start_waits_for_tkv_after(tmp_path):
    """``gpu/session start`` with TKV_AFTER=PIDFILE starts the benchmark only once that process
    has ended (SmolLM2 measured with the machine to itself, after the vLLM job); without it,
    at once. The benchmark is a stub script standing in for python."""
    import os
    import subprocess
    import time

    session = Path(__file__).resolve().parents[1] / "gpu" / "session"
    (tmp_path / "env.sh").write_text("export TKV_STUB=1\n")
    py = tmp_path / "py"
    py.write_text(f"#!/usr/bin/env bash\ndate +%s.%N > {tmp_path}/ran_at\n")
    py.chmod(0o755)
    env = {**os.environ, "TKV_ENV_SH": str(tmp_path / "env.sh"), "PYTHON": str(py),
           "TKV_E2E_DIR": str(tmp_path / "e2e"), "TKV_EP_DIR": str(tmp_path / "ep")}
    blocker = subprocess.Popen(["sleep", "4"])
    (tmp_path / "blocker.pid").write_text(str(blocker.pid))
    t0 = time.time()
    r = subprocess.run(["bash", str(session), "start", "all", "--model", "m"], capture_output=True,
                       text=True, env={**env, "TKV_AFTER": str(tmp_path / "blocker.pid")},
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "after " in r.stdout
    assert not (tmp_path / "ran_at").exists()          # still waiting for the blocker
    blocker.wait()
    deadline = time.time() + 20
    while not (tmp_path / "ran_at").exists() and time.time() < deadline:
        time.sleep(0.5)
    assert float((tmp_path / "ran_at").read_text()) >= t0 + 4
    pid = int((tmp_path / "e2e" / "job" / "pid").read_text())
    while time.time() < deadline:                       # until the job's wrapper has ended
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    (tmp_path / "ran_at").unlink()
    t1 = time.time()
    r = subprocess.run(["bash", str(session), "start", "all", "--model", "m"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    deadline = time.time() + 10
    while not (tmp_path / "ran_at").exists() and time.time() < deadline:
        time.sleep(0.2)
    assert float((tmp_path / "ran_at").read_text()) < t1 + 5


@pytest.mark.parametrize("mode,backend,no_piecewise", [
    ("bf16", "fa3", True), ("bf16", "triton", False), ("tkv", "fa3", False)])
def test_fa3_baseline_runs_without_piecewise_prefill_graphs(e2e, mode, backend, no_piecewise):
    """SGLang 0.5.11 fails to capture its piecewise prefill CUDA graphs with FA3 on the H200
    (session 16): only the fa3 bf16 baseline turns them off; tkv runs keep SGLang's default."""
    a = argparse.Namespace(model="m", mem=0.5, context_length=4096, batches=[64, 256],
                           eager=False, mode=mode, baseline_backend=backend, dummy=False)
    kw = e2e.engine_kwargs(a)
    assert kw.get("disable_piecewise_cuda_graph", False) is no_piecewise
    assert kw["attention_backend"] == ("turbo-attn" if mode == "tkv" else backend)


class _ProfilingEngine:
    """A stand-in ``sgl.Engine`` for the profile functions: ``start_profile`` /
    ``stop_profile`` write a gzipped chrome trace of ``events(t)`` for the ``t``-token
    generate in between; ``calls`` records ``(prompts, tokens, profiled)`` of every generate,
    each of which takes ``sleep`` seconds of host time."""

    def __init__(self, events, sleep: float = 0.0):
        self.events, self.sleep = events, sleep
        self.dir, self.calls, self._ev = None, [], []

    def start_profile(self, output_dir, activities, with_stack, record_shapes):
        assert activities == ["GPU"] and with_stack is False
        self.dir = Path(output_dir)

    def generate(self, input_ids, sampling_params):
        t = sampling_params["max_new_tokens"]
        self.calls.append((len(input_ids), t, self.dir is not None))
        if self.dir is not None:
            self._ev = self.events(t)
        time.sleep(self.sleep)

    def stop_profile(self):
        import gzip

        (self.dir / "123-TP-0.trace.json.gz").write_bytes(
            gzip.compress(json.dumps({"traceEvents": self._ev}).encode()))
        self.dir = None


def test_profile_decode_diffs_sglangs_two_traces(e2e, tmp_path):
    """sglang_e2e's profile_decode with a stand-in Engine whose start/stop_profile write a
    chrome trace of the generate in between: one decode step's kernels are the difference of
    the 2·T- and T-token traces divided by T (prefill kernels cancel), written and returned."""
    llm = _ProfilingEngine(lambda t: [
        {"ph": "X", "cat": "kernel", "name": "_decode_split_kernel", "dur": 5.0}] * (36 * t)
        + [{"ph": "X", "cat": "kernel", "name": "prefill", "dur": 50.0}] * 7)
    out = e2e.profile_decode(llm, lambda: [[1] * 4] * 3, 8, tmp_path / "x.profile.md")
    assert llm.calls == [(3, 8, False), (3, 16, False), (3, 8, True), (3, 16, True)]
    assert out["decode_kernels"] == [{"name": "_decode_split_kernel", "per_step": 36.0,
                                      "us_per_step": 180.0}]
    assert out["device_ms_per_step"] == 0.18 and out["kernels_per_step"] == 36.0
    assert "_decode_split_kernel" in (tmp_path / "x.profile.md").read_text()

    class Silent(_ProfilingEngine):
        def stop_profile(self):
            self.dir = None

    with pytest.raises(RuntimeError, match="no trace"):
        e2e.profile_decode(Silent(lambda t: []), lambda: [[1]], 2, tmp_path / "y.md")


def test_profile_prefill_lists_every_kernel_of_a_one_token_run(e2e, tmp_path):
    """profile_prefill: the batch generated with ONE token, first unprofiled then under
    SGLang's profiler; every kernel of that run (nothing subtracted) with launches and device
    µs per run, and gpu_busy = device / wall time."""
    llm = _ProfilingEngine(lambda t: (
        [{"ph": "X", "cat": "kernel", "name": "_prefill_kernel", "dur": 40.0}] * 30
        + [{"ph": "X", "cat": "kernel", "name": "_compress_store_kernel", "dur": 10.0}] * 30
        + [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 2.0}]
        + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0}]), sleep=0.02)
    out = e2e.profile_prefill(llm, lambda: [[1] * 4] * 16, tmp_path / "x.prefill.md")
    assert llm.calls == [(16, 1, False), (16, 1, True)]
    assert out["prefill_kernels"] == [
        {"name": "_prefill_kernel", "per_step": 30.0, "us_per_step": 1200.0},
        {"name": "_compress_store_kernel", "per_step": 30.0, "us_per_step": 300.0},
        {"name": "[memcpy] Memcpy HtoD", "per_step": 1.0, "us_per_step": 2.0}]
    assert out["device_ms_per_step"] == pytest.approx(1.502)
    assert out["prompts"] == 16 and out["seconds"] >= 0.02
    assert 0 < out["gpu_busy"] < 1.502 / 20 + 1e-9    # wall ≥ 20 ms of host sleep
    text = (tmp_path / "x.prefill.md").read_text()
    assert "| kernel | launches / run | µs / run | share |" in text
    assert "| **total** | 61 | 1502.0 | 100 % |" in text


def test_profile_flag_reaches_the_throughput_workers_only(e2e, tmp_path, monkeypatch):
    seen = []

    def run_group(cmd, env, log, *a, **k):
        seen.append(cmd)
        log.write_text("")
        return 0

    monkeypatch.setattr(e2e, "run_group", run_group)
    o = argparse.Namespace(mem=0.5, context_length=4096, baseline_backend="fa3", batches=[64, 256],
                           repeats=1, eager=False, timeout=10, profile=32,
                           profile_prefill=True)
    e2e.run_mode(tmp_path / "m", True, "tkv", "4.0", None, tmp_path, o)
    e2e.run_mode(tmp_path / "m", True, "tkv", "8.0", None, tmp_path, o, greedy_only=True)
    assert seen[0][-3:] == ["--profile", "32", "--profile-prefill"]
    assert "--profile" not in seen[1] and "--profile-prefill" not in seen[1]
    o.profile, o.profile_prefill = 0, False
    e2e.run_mode(tmp_path / "m", True, "tkv", "4.0", None, tmp_path, o)
    assert not any(x.startswith("--profile") for x in seen[2])


def _run_variants(e2e, tmp_path, monkeypatch, variants, baseline):
    """``run_models`` on a stub model with ``variants``, the engine runs stubbed: the worker
    command and environment of each run, by file tag."""
    model = tmp_path / "m"
    model.mkdir()
    runs = {}

    def fake_run_group(cmd, env, log, timeout, out, result=None):
        runs[Path(result).stem] = (cmd, env)
        Path(log).write_text("")
        Path(result).write_text(json.dumps({"kv_tokens": 100, "greedy": [[1, 2]] * 8}))
        return 0

    monkeypatch.setattr(e2e, "run_group", fake_run_group)
    monkeypatch.setattr(e2e, "resolve_model", lambda spec, d: (model, "real"))
    monkeypatch.setattr(e2e, "write_uniform_bundle", lambda m, path: path)
    o = argparse.Namespace(out=str(tmp_path / "out"), mem=0.5, context_length=4096,
                           baseline_backend=baseline, batches=[8], eager=baseline != "fa3",
                           bundle=None, model=[str(model)], serve=False, timeout=60,
                           repeats=1, variants=variants)
    e2e.run_models(o, ["4.0"], ["4.0"])
    return runs


def test_variant_runs_get_their_engine_setting(e2e, tmp_path, monkeypatch):
    """``all --variants flash``: after each throughput tkv run, the same run with
    TKV_PREFILL_ATTENTION=flash in the worker's environment, under its own key, file tag and
    table row; the plain run's environment does not carry it."""
    runs = _run_variants(e2e, tmp_path, monkeypatch, ["flash", "split2"], "triton")
    envs = {tag: env for tag, (_cmd, env) in runs.items()}
    assert set(envs) == {"m-bf16", "m-tkv-4.0", "m-tkv-4.0-flash", "m-tkv-4.0-split2"}
    assert envs["m-tkv-4.0-flash"]["TKV_PREFILL_ATTENTION"] == "flash"
    assert envs["m-tkv-4.0-split2"]["TKV_DECODE_SINGLE_SPLIT"] == "0"
    assert envs["m-tkv-4.0"].get("TKV_PREFILL_ATTENTION") == envs["m-bf16"].get(
        "TKV_PREFILL_ATTENTION")   # inherited from the driver's environment, not set
    res = json.loads((tmp_path / "out" / "m.json").read_text())
    assert list(res) == ["bf16", "tkv@4.0", "tkv@4.0 flash", "tkv@4.0 split2"]
    assert "| tkv@4.0 flash |" in (tmp_path / "out" / "README.md").read_text()
    with pytest.raises(SystemExit):   # the CLI refuses an unknown variant
        e2e.main(["all", "--variants", "nosuch"])


def test_engine_variant_changes_one_engine_argument(e2e, tmp_path, monkeypatch):
    """``all --variants nopcg``: the same tkv run with ``disable_piecewise_cuda_graph=True``
    (what the fa3 baseline runs with) — an sgl.Engine argument passed to the worker as
    ``--engine-variant``, not an environment setting; the plain tkv run keeps the graphs."""
    runs = _run_variants(e2e, tmp_path, monkeypatch, ["nopcg"], "fa3")
    cmds = {tag: cmd for tag, (cmd, _env) in runs.items()}
    model = tmp_path / "m"
    assert set(cmds) == {"m-bf16", "m-tkv-4.0", "m-tkv-4.0-nopcg"}
    assert cmds["m-tkv-4.0-nopcg"][-2:] == ["--engine-variant", "nopcg"]
    assert "--engine-variant" not in cmds["m-tkv-4.0"]

    def kwargs(argv):   # the worker's parsed arguments -> its sgl.Engine arguments
        parsed = {}
        monkeypatch.setattr(e2e, "worker", lambda a: parsed.setdefault("a", a))
        e2e.main(argv)
        return e2e.engine_kwargs(parsed["a"])

    worker = ["worker", "--model", str(model), "--mode", "tkv", "--result", "r.json"]
    assert kwargs([*worker, "--engine-variant", "nopcg"])["disable_piecewise_cuda_graph"]
    assert "disable_piecewise_cuda_graph" not in kwargs(worker)
    with pytest.raises(SystemExit):
        e2e.main([*worker, "--engine-variant", "nosuch"])
