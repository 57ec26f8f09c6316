"""tkv.kernels.jit_log: Triton JIT events of a process appended to a file."""

import os
import time
from types import SimpleNamespace

import pytest
from triton import knobs

from tkv.kernels import jit_log
from tkv.kernels.testing import jit_hooks_isolated


@pytest.fixture
def hooks():
    """Restore Triton's compilation listener and the module's install state after each
    test."""
    with jit_hooks_isolated():
        yield


def _fire(name: str, delay: float = 0.0, cache_hit: bool = False):
    """What ``triton.compile`` (3.6) does at the end of one compile or disk-cache load: call
    ``knobs.compilation.listener`` with the source (an ASTSource holding the JITFunction)
    and the phase times in microseconds."""
    fn = SimpleNamespace(module="tkv.kernels.prefill", __qualname__=name, __name__=name)
    us = int(delay * 1e6)
    times = knobs.CompileTimes(ir_initialization=us // 2, lowering_stages=[("ttir", us // 4)],
                               store_results=us - us // 2 - us // 4)
    time.sleep(delay)
    knobs.compilation.listener(src=SimpleNamespace(fn=fn, name=name), metadata={},
                               metadata_group={}, times=times, cache_hit=cache_hit)


def test_events_are_logged_with_duration_pid_name_and_source(tmp_path, hooks):
    path = tmp_path / "sub" / "jit.tsv"
    jit_log.install(path)
    jit_log.install(path)   # idempotent: one line per event, not two
    t0 = time.time()
    _fire("_prefill_kernel", delay=0.02)
    _fire("_dequant_prefix_kernel", cache_hit=True)
    ev = jit_log.read_events(path)
    assert [e.kernel for e in ev] == ["tkv.kernels.prefill:_prefill_kernel",
                                      "tkv.kernels.prefill:_dequant_prefix_kernel"]
    assert [e.source for e in ev] == ["compile", "disk"]
    assert abs(ev[0].seconds - 0.02) < 1e-5 and t0 - 1e-3 <= ev[0].start <= ev[1].start
    assert {e.pid for e in ev} == {os.getpid()}
    assert jit_log.read_events(path, since=ev[1].start) == [ev[1]]
    assert jit_log.read_events(path, until=ev[0].start) == [ev[0]]


def test_runtime_jit_hooks_stay_unset(tmp_path, hooks):
    """The runtime JIT hooks make Triton json.dumps every launch's constexprs, which fails
    for kernels taking @triton.jit functions as constexprs (tkv's FETCH / DEQUANT): the log
    must not set them."""
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    jit_log.install(tmp_path / "jit.tsv")
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    assert knobs.compilation.listener is not None


_PROBE = """
import triton.language as tl
from triton.runtime.jit import JITFunction


def _plus_one(x):
    return x + 1


def _jit_log_probe(x_ptr, F: tl.constexpr, SALT: tl.constexpr):
    tl.store(x_ptr, F(tl.load(x_ptr)) + SALT)


# JITFunction directly: under TRITON_INTERPRET=1 @triton.jit gives an interpreted function
plus_one, probe = JITFunction(_plus_one), JITFunction(_jit_log_probe)
"""

_COMPILE = """
import sys
sys.path.insert(0, sys.argv[1])
from triton import knobs
knobs.cache.dir = sys.argv[2]
from tkv.kernels import jit_log
jit_log.install(sys.argv[3])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import jit_log_probe as p
src = ASTSource(p.probe, {"x_ptr": "*fp32", "F": "constexpr", "SALT": "constexpr"},
                constexprs={"F": p.plus_one, "SALT": 3})
for _ in range(2):
    triton.compile(src, target=GPUTarget("cuda", 90, 32))
"""


def test_a_real_compile_and_disk_load_of_a_kernel_with_a_function_constexpr(tmp_path):
    """``triton.compile`` for sm_90 runs on the CPU (no launch): the real listener path logs
    the compile, then the disk-cache load of the same kernel, a kernel that takes a
    ``@triton.jit`` function as a constexpr as tkv's attention kernels do. In a fresh
    process: a kernel run by the Triton interpreter earlier in this one (any interpreted test
    collected before this file) leaves its patches of ``triton.language`` behind, and code
    generation cannot run on the patched module."""
    import subprocess
    import sys

    (tmp_path / "jit_log_probe.py").write_text(_PROBE)
    log = tmp_path / "jit.tsv"
    subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path), str(tmp_path / "cache"),
                    str(log)], check=True, timeout=300)
    ev = jit_log.read_events(log)
    assert [e.kernel for e in ev] == ["jit_log_probe:_jit_log_probe"] * 2
    assert [e.source for e in ev] == ["compile", "disk"]
    assert ev[0].seconds > 0 and ev[0].start <= ev[1].start


def test_an_existing_listener_is_kept(tmp_path, hooks):
    seen = []
    knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
    jit_log.install(tmp_path / "jit.tsv")
    _fire("_compress_store_kernel", cache_hit=True)
    assert seen == [True]
    assert len(jit_log.read_events(tmp_path / "jit.tsv")) == 1


