"""Shared fixtures: the vLLM v0.20.1 sdist from PyPI, cached under ~/.cache/tkv."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tkv.vllm import patching

SDIST = f"vllm-{patching.VLLM_VERSION}.tar.gz"
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"


def _cache_dir() -> Path:
    return Path(os.environ.get("TKV_CACHE_DIR", Path.home() / ".cache" / "tkv"))


def _download_sdist(dest: Path) -> None:
    """Find the sdist on PyPI's simple index, download it and verify its sha256."""
    with urllib.request.urlopen(SIMPLE_INDEX, timeout=30) as r:
        page = r.read().decode()
    m = re.search(r'href="([^"]*/' + re.escape(SDIST) + r')#sha256=([0-9a-f]{64})"', page)
    if m is None:
        raise RuntimeError(f"{SDIST} not listed on {SIMPLE_INDEX}")
    url, sha = m.group(1), m.group(2)
    tmp = dest.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as r, tmp.open("wb") as f:
        shutil.copyfileobj(r, f)
    got = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if got != sha:
        tmp.unlink()
        raise RuntimeError(f"{SDIST}: sha256 {got} != PyPI's {sha}")
    tmp.replace(dest)


@pytest.fixture(scope="session")
def vllm_sdist_tree() -> Path:
    """Root of the unpacked (pristine, read-only by convention) vLLM v0.20.1 sdist.

    Downloaded once from PyPI into ~/.cache/tkv (or $TKV_CACHE_DIR); skips only when
    PyPI cannot be reached and no cached copy exists.
    """
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / SDIST
    root = cache / "src" / f"vllm-{patching.VLLM_VERSION}"
    if not tarball.is_file():
        try:
            _download_sdist(tarball)
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            pytest.skip(f"PyPI unreachable, cannot fetch {SDIST}: {e}")
    if not (root / "vllm" / "_version.py").is_file():
        # extract beside, then rename: concurrent test runs never see a half tree
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".extract-"))
        try:
            with tarfile.open(tarball) as t:
                t.extractall(tmp, filter="data")
            (cache / "src").mkdir(exist_ok=True)
            try:
                (tmp / root.name).rename(root)
            except OSError:
                if not (root / "vllm" / "_version.py").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def touched_files() -> list[str]:
    """Paths (relative to the tree root) the series modifies."""
    return sorted({fp.path for pf in patching.load_series() for fp in pf.files})


@pytest.fixture
def vllm_tree_copy(vllm_sdist_tree: Path, tmp_path: Path) -> Path:
    """A scratch copy of the files the series touches (plus vllm/_version.py)."""
    root = tmp_path / "vllm-tree"
    for rel in [*touched_files(), "vllm/_version.py"]:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(vllm_sdist_tree / rel, dst)
    return root


# ----------------------------------------------------------------------------- fakes
def fake_model_config(num_layers=4, num_kv_heads=2, head_dim=64, **flags):
    """Duck-typed stand-in for vLLM's ModelConfig (only what tkv.vllm reads)."""
    from types import SimpleNamespace

    ns = SimpleNamespace(model="fake/model", use_mla=False, is_encoder_decoder=False,
                         is_hybrid=False, is_attention_free=False, has_noops=False,
                         max_model_len=2048, dtype=torch.bfloat16)
    for k, v in flags.items():
        setattr(ns, k, v)
    ns.get_total_num_hidden_layers = lambda: num_layers
    ns.get_total_num_kv_heads = lambda: num_kv_heads
    ns.get_head_size = lambda: head_dim
    return ns


def fake_vllm_config(model_config=None, *, tp=1, block_size=16, layers=None,
                     disable_hybrid=False, max_num_seqs=8):
    """Duck-typed VllmConfig with the fields tkv.vllm and vLLM's builder base read."""
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=model_config or fake_model_config(),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=1),
        cache_config=SimpleNamespace(block_size=block_size),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=disable_hybrid,
                                         max_num_seqs=max_num_seqs, max_num_batched_tokens=256),
        compilation_config=SimpleNamespace(static_forward_context=dict(layers or {})),
        speculative_config=None)


def make_bundle(path: Path, num_layers=4, num_kv_heads=2, head_dim=64, rows=None) -> Path:
    """A small valid calibration bundle (uniform 4.0 row + a SmartMix-like 3.5 row)."""
    from tkv.codec.bundle import CalibrationBundle, LayerAllocation, LayerCalibration, ModelGeometry

    if rows is None:
        rows = {"4.0": LayerAllocation.uniform(num_layers, 4, 4),
                "3.5": LayerAllocation(tuple([4, 3] * (num_layers // 2)),
                                       tuple([3, 3] * (num_layers // 2)), "smartmix")}
    b = CalibrationBundle(ModelGeometry(num_layers, num_kv_heads, head_dim, model="fake/model"),
                          tuple(LayerCalibration() for _ in range(num_layers)), rows,
                          provenance={"tool": "test"})
    return b.save(path)


@pytest.fixture(scope="session")
def patched_vllm():
    """vLLM 0.20.1 with the tkv series applied and the plugins loaded; skips without vLLM
    (the default workspace run), and when vLLM is unpatched (test_installed_vllm_is_patched
    fails loudly in that case)."""
    pytest.importorskip("vllm", reason="vllm not installed (nox -s vllm installs it)")
    st = patching.status(patching.find_vllm_root())
    if st.state is not patching.PatchState.APPLIED:
        pytest.skip("installed vLLM is not patched: run `tkv-vllm patch apply`")
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm

    return vllm


class FakeAttention:
    """Just what tkv.vllm reads from a vLLM ``Attention`` layer (a torch Module is built in
    make_layer so that ``buffers()`` gives the device)."""


def make_layer(name, impl=None, *, num_kv_heads=2, head_size=64, sliding_window=None,
               num_heads=4):
    import torch

    class _Layer(torch.nn.Module):
        pass

    lay = _Layer()
    lay.register_buffer("_k_scale", torch.ones(1))
    lay.layer_name = name
    lay.num_kv_heads = num_kv_heads
    lay.num_heads = num_heads
    lay.head_size = head_size
    lay.sliding_window = sliding_window
    lay.kv_cache_dtype = "tkv"
    lay.kv_sharing_target_layer_name = None
    lay.impl = impl
    return lay
