"""The Headroom source trees bench/relay.py measures, each in both builds.

Every Headroom target runs from a tree of its own, a copy made in the run directory:

- ``headroom``: the checkout as it is (tracked and untracked, not ignored, files of the
  working tree), interpreted; or ``git archive REV`` with ``--source REV``;
- ``headroom-compiled``: the same copy, then ``HEADROOM_MYPYC=1 python setup.py
  build_ext --inplace`` (docs/performance.md), checked with ``python -m proxy.speedups
  --require-compiled``;
- ``baseline`` and ``baseline-compiled`` (``--baseline REV``): the same two builds of
  ``git archive REV``.

A tree runs as ``python -m proxy serve`` with ``PYTHONPATH`` and the working directory
set to it, so the copy is imported, never the editable install. Every tree's build is
asked of the tree itself (``python -m proxy.speedups``) and refused when it is not the
build its name says.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness import (  # type: ignore[import-not-found,unused-ignore]
    ROUTE_PATH,
    Processes,
    Relay,
    free_port,
    headroom_config,
    wait_port,
)

__all__ = [
    "HEADROOM_TREES",
    "Tree",
    "audio_seconds_metered",
    "build_compiled",
    "build_status",
    "copy_checkout",
    "enable_admin",
    "export_revision",
    "prepare_trees",
    "start_headroom",
]

CHECKOUT = Path(__file__).resolve().parent.parent
GC_TRACE = Path(__file__).resolve().parent / "gc_trace.py"
#: Target name -> (source, compiled): the checkout or the baseline revision.
HEADROOM_TREES: dict[str, tuple[str, bool]] = {
    "headroom": ("checkout", False),
    "headroom-compiled": ("checkout", True),
    "baseline": ("baseline", False),
    "baseline-compiled": ("baseline", True),
}
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Tree:
    """A Headroom source tree and the build its per-chunk modules run in."""

    target: str
    path: Path
    revision: str
    build: str  # proxy.speedups' one-line description


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(CHECKOUT), *args], capture_output=True, timeout=120, check=True
    )
    return out.stdout.decode()


def copy_checkout(dest: Path) -> str:
    """Copy the working tree's files (tracked, and untracked but not ignored) to
    ``dest``; returns the revision, ``+dirty`` when ``proxy/`` has changes."""
    names = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in sorted(set(filter(None, names))):
        src = CHECKOUT / name
        if src.is_file():  # a tracked file deleted in the working tree is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    head = _git("rev-parse", "--short", "HEAD").strip()
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "proxy").strip()
    return head + ("+dirty" if dirty else "")


def export_revision(rev: str, dest: Path) -> str:
    """``git archive REV`` unpacked in ``dest`` (the repository is only read); returns
    the revision's short hash."""
    short = _git("rev-parse", "--short", "--verify", f"{rev}^{{commit}}").strip()
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(CHECKOUT), "archive", "--format=tar", short],
        capture_output=True, timeout=300, check=True,
    )  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, timeout=300, check=True)
    return short


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def build_status(tree: Path) -> tuple[bool, str]:
    """(all per-chunk modules compiled and fresh, the one-line description) of the
    Headroom in ``tree``, asked of that tree's own ``proxy.speedups``."""
    out = subprocess.run(
        [sys.executable, "-m", "proxy.speedups", "--require-compiled"],
        capture_output=True, text=True, timeout=120, cwd=tree, env=_env(tree), check=False,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    if not lines or "per-chunk modules" not in lines[-1]:
        raise RuntimeError(f"{tree}: python -m proxy.speedups: {(out.stdout + out.stderr)[-500:]}")
    return out.returncode == 0, lines[-1]


def build_compiled(source: Path, dest: Path) -> None:
    """A copy of ``source`` in ``dest`` with the per-chunk modules compiled in place."""
    shutil.copytree(source, dest, symlinks=True)
    log = dest / "build_ext.log"
    with log.open("wb") as out:
        done = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"],
            cwd=dest, env={**_env(dest), "HEADROOM_MYPYC": "1"}, stdout=out,
            stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"compiled build of {source} failed:\n{tail}")