def test_installing_another_path_replaces_the_first(tmp_path, hooks):
    """A second install moves the log (no event written twice); a listener that was there
    before tkv's stays chained once."""
    seen = []
    knobs.compilation.listener = lambda **kw: seen.append(kw["src"].name)
    jit_log.install(tmp_path / "a.tsv")
    jit_log.install(tmp_path / "b.tsv")
    _fire("_decode_split_kernel", delay=0.01)
    assert jit_log.read_events(tmp_path / "a.tsv") == []
    (ev,) = jit_log.read_events(tmp_path / "b.tsv")
    assert ev.seconds >= 0.01 - 1e-6 and seen == ["_decode_split_kernel"]


def test_install_from_env(tmp_path, hooks, monkeypatch):
    monkeypatch.delenv(jit_log.ENV, raising=False)
    assert jit_log.install_from_env() is None
    assert jit_log._INSTALLED == {}
    monkeypatch.setenv(jit_log.ENV, str(tmp_path / "j.tsv"))
    assert jit_log.install_from_env() == str(tmp_path / "j.tsv")
    _fire("_decode_split_kernel")
    assert len(jit_log.read_events(tmp_path / "j.tsv")) == 1


def test_read_events_missing_and_malformed(tmp_path):
    assert jit_log.read_events(tmp_path / "none.tsv") == []
    bad = tmp_path / "bad.tsv"
    bad.write_text("1.0\t0.5\t12\tm:k\n2.0\t0.1\t12\tm:k\tdisk\nnot a line\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:3"):
        jit_log.read_events(bad)
    bad.write_text("1.0\t0.5\t12\tm:k\n2.0\t0.1\t12\tm:k\tdisk\n")   # old 4-field lines too
    assert [e.source for e in jit_log.read_events(bad)] == ["unknown", "disk"]
    bad.write_text("2.0\t0.1\t12\tm:k\tcache\n")
    with pytest.raises(ValueError, match="compile or disk"):
        jit_log.read_events(bad)


def test_a_failed_write_warns_once_and_never_fails_the_compile(tmp_path, hooks):
    """The listener runs inside ``triton.compile``: a log it cannot write (folder removed,
    disk full) must not fail the kernel — one RuntimeWarning, the chained listener still
    called, logging resumes once the file can be written again."""
    import shutil

    seen = []
    knobs.compilation.listener = lambda **kw: seen.append(kw["src"].name)
    jit_log.install(tmp_path / "gone" / "jit.tsv")
    shutil.rmtree(tmp_path / "gone")
    with pytest.warns(RuntimeWarning, match="cannot append"):
        _fire("_decode_split_kernel")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fire("_decode_reduce_kernel")   # warned once only
    assert seen == ["_decode_split_kernel", "_decode_reduce_kernel"]
    jit_log.install(tmp_path / "back.tsv")
    _fire("_compress_store_kernel")
    assert [e.kernel.rsplit(":", 1)[1] for e in jit_log.read_events(tmp_path / "back.tsv")] \
        == ["_compress_store_kernel"]


def test_a_listener_wrapped_around_tkvs_survives_a_second_install(tmp_path, hooks):
    jit_log.install(tmp_path / "a.tsv")
    inner, seen = knobs.compilation.listener, []

    def wrapper(**kw):
        seen.append(kw["src"].name)
        inner(**kw)

    knobs.compilation.listener = wrapper
    jit_log.install(tmp_path / "b.tsv")   # moves the log, keeps the wrapper
    assert knobs.compilation.listener is wrapper
    _fire("_prefill_kernel")
    assert seen == ["_prefill_kernel"] and len(jit_log.read_events(tmp_path / "b.tsv")) == 1
    assert jit_log.read_events(tmp_path / "a.tsv") == []


def test_isolation_restores_an_earlier_install(tmp_path):
    """``jit_hooks_isolated`` gives a block a clean slate and puts back the listener and the
    install state found on entry (one line per event afterwards, not two)."""
    with jit_hooks_isolated():
        jit_log.install(tmp_path / "outer.tsv")
        with jit_hooks_isolated():
            assert knobs.compilation.listener is None and jit_log._INSTALLED == {}
            jit_log.install(tmp_path / "inner.tsv")
        jit_log.install(tmp_path / "outer.tsv")
        _fire("_decode_split_kernel")
        assert len(jit_log.read_events(tmp_path / "outer.tsv")) == 1
        assert jit_log.read_events(tmp_path / "inner.tsv") == []


def test_an_unusable_env_path_is_named_and_the_plugins_carry_on(tmp_path, hooks, monkeypatch,
                                                                caplog):
    """A directory, or a path under a file, raises an OSError naming TKV_JIT_LOG (not a bare
    IsADirectoryError); the engine plugins' variant logs it and returns None; a blank value
    is unset (no file named " " in the working directory)."""
    import logging

    (tmp_path / "file").write_text("x")
    for bad in (str(tmp_path), str(tmp_path / "file" / "log.tsv")):
        monkeypatch.setenv(jit_log.ENV, bad)
        with pytest.raises(OSError, match="TKV_JIT_LOG="):
            jit_log.install_from_env()
        with caplog.at_level(logging.ERROR, logger="tkv.test"):
            assert jit_log.install_from_env_or_log(logging.getLogger("tkv.test")) is None
        assert "TKV_JIT_LOG=" in caplog.text
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(jit_log.ENV, "   ")
    assert jit_log.install_from_env() is None
    assert not (tmp_path / "   ").exists()
