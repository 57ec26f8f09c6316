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
    """Restore Triton's JIT hooks and the module's install state after each test."""
    with jit_hooks_isolated():
        yield


_KERNELS: dict[str, object] = {}   # stand-ins for JITFunction objects, one per name


def _fire(name: str, key: str, delay: float = 0.0):
    """What Triton 3.6 does around one compile: the cache hook, the compile, the post hook —
    each hook call with a NEW ``fn`` info object (``JitFunctionInfo(module, name, self)``)
    around the same JITFunction, while the compile keeps other objects alive."""
    jf = _KERNELS.setdefault(name, object())

    def info():
        return SimpleNamespace(module=SimpleNamespace(__name__="tkv.kernels.prefill"),
                               name=name, jit_function=jf)

    kw = dict(key=key, repr=name, compile={}, is_manual_warmup=False, already_compiled=False)
    skipped = knobs.runtime.jit_cache_hook(fn=info(), **kw)
    busy = [SimpleNamespace(i=i) for i in range(1000)]   # a compile allocates meanwhile
    time.sleep(delay)
    knobs.runtime.jit_post_compile_hook(fn=info(), **kw)
    del busy
    return skipped


def test_events_are_logged_with_duration_pid_and_name(tmp_path, hooks):
    path = tmp_path / "sub" / "jit.tsv"
    jit_log.install(path)
    jit_log.install(path)   # idempotent: one line per event, not two
    t0 = time.time()
    assert not _fire("_prefill_kernel", "k1", delay=0.02)
    _fire("_dequant_prefix_kernel", "k2")
    ev = jit_log.read_events(path)
    assert [e.kernel for e in ev] == ["tkv.kernels.prefill:_prefill_kernel",
                                      "tkv.kernels.prefill:_dequant_prefix_kernel"]
    assert ev[0].seconds >= 0.02 and ev[0].start >= t0 - 1e-3
    assert {e.pid for e in ev} == {os.getpid()}
    assert jit_log.read_events(path, since=ev[1].start) == [ev[1]]
    assert jit_log.read_events(path, until=ev[0].start) == [ev[0]]


def test_existing_hooks_are_kept(tmp_path, hooks):
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("before", kw["key"])) or True
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["key"]))
    jit_log.install(tmp_path / "jit.tsv")
    assert _fire("_compress_store_kernel", "k") is True   # the earlier hook's verdict stands
    assert seen == [("before", "k"), ("after", "k")]
    assert len(jit_log.read_events(tmp_path / "jit.tsv")) == 1


def test_installing_another_path_replaces_the_first(tmp_path, hooks):
    """A second install moves the log (no event written twice); hooks that were there before
    tkv's stay chained once."""
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
    jit_log.install(tmp_path / "a.tsv")
    jit_log.install(tmp_path / "b.tsv")
    _fire("_decode_split_kernel", "k", delay=0.01)
    assert jit_log.read_events(tmp_path / "a.tsv") == []
    (ev,) = jit_log.read_events(tmp_path / "b.tsv")
    assert ev.seconds >= 0.01 and seen == ["k"]


def test_install_from_env(tmp_path, hooks, monkeypatch):
    monkeypatch.delenv(jit_log.ENV, raising=False)
    assert jit_log.install_from_env() is None
    assert jit_log._INSTALLED == {}
    monkeypatch.setenv(jit_log.ENV, str(tmp_path / "j.tsv"))
    assert jit_log.install_from_env() == str(tmp_path / "j.tsv")
    _fire("_decode_split_kernel", "k")
    assert len(jit_log.read_events(tmp_path / "j.tsv")) == 1


def test_read_events_missing_and_malformed(tmp_path):
    assert jit_log.read_events(tmp_path / "none.tsv") == []
    bad = tmp_path / "bad.tsv"
    bad.write_text("1.0\t0.5\t12\tm:k\nnot a line\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:2"):
        jit_log.read_events(bad)
