"""deploy/docker/build.sh wheels cleans up after itself: what the builds write into the
source tree (setuptools' build/ and .egg-info, mypy's cache) is gone when it ends, unless
the tree had it before. Run with a PYTHON whose venv and pip stand in for the real ones and
write what a setuptools build writes; test_docker_build.py runs the real build."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .support import REPO

SCRIPT = REPO / "deploy" / "docker" / "build.sh"

# python -m venv DIR: DIR/bin/python is this stand-in again. python -m pip install: nothing.
# python -m pip wheel ... --wheel-dir OUT: the files a setuptools + mypy build leaves in the
# working directory, and a wheel in OUT.
FAKE_PYTHON = """\
import os, shutil, sys
from pathlib import Path

args = sys.argv[2:]
if args[:2] == ["-m", "venv"]:
    (Path(args[2]) / "bin").mkdir(parents=True)
    shutil.copy(sys.argv[1], Path(args[2]) / "bin" / "python")
elif args[:3] == ["-m", "pip", "wheel"]:
    Path("build/lib/proxy").mkdir(parents=True, exist_ok=True)
    Path("build/lib/proxy/meter.c").write_text("/* generated */")
    Path("headroom_proxy.egg-info").mkdir(exist_ok=True)
    Path("headroom_proxy.egg-info/PKG-INFO").write_text("Name: headroom-proxy")
    cache = Path(os.environ.get("MYPY_CACHE_DIR") or ".mypy_cache")
    (cache / "3.11").mkdir(parents=True, exist_ok=True)
    out = Path(args[args.index("--wheel-dir") + 1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "headroom_proxy-0.1.0-py3-none-any.whl").write_bytes(b"PK")
else:
    assert args[:3] == ["-m", "pip", "install"], args
"""


@pytest.fixture
def python(tmp_path: Path) -> Path:
    fake = tmp_path / "fake_python.py"
    fake.write_text(FAKE_PYTHON)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake}" "$0" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "proxy").mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "proxy/__init__.py"):
        (src / name).write_text("")
    return src


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _wheels(tree: Path, python: Path, out: str) -> None:
    result = subprocess.run(
        ["sh", str(SCRIPT), "wheels", out], cwd=tree, capture_output=True, text=True,
        timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": str(python), "HEADROOM_MYPYC": "0"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_a_clean_tree_stays_clean(tmp_path: Path, tree: Path, python: Path) -> None:
    before = _files(tree)
    _wheels(tree, python, str(tmp_path / "wheels"))
    assert _files(tree) == before
    assert (tmp_path / "wheels" / "headroom_proxy-0.1.0-py3-none-any.whl").is_file()


def test_what_the_tree_had_before_is_kept(tmp_path: Path, tree: Path, python: Path) -> None:
    for name in ("build", "headroom_proxy.egg-info", ".mypy_cache"):
        (tree / name).mkdir()
        (tree / name / "mine").write_text("kept")
    _wheels(tree, python, str(tmp_path / "wheels"))
    for name in ("build", "headroom_proxy.egg-info", ".mypy_cache"):
        assert (tree / name / "mine").read_text() == "kept", name
    assert list((tree / ".mypy_cache").iterdir()) == [tree / ".mypy_cache" / "mine"]


def test_wheels_written_inside_the_build_directory_are_kept(tree: Path, python: Path) -> None:
    _wheels(tree, python, "build/wheels")
    assert [p.name for p in (tree / "build" / "wheels").iterdir()] == [
        "headroom_proxy-0.1.0-py3-none-any.whl"
    ]
    assert not (tree / "headroom_proxy.egg-info").exists()
    assert not (tree / ".mypy_cache").exists()