def prepare_trees(
    targets: list[str], run_dir: Path, baseline: str | None, source: str | None = None
) -> dict[str, Tree]:
    """The trees of the Headroom targets among ``targets``, made and checked: the
    ``headroom`` ones from the working tree, or from ``git archive source`` when given."""
    sources: dict[str, tuple[Path, str]] = {}
    trees: dict[str, Tree] = {}
    for target in targets:
        if target not in HEADROOM_TREES:
            continue
        origin, compiled = HEADROOM_TREES[target]
        if origin not in sources:
            path = run_dir / "trees" / origin
            path.mkdir(parents=True, exist_ok=True)
            rev = source if origin == "checkout" else baseline
            if origin == "baseline" and rev is None:
                raise RuntimeError(f"{target} needs --baseline REV")
            revision = copy_checkout(path) if rev is None else export_revision(rev, path)
            sources[origin] = (path, revision)
        path, revision = sources[origin]
        if compiled:
            print(f"-- building {target} (mypyc) from {revision}", file=sys.stderr, flush=True)
            build_compiled(path, path.with_name(f"{origin}-compiled"))
            path = path.with_name(f"{origin}-compiled")
        all_compiled, describe = build_status(path)
        if compiled and not all_compiled:
            raise RuntimeError(f"{target}: not every per-chunk module compiled: {describe}")
        if not compiled and "interpreted (0 of" not in describe:
            raise RuntimeError(f"{target}: expected an interpreted tree, found: {describe}")
        trees[target] = Tree(target, path, revision, describe)
    return trees


async def start_headroom(
    procs: Processes,
    tree: Tree,
    cell_dir: Path,
    upstream_port: int,
    *,
    max_sessions: int,
    protocol: str,
    edit: Callable[[str], str] | None = None,
    gc_trace: Path | None = None,
    gc_freeze_s: float | None = None,
    wrapper: list[str] | None = None,
    start_timeout_s: float = 30.0,
) -> Relay:
    """``python -m proxy serve`` from ``tree`` in front of the upstream, with the bench's
    one-pool configuration (``edit``: a change to it; ``wrapper``: a command the relay
    runs under, such as valgrind, which slows its start: ``start_timeout_s``)."""
    port = free_port()
    cell_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - before any load
    conf = cell_dir / "headroom.yaml"
    text = headroom_config(port, upstream_port, max_sessions, protocol)
    conf.write_text(edit(text) if edit else text)
    serve = ["serve", "--config", str(conf)]
    cmd = [sys.executable, "-m", "proxy", *serve]
    if gc_trace is not None:  # the same command, with every GC pass logged
        freeze = ["--freeze-after", str(gc_freeze_s)] if gc_freeze_s is not None else []
        cmd = [sys.executable, str(GC_TRACE), str(gc_trace), *freeze, "--", *serve]
    cmd = [*(wrapper or []), *cmd]
    log = cell_dir / "headroom.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True, cwd=str(tree.path), env=_env(tree.path),
        )  # fmt: skip
    procs.add(proc)
    try:
        await wait_port(port, start_timeout_s, proc)
    except RuntimeError as exc:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{tree.target} did not start: {exc}\n{tail}") from None
    return Relay(tree.target, f"ws://127.0.0.1:{port}{ROUTE_PATH}", proc, log)


async def audio_seconds_metered(admin_port: int, timeout_s: float = 10.0) -> float:
    """``headroom_audio_delivered_seconds_total`` summed over replicas, scraped from the
    admin listener's ``/metrics``: the audio the meter counted."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection("127.0.0.1", admin_port)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            raw = await reader.read()
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"GET /metrics: {head[:200]!r}")
    total = 0.0
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("headroom_audio_delivered_seconds_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def enable_admin(text: str, port: int) -> str:
    """The bench configuration with the admin listener on ``port`` (loopback)."""
    old = "admin: {enabled: false}"
    if text.count(old) != 1:
        raise RuntimeError(f"{old!r} not once in the bench configuration")
    return text.replace(old, f"admin: {{enabled: true, host: 127.0.0.1, port: {port}}}")
