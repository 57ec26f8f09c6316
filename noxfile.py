"""nox sessions: build and test each package and engine combination.

``uv run --frozen nox`` (the README's test command, also ``.ci/run``) runs the default
sessions: ``lint``, ``codec`` and ``tests``. Every venv installs pinned versions exported from
``uv.lock`` (torch==2.11.0), so CI tests exactly what the lock says.

* ``lint``     — ruff over the whole tree.
* ``codec``    — a fresh venv with ONLY tkv-codec, its torch dependency and the test tools:
                 proves the codec installs and works alone (e.g. beside FlashInfer).
* ``tests``    — every package's CPU tests in the workspace env (Triton kernels under
                 TRITON_INTERPRET=1, GPU tests skip), the ``slow`` real-model test included
                 (SmolLM2-135M: a small calibration job and TkvCache generation, ~1 min);
                 ``nox -s tests -- -m "not slow"`` leaves it out.
* ``kernels``, ``calibrate`` — one package's tests in a venv of its own.
* ``vllm``, ``sglang`` — the engine adapters with the pinned engine installed (large downloads;
                 not in the default run).
"""

from __future__ import annotations

import os
import tempfile

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "codec", "tests"]
nox.options.error_on_external_run = True

PYTHON = "3.11"
VLLM_VERSION = "0.20.1"
_ISOLATION_CHECK = """
import importlib.util as u
present = [m for m in ("tkv.kernels", "tkv.calibrate", "transformers", "vllm", "sglang")
           if u.find_spec(m) is not None]
assert not present, f"codec venv is not isolated: {present}"
print("codec venv holds tkv.codec + torch only")
"""
SGLANG_VERSION = "0.5.11"


def _install_locked(session: nox.Session, *export_args: str) -> None:
    """Install the pinned requirement set ``uv export --frozen <export_args>`` into the venv."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        req = f.name
    try:
        session.run("uv", "export", "--frozen", "--no-hashes", "--no-emit-project",
                    "--output-file", req, *export_args, external=True, silent=True)
        session.install("-r", req)
    finally:
        os.unlink(req)


def _pytest(session: nox.Session, *paths: str) -> None:
    """pytest over ``paths`` (default: the configured testpaths), every marker included unless
    the command line passes its own arguments (e.g. ``-- -m "not slow"``)."""
    session.run("python", "-m", "pytest", *paths, *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check over the tree (pinned by uv.lock's lint group)."""
    _install_locked(session, "--only-group", "lint")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def codec(session: nox.Session) -> None:
    """tkv-codec alone: torch + the codec + test tools, nothing else."""
    _install_locked(session, "--package", "tkv-codec", "--no-dev")
    _install_locked(session, "--only-group", "test")
    session.install("--no-deps", "./packages/tkv-codec")
    # Prove the isolation: no other tkv distribution and no engine/model library in this venv.
    session.run("python", "-c", _ISOLATION_CHECK)
    _pytest(session, "packages/tkv-codec/tests")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All CPU tests of every package, in the locked workspace environment."""
    session.run_install("uv", "sync", "--frozen", "--all-packages", "--group", "test",
                        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
                        external=True)
    _pytest(session)


def _package_session(session: nox.Session, package: str, *workspace_deps: str) -> None:
    """One package's tests in a venv holding only its locked dependency closure."""
    _install_locked(session, "--package", package, "--no-dev")
    _install_locked(session, "--only-group", "test")
    session.install("--no-deps", *(f"./packages/{p}" for p in (*workspace_deps, package)))
    _pytest(session, f"packages/{package}/tests")


@nox.session(python=PYTHON)
def kernels(session: nox.Session) -> None:
    """tkv-kernels (Triton kernels under TRITON_INTERPRET=1 on CPU; GPU tests skip)."""
    _package_session(session, "tkv-kernels", "tkv-codec")


@nox.session(python=PYTHON)
def calibrate(session: nox.Session) -> None:
    """tkv-calibrate."""
    _package_session(session, "tkv-calibrate", "tkv-codec")


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """tkv-vllm against the pinned vLLM (downloads vLLM and its dependencies)."""
    session.install(f"vllm=={VLLM_VERSION}", "torch==2.11.0")
    _install_locked(session, "--only-group", "test")
    session.install("--no-deps", "./packages/tkv-codec", "./packages/tkv-kernels",
                    "./packages/tkv-vllm")
    session.run("tkv-vllm", "patch", "apply")  # the series the operator applies, then its tests
    session.env["TRITON_INTERPRET"] = "1"
    _pytest(session, "packages/tkv-vllm/tests")


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """tkv-sglang against the pinned SGLang (downloads SGLang and its dependencies)."""
    # kernels<0.12: sglang leaves it unpinned and kernels>=0.17 breaks `import sglang`
    # beside its pinned transformers 5.6.0.
    session.install(f"sglang=={SGLANG_VERSION}", "torch==2.11.0", "kernels<0.12")
    _install_locked(session, "--only-group", "test")
    session.install("--no-deps", "./packages/tkv-codec", "./packages/tkv-kernels",
                    "./packages/tkv-sglang")
    session.run("tkv-sglang", "patch", "apply")
    session.env["TRITON_INTERPRET"] = "1"
    # sglang's import chain reaches deep_gemm -> torch.utils.cpp_extension -> setuptools after
    # the standard library's distutils is already loaded; setuptools' distutils shim then
    # asserts (seen 2026-12-05 on a fresh machine). Python 3.11's own distutils serves.
    session.env["SETUPTOOLS_USE_DISTUTILS"] = "stdlib"
    _pytest(session, "packages/tkv-sglang/tests")
