"""The SGLang v0.5.11 patch series: it applies to the real source, and the `tkv-sglang patch`
command applies/reverts it idempotently, refuses another version, never half-applies."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from tkv.sglang import cli
from tkv.sglang.errors import PatchError, SglangVersionError
from tkv.sglang.patching import (
    APPLIED,
    UNAPPLIED,
    apply_series,
    patch_states,
    revert_series,
    series_dir,
    series_patches,
)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_series_file_lists_every_patch_with_a_header():
    d = series_dir()
    listed = [p.name for p in series_patches()]
    assert listed == sorted(p.name for p in d.glob("*.patch"))
    assert all(re.fullmatch(r"\d{4}-[a-z0-9-]+\.patch", n) for n in listed)
    for p in series_patches():
        head = p.read_text().split("diff --git", 1)[0]
        assert "What:" in head and "Why:" in head, f"{p.name} lacks its what/why header"


def test_git_apply_check_on_pristine_source(sglang_source):
    states = patch_states(sglang_source)
    assert [s.state for s in states] == [UNAPPLIED] * len(states), states


def test_apply_is_idempotent_and_revert_restores_bytes(sglang_copy):
    before = _snapshot(sglang_copy)
    out = apply_series(sglang_copy)
    assert out == [f"applied {p.name}" for p in series_patches()]
    assert [s.state for s in patch_states(sglang_copy)] == [APPLIED] * len(out)
    reg = sglang_copy / "sglang/srt/mem_cache/kv_cache_dtype_registry.py"
    assert reg.is_file()
    assert "get_kv_cache_dtype_choices()" in (sglang_copy / "sglang/srt/server_args.py").read_text()
    after = _snapshot(sglang_copy)
    assert after != before
    assert apply_series(sglang_copy) == [f"already applied {p.name}" for p in series_patches()]
    assert _snapshot(sglang_copy) == after
    revert_series(sglang_copy)
    assert _snapshot(sglang_copy) == before
    assert revert_series(sglang_copy) == [f"not applied {p.name}" for p in reversed(series_patches())]


def test_refuses_another_sglang_version(sglang_copy):
    meta = next(sglang_copy.glob("sglang-*.dist-info")) / "METADATA"
    meta.write_text(re.sub(r"^Version: .*$", "Version: 0.5.10", meta.read_text(), flags=re.M))
    before = _snapshot(sglang_copy)
    with pytest.raises(SglangVersionError, match=r"0\.5\.10"):
        apply_series(sglang_copy)
    assert _snapshot(sglang_copy) == before
    assert cli.main(["patch", "apply", "--target", str(sglang_copy)]) == 2


def test_conflict_leaves_nothing_half_applied(sglang_copy):
    mr = sglang_copy / "sglang/srt/model_executor/model_runner.py"
    mr.write_text(mr.read_text().replace('if self.server_args.kv_cache_dtype == "auto":',
                                         'if self.server_args.kv_cache_dtype in ("auto",):'))
    before = _snapshot(sglang_copy)
    with pytest.raises(PatchError, match="0002"):
        apply_series(sglang_copy)
    assert _snapshot(sglang_copy) == before  # 0001 was rolled back
    assert cli.main(["patch", "status", "--target", str(sglang_copy)]) == 2


def test_an_edited_file_of_an_applied_patch_is_named(sglang_copy, capsys):
    """After a local edit to a file an applied patch created, `patch status` used to print
    only the forward check ("patch does not apply" for another file, expected since it is
    applied); the reverse check, which names the edited file, is shown too."""
    apply_series(sglang_copy)
    reg = sglang_copy / "sglang/srt/mem_cache/kv_cache_dtype_registry.py"
    reg.write_text(reg.read_text() + "# local\n")
    assert cli.main(["patch", "status", "--target", str(sglang_copy)]) == 2
    out = capsys.readouterr()
    assert "kv_cache_dtype_registry.py" in out.out + out.err
    assert "as applied (git apply --check --reverse)" in out.out + out.err


def test_revert_is_all_or_nothing(sglang_copy, monkeypatch):
    """A patch that fails to revert re-applies the ones reverted before it (docs: apply and
    revert are all-or-nothing); it used to leave the tree half reverted."""
    import tkv.sglang.patching as P

    apply_series(sglang_copy)
    applied = _snapshot(sglang_copy)
    first = series_patches()[0].name
    real = P._git

    def failing(root, *args):
        if "--reverse" in args and "--check" not in args and args[-1].endswith(first):
            return type("R", (), {"returncode": 1, "stderr": "simulated failure", "stdout": ""})()
        return real(root, *args)

    monkeypatch.setattr(P, "_git", failing)
    with pytest.raises(PatchError, match="re-applied"):
        revert_series(sglang_copy)
    assert _snapshot(sglang_copy) == applied
    assert [s.state for s in patch_states(sglang_copy)] == [APPLIED] * len(series_patches())


def test_cli_status_apply_revert(sglang_copy, capsys):
    t = ["--target", str(sglang_copy)]
    assert cli.main(["patch", "status", *t]) == 1
    assert cli.main(["patch", "apply", *t]) == 0
    assert cli.main(["patch", "status", *t]) == 0
    assert cli.main(["patch", "apply", *t]) == 0
    assert "already applied" in capsys.readouterr().out
    assert cli.main(["patch", "revert", *t]) == 0
    assert cli.main(["patch", "status", *t]) == 1


def test_cli_rejects_a_folder_without_sglang(tmp_path, capsys):
    assert cli.main(["patch", "apply", "--target", str(tmp_path)]) == 2
    assert "does not hold an sglang package" in capsys.readouterr().err


def _load_registry(root: Path):
    path = root / "sglang/srt/mem_cache/kv_cache_dtype_registry.py"
    spec = importlib.util.spec_from_file_location("_tkv_test_kv_cache_dtype_registry", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    return mod


def test_patched_registry_contract(sglang_copy):
    """The registry the series adds (it needs only torch): choices, lookup, pairing both ways."""
    apply_series(sglang_copy)
    reg = _load_registry(sglang_copy)
    assert reg.get_kv_cache_dtype_choices() == list(reg.BUILTIN_KV_CACHE_DTYPES)
    spec = reg.KVCacheDtypeSpec("tkv", torch.uint8, create_pool=lambda mr: None,
                                cell_size=lambda mr, n: 1, attention_backends=("turbo-attn",),
                                default_attention_backend="turbo-attn")
    reg.register_kv_cache_dtype(spec)
    reg.register_attention_backend_kv_cache_dtypes("turbo-attn", ["tkv"])
    assert reg.get_kv_cache_dtype_choices()[-1] == "tkv"
    assert reg.get_kv_cache_dtype_spec("tkv") is spec
    assert reg.get_kv_cache_dtype_spec("auto") is None
    with pytest.raises(ValueError, match="already registered"):
        reg.register_kv_cache_dtype(spec)
    reg.register_kv_cache_dtype(spec, override=True)
    with pytest.raises(ValueError, match="built into SGLang"):
        reg.register_kv_cache_dtype(reg.KVCacheDtypeSpec("bf16", torch.bfloat16, None, None))
    reg.check_kv_cache_dtype_backends("tkv", ["turbo-attn", None])
    reg.check_kv_cache_dtype_backends("auto", ["fa3", "triton"])
    with pytest.raises(ValueError, match="can only be read by the attention backend"):
        reg.check_kv_cache_dtype_backends("tkv", ["turbo-attn", "fa3"])
    with pytest.raises(ValueError, match="only reads --kv-cache-dtype tkv"):
        reg.check_kv_cache_dtype_backends("auto", ["turbo-attn"])


def test_tree_inside_a_git_work_tree_is_patched_in_place(sglang_source, tmp_path):
    """A venv inside a git checkout (e.g. the nox venv under the repo): git apply must not
    resolve paths against the enclosing repository."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    site = repo / ".venv" / "lib" / "site-packages"
    shutil.copytree(sglang_source, site)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    before = _snapshot(site)
    apply_series(site)
    assert (site / "sglang/srt/mem_cache/kv_cache_dtype_registry.py").is_file()
    assert not (repo / "sglang").exists()
    revert_series(site)
    assert _snapshot(site) == before


def test_series_ships_inside_the_package():
    """The series lives in ``tkv/sglang/_patches`` (wheels and sdists carry it); the
    repository's ``patches/sglang-v0.5.11`` is a symlink to the same folder."""
    import tkv.sglang.patching as patching

    d = series_dir()
    assert d.parent.name == "_patches" and d.parent.parent == Path(patching.__file__).parent
    repo_link = Path(patching.__file__).resolve().parents[5] / "patches" / d.name
    if repo_link.exists():  # source checkout
        assert repo_link.resolve() == d.resolve()
