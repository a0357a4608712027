"""Build hook: with HEADROOM_MYPYC=1, compile the per-chunk modules (proxy/speedups.py's
HOT_MODULES) to C extensions with mypyc. Without it the package is pure Python and
everything else about it is in pyproject.toml. See docs/performance.md.

    pip install 'mypy>=1.10' types-PyYAML setuptools wheel .  # mypyc checks against these
    HEADROOM_MYPYC=1 pip install --no-build-isolation --force-reinstall --no-deps .
    HEADROOM_MYPYC=1 python setup.py build_ext --inplace      # in a source tree (bench, CI)
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def hot_modules() -> list[str]:
    """HOT_MODULES from proxy/speedups.py, read without importing the package."""
    tree = ast.parse((HERE / "proxy" / "speedups.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "HOT_MODULES"
            and node.value is not None
        ):
            return list(ast.literal_eval(node.value))
    raise SystemExit("setup.py: HOT_MODULES not found in proxy/speedups.py")


def ext_modules() -> list[object]:
    flag = os.environ.get("HEADROOM_MYPYC", "").strip()
    if flag in ("", "0"):
        return []
    if flag != "1":
        raise SystemExit(f"setup.py: HEADROOM_MYPYC must be 0 or 1, got {flag!r}")
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        raise SystemExit(
            "setup.py: HEADROOM_MYPYC=1 needs mypy in the build environment, beside the "
            "project's dependencies (mypyc type-checks against them): pip install "
            "'mypy>=1.10' types-PyYAML setuptools wheel . -- then build with "
            "--no-build-isolation"
        ) from exc
    paths = [name.replace(".", "/") + ".py" for name in hot_modules()]
    return list(mypycify(paths, opt_level="3", group_name="headroom_speedups"))


if __name__ == "__main__":  # setuptools runs this file as __main__
    setup(ext_modules=ext_modules())
