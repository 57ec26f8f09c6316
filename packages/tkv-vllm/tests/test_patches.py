"""The patch series against the real vLLM v0.20.1 sdist: `git apply --check`, and the
pure-Python applier behind `tkv-vllm patch` (idempotent, revertible, version-checked,
atomic on conflict)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tkv.vllm import cli, patching

from .conftest import touched_files


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_series_has_headers_and_numbering():
    series = patching.load_series()
    assert [p.name[:4] for p in series] == [f"{i:04d}" for i in range(1, len(series) + 1)]
    for p in series:
        assert "What:" in p.header and "Why:" in p.header, p.name


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_apply_check_on_sdist(vllm_tree_copy: Path):
    """Each patch passes `git apply --check` on the tree the previous ones produced."""
    for p in sorted(patching.series_dir().glob("[0-9][0-9][0-9][0-9]-*.patch")):
        r = subprocess.run(["git", "apply", "--check", str(p)], cwd=vllm_tree_copy,
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{p.name}: {r.stderr}"
        subprocess.run(["git", "apply", str(p)], cwd=vllm_tree_copy, check=True)
    assert patching.status(vllm_tree_copy).state is patching.PatchState.APPLIED


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_python_applier_matches_git(vllm_tree_copy: Path, tmp_path: Path):
    git_tree = tmp_path / "git-tree"
    shutil.copytree(vllm_tree_copy, git_tree)
    for p in sorted(patching.series_dir().glob("[0-9][0-9][0-9][0-9]-*.patch")):
        subprocess.run(["git", "apply", str(p)], cwd=git_tree, check=True)
    changed = patching.apply(vllm_tree_copy)
    assert sorted(str(c.relative_to(vllm_tree_copy)) for c in changed) == touched_files()
    assert _snapshot(vllm_tree_copy) == _snapshot(git_tree)


def test_apply_is_idempotent_and_revert_restores(vllm_tree_copy: Path):
    pristine = _snapshot(vllm_tree_copy)
    assert patching.status(vllm_tree_copy).state is patching.PatchState.NOT_APPLIED
    assert patching.apply(vllm_tree_copy)
    patched = _snapshot(vllm_tree_copy)
    assert patched != pristine
    assert patching.apply(vllm_tree_copy) == []  # idempotent
    assert _snapshot(vllm_tree_copy) == patched
    assert patching.revert(vllm_tree_copy)
    assert _snapshot(vllm_tree_copy) == pristine
    assert patching.revert(vllm_tree_copy) == []
    assert patching.status(vllm_tree_copy).state is patching.PatchState.NOT_APPLIED


def test_partial_state_is_reported_and_completed(vllm_tree_copy: Path):
    series = patching.load_series()
    patching.apply(vllm_tree_copy, series[:1])
    st = patching.status(vllm_tree_copy)
    assert st.patches[0][1] is patching.PatchState.APPLIED
    assert st.state is patching.PatchState.PARTIAL
    patching.apply(vllm_tree_copy)
    assert patching.status(vllm_tree_copy).state is patching.PatchState.APPLIED


def test_version_mismatch_is_refused(vllm_tree_copy: Path):
    v = vllm_tree_copy / "vllm" / "_version.py"
    v.write_text(v.read_text().replace("'0.20.1'", "'0.20.2'"))
    before = _snapshot(vllm_tree_copy)
    with pytest.raises(patching.VllmVersionError, match=r"0\.20\.2"):
        patching.apply(vllm_tree_copy)
    assert _snapshot(vllm_tree_copy) == before
    assert cli.main(["patch", "apply", "--root", str(vllm_tree_copy)]) == 2


def test_conflict_changes_nothing(vllm_tree_copy: Path):
    f = vllm_tree_copy / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    f.write_text(f.read_text().replace("cache_dtype_str=self.cache_config.cache_dtype",
                                       "cache_dtype_str=self.cache_config.cache_dtype_x"))
    before = _snapshot(vllm_tree_copy)
    with pytest.raises(patching.PatchConflictError, match="0003"):
        patching.apply(vllm_tree_copy)
    assert _snapshot(vllm_tree_copy) == before
    assert patching.status(vllm_tree_copy).state is patching.PatchState.CONFLICT


def test_cli_roundtrip(vllm_tree_copy: Path, capsys):
    root = str(vllm_tree_copy)
    assert cli.main(["patch", "status", "--root", root]) == 1
    assert cli.main(["patch", "apply", "--root", root]) == 0
    assert f"{len(touched_files())} file(s) changed" in capsys.readouterr().out
    assert cli.main(["patch", "apply", "--root", root]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert cli.main(["patch", "status", "--root", root]) == 0
    assert cli.main(["patch", "revert", "--root", root]) == 0
    assert cli.main(["patch", "list"]) == 0
    assert "TURBO_ATTN" in capsys.readouterr().out


def test_parse_patch_rejects_garbage():
    with pytest.raises(ValueError, match="no file sections"):
        patching.parse_patch("just text\n")
    bad = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n-b\n"
    with pytest.raises(ValueError, match="truncated"):
        patching.parse_patch(bad)


def test_unwritable_tree_is_left_unchanged(vllm_tree_copy: Path, monkeypatch):
    """A failing replacement half-way restores the files already replaced."""
    before = _snapshot(vllm_tree_copy)
    real_replace = Path.replace
    calls = {"n": 0}

    def flaky(self, target):
        calls["n"] += 1
        if calls["n"] == 3:
            raise PermissionError(13, "Permission denied", str(target))
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", flaky)
    with pytest.raises(PermissionError):
        patching.apply(vllm_tree_copy)
    monkeypatch.undo()
    assert _snapshot(vllm_tree_copy) == before
    assert cli.main(["patch", "apply", "--root", str(vllm_tree_copy)]) == 0


def test_series_ships_inside_the_package():
    """The series lives in ``tkv/vllm/_patches`` (wheels and sdists carry it); the repository's
    ``patches/vllm-v0.20.1`` is a symlink to the same folder, so there is one copy."""
    d = patching.series_dir()
    assert d.parent.name == "_patches" and d.parent.parent == Path(patching.__file__).parent
    repo_link = Path(patching.__file__).resolve().parents[5] / "patches" / d.name
    if repo_link.exists():  # source checkout
        assert repo_link.resolve() == d.resolve()
